"""The pipeline's ordering decisions, checked on CPU: helper threads parked while a CUDA graph is
captured (a gate, watched with a fake device op), which stream waits for which event (recording
fake streams and events standing in for CUDA's), and graphs kept per model, not per pipeline.
The CUDA runs of the same rules are in test_pipeline_cuda.py."""

import threading
import time
from contextlib import contextmanager

import pytest
import torch
from torch import nn

from dist_helpers import make_batches, make_dmp_dlrm, plain_loop, progress_losses, run_ranks
from torchrec_ext.pipeline import PipelineOptions, TrainPipeline
from torchrec_ext.pipeline import prefetch as prefetch_module
from torchrec_ext.pipeline import train_pipeline as train_pipeline_module
from torchrec_ext.pipeline.dense_sync import FlatGradSync, GraphedForward
from torchrec_ext.pipeline.prefetch import BatchPrefetcher, copy_to_device
from torchrec_ext.pipeline.quiesce import DeviceWorkGate, quiesced
from torchrec_ext.pipeline.streams import ReplayFence
from torchrec_ext.pipeline.worker import HelperThread

# ----------------------------------------------------------------- the capture gate


class DeviceOps:
    """Stands in for the device: records when each op ran and whether the gate was closed then."""

    def __init__(self, gate: DeviceWorkGate, op_s: float = 0.01):
        self.gate, self.op_s = gate, op_s
        self.lock = threading.Lock()
        self.spans = []  # (start, end) of every op
        self.while_closed = []  # ops that started while the gate was closed

    def op(self):
        start = time.monotonic()
        if self.gate.is_closed:
            self.while_closed.append(threading.current_thread().name)
        time.sleep(self.op_s)
        with self.lock:
            self.spans.append((start, time.monotonic()))


class _DeviceBatch:
    """A batch whose copy to the device is a device op."""

    def __init__(self, value, ops):
        self.value, self.ops = value, ops

    def to(self, device, non_blocking=False):
        self.ops.op()
        return self

    def record_stream(self, stream):
        pass


def test_capture_gate_parks_prefetch_workers_and_the_helper_thread():
    gate = DeviceWorkGate()
    ops = DeviceOps(gate)
    n = 300
    prefetcher = BatchPrefetcher(
        iter([_DeviceBatch(i, ops) for i in range(n)]), torch.device("cpu"), num_threads=4, depth=16, gate=gate
    )
    helper = HelperThread("torchrec_ext-test-helper", gate)
    stop = threading.Event()

    def keep_helper_busy():
        while not stop.is_set():
            helper.submit(ops.op).result(timeout=10)

    feeder = threading.Thread(target=keep_helper_busy)
    feeder.start()
    got, held = [], []
    try:
        for i in range(n):
            got.append(prefetcher.next().batch.value)
            if i % 60 == 30:  # a "capture" while every worker is mid-stream
                with gate.closed(timeout_s=10):
                    start = time.monotonic()
                    time.sleep(0.1)
                    held.append((start, time.monotonic()))
    finally:
        stop.set()
        feeder.join(10)
        prefetcher.close()
        helper.close(10)
    assert got == list(range(n))  # parking loses and reorders nothing
    assert len(held) == 5 and not ops.while_closed
    overlaps = [(a, b) for a, b in ops.spans for s, e in held if a < e and b > s]
    assert not overlaps, f"device ops ran while the gate was held: {overlaps[:3]}"
    assert len(ops.spans) > n  # the helper did run between captures


def test_closing_the_gate_waits_for_the_item_under_way():
    gate = DeviceWorkGate()
    started, finished = threading.Event(), []

    def slow_item():
        with gate.working():
            started.set()
            time.sleep(0.3)
            finished.append(time.monotonic())

    worker = threading.Thread(target=slow_item)
    worker.start()
    started.wait(5)
    with gate.closed(timeout_s=5):
        closed_at = time.monotonic()
    worker.join(5)
    assert finished and closed_at >= finished[0]


def test_gate_times_out_on_a_stuck_worker_and_reopens():
    gate = DeviceWorkGate()
    release, started = threading.Event(), threading.Event()

    def stuck():
        with gate.working():
            started.set()
            release.wait(10)

    worker = threading.Thread(target=stuck)
    worker.start()
    started.wait(5)
    with pytest.raises(TimeoutError, match="still on the device after 0 s"), gate.closed(timeout_s=0.2):
        pass
    assert not gate.is_closed
    release.set()
    worker.join(5)
    with gate.working():  # open again: nothing parks
        pass


# ----------------------------------------------------------------- streams and events


class FakeEvent:
    def __init__(self, log):
        self.log, self.stream = log, None

    def record(self, stream):
        self.stream = stream
        self.log.append(("record", stream.name, self))


class FakeStream:
    def __init__(self, name, log):
        self.name, self.log, self.waited = name, log, []

    def wait_event(self, event):
        assert event.stream is not None, "waiting for an event never recorded"
        self.waited.append(event)
        self.log.append(("wait", self.name, event))

    def __repr__(self):
        return f"FakeStream({self.name})"


class FakeStreams:
    """CudaStreams' shape, recording: which stream each thread issues work on, and every
    wait and record."""

    def __init__(self):
        self.log = []
        self._local = threading.local()
        self._count = 0
        self.main_dist = FakeStream("main_dist", self.log)
        self.compute = FakeStream("compute", self.log)
        self.made = []

    def new_stream(self):
        self._count += 1
        stream = FakeStream(f"s{self._count}", self.log)
        self.made.append(stream)
        return stream

    def new_event(self):
        return FakeEvent(self.log)

    def current(self):
        stack = getattr(self._local, "stack", [])
        return stack[-1] if stack else self.compute

    def use(self, stream):
        streams = self

        class _Use:
            def __enter__(self):
                streams._local.stack = getattr(streams._local, "stack", []) + [stream]

            def __exit__(self, *exc):
                streams._local.stack = streams._local.stack[:-1]

        return _Use()

    def mark_used(self, batch, stream):
        self.log.append(("used", stream.name, id(batch)))


class _HostBatch:
    def __init__(self, log):
        self.log = log

    def pin_memory(self):
        self.log.append(("pin",))
        return self

    def to(self, device, non_blocking=False):
        self.log.append(("copy", non_blocking))
        return self


def test_copy_to_device_pins_copies_on_its_stream_and_records_after_the_copy():
    streams = FakeStreams()
    stream = streams.new_stream()
    seen = []

    class Batch(_HostBatch):
        def to(self, device, non_blocking=False):
            seen.append(streams.current())
            return super().to(device, non_blocking)

    ready = copy_to_device(Batch(streams.log), torch.device("cpu"), streams, stream, pin=True)
    assert [e[0] for e in streams.log] == ["pin", "copy", "record"]
    assert streams.log[1] == ("copy", True) and seen == [stream]
    assert ready.copied.stream is stream
    consumer = streams.new_stream()
    assert ready.wait(consumer) is ready.batch
    assert consumer.waited == [ready.copied] and streams.log[-1] == ("used", consumer.name, id(ready.batch))


def test_a_batch_already_on_the_device_is_copied_without_pinning():
    # A dataloader that makes its batches on the GPU: pin_memory() refuses device tensors ("only
    # dense CPU tensors can be pinned"), so the pipeline failed on CUDA where TorchRec's takes
    # them. A meta tensor refuses pinning the same way on CPU.
    class DeviceBatch:
        def __init__(self, x):
            self.x = x

        def pin_memory(self):
            return DeviceBatch(self.x.pin_memory())

        def to(self, device, non_blocking=False):
            return DeviceBatch(self.x.to(device, non_blocking=non_blocking))

    streams = FakeStreams()
    stream = streams.new_stream()
    batch = DeviceBatch(torch.empty(4, device="meta"))
    ready = copy_to_device(batch, torch.device("meta"), streams, stream, pin=True)
    assert ready.batch.x.device.type == "meta" and ready.copied.stream is stream

    class Failing(DeviceBatch):
        def pin_memory(self):
            raise RuntimeError("CUDA error: out of memory")

    with pytest.raises(RuntimeError, match="out of memory"):  # other pinning errors are not hidden
        copy_to_device(Failing(batch.x), torch.device("meta"), streams, stream, pin=True)


def test_replay_fence_waits_for_every_read_since_the_last_replay():
    streams = FakeStreams()
    side = streams.new_stream()
    fence = ReplayFence()
    reads = [streams.new_event() for _ in range(2)]
    for event in reads:
        event.record(side)
        fence.read_by(event)
    replay = streams.new_stream()
    fence.before_replay(replay)
    assert replay.waited == reads
    fence.before_replay(replay)
    assert replay.waited == reads  # each read waited for once


def _ordering_in_the_pipeline(rank, world_size, options_kw):
    # The real pipeline over a DMP model on CPU, its streams replaced by recording fakes: every
    # input dist (the first batch's, each new iterator's first batch, and those launched a step
    # ahead) starts on a stream that has waited for that batch's copy; the ones launched ahead
    # run on a stream other than the main data-dist stream, and the main one waits for each of
    # them by its event.
    streams = FakeStreams()
    train_pipeline_module.device_streams = lambda device, main_dist: streams
    copies, dists = [], []

    def spy_copy(batch, device, streams_, stream, pin):
        ready = real_copy(batch, device, streams_, stream, pin)
        copies.append((ready, stream, threading.current_thread().name))
        return ready

    def spy_dist(modules, batch, context):
        dists.append((batch, streams.current(), threading.current_thread().name))
        return real_dist(modules, batch, context)

    real_copy, real_dist = prefetch_module.copy_to_device, train_pipeline_module._start_data_dist
    prefetch_module.copy_to_device = train_pipeline_module.copy_to_device = spy_copy
    train_pipeline_module._start_data_dist = spy_dist

    epochs = [make_batches(rank, batch_size=8, num_full=4, last=3, seed=s) for s in range(2)]
    reference, reference_opt = make_dmp_dlrm(world_size)
    want = plain_loop(reference, reference_opt, [b for batches in epochs for b in batches])
    model, optimizer = make_dmp_dlrm(world_size)
    losses = []
    with TrainPipeline(model, optimizer, torch.device("cpu"), PipelineOptions(**options_kw)) as pipeline:
        for batches in epochs:  # a new iterator per epoch
            it = iter(batches)
            while True:
                try:
                    losses.append(pipeline.progress(it)[0].detach().clone())
                except StopIteration:
                    break
        ahead = pipeline._ahead_dist_stream
    for got, w in zip(losses, want):
        torch.testing.assert_close(got, w, rtol=0, atol=0)
    assert len(losses) == len(want)

    n = len(want)
    assert len(copies) == n and len(dists) == n
    if options_kw["prefetch_threads"] == 0:  # inline: copied on the pipeline's own stream, with an event
        assert all(stream is not None and ready.copied.stream is stream for ready, stream, _ in copies)
    copied = {id(ready.batch): ready.copied for ready, _, _ in copies}
    for k, (batch, stream, _thread) in enumerate(dists):
        assert copied[id(batch)] in stream.waited, f"input dist {k} on {stream} not ordered after its copy"
    firsts = {0, len(epochs[0])}  # fill_pipeline's, one per iterator
    assert all(dists[k][1] is streams.main_dist for k in firsts)
    launched_ahead = [d for k, d in enumerate(dists) if k not in firsts]
    assert ahead is not streams.main_dist
    assert all(stream is ahead for _, stream, _ in launched_ahead)
    if options_kw["threaded_input_dist"]:
        assert all(thread == "torchrec_ext-input-dist" for _, _, thread in launched_ahead)
    done = [e for e in streams.main_dist.waited if e.stream is ahead]
    assert len(done) == len(launched_ahead)  # the main stream waits for each by its own event
    assert not [e for e in streams.main_dist.waited if e.stream not in (ahead,) and e not in copied.values()]


@pytest.mark.parametrize(
    "options_kw",
    [
        dict(prefetch_threads=2, threaded_input_dist=True),
        dict(prefetch_threads=0, threaded_input_dist=False),
        dict(prefetch_threads=0, threaded_input_dist=True),
    ],
    ids=["threads", "inline", "inline_copy_threaded_dist"],
)
def test_every_input_dist_is_ordered_after_its_copy_on_its_own_stream(options_kw):
    run_ranks(_ordering_in_the_pipeline, 1, options_kw)


# ----------------------------------------------------------------- graphs per model


def test_flat_grad_sync_captures_nothing_at_world_size_one():
    # Nothing to all-reduce and no optimizer step to capture: every step runs eagerly (on a
    # GPU the old code captured an empty graph; on CPU it called into CUDA and failed).
    model = nn.Linear(4, 2)
    sync = FlatGradSync(list(model.parameters()), None, capture=True, warmup_steps=1)
    assert not sync.graphed
    for _ in range(4):
        model(torch.randn(3, 4)).sum().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        sync()
        assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    assert sync._graph is None
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    assert FlatGradSync(list(model.parameters()), None, capture=True, optimizer=optimizer).graphed


def _mixed_dtypes_are_averaged_in_their_own_dtypes(rank, world_size):
    import torch.distributed as dist

    # A bfloat16 layer first, then float32 ones: each gradient averaged in its own dtype, as
    # DDP's per-dtype buckets do (one flat buffer in the first gradient's dtype rounded the
    # float32 gradients to bfloat16: 1/3 + rank / 1000 is not a bfloat16).
    model = nn.Sequential(nn.Linear(4, 4).to(torch.bfloat16), nn.Linear(4, 3), nn.Linear(3, 2, bias=False))
    params = list(model.parameters())
    for i, p in enumerate(params):
        p.grad = torch.full_like(p, 1 / 3 + rank / 1000 + i)
    want = []
    for p in params:
        g = p.grad / world_size
        dist.all_reduce(g)
        want.append(g)
    FlatGradSync(params, None)()
    for p, w in zip(params, want):
        assert p.grad.dtype == p.dtype and torch.equal(p.grad, w), (p.dtype, p.grad.flatten()[:2], w.flatten()[:2])


def test_flat_grad_sync_averages_each_dtype_in_its_own_buffer():
    run_ranks(_mixed_dtypes_are_averaged_in_their_own_dtypes, 2)


def _two_pipelines_share_one_grad_sync(rank, world_size):
    model, optimizer = make_dmp_dlrm(world_size)
    options = PipelineOptions(flat_dense_allreduce=True, prefetch_threads=0, threaded_input_dist=False)
    first = TrainPipeline(model, optimizer, torch.device("cpu"), options)
    second = TrainPipeline(model, optimizer, torch.device("cpu"), options)
    assert first._grad_sync is not None and first._grad_sync is second._grad_sync
    first.close()
    second.close()
    third = TrainPipeline(model, optimizer, torch.device("cpu"), options)
    assert third._grad_sync is first._grad_sync  # and so is the next segment's
    third.close()
    other, other_opt = make_dmp_dlrm(world_size)
    fourth = TrainPipeline(other, other_opt, torch.device("cpu"), options)
    assert fourth._grad_sync is not first._grad_sync  # another model, its own
    fourth.close()


def test_pipelines_over_one_model_share_its_grad_sync():
    run_ranks(_two_pipelines_share_one_grad_sync, 1)


def test_graphed_forward_is_installed_once_per_module():
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    original = module.forward
    first = GraphedForward.install(module)
    second = GraphedForward.install(module)  # a second pipeline over the same model
    assert first is second and module.forward is first
    assert first._original == original  # wraps the module's own forward, not another wrapper
    x = torch.randn(5, 4)
    torch.testing.assert_close(module(x), original(x), rtol=0, atol=0)


# ----------------------------------------------------------------- threads the gate does not hold


def test_quiesced_joins_threads_the_gate_does_not_hold_before_closing_it():
    # A stage of tiered tables may wait for an input dist on the gate's helper thread: joining it
    # after the gate closed would park that thread and deadlock; before, both finish.
    gate = DeviceWorkGate()
    helper = HelperThread("torchrec_ext-test-helper", gate)
    order = []

    def join_stage():
        order.append(("join", gate.is_closed))
        helper.submit(lambda: order.append("helper")).result(timeout=5)

    try:
        with quiesced(gate, 5, [join_stage]):
            order.append(("capture", gate.is_closed))
    finally:
        helper.close(5)
    assert order == [("join", False), "helper", ("capture", True)]


def test_flat_grad_sync_joins_other_threads_then_captures_with_the_gate_closed(monkeypatch):
    gate, events = DeviceWorkGate(), []

    class FakeGraph:
        def replay(self):
            events.append("replay")

    @contextmanager
    def fake_capture(graph, capture_error_mode):
        events.append(("capture", capture_error_mode, gate.is_closed))
        yield

    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", fake_capture)
    model = nn.Linear(4, 2)
    sync = FlatGradSync(
        list(model.parameters()),
        None,
        capture=True,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        warmup_steps=2,
    )
    for _ in range(5):
        model(torch.randn(3, 4)).sum().backward()
        sync(gate, 5, [lambda: events.append(("join", gate.is_closed))])
    # two warm-up steps, the capture (joined first, then the gate closed), a replay per step from then on
    assert events == [("join", False), ("capture", "thread_local", True), "replay", "replay", "replay"]


def test_a_captured_optimizer_step_is_captured_again_when_its_hyperparameters_change(monkeypatch):
    # The graph bakes the optimizer's Python-number hyperparameters in (an LR scheduler's new lr
    # would never reach the replays: a GPU-only silent error); a tensor lr is read at each replay.
    events = []

    class FakeGraph:
        def replay(self):
            events.append("replay")

    @contextmanager
    def fake_capture(graph, capture_error_mode):
        events.append("capture")
        yield

    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", fake_capture)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    sync = FlatGradSync(list(model.parameters()), None, capture=True, optimizer=optimizer, warmup_steps=1)
    for _ in range(5):
        model(torch.randn(3, 4)).sum().backward()
        sync(DeviceWorkGate(), 5)
        scheduler.step()  # lr halves after steps 2 and 4
    assert events == ["capture", "replay", "capture", "replay", "replay", "capture", "replay"]


def test_the_pipeline_joins_the_tiered_tables_stage_before_its_captures(tmp_path):
    from test_tiers import _backing, _bag_configs, _dlrm, _dlrm_batches
    from torchrec_ext import DynamicEmbeddingBagCollection

    ebc = DynamicEmbeddingBagCollection(
        _bag_configs(_backing("host", tmp_path), 0.3, policies=("lru", "lru")),
        optimizer="adagrad",
        optimizer_kwargs={"lr": 0.05},
    )
    model, optimizer = _dlrm(ebc)
    options = PipelineOptions(prefetch_threads=0, threaded_input_dist=False, tier_prefetch=True)
    with TrainPipeline(model, optimizer, torch.device("cpu"), options) as pipeline:
        it = iter(_dlrm_batches(4))
        pipeline.progress(it)
        assert ebc._tables._staging is not None  # batch 1's stage, started by batch 0's lookup
        pipeline._join_stages()
        assert ebc._tables._staging is None
        pipeline.progress(it)


def _grad_sync_is_handed_the_stage_join(rank, world_size):
    calls, original = [], FlatGradSync.__call__

    def recording(self, gate, timeout_s, join_before_capture=()):
        calls.append(join_before_capture)
        return original(self, gate, timeout_s, join_before_capture)

    FlatGradSync.__call__ = recording
    try:
        model, optimizer = make_dmp_dlrm(world_size)
        options = PipelineOptions(flat_dense_allreduce=True, prefetch_threads=0, threaded_input_dist=False)
        with TrainPipeline(model, optimizer, torch.device("cpu"), options) as pipeline:
            progress_losses(pipeline, make_batches(rank, batch_size=8, num_full=2, last=3, seed=0))
            assert len(calls) == 3 and all(join == (pipeline._join_stages,) for join in calls)
    finally:
        FlatGradSync.__call__ = original


def test_the_pipeline_hands_its_stage_join_to_the_dense_sync():
    run_ranks(_grad_sync_is_handed_the_stage_join, 1)
