"""A single daemon helper thread that runs submitted jobs in order, returning futures.

Unlike ``concurrent.futures.ThreadPoolExecutor``, whose threads the interpreter joins at exit
without a bound, ``close`` waits a bounded time and then leaves a stuck thread (say, a
collective whose peer died) to die with the process.

With a ``gate``, each job runs inside ``gate.working()``: a CUDA graph capture holding the gate
closed waits for the job under way and keeps the next one parked until it reopens."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import nullcontext

from torchrec_ext.pipeline.quiesce import DeviceWorkGate

logger = logging.getLogger(__name__)


class HelperThread:
    def __init__(self, name: str, gate: DeviceWorkGate | None = None) -> None:
        self._gate = gate
        self._jobs: queue.Queue[tuple | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], object]) -> Future:
        future: Future = Future()
        self._jobs.put((fn, future))
        return future

    def close(self, timeout_s: float) -> bool:
        """Lets queued jobs finish and joins the thread; False if it was left behind."""
        self._jobs.put(None)
        self._thread.join(timeout=timeout_s)
        if self._thread.is_alive():
            logger.warning("%s did not finish within %.0f s; leaving it behind", self._thread.name, timeout_s)
            return False
        return True

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, future = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                with self._gate.working() if self._gate is not None else nullcontext():
                    result = fn()
                future.set_result(result)
            except BaseException as e:  # noqa: BLE001 - re-raised by future.result() in the caller
                future.set_exception(e)
