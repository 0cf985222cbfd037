"""Flat float32 buffers over address space reserved once for a growing table's largest size.

A growing module's buffers (vectors, optimizer state) live in one anonymous mapping each, sized
for every table at num_embeddings but reserved without committing memory (MAP_NORESERVE): a page
takes memory only once written, so resident memory still follows the capacity reached. A growth
then rewrites the buffer in place (``DynamicTables._relayout``): the pages of the old capacity are
reused and only the new ones are first touched, where a fresh buffer per growth touches every
capacity reached (twice the final size over a run of doublings) and first touches are the slow
part of a growth (page faults, zeroing; on a VM, the host's faults too). Rows that only change
place (a table whose span moves up when an earlier one grows) move by remapping their pages
(``remap``: no copy, no new page) where the kernel allows it.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import sys

import torch
from torch import Tensor

_HUGE_PAGE = 2 << 20
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)  # (Python < 3.13 lacks the name; Linux's value)
# mremap(2)'s flags: move the pages to a given address and leave the old range mapped, empty
# (MREMAP_DONTUNMAP: Linux >= 5.7, private anonymous mappings such as this one).
_MREMAP_MAYMOVE, _MREMAP_FIXED, _MREMAP_DONTUNMAP = 1, 2, 4


def _load_mremap():
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).mremap
    except (OSError, AttributeError):  # pragma: no cover
        return None
    fn.restype = ctypes.c_void_p
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    return fn


_mremap = _load_mremap()
_MAP_FAILED = ctypes.c_void_p(-1).value


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

    def remap(self, src: int, dst: int, nbytes: int) -> bool:
        """Moves the ``nbytes`` at byte ``src`` of the buffer to byte ``dst`` by moving their pages
        (no copy; the source range then reads as zeros). Both must start on a page boundary,
        ``nbytes`` be whole pages and the ranges not overlap. False (nothing moved) where the
        kernel refuses (no MREMAP_DONTUNMAP, a range over several mappings): the caller copies."""
        page = mmap.PAGESIZE
        if _mremap is None or nbytes <= 0 or (self._start + src) % page or (self._start + dst) % page or nbytes % page:
            return False
        if min(src, dst) < 0 or max(src, dst) + nbytes > self.numel_max * 4 or abs(src - dst) < nbytes:
            return False
        flags = _MREMAP_MAYMOVE | _MREMAP_FIXED | _MREMAP_DONTUNMAP
        got = _mremap(self._start + src, nbytes, nbytes, flags, self._start + dst)
        return got is not None and got != _MAP_FAILED

    def release_beyond(self, numel: int) -> None:
        """Returns the pages past the first ``numel`` values to the system (a shrink): resident
        memory follows the buffer's size. Their contents read as zeros afterwards."""
        start = -(-(self._offset + numel * 4) // mmap.PAGESIZE) * mmap.PAGESIZE
        end = self._offset + self.numel_max * 4
        if end > start:
            self._map.madvise(mmap.MADV_DONTNEED, start, end - start)
