"""DynamicEmbeddingCollection against TorchRec's EmbeddingCollection holding copies of our rows,
and its fused updates against torch's optimizers on a dense EC."""

import pytest
import torch
from torchrec import EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor

from modules_helpers import copied_ec, live_rows, random_kjt, remap_kjt
from torchrec_ext import DynamicEmbeddingCollection, DynamicEmbeddingConfig, Initializer
from torchrec_ext import reference as ref

IDS = torch.tensor([0, -1, 2**63 - 1, -(2**63), 7, 2**40 + 3, -42, 99, 5])


def _configs():
    return [
        DynamicEmbeddingConfig(
            name="t1",
            embedding_dim=8,
            num_embeddings=128,
            feature_names=["f1", "f2"],
            initializer=Initializer("normal", std=0.3),
        ),
        EmbeddingConfig(name="t2", embedding_dim=8, num_embeddings=64, feature_names=["f3"]),
    ]


@pytest.mark.parametrize("need_indices", [False, True])
def test_forward_equals_torchrec_ec_with_copied_rows(need_indices):
    module = DynamicEmbeddingCollection(
        _configs(), need_indices=need_indices, optimizer="adam", optimizer_kwargs={"lr": 0.1}
    )
    for _ in range(3):
        out = module(random_kjt(["f1", "f2", "f3"], 5, IDS))
        sum(jt.values().sum() for jt in out.values()).backward()
    module.eval()
    kjt = random_kjt(["f3", "f1", "f2"], 6, torch.cat([IDS, torch.tensor([31337])]))
    ours = module(kjt)
    ec, maps = copied_ec(module)
    theirs = ec(remap_kjt(kjt, {"f1": "t1", "f2": "t1", "f3": "t2"}, maps))
    assert list(ours) == ["f1", "f2", "f3"] and set(ours) == set(theirs)
    for name in ours:
        torch.testing.assert_close(ours[name].values(), theirs[name].values())
        assert torch.equal(ours[name].lengths(), theirs[name].lengths())
        if need_indices:
            assert torch.equal(ours[name].weights(), kjt[name].values())


def test_shared_feature_gets_one_sequence_per_table():
    configs = [
        DynamicEmbeddingConfig(name="a", embedding_dim=4, num_embeddings=32, feature_names=["f"]),
        DynamicEmbeddingConfig(name="b", embedding_dim=4, num_embeddings=32, feature_names=["f"], seed=1),
    ]
    module = DynamicEmbeddingCollection(configs, optimizer="sgd")
    with torch.no_grad():
        out = module(KeyedJaggedTensor(keys=["f"], values=torch.tensor([3, 4, 3]), lengths=torch.tensor([2, 1])))
    assert list(out) == ["f@a", "f@b"]
    assert torch.equal(out["f@a"].values()[0], out["f@a"].values()[2])
    assert not torch.equal(out["f@a"].values(), out["f@b"].values())


def test_fused_updates_equal_torch_optimizer_on_dense_ec():
    configs = [
        DynamicEmbeddingConfig(
            name="t",
            embedding_dim=6,
            num_embeddings=64,
            feature_names=["f", "g"],
            initializer=Initializer("uniform", low=-0.5, high=0.5),
        )
    ]
    ours = DynamicEmbeddingCollection(configs, optimizer=torch.optim.Adagrad, optimizer_kwargs={"lr": 0.3})
    dense = EmbeddingCollection(
        [EmbeddingConfig(name="t", embedding_dim=6, num_embeddings=len(IDS), feature_names=["f", "g"])]
    )
    with torch.no_grad():
        dense.embeddings.t.weight.copy_(ref.init_vectors(IDS, 6, ref.table_seed(0, "t"), "uniform", (-0.5, 0.5)))
    dense_opt = torch.optim.Adagrad(dense.parameters(), lr=0.3)
    maps = {"t": {k: i for i, k in enumerate(IDS.tolist())}}
    for _ in range(3):
        kjt = random_kjt(["f", "g"], 4, IDS)
        targets = {k: torch.randn(int(kjt[k].lengths().sum()), 6) for k in ("f", "g")}
        loss = lambda out: sum((out[k].values() * targets[k]).sum() for k in ("f", "g"))
        loss(ours(kjt)).backward()
        dense_opt.zero_grad()
        loss(dense(remap_kjt(kjt, {"f": "t", "g": "t"}, maps))).backward()
        dense_opt.step()
    ids, vecs = live_rows(ours, "embeddings")["t"]
    want = dense.embeddings.t.weight.detach()[[maps["t"][k] for k in ids.tolist()]]
    torch.testing.assert_close(vecs, want)


def test_state_dict_round_trip():
    module = DynamicEmbeddingCollection(_configs(), optimizer="rowwise_adagrad", optimizer_kwargs={"lr": 0.1})
    batches = [random_kjt(["f1", "f2", "f3"], 4, IDS) for _ in range(4)]
    for kjt in batches[:2]:
        sum(jt.values().sum() for jt in module(kjt).values()).backward()
    twin = DynamicEmbeddingCollection(_configs(), optimizer="rowwise_adagrad", optimizer_kwargs={"lr": 0.1})
    twin.load_state_dict(module.state_dict())
    for m in (module, twin):
        for kjt in batches[2:]:
            sum(jt.values().sum() for jt in m(kjt).values()).backward()
    a, b = module.state_dict(), twin.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_tables_must_share_one_dim():
    with pytest.raises(ValueError, match="same embedding dimension"):
        DynamicEmbeddingCollection(
            [
                EmbeddingConfig(name="a", embedding_dim=4, num_embeddings=8),
                EmbeddingConfig(name="b", embedding_dim=8, num_embeddings=8),
            ]
        )
