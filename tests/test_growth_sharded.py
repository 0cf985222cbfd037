"""Growing tables sharded on 2 gloo ranks (issue 15 item 3): each rank's share grows on its own,
under torchrec_ext.pipeline.TrainPipeline (the next batch's input dist in flight every step), and
never while a lookup awaits its fused update. Oracle: the same DLRM with preallocated tables
trained by a plain loop on the same batches: the same losses, and per id the same vectors and
optimizer state; the grown model's checkpoint loads into an unsharded growing module."""

import torch

from dist_helpers import DIM, NUM_TABLES, make_batches, make_dmp_dlrm, plain_loop, progress_losses, run_ranks
from torchrec_ext import DynamicEmbeddingBagCollection, DynamicEmbeddingBagConfig
from torchrec_ext.modules.dynamic_tables import DynamicTables
from torchrec_ext.pipeline import PipelineOptions, TrainPipeline

MAX_ROWS, INITIAL, ID_RANGE = 1024, 16, 400


def _tables(initial):
    return [
        DynamicEmbeddingBagConfig(
            name=f"t{i}",
            embedding_dim=DIM,
            num_embeddings=MAX_ROWS,
            feature_names=[f"f{i}"],
            initial_capacity=initial,
            ttl_steps=100 if i == 2 else None,
        )
        for i in range(NUM_TABLES)
    ]


def _tables_by_id(state):
    """table -> {key: full tensor sorted by weight_id} of a full (unsharded) state_dict."""
    out = {}
    for i in range(NUM_TABLES):
        prefix = f"model.sparse_arch.embedding_bag_collection.embedding_bags.t{i}."
        order = state[prefix + "weight_id"].argsort()
        out[f"t{i}"] = {
            k[len(prefix) :]: v[order]
            for k, v in state.items()
            if k.startswith(prefix) and k[len(prefix) :] not in ("row", "counters")
        }
    return out


def _pipelined(dmp, optimizer, batches):
    options = PipelineOptions(prefetch_threads=2, threaded_input_dist=True)
    with TrainPipeline(dmp, optimizer, torch.device("cpu"), options) as pipeline:
        return progress_losses(pipeline, batches)


def _grow_under_the_pipeline(rank, world_size):
    from torchrec_ext.distributed import full_state_dict

    relayouts = []  # (pending backwards, capacities before) at every relayout on this rank
    original = DynamicTables._relayout

    def spy(self, plans, indexes):
        relayouts.append((self.pending_backward, [m.capacity for m in self.meta]))
        return original(self, plans, indexes)

    DynamicTables._relayout = spy
    try:
        batches = make_batches(rank, batch_size=16, num_full=10, last=6, rows=ID_RANGE)
        full, full_opt = make_dmp_dlrm(world_size, dynamic=True, tables=_tables(None))
        want_losses = plain_loop(full, full_opt, batches)
        grown, grown_opt = make_dmp_dlrm(world_size, dynamic=True, tables=_tables(INITIAL))
        local = grown.module.model.sparse_arch.embedding_bag_collection._local
        assert (
            [m.capacity for m in local._tables.meta] == [INITIAL // world_size, INITIAL, INITIAL // world_size]
            if rank == world_size - 1
            else [INITIAL // world_size] * 2
        )
        losses = _pipelined(grown, grown_opt, batches)
    finally:
        DynamicTables._relayout = original
    assert len(losses) == len(want_losses)
    for step, (got, want) in enumerate(zip(losses, want_losses)):
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"rank {rank}: loss of step {step}")
    # Each rank's share grew on its own, and only with no lookup pending (the pipeline's next
    # batch was in flight, input-distributed, at each of them).
    assert relayouts and all(pending == 0 for pending, _ in relayouts), relayouts
    stats = local.table_stats()
    assert all(s.capacity > INITIAL // world_size and s.evictions == 0 for s in stats.values()), stats
    assert all(s.max_capacity == (MAX_ROWS if name == "t1" else MAX_ROWS // world_size) for name, s in stats.items())
    # Per id, the same rows as the preallocated model's.
    got = _tables_by_id(full_state_dict(grown.state_dict()))
    want = _tables_by_id(full_state_dict(full.state_dict()))
    for name in want:
        assert got[name].keys() == want[name].keys()
        for key in want[name]:
            torch.testing.assert_close(got[name][key], want[name][key], rtol=0, atol=0, msg=f"{name}.{key}")
    # The grown sharded checkpoint loads into a fresh sharded growing model: each rank's share
    # grows to fit its ids (to the capacity the saving share had: no id was evicted or expired).
    fresh, _ = make_dmp_dlrm(world_size, dynamic=True, tables=_tables(INITIAL))
    fresh.load_state_dict(grown.state_dict())
    reloaded = _tables_by_id(full_state_dict(fresh.state_dict()))
    for name in want:
        for key in want[name]:
            torch.testing.assert_close(reloaded[name][key], want[name][key], rtol=0, atol=0, msg=f"{name}.{key}")
    fresh_local = fresh.module.model.sparse_arch.embedding_bag_collection._local
    assert {n: s.capacity for n, s in fresh_local.table_stats().items()} == {n: s.capacity for n, s in stats.items()}
    # The grown checkpoint loads into an unsharded growing module, which fits its ids.
    state = full_state_dict(grown.state_dict())
    prefix = "model.sparse_arch.embedding_bag_collection."
    unsharded = DynamicEmbeddingBagCollection(_tables(INITIAL), optimizer="adagrad", optimizer_kwargs={"lr": 0.05})
    unsharded.load_state_dict({k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)})
    for name, s in unsharded.table_stats().items():
        assert s.live_rows == want[name]["weight_id"].numel() and INITIAL < s.capacity < MAX_ROWS
        assert s.live_rows <= 0.75 * s.capacity
    reloaded = unsharded.state_dict()
    for name in want:
        order = reloaded[f"embedding_bags.{name}.weight_id"].argsort()
        for key in want[name]:
            torch.testing.assert_close(reloaded[f"embedding_bags.{name}.{key}"][order], want[name][key], rtol=0, atol=0)


def test_sharded_growth_under_the_pipeline_equals_preallocated_tables():
    run_ranks(_grow_under_the_pipeline, 2)
