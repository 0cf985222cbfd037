"""Flat float32 buffers over address space reserved once for a growing table's largest size.

A growing module's buffers (vectors, optimizer state) live in one anonymous mapping each, sized
for every table at num_embeddings but reserved without committing memory (MAP_NORESERVE): a page
takes memory only once written, so resident memory still follows the capacity reached. A growth
then rewrites the buffer in place (``DynamicTables._relayout``): the pages of the old capacity are
reused and only the new ones are first touched, where a fresh buffer per growth touches every
capacity reached (twice the final size over a run of doublings) and first touches are the slow
part of a growth (page faults, zeroing; on a VM, the host's faults too).
"""

from __future__ import annotations

import contextlib
import mmap

import torch
from torch import Tensor

_HUGE_PAGE = 2 << 20
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)  # (Python < 3.13 lacks the name; Linux's value)


class ReservedBuffer:
    """``numel_max`` float32 values of reserved address space (CPU); ``view(numel)`` is the buffer
    of the first ``numel`` of them. The mapping lives as long as any view of it."""

    def __init__(self, numel_max: int):
        self.numel_max = numel_max
        length = numel_max * 4 + _HUGE_PAGE  # room to start on a huge-page boundary
        self._map = mmap.mmap(
            -1,
            length,
            flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE,
            prot=mmap.PROT_READ | mmap.PROT_WRITE,
        )
        with contextlib.suppress(AttributeError, OSError):  # rows are touched at random: huge pages
            self._map.madvise(mmap.MADV_HUGEPAGE)  # spare TLB misses (best effort)
        base = torch.frombuffer(self._map, dtype=torch.uint8, count=1).data_ptr()
        self._offset = -base % _HUGE_PAGE
        self._start = base + self._offset

    def view(self, numel: int) -> Tensor:
        """The first ``numel`` values, as a tensor whose storage is exactly those (so a pickle or a
        copy of it, or of a view of it, carries only them, not the reserved range)."""
        if not 0 <= numel <= self.numel_max:
            raise ValueError(f"ReservedBuffer.view: numel must be in [0, {self.numel_max}], got {numel}")
        if numel == 0:
            return torch.empty(0, dtype=torch.float32)
        return torch.frombuffer(self._map, dtype=torch.float32, count=numel, offset=self._offset)

    def holds(self, buf: Tensor) -> bool:
        """Whether ``buf`` starts where this reservation does (a buffer ``view`` returned)."""
        return buf.device.type == "cpu" and buf.numel() > 0 and buf.data_ptr() == self._start

    def release_beyond(self, numel: int) -> None:
        """Returns the pages past the first ``numel`` values to the system (a shrink): resident
        memory follows the buffer's size. Their contents read as zeros afterwards."""
        start = -(-(self._offset + numel * 4) // mmap.PAGESIZE) * mmap.PAGESIZE
        end = self._offset + self.numel_max * 4
        if end > start:
            self._map.madvise(mmap.MADV_DONTNEED, start, end - start)
