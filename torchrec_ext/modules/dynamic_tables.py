"""The storage and id-to-row logic shared by the dynamic embedding modules.

``DynamicTables`` holds a module's tables: one flat buffer of 4-byte words holding all vectors
(table t's [capacity_t, dim_t] rows from word ``table_offsets[t]``, packed in the table's storage
dtype: float32, float16 or bfloat16 from its config's ``data_type``; the layout the kernels take),
the float32 optimizer state (element-wise states: the tables back to back), and one
``HashTable`` per table mapping raw ids to rows. Half-precision rows are stepped in float32 and
written back with stochastic rounding (a pure function of the table's seed, the id, the element
and the optimizer step) unless the table's ``stochastic_rounding`` is off.

Per training batch it deduplicates each table's ids, admits ids seen often enough, inserts the
unseen ones (evicting by the table's policy when full), initialises the rows of new ids (a pure
function of seed, table and id) and clears their optimizer state. In eval nothing is inserted:
unseen ids get row -1, which the kernels read as zeros.

Fallback rows (a config's ``fallback_rows=K``): K rows of the table's storage after its capacity
rows, which the index never hands out. A distinct id without a row (-1 above) reads row
``capacity + reference.fallback_slots(id)`` instead, in training and eval; the distinct ids
reading one fallback row are merged into one unique row of the lookup, so the fused update takes
one step of that row on their summed gradient, with its own optimizer state, as for any row.

Growth (a config's ``initial_capacity`` < num_embeddings): a table's capacity rows start at
initial_capacity and double, up to num_embeddings, when a training batch could push its load past
``growth_load_factor`` (``grow``). Every table's vectors and optimizer state move to the new
layout, the grown tables' rows to their keys' places in a rebuilt index (``HashTable.grown``),
with their last-seen steps and delta versions (``_relayout``): on CPU within the buffers' own
memory, reserved for the largest layout (``ReservedBuffer``, so only the new pages are first
touched), else into new buffers. Rows move only then, and only while no lookup awaits its fused
update (``pending_backward``).

On CPU, when a backward will follow, new rows are not written by the lookup: their initial
vectors go to a small dense block (``NewRows``) that the lookup kernels read, and the fused
update writes each one to its row with the row's first step. New ids are most of a batch's
distinct ids on heavy-tailed data, and their rows are scattered over gigabytes: this saves two
of the three passes over them. Anything else that reads the tables first writes the pending
rows (``write_new_rows``), so the deferral is never visible.
"""

from __future__ import annotations

import ctypes
import sys
import warnings
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor
from torchrec.modules.embedding_configs import BaseEmbeddingConfig

from torchrec_ext import device_sync, ops
from torchrec_ext.hashing import as_int64, fallback_seed, fallback_slots, rounding_seed, table_seed
from torchrec_ext.modules.admission import Admission, bloom_geometry, make_admission
from torchrec_ext.modules.configs import initial_capacity_of, initializer_of, options_of, storage_dtype_of
from torchrec_ext.modules.fused_optimizer import OptimizerSpec
from torchrec_ext.modules.reserved_buffers import ReservedBuffer
from torchrec_ext.modules.state_checks import _check_distinct, _checked
from torchrec_ext.modules.table_stats import MAX_AGE_BINS, TableCounters, TableStats
from torchrec_ext.table import (
    CLOCK_LIMIT,
    EPOCH_LIMIT,
    LAYOUT_LIMIT,
    LAYOUT_VERSION,
    LAYOUTS,
    SAME_BUCKET_LAYOUTS,
    FixedInsertResult,
    HashTable,
    check_counter,
    find_or_insert_tables,
    place_keys,
    stash_slots,
)
from torchrec_ext.vocabulary import (
    INITIALIZER_NAMES,
    INITIALIZER_PARAM_COUNTS,
    OPTIMIZER_STATES,
    OPTIMIZERS,
    ROWWISE_STATE,
    SQUARED_STATES,
    dense_state_offsets,
    dtype_code,
    index_bytes,
    pending_row,
    row_map_bytes,
    table_words,
)

_SCORED_BY_COUNT = {"lfu", "epoch_lfu"}
# SGD hyper-parameters (lr, eps, beta1, beta2, weight_decay, lr_decay) whose step on a zeroed row
# leaves the row's summed gradient in it.
_MINUS_ONE_SGD = (-1.0, 0.0, 0.0, 0.0, 0.0, 0.0)


class GrowthError(RuntimeError):
    """A growing table could not allocate its larger storage: the tables keep their storage and
    rows and stay usable (at their current capacity). Raised by a training lookup before it
    inserts anything, except for tables with admission, which grow once their admitted ids are
    known: there the lookup's admission counts of that table, and the tables before it in the
    batch, keep what the lookup did."""


@dataclass
class NewRows:
    """New ids' rows from one training lookup, their initial values not yet written there.

    vectors[t]: [n_t, dim_t] initial vectors of table t's new ids; rows[t]: their rows;
    unique_new: per unique id of the lookup, its index into its table's vectors (-1: not new).
    """

    vectors: list[Tensor]
    rows: list[Tensor]
    unique_new: Tensor
    written: bool = False


class RowLookup(NamedTuple):
    """Rows of one batch's ids, and the grouping the fused backward needs.

    rows: the row each id is read from (-1: none, zeros; -2 - j: vector j of its table's
    ``new.vectors``). unique_rows / unique_table: each table's distinct ids' rows and tables,
    tables in order. inverse: each id's index into unique_rows. new: rows still to be written.
    unique_ids: the id of each unique row (stochastic rounding's bits are drawn per id).
    """

    rows: Tensor
    unique_rows: Tensor
    unique_table: Tensor
    inverse: Tensor
    new: NewRows | None = None
    unique_ids: Tensor | None = None

    @property
    def new_vectors(self) -> list[Tensor]:
        """The blocks the lookup kernels read rows -2 - j from (none when no row is pending)."""
        return self.new.vectors if self.new is not None else []


@dataclass
class _TableMeta:
    name: str
    capacity: int  # rows of storage now (the index's capacity); grows up to max_capacity
    dim: int
    policy: str
    seed: int
    init_kind: int
    init_params: tuple[float, ...]
    admission: str | None  # the strategy's name (None: every id is admitted)
    options: object  # the config's DynamicTableOptions, which the strategy is built from
    ttl_steps: int | None
    dtype: torch.dtype = torch.float32  # storage dtype of the vectors
    rounding_seed: int = 0  # stochastic rounding of half rows: the stream's seed; 0: to nearest
    fallback_rows: int = 0  # K shared rows after the capacity rows (0: none)
    fallback_seed: int = 0  # the fallback-row hash's seed
    max_capacity: int = 0  # num_embeddings: what the table may grow to
    initial_capacity: int = 0  # what it starts with (and returns to on reset)
    growth_load_factor: float = 1.0  # the load past which it doubles

    @property
    def may_grow(self) -> bool:
        """Whether the table grows at all (its index then maps slots to rows: growth keeps rows)."""
        return self.max_capacity > self.initial_capacity

    @property
    def grows(self) -> bool:
        """Whether the table may still grow."""
        return self.capacity < self.max_capacity

    def fit_capacity(self, live: int, start: int | None = None) -> int:
        """The capacity, doubling from ``start`` (default: the current one) up to max_capacity, at
        which ``live`` rows are within the growth load factor."""
        capacity = self.capacity if start is None else start
        while capacity < self.max_capacity and live > self.growth_load_factor * capacity:
            capacity = min(2 * capacity, self.max_capacity)
        return capacity

    @property
    def rows(self) -> int:
        """Rows of storage: the index's capacity rows, then the fallback rows."""
        return self.capacity + self.fallback_rows


@dataclass
class _LoadedTable:
    """One table's checkpoint state, checked and placed: what replaces the table's own."""

    index: HashTable
    rows: Tensor  # the row of each kept entry
    vectors: Tensor  # their vectors, in the table's dtype on the storage's device
    states: dict[str, Tensor | None]  # optimizer state per name (None: not saved, initial values)
    last_seen: Tensor | None
    admission: Admission | None
    train_step: int
    optimizer_step: int
    warning: str | None  # said once the load is applied (entries that did not fit)
    dtype_warning: str | None = None  # said once the load is applied (vectors converted to the table's dtype)
    fallback: Tensor | None = None  # the fallback rows (None: not saved, initial values: zeros)
    fallback_states: dict[str, Tensor | None] | None = None  # their optimizer state (None: initial values)
    layout_warning: str | None = None  # said once the load is applied (rows of another layout re-placed)
    capacity: int = 0  # the table's capacity once loaded (a growing table fits its ids)


# A table state's ``counters``: what they are, and the exclusive upper bound of each. ``layout``
# is the LAYOUT_VERSION its rows follow; states saved before it had the first four only (layout 1).
COUNTERS = (
    ("clock", CLOCK_LIMIT),
    ("epoch", EPOCH_LIMIT),
    ("training step", CLOCK_LIMIT),
    ("optimizer step", CLOCK_LIMIT),
    ("layout", LAYOUT_LIMIT),
)


def _allocate(numel: int, value: float, device: torch.device) -> Tensor:
    """A float32 buffer filled with ``value``; on CPU backed by transparent huge pages where the
    kernel offers them, since rows are touched at random and 4 KiB pages make each a TLB miss."""
    buf = torch.empty(numel, dtype=torch.float32, device=device)
    if device.type == "cpu" and numel * 4 >= _HUGE_PAGE:
        _advise_huge_pages(buf)
    if device.type != "meta":
        buf.fill_(value)
    return buf


_HUGE_PAGE = 2 << 20


def _advise_huge_pages(buf: Tensor) -> None:
    start = -(-buf.data_ptr() // _HUGE_PAGE) * _HUGE_PAGE
    end = (buf.data_ptr() + buf.numel() * buf.element_size()) // _HUGE_PAGE * _HUGE_PAGE
    if end > start and _libc is not None:
        _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_HUGEPAGE)  # best effort


_MADV_HUGEPAGE = 14
try:
    _libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
except OSError:  # pragma: no cover
    _libc = None


class _RowMoves(NamedTuple):
    """The rows one table carries through a relayout: its live rows (``live_src`` old rows to
    ``live_dst`` new rows, sorted by destination), and those plus its fallback rows (``src``, ``dst``).
    ``block`` > 0: the rows [0, block) keep their numbers (a growth: the index maps its slots to
    rows, so the rows stay), and are carried as one block; the fallback rows one by one."""

    live_src: Tensor
    live_dst: Tensor
    src: Tensor
    dst: Tensor
    block: int = 0

    def scattered(self, whole: bool = False) -> tuple[Tensor, Tensor]:
        """(src, dst) of the rows carried one by one (``whole``: the block's live rows too)."""
        if whole or not self.block:
            return self.src, self.dst
        live = self.live_src.numel()
        return self.src[live:], self.dst[live:]


def _carried_bytes(view: Tensor, move: _RowMoves | None, whole: bool = False) -> int:
    """Bytes of the rows of ``view`` (a table's old rows in one buffer) a relayout carries through
    scratch (``whole``: a block's too), rounded up to 8 (scratch blocks stay aligned for any dtype)."""
    rows = (view.shape[0] if whole else 0) if move is None else move.scattered(whole)[0].numel()
    return -(-rows * (view[:1].numel() or 1) * view.element_size() // 8) * 8 if rows else 0


def _move_block(buf: Tensor, old: Tensor, new: Tensor) -> None:
    """Copies ``old`` to ``new`` (views of the same numel and dtype into ``buf``, which may
    overlap) with no scratch: in chunks no longer than the distance, from the far end."""
    u8, base = buf.view(torch.uint8), buf.data_ptr()
    n = old.numel() * old.element_size()
    s, d = old.data_ptr() - base, new.data_ptr() - base
    step = abs(d - s)
    if n == 0 or step == 0:
        return
    if step < min(n, 1 << 20):  # a short shift: many small chunks would cost more than a copy
        u8[d : d + n].copy_(u8[s : s + n].clone())
        return
    starts = range(0, n, step)
    for a in reversed(starts) if d > s else starts:
        e = min(a + step, n)
        u8[d + a : d + e].copy_(u8[s + a : s + e])


def _rewrite_in_place(
    buf: Tensor,
    old_views: list[Tensor],
    new_views: list[Tensor],
    old_spans: list[int],
    new_spans: list[int],
    value: float,
    moves: list[_RowMoves | None],
    scratch: Tensor,
) -> None:
    """One buffer's relayout within its own memory: ``old_views[t]`` (the old layout's rows of
    table t) and ``new_views[t]`` view the same memory, table t's span of it running from
    ``old_spans[t]`` to ``old_spans[t + 1]`` before and ``new_spans`` after. Each table's carried
    rows go to ``scratch``, its new span is filled with ``value`` and the rows are written to
    their new places. When every span moves up (a growth) tables are done last to first, when
    every one moves down first to last, so no span is written before the rows it held are
    saved, and one table's rows fit in ``scratch``, the rows that keep their numbers (a whole
    table kept, a grown table's block) moving as one block, no scratch; otherwise all are saved
    first. A table that keeps its rows and its place is not touched."""
    tables = range(len(moves))
    if all(n >= o for n, o in zip(new_spans, old_spans)):
        order, save_all = list(reversed(tables)), False
    elif all(n <= o for n, o in zip(new_spans, old_spans)):
        order, save_all = list(tables), False
    else:
        order, save_all = list(tables), True
    order = [t for t in order if not (moves[t] is None and new_spans[t] == old_spans[t])]
    saved, offset = {}, 0
    for t in order if save_all else []:
        saved[t], offset = _save_rows(old_views[t], moves[t], scratch, offset, whole=True)
    for t in order:
        move = moves[t]
        if save_all:
            rows = saved[t]
        else:  # the rows carried one by one first: the block's move may cover them
            rows = _save_rows(old_views[t], move, scratch, 0)[0]
            block = old_views[t].shape[0] if move is None else move.block
            _move_block(buf, old_views[t][:block], new_views[t][:block])
            new_views[t][block:].fill_(value)
            if move is None:
                continue
        if save_all:
            buf[new_spans[t] : new_spans[t + 1]].fill_(value)
            if move is None:
                new_views[t].copy_(rows)
                continue
        if rows.shape[0]:
            new_views[t].index_copy_(0, move.scattered(save_all)[1], rows)


def _save_rows(
    view: Tensor, move: _RowMoves | None, scratch: Tensor, offset: int, whole: bool = False
) -> tuple[Tensor, int]:
    """The rows of ``view`` that ``move`` carries one by one (``whole``: a block's too, all of
    them for None), copied to ``scratch`` from byte ``offset``; returns them and the offset after them."""
    size = _carried_bytes(view, move, whole)
    rows = (view.shape[0] if whole else 0) if move is None else move.scattered(whole)[0].numel()
    out = (
        scratch[offset : offset + size]
        .view(view.dtype)[: rows * (view[:1].numel() or 1)]
        .view((rows,) + view.shape[1:])
    )
    if move is None:
        if rows:
            out.copy_(view)
    elif rows:
        torch.index_select(view, 0, move.scattered(whole)[0], out=out)
    return out, offset + size


class DynamicTables:
    """All dynamic tables of one module: vectors, optimizer state and the id -> row indexes."""

    def __init__(self, configs: Sequence[BaseEmbeddingConfig], device: torch.device):
        self.meta: list[_TableMeta] = []
        for cfg in configs:
            opts = options_of(cfg)
            kind, params = initializer_of(cfg)
            dtype, seed = storage_dtype_of(cfg), table_seed(opts.seed, cfg.name)
            self.meta.append(
                _TableMeta(
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
        sizes = self._compute_layout()
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
        self.weights = self._allocate_buffer("weights", sum(sizes), 0.0, device)
        self._init_views: list | None = None
        self.optimizer: OptimizerSpec | None = None
        self.states: list[Tensor] = []
        self.optimizer_step = torch.zeros((), dtype=torch.int64, device=cpu)
        self.train_step = 0  # training batches seen: the clock of ttl_steps
        self._device_layout: dict[torch.device, tuple[Tensor, Tensor, Tensor]] = {}
        self.indexes: list[HashTable | None] = []
        self._new_rows: NewRows | None = None
        self.defer_new_rows = True  # False: lookups write new rows themselves (as on GPUs)
        # Holds NewRows.vectors; reused by every lookup (its previous contents are written by
        # then), since a fresh allocation per batch page-faults megabytes each time. Table t's
        # block starts at its first unique id times the widest dim, so blocks never overlap.
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

    def _compute_layout(self) -> list[int]:
        """Where each table's rows and optimizer state start in the flat buffers, from the tables'
        current capacities; returns each table's words of vectors."""
        # Fallback rows are rows of their table's storage after its capacity rows: the kernels
        # read, pool and step them as any row; only the index never hands them out.
        sizes = [table_words(m.rows, m.dim, m.dtype) for m in self.meta]
        # Layout descriptors and counters live on the CPU (named explicitly, so that a module
        # built under ``with torch.device("meta")`` keeps them); layouts are copied to the
        # storage's device as needed.
        cpu = torch.device("cpu")
        self.table_offsets = (
            torch.tensor([0] + sizes[:-1], dtype=torch.int64, device=cpu).cumsum(0)
            if sizes
            else torch.zeros(0, dtype=torch.int64, device=cpu)
        )
        self.state_row_offsets = torch.tensor(
            [0] + [m.rows for m in self.meta][:-1], dtype=torch.int64, device=cpu
        ).cumsum(0)
        self.dense_state_offsets = dense_state_offsets([m.rows for m in self.meta], [m.dim for m in self.meta])
        # Per table: capacity, fallback rows and fallback seed (None: no table has fallback rows).
        self.fallback_layout = (
            torch.tensor(
                [[m.capacity, m.fallback_rows, m.fallback_seed] for m in self.meta], dtype=torch.int64, device=cpu
            )
            if any(m.fallback_rows for m in self.meta)
            else None
        )
        self._device_layout = {}
        return sizes

    def __getstate__(self) -> dict[str, object]:
        """For deepcopy / pickle / torch.save: pending new rows are written first, so the copy
        holds every row its indexes name; caches and the scratch buffer are not carried."""
        self.write_new_rows()
        state = dict(self.__dict__)
        state["_reserved"] = {}  # the copy's buffers are plain ones (its next growth reserves again)
        state["_init_views"] = None
        state["_new_vector_buffer"] = torch.empty(0, dtype=torch.float32)
        state["_pending"] = {}  # a copy has no lookup in flight
        state["_parameter_owners"] = None  # the copy's table modules register themselves
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self._parameter_owners = weakref.WeakSet()

    def register_parameter_owner(self, owner: object) -> None:
        """``owner.weight`` (a table module's parameter, table ``owner._index``) views this storage:
        re-pointed at the new storage when a growth replaces it."""
        self._parameter_owners.add(owner)

    def _rebind_parameters(self) -> None:
        for owner in list(self._parameter_owners):
            if getattr(owner, "_tables", None) is self:
                owner.weight.data = self.table_view(owner._index)

    # ------------------------------------------------------------------ storage

    @property
    def device(self) -> torch.device:
        return self.weights.device

    def table_view(self, t: int) -> Tensor:
        """Table t's [capacity, dim] rows, in its storage dtype (a view of the word buffer)."""
        return self._storage_view(t)[: self.meta[t].capacity]

    def fallback_view(self, t: int) -> Tensor:
        """Table t's [fallback_rows, dim] fallback rows (after its capacity rows)."""
        return self._storage_view(t)[self.meta[t].capacity :]

    def _storage_view(self, t: int) -> Tensor:
        m = self.meta[t]
        start = int(self.table_offsets[t])
        words = self.weights[start : start + table_words(m.rows, m.dim, m.dtype)]
        return words.view(m.dtype)[: m.rows * m.dim].view(m.rows, m.dim)

    def state_views(self, t: int, fallback: bool = False) -> dict[str, Tensor]:
        """This table's optimizer state: [capacity, dim] per element-wise state, [capacity] row-wise
        (fallback: the fallback rows' state, [fallback_rows, dim] / [fallback_rows])."""
        if self.optimizer is None:
            return {}
        m = self.meta[t]
        first, count = (m.capacity, m.fallback_rows) if fallback else (0, m.capacity)
        views = {}
        for name, buf in zip(OPTIMIZER_STATES[self.optimizer.kind], self.states):
            if self.optimizer.kind in ROWWISE_STATE:
                start = int(self.state_row_offsets[t]) + first
                views[name] = buf[start : start + count]
            else:
                start = self.dense_state_offsets[t] + first * m.dim
                views[name] = buf[start : start + count * m.dim].view(count, m.dim)
        return views

    def layout(self) -> tuple[Tensor, Tensor, Tensor]:
        """(table_offsets, table_dims, state_row_offsets) on the storage's device."""
        return self._on_device()[:3]

    def dtype_layout(self) -> tuple[Tensor | None, Tensor | None]:
        """(table_dtypes, rounding_seeds) on the storage's device, each None when not needed."""
        return self._on_device()[3:5]

    def _on_device(self) -> tuple[Tensor | None, ...]:
        dev = self.device
        if dev not in self._device_layout:
            # Mirrored: the kernels read their host values (the widest dim) without a sync.
            self._device_layout[dev] = tuple(
                None if t is None else device_sync.mirror(t.to(dev), t)
                for t in (
                    self.table_offsets,
                    self.table_dims,
                    self.state_row_offsets,
                    self.table_dtypes,
                    self.rounding_seeds,
                    self.fallback_layout,
                )
            )
        return self._device_layout[dev]

    def set_optimizer(self, spec: OptimizerSpec) -> None:
        """Allocates (or keeps, when the kind is unchanged) the optimizer state for ``spec``."""
        self.write_new_rows()
        if self.optimizer is not None and self.optimizer.kind == spec.kind:
            self.optimizer = spec
            self._init_views = None  # the fill values may have changed
            return
        size = sum(m.rows * (1 if spec.kind in ROWWISE_STATE else m.dim) for m in self.meta)
        self.optimizer = spec
        self.states = [
            self._allocate_buffer(name, size, value, self.device)
            for name, value in zip(OPTIMIZER_STATES[spec.kind], self._initial_state_values())
        ]
        self._init_views = None

    def _allocate_buffer(
        self, name: str, numel: int, value: float, device: torch.device, untouched: bool = False
    ) -> Tensor:
        """The flat buffer ``name`` ("weights" or an optimizer state) of ``numel`` elements, filled
        with ``value`` (a hook: tiered tables keep these in a cache over a backing store).

        On CPU, a module whose tables may grow keeps each buffer at the start of address space
        reserved for all tables at num_embeddings (``ReservedBuffer``: memory is taken only by the
        pages written). ``untouched`` (a relayout): the buffer may then be the current one of that
        name, resized in place with its contents as they were (the caller moves rows and fills
        the rest); otherwise it is filled."""
        if device.type != "cpu" or not any(m.max_capacity > m.initial_capacity for m in self.meta):
            return _allocate(numel, value, device)
        reserved = self._reserved.get(name)
        if reserved is None or reserved.numel_max < numel:
            try:
                reserved = ReservedBuffer(max(numel, self._max_numel(name)))
            except (OSError, OverflowError):  # no address space to reserve (strict overcommit, ulimit -v)
                self._reserved.pop(name, None)
                return _allocate(numel, value, device)
            self._reserved[name] = reserved
            untouched = False
        buf = reserved.view(numel)
        if not untouched:
            buf.fill_(value)
        return buf

    def _max_numel(self, name: str) -> int:
        """Elements of buffer ``name`` once every table is at num_embeddings."""
        if name == "weights":
            return sum(table_words(m.max_capacity + m.fallback_rows, m.dim, m.dtype) for m in self.meta)
        rowwise = self.optimizer is not None and self.optimizer.kind in ROWWISE_STATE
        return sum((m.max_capacity + m.fallback_rows) * (1 if rowwise else m.dim) for m in self.meta)

    def apply(self, fn) -> None:
        """Applies a tensor function (``Module._apply``'s) to the storage and moves the indexes."""
        self.write_new_rows()
        old_device = self.device
        self.weights = fn(self.weights)
        self.states = [fn(s) for s in self.states]
        if not self._reserved.get("weights", None) or not self._reserved["weights"].holds(self.weights):
            self._reserved = {}  # moved or converted: the buffers are plain ones now
        self._init_views = None
        if self.device != old_device:
            self._build_indexes(carry_from=old_device)

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

    def _build_indexes(self, carry_from: torch.device | None = None) -> None:
        device = self.device
        if device.type == "meta":
            self.indexes = [None] * len(self.meta)
            self.last_seen = [None] * len(self.meta)
            self.admission = [None] * len(self.meta)
            self.counters = None
            return
        old = self.indexes if carry_from is not None and carry_from.type != "meta" else None
        self.indexes, self.last_seen, self.admission = [], [], []
        for t, m in enumerate(self.meta):
            index = HashTable(m.capacity, policy=m.policy, device=device, mapped_rows=m.may_grow)
            if old is not None and old[t] is not None:
                state = old[t].state_dict()
                index.load_state_dict({k: (v.to(device) if isinstance(v, Tensor) else v) for k, v in state.items()})
            self.indexes.append(index)
            self.last_seen.append(torch.zeros(m.capacity, dtype=torch.int64, device=device) if m.ttl_steps else None)
            self.admission.append(make_admission(m.options, m.admission, m.max_capacity, m.seed, device))
        # Ages of evicted rows, in steps since last read: known where last_seen is kept (ttl_steps),
        # and then bounded by about twice the ttl (older rows are swept), the last bin holding the rest.
        self.counters = TableCounters(
            len(self.meta),
            [None if m.ttl_steps is None else min(2 * m.ttl_steps + 2, MAX_AGE_BINS) for m in self.meta],
            device,
        )

    def check_ready(self, where: str) -> None:
        if self.device.type == "meta":
            raise RuntimeError(
                f"{where}: the module is on the meta device; materialise it first "
                "(module.to_empty(device=...) then module.reset_parameters())"
            )

    # ------------------------------------------------------------------ ids -> rows

    def lookup(self, ids: Tensor, segment_offsets: Tensor, training: bool, backward_follows: bool = False) -> RowLookup:
        """Rows of ``ids``, table t's ids being ``ids[segment_offsets[t]:segment_offsets[t+1]]``.

        backward_follows: the caller will run the fused update on this lookup, which may then
        write the new rows (CPU; see ``NewRows``) instead of the lookup writing them now.
        """
        self.write_new_rows()
        unique, inverse, counts, unique_offsets = ops.dedup_segments(ids, segment_offsets)
        exporting = torch.compiler.is_compiling()  # bounds are symbolic: tell what the op guarantees
        bounds = device_sync.host_list(unique_offsets, "lookup: where each table's unique ids start")
        if training and self._growing and not exporting:
            # Room for every distinct id of the batch (a bound on its new ones) before any is
            # inserted; tables with admission grow in _rows_for, for the ids admitted.
            self._grow_or_defer(
                {
                    t: end - start
                    for t, (start, end) in enumerate(zip(bounds[:-1], bounds[1:]))
                    if self.admission[t] is None
                }
            )
        if training:
            self.train_step += 1
        new = None
        if training and backward_follows and self.defer_new_rows and self.device.type == "cpu":
            new = NewRows(
                vectors=[self.weights.new_empty(0, m.dim, dtype=m.dtype) for m in self.meta],
                rows=[unique.new_empty(0) for _ in self.meta],
                unique_new=torch.full_like(unique, -1),
            )
            most = unique.numel() * self._widest
            if self._new_vector_buffer.numel() < most:
                self._new_vector_buffer = _allocate(max(most, 2 * self._new_vector_buffer.numel()), 0.0, self.device)
        # Each table writes its rows into its slice of one buffer (no concatenation after).
        unique_rows = torch.empty_like(unique)
        inserted = torch.zeros_like(unique, dtype=torch.bool) if training else None  # for the table counters
        flat = training and new is None and not exporting and self._flat_init()  # all tables' rows in one call
        table_of = torch.arange(len(self.meta), device=ids.device)
        unique_table = torch.repeat_interleave(
            table_of, unique_offsets[1:] - unique_offsets[:-1], output_size=unique.numel()
        )
        batched = training and not exporting and self._batched_upsert()  # all tables' upserts in one call
        if batched:
            unique_rows, inserted = self._rows_for_tables(unique, counts, bounds, unique_table)
        for t, (start, end) in enumerate(zip(bounds[:-1], bounds[1:]) if not batched else ()):
            if exporting:
                torch._check(start >= 0)
                torch._check(start <= end)
                torch._check(end <= unique.numel())
            # An empty slice costs nothing to trace. In training every table is touched, ids or
            # not, so its clock counts training batches: a row-wise shard's clock then equals the
            # unsharded table's, and the sharded state's counters are one [4] for all ranks.
            if exporting or training or end > start:
                keys = unique[start:end]
                rows, fresh = self._rows_for(t, keys, counts[start:end], training)
                unique_rows[start:end] = rows
                if fresh is not None:
                    inserted[start:end] = fresh
                    if not flat:
                        self._initialise(t, rows, fresh, keys, new, start)
        for t, (start, end) in enumerate(zip(bounds[:-1], bounds[1:]) if batched and not flat else ()):
            if end > start:
                self._initialise(t, unique_rows[start:end], inserted[start:end], unique[start:end], new, start)
        if flat:
            self._initialise_tables(unique_rows, inserted, unique, unique_table)
        if training and not exporting:
            self.counters.count_batch(unique_rows, inserted, unique_table, counts)
        unique_ids = unique
        if self.fallback_layout is not None:
            unique_rows, unique_table, inverse, unique_ids = self._read_fallback(
                unique, unique_rows, unique_table, inverse, new
            )
        unique_ids = unique_ids if self.rounding_seeds is not None else None
        if new is None:
            result = RowLookup(unique_rows[inverse], unique_rows, unique_table, inverse, unique_ids=unique_ids)
        else:
            self._new_rows = new
            read_from = torch.where(new.unique_new >= 0, pending_row(new.unique_new), unique_rows)
            result = RowLookup(read_from[inverse], unique_rows, unique_table, inverse, new, unique_ids)
        if backward_follows and not exporting:
            # Pending until its fused update lands, or its autograd graph (which holds it) is dropped.
            self._pending[id(result.unique_rows)] = weakref.finalize(
                result.unique_rows, self._backward_done, id(result.unique_rows)
            )
        return result

    @property
    def pending_backward(self) -> int:
        """How many lookups await their fused update."""
        return len(self._pending)

    def _backward_done(self, key: int) -> None:
        self._pending.pop(key, None)

    # ------------------------------------------------------------------ growth

    def _grow_or_defer(self, incoming: dict[int, int]) -> None:
        """``grow(incoming)`` now, or, while a lookup awaits its fused update, once the last
        pending update has run (that update grows the tables then)."""
        if self.pending_backward == 0:
            self.grow(incoming)
        else:
            self._growth_deferred = True

    def grow(self, incoming: dict[int, int] | None = None) -> list[int]:
        """Doubles (repeatedly, up to max_capacity) each growing table whose load with
        ``incoming[t]`` more rows would pass its growth_load_factor (``incoming`` None: every table,
        none incoming; else the tables it names); returns the tables grown. Only while no lookup
        awaits its fused update (else a no-op: rows must not move under it); the lookup and the
        update that ends the last pending one call it. All tables growing
        at once share one relayout (``_relayout``): their rows move to their keys' new places,
        with their vectors, optimizer state, last-seen steps and delta versions; ids, scores,
        admission and counters are untouched. Raises ``GrowthError`` (nothing changed) when the
        new storage cannot be allocated."""
        if not self._growing or self.pending_backward or self.device.type == "meta":
            return []
        tables = [t for t, m in enumerate(self.meta) if m.grows and (incoming is None or t in incoming)]
        # Every table's live rows in one host read (not one per table).
        live = (
            device_sync.host_list(torch.cat([self.indexes[t].size_tensor() for t in tables]), "growth: live rows")
            if tables
            else []
        )
        targets = {}
        for t, size in zip(tables, live):
            want = self.meta[t].fit_capacity(size + (incoming or {}).get(t, 0))
            if want != self.meta[t].capacity:
                targets[t] = want
        if not targets:
            return []
        self.write_new_rows()
        grown = {t: self.indexes[t].grown(c) for t, c in targets.items()}  # new indexes; nothing changed yet
        self._relayout({t: (c, grown[t][1]) for t, c in targets.items()}, {t: g[0] for t, g in grown.items()})
        return sorted(targets)

    def _relayout(self, plans: dict[int, tuple[int, Tensor | None]], indexes: dict[int, HashTable]) -> None:
        """Gives tables new capacities: ``plans[t] = (capacity, row_map)``, ``row_map[old_row]``
        the new row of each old row (-1: dropped; None: no row carried, the caller replaces the
        table). New buffers are allocated first (``GrowthError`` if they cannot be: nothing
        changed), then every table's vectors and optimizer state are copied over (other tables
        whole, fallback rows whole), then ``indexes`` replace the tables' indexes. On the storage's
        device throughout. A buffer in reserved address space is rewritten in place
        (``_rewrite_in_place``): only the pages past its old size are new."""
        self.write_new_rows()
        device, old_row_starts = self.device, self.state_row_offsets
        old_views = [(self._storage_view(t), self._all_state_views(t)) for t in range(len(self.meta))]
        old_buffers = [self.weights] + list(self.states)
        old_spans = self._buffer_spans()
        old_caps = [m.capacity for m in self.meta]
        new_caps = [plans[t][0] if t in plans else m.capacity for t, m in enumerate(self.meta)]
        words = sum(table_words(c + m.fallback_rows, m.dim, m.dtype) for c, m in zip(new_caps, self.meta))
        rowwise = self.optimizer is not None and self.optimizer.kind in ROWWISE_STATE
        state_size = sum((c + m.fallback_rows) * (1 if rowwise else m.dim) for c, m in zip(new_caps, self.meta))
        moves = [self._row_moves(t, old_caps[t], plans.get(t)) for t in range(len(self.meta))]
        try:
            weights = self._allocate_buffer("weights", words, 0.0, device, untouched=True)
            states = [
                self._allocate_buffer(name, state_size, value, device, untouched=True)
                for name, value in zip(
                    OPTIMIZER_STATES[self.optimizer.kind] if self.optimizer is not None else (),
                    self._initial_state_values(),
                )
            ]
            last_seen = {
                t: torch.zeros(plans[t][0], dtype=torch.int64, device=device)
                for t in plans
                if self.last_seen[t] is not None
            }
            in_place = [
                new.numel() > 0 and new.data_ptr() == old.data_ptr()
                for new, old in zip([weights] + states, old_buffers)
            ]
            monotone = all(n >= o for n, o in zip(new_caps, old_caps)) or all(
                n <= o for n, o in zip(new_caps, old_caps)
            )
            scratch = (
                torch.empty(self._scratch_bytes(moves, old_views, in_place, monotone), dtype=torch.uint8, device=device)
                if any(in_place)
                else None
            )
        except (RuntimeError, MemoryError, OSError) as e:
            names = [self.meta[t].name for t in plans]
            need = words * 4 + len(self.states) * state_size * 4
            raise GrowthError(
                f"tables {names}: growing to capacities {[plans[t][0] for t in plans]} needs new "
                f"storage of {need} bytes (all tables' buffers are reallocated), which could not be "
                f"allocated ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); the tables "
                f"are unchanged, at capacities {[old_caps[t] for t in plans]}"
            ) from e
        # The new layout: from here on nothing can fail.
        for t, c in enumerate(new_caps):
            self.meta[t].capacity = c
        self._compute_layout()
        self.weights, self.states = weights, states
        self._init_views = None
        new_views = [(self._storage_view(t), self._all_state_views(t)) for t in range(len(self.meta))]
        new_spans = self._buffer_spans()
        values = [0.0] + self._initial_state_values()
        for k, (buf, value) in enumerate(zip([weights] + states, values)):
            old_k = [v[0] if k == 0 else v[1][k - 1] for v in old_views]
            new_k = [v[0] if k == 0 else v[1][k - 1] for v in new_views]
            if in_place[k]:
                _rewrite_in_place(buf, old_k, new_k, old_spans[k], new_spans[k], value, moves, scratch)
                if buf.numel() < old_spans[k][-1]:  # a shrink: the pages past the new end go back
                    name = "weights" if k == 0 else OPTIMIZER_STATES[self.optimizer.kind][k - 1]
                    self._reserved[name].release_beyond(buf.numel())
                continue
            # A fresh buffer, filled (scattering rows into fresh pages instead faults them in at
            # random, ~2.5x slower than the fill plus the copy, measured on CPU at 1M rows of dim 64).
            for t, move in enumerate(moves):
                if move is None:
                    new_k[t].copy_(old_k[t])
                    continue
                new_k[t][: move.block].copy_(old_k[t][: move.block])
                src, dst = move.scattered()
                if src.numel():
                    new_k[t].index_copy_(0, dst, old_k[t].index_select(0, src))
        flat_map = (
            None
            if self.delta_log is None
            else torch.full(
                (sum(old_caps[t] + m.fallback_rows for t, m in enumerate(self.meta)),),
                -1,
                dtype=torch.int64,
                device=device,
            )
        )
        for t, m in enumerate(self.meta):
            move, old_start, new_start = moves[t], int(old_row_starts[t]), int(self.state_row_offsets[t])
            if flat_map is not None:
                if move is None:
                    flat_map[old_start : old_start + m.rows] = torch.arange(
                        new_start, new_start + m.rows, device=device
                    )
                else:
                    flat_map[old_start + move.src] = new_start + move.dst
            if t in last_seen:
                last_seen[t].index_copy_(0, move.live_dst, self.last_seen[t].index_select(0, move.live_src))
        for t, seen in last_seen.items():
            self.last_seen[t] = seen
        for t, index in indexes.items():
            self.indexes[t] = index
        if self.delta_log is not None:
            self.delta_log.relayout(self, flat_map)
        self._growing = any(m.grows for m in self.meta)
        self._rebind_parameters()

    def _row_moves(self, t: int, old_cap: int, plan: tuple[int, Tensor | None] | None) -> _RowMoves | None:
        """The rows table t carries through a relayout (None: all of them, the same rows)."""
        if plan is None:
            return None
        m, device, cap_new = self.meta[t], self.device, plan[0]
        live_src = live_dst = torch.zeros(0, dtype=torch.int64, device=device)
        if plan[1] is not None:
            live_src = (plan[1] >= 0).nonzero().squeeze(1)
            live_dst, order = (
                plan[1].index_select(0, live_src).sort()
            )  # writes in address order: fewer cache and TLB misses
            live_src = live_src.index_select(0, order)
        fallback = torch.arange(m.fallback_rows, dtype=torch.int64, device=device)  # fallback rows: whole
        # A growth keeps every live row's number (HashTable.grown): the rows move as one block.
        kept = plan[1] is not None and cap_new >= old_cap and bool(live_src.equal(live_dst))
        return _RowMoves(
            live_src,
            live_dst,
            torch.cat([live_src, old_cap + fallback]),
            torch.cat([live_dst, cap_new + fallback]),
            old_cap if kept else 0,
        )

    def _buffer_spans(self) -> list[list[int]]:
        """Per buffer (weights, then each optimizer state): where each table's span starts, and
        the buffer's end."""
        rowwise = self.optimizer is not None and self.optimizer.kind in ROWWISE_STATE
        state_starts = [int(x) for x in self.state_row_offsets] if rowwise else list(self.dense_state_offsets)
        state_end = sum(m.rows * (1 if rowwise else m.dim) for m in self.meta)
        weights = [int(x) for x in self.table_offsets] + [sum(table_words(m.rows, m.dim, m.dtype) for m in self.meta)]
        return [weights] + [state_starts + [state_end] for _ in self.states]

    @staticmethod
    def _scratch_bytes(moves, old_views, in_place: list[bool], monotone: bool) -> int:
        """Bytes ``_rewrite_in_place`` needs for the buffers rewritten in place: the largest table's
        rows carried one by one when every table grows (or every one shrinks), else all tables'
        carried rows."""
        most = 8
        for k, rewritten in enumerate(in_place):
            if rewritten:
                sizes = [
                    _carried_bytes(v[0] if k == 0 else v[1][k - 1], move, whole=not monotone)
                    for v, move in zip(old_views, moves)
                ]
                most = max(most, max(sizes, default=0) if monotone else sum(sizes))
        return most

    def _all_state_views(self, t: int) -> list[Tensor]:
        """Table t's optimizer state, every row (capacity rows, then fallback rows)."""
        m = self.meta[t]
        rowwise = self.optimizer is not None and self.optimizer.kind in ROWWISE_STATE
        if rowwise:
            start = int(self.state_row_offsets[t])
            return [buf[start : start + m.rows] for buf in self.states]
        start = self.dense_state_offsets[t]
        return [buf[start : start + m.rows * m.dim].view(m.rows, m.dim) for buf in self.states]

    def _read_fallback(
        self, unique: Tensor, unique_rows: Tensor, unique_table: Tensor, inverse: Tensor, new: NewRows | None
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Unique ids without a row (-1) of tables with fallback rows read their fallback row
        instead. The uniques reading one fallback row are merged into the first of them, since
        the fused update steps each unique row once: (unique_rows, unique_table, inverse,
        unique_ids) after the merge, the id of a fallback row being its slot (stochastic
        rounding draws its bits per row, whichever ids read it). ``new.unique_new`` follows."""
        layout = self._on_device()[5]
        # Fixed-size throughout (no compaction of the uniques that read a fallback row, no
        # unique count read on the host): a merged unique stays, with row -1 (no read, no step),
        # and its ids point at its representative.
        capacity, count, seed = layout.index_select(0, unique_table).unbind(1)
        reads = (unique_rows < 0) & (count > 0)
        slot = fallback_slots(unique, seed, count.clamp(min=1))
        rows = torch.where(reads, capacity + slot, unique_rows)
        ids = torch.where(reads, slot, unique)
        # Each unique reading a fallback row is represented by the first one reading that row:
        # a stable sort by (table, fallback row), the others keeping codes of their own.
        n = unique.numel()
        position = torch.arange(n, device=unique.device)
        code = torch.where(reads, unique_table * self._fallback_max + slot, -1 - position)
        order = torch.argsort(code, stable=True)
        sorted_code = code.index_select(0, order)
        head = torch.ones(n, dtype=torch.bool, device=unique.device)
        head[1:] = sorted_code[1:] != sorted_code[:-1]
        head_at = torch.where(head, position, 0).cummax(0).values  # each sorted entry's group head
        first = torch.empty_like(order).index_copy_(0, order, order.index_select(0, head_at))
        rows = torch.where(first == position, rows, -1)
        return rows, unique_table, first.index_select(0, inverse), ids

    def write_new_rows(self) -> None:
        """Writes the pending new rows of the last training lookup (initial vectors, initial
        optimizer state), when its fused update has not."""
        new, self._new_rows = self._new_rows, None
        if new is None or new.written:
            return
        for t, (rows, vectors) in enumerate(zip(new.rows, new.vectors)):
            if rows.numel():
                table, states, fills = self._init_view(t)
                table[rows] = vectors
                for state, fill in zip(states, fills):
                    state[rows] = fill
        new.written = True

    def _rows_for(self, t: int, keys: Tensor, counts: Tensor, training: bool) -> tuple[Tensor, Tensor | None]:
        """Rows of table t's distinct ``keys``, and in training which of them are new (rows to initialise)."""
        m, index = self.meta[t], self.indexes[t]
        if not training:
            rows, found = index.find(keys)
            return self._mask_expired(t, rows, found), None
        candidates = self._admit(t, keys, counts)
        scores = counts if m.policy in _SCORED_BY_COUNT else None
        # One entry per key out (no eviction count read on the host); dedup counts are >= 1.
        result = self.indexes[t].find_or_insert_fixed(keys, scores, candidates)
        return self._after_upsert(t, keys, result)

    def _admit(self, t: int, keys: Tensor, counts: Tensor) -> Tensor | None:
        """Which of table t's distinct ``keys`` take part in this step's upsert (None: all): the
        ones it holds and those its admission admits now (growing the table for them)."""
        m, index, admission = self.meta[t], self.indexes[t], self.admission[t]
        if admission is None:
            return None
        _, found = index.find(keys)
        unseen = ~found
        admitted = admission.admit(keys, counts, unseen, self.train_step)
        self.counters.count_rejected(t, unseen & ~admitted)
        if m.grows and not torch.compiler.is_compiling():
            # Room for the ids admitted now. Only this table's rows move: the rows other
            # tables gave this batch's ids so far stay theirs (a relayout copies them whole).
            if self.pending_backward == 0:
                self.grow({t: int(device_sync.to_host((unseen & admitted).sum(), "growth: admitted ids"))})
            else:
                self._growth_deferred = True
        return found | admitted  # the others take no part in the upsert (no compaction)

    def _needs_after_upsert(self, t: int) -> bool:
        """Whether table t's upsert results need per-table work (ttl, the delta log) beyond the
        eviction count, which ``_rows_for_tables`` makes for all tables at once."""
        return self.meta[t].ttl_steps is not None or self.delta_log is not None

    def _rows_for_tables(
        self, unique: Tensor, counts: Tensor, bounds: list[int], unique_table: Tensor
    ) -> tuple[Tensor, Tensor]:
        """``_rows_for`` of every table in training, their upserts in one call
        (``find_or_insert_tables``: launches independent of the table count on a GPU): the rows
        of all distinct ids and which are new (rows to initialise)."""
        pending = None
        for t, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
            if self.admission[t] is not None:
                candidates = self._admit(t, unique[start:end], counts[start:end])
                if pending is None:
                    pending = torch.ones_like(unique, dtype=torch.bool)
                pending[start:end] = candidates
        scored = any(m.policy in _SCORED_BY_COUNT for m in self.meta)  # the other policies ignore scores
        result = find_or_insert_tables(self.indexes, unique, bounds, counts if scored else None, pending)
        self.counters.count_evicted_tables(unique_table, result.evicted)
        rows, inserted = result.rows, result.inserted
        for t, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
            if self._needs_after_upsert(t):
                part = FixedInsertResult(*(x[start:end] for x in result))
                rows[start:end], inserted[start:end] = self._after_upsert(t, unique[start:end], part, counted=True)
        return rows, inserted

    def _after_upsert(
        self, t: int, keys: Tensor, result: FixedInsertResult, counted: bool = False
    ) -> tuple[Tensor, Tensor]:
        """Table t's rows and new rows after its upsert: counters (its evictions unless
        ``counted``), ttl expiry, the delta log."""
        m = self.meta[t]
        fresh = result.inserted
        live = result.rows >= 0
        if m.ttl_steps is None:
            if not counted:
                self.counters.count_evicted(t, result.evicted, None)
        else:
            seen = self.last_seen[t].index_select(0, result.rows.clamp(min=0))
            self.counters.count_evicted(t, result.evicted, self.train_step - seen, counted)
            expired = live & ~fresh & (seen < self.train_step - m.ttl_steps)
            self.counters.count_expired(t, expired)
            fresh = fresh | expired
        if self.delta_log is not None:  # the delta log lists rows: a host read of its own
            inserted_rows = result.rows.index_select(0, device_sync.nonzero(result.inserted, "delta log: inserted"))
            evicted_at = device_sync.nonzero(result.evicted, "delta log: evicted")
            if evicted_at.numel():
                self.delta_log.removed(
                    t,
                    result.evicted_keys.index_select(0, evicted_at),
                    result.rows.index_select(0, evicted_at),
                    keys.index_select(0, device_sync.nonzero(result.inserted, "delta log: inserted")),
                )
            self.delta_log.inserted(t, inserted_rows)
            self.delta_log.written(t, result.rows.index_select(0, device_sync.nonzero(fresh, "delta log: written")))
        if m.ttl_steps is not None:
            # Seen now: last_seen never passes the step, so a max with it (0 where no row) sets the
            # live rows without a mask index.
            self.last_seen[t].scatter_reduce_(
                0, result.rows.clamp(min=0), torch.where(live, self.train_step, 0), "amax"
            )
            if self.train_step % m.ttl_steps == 0:
                self._erase_expired(t)
        return result.rows, fresh

    def _mask_expired(self, t: int, rows: Tensor, found: Tensor, step: int | None = None) -> Tensor:
        """-1 for rows expired at ``step`` (default: the current training step)."""
        m = self.meta[t]
        if m.ttl_steps is None:
            return rows
        step = self.train_step if step is None else step
        expired = found & (self.last_seen[t][rows.clamp(min=0)] < step - m.ttl_steps)
        return torch.where(expired, torch.full_like(rows, -1), rows)

    def _erase_expired(self, t: int) -> None:
        """Frees the rows of ids unseen for more than ttl_steps (reads of them are already masked):
        a pass over the table's rows, nothing read on the host."""
        m, index = self.meta[t], self.indexes[t]
        stale = self.last_seen[t] < self.train_step - m.ttl_steps
        if self.delta_log is not None:  # the delta log lists the keys: a host read of its own
            rows = device_sync.nonzero(
                stale & (index.entries_at(torch.arange(m.capacity, device=stale.device))[2]), "delta log: swept"
            )
            self.delta_log.removed(t, index.entries_at(rows)[0], rows)
        self.counters.count_swept(t, index.erase_rows(stale))

    # Training-only and data-dependent throughout (which ids are new): run eagerly under torch.compile
    # (a graph break; Dynamo cannot size the half-precision block views it carves).
    @torch.compiler.disable
    def _initialise(self, t: int, rows: Tensor, fresh: Tensor, keys: Tensor, new: NewRows | None, start: int) -> None:
        """The rows of table t's new ids (``fresh``): their initial vectors and optimizer state,
        written now, or into ``new`` (whose unique ids start at ``start`` for this table)."""
        m = self.meta[t]
        if new is None:
            # Rows of -1 are skipped by init_rows: no mask-and-gather of the new ids needed.
            table, states, fills = self._init_view(t)
            ops.init_rows(table, torch.where(fresh, rows, -1), keys, m.seed, m.init_kind, m.init_params, states, fills)
            return
        which = fresh.nonzero().squeeze(1)
        slots = torch.arange(which.numel(), device=which.device)
        first = start * self._widest  # a half block takes half of its words: blocks still never overlap
        block = self._new_vector_buffer[first : first + table_words(which.numel(), m.dim, m.dtype)]
        new.vectors[t] = block.view(m.dtype)[: which.numel() * m.dim].view(which.numel(), m.dim)
        ops.init_rows(new.vectors[t], slots, keys[which], m.seed, m.init_kind, m.init_params)
        new.rows[t] = rows[which]
        new.unique_new[start + which] = slots

    def _flat_init(self) -> bool:
        """Whether a training lookup writes every table's new rows in one call (``flat_init``:
        None, the default, on GPUs, where per-table calls cost launches per table). Only where
        the rows live in the flat buffer itself (a subclass keeping them elsewhere overrides
        ``_init_view``)."""
        if type(self)._init_view is not DynamicTables._init_view:
            return False
        if any(len(m.init_params) > INITIALIZER_PARAM_COUNTS[INITIALIZER_NAMES[m.init_kind]] for m in self.meta):
            return False  # a column shard's vectors start at a column of its table's: per table
        chosen = getattr(self, "flat_init", None)
        return self.device.type == "cuda" if chosen is None else bool(chosen)

    def _batched_upsert(self) -> bool:
        """Whether a training lookup upserts every table in one call (``batched_upsert``: None, the
        default, yes: on GPUs per-table calls cost launches per table, and on CPU the one call took
        0.6-0.8x the step's CPU time of per-table calls at 26 tables). Not for a subclass that
        follows each table's upsert with work of its own (``_rows_for``: the tiered tables' cache)."""
        if type(self)._rows_for is not DynamicTables._rows_for or not self.indexes:
            return False  # (a module of no tables has nothing to upsert)
        chosen = getattr(self, "batched_upsert", None)
        return True if chosen is None else bool(chosen)

    @torch.compiler.disable
    def _initialise_tables(self, unique_rows: Tensor, inserted: Tensor, unique: Tensor, unique_table: Tensor) -> None:
        """The rows of the new ids (``inserted``) of every table, written now in one call
        (``ops.init_rows_tables``): the same vectors and optimizer state as ``_initialise``."""
        table_offsets, table_dims, state_row_offsets = self.layout()
        rowwise = self.optimizer is not None and self.optimizer.kind in ROWWISE_STATE
        key = ("init", self.device, rowwise)
        if key not in self._device_layout:  # per-table initializer descriptors, reset with the layout
            dense = torch.tensor(self.dense_state_offsets, dtype=torch.int64)
            self._device_layout[key] = (
                torch.tensor([as_int64(m.seed) for m in self.meta], dtype=torch.int64).to(self.device),
                torch.tensor([m.init_kind for m in self.meta], dtype=torch.int64).to(self.device),
                torch.tensor(
                    [list(m.init_params) + [0.0] * (4 - len(m.init_params)) for m in self.meta], dtype=torch.float64
                ).to(self.device),
                state_row_offsets if rowwise else dense.to(self.device),
            )
        seeds, kinds, params, state_offsets = self._device_layout[key]
        ops.init_rows_tables(
            self.weights,
            table_offsets,
            table_dims,
            self.dtype_layout()[0],
            torch.where(inserted, unique_rows, -1),
            unique_table,
            unique,
            seeds,
            kinds,
            params,
            sorted({m.init_kind for m in self.meta}),
            self._widest,
            self.states,
            state_offsets,
            rowwise,
            self._initial_state_values(),
        )

    def _init_view(self, t: int) -> tuple[Tensor, list[Tensor], list[float]]:
        """Table t's [capacity, dim] rows, its states as [capacity, width], and their initial values."""
        if self._init_views is None:  # per-table views, built once per storage and optimizer
            self._init_views = []
            for i in range(len(self.meta)):
                views = self.state_views(i)
                self._init_views.append(
                    (
                        self.table_view(i),
                        [v if v.dim() == 2 else v.unsqueeze(1) for v in views.values()],
                        self._initial_state_values(),
                    )
                )
        return self._init_views[t]

    def _initial_state_values(self) -> list[float]:
        """One initial value per optimizer state buffer, in ``self.states`` order (none without an
        optimizer)."""
        return [] if self.optimizer is None else list(self.optimizer.initial_state_values())

    # ------------------------------------------------------------------ backward

    def apply_gradients(
        self,
        grad: Tensor,
        lookup: RowLookup,
        offsets: Tensor | None,
        per_sample_weights: Tensor | None,
        feature_col: Tensor,
        feature_mean: Tensor,
        batch_size: int,
        hyperparams: tuple[float, ...],
    ) -> None:
        """The fused backward: per unique row, sum its ids' gradients and take one optimizer step."""
        if self.optimizer is None:
            raise RuntimeError(
                "dynamic embedding backward: no fused optimizer; pass optimizer=... to the module or call "
                "torchrec.optim.apply_optimizer_in_backward(cls, module.parameters(), kwargs) before training"
            )
        self.optimizer_step += 1
        table_offsets, table_dims, state_row_offsets = self.layout()
        table_dtypes, rounding_seeds = self.dtype_layout()
        new = lookup.new if lookup.new is not None and not lookup.new.written else None
        unique_rows, summed = lookup.unique_rows, None
        if self.replicated_fallback is not None:  # those rows step below, on the ranks' summed gradient
            replicated, summed = self._sum_replicated_fallback_gradients(
                grad, lookup, offsets, per_sample_weights, feature_col, feature_mean, batch_size
            )
            unique_rows = unique_rows.masked_fill(replicated, -1)
        ops.fused_update(
            grad,
            self.weights,
            self.states,
            table_offsets,
            table_dims,
            state_row_offsets,
            unique_rows,
            lookup.unique_table,
            lookup.inverse,
            offsets,
            per_sample_weights,
            feature_col,
            feature_mean,
            batch_size,
            self.optimizer.kind_id,
            hyperparams,
            int(self.optimizer_step),
            *(((), None, ()) if new is None else (new.vectors, new.unique_new, self._initial_state_values())),
            table_dtypes=table_dtypes,
            unique_ids=lookup.unique_ids,
            rounding_seeds=rounding_seeds,
        )
        if new is not None:
            new.written = True
        if self.delta_log is not None:
            self.delta_log.updated(unique_rows, lookup.unique_table)
        if summed is not None:
            self._step_replicated_fallback(summed, hyperparams)
        done = self._pending.get(id(lookup.unique_rows))
        if done is not None:
            done()
            if self.pending_backward == 0 and getattr(self, "_growth_deferred", False):
                self._growth_deferred = False
                self.grow()  # growths put off while this update was pending

    def _replicated_fallback_layout(self) -> tuple[list[int], list[int], int]:
        """Where each table's fallback gradients go in the buffer the ranks sum: (word start,
        row start of the read counts after the gradients, words of gradients); tables whose
        fallback rows are not replicated take no room."""
        tables = set(self.replicated_fallback[0])
        rows = [m.fallback_rows if t in tables else 0 for t, m in enumerate(self.meta)]
        words = [k * m.dim for k, m in zip(rows, self.meta)]
        word_starts = [sum(words[:t]) for t in range(len(words))]
        return word_starts, [sum(rows[:t]) for t in range(len(rows))], sum(words)

    def _sum_replicated_fallback_gradients(
        self,
        grad: Tensor,
        lookup: RowLookup,
        offsets: Tensor | None,
        per_sample_weights: Tensor | None,
        feature_col: Tensor,
        feature_mean: Tensor,
        batch_size: int,
    ) -> tuple[Tensor, Tensor]:
        """Which uniques read a replicated fallback row, and the buffer holding, summed over the
        ranks, each such row's gradient and how many ranks read it (0: it takes no step).

        The gradients are the fused kernel's own sums: a plain SGD step of learning rate -1 on a
        zeroed copy of those rows leaves each row's summed gradient in it."""
        tables, all_reduce = self.replicated_fallback
        word_starts, row_starts, words = self._replicated_fallback_layout()
        device = self.device
        flags = torch.zeros(len(self.meta), dtype=torch.bool, device=device)
        flags[tables] = True
        capacity = self._on_device()[5][:, 0]
        table = lookup.unique_table
        replicated = (lookup.unique_rows >= capacity[table]) & flags[table]
        local = torch.where(replicated, lookup.unique_rows - capacity[table], -1)
        reads = sum(self.meta[t].fallback_rows for t in tables)
        buffer = torch.zeros(words + reads, dtype=torch.float32, device=device)
        ops.fused_update(
            grad,
            buffer[:words],
            [],
            torch.tensor(word_starts, dtype=torch.int64, device=device),
            self.layout()[1],
            torch.zeros(len(self.meta), dtype=torch.int64, device=device),
            local,
            table,
            lookup.inverse,
            offsets,
            per_sample_weights,
            feature_col,
            feature_mean,
            batch_size,
            OPTIMIZERS["sgd"],
            _MINUS_ONE_SGD,
            1,
        )
        read = replicated.nonzero().squeeze(1)
        starts = torch.tensor(row_starts, dtype=torch.int64, device=device)
        buffer[words + starts[table[read]] + local[read]] = 1.0
        all_reduce(buffer)
        return replicated, buffer

    def _step_replicated_fallback(self, summed: Tensor, hyperparams: tuple[float, ...]) -> None:
        """One optimizer step of each replicated fallback row some rank read, on the summed
        gradient: every rank takes the same step, the one the unsharded table takes."""
        table_offsets, table_dims, state_row_offsets = self.layout()
        table_dtypes, rounding_seeds = self.dtype_layout()
        word_starts, row_starts, words = self._replicated_fallback_layout()
        device = self.device
        for t in self.replicated_fallback[0]:
            m = self.meta[t]
            read = summed[words + row_starts[t] : words + row_starts[t] + m.fallback_rows].nonzero().squeeze(1)
            if read.numel() == 0:
                continue
            grad = summed[word_starts[t] : word_starts[t] + m.fallback_rows * m.dim].view(m.fallback_rows, m.dim)[read]
            rows, n = m.capacity + read, read.numel()
            no_features = torch.zeros(0, dtype=torch.int64, device=device)
            # A sequence-shaped update: gradient row i is fallback row read[i]'s whole gradient;
            # its id for stochastic rounding is its slot, as in the unsharded lookup.
            ops.fused_update(
                grad,
                self.weights,
                self.states,
                table_offsets,
                table_dims,
                state_row_offsets,
                rows,
                torch.full((n,), t, dtype=torch.int64, device=device),
                torch.arange(n, device=device),
                None,
                None,
                no_features,
                no_features.bool(),
                0,
                self.optimizer.kind_id,
                hyperparams,
                int(self.optimizer_step),
                table_dtypes=table_dtypes,
                unique_ids=read,
                rounding_seeds=rounding_seeds,
            )
            if self.delta_log is not None:
                self.delta_log.updated(rows, torch.full((n,), t, dtype=torch.int64, device=device))

    # ------------------------------------------------------------------ checkpoint

    def table_state(self, t: int) -> dict[str, Tensor]:
        """Table t's live rows: vectors, ids, scores, rows, optimizer state, counters."""
        if self.device.type == "meta":
            return self._shape_only_state(t)
        if self.__dict__.get("_rows_as_shapes"):
            return self._shape_only_state(t, self.device)
        self.write_new_rows()
        state = self.indexes[t].state_dict()
        keys, rows, scores = state["keys"], state["rows"], state["scores"]
        per_row, whole = self.rows_state(t, rows), self.whole_table_state(t)
        out = {
            "weight": per_row.pop("weight"),
            "weight_id": keys,
            "metadata": scores,
            "row": rows,
            "counters": whole.pop("counters"),
        }
        out.update(per_row)  # optimizer state, last seen
        out.update(whole)  # admission, fallback rows
        return out

    def rows_state(self, t: int, rows: Tensor) -> dict[str, Tensor]:
        """Table t's per-row state at ``rows`` (live rows): vectors, optimizer state, last seen.
        Gathered copies (the state never aliases the table), by index_select: indexing (``view[rows]``)
        costs ~15 ms more per call on CPU, which a small delta would pay per key."""
        out = {"weight": self.table_view(t).index_select(0, rows)}
        for name, view in self.state_views(t).items():
            out[f"optimizer.{name}"] = view.index_select(0, rows)
        if self.meta[t].ttl_steps is not None:
            out["last_seen"] = self.last_seen[t].index_select(0, rows)
        return out

    def whole_table_state(self, t: int) -> dict[str, Tensor]:
        """Table t's state that is not per row: counters, admission state, fallback rows (small;
        what an incremental checkpoint saves whole)."""
        self.write_new_rows()
        m, index = self.meta[t], self.indexes[t]
        out = {
            # on the storage's device, as every other key (one device per rank's checkpoint shards)
            "counters": torch.tensor(
                [index.clock, index.epoch, self.train_step, int(self.optimizer_step), LAYOUT_VERSION],
                device=self.device,
            ),
        }
        if self.admission[t] is not None:
            out.update(self.admission[t].state())
        if m.fallback_rows:
            out["fallback_weight"] = self.fallback_view(t).clone()
            for name, view in self.state_views(t, fallback=True).items():
                out[f"fallback_optimizer.{name}"] = view.clone()
        return out

    @contextmanager
    def rows_as_shapes(self) -> Iterator[None]:
        """Within it, ``table_state`` gives each key's dtype and trailing shape with no rows (on the
        tables' device, zeros where a key has a fixed size): a template to load a checkpoint into
        that gathers no row (``load_checkpoint`` sizes the entries from the checkpoint)."""
        self.__dict__["_rows_as_shapes"] = True
        try:
            yield
        finally:
            self.__dict__.pop("_rows_as_shapes", None)

    def _shape_only_state(self, t: int, device: torch.device | None = None) -> dict[str, Tensor]:
        """A meta module's state: the keys, dtypes and shapes of a fresh module's (no live rows),
        on the meta device (or ``device``), as TorchRec's modules give shape-only state on meta."""
        m, meta = self.meta[t], device or torch.device("meta")
        out = {}
        for key in self.state_keys(t):
            if key == "weight":
                out[key] = torch.zeros(0, m.dim, dtype=m.dtype, device=meta)
            elif key == "counters":
                out[key] = torch.zeros(len(COUNTERS), dtype=torch.int64, device=meta)
            elif key == "admission_bloom":  # one packed filter
                opts = m.options
                nbytes = bloom_geometry(
                    opts.bloom_expected_ids or m.max_capacity,
                    opts.bloom_bytes,
                    opts.bloom_fpr,
                    m.name,
                    opts.bloom_hashes,
                ).nbytes
                out[key] = torch.zeros(1, nbytes, dtype=torch.uint8, device=meta)
            elif key.startswith("optimizer."):
                view = self.state_views(t)[key[len("optimizer.") :]]
                out[key] = torch.zeros((0,) + tuple(view.shape[1:]), dtype=view.dtype, device=meta)
            elif key == "fallback_weight":  # fixed size: the fallback rows themselves
                out[key] = torch.zeros(m.fallback_rows, m.dim, dtype=m.dtype, device=meta)
            elif key.startswith("fallback_optimizer."):
                view = self.state_views(t, fallback=True)[key[len("fallback_optimizer.") :]]
                out[key] = torch.zeros(view.shape, dtype=view.dtype, device=meta)
            else:  # ids, scores, rows, last_seen, admission ids and counts
                out[key] = torch.zeros(0, dtype=torch.int64, device=meta)
        return out

    def state_keys(self, t: int) -> list[str]:
        m = self.meta[t]
        keys = ["weight", "weight_id", "metadata", "row", "counters"]
        keys += [f"optimizer.{name}" for name in self.state_views(t)]
        keys += ["last_seen"] if m.ttl_steps is not None else []
        keys += {"counter": ["admission_id", "admission_count"], "bloom": ["admission_bloom"]}.get(m.admission, [])
        if m.fallback_rows:
            keys += ["fallback_weight"] + [f"fallback_optimizer.{name}" for name in self.state_views(t)]
        return keys

    def load_states(self, states: dict[int, dict[str, Tensor]], where: str) -> None:
        """Replaces tables by ``table_state`` outputs (table index -> state), all or none: every
        state is checked and its index built before any table changes. ``row`` may be absent
        (rows placed afresh), and so may optimizer state, ``last_seen`` and the admission keys
        (initial values: fresh optimizer state, seen now, nothing pending)."""
        if not states:
            return
        self.check_ready(where)
        loaded = {t: self._check_table_state(t, state, where) for t, state in states.items()}
        self.write_new_rows()
        resized = {t: (table.capacity, None) for t, table in loaded.items() if table.capacity != self.meta[t].capacity}
        if resized:  # growing tables fit the checkpoint's ids (GrowthError, nothing changed, if they cannot)
            self._relayout(resized, {})
        if self.delta_log is not None:
            self.delta_log.replaced(self, list(loaded), [table.rows for table in loaded.values()])
        for t, table in loaded.items():
            self._replace_table(t, table)
        self.train_step = max(table.train_step for table in loaded.values())
        self.optimizer_step.fill_(max(table.optimizer_step for table in loaded.values()))
        for table in loaded.values():
            for said in (table.dtype_warning, table.layout_warning, table.warning):
                if said is not None:
                    warnings.warn(said, stacklevel=3)

    def _check_table_state(self, t: int, state: dict[str, Tensor], where: str) -> _LoadedTable:
        """Table t's checkpoint state, checked (types, shapes, finite values, distinct ids, counter
        ranges) and placed in a new index; raises TypeError / ValueError naming the key."""
        m, device = self.meta[t], self.device
        name = f"{where}: table {m.name!r}"
        ids = _checked(name, "weight_id", state["weight_id"], "int", None)
        n = ids.numel()
        vectors = _checked(name, "weight", state["weight"], "float", (n, m.dim), ids)
        scores = _checked(name, "metadata", state["metadata"], "int", (n,))
        before_layouts = isinstance(state["counters"], Tensor) and tuple(state["counters"].shape) == (
            len(COUNTERS) - 1,
        )
        counters = _checked(name, "counters", state["counters"], "int", (len(COUNTERS) - before_layouts,)).tolist()
        clock, epoch, train_step, optimizer_step, layout = (
            check_counter(where, f"table {m.name!r} counters[{i}] ({what})", value, limit)
            for i, ((what, limit), value) in enumerate(zip(COUNTERS, counters + [1] * before_layouts))
        )
        saved_rows = _checked(name, "row", state["row"], "int", (n,)) if "row" in state else None
        _check_distinct(name, "weight_id", ids)
        states: dict[str, Tensor | None] = {}
        for key, view in self.state_views(t).items():
            value = state.get(f"optimizer.{key}")
            if value is not None:
                value = _checked(
                    name,
                    f"optimizer.{key}",
                    value,
                    "float",
                    (n,) + tuple(view.shape[1:]),
                    ids,
                    non_negative=(self.optimizer.kind, key) in SQUARED_STATES,
                )
            states[key] = value
        last_seen = None
        if m.ttl_steps is not None and "last_seen" in state:
            last_seen = _checked(name, "last_seen", state["last_seen"], "int", (n,))
            late = (last_seen < 0) | (last_seen > train_step)
            if bool(late.any()):
                i = int(late.nonzero()[0])
                raise ValueError(
                    f"{name} last_seen must be in [0, training step {train_step}], got {int(last_seen[i])} "
                    f"at entry {i} (weight_id {int(ids[i])})"
                )
        admission = None if self.admission[t] is None else self.admission[t].checked_state(state, name)
        fallback, fallback_states = self._checked_fallback(t, state, name)

        # Placement: the saved rows when valid in this table, else placed afresh: silently after a
        # change of capacity or world size, said once when the rows follow another layout. A
        # growing table takes the capacity its ids fit in, doubling from its initial one (that of
        # the table that saved them, unless it grew for ids since evicted or expired).
        ids, scores = ids.to(device, torch.int64), scores.to(device, torch.int64)
        capacity = m.fit_capacity(n, start=m.initial_capacity) if m.max_capacity != m.initial_capacity else m.capacity
        index = HashTable(capacity, policy=m.policy, device=device, mapped_rows=m.may_grow)
        entry = {"capacity": capacity, "policy": m.policy, "clock": clock, "epoch": epoch, "layout": LAYOUT_VERSION}
        rows, keep, warning, layout_warning = None, None, None, None
        if saved_rows is not None and n <= capacity:
            saved_rows = saved_rows.to(device, torch.int64)
            try:
                index.load_state_dict(dict(entry, layout=layout, keys=ids, rows=saved_rows, scores=scores))
                rows = saved_rows
            except ValueError:
                pass  # saved at another capacity, or with another layout, or by a grown table
        if rows is None and saved_rows is not None and m.may_grow and n <= capacity:
            rows = self._keep_saved_rows(index, entry, ids, saved_rows, scores)
        if rows is None:
            if saved_rows is not None and layout not in SAME_BUCKET_LAYOUTS:
                layout_warning = (
                    f"{name}: the checkpoint's rows follow hash-table layout {layout} "
                    f"({LAYOUTS.get(layout, 'unknown')}), this table's layout is {LAYOUT_VERSION} "
                    f"({LAYOUTS[LAYOUT_VERSION]}): its ids were given new rows"
                )
            rows = place_keys(ids, scores, capacity)
            keep = rows >= 0
            index.load_state_dict(dict(entry, keys=ids[keep], rows=rows[keep], scores=scores[keep]))
            kept = int(keep.sum())
            if kept < n:
                warning = (
                    f"{name}: placed {kept} of the checkpoint's {n} ids in capacity {capacity}; the other "
                    f"{n - kept} were dropped, by eviction score (metadata), highest kept: an id is dropped when "
                    f"the two 32-row buckets it hashes to have no free row in any placement of the higher-scored "
                    f"ids kept and the stash ({stash_slots(capacity)} ids outside their buckets) is full"
                    + (f" ({n} ids > capacity {capacity})" if n > capacity else "")
                )
            rows = rows[keep]
            keep = keep.to(vectors.device)
        pick = (lambda x: x.to(device)) if keep is None else (lambda x: x[keep.to(x.device)].to(device))
        if m.ttl_steps is not None:
            last_seen = (
                torch.full((rows.numel(),), train_step, dtype=torch.int64, device=device)
                if last_seen is None
                else pick(last_seen.to(torch.int64))
            )
        return _LoadedTable(
            index=index,
            rows=rows,
            vectors=pick(vectors.to(m.dtype)),
            states={k: None if v is None else pick(v.to(torch.float32)) for k, v in states.items()},
            last_seen=last_seen,
            admission=admission,
            train_step=train_step,
            optimizer_step=optimizer_step,
            warning=warning,
            dtype_warning=self._dtype_warning(t, vectors, ids, name),
            layout_warning=layout_warning,
            fallback=fallback,
            fallback_states=fallback_states,
            capacity=capacity,
        )

    @staticmethod
    def _keep_saved_rows(index: HashTable, entry: dict, ids: Tensor, rows: Tensor, scores: Tensor) -> Tensor | None:
        """Loads ``ids`` into a growing table's ``index`` (its slots map to rows) at their saved
        ``rows``, placing them in slots afresh; None (the index unchanged) when the rows are not
        distinct rows of the table or some id finds no slot."""
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= index.capacity):
            return None
        if torch.unique(rows).numel() != rows.numel():
            return None
        slots = place_keys(ids, scores, index.capacity)
        if bool((slots < 0).any()):
            return None
        index.load_state_dict(dict(entry, keys=ids, rows=rows, slots=slots, scores=scores))
        return rows

    def _checked_fallback(
        self, t: int, state: dict[str, Tensor], name: str
    ) -> tuple[Tensor | None, dict[str, Tensor | None]]:
        """Table t's saved fallback rows and their optimizer state, checked and converted (None
        where not saved)."""
        m, device = self.meta[t], self.device
        if not m.fallback_rows:
            return None, {}
        fallback = state.get("fallback_weight")
        if fallback is not None:
            fallback = _checked(name, "fallback_weight", fallback, "float", (m.fallback_rows, m.dim))
            fallback = fallback.to(device, m.dtype)
            if not bool(torch.isfinite(fallback.float().sum())):
                raise ValueError(
                    f"{name} fallback_weight holds values beyond the range of the table's data_type ({m.dtype})"
                )
        states: dict[str, Tensor | None] = {}
        for key, view in self.state_views(t, fallback=True).items():
            value = state.get(f"fallback_optimizer.{key}")
            if value is not None:
                value = _checked(
                    name,
                    f"fallback_optimizer.{key}",
                    value,
                    "float",
                    tuple(view.shape),
                    non_negative=(self.optimizer.kind, key) in SQUARED_STATES,
                ).to(device, torch.float32)
            states[key] = value
        return fallback, states

    def _dtype_warning(self, t: int, vectors: Tensor, ids: Tensor, name: str) -> str | None:
        """None when the checkpoint's vectors have table t's storage dtype; else what converting
        them (to nearest) is said with. Values beyond the dtype's range are refused, naming an id."""
        dtype = self.meta[t].dtype
        if vectors.dtype == dtype:
            return None
        converted = vectors.to(dtype)
        if vectors.numel() and not bool(torch.isfinite(converted.float().sum())):
            at = (~torch.isfinite(converted)).nonzero()[0].tolist()
            raise ValueError(
                f"{name} weight holds {vectors[tuple(at)].item()} at {at} (weight_id {int(ids[at[0]])}), "
                f"beyond the range of the table's data_type ({dtype})"
            )
        return (
            f"{name}: the checkpoint's weight is {vectors.dtype}, the table stores {dtype} (its config's "
            "data_type): converted, rounding to nearest"
        )

    def _replace_table(self, t: int, table: _LoadedTable) -> None:
        m, rows = self.meta[t], table.rows
        self.indexes[t] = table.index
        # index_copy_ / index_fill_ rather than view[rows] = ...: indexing costs ~15 ms more per call on CPU
        self.table_view(t).index_copy_(0, rows, table.vectors)
        for (key, view), fill in zip(self.state_views(t).items(), self._initial_state_values()):
            value = table.states[key]
            view.index_fill_(0, rows, fill) if value is None else view.index_copy_(0, rows, value)
        if m.ttl_steps is not None:
            self.last_seen[t].zero_()
            self.last_seen[t].index_copy_(0, rows, table.last_seen)
        if table.admission is not None:
            self.admission[t] = table.admission
        if m.fallback_rows:  # what was not saved starts over: zero rows, initial optimizer state
            if table.fallback is not None:
                self.fallback_view(t).copy_(table.fallback)
            else:
                self.fallback_view(t).zero_()
            for (key, view), fill in zip(self.state_views(t, fallback=True).items(), self._initial_state_values()):
                if table.fallback_states[key] is not None:
                    view.copy_(table.fallback_states[key])
                else:
                    view.fill_(fill)

    # ------------------------------------------------------------------ accounting

    def num_live_rows(self) -> int:
        return sum(index.size() for index in self.indexes if index is not None)

    def storage_bytes(self, maximum: bool = False) -> int:
        """Bytes of vectors, optimizer state and index metadata (digest, key, score per slot), last-seen
        steps and admission state, as allocated now; ``maximum``: what they take once every growing
        table reached num_embeddings (the same for tables that do not grow)."""
        if maximum:
            return self._bytes_at([m.max_capacity for m in self.meta])
        total = self.weights.numel() * 4 + sum(s.numel() * s.element_size() for s in self.states)
        for index, last_seen, admission in zip(self.indexes, self.last_seen, self.admission):
            if index is not None:
                total += index.metadata_bytes()
            if last_seen is not None:
                total += last_seen.numel() * last_seen.element_size()
            if admission is not None:
                total += admission.nbytes()
        return total

    def _bytes_at(self, capacities: Sequence[int]) -> int:
        """storage_bytes() of these tables at ``capacities`` (the byte model of the planner)."""
        total = 0
        per_row = len(self.states) * 4 if self.optimizer is not None else 0
        for c, m, admission in zip(capacities, self.meta, self.admission):
            total += table_words(c + m.fallback_rows, m.dim, m.dtype) * 4
            total += (
                (c + m.fallback_rows)
                * per_row
                * (1 if self.optimizer is None or self.optimizer.kind in ROWWISE_STATE else m.dim)
            )
            total += index_bytes(c) + (row_map_bytes(c) if m.may_grow else 0)
            total += 8 * c if m.ttl_steps else 0
            total += admission.nbytes() if admission is not None else 0
        return total

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
