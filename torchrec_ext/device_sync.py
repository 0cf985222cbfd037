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
was not written since (its version counter). An inference tensor has no version counter, so it
is never mirrored: ``to_device`` makes its copies normal tensors under ``torch.inference_mode``.

``to_device`` is the step path's one host-to-device copy: a blocking copy of pageable memory
is a sync on a GPU too, so it copies through pinned memory without blocking (and mirrors).

``defer_check`` validates on the device without a sync of its own: the check's few values are
copied to the host without blocking, and read (``settle``) at the next counted read of the same
thread (which has drained the stream, so they are there), or at the latest by ``settle`` itself.

Lowest layer (vocabulary's): imports torch only, so the kernels may use it.
"""

from __future__ import annotations

import threading
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext

import torch
from torch import Tensor

_lock = threading.Lock()
_total = 0
_recorders: list[Counter] = []
# id(device tensor) -> (weak reference, its version when mirrored, host copy)
_mirrors: dict[int, tuple[weakref.ref, int, Tensor]] = {}
_pending = threading.local()  # .checks: this thread's deferred checks, oldest first


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
    # No lock: a dict store is atomic under the GIL, and the weakref's callback may run inside any
    # allocation (a collection of a dead mirrored tensor), even one made while this thread holds
    # ``_lock``, so the callback must not take it either.
    _mirrors[key] = (
        weakref.ref(device_tensor, lambda ref, key=key: _forget(key, ref)),
        device_tensor._version,
        host.detach().cpu(),
    )
    return device_tensor


def _forget(key: int, ref: weakref.ref) -> None:
    entry = _mirrors.get(key)
    if entry is not None and entry[0] is ref:  # not a newer tensor's entry under a reused id
        _mirrors.pop(key, None)


def _mirrored(t: Tensor) -> Tensor | None:
    found = _mirrors.get(id(t))
    if found is None or t.is_inference() or found[0]() is not t or found[1] != t._version:
        return None
    return found[2]


def host_list_if_free(t: Tensor) -> list | None:
    """``t``'s values as a list when reading them costs nothing (``t`` is mirrored and
    unchanged), else None: for reads that only tune a kernel (it has a safe default without)."""
    host = None if torch.compiler.is_compiling() else _mirrored(t)
    return None if host is None else host.tolist()


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
    settle()  # the stream has drained: the deferred checks' values are on the host, free to read
    return host


def host_list(t: Tensor, reason: str) -> list:
    """``to_host(t, reason).tolist()``."""
    if torch.compiler.is_compiling():
        return t.tolist()  # symbolic ints
    return to_host(t, reason).tolist()


def nonzero(mask: Tensor, reason: str) -> Tensor:
    """Positions of the True entries of a 1-D bool ``mask`` (on its device): its output size is
    data-dependent, so this is a counted sync."""
    if torch.compiler.is_compiling():
        return mask.nonzero().squeeze(1)
    _count(reason)
    out = mask.nonzero().squeeze(1)
    settle()  # (as to_host)
    return out


def to_device(host: Tensor, device: torch.device) -> Tensor:
    """``host`` (a CPU tensor) on ``device``, mirrored: on a GPU through pinned memory without
    blocking (a blocking copy of pageable memory would wait for the stream). The caching host
    allocator keeps the pinned block until the copy has run.

    Under ``torch.inference_mode`` the copy is made a normal tensor, which has the version counter
    a mirror needs (an inference tensor has none: every read of it would be a sync). On the CPU,
    which stands for the device, an inference ``host`` is copied likewise: read as a GPU's copy is."""
    device = torch.device(device)
    if torch.compiler.is_compiling() or host.device.type != "cpu":
        return host.to(device)
    if device.type == "cuda":
        with normal_tensors():
            return mirror(host.pin_memory().to(device, non_blocking=True), host)
    if device.type == "cpu" and host.is_inference():
        with normal_tensors():
            return mirror(host.clone(), host)
    return host.to(device)


def normal_tensors():
    """Within it, tensors made are normal ones, even under ``torch.inference_mode``: for tensors
    to be mirrored, or kept past the call (an inference tensor cannot be written outside it)."""
    return torch.inference_mode(False) if torch.is_inference_mode_enabled() else nullcontext()


# Tests set this to defer CPU checks as a GPU does (raised at the next read, not at once).
defer_on_cpu = False


class _Deferred:
    def __init__(
        self,
        values: Tensor,
        verdict: Callable[[list], Exception | None],
        fails: Callable[[Tensor], Tensor],
    ) -> None:
        self.verdict, self.values, self.fails = verdict, values, fails
        self.event = None
        self.later = values.device.type == "cuda" or defer_on_cpu
        if values.device.type == "cuda":
            self.host = torch.empty(values.shape, dtype=values.dtype, device="cpu", pin_memory=True)
            self.host.copy_(values, non_blocking=True)  # on the current stream of values' device
            self.event = torch.cuda.Event()
            # That stream, not the current device's (another GPU's when this thread's device
            # differs): an event there could complete before the copy, and the check read stale bytes.
            self.event.record(torch.cuda.current_stream(values.device))
        else:
            self.host = values  # a CPU tensor: read for free

    def error(self) -> Exception | None:
        if self.event is not None and not self.event.query():
            _count("deferred check: read before any other sync")  # nothing has drained the stream yet
            self.event.synchronize()
        return self.verdict(self.host.tolist())


def defer_check(values: Tensor, verdict: Callable[[list], Exception | None], fails: Callable[[Tensor], Tensor]) -> None:
    """Checks ``values`` (a small device tensor computed by the caller) on the host later:
    ``verdict(values as a list)`` returns the error to raise, or None. Raised by the next counted
    read of this thread (``to_host``), or by ``settle``; on CPU right away (no sync to wait for).
    The caller must settle before it changes anything the error should leave unchanged.
    fails: ``values`` -> a bool device scalar, True exactly where the verdict will be an error, for
    ``TakenChecks.failed``: the sharded input dist tells its peers with it, without a sync. It is
    required: a check its peers were not told of would raise on its own rank while they went on
    into the data all-to-all and waited there."""
    if torch.compiler.is_compiling():
        return
    check = _Deferred(values.detach(), verdict, fails)
    if not check.later:
        error = check.error()
        if error is not None:
            raise error
        return
    if not hasattr(_pending, "checks"):
        _pending.checks = []
    _pending.checks.append(check)


def settle() -> None:
    """Raises the first failed deferred check of this thread (all are done with either way)."""
    checks = getattr(_pending, "checks", None)
    if not checks:
        return
    _pending.checks = []
    for check in checks:
        error = check.error()
        if error is not None:
            raise error


class TakenChecks:
    """Pending checks taken from their thread (``take_pending``): no other read raises them."""

    def __init__(self, checks: list[_Deferred]) -> None:
        self._checks = checks

    def failed(self) -> Tensor | None:
        """A bool device scalar, True where one of the checks will fail (computed on the device,
        no sync); None when there are none."""
        flags = [check.fails(check.values).reshape(1) for check in self._checks]
        return torch.cat(flags).any() if flags else None

    def settle(self) -> None:
        """Raises the first failed one (as ``settle``; after a sync, their values are on the host)."""
        checks, self._checks = self._checks, []
        for check in checks:
            error = check.error()
            if error is not None:
                raise error


def take_pending() -> TakenChecks:
    """Takes this thread's pending checks away, for the caller to raise at a point of its own:
    the sharded input dist raises a batch's checks at its counts exchange's wait, on every rank
    at once, not at whatever read of this thread comes first (another batch's forward in a
    pipeline, while the peers go on into that batch's collectives)."""
    checks = getattr(_pending, "checks", None) or []
    _pending.checks = []
    return TakenChecks(checks)


__all__ = [
    "defer_check",
    "host_list",
    "mirror",
    "nonzero",
    "normal_tensors",
    "recording",
    "settle",
    "sync_count",
    "take_pending",
    "to_device",
    "to_host",
]
