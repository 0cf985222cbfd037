"""TorchRec code that branches on ``isinstance(m, EmbeddingBagCollection / EmbeddingCollection)``
with our modules (issue 14, item 10): each branch either handles ours correctly or refuses it
with a clear message.

- ``torchrec.inference.modules.quantize_inference_model``: refuses ours (it would leave them in
  float silently), saying how to keep them in float while quantizing TorchRec's tables.
- ``EmbeddingTowerCollection``: gives a module it does not know both KJTs; ours read the right one.
- ``ManagedCollisionEmbeddingBagCollection`` / ``...EmbeddingCollection`` over ours: built and run
  (ids remapped by the MC modules, then looked up).
- ``EmbeddingTowerSharder``: TorchRec refuses ours itself ("Unsupported embedding type").
"""

import pytest
import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingConfig, KeyedJaggedTensor

from torchrec_ext import DynamicEmbeddingBagCollection, DynamicEmbeddingCollection


def _kjt(keys, gen_seed=0, weighted=False, batch=3):
    gen = torch.Generator().manual_seed(gen_seed)
    lengths = torch.randint(1, 4, (len(keys) * batch,), generator=gen)
    values = torch.randint(0, 1 << 40, (int(lengths.sum()),), generator=gen)
    weights = torch.rand(values.numel(), generator=gen) if weighted else None
    return KeyedJaggedTensor(keys=keys, values=values, lengths=lengths, weights=weights, stride=batch)


def _bags(names, weighted=False):
    return DynamicEmbeddingBagCollection(
        [EmbeddingBagConfig(name=f"t_{n}", embedding_dim=4, num_embeddings=64, feature_names=[n]) for n in names],
        is_weighted=weighted,
    )


# ------------------------------------------------------------------ quantization


class _TwoTables(nn.Module):
    def __init__(self):
        super().__init__()
        self.dyn = _bags(["f"])
        torch.manual_seed(0)
        self.stock = EmbeddingBagCollection(
            [EmbeddingBagConfig(name="s", embedding_dim=4, num_embeddings=16, feature_names=["g"])]
        )

    def forward(self, kjt, stock_kjt):
        return self.dyn(kjt).values(), self.stock(stock_kjt).values()


def test_quantize_inference_model_refuses_ours_and_says_how_to_keep_them_float():
    from torchrec.inference.modules import DEFAULT_QUANT_MAPPING, quantize_inference_model
    from torchrec.quant.embedding_modules import EmbeddingBagCollection as QuantEmbeddingBagCollection

    model = _TwoTables()
    with pytest.raises(TypeError, match=r"DynamicEmbeddingBagCollection has no quantized .* quantization_mapping="):
        quantize_inference_model(model)
    assert isinstance(model.dyn, DynamicEmbeddingBagCollection)

    # What the message says: TorchRec's table is quantized, ours stays float and computes as before.
    model = _TwoTables()
    kjt, stock_kjt = (
        _kjt(["f"]),
        KeyedJaggedTensor(keys=["g"], values=torch.tensor([1, 2, 3]), lengths=torch.tensor([1, 2, 0])),
    )
    model.dyn(kjt)  # rows for these ids
    model.eval()
    before = model(kjt, stock_kjt)
    mapping = {k: v for k, v in DEFAULT_QUANT_MAPPING.items() if not k.startswith("torchrec_ext.")}
    quantize_inference_model(model, quantization_mapping=mapping)
    assert isinstance(model.stock, QuantEmbeddingBagCollection)
    assert isinstance(model.dyn, DynamicEmbeddingBagCollection)
    after = model(kjt, stock_kjt)
    torch.testing.assert_close(after[0], before[0], rtol=0, atol=0)
    torch.testing.assert_close(after[1].float(), before[1], rtol=0.05, atol=0.02)  # int8 rows


def test_quantize_refusal_names_the_collection():
    from torchrec.inference.modules import quantize_inference_model

    model = nn.ModuleDict(
        {
            "seq": DynamicEmbeddingCollection(
                [EmbeddingConfig(name="t", embedding_dim=4, num_embeddings=8, feature_names=["f"])]
            )
        }
    )
    with pytest.raises(TypeError, match="DynamicEmbeddingCollection has no quantized"):
        quantize_inference_model(model)


# ------------------------------------------------------------------ embedding towers


def test_embedding_tower_collection_feeds_ours_the_kjt_each_reads():
    """TorchRec's tower collection passes (features, weighted_features) to modules it does not
    know; TorchRec's own EBC would get only the one it reads. Outputs equal each module's own."""
    from torchrec.modules.embedding_tower import EmbeddingTower, EmbeddingTowerCollection

    plain, weighted = _bags(["a"]), _bags(["w"], weighted=True)
    seq = DynamicEmbeddingCollection(
        [EmbeddingConfig(name="t_s", embedding_dim=4, num_embeddings=64, feature_names=["a"])]
    )
    features, weighted_features = _kjt(["a"], 1), _kjt(["w"], 2, weighted=True)
    pooled = lambda kt: kt.values()
    first = lambda jts: jts["a"].to_padded_dense(desired_length=4).sum(1)

    class Interaction(nn.Module):
        def __init__(self, fn):
            super().__init__()
            self.fn = fn

        def forward(self, x):
            return self.fn(x)

    towers = EmbeddingTowerCollection(
        [
            EmbeddingTower(plain, Interaction(pooled)),
            EmbeddingTower(weighted, Interaction(pooled)),
            EmbeddingTower(seq, Interaction(first)),
        ]
    )
    got = towers(features, weighted_features)  # training: inserts the ids' rows
    for module in (plain, weighted, seq):
        module.eval()
    want = torch.cat([plain(features).values(), weighted(weighted_features).values(), first(seq(features))], dim=1)
    torch.testing.assert_close(got, want)
    assert want.abs().sum() > 0


def test_embedding_tower_sharder_refuses_ours_itself():
    from torchrec.distributed.embedding_tower_sharding import EmbeddingTowerSharder
    from torchrec.modules.embedding_tower import EmbeddingTower

    with pytest.raises(RuntimeError, match="nsupported embedding type"):
        EmbeddingTowerSharder().embedding_sharder(EmbeddingTower(_bags(["a"]), nn.Identity()))


# ------------------------------------------------------------------ managed collision


def _mc_collection(configs):
    from torchrec.modules.mc_modules import (
        DistanceLFU_EvictionPolicy,
        ManagedCollisionCollection,
        MCHManagedCollisionModule,
    )

    return ManagedCollisionCollection(
        {
            c.name: MCHManagedCollisionModule(
                zch_size=c.num_embeddings,
                device=torch.device("cpu"),
                eviction_interval=1,
                input_hash_size=2**62,
                eviction_policy=DistanceLFU_EvictionPolicy(),
            )
            for c in configs
        },
        embedding_configs=configs,
    )


@pytest.mark.parametrize("kind", ["ebc", "ec"])
def test_managed_collision_over_ours_remaps_then_looks_up(kind):
    from torchrec.modules.mc_embedding_modules import (
        ManagedCollisionEmbeddingBagCollection,
        ManagedCollisionEmbeddingCollection,
    )

    if kind == "ebc":
        configs = [EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=64, feature_names=["f"])]
        module, wrapper = DynamicEmbeddingBagCollection(configs), ManagedCollisionEmbeddingBagCollection
    else:
        configs = [EmbeddingConfig(name="t", embedding_dim=4, num_embeddings=64, feature_names=["f"])]
        module, wrapper = DynamicEmbeddingCollection(configs), ManagedCollisionEmbeddingCollection
    mc = wrapper(module, _mc_collection(configs), return_remapped_features=True)
    kjt = _kjt(["f"], 3)
    out, remapped = mc(kjt)
    assert int(remapped.values().max()) < 64  # the MC module's slots, which our table then maps
    module.eval()
    want = module(remapped)
    if kind == "ebc":
        torch.testing.assert_close(out.values(), want.values())
    else:
        torch.testing.assert_close(out["f"].values(), want["f"].values())


@pytest.mark.parametrize("container", ["mc", "tower"])
def test_planning_a_tower_or_mc_module_over_ours_is_refused_naming_it(container):
    """DMP's planner with our sharders: TorchRec's MC sharder found no kernel for ours (an opaque
    error about table t), and a tower's dynamic module was sharded alone, then failed in forward
    (the tower passes it two KJTs). Both are refused at planning, naming the module."""
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.types import PlannerError
    from torchrec.modules.embedding_tower import EmbeddingTower, EmbeddingTowerCollection
    from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection

    from torchrec_ext.distributed import get_sharders

    configs = [EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=64, feature_names=["f"])]
    if container == "mc":
        inner = ManagedCollisionEmbeddingBagCollection(DynamicEmbeddingBagCollection(configs), _mc_collection(configs))
        where = (
            r"m\._embedding_module \(DynamicEmbeddingBagCollection inside ManagedCollisionEmbeddingBagCollection m\)"
        )
    else:
        inner = EmbeddingTowerCollection([EmbeddingTower(DynamicEmbeddingBagCollection(configs), nn.Identity())])
        where = r"m\.towers\.0\.embedding \(DynamicEmbeddingBagCollection inside EmbeddingTowerCollection m\)"
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=1, compute_device="cpu"))
    with pytest.raises(PlannerError, match=rf"cannot be sharded over a dynamic collection: {where}"):
        planner.plan(nn.ModuleDict({"m": inner}), get_sharders())
