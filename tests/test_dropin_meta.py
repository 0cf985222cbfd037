"""The meta device, the TorchRec way (issue 14, item 5): our collections built under
``with torch.device("meta")`` or with ``device="meta"``, their forward on meta inputs and their
``state_dict()`` give what TorchRec's modules give on meta (shapes, keys, dtypes, no data);
``to_empty()`` + ``reset_parameters()`` materialise them; and DistributedModelParallel shards a
model built on meta (as TorchRec's docs show) into tables with real storage on 2 gloo ranks."""

import pytest
import torch
from torch import nn
from torchrec import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    KeyedJaggedTensor,
    KeyedTensor,
)
from torchrec.modules.embedding_configs import PoolingType

from dist_helpers import run_ranks
from torchrec_ext import DynamicEmbeddingBagCollection, DynamicEmbeddingCollection

META = torch.device("meta")
BAG_TABLES = [
    EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=64, feature_names=["f0", "f1"]),
    EmbeddingBagConfig(name="t1", embedding_dim=8, num_embeddings=32, feature_names=["f1"], pooling=PoolingType.MEAN),
]
SEQ_TABLES = [
    EmbeddingConfig(name="t0", embedding_dim=4, num_embeddings=64, feature_names=["f0", "f1"]),
    EmbeddingConfig(name="t1", embedding_dim=4, num_embeddings=32, feature_names=["f2"]),
]
PAIRS = [
    (EmbeddingBagCollection, DynamicEmbeddingBagCollection, BAG_TABLES, {}),
    (EmbeddingCollection, DynamicEmbeddingCollection, SEQ_TABLES, {"need_indices": True}),
]
IDS = pytest.mark.parametrize("stock, ours, tables, kwargs", PAIRS, ids=["ebc", "ec"])


def _keys(tables):
    return sorted({f for t in tables for f in t.feature_names})


def _kjt(tables, device, batch=3, extra_key=False):
    keys = _keys(tables) + (["unread"] if extra_key else [])
    lengths = torch.tensor([1, 0, 2] * len(keys), device=device)
    values = (
        torch.arange(int(3 * len(keys)), device=device)
        if device.type != "meta"
        else torch.empty(3 * len(keys), dtype=torch.int64, device=device)
    )
    return KeyedJaggedTensor(keys=keys, values=values, lengths=lengths, stride=batch)


@IDS
@pytest.mark.parametrize("how", ["context", "argument"])
def test_built_on_meta_like_torchrec(stock, ours, tables, kwargs, how):
    """Parameters on meta with TorchRec's shapes; nothing allocated; the tables report meta."""
    if how == "context":
        with torch.device("meta"):
            module, reference = ours(tables=tables, **kwargs), stock(tables=tables, **kwargs)
    else:
        module, reference = ours(tables=tables, device=META, **kwargs), stock(tables=tables, device=META, **kwargs)
    assert module.device == META
    mine = {n: (p.shape, p.device) for n, p in module.named_parameters()}
    theirs = {n: (p.shape, p.device) for n, p in reference.named_parameters()}
    assert mine == theirs
    assert module.num_live_rows() == 0


@IDS
def test_forward_on_meta_gives_torchrec_shapes(stock, ours, tables, kwargs):
    """Meta in, meta out: TorchRec's output types, keys, and shapes (a KJT on meta has no
    lengths to read: TorchRec splits its ids evenly over the keys, and so do we)."""
    with torch.device("meta"):
        module, reference = ours(tables=tables, **kwargs), stock(tables=tables, **kwargs)
    for extra in (False, True):  # a key no table reads is ignored, as TorchRec does
        kjt = _kjt(tables, META, extra_key=extra)
        got, want = module(kjt), reference(_kjt(tables, META, extra_key=extra))
        if isinstance(want, KeyedTensor):
            assert isinstance(got, KeyedTensor)
            assert (got.keys(), got.length_per_key(), got.values().shape) == (
                want.keys(),
                want.length_per_key(),
                want.values().shape,
            )
            assert got.values().device == META and got.values().dtype == want.values().dtype
        else:
            assert list(got) == list(want)
            for name in want:
                g, w = got[name], want[name]
                assert (g.values().shape, g.lengths().shape, g.values().device) == (
                    w.values().shape,
                    w.lengths().shape,
                    w.values().device,
                )
                assert g.weights().shape == w.weights().shape  # need_indices: the ids


@IDS
def test_meta_forward_still_checks_keys(stock, ours, tables, kwargs):
    module = ours(tables=tables, device=META, **kwargs)
    kjt = KeyedJaggedTensor(
        keys=["f0"],
        values=torch.empty(2, dtype=torch.int64, device=META),
        lengths=torch.empty(3, dtype=torch.int64, device=META),
        stride=3,
    )
    with pytest.raises(ValueError, match="lacks the features"):
        module(kjt)


@IDS
def test_meta_state_dict_is_shape_only_with_the_real_modules_keys(stock, ours, tables, kwargs):
    """Same keys, dtypes and shapes as the module built on the CPU (a fresh one: no live rows),
    every tensor on meta; with a fused optimizer its state keys too."""
    for extra in ({}, {"optimizer": torch.optim.Adagrad, "optimizer_kwargs": {"lr": 0.1}}):
        on_meta = ours(tables=tables, device=META, **kwargs, **extra).state_dict()
        on_cpu = ours(tables=tables, **kwargs, **extra).state_dict()
        assert list(on_meta) == list(on_cpu)
        for key, value in on_meta.items():
            assert value.device == META, key
            assert (value.shape, value.dtype) == (on_cpu[key].shape, on_cpu[key].dtype), key
        assert any(".optimizer." in k for k in on_meta) == bool(extra)


@IDS
def test_to_empty_and_reset_parameters_materialise(stock, ours, tables, kwargs):
    """A meta module computes shapes only (and refuses a checkpoint) until materialised, then
    what a module built on the CPU computes (initial vectors are a function of seed, table and
    id), training included."""
    with torch.device("meta"):
        module = ours(tables=tables, optimizer="sgd", optimizer_kwargs={"lr": 0.5}, **kwargs)
    out = module(_kjt(tables, torch.device("cpu")))
    assert all(
        v.device == META
        for v in ([out.values()] if isinstance(out, KeyedTensor) else [jt.values() for jt in out.values()])
    )
    trained = ours(tables=tables, optimizer="sgd", optimizer_kwargs={"lr": 0.5}, **kwargs)
    trained(_kjt(tables, torch.device("cpu")))
    with pytest.raises(RuntimeError, match="meta device; materialise it first"):
        module.load_state_dict(trained.state_dict())
    module.to_empty(device="cpu")
    module.reset_parameters()
    reference = ours(tables=tables, optimizer="sgd", optimizer_kwargs={"lr": 0.5}, **kwargs)
    assert all(p.device.type == "cpu" for p in module.parameters())
    for _ in range(3):
        got, want = module(_kjt(tables, torch.device("cpu"))), reference(_kjt(tables, torch.device("cpu")))
        if isinstance(want, KeyedTensor):
            got, want = got.values(), want.values()
        else:
            got = torch.cat([jt.values() for jt in got.values()])
            want = torch.cat([jt.values() for jt in want.values()])
        torch.testing.assert_close(got, want)
        got.sum().backward()
        want.sum().backward()
    assert module.num_live_rows() == reference.num_live_rows() > 0


# ------------------------------------------------------------------ DMP from a meta model


class _Model(nn.Module):
    """A dense layer over our collection, plus a stock TorchRec EBC: all built on meta."""

    def __init__(self):
        super().__init__()
        self.dyn = DynamicEmbeddingBagCollection(tables=BAG_TABLES, optimizer="sgd", optimizer_kwargs={"lr": 0.5})
        self.stock = EmbeddingBagCollection(
            tables=[EmbeddingBagConfig(name="s0", embedding_dim=4, num_embeddings=16, feature_names=["g"])]
        )
        self.dense = nn.Linear(16, 1)

    def forward(self, kjt, stock_kjt):
        return self.dense(self.dyn(kjt).values()), self.stock(stock_kjt).values()


def _dmp_from_meta(rank, world_size, init_data_parallel):
    from torchrec.distributed import DistributedModelParallel

    from torchrec_ext.distributed import ShardedDynamicEmbeddingBagCollection, get_sharders

    with torch.device("meta"):
        model = _Model()
    dmp = DistributedModelParallel(
        model, device=torch.device("cpu"), sharders=get_sharders(), init_data_parallel=init_data_parallel
    )
    if not init_data_parallel:
        dmp.init_data_parallel()
    sharded = dmp.module.dyn
    assert isinstance(sharded, ShardedDynamicEmbeddingBagCollection)
    # Every parameter and every state_dict tensor has storage on the CPU now, ours included.
    assert all(p.device.type == "cpu" for p in dmp.parameters())
    state = dmp.state_dict()
    assert any(k.startswith("dyn.") for k in state)
    reference = DynamicEmbeddingBagCollection(tables=BAG_TABLES, optimizer="sgd", optimizer_kwargs={"lr": 0.5})
    for step in range(3):
        kjts = [_rank_batch(step, r) for r in range(world_size)]
        out = sharded(kjts[rank]).values()
        want = reference(_global(kjts)).values()
        torch.testing.assert_close(out, want[rank * 3 : (rank + 1) * 3], rtol=1e-5, atol=1e-5)
        out.sum().backward()
        want.sum().backward()
    stock_kjt = KeyedJaggedTensor(keys=["g"], values=torch.tensor([1, 2, 3]), lengths=torch.tensor([1, 2, 0]))
    dense_out, stock_out = dmp(_rank_batch(9, rank), stock_kjt)
    assert dense_out.shape == (3, 1) and stock_out.shape == (3, 4)
    assert torch.isfinite(dense_out).all() and torch.isfinite(stock_out).all()


def _rank_batch(step, rank):
    gen = torch.Generator().manual_seed(step * 10 + rank)
    lengths = torch.randint(0, 3, (2 * 3,), generator=gen)
    values = torch.randint(-(1 << 40), 1 << 40, (int(lengths.sum()),), generator=gen)
    return KeyedJaggedTensor(keys=["f0", "f1"], values=values, lengths=lengths, stride=3)


def _global(kjts):
    per_key = [k.to_dict() for k in kjts]
    keys = ["f0", "f1"]
    return KeyedJaggedTensor(
        keys=keys,
        values=torch.cat([jt[key].values() for key in keys for jt in per_key]),
        lengths=torch.cat([jt[key].lengths() for key in keys for jt in per_key]),
        stride=3 * len(kjts),
    )


def test_dmp_shards_a_model_built_on_meta():
    run_ranks(_dmp_from_meta, 2, False)  # init_data_parallel() called after, as TorchRec's docs for meta
