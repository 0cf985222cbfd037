"""Drop-in details of the dynamic modules against TorchRec 1.8's own EBC / EC (issue 14,
items 3, 6, 10): KJT keys and weights a module does not read are ignored, ``tables=[]`` builds
an empty module, the standard torch.nn.init init_fns are honoured id by id, and the
constructors take every argument TorchRec's take.
"""

import inspect
from functools import partial

import pytest
import torch
import torch.distributed as dist
from torchrec import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    KeyedJaggedTensor,
    PoolingType,
)

from modules_helpers import copied_ebc, copied_ec, feature_tables, remap_kjt
from torchrec_ext import (
    DynamicEmbeddingBagCollection,
    DynamicEmbeddingBagConfig,
    DynamicEmbeddingCollection,
    DynamicEmbeddingConfig,
)
from torchrec_ext.reference import init_vectors, table_seed

EXTRA = ["x", "y"]  # keys of another module sharing the KJT


def _kjt(keys, batch_size, weighted, seed):
    """A KJT over ``keys`` (any order) with ids from a small pool, so lookups repeat ids."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (len(keys) * batch_size,), generator=g)
    n = int(lengths.sum())
    values = torch.randint(-50, 50, (n,), generator=g) * 1_000_003
    return KeyedJaggedTensor(
        keys=list(keys),
        values=values,
        lengths=lengths,
        stride=batch_size,
        weights=torch.rand(n, generator=g) if weighted else None,
    )


def _shuffled(keys, seed):
    order = torch.randperm(len(keys), generator=torch.Generator().manual_seed(seed)).tolist()
    return [keys[i] for i in order]


def _torchrec_kjt(kjt, module_configs, maps):
    """``kjt`` with the ids of the module's features as row indices of the copied TorchRec module
    (keys the module does not read keep ids that index nothing: TorchRec must not read them)."""
    tables = {f: ts[0] for f, ts in feature_tables(module_configs).items()}
    tables.update({k: "<unread>" for k in kjt.keys() if k not in tables})
    return remap_kjt(kjt, tables, {**maps, "<unread>": {}})


# ---------------------------------------------------------------------------- item 3: keys


def _bag_tables(pooling):
    return [
        DynamicEmbeddingBagConfig(
            name="t1", embedding_dim=4, num_embeddings=256, feature_names=["f1", "f2"], pooling=pooling
        ),
        DynamicEmbeddingBagConfig(
            name="t2", embedding_dim=8, num_embeddings=256, feature_names=["f3"], pooling=pooling
        ),
    ]


@pytest.mark.parametrize("pooling", [PoolingType.SUM, PoolingType.MEAN])
@pytest.mark.parametrize("module_weighted", [False, True], ids=["unweighted_module", "weighted_module"])
@pytest.mark.parametrize("kjt_weighted", [False, True], ids=["unweighted_kjt", "weighted_kjt"])
def test_ebc_ignores_keys_it_does_not_read(pooling, module_weighted, kjt_weighted):
    if module_weighted and not kjt_weighted:
        pytest.skip("a weighted module needs weights (TorchRec asserts so too)")
    if module_weighted and pooling == PoolingType.MEAN:
        pytest.skip("TorchRec's EBC has no weighted mean pooling to compare with")
    ours = DynamicEmbeddingBagCollection(_bag_tables(pooling), is_weighted=module_weighted, optimizer="sgd")
    read = ["f1", "f2", "f3"]
    for step in range(3):  # training: rows for the ids, extra keys' ids inserted nowhere
        kjt = _kjt(_shuffled(read + EXTRA, step), 5, kjt_weighted, step)
        ours(kjt).values().sum().backward()
    ours.eval()
    theirs, maps = copied_ebc(ours)
    for step in range(3, 6):
        kjt = _kjt(_shuffled(read + EXTRA, step), 5, kjt_weighted, step)
        got, want = ours(kjt), theirs(_torchrec_kjt(kjt, ours.embedding_bag_configs(), maps))
        assert got.keys() == want.keys() == ["f1", "f2", "f3"]
        assert got.length_per_key() == want.length_per_key()
        torch.testing.assert_close(got.values(), want.values())
    # No table holds an id of the extra keys only: the same rows as training on the read keys alone.
    assert ours.num_live_rows() == sum(len(m) for m in maps.values())


@pytest.mark.parametrize("kjt_weighted", [False, True], ids=["unweighted_kjt", "weighted_kjt"])
def test_ec_ignores_keys_and_weights_it_does_not_read(kjt_weighted):
    tables = [
        DynamicEmbeddingConfig(name="t1", embedding_dim=4, num_embeddings=256, feature_names=["f1", "f2"]),
        DynamicEmbeddingConfig(name="t2", embedding_dim=4, num_embeddings=256, feature_names=["f3"]),
    ]
    ours = DynamicEmbeddingCollection(tables, need_indices=True, optimizer="sgd")
    for step in range(3):
        kjt = _kjt(_shuffled(["f1", "f2", "f3"] + EXTRA, step), 4, kjt_weighted, step)
        torch.cat([jt.values() for jt in ours(kjt).values()]).sum().backward()
    ours.eval()
    theirs, maps = copied_ec(ours)
    for step in range(3, 6):
        kjt = _kjt(_shuffled(["f1", "f2", "f3"] + EXTRA, step), 4, kjt_weighted, step)
        got, want = ours(kjt), theirs(_torchrec_kjt(kjt, ours.embedding_configs(), maps))
        assert list(got) == list(want) == ["f1", "f2", "f3"]
        jts = kjt.to_dict()
        for name, jt in want.items():
            torch.testing.assert_close(got[name].values(), jt.values())
            assert torch.equal(got[name].lengths(), jt.lengths())
            assert torch.equal(got[name].weights(), jts[name].values())  # need_indices: the raw ids


def test_duplicated_key_still_refused():
    ours = DynamicEmbeddingBagCollection(_bag_tables(PoolingType.SUM))
    kjt = KeyedJaggedTensor(
        keys=["f1", "f2", "f3", "x", "x"], values=torch.arange(5), lengths=torch.ones(5, dtype=torch.int64)
    )
    with pytest.raises(ValueError, match=r"KJT keys must be distinct, got \['x'\] more than once"):
        ours(kjt)


def test_empty_modules_like_torchrec():
    kjt = KeyedJaggedTensor(keys=["f"], values=torch.tensor([1, 2, 3]), lengths=torch.tensor([2, 1]))
    ec, their_ec = DynamicEmbeddingCollection(tables=[]), EmbeddingCollection(tables=[])
    assert ec(kjt) == their_ec(kjt) == {}
    assert ec.embedding_dim() == their_ec.embedding_dim() == -1
    assert ec.embedding_names_by_table() == their_ec.embedding_names_by_table() == []
    ebc, their_ebc = DynamicEmbeddingBagCollection(tables=[]), EmbeddingBagCollection(tables=[])
    for ours, theirs in ((ebc, their_ebc), (ec, their_ec)):
        assert list(ours.state_dict()) == list(theirs.state_dict()) == []
        assert list(ours.parameters()) == list(theirs.parameters()) == []
    # TorchRec's empty EBC fails in forward (torch.cat of no pooled output); ours gives the
    # empty pooled output that a non-empty one's shape rule implies: [batch_size, 0], no keys.
    with pytest.raises(ValueError, match="torch.cat"):
        their_ebc(kjt)
    pooled = ebc(kjt)
    assert pooled.keys() == [] and pooled.length_per_key() == []
    assert pooled.values().shape == (2, 0) and pooled.values().dtype == torch.float32


@pytest.mark.parametrize("sharding", ["table_wise", "row_wise"])
@pytest.mark.parametrize("bag", [True, False], ids=["ebc", "ec"])
def test_sharded_input_dist_ignores_keys_it_does_not_read(one_rank_group, bag, sharding):
    """The sharded modules check their input with the unsharded modules' check: what they
    send is that of the KJT without the extra keys (and, unweighted, without weights)."""
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
    from torchrec.distributed.types import ShardingEnv

    from torchrec_ext.distributed import DynamicEmbeddingBagCollectionSharder, DynamicEmbeddingCollectionSharder

    if bag:
        module = DynamicEmbeddingBagCollection(_bag_tables(PoolingType.SUM), optimizer="sgd")
        sharder = DynamicEmbeddingBagCollectionSharder()
    else:
        module = DynamicEmbeddingCollection(
            [DynamicEmbeddingConfig(name="t1", embedding_dim=4, num_embeddings=64, feature_names=["f1", "f2", "f3"])],
            optimizer="sgd",
        )
        sharder = DynamicEmbeddingCollectionSharder()
    spec = table_wise(rank=0) if sharding == "table_wise" else row_wise()
    plan = construct_module_sharding_plan(
        module,
        per_param_sharding={
            t.name: spec for t in (module.embedding_bag_configs() if bag else module.embedding_configs())
        },
        sharder=sharder,
        world_size=1,
        local_size=1,
        device_type="cpu",
    )
    sharded = sharder.shard(module, plan, ShardingEnv.from_process_group(dist.group.WORLD), torch.device("cpu"))
    full = _kjt(["y", "f3", "f1", "x", "f2"], 3, True, 0)
    jts = full.to_dict()
    read = KeyedJaggedTensor.from_jt_dict({k: jts[k] for k in ["f1", "f2", "f3"]})

    def sent(kjt):
        received = sharded.input_dist(sharded.create_context(), kjt).wait().wait()[0]
        return received.keys(), received.values(), received.lengths(), received.weights_or_none()

    got, want = sent(full), sent(KeyedJaggedTensor(keys=read.keys(), values=read.values(), lengths=read.lengths()))
    assert got[0] == want[0]
    for a, b in zip(got[1:], want[1:]):
        assert (a is None and b is None) or torch.equal(a, b)


# ---------------------------------------------------------------------------- item 6: init_fn

NUM_IDS, DIM = 4000, 16
IDS = torch.arange(NUM_IDS, dtype=torch.int64) * 7919 - 10**12  # raw ids, negative and positive

INIT_FNS = {
    "uniform": (partial(torch.nn.init.uniform_, a=-0.3, b=0.7), "uniform", (-0.3, 0.7)),
    "uniform torch defaults": (partial(torch.nn.init.uniform_), "uniform", (0.0, 1.0)),
    "uniform one bound": (partial(torch.nn.init.uniform_, b=0.5), "uniform", (0.0, 0.5)),
    "normal": (partial(torch.nn.init.normal_, mean=0.25, std=0.05), "normal", (0.25, 0.05)),
    "normal bare": (torch.nn.init.normal_, "normal", (0.0, 1.0)),
    "trunc_normal": (
        partial(torch.nn.init.trunc_normal_, mean=0.1, std=0.5, a=-0.2, b=0.6),
        "truncated_normal",
        (0.1, 0.5, -0.2, 0.6),
    ),
    "trunc_normal torch bounds": (
        partial(torch.nn.init.trunc_normal_, std=3.0),
        "truncated_normal",
        (0.0, 3.0, -2.0, 2.0),
    ),  # a, b are absolute: not mean -+ 2 std
    "constant": (partial(torch.nn.init.constant_, val=0.125), "constant", (0.125,)),
}


def _initial_vectors(init_fn, bag=True, name="t", seed=None, ids=IDS):
    """The vectors a fresh module gives ``ids`` on their first (training) lookup."""
    if bag:
        config_type = EmbeddingBagConfig if seed is None else partial(DynamicEmbeddingBagConfig, seed=seed)
        cfg = config_type(
            name=name, embedding_dim=DIM, num_embeddings=2 * NUM_IDS, feature_names=["f"], init_fn=init_fn
        )
        module = DynamicEmbeddingBagCollection([cfg], is_weighted=False)
    else:
        config_type = EmbeddingConfig if seed is None else partial(DynamicEmbeddingConfig, seed=seed)
        cfg = config_type(
            name=name, embedding_dim=DIM, num_embeddings=2 * NUM_IDS, feature_names=["f"], init_fn=init_fn
        )
        module = DynamicEmbeddingCollection([cfg])
    kjt = KeyedJaggedTensor(keys=["f"], values=ids, lengths=torch.ones(ids.numel(), dtype=torch.int64))
    with torch.no_grad():
        out = module(kjt)
    return out.values() if bag else out["f"].values()


def _torch_draws(init_fn):
    """torch's own draws with the same init_fn: the distribution asked for."""
    torch.manual_seed(0)
    w = torch.empty(NUM_IDS, DIM)
    init_fn(w)
    return w


@pytest.mark.parametrize("bag", [True, False], ids=["ebc", "ec"])
@pytest.mark.parametrize("case", list(INIT_FNS))
def test_init_fn_distribution(case, bag):
    init_fn, kind, params = INIT_FNS[case]
    got = _initial_vectors(init_fn, bag)
    assert got.shape == (NUM_IDS, DIM)
    theirs = _torch_draws(init_fn)
    if kind == "constant":
        assert torch.equal(got, theirs)
        return
    if kind in ("uniform", "truncated_normal"):
        low, high = params[-2:]
        assert float(got.min()) >= low and float(got.max()) <= high
    # Mean and std within 6 standard errors of torch's own sample of the same size.
    n = got.numel()
    spread = float(theirs.std())
    assert abs(float(got.mean()) - float(theirs.mean())) < 6 * spread * (2 / n) ** 0.5
    assert abs(float(got.std()) - spread) < 6 * spread * (1 / n) ** 0.5 * 1.5
    # Each id's vector is the reference's draw for (seed, table, id) with these parameters.
    torch.testing.assert_close(got, init_vectors(IDS, DIM, table_seed(0, "t"), kind, params), rtol=0, atol=0)


@pytest.mark.parametrize("case", ["uniform", "normal", "trunc_normal"])
def test_init_fn_pure_function_of_seed_table_id(case):
    init_fn = INIT_FNS[case][0]
    first = _initial_vectors(init_fn)
    # Another module, the ids in another order and in a batch with other ids: the same vectors.
    perm = torch.randperm(NUM_IDS, generator=torch.Generator().manual_seed(1))
    again = _initial_vectors(init_fn, ids=torch.cat([IDS[perm], IDS[:0] + 123456789]))
    torch.testing.assert_close(again[:NUM_IDS], first[perm], rtol=0, atol=0)
    assert torch.equal(_initial_vectors(init_fn, seed=0), first)  # seed 0 is the default
    assert not torch.equal(_initial_vectors(init_fn, seed=1), first)
    assert not torch.equal(_initial_vectors(init_fn, name="u"), first)


def test_init_fn_refused_lists_the_accepted():
    cfg = EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=8, init_fn=torch.nn.init.orthogonal_)
    with pytest.raises(
        ValueError,
        match=r"table 't': init_fn <function orthogonal_ .* cannot initialise rows id by "
        r"id; an init_fn must be torch.nn.init.uniform_, normal_, trunc_normal_ or "
        r"constant_, or a functools.partial of one",
    ):
        DynamicEmbeddingBagCollection([cfg])


# ---------------------------------------------------------------------------- item 10: constructor arguments


def _parameters(cls):
    return list(inspect.signature(cls.__init__).parameters.values())[1:]  # without self


# The constructor arguments TorchRec added after 1.6, the oldest TorchRec supported.
TORCHREC_ADDED_SINCE_1_6 = {EmbeddingBagCollection: [], EmbeddingCollection: ["use_gather_select_per_sharding"]}


@pytest.mark.parametrize(
    "ours,theirs",
    [(DynamicEmbeddingBagCollection, EmbeddingBagCollection), (DynamicEmbeddingCollection, EmbeddingCollection)],
    ids=["ebc", "ec"],
)
def test_constructor_takes_torchrec_arguments(ours, theirs):
    """Every argument of TorchRec's constructor, in its position, with its default; ours then
    adds optimizer / optimizer_kwargs / per_rank_tables. A new TorchRec argument fails here.
    (Against an older TorchRec, ours also takes the arguments TorchRec added since, before ours:
    EmbeddingCollection's use_gather_select_per_sharding came in 1.7.)"""
    their_params, our_params = _parameters(theirs), _parameters(ours)
    assert [(p.name, p.kind, p.default) for p in our_params[: len(their_params)]] == [
        (p.name, p.kind, p.default) for p in their_params
    ]
    added_since = [n for n in TORCHREC_ADDED_SINCE_1_6[theirs] if n not in {p.name for p in their_params}]
    assert [p.name for p in our_params[len(their_params) :]] == [
        *added_since,
        "optimizer",
        "optimizer_kwargs",
        "per_rank_tables",
    ]

    bag = ours is DynamicEmbeddingBagCollection
    config = (EmbeddingBagConfig if bag else EmbeddingConfig)(
        name="t", embedding_dim=4, num_embeddings=32, feature_names=["f"]
    )
    # Non-default values where TorchRec has them (the hints are kept, as TorchRec's getters show).
    chosen = {
        "tables": [config],
        "device": torch.device("cpu"),
        "is_weighted": True,
        "need_indices": True,
        "use_gather_select": True,
        "use_gather_select_per_sharding": {"row_wise": True},
    }
    kwargs = {p.name: chosen.get(p.name, p.default) for p in their_params}
    module, reference = ours(**kwargs), theirs(**kwargs)
    for getter in (
        "is_weighted",
        "need_indices",
        "use_gather_select",
        "use_gather_select_per_sharding",
        "embedding_dim",
        "embedding_names_by_table",
    ):
        if hasattr(reference, getter):
            assert getattr(module, getter)() == getattr(reference, getter)(), getter
    assert module.device == reference.device

    # The gather hints change nothing: the same output as a module built without them.
    kjt = KeyedJaggedTensor(
        keys=["f"], values=torch.tensor([5, 6, 7]), lengths=torch.tensor([2, 1]), weights=torch.tensor([1.0, 2.0, 3.0])
    )
    plain = ours(**{k: v for k, v in kwargs.items() if not k.startswith("use_gather_select")})
    with torch.no_grad():  # training lookups: the rows are the ids' initial vectors
        got, want = module(kjt), plain(kjt)
    if bag:
        torch.testing.assert_close(got.values(), want.values())
    else:
        assert list(got) == list(want)
        torch.testing.assert_close(got["f"].values(), want["f"].values())
