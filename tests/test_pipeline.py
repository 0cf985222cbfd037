"""torchrec_ext.pipeline.TrainPipeline: the same losses and parameters as a plain loop, on 2
real CPU ranks (gloo), with each stage on or off, and over our dynamic tables with column-wise
shards; worker failures surface; nothing hangs."""

import os
import threading
import time
import traceback

import pytest
import torch
import torch.distributed as dist

from dist_helpers import local_state, make_batches, make_dmp_dlrm, plain_loop, progress_losses, run_ranks
from torchrec_ext.pipeline import BatchPrefetcher, PipelineOptions, TrainPipeline

VARIANTS = {
    "all_stages": PipelineOptions(prefetch_threads=2, threaded_input_dist=True, flat_dense_allreduce=True),
    "defaults": PipelineOptions(),
    "no_threads": PipelineOptions(prefetch_threads=0, threaded_input_dist=False),
    "ddp_allreduce": PipelineOptions(flat_dense_allreduce=False, prefetch_threads=3, threaded_input_dist=True),
    "graph_options_on_cpu": PipelineOptions(
        graph_modules=("model.dense_arch", "model.over_arch"), threaded_input_dist=True
    ),
}


def _pipelined(dmp, optimizer, batches, options):
    with TrainPipeline(dmp, optimizer, torch.device("cpu"), options) as pipeline:
        losses = progress_losses(pipeline, batches)
        host = pipeline.drain_host_outputs()
        # The helper thread's collectives ran on their own process group, not the modules' own.
        assert bool(pipeline._dist_groups) == pipeline.options.threaded_input_dist
    assert [step for step, _ in host] == list(range(len(batches)))
    assert all(torch.equal(out[0], loss) for (_, out), loss in zip(host, losses))
    return losses


def _compare_with_plain_loop(rank, world_size):
    batches = make_batches(rank, batch_size=16, num_full=6, last=10)  # last partial batch
    reference_model, reference_opt = make_dmp_dlrm(world_size)
    want_losses = plain_loop(reference_model, reference_opt, batches)
    want_state = local_state(reference_model)
    assert want_losses[-1] < want_losses[0] + 1.0  # it trains (sanity, not the oracle)
    for name, options in VARIANTS.items():
        model, optimizer = make_dmp_dlrm(world_size)
        losses = _pipelined(model, optimizer, batches, options)
        assert len(losses) == len(want_losses), name
        for step, (got, want) in enumerate(zip(losses, want_losses)):
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"{name}: loss of step {step}")
        state = local_state(model)
        assert state.keys() == want_state.keys()
        for key in want_state:
            torch.testing.assert_close(state[key], want_state[key], rtol=0, atol=0, msg=f"{name}: {key}")

    # Our dynamic tables with a column-wise one (a column shard per rank: each rank pools its
    # columns of every id), every stage on: the pipeline still trains as the plain loop.
    reference_model, reference_opt = make_dmp_dlrm(world_size, dynamic=True, t1_column_wise=True)
    assert {
        s.sharding_type for s in reference_model.plan.plan["model.sparse_arch.embedding_bag_collection"].values()
    } == {
        "row_wise",
        "column_wise",
    }
    want_losses, want_state = plain_loop(reference_model, reference_opt, batches), local_state(reference_model)
    model, optimizer = make_dmp_dlrm(world_size, dynamic=True, t1_column_wise=True)
    losses = _pipelined(model, optimizer, batches, VARIANTS["all_stages"])
    torch.testing.assert_close(torch.stack(losses), torch.stack(want_losses), rtol=0, atol=0)
    state = local_state(model)
    assert state.keys() == want_state.keys() and any(".t1." in k for k in state)
    for key in want_state:
        torch.testing.assert_close(state[key], want_state[key], rtol=0, atol=0, msg=f"column-wise: {key}")


def _pipeline_then_plain_loop(rank, world_size):
    # The pipeline takes over DDP's all-reduce only while it runs: the same model trained on
    # afterwards by a plain loop must still average its dense gradients.
    batches = make_batches(rank, batch_size=16, num_full=6, last=0)
    reference_model, reference_opt = make_dmp_dlrm(world_size)
    want_losses = plain_loop(reference_model, reference_opt, batches)
    model, optimizer = make_dmp_dlrm(world_size)
    losses = _pipelined(
        model,
        optimizer,
        batches[:3],
        PipelineOptions(prefetch_threads=2, threaded_input_dist=True, flat_dense_allreduce=True),
    )
    losses += plain_loop(model, optimizer, batches[3:])
    for got, want in zip(losses, want_losses):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    want_state, state = local_state(reference_model), local_state(model)
    for key in want_state:
        torch.testing.assert_close(state[key], want_state[key], rtol=0, atol=0, msg=key)

    # Eval mode: forward only, the outputs of a plain no-grad forward.
    model.eval()
    with torch.no_grad():
        want_logits = [model(b)[1][1] for b in batches]
    pipeline = TrainPipeline(model, optimizer, torch.device("cpu"))
    it = iter(batches)
    with torch.no_grad():
        got_logits = [pipeline.progress(it)[1] for _ in batches]
    with pytest.raises(StopIteration):
        pipeline.progress(it)
    pipeline.close()
    for got, want in zip(got_logits, want_logits):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="progress\\(\\) after close\\(\\)"):
        pipeline.progress(iter(batches))


def test_model_trains_and_evaluates_correctly_around_the_pipeline():
    run_ranks(_pipeline_then_plain_loop, 2)


def test_pipeline_equals_plain_loop_on_two_ranks():
    run_ranks(_compare_with_plain_loop, 2)


class _FailingLoader:
    def __init__(self, batches, fail_at):
        self._it, self._i, self._fail_at = iter(batches), 0, fail_at

    def __iter__(self):
        return self

    def __next__(self):
        if self._i == self._fail_at:
            raise_from_loader()
        self._i += 1
        return next(self._it)


def raise_from_loader():
    raise KeyError("bad record in shard 7")


def _worker_error_reaches_caller(rank, world_size):
    batches = make_batches(rank, batch_size=8, num_full=5, last=0)
    model, optimizer = make_dmp_dlrm(world_size)
    pipeline = TrainPipeline(
        model,
        optimizer,
        torch.device("cpu"),
        PipelineOptions(prefetch_threads=2, threaded_input_dist=True, timeout_s=60),
    )
    it = _FailingLoader(batches, fail_at=3)
    steps = 0
    with pytest.raises(KeyError, match="bad record in shard 7") as info:
        while True:
            pipeline.progress(it)
            steps += 1
    assert "raise_from_loader" in "".join(traceback.format_tb(info.value.__traceback__))
    assert steps <= 3
    pipeline.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("torchrec_ext-")]


def test_worker_exception_reaches_caller_with_traceback_and_threads_join():
    run_ranks(_worker_error_reaches_caller, 2)


def test_unknown_graph_module_is_a_clear_error():
    run_ranks(_unknown_graph_module, 1)


def _unknown_graph_module(rank, world_size):
    model, optimizer = make_dmp_dlrm(world_size)
    with pytest.raises(ValueError, match="graph_modules names 'model.no_such_arch'"):
        TrainPipeline(model, optimizer, torch.device("cpu"), PipelineOptions(graph_modules=("model.no_such_arch",)))


# ----------------------------------------------------------------- the prefetcher on its own


class _Item:
    def __init__(self, value):
        self.value = value

    def to(self, device, non_blocking=False):
        return self

    def record_stream(self, stream):
        pass


def test_prefetcher_keeps_order_with_many_threads():
    items = [_Item(i) for i in range(200)]
    prefetcher = BatchPrefetcher(iter(items), torch.device("cpu"), num_threads=4, depth=3)
    got = []
    with pytest.raises(StopIteration):
        while True:
            got.append(prefetcher.next().batch.value)
    assert got == list(range(200))
    prefetcher.close()


def test_prefetcher_times_out_instead_of_hanging():
    release = threading.Event()

    def slow():
        release.wait(10)
        yield _Item(0)

    prefetcher = BatchPrefetcher(slow(), torch.device("cpu"), num_threads=1, timeout_s=0.2)
    with pytest.raises(TimeoutError, match="no batch within"):
        prefetcher.next()
    release.set()
    assert prefetcher.next().batch.value == 0
    prefetcher.close()


def test_prefetcher_close_joins_blocked_workers():
    prefetcher = BatchPrefetcher(iter([_Item(i) for i in range(100)]), torch.device("cpu"), num_threads=3, depth=2)
    prefetcher.next()
    prefetcher.close(timeout_s=10)
    assert not any(t.is_alive() for t in prefetcher._threads)


@pytest.mark.parametrize("fails_in", ["loader", "copy"])
def test_prefetcher_hands_out_every_earlier_batch_before_the_error(fails_in):
    # Batch 0 is still being copied when batch 5 fails (the loader raises, or its copy does):
    # batches 0-4 come out first, in order, then the error.
    failed = threading.Event()

    class SlowCopy(_Item):
        def to(self, device, non_blocking=False):
            failed.wait(10)
            time.sleep(0.2)  # the failure is recorded meanwhile
            return self

    class FailingCopy(_Item):
        def to(self, device, non_blocking=False):
            failed.set()
            raise OSError("copy of batch 5 failed")

    def loader():
        yield SlowCopy(0)
        yield from (_Item(i) for i in range(1, 5))
        if fails_in == "copy":
            yield FailingCopy(5)
        failed.set()
        raise KeyError("bad record in batch 5")

    prefetcher = BatchPrefetcher(loader(), torch.device("cpu"), num_threads=3, depth=8)
    got = []
    with pytest.raises(KeyError if fails_in == "loader" else OSError, match="batch 5"):
        while True:
            got.append(prefetcher.next().batch.value)
    assert got == [0, 1, 2, 3, 4]
    prefetcher.close()


def _threads_fds_groups():
    return (
        len(os.listdir("/proc/self/task")),
        len(os.listdir("/proc/self/fd")),
        len(dist.distributed_c10d._world.pg_map),
    )


def _segments_reuse_one_process_group(rank, world_size):
    # The job builds a pipeline per train segment (between evals and checkpoints). With the
    # input dist on a helper thread each pipeline needs its own process group: 12 segments must
    # not leave 12 groups (each with its threads and sockets) behind, and the reused group must
    # still train exactly like a plain loop.
    segments = [make_batches(rank, batch_size=8, num_full=2, last=0, seed=s) for s in range(12)]
    reference_model, reference_opt = make_dmp_dlrm(world_size)
    want = plain_loop(reference_model, reference_opt, [b for seg in segments for b in seg])
    model, optimizer = make_dmp_dlrm(world_size)
    options = PipelineOptions(prefetch_threads=2, threaded_input_dist=True)
    got, counts = [], []
    for batches in segments:
        got += _pipelined(model, optimizer, batches, options)
        counts.append(_threads_fds_groups())
    # Exact for files and groups; a joined thread may take a moment more to leave /proc.
    first, last = counts[0], counts[-1]
    assert last[1:] == first[1:] and last[0] <= first[0] + 1, (
        f"threads, open files, process groups after each segment: {counts}"
    )
    for step, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g, w, rtol=0, atol=0, msg=f"loss of step {step}")


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads and files in /proc")
def test_pipelines_built_per_segment_do_not_leak_process_groups_threads_or_files():
    run_ranks(_segments_reuse_one_process_group, 2)


def _timed_out_close_closes_the_group_pool(rank, world_size):
    # A close whose input-dist thread did not stop (faked: the worker reports it still runs) must
    # not hand that thread's group to the next pipeline, nor create a group (a collective) while a
    # peer whose close went well reuses one: the next borrow refuses, saying why.
    model, optimizer = make_dmp_dlrm(world_size)
    options = PipelineOptions(prefetch_threads=0, threaded_input_dist=True)
    batches = make_batches(rank, batch_size=8, num_full=2, last=0)
    pipeline = TrainPipeline(model, optimizer, torch.device("cpu"), options)
    progress_losses(pipeline, batches)
    worker = pipeline._dist_worker
    real_close = worker.close
    worker.close = lambda timeout_s: real_close(timeout_s) and False
    groups_before = len(dist.distributed_c10d._world.pg_map)
    pipeline.close()
    with (
        pytest.raises(RuntimeError, match="input-dist thread did not stop within its close timeout"),
        TrainPipeline(model, optimizer, torch.device("cpu"), options) as again,
    ):
        progress_losses(again, batches)
    assert len(dist.distributed_c10d._world.pg_map) == groups_before  # no group was created


def test_a_timed_out_close_never_lets_ranks_pools_of_groups_diverge():
    run_ranks(_timed_out_close_closes_the_group_pool, 1)
