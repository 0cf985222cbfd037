"""Growth of tables (a config's ``initial_capacity`` < num_embeddings): a table's capacity rows start
at initial_capacity and double, up to num_embeddings, when a training batch could push its load
past ``growth_load_factor`` (``TableGrowth.grow``).

Every table's vectors and optimizer state move to the new layout, the grown tables' rows to their
keys' places in a rebuilt index (``HashTable.grown``), with their last-seen steps and delta versions
(``_relayout``): on CPU within the buffers' own memory, reserved for the largest layout
(``ReservedBuffer``, so only the new pages are first touched), else into new buffers. Rows move
only then, and only while no lookup awaits its fused update (``pending_backward``).
"""

from __future__ import annotations

import mmap
from typing import NamedTuple

import torch
from torch import Tensor

from torchrec_ext import device_sync
from torchrec_ext.modules.pending_rows import pending_rows_written
from torchrec_ext.modules.reserved_buffers import ReservedBuffer
from torchrec_ext.table import HashTable
from torchrec_ext.vocabulary import OPTIMIZER_STATES, ROWWISE_STATE, table_words


class GrowthError(RuntimeError):
    """A growing table could not allocate its larger storage: the tables keep their storage and
    rows and stay usable (at their current capacity). Raised by a training lookup before it
    inserts anything, except for tables with admission, which grow once their admitted ids are
    known: there the lookup's admission counts of that table, and the tables before it in the
    batch, keep what the lookup did."""


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


_PAGE = mmap.PAGESIZE


def _move_block(buf: Tensor, old: Tensor, new: Tensor, reserved: ReservedBuffer | None = None) -> None:
    """Moves ``old`` to ``new`` (views of the same numel and dtype into ``buf``, which may
    overlap) with no scratch: in chunks no longer than the distance, from the far end; in a
    reserved buffer the whole pages of each chunk by remapping them (``ReservedBuffer.remap``),
    its edges by a copy."""
    u8, base = buf.view(torch.uint8), buf.data_ptr()
    n = old.numel() * old.element_size()
    s, d = old.data_ptr() - base, new.data_ptr() - base
    step = abs(d - s)
    if n == 0 or step == 0:
        return
    if step < min(n, 1 << 20):  # a short shift: many small chunks would cost more than a copy
        u8[d : d + n].copy_(u8[s : s + n].clone())
        return
    page = _PAGE
    if reserved is not None and (d - s) % page == 0 and step >= page:
        step -= step % page  # chunks of whole pages, so that each one's middle can be remapped
    else:
        reserved = None
    starts = range(0, n, step)
    for a in reversed(starts) if d > s else starts:
        e = min(a + step, n)
        head = min(-(base + s + a) % page, e - a) if reserved is not None else e - a
        whole = (e - a - head) // page * page
        if whole and reserved.remap(s + a + head, d + a + head, whole):
            u8[d + a : d + a + head].copy_(u8[s + a : s + a + head])
            u8[d + a + head + whole : d + e].copy_(u8[s + a + head + whole : s + e])
        else:
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
    reserved: ReservedBuffer | None = None,
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
            _move_block(buf, old_views[t][:block], new_views[t][:block], reserved)
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


class TableGrowth:
    """The growth part of ``DynamicTables``: capacities double between steps, rows move to the new
    layout (see the module docstring). Reads the storage (``TableStorage``) and the indexes."""

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
        grown = {t: self.indexes[t].grown(c) for t, c in targets.items()}  # new indexes; nothing changed yet
        self._relayout({t: (c, grown[t][1]) for t, c in targets.items()}, {t: g[0] for t, g in grown.items()})
        return sorted(targets)

    @pending_rows_written
    def _relayout(self, plans: dict[int, tuple[int, Tensor | None]], indexes: dict[int, HashTable]) -> None:
        """Gives tables new capacities: ``plans[t] = (capacity, row_map)``, ``row_map[old_row]``
        the new row of each old row (-1: dropped; None: no row carried, the caller replaces the
        table). New buffers are allocated first (``GrowthError`` if they cannot be: nothing
        changed), then every table's vectors and optimizer state are copied over (other tables
        whole, fallback rows whole), then ``indexes`` replace the tables' indexes. On the storage's
        device throughout. A buffer in reserved address space is rewritten in place
        (``_rewrite_in_place``): only the pages past its old size are new."""
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
                name = "weights" if k == 0 else OPTIMIZER_STATES[self.optimizer.kind][k - 1]
                reserved = self._reserved.get(name)
                reserved = reserved if reserved is not None and reserved.holds(buf) else None
                _rewrite_in_place(buf, old_k, new_k, old_spans[k], new_spans[k], value, moves, scratch, reserved)
                if buf.numel() < old_spans[k][-1]:  # a shrink: the pages past the new end go back
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
