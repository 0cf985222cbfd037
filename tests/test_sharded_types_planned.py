"""Every sharding type of dynamic tables forced through TorchRec's own EmbeddingShardingPlanner
(ParameterConstraints(sharding_types=[...])) and run by DistributedModelParallel on 2 gloo ranks:
outputs and table contents equal the unsharded module fed the global batch, EBC (sum, mean,
weighted) and EC; table_row_wise on 2 nodes x 1 rank (local_world_size=1) and 1 node x 2 ranks.
Also the routing of table-row-wise groups smaller than the world, against brute force."""
import torch
import torch.distributed as dist
from torchrec import KeyedJaggedTensor, PoolingType

from dist_helpers import ModelWith, assert_same_tables, global_batch, run_ranks
from torchrec_ext import (
    DynamicEmbeddingBagCollection, DynamicEmbeddingBagConfig, DynamicEmbeddingCollection, DynamicEmbeddingConfig,
)

WORLD, BATCH, KEYS = 2, 4, ["f1", "f2"]
# (sharding type, local_world_size): table_row_wise on 2 nodes x 1 rank and on 1 node x 2 ranks
CASES = [("column_wise", 2), ("table_column_wise", 2), ("table_row_wise", 1), ("table_row_wise", 2)]


def _rank_batch(step, rank, weighted):
    gen = torch.Generator().manual_seed(step * 10 + rank)
    lengths = torch.randint(0, 3, (len(KEYS) * BATCH,), generator=gen)
    n = int(lengths.sum())
    return KeyedJaggedTensor(keys=KEYS, values=torch.randint(0, 30, (n,), generator=gen) * 7919, lengths=lengths,
                             stride=BATCH, weights=torch.rand(n, generator=gen) if weighted else None)


def _make(kind, weighted):
    if kind == "ebc":
        return DynamicEmbeddingBagCollection(
            [DynamicEmbeddingBagConfig(name="t1", embedding_dim=8, num_embeddings=64, feature_names=["f1"]),
             DynamicEmbeddingBagConfig(name="t2", embedding_dim=8, num_embeddings=64, feature_names=["f2"],
                                       pooling=PoolingType.MEAN)],
            is_weighted=weighted, optimizer="adagrad", optimizer_kwargs={"lr": 0.1})
    return DynamicEmbeddingCollection(
        [DynamicEmbeddingConfig(name="t1", embedding_dim=8, num_embeddings=64, feature_names=["f1", "f2"])],
        optimizer="adam", optimizer_kwargs={"lr": 0.1})


def _planned(rank, world_size):
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology

    from torchrec_ext.distributed import full_state_dict, get_sharders

    for sharding_type, local in CASES:
        for kind, weighted in (("ebc", False), ("ebc", True), ("ec", False)):
            reference, model = _make(kind, weighted), ModelWith("m", _make(kind, weighted))
            constraints = {t: ParameterConstraints(sharding_types=[sharding_type], min_partition=4)
                           for t in ("t1", "t2")}
            planner = EmbeddingShardingPlanner(
                topology=Topology(world_size=world_size, local_world_size=local, compute_device="cpu"),
                batch_size=BATCH, constraints=constraints)
            plan = planner.collective_plan(model, get_sharders(), dist.group.WORLD)
            assert {p.sharding_type for p in plan.plan["m"].values()} == {sharding_type}
            if sharding_type == "column_wise":  # two column shards, on both ranks
                assert sorted(plan.plan["m"]["t1"].ranks) == [0, 1]
            dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=get_sharders())
            for step in range(2):
                kjts = [_rank_batch(step, r, weighted) for r in range(world_size)]
                out = dmp(kjts[rank])
                want = reference(global_batch(kjts))
                if kind == "ebc":
                    torch.testing.assert_close(out.values(), want.values()[rank * BATCH:(rank + 1) * BATCH])
                    out.values().sum().backward()
                    (want.values().sum() / world_size).backward()  # the ranks train on their losses' mean
                    continue
                out = out.wait() if hasattr(out, "wait") else out
                loss = ref_loss = 0
                for name, jt in out.items():
                    before = sum(int(kjts[r][name.split("@")[0]].lengths().sum()) for r in range(rank))
                    n = int(jt.lengths().sum())
                    torch.testing.assert_close(jt.values(), want[name].values()[before:before + n])
                    loss, ref_loss = loss + jt.values().sum(), ref_loss + want[name].values().sum()
                loss.backward()
                ref_loss.backward()  # each id's gradient comes whole from the rank whose batch holds it
            prefix = "m.embedding_bags." if kind == "ebc" else "m.embeddings."
            whole = full_state_dict(dmp.state_dict())
            assert_same_tables(whole, {"m." + k: v for k, v in reference.state_dict().items()}, prefix)
            # Checkpoints: the sharded state and the whole tables load into a fresh DMP of the plan.
            for state in (dmp.state_dict(), whole):
                copy = DistributedModelParallel(ModelWith("m", _make(kind, weighted)), device=torch.device("cpu"),
                                                plan=plan, sharders=get_sharders())
                copy.load_state_dict(state)
                assert_same_tables(full_state_dict(copy.state_dict()), whole, prefix)


def test_every_sharding_type_forced_by_constraints_runs_in_dmp_and_equals_unsharded():
    run_ranks(_planned, WORLD)


def test_table_row_wise_groups_route_ids_within_their_node():
    from torchrec_ext import ops
    from torchrec_ext.distributed.placement import TablePlacement
    from torchrec_ext.distributed.routing import SlotRouting

    world, batch = 4, 3
    placements = [TablePlacement("row", (2, 3), ((0, 8),)), TablePlacement("table", (1,), ((0, 8),)),
                  TablePlacement("row", (0, 1, 2, 3), ((0, 8),)), TablePlacement("column", (0, 3), ((0, 4), (4, 4)))]
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
        got = [(i, b, next(values)) for i in range(len(routing.source)) for b in range(batch)
               for _ in range(int(got_lengths[r, i, b]))]
        assert got == sorted(want[r], key=lambda t: (t[0], t[1])), r
    assert torch.equal(ids[expand[order]], routed.values())  # positions lead back to the input ids
