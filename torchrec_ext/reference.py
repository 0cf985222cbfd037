"""Pure-Python/PyTorch references of every torchrec_ext op: the test oracles.

Written from the specification, not from the kernels, and kept deliberately simple (one key at
a time, plain dicts), so a disagreement with a kernel points at a bug in one of them.
"""
from __future__ import annotations

import bisect
import math
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


def _stripe_span(stripe: int, buckets: int, stripes: int) -> Tuple[int, int]:
    """(first bucket, bucket count) of a stripe: the first ``buckets % stripes`` have one more."""
    width, wide = divmod(buckets, stripes)
    return stripe * width + min(stripe, wide), width + (stripe < wide)


def stripe_of(key: int, capacity: int) -> int:
    """The stripe of a key: the stripe of its bucket1."""
    _, stripes = geometry(capacity)
    h = _fmix64((key & _MASK64) ^ 0x9E3779B97F4A7C15)
    return _fastrange32(_fmix64(h ^ 0xC2B2AE3D27D4EB4F), stripes)


def place(key: int, capacity: int) -> Tuple[int, int, int]:
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


def place_keys(keys: Sequence[int], scores: Sequence[int], capacity: int) -> List[bool]:
    """Which of distinct ``keys`` an empty table of ``capacity`` rows holds when they are placed
    by priority (higher score first, then earlier position): each is kept iff it fits beside the
    keys kept before it, found by a breadth-first augmenting path over buckets (a held key may
    move to its other bucket; Kuhn's algorithm, one key at a time). The kept set is the greedy
    basis of the matroid of placeable sets: unique, whichever rows the keys end up in."""
    buckets, _ = geometry(capacity)
    room = [min(SLOTS, capacity - b * SLOTS) for b in range(buckets)]
    pairs = [place(k, capacity)[:2] for k in keys]
    held: List[List[int]] = [[] for _ in range(buckets)]  # key indices in each bucket
    kept = [False] * len(keys)
    for i in sorted(range(len(keys)), key=lambda i: (-scores[i], i)):
        parent: Dict[int, Optional[Tuple[int, int]]] = {b: None for b in pairs[i]}
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


def upsert_windows(capacity: int, n: int) -> List[int]:
    """First batch positions of the insert windows of an upsert of ``n`` keys."""
    starts, begin = [], 0
    while begin < n:
        starts.append(begin)
        begin += upsert_window(capacity, begin)
    return starts


def insert_order(keys: Sequence[int], capacity: int, clock: int) -> List[int]:
    """The order in which an upsert (of logical clock ``clock``) inserts the keys at positions
    0..n-1 that hold no row: window by window (``upsert_windows``); within a window phase by
    phase, the call's first phase being ``clock`` mod the number of phases (1, 2, or 3 on an odd
    ring), so no class of stripes takes free rows and cheap victims first call after call;
    within a phase, in batch order."""
    _, stripes = geometry(capacity)
    phases = 1 if stripes == 1 else 3 if stripes >= 3 and stripes % 2 == 1 else 2
    starts = upsert_windows(capacity, len(keys))

    def rank(i: int) -> Tuple[int, int, int]:
        phase = upsert_phase(stripe_of(keys[i], capacity), stripes)
        return bisect.bisect_right(starts, i) - 1, (phase - clock) % phases, i

    return sorted(range(len(keys)), key=rank)


def route(key: int, world_size: int) -> int:
    """Owning rank of ``key`` under row-wise sharding."""
    return _fastrange32(_fmix64((key & _MASK64) ^ 0x165667B19E3779F9) >> 32, world_size)


def route_bucketize(ids: Sequence[int], lengths: Sequence[int], slot_owner: Sequence[int], world_size: int,
                    batch_size: int) -> Tuple[List[int], List[int], List[int]]:
    """Input routing of sharded tables, one id at a time: bag g (slot g // batch_size) sends each
    of its ids to its slot's owner, or to ``route(id)`` when the owner is -1 (row-wise). Returns
    the ids regrouped destination-major then by bag (batch order within a bag), the
    ``[world_size * bags]`` lengths, and each routed id's input position."""
    bags = len(slot_owner) * batch_size
    blocks: List[List[int]] = [[] for _ in range(world_size * bags)]
    position = 0
    for bag, length in enumerate(lengths):
        owner = slot_owner[bag // batch_size]
        for _ in range(length):
            dest = owner if owner >= 0 else route(ids[position], world_size)
            blocks[dest * bags + bag].append(position)
            position += 1
    order = [p for block in blocks for p in block]
    return [ids[p] for p in order], [len(block) for block in blocks], order


BLOOM_COUNTER_MAX = 15


def bloom_key_cells(key: int, hash_seed: int, counters: int, hashes: int) -> List[int]:
    """The ``hashes`` counters of ``key`` in a counting Bloom filter of ``counters`` cells (a
    power of two): double hashing h1 + i * h2 of h = fmix64(key ^ hash_seed), h1 the low 32 bits
    of h, h2 its high 32 bits with the lowest bit set (odd: the steps visit every cell)."""
    h = _fmix64((key ^ hash_seed) & _MASK64)
    h1, h2 = h & 0xFFFFFFFF, (h >> 32) | 1
    return [(h1 + i * h2) % counters for i in range(hashes)]


def bloom_admit(packed: Sequence[int], keys: Sequence[int], counts: Sequence[int], pending: Optional[Sequence[bool]],
                hash_seed: int, hashes: int, admit_after: int) -> Tuple[List[int], List[bool]]:
    """One batch of a counting Bloom filter, one key and one counter at a time. ``packed``: the
    filter's bytes, two 4-bit counters each (low nibble first). Each pending key (all when
    ``pending`` is None) adds its count to each of its cells in turn, saturating at 15 (a key
    whose cells repeat adds to that counter once per repeat); then, with every increment in,
    a pending key is admitted iff all its counters are >= ``admit_after``. Returns the new
    bytes and the admitted flags."""
    counters = [(packed[c // 2] >> (4 * (c % 2))) & 0xF for c in range(2 * len(packed))]
    pending = [True] * len(keys) if pending is None else list(pending)
    for key, count, counted in zip(keys, counts, pending):
        if counted:
            for cell in bloom_key_cells(key, hash_seed, len(counters), hashes):
                counters[cell] = min(BLOOM_COUNTER_MAX, counters[cell] + count)
    admitted = [bool(counted) and min(counters[c] for c in bloom_key_cells(key, hash_seed, len(counters), hashes))
                >= admit_after for key, counted in zip(keys, pending)]
    return [counters[2 * b] | (counters[2 * b + 1] << 4) for b in range(len(packed))], admitted


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
        """find_or_insert (assign=False) or insert_or_assign (assign=True).

        First every key that holds a row is touched and pinned (in batch order), then the others
        are inserted one at a time, in ``insert_order``: a new key never evicts a key of its own
        call. (Stripes of one phase share no bucket, so the kernels apply them in parallel: this
        order is the one their results equal.)
        """
        self.clock += 1
        rows: List[Optional[int]] = [None] * len(keys)
        inserted = [False] * len(keys)
        evicted = []
        pinned = set()

        def touch(i: int, row: int) -> None:
            given = None if scores is None else scores[i]
            self.score_at[row] = given if (assign and given is not None) else touched_score(
                self.policy, self.score_at[row], given, self.clock, self.epoch)
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
            new_score = given if (assign and given is not None) else touched_score(
                self.policy, None, given, self.clock, self.epoch)
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


# =============================================================================================
# Embedding kernels: dedup, initial vectors, pooled / sequence lookup, backward + fused update.
#
# Storage convention shared with csrc/embedding_cpu.cpp and triton_kernels/: all tables of a
# module live in one flat buffer of 4-byte words (a float32 tensor); table t's [capacity_t,
# dim_t] rows start at word table_offsets[t] and are stored in the table's storage dtype
# (table_dtypes[t]: 0 float32, 1 float16, 2 bfloat16; all float32 when not given), packed, its
# span rounded up to whole words. Optimizer state is float32: element-wise states hold every
# table's [capacity_t, dim_t] back to back in table order (dense_state_offsets), row-wise ones
# one float per row from state_row_offsets[t].
# A row of -1 means "no row" (refused, not admitted, or unseen in eval): it reads as zeros and
# takes no update. Bags are KJT-ordered: bag g = f * batch_size + b is sample b of feature f.
# =============================================================================================

import torch
from torch import Tensor

GOLDEN = 0x9E3779B97F4A7C15
INITIALIZERS = {"uniform": 0, "normal": 1, "truncated_normal": 2, "constant": 3}
INITIALIZER_NAMES = {kind: name for name, kind in INITIALIZERS.items()}
OPTIMIZERS = {"sgd": 0, "adagrad": 1, "rowwise_adagrad": 2, "adam": 3, "adamw": 4, "ftrl": 5}
# Optimizer state buffers per kind: elementwise ones are shaped like the weights, row-wise ones
# hold one float per row. Adam's moments keep fbgemm's names; FTRL's keep TensorFlow's
# (accumulator n, the sum of squared gradients; linear z).
OPTIMIZER_STATES = {"sgd": (), "adagrad": ("momentum1",), "rowwise_adagrad": ("momentum1",),
                    "adam": ("momentum1", "momentum2"), "adamw": ("momentum1", "momentum2"),
                    "ftrl": ("accumulator", "linear")}
# The kernels' hyper-parameters, in order; FTRL's four come after the others' six (which it
# leaves at 0 but lr).
HYPERPARAMS = ("lr", "eps", "beta1", "beta2", "weight_decay", "lr_decay", "lr_power", "l1", "l2", "beta")
ROWWISE_STATE = {"rowwise_adagrad"}
TRUNC_NORMAL_ATTEMPTS = 16


def dedup_ids(ids: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """(unique ids in first-occurrence order, inverse index of each id, count of each unique)."""
    first: Dict[int, int] = {}
    inverse = []
    for v in ids.tolist():
        inverse.append(first.setdefault(v, len(first)))
    unique = torch.tensor(list(first), dtype=torch.int64)
    inv = torch.tensor(inverse, dtype=torch.int64)
    return unique, inv, torch.bincount(inv, minlength=len(first)).to(torch.int64)


def dedup_segments(ids: Tensor, segment_offsets: Tensor) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """``dedup_ids`` within each segment [segment_offsets[s], segment_offsets[s+1]) (one table's ids).

    Returns the segments' unique ids concatenated, each id's index into that concatenation,
    the counts, and unique_offsets (where each segment's uniques start).
    """
    uniques, inverses, counts, unique_offsets = [], [], [], [0]
    bounds = segment_offsets.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        u, inv, c = dedup_ids(ids[start:end])
        uniques.append(u)
        inverses.append(inv + unique_offsets[-1])
        counts.append(c)
        unique_offsets.append(unique_offsets[-1] + u.numel())
    cat = lambda parts: torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)
    return cat(uniques), cat(inverses), cat(counts), torch.tensor(unique_offsets, dtype=torch.int64)


def table_seed(seed: int, table_name: str) -> int:
    """64-bit seed of one table: FNV-1a of its name mixed with the user's seed (as int64)."""
    h = 0xCBF29CE484222325
    for byte in table_name.encode():
        h = ((h ^ byte) * 0x100000001B3) & _MASK64
    h = _fmix64(h ^ _fmix64((seed & _MASK64) ^ GOLDEN))
    return h - (1 << 64) if h >> 63 else h


def _u64(x: int) -> Tensor:
    """A uint64 constant as the int64 tensor with the same bits."""
    return torch.tensor(x - (1 << 64) if x >> 63 else x, dtype=torch.int64)


def _srl(x: Tensor, s: int) -> Tensor:
    """Logical right shift of int64 bit patterns."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def fmix64_tensor(x: Tensor) -> Tensor:
    """MurmurHash3's 64-bit finaliser on int64 bit patterns (wrapping arithmetic)."""
    x = x ^ _srl(x, 33)
    x = x * _u64(0xFF51AFD7ED558CCD)
    x = x ^ _srl(x, 33)
    x = x * _u64(0xC4CEB9FE1A85EC53)
    return x ^ _srl(x, 33)


def bucket_pairs(keys: Tensor, capacity: int) -> Tuple[Tensor, Tensor]:
    """``place`` of many keys at once: the two buckets each int64 key may use in a table of
    ``capacity`` rows, vectorised on int64 bit patterns."""
    num_buckets, num_stripes = geometry(capacity)
    low = 0xFFFFFFFF
    h = fmix64_tensor(keys.to(torch.int64) ^ _u64(0x9E3779B97F4A7C15))
    h2 = fmix64_tensor(h ^ _u64(0xC2B2AE3D27D4EB4F))
    width, wide = divmod(num_buckets, num_stripes)

    def span(stripe: Tensor) -> Tuple[Tensor, Tensor]:  # first bucket and bucket count
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


def pair_bits(ids: Tensor, num_pairs: int, seed: int, attempt: int = 0) -> Tensor:
    """[n, num_pairs] int64 random bits; pair p of id k feeds its elements 2p and 2p+1:
    fmix64(fmix64(k ^ seed) + (attempt * 2^32 + p + 1) * GOLDEN)."""
    row_key = fmix64_tensor(ids.to(torch.int64) ^ _u64(seed & _MASK64)).unsqueeze(1)
    counters = torch.arange(num_pairs, dtype=torch.int64, device=ids.device) + (attempt << 32) + 1
    return fmix64_tensor(row_key + counters * _u64(GOLDEN))


def _box_muller(bits: Tensor) -> Tensor:
    """[n, 2 * pairs] normals: r cos(theta), r sin(theta) from each pair's high and low 32 bits."""
    u1 = (_srl(bits, 32).double() + 0.5) * 2.0**-32
    u2 = (bits & 0xFFFFFFFF).double() * 2.0**-32
    r = torch.sqrt(-2.0 * torch.log(u1))
    return torch.stack([r * torch.cos(2.0 * math.pi * u2), r * torch.sin(2.0 * math.pi * u2)], dim=2).flatten(1)


def init_vectors(ids: Tensor, dim: int, seed: int, kind: str, params: Sequence[float]) -> Tensor:
    """Initial [n, dim] float32 vectors of ``ids``: a pure function of (seed, id, element).

    kind/params: uniform (low, high), normal (mean, std), truncated_normal (mean, std, low, high:
    an element out of range is redrawn from its pair's next attempts, up to 16 draws, then
    clamped), constant (value,). One 64-bit hash feeds two elements; float64, then cast.
    """
    if kind == "constant":
        return torch.full((ids.numel(), dim), params[0], dtype=torch.float32, device=ids.device)
    num_pairs = (dim + 1) // 2
    bits = pair_bits(ids, num_pairs, seed)
    if kind == "uniform":
        low, high = params[0], params[1]
        u = torch.stack([_srl(bits, 40), (bits & 0xFFFFFFFF) >> 8], dim=2).flatten(1).double() * 2.0**-24
        return (low + (high - low) * u)[:, :dim].float()
    mean, std = params[0], params[1]
    values = mean + std * _box_muller(bits)
    if kind == "truncated_normal":
        low, high = params[2], params[3]
        for attempt in range(1, TRUNC_NORMAL_ATTEMPTS):
            outside = (values < low) | (values > high)
            if not bool(outside.any()):
                break
            redraw = mean + std * _box_muller(pair_bits(ids, num_pairs, seed, attempt))
            values = torch.where(outside, redraw, values)
        values = values.clamp(low, high)
    return values[:, :dim].float()


STORAGE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # index = the kernels' dtype code
SR_GOLDEN = 0xD6E8FEB86659FD93  # the rounding stream's counter constant (not the init stream's)


def dtype_code(dtype: torch.dtype) -> int:
    return STORAGE_DTYPES.index(dtype)


def table_words(capacity: int, dim: int, dtype: torch.dtype = torch.float32) -> int:
    """4-byte words of a table's rows in the flat buffer: its bytes rounded up to whole words."""
    return -(-capacity * dim * STORAGE_DTYPES[dtype_code(dtype)].itemsize // 4)


def _dtypes_of(table_dtypes: Optional[Tensor], num_tables: int) -> List[torch.dtype]:
    codes = [0] * num_tables if table_dtypes is None else table_dtypes.tolist()
    return [STORAGE_DTYPES[c] for c in codes]


def _table_rows(weights: Tensor, table_offsets: Tensor, table_dims: Tensor, capacities: Sequence[int],
                dtypes: Sequence[torch.dtype]) -> List[Tensor]:
    """[capacity_t, dim_t] views of each table inside the flat buffer, in its storage dtype."""
    views = []
    for t, (cap, dtype) in enumerate(zip(capacities, dtypes)):
        off, dim = int(table_offsets[t]), int(table_dims[t])
        words = weights[off:off + table_words(cap, dim, dtype)]
        views.append(words.view(dtype)[:cap * dim].view(cap, dim))
    return views


def _capacities(weights: Tensor, table_offsets: Tensor, table_dims: Tensor, dtypes: Sequence[torch.dtype]) -> List[int]:
    ends = table_offsets.tolist()[1:] + [weights.numel()]
    return [(end - off) * 4 // (dim * dtype.itemsize)
            for off, end, dim, dtype in zip(table_offsets.tolist(), ends, table_dims.tolist(), dtypes)]


def dense_state_offsets(capacities: Sequence[int], dims: Sequence[int]) -> List[int]:
    """Where each table's element-wise optimizer state starts: the tables back to back."""
    out, total = [], 0
    for cap, dim in zip(capacities, dims):
        out.append(total)
        total += cap * dim
    return out


def rounding_seed(table_seed: int) -> int:
    """A table's stochastic-rounding seed (as int64): a stream of its own, not the init stream's,
    and never 0 (which the kernels read as "round to nearest")."""
    h = _fmix64((table_seed ^ SR_GOLDEN) & _MASK64) | 1
    return h - (1 << 64) if h >> 63 else h


FALLBACK_GOLDEN = 0x8CB92BA72F3D8DD7  # the fallback-row hash's constant (neither the bucket's nor the route's)


def fallback_seed(table_seed: int) -> int:
    """A table's fallback-row hash seed (as int64): from the table seed, so the choice of
    fallback row is a stream of its own, independent of the bucket hash (``fmix64(id ^ GOLDEN)``)
    and of the routing hash (unseeded), and the same for every shard of the table."""
    h = _fmix64((table_seed ^ FALLBACK_GOLDEN) & _MASK64)
    return h - (1 << 64) if h >> 63 else h


def fallback_slots(ids: Tensor, seeds: Tensor, num_rows: Tensor) -> Tensor:
    """Which of its table's ``num_rows`` fallback rows each id reads: ``fmix64(id ^ seed) >> 1``
    modulo num_rows (``seeds``: ``fallback_seed`` of each id's table; both broadcast with ids)."""
    return _srl(fmix64_tensor(ids.to(torch.int64) ^ seeds), 1) % num_rows


def rounding_bits(ids: Tensor, dim: int, seed: int, step: int) -> Tensor:
    """[n, dim] int64 in [0, 2^16): the random bits stochastic rounding adds to element d of the
    row of each id at optimizer step ``step``, for a table whose rounding seed is ``seed``:
        key = fmix64(fmix64(id ^ seed) + step * SR_GOLDEN)
        bits_q = fmix64(key + (q + 1) * SR_GOLDEN), one 64-bit hash per 4 elements (q = d // 4)
        r_d = (bits_q >> 16 * (d % 4)) & 0xFFFF
    A pure function: no generator state to checkpoint, the same bits whatever the world size."""
    key = fmix64_tensor(fmix64_tensor(ids.to(torch.int64) ^ _u64(seed & _MASK64)) + _u64((step * SR_GOLDEN) & _MASK64))
    q = torch.arange((dim + 3) // 4, dtype=torch.int64, device=ids.device) + 1
    bits = fmix64_tensor(key.unsqueeze(1) + q * _u64(SR_GOLDEN))
    return torch.stack([_srl(bits, 16 * e) & 0xFFFF for e in range(4)], dim=2).flatten(1)[:, :dim]


# float32 bit patterns of each half dtype's largest finite value and of the magnitude from which
# round to nearest gives inf (stochastic rounding below it stays finite)
BF16_MAX_BITS, BF16_OVERFLOW_BOUNDARY = 0x7F7F0000, 0x7F7F8000
HALF_MAX_BITS, HALF_OVERFLOW_BOUNDARY = 0x477FE000, 0x477FF000


def round_to_storage(x: Tensor, dtype: torch.dtype, bits: Optional[Tensor] = None) -> Tensor:
    """float32 ``x`` in the storage dtype: round to nearest even (``bits`` None, or float32), else
    stochastic rounding with 16 random bits per element (``rounding_bits``):

    bfloat16: the float32 bit pattern plus r, truncated to its top 16 bits (16 bits are dropped:
    exactly unbiased). float16: D dropped bits, D = 13 for |x| >= 2^-14 and 126 - biased exponent
    (up to 23) below, in the subnormal range; the pattern plus r scaled to D bits (r >> (16 - D),
    or r << (D - 16)), truncated to a multiple of 2^D, which is then exactly a float16. |x| < 2^-24
    rounds to 2^-24 when r < |x| * 2^40, else to 0. Inf and NaN round to nearest. Truncation is
    toward zero in magnitude; the sign is kept. A finite x below the dtype's overflow boundary
    (where round to nearest turns to inf: 65520 for float16) never rounds up to inf: it takes
    the dtype's largest finite value."""
    if dtype == torch.float32:
        return x.float()
    if bits is None:
        return x.float().to(dtype)
    u = x.float().contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    sign, a = u & 0x80000000, u & 0x7FFFFFFF
    special = a >= 0x7F800000
    if dtype == torch.bfloat16:
        t = (a + bits) & 0xFFFF0000
        t = torch.where((t == 0x7F800000) & (a < BF16_OVERFLOW_BOUNDARY), torch.full_like(a, BF16_MAX_BITS), t)
    else:
        dropped = torch.clamp(126 - (a >> 23), min=13)
        scaled = torch.where(dropped >= 16, bits << (dropped - 16).clamp(min=0), bits >> (16 - dropped).clamp(min=0))
        t = (a + scaled) & ~((torch.ones_like(a) << dropped.clamp(max=62)) - 1)
        tiny = a < 0x33800000
        away = bits.double() < x.double().abs() * 2.0**40
        t = torch.where(tiny, torch.where(away, torch.full_like(a, 0x33800000), torch.zeros_like(a)), t)
        t = torch.where((t >= 0x47800000) & (a < HALF_OVERFLOW_BOUNDARY), torch.full_like(a, HALF_MAX_BITS), t)
    rounded = (t | sign).to(torch.int32).view(torch.float32).to(dtype)  # exact: t is on the dtype's grid
    return torch.where(special, x.float().to(dtype), rounded)


def _bag_of_values(offsets: Tensor, num_values: int) -> Tensor:
    lengths = (offsets[1:] - offsets[:-1]).clamp(min=0)
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=offsets.device), lengths)[:num_values]


def pooled_lookup(
    weights: Tensor, table_offsets: Tensor, table_dims: Tensor,
    feature_table: Tensor, feature_col: Tensor, feature_mean: Tensor,
    rows: Tensor, offsets: Tensor, per_sample_weights: Optional[Tensor],
    batch_size: int, total_dim: int, new_vectors: Sequence[Tensor] = (), table_dtypes: Optional[Tensor] = None,
) -> Tensor:
    """[batch_size, total_dim] float32 pooled output: feature f's bags land in columns feature_col[f]...

    Each bag sums (or, where feature_mean[f], averages over its length) the rows of its ids,
    scaled by per_sample_weights when given. Rows of -1 read as zeros; empty bags are zeros.
    Row -2 - j of table t reads new_vectors[t][j] (a new row's initial vector, not yet written, in
    the table's storage dtype). Rows are read as float32 and summed in float32.
    """
    dtypes = _dtypes_of(table_dtypes, table_offsets.numel())
    tables = _table_rows(weights, table_offsets, table_dims, _capacities(weights, table_offsets, table_dims, dtypes),
                         dtypes)
    out = torch.zeros(batch_size, total_dim, dtype=torch.float32, device=weights.device)
    for f in range(feature_table.numel()):
        t, col = int(feature_table[f]), int(feature_col[f])
        dim = int(table_dims[t])
        for b in range(batch_size):
            start, end = int(offsets[f * batch_size + b]), int(offsets[f * batch_size + b + 1])
            acc = torch.zeros(dim, dtype=torch.float32, device=weights.device)
            for i in range(start, end):
                r = int(rows[i])
                if r != -1:
                    scale = 1.0 if per_sample_weights is None else float(per_sample_weights[i])
                    acc += scale * (tables[t][r] if r >= 0 else new_vectors[t][-2 - r]).float()
            if bool(feature_mean[f]) and end > start:
                acc /= end - start
            out[b, col:col + dim] = acc
    return out


def sequence_lookup(
    weights: Tensor, table_offsets: Tensor, dim: int, feature_table: Tensor,
    feature_value_offsets: Tensor, rows: Tensor, new_vectors: Sequence[Tensor] = (),
    table_dtypes: Optional[Tensor] = None,
) -> Tensor:
    """[num_values, dim] float32: the row of each id (zeros for -1; new_vectors[t][j] for -2 - j);
    values of feature f are [feature_value_offsets[f], feature_value_offsets[f + 1]) and read table
    feature_table[f]."""
    dtypes = _dtypes_of(table_dtypes, table_offsets.numel())
    dims = torch.full_like(table_offsets, dim)
    tables = _table_rows(weights, table_offsets, dims, _capacities(weights, table_offsets, dims, dtypes), dtypes)
    out = torch.zeros(rows.numel(), dim, dtype=torch.float32, device=weights.device)
    for f in range(feature_table.numel()):
        t = int(feature_table[f])
        for i in range(int(feature_value_offsets[f]), int(feature_value_offsets[f + 1])):
            r = int(rows[i])
            if r >= 0:
                out[i] = tables[t][r].float()
            elif r <= -2:
                out[i] = new_vectors[t][-2 - r].float()
    return out


def fused_update(
    grad: Tensor, weights: Tensor, states: List[Tensor],
    table_offsets: Tensor, table_dims: Tensor, state_row_offsets: Tensor,
    unique_rows: Tensor, unique_table: Tensor, inverse: Tensor,
    offsets: Optional[Tensor], per_sample_weights: Optional[Tensor],
    feature_col: Tensor, feature_mean: Tensor, batch_size: int,
    optimizer: str, hparams: Sequence[float], step: int,
    new_vectors: Sequence[Tensor] = (), unique_new: Optional[Tensor] = None, state_init: Sequence[float] = (),
    table_dtypes: Optional[Tensor] = None, unique_ids: Optional[Tensor] = None,
    rounding_seeds: Optional[Tensor] = None,
) -> None:
    """Backward of a lookup fused with the optimizer step, in place on weights and states.

    The step runs in float32 on the row read as float32; the result is written in the table's
    storage dtype: round to nearest even, or, for a half-precision table t with
    rounding_seeds[t] != 0, stochastic rounding (``round_to_storage``) with the bits
    ``rounding_bits(unique_ids[u], dim, rounding_seeds[t], step)``.

    New rows first: a unique row u with unique_new[u] = j >= 0 takes new_vectors[t][j] and each
    state its state_init value over that row, then the step below.

    Value i belongs to unique row inverse[i]. Its gradient is, for a pooled lookup (offsets
    given), grad[b, col:col+dim] of its bag g = f * batch_size + b times its per-sample weight
    and 1/len(bag) for mean features; for a sequence lookup (offsets None), grad[i]. Gradients
    are summed per unique row, then each unique row with row >= 0 takes one step of
    ``optimizer`` with hparams (lr, eps, beta1, beta2, weight_decay, lr_decay[, lr_power, l1, l2,
    beta]) (``HYPERPARAMS``; the last four only for FTRL), ``step`` being the 1-based step count
    (Adam's bias correction, Adagrad's lr decay). The update rules are torch.optim's SGD /
    Adagrad / Adam / AdamW and torchrec.optim.RowWiseAdagrad on the touched rows, and
    FTRL-Proximal (``ftrl_step``).
    """
    lr, eps, beta1, beta2, weight_decay, lr_decay = hparams[:6]
    dtypes = _dtypes_of(table_dtypes, table_offsets.numel())
    caps = _capacities(weights, table_offsets, table_dims, dtypes)
    tables = _table_rows(weights, table_offsets, table_dims, caps, dtypes)
    state_offsets = dense_state_offsets(caps, table_dims.tolist())
    if unique_new is not None:
        for u in (unique_new >= 0).nonzero().flatten().tolist():
            r, t, j = int(unique_rows[u]), int(unique_table[u]), int(unique_new[u])
            dim, off = int(table_dims[t]), state_offsets[t]
            tables[t][r] = new_vectors[t][j]
            for state, value in zip(states, state_init):
                if optimizer == "rowwise_adagrad":
                    state[int(state_row_offsets[t]) + r] = value
                else:
                    state[off + r * dim: off + (r + 1) * dim] = value
    n = inverse.numel()
    if offsets is None:
        value_grads = grad[:n].float()
    else:
        bags = _bag_of_values(offsets, n)
        feature, sample = bags // batch_size, bags % batch_size
        lengths = (offsets[1:] - offsets[:-1]).to(torch.float32)
        scale = torch.ones(n, dtype=torch.float32, device=grad.device)
        if per_sample_weights is not None:
            scale = scale * per_sample_weights.float()
        mean = feature_mean[feature]
        scale = torch.where(mean, scale / lengths[bags].clamp(min=1), scale)
        value_grads = [scale[i] * grad[sample[i], int(feature_col[feature[i]]):][: int(table_dims[int(unique_table[int(inverse[i])])])]
                       for i in range(n)]
    for u in range(unique_rows.numel()):
        r, t = int(unique_rows[u]), int(unique_table[u])
        if r < 0:
            continue
        dim = int(table_dims[t])
        g = torch.zeros(dim, dtype=torch.float32, device=grad.device)
        for i in (inverse == u).nonzero().flatten().tolist():
            g += value_grads[i][:dim]
        w = tables[t][r].float()  # a copy: the step runs in float32, the result is stored below
        elem = slice(state_offsets[t] + r * dim, state_offsets[t] + (r + 1) * dim)
        if weight_decay != 0 and optimizer in ("sgd", "adagrad", "rowwise_adagrad", "adam"):
            g = g + weight_decay * w  # L2: torch's coupled weight decay
        if optimizer == "sgd":
            w.add_(g, alpha=-lr)
        elif optimizer == "adagrad":
            s = states[0][elem]
            s.addcmul_(g, g)
            clr = lr / (1 + (step - 1) * lr_decay)
            w.addcdiv_(g, s.sqrt().add_(eps), value=-clr)
        elif optimizer == "rowwise_adagrad":
            s = states[0][int(state_row_offsets[t]) + r:][:1]
            s += g.pow(2).mean()
            clr = lr / (1 + (step - 1) * lr_decay)
            w.addcdiv_(g, s.sqrt().add_(eps), value=-clr)
        elif optimizer in ("adam", "adamw"):
            if optimizer == "adamw":
                # torch.optim.AdamW: decay the weight first (decoupled from the moments), then Adam.
                w.mul_(1 - lr * weight_decay)
            m, v = states[0][elem], states[1][elem]
            m.lerp_(g, 1 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            bc1, bc2 = 1 - beta1**step, 1 - beta2**step
            w.addcdiv_(m, (v.sqrt() / math.sqrt(bc2)).add_(eps), value=-lr / bc1)
        elif optimizer == "ftrl":
            lr_power, l1, l2, beta = hparams[6:10]
            ftrl_step(w, g, states[0][elem], states[1][elem], lr, lr_power, l1, l2, beta)
        else:
            raise ValueError(f"fused_update: optimizer must be one of {sorted(OPTIMIZERS)}, got {optimizer!r}")
        seed = 0 if rounding_seeds is None else int(rounding_seeds[t])
        bits = None if seed == 0 or dtypes[t] == torch.float32 else \
            rounding_bits(unique_ids[u:u + 1], dim, seed, step)[0]
        tables[t][r] = round_to_storage(w, dtypes[t], bits)


def ftrl_step(w: Tensor, g: Tensor, n: Tensor, z: Tensor, lr: float, lr_power: float, l1: float, l2: float,
              beta: float) -> None:
    """One FTRL-Proximal step, in place on the weights ``w``, accumulator ``n`` and linear ``z``.

    TensorFlow's update (tf.keras.optimizers.Ftrl, kernel ApplyFtrl with beta folded into l2 as
    l2 + beta / (2 lr), so the denominator below), per element:
        n' = n + g^2
        sigma = (n'^-lr_power - n^-lr_power) / lr
        z' = z + g - sigma * w
        w' = (sign(z') * l1 - z') / ((beta + n'^-lr_power) / lr + 2 * l2)   where |z'| > l1, else 0
    Signs: z accumulates the gradient as it is (McMahan et al. 2013, Algorithm 1), so w' has the
    sign of -z'. TensorFlow's documentation writes the denominator's l2 term as lambda_2, its
    kernel (what it trains with) as 2 * l2: this follows the kernel.
    """
    n_new = n + g * g
    p_new, p_old = n_new.pow(-lr_power), n.pow(-lr_power)
    sigma = (p_new - p_old) / lr
    z.add_(g - sigma * w)
    n.copy_(n_new)
    quadratic = (p_new + beta) / lr + 2 * l2
    w.copy_(torch.where(z.abs() > l1, (torch.sign(z) * l1 - z) / quadratic, torch.zeros_like(w)))
