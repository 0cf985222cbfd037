"""A grown HashTable keeps every key's row (issue 15, growth): its index maps slots to rows.

Oracle: ``ReferenceHashTable.grown``, the dict model written from the rule (keys re-inserted with
their scores, each keeping its row; free rows to the empty slots, both ascending), fed the same
calls; rows must equal exactly, so the free-row assignment, evictions and refusals are checked too.
"""

import pytest
import torch

from torchrec_ext import HashTable, ops, torch_kernels
from torchrec_ext.modules.delta_placement import place_exactly
from torchrec_ext.reference import ReferenceHashTable, bucket_pairs
from torchrec_ext.table import find_or_insert_tables, place_keys


def _keys(gen, n):
    return torch.randint(-(2**63), 2**63 - 1, (n,), generator=gen)


def _grown_pair(capacity, policy, gen, growths=2):
    table, ref = HashTable(capacity, policy=policy), ReferenceHashTable(capacity, policy)
    for _ in range(growths):
        keys = _keys(gen, int(table.capacity * 0.7))
        assert table.find_or_insert(keys).rows.tolist() == ref.upsert(keys.tolist())[0]
        before = table.state_dict()
        table, row_map = table.grown(2 * table.capacity)
        ref = ref.grown(2 * ref.capacity)
        # Every key keeps its row: the row map is the identity on the live rows.
        assert table.find(before["keys"])[0].equal(before["rows"])
        assert row_map[before["rows"]].equal(before["rows"]) and int((row_map >= 0).sum()) == before["keys"].numel()
    return table, ref


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_a_grown_table_gives_the_reference_rows_through_inserts_and_evictions(policy):
    gen = torch.Generator().manual_seed(1)
    table, ref = _grown_pair(96, policy, gen)
    for _ in range(4):  # past full: evicted rows are handed to the new keys
        keys = _keys(gen, 200)
        keys[::7] = table.state_dict()["keys"][: keys[::7].numel()]  # some held keys
        got, want = table.find_or_insert(keys), ref.upsert(keys.tolist())
        assert got.rows.tolist() == want[0] and got.inserted.tolist() == want[1]
        assert got.evicted_keys.tolist() == want[2] and got.evicted_rows.tolist() == want[3]
    live = table.state_dict()
    held = list(ref.row_of)
    assert sorted(zip(live["keys"].tolist(), live["rows"].tolist())) == sorted(zip(held, ref.find(held)[0]))
    assert len(set(live["rows"].tolist())) == live["rows"].numel()  # one key per row
    keys = _keys(gen, 50)
    fixed = table.find_or_insert_fixed(keys)
    want = ref.upsert(keys.tolist())
    assert fixed.rows.tolist() == want[0] and fixed.inserted.tolist() == want[1]


def test_rows_of_a_grown_table_through_every_call():
    gen = torch.Generator().manual_seed(2)
    table, ref = _grown_pair(128, "lru", gen)
    state = table.state_dict()
    keys, rows = state["keys"], state["rows"]
    assert (rows >= 0).all() and (rows < table.capacity).all()
    # export, entries_at and the stash count speak rows.
    exported = torch.cat([page[1] for page in table.export(page_size=100)])
    assert sorted(exported.tolist()) == sorted(rows.tolist())
    at_keys, _, live = table.entries_at(rows)
    assert at_keys.equal(keys) and live.all()
    empty = torch.ones(table.capacity, dtype=torch.bool)
    empty[rows] = False
    assert not table.entries_at(empty.nonzero().squeeze(1))[2].any()
    # A state round trip and a clone keep the rows; a state without slots loads rows as slots.
    loaded = HashTable(table.capacity)
    loaded.load_state_dict(state)
    twin = table.clone()
    for other in (loaded, twin):
        assert other.find(keys)[0].equal(rows)
    # erase_rows removes the keys at the rows named, reporting rows.
    mask = torch.zeros(table.capacity, dtype=torch.bool)
    mask[rows[::3]] = True
    assert twin.erase_rows(mask).equal(mask)
    assert not twin.find(keys[::3])[1].any() and twin.find(keys[1::3])[0].equal(rows[1::3])
    ref.erase(keys[::3].tolist())
    new = _keys(gen, 40)  # new keys take the freed rows of their slots, as the reference says
    assert twin.find_or_insert(new).rows.tolist() == ref.upsert(new.tolist())[0]


def test_a_grown_state_with_bad_rows_is_refused_and_leaves_the_table():
    table, _ = _grown_pair(64, "lru", torch.Generator().manual_seed(3), growths=1)
    state = table.state_dict()
    target = HashTable(table.capacity)
    for rows, match in ((state["rows"].clone().fill_(0), "distinct"), (state["rows"] + table.capacity, "must be in")):
        with pytest.raises(ValueError, match=match):
            target.load_state_dict(dict(state, rows=rows))
        assert target.size() == 0


def test_an_exact_replacement_of_a_grown_table_moves_no_row():
    gen = torch.Generator().manual_seed(4)
    table, _ = _grown_pair(64, "lru", gen, growths=1)
    held = table.state_dict()
    ids = _keys(gen, table.capacity - held["keys"].numel())
    plan = place_exactly(table, ids, torch.zeros(0, dtype=torch.int64))
    assert plan.moved_from is None
    assert plan.index.find(held["keys"])[0].equal(held["rows"])
    new_rows = plan.rows[plan.inserted]
    assert plan.inserted.all() and set(new_rows.tolist()).isdisjoint(held["rows"].tolist())
    assert sorted(torch.cat([held["rows"], new_rows]).tolist()) == list(range(table.capacity))


def test_the_slot_to_row_kernels_map_each_tables_slots():
    gen = torch.Generator().manual_seed(5)
    maps = [torch.randperm(100, generator=gen).to(torch.int32), None, torch.randperm(7, generator=gen)]
    offsets = [0, 40, 55, 70]
    slots = torch.cat([torch.randint(-1, 100, (40,), generator=gen), torch.arange(-1, 14), torch.randint(-1, 7, (15,))])
    want = [
        s if m is None or s < 0 else int(m[s])
        for t, m in enumerate(maps)
        for s in slots[offsets[t] : offsets[t + 1]].tolist()
    ]
    for kernel in (ops.hash_slot_rows, torch_kernels.hash_slot_rows):  # C++ (CPU), torch ops (CUDA's)
        rows = slots.clone()
        kernel(rows, offsets, maps)
        assert rows.tolist() == want
    bad = slots.clone()
    bad[60] = 7
    with pytest.raises(RuntimeError, match=r"rows\[60\] = 7 is not a slot of table 2"):
        ops.hash_slot_rows(bad, offsets, maps)


def test_stashed_keys_of_a_mapped_table_keep_their_rows():
    """A full load stashes a few keys outside their buckets; with slots mapped to rows they are
    found at their rows, and erasing one frees its row for the next insert into its slot."""
    gen = torch.Generator().manual_seed(6)
    capacity = 2048
    # A full table whose bucket 0 only 20 keys may take: 12 keys end in the stash.
    pool = _keys(gen, 4 * capacity).unique()
    b1, b2 = bucket_pairs(pool, capacity)
    hits = (b1 == 0).to(torch.int64) + (b2 == 0).to(torch.int64)
    keys = torch.cat([pool[hits == 0][: capacity - 20], pool[hits == 1][:20]])
    scores = torch.arange(capacity)
    slots = place_keys(keys, scores, capacity)
    keep = slots >= 0
    keys, scores, slots = keys[keep], scores[keep], slots[keep]
    rows = torch.randperm(capacity, generator=gen)[: keys.numel()]
    table = HashTable(capacity, mapped_rows=True)
    table.load_state_dict(
        {"capacity": capacity, "policy": "lru", "clock": 1, "epoch": 0, "keys": keys, "rows": rows, "scores": scores}
        | {"slots": slots, "layout": 3}
    )
    assert table.stash_size() > 0
    assert table.find(keys)[0].equal(rows)
    stashed_keys, stashed_rows = table._stash_entries()
    assert table.find(stashed_keys)[0].equal(stashed_rows)
    table.erase(stashed_keys[:1])
    assert not table.find(stashed_keys[:1])[1].any() and table.size() == keys.numel() - 1
    live = table.state_dict()
    assert len(set(live["rows"].tolist())) == live["rows"].numel() == keys.numel() - 1


def test_a_mapped_table_maps_no_slot_before_its_first_growth(monkeypatch):
    """A table that will grow keeps its slot -> row map from the start (its memory), but the map is
    the identity until the first growth: calls then pass no slot through it; after the growth they do.
    Oracle: the same calls on a table without a map (rows are slots), and the reference once grown."""
    gen = torch.Generator().manual_seed(9)
    mapped, plain = HashTable(256, mapped_rows=True), HashTable(256)
    calls = []
    original = ops.hash_slot_rows
    monkeypatch.setattr(ops, "hash_slot_rows", lambda *a: calls.append(1) or original(*a))
    keys = _keys(gen, 150)
    assert mapped.find_or_insert(keys).rows.equal(plain.find_or_insert(keys).rows)
    assert find_or_insert_tables([mapped], keys, [0, 150]).rows.equal(plain.find(keys)[0])
    assert mapped.find(keys)[0].equal(plain.find(keys)[0]) and not calls
    grown, _ = mapped.grown(512)
    ref = ReferenceHashTable(256, "lru")
    ref.upsert(keys.tolist())
    ref = ref.grown(512)
    more = _keys(gen, 100)
    assert grown.find_or_insert(more).rows.tolist() == ref.upsert(more.tolist())[0] and calls
