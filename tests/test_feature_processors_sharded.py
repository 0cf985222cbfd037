"""TorchRec's FeatureProcessedEmbeddingBagCollection over the dynamic EBC, sharded through
TorchRec's front doors (issue 14, item 7): DistributedModelParallel with get_sharders() and a
plan from TorchRec's EmbeddingShardingPlanner (each sharding type forced by constraints), or no
plan, on 2 gloo ranks. Outputs, position-weight gradients (DDP's mean over the ranks), position
weights trained by a dense optimizer, and tables equal the unsharded FP-EBC over our EBC fed the
global batch with the ranks' mean loss; TorchRec's and our train pipelines train it as a plain
loop does. An FP-EBC over TorchRec's EBC in the same model still gets TorchRec's own sharded
FP-EBC; the composable shard() keeps the unsharded FQNs."""

import pytest
import torch
import torch.distributed as dist
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.modules.feature_processor_ import PositionWeightedModule, PositionWeightedModuleCollection
from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection

from dist_helpers import ModelWith, assert_same_tables, copy_stock_table, global_batch, run_ranks
from torchrec_ext import DynamicEmbeddingBagCollection, DynamicEmbeddingBagConfig

WORLD, BATCH, MAX_LEN = 2, 4, 4
KEYS = ["f1", "f2", "f3"]
TOTAL_DIM = 16  # t1 (f1, f2): 4 each, t2 (f3): 8


def _fp_ebc(kind):
    ebc = DynamicEmbeddingBagCollection(
        [
            DynamicEmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=256, feature_names=["f1", "f2"]),
            DynamicEmbeddingBagConfig(name="t2", embedding_dim=8, num_embeddings=256, feature_names=["f3"]),
        ],
        is_weighted=True,
        optimizer="adagrad",
        optimizer_kwargs={"lr": 0.1},
    )
    if kind.startswith("collection"):
        processors = PositionWeightedModuleCollection(dict.fromkeys(KEYS, MAX_LEN))
        weights = list(processors.position_weights.values())
    else:
        processors = {k: PositionWeightedModule(MAX_LEN) for k in KEYS}
        weights = [m.position_weight for m in processors.values()]
    with torch.no_grad():
        for i, w in enumerate(weights):
            w.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(i))
    return FeatureProcessedEmbeddingBagCollection(ebc, processors)


class _Model(torch.nn.Module):
    """The FP-EBC as ``.fp``, returning its pooled tensor, or with kind "...-kt" its KeyedTensor
    itself (DDP, around the dense part, looks for the tensors a model returns: sharded, the
    KeyedTensor is an awaitable, which it must see through)."""

    def __init__(self, kind):
        super().__init__()
        self.fp = _fp_ebc(kind)
        self.returns_keyed_tensor = kind.endswith("-kt")

    def forward(self, kjt):
        pooled = self.fp(kjt)
        return pooled if self.returns_keyed_tensor else pooled.values()


def _rank_batch(step, rank):
    gen = torch.Generator().manual_seed(step * 10 + rank)
    lengths = torch.randint(0, MAX_LEN + 1, (len(KEYS) * BATCH,), generator=gen)
    values = torch.randint(0, 12, (int(lengths.sum()),), generator=gen) * 7919  # ids recur across steps
    return KeyedJaggedTensor(keys=KEYS, values=values, lengths=lengths, stride=BATCH)


def _upstream(step):
    return torch.randn(BATCH * WORLD, TOTAL_DIM, generator=torch.Generator().manual_seed(100 + step))


def _position_weights(named_parameters):
    """By their name in the unsharded model (DMP's and DDP's wrappers' prefixes dropped)."""
    return {n[n.index("fp.") :]: p for n, p in named_parameters if "position_weight" in n}


def _train_and_compare(rank, world_size, dmp, reference, steps=3):
    """Each step: outputs, then position-weight gradients equal the reference's; both take a
    dense SGD step on their position weights (the tables train in backward)."""
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    ours, theirs = _position_weights(dmp.named_parameters()), _position_weights(reference.named_parameters())
    assert sorted(ours) == sorted(theirs) and len(ours) == len(KEYS), (sorted(ours), sorted(theirs))
    dense = dict(in_backward_optimizer_filter(dmp.named_parameters()))
    assert len(dense) == len(KEYS)  # the position weights only: the tables train in backward
    dense_opt = torch.optim.SGD(list(dense.values()), lr=0.5)
    ref_opt = torch.optim.SGD(list(theirs.values()), lr=0.5)
    for step in range(steps):
        kjts = [_rank_batch(step, r) for r in range(world_size)]
        want, out = reference(global_batch(kjts)), dmp(kjts[rank])
        if reference.returns_keyed_tensor:
            want, out = want.values(), out.values()
        mine = slice(rank * BATCH, (rank + 1) * BATCH)
        torch.testing.assert_close(out, want[mine], rtol=1e-5, atol=1e-5)
        dense_opt.zero_grad()
        ref_opt.zero_grad()
        (out * _upstream(step)[mine]).sum().backward()
        ((want * _upstream(step)).sum() / world_size).backward()  # the ranks train on their losses' mean
        for name, p in theirs.items():
            assert p.grad is not None and p.grad.abs().sum() > 0, name
            torch.testing.assert_close(ours[name].grad, p.grad, rtol=1e-5, atol=1e-6, msg=name)
        dense_opt.step()
        ref_opt.step()
    for name, p in theirs.items():
        torch.testing.assert_close(ours[name].detach(), p.detach(), rtol=1e-5, atol=1e-6, msg=name)


CASES = [
    ("row_wise", "collection"),
    ("table_wise", "collection"),
    ("column_wise", "collection"),
    ("table_row_wise", "collection"),
    ("row_wise", "modules"),
    ("table_wise", "modules"),
    ("table_wise", "collection-kt"),
]


def _planned(rank, world_size, cases):
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology

    from torchrec_ext.distributed import (
        ShardedFeatureProcessedDynamicEmbeddingBagCollection,
        full_state_dict,
        get_sharders,
    )

    for sharding_type, kind in cases:
        reference, model = _Model(kind), _Model(kind)
        constraints = {t: ParameterConstraints(sharding_types=[sharding_type], min_partition=4) for t in ("t1", "t2")}
        planner = EmbeddingShardingPlanner(
            topology=Topology(world_size=world_size, compute_device="cpu"), batch_size=BATCH, constraints=constraints
        )
        plan = planner.collective_plan(model, get_sharders(), dist.group.WORLD)
        assert {p.sharding_type for p in plan.plan["fp"].values()} == {sharding_type}
        assert {p.compute_kernel for p in plan.plan["fp"].values()} == {"customized_kernel"}
        dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=get_sharders())
        assert isinstance(dmp.module.fp, ShardedFeatureProcessedDynamicEmbeddingBagCollection)
        _train_and_compare(rank, world_size, dmp, reference)
        state = dmp.state_dict()
        assert_same_tables(
            full_state_dict(state), reference.state_dict(), "fp._embedding_bag_collection.embedding_bags."
        )
        for name, value in reference.state_dict().items():
            if "position_weight" in name:
                torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("cases", [CASES[:3], CASES[3:]], ids=["rw-tw-cw", "twrw-modules"])
def test_fp_ebc_over_dynamic_ebc_shards_through_the_planner_and_equals_unsharded(cases):
    run_ranks(_planned, WORLD, cases)


# ------------------------------------------------------------------ no plan, next to TorchRec's FP-EBC


class _TwoFpEbcs(torch.nn.Module):
    """An FP-EBC over our EBC and one over TorchRec's, fed the same KJT."""

    def __init__(self):
        super().__init__()
        self.dyn = _fp_ebc("collection")
        torch.manual_seed(0)
        stock = EmbeddingBagCollection(
            [EmbeddingBagConfig(name="s1", embedding_dim=4, num_embeddings=16, feature_names=["f1"])], is_weighted=True
        )
        self.stock = FeatureProcessedEmbeddingBagCollection(stock, PositionWeightedModuleCollection({"f1": MAX_LEN}))

    def forward(self, kjt):
        return torch.cat([self.dyn(kjt).values(), self.stock(kjt).values()], dim=1)


def _dmp_without_plan(rank, world_size):
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.fp_embeddingbag import ShardedFeatureProcessedEmbeddingBagCollection

    from torchrec_ext.distributed import ShardedFeatureProcessedDynamicEmbeddingBagCollection, get_sharders

    model, reference = _TwoFpEbcs(), _TwoFpEbcs()
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), sharders=get_sharders())
    assert type(dmp.module.dyn) is ShardedFeatureProcessedDynamicEmbeddingBagCollection
    assert type(dmp.module.stock) is ShardedFeatureProcessedEmbeddingBagCollection  # TorchRec's, over its EBC
    assert {p.compute_kernel for p in dmp.plan.plan["dyn"].values()} == {"customized_kernel"}
    assert "customized_kernel" not in {p.compute_kernel for p in dmp.plan.plan["stock"].values()}
    copy_stock_table(
        dmp,
        "stock._embedding_bag_collection.embedding_bags.s1.weight",
        reference.stock._embedding_bag_collection.embedding_bags["s1"],
    )
    for step in range(2):
        kjts = [
            KeyedJaggedTensor(keys=KEYS, values=(k.values() % 16), lengths=k.lengths(), stride=BATCH)
            for k in (_rank_batch(step, r) for r in range(world_size))
        ]
        want = reference.dyn(global_batch(kjts)).values()
        stock_want = reference.stock(global_batch(kjts)).values() if step == 0 else None
        out = dmp(kjts[rank])
        mine = slice(rank * BATCH, (rank + 1) * BATCH)
        torch.testing.assert_close(out[:, :TOTAL_DIM], want[mine], rtol=1e-5, atol=1e-5)
        if stock_want is not None:  # TorchRec's table trains with its own optimizer: the first forward only
            torch.testing.assert_close(out[:, TOTAL_DIM:], stock_want[mine], rtol=1e-5, atol=1e-5)
        out[:, :TOTAL_DIM].sum().backward()
        (want.sum() / world_size).backward()


def test_dmp_without_plan_shards_fp_ebcs_over_both_ebcs():
    run_ranks(_dmp_without_plan, WORLD)


# ------------------------------------------------------------------ missing sharders are loud


def test_planning_without_our_fp_sharder_names_get_sharders():
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.types import PlannerError
    from torchrec.distributed.sharding_plan import get_default_sharders

    from torchrec_ext.distributed import DynamicEmbeddingBagCollectionSharder, get_sharders

    planner = EmbeddingShardingPlanner(topology=Topology(world_size=WORLD, compute_device="cpu"), batch_size=BATCH)
    model = ModelWith("fp", _fp_ebc("collection"))
    # TorchRec's FP sharder would shard our EBC inside with TorchRec's EBC sharder.
    for sharders in (
        list(get_default_sharders()),
        [DynamicEmbeddingBagCollectionSharder()] + list(get_default_sharders()),
    ):
        with pytest.raises(PlannerError, match=r"fp.*torchrec_ext\.distributed\.get_sharders\(\)"):
            planner.plan(model, sharders)
    assert set(planner.plan(model, get_sharders()).plan["fp"]) == {"t1", "t2"}


# ------------------------------------------------------------------ composable shard()


def _composable_shard(rank, world_size):
    from torchrec.distributed.shard import shard
    from torchrec.distributed.sharding_plan import row_wise, table_wise

    from torchrec_ext.distributed import ShardedFeatureProcessedDynamicEmbeddingBagCollection, full_state_dict

    module, reference = _fp_ebc("collection"), _fp_ebc("collection")
    names, modules = [n for n, _ in module.named_parameters()], [n for n, _ in module.named_modules()]
    # No sharder given: TorchRec finds ours for an FP-EBC (import torchrec_ext.distributed).
    sharded = shard(
        module,
        plan={"t1": row_wise(), "t2": table_wise(rank=1)},  # rank 0 holds no t2
        device=torch.device("cpu"),
    )
    assert isinstance(sharded, ShardedFeatureProcessedDynamicEmbeddingBagCollection)
    assert [n for n, _ in sharded.named_parameters()] == names
    assert [n for n, _ in sharded.named_modules()] == modules
    for step in range(3):  # no DDP here: the position weights stay as they are, the tables train
        kjts = [_rank_batch(step, r) for r in range(world_size)]
        want = reference(global_batch(kjts)).values()
        out = sharded(kjts[rank]).values()
        mine = slice(rank * BATCH, (rank + 1) * BATCH)
        torch.testing.assert_close(out, want[mine], rtol=1e-5, atol=1e-5)
        (out * _upstream(step)[mine]).sum().backward()
        ((want * _upstream(step)).sum() / world_size).backward()
    assert_same_tables(
        full_state_dict(sharded.state_dict()), reference.state_dict(), "_embedding_bag_collection.embedding_bags."
    )


def test_composable_shard_of_fp_ebc_over_dynamic_ebc():
    run_ranks(_composable_shard, WORLD)


# ------------------------------------------------------------------ pipelines


class _FpTrain(torch.nn.Module):
    """An FP-EBC over our EBC (f0..f2) and a linear layer on its pooled output and the dense
    features; forward(batch) -> (loss, (loss, logits)), as DLRMTrain's (a pipeline's progress
    returns the second item)."""

    def __init__(self):
        from dist_helpers import DENSE_IN, DIM, NUM_TABLES, ROWS

        super().__init__()
        torch.manual_seed(0)
        keys = [f"f{i}" for i in range(NUM_TABLES)]
        ebc = DynamicEmbeddingBagCollection(
            [
                DynamicEmbeddingBagConfig(name=f"t{i}", embedding_dim=DIM, num_embeddings=4 * ROWS, feature_names=[k])
                for i, k in enumerate(keys)
            ],
            is_weighted=True,
            optimizer="adagrad",
            optimizer_kwargs={"lr": 0.05},
        )
        self.fp = FeatureProcessedEmbeddingBagCollection(ebc, PositionWeightedModuleCollection(dict.fromkeys(keys, 4)))
        self.over = torch.nn.Linear(NUM_TABLES * DIM + DENSE_IN, 1)

    def forward(self, batch):
        pooled = self.fp(batch.sparse_features).values()
        logits = self.over(torch.cat([pooled, batch.dense_features], dim=1)).squeeze(1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
        return loss, (loss.detach(), logits.detach())


def _fp_dmp(world_size):
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.sharding_plan import column_wise, construct_module_sharding_plan, row_wise, table_wise
    from torchrec.distributed.types import ShardingPlan
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    from torchrec_ext.distributed import get_sharders

    model = _FpTrain()
    plan = construct_module_sharding_plan(
        model.fp,
        {"t0": row_wise(), "t1": table_wise(rank=1), "t2": column_wise(ranks=[0, 1])},
        local_size=world_size,
        world_size=world_size,
        device_type="cpu",
    )
    dmp = DistributedModelParallel(
        model, device=torch.device("cpu"), plan=ShardingPlan({"fp": plan}), sharders=get_sharders()
    )
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())), lambda params: torch.optim.SGD(params, lr=0.5)
    )
    return dmp, CombinedOptimizer([dmp.fused_optimizer, dense])


def _pipelines(rank, world_size):
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    from dist_helpers import local_state, make_batches, plain_loop, progress_losses
    from torchrec_ext.pipeline import TrainPipeline

    batches = make_batches(rank, batch_size=8, num_full=4, last=5)
    model, optimizer = _fp_dmp(world_size)
    want_losses, want_state = plain_loop(model, optimizer, batches), local_state(model)
    assert any("position_weight" in k for k in want_state)
    for make in (
        lambda m, o: TrainPipelineSparseDist(m, o, torch.device("cpu"), execute_all_batches=True),
        lambda m, o: TrainPipeline(m, o, torch.device("cpu")),
    ):
        model, optimizer = _fp_dmp(world_size)
        pipeline = make(model, optimizer)
        losses = progress_losses(pipeline, batches)
        if hasattr(pipeline, "close"):
            pipeline.close()
        assert len(losses) == len(want_losses)
        for step, (got, want) in enumerate(zip(losses, want_losses)):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=f"{type(pipeline).__name__}: step {step}")
        state = local_state(model)
        assert state.keys() == want_state.keys()
        for key in want_state:
            torch.testing.assert_close(state[key], want_state[key], rtol=1e-6, atol=1e-6, msg=key)


def test_pipelines_train_the_sharded_fp_ebc_as_a_plain_loop():
    run_ranks(_pipelines, WORLD)
