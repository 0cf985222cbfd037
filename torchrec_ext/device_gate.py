"""The process's capture gate: keeps helper threads off the device while a CUDA graph is captured.

During a capture, a CUDA call from another thread (a blocking copy, ``.item()``, cudaMalloc or
cudaHostAlloc: the capture has just emptied both caching allocators) either invalidates the
capture (global capture mode) or races with it. So every helper thread that touches the device
(the pipeline's prefetch workers and input-dist thread, the tiered tables' stage worker) wraps
each item of device work in ``gate.working()``, and a capture runs inside ``gate.closed()``: no
new item starts (its thread parks at ``working()``), the items under way finish, and the workers
resume once it reopens.

One gate serves the whole process (``DEVICE_WORK``): a capture is disturbed by any thread,
whoever started it. A user capturing on their own (``torch.cuda.graph``,
``make_graphed_callables``) wraps it in ``quiesced()``.

No deadlock: a holder never waits for another thread while holding the gate, since that thread
may be parked at a closed gate; it leaves for the wait (``stepped_aside()``) and comes back
through the gate. Holding is per thread and re-entrant (a nested ``working()`` never parks).

Lowest layer (beside device_sync): imports nothing of the package, so every layer may use it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

DEFAULT_CAPTURE_TIMEOUT_S = 600.0


class DeviceWorkGate:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._active = 0  # threads inside working()
        self._closers = 0  # captures holding the gate closed
        self._held = threading.local()  # this thread's working() depth

    def _depth(self) -> int:
        return getattr(self._held, "depth", 0)

    def _enter(self) -> None:
        with self._cond:
            while self._closers:
                self._cond.wait()
            self._active += 1

    def _leave(self) -> None:
        with self._cond:
            self._active -= 1
            self._cond.notify_all()

    @contextmanager
    def working(self) -> Iterator[None]:
        """Around one item of a helper thread's device work: waits while the gate is closed."""
        depth = self._depth()
        if depth == 0:
            self._enter()
        self._held.depth = depth + 1
        try:
            yield
        finally:
            self._held.depth = depth
            if depth == 0:
                self._leave()

    @contextmanager
    def stepped_aside(self) -> Iterator[None]:
        """Around a wait for another thread inside ``working()``: leaves the gate for it (a
        capture need not wait for this thread, nor this thread for one holding that thread
        parked), and comes back through the gate. A no-op on a thread not holding the gate."""
        depth = self._depth()
        if depth == 0:
            yield
            return
        self._held.depth = 0
        self._leave()
        try:
            yield
        finally:
            self._enter()
            self._held.depth = depth

    @contextmanager
    def closed(self, timeout_s: float = DEFAULT_CAPTURE_TIMEOUT_S) -> Iterator[None]:
        """Holds every helper thread off the device: waits (at most ``timeout_s``) for the items
        under way, keeps new ones parked until the block exits."""
        if self._depth():
            raise RuntimeError(
                "DeviceWorkGate: cannot close the gate from a thread inside gate.working() "
                "(it would wait for itself); capture from outside the helper's device work"
            )
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._closers += 1
            while self._active:
                left = deadline - time.monotonic()
                if left <= 0:
                    busy = self._active
                    self._closers -= 1
                    self._cond.notify_all()
                    raise TimeoutError(
                        f"DeviceWorkGate: {busy} helper thread(s) still on the device after {timeout_s:.0f} s; "
                        "cannot capture a CUDA graph while they run"
                    )
                self._cond.wait(left)
        try:
            yield
        finally:
            with self._cond:
                self._closers -= 1
                self._cond.notify_all()

    @property
    def is_closed(self) -> bool:
        with self._cond:
            return self._closers > 0


DEVICE_WORK = DeviceWorkGate()


@contextmanager
def quiesced(timeout_s: float = DEFAULT_CAPTURE_TIMEOUT_S) -> Iterator[None]:
    """Around a user's own CUDA graph capture (``torch.cuda.graph``, ``make_graphed_callables``):
    every torchrec_ext helper thread off the device (prefetch workers, the input-dist thread,
    tiered tables' stages), the items under way finished first, new ones parked until the block
    exits. Raises ``TimeoutError`` after ``timeout_s`` if a helper is still on the device."""
    with DEVICE_WORK.closed(timeout_s):
        yield
