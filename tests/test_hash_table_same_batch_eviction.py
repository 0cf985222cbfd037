"""A call never evicts its own keys (issue 11): every key of a batch that already holds a row is
touched and pinned before any key of the batch is inserted, so a new key early in the batch
cannot evict a resident key that comes later. Checked on full tables against the dict model in
torchrec_ext.reference (rows, inserted flags, evictions and the whole table, exactly)."""

import random

import pytest
import torch

from torchrec_ext import HashTable
from torchrec_ext.reference import ReferenceHashTable

POLICIES = ["lru", "lfu", "epoch_lru", "epoch_lfu", "custom"]
CAPACITY = 64 * 32 * 2  # two stripes of 64 buckets


def _keys(values, device):
    return torch.tensor(values, dtype=torch.int64, device=device)


def _upsert_both(table, model, batch, scores=None, assign=False):
    """One call on both; asserts equal results and equal tables, returns the table's result."""
    device = table.device
    call = table.insert_or_assign if assign else table.find_or_insert
    got = call(_keys(batch, device), None if scores is None else _keys(scores, device))
    rows, inserted, ev_keys, ev_rows = model.upsert(batch, scores, assign=assign)
    assert got.rows.tolist() == rows
    assert got.inserted.tolist() == inserted
    assert got.evicted_keys.tolist() == ev_keys and got.evicted_rows.tolist() == ev_rows
    assert not (table._digests & 0x80).any(), "a call left rows pinned"
    keys, table_rows, table_scores = (torch.cat(p).tolist() for p in zip(*table.export(page_size=1 << 16)))
    assert list(zip(keys, table_rows, table_scores)) == model.export()
    return got


def _full_pair(capacity, policy, device, rng):
    """A table and its model, filled to load factor 1.0 with random keys (equal scores)."""
    table, model = HashTable(capacity, policy=policy, device=device), ReferenceHashTable(capacity, policy)
    while table.size() < capacity:
        batch = [rng.randrange(-(2**63), 2**63) for _ in range(capacity // 2)]
        _upsert_both(table, model, batch, [1] * len(batch) if policy == "custom" else None)
    return table, model


def _assert_residents_kept(got, batch, before, device):
    """Every key of `batch` that held a row before the call holds the same row after it."""
    for i, key in enumerate(batch):
        if key in before:
            assert got.rows[i].item() == before[key] and not got.inserted[i], f"resident key {key} lost its row"
    assert not set(got.evicted_keys.tolist()) & set(batch), "the call evicted a key of its own batch"


@pytest.mark.parametrize("policy", POLICIES)
def test_new_keys_first_never_evict_resident_keys_later_in_the_batch(policy, device):
    rng = random.Random(POLICIES.index(policy))
    table, model = _full_pair(CAPACITY, policy, device, rng)
    live = [k for k, _, _ in model.export()]
    before = {k: r for k, r, _ in model.export()}
    residents = rng.sample(live, CAPACITY // 2)
    fresh = [rng.randrange(-(2**63), 2**63) for _ in range(CAPACITY // 2)]
    batch = fresh + residents  # the new keys come first and must evict someone
    scores = [1] * len(batch) if policy == "custom" else None
    got = _upsert_both(table, model, batch, scores)
    _assert_residents_kept(got, batch, before, device)
    # The table was full: every inserted key took the row of a key outside the batch.
    assert got.evicted_keys.numel() == int(got.inserted.sum()) > 0


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_random_mixed_batches_on_a_full_table_keep_their_resident_keys(policy, device):
    rng = random.Random(7)
    table, model = _full_pair(CAPACITY, policy, device, rng)
    for _ in range(8):
        live = [k for k, _, _ in model.export()]
        before = {k: r for k, r, _ in model.export()}
        batch = rng.sample(live, CAPACITY // 4) + [rng.randrange(-(2**63), 2**63) for _ in range(CAPACITY // 4)]
        rng.shuffle(batch)
        _assert_residents_kept(_upsert_both(table, model, batch), batch, before, device)


@pytest.mark.parametrize("assign", [False, True])
def test_duplicates_of_new_and_resident_keys(assign, device):
    table, model = HashTable(32, policy="lfu", device=device), ReferenceHashTable(32, "lfu")  # one bucket
    _upsert_both(table, model, list(range(32)))  # key k in slot k, all of count 1
    before = {k: r for k, r, _ in model.export()}
    # Each new key twice, around the resident key its eviction would pick first (the lowest
    # slot on ties), which also comes twice.
    fresh, resident = list(range(100, 110)), list(range(10))
    batch = []
    for new, old in zip(fresh, resident):
        batch += [new, old, new, old]
    scores = [random.Random(len(batch) + i).randrange(1, 4) for i in range(len(batch))]
    got = _upsert_both(table, model, batch, scores, assign=assign)
    _assert_residents_kept(got, batch, before, device)
    rows, inserted = got.rows.tolist(), got.inserted.tolist()
    for j in range(10):
        new_first, old_first, new_again, old_again = range(4 * j, 4 * j + 4)
        assert rows[new_first] == rows[new_again] >= 0 and rows[old_first] == rows[old_again]
        assert inserted[new_first] and not inserted[new_again]
    assert sorted(got.evicted_keys.tolist()) == list(range(10, 20))  # the lowest slots outside the call


def test_new_key_is_refused_when_every_slot_is_held_by_the_call(device):
    table, model = HashTable(32, policy="lru", device=device), ReferenceHashTable(32, "lru")  # one bucket
    _upsert_both(table, model, list(range(32)))
    # A new key first, then all 32 residents: nothing can be evicted, so the new key is refused.
    batch = [1000] + list(range(32)) + [1000]
    got = _upsert_both(table, model, batch)
    assert got.rows.tolist()[0] == got.rows.tolist()[-1] == -1
    assert got.rows.tolist()[1:-1] == model.find(list(range(32)))[0]
    assert not got.inserted.any() and got.evicted_keys.numel() == 0
    # One resident left out of the next call: the new key evicts exactly that one.
    got = _upsert_both(table, model, [1000] + list(range(1, 32)))
    assert got.evicted_keys.tolist() == [0] and got.inserted.tolist() == [True] + [False] * 31


def test_same_results_whatever_the_thread_count():
    capacity = 64 * 32 * 8  # 8 stripes: several stripe groups per thread
    results = []
    for threads in (1, 2):
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            rng = random.Random(11)
            table, model = _full_pair(capacity, "lru", "cpu", rng)
            calls = []
            for _ in range(4):
                live = [k for k, _, _ in model.export()]
                before_rows = {k: r for k, r, _ in model.export()}
                batch = [rng.randrange(-(2**63), 2**63) for _ in range(capacity // 4)] + rng.sample(live, capacity // 4)
                got = _upsert_both(table, model, batch)
                _assert_residents_kept(got, batch, before_rows, "cpu")
                calls.append(tuple(got))
            results.append((calls, table.state_dict()))
        finally:
            torch.set_num_threads(before)
    (calls1, state1), (calls2, state2) = results
    assert all(torch.equal(a, b) for c1, c2 in zip(calls1, calls2) for a, b in zip(c1, c2))
    assert all(torch.equal(state1[k], state2[k]) for k in ("keys", "rows", "scores"))
