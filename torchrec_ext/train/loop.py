"""One training segment of the job: trains on a run of batches with the chosen train loop
(``--pipeline``: ``ours`` = torchrec_ext's TrainPipeline, ``torchrec`` = TorchRec's
TrainPipelineSparseDist, ``plain`` = forward, backward, step) and returns each step's loss.

A pipeline is built per segment and closed at its end, so evals and checkpoints between
segments see a model with no batch in flight."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from torchrec_ext.train.progress import Progress
from torchrec_ext.train.tier_traffic import TierTraffic, model_tier_step_stats


def run_segment(
    kind: str,
    dmp: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Iterator,
    device: torch.device,
    progress: Progress,
    tiers: TierTraffic,
) -> list[torch.Tensor]:
    """Trains on every batch of ``batches`` with the train loop ``kind``; returns each step's
    (local) loss, in order, and adds each step's tier traffic (tiered tables) to ``tiers``."""
    loops = {"plain": _plain_loop, "torchrec": _torchrec_pipeline, "ours": _our_pipeline}
    return loops[kind](_Segment(dmp, optimizer, device, progress, tiers), batches)


def global_mean(losses: list[torch.Tensor], device: torch.device) -> list[float]:
    """Per step, the mean over ranks of the ranks' losses (collective)."""
    if not losses:
        return []
    t = torch.stack([loss.to(device) for loss in losses]).double()
    dist.all_reduce(t)
    return (t / dist.get_world_size()).tolist()


@dataclass
class _Segment:
    """What every train loop trains with, and where it records each step."""

    dmp: torch.nn.Module
    optimizer: torch.optim.Optimizer
    device: torch.device
    progress: Progress
    tiers: TierTraffic
    losses: list[torch.Tensor] = field(default_factory=list)

    def record(self, loss: torch.Tensor) -> None:
        """A step of a loop that returns its loss at once: its loss and the model's tier traffic."""
        self.tiers.add(model_tier_step_stats(self.dmp))
        self.losses.append(loss.detach())
        self.progress.step(loss.detach())


def _plain_loop(seg: _Segment, batches: Iterator) -> list[torch.Tensor]:
    for batch in batches:
        batch = batch.to(seg.device, non_blocking=True)
        seg.optimizer.zero_grad()
        loss, _ = seg.dmp(batch)
        loss.backward()
        seg.optimizer.step()
        seg.record(loss)
    return seg.losses


def _torchrec_pipeline(seg: _Segment, batches: Iterator) -> list[torch.Tensor]:
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    pipeline = TrainPipelineSparseDist(seg.dmp, seg.optimizer, seg.device, execute_all_batches=True)
    try:
        while True:
            try:
                loss, _, _ = pipeline.progress(batches)
            except StopIteration:
                break
            seg.record(loss)
    finally:
        pipeline.detach()  # the model's original forwards back, for eval and the next segment
    return seg.losses


def _our_pipeline(seg: _Segment, batches: Iterator) -> list[torch.Tensor]:
    from torchrec_ext.pipeline import TrainPipeline

    host: dict[int, torch.Tensor] = {}
    with TrainPipeline(seg.dmp, seg.optimizer, seg.device) as pipeline:
        while True:
            try:
                pipeline.progress(batches)
            except StopIteration:
                break
            seg.tiers.add(pipeline.tier_step_stats())  # the step's lookup and the stage that ran ahead of it
            latest = None
            for step, (loss, _, _) in pipeline.pop_host_outputs():  # copied to host without a sync
                host[step] = loss
                latest = loss
            seg.progress.step(latest)
        for step, (loss, _, _) in pipeline.drain_host_outputs():
            host[step] = loss
    return [host[i] for i in range(len(host))]
