"""Column-wise sharding of dynamic tables on 2 real gloo ranks, through DistributedModelParallel
with our sharders: outputs, table contents (full_state_dict) and fused optimizer state equal
the unsharded module fed the global batch (EBC sum / mean / weighted, EC); every column shard's
hash table (ids, slots, scores) is the same as the other's, with a table kept full so rows are
evicted; checkpoints round-trip (state_dict, DCP) and load unsharded; what cannot be exact is
refused with a clear error. Also: column shards of tables with TTL, each admission strategy and
FP16 rows keep every shard's last-seen steps and admission state identical, and equal unsharded."""

import os

import pytest
import torch
import torch.distributed as dist
from torchrec import DataType, KeyedJaggedTensor, PoolingType

from dist_helpers import ModelWith, assert_same_tables, dmp_of, global_batch, run_ranks
from torchrec_ext import (
    DynamicEmbeddingBagCollection,
    DynamicEmbeddingBagConfig,
    DynamicEmbeddingCollection,
    DynamicEmbeddingConfig,
    Initializer,
)

WORLD, BATCH, KEYS = 2, 6, ["f1", "f2", "f3"]
SMALL = 16  # t1's capacity: far fewer rows than ids seen, so it stays full and evicts
KERNEL = "customized_kernel"


def _ebc_configs():
    return [
        DynamicEmbeddingBagConfig(
            name="t1",
            embedding_dim=8,
            num_embeddings=SMALL,
            feature_names=["f1", "f2"],
            initializer=Initializer("normal", std=0.5),
            eviction_policy="lfu",
        ),
        DynamicEmbeddingBagConfig(
            name="t2", embedding_dim=8, num_embeddings=256, feature_names=["f3"], pooling=PoolingType.MEAN, ttl_steps=50
        ),
        DynamicEmbeddingBagConfig(
            name="t3", embedding_dim=16, num_embeddings=128, feature_names=["f1"], admit_after=2, fallback_rows=3
        ),  # ids not admitted yet read fallback rows
    ]


def _ec_configs():
    return [
        DynamicEmbeddingConfig(
            name="t1", embedding_dim=8, num_embeddings=SMALL, feature_names=["f1", "f2"], eviction_policy="lru"
        ),
        DynamicEmbeddingConfig(name="t2", embedding_dim=8, num_embeddings=128, feature_names=["f3"]),
    ]


def _rank_batch(step, rank, weighted=False):
    gen = torch.Generator().manual_seed(step * 100 + rank)
    lengths = torch.randint(0, 4, (len(KEYS) * BATCH,), generator=gen)
    n = int(lengths.sum())
    values = torch.randint(0, 60, (n,), generator=gen) * (2**35) - 3  # 60 ids, far more than SMALL
    return KeyedJaggedTensor(
        keys=KEYS,
        values=values,
        lengths=lengths,
        stride=BATCH,
        weights=torch.rand(n, generator=gen) if weighted else None,
    )


def _dmp(module, name, plan_generators, sharder):
    return dmp_of(ModelWith(name, module), name, plan_generators, sharder, WORLD)


SHARED_STATE = (
    "weight_id",
    "row",
    "metadata",
    "counters",
    "last_seen",
    "admission_id",
    "admission_count",
    "admission_bloom",
)


def _assert_shards_identical(local_module, prefix, tables):
    """Every rank holding a column shard of ``tables`` has the same hash table: ids, slots,
    scores, counters, and (where the table has them) last-seen steps and admission state (the
    counter's pending ids and counts, the Bloom filter) equal across ranks."""
    sd = local_module.state_dict()
    mine = {t: {f: sd[f"{prefix}{t}.{f}"].clone() for f in SHARED_STATE if f"{prefix}{t}.{f}" in sd} for t in tables}
    everyone = [None] * WORLD
    dist.all_gather_object(everyone, mine)
    for t in tables:
        assert everyone[0][t].keys() == everyone[1][t].keys()
        for f in mine[t]:
            assert torch.equal(everyone[0][t][f], everyone[1][t][f]), f"column shards of {t} differ in {f}"


def _train_step(dmp, reference, kjts, rank, step):
    """The sharded EBC's output on this rank's batch equals the reference's on the global batch;
    both train on random output gradients."""
    out = dmp(kjts[rank]).values()
    want = reference(global_batch(kjts)).values()
    grads = [
        torch.randn(BATCH, out.shape[1], generator=torch.Generator().manual_seed(step * 7 + r)) for r in range(WORLD)
    ]
    torch.testing.assert_close(out, want[rank * BATCH : (rank + 1) * BATCH], rtol=1e-5, atol=1e-5)
    (out * grads[rank]).sum().backward()
    # The ranks train on the mean of their losses (TorchRec's gradient division).
    ((want * torch.cat(grads)).sum() / WORLD).backward()


def _ebc_case(rank, root, weighted, optimizer, generators):
    from torchrec_ext.distributed import DynamicEmbeddingBagCollectionSharder, full_state_dict
    from torchrec_ext.distributed.checkpoint import load_checkpoint, save_checkpoint

    make = lambda: DynamicEmbeddingBagCollection(
        _ebc_configs(), is_weighted=weighted, optimizer=optimizer, optimizer_kwargs={"lr": 0.1}
    )
    reference = make()
    dmp = _dmp(make(), "ebc", generators, DynamicEmbeddingBagCollectionSharder())
    seen = set()
    for step in range(5):
        kjts = [_rank_batch(step, r, weighted) for r in range(WORLD)]
        seen |= set(kjts[0]["f1"].values().tolist() + kjts[1]["f1"].values().tolist())
        _train_step(dmp, reference, kjts, rank, step)
    columns = [t for t, g in generators.items() if g.__qualname__.startswith("column_wise")]
    _assert_shards_identical(dmp.module.ebc.local_module, "embedding_bags.", columns)
    if "t1" in columns:  # kept full: evictions happened, on every shard alike
        from torchrec_ext.distributed.table_stats import reduce_table_stats

        live = lambda module: module.state_dict()["embedding_bags.t1.weight_id"].numel()
        assert live(dmp.module.ebc.local_module) == live(reference) < len(seen)
        stats, want_stats = reduce_table_stats(dmp.module.ebc.table_stats())["t1"], reference.table_stats()["t1"]
        assert stats.evictions == want_stats.evictions > 0 and stats.inserts == want_stats.inserts
    sharded = dmp.state_dict()
    whole = full_state_dict(sharded)
    want_state = reference.state_dict()
    assert_same_tables(whole, {"ebc." + k: v for k, v in want_state.items()}, "ebc.embedding_bags.")
    fallback = [k for k in want_state if ".fallback_" in k]
    assert "embedding_bags.t3.fallback_weight" in fallback
    assert float(want_state["embedding_bags.t3.fallback_weight"].abs().sum()) > 0
    for key in fallback:  # trained, and whole on every rank
        torch.testing.assert_close(whole["ebc." + key], want_state[key], rtol=1e-5, atol=1e-5, msg=key)

    # Checkpoints: the sharded state into a fresh DMP of the same plan, the full state into an
    # unsharded module, and a DCP save loaded into a fresh DMP: the same eval outputs.
    evals = [[_rank_batch(50 + i, r, weighted) for r in range(WORLD)] for i in range(2)]
    dmp.eval()
    want = [dmp(kjts[rank]).values().detach() for kjts in evals]
    copy = _dmp(make(), "ebc", generators, DynamicEmbeddingBagCollectionSharder())
    copy.load_state_dict(sharded)
    unsharded = make()
    unsharded.load_state_dict({k[len("ebc.") :]: v for k, v in whole.items()})
    save_checkpoint(root, 1, {"model": sharded})
    restored = _dmp(make(), "ebc", generators, DynamicEmbeddingBagCollectionSharder())
    restored.load_state_dict(load_checkpoint(os.path.join(root, "step_1"), {"model": restored.state_dict()})["model"])
    for module in (copy, restored):
        module.eval()
        for kjts, expected in zip(evals, want):
            torch.testing.assert_close(module(kjts[rank]).values(), expected, rtol=0, atol=0)
    unsharded.eval()
    for kjts, expected in zip(evals, want):
        got = unsharded(global_batch(kjts)).values()[rank * BATCH : (rank + 1) * BATCH]
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    assert_same_tables(full_state_dict(restored.state_dict()), whole, "ebc.embedding_bags.")


def _ebc_column_wise(rank, world_size, root):
    from torchrec.distributed.sharding_plan import column_wise, row_wise, table_wise

    every = {t: column_wise(ranks=[0, 1], compute_kernel=KERNEL) for t in ("t1", "t2", "t3")}
    mixed = {
        "t1": column_wise(ranks=[1, 0], compute_kernel=KERNEL),
        "t2": row_wise(compute_kernel=KERNEL),
        "t3": table_wise(rank=0, compute_kernel=KERNEL),
    }
    _ebc_case(rank, os.path.join(root, "a"), False, "adagrad", every)
    _ebc_case(rank, os.path.join(root, "b"), True, "adam", mixed)


def test_column_wise_ebc_equals_unsharded_and_checkpoints_round_trip(tmp_path):
    run_ranks(_ebc_column_wise, WORLD, str(tmp_path))


def _ec_train_step(out, reference, kjts, rank, step, need_indices=False):
    """The sharded EC's output ``out`` on this rank's batch equals the reference's on the global
    batch (each feature's slice of it); both train on the same loss."""
    want = reference(global_batch(kjts))
    assert list(out) == list(want)
    loss = ref_loss = 0
    for name, jt in out.items():
        feature = name.split("@")[0]
        before = sum(int(kjts[r][feature].lengths().sum()) for r in range(rank))
        n = int(kjts[rank][feature].lengths().sum())
        torch.testing.assert_close(jt.values(), want[name].values()[before : before + n], rtol=1e-6, atol=1e-6)
        if need_indices:
            assert torch.equal(jt.weights(), kjts[rank][feature].values())
        loss = loss + (jt.values() * (step + 1)).sum()
        ref_loss = ref_loss + (want[name].values() * (step + 1)).sum()
    loss.backward()
    ref_loss.backward()


def _ec_column_wise(rank, world_size):
    from torchrec.distributed.sharding_plan import column_wise

    from torchrec_ext.distributed import DynamicEmbeddingCollectionSharder, full_state_dict

    make = lambda: DynamicEmbeddingCollection(
        _ec_configs(), need_indices=True, optimizer="adagrad", optimizer_kwargs={"lr": 0.2}
    )
    reference = make()
    generators = {
        "t1": column_wise(ranks=[0, 1], compute_kernel=KERNEL),
        "t2": column_wise(ranks=[1, 0], compute_kernel=KERNEL),
    }
    dmp = _dmp(make(), "ec", generators, DynamicEmbeddingCollectionSharder())
    for step in range(4):
        kjts = [_rank_batch(step, r) for r in range(WORLD)]
        out = dmp(kjts[rank])
        out = out.wait() if hasattr(out, "wait") else out
        _ec_train_step(out, reference, kjts, rank, step, need_indices=True)
    _assert_shards_identical(dmp.module.ec.local_module, "embeddings.", ["t1", "t2"])
    whole = full_state_dict(dmp.state_dict())
    assert_same_tables(whole, {"ec." + k: v for k, v in reference.state_dict().items()}, "ec.embeddings.")
    unsharded = make()
    unsharded.load_state_dict({k[len("ec.") :]: v for k, v in whole.items()})
    assert_same_tables({"ec." + k: v for k, v in unsharded.state_dict().items()}, whole, "ec.embeddings.")
    with pytest.raises(ValueError, match=r"rank [01] would hold columns of unequal width \{'t1': 4, 't2': [26]\}"):
        _dmp(
            make(),
            "ec",
            {"t1": generators["t1"], "t2": column_wise(size_per_rank=[2, 6], compute_kernel=KERNEL)},
            DynamicEmbeddingCollectionSharder(),
        )


def test_column_wise_ec_equals_unsharded():
    run_ranks(_ec_column_wise, WORLD)


def _odd_column_configs(pooled):
    """Tables split at odd columns: 6 = 3 + 3, 10 = 5 + 5 and 7 = 3 + 4 (EC: one dim, 7 = 3 + 4)."""
    if not pooled:
        return [
            DynamicEmbeddingConfig(name=n, embedding_dim=7, num_embeddings=n_rows, feature_names=f, **extra)
            for n, n_rows, f, extra in (
                ("t1", SMALL, ["f1", "f2"], dict(eviction_policy="lru")),
                ("t2", 128, ["f3"], dict(initializer=Initializer("normal", std=0.3))),
            )
        ]
    return [
        DynamicEmbeddingBagConfig(
            name="t1",
            embedding_dim=6,
            num_embeddings=SMALL,
            feature_names=["f1", "f2"],
            initializer=Initializer("normal", std=0.5),
            eviction_policy="lfu",
        ),
        DynamicEmbeddingBagConfig(
            name="t2",
            embedding_dim=10,
            num_embeddings=256,
            feature_names=["f3"],
            pooling=PoolingType.MEAN,
            initializer=Initializer("truncated_normal", std=0.4),
        ),
        DynamicEmbeddingBagConfig(
            name="t3", embedding_dim=7, num_embeddings=128, feature_names=["f1"], fallback_rows=3
        ),
    ]


def _odd_columns(rank, world_size):
    """Column shards starting at odd columns (TorchRec allows any split of the dim): outputs,
    tables and optimizer state equal the unsharded module, EBC and EC."""
    from torchrec.distributed.sharding_plan import column_wise

    from torchrec_ext.distributed import (
        DynamicEmbeddingBagCollectionSharder,
        DynamicEmbeddingCollectionSharder,
        full_state_dict,
    )

    make = lambda: DynamicEmbeddingBagCollection(
        _odd_column_configs(True), is_weighted=True, optimizer="adagrad", optimizer_kwargs={"lr": 0.1}
    )
    reference = make()
    # (column_wise(ranks=...) splits in TorchRec's blocks of 4 columns; size_per_rank splits anywhere)
    dmp = _dmp(
        make(),
        "ebc",
        {
            t: column_wise(size_per_rank=sizes, compute_kernel=KERNEL)
            for t, sizes in (("t1", [3, 3]), ("t2", [5, 5]), ("t3", [3, 4]))
        },
        DynamicEmbeddingBagCollectionSharder(),
    )
    firsts = {t: dmp.module.ebc._owners[t].local_columns(rank) for t in ("t1", "t2", "t3")}
    assert firsts == (
        {"t1": (0, 3), "t2": (0, 5), "t3": (0, 3)} if rank == 0 else {"t1": (3, 3), "t2": (5, 5), "t3": (3, 4)}
    ), firsts
    for step in range(4):
        _train_step(dmp, reference, [_rank_batch(step, r, True) for r in range(WORLD)], rank, step)
    _assert_shards_identical(dmp.module.ebc.local_module, "embedding_bags.", ["t1", "t2", "t3"])
    whole = full_state_dict(dmp.state_dict())
    assert_same_tables(whole, {"ebc." + k: v for k, v in reference.state_dict().items()}, "ebc.embedding_bags.")

    make = lambda: DynamicEmbeddingCollection(
        _odd_column_configs(False), optimizer="adagrad", optimizer_kwargs={"lr": 0.2}
    )
    reference = make()
    dmp = _dmp(
        make(),
        "ec",
        {t: column_wise(size_per_rank=[3, 4], compute_kernel=KERNEL) for t in ("t1", "t2")},
        DynamicEmbeddingCollectionSharder(),
    )
    import torchrec_ext.distributed.embedding as sharded_ec

    sent, send = [], sharded_ec.all_to_all_single

    def recording(output, input, *args, **kwargs):  # what the output dist sends back
        sent.append(input.numel())
        return send(output, input, *args, **kwargs)

    for step in range(4):
        kjts = [_rank_batch(step, r) for r in range(WORLD)]
        sharded_ec.all_to_all_single, sent[:] = recording, []
        try:
            out = dmp(kjts[rank])
            out = out.wait() if hasattr(out, "wait") else out
        finally:
            sharded_ec.all_to_all_single = send
        # Each shard sends its own columns of every id (both tables are split over both ranks):
        # 3 + 4 elements an id in all, not two whole 7-wide vectors.
        everyone = [None] * WORLD
        dist.all_gather_object(everyone, sum(sent))
        assert sum(everyone) == 7 * sum(int(k.lengths().sum()) for k in kjts), (everyone, step)
        _ec_train_step(out, reference, kjts, rank, step)
    _assert_shards_identical(dmp.module.ec.local_module, "embeddings.", ["t1", "t2"])
    whole = full_state_dict(dmp.state_dict())
    assert_same_tables(whole, {"ec." + k: v for k, v in reference.state_dict().items()}, "ec.embeddings.")


def test_column_shards_at_odd_columns_equal_unsharded():
    run_ranks(_odd_columns, WORLD)


def _state_configs():
    fp16 = dict(data_type=DataType.FP16, stochastic_rounding=False)  # rounded to nearest: exact per column
    return [
        DynamicEmbeddingBagConfig(
            name="t1", embedding_dim=8, num_embeddings=SMALL, feature_names=["f1"], ttl_steps=2, **fp16
        ),
        DynamicEmbeddingBagConfig(
            name="t2", embedding_dim=8, num_embeddings=128, feature_names=["f2"], admission="bloom", admit_after=2
        ),
        DynamicEmbeddingBagConfig(
            name="t3",
            embedding_dim=8,
            num_embeddings=128,
            feature_names=["f3"],
            admission="probabilistic",
            admit_probability=0.5,
            **fp16,
        ),
        DynamicEmbeddingBagConfig(
            name="t4",
            embedding_dim=8,
            num_embeddings=128,
            feature_names=["f1"],
            admission="counter",
            admit_after=2,
            ttl_steps=3,
        ),
    ]


def _admission_state(state, prefix, table):
    """A table's admission state by id: the counter's pending counts, and the Bloom filter."""
    out = {}
    if f"{prefix}{table}.admission_id" in state:
        out["pending"] = dict(
            zip(state[f"{prefix}{table}.admission_id"].tolist(), state[f"{prefix}{table}.admission_count"].tolist())
        )
    if f"{prefix}{table}.admission_bloom" in state:
        out["bloom"] = state[f"{prefix}{table}.admission_bloom"]
    return out


def _column_state_and_fp16(rank, world_size):
    """Column shards of tables with TTL, each admission strategy and FP16 rows: outputs and
    tables equal the unsharded module, and every shard's hash table, last-seen steps and
    admission state are the same."""
    from torchrec.distributed.sharding_plan import column_wise

    from torchrec_ext.distributed import DynamicEmbeddingBagCollectionSharder, full_state_dict

    make = lambda: DynamicEmbeddingBagCollection(_state_configs(), optimizer="adagrad", optimizer_kwargs={"lr": 0.1})
    reference = make()
    tables = [cfg.name for cfg in _state_configs()]
    dmp = _dmp(
        make(),
        "ebc",
        {t: column_wise(ranks=[0, 1], compute_kernel=KERNEL) for t in tables},
        DynamicEmbeddingBagCollectionSharder(),
    )
    for step in range(6):
        _train_step(dmp, reference, [_rank_batch(step, r) for r in range(WORLD)], rank, step)
    _assert_shards_identical(dmp.module.ebc.local_module, "embedding_bags.", tables)
    local = dmp.module.ebc.local_module.state_dict()
    assert local["embedding_bags.t1.weight"].dtype == torch.float16 and local["embedding_bags.t1.weight"].shape[1] == 4
    whole, want_state = full_state_dict(dmp.state_dict()), reference.state_dict()
    assert_same_tables(whole, {"ebc." + k: v for k, v in want_state.items()}, "ebc.embedding_bags.")
    for t in tables:
        got, want = (
            _admission_state(whole, "ebc.embedding_bags.", t),
            _admission_state(want_state, "embedding_bags.", t),
        )
        assert got.keys() == want.keys(), t
        assert got.get("pending") == want.get("pending"), t
        if "bloom" in want:
            assert torch.equal(got["bloom"].reshape(-1), want["bloom"].reshape(-1)), t
    assert want_state["embedding_bags.t1.weight"].dtype == torch.float16
    assert _admission_state(want_state, "embedding_bags.", "t4")["pending"]  # ids still waiting: compared
    from torchrec_ext.distributed.table_stats import reduce_table_stats

    # Rows went (a full table; TTL expiries) and ids were refused admission, alike on every shard.
    got, want = reduce_table_stats(dmp.module.ebc.table_stats()), reference.table_stats()
    assert want["t1"].evictions > 0 and want["t4"].ttl_expiries > 0
    assert all(want[t].admission_rejections > 0 for t in ("t2", "t3", "t4"))
    for t in tables:
        for field in ("live_rows", "inserts", "evictions", "ttl_expiries", "admission_rejections"):
            assert getattr(got[t], field) == getattr(want[t], field), (t, field)


def test_column_shards_keep_ttl_and_admission_state_identical_and_fp16_equals_unsharded():
    run_ranks(_column_state_and_fp16, WORLD)


def _refusals(rank, world_size):
    from torchrec.distributed.sharding_plan import column_wise, data_parallel, row_wise

    from torchrec_ext.distributed import DynamicEmbeddingBagCollectionSharder

    def shard(optimizer, generators, configs=None):
        module = DynamicEmbeddingBagCollection(configs or _ebc_configs(), optimizer=optimizer)
        return _dmp(module, "ebc", generators, DynamicEmbeddingBagCollectionSharder())

    rest = {"t2": row_wise(compute_kernel=KERNEL), "t3": row_wise(compute_kernel=KERNEL)}
    with pytest.raises(
        ValueError,
        match=r"table 't1' has optimizer 'rowwise_adagrad': a row-wise optimizer state "
        r"\(rowwise_adagrad averages the squared gradient over the whole row\)",
    ):
        shard("rowwise_adagrad", {"t1": column_wise(ranks=[0, 1], compute_kernel=KERNEL), **rest})
    fp16 = [
        DynamicEmbeddingBagConfig(
            name="t1", embedding_dim=8, num_embeddings=SMALL, feature_names=["f1", "f2"], data_type=DataType.FP16
        )
    ] + _ebc_configs()[1:]  # stochastic rounding: the default
    with pytest.raises(
        ValueError,
        match=r"table 't1' .*is torch.float16 with stochastic_rounding: a shard's rounding "
        r"bits are drawn per column of the shard",
    ):
        shard("sgd", {"t1": column_wise(ranks=[0, 1], compute_kernel=KERNEL), **rest}, fp16)
    with pytest.raises(
        ValueError,
        match=r"table 't1' asks for sharding type 'data_parallel': data_parallel cannot "
        r"serve a dynamic table: each rank would insert the ids of its own batch",
    ):
        shard("sgd", {"t1": data_parallel(), **rest})
    with pytest.raises(
        ValueError,
        match=r"rank 0 holds column shards \[\(0, 4\), \(8, 4\)\] that are not adjacent; .* "
        r"list a rank.s shards together \(column_wise\(ranks=\[0, 0, 1, 1\]\)",
    ):
        shard(
            "sgd",
            {
                "t1": row_wise(compute_kernel=KERNEL),
                "t2": row_wise(compute_kernel=KERNEL),
                "t3": column_wise(ranks=[0, 1, 0, 1], compute_kernel=KERNEL),
            },
        )


def test_what_column_wise_cannot_make_exact_is_refused():
    run_ranks(_refusals, WORLD)


@pytest.mark.parametrize(
    "kind,params",
    [
        ("uniform", (-0.5, 0.5)),
        ("normal", (0.1, 0.7)),
        ("truncated_normal", (0.0, 1.0, -0.3, 0.4)),
        ("constant", (0.25,)),
    ],
)
def test_a_column_shard_draws_its_columns_of_the_whole_tables_vectors(kind, params):
    """init_rows with a first column (C++ and torch kernels) writes exactly those columns of the
    reference's whole vectors, from any column (odd ones start mid-pair)."""
    from torchrec_ext import ops, torch_kernels
    from torchrec_ext.reference.init_rows import INITIALIZERS, init_vectors

    ids = torch.tensor([0, -1, 7, 2**62, -(2**40)])
    whole = init_vectors(ids, 11, 1234, kind, params)
    # Odd first columns too (a pair split between shards), odd and even widths, up to the end.
    for first, width in ((0, 4), (4, 4), (6, 5), (10, 1), (3, 3), (1, 10), (5, 6), (7, 2), (9, 1), (3, 8)):
        for init_rows in (ops.init_rows, torch_kernels.init_rows):
            for dtype in (torch.float32, torch.bfloat16):
                table = torch.zeros(len(ids), width, dtype=dtype)
                init_rows(
                    table, torch.arange(len(ids)), ids, 1234, INITIALIZERS[kind], params + (float(first),), [], []
                )
                torch.testing.assert_close(table, whole[:, first : first + width].to(dtype), rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="first column must be an integer >= 0, got 2.5"):
        ops.init_rows(torch.zeros(1, 4), torch.tensor([0]), ids[:1], 1, INITIALIZERS[kind], params + (2.5,))
    with pytest.raises(RuntimeError, match="first column must be an integer >= 0, got -2"):
        ops.init_rows(torch.zeros(1, 4), torch.tensor([0]), ids[:1], 1, INITIALIZERS[kind], params + (-2.0,))
    with pytest.raises(ValueError, match="first_column must be an int >= 0, got -1"):
        Initializer(kind, first_column=-1)
    assert Initializer(kind, first_column=5).first_column == 5


def test_every_column_on_one_rank_is_the_table_wise_placement():
    # TorchRec's planner gives a narrow table (dim <= its column block) one column shard: the
    # table lives whole on one rank, as table_wise, and is served as such (deltas included).
    from torchrec.distributed.sharding_plan import column_wise, construct_module_sharding_plan

    from torchrec_ext.distributed import DynamicEmbeddingBagCollectionSharder
    from torchrec_ext.distributed.placement import read_plan

    module = DynamicEmbeddingBagCollection(_ebc_configs(), optimizer="sgd")
    plan = construct_module_sharding_plan(
        module,
        {
            "t1": column_wise(ranks=[1], compute_kernel=KERNEL),
            "t2": column_wise(ranks=[0, 0], compute_kernel=KERNEL),
            "t3": column_wise(ranks=[0, 1], compute_kernel=KERNEL),
        },
        sharder=DynamicEmbeddingBagCollectionSharder(),
        local_size=WORLD,
        world_size=WORLD,
        device_type="cpu",
    )
    placed = read_plan("test", module.embedding_configs(), plan, WORLD, "sgd")
    dims = {cfg.name: cfg.embedding_dim for cfg in module.embedding_configs()}
    assert (placed["t1"].kind, placed["t1"].ranks, placed["t1"].columns) == ("table", (1,), ((0, dims["t1"]),))
    assert (placed["t2"].kind, placed["t2"].ranks) == ("table", (0,))
    assert placed["t3"].kind == "column" and placed["t3"].ranks == (0, 1)
