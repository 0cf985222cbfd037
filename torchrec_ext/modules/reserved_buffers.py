"""Flat float32 buffers over address space reserved without committing memory.

A growing module on CPU lays each table's span out for num_embeddings (``TableStorage._spans_at_max``)
in one anonymous mapping per buffer (vectors, each optimizer state), reserved with MAP_NORESERVE:
a page takes memory only once written, so resident memory follows the rows written, and a growth
moves no row (``DynamicTables._relayout``): the pages of the new rows are first touched when a row
there is first written, as in a preallocated table. Fresh pages read as zeros; ``zero`` gives
pages back (a shrink, a reset), after which they read as zeros again; ``populate`` has a
background thread fault pages in ahead of their first write (``TableGrowth.populate_ahead``).
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import queue
import sys
import threading

import torch
from torch import Tensor

_HUGE_PAGE = 2 << 20
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)  # (Python < 3.13 lacks the name; Linux's value)
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14: fault pages in writable, writing no value
_POPULATE_CHUNK = 32 << 20  # bytes per madvise call (a zero() in between skips the rest)


def _load_madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise  # (ctypes releases the GIL during the call)
    except (OSError, AttributeError):  # pragma: no cover
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return fn


_madvise = _load_madvise()
_requests: queue.SimpleQueue = queue.SimpleQueue()
_worker: threading.Thread | None = None
_worker_lock = threading.Lock()


def _forget_worker() -> None:  # a forked child has no worker thread: it starts its own
    global _worker, _requests
    _worker, _requests = None, queue.SimpleQueue()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_worker)


def _populate_forever() -> None:
    while True:
        reserved, generation, start, end = _requests.get()
        for a in range(start, end, _POPULATE_CHUNK):
            if reserved.generation != generation:  # zeroed since: its pages are to stay free
                break
            if _madvise(reserved.start + a, min(_POPULATE_CHUNK, end - a), _MADV_POPULATE_WRITE) != 0:
                break  # (an older kernel: EINVAL)
        del reserved


class ReservedBuffer:
    """``numel_max`` float32 values of reserved address space (CPU), starting on a huge-page
    boundary; ``view(numel)`` is the buffer of the first ``numel`` of them. The mapping lives as
    long as any view of it."""

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
        self.start = base + self._offset  # the address of value 0
        self.generation = 0  # counts zero() calls: populate() requests made before one are dropped

    def view(self, numel: int) -> Tensor:
        """The first ``numel`` values, as a tensor whose storage is exactly those (so a pickle or a
        copy of it, or of a view of it, carries only them, not the reserved range)."""
        if not 0 <= numel <= self.numel_max:
            raise ValueError(f"ReservedBuffer.view: numel must be in [0, {self.numel_max}], got {numel}")
        if numel == 0:
            return torch.empty(0, dtype=torch.float32, device="cpu")
        return torch.frombuffer(self._map, dtype=torch.float32, count=numel, offset=self._offset)

    def rows(self, word: int, rows: int, dim: int, dtype: torch.dtype) -> Tensor:
        """[rows, dim] values of ``dtype`` from 4-byte word ``word``, as a tensor whose storage is
        exactly those (a table's rows: what a pickle of its parameter carries)."""
        itemsize = torch.empty(0, dtype=dtype, device="cpu").element_size()
        if word < 0 or word * 4 + rows * dim * itemsize > self.numel_max * 4:
            raise ValueError(
                f"ReservedBuffer.rows: [{rows}, {dim}] {dtype} from word {word} exceed {self.numel_max} words"
            )
        if rows * dim == 0:
            return torch.empty(rows, dim, dtype=dtype, device="cpu")
        flat = torch.frombuffer(self._map, dtype=dtype, count=rows * dim, offset=self._offset + word * 4)
        return flat.view(rows, dim)

    def populate(self, start: int, end: int) -> None:
        """Asks a background thread to fault in the whole pages of bytes [start, end) of the buffer
        (``MADV_POPULATE_WRITE``: their values stay as they are, zeros), so that the first write of
        a row there finds its page backed; a no-op where the call is not offered."""
        global _worker
        page = mmap.PAGESIZE
        first, last = (
            -(-(self.start + start) // page) * page - self.start,
            (self.start + end) // page * page - self.start,
        )
        if _madvise is None or last <= first or not 0 <= first <= last <= self.numel_max * 4:
            return
        with _worker_lock:
            if _worker is None:
                _worker = threading.Thread(target=_populate_forever, name="torchrec_ext-populate", daemon=True)
                _worker.start()
        _requests.put((self, self.generation, first, last))

    def zero(self, start: int, end: int) -> None:
        """Makes bytes [start, end) of the buffer read as zeros: the whole pages among them go back
        to the system (resident memory follows), the partial ones at the edges are written."""
        if not 0 <= start <= end <= self.numel_max * 4:
            raise ValueError(f"ReservedBuffer.zero: need 0 <= start <= end <= {self.numel_max * 4}, got {start}, {end}")
        page = mmap.PAGESIZE
        first = min(-(-(self._offset + start) // page) * page - self._offset, end)
        last = max((self._offset + end) // page * page - self._offset, first)
        self.generation += 1
        if last > first:
            self._map.madvise(mmap.MADV_DONTNEED, self._offset + first, last - first)
        raw = torch.frombuffer(self._map, dtype=torch.uint8, count=end, offset=self._offset)
        raw[start:first].zero_()
        raw[last:end].zero_()
