"""Optimizers the TorchRec ways (issue 14, item 2).

- With no fused optimizer chosen, the tables train with TorchRec's sharded default (fbgemm's
  EXACT_SGD, learning rate 0.01), so a plain ``torch.optim.X(model.parameters())`` loop trains
  the whole DLRM; oracle: the same model given that optimizer explicitly.
- A sharder's ``fused_params`` (2 gloo ranks) give the same tables as the unsharded module
  trained with the equivalent ``apply_optimizer_in_backward`` on the mean of the ranks' losses
  (TorchRec's sharded gradient scale); the module's own choice wins.
- ``fuse_embedding_optimizer`` sets our modules' fused optimizer (same rows as
  ``apply_optimizer_in_backward``) and still replaces TorchRec's own EBCs.
- Unsupported optimizers and fused_params are refused with a clear message.
"""

import copy
import warnings

import pytest
import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.models.dlrm import DLRM
from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection
from torchrec.optim import RowWiseAdagrad, apply_optimizer_in_backward

from dist_helpers import ModelWith, run_ranks
from torchrec_ext import DynamicEmbeddingBagCollection
from torchrec_ext.distributed import DynamicEmbeddingBagCollectionSharder
from torchrec_ext.modules import fuse_embedding_optimizer

FEATURES = ["f0", "f1"]
DIM, BATCH, DENSE_IN = 4, 8, 3


def _tables():
    return [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=DIM, num_embeddings=64, feature_names=[f])
        for i, f in enumerate(FEATURES)
    ]


def _batch(step: int, rank: int = 0, batch: int = BATCH):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    lengths = torch.randint(1, 4, (len(FEATURES) * batch,), generator=gen)
    ids = torch.randint(0, 20, (int(lengths.sum()),), generator=gen)
    kjt = KeyedJaggedTensor.from_lengths_sync(FEATURES, ids, lengths)
    return torch.randn(batch, DENSE_IN, generator=gen), kjt, torch.randint(0, 2, (batch,), generator=gen).float()


def _dlrm(ebc):
    torch.manual_seed(0)
    return DLRM(
        embedding_bag_collection=ebc,
        dense_in_features=DENSE_IN,
        dense_arch_layer_sizes=[8, DIM],
        over_arch_layer_sizes=[8, 1],
    )


def _rows(ebc):
    sd = ebc.state_dict()
    return {
        t.name: dict(zip(sd[f"embedding_bags.{t.name}.weight_id"].tolist(), sd[f"embedding_bags.{t.name}.weight"]))
        for t in _tables()
    }


def _assert_rows_equal(got, want, what=""):
    assert got.keys() == want.keys()
    for t in want:
        assert got[t].keys() == want[t].keys(), t
        for i in want[t]:
            torch.testing.assert_close(
                got[t][i], want[t][i], rtol=1e-5, atol=1e-5, msg=lambda m: f"{what} {t}[{i}]: {m}"
            )


def _dense_loop(model, steps, make_optimizer):
    """The plain loop a TorchRec user writes over an unsharded model."""
    optimizer = make_optimizer(model.parameters())
    loss_fn = torch.nn.BCEWithLogitsLoss()
    losses = []
    for step in range(steps):
        dense, kjt, labels = _batch(step % 4)
        optimizer.zero_grad()
        loss = loss_fn(model(dense, kjt).squeeze(-1), labels)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_dense_optimizer_loop_trains_dlrm_with_the_default_fused_optimizer():
    model = _dlrm(DynamicEmbeddingBagCollection(_tables()))
    ebc = model.sparse_arch.embedding_bag_collection
    with torch.no_grad():  # first rows, inserted in eval: trained ones must differ from them
        ebc(_batch(0)[1])
    before = _rows(ebc)
    adagrad = lambda params: torch.optim.Adagrad(params, lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses = _dense_loop(model, 24, adagrad)
    default_warnings = [w for w in caught if "EXACT_SGD" in str(w.message)]
    assert len(default_warnings) == 1 and "apply_optimizer_in_backward" in str(default_warnings[0].message)
    assert sum(losses[-4:]) < sum(losses[:4])
    assert all(t.weight.grad is None for t in ebc.embedding_bags.values())  # the dense Adagrad skipped them
    after = _rows(ebc)
    assert any(not torch.equal(after[t][i], before[t][i]) for t in before for i in before[t])
    # Oracle: the same model given TorchRec's sharded default explicitly (SGD, lr 0.01).
    explicit = _dlrm(DynamicEmbeddingBagCollection(_tables(), optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.01}))
    with torch.no_grad():
        explicit.sparse_arch.embedding_bag_collection(_batch(0)[1])
    assert _dense_loop(explicit, 24, adagrad) == losses
    _assert_rows_equal(after, _rows(explicit.sparse_arch.embedding_bag_collection))
    assert ebc.fused_optimizer.param_groups[0]["lr"] == 0.01  # exposed for schedulers, as sharded TorchRec


def test_fuse_embedding_optimizer_sets_ours_and_replaces_torchrec_ebcs():
    class TwoCollections(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.dynamic = DynamicEmbeddingBagCollection(_tables())
            self.stock = EmbeddingBagCollection(_tables())

    model = TwoCollections()
    apply_optimizer_in_backward(torch.optim.SGD, model.dynamic.parameters(), {"lr": 0.5})  # replaced below
    out = fuse_embedding_optimizer(model, torch.optim.Adagrad, {"lr": 0.2, "eps": 1e-3}, torch.device("cpu"))
    assert out is model and isinstance(model.stock, FusedEmbeddingBagCollection)
    reference = DynamicEmbeddingBagCollection(_tables())
    apply_optimizer_in_backward(torch.optim.Adagrad, reference.parameters(), {"lr": 0.2, "eps": 1e-3})
    for step in range(4):
        kjt = _batch(step)[1]
        weights = torch.randn(BATCH, DIM * len(FEATURES), generator=torch.Generator().manual_seed(step))
        for module in (model.dynamic, reference):
            (module(kjt).values() * weights).sum().backward()
    _assert_rows_equal(_rows(model.dynamic), _rows(reference))
    assert model.dynamic.fused_optimizer.spec.kind == "adagrad"
    # A collection passed on its own comes back, with its optimizer set.
    alone = DynamicEmbeddingBagCollection(_tables())
    assert fuse_embedding_optimizer(alone, RowWiseAdagrad, {"lr": 0.1}, torch.device("cpu")) is alone
    assert alone.fused_optimizer.spec.kind == "rowwise_adagrad"


def test_torchrecs_own_fuse_embedding_optimizer_sets_ours():
    """Called by TorchRec's name (its module attribute, as TorchRec code and users reach it), the
    function no longer skips ours: same rows as apply_optimizer_in_backward with that optimizer."""
    import torchrec.modules.fused_embedding_modules as torchrec_fused

    model, reference = (
        ModelWith("ebc", DynamicEmbeddingBagCollection(_tables())),
        DynamicEmbeddingBagCollection(_tables()),
    )
    assert (
        torchrec_fused.fuse_embedding_optimizer(model, torch.optim.Adagrad, {"lr": 0.2}, torch.device("cpu")) is model
    )
    apply_optimizer_in_backward(torch.optim.Adagrad, reference.parameters(), {"lr": 0.2})
    for step in range(3):
        for module in (model.ebc, reference):
            module(_batch(step)[1]).values().sum().backward()
    assert model.ebc.fused_optimizer.spec.kind == "adagrad"
    _assert_rows_equal(_rows(model.ebc), _rows(reference))


def _train(module, steps):
    for step in steps:
        weights = torch.randn(BATCH, DIM * len(FEATURES), generator=torch.Generator().manual_seed(step))
        (module(_batch(step)[1]).values() * weights).sum().backward()


def test_apply_optimizer_in_backward_kwargs_edited_in_place_take_effect():
    """apply_optimizer_in_backward's markers hold the caller's kwargs themselves, which the module
    reads at each step: an edit made in place, of a list inside them too (Adam's betas), takes
    effect as a fresh call with the edited kwargs does, never lost or half-seen."""
    kwargs = {"lr": 0.05, "betas": [0.9, 0.999]}
    edited, oracle, unedited = (DynamicEmbeddingBagCollection(_tables()) for _ in range(3))
    apply_optimizer_in_backward(torch.optim.Adam, edited.parameters(), kwargs)
    for module in (oracle, unedited):
        apply_optimizer_in_backward(torch.optim.Adam, module.parameters(), {"lr": 0.05, "betas": [0.9, 0.999]})
    for module in (edited, oracle, unedited):
        _train(module, range(2))
    kwargs["betas"][0] = 0.5
    apply_optimizer_in_backward(torch.optim.Adam, oracle.parameters(), {"lr": 0.05, "betas": [0.5, 0.999]})
    for module in (edited, oracle, unedited):
        _train(module, range(2, 4))
    assert edited.fused_optimizer.param_groups[0]["beta1"] == 0.5
    assert edited._tables.optimizer_step == oracle._tables.optimizer_step == 4  # (Adam's step count kept)
    _assert_rows_equal(_rows(edited), _rows(oracle))
    with pytest.raises(AssertionError):  # (the edit mattered)
        _assert_rows_equal(_rows(edited), _rows(unedited))
    kwargs["betas"][1] = 1.0  # checked as at the call: refused by name at the next step
    with pytest.raises(ValueError, match=r"betas\[1\] must be in \[0, 1\), got 1.0"):
        _train(edited, range(4, 5))


def test_fuse_embedding_optimizer_and_the_constructor_read_their_kwargs_once():
    """fuse_embedding_optimizer's kwargs and the constructor's optimizer_kwargs are read by the
    call (as TorchRec's fused modules read theirs): a later edit of the caller's objects, of a
    list inside them too, changes nothing."""
    kwargs = {"lr": 0.05, "betas": [0.9, 0.999]}
    fused = fuse_embedding_optimizer(
        DynamicEmbeddingBagCollection(_tables()), torch.optim.Adam, kwargs, torch.device("cpu")
    )
    built = DynamicEmbeddingBagCollection(_tables(), optimizer=torch.optim.Adam, optimizer_kwargs=kwargs)
    oracle = DynamicEmbeddingBagCollection(
        _tables(), optimizer=torch.optim.Adam, optimizer_kwargs={"lr": 0.05, "betas": [0.9, 0.999]}
    )
    for module in (fused, built, oracle):
        _train(module, range(2))
    kwargs["betas"][0], kwargs["lr"] = 0.5, 1.0
    for module in (fused, built, oracle):
        _train(module, range(2, 4))
    for module in (fused, built):
        assert module.fused_optimizer.param_groups[0]["beta1"] == 0.9
        _assert_rows_equal(_rows(module), _rows(oracle))


def test_unsupported_optimizers_are_refused_clearly():
    with pytest.raises(ValueError, match=r"fused_params optimizer .*LAMB.* not supported.*EXACT_ROWWISE_ADAGRAD"):
        DynamicEmbeddingBagCollectionSharder(fused_params={"optimizer": EmbOptimType.LAMB})
    with pytest.raises(ValueError, match=r"fused_params \['momentum'\] are not supported"):
        DynamicEmbeddingBagCollectionSharder(fused_params={"optimizer": EmbOptimType.EXACT_SGD, "momentum": 0.9})
    with pytest.raises(ValueError, match=r"weight_decay=0.1 without weight_decay_mode=WeightDecayMode.L2"):
        DynamicEmbeddingBagCollectionSharder(fused_params={"optimizer": EmbOptimType.ADAM, "weight_decay": 0.1})
    with pytest.raises(ValueError, match=r"learning_rate|lr must be finite and >= 0"):
        DynamicEmbeddingBagCollectionSharder(fused_params={"optimizer": "EXACT_ADAGRAD", "learning_rate": -1.0})
    module = DynamicEmbeddingBagCollection(_tables())
    with pytest.raises(ValueError, match="optimizer must be torch.optim.SGD/Adagrad/Adam"):
        fuse_embedding_optimizer(ModelWith("ebc", module), torch.optim.RMSprop, {"lr": 0.1}, torch.device("cpu"))
    assert module._chosen_spec() is None and module._fused is None  # nothing changed


# ----------------------------------------------------------------------------- sharded

_CASES = [  # (sharder fused_params, equivalent apply_optimizer_in_backward, module's own choice)
    (
        {
            "optimizer": EmbOptimType.EXACT_ADAGRAD,
            "learning_rate": 0.1,
            "weight_decay_mode": "L2",
            "prefetch_pipeline": True,
        },  # eps: fbgemm's default, 1e-8
        (torch.optim.Adagrad, {"lr": 0.1, "eps": 1e-8}),
        None,
    ),
    # The module's apply_optimizer_in_backward wins over the sharder's fused_params, as in TorchRec.
    (
        {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.3},
        (torch.optim.Adagrad, {"lr": 0.2}),
        (torch.optim.Adagrad, {"lr": 0.2}),
    ),
    # Updates that scale with the gradient (SGD, weight decay, a large eps): Adagrad and Adam at
    # a tiny eps are blind to a gradient off by a constant factor, these are not.
    (None, (torch.optim.SGD, {"lr": 0.01}), None),  # TorchRec's sharded default
    (
        {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.3},
        (torch.optim.SGD, {"lr": 0.05}),
        (torch.optim.SGD, {"lr": 0.05}),
    ),
    (
        {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1, "eps": 1e-3},
        (RowWiseAdagrad, {"lr": 0.1, "eps": 1e-3}),
        None,
    ),
    (
        {
            "optimizer": EmbOptimType.EXACT_ADAGRAD,
            "learning_rate": 0.1,
            "weight_decay": 0.01,
            "weight_decay_mode": "L2",
        },
        (torch.optim.Adagrad, {"lr": 0.1, "eps": 1e-8, "weight_decay": 0.01}),
        None,
    ),
    (
        {"optimizer": EmbOptimType.ADAM, "learning_rate": 0.01, "weight_decay": 0.01, "weight_decay_mode": "L2"},
        (torch.optim.Adam, {"lr": 0.01, "eps": 1e-8, "weight_decay": 0.01}),
        None,
    ),
    # The module's kwargs are read once, at sharding, as TorchRec's sharders read them: edited in
    # place after it (betas[0] = 0.5, below), they change nothing.
    (
        {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.3},
        (torch.optim.Adam, {"lr": 0.01, "betas": [0.9, 0.999]}),
        (torch.optim.Adam, {"lr": 0.01, "betas": [0.9, 0.999]}),
    ),
    # fbgemm's ADAM with decoupled decay is AdamW.
    (
        {"optimizer": EmbOptimType.ADAM, "learning_rate": 0.01, "weight_decay": 0.5, "weight_decay_mode": "DECOUPLE"},
        (torch.optim.AdamW, {"lr": 0.01, "eps": 1e-8, "weight_decay": 0.5}),
        None,
    ),
]


def _fused_params_match_unsharded(rank, world_size):
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
    from torchrec.distributed.types import ShardingEnv, ShardingPlan

    # The batches hold ids of the row-wise table looked up on both ranks in one step (their owner
    # sums both ranks' gradients) and ids first seen after step 0 (inserted mid-training).
    t0_ids = [[set(_batch(step, r)[1]["f0"].values().tolist()) for r in range(world_size)] for step in range(3)]
    assert all(set.intersection(*ranks) for ranks in t0_ids)
    assert set.union(*t0_ids[2]) - set.union(*t0_ids[0], *t0_ids[1])
    for fused_params, (cls, kwargs), own in _CASES:
        reference = DynamicEmbeddingBagCollection(_tables())
        apply_optimizer_in_backward(cls, reference.parameters(), kwargs)
        model = ModelWith("ebc", DynamicEmbeddingBagCollection(_tables()))
        own_kwargs = None if own is None else copy.deepcopy(own[1])
        if own is not None:
            apply_optimizer_in_backward(own[0], model.ebc.parameters(), own_kwargs)
        sharder = DynamicEmbeddingBagCollectionSharder(fused_params=fused_params)
        plan = construct_module_sharding_plan(
            model.ebc,
            {
                "t0": row_wise(compute_kernel="customized_kernel"),
                "t1": table_wise(rank=1, compute_kernel="customized_kernel"),
            },
            sharder=sharder,
            local_size=world_size,
            world_size=world_size,
            device_type="cpu",
        )
        dmp = DistributedModelParallel(
            model,
            env=ShardingEnv.from_process_group(dist.group.WORLD),
            device=torch.device("cpu"),
            plan=ShardingPlan({"ebc": plan}),
            sharders=[sharder],
        )
        if own_kwargs is not None and "betas" in own_kwargs:
            own_kwargs["betas"][0] = 0.5
        for step in range(3):
            kjts = [_batch(step, r)[1] for r in range(world_size)]
            weights = [
                torch.randn(BATCH, DIM * len(FEATURES), generator=torch.Generator().manual_seed(10 * step + r))
                for r in range(world_size)
            ]
            (dmp(kjts[rank]).values() * weights[rank]).sum().backward()
            # TorchRec's sharded output dists divide the gradient they send back by the world size
            # (comm_ops.GRADIENT_DIVISION, "equivalent to running on a single rank", as DDP averages
            # dense gradients): W ranks each back-propagating its own loss train as one module on
            # the mean of those losses. TorchRec's own sharded EBC does the same.
            whole = _global(kjts)
            ((reference(whole).values() * torch.cat(weights)).sum() / world_size).backward()
        local = dmp.module.ebc.local_module
        mine = {t: {i: v.tolist() for i, v in rows.items()} for t, rows in _rows_partial(local).items()}
        gathered = [None] * world_size
        dist.all_gather_object(gathered, mine)
        merged = {}
        for part in gathered:
            for t, rows in part.items():
                merged.setdefault(t, {}).update({i: torch.tensor(v) for i, v in rows.items()})
        _assert_rows_equal(merged, _rows(reference), f"fused_params={fused_params}, module's own={own}:")


def _rows_partial(module):
    sd = module.state_dict()
    names = {k.split(".")[1] for k in sd if k.endswith(".weight_id")}
    return {t: dict(zip(sd[f"embedding_bags.{t}.weight_id"].tolist(), sd[f"embedding_bags.{t}.weight"])) for t in names}


def _global(kjts):
    """Every rank's samples, rank after rank."""
    per_key = [k.to_dict() for k in kjts]
    values = torch.cat([jt[key].values() for key in FEATURES for jt in per_key])
    lengths = torch.cat([jt[key].lengths() for key in FEATURES for jt in per_key])
    return KeyedJaggedTensor(keys=FEATURES, values=values, lengths=lengths, stride=BATCH * len(kjts))


def test_sharder_fused_params_train_as_apply_optimizer_in_backward_on_two_ranks():
    run_ranks(_fused_params_match_unsharded, 2)


class _StockAndDynamic(torch.nn.Module):
    """A TorchRec EBC and ours side by side, as a model migrating table by table has them."""

    def __init__(self):
        super().__init__()
        stock = [EmbeddingBagConfig(name="stock", embedding_dim=DIM, num_embeddings=64, feature_names=["f0"])]
        self.stock = EmbeddingBagCollection(stock, device=torch.device("meta"))
        self.ebc = DynamicEmbeddingBagCollection(_tables()[1:], device=torch.device("meta"))

    def forward(self, kjt):
        return torch.cat([self.stock(kjt).values(), self.ebc(kjt).values()], dim=1)


def _one_call_over_stock_and_dynamic_tables(rank, world_size):
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.sharding_plan import get_default_sharders

    from torchrec_ext.distributed import get_sharders

    kwargs = {"lr": 0.05, "eps": 1e-6}
    model = _StockAndDynamic()
    apply_optimizer_in_backward(torch.optim.Adagrad, model.parameters(), kwargs)  # one dict for every table
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), sharders=get_sharders())
    assert any(type(s) in map(type, get_default_sharders()) for s in get_sharders())
    assert "learning_rate" in kwargs and "lr" not in kwargs  # what TorchRec's EBC sharder did to the dict
    reference = DynamicEmbeddingBagCollection(_tables()[1:])
    apply_optimizer_in_backward(torch.optim.Adagrad, reference.parameters(), {"lr": 0.05, "eps": 1e-6})
    weights = torch.randn(BATCH, DIM, generator=torch.Generator().manual_seed(7))
    for step in range(3):
        kjt = _batch(step)[1]
        (dmp(kjt)[:, DIM:] * weights).sum().backward()
        (reference(kjt).values() * weights).sum().backward()

    def t1_rows(module):
        sd = module.state_dict()
        return {"t1": dict(zip(sd["embedding_bags.t1.weight_id"].tolist(), sd["embedding_bags.t1.weight"]))}

    assert t1_rows(reference)["t1"]
    _assert_rows_equal(t1_rows(dmp.module.ebc.local_module), t1_rows(reference))


def test_one_apply_optimizer_in_backward_call_over_torchrecs_tables_and_ours():
    """apply_optimizer_in_backward gives all the parameters of one call the same kwargs dict, which
    TorchRec's EBC sharder rewrites in place into fbgemm's form (adds optimizer=EXACT_ADAGRAD,
    renames lr to learning_rate). Ours, sharded in the same DMP, read it back in torch's form: the
    table trains as an unsharded module given the call's original kwargs (1 gloo rank)."""
    run_ranks(_one_call_over_stock_and_dynamic_tables, 1)


def test_an_optimizer_key_naming_another_optimizer_is_refused():
    """An ``optimizer`` key put into the call's kwargs afterwards (as TorchRec's sharders do) must
    name the call's class: another one is refused by name, not trained with either."""
    module, kwargs = DynamicEmbeddingBagCollection(_tables()), {"lr": 0.1}
    apply_optimizer_in_backward(torch.optim.Adagrad, module.parameters(), kwargs)
    kwargs["optimizer"] = EmbOptimType.ADAM
    with pytest.raises(ValueError, match=r"optimizer=.*ADAM.*, which is not the optimizer class Adagrad"):
        _train(module, range(1))
