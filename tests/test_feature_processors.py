"""TorchRec's feature processors over the dynamic EBC (issue 14, item 7): a
FeatureProcessedEmbeddingBagCollection with PositionWeightedModule(Collection) trains its
position weights through our module (their gradient: each id's row dotted with its bag's output
gradient), against TorchRec's own FP-EBC holding the same rows and a brute-force autograd model.
"""

import pytest
import torch
from torchrec import KeyedJaggedTensor, PoolingType
from torchrec.modules.feature_processor_ import PositionWeightedModule, PositionWeightedModuleCollection
from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection

from modules_helpers import copied_ebc, live_rows
from torchrec_ext import DynamicEmbeddingBagCollection, DynamicEmbeddingBagConfig

KEYS = ["f1", "f2", "f3"]
MAX_LEN = 4


def _tables(pooling=PoolingType.SUM):
    return [
        DynamicEmbeddingBagConfig(
            name="t1", embedding_dim=4, num_embeddings=128, feature_names=["f1", "f2"], pooling=pooling
        ),
        DynamicEmbeddingBagConfig(
            name="t2", embedding_dim=8, num_embeddings=128, feature_names=["f3"], pooling=pooling
        ),
    ]


def _kjt(seed, batch=4):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, MAX_LEN + 1, (len(KEYS) * batch,), generator=g)
    values = torch.randint(0, 12, (int(lengths.sum()),), generator=g) * 1_000_003 - 5
    return KeyedJaggedTensor(keys=KEYS, values=values, lengths=lengths, stride=batch)


def _processors(kind):
    if kind == "collection":
        fp = PositionWeightedModuleCollection(dict.fromkeys(KEYS, MAX_LEN))
        with torch.no_grad():
            for p in fp.position_weights.values():
                p.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(7))
        return fp
    fp = {k: PositionWeightedModule(MAX_LEN) for k in KEYS}
    with torch.no_grad():
        for i, m in enumerate(fp.values()):
            m.position_weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(i))
    return fp


def _position_grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if "position_weight" in n}


def _brute_force_grads(module, kjt, upstream, weights_by_key, pooling):
    """Position-weight gradients of sum((pooled * upstream)) from the live rows, by autograd."""
    rows = live_rows(module, "embedding_bags")
    vectors = {t: dict(zip(ids.tolist(), v)) for t, (ids, v) in rows.items()}
    tables = {f: cfg for cfg in module.embedding_bag_configs() for f in cfg.feature_names}
    leaves = {k: w.detach().clone().requires_grad_() for k, w in weights_by_key.items()}
    loss, col, jts = 0.0, 0, kjt.to_dict()
    for key in KEYS:
        cfg = tables[key]
        lengths, values = jts[key].lengths().tolist(), jts[key].values().tolist()
        start = 0
        for b, n in enumerate(lengths):
            bag = torch.zeros(cfg.embedding_dim)
            for pos in range(n):
                v = vectors[cfg.name].get(values[start + pos], torch.zeros(cfg.embedding_dim))
                bag = bag + leaves[key][pos] * v
            if pooling == PoolingType.MEAN and n:
                bag = bag / n
            loss = loss + (bag * upstream[b, col : col + cfg.embedding_dim]).sum()
            start += n
        col += cfg.embedding_dim
    loss.backward()
    return {k: w.grad for k, w in leaves.items()}


@pytest.mark.parametrize("kind", ["collection", "modules"])
@pytest.mark.parametrize("pooling", [PoolingType.SUM, PoolingType.MEAN])
def test_position_weights_get_their_gradients(kind, pooling):
    ours = DynamicEmbeddingBagCollection(
        _tables(pooling), is_weighted=True, optimizer="adagrad", optimizer_kwargs={"lr": 0.05}
    )
    model = FeatureProcessedEmbeddingBagCollection(ours, _processors(kind))
    for step in range(3):
        kjt = _kjt(step)
        # The rows as the forward reads them, before the fused update moves them.
        model(kjt)  # inserts this batch's ids (training lookup), so the snapshot below has them
        model.zero_grad()
        upstream = torch.randn(4, 16, generator=torch.Generator().manual_seed(step))
        snapshot = DynamicEmbeddingBagCollection(_tables(pooling), is_weighted=True, optimizer="adagrad")
        snapshot.load_state_dict(ours.state_dict())
        (model(kjt).values() * upstream).sum().backward()
        got = _position_grads(model)
        weights = {
            k: (
                model._feature_processors.position_weights[k]
                if kind == "collection"
                else model._feature_processors[k].position_weight
            )
            for k in KEYS
        }
        want = _brute_force_grads(snapshot, kjt, upstream, weights, pooling)
        assert len(got) == len(KEYS)
        for name, g in got.items():
            key = next(k for k in KEYS if name.endswith(k) or f".{k}." in name)
            torch.testing.assert_close(g, want[key], rtol=1e-5, atol=1e-6)
            assert g.abs().sum() > 0


def test_position_weight_gradients_equal_torchrecs_fp_ebc():
    ours = DynamicEmbeddingBagCollection(_tables(), is_weighted=True, optimizer="sgd", optimizer_kwargs={"lr": 0.0})
    warm = FeatureProcessedEmbeddingBagCollection(ours, _processors("collection"))
    for step in range(3):
        warm(_kjt(step)).values().sum().backward()
    theirs_ebc, maps = copied_ebc(ours)
    table_of = {"f1": "t1", "f2": "t1", "f3": "t2"}
    ours_fp = FeatureProcessedEmbeddingBagCollection(ours, _processors("collection"))
    theirs_fp = FeatureProcessedEmbeddingBagCollection(theirs_ebc, _processors("collection"))
    for step in range(3):
        kjt = _kjt(step)
        starts = torch.tensor([0] + kjt.length_per_key()).cumsum(0).tolist()
        remapped = KeyedJaggedTensor(
            keys=KEYS,
            values=torch.tensor(
                [
                    maps[table_of[k]].get(v, len(maps[table_of[k]]))
                    for i, k in enumerate(KEYS)
                    for v in kjt.values()[starts[i] : starts[i + 1]].tolist()
                ]
            ),
            lengths=kjt.lengths(),
            stride=4,
        )
        upstream = torch.randn(4, 16, generator=torch.Generator().manual_seed(10 + step))
        ours_fp.zero_grad()
        theirs_fp.zero_grad()
        got, want = ours_fp(kjt), theirs_fp(remapped)
        torch.testing.assert_close(got.values(), want.values())
        (got.values() * upstream).sum().backward()
        (want.values() * upstream).sum().backward()
        g_ours, g_theirs = _position_grads(ours_fp), _position_grads(theirs_fp)
        assert g_ours.keys() == g_theirs.keys() and len(g_ours) == len(KEYS)
        for name in g_ours:
            torch.testing.assert_close(g_ours[name], g_theirs[name], rtol=1e-5, atol=1e-6)


def test_new_ids_weights_read_their_initial_rows():
    """A batch of ids never seen (their rows still pending in the forward) gives the same
    position-weight gradients as the same batch once its rows exist: both read the initial vectors."""

    def grads(prefill):
        module = DynamicEmbeddingBagCollection(_tables(), is_weighted=True, optimizer="adagrad")
        model = FeatureProcessedEmbeddingBagCollection(module, _processors("collection"))
        kjt = _kjt(42)
        if prefill:
            with torch.no_grad():
                model(kjt)  # a training lookup: inserts the ids, their rows written before the next read
        (model(kjt).values() * torch.arange(16.0)).sum().backward()
        return _position_grads(model)

    fresh, existing = grads(False), grads(True)
    for name in fresh:
        torch.testing.assert_close(fresh[name], existing[name], rtol=1e-6, atol=1e-7)
        assert fresh[name].abs().sum() > 0
