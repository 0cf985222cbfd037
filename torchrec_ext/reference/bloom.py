"""The bloom admission's counting Bloom filter (``bloom_admit``), one key and one counter at a time."""

from __future__ import annotations

from collections.abc import Sequence

from torchrec_ext.reference.hashing import _MASK64, _fmix64

BLOOM_COUNTER_MAX = 15


def bloom_key_cells(key: int, hash_seed: int, counters: int, hashes: int) -> list[int]:
    """The ``hashes`` counters of ``key`` in a counting Bloom filter of ``counters`` cells (a
    power of two): double hashing h1 + i * h2 of h = fmix64(key ^ hash_seed), h1 the low 32 bits
    of h, h2 its high 32 bits with the lowest bit set (odd: the steps visit every cell)."""
    h = _fmix64((key ^ hash_seed) & _MASK64)
    h1, h2 = h & 0xFFFFFFFF, (h >> 32) | 1
    return [(h1 + i * h2) % counters for i in range(hashes)]


def bloom_admit(
    packed: Sequence[int],
    keys: Sequence[int],
    counts: Sequence[int],
    pending: Sequence[bool] | None,
    hash_seed: int,
    hashes: int,
    admit_after: int,
) -> tuple[list[int], list[bool]]:
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
    admitted = [
        bool(counted)
        and min(counters[c] for c in bloom_key_cells(key, hash_seed, len(counters), hashes)) >= admit_after
        for key, counted in zip(keys, pending)
    ]
    return [counters[2 * b] | (counters[2 * b + 1] << 4) for b in range(len(packed))], admitted
