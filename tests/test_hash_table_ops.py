"""Each ``hash_*`` op against its reference function of the same name (``torchrec_ext.reference``),
on the raw arrays the ops take: outputs exactly, and the tables' live entries and sizes after
every call. (``test_hash_table.py`` checks ``HashTable``, the class over these ops, against the
dict model.)"""

import random

import pytest
import torch

from torchrec_ext import ops, reference
from torchrec_ext.vocabulary import POLICIES, index_lengths

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def _empty(capacity: int) -> list[torch.Tensor]:
    digests, keys, scores = index_lengths(capacity)
    return [
        torch.zeros(digests, dtype=torch.uint8),
        torch.zeros(keys, dtype=torch.int64),
        torch.zeros(scores, dtype=torch.int64),
        torch.zeros(1, dtype=torch.int64),
    ]


def _assert_same_table(kernel: list[torch.Tensor], ref: list[torch.Tensor], capacity: int) -> None:
    digests, keys, scores, size = kernel
    slots = index_lengths(capacity)[2]
    want = reference.hash_export(ref[0], ref[1], ref[2], capacity, 0, slots)
    got = ops.hash_export(digests, keys, scores, capacity, 0, slots)
    for g, w in zip(got, want):
        assert g.tolist() == w.tolist()
    assert int(size) == int(ref[3])
    assert not (digests & 0x80).any(), "a call left rows pinned"


def _same(got, want) -> None:
    for g, w in zip(got, want):
        assert g.tolist() == w.tolist()


@pytest.mark.parametrize("policy", ["lru", "lfu", "epoch_lfu", "custom", "none"])
@pytest.mark.parametrize("capacity", [37, 200])
def test_ops_match_their_references_over_random_calls(policy, capacity):
    rng = random.Random(capacity + len(policy))
    kernel, ref = _empty(capacity), _empty(capacity)
    universe = [rng.randrange(INT64_MIN, INT64_MAX) for _ in range(2 * capacity)] + [INT64_MIN, -1, 0, INT64_MAX]
    code, clock, epoch = POLICIES[policy], 0, 0
    for step in range(30):
        call = rng.choice(["upsert", "upsert", "fixed", "fixed", "find", "erase"])
        batch = [rng.choice(universe) for _ in range(rng.randint(0, capacity // 2 + 3))]
        keys = torch.tensor(batch, dtype=torch.int64)
        scored = policy == "custom" or (policy in ("lfu", "epoch_lfu") and rng.random() < 0.5)
        scores = torch.tensor([rng.randrange(0, 50) for _ in batch], dtype=torch.int64) if scored else None
        if call == "find":
            _same(
                ops.hash_find(kernel[0], kernel[1], keys, capacity), reference.hash_find(ref[0], ref[1], keys, capacity)
            )
        elif call == "erase":
            got = ops.hash_erase(kernel[0], kernel[1], kernel[3], keys, capacity)
            assert got.tolist() == reference.hash_erase(ref[0], ref[1], ref[3], keys, capacity).tolist()
        else:
            clock += 1
            epoch += policy.startswith("epoch") and step % 10 == 9
            assign = call == "upsert" and rng.random() < 0.3
            args = (keys, scores, capacity, code, clock, epoch, assign)
            if call == "upsert":
                _same(ops.hash_upsert(*kernel, *args), reference.hash_upsert(*ref, *args))
            else:
                pending = torch.tensor([rng.random() < 0.7 for _ in batch], dtype=torch.bool)
                fixed = (keys, scores, pending, capacity, code, clock, epoch, False)
                _same(ops.hash_upsert_fixed(*kernel, *fixed), reference.hash_upsert_fixed(*ref, *fixed))
        _assert_same_table(kernel, ref, capacity)
    assert int(kernel[3]) > 0
    # A page of the export, as a large table's is read.
    _same(
        ops.hash_export(kernel[0], kernel[1], kernel[2], capacity, 5, 33),
        reference.hash_export(ref[0], ref[1], ref[2], capacity, 5, 33),
    )


def test_table_ops_match_their_references():
    rng = random.Random(3)
    capacities, policies = [40, 100, 33], ["lru", "lfu", "none"]
    kernel = [_empty(c) for c in capacities]
    ref = [_empty(c) for c in capacities]
    for clock in range(1, 8):
        counts = [rng.randint(0, 30) for _ in capacities]
        offsets = [0]
        for n in counts:
            offsets.append(offsets[-1] + n)
        keys = torch.tensor([rng.randrange(0, 150) for _ in range(offsets[-1])], dtype=torch.int64)
        scores = torch.randint(1, 5, (offsets[-1],), generator=torch.Generator().manual_seed(clock))
        pending = torch.rand(offsets[-1], generator=torch.Generator().manual_seed(clock)) < 0.8
        tail = (
            keys,
            offsets,
            scores,
            pending,
            capacities,
            [POLICIES[p] for p in policies],
            [clock] * 3,
            [0] * 3,
            False,
        )

        def arrays(tables):
            return [[t[i] for t in tables] for i in range(4)]

        _same(ops.hash_upsert_tables(*arrays(kernel), *tail), reference.hash_upsert_tables(*arrays(ref), *tail))
        for k, r, c in zip(kernel, ref, capacities):
            _assert_same_table(k, r, c)
        finds = (keys, offsets, capacities)
        _same(
            ops.hash_find_tables([k[0] for k in kernel], [k[1] for k in kernel], *finds),
            reference.hash_find_tables([r[0] for r in ref], [r[1] for r in ref], *finds),
        )


def test_hash_slot_rows_matches_its_reference():
    gen = torch.Generator().manual_seed(0)
    rows = torch.randint(-1, 64, (50,), generator=gen)
    offsets = [0, 20, 35, 50]
    maps = [torch.randperm(64, generator=gen).to(torch.int32), None, torch.randperm(64, generator=gen)]
    got, want = rows.clone(), rows.clone()
    ops.hash_slot_rows(got, offsets, maps)
    reference.hash_slot_rows(want, offsets, maps)
    assert got.tolist() == want.tolist()
    assert got[20:35].tolist() == rows[20:35].tolist() and (got == rows).sum() < 50


def _crowded_keys(capacity: int, crowd: int, others: int) -> torch.Tensor:
    """``crowd`` keys whose two buckets are buckets 0 and 1 (more than their 64 slots hold, so the
    rest go to the stash), then ``others`` keys of any buckets."""
    crowded, spread, key = [], [], 1
    while len(crowded) < crowd or len(spread) < others:
        pair = set(reference.place(key, capacity)[:2])
        if pair == {0, 1} and len(crowded) < crowd:
            crowded.append(key)
        elif not pair & {0, 1} and len(spread) < others:
            spread.append(key)
        key += 1
    return torch.tensor(crowded + spread, dtype=torch.int64)


@pytest.mark.parametrize(("capacity", "crowd", "others"), [(300, 70, 100), (64, 0, 80)])
def test_place_and_restore_match_their_references(capacity, crowd, others):
    """Keys that crowd two buckets (300 rows: some go to the stash) or more keys than rows (64:
    some are left out); the kept set is the reference's, and both restores then hold and find
    the same entries."""
    keys = _crowded_keys(capacity, crowd, others) if crowd else torch.arange(others, dtype=torch.int64) * 7919
    scores = torch.randint(0, 1000, (keys.numel(),), generator=torch.Generator().manual_seed(capacity))
    rows = ops.hash_place(keys, scores, capacity)
    want_rows = reference.hash_place(keys, scores, capacity)
    assert (rows >= 0).tolist() == (want_rows >= 0).tolist()
    placed = rows >= 0
    outside = [int(r) // 32 not in reference.place(int(k), capacity)[:2] for k, r in zip(keys[placed], rows[placed])]
    assert any(outside) == bool(crowd) and bool(placed.all()) == bool(crowd)
    kernel, ref = _empty(capacity), _empty(capacity)
    ops.hash_restore(*kernel, keys[placed], rows[placed], scores[placed], capacity)
    reference.hash_restore(*ref, keys[placed], rows[placed], scores[placed], capacity)
    _assert_same_table(kernel, ref, capacity)
    _same(ops.hash_find(kernel[0], kernel[1], keys, capacity), reference.hash_find(ref[0], ref[1], keys, capacity))
    # The reference's own placement is one the op accepts, and the op then finds each key there.
    twin = _empty(capacity)
    kept = want_rows >= 0
    ops.hash_restore(*twin, keys[kept], want_rows[kept], scores[kept], capacity)
    assert ops.hash_find(twin[0], twin[1], keys, capacity)[0].tolist() == want_rows.tolist()


def test_restore_reference_refuses_what_the_op_refuses():
    capacity = 64
    keys = torch.tensor([1, 2], dtype=torch.int64)
    scores = torch.zeros(2, dtype=torch.int64)
    for rows in (torch.tensor([3, 3]), torch.tensor([0, capacity])):
        kernel, ref = _empty(capacity), _empty(capacity)
        with pytest.raises(RuntimeError, match="hash_restore"):
            ops.hash_restore(*kernel, keys, rows, scores, capacity)
        with pytest.raises(ValueError, match="hash_restore"):
            reference.hash_restore(*ref, keys, rows, scores, capacity)
        assert not ref[0].any() and int(ref[3]) == 0
