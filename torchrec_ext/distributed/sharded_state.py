"""Checkpoint layout of sharded dynamic tables.

``state_dict()`` gives, for every table on every rank, ShardedTensors along dim 0 holding the
live rows of all ranks: ``weight`` [n, dim], ``weight_id``, ``metadata`` (scores),
``optimizer.<state>``, plus ``last_seen`` / ``admission_id`` / ``admission_count`` when those
features are on, and ``counters`` [world_size, 4]. Sizes come from an all-gather of each rank's
live-row counts, so every rank must call ``state_dict()`` together (as a DCP save does).

Loading takes either those ShardedTensors (same world size and plan: each rank keeps its local
shards) or full tensors of the whole table (any world size: each rank keeps the ids routed to
it). ``torchrec_ext.distributed.checkpoint`` loads DCP checkpoints as full tensors.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata, TensorProperties

from torchrec_ext import ops
from torchrec_ext.reference import OPTIMIZER_STATES, ROWWISE_STATE

ROW_KEYS = ("weight", "weight_id", "metadata")
PENDING_KEYS = ("admission_id", "admission_count")


def row_keys(dim: int, optimizer: Optional[str], ttl: bool) -> Dict[str, Tuple[Tuple[int, ...], torch.dtype]]:
    """Per-row keys of one table and their (trailing shape, dtype)."""
    keys = {"weight": ((dim,), torch.float32), "weight_id": ((), torch.int64), "metadata": ((), torch.int64)}
    if optimizer is not None:
        for name in OPTIMIZER_STATES[optimizer]:
            keys[f"optimizer.{name}"] = ((() if optimizer in ROWWISE_STATE else (dim,)), torch.float32)
    if ttl:
        keys["last_seen"] = ((), torch.int64)
    return keys


def sharded_rows(local: Tensor, counts: Sequence[int], rank: int, pg) -> ShardedTensor:
    """A ShardedTensor along dim 0 whose rank r shard has counts[r] rows."""
    trailing = list(local.shape[1:])
    offsets = [sum(counts[:r]) for r in range(len(counts))]
    device = local.device.type
    metas = [ShardMetadata([offsets[r]] + [0] * len(trailing), [counts[r]] + trailing, f"rank:{r}/{device}")
             for r in range(len(counts))]
    global_meta = ShardedTensorMetadata(metas, torch.Size([sum(counts)] + trailing), TensorProperties.create_from_tensor(local))
    return ShardedTensor._init_from_local_shards_and_global_metadata([Shard(local, metas[rank])], global_meta, process_group=pg)


def gather_counts(local_counts: List[int], world_size: int, pg) -> List[List[int]]:
    """counts[r][i]: rank r's local_counts[i] (one all-gather)."""
    mine = torch.tensor(local_counts, dtype=torch.int64)
    everyone = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(everyone, mine, group=pg)
    return [t.tolist() for t in everyone]


def local_rows(value, mine) -> Tensor:
    """This rank's rows of a saved key: a ShardedTensor's local shards, or the rows of a full
    tensor selected by ``mine`` (a bool mask over its rows, from the ids' routing)."""
    if isinstance(value, ShardedTensor):
        shards = [s.tensor for s in value.local_shards()]
        return torch.cat(shards) if shards else torch.empty((0,) + tuple(value.size()[1:]), dtype=value.dtype)
    return value[mine] if mine is not None else value


def owned_mask(ids: Tensor, owner: int, rank: int, world_size: int) -> Tensor:
    """Which ids this rank holds: route(id) == rank for row-wise (owner -1), else all or none."""
    if owner < 0:
        return ops.route(ids.to(torch.int64).contiguous(), world_size) == rank
    return torch.full((ids.numel(),), owner == rank, dtype=torch.bool)
