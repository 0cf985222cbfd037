"""A grown HashTable keeps every key's row (issue 15, growth): its index maps slots to rows.

Oracle: ``ReferenceHashTable.grown``, the dict model written from the rule (keys re-inserted with
their scores, each keeping its row; free rows to the empty slots, both ascending), fed the same
calls; rows must equal exactly, so the free-row assignment, evictions and refusals are checked too.
"""

import warnings

import pytest
import torch

from torchrec_ext import HashTable, device_sync, ops, torch_kernels
from torchrec_ext.modules.delta_placement import place_exactly
from torchrec_ext.reference import ReferenceHashTable, bucket_pairs
from torchrec_ext.table import find_or_insert_tables, grown_tables, place_keys


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


def test_tables_grown_together_give_the_reference_rows_with_one_placement_call(monkeypatch):
    """``grown_tables`` of several tables (mixed policies, fills, one empty) places every table's
    keys in one ``hash_upsert_tables`` call, exports with no sized op (on a GPU: no sync per
    table), and each grown table then gives the reference's rows."""
    gen = torch.Generator().manual_seed(5)
    pairs = []
    for capacity, policy, fill in [(96, "lru", 0.7), (64, "lfu", 0.5), (128, "lru", 0.0), (80, "lfu", 0.9)]:
        table, ref = HashTable(capacity, policy=policy), ReferenceHashTable(capacity, policy)
        keys = _keys(gen, int(capacity * fill))
        assert table.find_or_insert(keys).rows.tolist() == ref.upsert(keys.tolist())[0]
        pairs.append((table, ref))
    real, calls = ops.hash_upsert_tables, []

    def counted(*args):
        calls.append(len(args[0]))
        return real(*args)

    def sized(*args, **kwargs):
        raise AssertionError("a sized op (its output counted on the host) in grown_tables")

    monkeypatch.setattr(ops, "hash_upsert_tables", counted)
    for name in ("hash_export", "hash_upsert"):
        monkeypatch.setattr(ops, name, sized)
    grown = grown_tables([t for t, _ in pairs], [2 * t.capacity for t, _ in pairs])
    monkeypatch.undo()
    assert calls == [3]  # the three tables holding keys, in one call
    for (table, row_map), (old, ref) in zip(grown, pairs):
        before = old.state_dict()
        assert table.find(before["keys"])[0].equal(before["rows"])
        assert row_map[before["rows"]].equal(before["rows"])
        ref = ref.grown(2 * ref.capacity)
        for _ in range(3):
            keys = _keys(gen, 150)
            assert table.find_or_insert(keys).rows.tolist() == ref.upsert(keys.tolist())[0]


def test_a_size_the_table_does_not_hold_is_refused_and_no_table_changes():
    table = HashTable(64)
    table.find_or_insert(torch.arange(30) * 7919)
    before = table.state_dict()
    for size in (29, 31):
        with pytest.raises(RuntimeError, match=f"table 0 holds 30 live keys where its size read {size}"):
            grown_tables([table], [128], [size])
    with pytest.raises(ValueError, match="capacity must hold the table's 30 keys, got 16"):
        table.grown(16)
    after = table.state_dict()
    assert all(torch.equal(v, after[k]) if isinstance(v, torch.Tensor) else v == after[k] for k, v in before.items())


def test_growing_many_tables_reads_the_host_once(device):
    """``grown_tables`` of 26 tables given their sizes: one counted read (keys placed), whatever
    the table count; on a GPU also the one real sync (torch's sync debug mode: the export by
    ``nonzero_static``, the batched placement and the row maps read nothing back)."""
    gen = torch.Generator().manual_seed(9)
    tables = []
    for t in range(26):
        table = HashTable(128, policy=("lru", "lfu")[t % 2], device=device, mapped_rows=t % 3 == 0)
        table.find_or_insert_fixed(_keys(gen, 40 + t).to(device))
        tables.append(table)
    sizes = device_sync.host_list(torch.cat([t.size_tensor() for t in tables]), "test: sizes")
    grown_tables(tables, [256] * 26, sizes)  # (warm: the caching allocator holds its blocks)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught, device_sync.recording() as counted:
            warnings.simplefilter("always")
            grown = grown_tables(tables, [256] * 26, sizes)
    finally:
        if device == "cuda":
            torch.cuda.set_sync_debug_mode(0)
    assert dict(counted) == {"growth: keys placed": 1}
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) == (1 if device == "cuda" else 0), syncs
    for old, (table, _) in zip(tables, grown):
        before = old.state_dict()
        assert table.find(before["keys"])[0].equal(before["rows"])
