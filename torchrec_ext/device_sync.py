"""The one door through which the training step reads device values on the host.

On a GPU every read of a device tensor's values by the host (``.item()``, ``.tolist()``,
``int(t)``, a ``nonzero`` or boolean-mask index sizing its output) waits for the stream to drain:
a device-to-host sync. The step path of the dynamic modules makes those reads only here, so
they can be counted (``recording``) and kept few (tests/test_sync_budget.py: at most 3 per step
of a whole module, whatever its table count). On CPU the same calls are plain reads; they are
counted all the same, so the CPU test sees what a GPU would pay.

Under torch.compile / export the values are symbolic: nothing is read, counted or mirrored
(the traced program's reads are the compiler's).

``mirror`` keeps host values beside a device tensor made from them (layout descriptors, bounds
read once): reading such a tensor again costs nothing and is not counted, as long as the tensor
was not written since (its version counter).

Lowest layer (vocabulary's): imports torch only, so the kernels may use it.
"""

from __future__ import annotations

import threading
import weakref
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

_lock = threading.Lock()
_total = 0
_recorders: list[Counter] = []
# id(device tensor) -> (weak reference, its version when mirrored, host copy)
_mirrors: dict[int, tuple[weakref.ref, int, Tensor]] = {}


def _count(reason: str) -> None:
    global _total
    with _lock:
        _total += 1
        for recorder in _recorders:
            recorder[reason] += 1


def sync_count() -> int:
    """Host reads of device values made through this module since the process started."""
    return _total


@contextmanager
def recording() -> Iterator[Counter]:
    """Counts the host reads made while the block runs, by reason (all threads)."""
    recorder: Counter = Counter()
    with _lock:
        _recorders.append(recorder)
    try:
        yield recorder
    finally:
        with _lock:
            _recorders.remove(recorder)


def mirror(device_tensor: Tensor, host: Tensor) -> Tensor:
    """Remembers ``host`` (a CPU tensor of the same values) as ``device_tensor``'s host copy;
    returns ``device_tensor``. A later ``to_host`` of it reads the copy (no sync, not counted)."""
    if torch.compiler.is_compiling() or device_tensor.is_inference():  # (no version counter to check)
        return device_tensor
    key = id(device_tensor)
    with _lock:
        _mirrors[key] = (
            weakref.ref(device_tensor, lambda _, key=key: _forget(key)),
            device_tensor._version,
            host.detach().cpu(),
        )
    return device_tensor


def _forget(key: int) -> None:
    with _lock:
        _mirrors.pop(key, None)


def _mirrored(t: Tensor) -> Tensor | None:
    found = _mirrors.get(id(t))
    if found is None or t.is_inference() or found[0]() is not t or found[1] != t._version:
        return None
    return found[2]


def to_host(t: Tensor, reason: str) -> Tensor:
    """``t``'s values on the host (a CPU tensor): one counted sync (whatever ``t``'s device: on
    CPU it stands for the GPU's), unless ``t`` is mirrored. The values read are mirrored, so a
    second read of the same unchanged tensor is free."""
    if torch.compiler.is_compiling():
        return t.detach()
    host = _mirrored(t)
    if host is not None:
        return host
    _count(reason)
    host = t.detach().to("cpu")  # the one place the step path copies device values to the host
    mirror(t, host)
    return host


def host_list(t: Tensor, reason: str) -> list:
    """``to_host(t, reason).tolist()``."""
    if torch.compiler.is_compiling():
        return t.tolist()  # symbolic ints
    return to_host(t, reason).tolist()


def nonzero(mask: Tensor, reason: str) -> Tensor:
    """Positions of the True entries of a 1-D bool ``mask`` (on its device): its output size is
    data-dependent, so this is a counted sync."""
    if not torch.compiler.is_compiling():
        _count(reason)
    return mask.nonzero().squeeze(1)


__all__ = ["host_list", "mirror", "nonzero", "recording", "sync_count", "to_host"]
