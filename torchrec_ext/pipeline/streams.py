"""The streams and events the pipeline's own code orders its work with, behind one small object.

``CudaStreams`` issues the real calls; on CPU the pipeline has none (``device_streams`` returns
None) and orders nothing. Everything the pipeline decides about ordering goes through these
methods and through ``stream.wait_event`` / ``event.record``, so tests can check the decisions on
CPU with recording fakes of the same shape.

``main_dist`` is TorchRec's data-dist stream, the one its pipelined forwards wait on. The
pipeline keeps on it only what the next forward needs: the main thread's input dists (the first
batch's, a new iterator's) and, for a batch whose input dist ran a step ahead on a stream of its
own, a wait for that batch's event — not for a stream already busy with the batch after it.
"""

from __future__ import annotations

from typing import Any

import torch


class CudaStreams:
    def __init__(self, device: torch.device, main_dist: torch.cuda.Stream | None = None) -> None:
        self.device = device
        self.main_dist = main_dist

    def new_stream(self) -> torch.cuda.Stream:
        return torch.cuda.Stream(self.device)

    def new_event(self) -> torch.cuda.Event:
        return torch.cuda.Event()

    def use(self, stream: torch.cuda.Stream):
        """Context in which work is issued on ``stream``."""
        return torch.cuda.stream(stream)

    def current(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    @staticmethod
    def mark_used(batch: Any, stream: torch.cuda.Stream) -> None:
        """Tells the caching allocator ``batch`` is read on ``stream`` (it was made on another)."""
        batch.record_stream(stream)


def device_streams(device: torch.device, main_dist: torch.cuda.Stream | None) -> CudaStreams | None:
    """The pipeline's streams on a CUDA device; None elsewhere."""
    return CudaStreams(device, main_dist) if device.type == "cuda" else None


def record_event(streams: CudaStreams, stream: Any) -> Any:
    """An event marking the work issued on ``stream`` so far."""
    event = streams.new_event()
    event.record(stream)
    return event


class ReplayFence:
    """Reads of a CUDA graph's static outputs on other streams (the pinned device-to-host copy of
    a step's outputs), which the graph's next replay must wait for: the replay overwrites them."""

    def __init__(self) -> None:
        self._reads: list[Any] = []

    def read_by(self, event: Any) -> None:
        """``event`` completes once a read of the static outputs has finished."""
        self._reads.append(event)

    def before_replay(self, stream: Any) -> None:
        """Makes ``stream`` (the one the replay runs on) wait for every read noted since the last replay."""
        for event in self._reads:
            stream.wait_event(event)
        self._reads.clear()
