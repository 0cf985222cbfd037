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

from contextlib import nullcontext
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata, TensorProperties

from torchrec_ext import ops
from torchrec_ext.modules.base import DynamicTableDict
from torchrec_ext.modules.configs import options_of
from torchrec_ext.reference import OPTIMIZER_STATES, ROWWISE_STATE

PENDING_KEYS = ("admission_id", "admission_count")


def row_keys(dim: int, optimizer: Optional[str], ttl: bool) -> Dict[str, Tuple[Tuple[int, ...], torch.dtype]]:
    """Per-row keys of one table and their (trailing shape, dtype)."""
    keys = {"weight": ((dim,), torch.float32), "weight_id": ((), torch.int64), "metadata": ((), torch.int64),
            "row": ((), torch.int64)}
    if optimizer is not None:
        for name in OPTIMIZER_STATES[optimizer]:
            keys[f"optimizer.{name}"] = ((() if optimizer in ROWWISE_STATE else (dim,)), torch.float32)
    if ttl:
        keys["last_seen"] = ((), torch.int64)
    return keys


def sharded_rows(local: Tensor, counts: Sequence[int], rank: int, pg) -> ShardedTensor:
    """A ShardedTensor along dim 0 whose rank r shard has counts[r] rows (ranks with none hold
    no shard, as DCP could take an empty shard at a shared offset for the real one; an empty
    tensor is one empty shard on rank 0)."""
    trailing = list(local.shape[1:])
    offsets = [sum(counts[:r]) for r in range(len(counts))]
    device = local.device.type
    metas = {r: ShardMetadata([offsets[r]] + [0] * len(trailing), [counts[r]] + trailing, f"rank:{r}/{device}")
             for r in range(len(counts)) if counts[r] > 0 or (r == 0 and not any(counts))}
    global_meta = ShardedTensorMetadata(list(metas.values()), torch.Size([sum(counts)] + trailing),
                                        TensorProperties.create_from_tensor(local))
    shards = [Shard(local, metas[rank])] if rank in metas else []
    tensor = ShardedTensor._init_from_local_shards_and_global_metadata(shards, global_meta, process_group=pg)
    tensor.dynamic_rows = True  # checkpoint loading reads these whole (see distributed.checkpoint)
    return tensor


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


class ShardedDynamicState:
    """State-dict hooks of the sharded dynamic modules (the layout described above). The host
    is a ShardedModule with ``_env``, ``_world_size``, ``_rank`` and ``_owners`` (table -> rank,
    -1 for row-wise) that calls ``_init_sharded_state`` in its constructor."""

    def _init_sharded_state(self, container: str, configs, optimizer_kind: Optional[str]) -> None:
        self._container, self._state_configs, self._optimizer_kind = container, configs, optimizer_kind
        self._register_state_dict_hook(ShardedDynamicState._sharded_state_dict)
        self._register_load_state_dict_pre_hook(self._route_loaded_state, with_module=False)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        # DMP loads a sharded module with this call: its tables' container sees the strictness.
        tables = getattr(self, self._container)
        loading = tables.loading(strict) if isinstance(tables, DynamicTableDict) else nullcontext()
        with loading:
            return super().load_state_dict(state_dict, strict=strict, assign=assign)

    @staticmethod
    def _sharded_state_dict(module: "ShardedDynamicState", state_dict, prefix: str, local_metadata) -> None:
        pg, world, rank = module._env.process_group, module._world_size, module._rank
        configs, container = module._state_configs, module._container
        local = {}
        for cfg in configs:
            keys = [k for k in state_dict if k.startswith(f"{prefix}{container}.{cfg.name}.")]
            local[cfg.name] = {k[len(f"{prefix}{container}.{cfg.name}."):]: state_dict.pop(k) for k in keys}
        row_counts = [int(local[c.name]["weight_id"].numel()) if local[c.name] else 0 for c in configs]
        pending_counts = [int(local[c.name]["admission_id"].numel()) if "admission_id" in local[c.name] else 0
                          for c in configs]
        counts = gather_counts(row_counts + pending_counts, world, pg)
        for i, cfg in enumerate(configs):
            opts = options_of(cfg)
            mine = local[cfg.name]
            base = f"{prefix}{container}.{cfg.name}."
            for key, (trailing, dtype) in row_keys(cfg.embedding_dim, module._optimizer_kind, opts.ttl_steps is not None).items():
                tensor = mine.get(key, torch.empty((0,) + trailing, dtype=dtype))
                state_dict[base + key] = sharded_rows(tensor, [c[i] for c in counts], rank, pg)
            if opts.admit_after > 1:
                for key in PENDING_KEYS:
                    tensor = mine.get(key, torch.empty(0, dtype=torch.int64))
                    state_dict[base + key] = sharded_rows(tensor, [c[len(configs) + i] for c in counts], rank, pg)
            counters = mine.get("counters", torch.zeros(4, dtype=torch.int64)).view(1, 4)
            state_dict[base + "counters"] = sharded_rows(counters, [1] * world, rank, pg)

    def _route_loaded_state(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs) -> None:
        for cfg in self._state_configs:
            base = f"{prefix}{self._container}.{cfg.name}."
            keys = [k for k in list(state_dict) if k.startswith(base)]
            owner = self._owners[cfg.name]
            if owner >= 0 and owner != self._rank:  # another rank's table-wise table
                for k in keys:
                    del state_dict[k]
                continue
            if base + "weight_id" not in state_dict:
                continue  # reported as missing by the table itself
            ids = state_dict[base + "weight_id"]
            mine = None if isinstance(ids, ShardedTensor) else owned_mask(ids, owner, self._rank, self._world_size)
            pending = state_dict.get(base + "admission_id")
            pending_mine = None if pending is None or isinstance(pending, ShardedTensor) else \
                owned_mask(pending, owner, self._rank, self._world_size)
            counters = state_dict.get(base + "counters")
            saved_world = None if counters is None else int(counters.size(0))
            same_layout = saved_world == self._world_size
            for k in keys:
                name = k[len(base):]
                if name == "counters":
                    rows = local_rows(state_dict[k], None).view(-1, 4)
                    if isinstance(state_dict[k], ShardedTensor) or not same_layout:
                        state_dict[k] = rows.max(0).values if rows.numel() else torch.zeros(4, dtype=torch.int64)
                    else:  # the same ranks: each takes its own clocks back
                        state_dict[k] = rows[self._rank]
                elif name in PENDING_KEYS:
                    state_dict[k] = local_rows(state_dict[k], pending_mine)
                else:
                    state_dict[k] = local_rows(state_dict[k], mine)
            if not same_layout:
                state_dict.pop(base + "row", None)  # placement of another world size: re-insert
