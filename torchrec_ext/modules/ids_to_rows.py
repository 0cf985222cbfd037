"""Ids to rows: per training batch each table's ids are deduplicated, ids seen often enough admitted
(``admission``), the unseen ones inserted (evicting by the table's policy when full), rows of ids
unseen for ``ttl_steps`` expired, and the rows of new ids initialised (a pure function of seed,
table and id) with cleared optimizer state. In eval nothing is inserted: unseen ids get row -1,
which the kernels read as zeros.

Fallback rows (a config's ``fallback_rows=K``): K rows of the table's storage after its capacity
rows, which the index never hands out. A distinct id without a row (-1 above) reads row
``capacity + hashing.fallback_slots(id)`` instead, in training and eval; the distinct ids reading
one fallback row are merged into one unique row of the lookup, so the fused update takes one step
of that row on their summed gradient, with its own optimizer state, as for any row.

On CPU, when a backward will follow, new rows are not written by the lookup but left pending
(``pending_rows.py``: the protocol and its one guard).

A lookup's life ends here too: what its fused update (``lookup_functions.fused_backward``) writes
(``begin_update``: the buffers, the lookup's layout and pending rows) and what follows the update
(``end_update``: pending rows marked written, the delta log, deferred growth). Half-precision rows
are stepped in float32 and written back with stochastic rounding (a pure function of the table's
seed, the id, the element and the optimizer step) unless the table's ``stochastic_rounding`` is off.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch
from torch import Tensor

from torchrec_ext import device_sync, ops
from torchrec_ext.hashing import as_int64, fallback_slots
from torchrec_ext.modules.admission import make_admission
from torchrec_ext.modules.pending_rows import NewRows, pending_rows_written
from torchrec_ext.modules.table_stats import MAX_AGE_BINS, TableCounters
from torchrec_ext.modules.table_storage import TableStorage, allocate_filled
from torchrec_ext.table import FixedInsertResult, HashTable, find_or_insert_tables
from torchrec_ext.vocabulary import INITIALIZER_NAMES, INITIALIZER_PARAM_COUNTS, ROWWISE_STATE, table_words

_SCORED_BY_COUNT = {"lfu", "epoch_lfu"}


class StorageLayout(NamedTuple):
    """The storage's layout as the kernels take it, on its device (``TableStorage.layout`` and
    ``dtype_layout``): each table's first word, dim and first row-wise state row, and the tables'
    storage dtype codes and rounding seeds (each None when not needed). Fixed while a lookup is in
    flight (tables grow only when none is), so the lookup carries it to its kernels."""

    table_offsets: Tensor
    table_dims: Tensor
    state_row_offsets: Tensor
    table_dtypes: Tensor | None
    rounding_seeds: Tensor | None


class RowLookup(NamedTuple):
    """Rows of one batch's ids, and the grouping the fused backward needs.

    rows: the row each id is read from (-1: none, zeros; -2 - j: vector j of its table's
    ``new.vectors``). unique_rows / unique_table: each table's distinct ids' rows and tables,
    tables in order. inverse: each id's index into unique_rows. new: rows still to be written.
    unique_ids: the id of each unique row (stochastic rounding's bits are drawn per id).
    layout: the storage's layout the lookup and update kernels take.
    """

    rows: Tensor
    unique_rows: Tensor
    unique_table: Tensor
    inverse: Tensor
    new: NewRows | None = None
    unique_ids: Tensor | None = None
    layout: StorageLayout | None = None

    @property
    def new_vectors(self) -> list[Tensor]:
        """The blocks the lookup kernels read rows -2 - j from (none when no row is pending)."""
        return self.new.vectors if self.new is not None else []


class UpdateBags(NamedTuple):
    """How the rows of a lookup's output gradient map to its ids: a pooled lookup's bags
    (``offsets`` [F * batch_size + 1], per-sample weights or None, each feature's first output
    column and mean pooling), or, for a sequence lookup, one row per id (``UpdateBags.sequence``)."""

    offsets: Tensor | None
    per_sample_weights: Tensor | None
    feature_col: Tensor
    feature_mean: Tensor
    batch_size: int

    @staticmethod
    def sequence(device: torch.device) -> UpdateBags:
        """A sequence lookup's: no bags, each gradient row is one id's."""
        empty = torch.zeros(0, dtype=torch.int64, device=device)
        return UpdateBags(None, None, empty, empty.bool(), 0)


class FusedUpdate(NamedTuple):
    """One fused update's target (``DynamicTables.begin_update``): the buffers it steps and their
    layout, the lookup's unique rows this rank steps (-1: none, such as replicated fallback rows,
    which ``end_update`` steps), the optimizer and its step, the lookup's pending rows as
    ``ops.fused_update`` takes them (``NewRows.update_args``), the storage dtypes and
    rounding seeds, and what ``end_update`` needs."""

    weights: Tensor
    states: list[Tensor]
    table_offsets: Tensor
    table_dims: Tensor
    state_row_offsets: Tensor
    unique_rows: Tensor
    optimizer: int
    step: int
    pending: tuple
    table_dtypes: Tensor | None
    rounding_seeds: Tensor | None
    new: NewRows | None  # marked written by end_update
    replicated_sum: Tensor | None  # the ranks' summed fallback gradients (None: none replicated)


class IdsToRows:
    """The ids -> rows part of ``DynamicTables``: one index per table, admission, TTL, the lookup of
    a batch, the new rows it initialises and the pending ones it defers (see the module
    docstring)."""

    def _build_indexes(self, carry_from: torch.device | None = None) -> None:
        device = self.device
        if device.type == "meta":
            self.indexes = [None] * len(self.meta)
            self.last_seen = [None] * len(self.meta)
            self.admission = [None] * len(self.meta)
            self.counters = None
            return
        if carry_from is not None and carry_from.type != "meta":
            # A move carries the indexes, the rows' ttl state, the admission sightings and the
            # counters, each allocated once on the new device (a fresh last_seen would read every
            # row as unseen since step 0: expired, its trained values dropped).
            self.indexes = [index.clone(device) for index in self.indexes]  # arrays copied: no rebuild
            self.last_seen = [None if seen is None else seen.to(device) for seen in self.last_seen]
            self.admission = [None if a is None else a.moved(device) for a in self.admission]
            self.counters = self.counters.to(device)
            return
        self.indexes = [self._new_index(m) for m in self.meta]
        self.last_seen = [
            torch.zeros(m.capacity, dtype=torch.int64, device=device) if m.ttl_steps else None for m in self.meta
        ]
        self.admission = [make_admission(m.options, m.admission, m.max_capacity, m.seed, device) for m in self.meta]
        # Ages of evicted rows, in steps since last read: known where last_seen is kept (ttl_steps),
        # and then bounded by about twice the ttl (older rows are swept), the last bin holding the rest.
        self.counters = TableCounters(
            len(self.meta),
            [None if m.ttl_steps is None else min(2 * m.ttl_steps + 2, MAX_AGE_BINS) for m in self.meta],
            device,
        )

    def _new_index(self, m) -> HashTable:
        """Table ``m``'s index on the tables' device, empty."""
        return HashTable(m.capacity, policy=m.policy, device=self.device, mapped_rows=m.may_grow)

    def check_ready(self, where: str) -> None:
        if self.device.type == "meta":
            raise RuntimeError(
                f"{where}: the module is on the meta device; materialise it first "
                "(module.to_empty(device=...) then module.reset_parameters())"
            )

    @pending_rows_written
    def lookup(self, ids: Tensor, segment_offsets: Tensor, training: bool, backward_follows: bool = False) -> RowLookup:
        """Rows of ``ids``, table t's ids being ``ids[segment_offsets[t]:segment_offsets[t+1]]``.

        backward_follows: the caller will run the fused update on this lookup, which may then
        write the new rows (CPU; see ``NewRows``) instead of the lookup writing them now.
        """
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
        deferred = training and backward_follows and self.defer_new_rows and self.device.type == "cpu"
        batched = training and not exporting and self._batched_upsert()  # all tables' upserts in one call
        if deferred:  # (its NewRows built at once for all tables, after the upserts: _defer_tables)
            most = unique.numel() * self._widest
            if self._new_vector_buffer.numel() < most:
                self._new_vector_buffer = allocate_filled(
                    max(most, 2 * self._new_vector_buffer.numel()), 0.0, self.device
                )
        flat = training and not deferred and not exporting and self._flat_init()  # all tables' rows in one call
        table_of = torch.arange(len(self.meta), device=ids.device)
        unique_table = torch.repeat_interleave(
            table_of, unique_offsets[1:] - unique_offsets[:-1], output_size=unique.numel()
        )
        if batched:
            unique_rows, inserted = self._rows_for_tables(unique, counts, bounds, unique_table)
        else:  # each table writes its rows into its slice of one buffer (no concatenation after)
            unique_rows = torch.empty_like(unique)
            inserted = torch.zeros_like(unique, dtype=torch.bool) if training else None  # for the table counters
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
                into = unique_rows[start:end]
                if exporting:  # (torch 2.11's export gives each slice of symbolic bounds a size of its own)
                    torch._check(rows.shape[0] == into.shape[0])
                into.copy_(rows)
                if fresh is not None:
                    inserted[start:end] = fresh
        new = self._defer_tables(unique_rows, inserted, unique, unique_table) if deferred else None
        if training and not flat and not deferred:  # each table's new rows written now
            for t, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
                if exporting or end > start:  # (bounds are symbolic when exporting: checked in the loop above)
                    self._initialise(t, unique_rows[start:end], inserted[start:end], unique[start:end])
        if flat:
            self._initialise_tables(unique_rows, inserted, unique, unique_table)
        if training and not exporting:
            self.counters.count_batch(unique_rows, inserted, unique_table, counts)
        unique_ids = unique
        if self.fallback_layout is not None:
            unique_rows, unique_table, inverse, unique_ids = self._read_fallback(
                unique, unique_rows, unique_table, inverse
            )
        unique_ids = unique_ids if self.rounding_seeds is not None else None
        layout = StorageLayout(*self._on_device()[:5])
        if new is None:
            result = RowLookup(unique_rows[inverse], unique_rows, unique_table, inverse, None, unique_ids, layout)
        else:
            self._new_rows = new
            read_from = new.read_rows(unique_rows)
            result = RowLookup(read_from[inverse], unique_rows, unique_table, inverse, new, unique_ids, layout)
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

    # ------------------------------------------------------------------ the lookup's fused update

    def begin_update(self, grad: Tensor, lookup: RowLookup, bags: UpdateBags) -> FusedUpdate:
        """What the fused update of ``lookup`` (``lookup_functions.fused_backward``) writes and with
        what: counts the optimizer step, and sums the replicated fallback rows' gradients over
        the ranks first (those rows step in ``end_update``)."""
        if self.optimizer is None:
            raise RuntimeError(
                "dynamic embedding backward: no fused optimizer; pass optimizer=... to the module or call "
                "torchrec.optim.apply_optimizer_in_backward(cls, module.parameters(), kwargs) before training"
            )
        self.optimizer_step += 1
        table_offsets, table_dims, state_row_offsets, table_dtypes, rounding_seeds = lookup.layout
        new = lookup.new if lookup.new is not None and not lookup.new.written else None
        unique_rows, summed = lookup.unique_rows, None
        if self.replicated_fallback is not None:  # those rows step in end_update, on the ranks' summed gradient
            replicated, summed = self._sum_replicated_fallback_gradients(grad, lookup, *bags)
            unique_rows = unique_rows.masked_fill(replicated, -1)
        return FusedUpdate(
            self.weights,
            self.states,
            table_offsets,
            table_dims,
            state_row_offsets,
            unique_rows,
            self.optimizer.kind_id,
            int(self.optimizer_step),
            ((), None, ()) if new is None else new.update_args(self._initial_state_values()),
            table_dtypes,
            rounding_seeds,
            new,
            summed,
        )

    def end_update(self, lookup: RowLookup, update: FusedUpdate, hyperparams: tuple[float, ...]) -> None:
        """After the fused update of ``lookup``: its pending rows are written, the delta log told,
        the replicated fallback rows stepped, and growths put off while it was pending run."""
        if update.new is not None:
            update.new.written = True
        if self.delta_log is not None:
            self.delta_log.updated(update.unique_rows, lookup.unique_table)
        if update.replicated_sum is not None:
            self._step_replicated_fallback(update.replicated_sum, hyperparams)
        done = self._pending.get(id(lookup.unique_rows))
        if done is not None:
            done()
            if self.pending_backward == 0 and getattr(self, "_growth_deferred", False):
                self._growth_deferred = False
                self.grow()  # growths put off while this update was pending

    def _read_fallback(
        self, unique: Tensor, unique_rows: Tensor, unique_table: Tensor, inverse: Tensor
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Unique ids without a row (-1) of tables with fallback rows read their fallback row
        instead. The uniques reading one fallback row are merged into the first of them, since
        the fused update steps each unique row once: (unique_rows, unique_table, inverse,
        unique_ids) after the merge, the id of a fallback row being its slot (stochastic
        rounding draws its bits per row, whichever ids read it). The uniques keep their places,
        so the pending rows' ``NewRows.unique_new`` still holds (no id reading a fallback row is new)."""
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
        if new is not None:
            new.write(self._init_view)

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

    def _rows_for_tables(
        self, unique: Tensor, counts: Tensor, bounds: list[int], unique_table: Tensor
    ) -> tuple[Tensor, Tensor]:
        """``_rows_for`` of every table in training, their upserts in one call
        (``find_or_insert_tables``: launches independent of the table count on a GPU): the rows
        of all distinct ids and which are new (rows to initialise)."""
        pending = None
        # (comprehensions, not a method call per table: the tables that need work of their own)
        admitting = [t for t, a in enumerate(self.admission) if a is not None]
        for t in admitting:
            start, end = bounds[t], bounds[t + 1]
            candidates = self._admit(t, unique[start:end], counts[start:end])
            if pending is None:
                pending = torch.ones_like(unique, dtype=torch.bool)
            pending[start:end] = candidates
        scored = any([m.policy in _SCORED_BY_COUNT for m in self.meta])  # noqa: C419 (the others ignore scores)
        result = find_or_insert_tables(self.indexes, unique, bounds, counts if scored else None, pending)
        self.counters.count_evicted_tables(unique_table, result.evicted)
        rows, inserted = result.rows, result.inserted
        ttl = [t for t, m in enumerate(self.meta) if m.ttl_steps is not None]
        if self.delta_log is None:
            if ttl:  # every ttl table's expiry at once; the sweeps (every ttl_steps steps) table by table
                inserted = self._expire_tables(unique_table, result)
            for t in ttl:
                if self.train_step % self.meta[t].ttl_steps == 0:
                    self._erase_expired(t)
            return rows, inserted
        for t in range(len(self.meta)):  # the delta log lists each table's rows: table by table
            start, end = bounds[t], bounds[t + 1]
            part = FixedInsertResult(*(x[start:end] for x in result))
            rows[start:end], inserted[start:end] = self._after_upsert(t, unique[start:end], part, counted=True)
        return rows, inserted

    def _expire_tables(self, unique_table: Tensor, result: FixedInsertResult) -> Tensor:
        """``_after_upsert``'s ttl work of every table at once (the batched upsert's, without a
        delta log): evicted rows' ages counted, rows unseen for more than ttl_steps expired (their
        ids take new rows), every live row seen now. Returns which rows are new (to initialise)."""
        last_seen, layout = self._ttl_layout()
        start, last, ttl = layout.index_select(0, unique_table).unbind(1)
        live = result.rows >= 0
        at = torch.minimum(start + result.rows.clamp(min=0), last)  # (the sink for tables without ttl)
        seen = last_seen.index_select(0, at)
        self.counters.count_evicted_ages_tables(unique_table, result.evicted, self.train_step - seen)
        expired = live & ~result.inserted & (seen < self.train_step - ttl)
        self.counters.count_expired_tables(unique_table, expired)
        # Seen now: a max with the step (0 where no row) sets the live rows without a mask index.
        last_seen.scatter_reduce_(0, at, torch.where(live, self.train_step, 0), "amax")
        return result.inserted | expired

    def _ttl_layout(self) -> tuple[Tensor, Tensor]:
        """Every ttl table's ``last_seen`` as a view of one flat tensor that ends in a sink (read
        and written by the keys of tables without ttl), and per table [T, 3] on the device: its
        first and last entries in it (the sink for tables without ttl) and its ttl (beyond any
        step for those). Laid out again when a table's ``last_seen`` was replaced (a growth, a
        load) since."""
        cached = self.__dict__.get("_ttl_flat")
        if cached is not None and all([a is b for a, b in zip(cached[2], self.last_seen)]):  # noqa: C419
            return cached[:2]
        sizes = [0 if seen is None else seen.numel() for seen in self.last_seen]
        sink = sum(sizes)
        flat = torch.zeros(sink + 1, dtype=torch.int64, device=self.device)
        layout = []
        for t, (seen, m) in enumerate(zip(self.last_seen, self.meta)):
            if seen is None:
                layout.append([sink, sink, 1 << 62])
                continue
            first = sum(sizes[:t])
            self.last_seen[t] = flat[first : first + sizes[t]].copy_(seen)
            layout.append([first, first + sizes[t] - 1, m.ttl_steps])
        self._ttl_flat = (flat, torch.tensor(layout, dtype=torch.int64, device=self.device), list(self.last_seen))
        return self._ttl_flat[:2]

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

    # Training-only and data-dependent throughout (which ids are new): run eagerly under torch.compile.
    @torch.compiler.disable
    def _initialise(self, t: int, rows: Tensor, fresh: Tensor, keys: Tensor) -> None:
        """The rows of table t's new ids (``fresh``), written now: their initial vectors and
        optimizer state (rows of -1 are skipped by init_rows: no mask-and-gather of the new ids)."""
        m = self.meta[t]
        table, states, fills = self._init_view(t)
        ops.init_rows(table, torch.where(fresh, rows, -1), keys, m.seed, m.init_kind, m.init_params, states, fills)

    @torch.compiler.disable
    def _defer_tables(self, unique_rows: Tensor, inserted: Tensor, unique: Tensor, unique_table: Tensor) -> NewRows:
        """The new ids (``inserted``) of every table, deferred (CPU): their initial vectors drawn
        into the scratch block, tables back to back, by the C++ kernel table by table (a
        composite over all tables draws them 1.5-4x slower on CPU); everything else (numbering
        each table's new ids, their blocks, rows and ids) in a few ops for all tables."""
        which = inserted.nonzero().squeeze(1)  # CPU tensors only (lookup defers on CPU only)
        table = unique_table.index_select(0, which)
        per_table = torch.bincount(table, minlength=len(self.meta))
        counts = per_table.tolist()
        first = torch.cumsum(per_table, 0) - per_table
        slots = torch.arange(which.numel(), device=which.device) - first.index_select(0, table)
        unique_new = torch.full_like(unique, -1).index_put_((which,), slots)
        words = [table_words(n, m.dim, m.dtype) for n, m in zip(counts, self.meta)]
        blocks = torch.split(self._new_vector_buffer[: sum(words)], words)
        vectors = [
            (b if m.dtype == torch.float32 else b.view(m.dtype)[: n * m.dim]).view(n, m.dim)
            for b, n, m in zip(blocks, counts, self.meta)
        ]
        ids, rows = unique.index_select(0, which), unique_rows.index_select(0, which)
        for t, (v, s, i) in enumerate(zip(vectors, torch.split(slots, counts), torch.split(ids, counts))):
            if counts[t]:
                m = self.meta[t]
                ops.init_rows(v, s, i, m.seed, m.init_kind, m.init_params)
        return NewRows(vectors=vectors, rows=list(torch.split(rows, counts)), unique_new=unique_new)

    def _flat_init(self) -> bool:
        """Whether a training lookup writes every table's new rows in one call (``flat_init``:
        None, the default, on GPUs, where per-table calls cost launches per table). Only where
        the rows live in the flat buffer itself (a subclass keeping them elsewhere overrides
        ``_init_view``)."""
        if type(self)._init_view is not TableStorage._init_view:
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
        if type(self)._rows_for is not IdsToRows._rows_for or not self.indexes:
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
            dense = torch.tensor(self.dense_state_offsets, dtype=torch.int64, device="cpu")
            self._device_layout[key] = (
                torch.tensor([as_int64(m.seed) for m in self.meta], dtype=torch.int64, device=self.device),
                torch.tensor([m.init_kind for m in self.meta], dtype=torch.int64, device=self.device),
                torch.tensor(
                    [list(m.init_params) + [0.0] * (4 - len(m.init_params)) for m in self.meta],
                    dtype=torch.float64,
                    device=self.device,
                ),
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
