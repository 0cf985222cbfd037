"""Pure-Python/PyTorch references of every torchrec_ext op: the test oracles.

Written from the specification, not from the kernels, and kept deliberately simple (one key at
a time, plain dicts), so a disagreement with a kernel points at a bug in one of them.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

_MASK64 = (1 << 64) - 1
_INT64_MAX = (1 << 63) - 1
SLOTS = 32
POLICIES = ("none", "lru", "lfu", "epoch_lru", "epoch_lfu", "custom")


def _fmix64(k: int) -> int:
    k ^= k >> 33
    k = (k * 0xFF51AFD7ED558CCD) & _MASK64
    k ^= k >> 33
    k = (k * 0xC4CEB9FE1A85EC53) & _MASK64
    k ^= k >> 33
    return k


def _fastrange32(x: int, n: int) -> int:
    return ((x & 0xFFFFFFFF) * n) >> 32


def geometry(capacity: int) -> Tuple[int, int]:
    """(num_buckets, num_stripes) for a table of ``capacity`` rows."""
    buckets = -(-capacity // SLOTS)
    return buckets, min(max(buckets // 64, 1), 1 << 16)


def place(key: int, capacity: int) -> Tuple[int, int, int]:
    """(bucket1, bucket2, tag) of a key: two candidate buckets within the key's stripe."""
    buckets, stripes = geometry(capacity)
    h = _fmix64((key & _MASK64) ^ 0x9E3779B97F4A7C15)
    h2 = _fmix64(h ^ 0xC2B2AE3D27D4EB4F)
    stripe = _fastrange32(h2, stripes)
    width, wide = divmod(buckets, stripes)  # the first `wide` stripes have one bucket more
    begin = stripe * width + min(stripe, wide)
    width += stripe < wide
    off1 = _fastrange32(h, width)
    off2 = off1
    if width > 1:
        off2 = _fastrange32(h2 >> 32, width - 1)
        if off2 >= off1:
            off2 += 1
    return begin + off1, begin + off2, (h >> 57) % 127 + 1


def route(key: int, world_size: int) -> int:
    """Owning rank of ``key`` under row-wise sharding."""
    return _fastrange32(_fmix64((key & _MASK64) ^ 0x165667B19E3779F9) >> 32, world_size)


def touched_score(policy: str, old: Optional[int], given: Optional[int], clock: int, epoch: int) -> int:
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
    """The dict model of ``torchrec_ext.HashTable``: same placement, scores and eviction rule."""

    def __init__(self, capacity: int, policy: str = "lru"):
        self.capacity = capacity
        self.policy = policy
        self.num_buckets, _ = geometry(capacity)
        self.row_of: Dict[int, int] = {}
        self.key_at: Dict[int, int] = {}
        self.score_at: Dict[int, int] = {}
        self.clock = 0
        self.epoch = 0

    def _usable_rows(self, bucket: int) -> List[int]:
        return [r for r in range(bucket * SLOTS, (bucket + 1) * SLOTS) if r < self.capacity]

    def _candidate_buckets(self, key: int) -> List[int]:
        b1, b2, _ = place(key, self.capacity)
        return [b1] if b1 == b2 else [b1, b2]

    def find(self, keys: Sequence[int]) -> Tuple[List[int], List[bool]]:
        rows = [self.row_of.get(k, -1) for k in keys]
        return rows, [r >= 0 for r in rows]

    def upsert(self, keys: Sequence[int], scores: Optional[Sequence[int]] = None, assign: bool = False):
        """find_or_insert (assign=False) or insert_or_assign (assign=True), one key at a time."""
        self.clock += 1
        rows, inserted, evicted = [], [], []
        pinned = set()
        for i, key in enumerate(keys):
            given = None if scores is None else scores[i]
            row = self.row_of.get(key, -1)
            if row >= 0:
                old = self.score_at[row]
                self.score_at[row] = given if (assign and given is not None) else touched_score(
                    self.policy, old, given, self.clock, self.epoch)
                pinned.add(row)
                rows.append(row)
                inserted.append(False)
                continue
            new_score = given if (assign and given is not None) else touched_score(
                self.policy, None, given, self.clock, self.epoch)
            free = [[r for r in self._usable_rows(b) if r not in self.key_at] for b in self._candidate_buckets(key)]
            if any(free):
                # The bucket with more free slots, the first on ties; its lowest free slot.
                chosen = free[0] if len(free) == 1 or len(free[0]) >= len(free[1]) else free[1]
                row = chosen[0]
            else:
                if self.policy == "none":
                    rows.append(-1)
                    inserted.append(False)
                    continue
                victim = None
                for b in self._candidate_buckets(key):
                    for r in self._usable_rows(b):
                        if r not in pinned and (victim is None or self.score_at[r] < self.score_at[victim]):
                            victim = r
                if victim is None or new_score < self.score_at[victim]:
                    rows.append(-1)
                    inserted.append(False)
                    continue
                row = victim
                evicted.append((self.key_at[row], row))
                del self.row_of[self.key_at[row]]
            self.row_of[key] = row
            self.key_at[row] = key
            self.score_at[row] = new_score
            pinned.add(row)
            rows.append(row)
            inserted.append(True)
        return rows, inserted, [k for k, _ in evicted], [r for _, r in evicted]

    def erase(self, keys: Sequence[int]) -> List[bool]:
        out = []
        for key in keys:
            row = self.row_of.pop(key, None)
            if row is not None:
                del self.key_at[row]
                del self.score_at[row]
            out.append(row is not None)
        return out

    def export(self) -> List[Tuple[int, int, int]]:
        """Live (key, row, score) in row order."""
        return [(self.key_at[r], r, self.score_at[r]) for r in sorted(self.key_at)]

    def size(self) -> int:
        return len(self.row_of)
