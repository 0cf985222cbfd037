"""Growth of tables (a config's ``initial_capacity`` < num_embeddings): a table's capacity rows start
at initial_capacity and double, up to num_embeddings, when a training batch could push its load
past ``growth_load_factor`` (``TableGrowth.grow``).

A growth rebuilds the grown tables' indexes (``HashTable.grown``: every key keeps its row) and
gives the tables their new capacities (``_relayout``). On CPU, where each table's span is laid out
for num_embeddings in reserved address space (``TableStorage._spans_at_max``), no row moves: only
the fallback rows (which follow the capacity rows) and the last-seen steps, and the new rows' pages
are left unwritten (they read as zeros, the initial value of vectors and of most optimizer
states; a nonzero state value is written) until a row there is first written, as in a
preallocated table. Elsewhere (CUDA, no address space to reserve) the vectors and optimizer state
of every table (one flat buffer holds them all) are copied into new buffers on the device, so a
growth holds the old and the new storage at once (the planner counts that peak on CUDA:
``distributed.planner.growth_peak_bytes``). Rows move only then, and only while no lookup
awaits its fused update (``pending_backward``).

Everything a growth allocates is allocated before anything of the tables changes: an allocation
that fails (``torch.OutOfMemoryError`` on a GPU) raises ``GrowthError`` naming the tables, the
capacities and the bytes, and the tables are as they were.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from torchrec_ext import device_sync
from torchrec_ext.modules.pending_rows import pending_rows_written
from torchrec_ext.modules.reserved_buffers import ReservedBuffer
from torchrec_ext.modules.table_storage import LAYOUT_ATTRIBUTES
from torchrec_ext.table import HashTable, grown_tables
from torchrec_ext.vocabulary import OPTIMIZER_STATES, ROWWISE_STATE, index_bytes, row_map_bytes, table_words


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

    def scattered(self) -> tuple[Tensor, Tensor]:
        """(src, dst) of the rows carried one by one (not the block's)."""
        if not self.block:
            return self.src, self.dst
        live = self.live_src.numel()
        return self.src[live:], self.dst[live:]


def _carried_in_span(old: Tensor, move: _RowMoves, old_cap: int, new_cap: int) -> Tensor:
    """What ``_resize_in_span`` writes back of one table's rows in one buffer, copied out first
    (the span is rewritten in place): its fallback rows (a growth that keeps the rows), else
    every carried row."""
    if move.block == old_cap and new_cap >= old_cap:
        return old[old_cap:].clone()
    return old.index_select(0, move.src)


def _resize_in_span(
    reserved: ReservedBuffer,
    old: Tensor,
    new: Tensor,
    value: float,
    move: _RowMoves,
    old_cap: int,
    new_cap: int,
    carried: Tensor,
) -> None:
    """One table's rows in one buffer whose spans are laid out at num_embeddings: ``old`` (its
    rows before: capacity rows, then fallback rows) and ``new`` (after) start at the same place,
    and what lies past a table's rows reads as zeros (never written, or given back). A growth that
    keeps the rows moves only the fallback rows; the rows it adds are written only where
    ``value`` is not 0. Otherwise (a shrink, a table replaced) the span's pages are given back
    (``ReservedBuffer.zero``) and the carried rows written to their new places. ``carried``:
    ``_carried_in_span``'s copy. Allocates nothing."""
    if move.block == old_cap and new_cap >= old_cap:
        if value != 0:
            new[old_cap:new_cap].fill_(value)
        else:  # where the fallback rows were; the rest of the new rows was never written
            new[old_cap : min(old_cap + carried.shape[0], new_cap)].zero_()
        new[new_cap:].copy_(carried)
        return
    end = max(old.data_ptr() + old.numel() * old.element_size(), new.data_ptr() + new.numel() * new.element_size())
    reserved.zero(new.data_ptr() - reserved.start, end - reserved.start)
    if value != 0:
        new.fill_(value)
    if carried.shape[0]:
        new.index_copy_(0, move.dst, carried)


def _allocation_failed(error: BaseException) -> bool:
    """Whether ``error`` is what a failed allocation raises: torch.OutOfMemoryError (a GPU's),
    the CPU allocator's RuntimeError, MemoryError, or OSError (a reservation); not a kernel's
    other errors, which a growth passes on as they are (a GrowthError already names its tables)."""
    if isinstance(error, GrowthError):
        return False
    if isinstance(error, (torch.OutOfMemoryError, MemoryError, OSError)):
        return True
    said = str(error)
    return isinstance(error, RuntimeError) and ("allocat" in said or "out of memory" in said.lower())


class TableGrowth:
    """The growth part of ``DynamicTables``: capacities double between steps, the tables take the
    new layout (see the module docstring). Reads the storage (``TableStorage``) and the indexes."""

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
        update that ends the last pending one call it. All tables growing at once share one
        relayout (``_relayout``): every key keeps its row, vectors, optimizer state, last-seen step
        and delta versions; ids, scores, admission and counters are untouched. Raises
        ``GrowthError`` (nothing changed) when the new storage cannot be allocated."""
        if not self._growing or self.pending_backward or self.device.type == "meta":
            return []
        tables = [t for t, m in enumerate(self.meta) if m.grows and (incoming is None or t in incoming)]
        if not tables:
            return []
        targets: dict[int, int] = {}
        try:
            # Every table's live rows in one host read (not one per table).
            live = device_sync.host_list(
                torch.cat([self.indexes[t].size_tensor() for t in tables]), "growth: live rows"
            )
            for t, size in zip(tables, live):
                want = self.meta[t].fit_capacity(size + (incoming or {}).get(t, 0))
                if want != self.meta[t].capacity:
                    targets[t] = want
            if not targets:
                return []
            # New indexes (nothing changed yet), with one read for all tables.
            sizes = dict(zip(tables, live))
            grown = grown_tables(
                [self.indexes[t] for t in targets], list(targets.values()), [sizes[t] for t in targets]
            )
            grown = dict(zip(targets, grown))
        except Exception as e:
            if not _allocation_failed(e):
                raise
            raise self._growth_error(targets or dict.fromkeys(tables), e) from e
        self._relayout({t: (c, grown[t][1]) for t, c in targets.items()}, {t: g[0] for t, g in grown.items()})
        if self.populate_ahead:
            self._populate_next_doubling(sorted(targets))
        return sorted(targets)

    # Whether each growth has a background thread fault in the pages of the next doubling's rows
    # (spans at num_embeddings only), so that the steps after that growth find them backed.
    populate_ahead: bool = False

    def _populate_next_doubling(self, tables: list[int]) -> None:
        """Asks for the pages of rows [capacity, next capacity) of ``tables`` (past their fallback
        rows) in every buffer (``ReservedBuffer.populate``)."""
        if not self._spans_at_max or self.device.type != "cpu":
            return
        rowwise = self.optimizer is not None and self.optimizer.kind in ROWWISE_STATE
        for t in tables:
            m = self.meta[t]
            first, last = m.rows, min(2 * m.capacity, m.max_capacity) + m.fallback_rows
            if last <= first:
                continue
            row_bytes = m.dim * m.dtype.itemsize
            start = int(self.table_offsets[t]) * 4
            self._reserved["weights"].populate(start + first * row_bytes, start + last * row_bytes)
            width = 1 if rowwise else m.dim
            start = (int(self.state_row_offsets[t]) if rowwise else self.dense_state_offsets[t]) * 4
            for name in OPTIMIZER_STATES[self.optimizer.kind] if self.optimizer is not None else ():
                self._reserved[name].populate(start + first * width * 4, start + last * width * 4)

    def _growth_bytes(self, capacities: dict[int, int | None]) -> int:
        """Bytes a relayout to ``capacities`` allocates beside the tables' storage now: every
        table's buffers at the new capacities (spans at num_embeddings on CPU: the grown rows
        only), and the grown tables' indexes, row maps and last-seen steps."""
        caps = [capacities.get(t, m.capacity) for t, m in enumerate(self.meta)]
        in_span = self._spans_at_max and self.device.type == "cpu"
        rowwise = self.optimizer is not None and self.optimizer.kind in ROWWISE_STATE
        states = len(self.states)
        total = 0
        for t, (c, m) in enumerate(zip(caps, self.meta)):
            rows = max(c - m.capacity, 0) if in_span else c + m.fallback_rows
            total += table_words(rows, m.dim, m.dtype) * 4 + states * rows * (1 if rowwise else m.dim) * 4
            if t in capacities:
                total += index_bytes(c) + (row_map_bytes(c) if m.may_grow else 0)
                total += 8 * c if self.last_seen[t] is not None else 0
        return total

    def _growth_error(self, capacities: dict[int, int | None], error: BaseException) -> GrowthError:
        """The GrowthError of a relayout to ``capacities`` that could not allocate (None: not known
        yet, the tables' live rows could not be read): names the tables, the capacities and the
        bytes, says nothing changed."""
        tables = sorted(capacities)
        said = str(error).strip().splitlines()[0] if str(error).strip() else ""
        if any(capacities[t] is None for t in tables):
            what = f"reading their live rows before a growth needs {8 * len(tables)} bytes"
        else:
            what = (
                f"growing to capacities {[capacities[t] for t in tables]} needs new storage of "
                f"{self._growth_bytes(capacities)} bytes"
            )
        return GrowthError(
            f"tables {[self.meta[t].name for t in tables]}: {what} on {self.device} (beside the tables' "
            f"storage now), which could not be allocated ({type(error).__name__}: {said}); the tables are "
            f"unchanged, at capacities {[self.meta[t].capacity for t in tables]}"
        )

    @pending_rows_written
    def _relayout(self, plans: dict[int, tuple[int, Tensor | None]], indexes: dict[int, HashTable]) -> None:
        """Gives tables new capacities: ``plans[t] = (capacity, row_map)``, ``row_map[old_row]``
        the new row of each old row (-1: dropped; None: no row carried, the caller replaces the
        table). Everything it allocates (row moves, buffers, carried rows, last-seen steps, the
        delta log's versions) is allocated first, while the tables keep their storage: should an
        allocation fail (``torch.OutOfMemoryError`` on a GPU), the tables are as they were and
        ``GrowthError`` says so. Then the rows go to the new layout (other tables whole, fallback
        rows whole), ``indexes`` replace the tables' indexes. On the storage's device throughout.
        With spans at num_embeddings the buffers stay where they are (``_resize_in_span``)."""
        saved = (
            [m.capacity for m in self.meta],
            self.weights,
            self.states,
            self._init_views,
            {name: getattr(self, name) for name in LAYOUT_ATTRIBUTES},
        )
        try:
            put_in_place = self._relaid(plans, indexes)
        except Exception as e:  # whatever it was, the tables take their layout back
            capacities, self.weights, self.states, self._init_views, layout = saved
            for m, c in zip(self.meta, capacities):
                m.capacity = c
            for name, value in layout.items():
                setattr(self, name, value)
            if not _allocation_failed(e):
                raise
            raise self._growth_error({t: plan[0] for t, plan in plans.items()}, e) from e
        put_in_place()

    def _relaid(self, plans: dict[int, tuple[int, Tensor | None]], indexes: dict[int, HashTable]):
        """``_relayout``'s first part: allocates, takes the new layout and copies the rows into
        new buffers, changing nothing the old layout's buffers hold; returns its second part,
        which allocates nothing on the device (the writes in place of spans at num_embeddings,
        the new indexes, last-seen steps and delta versions put in place)."""
        device, old_row_starts = self.device, self.row_starts()
        old_views = [(self._storage_view(t), self._all_state_views(t)) for t in range(len(self.meta))]
        old_caps = [m.capacity for m in self.meta]
        new_caps = [plans[t][0] if t in plans else m.capacity for t, m in enumerate(self.meta)]
        words = sum(table_words(c + m.fallback_rows, m.dim, m.dtype) for c, m in zip(new_caps, self.meta))
        rowwise = self.optimizer is not None and self.optimizer.kind in ROWWISE_STATE
        state_size = sum((c + m.fallback_rows) * (1 if rowwise else m.dim) for c, m in zip(new_caps, self.meta))
        in_span = self._spans_at_max and device.type == "cpu"
        names = ["weights"] + list(OPTIMIZER_STATES[self.optimizer.kind] if self.optimizer is not None else ())
        values = [0.0] + self._initial_state_values()
        carried_rows = self._carried_rows(plans, old_caps)
        moves = [self._row_moves(t, old_caps[t], plans.get(t), carried_rows.get(t)) for t in range(len(self.meta))]
        buffers = [
            self._allocate_buffer(
                name, self._buffer_numel(name) if in_span else (words if k == 0 else state_size), value, device, True
            )
            for k, (name, value) in enumerate(zip(names, values))
        ]
        old_by_buffer = [[v[0] if k == 0 else v[1][k - 1] for v in old_views] for k in range(len(names))]
        # Spans at num_embeddings are rewritten in place: what they carry is copied out first.
        carried = (
            [
                [
                    None if move is None else _carried_in_span(old[t], move, old_caps[t], new_caps[t])
                    for t, move in enumerate(moves)
                ]
                for old in old_by_buffer
            ]
            if in_span
            else None
        )
        # The new layout.
        for t, c in enumerate(new_caps):
            self.meta[t].capacity = c
        self._compute_layout()
        self.weights, self.states = buffers[0], buffers[1:]
        self._init_views = None
        new_views = [(self._storage_view(t), self._all_state_views(t)) for t in range(len(self.meta))]
        new_by_buffer = [[v[0] if k == 0 else v[1][k - 1] for v in new_views] for k in range(len(names))]
        if not in_span:
            for old_k, new_k in zip(old_by_buffer, new_by_buffer):
                for t, move in enumerate(moves):
                    # A fresh buffer, filled (scattering rows into fresh pages instead faults them
                    # in at random, ~2.5x slower than the fill plus the copy, measured on CPU at 1M
                    # rows of dim 64).
                    if move is None:
                        new_k[t].copy_(old_k[t])
                        continue
                    new_k[t][: move.block].copy_(old_k[t][: move.block])
                    src, dst = move.scattered()
                    if src.numel():
                        new_k[t].index_copy_(0, dst, old_k[t].index_select(0, src))
        last_seen = {
            t: torch.zeros(plans[t][0], dtype=torch.int64, device=device).index_copy_(
                0, moves[t].live_dst, self.last_seen[t].index_select(0, moves[t].live_src)
            )
            for t in plans
            if self.last_seen[t] is not None
        }
        take_versions = None
        if self.delta_log is not None:
            new_row_starts = self.row_starts()
            flat_map = torch.full(
                (sum(old_caps[t] + m.fallback_rows for t, m in enumerate(self.meta)),),
                -1,
                dtype=torch.int64,
                device=device,
            )
            for t, m in enumerate(self.meta):
                move, old_start, new_start = moves[t], int(old_row_starts[t]), int(new_row_starts[t])
                if move is None:
                    flat_map[old_start : old_start + m.rows] = torch.arange(
                        new_start, new_start + m.rows, device=device
                    )
                else:
                    flat_map[old_start + move.src] = new_start + move.dst
            take_versions = self.delta_log.relayout(self, flat_map)

        def put_in_place() -> None:
            if carried is not None:
                for k, (name, value) in enumerate(zip(names, values)):
                    for t, move in enumerate(moves):
                        if move is not None:
                            _resize_in_span(
                                self._reserved[name],
                                old_by_buffer[k][t],
                                new_by_buffer[k][t],
                                value,
                                move,
                                old_caps[t],
                                new_caps[t],
                                carried[k][t],
                            )
            for t, seen in last_seen.items():
                self.last_seen[t] = seen
            for t, index in indexes.items():
                self.indexes[t] = index
            if take_versions is not None:
                take_versions()
            self._growing = any(m.grows for m in self.meta)
            self._rebind_parameters()

        return put_in_place

    def _carried_rows(
        self, plans: dict[int, tuple[int, Tensor | None]], old_caps: list[int]
    ) -> dict[int, tuple[int, bool]]:
        """For each table whose plan carries rows (a row map): how many live rows it carries, and
        whether every one keeps its number (a growth: HashTable.grown keeps them). Every table's in
        one counted host read, not one or two per table."""
        mapped = [t for t, plan in plans.items() if plan[1] is not None]
        if not mapped:
            return {}
        per_table = []
        for t in mapped:
            row_map = plans[t][1]
            old_rows = torch.arange(row_map.numel(), dtype=torch.int64, device=row_map.device)
            kept = ((row_map < 0) | (row_map == old_rows)).all()
            per_table.append(torch.stack([(row_map >= 0).sum(), kept.to(torch.int64)]))
        read = device_sync.host_list(torch.stack(per_table), "growth: rows carried")
        return {t: (count, bool(kept) and plans[t][0] >= old_caps[t]) for t, (count, kept) in zip(mapped, read)}

    def _row_moves(
        self, t: int, old_cap: int, plan: tuple[int, Tensor | None] | None, carried: tuple[int, bool] | None
    ) -> _RowMoves | None:
        """The rows table t carries through a relayout (None: all of them, the same rows).
        ``carried``: ``_carried_rows``' (live rows, kept) of the table (with a row map), read on
        the host already, so that the live rows are found without a sync of their own."""
        if plan is None:
            return None
        m, device, cap_new = self.meta[t], self.device, plan[0]
        live_src = live_dst = torch.zeros(0, dtype=torch.int64, device=device)
        kept = False
        if plan[1] is not None:
            count, kept = carried
            # The count is known: the static form sizes its output without reading the device.
            live_src = torch.nonzero_static(plan[1] >= 0, size=count).squeeze(1)
            live_dst = plan[1].index_select(0, live_src)
            # A growth keeps every live row's number (HashTable.grown): the rows move as one block.
            if not kept:  # written in address order: fewer cache and TLB misses
                live_dst, order = live_dst.sort()
                live_src = live_src.index_select(0, order)
        fallback = torch.arange(m.fallback_rows, dtype=torch.int64, device=device)  # fallback rows: whole
        return _RowMoves(
            live_src,
            live_dst,
            torch.cat([live_src, old_cap + fallback]),
            torch.cat([live_dst, cap_new + fallback]),
            old_cap if kept else 0,
        )
