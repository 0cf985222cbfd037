"""The process's capture gate (torchrec_ext/device_gate.py) and the tiered tables' stage worker
under it, on CPU: a capture (``torchrec_ext.quiesced()``, what a user wraps their own
``torch.cuda.graph`` in) waits for a stage in flight, a stage started during a capture waits for
its end, and a stage waiting for the pipeline's input dist never deadlocks with a capture. Times
are recorded by the threads themselves (the stage's resolve call stands in for its device work).
Every wait is bounded: a deadlock fails the test instead of hanging it."""

import threading
import time
from concurrent.futures import Future
from types import SimpleNamespace

import pytest
import torch

import torchrec_ext
from modules_helpers import random_kjt
from torchrec_ext import DynamicEmbeddingBagCollection, DynamicEmbeddingBagConfig
from torchrec_ext.device_gate import DEVICE_WORK, DeviceWorkGate
from torchrec_ext.pipeline import TrainPipeline, quiesce
from torchrec_ext.pipeline.worker import HelperThread

POOL = torch.randint(-(2**62), 2**62, (500,), generator=torch.Generator().manual_seed(5))
FEATURES = ["f0", "f1"]


def _bounded(fn, timeout_s=20.0):
    """Runs ``fn`` on a daemon thread; fails (instead of hanging) if it is not back in time."""
    out: list = []

    def run():
        try:
            out.append(("ok", fn()))
        except BaseException as e:  # noqa: BLE001 - re-raised below
            out.append(("error", e))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert out, f"deadlock: not done after {timeout_s} s"
    kind, value = out[0]
    if kind == "error":
        raise value
    return value


def _tiered_module():
    configs = [
        DynamicEmbeddingBagConfig(
            name="t", embedding_dim=8, num_embeddings=256, feature_names=FEATURES, backing="host", cache_load_factor=0.3
        )
    ]
    return DynamicEmbeddingBagCollection(configs, optimizer="sgd", optimizer_kwargs={"lr": 0.05})


def _batch(seed):
    torch.manual_seed(seed)
    return random_kjt(FEATURES, 4, POOL, 4)


def test_the_public_names_are_one_gate():
    assert quiesce.DEVICE_WORK is DEVICE_WORK and quiesce.DeviceWorkGate is DeviceWorkGate
    assert torchrec_ext.quiesced is torchrec_ext.device_gate.quiesced


def test_a_capture_waits_for_the_stage_in_flight():
    module, kjt0, kjt1 = _tiered_module(), _batch(0), _batch(1)
    started, resolved = threading.Event(), []

    def next_features():  # on the stage's worker, inside its device work
        started.set()
        time.sleep(0.3)
        resolved.append(time.monotonic())
        return kjt1

    def body():
        module.stage_next(next_features)
        module(kjt0)  # starts the stage
        assert started.wait(10)
        with torchrec_ext.quiesced(timeout_s=10):
            entered = time.monotonic()
            stage_done = module._tables._staging.done()
        module(kjt1)
        return entered, stage_done

    entered, stage_done = _bounded(body)
    assert resolved and entered >= resolved[0] and stage_done


def test_a_stage_started_during_a_capture_waits_for_its_end():
    module, kjt0, kjt1 = _tiered_module(), _batch(0), _batch(1)
    capturing, captured = threading.Event(), []
    resolved = []

    def capture():  # a user's capture on another thread
        with torchrec_ext.quiesced(timeout_s=10):
            capturing.set()
            time.sleep(0.3)
            captured.append(time.monotonic())

    def next_features():
        resolved.append(time.monotonic())
        return kjt1

    def body():
        capturer = threading.Thread(target=capture)
        capturer.start()
        assert capturing.wait(10)
        module.stage_next(next_features)
        module(kjt0)  # the lookup runs; its stage parks at the gate
        capturer.join(10)
        module(kjt1)  # joins the stage

    _bounded(body)
    assert captured and resolved and resolved[0] >= captured[0]  # the stage ran, after the capture


def test_a_stage_waiting_for_the_input_dist_does_not_deadlock_a_capture():
    # The stage holds the gate and waits for the pipeline's input dist, launched on the helper
    # thread; a capture closes the gate before that job starts, so the helper parks at it.
    # The stage steps aside from the gate for that wait: the capture need not wait for it.
    module, kjt0, kjt1 = _tiered_module(), _batch(0), _batch(1)
    helper = HelperThread("torchrec_ext-test-helper", DEVICE_WORK)
    launched: Future = Future()
    context = SimpleNamespace(input_dist_tensors_requests={"m": SimpleNamespace(wait=lambda: kjt1)})
    pipeline = SimpleNamespace(_dist_future=launched, options=SimpleNamespace(timeout_s=10), _gate=DEVICE_WORK)
    dist_input = TrainPipeline._dist_input_of(pipeline, context, "m")
    waiting, received = threading.Event(), []

    def next_features():
        waiting.set()
        received.append(dist_input())
        return received[-1]

    def body():
        module.stage_next(next_features)
        module(kjt0)
        assert waiting.wait(10)
        time.sleep(0.05)  # the stage is in launched.result()
        with torchrec_ext.quiesced(timeout_s=3):
            job = helper.submit(lambda: launched.set_result(None))
            time.sleep(0.1)
            parked = not job.done()
        job.result(10)
        module(kjt1)  # joins the stage
        return parked

    try:
        parked = _bounded(body)
    finally:
        helper.close(10)
    assert parked and received == [kjt1]  # the stage got its ids once the capture was over


def test_a_nested_working_never_parks_and_a_holder_cannot_close_the_gate():
    gate = DeviceWorkGate()
    inside, closing, order = threading.Event(), threading.Event(), []

    def holder():
        with gate.working():
            inside.set()
            assert closing.wait(10)
            time.sleep(0.1)  # the capture is waiting for this thread now
            with gate.working():  # would deadlock if it parked
                order.append("nested")
            try:
                with gate.closed(1):
                    order.append("closed by a holder")
            except RuntimeError as e:
                order.append(str(e).split(":")[0])

    def body():
        thread = threading.Thread(target=holder)
        thread.start()
        assert inside.wait(10)
        closing.set()
        with gate.closed(10):
            order.append("captured")
        thread.join(10)

    _bounded(body)
    assert order == ["nested", "DeviceWorkGate", "captured"]


def test_stepping_aside_comes_back_through_the_gate():
    gate = DeviceWorkGate()
    aside, order = threading.Event(), []
    release = threading.Event()

    def holder():
        with gate.working():
            with gate.stepped_aside():
                aside.set()
                assert release.wait(10)
            order.append(("back", time.monotonic()))

    def body():
        thread = threading.Thread(target=holder)
        thread.start()
        assert aside.wait(10)
        with gate.closed(2):  # does not wait for the thread stepped aside
            release.set()
            time.sleep(0.2)
            order.append(("captured", time.monotonic()))
        thread.join(10)

    _bounded(body)
    assert [name for name, _ in order] == ["captured", "back"]
    assert not gate.is_closed and gate._active == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_user_capture_while_a_tiered_stage_runs_on_cuda(tmp_path):
    # A user's own capture in the default (global) error mode while a tiered stage copies, syncs
    # and allocates on its worker: quiesced() holds the stage off the device, so the capture is
    # valid (replays equal eager) and the tables train on as all-resident ones.
    from test_tiers import _backing, _bag_configs
    from test_tiers_device import _assert_same, _batches, _make

    device = torch.device("cuda")
    resident, tiered = _make(_bag_configs(), device), _make(_bag_configs(_backing("host", tmp_path), 0.3), device)
    batches = _batches(8, seed=3, device=device)
    dense = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)).to(device)
    static_x = torch.randn(32, 64, device=device)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up, as torch.cuda.graph asks
        for _ in range(3):
            dense(static_x)
    torch.cuda.current_stream().wait_stream(side)
    in_stage = threading.Event()

    def churning(kjt):
        def features():  # on the stage's worker: allocations and syncs, as a stage makes
            in_stage.set()
            for i in range(200):
                torch.empty(1 << (16 + i % 3), device=device).fill_(1.0).sum().item()
            return kjt

        return features

    graph = None
    for step, kjt in enumerate(batches):
        if step + 1 < len(batches):
            assert tiered.stage_next(churning(batches[step + 1]))
        outs = [m(kjt).values() for m in (resident, tiered)]
        _assert_same(outs[0], outs[1], step)
        if step == 3:  # the stage of batch 4 is in flight
            assert in_stage.wait(10)
            with torchrec_ext.quiesced(timeout_s=60):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    static_y = dense(static_x)
        grad = torch.randn(outs[0].shape, device=device)
        for out in outs:
            out.backward(grad)
        in_stage.clear()
    x = torch.randn(32, 64, device=device)
    static_x.copy_(x)
    graph.replay()
    torch.testing.assert_close(static_y, dense(x))
