"""A gate that keeps helper threads off the device while a CUDA graph is captured.

During a capture, a CUDA call from another thread (a blocking copy, ``.item()``, cudaMalloc or
cudaHostAlloc — the capture has just emptied both caching allocators) either invalidates the
capture (global capture mode) or races with it. So every helper thread that touches the device
(the prefetch workers, the input-dist thread) wraps each item of device work in
``gate.working()``, and a capture runs inside ``gate.closed()``: no new item starts (its thread
parks at ``working()``), the items under way finish, and the workers resume once it reopens.

One gate serves the whole process (``DEVICE_WORK``): a capture is disturbed by any thread,
whichever pipeline started it. Threads of lower layers cannot take the gate (the tiered tables'
stage worker: modules never import the pipeline), so a capture first joins their work in flight
(``quiesced``'s ``join_first``): they start new work only from the train thread, which is capturing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager


class DeviceWorkGate:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._active = 0  # items of device work under way
        self._closers = 0  # captures holding the gate closed

    @contextmanager
    def working(self) -> Iterator[None]:
        """Around one item of a helper thread's device work: waits while the gate is closed."""
        with self._cond:
            while self._closers:
                self._cond.wait()
            self._active += 1
        try:
            yield
        finally:
            with self._cond:
                self._active -= 1
                self._cond.notify_all()

    @contextmanager
    def closed(self, timeout_s: float = 600.0) -> Iterator[None]:
        """Holds every helper thread off the device: waits (at most ``timeout_s``) for the items
        under way, keeps new ones parked until the block exits."""
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
def quiesced(gate: DeviceWorkGate, timeout_s: float, join_first: Iterable[Callable[[], None]] = ()) -> Iterator[None]:
    """Around a CUDA graph capture: every helper thread off the device. Each ``join_first`` call
    waits for device work of a thread the gate does not hold (it runs before the gate closes, so
    that work may still use the gate's threads); then ``gate`` is closed."""
    for join in join_first:
        join()
    with gate.closed(timeout_s):
        yield
