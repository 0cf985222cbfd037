"""The CUDA-only stages of the pipeline, each against its eager/CPU equivalent. They skip
without a GPU (the whole-pipeline comparison on GPU needs embedding kernels that run there:
stock TorchRec tables need fbgemm's CUDA build)."""
import pytest
import torch
from torch import nn

from torchrec_ext.pipeline.dense_sync import GraphedForward
from torchrec_ext.pipeline.host_outputs import HostOutputs
from torchrec_ext.pipeline.prefetch import BatchPrefetcher

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
