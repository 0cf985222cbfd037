"""TorchRec's own front doors with our modules, on 2 gloo ranks: DistributedModelParallel with
our sharders and no plan, TorchRec's default EmbeddingShardingPlanner, construct_module_sharding_plan
and the composable shard(); and DMP with TorchRec's default sharders refusing our modules at
construction instead of leaving them out of the plan."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor

from dist_helpers import ModelWith, assert_same_tables, copy_stock_table, run_ranks
from torchrec_ext import DynamicEmbeddingBagCollection, DynamicEmbeddingBagConfig

WORLD = 2
BATCH = 4
KEYS = ["f1", "f2"]


def _dynamic():
    return DynamicEmbeddingBagCollection(
        [
            DynamicEmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=64, feature_names=["f1"]),
            DynamicEmbeddingBagConfig(name="t2", embedding_dim=4, num_embeddings=32, feature_names=["f2"]),
        ],
        optimizer="sgd",
        optimizer_kwargs={"lr": 0.5},
    )


def _stock():
    torch.manual_seed(0)
    return EmbeddingBagCollection(
        [EmbeddingBagConfig(name="s1", embedding_dim=4, num_embeddings=16, feature_names=["g"])]
    )


class _Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.dyn, self.stock = _dynamic(), _stock()

    def forward(self, kjt, stock_kjt):
        return torch.cat([self.dyn(kjt).values(), self.stock(stock_kjt).values()], dim=1)


def _batch(step, rank, keys=KEYS, rows=1000):
    gen = torch.Generator().manual_seed(step * 10 + rank)
    lengths = torch.randint(0, 3, (len(keys) * BATCH,), generator=gen)
    values = torch.randint(0, rows, (int(lengths.sum()),), generator=gen)
    return KeyedJaggedTensor(keys=keys, values=values, lengths=lengths, stride=BATCH)


def _global(kjts, keys=KEYS):
    per_key = [k.to_dict() for k in kjts]
    return KeyedJaggedTensor(
        keys=keys,
        values=torch.cat([jt[key].values() for key in keys for jt in per_key]),
        lengths=torch.cat([jt[key].lengths() for key in keys for jt in per_key]),
        stride=BATCH * len(kjts),
    )


def _train_and_compare(rank, world_size, sharded, reference, steps=3):
    """Forward + backward of the sharded model on each rank's batch equal the unsharded module on
    the global batch (the later steps' outputs check the updates of the earlier backwards)."""
    for step in range(steps):
        kjts = [_batch(step, r) for r in range(world_size)]
        out = sharded(kjts[rank]).values()
        want = reference(_global(kjts)).values()
        torch.testing.assert_close(out, want[rank * BATCH : (rank + 1) * BATCH], rtol=1e-5, atol=1e-5)
        out.sum().backward()
        (want.sum() / world_size).backward()  # the ranks train on their losses' mean


# ------------------------------------------------------------------ DMP with our sharders, no plan


def _dmp_without_plan(rank, world_size):
    from torchrec.distributed import DistributedModelParallel

    from torchrec_ext.distributed import ShardedDynamicEmbeddingBagCollection, get_sharders

    model, reference = _Mixed(), _Mixed()
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), sharders=get_sharders())
    assert isinstance(dmp.module.dyn, ShardedDynamicEmbeddingBagCollection)
    assert set(dmp.plan.plan["dyn"]) == {"t1", "t2"} and "s1" in dmp.plan.plan["stock"]
    assert {p.compute_kernel for p in dmp.plan.plan["dyn"].values()} == {"customized_kernel"}
    copy_stock_table(
        dmp, "stock.embedding_bags.s1.weight", reference.stock.embedding_bags["s1"]
    )  # TorchRec's sharded stock table draws its own initial rows
    stock_kjts = [_batch(0, r, ["g"], 16) for r in range(world_size)]
    for step in range(3):
        kjts = [_batch(step, r) for r in range(world_size)]
        out = dmp(kjts[rank], stock_kjts[rank])
        dyn_want = reference.dyn(_global(kjts)).values()[rank * BATCH : (rank + 1) * BATCH]
        torch.testing.assert_close(out[:, :8], dyn_want, rtol=1e-5, atol=1e-5)
        if step == 0:  # the stock table trains with TorchRec's own optimizer: compare its first forward only
            stock_want = reference.stock(_global(stock_kjts, ["g"])).values()[rank * BATCH : (rank + 1) * BATCH]
            torch.testing.assert_close(out[:, 8:], stock_want, rtol=1e-5, atol=1e-5)
        out[:, :8].sum().backward()
        (reference.dyn(_global(kjts)).values().sum() / world_size).backward()  # the ranks' losses' mean


def test_dmp_with_our_sharders_and_no_plan_plans_shards_and_trains():
    run_ranks(_dmp_without_plan, WORLD)


# ------------------------------------------------------------------ TorchRec's default planner


def test_default_planner_costs_our_tables_with_our_estimators():
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.enumerators import EmbeddingEnumerator

    from torchrec_ext.distributed import get_sharders, make_planner

    topology = Topology(world_size=WORLD, compute_device="cpu")
    plan = EmbeddingShardingPlanner(topology=topology, batch_size=64).plan(_Mixed(), get_sharders())
    assert set(plan.plan["dyn"]) == {"t1", "t2"} and "s1" in plan.plan["stock"]
    # Oracle: the options make_planner's enumerator (our estimators, passed explicitly) costs.
    model = _Mixed()
    default = EmbeddingEnumerator(topology=topology, batch_size=64).enumerate(model, get_sharders())
    explicit = make_planner(topology, batch_size=64)._enumerator.enumerate(model, get_sharders())
    key = lambda o: (o.fqn, o.sharding_type, o.compute_kernel)
    want = {key(o): [(s.storage, s.perf) for s in o.shards] for o in explicit}
    assert {key(o) for o in default} == set(want)
    for option in default:
        assert [(s.storage, s.perf) for s in option.shards] == want[key(option)], option.fqn


def _default_planner_collective(rank, world_size):
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology

    from torchrec_ext.distributed import get_sharders

    planner = EmbeddingShardingPlanner(topology=Topology(world_size=world_size, compute_device="cpu"))
    plan = planner.collective_plan(_Mixed(), get_sharders(), dist.group.WORLD)
    assert set(plan.plan["dyn"]) == {"t1", "t2"}
    assert {p.sharding_type for p in plan.plan["dyn"].values()} <= {"table_wise", "row_wise"}


def test_default_planner_collective_plan_covers_our_module():
    run_ranks(_default_planner_collective, WORLD)


# ------------------------------------------------------------------ construct_module_sharding_plan + DMP


def _constructed_plan(rank, world_size):
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
    from torchrec.distributed.types import ShardingPlan

    from torchrec_ext.distributed import DynamicEmbeddingBagCollectionSharder, get_sharders

    model, reference = ModelWith("ebc", _dynamic()), _dynamic()
    module_plan = construct_module_sharding_plan(
        model.ebc,
        {"t1": row_wise(), "t2": table_wise(rank=1)},
        sharder=DynamicEmbeddingBagCollectionSharder(),
        local_size=world_size,
        world_size=world_size,
        device_type="cpu",
    )
    assert module_plan["t1"].sharding_type == "row_wise" and module_plan["t2"].ranks == [1]
    dmp = DistributedModelParallel(
        model, device=torch.device("cpu"), plan=ShardingPlan({"ebc": module_plan}), sharders=get_sharders()
    )
    _train_and_compare(rank, world_size, dmp, reference)


def test_construct_module_sharding_plan_and_dmp():
    run_ranks(_constructed_plan, WORLD)


# ------------------------------------------------------------------ composable shard()


def _composable_shard(rank, world_size):
    from torchrec.distributed.shard import shard
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_wise

    from torchrec_ext.distributed import (
        DynamicEmbeddingBagCollectionSharder,
        ShardedDynamicEmbeddingBagCollection,
        full_state_dict,
    )

    per_table = {"t1": row_wise(), "t2": table_wise(rank=0)}  # rank 1 holds no t2
    # No sharder given: TorchRec looks ours up by module type (import torchrec_ext.distributed).
    module_plan = construct_module_sharding_plan(
        _dynamic(), dict(per_table), local_size=world_size, world_size=world_size, device_type="cpu"
    )
    # generators with our sharder, and the plan construct_module_sharding_plan made with none
    for plan, sharder in ((per_table, DynamicEmbeddingBagCollectionSharder()), (module_plan, None)):
        module, reference = _dynamic(), _dynamic()
        names, modules = [n for n, _ in module.named_parameters()], [n for n, _ in module.named_modules()]
        keys = list(module.state_dict())
        sharded = shard(module, plan=dict(plan), sharder=sharder, device=torch.device("cpu"))
        assert isinstance(sharded, ShardedDynamicEmbeddingBagCollection)
        # The unsharded module's names, on every rank (torch's composable contract checks them too).
        assert [n for n, _ in sharded.named_parameters()] == names
        assert [n for n, _ in sharded.named_modules()] == modules
        _train_and_compare(rank, world_size, sharded, reference)
        state = sharded.state_dict()
        assert list(state) == keys
        assert_same_tables(full_state_dict(state), reference.state_dict(), "embedding_bags.")


def test_composable_shard():
    run_ranks(_composable_shard, WORLD)


def _composable_shard_ec(rank, world_size):
    from torchrec.distributed.shard import shard
    from torchrec.distributed.sharding_plan import row_wise, table_wise

    from torchrec_ext import DynamicEmbeddingCollection, DynamicEmbeddingConfig
    from torchrec_ext.distributed import ShardedDynamicEmbeddingCollection, full_state_dict

    make = lambda: DynamicEmbeddingCollection(
        [
            DynamicEmbeddingConfig(name="t1", embedding_dim=4, num_embeddings=64, feature_names=["f1"]),
            DynamicEmbeddingConfig(name="t2", embedding_dim=4, num_embeddings=32, feature_names=["f2"]),
        ],
        optimizer="sgd",
        optimizer_kwargs={"lr": 0.5},
    )
    module, reference = make(), make()
    names, keys = [n for n, _ in module.named_parameters()], list(module.state_dict())
    sharded = shard(module, plan={"t1": row_wise(), "t2": table_wise(rank=0)}, device=torch.device("cpu"))
    assert isinstance(sharded, ShardedDynamicEmbeddingCollection)
    assert [n for n, _ in sharded.named_parameters()] == names  # rank 1 holds no t2
    for step in range(3):
        kjts = [_batch(step, r) for r in range(world_size)]
        out, want = sharded(kjts[rank]), reference(_global(kjts))
        out = out.wait() if hasattr(out, "wait") else out
        loss = 0
        for key in KEYS:
            before = sum(int(kjts[r][key].lengths().sum()) for r in range(rank))
            n = int(kjts[rank][key].lengths().sum())
            torch.testing.assert_close(out[key].values(), want[key].values()[before : before + n])
            loss = loss + out[key].values().sum()
        loss.backward()
        sum(jt.values().sum() for jt in want.values()).backward()  # each id's gradient from its own rank
    state = sharded.state_dict()
    assert list(state) == keys
    assert_same_tables(full_state_dict(state), reference.state_dict(), "embeddings.")


def test_composable_shard_of_an_embedding_collection():
    run_ranks(_composable_shard_ec, WORLD)


# ------------------------------------------------------------------ missing sharders are loud


def _dmp_default_sharders(rank, world_size):
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.planner.types import PlannerError

    import torchrec_ext.distributed  # noqa: F401  (installs the planner hook)

    with pytest.raises(PlannerError, match=r"torchrec_ext\.distributed\.get_sharders\(\).*") as error:
        DistributedModelParallel(_Mixed(), device=torch.device("cpu"))
    assert "dyn (DynamicEmbeddingBagCollection)" in str(error.value)


def test_dmp_with_default_sharders_refuses_our_modules_at_construction():
    run_ranks(_dmp_default_sharders, WORLD)


def test_the_one_line_swap_alone_makes_the_default_planner_refuse_our_modules():
    """A user who only swapped the class (``import torchrec_ext``, never ``torchrec_ext.distributed``)
    is refused at planning too, not silently left out of the plan and DDP-wrapped. A fresh
    interpreter: this test session has imported torchrec_ext.distributed already."""
    script = (
        "import sys, torch, torchrec_ext\n"
        "from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology\n"
        "from torchrec.distributed.planner.types import PlannerError\n"
        "from torchrec.distributed.sharding_plan import get_default_sharders\n"
        "ebc = torchrec_ext.DynamicEmbeddingBagCollection([torchrec_ext.DynamicEmbeddingBagConfig("
        "name='t1', embedding_dim=4, num_embeddings=64, feature_names=['f1'])])\n"
        "planner = EmbeddingShardingPlanner(topology=Topology(world_size=1, compute_device='cpu'))\n"
        "try:\n"
        "    planner.plan(torch.nn.ModuleDict({'dyn': ebc}), get_default_sharders())\n"
        "except PlannerError as error:\n"
        "    sys.exit(0 if 'torchrec_ext.distributed.get_sharders()' in str(error) else 2)\n"
        "sys.exit(1)\n"
    )
    root = str(Path(__file__).resolve().parents[1])  # this checkout's package, not the installed one
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
