"""Every sharding type of dynamic tables forced through TorchRec's own EmbeddingShardingPlanner
(ParameterConstraints(sharding_types=[...])) and run by DistributedModelParallel on 2 gloo ranks:
outputs and table contents equal the unsharded module fed the global batch, EBC (sum, mean,
weighted) and EC; table_row_wise on 2 nodes x 1 rank (local_world_size=1), 1 node x 2 ranks, and
on 4 ranks as 2 nodes x 2 ranks.
Also the routing of table-row-wise groups smaller than the world, against brute force."""

import torch
import torch.distributed as dist
from torchrec import DataType, KeyedJaggedTensor, PoolingType

from dist_helpers import ModelWith, assert_same_tables, global_batch, run_ranks
from torchrec_ext import (
    DynamicEmbeddingBagCollection,
    DynamicEmbeddingBagConfig,
    DynamicEmbeddingCollection,
    DynamicEmbeddingConfig,
)

WORLD, BATCH, KEYS = 2, 4, ["f1", "f2"]
# (sharding type, local_world_size): table_row_wise on 2 nodes x 1 rank and on 1 node x 2 ranks
CASES = [("column_wise", 2), ("table_column_wise", 2), ("table_row_wise", 1), ("table_row_wise", 2)]


def _rank_batch(step, rank, weighted):
    gen = torch.Generator().manual_seed(step * 10 + rank)
    lengths = torch.randint(0, 3, (len(KEYS) * BATCH,), generator=gen)
    n = int(lengths.sum())
    return KeyedJaggedTensor(
        keys=KEYS,
        values=torch.randint(0, 30, (n,), generator=gen) * 7919,
        lengths=lengths,
        stride=BATCH,
        weights=torch.rand(n, generator=gen) if weighted else None,
    )


def _make(kind, weighted, dim=8):
    if kind == "ebc":
        return DynamicEmbeddingBagCollection(
            [
                DynamicEmbeddingBagConfig(name="t1", embedding_dim=dim, num_embeddings=64, feature_names=["f1"]),
                DynamicEmbeddingBagConfig(
                    name="t2", embedding_dim=8, num_embeddings=64, feature_names=["f2"], pooling=PoolingType.MEAN
                ),
            ],
            is_weighted=weighted,
            optimizer="adagrad",
            optimizer_kwargs={"lr": 0.1},
        )
    return DynamicEmbeddingCollection(
        [DynamicEmbeddingConfig(name="t1", embedding_dim=dim, num_embeddings=64, feature_names=["f1", "f2"])],
        optimizer="adam",
        optimizer_kwargs={"lr": 0.1},
    )


KINDS = (("ebc", False), ("ebc", True), ("ec", False))


def _planned(rank, world_size, cases=CASES, dim=8, kinds=KINDS, checkpoints=True):
    """Each (sharding type, local_world_size) of ``cases`` forced on both tables (t1 of width
    ``dim``; column shards of 4 columns), planned, run and (``checkpoints``) checkpointed in DMP,
    for each (module kind, weighted) of ``kinds``."""
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology

    from torchrec_ext.distributed import full_state_dict, get_sharders

    for sharding_type, local in cases:
        for kind, weighted in kinds:
            reference, model = _make(kind, weighted, dim), ModelWith("m", _make(kind, weighted, dim))
            constraints = {
                t: ParameterConstraints(sharding_types=[sharding_type], min_partition=4) for t in ("t1", "t2")
            }
            planner = EmbeddingShardingPlanner(
                topology=Topology(world_size=world_size, local_world_size=local, compute_device="cpu"),
                batch_size=BATCH,
                constraints=constraints,
            )
            plan = planner.collective_plan(model, get_sharders(), dist.group.WORLD)
            assert {p.sharding_type for p in plan.plan["m"].values()} == {sharding_type}
            if sharding_type == "table_row_wise":  # each table's rows within one node's ranks
                for table, spec in plan.plan["m"].items():
                    assert len({r // local for r in spec.ranks}) == 1, (table, spec.ranks)
            if sharding_type == "column_wise":  # dim / 4 column shards of 4, on both ranks
                assert sorted(set(plan.plan["m"]["t1"].ranks)) == [0, 1]
                assert len(plan.plan["m"]["t1"].ranks) == dim // 4
            dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=get_sharders())
            for step in range(2):
                kjts = [_rank_batch(step, r, weighted) for r in range(world_size)]
                out = dmp(kjts[rank])
                want = reference(global_batch(kjts))
                if kind == "ebc":
                    torch.testing.assert_close(out.values(), want.values()[rank * BATCH : (rank + 1) * BATCH])
                    out.values().sum().backward()
                    (want.values().sum() / world_size).backward()  # the ranks train on their losses' mean
                    continue
                out = out.wait() if hasattr(out, "wait") else out
                loss = ref_loss = 0
                for name, jt in out.items():
                    before = sum(int(kjts[r][name.split("@")[0]].lengths().sum()) for r in range(rank))
                    n = int(jt.lengths().sum())
                    torch.testing.assert_close(jt.values(), want[name].values()[before : before + n])
                    loss, ref_loss = loss + jt.values().sum(), ref_loss + want[name].values().sum()
                loss.backward()
                ref_loss.backward()  # each id's gradient comes whole from the rank whose batch holds it
            prefix = "m.embedding_bags." if kind == "ebc" else "m.embeddings."
            whole = full_state_dict(dmp.state_dict())
            assert_same_tables(whole, {"m." + k: v for k, v in reference.state_dict().items()}, prefix)
            if not checkpoints:
                continue
            # Checkpoints: the sharded state and the whole tables load into a fresh DMP of the plan.
            for state in (dmp.state_dict(), whole):
                copy = DistributedModelParallel(
                    ModelWith("m", _make(kind, weighted, dim)),
                    device=torch.device("cpu"),
                    plan=plan,
                    sharders=get_sharders(),
                )
                copy.load_state_dict(state)
                assert_same_tables(full_state_dict(copy.state_dict()), whole, prefix)


def test_every_sharding_type_forced_by_constraints_runs_in_dmp_and_equals_unsharded():
    run_ranks(_planned, WORLD)


def test_table_row_wise_on_two_nodes_of_two_ranks_runs_in_dmp_and_equals_unsharded():
    # 4 ranks, local_world_size=2: a table's rows spread over its node's 2 ranks, ids routed
    # within that node (the weighted EBC's sum and mean tables, and the EC; 4 spawned ranks: lean).
    run_ranks(_planned, 4, [("table_row_wise", 2)], 8, (("ebc", True), ("ec", False)), False)


def test_column_plans_with_several_shards_per_rank_run_in_dmp_and_equal_unsharded():
    # TorchRec's planner splits a wide table into min_partition-column shards and deals them out
    # over the ranks (4 shards on 2 ranks: ranks [0, 1, 0, 1]); our planner hook gives each rank
    # adjacent shards, which the sharded module serves.
    run_ranks(_planned, WORLD, [("column_wise", 2), ("table_column_wise", 2)], 16)


def test_table_row_wise_groups_route_ids_within_their_node():
    from torchrec_ext import ops
    from torchrec_ext.distributed.placement import TablePlacement
    from torchrec_ext.distributed.routing import SlotRouting

    world, batch = 4, 3
    placements = [
        TablePlacement("row", (2, 3), ((0, 8),)),
        TablePlacement("table", (1,), ((0, 8),)),
        TablePlacement("row", (0, 1, 2, 3), ((0, 8),)),
        TablePlacement("column", (0, 3), ((0, 4), (4, 4))),
    ]
    routing = SlotRouting.of(["a", "b", "c", "d"], placements, world)
    assert routing.source == [0, 1, 2, 3, 3] and routing.slots_on(3) == [0, 2, 4] and routing.expands
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(0, 4, (4 * batch,), generator=gen)
    ids = torch.randint(-(2**50), 2**50, (int(lengths.sum()),), generator=gen)
    routed, order, expand = routing.route(ids, lengths, None, batch)
    # Brute force: each routing slot's ids, each to its rank, in (rank, slot, sample) order.
    per_slot = torch.split(ids, lengths.view(4, batch).sum(1).tolist())
    want = {r: [] for r in range(world)}
    for i, (s, dest) in enumerate(zip(routing.source, routing.dest)):
        bags = torch.split(per_slot[s], lengths.view(4, batch)[s].tolist())
        for b, bag in enumerate(bags):
            for id_ in bag.tolist():
                if isinstance(dest, int):
                    r = dest
                else:
                    r = dest[int(ops.route(torch.tensor([id_]), len(dest)))]
                want[r].append((i, b, id_))
    got_lengths = routed.lengths().view(world, len(routing.source), batch)
    values = iter(routed.values().tolist())
    for r in range(world):
        got = [
            (i, b, next(values))
            for i in range(len(routing.source))
            for b in range(batch)
            for _ in range(int(got_lengths[r, i, b]))
        ]
        assert got == sorted(want[r], key=lambda t: (t[0], t[1])), r
    assert torch.equal(ids[expand[order]], routed.values())  # positions lead back to the input ids


def _fp16_ebc(stochastic_rounding, optimizer="adagrad"):
    return DynamicEmbeddingBagCollection(
        [
            DynamicEmbeddingBagConfig(
                name="t1",
                embedding_dim=8,
                num_embeddings=64,
                feature_names=["f1", "f2"],
                data_type=DataType.FP16,
                stochastic_rounding=stochastic_rounding,
            )
        ],
        optimizer=optimizer,
        optimizer_kwargs={"lr": 0.1},
    )


def _column_plan(model, sharders, world_size, local=True):
    """The plan of EmbeddingShardingPlanner with t1 forced column_wise (2 shards of 4); ``local``:
    planned on each rank (an error is raised on every rank), else collectively."""
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology

    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world_size, compute_device="cpu"),
        batch_size=BATCH,
        constraints={"t1": ParameterConstraints(sharding_types=["column_wise"], min_partition=4)},
    )
    return planner.plan(model, sharders) if local else planner.collective_plan(model, sharders, dist.group.WORLD)


def _run_against(rank, world_size, dmp, reference, prefix="m.embedding_bags."):
    """Two training steps of ``dmp`` and of the unsharded ``reference`` fed the global batch:
    equal outputs and tables."""
    from torchrec_ext.distributed import full_state_dict

    for step in range(2):
        kjts = [_rank_batch(step, r, False) for r in range(world_size)]
        out, want = dmp(kjts[rank]), reference(global_batch(kjts))
        torch.testing.assert_close(out.values(), want.values()[rank * BATCH : (rank + 1) * BATCH])
        out.values().sum().backward()
        (want.values().sum() / world_size).backward()
    assert_same_tables(
        full_state_dict(dmp.state_dict()), {"m." + k: v for k, v in reference.state_dict().items()}, prefix
    )


def _sharder_stochastic_rounding_decides(rank, world_size):
    import pytest
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.planner.types import PlannerError
    from torchrec.distributed.sharding_plan import column_wise, construct_module_sharding_plan
    from torchrec.distributed.types import ShardingPlan

    from torchrec_ext.distributed import DynamicEmbeddingBagCollectionSharder

    # Config on, sharder off: the tables round to nearest, so column shards are exact.
    sharders = [DynamicEmbeddingBagCollectionSharder(fused_params={"stochastic_rounding": False})]
    model = ModelWith("m", _fp16_ebc(True))
    plan = _column_plan(model, sharders, world_size, local=False)
    assert plan.plan["m"]["t1"].sharding_type == "column_wise" and sorted(plan.plan["m"]["t1"].ranks) == [0, 1]
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=sharders)
    _run_against(rank, world_size, dmp, _fp16_ebc(False))

    # Config off, sharder on: stochastic rounding, refused by the planner and at sharding time.
    sharders = [DynamicEmbeddingBagCollectionSharder(fused_params={"stochastic_rounding": True})]
    with pytest.raises(
        PlannerError,
        match=r"cannot be split into column shards: it is torch.float16 with "
        r"stochastic_rounding",
    ):
        _column_plan(ModelWith("m", _fp16_ebc(False)), sharders, world_size)
    module = _fp16_ebc(False)
    hand = construct_module_sharding_plan(
        module,
        {"t1": column_wise(ranks=[0, 1], compute_kernel="customized_kernel")},
        sharder=sharders[0],
        local_size=world_size,
        world_size=world_size,
        device_type="cpu",
    )
    with pytest.raises(ValueError, match=r"table 't1' is torch.float16 with stochastic_rounding"):
        DistributedModelParallel(
            ModelWith("m", module), device=torch.device("cpu"), plan=ShardingPlan({"m": hand}), sharders=sharders
        )


def test_the_sharders_stochastic_rounding_decides_whether_a_column_plan_is_exact():
    run_ranks(_sharder_stochastic_rounding_decides, WORLD)


def _empty_batch(rank, world_size):
    from torchrec.distributed import DistributedModelParallel

    from torchrec_ext.distributed import get_sharders

    empty = KeyedJaggedTensor(
        keys=KEYS, values=torch.empty(0, dtype=torch.int64), lengths=torch.empty(0, dtype=torch.int64), stride=0
    )
    for kind in ("ebc", "ec"):
        model = ModelWith("m", _make(kind, False))
        plan = _column_plan(model, get_sharders(), world_size, local=False)
        assert plan.plan["m"]["t1"].sharding_type == "column_wise"
        dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=get_sharders())
        out = dmp(empty)
        if kind == "ebc":
            assert out.values().shape == (0, 16) and out.keys() == KEYS
        else:
            out = out.wait() if hasattr(out, "wait") else out
            assert all(out[name].values().shape == (0, 8) for name in out)
        # An empty batch changes nothing: a step after it equals the unsharded module's.
        reference = _make(kind, False)
        kjts = [_rank_batch(0, r, False) for r in range(world_size)]
        got, want = dmp(kjts[rank]), reference(global_batch(kjts))
        if kind == "ebc":
            torch.testing.assert_close(got.values(), want.values()[rank * BATCH : (rank + 1) * BATCH])
        else:
            got = got.wait() if hasattr(got, "wait") else got
            for name, jt in got.items():
                before = sum(int(kjts[r][name.split("@")[0]].lengths().sum()) for r in range(rank))
                torch.testing.assert_close(jt.values(), want[name].values()[before : before + jt.values().shape[0]])


def test_an_empty_batch_through_a_column_table():
    run_ranks(_empty_batch, WORLD)


def _sharder_optimizer_decides(rank, world_size):
    import pytest
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.distributed.planner.types import PlannerError

    from torchrec_ext.distributed import DynamicEmbeddingBagCollectionSharder
    from torchrec_ext.modules.fused_optimizer import spec_from_fused_params

    fused_params = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1}
    sharders = [DynamicEmbeddingBagCollectionSharder(fused_params=fused_params)]
    spec = spec_from_fused_params(fused_params, "test")
    make = lambda optimizer, kwargs: DynamicEmbeddingBagCollection(
        [DynamicEmbeddingBagConfig(name="t1", embedding_dim=8, num_embeddings=64, feature_names=["f1", "f2"])],
        optimizer=optimizer,
        optimizer_kwargs=kwargs,
    )
    # The module chooses no optimizer: the sharder's rowwise_adagrad trains it, so no column plan.
    with pytest.raises(PlannerError, match=r"cannot be split into column shards: it has optimizer 'rowwise_adagrad'"):
        _column_plan(ModelWith("m", make(None, None)), sharders, world_size)
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world_size, compute_device="cpu"),
        batch_size=BATCH,
        constraints={"t1": ParameterConstraints(sharding_types=["column_wise", "table_wise"], min_partition=4)},
    )
    model = ModelWith("m", make(None, None))
    plan = planner.collective_plan(model, sharders, dist.group.WORLD)
    assert plan.plan["m"]["t1"].sharding_type == "table_wise"
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=sharders)
    _run_against(rank, world_size, dmp, make(spec.kind, spec.torch_kwargs()))


def test_the_sharders_optimizer_decides_whether_a_table_gets_column_options():
    run_ranks(_sharder_optimizer_decides, WORLD)


def _rowwise_optimizer_whole_columns(rank, world_size):
    import pytest
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.distributed.sharding_plan import column_wise, construct_module_sharding_plan
    from torchrec.distributed.types import ShardingPlan

    from torchrec_ext.distributed import DynamicEmbeddingBagCollectionSharder

    sharder = DynamicEmbeddingBagCollectionSharder()
    make = lambda: DynamicEmbeddingBagCollection(
        [DynamicEmbeddingBagConfig(name="t1", embedding_dim=8, num_embeddings=64, feature_names=["f1", "f2"])],
        optimizer="rowwise_adagrad",
        optimizer_kwargs={"lr": 0.1},
    )
    # Planned: dim 8 with the default min_partition is one column shard, the whole table.
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world_size, compute_device="cpu"),
        batch_size=BATCH,
        constraints={"t1": ParameterConstraints(sharding_types=["column_wise"])},
    )
    model = ModelWith("m", make())
    plan = planner.collective_plan(model, [sharder], dist.group.WORLD)
    assert plan.plan["m"]["t1"].sharding_type == "column_wise" and len(plan.plan["m"]["t1"].ranks) == 1
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=[sharder])
    _run_against(rank, world_size, dmp, make())
    # By hand: two column shards on one rank hold every column there (exact); on two ranks, refused.
    for ranks in ([1, 1], [0, 1]):
        module = make()
        hand = construct_module_sharding_plan(
            module,
            {"t1": column_wise(ranks=ranks, compute_kernel="customized_kernel")},
            sharder=sharder,
            local_size=world_size,
            world_size=world_size,
            device_type="cpu",
        )
        shard = lambda: DistributedModelParallel(
            ModelWith("m", module), device=torch.device("cpu"), plan=ShardingPlan({"m": hand}), sharders=[sharder]
        )
        if ranks == [1, 1]:
            _run_against(rank, world_size, shard(), make())
        else:
            with pytest.raises(ValueError, match=r"table 't1' has optimizer 'rowwise_adagrad'"):
                shard()


def test_a_rowwise_optimizer_is_allowed_when_each_rank_holds_every_column():
    run_ranks(_rowwise_optimizer_whole_columns, WORLD)
