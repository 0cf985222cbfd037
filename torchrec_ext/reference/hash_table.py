"""The hash table's specification: bucket geometry, where a key may live (``place``), the
order an upsert inserts in, the scores each policy leaves, the dict model ``ReferenceHashTable``,
the placement oracle ``place_keys``, and each ``hash_*`` op under its own name, over the arrays
the op takes (``hash_find``, ``hash_find_tables``, ``hash_upsert``, ``hash_upsert_fixed``,
``hash_upsert_tables``, ``hash_slot_rows``, ``hash_erase``, ``hash_export``, ``hash_restore``,
``hash_place``)."""

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


def _match_to_buckets(keys: Sequence[int], order: Sequence[int], capacity: int) -> list[list[int]]:
    """The key indices each bucket holds when the keys at ``order`` are placed one at a time,
    each kept iff a breadth-first augmenting path over buckets makes room for it (a held key may
    move to its other bucket; Kuhn's algorithm)."""
    buckets, _ = geometry(capacity)
    room = [min(SLOTS, capacity - b * SLOTS) for b in range(buckets)]
    pairs = {i: place(keys[i], capacity)[:2] for i in order}
    held: list[list[int]] = [[] for _ in range(buckets)]
    for i in order:
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
    return held


def place_keys(keys: Sequence[int], scores: Sequence[int], capacity: int) -> list[bool]:
    """Which of distinct ``keys`` an empty table of ``capacity`` rows holds when they are placed
    by priority (higher score first, then earlier position): each is kept iff it fits beside the
    keys kept before it, found by a breadth-first augmenting path over buckets (a held key may
    move to its other bucket; Kuhn's algorithm, one key at a time). The kept set is the greedy
    basis of the matroid of placeable sets: unique, whichever rows the keys end up in.

    Then the stash: the ``stash_slots`` left-out keys of highest priority are kept too (in free
    rows outside their buckets), and the kept keys are cut to ``capacity`` by priority: the greedy
    basis of that matroid joined with any ``stash_slots`` keys, truncated at ``capacity``."""
    held = _match_to_buckets(keys, sorted(range(len(keys)), key=lambda i: (-scores[i], i)), capacity)
    kept = [False] * len(keys)
    for members in held:
        for i in members:
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


# ---------------------------------------------------------------------------------------------
# The hash_* ops, each under its own name, over the arrays the ops take (``torchrec_ext.ops``):
# the arrays are read into the dict model, the model runs the call, and what the model holds then
# is written back to the main slots and the size. A slot is live where its digest is non-zero;
# its row is the slot itself (a growing table's slot -> row map is ``hash_slot_rows``'). The
# stash's entries (after the main slots: the kernels' index of the keys held outside their
# buckets) are neither read nor written: the model finds every key by its slot, so a kernel that
# lost a stashed key disagrees with these on ``hash_find``.


def _main_slots(capacity: int) -> int:
    return geometry(capacity)[0] * SLOTS


def _model_of(
    digests: Tensor, slot_keys: Tensor, slot_scores: Tensor, capacity: int, policy: str = "lru"
) -> ReferenceHashTable:
    """The dict model holding the live entries of a table's arrays."""
    model = ReferenceHashTable(capacity, policy)
    d, k, s = digests.tolist(), slot_keys.tolist(), slot_scores.tolist()
    model.load([(k[slot], slot, s[slot]) for slot in range(_main_slots(capacity)) if d[slot] != 0])
    return model


def _write_back(
    model: ReferenceHashTable, digests: Tensor, slot_keys: Tensor, slot_scores: Tensor, size: Tensor
) -> None:
    """The model's entries into the arrays' main slots (digest: the key's tag, unpinned), in place."""
    main = _main_slots(model.capacity)
    digests[:main] = 0
    for slot, key in model.key_at.items():
        digests[slot] = place(key, model.capacity)[2]
        slot_keys[slot] = key
        slot_scores[slot] = model.score_at[slot]
    size[0] = model.size()


def _policy_name(policy: int) -> str:
    return POLICIES[policy]


def hash_find(digests: Tensor, slot_keys: Tensor, keys: Tensor, capacity: int) -> tuple[Tensor, Tensor]:
    """``ops.hash_find``: each key's row (-1: absent) and whether it was found. Read-only."""
    model = _model_of(digests, slot_keys, torch.zeros_like(slot_keys), capacity)
    rows, found = model.find(keys.tolist())
    return torch.tensor(rows, dtype=torch.int64), torch.tensor(found, dtype=torch.bool)


def hash_find_tables(
    digests: Sequence[Tensor],
    slot_keys: Sequence[Tensor],
    keys: Tensor,
    key_offsets: Sequence[int],
    capacities: Sequence[int],
) -> tuple[Tensor, Tensor]:
    """``ops.hash_find_tables``: ``hash_find`` of table t on ``keys[key_offsets[t]:key_offsets[t+1]]``,
    concatenated."""
    parts = [
        hash_find(d, k, keys[key_offsets[t] : key_offsets[t + 1]], capacities[t])
        for t, (d, k) in enumerate(zip(digests, slot_keys))
    ]
    if not parts:
        return torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.bool)
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def hash_upsert(
    digests: Tensor,
    slot_keys: Tensor,
    slot_scores: Tensor,
    size: Tensor,
    keys: Tensor,
    scores: Tensor | None,
    capacity: int,
    policy: int,
    clock: int,
    epoch: int,
    assign: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``ops.hash_upsert``, in place: (rows, inserted, evicted_keys, evicted_rows), the call made
    at ``clock`` (the score an lru touch stores) and ``epoch``."""
    model = _model_of(digests, slot_keys, slot_scores, capacity, _policy_name(policy))
    model.clock, model.epoch = clock - 1, epoch  # the model's upsert advances its clock first
    rows, inserted, evicted_keys, evicted_rows = model.upsert(
        keys.tolist(), None if scores is None else scores.tolist(), assign
    )
    _write_back(model, digests, slot_keys, slot_scores, size)
    return (
        torch.tensor(rows, dtype=torch.int64),
        torch.tensor(inserted, dtype=torch.bool),
        torch.tensor(evicted_keys, dtype=torch.int64),
        torch.tensor(evicted_rows, dtype=torch.int64),
    )


def hash_upsert_fixed(
    digests: Tensor,
    slot_keys: Tensor,
    slot_scores: Tensor,
    size: Tensor,
    keys: Tensor,
    scores: Tensor | None,
    pending: Tensor | None,
    capacity: int,
    policy: int,
    clock: int,
    epoch: int,
    assign: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``ops.hash_upsert_fixed``, in place: ``hash_upsert`` of the pending keys alone (all when
    ``pending`` is None), its results put back at their positions (row -1, nothing inserted
    elsewhere); ``evicted[i]``: key i took an evicted key's row, ``evicted_keys[i]`` that key."""
    n = keys.numel()
    at = list(range(n)) if pending is None else [i for i, p in enumerate(pending.tolist()) if p]
    sub_scores = None if scores is None else scores[at]
    sub_rows, sub_inserted, gone_keys, gone_rows = hash_upsert(
        digests, slot_keys, slot_scores, size, keys[at], sub_scores, capacity, policy, clock, epoch, assign
    )
    rows = torch.full((n,), -1, dtype=torch.int64)
    inserted = torch.zeros(n, dtype=torch.bool)
    evicted = torch.zeros(n, dtype=torch.bool)
    evicted_keys = torch.zeros(n, dtype=torch.int64)
    key_of_row = dict(zip(gone_rows.tolist(), gone_keys.tolist()))
    for j, i in enumerate(at):
        rows[i], inserted[i] = sub_rows[j], sub_inserted[j]
        row = int(sub_rows[j])
        if bool(sub_inserted[j]) and row in key_of_row:
            evicted[i], evicted_keys[i] = True, key_of_row[row]
    return rows, inserted, evicted, evicted_keys


def hash_upsert_tables(
    digests: Sequence[Tensor],
    slot_keys: Sequence[Tensor],
    slot_scores: Sequence[Tensor],
    sizes: Sequence[Tensor],
    keys: Tensor,
    key_offsets: Sequence[int],
    scores: Tensor | None,
    pending: Tensor | None,
    capacities: Sequence[int],
    policies: Sequence[int],
    clocks: Sequence[int],
    epochs: Sequence[int],
    assign: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``ops.hash_upsert_tables``, in place: ``hash_upsert_fixed`` of table t on its slice of the
    batch, table by table, the results concatenated."""
    n = keys.numel()
    out = [
        torch.full((n,), -1, dtype=torch.int64),
        torch.zeros(n, dtype=torch.bool),
        torch.zeros(n, dtype=torch.bool),
        torch.zeros(n, dtype=torch.int64),
    ]
    for t in range(len(digests)):
        lo, hi = key_offsets[t], key_offsets[t + 1]
        part = hash_upsert_fixed(
            digests[t],
            slot_keys[t],
            slot_scores[t],
            sizes[t],
            keys[lo:hi],
            None if scores is None else scores[lo:hi],
            None if pending is None else pending[lo:hi],
            capacities[t],
            policies[t],
            clocks[t],
            epochs[t],
            assign,
        )
        for whole, piece in zip(out, part):
            whole[lo:hi] = piece
    return tuple(out)


def hash_slot_rows(rows: Tensor, key_offsets: Sequence[int], slot_rows: Sequence[Tensor | None]) -> None:
    """``ops.hash_slot_rows``, in place: table t's slots (``rows[key_offsets[t]:key_offsets[t+1]]``,
    -1 kept) become ``slot_rows[t][slot]``; a table without a map keeps its slots."""
    for t, mapping in enumerate(slot_rows):
        if mapping is None:
            continue
        part = rows[key_offsets[t] : key_offsets[t + 1]]
        mapped = mapping.to(torch.int64)[part.clamp(min=0)]
        part.copy_(torch.where(part >= 0, mapped, part))


def hash_erase(digests: Tensor, slot_keys: Tensor, size: Tensor, keys: Tensor, capacity: int) -> Tensor:
    """``ops.hash_erase``, in place: True at the position that removed each key (the first of
    duplicates); the removed keys' slots become empty."""
    model = _model_of(digests, slot_keys, torch.zeros_like(slot_keys), capacity)
    removed = model.erase(keys.tolist())
    main = _main_slots(capacity)
    live = torch.zeros(main, dtype=torch.bool)
    live[list(model.key_at)] = True
    digests[:main] = torch.where(live, digests[:main], 0)
    size[0] = model.size()
    return torch.tensor(removed, dtype=torch.bool)


def hash_export(
    digests: Tensor, slot_keys: Tensor, slot_scores: Tensor, capacity: int, start: int, end: int
) -> tuple[Tensor, Tensor, Tensor]:
    """``ops.hash_export``: (keys, rows, scores) of the live slots among ``[start, end)``, in row
    order. Read-only."""
    if not 0 <= start <= end <= _main_slots(capacity):
        raise ValueError(f"hash_export: need 0 <= start <= end <= {_main_slots(capacity)}, got {start}, {end}")
    entries = [e for e in _model_of(digests, slot_keys, slot_scores, capacity).export() if start <= e[1] < end]
    columns = list(zip(*entries)) if entries else [(), (), ()]
    return tuple(torch.tensor(c, dtype=torch.int64) for c in columns)


def hash_restore(
    digests: Tensor,
    slot_keys: Tensor,
    slot_scores: Tensor,
    size: Tensor,
    keys: Tensor,
    rows: Tensor,
    scores: Tensor,
    capacity: int,
) -> None:
    """``ops.hash_restore``, in place: ``keys`` at ``rows`` with ``scores`` in an empty table.
    Refused (ValueError, nothing written) unless the table is empty, the keys and rows distinct,
    every row in ``[0, capacity)``, and the keys held outside their two buckets no more than the
    stash holds (``stash_slots``)."""
    key_list, row_list = keys.tolist(), rows.tolist()
    if int(size[0]) != 0 or bool((digests[: _main_slots(capacity)] != 0).any()):
        raise ValueError("hash_restore: the table must be empty")
    if len(set(key_list)) != len(key_list) or len(set(row_list)) != len(row_list):
        raise ValueError("hash_restore: keys and rows must be distinct")
    if any(not 0 <= r < capacity for r in row_list):
        raise ValueError(f"hash_restore: rows must be in [0, {capacity})")
    outside = sum(r // SLOTS not in place(k, capacity)[:2] for k, r in zip(key_list, row_list))
    if outside > stash_slots(capacity):
        raise ValueError(f"hash_restore: {outside} keys outside their buckets, the stash holds {stash_slots(capacity)}")
    model = ReferenceHashTable(capacity)
    model.load(list(zip(key_list, row_list, scores.tolist())))
    _write_back(model, digests, slot_keys, slot_scores, size)


def hash_place(keys: Tensor, scores: Tensor, capacity: int, start_rows: Tensor | None = None) -> Tensor:
    """``ops.hash_place`` without a starting placement: rows for distinct ``keys`` in an empty
    table, -1 for the keys left out. Which keys are placed is ``place_keys``' (unique: the greedy
    basis by priority); the rows are one valid placement (each key in one of its buckets, or a
    stashed key in a free row outside them), not necessarily the op's."""
    if start_rows is not None:
        raise NotImplementedError("reference hash_place: no starting placement (its kept set is not specified)")
    key_list, score_list = keys.tolist(), scores.tolist()
    kept = place_keys(key_list, score_list, capacity)
    # The kept keys that fit their buckets, matched again by priority (the others are stashed).
    held = _match_to_buckets(
        key_list, [i for i in sorted(range(len(key_list)), key=lambda i: (-score_list[i], i)) if kept[i]], capacity
    )
    in_bucket = [False] * len(key_list)
    for members in held:
        for i in members:
            in_bucket[i] = True
    pairs = [place(k, capacity)[:2] for k in key_list]
    rows = [-1] * len(key_list)
    for b, members in enumerate(held):
        for slot, i in enumerate(sorted(members)):
            rows[i] = b * SLOTS + slot
    taken = set(rows)
    free = [r for r in range(capacity) if r not in taken]
    for i in range(len(key_list)):
        if kept[i] and not in_bucket[i]:  # the lowest free row outside its buckets
            rows[i] = next(r for r in free if r // SLOTS not in pairs[i])
            free.remove(rows[i])
    return torch.tensor(rows, dtype=torch.int64)
