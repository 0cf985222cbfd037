"""Row copies through a file-backed tier's mappings that fail with ``OSError``, never SIGBUS.

The backing files of ``backing="file:<dir>"`` (tier_store.py: the rows files; tier_log.py: the
logs) are mapped MAP_SHARED. A read or write of a mapped page that the kernel cannot serve (a
disk I/O error; the file truncated by another process: the files' ``flock`` is advisory) raises
SIGBUS in the thread that touched it, which kills the process mid-step. Every copy of rows to or
from a mapping therefore goes through ``copy_rows`` here (``ops.guarded_copy_rows``: one memcpy a
row, a SIGBUS inside it ends the copy and returns its address), which raises
``OSError(errno.EIO)`` naming the file, the tables and the byte offset in the file. Reads of a file
registered with its open file are ``pread`` calls on it instead (``READ_WITH_PREAD``: no page is
mapped, a failed read an errno); copies still made through a mapping unmap its pages after them
(``RELEASE_AFTER_COPY``). Host backing (anonymous memory, no file to fail) keeps plain torch ops.

The SIGBUS handler is installed once, when the first file is mapped (``register``); a SIGBUS
outside a guarded copy goes to the handler installed before it (Python's ``faulthandler`` under
pytest), or kills the process as SIGBUS always did. A handler installed after it for SIGBUS
(``faulthandler.enable()`` or ``signal.signal`` later) runs instead of it, and one removed
after it (``faulthandler.disable()`` puts back the default) takes it away: the guard then no
longer applies. Views of the mappings handed out as they are (the tables' parameters,
``table_view``; a pickle or deepcopy of the module) are read by torch's ops, and a new
optimizer's state files are filled by them (``BackingStore.map``): a failed page there is still
a SIGBUS. A load (``TieredTables._replace_table``) writes through ``copy_rows``: a failed page
leaves every table of the load empty (no id reading a row not its own) and raises. A file cut
short within a page keeps that page mapped (its bytes past the new end read as zeros, writes to
them are lost: no SIGBUS to catch), so each copy and each log append first checks that the
file is still as long as its mapping (``check_whole``: a ``stat`` a call).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading
import weakref

from torch import Tensor

from torchrec_ext import _C, ops

_lock = threading.Lock()
_mapped: dict[int, tuple[int, str, str]] = {}  # first address of a file's mapping -> (bytes, path, where)
# first address of a file's mapping -> the open file it maps, to pread (weakly: the tables own it)
_files: dict[int, weakref.ref] = {}


def register(whole: Tensor, path: str, where: str, file: object | None = None) -> None:
    """``whole`` maps all of file ``path`` (from offset 0) for the tables ``where`` names: a fault
    in it is reported with that path and offset. With ``file`` (the open file, kept open while the
    tables use it), reads of rows are ``pread`` calls on it (``READ_WITH_PREAD``) while it is open.
    Installs the SIGBUS handler (once)."""
    _C.install_sigbus_guard()
    start = whole.data_ptr()
    nbytes = whole.numel() * whole.element_size()
    with _lock:
        # A mapping gone (a file mapped again, a module freed) may have left its address range to
        # this one: live mappings never overlap, so any entry overlapping this one is stale.
        for other in [s for s, (n, _, _) in _mapped.items() if s < start + nbytes and start < s + n]:
            del _mapped[other]
            _files.pop(other, None)
        _mapped[start] = (nbytes, path, where)
        if file is not None:
            _files[start] = weakref.ref(file)


KEPT = "the tables keep the rows they had before this call"


def _mapping_at(address: int) -> tuple[int, int, str, str] | None:
    """(first address, bytes, path, where) of the registered mapping holding ``address``, or None."""
    with _lock:
        for start, (nbytes, path, where) in _mapped.items():
            if start <= address < start + nbytes:
                return start, nbytes, path, where
    return None


def _error(address: int, doing: str, consequence: str = KEPT) -> OSError:
    found = _mapping_at(address)
    if found is None:
        return OSError(errno.EIO, f"tiered tables: SIGBUS {doing} a mapped backing file at address {address:#x}")
    start, _, path, where = found
    return OSError(
        errno.EIO,
        f"{where}: cannot {doing} backing file {path!r} at byte offset {address - start}: its page failed "
        f"(SIGBUS: a disk I/O error, or the file was truncated by another process); {consequence}",
    )


def check_whole(t: Tensor, doing: str, consequence: str = KEPT) -> None:
    """``OSError(EIO)`` when ``t`` lies in a registered mapping whose file is now shorter than
    the mapping (cut by another process: its lock is advisory). Checked before a copy or an
    append: a page the cut leaves in part faults on nothing (its bytes past the end read as
    zeros, writes to them are lost), and an append past the cut would make the file whole again
    with a hole where the cut records were."""
    found = _mapping_at(t.data_ptr())
    if found is None:
        return
    _, nbytes, path, where = found
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:  # (unlinked: the mapping keeps the file's pages)
        return
    if size < nbytes:
        raise OSError(
            errno.EIO,
            f"{where}: cannot {doing} backing file {path!r}: it is {size:,} bytes, shorter than the {nbytes:,} "
            f"it was made with (truncated by another process?); {consequence}",
        )


def copy_rows(
    dst: Tensor, dst_rows: Tensor | None, src: Tensor, src_rows: Tensor | None, doing: str, consequence: str = KEPT
) -> None:
    """``dst[dst_rows] = src[src_rows]`` (``ops.guarded_copy_rows``); ``OSError(EIO)`` when a
    mapped page fails or the mapped file was cut short (``check_whole``; ``doing``: "read" from
    the mapping ``src`` or "write" into the mapping ``dst``, and ``consequence``, what the caller
    leaves: for the message)."""
    mapped = src if doing == "read" else dst  # (the side that is a mapping)
    check_whole(mapped, doing, consequence)
    if doing == "read" and READ_WITH_PREAD and _pread(dst, dst_rows, src, src_rows, consequence):
        return
    fault = ops.guarded_copy_rows(dst, dst_rows, src, src_rows)
    if RELEASE_AFTER_COPY:
        release_pages(mapped)
    if fault:
        raise _error(fault, doing, consequence)


# Unmap a file's pages after each copy through its mapping (process-wide;
# TORCHREC_EXT_TIER_RELEASE_PAGES=0 keeps them): with reads by pread (below) only writes through
# the mapping are left (a load, a flush home), which would otherwise leave every page they wrote
# mapped. Reads through the mapping released each time cost the dlrm-small step 1.30-1.49x the
# all-resident one against 1.11-1.26x kept (benchmarks/results/tiers_cpu.md): pread is the way.
RELEASE_AFTER_COPY = os.environ.get("TORCHREC_EXT_TIER_RELEASE_PAGES", "1") == "1"

# Read rows from a registered file with pread(2) instead of through its mapping (process-wide;
# TORCHREC_EXT_TIER_PREAD=0 reads through the mapping): the process then maps none of the pages
# its reads touch, which it would keep mapped (and the kernel's fault-around their neighbours) up
# to the files' size: with the release above, peak RSS 0.99x cache + working set against 1.84x, for
# about the same step (1.11-1.26x the all-resident one in six runs; 1.11-1.26x in seven through the
# mappings: benchmarks/results/tiers_memory_cpu.md, tiers_cpu.md).
READ_WITH_PREAD = os.environ.get("TORCHREC_EXT_TIER_PREAD", "1") == "1"


def _pread(dst: Tensor, dst_rows: Tensor | None, src: Tensor, src_rows: Tensor | None, consequence: str) -> bool:
    """The read by ``ops.pread_rows`` when ``src`` lies in a mapping registered with its file,
    still open; False when it does not (the caller copies through the mapping)."""
    found = _mapping_at(src.data_ptr())
    ref = None if found is None else _files.get(found[0])
    file = None if ref is None else ref()
    if file is None or file.closed:  # (freed or closed with its tables: their mapping may live on)
        return False
    start, _, path, where = found
    offset, err = ops.pread_rows(dst, dst_rows, src, src_rows, file.fileno(), src.data_ptr() - start)
    if offset >= 0:
        why = os.strerror(err) if err else "the file ends there (truncated by another process?)"
        raise OSError(
            errno.EIO, f"{where}: cannot read backing file {path!r} at byte offset {offset}: {why}; {consequence}"
        )
    return True


_libc = ctypes.CDLL(None, use_errno=True)


def madvise(address: int, nbytes: int, advice: int) -> int:
    """madvise(2) of ``nbytes`` from ``address`` (an ``mmap.MADV_*`` advice); 0, or its errno."""
    if _libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(nbytes), advice) != 0:
        return ctypes.get_errno()
    return 0


def release_pages(t: Tensor) -> None:
    """Unmaps from this process the pages of the registered mapping holding ``t`` (MADV_DONTNEED;
    the page cache keeps them, dirty ones included, and the next touch maps them again). A row is
    a fraction of a page, so a copy of scattered rows maps a page for each: without this, the
    process's resident memory grows with every page the tables ever touched, up to the files'
    size, instead of holding one copy's pages at a time."""
    found = _mapping_at(t.data_ptr())
    if found is not None:
        start, nbytes, _, _ = found
        madvise(start, nbytes, mmap.MADV_DONTNEED)  # (advice: a failure changes no row)
