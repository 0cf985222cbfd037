"""Our routed input dist (all_to_all_single + torch regrouping, input_dist.py) on 2 real gloo ranks
against TorchRec's KJTAllToAll, which regroups with fbgemm: the same received KJTs, and sharded
modules that train to the same outputs and table contents whichever of the two they use; ours
dispatches no fbgemm op, so it runs where fbgemm has no CUDA build."""

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torchrec import KeyedJaggedTensor

from dist_helpers import ModelWith, run_ranks
from torchrec_ext import device_sync

WORLD, KEYS = 2, ["f1", "f2", "f3"]


class _OpsSeen(TorchDispatchMode):
    """The names of the operators dispatched inside the with-block."""

    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(str(func.name()))
        return func(*args, **(kwargs or {}))

    def fbgemm(self):
        return sorted(n for n in self.names if n.startswith("fbgemm::"))


def _routed(rank, world_size, case, generator):
    """A routed KJT (keys KEYS * world_size, block r bound for rank r) for one case."""
    batch = {"uneven_batches": 3 + 2 * rank, "no_ids": 4}.get(case, 4)
    lengths = torch.randint(0, 4, (world_size, len(KEYS), batch), generator=generator)
    if case == "empty_share":  # rank 1 sends rank 0 nothing; rank 0 sends rank 1 nothing for f2
        if rank == 1:
            lengths[0] = 0
        else:
            lengths[1, 1] = 0
    if case == "no_ids":
        lengths.zero_()
    lengths = lengths.reshape(-1)
    n = int(lengths.sum())
    ids = torch.tensor([7, -1, 2**62, 7, 7, 3])[torch.randint(0, 6, (n,), generator=generator)]  # duplicates
    if case == "int32_ids":
        ids = ids.clamp(-100, 100).to(torch.int32)
    weights = torch.rand(n, generator=generator) if case in ("weighted", "empty_share", "uneven_batches") else None
    return KeyedJaggedTensor(keys=KEYS * world_size, values=ids, lengths=lengths, weights=weights, stride=batch)


def _exchanges_agree(rank, world_size):
    from torchrec.distributed.dist_data import KJTAllToAll
    from torchrec.distributed.embedding_sharding import EmbeddingShardingContext, KJTListSplitsAwaitable

    from torchrec_ext.distributed.input_dist import RoutedInputDist

    pg = dist.group.WORLD
    cases = ["weighted", "unweighted", "int32_ids", "empty_share", "uneven_batches", "no_ids"]
    for case in cases:
        routed = _routed(rank, world_size, case, torch.Generator().manual_seed(cases.index(case) * 10 + rank))
        theirs_ctx, ours_ctx = (type("Ctx", (), {"sharding_contexts": [EmbeddingShardingContext()]})() for _ in "ab")
        with _OpsSeen() as seen_theirs:
            theirs = (
                KJTListSplitsAwaitable([KJTAllToAll(pg, [len(KEYS)] * world_size)(routed)], theirs_ctx).wait().wait()[0]
            )
        with _OpsSeen() as seen_ours, device_sync.recording() as seen_reads:
            ours = (
                KJTListSplitsAwaitable(
                    [RoutedInputDist(pg, len(KEYS), world_size)(routed, ours_ctx.sharding_contexts[0])], ours_ctx
                )
                .wait()
                .wait()[0]
            )
        assert ours.keys() == theirs.keys() == KEYS, case
        assert ours.stride() == theirs.stride(), case
        for part in ("lengths", "values", "weights_or_none"):
            got, want = getattr(ours, part)(), getattr(theirs, part)()
            if want is None:
                assert got is None, (case, part)
                continue
            assert got.dtype == want.dtype and torch.equal(got, want), (case, part, got, want)
        # The reduce-scatter of the pooled output splits by these.
        assert ours_ctx.sharding_contexts[0].batch_size_per_rank == theirs_ctx.sharding_contexts[0].batch_size_per_rank
        # Its ids per key known on the host, from the one read of the exchange's splits.
        assert ours.length_per_key_or_none() == theirs.length_per_key(), case
        assert seen_reads == {"input dist: the splits of the data exchange": 1}, (case, dict(seen_reads))
        assert seen_ours.fbgemm() == [], (case, seen_ours.fbgemm())
        if case != "no_ids":  # the check sees fbgemm's kernels when they run
            assert any("permute" in n for n in seen_theirs.fbgemm()), (case, seen_theirs.fbgemm())


def test_exchange_equals_kjt_all_to_all_without_fbgemm():
    run_ranks(_exchanges_agree, WORLD)


class _TorchRecInputDist(torch.nn.Module):
    """The input dist as it was: TorchRec's KJTAllToAll (its awaitables fill the sharding context)."""

    def __init__(self, pg, num_keys, world_size):
        super().__init__()
        from torchrec.distributed.dist_data import KJTAllToAll

        self._dist = KJTAllToAll(pg, splits=[num_keys] * world_size)

    def forward(self, routed, sharding_ctx=None):
        return self._dist(routed)


def _module_batch(step, rank, weighted, batch=5):
    gen = torch.Generator().manual_seed(step * 10 + rank)
    lengths = torch.randint(0, 4, (len(KEYS) * batch,), generator=gen)
    if step == 1 and rank == 1:
        lengths.zero_()  # a rank with no ids at all: every rank's share from it is empty
    n = int(lengths.sum())
    ids = torch.tensor([0, -1, 2**63 - 1, 3, 3, 2**50])[torch.randint(0, 6, (n,), generator=gen)]
    return KeyedJaggedTensor(
        keys=KEYS,
        values=ids,
        lengths=lengths,
        stride=batch,
        weights=torch.rand(n, generator=gen) if weighted else None,
        length_per_key=lengths.view(len(KEYS), batch).sum(1).tolist(),  # as from_lengths_sync: checks read nothing
    )


def _modules_train_alike(rank, world_size):
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
    from torchrec.distributed.types import ShardingEnv, ShardingPlan

    from dist_helpers import local_state
    from torchrec_ext import (
        DynamicEmbeddingBagCollection,
        DynamicEmbeddingBagConfig,
        DynamicEmbeddingCollection,
        DynamicEmbeddingConfig,
    )
    from torchrec_ext.distributed import get_sharders

    def bags():
        return DynamicEmbeddingBagCollection(
            [
                DynamicEmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=64, feature_names=["f1", "f2"]),
                DynamicEmbeddingBagConfig(name="t2", embedding_dim=3, num_embeddings=64, feature_names=["f3"]),
            ],
            is_weighted=True,
            optimizer="adagrad",
            optimizer_kwargs={"lr": 0.1},
        )

    def sequences():
        return DynamicEmbeddingCollection(
            [
                DynamicEmbeddingConfig(name="t1", embedding_dim=4, num_embeddings=64, feature_names=["f1", "f3"]),
                DynamicEmbeddingConfig(name="t2", embedding_dim=4, num_embeddings=64, feature_names=["f2"]),
            ],
            need_indices=True,
            optimizer="adam",
            optimizer_kwargs={"lr": 0.1},
        )

    # t2 on rank 1 alone: rank 0 receives no ids of its slots.
    plan = {
        "t1": row_wise(compute_kernel="customized_kernel"),
        "t2": table_wise(rank=1, compute_kernel="customized_kernel"),
    }

    def sharded(make, torchrec_dist):
        model = ModelWith("m", make())
        module_plan = construct_module_sharding_plan(
            model.m,
            plan,
            sharder=next(s for s in get_sharders() if s.module_type is type(model.m)),
            local_size=world_size,
            world_size=world_size,
            device_type="cpu",
        )
        dmp = DistributedModelParallel(
            model,
            env=ShardingEnv.from_process_group(dist.group.WORLD),
            device=torch.device("cpu"),
            plan=ShardingPlan({"m": module_plan}),
            sharders=get_sharders(),
        )
        if torchrec_dist:
            input_dists = dmp.module.m._input_dists
            input_dists[0] = _TorchRecInputDist(dist.group.WORLD, len(KEYS), world_size)
        return dmp

    for make, weighted in ((bags, True), (sequences, False)):
        ours, theirs = sharded(make, False), sharded(make, True)
        for step in range(3):
            kjt = _module_batch(step, rank, weighted)
            outs = []
            for dmp in (ours, theirs):
                with device_sync.recording() as seen:
                    out = dmp(kjt)
                    out = out.wait() if hasattr(out, "wait") else out
                    values = out.values() if weighted else torch.cat([jt.values() for jt in out.values()])
                    (values * (step + 1)).sum().backward()
                outs.append(values.detach())
                if dmp is ours and step > 0:  # (step 0 builds cached layouts)
                    # The exchange's splits in one read (the received KJT knows its ids per key,
                    # so the local module reads no lengths), and the lookup's unique count.
                    assert seen == STEP_READS, (make.__name__, step, dict(seen))
            torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
        state_ours, state_theirs = local_state(ours), local_state(theirs)
        assert state_ours.keys() == state_theirs.keys() and state_ours
        for key in state_ours:
            torch.testing.assert_close(state_ours[key], state_theirs[key], rtol=0, atol=0, msg=key)


STEP_READS = {"input dist: the splits of the data exchange": 1, "lookup: where each table's unique ids start": 1}


def test_sharded_modules_train_alike_with_either_input_dist():
    run_ranks(_modules_train_alike, WORLD)


def _pipeline_keeps_our_dist(rank, world_size):
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    from dist_helpers import make_batches, make_dmp_dlrm

    batches = make_batches(rank, batch_size=8, num_full=3, last=0)
    model, optimizer = make_dmp_dlrm(world_size, dynamic=True)
    pipeline = TrainPipelineSparseDist(model, optimizer, torch.device("cpu"))
    it = iter(batches)
    with _OpsSeen() as seen:
        for _ in batches:
            pipeline.progress(it)
    # The pipeline swapped _dist.forward for its fused-splits one (fbgemm regrouping); ours stays in use.
    assert [type(m).__name__ for m in pipeline._pipelined_modules] == ["ShardedDynamicEmbeddingBagCollection"]
    assert type(pipeline._pipelined_modules[0]._input_dists[0]._dist.forward).__name__ == "KJTAllToAllForward"
    assert seen.fbgemm() == [], seen.fbgemm()


def test_torchrec_pipeline_runs_our_dist_without_fbgemm():
    run_ranks(_pipeline_keeps_our_dist, WORLD)
