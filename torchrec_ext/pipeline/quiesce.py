"""The pipeline's side of the capture gate (``torchrec_ext.device_gate``, where the gate lives, a
layer low enough for the tiered tables' stage worker to take it too).

The pipeline's captures also join the tiered tables' stage in flight first (``join_first``):
the gate already keeps that worker off the device, the join also orders the train stream after
the rows it brought in, outside the capture.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

from torchrec_ext.device_gate import DEVICE_WORK, DeviceWorkGate

__all__ = ["DEVICE_WORK", "DeviceWorkGate", "quiesced"]


@contextmanager
def quiesced(gate: DeviceWorkGate, timeout_s: float, join_first: Iterable[Callable[[], None]] = ()) -> Iterator[None]:
    """Around a CUDA graph capture: every helper thread off the device. Each ``join_first`` call
    waits for work in flight that the capture should follow (it runs before the gate closes, so
    that work may still use the gate's threads); then ``gate`` is closed."""
    for join in join_first:
        join()
    with gate.closed(timeout_s):
        yield
