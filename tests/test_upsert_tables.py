"""The multi-table hash ops. ``hash_upsert_tables`` (issue 13 items 6 and 7): the upsert of every table of a step in one call
(on a GPU one grid over all tables' stripes per pass), bit for bit against ``hash_upsert_fixed``
called table by table: same rows, flags, evicted keys, scores and sizes, every byte of every
table after each call. Random batches into full, evicting tables of several sizes (one-stripe
tables, two stripes, odd rings of three and five stripes) and policies mixed in one call, with
duplicate keys, extreme keys, empty tables, batches larger than a table (several insert windows),
pending masks, scores and clocks and epochs that differ per table; the CPU kernel, and the CUDA
kernel under the warp emulator (also with each launch's warps run last to first).
``hash_find_tables`` (a serving lookup's one find for all tables, issue 17) likewise against
``hash_find`` table by table."""

import random

import pytest
import torch

from cuda_emulation.build import build, cuda_include_dir
from torchrec_ext import ops
from torchrec_ext import reference as ref
from torchrec_ext.vocabulary import index_lengths

I64MIN, I64MAX = -(2**63), 2**63 - 1
_ops = torch.ops.torchrec_ext
STRIPE = 64 * 32  # slots of a stripe
LRU, LFU = ref.POLICIES.index("lru"), ref.POLICIES.index("lfu")


def _table(capacity):
    digests, keys, scores = index_lengths(capacity)  # main slots, then the stash
    return [
        torch.zeros(digests, dtype=torch.uint8),
        torch.zeros(keys, dtype=torch.int64),
        torch.zeros(scores, dtype=torch.int64),
        torch.zeros(1, dtype=torch.int64),
    ]


def _tables(capacities):
    return [_table(c) for c in capacities]


def _batches(capacities, seed, steps, need_scores=False):
    """Per call: (keys, key_offsets, scores, pending, clocks, epochs, assign) for all tables."""
    rng = random.Random(seed)
    universes = [
        [rng.randrange(I64MIN, I64MAX) for _ in range(int(1.6 * c) + 8)] + [I64MIN, -1, 0, 1, I64MAX]
        for c in capacities
    ]
    epochs = [0] * len(capacities)
    for step in range(1, steps + 1):
        parts, offsets = [], [0]
        for c, universe in zip(capacities, universes):
            n = rng.choice([0, 1, 5, c // 4 + 1, c // 2 + 1, c + 1, 2 * c + 3])
            parts += [rng.choice(universe) for _ in range(n)]
            offsets.append(len(parts))
        keys = torch.tensor(parts, dtype=torch.int64)
        n = keys.numel()
        scores = (
            torch.tensor([rng.randrange(0, 5) for _ in range(n)], dtype=torch.int64)
            if need_scores or rng.random() < 0.5
            else None
        )
        pending = None if rng.random() < 0.3 else torch.tensor([rng.random() < 0.7 for _ in range(n)], dtype=torch.bool)
        epochs = [e if rng.random() < 0.8 else rng.randrange(0, 2**31) for e in epochs]
        clocks = [step + t + rng.choice([0, 0, 2**32]) for t in range(len(capacities))]
        yield keys, offsets, scores, pending, clocks, list(epochs), rng.random() < 0.2


def _per_table(states, keys, offsets, scores, pending, capacities, policies, clocks, epochs, assign):
    """The oracle: hash_upsert_fixed on each table's slice, outputs concatenated."""
    outs = []
    for t, state in enumerate(states):
        b, e = offsets[t], offsets[t + 1]
        outs.append(
            _ops.hash_upsert_fixed(
                *state,
                keys[b:e],
                None if scores is None else scores[b:e],
                None if pending is None else pending[b:e],
                capacities[t],
                policies[t],
                clocks[t],
                epochs[t],
                assign,
            )
        )
    return [torch.cat([o[i] for o in outs]) if outs else torch.empty(0) for i in range(4)]


def _call(upsert_tables, states, keys, offsets, scores, pending, capacities, policies, clocks, epochs, assign):
    return upsert_tables(
        [s[0] for s in states],
        [s[1] for s in states],
        [s[2] for s in states],
        [s[3] for s in states],
        keys,
        offsets,
        scores,
        pending,
        capacities,
        policies,
        clocks,
        epochs,
        assign,
    )


def _same_tables(a, b, what):
    for t, (x, y) in enumerate(zip(a, b)):
        for name, u, v in zip(("digests", "slot_keys", "slot_scores", "size"), x, y):
            assert torch.equal(u, v), f"{what}: table {t} {name}"


def _check(upsert_tables, expected, capacities, policies, seed, steps, reverse_some=False, monkeypatch=None):
    """Runs upsert_tables and `expected` (same signature as _per_table) side by side."""
    got_states, want_states = _tables(capacities), _tables(capacities)
    evictions = refusals = 0
    for step, (keys, offsets, scores, pending, clocks, epochs, assign) in enumerate(
        _batches(capacities, seed, steps, need_scores=ref.POLICIES.index("custom") in policies)
    ):
        args = (keys, offsets, scores, pending, capacities, policies, clocks, epochs, assign)
        want = expected(want_states, *args)
        if reverse_some and step % 2:
            backward = [[x.clone() for x in s] for s in got_states]
            monkeypatch.setenv("TORCHREC_EMU_REVERSE_WARPS", "1")
            reversed_got = _call(upsert_tables, backward, *args)
            monkeypatch.delenv("TORCHREC_EMU_REVERSE_WARPS")
        got = _call(upsert_tables, got_states, *args)
        for name, a, b in zip(("rows", "inserted", "evicted", "evicted_keys"), got, want):
            assert torch.equal(a, b), f"step {step}: {name}"
        _same_tables(got_states, want_states, f"step {step}")
        if reverse_some and step % 2:
            for name, a, b in zip(("rows", "inserted", "evicted", "evicted_keys"), got, reversed_got):
                assert torch.equal(a, b), f"step {step}, warps reversed: {name}"
            _same_tables(got_states, backward, f"step {step}, warps reversed")
        assert not any((s[0] & 0x80).any() for s in got_states), "rows left pinned"
        evictions += int(got[2].sum())
        refusals += int(((got[0] < 0) & (pending if pending is not None else True)).sum())
    return evictions, refusals


# One-stripe tables (1, 33 and 2048 rows), 2 stripes, odd rings of 3 and 5 (three insert phases).
CAPACITIES = [1, 33, STRIPE, 2 * STRIPE, 3 * STRIPE + 5, 5 * STRIPE + 7]


@pytest.mark.parametrize("policy", ["lru", "lfu", "mixed"])
def test_cpu_kernel_equals_per_table_calls(policy):
    policies = {"lru": [LRU] * 6, "lfu": [LFU] * 6, "mixed": [0, 1, 2, 3, 4, 5]}[policy]
    evictions, refusals = _check(_ops.hash_upsert_tables, _per_table, CAPACITIES, policies, seed=len(policy), steps=10)
    assert evictions > 0  # the tables filled and evicted
    if policy == "mixed":
        assert refusals > 0  # the 'none' table refused keys once full


def test_cpu_kernel_in_parallel_over_tables_equals_per_table_calls():
    """Many small tables sharing a large batch: the kernel runs the tables on parallel threads."""
    capacities = [STRIPE + 3 * t for t in range(16)]  # two of the six calls run in parallel (>= 16384 keys)
    _check(_ops.hash_upsert_tables, _per_table, capacities, [LRU, LFU] * 8, seed=7, steps=6)


def test_the_wrapper_and_an_empty_call():
    state = _table(64)
    rows, inserted, evicted, evicted_keys = ops.hash_upsert_tables(
        [], [], [], [], torch.empty(0, dtype=torch.int64), [0], None, None, [], [], [], [], False
    )
    assert rows.numel() == 0 and inserted.dtype == torch.bool
    rows, inserted, _, _ = ops.hash_upsert_tables(
        [state[0]],
        [state[1]],
        [state[2]],
        [state[3]],
        torch.tensor([5, 6, 5]),
        [0, 3],
        None,
        None,
        [64],
        [LRU],
        [1],
        [0],
        False,
    )
    assert inserted.tolist() == [True, True, False] and rows[0] == rows[2] and int(state[3]) == 2


def _bad_calls():
    """(what the error must say, arguments): each an error before any table is written."""
    keys = torch.arange(10)
    good = dict(
        keys=keys,
        key_offsets=[0, 4, 10],
        scores=None,
        pending=None,
        capacities=[64, 100],
        policies=[LRU, LFU],
        clocks=[1, 1],
        epochs=[0, 0],
    )
    yield "slot_keys must have one entry per table", dict(good), "slot_keys"
    yield "key_offsets must have 3 entries", dict(good, key_offsets=[0, 10]), None
    yield "key_offsets must run from 0 to keys.numel", dict(good, key_offsets=[0, 4, 9]), None
    yield "key_offsets must not decrease", dict(good, key_offsets=[0, 11, 10]), None
    yield "capacity must be > 0", dict(good, capacities=[64, 0]), None
    yield (
        "digests must be a contiguous uint8 tensor of 263 entries for capacity 200",  # slots, stash, counts
        dict(good, capacities=[64, 200]),
        None,
    )
    yield "clock must be >= 0, got -1", dict(good, clocks=[1, -1]), None
    yield "unknown policy id 9", dict(good, policies=[LRU, 9]), None
    yield "the custom policy needs scores", dict(good, policies=[5, LRU]), None
    yield "scores must be a 1-D int64 tensor of 10 elements", dict(good, scores=torch.ones(9, dtype=torch.int64)), None
    yield "pending must be a 1-D bool tensor of 10 elements", dict(good, pending=torch.ones(10)), None
    yield "table 1 is table 0 again", dict(good, capacities=[64, 64]), "alias"


@pytest.mark.parametrize("message,kwargs,twist", list(_bad_calls()), ids=[m for m, _, _ in _bad_calls()])
def test_bad_input_names_the_argument_and_leaves_tables_unchanged(message, kwargs, twist):
    states = [_table(64), _table(100)]
    if twist == "alias":
        states[1] = states[0]
    before = [[x.clone() for x in s] for s in states]
    lists = [[s[i] for s in states] for i in range(4)]
    if twist == "slot_keys":
        lists[1] = lists[1][:1]
    with pytest.raises(RuntimeError, match=f"hash_upsert.*{message}"):
        _ops.hash_upsert_tables(*lists, assign=False, **kwargs)
    _same_tables(states, before, "after a refused call")


# ----------------------------------------------------------------------------- CUDA kernel, emulated

needs_emulator = pytest.mark.skipif(cuda_include_dir() is None, reason="needs the CUDA toolkit headers")


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    return build(str(tmp_path_factory.mktemp("torchrec_emu")))


def _cpu_tables(states, *args):
    return _call(_ops.hash_upsert_tables, states, *args)


@needs_emulator
@pytest.mark.parametrize("policies", [[LRU] * 5, [LFU] * 5, [0, 2, 3, 4, 1]], ids=["lru", "lfu", "mixed"])
def test_emulated_cuda_kernel_equals_cpu_kernel(emulated, policies, monkeypatch):
    capacities = [1, 33, STRIPE, 2 * STRIPE, 3 * STRIPE + 5]
    evictions, _ = _check(
        emulated.hash_upsert_tables,
        _cpu_tables,
        capacities,
        policies,
        seed=sum(policies),
        steps=6,
        reverse_some=True,
        monkeypatch=monkeypatch,
    )
    assert evictions > 0


@needs_emulator
def test_emulated_cuda_kernel_equals_per_table_emulated_calls(emulated):
    """Against the per-table CUDA kernel itself (hash_upsert_fixed under the emulator)."""
    capacities = [40, STRIPE + 9, 3 * STRIPE + 5]

    def per_table_emulated(states, keys, offsets, scores, pending, caps, policies, clocks, epochs, assign):
        outs = [
            emulated.hash_upsert_fixed(
                *s,
                keys[offsets[t] : offsets[t + 1]],
                None if scores is None else scores[offsets[t] : offsets[t + 1]],
                None if pending is None else pending[offsets[t] : offsets[t + 1]],
                caps[t],
                policies[t],
                clocks[t],
                epochs[t],
                assign,
            )
            for t, s in enumerate(states)
        ]
        return [torch.cat([o[i] for o in outs]) for i in range(4)]

    _check(emulated.hash_upsert_tables, per_table_emulated, capacities, [LRU, LFU, LRU], seed=3, steps=4)


# ----------------------------------------------------------------------------- HashTable level


def test_find_or_insert_tables_equals_each_tables_find_or_insert_fixed():
    from torchrec_ext.table import HashTable, find_or_insert_tables

    policies = ["lru", "lfu", "epoch_lfu", "none"]
    ours, theirs = ([HashTable(100 + 40 * t, policy=p) for t, p in enumerate(policies)] for _ in range(2))
    for t in (1, 3):
        ours[t].set_epoch(3), theirs[t].set_epoch(3)
    g = torch.Generator().manual_seed(1)
    for step in range(5):
        sizes = [0 if (t + step) % 4 == 0 else 60 + 30 * t for t in range(4)]
        keys = torch.randint(0, 400, (sum(sizes),), generator=g)
        scores = torch.randint(1, 4, keys.shape, generator=g)
        pending = torch.rand(keys.shape, generator=g) < 0.8
        offsets = [0] + torch.tensor(sizes).cumsum(0).tolist()
        got = find_or_insert_tables(ours, keys, offsets, scores, pending)
        for t, (table, b, e) in enumerate(zip(theirs, offsets, offsets[1:])):
            want = table.find_or_insert_fixed(
                keys[b:e], scores[b:e] if table.policy in ("lfu", "epoch_lfu") else None, pending[b:e]
            )
            for a, w in zip(got, want):
                assert torch.equal(a[b:e], w), f"step {step} table {t}"
    for a, b in zip(ours, theirs):
        assert a.clock == b.clock and torch.equal(a._slot_scores, b._slot_scores) and a.size() == b.size()


def test_find_or_insert_tables_refuses_bad_input_and_leaves_tables_unchanged():
    from torchrec_ext.table import HashTable, find_or_insert_tables

    tables = [HashTable(64), HashTable(64, policy="custom")]
    keys = torch.arange(10)
    cases = [
        ((tables[:1] * 2, keys, [0, 5, 10]), "a table appears twice"),
        ((tables, keys, [0, 5]), r"key_offsets must be 3 ascending ints from 0 to 10, got \[0, 5\]"),
        ((tables, keys, [0, 6, 5]), "key_offsets must be 3 ascending"),
        ((tables, keys.float(), [0, 5, 10]), "keys must be an integer tensor"),
        ((tables, keys, [0, 5, 10]), "'custom' policy needs scores"),
        (
            (tables, keys, [0, 5, 10], torch.ones(10, dtype=torch.int64), torch.ones(9, dtype=torch.bool)),
            "pending must be a bool tensor of one flag per key",
        ),
    ]
    for args, message in cases:
        with pytest.raises((ValueError, TypeError), match=message):
            find_or_insert_tables(*args)
    assert all(t.size() == 0 and t.clock == 0 for t in tables)


# ----------------------------------------------------------------------------- hash_find_tables


def _filled(capacities, seed):
    """Tables filled by a few upserts, and a batch per table (present and absent keys, some tables empty)."""
    states = _tables(capacities)
    batches = list(_batches(capacities, seed, 3))
    for keys, offsets, scores, pending, clocks, epochs, _ in batches:
        _call(
            _ops.hash_upsert_tables,
            states,
            keys,
            offsets,
            scores,
            pending,
            capacities,
            [LRU] * len(capacities),
            clocks,
            epochs,
            False,
        )
    keys, offsets = batches[-1][0], batches[-1][1]
    return states, torch.cat([keys, torch.tensor([I64MIN, I64MAX])]), offsets[:-1] + [offsets[-1] + 2]


def _find_per_table(states, keys, offsets, capacities):
    outs = [_ops.hash_find(s[0], s[1], keys[offsets[t] : offsets[t + 1]], capacities[t]) for t, s in enumerate(states)]
    return [torch.cat([o[i] for o in outs]) for i in range(2)]


@pytest.mark.parametrize("capacities", [CAPACITIES, [STRIPE + 3 * t for t in range(16)]], ids=["sizes", "parallel"])
def test_find_tables_equals_per_table_finds(capacities):
    states, keys, offsets = _filled(capacities, seed=11)
    got = ops.hash_find_tables([s[0] for s in states], [s[1] for s in states], keys, offsets, capacities)
    want = _find_per_table(states, keys, offsets, capacities)
    assert all(torch.equal(a, b) for a, b in zip(got, want)) and got[1].any() and not got[1].all()
    with pytest.raises(RuntimeError, match="hash_find_tables: key_offsets must not decrease"):
        ops.hash_find_tables([s[0] for s in states], [s[1] for s in states], keys, [0, 5, 3] + offsets[3:], capacities)


@needs_emulator
def test_emulated_find_tables_equals_cpu(emulated):
    capacities = [1, 33, STRIPE + 9, 3 * STRIPE + 5]
    states, keys, offsets = _filled(capacities, seed=12)
    args = ([s[0] for s in states], [s[1] for s in states], keys, offsets, capacities)
    for a, b in zip(emulated.hash_find_tables(*args), _ops.hash_find_tables(*args)):
        assert torch.equal(a, b)
