"""The ring of stripes (issue 11, finding 6): a key's bucket2 lies in the stripe after its own, so
keys can flow between stripes, and an upsert inserts its new keys phase by phase (even stripes,
odd stripes, the last stripe of an odd ring), each stripe's in batch order. Checked against the
dict model in torchrec_ext.reference for 1, 2, 3, 4 and 5 stripes, on 1 and 2 threads (which
must give the same results), with full tables where new keys of neighbouring stripes compete
for the same buckets and evict."""

import bisect
import math
import random

import pytest
import torch

from torchrec_ext import HashTable
from torchrec_ext.reference import (
    ReferenceHashTable,
    bucket_pairs,
    geometry,
    insert_order,
    place,
    stripe_of,
    upsert_phase,
    upsert_windows,
)

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# Capacities giving 1, 2, 3, 4 and 5 stripes (the odd ones have an uneven last bucket or stripe).
STRIPES = {2048: 1, 4096: 2, 64 * 32 * 3 + 5: 3, 64 * 32 * 4: 4, 64 * 32 * 5 + 7: 5}


def _keys(values):
    return torch.tensor(values, dtype=torch.int64)


@pytest.mark.parametrize("capacity", list(STRIPES) + [33, 3 * 2**21 + 7])
def test_bucket2_lies_in_the_next_stripe(capacity):
    buckets, stripes = geometry(capacity)
    assert STRIPES.get(capacity, stripes) == stripes
    width, wide = divmod(buckets, stripes)
    first = [s * width + min(s, wide) for s in range(stripes)] + [buckets]
    stripe_of_bucket = [s for s in range(stripes) for _ in range(first[s], first[s + 1])]
    keys = torch.randint(INT64_MIN, INT64_MAX, (2000,), generator=torch.Generator().manual_seed(capacity))
    b1, b2 = bucket_pairs(keys, capacity)  # the vectorised mirror of place_key equals the oracle
    assert list(zip(b1.tolist(), b2.tolist())) == [place(k, capacity)[:2] for k in keys.tolist()]
    for k, x, y in zip(keys.tolist(), b1.tolist(), b2.tolist()):
        s = stripe_of(k, capacity)
        assert stripe_of_bucket[x] == s
        assert stripe_of_bucket[y] == ((s + 1) % stripes if stripes > 1 else s)
        assert x != y or buckets == 1
    if 1 < stripes <= 64:  # the bucket2s reach every stripe (of few enough to be hit by 2000 keys)
        assert {stripe_of_bucket[y] for y in b2.tolist()} == set(range(stripes))


# 3 stripes (phases 0, 1, 2): windows of ceil(6149 / 8) = 769 positions, or an eighth of the
# positions before them once that is more (from position 6153 on).
@pytest.mark.parametrize("n", [2000, 40_000])
def test_insert_order_windows_and_rotating_phases(n):
    capacity = 64 * 32 * 3 + 5
    starts = upsert_windows(capacity, n)
    ends = starts[1:] + [n]
    assert starts[0] == 0 and all(e - b == max(769, -(-b // 8)) for b, e in zip(starts, ends[:-1]))
    assert 0 < ends[-1] - starts[-1] <= max(769, -(-starts[-1] // 8))
    if n > capacity:  # ~8 + 8.5 ln(n / capacity) windows, not n / 769
        assert len(starts) <= 9 + 8.5 * math.log(n / capacity) < n / 769
    window_of = [bisect.bisect_right(starts, i) - 1 for i in range(n)]
    rng = random.Random(1)
    keys = [rng.randrange(INT64_MIN, INT64_MAX) for _ in range(n)]
    phase = [upsert_phase(stripe_of(k, capacity), 3) for k in keys]
    for clock in (3, 4, 5):
        order = insert_order(keys, capacity, clock)
        assert sorted(order) == list(range(len(keys)))
        ranks = [(window_of[i], (phase[i] - clock) % 3, i) for i in order]
        assert ranks == sorted(ranks)
        assert phase[order[0]] == clock % 3  # the first phase rotates with the clock


def test_upsert_phases():
    assert [upsert_phase(s, 1) for s in range(1)] == [0]
    assert [upsert_phase(s, 2) for s in range(2)] == [0, 1]
    assert [upsert_phase(s, 3) for s in range(3)] == [0, 1, 2]
    assert [upsert_phase(s, 4) for s in range(4)] == [0, 1, 0, 1]
    assert [upsert_phase(s, 5) for s in range(5)] == [0, 1, 0, 1, 2]
    for stripes in range(1, 9):  # stripes of one phase never share a bucket: {s, s + 1} disjoint
        for phase in range(3):
            mine = [s for s in range(stripes) if upsert_phase(s, stripes) == phase]
            touched = [t for s in mine for t in {s, (s + 1) % stripes}]
            assert len(touched) == len(set(touched)), (stripes, phase)


def _run(capacity, policy, threads, seed):
    """A random sequence of upserts, erases and finds on a table kept full, compared with the
    dict model after every call; returns every call's results and the final state."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        rng = random.Random(seed)
        table, model = HashTable(capacity, policy=policy), ReferenceHashTable(capacity, policy)
        universe = [rng.randrange(INT64_MIN, INT64_MAX) for _ in range(3 * capacity)] + [INT64_MIN, -1, 0, INT64_MAX]
        results = []
        for step in range(10):
            op = "upsert" if step < 3 else rng.choice(["upsert"] * 5 + ["assign", "erase", "find"])
            live = [k for k, _, _ in model.export()]
            n = capacity if step < 3 else rng.randint(1, capacity // 2)
            batch = [rng.choice(universe) for _ in range(n)]
            if live and step >= 3:  # residents of every stripe mixed in, so pins matter
                batch += rng.sample(live, min(len(live), n // 2))
                rng.shuffle(batch)
            keys = _keys(batch)
            if op == "find":
                rows, found = table.find(keys)
                assert (rows.tolist(), found.tolist()) == model.find(batch)
                results.append((rows, found))
            elif op == "erase":
                erased = table.erase(keys)
                assert erased.tolist() == model.erase(batch)
                results.append((erased,))
            else:
                scores = [rng.randrange(0, 9) for _ in batch] if policy == "lfu" and rng.random() < 0.5 else None
                assign = op == "assign"
                call = table.insert_or_assign if assign else table.find_or_insert
                got = call(keys, None if scores is None else _keys(scores))
                want = model.upsert(batch, scores, assign=assign)
                assert [t.tolist() for t in got] == list(want), (step, op)
                results.append(tuple(got))
            assert table.size() == model.size()
            assert not (table._digests & 0x80).any(), "a call left rows pinned"
            keys_, rows_, scores_ = table.state_dict()["keys"], table.state_dict()["rows"], table.state_dict()["scores"]
            assert list(zip(keys_.tolist(), rows_.tolist(), scores_.tolist())) == model.export(), (step, op)
        return results, table.state_dict()
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(
    "capacity, policy",
    [
        (2048, "lru"),
        (4096, "lfu"),
        (64 * 32 * 3 + 5, "lru"),
        (64 * 32 * 3 + 5, "lfu"),
        (64 * 32 * 4, "lru"),
        (64 * 32 * 5 + 7, "lfu"),
    ],
)
def test_kernels_match_reference_on_one_and_two_threads(capacity, policy):
    one = _run(capacity, policy, 1, capacity + len(policy))
    two = _run(capacity, policy, 2, capacity + len(policy))
    for a, b in zip(one[0], two[0]):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert all(torch.equal(one[1][k], two[1][k]) for k in ("keys", "rows", "scores"))


@pytest.mark.parametrize("capacity, policy", [(4096, "lru"), (64 * 32 * 3 + 5, "lfu")])
def test_kernels_match_reference_on_batches_far_larger_than_the_table(capacity, policy):
    """Batches of 5 to 9 times the capacity (resident and repeated keys mixed in): their windows
    grow past the first `capacity` positions (an eighth of the positions before them), and the
    kernels, on 1 and 2 threads, give the dict model's results, in which the window bounds decide
    which new keys take the rows."""
    runs = []
    for threads in (1, 2):
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            rng = random.Random(capacity)
            table, model = HashTable(capacity, policy=policy), ReferenceHashTable(capacity, policy)
            results = []
            for step in range(4):
                live = [k for k, _, _ in model.export()]
                n = rng.choice([5, 7, 9]) * capacity
                batch = [rng.randrange(INT64_MIN, INT64_MAX) for _ in range(n - len(live) // 2)]
                batch += rng.sample(live, len(live) // 2) + batch[: n // 10]
                rng.shuffle(batch)
                assert len(upsert_windows(capacity, len(batch))) < len(batch) / -(-capacity // 8)
                got = table.find_or_insert(_keys(batch))
                assert [t.tolist() for t in got] == list(model.upsert(batch)), step
                results.append(tuple(got))
            assert list(zip(*[table.state_dict()[k].tolist() for k in ("keys", "rows", "scores")])) == model.export()
            runs.append(results)
        finally:
            torch.set_num_threads(before)
    for a, b in zip(*runs):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("clock", [0, 1])
def test_phase_order_decides_which_new_key_gets_a_contested_slot(clock):
    """Two stripes: a new key of stripe 1 early in the batch and one of stripe 0 later, whose only
    free slot is the same one, in a bucket of stripe 1 (bucket1 of the first, bucket2 of the
    second). The call's first phase (its clock mod 2) takes it: stripe 1's key on odd clocks,
    stripe 0's on even ones, whatever the batch order."""
    capacity = 4096
    rng = random.Random(7)
    pool = [rng.randrange(INT64_MIN, INT64_MAX) for _ in range(20_000)]
    b = 64 + 5  # a bucket of stripe 1
    early = next(k for k in pool if place(k, capacity)[0] == b)  # stripe 1, bucket1 == b
    late = next(k for k in pool if place(k, capacity)[1] == b)  # stripe 0, bucket2 == b
    assert stripe_of(early, capacity) == 1 and stripe_of(late, capacity) == 0
    # b gets 31 keys, the other bucket of each of the two keys 32: one free slot between them.
    room = {b: 31, place(early, capacity)[1]: 32, place(late, capacity)[0]: 32}
    filled = dict.fromkeys(room, 0)
    keys, rows = [], []
    for k in pool:
        if k in (early, late):
            continue
        for bucket in place(k, capacity)[:2]:
            if bucket in room and filled[bucket] < room[bucket]:
                keys.append(k)
                rows.append(bucket * 32 + filled[bucket])
                filled[bucket] += 1
                break
    assert filled == room
    table, model = HashTable(capacity, policy="none"), ReferenceHashTable(capacity, "none")
    table.load_state_dict(
        {
            "capacity": capacity,
            "policy": "none",
            "clock": clock,
            "epoch": 0,
            "keys": _keys(keys),
            "rows": _keys(rows),
            "scores": torch.zeros(len(keys), dtype=torch.int64),
        }
    )
    for k, r in zip(keys, rows):
        model.row_of[k], model.key_at[r], model.score_at[r] = r, k, 0
    model.clock = clock
    got = table.find_or_insert(_keys([early, late]))  # the call's clock is clock + 1
    assert [t.tolist() for t in got] == list(model.upsert([early, late]))
    winner = 1 if (clock + 1) % 2 == 0 else 0
    assert got.rows.tolist()[winner] == b * 32 + 31 and got.rows.tolist()[1 - winner] == -1


@pytest.mark.parametrize("times", [2, 64])
@pytest.mark.parametrize("policy", ["lru", "lfu", "none"])
def test_a_batch_of_more_new_keys_than_rows_fills_every_stripe_evenly(policy, times):
    """A full table, then batches of 2 or 64 times its capacity in fresh keys (as a warm-up does):
    the keys kept come from every stripe alike. Were all of a phase's keys inserted before the next
    phase's, the first phase's stripes (even ones) would take every row, and a reshard of such a
    table could not place its ids (their buckets miss the odd stripes of the new geometry). At 64x,
    windows of a fixed share of the batch (64 * capacity / 32 positions) would let one phase's
    keys of the first window take nearly every row."""
    capacity = 8192  # 4 stripes
    table = HashTable(capacity, policy=policy)
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        table.find_or_insert(torch.randint(-(2**62), 2**62, (times * capacity,), generator=gen))
    assert table.size() == capacity
    keys = table.state_dict()["keys"]
    stripes = torch.tensor([stripe_of(k, capacity) for k in keys.tolist()])
    per_stripe = torch.bincount(stripes, minlength=4)
    assert int(per_stripe.min()) > 0.8 * capacity / 4, per_stripe.tolist()
