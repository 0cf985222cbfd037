"""ShardedDynamicEmbeddingCollection on 2 real gloo ranks against the unsharded module fed the
global batch: the same sequences and, after training, the same table contents."""

import pytest
import torch
import torch.distributed as dist
from torchrec import EmbeddingConfig, KeyedJaggedTensor

from dist_helpers import ModelWith, run_ranks
from torchrec_ext import DynamicEmbeddingCollection, DynamicEmbeddingConfig

WORLD, BATCH, KEYS = 2, 5, ["f1", "f2", "f3"]


def _configs():
    return [
        DynamicEmbeddingConfig(name="t1", embedding_dim=4, num_embeddings=256, feature_names=["f1", "f2"]),
        EmbeddingConfig(name="t2", embedding_dim=4, num_embeddings=128, feature_names=["f3", "f1"]),
    ]


def _rank_batch(step, rank):
    gen = torch.Generator().manual_seed(step * 10 + rank)
    lengths = torch.randint(0, 4, (len(KEYS) * BATCH,), generator=gen)
    pool = torch.tensor([0, -1, 2**63 - 1, 3, 4, 2**50, -77])
    values = pool[torch.randint(0, len(pool), (int(lengths.sum()),), generator=gen)]
    return KeyedJaggedTensor(keys=KEYS, values=values, lengths=lengths, stride=BATCH)


def _check(rank, world_size, sharding):
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
    from torchrec.distributed.types import ShardingEnv, ShardingPlan

    from torchrec_ext.distributed import DynamicEmbeddingCollectionSharder, get_sharders

    make = lambda: DynamicEmbeddingCollection(
        _configs(), need_indices=True, optimizer="adagrad", optimizer_kwargs={"lr": 0.2}
    )
    reference, model = make(), ModelWith("ec", make())
    gens = {
        "row_wise": {
            "t1": row_wise(compute_kernel="customized_kernel"),
            "t2": row_wise(compute_kernel="customized_kernel"),
        },
        "mixed": {
            "t1": row_wise(compute_kernel="customized_kernel"),
            "t2": table_wise(rank=1, compute_kernel="customized_kernel"),
        },
    }[sharding]
    plan = construct_module_sharding_plan(
        model.ec,
        gens,
        sharder=DynamicEmbeddingCollectionSharder(),
        local_size=world_size,
        world_size=world_size,
        device_type="cpu",
    )
    dmp = DistributedModelParallel(
        model,
        env=ShardingEnv.from_process_group(dist.group.WORLD),
        device=torch.device("cpu"),
        plan=ShardingPlan({"ec": plan}),
        sharders=get_sharders(),
    )
    for step in range(3):
        kjts = [_rank_batch(step, r) for r in range(world_size)]
        out = dmp(kjts[rank])
        mine = kjts[rank].to_dict()
        # The unsharded module sees every rank's samples; this rank's ids come first in each feature.
        global_kjt = KeyedJaggedTensor.from_jt_dict(
            {k: _cat_jts([kjts[r].to_dict()[k] for r in _order(rank, world_size)]) for k in KEYS}
        )
        want = reference(global_kjt)
        out = out.wait() if hasattr(out, "wait") else out
        assert list(out) == list(want) == ["f1@t1", "f2", "f3", "f1@t2"]
        loss, ref_loss = 0, 0
        for name, jt in out.items():
            feature = name.split("@")[0]
            n = int(mine[feature].lengths().sum())
            torch.testing.assert_close(jt.values(), want[name].values()[:n], rtol=1e-6, atol=1e-6)
            assert torch.equal(jt.lengths(), mine[feature].lengths())
            assert torch.equal(jt.weights(), mine[feature].values())
            loss = loss + (jt.values() * (step + 1)).sum()
        loss.backward()
        # Reference: every rank's loss (each rank's share weighted alike), so one step per global batch.
        for jt in want.values():
            ref_loss = ref_loss + (jt.values() * (step + 1)).sum()
        ref_loss.backward()
    local = dmp.module.ec.local_module
    sd = local.state_dict() if local is not None else {}
    mine = {k: v for k, v in sd.items() if k.endswith((".weight", ".weight_id"))}
    gathered = [None] * world_size
    dist.all_gather_object(gathered, mine)
    want_sd = reference.state_dict()
    for cfg in _configs():
        ids = torch.cat(
            [g[f"embeddings.{cfg.name}.weight_id"] for g in gathered if f"embeddings.{cfg.name}.weight_id" in g]
        )
        vecs = torch.cat([g[f"embeddings.{cfg.name}.weight"] for g in gathered if f"embeddings.{cfg.name}.weight" in g])
        want_rows = dict(
            zip(want_sd[f"embeddings.{cfg.name}.weight_id"].tolist(), want_sd[f"embeddings.{cfg.name}.weight"])
        )
        assert sorted(ids.tolist()) == sorted(want_rows)
        for k, v in zip(ids.tolist(), vecs):
            torch.testing.assert_close(v, want_rows[k], rtol=1e-5, atol=1e-5)


def _order(rank, world_size):
    return [rank] + [r for r in range(world_size) if r != rank]


def _cat_jts(jts):
    from torchrec import JaggedTensor

    return JaggedTensor(values=torch.cat([j.values() for j in jts]), lengths=torch.cat([j.lengths() for j in jts]))


def _check_and_count_ops(rank, world_size, sharding):
    _check(rank, world_size, sharding)
    if sharding == "row_wise":  # (on the ranks already spawned)
        _input_dist_ops(rank, world_size)


@pytest.mark.parametrize("sharding", ["row_wise", "mixed"])
def test_sharded_ec_equals_unsharded_on_two_ranks(sharding):
    """Row-wise, also: the input dist dispatches the pooled module's ops (``_input_dist_ops``)."""
    run_ranks(_check_and_count_ops, WORLD, sharding)


def _input_dist_ops(rank, world_size):
    """The sequence module's input dist costs what the pooled one's does (the same routing and
    exchange): what only its rarer output dists read (ids sent per routing slot) is not reduced
    every step."""
    from torchrec.distributed.sharding_plan import row_wise

    from dist_helpers import dmp_of
    from test_batched_upsert_module import _CountOps
    from torchrec_ext import DynamicEmbeddingBagCollection, DynamicEmbeddingBagConfig
    from torchrec_ext.distributed import DynamicEmbeddingBagCollectionSharder, DynamicEmbeddingCollectionSharder

    table = {"name": "t1", "embedding_dim": 4, "num_embeddings": 64, "feature_names": KEYS}
    kinds = {
        "ec": (DynamicEmbeddingCollection([DynamicEmbeddingConfig(**table)]), DynamicEmbeddingCollectionSharder()),
        "ebc": (
            DynamicEmbeddingBagCollection([DynamicEmbeddingBagConfig(**table)]),
            DynamicEmbeddingBagCollectionSharder(),
        ),
    }
    ops = {}
    for name, (module, sharder) in kinds.items():
        sharded = getattr(dmp_of(ModelWith(name, module), name, {"t1": row_wise()}, sharder, world_size).module, name)
        for step in range(2):  # (the second: cached layouts built)
            with _CountOps() as counted:
                sharded.input_dist(sharded.create_context(), _rank_batch(step, rank))
        ops[name] = counted.ops
    assert ops["ec"] == ops["ebc"], (ops["ec"] - ops["ebc"], ops["ebc"] - ops["ec"])
