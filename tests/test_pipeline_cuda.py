"""The CUDA-only stages of the pipeline, each against its eager/CPU equivalent. They skip
without a GPU (the whole-pipeline comparison on GPU needs embedding kernels that run there:
stock TorchRec tables need fbgemm's CUDA build). The ordering rules behind them are checked on
CPU with fake streams in test_pipeline_ordering.py."""

import copy
import threading

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from torchrec_ext.pipeline.dense_sync import FlatGradSync, GraphedForward
from torchrec_ext.pipeline.host_outputs import HostOutputs
from torchrec_ext.pipeline.prefetch import BatchPrefetcher
from torchrec_ext.pipeline.quiesce import DEVICE_WORK
from torchrec_ext.pipeline.worker import HelperThread

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


class _Batch:
    def __init__(self, x):
        self.x = x

    def to(self, device, non_blocking=False):
        return _Batch(self.x.to(device, non_blocking=non_blocking))

    def pin_memory(self):
        return _Batch(self.x.pin_memory())

    def record_stream(self, stream):
        self.x.record_stream(stream)


def test_prefetcher_copies_on_its_streams_and_keeps_order():
    device = torch.device("cuda")
    host = [torch.randn(1000, 64) for _ in range(20)]
    prefetcher = BatchPrefetcher(iter([_Batch(x) for x in host]), device, num_threads=3)
    got = []
    with pytest.raises(StopIteration):
        while True:
            ready = prefetcher.next()
            batch = ready.wait(torch.cuda.current_stream())
            assert batch.x.is_cuda
            got.append(batch.x.cpu())
    prefetcher.close()
    assert all(torch.equal(a, b) for a, b in zip(got, host))


def test_host_outputs_are_pinned_copies_surfaced_without_sync():
    outputs = HostOutputs(torch.device("cuda"))
    sent = []
    for step in range(5):
        loss = torch.randn((), device="cuda")
        logits = torch.randn(128, device="cuda")
        outputs.push(step, (loss, {"logits": logits}))
        sent.append((loss.cpu(), logits.cpu()))
    got = outputs.drain()
    assert [s for s, _ in got] == list(range(5))
    for (_, (loss, d)), (want_loss, want_logits) in zip(got, sent):
        assert loss.is_pinned() and d["logits"].is_pinned()
        assert torch.equal(loss, want_loss) and torch.equal(d["logits"], want_logits)


def test_graphed_forward_matches_eager_and_falls_back_for_other_shapes():
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)).cuda()
    graphed = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)).cuda()
    graphed.load_state_dict(eager.state_dict())
    GraphedForward(graphed)
    for batch in (64, 64, 64, 24):  # the last, partial batch runs eagerly
        x = torch.randn(batch, 16, device="cuda", requires_grad=True)
        x2 = x.detach().clone().requires_grad_()
        eager.zero_grad()
        graphed.zero_grad()
        eager(x).sum().backward()
        graphed(x2).sum().backward()
        torch.testing.assert_close(x2.grad, x.grad)
        for p, q in zip(graphed.parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
    assert list(graphed.state_dict()) == list(eager.state_dict())  # state-dict keys unchanged


def _mlp():
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1)).cuda()


def _adam(model):
    return torch.optim.Adam(model.parameters(), lr=1e-2, capturable=True)


def test_captures_stay_valid_while_workers_touch_cuda():
    # Prefetch workers pin and copy (cudaHostAlloc, async copies) and the helper thread syncs
    # (.item(), .tolist(), cudaMalloc) all through both captures: the forward/backward graphs
    # and the optimizer-step graph. The gate parks them; the results equal eager training.
    device = torch.device("cuda")
    torch.manual_seed(0)
    host = [torch.randn(2048, 64) for _ in range(400)]
    prefetcher = BatchPrefetcher(iter([_Batch(x) for x in host]), device, num_threads=4, depth=16)
    helper = HelperThread("torchrec_ext-test-helper", DEVICE_WORK)
    stop = threading.Event()

    def sync_heavy():
        t = torch.randn(4096, device=device)
        t.sum().item()
        t[:8].tolist()
        torch.empty(1 << 22, device=device).fill_(1)

    def keep_helper_busy():
        while not stop.is_set():
            helper.submit(sync_heavy).result(timeout=60)

    feeder = threading.Thread(target=keep_helper_busy)
    feeder.start()
    eager = _mlp()
    graphed = copy.deepcopy(eager)
    GraphedForward.install(graphed)
    eager_opt, graphed_opt = _adam(eager), _adam(graphed)
    sync = FlatGradSync(list(graphed.parameters()), None, capture=True, optimizer=graphed_opt, warmup_steps=2)
    got = []
    try:
        for step in range(8):
            x = torch.randn(128, 64, device=device)
            for model in (eager, graphed):
                model.zero_grad(set_to_none=False)
                model(x).square().mean().backward()
            # gradients first: a mismatch here is the backward's (the graphed one), not Adam's
            for (name, p), q in zip(graphed.named_parameters(), eager.parameters()):
                torch.testing.assert_close(
                    p.grad, q.grad, msg=lambda m, step=step, n=name: f"step {step} grad {n}: {m}"
                )
            eager_opt.step()
            sync()  # steps graphed_opt, from step 3 on by replaying its graph
            for p, q in zip(graphed.parameters(), eager.parameters()):
                torch.testing.assert_close(p, q, msg=lambda m, step=step: f"step {step}: {m}")
            got.append(prefetcher.next().wait(torch.cuda.current_stream()).x.cpu())
    finally:
        stop.set()
        feeder.join(60)
        prefetcher.close()
        helper.close(60)
    assert sync._graph is not None and graphed.forward._graphed is not None
    assert all(torch.equal(a, b) for a, b in zip(got, host))


def test_world_size_one_captures_no_all_reduce_graph():
    model = _mlp()
    sync = FlatGradSync(list(model.parameters()), None, capture=True, warmup_steps=1)
    for _ in range(4):
        model.zero_grad(set_to_none=False)
        model(torch.randn(32, 64, device="cuda")).sum().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        sync()
        assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    assert not sync.graphed and sync._graph is None


@pytest.fixture
def nccl_world_of_one(tmp_path):
    dist.init_process_group("nccl", init_method=f"file://{tmp_path}/init", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_pipelines_over_one_model_replay_one_graph(nccl_world_of_one):
    # Two pipelines (two segments) over one DDP model get one FlatGradSync: the second replays
    # the first one's graph. Gradients re-made elsewhere (set to None) get a new capture.
    torch.manual_seed(0)
    eager = _mlp()
    ddp = DistributedDataParallel(copy.deepcopy(eager), device_ids=[0])
    eager_opt, opt = _adam(eager), _adam(ddp.module)
    first = FlatGradSync.of(ddp, capture=True, optimizer=opt)
    assert FlatGradSync.of(ddp, capture=True, optimizer=opt) is first

    def step(sync, set_to_none=False):
        x = torch.randn(64, 64, device="cuda")
        eager.zero_grad(set_to_none=set_to_none)
        ddp.module.zero_grad(set_to_none=set_to_none)
        eager(x).square().mean().backward()
        ddp.module(x).square().mean().backward()
        eager_opt.step()
        sync()
        for p, q in zip(ddp.module.parameters(), eager.parameters()):
            torch.testing.assert_close(p, q)

    for _ in range(5):
        step(first)
    graph = first._graph
    assert graph is not None
    second = FlatGradSync.of(ddp, capture=True, optimizer=opt)  # the next pipeline
    for _ in range(2):
        step(second)
    assert second is first and second._graph is graph  # replayed, not captured again
    step(second, set_to_none=True)  # new gradient storage: captured again, still correct
    assert second._graph is not graph

    module = _mlp()
    graphed = GraphedForward.install(module)
    module(torch.randn(16, 64, device="cuda")).sum().backward()
    captured = graphed._graphed
    assert GraphedForward.install(module) is graphed
    module(torch.randn(16, 64, device="cuda")).sum().backward()
    assert graphed._graphed is captured


def test_next_replay_waits_for_the_pinned_copy_of_its_static_outputs():
    # A graphed module's output aliases the graph's static output buffer. The step's output is
    # copied to pinned memory on a side stream, held back here by a sleep on that stream; the
    # next replay must wait for that copy, or the host sees the next step's values.
    torch.manual_seed(0)
    module = nn.Linear(256, 1 << 16).cuda()
    graphed = GraphedForward.install(module)
    outputs = HostOutputs(torch.device("cuda"))
    x1, x2 = torch.randn(8, 256, device="cuda"), torch.randn(8, 256, device="cuda")
    module(x1)  # capture
    want = graphed._original(x1).detach().cpu()
    y1 = module(x1)  # replay: y1 is the static output
    with torch.cuda.stream(outputs._stream):
        torch.cuda._sleep(1 << 30)  # ~0.5 s of GPU time before the copy starts
    copied = outputs.push(0, y1.detach())
    graphed.outputs_read.read_by(copied)
    module(x2)  # replay: overwrites y1's buffer once the copy is done
    ((_, host),) = outputs.drain()
    torch.testing.assert_close(host, want)


def _our_cuda_kernels() -> bool:
    from torchrec_ext import ops

    return torch.cuda.is_available() and ops.has_kernel("hash_find", torch.device("cuda"))


@pytest.mark.skipif(not _our_cuda_kernels(), reason="needs a CUDA build of torchrec_ext")
def test_a_capture_joins_the_tiered_tables_stage_and_trains_as_eager(tmp_path):
    # Tiered tables stage batch i+1's rows on a worker thread (copies, syncs, allocations) that
    # the capture gate does not hold; the mlp's capture, right after batch 0's lookup started
    # that stage, first joins it. Oracle: all-resident tables, eager mlp, a plain loop.
    from dist_helpers import progress_losses
    from test_tiers import _backing, _bag_configs, _dlrm_batches, _Ranker
    from torchrec_ext import DynamicEmbeddingBagCollection
    from torchrec_ext.pipeline import PipelineOptions, TrainPipeline

    device = torch.device("cuda")

    def build(configs):
        torch.manual_seed(0)
        ebc = DynamicEmbeddingBagCollection(configs, optimizer="adagrad", optimizer_kwargs={"lr": 0.05}, device=device)
        model = _Ranker(ebc)
        model.mlp.to(device)
        return model, torch.optim.Adagrad(model.mlp.parameters(), lr=0.05)

    batches = _dlrm_batches(12)
    eager, eager_opt = build(_bag_configs(policies=("lru", "lru")))
    want = []
    for batch in batches:
        eager_opt.zero_grad()
        loss, _ = eager(batch.to(device))
        loss.backward()
        eager_opt.step()
        want.append(loss.detach().clone())
    tiered, optimizer = build(_bag_configs(_backing("host", tmp_path), 0.3, policies=("lru", "lru")))
    options = PipelineOptions(prefetch_threads=2, threaded_input_dist=True, tier_prefetch=True, graph_modules=("mlp",))
    stats = []
    with TrainPipeline(tiered, optimizer, device, options) as pipeline:
        losses = progress_losses(pipeline, batches, stats)
    assert tiered.mlp.forward._graphed is not None  # captured, and replayed from then on
    assert sum(s["staged"] for step in stats for s in step.values()) > 0
    assert len(losses) == len(want)
    for step, (got, expected) in enumerate(zip(losses, want)):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5, msg=lambda m, step=step: f"step {step}: {m}")
