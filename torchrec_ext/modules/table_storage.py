"""Where a module's rows live: one flat buffer of 4-byte words holding every table's vectors, and
the float32 optimizer state, laid out table after table.

Table t's [capacity_t, dim_t] rows start at word ``table_offsets[t]``, packed in the table's storage
dtype (float32, float16 or bfloat16 from its config's ``data_type``): the layout the kernels take.
Element-wise optimizer states lie the tables back to back, row-wise ones one float per row. A
table's fallback rows follow its capacity rows. ``TableStorage`` holds the buffers, their layout
descriptors (on the CPU, mirrored to the storage's device), the per-table views and the byte
accounting; ``TableMeta`` is one table's settings.

Each table's span holds its rows now (capacity + fallback rows), except in a growing module on
CPU (``_spans_at_max``): there every span is laid out for num_embeddings, in address space
reserved once (``ReservedBuffer``), so that a growth moves no row and no optimizer state (only
the fallback rows, which follow the capacity rows); the pages past a table's rows are never
written (they read as zeros and take no memory), so resident memory still follows the rows in use.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from torchrec_ext import device_sync
from torchrec_ext.modules.fused_optimizer import OptimizerSpec
from torchrec_ext.modules.pending_rows import pending_rows_written
from torchrec_ext.modules.reserved_buffers import ReservedBuffer
from torchrec_ext.vocabulary import (
    OPTIMIZER_STATES,
    ROWWISE_STATE,
    dense_state_offsets,
    index_bytes,
    row_map_bytes,
    table_words,
)


@dataclass
class TableMeta:
    """One table's settings, from its config, and its capacity now."""

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


def allocate_filled(numel: int, value: float, device: torch.device) -> Tensor:
    """A float32 buffer filled with ``value``; on CPU backed by transparent huge pages where the
    kernel offers them, since rows are touched at random and 4 KiB pages make each a TLB miss."""
    buf = torch.empty(numel, dtype=torch.float32, device=device)
    if device.type == "cpu" and numel * 4 >= _HUGE_PAGE:
        _advise_huge_pages(buf)
    if device.type != "meta":
        buf.fill_(value)
    return buf


_HUGE_PAGE = 2 << 20

# What ``TableStorage._compute_layout`` sets: a relayout that fails puts them back.
LAYOUT_ATTRIBUTES = (
    "table_offsets",
    "state_row_offsets",
    "dense_state_offsets",
    "fallback_layout",
    "_device_layout",
    "_span_views",
)


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


class TableStorage:
    """The storage part of ``DynamicTables``: vectors and optimizer state of all tables, their
    layout, the views of one table and the byte accounting. ``DynamicTables.__init__`` sets the
    attributes; ``write_new_rows`` (pending rows written before the optimizer state changes) is
    ``IdsToRows``'."""

    meta: list[TableMeta]
    weights: Tensor
    states: list[Tensor]
    optimizer: OptimizerSpec | None

    def _compute_layout(self) -> list[int]:
        """Where each table's rows and optimizer state start in the flat buffers, from the tables'
        current capacities; returns each table's words of vectors."""
        # Fallback rows are rows of their table's storage after its capacity rows: the kernels
        # read, pool and step them as any row; only the index never hands them out.
        spans = [self._span_rows(m) for m in self.meta]
        sizes = [table_words(rows, m.dim, m.dtype) for rows, m in zip(spans, self.meta)]
        # Layout descriptors and counters live on the CPU (named explicitly, so that a module
        # built under ``with torch.device("meta")`` keeps them); layouts are copied to the
        # storage's device as needed.
        cpu = torch.device("cpu")
        self.table_offsets = (
            torch.tensor([0] + sizes[:-1], dtype=torch.int64, device=cpu).cumsum(0)
            if sizes
            else torch.zeros(0, dtype=torch.int64, device=cpu)
        )
        self.state_row_offsets = torch.tensor([0] + spans[:-1], dtype=torch.int64, device=cpu).cumsum(0)
        self.dense_state_offsets = dense_state_offsets(spans, [m.dim for m in self.meta])
        # Per table: capacity, fallback rows and fallback seed (None: no table has fallback rows).
        self.fallback_layout = (
            torch.tensor(
                [[m.capacity, m.fallback_rows, m.fallback_seed] for m in self.meta], dtype=torch.int64, device=cpu
            )
            if any(m.fallback_rows for m in self.meta)
            else None
        )
        self._device_layout = {}
        self._span_views = {}
        return sizes

    # Whether every table's span is laid out for num_embeddings (see the module docstring).
    _spans_at_max: bool = False
    _span_views: dict[int, Tensor]  # with spans at num_embeddings: each table's rows (``_storage_view``)

    def _span_rows(self, m: TableMeta) -> int:
        """Rows of a table's span in the buffers (its rows, or room for its largest size)."""
        return m.max_capacity + m.fallback_rows if self._spans_at_max else m.rows

    def _buffer_numel(self, name: str) -> int:
        """Elements of buffer ``name`` ("weights" or an optimizer state) in the current layout."""
        spans = [self._span_rows(m) for m in self.meta]
        if name == "weights":
            return sum(table_words(rows, m.dim, m.dtype) for rows, m in zip(spans, self.meta))
        rowwise = self.optimizer is not None and self.optimizer.kind in ROWWISE_STATE
        return sum(rows * (1 if rowwise else m.dim) for rows, m in zip(spans, self.meta))

    def _rows_in_use(self, name: str) -> list[tuple[int, int]]:
        """Per table, the [start, end) elements of buffer ``name`` holding its rows now."""
        out = []
        for t, m in enumerate(self.meta):
            if name == "weights":
                start = int(self.table_offsets[t])
                out.append((start, start + table_words(m.rows, m.dim, m.dtype)))
            elif self.optimizer is not None and self.optimizer.kind in ROWWISE_STATE:
                start = int(self.state_row_offsets[t])
                out.append((start, start + m.rows))
            else:
                start = self.dense_state_offsets[t]
                out.append((start, start + m.rows * m.dim))
        return out

    def row_starts(self) -> Tensor:
        """Where each table's rows start in a numbering of every table's rows (fallback rows
        included) back to back, whatever the buffers' layout (the delta log's flat rows)."""
        return torch.tensor([0] + [m.rows for m in self.meta][:-1], dtype=torch.int64, device="cpu").cumsum(0)

    def register_parameter_owner(self, owner: object) -> None:
        """``owner.weight`` (a table module's parameter, table ``owner._index``) views this storage:
        re-pointed at the new storage when a growth replaces it."""
        self._parameter_owners.add(owner)

    def _rebind_parameters(self) -> None:
        for owner in list(self._parameter_owners):
            if getattr(owner, "_tables", None) is self:
                owner.weight.data = self.table_view(owner._index)

    # ------------------------------------------------------------------ views

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
        reserved = self._reserved.get("weights") if self._spans_at_max else None
        if reserved is not None and reserved.start == self.weights.data_ptr():
            # A tensor of its own over these rows, not over the whole reserved range: the one the
            # table's parameter views, so that a pickle of the parameter carries these rows only.
            view = self._span_views.get(t)
            if view is None or view.shape[0] != m.rows or view.data_ptr() != reserved.start + start * 4:
                view = self._span_views[t] = reserved.rows(start, m.rows, m.dim, m.dtype)
            return view
        words = self.weights[start : start + table_words(m.rows, m.dim, m.dtype)]  # (a span may be longer)
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
            # Mirrored: the kernels read their host values (the widest dim) without a sync. Normal
            # tensors, though first made under inference_mode: those would never be mirrored.
            with device_sync.normal_tensors():
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

    def _all_state_views(self, t: int) -> list[Tensor]:
        """Table t's optimizer state, every row (capacity rows, then fallback rows)."""
        m = self.meta[t]
        rowwise = self.optimizer is not None and self.optimizer.kind in ROWWISE_STATE
        if rowwise:
            start = int(self.state_row_offsets[t])
            return [buf[start : start + m.rows] for buf in self.states]
        start = self.dense_state_offsets[t]
        return [buf[start : start + m.rows * m.dim].view(m.rows, m.dim) for buf in self.states]

    # ------------------------------------------------------------------ buffers

    @pending_rows_written
    def set_optimizer(self, spec: OptimizerSpec) -> None:
        """Allocates (or keeps, when the kind is unchanged) the optimizer state for ``spec``."""
        if self.optimizer is not None and self.optimizer.kind == spec.kind:
            self.optimizer = spec
            self._init_views = None  # the fill values may have changed
            return
        self.optimizer, self.states, self._init_views = spec, [], None
        names = list(zip(OPTIMIZER_STATES[spec.kind], self._initial_state_values()))
        keep = {"weights"} | {name for name, _ in names}  # another kind's states go, with their pages
        self._reserved = {name: r for name, r in self._reserved.items() if name in keep}

        def allocate() -> list[Tensor]:
            return [self._allocate_buffer(name, self._buffer_numel(name), v, self.device) for name, v in names]

        try:
            states = allocate()
        except (OSError, OverflowError):  # no address space for the states' spans at num_embeddings
            self._pack_spans()
            self._rebind_parameters()
            states = allocate()
        self.states = states

    def _allocate_weights(self, device: torch.device) -> Tensor:
        """A new module's vectors, which fixes its layout: a module that grows, on CPU, lays its
        spans out at num_embeddings where the address space can be reserved."""
        self._spans_at_max = device.type == "cpu" and any(m.may_grow for m in self.meta)
        self._compute_layout()
        if self._spans_at_max:
            try:
                return self._allocate_buffer("weights", self._buffer_numel("weights"), 0.0, device)
            except (OSError, OverflowError):  # no address space to reserve (strict overcommit, ulimit -v)
                self._spans_at_max, self._reserved = False, {}
                self._compute_layout()
        return self._allocate_buffer("weights", self._buffer_numel("weights"), 0.0, device)

    def _allocate_buffer(
        self, name: str, numel: int, value: float, device: torch.device, untouched: bool = False
    ) -> Tensor:
        """The flat buffer ``name`` ("weights" or an optimizer state) of ``numel`` elements, the
        rows in use filled with ``value`` (a hook: tiered tables keep these in a cache over a
        backing store).

        With spans at num_embeddings (``_spans_at_max``) the buffer is a reservation
        (``ReservedBuffer``, OSError if it cannot be made; that of the same name and size again,
        its pages given back) of which only the rows in use are written, and only where
        ``value`` is not 0: fresh pages read as zeros and take memory once written. ``untouched`` (a relayout): the current buffer of that name where it has
        this size, as it is (the caller writes what changes)."""
        if device.type != "cpu" or not self._spans_at_max:
            return allocate_filled(numel, value, device)
        reserved = self._reserved.get(name)
        if reserved is not None and reserved.numel_max == numel:
            if untouched:
                return reserved.view(numel)
            reserved.zero(0, numel * 4)  # its pages go back: it reads as a fresh one
        else:
            reserved = ReservedBuffer(numel)
            self._reserved[name] = reserved
        buf = reserved.view(numel)
        if value != 0:
            for start, end in self._rows_in_use(name):
                buf[start:end].fill_(value)
        return buf

    def _pack_spans(self) -> None:
        """Lays the spans out at their tables' rows now, in plain buffers (where spans at
        num_embeddings cannot be kept: a copy, another device, no address space)."""
        if self._spans_at_max:
            self._relay_spans(False)

    def _spread_spans(self, saved: list[tuple[Tensor, list[Tensor]]] | None = None) -> None:
        """Lays a growing module's spans out at num_embeddings again, on CPU, where the address
        space can be reserved (else they stay at the tables' rows); ``saved``: each table's rows
        and states (a pickle's, ``__getstate__``), which become the buffers either way."""
        if saved is None and (
            self._spans_at_max or self.device.type != "cpu" or not any(m.may_grow for m in self.meta)
        ):
            return
        try:
            self._relay_spans(True, saved)
        except (OSError, OverflowError):  # no address space to reserve
            if saved is not None:
                self._relay_spans(False, saved)
            else:
                self._spans_at_max, self._reserved = False, {}
                self._compute_layout()

    def _relay_spans(self, at_max: bool, saved: list[tuple[Tensor, list[Tensor]]] | None = None) -> None:
        """Copies every table's rows and optimizer state (``saved``, default: the buffers' own)
        into new buffers laid out with spans at num_embeddings (``at_max``) or at the tables' rows.
        Row numbers do not change."""
        old = (
            saved
            if saved is not None
            else [(self._storage_view(t), self._all_state_views(t)) for t in range(len(self.meta))]
        )
        device = old[0][0].device if old else self.device
        states = len(old[0][1]) if old else len(self.states)
        names = ["weights"] + list(OPTIMIZER_STATES[self.optimizer.kind] if self.optimizer is not None else ())[:states]
        self._spans_at_max, self._reserved = at_max, {}
        self._compute_layout()
        buffers = [self._allocate_buffer(name, self._buffer_numel(name), 0.0, device) for name in names]
        self.weights, self.states = buffers[0], buffers[1:]
        for t, (vectors, states) in enumerate(old):
            self._storage_view(t).copy_(vectors)
            for new, state in zip(self._all_state_views(t), states):
                new.copy_(state)
        self._init_views = None

    def _saved_rows(self) -> list[tuple[Tensor, list[Tensor]]]:
        """Each table's rows (the tensors its parameter views) and a copy of its optimizer state:
        what a pickle of spans at num_embeddings carries instead of the reserved buffers."""
        return [(self._storage_view(t), [s.clone() for s in self._all_state_views(t)]) for t in range(len(self.meta))]

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

    # ------------------------------------------------------------------ accounting

    def storage_bytes(self, maximum: bool = False) -> int:
        """Bytes of vectors, optimizer state and index metadata (digest, key, score per slot), last-seen
        steps and admission state, as allocated now; ``maximum``: what they take once every growing
        table reached num_embeddings (the same for tables that do not grow)."""
        if maximum:
            return self._bytes_at([m.max_capacity for m in self.meta])
        if self._spans_at_max:  # the rows in use: the rest of the spans is address space, not memory
            total = sum(end - start for start, end in self._rows_in_use("weights")) * 4
            total += len(self.states) * sum(end - start for start, end in self._rows_in_use("state")) * 4
        else:
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
