"""HashTable against the dict model in torchrec_ext.reference, op by op, exactly."""

import random

import pytest
import torch

from torchrec_ext import HashTable
from torchrec_ext.reference import ReferenceHashTable, place

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
EXTREME_KEYS = [INT64_MIN, INT64_MIN + 1, -1, 0, 1, INT64_MAX - 1, INT64_MAX]


def _keys(values, device):
    return torch.tensor(values, dtype=torch.int64, device=device)


def _assert_same_state(table: HashTable, model: ReferenceHashTable):
    assert table.size() == model.size()
    assert not (table._digests & 0x80).any(), "a call left rows pinned"
    keys, rows, scores = (torch.cat(parts).tolist() for parts in zip(*table.export(page_size=1000)))
    assert list(zip(keys, rows, scores)) == model.export()


def _random_batch(rng: random.Random, universe, n):
    batch = [rng.choice(universe) for _ in range(n)]
    batch += rng.sample(EXTREME_KEYS, 2)  # extremes in every batch, duplicates common
    rng.shuffle(batch)
    return batch


@pytest.mark.parametrize("policy", ["lru", "lfu", "epoch_lru", "epoch_lfu", "custom", "none"])
@pytest.mark.parametrize("capacity", [20, 37, 1000, 64 * 32 * 3 + 5])
def test_random_sequences_match_dict_model(policy, capacity, device):
    rng = random.Random(capacity * 7 + len(policy))
    table = HashTable(capacity, policy=policy, device=device)
    model = ReferenceHashTable(capacity, policy)
    # Universe ~2x capacity so buckets fill, evictions and refusals happen.
    universe = [rng.randrange(INT64_MIN, INT64_MAX) for _ in range(2 * capacity)] + EXTREME_KEYS
    for step in range(40):
        op = rng.choice(["find_or_insert"] * 4 + ["insert_or_assign", "find", "erase"])
        batch = _random_batch(rng, universe, rng.randint(0, capacity // 2 + 3))
        keys = _keys(batch, device)
        if op == "find":
            rows, found = table.find(keys)
            want_rows, want_found = model.find(batch)
            assert rows.tolist() == want_rows and found.tolist() == want_found
        elif op == "erase":
            assert table.erase(keys).tolist() == model.erase(batch)
        else:
            assign = op == "insert_or_assign"
            scores = None
            if (
                policy == "custom"
                or (assign and rng.random() < 0.5)
                or (policy in ("lfu", "epoch_lfu") and rng.random() < 0.3)
            ):
                scores = [rng.randrange(0, 50) for _ in batch]
            if step % 10 == 9 and policy.startswith("epoch"):
                table.set_epoch(step)
                model.epoch = step
            call = table.insert_or_assign if assign else table.find_or_insert
            got = call(keys, None if scores is None else _keys(scores, device))
            rows, inserted, ev_keys, ev_rows = model.upsert(batch, scores, assign=assign)
            assert got.rows.tolist() == rows
            assert got.inserted.tolist() == inserted
            assert got.evicted_keys.tolist() == ev_keys
            assert got.evicted_rows.tolist() == ev_rows
        _assert_same_state(table, model)


def test_duplicates_share_one_row_and_only_first_is_inserted(device):
    table = HashTable(1000, device=device)
    res = table.find_or_insert(_keys([5, 7, 5, 5, -1, 7], device))
    r = res.rows.tolist()
    assert r[0] == r[2] == r[3] and r[1] == r[5]
    assert len({r[0], r[1], r[4]}) == 3
    assert res.inserted.tolist() == [True, True, False, False, True, False]
    assert table.size() == 3


def test_extreme_keys_are_ordinary_keys(device):
    table = HashTable(64, policy="none", device=device)
    keys = _keys(EXTREME_KEYS, device)
    rows = table.find_or_insert(keys).rows
    assert (rows >= 0).all() and (rows < 64).all() and len(set(rows.tolist())) == len(EXTREME_KEYS)
    found_rows, found = table.find(keys)
    assert found.all() and torch.equal(found_rows, rows)
    assert table.erase(_keys([0], device)).tolist() == [True]
    assert table.find(keys)[1].tolist() == [k != 0 for k in EXTREME_KEYS]


def test_find_reads_digests_that_are_not_16_byte_aligned(device):
    """A digests view off a 16-byte boundary finds what the table finds (on CUDA the find kernel
    then loads each bucket's digests byte by byte, not in two 16-byte loads)."""
    from torchrec_ext import ops

    capacity = 64 * 32 * 3 + 5  # 3 stripes
    table = HashTable(capacity, policy="lru", device=device)
    resident = torch.randint(INT64_MIN, INT64_MAX, (3000,), generator=torch.Generator().manual_seed(5))
    table.find_or_insert(resident.to(device))
    queries = torch.cat([resident, torch.randint(INT64_MIN, INT64_MAX, (2000,)), torch.tensor(EXTREME_KEYS)])
    queries = queries.to(device)
    want_rows, want_found = table.find(queries)
    assert want_found[:3000].all() and not want_found[3000:].any()
    digests = table._digests
    unaligned = torch.empty(digests.numel() + 1, dtype=torch.uint8, device=device)[1:].copy_(digests)
    assert unaligned.data_ptr() % 16 != 0
    rows, found = ops.hash_find(unaligned, table._slot_keys, queries, capacity)
    assert torch.equal(rows, want_rows) and torch.equal(found, want_found)


def test_rows_stay_below_capacity_in_partial_last_bucket(device):
    capacity = 3 * 32 + 5  # last bucket has 5 usable slots
    table = HashTable(capacity, policy="lru", device=device)
    for start in range(0, 20 * capacity, 50):
        rows = table.find_or_insert(torch.arange(start, start + 50, device=device)).rows
        assert rows.max() < capacity
    assert table.size() == capacity  # load factor reaches exactly 1.0
    assert table.load_factor() == 1.0


def test_load_factor_one_with_eviction_matches_model(device):
    capacity = 64 * 32 * 2  # 2 stripes of 64 buckets
    table, model = HashTable(capacity, policy="lru", device=device), ReferenceHashTable(capacity, "lru")
    rng = random.Random(3)
    for _ in range(30):
        batch = [rng.randrange(INT64_MIN, INT64_MAX) for _ in range(capacity // 2)]
        got = table.find_or_insert(_keys(batch, device))
        assert got.rows.tolist() == model.upsert(batch)[0]
    assert table.size() == model.size() == capacity
    keys, rows, _ = next(table.export(page_size=capacity + 64))
    found_rows, found = table.find(keys)
    assert found.all() and torch.equal(found_rows, rows)


def test_none_policy_refuses_when_full_and_keeps_old_keys(device):
    table = HashTable(32, policy="none", device=device)  # one bucket
    first = table.find_or_insert(torch.arange(32, device=device))
    assert (first.rows >= 0).all()
    more = table.find_or_insert(torch.arange(100, 110, device=device))
    assert (more.rows == -1).all() and not more.inserted.any() and more.evicted_keys.numel() == 0
    assert table.find(torch.arange(32, device=device))[1].all()


def test_lru_evicts_least_recently_touched(device):
    table = HashTable(32, policy="lru", device=device)  # one bucket: eviction order is global
    table.find_or_insert(torch.arange(32, device=device))
    table.find_or_insert(torch.arange(1, 32, device=device))  # key 0 is now the oldest
    res = table.find_or_insert(_keys([1000], device))
    assert res.evicted_keys.tolist() == [0] and res.rows.tolist() == res.evicted_rows.tolist()


def test_lfu_evicts_least_frequent_and_refuses_less_frequent_newcomer(device):
    table = HashTable(32, policy="lfu", device=device)
    keys = torch.arange(32, device=device)
    table.find_or_insert(keys, scores=torch.full((32,), 5, device=device))
    table.find_or_insert(_keys([7], device), scores=_keys([-0 + 0], device))  # +0 keeps it at 5
    res = table.find_or_insert(_keys([500], device), scores=_keys([3], device))
    assert res.rows.tolist() == [-1]  # 3 < 5: refused
    table.find_or_insert(_keys([9], device))  # 9 -> 6; all others 5
    res = table.find_or_insert(_keys([501], device), scores=_keys([5], device))
    assert res.evicted_keys.tolist() == [0]  # lowest score, first slot on ties


def test_keys_of_the_call_in_flight_are_not_evicted(device):
    table = HashTable(32, policy="lfu", device=device)  # one bucket
    table.find_or_insert(torch.arange(32, device=device))
    # 32 fresh keys (score 1 each, ties with the residents): each evicts one resident, never
    # one of the fresh keys inserted earlier in the same call.
    fresh = torch.arange(100, 132, device=device)
    res = table.find_or_insert(fresh)
    assert res.inserted.all() and len(set(res.rows.tolist())) == 32
    assert sorted(res.evicted_keys.tolist()) == list(range(32))
    rows, found = table.find(fresh)
    assert found.all() and torch.equal(rows, res.rows)


def test_export_pages_cover_exactly_the_live_keys(device):
    table = HashTable(5000, policy="lru", device=device)
    keys = torch.randint(INT64_MIN, INT64_MAX, (4000,), device=device)
    table.find_or_insert(keys)
    table.erase(keys[:1000])
    live = set(keys[1000:].tolist())
    for page_size in (1, 33, 1024, 10**6):
        pages = list(table.export(page_size=page_size))
        got = torch.cat([p[0] for p in pages]).tolist()
        assert len(got) == len(set(got)) and set(got) == live
        rows = torch.cat([p[1] for p in pages])
        assert torch.equal(table.find(torch.tensor(got, device=device))[0], rows)


def test_state_dict_round_trip_then_identical_behaviour(device):
    rng = random.Random(11)
    table = HashTable(3000, policy="lfu", device=device)
    for _ in range(5):
        table.find_or_insert(_keys([rng.randrange(-5000, 5000) for _ in range(1500)], device))
    state = table.state_dict()
    restored = HashTable(3000, policy="lfu", device=device)
    restored.load_state_dict(state)
    probe = _keys([rng.randrange(-6000, 6000) for _ in range(4000)], device)
    assert all(torch.equal(a, b) for a, b in zip(table.find(probe), restored.find(probe)))
    for _ in range(3):
        batch = _keys([rng.randrange(-8000, 8000) for _ in range(2000)], device)
        for a, b in zip(table.find_or_insert(batch), restored.find_or_insert(batch)):
            assert torch.equal(a, b)
    for a, b in zip(table.state_dict().values(), restored.state_dict().values()):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def test_clear_and_clone(device):
    table = HashTable(100, device=device)
    table.find_or_insert(torch.arange(50, device=device))
    twin = table.clone()
    table.clear()
    assert table.size() == 0 and not table.find(torch.arange(50, device=device))[1].any()
    assert twin.size() == 50 and twin.find(torch.arange(50, device=device))[1].all()


@pytest.mark.parametrize("threads", [1, 2])
def test_single_thread_ranges_with_empty_groups_release_pins(threads):
    # Regression: a thread whose range of stripe groups began with an empty group kept its
    # pins after the call, so those rows could never be evicted again.
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        rng = random.Random(5)
        table, model = HashTable(4096, policy="lru"), ReferenceHashTable(4096, "lru")
        for _ in range(60):
            batch = [rng.randrange(-(10**6), 10**6) for _ in range(rng.randint(1, 300))]
            assert table.find_or_insert(_keys(batch, "cpu")).rows.tolist() == model.upsert(batch)[0]
            _assert_same_state(table, model)
    finally:
        torch.set_num_threads(before)


def test_results_do_not_depend_on_thread_count():
    keys = torch.randint(-(10**6), 10**6, (200_000,))
    states = []
    for threads in (1, 2):
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            table = HashTable(100_000, policy="lfu")
            for chunk in keys.split(50_000):
                table.find_or_insert(chunk)
            states.append(table.state_dict())
        finally:
            torch.set_num_threads(before)
    assert all(torch.equal(states[0][k], states[1][k]) for k in ("keys", "rows", "scores"))


def test_model_placement_matches_two_candidate_buckets(device):
    # The table's rows must lie in one of the two buckets the spec assigns a key.
    table = HashTable(10_000, device=device)
    keys = torch.randint(INT64_MIN, INT64_MAX, (5000,), device=device)
    rows = table.find_or_insert(keys).rows.tolist()
    for key, row in zip(keys.tolist(), rows):
        b1, b2, _ = place(key, 10_000)
        assert row // 32 in (b1, b2)


@pytest.mark.parametrize("policy", ["lru", "lfu", "epoch_lru", "epoch_lfu", "none"])
def test_new_key_score_is_the_score_an_insert_gives_a_new_key(policy, device):
    # Oracle: the score the table itself stores for a key new to the next call, after calls
    # that moved the clock and the epoch (and gave held keys other scores).
    table = HashTable(100, policy=policy, device=device)
    table.find_or_insert(torch.arange(10, device=device))
    table.find_or_insert(torch.arange(5, device=device))
    table.set_epoch(3)
    for insert in (table.find_or_insert, table.insert_or_assign):
        expected = table.new_key_score()
        key = 1000 + table.clock
        insert(_keys([key, 0], device))
        state = table.state_dict()
        assert int(state["scores"][state["keys"] == key]) == expected, insert.__name__
    with pytest.raises(ValueError, match="custom"):
        HashTable(10, policy="custom", device=device).new_key_score()


def test_place_keys_from_a_start_moves_only_the_keys_that_make_room():
    """A full table's keys after evictions (a placement of them exists: the table's own), re-placed
    from an older placement of the survivors, as a delta replica does: every key placed, each in
    one of its buckets (the reference's), rows distinct, and the survivors keep their rows but for
    the few on augmenting paths (a placement from nothing moves nearly all)."""
    from torchrec_ext.reference import bucket_pairs
    from torchrec_ext.table import place_keys

    capacity = 4096  # 2 stripes
    table = HashTable(capacity, policy="lru")
    gen = torch.Generator().manual_seed(3)
    for _ in range(6):
        table.find_or_insert(torch.randint(0, 1 << 40, (capacity // 2,), generator=gen))
    old = table.state_dict()
    for _ in range(3):  # the table moves on, evicting: its buckets now hold what this history left
        table.find_or_insert(torch.randint(0, 1 << 40, (capacity // 20,), generator=gen))
    new = table.state_dict()
    assert new["keys"].numel() == capacity
    old_row = dict(zip(old["keys"].tolist(), old["rows"].tolist()))
    start = torch.tensor([old_row.get(k, -1) for k in new["keys"].tolist()])
    # The survivors' old rows (the evicted ids' rows free) cannot hold every newcomer greedily...
    greedy = HashTable(capacity, policy="none")
    survived = start >= 0
    greedy.load_state_dict(
        {
            **old,
            "policy": "none",
            "keys": new["keys"][survived],
            "rows": start[survived],
            "scores": new["scores"][survived],
        }
    )
    assert bool((greedy.insert_or_assign(new["keys"][~survived]).rows < 0).any())
    # ... the placement from them does, moving few survivors.
    rows = place_keys(new["keys"], new["scores"], capacity, start)
    first, second = bucket_pairs(new["keys"], capacity)
    assert bool((rows >= 0).all()) and rows.unique().numel() == capacity
    assert bool(((rows // 32 == first) | (rows // 32 == second)).all())
    moved = int((rows[survived] != start[survived]).sum())
    afresh = place_keys(new["keys"], new["scores"], capacity)
    assert bool((afresh >= 0).all())
    assert moved < 0.05 * capacity < int((afresh[survived] != start[survived]).sum()), moved
    bad = start.clone()
    bad[0] = 32 * next(b for b in range(128) if b not in (int(first[0]), int(second[0])))
    # A start row outside the key's buckets is a stashed key's (a full load's): it is placed afresh.
    rows = place_keys(new["keys"], new["scores"], capacity, bad)
    assert bool((rows >= 0).all()) and rows.unique().numel() == capacity and int(rows[0]) != int(bad[0])
    bad[0] = capacity
    with pytest.raises(ValueError, match=rf"start_rows\[0\] = {capacity} is not a row of capacity {capacity}"):
        place_keys(new["keys"], new["scores"], capacity, bad)
    j = int((first == first[0]).nonzero()[1])  # another key of key 0's first bucket
    bad = torch.full_like(start, -1)
    bad[0] = bad[j] = 32 * int(first[0])
    with pytest.raises(ValueError, match=rf"start_rows\[{j}\] = \d+ is held by an earlier key"):
        place_keys(new["keys"], new["scores"], capacity, bad)
