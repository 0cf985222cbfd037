"""Half-precision rows in the dynamic modules (issue 15, items 1, 2, 5): a table's config
``data_type`` (FP32 / FP16 / BF16) sets the storage dtype of its vectors, mixed in one module;
outputs are float32; the fused update writes half rows with stochastic rounding (or to nearest
with ``stochastic_rounding=False``); checkpoints hold rows in the table's dtype and load across
dtypes with a warning; storage_bytes counts the storage dtype.

Oracle of the training test: TorchRec's dense EmbeddingBagCollection (float32) holding the same
half-valued rows, trained by the torch optimizer, each touched row then rounded by the spec's pure
function (reference.round_to_storage with reference.rounding_bits of the table's seed, id,
element and step).
"""

import warnings

import pytest
import torch
from torchrec import DataType, EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.optim import RowWiseAdagrad

from torchrec_ext import DynamicEmbeddingBagCollection, DynamicEmbeddingBagConfig, DynamicEmbeddingCollection
from torchrec_ext import reference as ref
from torchrec_ext.modules import DynamicEmbeddingConfig

FEATURES = ["f0", "f1", "f2"]
TYPES = [DataType.FP16, DataType.BF16, DataType.FP32]
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
DIM, VOCAB, BATCH, CAPACITY = 6, 40, 8, 128


def _configs(stochastic=True, types=TYPES, seed=7):
    return [
        DynamicEmbeddingBagConfig(
            name=f"t{i}",
            embedding_dim=DIM,
            num_embeddings=CAPACITY,
            feature_names=[f],
            data_type=types[i],
            stochastic_rounding=stochastic,
            seed=seed,
        )
        for i, f in enumerate(FEATURES)
    ]


def _batch(step):
    gen = torch.Generator().manual_seed(100 + step)
    lengths = torch.randint(0, 4, (len(FEATURES) * BATCH,), generator=gen)
    ids = torch.randint(0, VOCAB, (int(lengths.sum()),), generator=gen)
    return KeyedJaggedTensor.from_lengths_sync(FEATURES, ids, lengths), torch.randn(
        BATCH, len(FEATURES) * DIM, generator=gen
    )


OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": 0.3}),
    "adagrad": (torch.optim.Adagrad, {"lr": 0.2, "eps": 1e-3}),
    "rowwise_adagrad": (RowWiseAdagrad, {"lr": 0.2, "eps": 1e-3}),
}


def _dense_oracle(configs):
    """TorchRec's EBC over ids [0, VOCAB), each row the id's initial vector in its table's dtype."""
    dense = EmbeddingBagCollection(
        [
            EmbeddingBagConfig(name=c.name, embedding_dim=DIM, num_embeddings=VOCAB, feature_names=c.feature_names)
            for c in configs
        ]
    )
    with torch.no_grad():
        for cfg, dtype in zip(configs, DTYPES):
            low = -((1 / CAPACITY) ** 0.5)  # TorchRec's default uniform bounds, at the dynamic table's capacity
            vectors = ref.init_vectors(
                torch.arange(VOCAB), DIM, ref.table_seed(cfg.seed, cfg.name), "uniform", (low, -low)
            )
            dense.embedding_bags[cfg.name].weight.copy_(vectors.to(dtype).float())
    return dense


def _rows(module):
    sd = module.state_dict()
    return {
        c.name: (sd[f"embedding_bags.{c.name}.weight_id"], sd[f"embedding_bags.{c.name}.weight"])
        for c in module.embedding_bag_configs()
    }


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("stochastic", [True, False], ids=["stochastic", "nearest"])
def test_half_tables_train_as_the_dense_oracle_with_the_rounding_spec(optimizer, stochastic):
    cls, kwargs = OPTIMIZERS[optimizer]
    configs = _configs(stochastic)
    ours = DynamicEmbeddingBagCollection(configs, optimizer=cls, optimizer_kwargs=kwargs)
    dense = _dense_oracle(configs)
    dense_opt = cls(dense.parameters(), **kwargs)
    for step in range(1, 6):
        kjt, out_grad = _batch(step)
        got = ours(kjt)
        want = dense(kjt)
        assert got.values().dtype == torch.float32
        torch.testing.assert_close(got.values(), want.values(), rtol=1e-6, atol=1e-6)
        (got.values() * out_grad).sum().backward()
        dense_opt.zero_grad()
        (want.values() * out_grad).sum().backward()
        dense_opt.step()
        with torch.no_grad():  # the spec's rounding of each touched row
            for cfg, dtype, jt in zip(configs, DTYPES, [kjt[f] for f in FEATURES]):
                touched = jt.values().unique()
                w = dense.embedding_bags[cfg.name].weight
                seed = ref.rounding_seed(ref.table_seed(cfg.seed, cfg.name)) if stochastic else 0
                bits = ref.rounding_bits(touched, DIM, seed, step) if seed and dtype != torch.float32 else None
                w[touched] = ref.round_to_storage(w[touched], dtype, bits).float()
        for (name, (ids, vectors)), dtype in zip(_rows(ours).items(), DTYPES):
            assert vectors.dtype == dtype
            oracle = dense.embedding_bags[name].weight[ids].to(dtype)
            torch.testing.assert_close(
                vectors.float(),
                oracle.float(),
                rtol=1e-2 if dtype == torch.bfloat16 else 2e-3,
                atol=1e-6,
                msg=lambda m: f"step {step} {name}: {m}",
            )
            if dtype != torch.float32:  # bit for bit but where a float32 last-bit difference flips one
                assert (vectors == oracle).float().mean() > 0.97, (step, name)


def test_stochastic_rounding_differs_from_nearest_and_is_reproducible():
    runs = {}
    for name, stochastic in (("sr", True), ("sr_again", True), ("rne", False)):
        module = DynamicEmbeddingBagCollection(
            _configs(stochastic), optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.01}
        )
        for step in range(1, 4):
            kjt, out_grad = _batch(step)
            (module(kjt).values() * out_grad).sum().backward()
        runs[name] = _rows(module)
    for t in ("t0", "t1"):
        assert torch.equal(runs["sr"][t][1], runs["sr_again"][t][1])
        assert not torch.equal(runs["sr"][t][1], runs["rne"][t][1])
    assert torch.equal(runs["sr"]["t2"][1], runs["rne"]["t2"][1])  # float32: no rounding at all


def test_collection_half_rows_and_float32_output():
    configs = [
        DynamicEmbeddingConfig(
            name="e0", embedding_dim=4, num_embeddings=64, feature_names=["a"], data_type=DataType.BF16
        )
    ]
    module = DynamicEmbeddingCollection(configs, optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.5})
    kjt = KeyedJaggedTensor.from_lengths_sync(["a"], torch.tensor([3, 9, 3]), torch.tensor([2, 1]))
    out = module(kjt)["a"].values()
    assert out.dtype == torch.float32
    sd = module.state_dict()
    assert sd["embeddings.e0.weight"].dtype == torch.bfloat16
    vectors = dict(zip(sd["embeddings.e0.weight_id"].tolist(), sd["embeddings.e0.weight"]))
    assert torch.equal(out[0], vectors[3].float()) and torch.equal(out[1], vectors[9].float())
    out.sum().backward()
    after_sd = module.state_dict()
    after = dict(zip(after_sd["embeddings.e0.weight_id"].tolist(), after_sd["embeddings.e0.weight"]))
    assert not torch.equal(after[3], vectors[3]) and after[3].dtype == torch.bfloat16


# ------------------------------------------------------------------------- checkpoints


def _trained(configs, steps=3):
    module = DynamicEmbeddingBagCollection(configs, optimizer=torch.optim.Adagrad, optimizer_kwargs={"lr": 0.1})
    for step in range(1, steps + 1):
        kjt, out_grad = _batch(step)
        (module(kjt).values() * out_grad).sum().backward()
    return module


def test_state_dict_holds_rows_in_their_dtype_and_round_trips_bit_for_bit():
    a = _trained(_configs())
    sd = a.state_dict()
    for i, dtype in enumerate(DTYPES):
        assert sd[f"embedding_bags.t{i}.weight"].dtype == dtype
        assert sd[f"embedding_bags.t{i}.optimizer.momentum1"].dtype == torch.float32
    b = DynamicEmbeddingBagCollection(_configs(), optimizer=torch.optim.Adagrad, optimizer_kwargs={"lr": 0.1})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # same dtypes: no conversion warning
        b.load_state_dict(sd)
    for key, value in b.state_dict().items():
        assert torch.equal(value, sd[key]), key
    # and training goes on identically (the rounding bits are a function of seed, id, element, step)
    for module in (a, b):
        kjt, out_grad = _batch(9)
        (module(kjt).values() * out_grad).sum().backward()
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert ka == kb and torch.equal(va, vb), ka


def test_loading_another_dtype_converts_with_a_warning():
    fp32 = _trained(_configs(types=[DataType.FP32] * 3))
    sd = fp32.state_dict()
    half = DynamicEmbeddingBagCollection(_configs(), optimizer=torch.optim.Adagrad, optimizer_kwargs={"lr": 0.1})
    with pytest.warns(UserWarning, match=r"table 't0'.* weight is torch.float32, the table stores torch.float16"):
        half.load_state_dict(sd)
    got = half.state_dict()
    for i, dtype in enumerate(DTYPES):
        assert got[f"embedding_bags.t{i}.weight"].dtype == dtype
        assert torch.equal(got[f"embedding_bags.t{i}.weight"], sd[f"embedding_bags.t{i}.weight"].to(dtype))
        assert torch.equal(
            got[f"embedding_bags.t{i}.optimizer.momentum1"], sd[f"embedding_bags.t{i}.optimizer.momentum1"]
        )
    # and back: half rows into float32 tables, exactly
    back = DynamicEmbeddingBagCollection(
        _configs(types=[DataType.FP32] * 3), optimizer=torch.optim.Adagrad, optimizer_kwargs={"lr": 0.1}
    )
    with pytest.warns(UserWarning, match="torch.bfloat16, the table stores torch.float32"):
        back.load_state_dict(got)
    for i in range(3):
        assert torch.equal(back.state_dict()[f"embedding_bags.t{i}.weight"], got[f"embedding_bags.t{i}.weight"].float())


def test_loading_values_beyond_the_half_range_is_refused_and_changes_nothing():
    fp32 = _trained(_configs(types=[DataType.FP32] * 3))
    sd = fp32.state_dict()
    sd["embedding_bags.t1.weight"] = sd["embedding_bags.t1.weight"].clone()
    sd["embedding_bags.t1.weight"][2, 3] = 1e6  # fine in bfloat16
    sd["embedding_bags.t0.weight"] = sd["embedding_bags.t0.weight"].clone()
    sd["embedding_bags.t0.weight"][1, 0] = 1e6  # beyond float16's 65504
    half = _trained(_configs(), steps=1)
    before = half.state_dict()
    with pytest.raises(
        ValueError,
        match=r"table 't0'.* weight holds 1000000.0 at \[1, 0\] .*beyond the range of "
        r"the table's data_type \(torch.float16\)",
    ):
        half.load_state_dict(sd)
    for key, value in half.state_dict().items():
        assert torch.equal(value, before[key]), key


# Finite values at the edges of each dtype: the largest, ones whose float32 sum overflows (a table's
# rows near 3e38), the smallest normals and subnormals, signed zeros.
_EDGES = {
    torch.float16: [65504.0, -65504.0, 65519.0, 6.1e-5, 6e-8, 2.0**-24, 2.0**-25 * 1.5, -0.0, 1e-30],
    torch.bfloat16: [torch.finfo(torch.bfloat16).max, 3.0e38, -3.0e38, 1.7e38, 1.2e-38, 1e-39, 9.2e-41, -0.0],
    torch.float32: [torch.finfo(torch.float32).max, 3.3e38, -3.3e38, 1.2e-38, 1e-45, -0.0],
}


def _with_edges(weight, values):
    """``weight`` with its first rows holding ``values`` (row by row, cycled over the columns)."""
    weight = weight.clone()
    flat = weight.view(-1)
    flat[: len(values)] = torch.tensor(values, dtype=torch.float64).to(weight.dtype)
    flat[len(values) : 2 * len(values)] = torch.tensor(values, dtype=torch.float64).to(weight.dtype)
    return weight


@pytest.mark.parametrize("source", [torch.float32, torch.bfloat16, torch.float16])
def test_loading_values_at_the_edges_of_the_range_converts_as_torch_does(source):
    """Rows converted as ``Tensor.to`` converts them (to nearest even, subnormals kept), including
    finite values near the largest float32 / bfloat16 whose sum overflows float32 (which was refused
    with an IndexError); the value that does not fit the table's dtype is refused, naming it."""
    a = _trained(_configs(types=[DataType.FP32] * 3))
    sd = {k: (v.to(source) if k.endswith(".weight") else v) for k, v in a.state_dict().items()}
    for i, dtype in enumerate(DTYPES):
        fits = [v for v in _EDGES[source] if torch.isfinite(torch.tensor(v, dtype=torch.float64).to(source).to(dtype))]
        sd[f"embedding_bags.t{i}.weight"] = _with_edges(sd[f"embedding_bags.t{i}.weight"], fits)
    half = DynamicEmbeddingBagCollection(_configs(), optimizer=torch.optim.Adagrad, optimizer_kwargs={"lr": 0.1})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the conversion's (tested above)
        half.load_state_dict(sd)
    got = half.state_dict()
    for i, dtype in enumerate(DTYPES):
        want = sd[f"embedding_bags.t{i}.weight"].to(dtype)
        assert torch.equal(got[f"embedding_bags.t{i}.weight"].view(torch.int16 if dtype.itemsize == 2 else torch.int32),
                           want.view(torch.int16 if dtype.itemsize == 2 else torch.int32)), dtype  # fmt: skip
    # the largest float32 into a bfloat16 table, 65520 (rounds to inf) into a float16 one: refused
    for i, too_big in ((1, torch.finfo(torch.float32).max), (0, 65520.0)):
        if source == torch.float16 and i == 0:
            continue  # every float16 fits a float16 table
        bad = dict(sd)
        bad[f"embedding_bags.t{i}.weight"] = sd[f"embedding_bags.t{i}.weight"].clone()
        bad[f"embedding_bags.t{i}.weight"][3, 2] = too_big
        if not torch.isfinite(bad[f"embedding_bags.t{i}.weight"][3, 2]):
            continue  # beyond the source dtype itself
        before = half.state_dict()
        with pytest.raises(ValueError, match=rf"table 't{i}'.* weight holds .* at \[3, 2\] .*beyond the range"):
            half.load_state_dict(bad)
        for key, value in half.state_dict().items():
            assert torch.equal(value, before[key]), key


def test_fallback_rows_near_the_largest_bfloat16_load():
    """A bfloat16 table's fallback rows near its largest value (their float32 sum overflows) load
    as they are; a NaN among them is refused."""
    configs = [
        DynamicEmbeddingBagConfig(
            name="t", embedding_dim=4, num_embeddings=64, feature_names=["f"], data_type=DataType.BF16, fallback_rows=2
        )
    ]
    module = DynamicEmbeddingBagCollection(configs)
    sd = module.state_dict()
    fallback = torch.full((2, 4), 3.0e38, dtype=torch.bfloat16)
    fallback[1] = -torch.finfo(torch.bfloat16).max
    sd["embedding_bags.t.fallback_weight"] = fallback
    module.load_state_dict(sd)
    assert torch.equal(module.state_dict()["embedding_bags.t.fallback_weight"], fallback)
    fallback = fallback.clone()
    fallback[0, 1] = float("nan")
    sd["embedding_bags.t.fallback_weight"] = fallback
    with pytest.raises(ValueError, match="fallback_weight"):
        module.load_state_dict(sd)


def test_meta_module_state_has_the_storage_dtype():
    module = DynamicEmbeddingBagCollection(_configs(), device=torch.device("meta"))
    sd = module.state_dict()
    for i, dtype in enumerate(DTYPES):
        assert sd[f"embedding_bags.t{i}.weight"].dtype == dtype
        assert module.embedding_bags[f"t{i}"].weight.dtype == dtype


# ---------------------------------------------------------------------------- storage


def test_storage_bytes_counts_the_storage_dtype():
    def bytes_of(types, optimizer):
        configs = [
            DynamicEmbeddingBagConfig(
                name=f"t{i}", embedding_dim=64, num_embeddings=1024, feature_names=[f"f{i}"], data_type=t
            )
            for i, t in enumerate(types)
        ]
        return DynamicEmbeddingBagCollection(configs, optimizer=optimizer, optimizer_kwargs={"lr": 0.1}).storage_bytes()

    fp32 = bytes_of([DataType.FP32] * 2, RowWiseAdagrad)
    fp16 = bytes_of([DataType.FP16] * 2, RowWiseAdagrad)
    mixed = bytes_of([DataType.BF16, DataType.FP32], RowWiseAdagrad)
    assert fp32 - fp16 == 2 * 1024 * 64 * 2  # 2 bytes less per element
    assert fp32 - mixed == 1024 * 64 * 2
    assert fp16 / fp32 <= 0.55
    assert bytes_of([DataType.FP32], torch.optim.Adam) - bytes_of([DataType.FP16], torch.optim.Adam) == 1024 * 64 * 2


# ------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("data_type", [DataType.INT8, DataType.INT4, DataType.INT2, DataType.UINT8])
def test_unsupported_data_type_is_a_clear_error(data_type):
    configs = _configs()
    configs[1].data_type = data_type
    with pytest.raises(
        ValueError,
        match=rf"table 't1' data_type must be one of \['FP32', 'FP16', 'BF16'\] .*"
        rf"got {data_type}",
    ):
        DynamicEmbeddingBagCollection(configs)


def test_bad_stochastic_rounding_is_a_clear_error():
    with pytest.raises(TypeError, match="stochastic_rounding must be a bool, got 'yes'"):
        DynamicEmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=8, stochastic_rounding="yes")


# --------------------------------------------------------------- sharded: fused_params


def _sharded_rows_with(rank, world_size, fused_params, configs_stochastic, out_path):
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
    from torchrec.distributed.types import ShardingEnv, ShardingPlan

    from dist_helpers import ModelWith
    from torchrec_ext.distributed import DynamicEmbeddingBagCollectionSharder

    model = ModelWith("ebc", DynamicEmbeddingBagCollection(_configs(configs_stochastic)))
    sharder = DynamicEmbeddingBagCollectionSharder(fused_params=fused_params)
    plan = construct_module_sharding_plan(
        model.ebc,
        {
            "t0": row_wise(compute_kernel="customized_kernel"),
            "t1": table_wise(rank=0, compute_kernel="customized_kernel"),
            "t2": table_wise(rank=0, compute_kernel="customized_kernel"),
        },
        sharder=sharder,
        local_size=world_size,
        world_size=world_size,
        device_type="cpu",
    )
    dmp = DistributedModelParallel(
        model,
        env=ShardingEnv.from_process_group(torch.distributed.group.WORLD),
        device=torch.device("cpu"),
        plan=ShardingPlan({"ebc": plan}),
        sharders=[sharder],
    )
    for step in range(1, 4):
        kjt, out_grad = _batch(step)
        (dmp(kjt).values() * out_grad).sum().backward()
    torch.save(_rows(dmp.module.ebc.local_module), out_path)


@pytest.mark.parametrize("fused", [False, True])
def test_sharder_fused_params_stochastic_rounding_wins_over_the_configs(tmp_path, fused):
    """One rank: a sharder's fused_params={"stochastic_rounding": x} trains the tables as an
    unsharded module whose configs say x (the configs themselves saying the opposite)."""
    from dist_helpers import run_ranks

    out = str(tmp_path / "rows.pt")
    run_ranks(
        _sharded_rows_with,
        1,
        {"optimizer": "EXACT_SGD", "learning_rate": 0.3, "stochastic_rounding": fused},
        not fused,
        out,
    )
    sharded = torch.load(out)
    unsharded = DynamicEmbeddingBagCollection(_configs(fused), optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.3})
    for step in range(1, 4):
        kjt, out_grad = _batch(step)
        (unsharded(kjt).values() * out_grad).sum().backward()
    for name, (ids, vectors) in _rows(unsharded).items():
        got = dict(zip(sharded[name][0].tolist(), sharded[name][1]))
        assert set(got) == set(ids.tolist())
        assert torch.equal(torch.stack([got[i] for i in ids.tolist()]), vectors), name


def test_half_precision_dim_one_tables_are_refused():
    """A 2-byte row is as small as the word padding after an odd number of rows, so the kernels
    could not size the table from its words: refused by name (FP32 dim-1 tables are fine)."""
    from torchrec.modules.embedding_configs import DataType

    from torchrec_ext import DynamicEmbeddingBagCollection, DynamicEmbeddingBagConfig

    for data_type in (DataType.FP16, DataType.BF16):
        with pytest.raises(ValueError, match=r"table 'w' data_type .* needs embedding_dim >= 2.*got embedding_dim 1"):
            DynamicEmbeddingBagCollection(
                [
                    DynamicEmbeddingBagConfig(
                        name="w", embedding_dim=1, num_embeddings=33, feature_names=["f"], data_type=data_type
                    )
                ]
            )
    DynamicEmbeddingBagCollection(
        [DynamicEmbeddingBagConfig(name="w", embedding_dim=1, num_embeddings=33, feature_names=["f"])]
    )
