"""The step path's sync-free hash-table ops (issue 13 item 6), bit for bit against the ops they
stand for: ``hash_upsert_fixed`` (outputs of one entry per key, a pending mask) against
``hash_upsert`` on the pending keys alone, on the CPU kernels and on the CUDA kernels under the
warp emulator; ``HashTable.erase_rows`` against ``erase`` of the keys at those rows; the torch
(CUDA) ``init_rows`` without a boolean mask against the masked form it replaced."""

import random

import pytest
import torch

from torchrec_ext import ops, torch_kernels
from torchrec_ext import reference as ref
from torchrec_ext.table import HashTable
from torchrec_ext.vocabulary import index_lengths

I64MIN, I64MAX = -(2**63), 2**63 - 1
_ops = torch.ops.torchrec_ext


def _table(capacity):
    digests, keys, scores = index_lengths(capacity)  # main slots, then the stash
    return [
        torch.zeros(digests, dtype=torch.uint8),
        torch.zeros(keys, dtype=torch.int64),
        torch.zeros(scores, dtype=torch.int64),
        torch.zeros(1, dtype=torch.int64),
    ]


def _batches(capacity, policy, steps=10, seed=0):
    """(keys, scores, pending) batches with repeats, extreme keys and, in small tables, evictions."""
    rng = random.Random(capacity * 10 + policy + seed)
    universe = [rng.randrange(I64MIN, I64MAX) for _ in range(int(1.6 * capacity) + 8)] + [I64MIN, -1, 0, 1, I64MAX]
    for _ in range(steps):
        n = rng.choice([0, 1, 5, capacity // 4 + 1, capacity // 2 + 1, capacity + 1])
        keys = torch.tensor([rng.choice(universe) for _ in range(n)], dtype=torch.int64)
        scored = policy in (ref.POLICIES.index("lfu"), ref.POLICIES.index("epoch_lfu"), ref.POLICIES.index("custom"))
        scores = torch.tensor([rng.randrange(0, 5) for _ in range(n)], dtype=torch.int64) if scored else None
        pending = (
            None if rng.random() < 0.25 else torch.tensor([rng.random() < 0.7 for _ in range(n)], dtype=torch.bool)
        )
        yield keys, scores, pending


def _expected(state, keys, scores, pending, capacity, policy, clock):
    """hash_upsert on the pending keys alone, its outputs spread back to one entry per key."""
    at = torch.arange(keys.numel()) if pending is None else pending.nonzero().squeeze(1)
    rows, inserted, evicted_keys, evicted_rows = _ops.hash_upsert(
        *state, keys[at], None if scores is None else scores[at], capacity, policy, clock, 0, False
    )
    n = keys.numel()
    full_rows, full_inserted = torch.full((n,), -1), torch.zeros(n, dtype=torch.bool)
    full_rows[at], full_inserted[at] = rows, inserted
    evicted, keys_out = torch.zeros(n, dtype=torch.bool), torch.zeros(n, dtype=torch.int64)
    for key, row in zip(evicted_keys.tolist(), evicted_rows.tolist()):
        i = int(((full_rows == row) & full_inserted).nonzero()[0])
        evicted[i], keys_out[i] = True, key
    return full_rows, full_inserted, evicted, keys_out


def _check_against_upsert(upsert_fixed, capacity, policy):
    state, twin = _table(capacity), _table(capacity)
    evictions = 0
    for clock, (keys, scores, pending) in enumerate(_batches(capacity, policy), start=1):
        want = _expected(twin, keys, scores, pending, capacity, policy, clock)
        got = upsert_fixed(*state, keys, scores, pending, capacity, policy, clock, 0, False)
        for name, a, b in zip(("rows", "inserted", "evicted", "evicted_keys"), got, want):
            assert torch.equal(a, b), f"clock {clock}: {name}"
        for a, b in zip(state, twin):
            assert torch.equal(a, b), f"clock {clock}: table state"
        evictions += int(want[2].sum())
    return evictions


# 1 stripe (33), 2 and 3 stripes (odd: three insert phases, windows).
@pytest.mark.parametrize("capacity", [33, 64 * 32 * 2, 64 * 32 * 3 + 5])
@pytest.mark.parametrize("policy", [p for p in range(6) if ref.POLICIES[p] != "custom"])
def test_cpu_upsert_fixed_is_upsert_of_the_pending_keys(capacity, policy):
    evictions = _check_against_upsert(_ops.hash_upsert_fixed, capacity, policy)
    if capacity == 33 and ref.POLICIES[policy] in ("lru", "epoch_lru"):
        assert evictions > 0  # the eviction outputs were exercised


def test_upsert_fixed_refuses_a_bad_pending_mask():
    state = _table(64)
    keys = torch.arange(5)
    before = [t.clone() for t in state]
    with pytest.raises(RuntimeError, match="pending must be a 1-D bool tensor of 5 elements"):
        _ops.hash_upsert_fixed(*state, keys, None, torch.ones(4, dtype=torch.bool), 64, 1, 1, 0, False)
    with pytest.raises(ValueError, match="pending must be a bool tensor"):
        HashTable(64).find_or_insert_fixed(keys, None, torch.ones(5, dtype=torch.int64))
    for a, b in zip(state, before):
        assert torch.equal(a, b)


@pytest.mark.parametrize("capacity", [64 * 32 * 2 + 3])
def test_erase_rows_is_erase_of_the_keys_there(capacity):
    a, b = HashTable(capacity), HashTable(capacity)
    keys = torch.randint(-(2**62), 2**62, (capacity // 2,), generator=torch.Generator().manual_seed(1))
    rows = a.find_or_insert(keys).rows
    b.find_or_insert(keys)
    chosen = torch.zeros(capacity, dtype=torch.bool)
    chosen[torch.randperm(capacity, generator=torch.Generator().manual_seed(2))[: capacity // 3]] = True
    removed = a.erase_rows(chosen)
    at_chosen = rows[chosen[rows.clamp(min=0)] & (rows >= 0)]
    b.erase(keys[chosen[rows.clamp(min=0)] & (rows >= 0)])
    assert a.size() == b.size()
    assert torch.equal(removed.nonzero().squeeze(1).sort().values, at_chosen.sort().values)
    for name in ("_digests", "_slot_keys", "_slot_scores", "_size"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


def _masked_init_rows(table, rows, ids, seed, kind, params, states, values):
    """torch_kernels.init_rows as it was, a boolean mask of the rows to write (plus the cast to a
    half table's dtype, which it lacked: index_put refuses float32 values for a float16 table)."""
    keep = rows >= 0
    rows, ids = rows[keep], ids[keep]
    table[rows] = torch_kernels.init_vectors(ids, table.shape[1], seed, ref.INITIALIZER_NAMES[kind], params).to(
        table.dtype
    )
    for state, value in zip(states, values):
        state[rows] = value


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows", [[3, -1, 0, 7, -1], [-1, -1], [-1, 0, 5], [0], []])
def test_torch_init_rows_without_a_mask_is_bit_identical(dtype, rows):
    rows = torch.tensor(rows, dtype=torch.int64)
    ids = torch.arange(rows.numel()) * 7919 - 3
    for kind, params in (("uniform", (-1.0, 1.0)), ("truncated_normal", (0.0, 1.0, -0.3, 0.6)), ("normal", (0.0, 2.0))):
        a = torch.randn(9, 5).to(dtype)
        b = a.clone()
        sa, sb = torch.rand(9, 5), None
        sb = sa.clone()
        torch_kernels.init_rows(a, rows, ids, 11, ref.INITIALIZERS[kind], params, [sa], [0.25])
        _masked_init_rows(b, rows, ids, 11, ref.INITIALIZERS[kind], params, [sb], [0.25])
        assert torch.equal(a, b) and torch.equal(sa, sb), kind


# ------------------------------------------------ the CUDA kernels under the warp emulator


def _emulated(tmp_path_factory):
    from cuda_emulation.build import build, cuda_include_dir

    if cuda_include_dir() is None:
        pytest.skip("needs the CUDA toolkit headers")
    return build(str(tmp_path_factory.mktemp("torchrec_emu")))


@pytest.mark.parametrize("capacity", [33, 64 * 32 * 2, 64 * 32 * 3 + 5])
@pytest.mark.parametrize("policy", [ref.POLICIES.index(p) for p in ("lru", "lfu", "epoch_lru", "none")])
def test_emulated_cuda_upsert_fixed_is_upsert_of_the_pending_keys(tmp_path_factory, capacity, policy):
    emu = _emulated(tmp_path_factory)
    _check_against_upsert(emu.hash_upsert_fixed, capacity, policy)


# ------------------------------------------------ the multi-table init (GPU path), run on CPU here


def _module(flat, dtype_cycle, optimizer, init):
    from torchrec import DataType

    from torchrec_ext import DynamicEmbeddingBagCollection, DynamicEmbeddingBagConfig

    dtypes = [DataType.FP32, DataType.FP16, DataType.BF16]
    configs = [
        DynamicEmbeddingBagConfig(
            name=f"t{i}",
            embedding_dim=3 + 2 * (i % 4),
            num_embeddings=48,
            feature_names=[f"f{i}"],
            ttl_steps=2 if i % 5 == 1 else None,
            data_type=dtypes[i % 3] if dtype_cycle else DataType.FP32,
            initializer=init(i),
        )
        for i in range(7)
    ]
    module = DynamicEmbeddingBagCollection(configs, optimizer=optimizer)
    module._tables.defer_new_rows = False  # the lookup writes new rows (as on a GPU)
    module._tables.flat_init = flat
    return module


@pytest.mark.parametrize("optimizer", ["adagrad", "rowwise_adagrad", "adam"])
@pytest.mark.parametrize("dtype_cycle", [False, True], ids=["fp32", "mixed_dtypes"])
def test_multi_table_init_is_bit_identical_to_per_table_init(optimizer, dtype_cycle):
    """One init_rows_tables call per lookup against the per-table torch init_rows (the kernel of
    the GPU path, registered for CPU tensors here): the same tables, bit for bit, after training
    steps with evictions, TTL expiries, every initializer and storage dtype."""
    from torchrec import KeyedJaggedTensor

    from torchrec_ext import Initializer

    inits = [
        Initializer("uniform", low=-0.5, high=0.25),
        Initializer("normal", mean=0.1, std=0.3),
        Initializer("truncated_normal", mean=0.0, std=1.0, low=-0.4, high=0.6),
        Initializer("constant", value=0.125),
    ]
    flat, per_table = (_module(f, dtype_cycle, optimizer, lambda i: inits[i % 4]) for f in (True, False))
    calls = {"tables": 0}
    original = ops.init_rows_tables

    def counted(*args, **kwargs):
        calls["tables"] += 1
        return original(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ops, "init_rows_tables", counted)
        mp.setattr(ops, "init_rows", lambda *a: torch_kernels.init_rows(*a))  # the torch kernel, per table
        for step in range(5):
            g = torch.Generator().manual_seed(step)
            lengths = torch.randint(0, 5, (7 * 4,), generator=g)
            kjt = KeyedJaggedTensor(
                keys=[f"f{i}" for i in range(7)],
                values=torch.randint(0, 90, (int(lengths.sum()),), generator=g),
                lengths=lengths,
                stride=4,
            )
            for module in (flat, per_table):
                module(kjt).values().sum().backward()
    assert calls["tables"] == 5  # one call per training lookup, whatever the table count
    a, b = flat.state_dict(), per_table.state_dict()
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_multi_table_init_against_the_cpu_kernel_per_table():
    """init_rows_tables over three tables (dims 5, 8, 3; one float16) against the C++ init_rows
    of each table: uniform and constant bit for bit, the normals to float32 rounding (libm's
    log / cos against torch's, as tests/test_init_rows.py checks the torch init_rows)."""
    from torchrec_ext.hashing import as_int64
    from torchrec_ext.vocabulary import table_words

    dims, capacities, dtypes = [5, 8, 3], [10, 6, 9], [torch.float32, torch.float16, torch.float32]
    words = [table_words(c, d, dt) for c, d, dt in zip(capacities, dims, dtypes)]
    offsets = torch.tensor([0, words[0], words[0] + words[1]])
    state_offsets = torch.tensor([0, capacities[0] * dims[0], capacities[0] * dims[0] + capacities[1] * dims[1]])
    rows = torch.tensor([3, -1, 0, 9, 5, 1, -1, 8, 0])
    tables = torch.tensor([0, 0, 0, 0, 1, 1, 2, 2, 2])
    ids = torch.tensor([11, -7, 2**62, -(2**63), 5, 6, 7, 8, 9])
    seeds = [12345, -3, -(2**62) + 17]
    for kinds, params in (
        ([0, 3, 0], [(-1.0, 1.0), (0.5,), (-0.1, 0.3)]),
        ([1, 2, 1], [(0.0, 1.0), (0.0, 1.0, -0.3, 0.6), (2.0, 0.5)]),
    ):
        weights = torch.zeros(sum(words))
        state = torch.full((int(state_offsets[-1]) + capacities[2] * dims[2],), 7.0)
        ops.init_rows_tables(
            weights,
            offsets,
            torch.tensor(dims),
            torch.tensor([0, 1, 0]),
            rows,
            tables,
            ids,
            torch.tensor([as_int64(s) for s in seeds]),
            torch.tensor(kinds),
            torch.tensor([list(p) + [0.0] * (4 - len(p)) for p in params], dtype=torch.float64),
            sorted(set(kinds)),
            max(dims),
            [state],
            state_offsets,
            False,
            [0.5],
        )
        for t in range(3):
            n = capacities[t] * dims[t]
            view = weights if dtypes[t] == torch.float32 else weights.view(dtypes[t])
            start = int(offsets[t]) * (4 // view.element_size())
            got = view[start : start + n].view(capacities[t], dims[t])
            want, want_state = (
                torch.zeros(capacities[t], dims[t], dtype=dtypes[t]),
                torch.full((capacities[t], dims[t]), 7.0),
            )
            mine = tables == t
            ops.init_rows(want, rows[mine], ids[mine], seeds[t], kinds[t], params[t], [want_state], [0.5])
            got_state = state[int(state_offsets[t]) : int(state_offsets[t]) + n].view(capacities[t], dims[t])
            if kinds[t] in (0, 3):
                assert torch.equal(got, want), (t, kinds[t])
            else:
                torch.testing.assert_close(
                    got.float(), want.float(), rtol=1e-3 if dtypes[t] != torch.float32 else 1e-6, atol=1e-6
                )
            assert torch.equal(got_state, want_state)
