"""DynamicEmbeddingBagCollection against TorchRec's EmbeddingBagCollection holding copies of
our rows, a brute-force pooling oracle, and torch's optimizers on a dense EBC."""

import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, PoolingType
from torchrec.optim import RowWiseAdagrad, apply_optimizer_in_backward

from modules_helpers import brute_force_pooled, copied_ebc, live_rows, random_kjt, remap_kjt
from torchrec_ext import DynamicEmbeddingBagCollection, DynamicEmbeddingBagConfig, Initializer
from torchrec_ext import reference as ref
from torchrec_ext.modules import Ftrl

IDS = torch.tensor([0, -1, 2**63 - 1, -(2**63), 7, 2**40 + 3, 12345678901, -42, 99, 5, 6, 8])


def _configs(pooling=PoolingType.SUM, shared=False):
    return [
        DynamicEmbeddingBagConfig(
            name="t1", embedding_dim=8, num_embeddings=256, feature_names=["f1", "f2"], pooling=pooling
        ),
        EmbeddingBagConfig(
            name="t2",
            embedding_dim=12,
            num_embeddings=64,
            feature_names=["f3"] + (["f1"] if shared else []),
            pooling=pooling,
        ),
    ]


def _train_once(module, kjt):
    module(kjt).values().sum().backward()


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("pooling", [PoolingType.SUM, PoolingType.MEAN])
def test_forward_equals_torchrec_ebc_with_copied_rows(weighted, pooling):
    module = DynamicEmbeddingBagCollection(
        _configs(pooling), is_weighted=weighted, optimizer="adagrad", optimizer_kwargs={"lr": 0.1}
    )
    for _ in range(3):
        _train_once(module, random_kjt(["f1", "f2", "f3"], 5, IDS, weighted=weighted))
    module.eval()
    kjt = random_kjt(["f1", "f2", "f3"], 7, torch.cat([IDS, torch.tensor([31337, -7])]), weighted=weighted)
    ours = module(kjt)
    if weighted and pooling == PoolingType.MEAN:  # torch's EmbeddingBag has no weighted mean
        want = brute_force_pooled(module, kjt)
        for key in ours.keys():
            torch.testing.assert_close(ours[key], want[key])
        return
    ebc, maps = copied_ebc(module)
    theirs = ebc(remap_kjt(kjt, {"f1": "t1", "f2": "t1", "f3": "t2"}, maps))
    assert ours.keys() == theirs.keys() and ours.length_per_key() == theirs.length_per_key()
    torch.testing.assert_close(ours.values(), theirs.values())


def test_shared_feature_naming_order_and_permuted_kjt_keys():
    module = DynamicEmbeddingBagCollection(
        _configs(PoolingType.MEAN, shared=True), optimizer="sgd", optimizer_kwargs={"lr": 0.5}
    )
    _train_once(module, random_kjt(["f3", "f1", "f2"], 6, IDS))
    kjt = random_kjt(["f2", "f3", "f1"], 4, IDS)
    out = module(kjt)
    assert out.keys() == ["f1@t1", "f2", "f3", "f1@t2"]
    assert out.values().shape == (4, 8 + 8 + 12 + 12)
    want = brute_force_pooled(module, kjt)
    for key in out.keys():
        torch.testing.assert_close(out[key], want[key])


def test_empty_bags_and_empty_batch():
    module = DynamicEmbeddingBagCollection(_configs(), optimizer="sgd")
    kjt = KeyedJaggedTensor(
        keys=["f1", "f2", "f3"], values=torch.tensor([5, 6]), lengths=torch.tensor([0, 2, 0, 0, 0, 0])
    )
    out = module(kjt).values()
    assert torch.all(out[0, :8] == 0) and torch.all(out[:, 8:] == 0)  # empty bags pool to zeros
    assert out[1, :8].abs().sum() > 0
    empty = KeyedJaggedTensor(
        keys=["f1", "f2", "f3"],
        values=torch.zeros(0, dtype=torch.int64),
        lengths=torch.zeros(0, dtype=torch.int64),
        stride=0,
    )
    out = module(empty)
    assert out.values().shape == (0, 28)
    out.values().sum().backward()


def test_eval_never_inserts_and_unseen_ids_are_zeros():
    module = DynamicEmbeddingBagCollection(_configs(), optimizer="sgd")
    _train_once(
        module,
        KeyedJaggedTensor(keys=["f1", "f2", "f3"], values=torch.tensor([1, 2, 3]), lengths=torch.tensor([1, 1, 1])),
    )
    live = module.num_live_rows()
    module.eval()
    out = module(
        KeyedJaggedTensor(
            keys=["f1", "f2", "f3"], values=torch.tensor([1, 77, 3, 88]), lengths=torch.tensor([2, 0, 0, 0, 2, 0])
        )
    )
    assert module.num_live_rows() == live
    trained = dict(
        zip(live_rows(module, "embedding_bags")["t1"][0].tolist(), live_rows(module, "embedding_bags")["t1"][1])
    )
    torch.testing.assert_close(out.values()[0, :8], trained[1])  # 77 contributes zeros
    torch.testing.assert_close(out.values()[1, :8], torch.zeros(8))


def test_initial_vectors_are_a_function_of_seed_table_and_id():
    cfg = lambda seed: [
        DynamicEmbeddingBagConfig(
            name="t",
            embedding_dim=16,
            num_embeddings=512,
            feature_names=["f"],
            seed=seed,
            initializer=Initializer("normal", std=0.1),
        )
    ]
    a, b, c = (DynamicEmbeddingBagCollection(cfg(s), optimizer="sgd") for s in (0, 0, 1))
    with torch.no_grad():  # training mode inserts; no backward, so rows keep their initial vectors
        a(KeyedJaggedTensor(keys=["f"], values=IDS, lengths=torch.tensor([len(IDS)])))
        for chunk in IDS.flip(0).split(5):  # other order, other batches
            b(KeyedJaggedTensor(keys=["f"], values=chunk, lengths=torch.tensor([len(chunk)])))
        c(KeyedJaggedTensor(keys=["f"], values=IDS, lengths=torch.tensor([len(IDS)])))
    rows = {
        name: dict(zip(*(x.tolist() for x in live_rows(m, "embedding_bags")["t"]))) for name, m in zip("abc", (a, b, c))
    }
    want = ref.init_vectors(IDS, 16, ref.table_seed(0, "t"), "normal", (0.0, 0.1))
    for i, k in enumerate(IDS.tolist()):
        torch.testing.assert_close(torch.tensor(rows["a"][k]), want[i])
        assert rows["a"][k] == rows["b"][k]
        assert rows["a"][k] != rows["c"][k]


def test_plain_config_uses_torchrec_default_uniform_bounds():
    module = DynamicEmbeddingBagCollection(
        [EmbeddingBagConfig(name="t", embedding_dim=32, num_embeddings=100, feature_names=["f"])]
    )
    with torch.no_grad():
        module(KeyedJaggedTensor(keys=["f"], values=torch.arange(50), lengths=torch.tensor([50])))
    _, vecs = live_rows(module, "embedding_bags")["t"]
    bound = (1 / 100) ** 0.5
    assert vecs.abs().max() <= bound and vecs.abs().max() > 0.8 * bound


def test_evicted_rows_are_reinitialised_and_optimizer_state_cleared():
    cfg = [
        DynamicEmbeddingBagConfig(
            name="t", embedding_dim=4, num_embeddings=32, feature_names=["f"], eviction_policy="lru"
        )
    ]
    module = DynamicEmbeddingBagCollection(cfg, optimizer=torch.optim.Adagrad, optimizer_kwargs={"lr": 0.5})
    first = torch.arange(32)
    _train_once(module, KeyedJaggedTensor(keys=["f"], values=first, lengths=torch.tensor([32])))
    assert module.num_live_rows() == 32
    newcomers = torch.arange(1000, 1010)
    with torch.no_grad():
        module(KeyedJaggedTensor(keys=["f"], values=newcomers, lengths=torch.tensor([10])))
    sd = module.state_dict()
    ids = sd["embedding_bags.t.weight_id"].tolist()
    assert module.num_live_rows() == 32 and all(k in ids for k in newcomers.tolist())
    fresh = torch.tensor([ids.index(k) for k in newcomers.tolist()])
    want = ref.init_vectors(newcomers, 4, ref.table_seed(0, "t"), "uniform", (-((1 / 32) ** 0.5), (1 / 32) ** 0.5))
    torch.testing.assert_close(sd["embedding_bags.t.weight"][fresh], want)
    assert torch.all(sd["embedding_bags.t.optimizer.momentum1"][fresh] == 0)
    assert torch.all(sd["embedding_bags.t.optimizer.momentum1"][[i for i in range(32) if i not in fresh.tolist()]] > 0)


def test_admit_after_gives_rows_only_to_ids_seen_often_enough():
    cfg = [DynamicEmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=64, feature_names=["f"], admit_after=3)]
    module = DynamicEmbeddingBagCollection(cfg, optimizer="sgd", optimizer_kwargs={"lr": 0.1})
    batch = lambda *ids: KeyedJaggedTensor(keys=["f"], values=torch.tensor(ids), lengths=torch.tensor([len(ids)]))
    out = module(batch(1, 2, 2))
    assert module.num_live_rows() == 0 and torch.all(out.values() == 0)
    out.values().sum().backward()
    module(batch(1, 2)).values().sum().backward()  # 2 seen 3 times now: admitted; 1 only twice
    assert live_rows(module, "embedding_bags")["t"][0].tolist() == [2]
    module(batch(1)).values().sum().backward()
    assert sorted(live_rows(module, "embedding_bags")["t"][0].tolist()) == [1, 2]


def test_ttl_evicts_rows_unseen_for_ttl_steps():
    cfg = [DynamicEmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=64, feature_names=["f"], ttl_steps=2)]
    module = DynamicEmbeddingBagCollection(cfg, optimizer="sgd", optimizer_kwargs={"lr": 1.0})
    batch = lambda *ids: KeyedJaggedTensor(keys=["f"], values=torch.tensor(ids), lengths=torch.tensor([len(ids)]))
    module(batch(5, 6)).values().sum().backward()  # step 1: 5 and 6 get rows and one update
    module(batch(6)).values().sum().backward()  # step 2
    module(batch(6)).values().sum().backward()  # step 3: 5 unseen for 2 steps, still alive
    assert 5 in live_rows(module, "embedding_bags")["t"][0].tolist()
    module(batch(6)).values().sum().backward()  # step 4: 5 unseen for 3 > 2 steps: expired
    module.eval()
    assert torch.all(module(batch(5)).values() == 0)
    module.train()
    with torch.no_grad():
        out = module(batch(5)).values()  # re-admitted with a fresh initial vector
    want = ref.init_vectors(
        torch.tensor([5]), 4, ref.table_seed(0, "t"), "uniform", (-((1 / 64) ** 0.5), (1 / 64) ** 0.5)
    )
    torch.testing.assert_close(out, want)


# ----------------------------------------------------------------------------- optimizers

_OPTIMIZERS = [
    (torch.optim.SGD, {"lr": 0.3}),
    (torch.optim.Adagrad, {"lr": 0.2, "initial_accumulator_value": 0.1, "lr_decay": 0.01, "eps": 1e-8}),
    (RowWiseAdagrad, {"lr": 0.2, "eps": 1e-8}),
    (torch.optim.Adam, {"lr": 0.05, "betas": (0.8, 0.9)}),
    (torch.optim.Adam, {"lr": 0.05, "weight_decay": 0.1}),
    (torch.optim.AdamW, {"lr": 0.05, "betas": (0.8, 0.9), "weight_decay": 0.3}),
    # torch's Adam with decoupled decay is AdamW's update (Adam's defaults otherwise).
    (torch.optim.Adam, {"lr": 0.05, "weight_decay": 0.3, "decoupled_weight_decay": True}),
    # FTRL has no torch class: its dense twin is our Ftrl class, whose step is reference.ftrl_step.
    (Ftrl, {"lr": 0.2, "l1": 0.01, "l2": 0.05, "beta": 0.5}),
    (Ftrl, {"lr": 0.2, "lr_power": -0.25, "initial_accumulator_value": 0.3}),
]


@pytest.mark.parametrize("optimizer,kwargs", _OPTIMIZERS, ids=lambda x: getattr(x, "__name__", str(x)))
@pytest.mark.parametrize("via,weighted", [("constructor", True), ("apply_optimizer_in_backward", False)])
def test_fused_updates_equal_torch_optimizer_on_dense_ebc(optimizer, kwargs, via, weighted):
    # torch's EmbeddingBag has no weighted mean: the weighted case pools t2 by sum.
    t2_pooling = PoolingType.SUM if weighted else PoolingType.MEAN
    configs = [
        DynamicEmbeddingBagConfig(
            name="t1",
            embedding_dim=8,
            num_embeddings=256,
            feature_names=["f1", "f2"],
            initializer=Initializer("normal", std=0.5),
        ),
        DynamicEmbeddingBagConfig(
            name="t2",
            embedding_dim=5,
            num_embeddings=64,
            feature_names=["f3"],
            pooling=t2_pooling,
            initializer=Initializer("normal", std=0.5),
        ),
    ]
    if via == "constructor":
        ours = DynamicEmbeddingBagCollection(
            configs, is_weighted=weighted, optimizer=optimizer, optimizer_kwargs=kwargs
        )
    else:
        ours = DynamicEmbeddingBagCollection(configs, is_weighted=weighted)
        apply_optimizer_in_backward(optimizer, ours.parameters(), kwargs)
    # Dense twin: rows = the initial vectors of the id universe, in universe order.
    universe = IDS
    dense = EmbeddingBagCollection(
        [
            EmbeddingBagConfig(
                name=c.name,
                embedding_dim=c.embedding_dim,
                num_embeddings=len(universe),
                feature_names=c.feature_names,
                pooling=c.pooling,
            )
            for c in configs
        ],
        is_weighted=weighted,
    )
    with torch.no_grad():
        for c in configs:
            dense.embedding_bags[c.name].weight.copy_(
                ref.init_vectors(universe, c.embedding_dim, ref.table_seed(0, c.name), "normal", (0.0, 0.5))
            )
    dense_opt = optimizer(dense.parameters(), **kwargs)
    maps = {c.name: {k: i for i, k in enumerate(universe.tolist())} for c in configs}
    # Dense Adam moves untouched rows (momentum), AdamW and weight decay decay them, dense FTRL
    # rewrites them from (z, n) (a never-touched row to zeros): sparse updates are equal when
    # every row is touched every step.
    every_id_every_step = optimizer in (torch.optim.Adam, torch.optim.AdamW, Ftrl) or kwargs.get("weight_decay", 0) != 0
    for _ in range(4):
        kjt = random_kjt(["f1", "f2", "f3"], 6, universe, weighted=weighted)
        if every_id_every_step:  # dense Adam moves untouched rows; sparse is equal when all rows are touched
            kjt = _with_every_id(kjt, universe, features_to_extend=("f1", "f3"))
        loss_weights = torch.randn(6, 21)
        (ours(kjt).values() * loss_weights).sum().backward()
        dense_opt.zero_grad()
        (dense(remap_kjt(kjt, {"f1": "t1", "f2": "t1", "f3": "t2"}, maps)).values() * loss_weights).sum().backward()
        dense_opt.step()
    rows = live_rows(ours, "embedding_bags")
    for c in configs:
        ids, vecs = rows[c.name]
        want = dense.embedding_bags[c.name].weight.detach()[[maps[c.name][k] for k in ids.tolist()]]
        torch.testing.assert_close(vecs, want, rtol=1e-5, atol=1e-5)  # Adam divides by tiny moments
    assert ours.embedding_bags.t1.weight.grad is None


def _with_every_id(kjt, universe, features_to_extend):
    """kjt with the whole universe appended to the last bag of each listed feature."""
    jts = kjt.to_dict()
    values, lengths, weights = [], [], []
    for key in kjt.keys():
        jt = jts[key]
        extra = universe if key in features_to_extend else universe[:0]
        values += [jt.values(), extra]
        bag_lengths = jt.lengths().clone()
        bag_lengths[-1] += len(extra)
        lengths.append(bag_lengths)
        if kjt.weights_or_none() is not None:
            weights += [jt.weights(), torch.rand(len(extra))]
    return KeyedJaggedTensor(
        keys=kjt.keys(),
        values=torch.cat(values),
        lengths=torch.cat(lengths),
        weights=torch.cat(weights) if weights else None,
        stride=kjt.stride(),
    )


def test_learning_rate_changes_through_fused_optimizer():
    module = DynamicEmbeddingBagCollection(_configs(), optimizer="sgd", optimizer_kwargs={"lr": 1.0})
    kjt = random_kjt(["f1", "f2", "f3"], 4, IDS, allow_empty=False)
    with torch.no_grad():
        module(kjt)
    before = module.state_dict()
    module.fused_optimizer.param_groups[0]["lr"] = 0.0
    _train_once(module, kjt)
    after = module.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before if k.endswith(".weight"))
    scheduler = torch.optim.lr_scheduler.StepLR(module.fused_optimizer, step_size=1, gamma=0.5)
    module.fused_optimizer.param_groups[0]["lr"] = 1.0
    scheduler.base_lrs = [1.0]
    _train_once(module, kjt)
    assert not torch.equal(after["embedding_bags.t1.weight"], module.state_dict()["embedding_bags.t1.weight"])


def test_backward_without_optimizer_trains_with_torchrecs_sharded_default():
    kjt = random_kjt(["f1", "f2", "f3"], 3, IDS, allow_empty=False)
    module = DynamicEmbeddingBagCollection(_configs())
    explicit = DynamicEmbeddingBagCollection(_configs(), optimizer="sgd", optimizer_kwargs={"lr": 0.01})
    with pytest.warns(UserWarning, match="EXACT_SGD, learning_rate=0.01"):
        module(kjt).values().sum().backward()
    explicit(kjt).values().sum().backward()
    got, want = module.state_dict(), explicit.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


# ----------------------------------------------------------------------------- checkpoint


def _train_steps(module, batches):
    for kjt in batches:
        _train_once(module, kjt)


@pytest.mark.parametrize("optimizer", list(ref.OPTIMIZERS))
def test_state_dict_round_trip_gives_identical_lookups_and_training(optimizer):
    configs = lambda cap: [
        DynamicEmbeddingBagConfig(
            name="t1", embedding_dim=8, num_embeddings=cap, feature_names=["f1", "f2"], eviction_policy="lfu"
        ),
        DynamicEmbeddingBagConfig(
            name="t2", embedding_dim=4, num_embeddings=cap, feature_names=["f3"], ttl_steps=3, admit_after=2
        ),
    ]
    pool = torch.randint(-(2**40), 2**40, (300,))
    batches = [random_kjt(["f1", "f2", "f3"], 16, pool) for _ in range(8)]
    original = DynamicEmbeddingBagCollection(configs(128), optimizer=optimizer, optimizer_kwargs={"lr": 0.1})
    _train_steps(original, batches[:4])
    state, optim_state = original.state_dict(), original.fused_optimizer.state_dict()
    for capacity in (128, 4096):
        restored = DynamicEmbeddingBagCollection(configs(capacity), optimizer=optimizer, optimizer_kwargs={"lr": 0.1})
        restored.load_state_dict(state)
        restored.eval(), original.eval()
        torch.testing.assert_close(restored(batches[4]).values(), original(batches[4]).values(), rtol=0, atol=0)
        restored.train(), original.train()
        if capacity == 128:  # same capacity: identical placement, so identical evictions later too
            restored.fused_optimizer.load_state_dict(optim_state)
            twin = DynamicEmbeddingBagCollection(configs(128), optimizer=optimizer, optimizer_kwargs={"lr": 0.1})
            twin.load_state_dict(state)
            _train_steps(twin, batches[4:])
            _train_steps(restored, batches[4:])
            a, b = twin.state_dict(), restored.state_dict()
            assert a.keys() == b.keys()
            for k in a:
                assert torch.equal(a[k], b[k]), k


def test_load_state_dict_rejects_mismatched_tables():
    module = DynamicEmbeddingBagCollection(_configs(), optimizer="adagrad")
    _train_once(module, random_kjt(["f1", "f2", "f3"], 4, IDS, allow_empty=False))
    state = module.state_dict()
    other = DynamicEmbeddingBagCollection(
        [
            DynamicEmbeddingBagConfig(name="t1", embedding_dim=16, num_embeddings=256, feature_names=["f1", "f2"]),
            _configs()[1],
        ],
        optimizer="adagrad",
    )
    with pytest.raises(ValueError, match="t1.*weight must be"):
        other.load_state_dict(state)
    with pytest.raises(RuntimeError, match="Missing key"):
        other.load_state_dict({k: v for k, v in state.items() if "t2" not in k})


def test_meta_device_construction_then_materialise():
    module = DynamicEmbeddingBagCollection(_configs(), device=torch.device("meta"), optimizer="adam")
    assert module.embedding_bags.t1.weight.device.type == "meta"
    assert module(random_kjt(["f1", "f2", "f3"], 2, IDS)).values().device.type == "meta"  # shapes only, as TorchRec's
    module.to_empty(device="cpu")
    module.reset_parameters()
    _train_once(module, random_kjt(["f1", "f2", "f3"], 2, IDS, allow_empty=False))
    assert module.num_live_rows() > 0
    assert module.embedding_bags.t1.weight.data_ptr() == module._tables.weights.data_ptr()
