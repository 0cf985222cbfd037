"""A tiered module's cache maps on the cache's device, so that a cache hit never leaves it.

``RowCache`` (tiered_tables.py) keeps a table's maps on the host: a GPU lookup then brings every
table's rows to the host and does each table's bookkeeping there (~1-1.5 ms a table a step on an
H100's host). ``DeviceSlotMaps`` keeps the maps of all the module's tables on the cache's device,
in flat tensors (table t's rows at ``row_base[t]``, its slots at ``slot_base[t]``), so that a lookup
does the same few tensor calls whatever the table count:

- ``slot_of`` (row -> slot, -1: not cached), ``row_of`` (slot -> row, -1: empty), ``last_used``
  (each slot's clock: least recently used goes first) and ``dirty`` (newer than the backing store);
- each table's free slots, a stack (``free_stack``, mirrored on the host in ``free_host``: a
  pop's slots are known there without a read; its height ``free_count`` known on the host, as
  every change of it is);
- pins: per lookup in flight, its slots (one tensor for all tables), made a mask when a slot is
  to be taken;
- one spare entry after each map: masked-off scatters write there, so no scatter compacts
  its indices (a compaction reads its size on the host).

A lookup (``hold``): slots = slot_of[rows]; the rows without a slot counted per table, and those
to read (misses), in one small read on the host (the lookup's one sync of the tier). The hits are
touched, and when no table misses and each table's free stack holds its new rows, those take
free slots by a device scatter (``_take_free``): nothing else reaches the host. The tables with
misses, or out of free slots, take the host path together (``_fill``): their missing rows to the
host in one read, victims the least recently used unpinned slots not used at this clock (a
``topk`` over each table's clocks, all tables' victims read in one), dirty victims written back
and misses read through each table's mover (tier_copies.py's records on a GPU: all tables'
write-backs in one copy to the host, their reads in one copy to the device). ``stage`` (the
pipeline's stage on its worker, a side stream on a GPU) brings the next batch's rows in and
frees slots for its new rows the same way, so that the next lookup takes the fast path: one
read of all tables' missing rows, one of all evicting tables' victims, and one wait for all
tables' write-backs' copy.

LFU (a table's ``cache_algorithm="lfu"``): each row of such a table counts the lookups that held
it (``uses``, per row of the table, not per slot, so a hot row keeps its count across its
evictions, as fbgemm's LFU cache counts per row; a row new to its id starts again at 1). The
counts saturate at ``LFU_MAX_COUNT`` (2**24 - 1, fbgemm's LFU counter bits) and are not decayed:
the tier serves a training job over one id distribution, where a decayed count would only
forget the hot rows it has to keep (a drifting distribution is what LRU is for). The victims are
then the unpinned slots with the fewest uses, ties by least recent use: the same ``topk`` over
the key ``uses << 32 | last_used``. Lookups count, stages do not (the lookup after them will).

Exact as ``RowCache``: which rows a table holds and where is invisible to the outputs; rows of a
batch in flight are pinned (never a victim) until its update lands; a victim's dirty row is
written back before its slot is refilled; the counters (hits, misses, staged, write-backs,
bytes) count the same events. Victims among slots of one clock may differ from ``RowCache``'s
(``topk`` leaves ties in any order): only which rows move, never a value.
"""

from __future__ import annotations

import torch
from torch import Tensor

from torchrec_ext import device_sync

_NEVER = torch.iinfo(torch.int32).max  # the clock of a slot that must not be taken
_NEVER_KEY = torch.iinfo(torch.int64).max  # an LFU key (uses << 32 | clock) that must not be taken
LFU_MAX_COUNT = (1 << 24) - 1  # an LFU count saturates here (fbgemm's LFU counter bits)
_SLOT_BYTES = 8 + 4 + 4 + 4 + 1  # row_of, last_used, free_stack, free_host, dirty


class TableSlots:
    """Table t's share of ``DeviceSlotMaps``: its counters (as ``RowCache``'s) and the per-table
    operations (flush, forget, room)."""

    def __init__(self, maps: DeviceSlotMaps, t: int, capacity: int, slots: int, lfu: bool = False):
        self.maps, self.t, self.capacity, self.slots, self.lfu = maps, t, capacity, slots, lfu
        self.hits = self.misses = self.write_backs = self.bytes_moved = 0
        self.staged = self.staged_write_backs = 0

    @property
    def row_of(self) -> Tensor:
        """slot -> row of this table (a view)."""
        base = self.maps.slot_base_host[self.t]
        return self.maps.row_of[base : base + self.slots]

    @property
    def slot_of(self) -> Tensor:
        """row -> slot of this table (a view)."""
        base = self.maps.row_base_host[self.t]
        return self.maps.slot_of[base : base + self.capacity]

    @property
    def pinned(self) -> dict[int, Tensor]:
        return self.maps.pinned

    def nbytes(self) -> int:
        """The table's share of the maps' bytes: slot_of (int32 a row); row_of (int64 a slot),
        last_used and the free stack and its host mirror (int32), dirty (a byte); the first table's share also holds
        the maps' spare entries, their per-table offsets and the pins in flight."""
        own = (8 if self.lfu else 4) * self.capacity + _SLOT_BYTES * self.slots
        return own + (self.maps.nbytes() - self.maps.own_bytes() if self.t == 0 else 0)

    def pinned_mask(self) -> Tensor | None:
        """The slots of this table batches in flight hold (None: none held), as ``RowCache``'s."""
        mask = self.maps.pinned_mask()
        base = self.maps.slot_base_host[self.t]
        return None if mask is None else mask[base : base + self.slots]

    def pinned_at_most(self) -> int:
        return sum(counts[self.t] for counts in self.maps.pin_counts.values())

    def unpin(self, token: int) -> None:
        self.maps.unpin(token)

    def flush(self, mover, home: bool = True) -> None:
        self.maps.flush(self.t, mover, home)

    def forget(self) -> None:
        self.maps.forget(self.t)


class DeviceSlotMaps:
    """The cache maps of a module's tables on ``device`` (see the module docstring)."""

    # The maps' tensors on the device (``uses``, LFU's counts, only when a table has LFU).
    _DEVICE_TENSORS = ("row_base", "slot_base", "slot_of", "row_of", "last_used", "dirty", "free_stack", "free_top")

    def __init__(
        self, capacities: list[int], slots: list[int], device: torch.device, algorithms: list[str | None] | None = None
    ):
        self.device = torch.device(device)
        self.row_base_host = [0]
        self.slot_base_host = [0]
        for c, s in zip(capacities, slots):
            self.row_base_host.append(self.row_base_host[-1] + c)
            self.slot_base_host.append(self.slot_base_host[-1] + s)
        self.total_rows, self.total_slots = self.row_base_host.pop(), self.slot_base_host.pop()
        lfu = [a == "lfu" for a in algorithms or [None] * len(capacities)]
        self.tables = [TableSlots(self, t, c, s, f) for t, (c, s, f) in enumerate(zip(capacities, slots, lfu))]
        self.any_lfu = any(lfu)
        # Each LFU table's first entry in ``uses`` (its rows' counts, LFU tables only); an LRU
        # table's: the spare entry after them (counted into, never read).
        self.lfu_rows = sum(c for c, f in zip(capacities, lfu) if f)
        self.uses_base_host, first = [], 0
        for c, f in zip(capacities, lfu):
            self.uses_base_host.append(first if f else self.lfu_rows)
            first += c if f else 0
        self.pinned: dict[int, Tensor] = {}  # pin token -> the lookup's slots (global; the spare entry for none)
        self.pin_counts: dict[int, list[int]] = {}  # pin token -> slots it holds per table
        self._next_pin = 0
        self._allocate()

    def _allocate(self) -> None:
        device = self.device
        self.row_base = torch.tensor(self.row_base_host, dtype=torch.int64, device=device)
        self.slot_base = torch.tensor(self.slot_base_host, dtype=torch.int64, device=device)
        self.slot_of = torch.full((self.total_rows + 1,), -1, dtype=torch.int32, device=device)
        self.row_of = torch.full((self.total_slots + 1,), -1, dtype=torch.int64, device=device)
        self.last_used = torch.zeros(self.total_slots + 1, dtype=torch.int32, device=device)  # (2**31 steps)
        self.dirty = torch.zeros(self.total_slots + 1, dtype=torch.bool, device=device)
        # LFU: lookups per row of the LFU tables (none without one)
        self.uses = torch.zeros(self.lfu_rows + 1, dtype=torch.int32, device=device) if self.any_lfu else None
        self.uses_base = torch.tensor(self.uses_base_host, dtype=torch.int64, device=device) if self.any_lfu else None
        # Each table's free slots (its own slot numbers) in its segment, bottom first.
        self.free_host = torch.cat(
            [torch.arange(t.slots, dtype=torch.int32, device="cpu") for t in self.tables] or [self._none()]
        )
        self.free_stack = self.free_host.to(device, copy=True)
        self.free_count = [t.slots for t in self.tables]
        self.free_top = torch.tensor(self.free_count, dtype=torch.int64, device=device)

    def nbytes(self) -> int:
        """Bytes of all the maps' tensors (and of the pins in flight)."""
        held = [getattr(self, name) for name in self._DEVICE_TENSORS] + [self.free_host] + list(self.pinned.values())
        held += [self.uses, self.uses_base] if self.uses is not None else []
        return sum(t.numel() * t.element_size() for t in held)

    def own_bytes(self) -> int:
        """Bytes of the tables' own entries (``TableSlots.nbytes`` without the first one's extra)."""
        return 4 * (self.total_rows + self.lfu_rows) + _SLOT_BYTES * self.total_slots

    @staticmethod
    def _none() -> Tensor:
        return torch.zeros(0, dtype=torch.int32, device="cpu")

    def to(self, device: torch.device) -> None:
        """Moves the maps to ``device`` (the cache moved)."""
        self.device = torch.device(device)
        for name in self._DEVICE_TENSORS:
            setattr(self, name, getattr(self, name).to(self.device))
        if self.uses is not None:
            self.uses, self.uses_base = self.uses.to(self.device), self.uses_base.to(self.device)
        self.pinned = {k: v.to(self.device) for k, v in self.pinned.items()}

    def __getstate__(self) -> dict[str, object]:
        return dict(self.__dict__, pinned={}, pin_counts={})  # a copy has no batch in flight

    # ------------------------------------------------------------------ pins

    def pin(self, slots: Tensor, counts: list[int]) -> int:
        """Holds ``slots`` (global, the spare entry for none; ``counts`` of them per table) until ``unpin``."""
        self._next_pin += 1
        self.pinned[self._next_pin] = slots
        self.pin_counts[self._next_pin] = counts
        return self._next_pin

    def unpin(self, token: int) -> None:
        self.pinned.pop(token, None)  # gone already when the cache was emptied since
        self.pin_counts.pop(token, None)

    def pinned_mask(self) -> Tensor | None:
        """The slots batches in flight hold, a mask over all slots (None: none held)."""
        if not self.pinned:
            return None
        mask = torch.zeros(self.total_slots + 1, dtype=torch.bool, device=self.device)
        for slots in self.pinned.values():
            mask.index_fill_(0, slots, True)
        return mask

    # ------------------------------------------------------------------ a lookup

    def hold(
        self,
        rows: Tensor,
        fresh: Tensor | None,
        table_of: Tensor,
        segments: list[tuple[int, int, int]],
        modifies: bool,
        clock: int,
        movers,
    ) -> tuple[Tensor, int]:
        """The cache slots of ``rows`` (each table's rows, distinct within it; -1: none), table
        t's at ``segments`` (t, start, end), ``table_of`` the table of each, missing ones
        brought in, pinned (the token returned). ``fresh``: rows new to their id (initialised in
        their slot, not read); ``modifies``: the batch's update writes every row (else only the
        fresh ones are written: dirty)."""
        tables = len(self.tables)
        live = rows >= 0
        at_row = self.row_base.index_select(0, table_of) + rows.clamp(min=0)
        if self.uses is not None:
            self._count_uses(live, rows, table_of, fresh)
        slots = torch.where(live, self.slot_of.index_select(0, at_row).to(torch.int64), -1)
        need = live & (slots < 0)
        read = need if fresh is None else need & ~fresh
        flags = torch.stack([live, need, read]).to(torch.int64)
        counts = torch.zeros(3, tables, dtype=torch.int64, device=rows.device).index_add_(1, table_of, flags)
        lives, needs, reads = device_sync.host_list(counts, "tiered tables: rows without a cache slot")
        base = self.slot_base.index_select(0, table_of)
        spare = self.total_slots
        slow = [t for t, _, _ in segments if reads[t] or needs[t] > self.free_count[t]]
        fast = [t for t, _, _ in segments if needs[t] and t not in slow]
        for t, _, _ in segments:
            self.tables[t].hits += lives[t] - needs[t]
        if slow:  # the batch's hits are used now (first: victims are slots last used before this clock)
            self.last_used.index_fill_(0, torch.where(slots >= 0, base + slots, spare), clock)
            self._fill({t: needs[t] for t in slow}, rows, fresh, slots, table_of if fast else None, clock, movers)
        if fast:  # the other tables' new rows take free slots, on the device
            self._take_free(rows, at_row, table_of, base, slots)
            for t in fast:
                self.free_count[t] -= needs[t]
        at = torch.where(slots >= 0, base + slots, spare)
        self.last_used.index_fill_(0, at, clock)  # (the hits again, the new rows' slots)
        if modifies:
            self.dirty.index_fill_(0, at, True)
        elif fresh is not None:
            self.dirty.index_fill_(0, torch.where(fresh, at, spare), True)
        return slots, self.pin(at, lives)

    def _count_uses(self, live: Tensor, rows: Tensor, table_of: Tensor, fresh: Tensor | None) -> None:
        """LFU: one more lookup of each live row (distinct within its table) of an LFU table,
        saturating; a row new to its id starts at 1. (The LRU tables' rows count into the spare
        entry: never read.)"""
        base = self.uses_base.index_select(0, table_of)
        at = torch.where(live & (base < self.lfu_rows), base + rows.clamp(min=0), self.lfu_rows)
        more = self.uses.index_select(0, at).add_(1).clamp_(max=LFU_MAX_COUNT)
        if fresh is not None:
            more = torch.where(fresh, 1, more).to(torch.int32)
        self.uses.index_copy_(0, at, more)

    def _victim_keys(self, t: int, key: Tensor) -> Tensor:
        """Table t's victim keys: its slice of ``key`` (clocks, ``_NEVER``: not to be taken); an
        LFU table's as int64 ``uses << 32 | clock`` (fewest uses first, then least recent)."""
        base, n = self.slot_base_host[t], self.tables[t].slots
        part = key[base : base + n]
        if not self.tables[t].lfu:
            return part
        rows = self.row_of[base : base + n].clamp(min=0) + self.uses_base_host[t]
        uses = self.uses.index_select(0, rows).to(torch.int64)
        return torch.where(part == _NEVER, _NEVER_KEY, (uses << 32) | part.to(torch.int64))

    def _take_free(self, rows: Tensor, at_row: Tensor, table_of: Tensor, base: Tensor, slots: Tensor) -> None:
        """The rows without a slot take their table's free slots, from the top of its stack: all
        on the device (the caller checked that each table's stack holds them). They are all new
        to their ids (no miss takes this path): ``hold`` marks them dirty and used."""
        need = (rows >= 0) & (slots < 0)
        wanted = need.to(torch.int64)
        per_table = torch.zeros_like(self.free_top).index_add_(0, table_of, wanted)
        first = per_table.cumsum(0) - per_table  # each table's first entry in the running count
        rank = wanted.cumsum(0) - wanted - first.index_select(0, table_of)
        top = self.free_top.index_select(0, table_of)
        taken = self.free_stack.index_select(0, torch.where(need, base + top - 1 - rank, 0)).to(torch.int64)
        slots.copy_(torch.where(need, taken, slots))
        at = torch.where(need, base + taken, self.total_slots)
        self.row_of.index_copy_(0, at, rows)
        self.slot_of.index_copy_(0, torch.where(need, at_row, self.total_rows), taken.to(torch.int32))
        self.free_top.sub_(per_table)

    def _fill(
        self,
        needs: dict[int, int],
        rows: Tensor,
        fresh: Tensor | None,
        slots: Tensor,
        table_of: Tensor | None,
        clock: int,
        movers,
    ) -> None:
        """The host path of the rows without a slot of the tables ``needs`` (table -> how many):
        free slots first, then the least recently used (written back when dirty), all tables'
        in one ``_vacate``; misses read from the backing store. All tables' rows to the host in
        one read. Fills ``slots`` in place. ``table_of``: the table of each row, when other
        tables' rows without a slot take the fast path (None: no other table's)."""
        total = sum(needs.values())
        need = (rows >= 0) & (slots < 0)
        if table_of is not None:
            chosen = torch.zeros(len(self.tables), dtype=torch.bool, device="cpu")
            chosen[list(needs)] = True
            need &= device_sync.to_device(chosen, self.device).index_select(0, table_of)
        # Their positions, in order (tables in order), without a read: their count is known.
        rank = torch.where(need, need.cumsum(0) - 1, total)
        at = torch.zeros(total + 1, dtype=torch.int64, device=rows.device)
        at = at.index_copy_(0, rank, torch.arange(rows.numel(), device=rows.device))[:total]
        new = torch.zeros_like(at) if fresh is None else fresh.index_select(0, at).to(torch.int64)
        host = device_sync.to_host(torch.stack([rows.index_select(0, at), new]), "tiered tables: rows to read")
        shorts = {t: n - self.free_count[t] for t, n in needs.items() if n > self.free_count[t]}
        if shorts:
            self._vacate(shorts, clock, movers, self.pinned_mask(), ahead=False)
        for t, n in needs.items():
            if self.free_count[t] < n:  # TieredTables.lookup checked the room first
                raise RuntimeError(
                    f"tiered table cache: {n} rows to bring in, {self.free_count[t]} slots free of {self.tables[t].slots}"
                )
        taken, taken_host = self._take_slots(
            {t: host[0][first : first + n] for t, first, n in self._parts(needs)}, clock
        )
        slots.index_copy_(0, at, taken)
        misses = []
        for t, first, n in self._parts(needs):
            read = host[1][first : first + n] == 0
            if bool(read.any()):
                misses.append((t, taken_host[t][read], host[0][first : first + n][read]))
        try:
            _read(misses, movers)
        except BaseException:
            # A failed read (any table, any round) must not leave slots assigned but unfilled:
            # every slot taken here goes back, so later lookups miss and read again.
            self._give_back({t: (host[0][first : first + n], taken_host[t]) for t, first, n in self._parts(needs)})
            raise
        for t, _, rows in misses:  # (counted once read: rows given back were not)
            self.tables[t].misses += rows.numel()
            self.tables[t].bytes_moved += rows.numel() * movers[t].row_bytes

    def _give_back(self, held: dict[int, tuple[Tensor, Tensor]]) -> None:
        """Undoes ``_take_slots``: each table t's (rows, slots) of ``held`` (its own numbers, host
        tensors) forgotten (no row in them, no slot for the rows, clean) and the slots back on top
        of its free stack, in the order they were taken."""
        rows = torch.cat([r + self.row_base_host[t] for t, (r, _) in held.items()])
        slots = torch.cat([s + self.slot_base_host[t] for t, (_, s) in held.items()])
        at_row, at = device_sync.to_device(torch.stack([rows, slots]), self.device)
        self.slot_of.index_fill_(0, at_row, -1)
        self.row_of.index_fill_(0, at, -1)
        self.dirty.index_fill_(0, at, False)
        self._push_free({t: s for t, (_, s) in held.items()})

    @staticmethod
    def _parts(counts: dict[int, int]) -> list[tuple[int, int, int]]:
        """(table, first, count) of each table's part of entries laid out tables in order."""
        parts, first = [], 0
        for t, n in counts.items():
            parts.append((t, first, n))
            first += n
        return parts

    def _take_slots(self, rows: dict[int, Tensor], clock: int) -> tuple[Tensor, dict[int, Tensor]]:
        """Each table t's free slots off the top of its stack for its ``rows[t]`` (its own row
        numbers, a host tensor), which they now hold, clean, used at ``clock``: all tables' in
        one copy to the device. Returns the slots (the tables' own numbers), on the device
        (tables in order) and on the host per table (int64)."""
        taken, slot_base, row_base = {}, [], []
        for t, held in rows.items():
            k, top = held.numel(), self.slot_base_host[t] + self.free_count[t]
            self.free_count[t] -= k
            taken[t] = self.free_host[top - k : top].to(torch.int64)
            slot_base.append(self.slot_base_host[t])
            row_base.append(self.row_base_host[t])
        counts = torch.tensor([held.numel() for held in rows.values()], device="cpu")
        own_slots, own_rows = torch.cat(list(taken.values())), torch.cat(list(rows.values()))
        bases = torch.tensor([slot_base, row_base], device="cpu").repeat_interleave(counts, dim=1)
        host = torch.stack([own_slots, own_slots + bases[0], own_rows, own_rows + bases[1]])
        device = device_sync.to_device(
            torch.cat([host.view(-1), torch.tensor(self.free_count, device="cpu")]), self.device
        )
        own_slot, at, own_row, at_row = device[: host.numel()].view(4, -1)
        self.free_top.copy_(device[host.numel() :])
        self.row_of.index_copy_(0, at, own_row)
        self.slot_of.index_copy_(0, at_row, own_slot.to(torch.int32))
        self.dirty.index_fill_(0, at, False)
        self.last_used.index_fill_(0, at, clock)
        return own_slot, taken

    def _push_free(self, freed: dict[int, Tensor]) -> None:
        """Each table t's slots ``freed[t]`` (its own numbers, a host tensor) onto its free stack:
        all tables' in one copy to the device."""
        at = []
        for t, host in freed.items():
            top = self.slot_base_host[t] + self.free_count[t]
            self.free_host[top : top + host.numel()] = host
            at.append(torch.arange(top, top + host.numel(), device="cpu"))
            self.free_count[t] += host.numel()
        at, values = torch.cat(at), torch.cat(list(freed.values()))
        device = device_sync.to_device(
            torch.cat([at, values, torch.tensor(self.free_count, device="cpu")]), self.device
        )
        self.free_stack.index_copy_(0, device[: at.numel()], device[at.numel() : 2 * at.numel()].to(torch.int32))
        self.free_top.copy_(device[2 * at.numel() :])

    def _vacate(self, shorts: dict[int, int], clock: int, movers, pinned: Tensor | None, ahead: bool) -> None:
        """Empties up to ``shorts[t]`` of each table t's occupied slots onto its free stack, least
        recently used first, none used at ``clock`` or ``pinned`` (a mask, None: none); dirty rows
        written back (``movers[t]``). The victims chosen on the device (a ``topk`` over each table's
        clocks), all tables' read on the host in one read."""
        total = self.total_slots
        last = self.last_used[:total]
        takeable = (self.row_of[:total] >= 0) & (last < clock)
        if pinned is not None:
            takeable &= ~pinned[:total]
        key = torch.where(takeable, last, _NEVER)
        parts, counts = [], []
        for t, k in shorts.items():
            base, n = self.slot_base_host[t], self.tables[t].slots
            counts.append(min(k, n))
            keys = self._victim_keys(t, key)  # LRU: the clocks; LFU: uses, then clocks
            parts.append(torch.topk(keys, counts[-1], largest=False, sorted=True).indices + base)
        chosen = parts[0] if len(parts) == 1 else torch.cat(parts)
        ok = key.index_select(0, chosen) != _NEVER
        old = self.row_of.index_select(0, chosen)
        back = ok & self.dirty.index_select(0, chosen)
        host = device_sync.to_host(
            torch.stack([chosen, old, back.to(torch.int64), ok.to(torch.int64)]), "tiered tables: slots to evict"
        )
        bases = torch.tensor([[self.slot_base_host[t], self.row_base_host[t]] for t in shorts], device="cpu")
        bases = bases.t().repeat_interleave(torch.tensor(counts, device="cpu"), dim=1)
        at_row = torch.where(ok, old + device_sync.to_device(bases[1], self.device), self.total_rows)
        self.slot_of.index_fill_(0, at_row, -1)
        gone = torch.where(ok, chosen, total)
        self.row_of.index_fill_(0, gone, -1)
        self.dirty.index_fill_(0, gone, False)
        slots, rows, written, kept = host[0] - bases[0], host[1], host[2] == 1, host[3] == 1
        # The maps forgot the victims above: each table's write-back must run even when another
        # table's raises (an OS error writing its store); a table whose write-back raised gets its
        # dirty victims back (``_recache``), else their rows' newest copies would be lost.
        freed, writes, failed = {}, [], []
        for t, first, k in self._parts(dict(zip(shorts, counts))):
            these = slice(first, first + k)
            n = int(written[these].sum())
            if n:
                back = written[these]
                writes.append((t, slots[these][back], rows[these][back]))
                self._count_write_backs(t, n, ahead, movers)
            freed[t] = slots[these][kept[these]]
        _write(writes, movers, failed)  # (before any slot is refilled: the caller's reads come after)
        if failed:
            lost = {t for t, _ in failed}
            unwritten = [(t, s, r) for t, s, r in writes if t in lost or None in lost]
            self._recache(unwritten, ahead, movers)
            for t, held, _ in unwritten:
                freed[t] = freed[t][~torch.isin(freed[t], held)]
        self._push_free(freed)
        if failed:
            raise failed[0][1]

    def _count_write_backs(self, t: int, n: int, ahead: bool, movers) -> None:
        """Table t's counters of ``n`` rows written back (``ahead``: by a stage); n < 0 takes them back."""
        cache = self.tables[t]
        cache.write_backs += n
        if ahead:
            cache.staged_write_backs += n
        cache.bytes_moved += n * movers[t].row_bytes

    def _recache(self, unwritten: list[tuple[int, Tensor, Tensor]], ahead: bool, movers) -> None:
        """Victims whose write-back raised back in their slots as ``_vacate`` found them: each
        (table, slots, rows) of ``unwritten`` (its own numbers, host tensors) holding its rows
        again, dirty (their clocks and LFU counts were left as they were), not counted as
        written back."""
        for t, held, _ in unwritten:
            self._count_write_backs(t, -held.numel(), ahead, movers)
        rows = torch.cat([r for _, _, r in unwritten])
        slots = torch.cat([s for _, s, _ in unwritten])
        counts = torch.tensor([s.numel() for _, s, _ in unwritten], device="cpu")
        bases = torch.tensor(
            [[self.row_base_host[t] for t, _, _ in unwritten], [self.slot_base_host[t] for t, _, _ in unwritten]],
            device="cpu",
        ).repeat_interleave(counts, dim=1)
        own_row, at_row, own_slot, at = device_sync.to_device(
            torch.stack([rows, rows + bases[0], slots, slots + bases[1]]), self.device
        )
        self.slot_of.index_copy_(0, at_row, own_slot.to(torch.int32))
        self.row_of.index_copy_(0, at, own_row)
        self.dirty.index_fill_(0, at, True)

    # ------------------------------------------------------------------ ahead of a lookup

    def stage(
        self,
        rows: Tensor,
        table_of: Tensor,
        segments: list[tuple[int, int, int]],
        pinned: Tensor | None,
        clock: int,
        movers,
        frees_new: bool = True,
    ) -> None:
        """Ahead of a lookup: brings the live ``rows`` (each table's distinct rows; -1: an id
        without a row, which the lookup will give a new one) into the cache and, ``frees_new``,
        frees a slot for each -1 (dirty rows written back), around the slots ``pinned`` (a mask,
        None: none) and those used at ``clock``. Moves data between the tiers only."""
        live = rows >= 0
        at_row = self.row_base.index_select(0, table_of) + rows.clamp(min=0)
        slots = torch.where(live, self.slot_of.index_select(0, at_row).to(torch.int64), -1)
        hit = slots >= 0
        base = self.slot_base.index_select(0, table_of)
        self.last_used.index_fill_(0, torch.where(hit, base + slots, self.total_slots), clock)
        # All tables' missing rows to the host in one read (each row, -1 a hit, -2 an id without a row).
        code = device_sync.to_host(torch.where(live, torch.where(hit, -1, rows), -2), "tiered tables: rows to stage")
        plans, shorts = [], {}
        for t, start, end in segments:
            part = code[start:end]
            missing = part[part >= 0]
            short = missing.numel() + (int((part == -2).sum()) if frees_new else 0) - self.free_count[t]
            if short > 0:
                shorts[t] = short
            plans.append((t, missing))
        if shorts:  # (every table's write-backs before any table's reads)
            self._vacate(shorts, clock, movers, pinned, ahead=True)
        fills = {t: missing[: self.free_count[t]] for t, missing in plans if missing.numel() and self.free_count[t]}
        if not fills:
            return
        _, taken = self._take_slots(fills, clock)
        try:
            _read([(t, taken[t], wanted) for t, wanted in fills.items()], movers)
        except BaseException:
            # As a lookup's failed read (``_fill``): no slot left holding a row it never read (the
            # next lookup would take it for a hit); every slot taken here goes back.
            self._give_back({t: (wanted, taken[t]) for t, wanted in fills.items()})
            raise
        for t, wanted in fills.items():
            cache = self.tables[t]
            cache.staged += wanted.numel()
            cache.bytes_moved += wanted.numel() * movers[t].row_bytes

    # ------------------------------------------------------------------ checkpoints

    def flush(self, t: int, mover, home: bool = True) -> None:
        """Writes table t's dirty rows back (``home``: to the rows file itself, not a log); rows
        held by a batch in flight stay dirty (their update is still to land)."""
        cache = self.tables[t]
        base, n = self.slot_base_host[t], cache.slots
        dirty = self.dirty[base : base + n] & (self.row_of[base : base + n] >= 0)
        at = device_sync.nonzero(dirty, "tiered tables: dirty rows")
        if not at.numel():
            return
        rows = self.row_of[base : base + n].index_select(0, at)
        host = device_sync.to_host(torch.stack([at, rows]), "tiered tables: dirty rows")
        if home:
            mover.write_home(host[0], host[1])
        else:
            mover.write(host[0], host[1], once=True)
        cache.write_backs += at.numel()
        cache.bytes_moved += at.numel() * mover.row_bytes
        pinned = self.pinned_mask()
        keep = torch.zeros_like(at, dtype=torch.bool) if pinned is None else pinned.index_select(0, at + base)
        self.dirty.index_copy_(0, at + base, keep)

    def forget(self, t: int) -> None:
        """Empties table t's cache without writing back (its rows were replaced or reset)."""
        cache = self.tables[t]
        rows, slots = self.row_base_host[t], self.slot_base_host[t]
        self.slot_of[rows : rows + cache.capacity] = -1
        self.row_of[slots : slots + cache.slots] = -1
        self.dirty[slots : slots + cache.slots] = False
        self.last_used[slots : slots + cache.slots] = 0
        if cache.lfu:
            first = self.uses_base_host[t]
            self.uses[first : first + cache.capacity] = 0
        self.free_host[slots : slots + cache.slots] = torch.arange(cache.slots, device="cpu")
        self.free_stack[slots : slots + cache.slots] = torch.arange(cache.slots, device=self.device)
        self.free_count[t] = cache.slots
        self.free_top[t : t + 1].fill_(cache.slots)
        # Only this table's slots leave the pins in flight (the spare entry in their place): the
        # other tables' stay held, as each host RowCache forgets only its own pins.
        spare = self.total_slots
        for token, held in self.pinned.items():
            self.pinned[token] = torch.where((held >= slots) & (held < slots + cache.slots), spare, held)
            self.pin_counts[token] = [0 if u == t else n for u, n in enumerate(self.pin_counts[token])]


def _read(reads: list[tuple[int, Tensor, Tensor]], movers) -> None:
    """Each (table, slots, rows) of ``reads``: its backing store's ``rows`` into its cache's
    ``slots`` (host tensors). Through records (a GPU's cache): all tables' in one copy to the
    device (tier_copies.py's ``to_caches``; a module's movers share one ``DeviceCopies``)."""
    copies = movers[reads[0][0]].copies if reads else None
    if copies is None:
        for t, slots, rows in reads:
            movers[t].read(slots, rows)
        return
    copies.to_caches([(movers[t], slots, rows) for t, slots, rows in reads], copies.packed)


def _write(writes: list[tuple[int, Tensor, Tensor]], movers, failed: list[tuple[int | None, BaseException]]) -> None:
    """Each (table, slots, rows) of ``writes``: its cache's ``slots`` written back to its backing
    store's ``rows`` (host tensors), every table's even when one's raises (kept in ``failed``
    with the table, None when the copy of all tables' records raised). Through records (a GPU's
    cache): all tables' in one copy to the host (tier_copies.py's ``to_stores``, through the
    buffer of the packed reads)."""
    copies = movers[writes[0][0]].copies if writes else None
    if copies is None:
        for t, slots, rows in writes:
            _attempt(failed, t, movers[t].write, slots, rows)
        return
    table_of = {id(movers[t]): t for t, _, _ in writes}

    def store(mover, records: Tensor, rows: Tensor) -> None:
        _attempt(failed, table_of[id(mover)], mover.store, records, rows)

    writing = [(movers[t], slots, rows) for t, slots, rows in writes]
    _attempt(failed, None, copies.to_stores, writing, copies.packed, store)


def _attempt(failed: list[tuple[int | None, BaseException]], t: int | None, call, *args) -> None:
    """``call(*args)``; an exception it raises is kept in ``failed``, with ``t``."""
    try:
        call(*args)
    except Exception as error:  # noqa: BLE001  (re-raised by the caller once every write-back has run)
        failed.append((t, error))
