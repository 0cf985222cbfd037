"""ShardedDynamicEmbeddingBagCollection on 2 real gloo ranks against the unsharded module fed
the global batch: same outputs and, after several training steps, the same table contents."""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor, PoolingType

from dist_helpers import ModelWith, run_ranks
from torchrec_ext import DynamicEmbeddingBagCollection, DynamicEmbeddingBagConfig, Initializer

WORLD = 2
BATCH = 6
KEYS = ["f1", "f2", "f3"]


def _configs():
    return [
        DynamicEmbeddingBagConfig(
            name="t1",
            embedding_dim=8,
            num_embeddings=512,
            feature_names=["f1", "f2"],
            initializer=Initializer("normal", std=0.5),
        ),
        DynamicEmbeddingBagConfig(
            name="t2", embedding_dim=4, num_embeddings=256, feature_names=["f3"], pooling=PoolingType.MEAN
        ),
        EmbeddingBagConfig(name="t3", embedding_dim=6, num_embeddings=128, feature_names=["f1"]),  # f1 shared
    ]


def _rank_batch(step: int, rank: int, weighted: bool) -> KeyedJaggedTensor:
    gen = torch.Generator().manual_seed(step * 100 + rank)
    lengths = torch.randint(0, 4, (len(KEYS) * BATCH,), generator=gen)
    n = int(lengths.sum())
    pool = torch.tensor([0, -1, 2**63 - 1, -(2**63), 5, 6, 7, 2**40, 123456789, -99])
    values = pool[torch.randint(0, len(pool), (n,), generator=gen)]
    return KeyedJaggedTensor(
        keys=KEYS,
        values=values,
        lengths=lengths,
        stride=BATCH,
        weights=torch.rand(n, generator=gen) if weighted else None,
    )


def _global_batch(kjts):
    """The samples of every rank's batch, rank after rank."""
    per_key = [k.to_dict() for k in kjts]
    values = torch.cat([jt[key].values() for key in KEYS for jt in per_key])
    lengths = torch.cat([jt[key].lengths() for key in KEYS for jt in per_key])
    weights = (
        torch.cat([jt[key].weights() for key in KEYS for jt in per_key])
        if kjts[0].weights_or_none() is not None
        else None
    )
    return KeyedJaggedTensor(keys=KEYS, values=values, lengths=lengths, weights=weights, stride=BATCH * len(kjts))


def _rows_by_id(module):
    sd = module.state_dict()
    return {
        cfg.name: dict(
            zip(sd[f"embedding_bags.{cfg.name}.weight_id"].tolist(), sd[f"embedding_bags.{cfg.name}.weight"])
        )
        for cfg in module.embedding_bag_configs()
    }


def _check_against_unsharded(rank, world_size, sharding, weighted, optimizer):
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
    from torchrec.distributed.types import ShardingEnv, ShardingPlan

    from torchrec_ext.distributed import DynamicEmbeddingBagCollectionSharder, get_sharders

    make = lambda: DynamicEmbeddingBagCollection(
        _configs(), is_weighted=weighted, optimizer=optimizer, optimizer_kwargs={"lr": 0.1}
    )
    reference = make()
    model = ModelWith("ebc", make())
    generators = {
        "row_wise": {t: row_wise(compute_kernel="customized_kernel") for t in ("t1", "t2", "t3")},
        "table_wise": {
            "t1": table_wise(rank=0, compute_kernel="customized_kernel"),
            "t2": table_wise(rank=1, compute_kernel="customized_kernel"),
            "t3": table_wise(rank=1, compute_kernel="customized_kernel"),
        },
        "mixed": {
            "t1": row_wise(compute_kernel="customized_kernel"),
            "t2": table_wise(rank=1, compute_kernel="customized_kernel"),
            "t3": row_wise(compute_kernel="customized_kernel"),
        },
    }[sharding]
    module_plan = construct_module_sharding_plan(
        model.ebc,
        generators,
        sharder=DynamicEmbeddingBagCollectionSharder(),
        local_size=world_size,
        world_size=world_size,
        device_type="cpu",
    )
    dmp = DistributedModelParallel(
        model,
        env=ShardingEnv.from_process_group(dist.group.WORLD),
        device=torch.device("cpu"),
        plan=ShardingPlan({"ebc": module_plan}),
        sharders=get_sharders(),
    )
    for step in range(4):
        kjts = [_rank_batch(step, r, weighted) for r in range(world_size)]
        grad_weights = [
            torch.randn(BATCH, 26, generator=torch.Generator().manual_seed(step * 7 + r)) for r in range(world_size)
        ]
        out = dmp(kjts[rank])
        want = reference(_global_batch(kjts))
        assert out.keys() == want.keys() == ["f1@t1", "f2", "f3", "f1@t3"]
        torch.testing.assert_close(out.values(), want.values()[rank * BATCH : (rank + 1) * BATCH], rtol=1e-5, atol=1e-5)
        (out.values() * grad_weights[rank]).sum().backward()
        (want.values() * torch.cat(grad_weights)).sum().backward()
    # Table contents: the union of the ranks' local tables equals the unsharded tables.
    local = _rows_by_id(dmp.module.ebc.local_module) if dmp.module.ebc.local_module is not None else {}
    gathered = [None] * world_size
    dist.all_gather_object(gathered, {t: {k: v.tolist() for k, v in rows.items()} for t, rows in local.items()})
    merged = {}
    for part in gathered:
        for t, rows in part.items():
            assert not set(rows) & set(merged.get(t, {})), f"an id of {t} lives on two ranks"
            merged.setdefault(t, {}).update(rows)
    want_rows = _rows_by_id(reference)
    assert set(merged) == set(want_rows)
    for t, rows in want_rows.items():
        assert set(merged[t]) == set(rows), t
        for k, v in rows.items():
            torch.testing.assert_close(torch.tensor(merged[t][k]), v, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "sharding,weighted,optimizer",
    [
        ("row_wise", False, "adagrad"),
        ("table_wise", True, "adam"),
        ("mixed", False, "rowwise_adagrad"),
    ],
)
def test_sharded_equals_unsharded_on_two_ranks(sharding, weighted, optimizer):
    run_ranks(_check_against_unsharded, WORLD, sharding, weighted, optimizer)


def _pipelines_equal_plain_loop(rank, world_size):
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    from dist_helpers import local_state, make_batches, make_dmp_dlrm, plain_loop
    from torchrec_ext.distributed import ShardedDynamicEmbeddingBagCollection
    from torchrec_ext.pipeline import TrainPipeline

    batches = make_batches(rank, batch_size=16, num_full=5, last=0)
    reference, reference_opt = make_dmp_dlrm(world_size, dynamic=True)
    assert isinstance(reference.module.model.sparse_arch.embedding_bag_collection, ShardedDynamicEmbeddingBagCollection)
    fused_keys = set(reference.fused_optimizer.params)
    assert "model.sparse_arch.embedding_bag_collection.embedding_bags.t0.weight" in fused_keys
    want = plain_loop(reference, reference_opt, batches)
    want_state = local_state(reference)
    for make_pipeline in (
        lambda m, o: TrainPipelineSparseDist(m, o, torch.device("cpu")),
        lambda m, o: TrainPipeline(m, o, torch.device("cpu")),
    ):
        model, optimizer = make_dmp_dlrm(world_size, dynamic=True)
        pipeline = make_pipeline(model, optimizer)
        it, losses = iter(batches), []
        while True:
            try:
                out = pipeline.progress(it)
            except StopIteration:
                break
            losses.append(out[0].detach().clone())
        # The sharded module really was pipelined (not run unpipelined after a failed rewrite).
        assert [type(m).__name__ for m in pipeline._pipelined_modules] == ["ShardedDynamicEmbeddingBagCollection"]
        if hasattr(pipeline, "close"):
            pipeline.close()
        assert len(losses) == len(want)
        for got, expected in zip(losses, want):
            torch.testing.assert_close(got, expected, rtol=0, atol=0)
        state = local_state(model)
        assert state.keys() == want_state.keys()
        for key in want_state:
            torch.testing.assert_close(state[key], want_state[key], rtol=0, atol=0, msg=key)


def test_torchrec_and_our_pipelines_equal_plain_loop():
    run_ranks(_pipelines_equal_plain_loop, WORLD)


def _bad_plans(rank, world_size):
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
    from torchrec.distributed.types import ShardingEnv, ShardingPlan

    from torchrec_ext.distributed import DynamicEmbeddingBagCollectionSharder, get_sharders

    def shard(generators, plan_world=world_size):
        model = ModelWith("ebc", DynamicEmbeddingBagCollection(_configs(), optimizer="sgd"))
        plan = construct_module_sharding_plan(
            model.ebc,
            generators,
            sharder=DynamicEmbeddingBagCollectionSharder(),
            local_size=plan_world,
            world_size=plan_world,
            device_type="cpu",
        )
        return DistributedModelParallel(
            model,
            env=ShardingEnv.from_process_group(dist.group.WORLD),
            device=torch.device("cpu"),
            plan=ShardingPlan({"ebc": plan}),
            sharders=get_sharders(),
        )

    kernel = "customized_kernel"
    with pytest.raises(ValueError, match=r"planned on ranks \[.*3.*\], but the process group has world size 2"):
        shard({t: table_wise(rank=3, compute_kernel=kernel) for t in ("t1", "t2", "t3")}, plan_world=4)
    with pytest.raises(ValueError, match=r"ranks \[0, 1, 2\], but the process group has world size 2"):
        shard({t: row_wise(compute_kernel=kernel) for t in ("t1", "t2", "t3")}, plan_world=3)
    with pytest.raises(ValueError, match=r"row-wise table 't1' must span all 2 ranks, got \[0\]"):
        shard({t: row_wise(compute_kernel=kernel) for t in ("t1", "t2", "t3")}, plan_world=1)


def test_plans_we_cannot_serve_are_clear_errors():
    run_ranks(_bad_plans, WORLD)


class _Mixed(nn.Module):
    def __init__(self, dynamic, stock):
        super().__init__()
        self.dynamic, self.stock = dynamic, stock

    def forward(self, kjt_dynamic, kjt_stock):
        return self.dynamic(kjt_dynamic).values().sum() + self.stock(kjt_stock).values().sum()


def _planned_mixed_model(rank, world_size):
    from torchrec import EmbeddingBagCollection
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.planner import Topology
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.optim import apply_optimizer_in_backward

    from torchrec_ext.distributed import ShardedDynamicEmbeddingBagCollection, get_sharders, make_planner

    dynamic = DynamicEmbeddingBagCollection(_configs(), optimizer="adagrad")
    stock = EmbeddingBagCollection(
        [EmbeddingBagConfig(name="s1", embedding_dim=4, num_embeddings=100, feature_names=["g"])]
    )
    apply_optimizer_in_backward(torch.optim.SGD, stock.parameters(), {"lr": 0.1})
    model = _Mixed(dynamic, stock)
    constraints = {
        "t1": ParameterConstraints(sharding_types=["row_wise"]),
        "t2": ParameterConstraints(sharding_types=["table_wise"]),
    }
    planner = make_planner(
        Topology(world_size=world_size, compute_device="cpu"), batch_size=BATCH, constraints=constraints
    )
    plan = planner.collective_plan(model, get_sharders(), dist.group.WORLD)
    ours = plan.plan["dynamic"]
    assert ours["t1"].sharding_type == "row_wise" and ours["t2"].sharding_type == "table_wise"
    assert {p.compute_kernel for p in ours.values()} == {"customized_kernel"}
    assert "s1" in plan.plan["stock"]
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=get_sharders())
    assert isinstance(dmp.module.dynamic, ShardedDynamicEmbeddingBagCollection)
    stock_kjt = KeyedJaggedTensor(keys=["g"], values=torch.tensor([1, 2, 3]), lengths=torch.tensor([1, 0, 2, 0, 0, 0]))
    for step in range(2):
        dmp(_rank_batch(step, rank, False), stock_kjt).backward()
    assert dmp.module.dynamic.local_module.num_live_rows() > 0


def test_planner_plans_a_mixed_model_that_dmp_trains():
    run_ranks(_planned_mixed_model, WORLD)
