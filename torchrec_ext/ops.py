"""Typed wrappers over ``torch.ops.torchrec_ext.*`` and their fake kernels.

The schemas live in ``csrc/ops.cpp``; CPU kernels in ``csrc/hash_table_cpu.cpp`` and CUDA kernels
in ``csrc/hash_table_cuda.cu``. The fake kernels give output shapes and dtypes without data so
the ops trace under ``torch.fx`` / ``torch.compile``.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from torchrec_ext import _C  # noqa: F401  (loads the library: registers the ops)

_ops = torch.ops.torchrec_ext


def has_kernel(op_name: str, device: torch.device) -> bool:
    """Whether op ``torchrec_ext::<op_name>`` has a kernel for ``device``'s backend."""
    key = "CUDA" if device.type == "cuda" else device.type.upper()
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"torchrec_ext::{op_name}", key)


def hash_find(digests: Tensor, slot_keys: Tensor, keys: Tensor, capacity: int) -> Tuple[Tensor, Tensor]:
    return _ops.hash_find.default(digests, slot_keys, keys, capacity)


def hash_upsert(
    digests: Tensor,
    slot_keys: Tensor,
    slot_scores: Tensor,
    size: Tensor,
    keys: Tensor,
    scores: Optional[Tensor],
    capacity: int,
    policy: int,
    clock: int,
    epoch: int,
    assign: bool,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    return _ops.hash_upsert.default(
        digests, slot_keys, slot_scores, size, keys, scores, capacity, policy, clock, epoch, assign
    )


def hash_erase(digests: Tensor, slot_keys: Tensor, size: Tensor, keys: Tensor, capacity: int) -> Tensor:
    return _ops.hash_erase.default(digests, slot_keys, size, keys, capacity)


def hash_export(
    digests: Tensor, slot_keys: Tensor, slot_scores: Tensor, capacity: int, start: int, end: int
) -> Tuple[Tensor, Tensor, Tensor]:
    return _ops.hash_export.default(digests, slot_keys, slot_scores, capacity, start, end)


def hash_restore(
    digests: Tensor,
    slot_keys: Tensor,
    slot_scores: Tensor,
    size: Tensor,
    keys: Tensor,
    rows: Tensor,
    scores: Tensor,
    capacity: int,
) -> None:
    _ops.hash_restore.default(digests, slot_keys, slot_scores, size, keys, rows, scores, capacity)


def route(keys: Tensor, world_size: int) -> Tensor:
    """Owning rank in ``[0, world_size)`` of each int64 key under row-wise sharding.

    The hash is independent of the table's bucket hash, so the keys one rank owns spread over
    all of that rank's buckets.
    """
    if not isinstance(keys, Tensor):
        raise TypeError(f"route: keys must be a torch.Tensor, got {type(keys).__name__}")
    if keys.dtype != torch.int64:
        raise TypeError(f"route: keys must be int64, got {keys.dtype}")
    if keys.dim() != 1:
        raise ValueError(f"route: keys must be 1-D, got shape {tuple(keys.shape)}")
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"route: world_size must be an int >= 1, got {world_size!r}")
    return _ops.route.default(keys, world_size)


# ----------------------------------------------------------------------------- fake kernels


@torch.library.register_fake("torchrec_ext::hash_find")
def _hash_find_fake(digests, slot_keys, keys, capacity):
    return torch.empty_like(keys), torch.empty_like(keys, dtype=torch.bool)


@torch.library.register_fake("torchrec_ext::hash_upsert")
def _hash_upsert_fake(digests, slot_keys, slot_scores, size, keys, scores, capacity, policy, clock, epoch, assign):
    num_evicted = torch.library.get_ctx().new_dynamic_size()
    return (
        torch.empty_like(keys),
        torch.empty_like(keys, dtype=torch.bool),
        keys.new_empty(num_evicted),
        keys.new_empty(num_evicted),
    )


@torch.library.register_fake("torchrec_ext::hash_erase")
def _hash_erase_fake(digests, slot_keys, size, keys, capacity):
    return torch.empty_like(keys, dtype=torch.bool)


@torch.library.register_fake("torchrec_ext::hash_export")
def _hash_export_fake(digests, slot_keys, slot_scores, capacity, start, end):
    live = torch.library.get_ctx().new_dynamic_size()
    return slot_keys.new_empty(live), slot_keys.new_empty(live), slot_keys.new_empty(live)


@torch.library.register_fake("torchrec_ext::hash_restore")
def _hash_restore_fake(digests, slot_keys, slot_scores, size, keys, rows, scores, capacity):
    return None


@torch.library.register_fake("torchrec_ext::route")
def _route_fake(keys, world_size):
    return torch.empty_like(keys)
