"""Device-to-host copies of each step's outputs (losses, metrics) into pinned host memory, on a
side stream, surfaced once the copy is done: the train loop never synchronises the device to
read them. On CPU the outputs are simply detached copies, ready at once."""

from __future__ import annotations

from collections import deque
from typing import Any

import torch
from torch.utils import _pytree as pytree


class HostOutputs:
    def __init__(self, device: torch.device, pinned: bool = True) -> None:
        self._device = device
        self._cuda = device.type == "cuda"
        self._pinned = pinned and self._cuda
        self._stream = torch.cuda.Stream(device) if self._cuda else None
        self._pending: deque[tuple[int, Any, torch.cuda.Event | None]] = deque()

    def push(self, step: int, output: Any) -> torch.cuda.Event | None:
        """Starts copying ``output`` (any pytree of tensors) of step ``step`` to the host;
        returns the event the copy records when done (None on CPU, where it is done at once):
        whatever overwrites ``output`` in place (a graph replay) must wait for it."""
        leaves, spec = pytree.tree_flatten(output)
        if not self._cuda:
            host = [x.detach().clone() if isinstance(x, torch.Tensor) else x for x in leaves]
            self._pending.append((step, pytree.tree_unflatten(host, spec), None))
            return None
        self._stream.wait_stream(torch.cuda.current_stream(self._device))  # (this rank's GPU, whatever is current)
        host = []
        with torch.cuda.stream(self._stream):
            for x in leaves:
                if isinstance(x, torch.Tensor) and x.is_cuda:
                    buffer = torch.empty(x.shape, dtype=x.dtype, device="cpu", pin_memory=self._pinned)
                    buffer.copy_(x.detach(), non_blocking=True)
                    x.record_stream(self._stream)  # x may be freed on the compute stream meanwhile
                    host.append(buffer)
                else:
                    host.append(x)
            copied = torch.cuda.Event()
            copied.record(self._stream)
        self._pending.append((step, pytree.tree_unflatten(host, spec), copied))
        return copied

    def pop_ready(self) -> list[tuple[int, Any]]:
        """(step, host output) of every step whose copy has finished, oldest first; never blocks."""
        out = []
        while self._pending and (self._pending[0][2] is None or self._pending[0][2].query()):
            step, host, _ = self._pending.popleft()
            out.append((step, host))
        return out

    def drain(self) -> list[tuple[int, Any]]:
        """Waits for every copy still in flight and returns them all, oldest first."""
        for _, _, copied in self._pending:
            if copied is not None:
                copied.synchronize()
        return self.pop_ready()
