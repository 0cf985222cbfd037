"""Multithreaded input prefetch: worker threads pull batches ahead of the train loop, pin them
and copy them to the device on their own copy streams, and hand them over in dataloader order.

The dataloader iterator is not assumed thread-safe: ``next()`` is called under a lock. What the
workers overlap is everything after it: pinning, the host-to-device copy, and (for iterators
that release the GIL) their own work. A worker's exception reaches the consumer unchanged, with
its original traceback, in its place in the order: every batch pulled before the failing one is
handed out first. Every wait is bounded, so nothing hangs.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional

import torch


@dataclass
class ReadyBatch:
    """A batch on the device, and the event its copy recorded (None on CPU)."""

    batch: Any
    copied: Optional[torch.cuda.Event]

    def wait(self, stream: Optional[torch.cuda.Stream]) -> Any:
        """Makes ``stream`` wait for the copy and tells the allocator the batch is used there."""
        if self.copied is not None and stream is not None:
            stream.wait_event(self.copied)
            self.batch.record_stream(stream)
        return self.batch


class BatchPrefetcher:
    def __init__(
        self,
        dataloader_iter: Iterator[Any],
        device: torch.device,
        *,
        num_threads: int = 2,
        depth: Optional[int] = None,
        pin_memory: bool = True,
        timeout_s: float = 600.0,
    ) -> None:
        if num_threads < 1:
            raise ValueError(f"BatchPrefetcher: num_threads must be >= 1, got {num_threads}")
        self._iter = dataloader_iter
        self._device = device
        self._cuda = device.type == "cuda"
        self._pin = pin_memory and self._cuda
        self._timeout_s = timeout_s
        self._pull_lock = threading.Lock()  # serialises next(dataloader_iter) and numbering
        self._cond = threading.Condition()  # guards everything below
        self._ready: Dict[int, ReadyBatch] = {}
        self._pulled = 0  # batches taken from the iterator so far
        self._handed = 0  # batches given to the consumer so far
        self._end: Optional[int] = None  # number of batches the iterator had, once known
        self._error: Optional[BaseException] = None
        self._error_at = 0  # sequence number of the batch whose pull or copy failed
        self._closed = False
        self._slots = threading.Semaphore(depth or 2 * num_threads)  # bounds batches ahead
        self._threads: List[threading.Thread] = [
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
        stream = torch.cuda.Stream(self._device) if self._cuda else None
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
                ready = self._to_device(batch, stream)
            except BaseException as e:  # noqa: BLE001
                self._fail(seq, e)
                return
            with self._cond:
                self._ready[seq] = ready
                self._cond.notify_all()

    def _to_device(self, batch: Any, stream: Optional[torch.cuda.Stream]) -> ReadyBatch:
        if not self._cuda:
            return ReadyBatch(batch.to(self._device, non_blocking=False), None)
        with torch.cuda.stream(stream):
            if self._pin and hasattr(batch, "pin_memory"):
                batch = batch.pin_memory()
            batch = batch.to(self._device, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(stream)
        return ReadyBatch(batch, copied)

    def _fail(self, seq: int, error: BaseException) -> None:
        # Batches before seq may still be copying on other workers: the consumer gets them
        # first. Of two failures the earlier batch's wins.
        with self._cond:
            if self._error is None or seq < self._error_at:
                self._error, self._error_at = error, seq
            self._cond.notify_all()
