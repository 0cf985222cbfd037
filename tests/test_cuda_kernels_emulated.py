"""The CUDA kernels (csrc/hash_table_cuda.cu and their binding), run on CPU under a warp
emulator (tests/cuda_emulation), against the CPU kernels: every output and every byte of table
state must match after each call, for every policy, with duplicates, extreme keys, evictions,
refusals, erase, export and restore. What this cannot check (memory ordering between
concurrently running warps, speed) needs a real GPU: tests parametrised over `device` do that."""

import itertools
import random

import pytest
import torch

from cuda_emulation.build import build, cuda_include_dir, reversed_warps
from matrix import ci_subset
from torchrec_ext.vocabulary import index_lengths

I64MIN, I64MAX = -(2**63), 2**63 - 1

pytestmark = pytest.mark.skipif(cuda_include_dir() is None, reason="needs the CUDA toolkit headers")


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    return build(str(tmp_path_factory.mktemp("torchrec_emu")))


def _same(a, b, what):
    for x, y in zip(a, b):
        assert torch.equal(x, y), what


def _table(capacity):
    digests, keys, scores = index_lengths(capacity)  # main slots, then the stash
    return [
        torch.zeros(digests, dtype=torch.uint8),
        torch.zeros(keys, dtype=torch.int64),
        torch.zeros(scores, dtype=torch.int64),
        torch.zeros(1, dtype=torch.int64),
    ]


# 1 stripe (1, 33), 2, 3 and 5 stripes (odd rings: three insert phases). In CI: every capacity
# under LRU and every policy at 3 stripes; all 30 pairs with TORCHREC_EXT_FULL_MATRIX=1.
_THREE_STRIPES = 64 * 32 * 3 + 5


@pytest.mark.parametrize(
    "capacity, policy",
    ci_subset(
        itertools.product([1, 33, 64 * 32 * 2, _THREE_STRIPES, 64 * 32 * 5 + 7], range(6)),
        lambda capacity, policy: policy == 1 or capacity == _THREE_STRIPES,
    ),
)
def test_emulated_cuda_kernels_match_cpu(emulated, capacity, policy):
    cpu = torch.ops.torchrec_ext
    rng = random.Random(capacity * 10 + policy)
    state, twin = _table(capacity), _table(capacity)
    slots = state[2].numel()  # main slots: the stash's entries are not rows
    universe = [rng.randrange(I64MIN, I64MAX) for _ in range(int(1.6 * capacity))] + [I64MIN, -1, 0, 1, I64MAX]
    epoch = 0
    for step in range(12):
        n = rng.choice([0, 1, 5, capacity // 4, capacity // 2, capacity])
        keys = torch.tensor([rng.choice(universe) for _ in range(n)], dtype=torch.int64)
        op = rng.choice(["upsert", "upsert", "upsert", "erase", "find", "export"])
        if op == "upsert":
            scores = None
            if policy == 5 or rng.random() < 0.4:
                scores = torch.tensor(
                    [rng.choice([0, 1, 3, 7, 2**40, I64MAX - 1]) for _ in range(n)], dtype=torch.int64
                )
            if rng.random() < 0.2:
                epoch = rng.randrange(0, 2**31)
            args = (keys, scores, capacity, policy, step + 1 + rng.choice([0, 2**32]), epoch, rng.random() < 0.4)
            backward = [t.clone() for t in twin]
            got = emulated.hash_upsert(*twin, *args)
            _same(cpu.hash_upsert(*state, *args), got, "upsert")
            if step % 3 == 0:  # the same call with each launch's warps run last to first
                with reversed_warps():
                    _same(got, emulated.hash_upsert(*backward, *args), "upsert, warps reversed")
                _same(twin, backward, "table after upsert, warps reversed")
        elif op == "erase":
            _same(
                [cpu.hash_erase(state[0], state[1], state[3], keys, capacity)],
                [emulated.hash_erase(twin[0], twin[1], twin[3], keys, capacity)],
                "erase",
            )
        elif op == "find":
            _same(
                cpu.hash_find(state[0], state[1], keys, capacity),
                emulated.hash_find(twin[0], twin[1], keys, capacity),
                "find",
            )
        else:
            start = rng.randrange(0, slots + 1)
            end = rng.randrange(start, slots + 1)
            _same(
                cpu.hash_export(state[0], state[1], state[2], capacity, start, end),
                emulated.hash_export(twin[0], twin[1], twin[2], capacity, start, end),
                "export",
            )
        _same(state, twin, f"table after {op}")
        assert not (twin[0] & 0x80).any(), "the emulated kernels left rows pinned"
    keys, rows, scores = cpu.hash_export(*state[:3], capacity, 0, slots)
    restored, restored_twin = _table(capacity), _table(capacity)
    cpu.hash_restore(*restored, keys, rows, scores, capacity)
    emulated.hash_restore(*restored_twin, keys, rows, scores, capacity)
    _same(restored, restored_twin, "restore")


def test_emulated_upsert_refuses_a_negative_clock(emulated):
    state = _table(4096)
    with pytest.raises(RuntimeError, match="hash_upsert: clock must be >= 0, got -3"):
        emulated.hash_upsert(*state, torch.arange(10), None, 4096, 1, -3, 0, False)
    assert not any(t.any() for t in state)


def test_emulated_find_on_aligned_and_unaligned_digests_matches_cpu(emulated):
    """hash_find and hash_find_tables take a thread per key, which loads a bucket's digests in two
    16-byte loads where they are 16-byte aligned and byte by byte otherwise (a view): both give the
    CPU kernel's rows, for resident keys (tags shared with other slots of their buckets included:
    3,000 keys in 3 stripes), absent keys and extreme keys."""
    capacity = _THREE_STRIPES
    state = _table(capacity)
    resident = torch.randint(I64MIN, I64MAX, (3000,))
    torch.ops.torchrec_ext.hash_upsert(*state, resident, None, capacity, 1, 1, 0, False)
    queries = torch.cat([resident, torch.randint(I64MIN, I64MAX, (2000,)), torch.tensor([0, -1, I64MIN, I64MAX])])
    want = torch.ops.torchrec_ext.hash_find(state[0], state[1], queries, capacity)
    assert want[1][:3000].all() and want[0].unique().numel() > 3000 - 10
    misaligned = torch.empty(state[0].numel() + 1, dtype=torch.uint8)[1:].copy_(state[0])
    assert state[0].data_ptr() % 16 == 0 and misaligned.data_ptr() % 16 != 0
    for digests in (state[0], misaligned):
        _same(emulated.hash_find(digests, state[1], queries, capacity), want, "find")
    # hash_find_tables: 16-byte loads or byte loads per table's alignment.
    got = emulated.hash_find_tables(
        [state[0], misaligned], [state[1], state[1]], torch.cat([queries, queries]), [0, 5004, 10008], [capacity] * 2
    )
    _same(got, [torch.cat([w, w]) for w in want], "find_tables")


def test_emulated_route_matches_cpu(emulated):
    keys = torch.randint(I64MIN, I64MAX, (3000,))
    for world in (1, 3, 8, 2**31 - 1):
        assert torch.equal(torch.ops.torchrec_ext.route(keys, world), emulated.route(keys, world))


def test_emulated_upsert_of_a_batch_larger_than_the_table(emulated):
    """Batches of 1.5x the capacity (new, resident and repeated keys; 3 stripes) into a full
    table: their windows grow past the first `capacity` positions, each window-phase launch walks
    only its slice of a stripe's positions, and the results equal the CPU kernel's and the dict
    model's, also with each launch's warps run in reverse order."""
    from torchrec_ext.reference import ReferenceHashTable, upsert_windows

    capacity = 64 * 32 * 3 + 5
    rng = random.Random(capacity)
    model, state, twin = ReferenceHashTable(capacity, "lru"), _table(capacity), _table(capacity)
    for clock in (1, 2):
        live = [k for k, _, _ in model.export()]
        batch = [rng.randrange(I64MIN, I64MAX) for _ in range(3 * capacity // 2 - len(live) // 2)]
        batch += rng.sample(live, len(live) // 2) + batch[:100]
        rng.shuffle(batch)
        starts = upsert_windows(capacity, len(batch))
        assert starts[-1] - starts[-2] > -(-capacity // 8)
        args = (torch.tensor(batch, dtype=torch.int64), None, capacity, 1, clock, 0, False)
        backward = [t.clone() for t in twin]
        got = emulated.hash_upsert(*twin, *args)
        _same(torch.ops.torchrec_ext.hash_upsert(*state, *args), got, "upsert")
        assert [t.tolist() for t in got] == list(model.upsert(batch))
        if clock == 2:
            with reversed_warps():
                _same(got, emulated.hash_upsert(*backward, *args), "upsert, warps reversed")
            _same(twin, backward, "table after upsert, warps reversed")
        _same(state, twin, "table after upsert")
        assert not (twin[0] & 0x80).any(), "the emulated kernels left rows pinned"
    assert state[3].item() == capacity and got[2].numel() > 0


@pytest.mark.parametrize(
    "policy, capacity",
    [("lru", 64 * 32 * 2), ("lfu", 64 * 32 * 2), ("epoch_lfu", 64 * 32 * 2), ("lru", 64 * 32 * 3 + 5)],
)
def test_emulated_upsert_never_evicts_keys_of_its_own_batch(emulated, policy, capacity, monkeypatch):
    """A full table, then a batch of new keys followed by resident keys (issue 11): the CUDA
    kernel must pin the residents first and insert the new keys phase by phase (a new key may
    evict in the next stripe), as the dict model does, and agree with the CPU kernel, also with
    each launch's warps run in reverse order (a result depending on it would be a race on a GPU)."""
    from torchrec_ext.reference import POLICIES, ReferenceHashTable

    if policy == "lfu" or capacity % 2:
        monkeypatch.setenv("TORCHREC_EMU_REVERSE_WARPS", "1")
    policy_id = POLICIES.index(policy)
    rng = random.Random(policy_id)
    model, state, twin = ReferenceHashTable(capacity, policy), _table(capacity), _table(capacity)
    for clock in range(1, 7):
        if clock <= 3:  # fill: fresh keys until the table is full
            batch = [rng.randrange(I64MIN, I64MAX) for _ in range(capacity)]
        else:  # new keys first, then resident keys (one of them twice)
            resident = rng.sample([k for k, _, _ in model.export()], capacity // 2)
            batch = [rng.randrange(I64MIN, I64MAX) for _ in range(capacity // 2)] + resident + resident[:1]
        before = {k: r for k, r, _ in model.export()}
        want_rows, want_inserted, want_keys, want_evicted_rows = model.upsert(batch)
        args = (torch.tensor(batch, dtype=torch.int64), None, capacity, policy_id, clock, 0, False)
        got, cpu_got = emulated.hash_upsert(*twin, *args), torch.ops.torchrec_ext.hash_upsert(*state, *args)
        _same(cpu_got, got, "upsert")
        assert got[0].tolist() == want_rows and got[1].tolist() == want_inserted
        assert got[2].tolist() == want_keys and got[3].tolist() == want_evicted_rows
        assert all(got[0][i].item() == before[k] for i, k in enumerate(batch) if k in before)
        assert not set(got[2].tolist()) & set(batch)
        _same(state, twin, "table after upsert")
        assert not (twin[0] & 0x80).any(), "the emulated kernels left rows pinned"
    assert state[3].item() == capacity and cpu_got[2].numel() > 0


@pytest.mark.parametrize("policy", [1, 2, 0])  # lru, lfu, none
def test_emulated_kernels_with_a_stash_match_cpu_and_the_reference(emulated, policy):
    """A table loaded full with ids of which only 20 may use bucket 0 (12 of them stashed, in rows
    outside their buckets): the CUDA kernels find, touch (pin), evict and erase stashed keys as
    the CPU kernels and the dict model do, byte for byte, also with warps run in reverse."""
    from test_hash_table_stash import _starved
    from torchrec_ext.reference import POLICIES, ReferenceHashTable
    from torchrec_ext.table import place_keys

    capacity = 64 * 32 * 2
    rng = random.Random(policy)
    keys = _starved(capacity, capacity, seed=policy)
    scores = torch.tensor([rng.randrange(0, 40) for _ in range(capacity)], dtype=torch.int64)
    rows = place_keys(keys, scores, capacity)
    assert bool((rows >= 0).all())
    state, twin = _table(capacity), _table(capacity)
    torch.ops.torchrec_ext.hash_restore(*state, keys, rows, scores, capacity)
    emulated.hash_restore(*twin, keys, rows, scores, capacity)
    _same(state, twin, "restore")
    model = ReferenceHashTable(capacity, POLICIES[policy])
    model.load(list(zip(keys.tolist(), rows.tolist(), scores.tolist())))
    slots = state[2].numel()
    stash = state[1][slots : slots + 32][state[0][slots : slots + 32] != 0]  # the stashed keys' rows
    stashed = [int(state[1][r]) for r in stash.tolist()]
    assert len(stashed) == 12
    universe = keys.tolist() + [rng.randrange(I64MIN, I64MAX) for _ in range(capacity)]
    for clock in range(1, 9):
        batch = rng.sample(stashed, 3) + [rng.choice(universe) for _ in range(rng.choice([5, 200, 1500]))]
        rng.shuffle(batch)
        t = torch.tensor(batch, dtype=torch.int64)
        _same(
            torch.ops.torchrec_ext.hash_find(state[0], state[1], t, capacity),
            emulated.hash_find(twin[0], twin[1], t, capacity),
            "find",
        )
        assert torch.ops.torchrec_ext.hash_find(state[0], state[1], t, capacity)[0].tolist() == model.find(batch)[0]
        if clock == 5:
            erase = torch.tensor(batch[:7] + batch[:1], dtype=torch.int64)
            got = emulated.hash_erase(twin[0], twin[1], twin[3], erase, capacity)
            assert torch.equal(torch.ops.torchrec_ext.hash_erase(state[0], state[1], state[3], erase, capacity), got)
            assert got.tolist() == model.erase(erase.tolist())
        args = (t, None, capacity, policy, clock, 0, False)
        backward = [x.clone() for x in twin]
        got = emulated.hash_upsert(*twin, *args)
        _same(torch.ops.torchrec_ext.hash_upsert(*state, *args), got, "upsert")
        assert [x.tolist() for x in got] == list(model.upsert(batch))
        with reversed_warps():
            _same(got, emulated.hash_upsert(*backward, *args), "upsert, warps reversed")
        _same(twin, backward, "table after upsert, warps reversed")
        _same(state, twin, "table after upsert")
        assert not (twin[0] & 0x80).any(), "the emulated kernels left rows pinned"
    keys_out, rows_out, scores_out = torch.ops.torchrec_ext.hash_export(*state[:3], capacity, 0, slots)
    assert list(zip(keys_out.tolist(), rows_out.tolist(), scores_out.tolist())) == model.export()
    # The multi-table ops: the stashed table beside a small one, in one call each.
    left = [k for k in stashed if model.find([k])[1][0]]
    small, small_twin = _table(100), _table(100)
    batch = left + [rng.choice(universe) for _ in range(300)]
    t = torch.tensor(batch + [1, 2, 3, 1], dtype=torch.int64)
    offsets, caps = [0, len(batch), len(batch) + 4], [capacity, 100]
    both, both_twin = list(zip(state, small)), list(zip(twin, small_twin))
    _same(
        torch.ops.torchrec_ext.hash_find_tables(both[0], both[1], t, offsets, caps),
        emulated.hash_find_tables(both_twin[0], both_twin[1], t, offsets, caps),
        "find_tables",
    )
    args = (t, offsets, None, None, caps, [policy, 1], [20, 1], [0, 0], False)
    got = emulated.hash_upsert_tables(*[list(x) for x in both_twin], *args)
    _same(torch.ops.torchrec_ext.hash_upsert_tables(*[list(x) for x in both], *args), got, "upsert_tables")
    _same(state, twin, "stashed table after upsert_tables")
    _same(small, small_twin, "small table after upsert_tables")
    assert got[0][: len(left)].tolist() == model.find(left)[0]  # the stashed keys found where they were


# A one-stripe table of 40 buckets (a key's two buckets in the same stripe: any two keys of an
# insert round may share one), 2 stripes, 3 stripes (odd ring).
_ONE_STRIPE = 32 * 40


@pytest.mark.parametrize(
    "capacity, policy",
    ci_subset(
        itertools.product([_ONE_STRIPE, 64 * 32 * 2, _THREE_STRIPES], range(6)),
        lambda capacity, policy: (capacity, policy) in {(_ONE_STRIPE, 5), (_THREE_STRIPES, 2)},
    ),
)
def test_emulated_upsert_of_repeated_keys_matches_cpu(emulated, capacity, policy):
    """Batches of few distinct keys, each repeated ~4 times (within one group of 32 of its
    stripe's positions and across groups), into a table that fills and then evicts, with per-
    occurrence scores: the touch pass (a lane per key) must apply a key's repeats in batch order
    from one lane (lfu sums, custom and assign keep the last occurrence's score), and the insert
    pass (a lane per key, in rounds) must never let two keys of one bucket go in one round or out
    of batch order; so rows, flags, evictions and every byte of the table equal the CPU kernel's,
    also with each launch's warps and each warp's lanes run in reverse (a race on a GPU would show
    there). The multi-table op on this table beside a small one must agree as well."""
    cpu = torch.ops.torchrec_ext
    rng = random.Random(capacity * 10 + policy)
    universe = [rng.randrange(I64MIN, I64MAX) for _ in range(2 * capacity)]
    state, twin = _table(capacity), _table(capacity)
    pair, pair_twin = [_table(capacity), _table(100)], [_table(capacity), _table(100)]
    epoch, evictions = 0, 0
    for step in range(8):
        start = rng.randrange(0, len(universe) - capacity // 4)
        distinct = universe[start : start + capacity // 4]
        batch = [rng.choice(distinct) for _ in range(capacity)]
        keys = torch.tensor(batch, dtype=torch.int64)
        scores = None
        if policy == 5 or rng.random() < 0.5:
            scores = torch.tensor([rng.choice([0, 1, 3, 7, 2**40, I64MAX - 1]) for _ in batch], dtype=torch.int64)
        if step % 3 == 2:
            epoch += 1
        args = (keys, scores, capacity, policy, step + 1, epoch, rng.random() < 0.5)
        backward = [t.clone() for t in twin]
        got = emulated.hash_upsert(*twin, *args)
        _same(cpu.hash_upsert(*state, *args), got, f"upsert, step {step}")
        _same(state, twin, f"table after upsert, step {step}")
        with reversed_warps():
            _same(got, emulated.hash_upsert(*backward, *args), f"upsert, warps and lanes reversed, step {step}")
        _same(twin, backward, f"table after upsert, warps and lanes reversed, step {step}")
        assert not (twin[0] & 0x80).any(), "the emulated kernels left rows pinned"
        evictions += got[2].numel()
        # The multi-table op: this batch for the big table, its first 300 keys for the small one.
        both = torch.cat([keys, keys[:300]])
        both_scores = None if scores is None else torch.cat([scores, scores[:300]])
        multi = (both, [0, capacity, capacity + 300], both_scores, None, [capacity, 100], [policy, policy])
        multi += ([step + 1] * 2, [epoch] * 2, args[-1])
        columns = [list(x) for x in zip(*pair)]
        columns_twin = [list(x) for x in zip(*pair_twin)]
        _same(
            cpu.hash_upsert_tables(*columns, *multi),
            emulated.hash_upsert_tables(*columns_twin, *multi),
            f"upsert_tables, step {step}",
        )
        for a, b in zip(pair, pair_twin):
            _same(a, b, f"tables after upsert_tables, step {step}")
    assert state[3].item() > 0.95 * capacity and (evictions > 0 or policy == 0)  # filled, then evicted
