"""Checkpoint layout of sharded dynamic tables.

``state_dict()`` gives, for every table on every rank, ShardedTensors along dim 0 holding the
live rows of all ranks: ``weight`` [n, dim], ``weight_id``, ``metadata`` (scores),
``optimizer.<state>``, plus ``last_seen`` / ``admission_id`` / ``admission_count`` when those
features are on (``admission_bloom``: [filters, bytes], one Bloom filter per rank holding the table): the unsharded module's keys and logical shapes. ``counters`` is, as unsharded, one
[5] tensor (clock, epoch, training step, optimizer step, layout), the same on every rank (a replicated
tensor to DCP): every shard of a table counts the same training batches, so the ranks holding it
agree (the largest is taken). Sizes and counters come from one all-gather, so every rank must
call ``state_dict()`` together (as a DCP save does).

Devices: every shard of rank r (rows, counters, the empty placeholders of tables it does not
hold) lies on rank r's table device, and placements name it with its index (``rank:r/cuda:1``:
torch tells ``cuda`` from ``cuda:1`` and refuses a shard whose device differs from its
placement). Each rank's device index travels in the same all-gather, so all ranks build the same
metadata. That all-gather runs on the CPU when the group has a CPU backend (gloo, or
``cpu:gloo,cuda:nccl``), else on the table device (NCCL has no CPU backend).

Loading takes either those ShardedTensors (same world size and plan: each rank keeps its local
shards) or full tensors of the whole table (any world size: each rank keeps the ids routed to
it), e.g. an unsharded module's ``state_dict()``. ``torchrec_ext.distributed.checkpoint`` loads
DCP checkpoints as full tensors; ``full_state_dict`` turns a sharded state into full tensors on
every rank, which an unsharded module loads. Saved rows are kept where they are valid placements
in this rank's table, else its ids are placed afresh. (Checkpoints of the earlier layout, counters
[world_size, 4], still load, as do counters [4] of states saved before the layout version.)
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata, TensorProperties

from torchrec_ext import ops
from torchrec_ext.distributed.placement import TablePlacement
from torchrec_ext.modules.admission import local_bloom_geometry
from torchrec_ext.modules.configs import options_of, storage_dtype_of
from torchrec_ext.modules.table_checkpoint import COUNTERS
from torchrec_ext.modules.table_modules import DynamicTableDict
from torchrec_ext.vocabulary import OPTIMIZER_STATES, ROWWISE_STATE

PENDING_KEYS = ("admission_id", "admission_count")


def row_keys(
    dim: int, optimizer: str | None, ttl: bool, weight_dtype: torch.dtype = torch.float32
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Per-row keys of one table and their (trailing shape, dtype); ``weight`` is in the table's
    storage dtype, optimizer state float32."""
    keys = {
        "weight": ((dim,), weight_dtype),
        "weight_id": ((), torch.int64),
        "metadata": ((), torch.int64),
        "row": ((), torch.int64),
    }
    if optimizer is not None:
        for name in OPTIMIZER_STATES[optimizer]:
            keys[f"optimizer.{name}"] = ((() if optimizer in ROWWISE_STATE else (dim,)), torch.float32)
    if ttl:
        keys["last_seen"] = ((), torch.int64)
    return keys


def shard_device(device) -> torch.device:
    """``device`` with its index: ``cuda`` means this process's current CUDA device."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def placement(rank: int, device) -> str:
    """The placement of rank ``rank``'s shard on ``device`` (``rank:1/cuda:1``, ``rank:0/cpu``)."""
    return f"rank:{rank}/{shard_device(device)}"


def collective_device(pg, device) -> torch.device:
    """Where a tensor for a collective on ``pg`` goes: the CPU when the group has a CPU backend
    (host-side data stays there), else ``device`` (an NCCL group takes CUDA tensors only)."""
    backend = str(dist.get_backend(pg))
    if ":" in backend:  # per device type, e.g. "cpu:gloo,cuda:nccl"
        has_cpu = any(pair.split(":")[0].strip() == "cpu" for pair in backend.split(","))
    else:
        has_cpu = "cpu" in dist.Backend.backend_capability.get(backend, ["cpu"])
    return torch.device("cpu") if has_cpu else shard_device(device)


def rows_metadata(
    counts: Sequence[int], trailing: Sequence[int], properties: TensorProperties, devices: Sequence[torch.device]
) -> ShardedTensorMetadata:
    """Metadata of a ShardedTensor along dim 0 whose rank r shard has counts[r] rows on
    devices[r] (ranks with none hold no shard, as DCP could take an empty shard at a shared
    offset for the real one; an empty tensor is one empty shard on rank 0)."""
    if len(devices) != len(counts):
        raise ValueError(f"rows_metadata: devices must name one device per rank ({len(counts)}), got {len(devices)}")
    trailing = list(trailing)
    offsets = [sum(counts[:r]) for r in range(len(counts))]
    shards = [
        ShardMetadata([offsets[r]] + [0] * len(trailing), [counts[r]] + trailing, placement(r, devices[r]))
        for r in range(len(counts))
        if counts[r] > 0 or (r == 0 and not any(counts))
    ]
    return ShardedTensorMetadata(shards, torch.Size([sum(counts)] + trailing), properties)


def sharded_tensor(local: Tensor, metadata: ShardedTensorMetadata, rank: int, pg) -> ShardedTensor:
    """The ShardedTensor of ``metadata`` holding ``local`` as rank ``rank``'s shard (moved to
    its placement's device; ignored when the metadata gives this rank none)."""
    mine = [m for m in metadata.shards_metadata if m.placement.rank() == rank]
    shards = [Shard(local.to(m.placement.device()).contiguous(), m) for m in mine]
    tensor = ShardedTensor._init_from_local_shards_and_global_metadata(shards, metadata, process_group=pg)
    tensor.dynamic_rows = True  # checkpoint loading reads these whole (see distributed.checkpoint)
    return tensor


def sharded_rows(local: Tensor, counts: Sequence[int], rank: int, pg, devices: Sequence[torch.device]) -> ShardedTensor:
    """A ShardedTensor along dim 0 whose rank r shard has counts[r] rows on devices[r]; this
    rank's is ``local``."""
    metadata = rows_metadata(counts, local.shape[1:], TensorProperties.create_from_tensor(local), devices)
    return sharded_tensor(local, metadata, rank, pg)


def gather_counts(
    local_counts: list[int], device: torch.device, world_size: int, pg
) -> tuple[list[list[int]], list[torch.device]]:
    """counts[r][i]: rank r's local_counts[i], and rank r's shard device (one all-gather, of a
    tensor on the group's collective device). ``device`` is this rank's."""
    device = shard_device(device)
    index = -1 if device.index is None else device.index
    mine = torch.tensor(list(local_counts) + [index], dtype=torch.int64, device=collective_device(pg, device))
    everyone = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(everyone, mine, group=pg)
    rows = [t.tolist() for t in everyone]
    devices = [torch.device(device.type) if row[-1] < 0 else torch.device(device.type, row[-1]) for row in rows]
    return [row[:-1] for row in rows], devices


def full_state_dict(state_dict: dict[str, object], process_group=None) -> dict[str, object]:
    """``state_dict`` with every ShardedTensor made whole, on every rank (collective: all ranks
    call it with the same keys): what an unsharded module loads, e.g. a sharded model's tables
    into an unsharded copy for evaluation. Other values are passed through."""
    out = {}
    for key, value in state_dict.items():
        if not isinstance(value, ShardedTensor):
            out[key] = value
            continue
        shards = value.local_shards()
        device = collective_device(process_group or dist.group.WORLD, shards[0].tensor.device if shards else "cpu")
        full = torch.zeros(tuple(value.size()), dtype=value.dtype, device=device)
        for shard in shards:  # shards are disjoint: a sum over ranks puts each value in place
            where = tuple(slice(o, o + n) for o, n in zip(shard.metadata.shard_offsets, shard.metadata.shard_sizes))
            full[where] = shard.tensor.to(device)
        dist.all_reduce(full, group=process_group)
        out[key] = full
    return out


def local_rows(value, mine) -> Tensor:
    """This rank's rows of a saved key: a ShardedTensor's local shards, or the rows of a full
    tensor selected by ``mine`` (a bool mask over its rows, from the ids' routing)."""
    if isinstance(value, ShardedTensor):
        shards = [s.tensor for s in value.local_shards()]
        return (
            torch.cat(shards)
            if shards
            else torch.empty((0,) + tuple(value.size()[1:]), dtype=value.dtype, device="cpu")
        )
    return value[mine] if mine is not None else value


def owned_mask(ids: Tensor, owner, rank: int, world_size: int) -> Tensor:
    """Which ids this rank holds. owner: the table's ``TablePlacement``, or an int: -1 for a
    row-wise table (route(id) == rank), else the rank of a table-wise table (all or none)."""
    if isinstance(owner, TablePlacement):
        return owner.owns(ids, rank)
    if owner < 0:
        return ops.route(ids.to(torch.int64).contiguous(), world_size) == rank
    return torch.full((ids.numel(),), owner == rank, dtype=torch.bool, device=ids.device)


def column_rows(
    local: Tensor,
    rows: int,
    trailing: Sequence[int],
    table: TablePlacement,
    rank: int,
    pg,
    devices: Sequence[torch.device],
) -> ShardedTensor:
    """A ShardedTensor [rows, dim] of a column table's per-column key (weight, optimizer state):
    each rank holding shards of it has the block [rows, its columns] (TorchRec's column-wise
    layout); this rank's is ``local``."""
    shards = []
    for r in table.lookup_ranks():
        first, width = table.local_columns(r)
        shards.append(ShardMetadata([0, first], [rows, width], placement(r, devices[r])))
    properties = TensorProperties.create_from_tensor(local)
    metadata = ShardedTensorMetadata(shards, torch.Size([rows] + list(trailing)), properties)
    return sharded_tensor(local, metadata, rank, pg)


class ShardedDynamicState:
    """State-dict hooks of the sharded dynamic modules (the layout described above). The host
    is a ShardedModule with ``_env``, ``_world_size``, ``_rank``, ``_owners`` (table ->
    ``TablePlacement``), ``_device`` and ``_local`` (its tables' module or None) that calls
    ``_init_sharded_state`` in its constructor."""

    def _init_sharded_state(self, container: str, configs, optimizer_kind: str | None) -> None:
        self._container, self._state_configs, self._optimizer_kind = container, configs, optimizer_kind
        self._register_state_dict_hook(ShardedDynamicState._sharded_state_dict)
        self._register_load_state_dict_pre_hook(self._route_loaded_state, with_module=False)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        # DMP loads a sharded module with this call: its tables' container sees the strictness.
        tables = getattr(self, self._container)
        loading = tables.loading(strict) if isinstance(tables, DynamicTableDict) else nullcontext()
        with loading:
            return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def _shard_device(self) -> torch.device:
        """The device of this rank's shards: its tables' storage (the sharding device without tables)."""
        local = getattr(self, "_local", None)
        return shard_device(local.device if local is not None else self._device)

    @staticmethod
    def _sharded_state_dict(module: ShardedDynamicState, state_dict, prefix: str, local_metadata) -> None:
        pg, world, rank = module._env.process_group, module._world_size, module._rank
        configs, container = module._state_configs, module._container
        local = {}
        for cfg in configs:
            keys = [k for k in state_dict if k.startswith(f"{prefix}{container}.{cfg.name}.")]
            local[cfg.name] = {k[len(f"{prefix}{container}.{cfg.name}.") :]: state_dict.pop(k) for k in keys}
        # A column table's per-row data (ids, scores, admission) is the same on every shard: the
        # first shard's rank speaks for it.
        speaks = [module._owners[c.name].kind != "column" or module._owners[c.name].first_rank == rank for c in configs]
        row_counts = [
            int(local[c.name]["weight_id"].numel()) if local[c.name] and speaks[i] else 0 for i, c in enumerate(configs)
        ]
        pending_counts = [
            int(local[c.name]["admission_id"].numel()) if "admission_id" in local[c.name] and speaks[i] else 0
            for i, c in enumerate(configs)
        ]
        # Counters travel in the same all-gather; a rank without the table contributes zeros.
        width = len(COUNTERS)
        counters = [local[c.name]["counters"].tolist() if "counters" in local[c.name] else [0] * width for c in configs]
        filter_counts = [
            int(local[c.name]["admission_bloom"].shape[0]) if "admission_bloom" in local[c.name] and speaks[i] else 0
            for i, c in enumerate(configs)
        ]
        counts, devices = gather_counts(
            row_counts + pending_counts + [v for c in counters for v in c] + filter_counts,
            module._shard_device(),
            world,
            pg,
        )
        # Counters are replicated, not sharded: on this rank's tables' device, as unsharded.
        local_module = getattr(module, "_local", None)
        counters_device = local_module.device if local_module is not None else module._device
        for i, cfg in enumerate(configs):
            opts = options_of(cfg)
            mine = local[cfg.name]
            base = f"{prefix}{container}.{cfg.name}."
            # Placeholders of tables this rank does not hold are moved to its device with the rest.
            table = module._owners[cfg.name]
            for key, (trailing, dtype) in row_keys(
                cfg.embedding_dim, module._optimizer_kind, opts.ttl_steps is not None, storage_dtype_of(cfg)
            ).items():
                tensor = mine.get(key, torch.empty((0,) + trailing, dtype=dtype, device="cpu"))
                if table.kind == "column" and trailing:
                    state_dict[base + key] = column_rows(
                        tensor, sum(c[i] for c in counts), trailing, table, rank, pg, devices
                    )
                else:
                    state_dict[base + key] = sharded_rows(tensor, [c[i] for c in counts], rank, pg, devices)
            if opts.admission_strategy == "counter":
                for key in PENDING_KEYS:
                    tensor = mine.get(key, torch.empty(0, dtype=torch.int64, device="cpu"))
                    state_dict[base + key] = sharded_rows(
                        tensor, [c[len(configs) + i] for c in counts], rank, pg, devices
                    )
            if opts.admission_strategy == "bloom":  # one filter per rank holding the table: [filters, bytes]
                nbytes = local_bloom_geometry(opts, cfg.num_embeddings, table.parts).nbytes
                tensor = mine.get("admission_bloom", torch.empty(0, nbytes, dtype=torch.uint8, device="cpu"))
                state_dict[base + "admission_bloom"] = sharded_rows(
                    tensor, [c[(2 + width) * len(configs) + i] for c in counts], rank, pg, devices
                )
            if opts.fallback_rows:
                state_dict.update(module._fallback_state(cfg, base, mine, counters_device))
            first = 2 * len(configs) + width * i
            state_dict[base + "counters"] = torch.tensor(
                [max(c[first + j] for c in counts) for j in range(width)], dtype=torch.int64, device=counters_device
            )

    def _fallback_state(self, cfg, base: str, mine: dict[str, Tensor], device: torch.device) -> dict[str, Tensor]:
        """A table's fallback rows and their optimizer state: plain tensors, the same on every
        rank (a replicated tensor to DCP, as counters). A row-wise table's ranks each hold an equal
        copy; a table-wise table's owner sends its rows to the others; a column table's shards
        each give their columns (collective)."""
        names = ["fallback_weight"] + [
            f"fallback_{k}" for k in row_keys(1, self._optimizer_kind, False) if k.startswith("optimizer.")
        ]
        table = self._owners[cfg.name]
        owner = table.ranks[0]
        out = {}
        for name in names:
            if table.kind == "row":
                out[base + name] = mine[name]
                continue
            if name == "fallback_weight":
                shape, dtype = (options_of(cfg).fallback_rows, cfg.embedding_dim), storage_dtype_of(cfg)
            else:
                shape, dtype = (
                    (options_of(cfg).fallback_rows,)
                    + (() if self._optimizer_kind in ROWWISE_STATE else (cfg.embedding_dim,)),
                    torch.float32,
                )
            here = collective_device(self._env.process_group, device)
            pg = self._env.process_group
            if table.kind == "column":  # the shards' columns are disjoint: a sum puts each in place
                tensor = torch.zeros(shape, dtype=dtype, device=here)
                if table.holds(self._rank):
                    first, width = table.local_columns(self._rank)
                    tensor[:, first : first + width] = mine[name].to(here)
                dist.all_reduce(tensor, group=pg)
            else:
                tensor = mine[name].to(here) if owner == self._rank else torch.empty(shape, dtype=dtype, device=here)
                dist.broadcast(tensor, src=dist.get_global_rank(pg, owner), group=pg)
            out[base + name] = tensor.to(device)
        return out

    def _local_filters(self, filters, table: TablePlacement) -> Tensor:
        """A Bloom admission checkpoint [filters, bytes] for this rank: its own filter when saved
        with this layout (a sharded tensor's local shard, or this rank's row of one filter per
        rank of a row-wise table), else every saved filter (the table sums them; see modules.admission)."""
        if isinstance(filters, ShardedTensor):
            return local_rows(filters, None)
        if table.kind == "row" and filters.dim() == 2 and int(filters.shape[0]) == table.parts:
            at = table.ranks.index(self._rank)
            return filters[at : at + 1]
        return filters

    def _whole_column_state(self, state_dict, base: str) -> None:
        """A column table's saved ShardedTensors made whole (collective: every rank loads the same
        keys): a shard's rank holds its columns, and only the first shard's the per-row data."""
        for k in [k for k in state_dict if k.startswith(base) and isinstance(state_dict[k], ShardedTensor)]:
            state_dict[k] = full_state_dict({k: state_dict[k]}, self._env.process_group)[k].to(self._shard_device())

    def _route_loaded_state(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ) -> None:
        for cfg in self._state_configs:
            base = f"{prefix}{self._container}.{cfg.name}."
            table = self._owners[cfg.name]
            if table.kind == "column":
                self._whole_column_state(state_dict, base)
            keys = [k for k in list(state_dict) if k.startswith(base)]
            if not table.holds(self._rank):  # another rank's table
                for k in keys:
                    del state_dict[k]
                continue
            if base + "weight_id" not in state_dict:
                continue  # reported as missing by the table itself
            ids = state_dict[base + "weight_id"]
            mine = None if isinstance(ids, ShardedTensor) else table.owns(ids, self._rank)
            pending = state_dict.get(base + "admission_id")
            pending_mine = (
                None if pending is None or isinstance(pending, ShardedTensor) else table.owns(pending, self._rank)
            )
            first, width = table.local_columns(self._rank)
            columns = table.kind == "column" and width != cfg.embedding_dim
            counters = state_dict.get(base + "counters")
            # The earlier layout's counters were [world_size, 4], one row per rank, and its rows
            # were kept only when saved at this world size.
            legacy = counters is not None and len(counters.size()) == 2
            same_layout = not legacy or int(counters.size(0)) == self._world_size
            for k in keys:
                name = k[len(base) :]
                if name == "counters" and legacy:
                    rows = local_rows(state_dict[k], None).view(-1, 4)
                    if isinstance(state_dict[k], ShardedTensor) or not same_layout:
                        state_dict[k] = rows.max(0).values if rows.numel() else rows.new_zeros(4)
                    else:  # the same ranks: each takes its own clocks back
                        state_dict[k] = rows[self._rank]
                elif name == "counters":
                    pass  # one [5] for every rank ([4]: saved before the layout version)
                elif name in PENDING_KEYS:
                    state_dict[k] = local_rows(state_dict[k], pending_mine)
                elif name == "admission_bloom":
                    state_dict[k] = self._local_filters(state_dict[k], table)
                elif name.startswith("fallback_"):
                    # the table's fallback rows: every rank holding it takes them whole (its columns)
                    value = state_dict[k]
                    if columns and value.dim() == 2 and value.shape[1] == cfg.embedding_dim:
                        state_dict[k] = value[:, first : first + width]
                else:
                    rows = local_rows(state_dict[k], mine)
                    if columns and rows.dim() == 2 and rows.shape[1] == cfg.embedding_dim:  # its columns
                        rows = rows[:, first : first + width]
                    state_dict[k] = rows
            if not same_layout:
                state_dict.pop(base + "row", None)  # placement of another world size: re-insert
