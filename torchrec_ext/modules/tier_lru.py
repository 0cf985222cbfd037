"""The least recently used order of a tiered table's cache slots, kept as a queue of touches.

A tiered LRU table's cache (``tiered_tables.RowCache``, its host maps) gives up its least recently
used slots when rows must come in (an LFU table's victims are a top-k over its lookup counts, and
the device maps take theirs by a top-k over the clocks: tier_device_maps.py). Finding them by a top-k over every slot's last-use clock is a pass over all
slots per lookup and per stage, ~0.6 ms a table a step at dlrm-small scale (210k slots a table,
a top-k of 7k; with building the keys, ~10 ms of a ~60 ms stage). ``SlotOrder`` costs per slot
touched instead: each touch (slots set to the current clock) is appended as one chunk, and
victims are taken from the front, in clock order, skipping entries a later touch superseded
(their clock is no longer the slot's) or whose slot was emptied. Entries of slots not to be
taken now (held by batches in flight) stay at the front, in order.

Invariant (what makes the order exact): every write of ``last_used`` goes through ``touch``, and
no slot is touched twice at one clock, so each occupied slot has exactly one entry whose clock
equals its ``last_used`` (its current entry; the others are stale), and entries are in
non-decreasing clock order (the clock never goes back). Among slots of one clock, the earlier touched goes
first (``torch.topk`` left that order unspecified). Entries pile up when slots are touched far
more often than taken (a cache that always hits): past ``2 * slots`` entries the queue is rebuilt
from ``last_used`` (one sort), so it stays bounded (4 bytes an entry).
"""

from __future__ import annotations

from collections import deque

import torch
from torch import Tensor


class SlotOrder:
    """The least recently used order of ``slots`` cache slots (see the module docstring)."""

    def __init__(self, slots: int):
        self.slots = slots
        self._chunks: deque[tuple[Tensor, int]] = (
            deque()
        )  # (slots, int32, and the clock they were used at), oldest first
        self.entries = 0

    def nbytes(self) -> int:
        """Bytes of the storages the entries hold: 4 an entry, and the rest of the tensors of
        the chunks that are views (a rebuild's one tensor, and the one chunk partly taken:
        ``oldest`` puts its rest back as a view), each at most 4 bytes a slot."""
        held = {chunk.untyped_storage().data_ptr(): chunk.untyped_storage().nbytes() for chunk, _ in self._chunks}
        return sum(held.values())

    def clear(self) -> None:
        self._chunks.clear()
        self.entries = 0

    def touch(self, slots: Tensor, clock: int, last_used: Tensor, row_of: Tensor) -> None:
        """``slots`` (distinct, none touched at ``clock`` before) were used at ``clock``: their
        ``last_used`` set, they go to the back. ``row_of`` (slot -> row, -1: empty) is read when
        the queue is rebuilt."""
        if slots.numel() == 0:
            return
        last_used.index_fill_(0, slots, clock)
        self._push(slots.to(torch.int32), clock)
        if self.entries > 2 * self.slots:
            self._rebuild(last_used, row_of)

    def oldest(self, k: int, last_used: Tensor, row_of: Tensor, before: int, pinned: Tensor | None) -> Tensor:
        """Up to k occupied slots (int64), least recently used first, last used before clock
        ``before`` and not ``pinned`` (a mask of slots, or None), taken out of the order."""
        taken: list[Tensor] = []
        held: list[tuple[Tensor, Tensor]] = []  # pinned entries met (slots, clocks): they stay at the front, in order
        need = k
        while need > 0 and self._chunks and self._chunks[0][1] < before:
            # A window of chunks (1.5 entries per slot wanted: some entries are stale), one pass over it.
            chunks = []
            size = 0
            while self._chunks and self._chunks[0][1] < before and (size < 3 * need // 2 or not chunks):
                chunks.append(self._chunks.popleft())
                size += chunks[-1][0].numel()
            self.entries -= size
            sizes = [c[0].numel() for c in chunks]
            slots = chunks[0][0] if len(chunks) == 1 else torch.cat([c[0] for c in chunks])
            clocks = torch.tensor([c[1] for c in chunks], dtype=torch.int64, device="cpu")
            clocks = (
                clocks.expand(size) if len(chunks) == 1 else clocks.repeat_interleave(torch.tensor(sizes, device="cpu"))
            )
            current = (last_used.index_select(0, slots) == clocks) & (row_of.index_select(0, slots) >= 0)
            at = current.nonzero(as_tuple=True)[0]
            stay = None
            if pinned is not None:  # (checked on the current entries only: pinned ones are rare this far front)
                blocked = pinned.index_select(0, slots.index_select(0, at))
                if bool(blocked.any()):
                    stay, at = at[blocked], at[~blocked]
            if at.numel() > need:  # the window from its first entry not taken on goes back, chunk by chunk
                cut = int(at[need])
                back, first = [], 0
                for (chunk, clock), n in zip(chunks, sizes):
                    if first + n > cut:
                        back.append((chunk[max(cut - first, 0) :], clock))
                    first += n
                for chunk, clock in reversed(back):
                    self._push(chunk, clock, front=True)
                at = at[:need]
                if stay is not None:
                    stay = stay[stay < cut]
            if stay is not None and stay.numel():
                held.append((slots.index_select(0, stay), clocks.index_select(0, stay)))
            chosen = slots.index_select(0, at).to(torch.int64)
            taken.append(chosen)
            need -= chosen.numel()
        for slots, clocks in reversed(held):  # (rare: the cache's oldest slots held by a batch in flight)
            self.put_back(slots, clocks)
        if not taken:
            return torch.empty(0, dtype=torch.int64, device="cpu")
        return taken[0] if len(taken) == 1 else torch.cat(taken)

    def put_back(self, slots: Tensor, clocks: Tensor) -> None:
        """Slots ``oldest`` took (in its order; ``clocks``: their ``last_used``, neither emptied nor
        touched since) back at the front at their own clocks, as if never taken."""
        values, counts = torch.unique_consecutive(clocks, return_counts=True)
        for part, clock in reversed(list(zip(slots.split(counts.tolist()), values.tolist()))):
            self._push(part.to(torch.int32, copy=True), clock, front=True)  # (not views of one tensor: see nbytes)

    def give_back(self, slots: Tensor, clock: int, last_used: Tensor) -> None:
        """Slots ``oldest`` took (neither emptied nor touched since) back at the front, last used at ``clock``."""
        if slots.numel():
            last_used.index_fill_(0, slots, clock)
            self._push(slots.to(torch.int32), clock, front=True)

    def _push(self, slots: Tensor, clock: int, front: bool = False) -> None:
        if front:
            self._chunks.appendleft((slots, clock))
        else:
            self._chunks.append((slots, clock))
        self.entries += slots.numel()

    def _rebuild(self, last_used: Tensor, row_of: Tensor) -> None:
        """The queue from ``last_used``: each occupied slot once, a chunk per clock."""
        occupied = (row_of >= 0).nonzero().squeeze(1)
        clocks, order = torch.sort(last_used.index_select(0, occupied), stable=True)
        occupied = occupied.index_select(0, order).to(torch.int32)
        values, counts = torch.unique_consecutive(clocks, return_counts=True)
        self.clear()
        for slots, clock in zip(occupied.split(counts.tolist()), values.tolist()):
            self._push(slots, clock)
