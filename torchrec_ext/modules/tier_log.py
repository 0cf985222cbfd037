"""The write-back log of one file-backed tiered table: dirty rows leaving the cache, appended.

Written back in place, each evicted row dirtied one or two random 4 KiB pages of the backing
files (its vector and its optimizer state in separate places): at dlrm-small scale ~113k pages a
step, past the kernel's background dirty limit, where each write to a page the flusher has
cleaned takes a write fault (2-5 us a row, mapped or ``pwrite`` alike:
benchmarks/results/tier_file_writes.md). Here a write-back is one record per row (the row's
number, then its vector and each optimizer state, in their storage dtypes), appended with the
rest of its batch in one ``pwrite`` at the log's head: ~8 rows a page, pages written once,
sequentially. The log is what an LSM store's write path is (TorchRec's SSD tables sit on
RocksDB), reduced to what a table of fixed-size rows needs:

- ``where`` (in memory, int32 while the log's records fit, else int64: 4 bytes per row of the
  table): per row, the record holding its newest copy, or -1 when that is the base file; and
  its inverse ``row_at`` (the same dtype, per record of the log: ~8 bytes per row of the
  table): per record, the row it was appended for, so that cleaning finds a segment's live
  records in memory, not by reading the segment (4 MiB) through the mapping.
- Segments of ``SEGMENT_RECORDS`` records; the head takes a free segment when full. When dead
  records (superseded by a newer copy) outnumber live ones, each append also cleans segments,
  the fewest live first (each then holds fewer than half live records): their live records are
  re-appended and the segment is free again; at most ``2 * ceil(n / SEGMENT_RECORDS) + 1``
  segments per append of n records (bounded work, done where the write-back runs: on the
  stage's worker under the pipeline). The log holds ``max_segments`` (twice the table's rows,
  plus two segments): should appends outrun cleaning and fill it, the emptiest segment's live
  rows (fewer than half of it) are written home to the base file, and the segment is reused.
- A checkpoint reads each row's newest copy (``locate`` / ``read``: the log is left as it is);
  ``fold`` (``TieredTables.flush``, a copy, a new optimizer's record layout) writes every live
  record to its row in the base file and empties the log; loading a table empties it.

The log file (``<dir>/<tables>.<table>.log``) has the backing files' header; it is sparse, sized
for ``max_segments``, read with ``pread`` (a miss reads its newest copy: ``tier_guard.copy_rows``;
through the mapping where a file is not registered), written with ``pwrite`` only: a full disk or a failing write is an ``OSError`` naming the file, the log
and the table unchanged (the row stays dirty in the cache), never a SIGBUS. The prefetch stage's
appends are placed at once and written at the next stage's start, while its thread waits for
the lookup (``append(defer=True)``, ``land``): a landing that fails keeps their records in
memory and fails that stage (the lookup joining it raises before changing anything; a read
of them that lands them fails as any failed read: a lookup's is undone). The
log's reads (``read``, cleaning's) are ``tier_guard`` copies: a page that fails is an
``OSError`` too, and so is an append to a log another process cut short. Its records are not a checkpoint: a
module reopening the directory starts with an empty log (its index is new; a record cut short
by a crash is never read), and the last checkpoint loads as before
(tests/test_tiers_crash.py kills a process with SIGKILL mid-append, mid-fold and mid-flush).
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch import Tensor

from torchrec_ext.modules import tier_guard

SEGMENT_RECORDS = 8192  # ~4 MiB of 512-byte records: the most one clean moves
ROW_BYTES = 8  # each record starts with its row's number (int64)
_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02
_SYNC_RANGE_WRITE = ctypes.c_uint(2)  # SYNC_FILE_RANGE_WRITE: start writeback of the range's dirty pages, no wait
# Write-behind (RocksDB's bytes_per_sync): each append's pages are handed to the disk as soon as
# written, so the log's dirty pages never pile up to the kernel's dirty limits, past which every
# writer is throttled (balance_dirty_pages) and the flusher competes for the CPU in bursts. Asked
# on a thread of its own: submitting the writes costs ~0.3 us of CPU a KiB and can wait for the
# disk's queue, which the stage (the appender under the pipeline) should not. Off by default: at
# smoke size (dirty pages far below the limits) the third thread's CPU and GIL made the stage
# slower (benchmarks/results/tier_stage_profile.md); whether it pays at full size, where ~2 GB
# of log pass the limits, is `bench_tiers.py --write-behind 1`'s to say.
WRITE_BEHIND = False
_behind_pool: tuple[int, ThreadPoolExecutor] | None = None  # (the process it was made in: a fork's child makes its own)


def _write_behind(fd: int, offset: int, length: int) -> Future:
    global _behind_pool
    if _behind_pool is None or _behind_pool[0] != os.getpid():
        _behind_pool = (os.getpid(), ThreadPoolExecutor(1, thread_name_prefix="torchrec_ext-tier-write-behind"))
    # (advice: its result is not needed; a failed write shows at the next read or sync of the page)
    return _behind_pool[1].submit(
        _libc.sync_file_range, fd, ctypes.c_int64(offset), ctypes.c_int64(length), _SYNC_RANGE_WRITE
    )


_libc = ctypes.CDLL(None, use_errno=True)

# The crash drill's seam (tests/test_tiers_crash.py): when set, called with the name of the
# write-back under way at points in its middle, where the drill's child process is killed:
# "append" (a log append, between its writes: records cut short), "fold" (log records being
# written home: a row's vector written, its optimizer state not yet), "home" (the cache's dirty
# rows being written home, likewise). None outside that test.
crash_probe: Callable[[str], None] | None = None


def at_crash_point(point: str) -> None:
    """Calls ``crash_probe`` (when set) at ``point`` of a write-back."""
    if crash_probe is not None:
        crash_probe(point)


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    """Writes all of ``data`` at ``offset``, continuing short writes; OSError when a write fails
    or writes nothing."""
    while len(data):
        written = os.pwrite(fd, data, offset)
        if written <= 0:
            raise OSError(errno.EIO, f"wrote {written} of {len(data)} bytes at offset {offset}")
        data, offset = data[written:], offset + written
        if len(data):  # (a short write: the bytes so far are on file, the rest not yet)
            at_crash_point("append")


class RowLog:
    """The log of one table (see the module docstring). ``fd``: the log file, open and locked,
    ``records``: its mapping past the header as [max_records, record_bytes] uint8, ``offset``:
    the file offset of record 0, ``capacity``: the table's rows."""

    def __init__(self, fd: int, path: str, records: Tensor, offset: int, capacity: int, where: str):
        self.fd, self.path, self.records, self.offset, self.where_ = fd, path, records, offset, where
        self.record_bytes = records.shape[1]
        self.capacity = capacity
        self.max_segments = records.shape[0] // SEGMENT_RECORDS
        self.where = torch.full(
            (capacity,), -1, dtype=self.index_dtype(capacity), device="cpu"
        )  # row -> record of its newest copy, -1: base
        self.row_at = torch.full(
            (records.shape[0],), -1, dtype=self.where.dtype, device="cpu"
        )  # record -> the row it was appended for, -1: never appended since the log was emptied
        self.segment_live = torch.zeros(self.max_segments, dtype=torch.int64, device="cpu")  # live records per segment
        self.in_use = torch.zeros(self.max_segments, dtype=torch.bool, device="cpu")
        self.used = 0  # segments in use
        self.live = 0
        self.head: int | None = None  # the segment appended to, and how many records it holds
        self.head_fill = 0
        # records appended / re-appended by cleaning / sent home from a full log; segments cleaned
        self.appended = self.cleaned = self.sent_home = self.segments_cleaned = 0
        self.write_s = 0.0  # wall seconds in the log's writes (a write the kernel throttles shows here)
        # Deferred appends (``append(defer=True)``): placed (their rows point at them) but not
        # written yet, as (first record, records, data); written by ``land``, or
        # first by a read that names them; a segment freed drops its own (dead by then). The lock
        # orders the writes of two threads: the stage's worker lands while the train thread's
        # lookup may append or read (a fork's child, which has no such thread, takes a new one).
        self._unwritten: list[tuple[int, int, Tensor]] = []
        self._lock_of: tuple[int, threading.Lock] = (os.getpid(), threading.Lock())
        self._behind: list[Future] = []  # write-behind requests not done yet
        self._behind_pid = os.getpid()  # the process that asked them
        # Writes records ([n, record_bytes]) to their rows of the base file (set by the table's mover).
        self.home: Callable[[Tensor, Tensor], None] | None = None

    @staticmethod
    def max_records(capacity: int) -> int:
        return (2 * -(-capacity // SEGMENT_RECORDS) + 2) * SEGMENT_RECORDS

    @staticmethod
    def index_dtype(capacity: int) -> torch.dtype:
        return torch.int32 if RowLog.max_records(capacity) < 2**31 else torch.int64

    @staticmethod
    def map_bytes(capacity: int) -> int:
        """Memory of the maps of a table's log (the row -> record map: 4 bytes a row), whether
        or not it is open yet."""
        records = RowLog.max_records(capacity)
        return (capacity + records) * RowLog.index_dtype(capacity).itemsize + records // SEGMENT_RECORDS * (8 + 1)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.where, self.row_at, self.segment_live, self.in_use))

    def locate(self, rows: Tensor) -> Tensor:
        """Per row, the record of its newest copy (int64), -1 where that is the base file."""
        return self.where.index_select(0, rows).to(torch.int64)

    def read(self, records: Tensor, out: Tensor | None = None) -> Tensor:
        """The records at ``records`` (numbers), [n, record_bytes] uint8 (into ``out`` when given)."""
        self._land_any_of(records)
        if out is None:
            out = torch.empty(records.numel(), self.record_bytes, dtype=torch.uint8, device="cpu")
        tier_guard.copy_rows(out, None, self.records, records, "read")  # (a failed page: OSError, not SIGBUS)
        return out

    def live_rows(self) -> Tensor:
        """The rows whose newest copy is in the log, ascending."""
        return (self.where >= 0).nonzero().squeeze(1)

    def append(self, rows: Tensor, data: Tensor, defer: bool = False) -> None:
        """Appends the records ``data`` ([n, record_bytes] uint8, each starting with its row
        number) of the distinct ``rows``: they become the rows' newest copies. Cleans segments
        first while the free room is short of n and a spare segment, then while dead records outnumber live ones,
        ``2 * ceil(n / SEGMENT_RECORDS) + 1`` segments at most for each.

        ``defer``: the records are placed now and written later (``land``; ``data`` is the log's
        until then: not to be written to). The prefetch stage defers its write-backs' writes to
        the next stage's wait for its tables, where its thread is idle: the kernel's copy into
        the page cache (~8-16 ms a step at dlrm-small scale) leaves the stage's critical path. A
        read of an unwritten record lands it first; should its write fail, it stays unwritten
        (the rows' data in memory) and each later landing, or read of it (a lookup's miss,
        cleaning's, a checkpoint's), raises again."""
        n = rows.numel()
        budget = 2 * -(-n // SEGMENT_RECORDS) + 1
        for _ in range(budget):
            if self._room() >= n + SEGMENT_RECORDS or not self._cleanable():  # (a spare segment: room to clean into)
                break
            self._clean(self._victim(), defer)
        self._append(rows, data, defer)
        self.appended += n
        for _ in range(budget):
            if not self._dead_outnumber_live():
                break
            self._clean(self._victim(), defer)

    def unwritten(self) -> bool:
        """Whether deferred appends are still to be written (``land``)."""
        return bool(self._unwritten)

    @property
    def _write_lock(self) -> threading.Lock:
        pid, lock = self._lock_of
        if pid != os.getpid():  # (a fork's child: the parent's lock may have been held at the fork)
            self._lock_of = (os.getpid(), threading.Lock())
        return self._lock_of[1]

    def land(self) -> None:
        """Writes the records of the deferred appends; an OSError (as ``append``'s) leaves the
        ones not written yet unwritten."""
        if self._unwritten:  # (an entry leaves the list written, or dead: an empty list needs no lock)
            with self._write_lock:
                self._land_locked()

    def _land_locked(self) -> None:
        while self._unwritten:
            self._write(*self._unwritten[0])
            self._unwritten.pop(0)

    def _land_any_of(self, records: Tensor) -> None:
        """Lands the deferred appends when ``records`` (numbers) name one of theirs. Checked
        without the lock (a read naming none does not wait for a landing in progress): an
        entry leaves the list written, or dead (named by no row)."""
        unwritten = list(self._unwritten)
        if unwritten and any(self._names(records, first, n) for first, n, _ in unwritten):
            with self._write_lock:
                self._land_locked()

    @staticmethod
    def _names(records: Tensor, first: int, n: int) -> bool:
        return bool(((records >= first) & (records < first + n)).any())

    def _drop_unwritten(self, segment: int) -> None:
        """Forgets the deferred writes into ``segment`` (freed: its records all dead, its live
        ones moved), which would otherwise land over the records of its next use."""
        if self._unwritten:
            with self._write_lock:
                self._unwritten = [w for w in self._unwritten if w[0] // SEGMENT_RECORDS != segment]

    def forget(self, rows: Tensor) -> None:
        """``rows``' newest copies are in the base file now (written there, or no longer live)."""
        loc = self.locate(rows)
        held = loc >= 0
        if bool(held.any()):
            loc = loc[held]
            self.segment_live -= torch.bincount(loc // SEGMENT_RECORDS, minlength=self.max_segments)
            self.live -= loc.numel()
            self.where.index_fill_(0, rows[held], -1)

    def reset(self) -> None:
        """Empties the log (no row's newest copy in it) and gives its disk blocks back."""
        with self._write_lock:
            self._unwritten = []  # (no record is read again)
        self.where.fill_(-1)
        self.row_at.fill_(-1)
        self.segment_live.zero_()
        self.in_use.zero_()
        self.live, self.used, self.head, self.head_fill = 0, 0, None, 0
        length = self.records.numel()
        # (a file system without hole punching keeps the blocks: the log reuses them)
        _libc.fallocate(
            self.fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, ctypes.c_int64(self.offset), ctypes.c_int64(length)
        )

    # ------------------------------------------------------------------ segments

    def _append(self, rows: Tensor, data: Tensor, defer: bool = False) -> None:
        n, done = rows.numel(), 0
        while done < n:
            if self.head is None or self.head_fill == SEGMENT_RECORDS:
                self._next_head()
            take = min(n - done, SEGMENT_RECORDS - self.head_fill)
            first = self.head * SEGMENT_RECORDS + self.head_fill
            chunk = data if take == n else data[done : done + take]
            with self._write_lock:
                if defer:
                    self._unwritten.append((first, take, chunk))
                else:
                    self._write(first, take, chunk)
            # Written (or deferred): the records are the rows' newest copies now (not before: a
            # failed write leaves every row where it was).
            these = rows if take == n else rows[done : done + take]
            old = self.where.index_select(0, these)
            old = old[old >= 0]  # the copies these records supersede: dead now
            if old.numel():
                self.segment_live -= torch.bincount(old // SEGMENT_RECORDS, minlength=self.max_segments)
                self.live -= old.numel()
            self.where.index_copy_(0, these, torch.arange(first, first + take, dtype=self.where.dtype, device="cpu"))
            self.row_at.narrow(0, first, take).copy_(these)
            self.segment_live.narrow(0, self.head, 1).add_(take)
            self.live += take
            self.head_fill += take
            done += take

    def _write(self, first: int, n: int, chunk: Tensor) -> None:
        """Writes n records (``chunk``) from record ``first`` on (the write lock held)."""
        began, at = time.perf_counter(), self.offset + first * self.record_bytes
        try:
            tier_guard.check_whole(self.records, "append to")  # (cut short: the append would hide the cut)
            pwrite_all(self.fd, memoryview(chunk.numpy()).cast("B"), at)
            if WRITE_BEHIND:  # the kernel starts writing these pages to disk now
                self._behind = [f for f in self._behind if not f.done()] if self._behind_pid == os.getpid() else []
                self._behind_pid = os.getpid()
                self._behind.append(_write_behind(self.fd, at, chunk.numel()))
        except OSError as e:
            raise OSError(
                e.errno,
                f"{self.where_}: cannot append {n} rows ({n * self.record_bytes} bytes) "
                f"to backing log {self.path!r}: {e.strerror or e}",
            ) from None
        finally:
            self.write_s += time.perf_counter() - began

    def _next_head(self) -> None:
        free = (~self.in_use).nonzero()
        if free.numel() == 0:
            # Every segment used (appends outran cleaning's budget): the emptiest segment's live
            # rows (fewer than half of it: the log holds twice the table's rows) go home to the
            # base file, written there before the log lets go of them.
            victim = self._victim()
            rows, data = self._live_records(victim)
            self.home(rows, data)
            self.forget(rows)
            self._drop_unwritten(victim)
            self.in_use[victim] = False
            self.used -= 1
            self.sent_home += rows.numel()
            free = torch.tensor([victim], device="cpu")
        self.head, self.head_fill = int(free[0]), 0
        self.in_use[self.head] = True
        self.used += 1

    def _room(self) -> int:
        """Records appendable without taking a used segment."""
        head = 0 if self.head is None else SEGMENT_RECORDS - self.head_fill
        return head + (self.max_segments - self.used) * SEGMENT_RECORDS

    def _cleanable(self) -> bool:
        """Whether cleaning the emptiest segment would free room."""
        victim = self._victim()
        return bool(self.in_use[victim]) and int(self.segment_live[victim]) < SEGMENT_RECORDS

    def _dead_outnumber_live(self) -> bool:
        return self.used > 2 and (self.used - 1) * SEGMENT_RECORDS + self.head_fill > 2 * self.live

    def _victim(self) -> int:
        """The used segment with the fewest live records, not the head."""
        key = self.segment_live.masked_fill(~self.in_use, torch.iinfo(torch.int64).max)
        if self.head is not None:
            key[self.head] = torch.iinfo(torch.int64).max
        return int(key.argmin())

    def _live_records(self, segment: int) -> tuple[Tensor, Tensor]:
        first = segment * SEGMENT_RECORDS
        rows = self.row_at.narrow(0, first, SEGMENT_RECORDS).to(torch.int64)
        here = torch.arange(first, first + SEGMENT_RECORDS, dtype=torch.int64, device="cpu")
        live = (rows >= 0) & (self.where.index_select(0, rows.clamp(min=0)).to(torch.int64) == here)
        keep = live.nonzero().squeeze(1)
        # Copies (the segment is reused next), read from the file: its live records only.
        return rows.index_select(0, keep), self.read(keep.add_(first))

    def _clean(self, segment: int, defer: bool = False) -> None:
        rows, data = self._live_records(segment)  # (copies, its unwritten ones landed: deferred, they are the log's)
        self._drop_unwritten(segment)  # (the rest are dead: not to land over its next use)
        # Its live records leave it first (their where is rewritten by the append), then it is free.
        self._append(rows, data, defer)
        self.cleaned += rows.numel()
        self.segments_cleaned += 1
        if segment == self.head:  # (a full log: the append's next head was this segment, emptied home by _next_head)
            return
        self.in_use[segment] = False  # (its live count went to 0 as the append re-pointed its rows)
        self.used -= 1

    def settle(self) -> None:
        """Waits for the write-behind requests in flight (before the file is closed: they name it by its fd)."""
        if self._behind_pid == os.getpid():  # (a fork's child does not wait for its parent's requests)
            for request in self._behind:
                request.result()
        self._behind = []

    def close(self) -> None:
        """Before the file is closed: lands the deferred appends (their rows point at them) and
        waits for the write-behind requests. The mapping stays readable while referenced (a
        mover may read it after its store closed the file)."""
        self.land()
        self.settle()
