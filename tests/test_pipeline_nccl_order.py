"""Where the input dist runs on NCCL with peers (CUDA, world size > 1), only the train thread
launches collectives: NCCL needs every rank to launch the collectives of all communicators of a
GPU in one order, which a helper thread's all-to-all racing the train thread's all-reduce cannot
keep. Checked on 2 gloo ranks with the NCCL probe answering yes: the input dist stays on the
train thread, on the modules' own group, training equals a plain loop, and asking for the helper
thread is refused by name. The probe itself is checked against every backend string form."""

import functools
import threading
import time

import pytest
import torch
import torch.distributed as dist

from dist_helpers import local_state, make_batches, make_dmp_dlrm, plain_loop, progress_losses, run_ranks
from torchrec_ext.pipeline import PipelineOptions, TrainPipeline, groups
from torchrec_ext.pipeline import train_pipeline as train_pipeline_module


@pytest.mark.parametrize(
    "backend, nccl",
    [
        ("nccl", True),
        ("NCCL", True),
        ("gloo", False),
        ("cpu:gloo,cuda:nccl", True),
        ("cuda:nccl,cpu:gloo", True),
        ("cpu:gloo, cuda:nccl", True),
        ("cpu:gloo,cuda:gloo", False),
        ("cpu:nccl", False),
        ("mpi", False),
    ],
)
def test_nccl_for_cuda_reads_every_backend_form(backend, nccl):
    assert groups.nccl_for_cuda(backend) is nccl


class _CollectiveLog:
    """Records which thread launches each collective (patched over torch.distributed's)."""

    NAMES = ("all_to_all_single", "all_reduce", "all_gather", "broadcast", "reduce_scatter_tensor")

    def __init__(self, monkeypatch):
        self.calls: list[tuple[str, str]] = []
        for name in self.NAMES:
            monkeypatch.setattr(dist, name, self._wrapped(name, getattr(dist, name)))

    def _wrapped(self, name, original):
        def call(*args, **kwargs):
            self.calls.append((name, threading.current_thread().name))
            return original(*args, **kwargs)

        return call


def _nccl_probe_and_helper_thread(rank, world_size):
    monkeypatch = pytest.MonkeyPatch()
    try:
        batches = make_batches(rank, batch_size=16, num_full=5, last=6)
        reference_model, reference_opt = make_dmp_dlrm(world_size, dynamic=True)
        want_losses, want_state = plain_loop(reference_model, reference_opt, batches), local_state(reference_model)

        model, optimizer = make_dmp_dlrm(world_size, dynamic=True)
        # The probe reads DMP's group: gloo here, so no; as "cpu:gloo,cuda:nccl" on a CUDA device, yes.
        assert not train_pipeline_module._input_dist_on_nccl(model, torch.device("cuda"))
        with monkeypatch.context() as patched:
            patched.setattr(dist, "get_backend", lambda group=None: "cpu:gloo,cuda:nccl")
            assert train_pipeline_module._input_dist_on_nccl(model, torch.device("cuda"))
            assert not train_pipeline_module._input_dist_on_nccl(model, torch.device("cpu"))

        # From here the input dist "runs on NCCL" and a core is spare (always so on CUDA): a CPU
        # device stands in for the GPU.
        monkeypatch.setattr(train_pipeline_module, "_input_dist_on_nccl", lambda model, device: True)
        monkeypatch.setattr(train_pipeline_module, "_spare_cores", lambda device: True)
        with pytest.raises(ValueError, match="threaded_input_dist must be False or None .* got True"):
            TrainPipeline(model, optimizer, torch.device("cpu"), PipelineOptions(threaded_input_dist=True))

        log = _CollectiveLog(monkeypatch)
        options = PipelineOptions(prefetch_threads=2, flat_dense_allreduce=True)  # helper thread left to the default
        with TrainPipeline(model, optimizer, torch.device("cpu"), options) as pipeline:
            assert pipeline.options.threaded_input_dist is False
            forward = pipeline._model_fwd

            def marked_forward(batch):
                log.calls.append(("forward", ""))
                return forward(batch)

            pipeline._model_fwd = marked_forward
            losses = progress_losses(pipeline, batches)
            assert not pipeline._dist_groups  # no clone: the input dist stays on the modules' group
        launched_by = {thread for name, thread in log.calls if name != "forward"}
        assert launched_by == {threading.main_thread().name}, launched_by
        # TorchRec's order: the first batch's counts and data; then each step launches batch i+1's
        # counts before its forward, its data after it, then the dense all-reduce.
        order = "".join({"all_to_all_single": "a", "forward": "F", "all_reduce": "r"}.get(n, "") for n, _ in log.calls)
        steps = len(batches)
        assert order == "aa" + "aFar" * (steps - 1) + "Fr", order

        torch.testing.assert_close(torch.stack(losses), torch.stack(want_losses), rtol=0, atol=0)
        state = local_state(model)
        for key in want_state:
            torch.testing.assert_close(state[key], want_state[key], rtol=0, atol=0, msg=key)
    finally:
        monkeypatch.undo()


def test_input_dist_stays_on_the_train_thread_where_it_runs_on_nccl():
    run_ranks(_nccl_probe_and_helper_thread, 2)


def _deferred_input_dist_feeds_the_tiered_stage(rank, world_size, root):
    # Sharded tiered tables stage batch i+1's rows from its input dist: deferred to after the
    # forward (NCCL with peers), the stage still gets them, so every step after the first finds
    # its rows cached, and training equals the plain loop.
    from dist_helpers import DIM, NUM_TABLES, ROWS
    from torchrec_ext import DynamicEmbeddingBagConfig

    def tables(backing):
        extra = {} if backing is None else {"backing": backing, "cache_load_factor": 0.25}
        return [
            DynamicEmbeddingBagConfig(
                name=f"t{i}", embedding_dim=DIM, num_embeddings=2 * ROWS, feature_names=[f"f{i}"], **extra
            )
            for i in range(NUM_TABLES)
        ]

    monkeypatch = pytest.MonkeyPatch()
    try:
        batches = make_batches(rank, batch_size=4, num_full=8, last=0)
        reference, reference_opt = make_dmp_dlrm(world_size, dynamic=True, tables=tables(None))
        want = plain_loop(reference, reference_opt, batches)
        model, optimizer = make_dmp_dlrm(
            world_size, dynamic=True, tables=tables(f"file:{root}"), ebc_device=torch.device("meta")
        )
        monkeypatch.setattr(train_pipeline_module, "_input_dist_on_nccl", lambda model, device: True)
        stats = []
        options = PipelineOptions(prefetch_threads=0, tier_prefetch=True, timeout_s=60)
        with TrainPipeline(model, optimizer, torch.device("cpu"), options) as pipeline:
            assert pipeline._defer_dist_wait
            losses = progress_losses(pipeline, batches, stats)
        torch.testing.assert_close(torch.stack(losses), torch.stack(want), rtol=0, atol=0)
        moved = torch.tensor(
            [
                sum(s["staged"] for step in stats for s in step.values()),
                sum(s["misses"] for step in stats[1:] for s in step.values()),
            ]
        )
        dist.all_reduce(moved)
        assert moved[0] > 0 and moved[1] == 0, moved
    finally:
        monkeypatch.undo()


def test_deferred_input_dist_still_feeds_the_tiered_stage(tmp_path):
    run_ranks(_deferred_input_dist_feeds_the_tiered_stage, 2, str(tmp_path))


def test_the_pipeline_names_the_device_of_every_current_stream():
    # On rank r the GPU is cuda:r: a bare torch.cuda.current_stream() is the current device's,
    # cuda:0 wherever the caller did not set the device (a new thread, a library user).
    import pathlib
    import re

    package = pathlib.Path(train_pipeline_module.__file__).parent
    bare = [
        f"{path.name}:{number}"
        for path in sorted(package.glob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"cuda\.current_stream\(\s*\)", line)
    ]
    assert not bare, bare


def _forward_error_leaves_the_tiered_tables_usable(rank, world_size, root, before_close=False):
    # A forward that raises after the lookup started the stage (NCCL with peers: the stage waits
    # for the deferred input dist, which the raised step never finishes): once the pipeline is
    # closed the tables answer as they did, the stage having staged nothing (it only moves rows
    # ahead), rather than raising the closed pipeline's error at the next call (a job's
    # checkpoint on failure).
    from dist_helpers import DIM, NUM_TABLES, ROWS
    from torchrec_ext import DynamicEmbeddingBagConfig

    tables = [
        DynamicEmbeddingBagConfig(
            name=f"t{i}",
            embedding_dim=DIM,
            num_embeddings=2 * ROWS,
            feature_names=[f"f{i}"],
            backing=f"file:{root}",
            cache_load_factor=0.25,
        )
        for i in range(NUM_TABLES)
    ]
    monkeypatch = pytest.MonkeyPatch()
    try:
        batches = make_batches(rank, batch_size=4, num_full=6, last=0)
        model, optimizer = make_dmp_dlrm(world_size, dynamic=True, tables=tables, ebc_device=torch.device("meta"))
        monkeypatch.setattr(train_pipeline_module, "_input_dist_on_nccl", lambda model, device: True)
        over_arch = model.module.model.over_arch
        calls, forward = [], over_arch.forward

        def failing(*args):
            calls.append(1)
            if len(calls) == 3:
                raise RuntimeError("the dense arch failed")
            return forward(*args)

        monkeypatch.setattr(over_arch, "forward", failing)
        options = PipelineOptions(prefetch_threads=0, tier_prefetch=True, timeout_s=15 if before_close else 60)
        if before_close:  # the error caught and the tables used before close(): no wait for the stage
            pipeline = TrainPipeline(model, optimizer, torch.device("cpu"), options)
            with pytest.raises(RuntimeError, match="the dense arch failed"):
                progress_losses(pipeline, batches)
            started = time.monotonic()
            state = model.state_dict()
            assert time.monotonic() - started < 5
            assert any(key.endswith("weight") for key in state)
            with pytest.raises(RuntimeError, match="a forward raised before the input dist finished"):
                pipeline.progress(iter(batches))
            pipeline.close()
            return
        with (
            pytest.raises(RuntimeError, match="the dense arch failed"),
            TrainPipeline(model, optimizer, torch.device("cpu"), options) as pipeline,
        ):
            progress_losses(pipeline, batches)
        state = model.state_dict()  # (the tiered tables join their stage first)
        assert any(key.endswith("weight") for key in state)
    finally:
        monkeypatch.undo()


def test_a_forward_error_leaves_the_tiered_tables_usable(tmp_path):
    run_ranks(_forward_error_leaves_the_tiered_tables_usable, 2, str(tmp_path))


def test_a_forward_error_leaves_the_tiered_tables_usable_before_close(tmp_path):
    # (timeout_s short: without the abandon, the state_dict waits for it, then times out)
    run_ranks(functools.partial(_forward_error_leaves_the_tiered_tables_usable, before_close=True), 2, str(tmp_path))
