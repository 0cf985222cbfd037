"""Fallback rows: which of its table's shared rows an id without a row of its own reads."""

from __future__ import annotations

import torch
from torch import Tensor

from torchrec_ext.reference.hashing import _MASK64, _fmix64, _srl, fmix64_tensor

FALLBACK_GOLDEN = 0x8CB92BA72F3D8DD7  # the fallback-row hash's constant (neither the bucket's nor the route's)


def fallback_seed(table_seed: int) -> int:
    """A table's fallback-row hash seed (as int64): from the table seed, so the choice of
    fallback row is a stream of its own, independent of the bucket hash (``fmix64(id ^ GOLDEN)``)
    and of the routing hash (unseeded), and the same for every shard of the table."""
    h = _fmix64((table_seed ^ FALLBACK_GOLDEN) & _MASK64)
    return h - (1 << 64) if h >> 63 else h


def fallback_slots(ids: Tensor, seeds: Tensor, num_rows: Tensor) -> Tensor:
    """Which of its table's ``num_rows`` fallback rows each id reads: ``fmix64(id ^ seed) >> 1``
    modulo num_rows (``seeds``: ``fallback_seed`` of each id's table; both broadcast with ids)."""
    return _srl(fmix64_tensor(ids.to(torch.int64) ^ seeds), 1) % num_rows
