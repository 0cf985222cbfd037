"""The CPU find (``hash_find``, ``hash_find_tables``) runs ids in prefetched groups of 16
(csrc/hash_table_cpu.cpp, find_ids), across table boundaries and parallel chunks: its rows and
found flags must be exactly the brute-force answer read off the table's own arrays (the row whose
digest is set and whose slot key is the id; -1 if none), for half-full and full tables, misses,
repeats, batches of every length around the group size, empty batches and empty tables' slices,
tiny tables (one bucket, a partial last bucket) and keys held in the stash."""

import pytest
import torch

from test_hash_table_stash import _load, _starved
from torchrec_ext import HashTable, ops, reference

GROUP = 16  # kFindGroup
I64MIN, I64MAX = -(2**63), 2**63 - 1


def _brute_force(table, keys):
    """Rows of keys found by scanning every row of the table (stashed rows are ordinary rows)."""
    digests, slot_keys = table.lookup_arrays()
    occupied = (digests[: table.capacity] != 0).nonzero().flatten()
    where = {int(slot_keys[r]): int(r) for r in occupied}
    assert len(where) == occupied.numel(), "a key held twice"
    rows = torch.tensor([where.get(int(k), -1) for k in keys], dtype=torch.int64)
    return rows, rows >= 0


def _filled(capacity, load, seed):
    """A table after upserts of load * capacity random keys (load > 1: full, with evictions)."""
    gen = torch.Generator().manual_seed(seed)
    table = HashTable(capacity)
    for chunk in torch.randint(I64MIN, I64MAX, (int(load * capacity) + 1,), generator=gen).split(1000):
        table.find_or_insert(chunk)
    return table


def _batch(table, n, seed):
    """n ids: held keys (with repeats), unseen ids and the int64 extremes, shuffled."""
    gen = torch.Generator().manual_seed(seed)
    digests, slot_keys = table.lookup_arrays()
    held = slot_keys[: table.capacity][digests[: table.capacity] != 0]
    parts = [
        held[torch.randint(0, held.numel(), (n - n // 4,), generator=gen)]
        if held.numel()
        else torch.empty(0, dtype=torch.int64),
        torch.randint(I64MIN, I64MAX, (n // 4,), generator=gen),
    ]
    ids = torch.cat(parts + [torch.tensor([I64MIN, I64MAX, 0])])[: max(n, 0)]
    return ids[torch.randperm(ids.numel(), generator=gen)]


def _check(table, ids):
    rows, found = ops.hash_find(*table.lookup_arrays(), ids, table.capacity)
    want_rows, want_found = _brute_force(table, ids)
    assert torch.equal(rows, want_rows) and torch.equal(found, want_found)


@pytest.mark.parametrize("capacity,load", [(1, 3.0), (31, 0.5), (32, 2.0), (77, 1.0), (4096, 0.5), (5000, 1.5)])
@pytest.mark.parametrize("n", [0, 1, GROUP - 1, GROUP, GROUP + 1, 2 * GROUP + 3, 3 * GROUP, 9000])
def test_find_equals_brute_force(capacity, load, n):
    table = _filled(capacity, load, seed=capacity + n)
    _check(table, _batch(table, n, seed=n))


@pytest.mark.parametrize("threads", [1, 2])
def test_find_tables_equals_brute_force_per_table(threads):
    """Tables of every kind in one call, some with no ids: slices crossing groups and chunks."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        specs = [(4096, 0.5, 5000), (77, 1.0, 0), (1, 3.0, 7), (5000, 1.5, 4099), (32, 2.0, 0), (2048, 1.0, 17)]
        tables = [_filled(c, load, seed=i) for i, (c, load, _) in enumerate(specs)]
        batches = [_batch(t, n, seed=10 + i) for i, (t, (_, _, n)) in enumerate(zip(tables, specs))]
        offsets = [0]
        for b in batches:
            offsets.append(offsets[-1] + b.numel())
        rows, found = ops.hash_find_tables(
            [t.lookup_arrays()[0] for t in tables],
            [t.lookup_arrays()[1] for t in tables],
            torch.cat(batches),
            offsets,
            [t.capacity for t in tables],
        )
        want = [_brute_force(t, b) for t, b in zip(tables, batches)]
        assert torch.equal(rows, torch.cat([w[0] for w in want]))
        assert torch.equal(found, torch.cat([w[1] for w in want]))
        assert found.any() and not found.all()
    finally:
        torch.set_num_threads(previous)


def test_find_tables_of_no_ids():
    table = _filled(64, 1.0, seed=3)
    rows, found = ops.hash_find_tables(
        [table.lookup_arrays()[0]] * 2,
        [table.lookup_arrays()[1]] * 2,
        torch.empty(0, dtype=torch.int64),
        [0, 0, 0],
        [64, 64],
    )
    assert rows.numel() == 0 and found.numel() == 0


def test_find_sees_stashed_keys_in_every_group_position():
    """A full starved table (12 keys stashed, outside both their buckets): a stashed key at each
    position of three groups, among held and unseen ids; then every key in one call."""
    capacity = 4096
    keys = _starved(capacity, capacity)
    table = HashTable(capacity)
    rows = _load(table, keys, torch.zeros(capacity, dtype=torch.int64))
    bucket1, bucket2 = reference.bucket_pairs(keys, capacity)
    stashed = (rows // 32 != bucket1) & (rows // 32 != bucket2)
    assert int(stashed.sum()) == table.stash_size() > 0
    others = torch.cat([keys[~stashed][: 2 * GROUP], torch.arange(GROUP, dtype=torch.int64)])
    for position in range(3 * GROUP):
        ids = others.clone()
        ids[position] = keys[stashed][position % int(stashed.sum())]
        _check(table, ids)
    _check(table, keys)
    ids = torch.cat([keys[:5], keys])
    got = ops.hash_find_tables(
        [table.lookup_arrays()[0]] * 2, [table.lookup_arrays()[1]] * 2, ids, [0, 5, 5 + capacity], [capacity] * 2
    )
    want = _brute_force(table, ids)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and bool(got[1].all())
