"""The hash table's specification: bucket geometry, where a key may live (``place``), the
order an upsert inserts in, the scores each policy leaves, the dict model ``ReferenceHashTable``
and the placement oracle ``place_keys``."""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import torch
from torch import Tensor

from torchrec_ext.reference.hashing import _INT64_MAX, _MASK64, _fastrange32, _fmix64, _u64, fmix64_tensor

SLOTS = 32


POLICIES = ("none", "lru", "lfu", "epoch_lru", "epoch_lfu", "custom")


def geometry(capacity: int) -> tuple[int, int]:
    """(num_buckets, num_stripes) for a table of ``capacity`` rows."""
    buckets = -(-capacity // SLOTS)
    return buckets, min(max(buckets // 64, 1), 1 << 16)


def stash_slots(capacity: int) -> int:
    """Entries of the stash: keys a full load could not put in their buckets, in free rows
    elsewhere; 32 per 128 of ceil(sqrt(capacity)), at least 32."""
    root = 0
    while root * root < capacity:
        root += 1
    return SLOTS * max(-(-root // 128), 1)


def _stripe_span(stripe: int, buckets: int, stripes: int) -> tuple[int, int]:
    """(first bucket, bucket count) of a stripe: the first ``buckets % stripes`` have one more."""
    width, wide = divmod(buckets, stripes)
    return stripe * width + min(stripe, wide), width + (stripe < wide)


def stripe_of(key: int, capacity: int) -> int:
    """The stripe of a key: the stripe of its bucket1."""
    _, stripes = geometry(capacity)
    h = _fmix64((key & _MASK64) ^ 0x9E3779B97F4A7C15)
    return _fastrange32(_fmix64(h ^ 0xC2B2AE3D27D4EB4F), stripes)


def place(key: int, capacity: int) -> tuple[int, int, int]:
    """(bucket1, bucket2, tag) of a key: bucket1 in the key's stripe s, bucket2 in the next
    stripe (s + 1) mod S; with one stripe, two distinct buckets of it (when it has two)."""
    buckets, stripes = geometry(capacity)
    h = _fmix64((key & _MASK64) ^ 0x9E3779B97F4A7C15)
    h2 = _fmix64(h ^ 0xC2B2AE3D27D4EB4F)
    stripe = _fastrange32(h2, stripes)
    begin, width = _stripe_span(stripe, buckets, stripes)
    off1 = _fastrange32(h, width)
    if stripes > 1:
        begin2, width2 = _stripe_span((stripe + 1) % stripes, buckets, stripes)
        return begin + off1, begin2 + _fastrange32(h2 >> 32, width2), (h >> 57) % 127 + 1
    off2 = off1
    if width > 1:
        off2 = _fastrange32(h2 >> 32, width - 1)
        if off2 >= off1:
            off2 += 1
    return begin + off1, begin + off2, (h >> 57) % 127 + 1


def place_keys(keys: Sequence[int], scores: Sequence[int], capacity: int) -> list[bool]:
    """Which of distinct ``keys`` an empty table of ``capacity`` rows holds when they are placed
    by priority (higher score first, then earlier position): each is kept iff it fits beside the
    keys kept before it, found by a breadth-first augmenting path over buckets (a held key may
    move to its other bucket; Kuhn's algorithm, one key at a time). The kept set is the greedy
    basis of the matroid of placeable sets: unique, whichever rows the keys end up in.

    Then the stash: the ``stash_slots`` left-out keys of highest priority are kept too (in free
    rows outside their buckets), and the kept keys are cut to ``capacity`` by priority: the greedy
    basis of that matroid joined with any ``stash_slots`` keys, truncated at ``capacity``."""
    buckets, _ = geometry(capacity)
    room = [min(SLOTS, capacity - b * SLOTS) for b in range(buckets)]
    pairs = [place(k, capacity)[:2] for k in keys]
    held: list[list[int]] = [[] for _ in range(buckets)]  # key indices in each bucket
    kept = [False] * len(keys)
    for i in sorted(range(len(keys)), key=lambda i: (-scores[i], i)):
        parent: dict[int, tuple[int, int] | None] = dict.fromkeys(pairs[i])
        queue, end = list(parent), None
        for b in queue:  # grows while it is walked
            if len(held[b]) < room[b]:
                end = b
                break
            for j in held[b]:
                other = sum(pairs[j]) - b
                if other not in parent:
                    parent[other] = (b, j)
                    queue.append(other)
        if end is None:
            continue
        while parent[end] is not None:  # each key of the path moves one bucket on
            before, j = parent[end]
            held[before].remove(j)
            held[end].append(j)
            end = before
        held[end].append(i)
        kept[i] = True
    by_priority = sorted(range(len(keys)), key=lambda i: (-scores[i], i))
    for i in [i for i in by_priority if not kept[i]][: stash_slots(capacity)]:
        kept[i] = True
    for i in [i for i in by_priority if kept[i]][capacity:]:
        kept[i] = False
    return kept


def upsert_phase(stripe: int, stripes: int) -> int:
    """The phase in which an upsert inserts the new keys of a stripe: 0 for even stripes, 1 for
    odd ones, 2 for the last stripe of an odd ring of three or more (it wraps onto stripe 0).
    A key of stripe s may use stripes s and s + 1, so stripes of one phase share no bucket."""
    if stripes >= 3 and stripes % 2 == 1 and stripe == stripes - 1:
        return 2
    return stripe % 2


def upsert_window(capacity: int, begin: int) -> int:
    """Batch positions of an upsert's insert window starting at position ``begin``: an eighth
    of the capacity or of the positions before it, whichever is more."""
    return max(-(-capacity // 8), -(-begin // 8), 1)


def upsert_windows(capacity: int, n: int) -> list[int]:
    """First batch positions of the insert windows of an upsert of ``n`` keys."""
    starts, begin = [], 0
    while begin < n:
        starts.append(begin)
        begin += upsert_window(capacity, begin)
    return starts


def insert_order(keys: Sequence[int], capacity: int, clock: int) -> list[int]:
    """The order in which an upsert (of logical clock ``clock``) inserts the keys at positions
    0..n-1 that hold no row: window by window (``upsert_windows``); within a window phase by
    phase, the call's first phase being ``clock`` mod the number of phases (1, 2, or 3 on an odd
    ring), so no class of stripes takes free rows and cheap victims first call after call;
    within a phase, in batch order."""
    _, stripes = geometry(capacity)
    phases = 1 if stripes == 1 else 3 if stripes >= 3 and stripes % 2 == 1 else 2
    starts = upsert_windows(capacity, len(keys))

    def rank(i: int) -> tuple[int, int, int]:
        phase = upsert_phase(stripe_of(keys[i], capacity), stripes)
        return bisect.bisect_right(starts, i) - 1, (phase - clock) % phases, i

    return sorted(range(len(keys)), key=rank)


def touched_score(policy: str, old: int | None, given: int | None, clock: int, epoch: int) -> int:
    """Score after a touch; ``old`` is None for a new key; ``given`` the caller's score/increment."""
    if policy in ("none", "lru"):
        return clock
    if policy == "lfu":
        inc = 1 if given is None else given
        return inc if old is None else min(old + inc, _INT64_MAX)
    if policy == "epoch_lru":
        return (epoch << 32) | (clock & 0xFFFFFFFF)
    if policy == "epoch_lfu":
        inc = 1 if given is None else given
        count = old & 0xFFFFFFFF if old is not None and old >> 32 == epoch else 0
        return (epoch << 32) | min(count + inc, 0xFFFFFFFF)
    assert given is not None, "custom policy needs scores"
    return given


class ReferenceHashTable:
    """The dict model of ``torchrec_ext.HashTable``: same placement, scores and eviction rule.

    ``row_of`` / ``key_at`` / ``score_at`` are in slot space (a key's place in its buckets); what
    ``find``, ``upsert`` and ``export`` give are rows: a slot's row is the slot itself, until
    ``grown`` sets ``slot_row``, the row of every slot of [0, capacity).
    """

    def __init__(self, capacity: int, policy: str = "lru"):
        self.capacity = capacity
        self.policy = policy
        self.num_buckets, _ = geometry(capacity)
        self.row_of: dict[int, int] = {}
        self.key_at: dict[int, int] = {}
        self.score_at: dict[int, int] = {}
        self.clock = 0
        self.epoch = 0
        self.slot_row: list[int] | None = None

    def row(self, slot: int) -> int:
        """The row of ``slot`` (-1: none)."""
        return slot if self.slot_row is None or slot < 0 else self.slot_row[slot]

    def grown(self, capacity: int) -> ReferenceHashTable:
        """What ``HashTable.grown`` builds: a table of ``capacity`` (>= this one's) into which the
        live keys are inserted with their scores (``insert_or_assign``, in slot order); each key
        keeps its row, and the rows no key holds go to the empty slots, both in ascending order."""
        assert capacity >= self.capacity, "the reference grows only"
        twin = ReferenceHashTable(capacity, self.policy)
        twin.epoch = self.epoch
        slots = sorted(self.key_at)
        keys = [self.key_at[s] for s in slots]
        new_slots = twin._upsert([*keys], [self.score_at[s] for s in slots], assign=True)[0]
        assert all(s >= 0 for s in new_slots), "a key found no slot: HashTable.grown re-places (place_keys)"
        twin.clock = self.clock
        slot_row = dict(zip(new_slots, (self.row(s) for s in slots)))
        free_rows = iter(sorted(set(range(capacity)) - set(slot_row.values())))
        twin.slot_row = [slot_row[s] if s in slot_row else next(free_rows) for s in range(capacity)]
        return twin

    def load(self, entries: Sequence[tuple[int, int, int]]) -> None:
        """Holds ``(key, row, score)`` entries, as ``load_state_dict`` restores them: a row outside
        its key's buckets is a stashed key's (found by ``find``, touched, evicted as any row)."""
        for key, row, score in entries:
            self.row_of[key], self.key_at[row], self.score_at[row] = row, key, score

    def _usable_rows(self, bucket: int) -> list[int]:
        return [r for r in range(bucket * SLOTS, (bucket + 1) * SLOTS) if r < self.capacity]

    def _candidate_buckets(self, key: int) -> list[int]:
        b1, b2, _ = place(key, self.capacity)
        return [b1] if b1 == b2 else [b1, b2]

    def find(self, keys: Sequence[int]) -> tuple[list[int], list[bool]]:
        rows = [self.row(self.row_of.get(k, -1)) for k in keys]
        return rows, [r >= 0 for r in rows]

    def upsert(self, keys: Sequence[int], scores: Sequence[int] | None = None, assign: bool = False):
        """find_or_insert (assign=False) or insert_or_assign (assign=True).

        First every key that holds a row is touched and pinned (in batch order), then the others
        are inserted one at a time, in ``insert_order``: a new key never evicts a key of its own
        call. (Stripes of one phase share no bucket, so the kernels apply them in parallel: this
        order is the one their results equal.)
        """
        slots, inserted, evicted_keys, evicted_slots = self._upsert(keys, scores, assign)
        return [self.row(s) for s in slots], inserted, evicted_keys, [self.row(s) for s in evicted_slots]

    def _upsert(self, keys: Sequence[int], scores: Sequence[int] | None, assign: bool):
        """``upsert`` in slot space."""
        self.clock += 1
        rows: list[int | None] = [None] * len(keys)
        inserted = [False] * len(keys)
        evicted = []
        pinned = set()

        def touch(i: int, row: int) -> None:
            given = None if scores is None else scores[i]
            self.score_at[row] = (
                given
                if (assign and given is not None)
                else touched_score(self.policy, self.score_at[row], given, self.clock, self.epoch)
            )
            pinned.add(row)
            rows[i] = row

        for i, key in enumerate(keys):
            if key in self.row_of:
                touch(i, self.row_of[key])
        for i in insert_order(keys, self.capacity, self.clock):
            key = keys[i]
            if rows[i] is not None:
                continue
            if key in self.row_of:  # a repeat of a key inserted earlier in this pass
                touch(i, self.row_of[key])
                continue
            given = None if scores is None else scores[i]
            new_score = (
                given
                if (assign and given is not None)
                else touched_score(self.policy, None, given, self.clock, self.epoch)
            )
            rows[i] = -1
            free = [[r for r in self._usable_rows(b) if r not in self.key_at] for b in self._candidate_buckets(key)]
            if any(free):
                # The bucket with more free slots, the first on ties; its lowest free slot.
                chosen = free[0] if len(free) == 1 or len(free[0]) >= len(free[1]) else free[1]
                row = chosen[0]
            else:
                if self.policy == "none":
                    continue
                victim = None
                for b in self._candidate_buckets(key):
                    for r in self._usable_rows(b):
                        if r not in pinned and (victim is None or self.score_at[r] < self.score_at[victim]):
                            victim = r
                if victim is None or new_score < self.score_at[victim]:
                    continue
                row = victim
                evicted.append((i, self.key_at[row], row))
                del self.row_of[self.key_at[row]]
            self.row_of[key] = row
            self.key_at[row] = key
            self.score_at[row] = new_score
            pinned.add(row)
            rows[i] = row
            inserted[i] = True
        evicted.sort()  # reported in batch order (an input position evicts at most once)
        return rows, inserted, [k for _, k, _ in evicted], [r for _, _, r in evicted]

    def erase(self, keys: Sequence[int]) -> list[bool]:
        out = []
        for key in keys:
            row = self.row_of.pop(key, None)
            if row is not None:
                del self.key_at[row]
                del self.score_at[row]
            out.append(row is not None)
        return out

    def export(self) -> list[tuple[int, int, int]]:
        """Live (key, row, score) in slot order (row order unless the table grew)."""
        return [(self.key_at[s], self.row(s), self.score_at[s]) for s in sorted(self.key_at)]

    def size(self) -> int:
        return len(self.row_of)


def bucket_pairs(keys: Tensor, capacity: int) -> tuple[Tensor, Tensor]:
    """``place`` of many keys at once: the two buckets each int64 key may use in a table of
    ``capacity`` rows, vectorised on int64 bit patterns."""
    num_buckets, num_stripes = geometry(capacity)
    low = 0xFFFFFFFF
    h = fmix64_tensor(keys.to(torch.int64) ^ _u64(0x9E3779B97F4A7C15))
    h2 = fmix64_tensor(h ^ _u64(0xC2B2AE3D27D4EB4F))
    width, wide = divmod(num_buckets, num_stripes)

    def span(stripe: Tensor) -> tuple[Tensor, Tensor]:  # first bucket and bucket count
        return stripe * width + torch.clamp(stripe, max=wide), width + (stripe < wide).to(torch.int64)

    stripe = ((h2 & low) * num_stripes) >> 32
    begin, widths = span(stripe)
    off1 = ((h & low) * widths) >> 32
    if num_stripes > 1:  # bucket2 in the next stripe on the ring
        begin2, widths2 = span(torch.where(stripe + 1 == num_stripes, 0, stripe + 1))
        return begin + off1, begin2 + ((((h2 >> 32) & low) * widths2) >> 32)
    off2 = (((h2 >> 32) & low) * (widths - 1)) >> 32
    off2 = torch.where(widths > 1, off2 + (off2 >= off1).to(torch.int64), off1)
    return begin + off1, begin + off2
