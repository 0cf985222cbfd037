"""``DynamicTables``: all dynamic tables of one module, the object the collections, the sharded
modules and the fused backward hold. Its parts, one file each:

- ``table_storage.py``: the buffers of vectors and optimizer state, their layout, views, bytes;
- ``table_growth.py``: capacities doubling between steps and the rows' relayout;
- ``ids_to_rows.py``: per-table indexes, admission, TTL, fallback rows, the lookup of a batch, its
  pending new rows, and what the lookup's fused update writes (``begin_update``) and what follows
  it (``end_update``);
- ``replicated_fallback.py``: fallback rows copied on every rank of a row-wise sharded table;
- ``table_checkpoint.py``: a table's state out and in.

Here: construction (the tables' settings, including half-precision rows' rounding seeds), device
moves, reset and accounting.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
from torch import Tensor
from torchrec.modules.embedding_configs import BaseEmbeddingConfig

from torchrec_ext.hashing import fallback_seed, rounding_seed, table_seed
from torchrec_ext.modules.admission import Admission
from torchrec_ext.modules.configs import initial_capacity_of, initializer_of, options_of, storage_dtype_of
from torchrec_ext.modules.fused_optimizer import OptimizerSpec
from torchrec_ext.modules.ids_to_rows import FusedUpdate, IdsToRows, RowLookup, StorageLayout, UpdateBags
from torchrec_ext.modules.pending_rows import NewRows, pending_rows_written
from torchrec_ext.modules.replicated_fallback import ReplicatedFallback
from torchrec_ext.modules.reserved_buffers import ReservedBuffer
from torchrec_ext.modules.table_checkpoint import TableCheckpoint
from torchrec_ext.modules.table_growth import GrowthError, TableGrowth
from torchrec_ext.modules.table_stats import TableStats
from torchrec_ext.modules.table_storage import TableMeta, TableStorage
from torchrec_ext.table import HashTable
from torchrec_ext.vocabulary import dtype_code

# Where in-tree code and other branches import them from.
__all__ = ["DynamicTables", "FusedUpdate", "GrowthError", "NewRows", "RowLookup", "StorageLayout", "UpdateBags"]


class DynamicTables(IdsToRows, TableGrowth, ReplicatedFallback, TableCheckpoint, TableStorage):
    """All dynamic tables of one module: vectors, optimizer state and the id -> row indexes."""

    def __init__(self, configs: Sequence[BaseEmbeddingConfig], device: torch.device):
        self.meta: list[TableMeta] = []
        for cfg in configs:
            opts = options_of(cfg)
            kind, params = initializer_of(cfg)
            dtype, seed = storage_dtype_of(cfg), table_seed(opts.seed, cfg.name)
            self.meta.append(
                TableMeta(
                    name=cfg.name,
                    capacity=initial_capacity_of(cfg),
                    dim=cfg.embedding_dim,
                    policy=opts.eviction_policy,
                    seed=seed,
                    init_kind=kind,
                    init_params=params,
                    admission=opts.admission_strategy,
                    options=opts,
                    ttl_steps=opts.ttl_steps,
                    dtype=dtype,
                    rounding_seed=rounding_seed(seed) if dtype != torch.float32 and opts.stochastic_rounding else 0,
                    fallback_rows=opts.fallback_rows or 0,
                    fallback_seed=fallback_seed(seed),
                    max_capacity=cfg.num_embeddings,
                    initial_capacity=initial_capacity_of(cfg),
                    growth_load_factor=float(opts.growth_load_factor),
                )
            )
        cpu = torch.device("cpu")
        self.table_dims = torch.tensor([m.dim for m in self.meta], dtype=torch.int64, device=cpu)
        # The kernels' dtype arguments: None for an all-float32 module (the kernels' default).
        half = any(m.dtype != torch.float32 for m in self.meta)
        self.table_dtypes = torch.tensor([dtype_code(m.dtype) for m in self.meta], device=cpu) if half else None
        self.rounding_seeds = (
            torch.tensor([m.rounding_seed for m in self.meta], device=cpu)
            if any(m.rounding_seed for m in self.meta)
            else None
        )
        # Set by a row-wise sharded module: (tables whose fallback rows every rank holds a copy of,
        # all_reduce(tensor) summing over the ranks). Their gradients are summed over the ranks
        # before the step, so every copy takes the unsharded table's step.
        self.replicated_fallback: tuple[list[int], object] | None = None
        self._fallback_max = max((m.fallback_rows for m in self.meta), default=0)
        # Per buffer name, the address space a growing module's buffer lives in (see _allocate_buffer).
        self._reserved: dict[str, ReservedBuffer] = {}
        self.optimizer: OptimizerSpec | None = None
        self.weights = self._allocate_weights(device)  # (the layout too)
        self._init_views: list | None = None
        self.states: list[Tensor] = []
        self.optimizer_step = torch.zeros((), dtype=torch.int64, device=cpu)
        self.train_step = 0  # training batches seen: the clock of ttl_steps
        self._device_layout: dict[torch.device, tuple[Tensor, Tensor, Tensor]] = {}
        self.indexes: list[HashTable | None] = []
        self._new_rows: NewRows | None = None
        self.defer_new_rows = True  # False: lookups write new rows themselves (as on GPUs)
        # Holds NewRows.vectors; reused by every lookup (its previous contents are written by
        # then), since a fresh allocation per batch page-faults megabytes each time. The tables'
        # blocks lie back to back (_defer_tables), within the lookup's unique ids times the widest dim.
        self._new_vector_buffer = torch.empty(0, dtype=torch.float32, device=cpu)
        self._widest = max((m.dim for m in self.meta), default=0)
        self.last_seen: list[Tensor | None] = []
        self.admission: list[Admission | None] = []
        # Set by the first delta_token() (modules/deltas.py): told of every row write and removal.
        self.delta_log = None
        # Lookups whose fused update has not run yet (their autograd graph alive): rows must not
        # move while any is pending, so tables grow only when none is (see ``grow``).
        self._pending: dict[int, weakref.finalize] = {}
        # The table parameters viewing this storage, re-pointed when a growth replaces it.
        self._parameter_owners: weakref.WeakSet = weakref.WeakSet()
        self._growing = any(m.grows for m in self.meta)
        self._growth_deferred = False  # a lookup put a growth off (a fused update was pending)
        self._build_indexes()

    @pending_rows_written
    def __getstate__(self) -> dict[str, object]:
        """For deepcopy / pickle / torch.save: pending new rows are written first, so the copy
        holds every row its indexes name; caches and the scratch buffer are not carried."""
        state = dict(self.__dict__)
        if self._spans_at_max:  # each table's rows, not the reserved spans (laid out again on load)
            state["_saved_rows"] = self._saved_rows()
            state["weights"], state["states"], state["_reserved"], state["_span_views"] = None, [], {}, {}
        state["_init_views"] = None
        state["_new_vector_buffer"] = torch.empty(0, dtype=torch.float32, device="cpu")
        # Each table's own last_seen (not views of the lookup's flat layout, laid out again on use).
        state.pop("_ttl_flat", None)
        state["last_seen"] = [None if seen is None else seen.clone() for seen in self.last_seen]
        state["_pending"] = {}  # a copy has no lookup in flight
        state["_parameter_owners"] = None  # the copy's table modules register themselves
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        saved = state.pop("_saved_rows", None)
        self.__dict__.update(state)
        self._parameter_owners = weakref.WeakSet()
        if saved is not None:
            self._spread_spans(saved)

    @pending_rows_written
    def apply(self, fn) -> None:
        """Applies a tensor function (``Module._apply``'s) to the storage and moves the indexes."""
        old_device = self.device
        probe = torch.empty(0, dtype=torch.float32, device=old_device)
        if fn(probe) is not probe:  # moved or converted: not the whole reserved spans
            self._pack_spans()
        self.weights = fn(self.weights)
        self.states = [fn(s) for s in self.states]
        self._init_views = None
        if self.device != old_device:
            self._build_indexes(carry_from=old_device)
        self._spread_spans()  # a growing module on CPU: spans at num_embeddings again

    def reset(self) -> None:
        """Forgets every id: empty indexes, cleared optimizer state and counters; growing tables
        go back to their initial capacity."""
        self._new_rows = None
        if self.delta_log is not None:
            self.delta_log.replaced(self, range(len(self.meta)), [None] * len(self.meta))
        shrink = {t: (m.initial_capacity, None) for t, m in enumerate(self.meta) if m.capacity != m.initial_capacity}
        if shrink and self.device.type != "meta":
            self._relayout(shrink, {})
        self._build_indexes()
        for t, m in enumerate(self.meta):
            if m.fallback_rows:
                self.fallback_view(t).zero_()
        if self.optimizer is not None:
            spec, self.optimizer = self.optimizer, None
            self.set_optimizer(spec)
        self.optimizer_step.zero_()
        self.train_step = 0

    # ------------------------------------------------------------------ accounting

    def num_live_rows(self) -> int:
        return sum(index.size() for index in self.indexes if index is not None)

    def table_stats(self) -> dict[str, TableStats]:
        """Per table: live rows, capacity (now) and max_capacity, and the counters of
        ``TableCounters`` (see ``TableStats``)."""
        if self.counters is None:  # on meta: nothing counted
            return {m.name: TableStats(capacity=m.capacity, max_capacity=m.max_capacity) for m in self.meta}
        stats = self.counters.stats(
            [m.name for m in self.meta],
            [m.capacity for m in self.meta],
            [index.size() for index in self.indexes],
            [m.fallback_rows for m in self.meta],
        )
        for m in self.meta:
            stats[m.name].max_capacity = m.max_capacity
        return stats
