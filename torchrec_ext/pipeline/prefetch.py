"""Multithreaded input prefetch: worker threads pull batches ahead of the train loop, pin them
and copy them to the device on their own copy streams, and hand them over in dataloader order.

The dataloader iterator is not assumed thread-safe: ``next()`` is called under a lock. What the
workers overlap is everything after it: pinning, the host-to-device copy, and (for iterators
that release the GIL) their own work. A worker's exception reaches the consumer unchanged, with
its original traceback, in its place in the order: every batch pulled before the failing one is
handed out first. Every wait is bounded, so nothing hangs.

A worker's device work (its copy stream, pinning, the copy) runs inside the process's
``DeviceWorkGate``: a CUDA graph capture holds it closed, and workers finish the batch in hand
and park. Pulling from the dataloader is host work and goes on.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from torchrec_ext.pipeline.quiesce import DEVICE_WORK, DeviceWorkGate
from torchrec_ext.pipeline.streams import CudaStreams, device_streams, record_event


@dataclass
class ReadyBatch:
    """A batch on the device, the event its copy recorded and the streams that made it (None on CPU)."""

    batch: Any
    copied: Any = None
    streams: CudaStreams | None = None

    def wait(self, stream: Any) -> Any:
        """Makes ``stream`` wait for the copy and tells the allocator the batch is used there."""
        if self.copied is not None and stream is not None:
            stream.wait_event(self.copied)
            self.streams.mark_used(self.batch, stream)
        return self.batch


def copy_to_device(batch: Any, device: torch.device, streams: CudaStreams | None, stream: Any, pin: bool) -> ReadyBatch:
    """Copies ``batch`` to ``device`` on ``stream`` without blocking the host: pinned first (a
    non-blocking copy from pageable memory is neither asynchronous nor ordered by an event), then
    an event recorded after the copy, which every reader of the batch waits for."""
    if streams is None:
        return ReadyBatch(batch.to(device, non_blocking=False))
    with streams.use(stream):
        if pin and hasattr(batch, "pin_memory"):
            batch = _pinned(batch)
        batch = batch.to(device, non_blocking=True)
        return ReadyBatch(batch, record_event(streams, stream), streams)


def _pinned(batch: Any) -> Any:
    """``batch`` in pinned memory; as it is when it is already on the device (a dataloader that
    makes its batches there: ``pin_memory`` refuses them, and their ``.to(device)`` copies nothing)."""
    try:
        return batch.pin_memory()
    except RuntimeError as e:
        if "only dense CPU tensors can be pinned" not in str(e):
            raise
        return batch


class BatchPrefetcher:
    def __init__(
        self,
        dataloader_iter: Iterator[Any],
        device: torch.device,
        *,
        num_threads: int = 2,
        depth: int | None = None,
        pin_memory: bool = True,
        timeout_s: float = 600.0,
        streams: CudaStreams | None = None,
        gate: DeviceWorkGate = DEVICE_WORK,
    ) -> None:
        """``streams``: where each worker makes its copy stream (default: the device's; on CPU
        none, and batches are copied with a plain ``.to(device)``)."""
        if num_threads < 1:
            raise ValueError(f"BatchPrefetcher: num_threads must be >= 1, got {num_threads}")
        self._iter = dataloader_iter
        self._device = device
        self._streams = streams if streams is not None else device_streams(device, None)
        self._gate = gate
        self._pin = pin_memory and device.type == "cuda"
        self._timeout_s = timeout_s
        self._pull_lock = threading.Lock()  # serialises next(dataloader_iter) and numbering
        self._cond = threading.Condition()  # guards everything below
        self._ready: dict[int, ReadyBatch] = {}
        self._pulled = 0  # batches taken from the iterator so far
        self._handed = 0  # batches given to the consumer so far
        self._end: int | None = None  # number of batches the iterator had, once known
        self._error: BaseException | None = None
        self._error_at = 0  # sequence number of the batch whose pull or copy failed
        self._closed = False
        self._slots = threading.Semaphore(depth or 2 * num_threads)  # bounds batches ahead
        self._threads: list[threading.Thread] = [
            threading.Thread(target=self._work, name=f"torchrec_ext-prefetch-{i}", daemon=True)
            for i in range(num_threads)
        ]
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------------ consumer side

    def next(self) -> ReadyBatch:
        """The next batch in dataloader order; StopIteration after the last one."""
        with self._cond:
            while True:
                if self._handed in self._ready:
                    ready = self._ready.pop(self._handed)
                    self._handed += 1
                    self._slots.release()
                    return ready
                if self._error is not None and self._handed >= self._error_at:
                    raise self._error
                if self._end is not None and self._handed >= self._end:
                    raise StopIteration
                if self._closed:
                    raise RuntimeError("BatchPrefetcher: next() after close()")
                if not self._cond.wait(timeout=self._timeout_s):
                    raise TimeoutError(
                        f"BatchPrefetcher: no batch within {self._timeout_s:.0f} s "
                        f"(batch {self._handed}, {len(self._ready)} ready, workers alive: "
                        f"{sum(t.is_alive() for t in self._threads)})"
                    )

    def close(self, timeout_s: float = 30.0) -> None:
        """Stops the workers and joins them; batches not handed out are dropped."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for _ in self._threads:
            self._slots.release()  # wake workers blocked on a slot
        for t in self._threads:
            t.join(timeout=timeout_s)

    # ------------------------------------------------------------------ worker side

    def _work(self) -> None:
        stream = None  # made at the first copy, inside the gate
        while True:
            self._slots.acquire()
            with self._pull_lock:
                with self._cond:
                    if self._closed or self._error is not None or self._end is not None:
                        return
                seq = self._pulled
                try:
                    batch = next(self._iter)
                except StopIteration:
                    with self._cond:
                        self._end = seq
                        self._cond.notify_all()
                    return
                except BaseException as e:  # noqa: BLE001 - handed to the consumer as is
                    self._fail(seq, e)
                    return
                self._pulled += 1
            try:
                with self._gate.working():
                    if stream is None and self._streams is not None:
                        stream = self._streams.new_stream()
                    ready = copy_to_device(batch, self._device, self._streams, stream, self._pin)
            except BaseException as e:  # noqa: BLE001
                self._fail(seq, e)
                return
            with self._cond:
                self._ready[seq] = ready
                self._cond.notify_all()

    def _fail(self, seq: int, error: BaseException) -> None:
        # Batches before seq may still be copying on other workers: the consumer gets them
        # first. Of two failures the earlier batch's wins.
        with self._cond:
            if self._error is None or seq < self._error_at:
                self._error, self._error_at = error, seq
            self._cond.notify_all()
