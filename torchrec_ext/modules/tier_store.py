"""The backing store of tiered tables: every row of a module's tables, in host memory or in files.

A module's tiered tables (``tiered_tables.TieredTables``) keep each of their flat buffers (the
vectors' words, each optimizer state) whole here, in the layout an all-resident module's buffer
has, and only a cache of hot rows in the module's own buffer.

``backing="host"``: host tensors (allocated by the tables, as their cache). ``backing="file:<dir>"``: one file per buffer,
``<dir>/<tables>.<buffer>.rows`` (a rank's share of sharded tables: ``<dir>/<shard>.<tables>.<buffer>.rows``,
the shard named by rank and world size, e.g. ``rank1-of-2``, so ranks sharing a directory never
share a file): a 4 KiB header (magic, layout version, the tables' names, capacities, dims and
dtypes, the shard, the buffer's name and length) and then the buffer, mapped
MAP_SHARED (``torch.from_file``), so that reading and writing rows of the tensor is the file's
I/O and the page cache decides what stays in RAM; advised random (``advise_random``: a fault
reads its page, no readahead window). The file's space is reserved when it is
created (``posix_fallocate``) and then written with zeros once: a full disk or a failing write
is an error then, not a SIGBUS in the middle of a training step, and no write-back later
allocates a block. (A block reserved but unwritten costs the first write through the mapping
30-45 us per 4 KiB page on ext4, the conversion of its extent; a written page in the page cache
0.05-0.5 us a row, less than an explicit ``pwrite`` a row, ~2 us: benchmarks/results/tier_file_writes.md.)
Rows are copied to and from the mappings by ``tier_guard.copy_rows``: reads by ``pread`` of the
file (``READ_WITH_PREAD``: they map no page), writes through the mapping, whose pages are unmapped
after the copy (``RELEASE_AFTER_COPY``; the page cache keeps them). A row is a fraction of a page:
copies through the mappings would keep mapped every page the tables touched, up to the files'
size, in the process's resident memory. A page that fails later (a
disk I/O error, the file truncated by another process) is an ``OSError`` naming the file and the
offset, raised before the step changes any map, not a SIGBUS (``register`` here names each
mapping's file). Each file is locked (``flock``, advisory) while its module lives, so two live
modules never share rows; a file of other tables or of another layout version is refused, one
of the same tables is reused (its rows are overwritten before any is read: a fresh index names
no row).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import mmap
import os
import re

import torch
from torch import Tensor

from torchrec_ext.modules import tier_guard
from torchrec_ext.modules.tier_log import RowLog

LAYOUT_VERSION = 2  # 2: write-backs go to a log (tier_log.py), the rows file is not all of a table
MAGIC = b"TRXTIER\0"
HEADER_BYTES = 4096  # a page: the rows after it stay page-aligned


def parse_backing(backing: str) -> str | None:
    """The directory of a ``"file:<dir>"`` backing; None for ``"host"``."""
    return backing[len("file:") :] if backing.startswith("file:") else None


PAGE_BYTES = mmap.PAGESIZE


def write_zeros(fd: int, offset: int, length: int) -> None:
    """Writes ``length`` zero bytes at ``offset`` of ``fd``, a page a write, and syncs them: the
    blocks are then written on disk, not merely reserved (an unwritten extent until the kernel
    writes the pages back, whose first write through the mapping pays the conversion), and the
    page cache holds them in single pages: a larger write makes larger folios (up to 2 MiB on
    ext4 of Linux 6.18), and a row written back through the mapping then dirties, and the kernel
    writes to disk, the whole folio. OSError on a failed write or sync, or a write that writes
    nothing."""
    zeros = memoryview(bytes(PAGE_BYTES))
    end = offset + length
    while offset < end:
        written = os.pwrite(fd, zeros[: min(PAGE_BYTES - offset % PAGE_BYTES, end - offset)], offset)
        if written <= 0:  # (a short write is continued; none at all would loop forever)
            raise OSError(errno.EIO, f"wrote {written} of {end - offset} bytes at offset {offset}")
        offset += written
    os.fdatasync(fd)


def advise_random(mapped: Tensor, fd: int, path: str, where: str) -> None:
    """Tells the kernel that ``mapped`` (a whole file mapping) and the open file ``fd`` are read at
    random (MADV_RANDOM, POSIX_FADV_RANDOM): a page fault or a ``pread`` then reads its pages only,
    not the device's readahead window around them (8 MiB on this machine's disk: training a file
    larger than RAM read ~2,000x the bytes it used; rows read in ascending order look sequential)."""
    err = tier_guard.madvise(mapped.data_ptr(), mapped.numel() * mapped.element_size(), mmap.MADV_RANDOM)
    if err:
        raise ValueError(f"{where}: madvise(MADV_RANDOM) of backing file {path!r} failed: {os.strerror(err)}")
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    except OSError as e:
        raise ValueError(f"{where}: posix_fadvise(POSIX_FADV_RANDOM) of backing file {path!r} failed: {e}") from None


class BackingStore:
    """The backing buffers of one module's tables (see the module docstring).

    tables: per table (name, capacity, dim, storage dtype), which the files' headers name.
    shard: which shard of sharded tables these are (``DynamicTableOptions.backing_shard``), or None.
    """

    def __init__(self, backing: str, tables: list[tuple], where: str, shard: str | None = None):
        self.backing = backing
        self.shard = shard
        self.directory = parse_backing(backing)
        self.tables = [
            {"name": n, "capacity": c, "dim": d, "dtype": str(dt).replace("torch.", "")} for n, c, d, dt in tables
        ]
        self._files: dict[str, object] = {}  # buffer name (a log: "log<t>") -> its open, locked file
        self._logs: dict[int, RowLog] = {}  # table -> its write-back log (tier_log.py)
        if self.directory is not None:
            if os.path.exists(self.directory) and not os.path.isdir(self.directory):
                raise ValueError(
                    f"{where}: backing directory {self.directory!r} is not a directory (backing={backing!r}: "
                    "file:<dir> names a directory, in which the module makes its files)"
                )
            if not os.path.isdir(self.directory):
                raise ValueError(f"{where}: backing directory {self.directory!r} does not exist (backing={backing!r})")
            if not os.access(self.directory, os.W_OK | os.X_OK):
                raise ValueError(f"{where}: backing directory {self.directory!r} is not writable (backing={backing!r})")
        self.where = where

    def map(self, name: str, numel: int, value: float, fill: bool) -> Tensor:
        """Buffer ``name`` of ``numel`` float32 elements, mapped from its file (file backing);
        filled with ``value`` when ``fill`` (otherwise unspecified: zeros in a new file)."""
        buf = self._map(name, numel)
        if fill:
            buf.fill_(value)
        return buf

    def path(self, name: str, kind: str = "rows") -> str:
        names = "+".join(re.sub(r"[^A-Za-z0-9_.-]", "_", t["name"]) for t in self.tables)
        if len(names) > 120:  # long or many names: a digest of them instead
            names = "tables-" + hashlib.sha1(names.encode()).hexdigest()[:16]
        prefix = "" if self.shard is None else f"{self.shard}."
        return os.path.join(self.directory, f"{prefix}{names}.{name}.{kind}")

    def _header(self, name: str, numel: int | None) -> dict:
        header = {"layout_version": LAYOUT_VERSION, "buffer": name, "numel": numel, "tables": self.tables}
        if self.shard is not None:  # (files of unsharded tables keep the header they had)
            header["shard"] = self.shard
        return header

    def _map(self, name: str, numel: int) -> Tensor:
        path, header = self.path(name), self._header(name, numel)
        old = self._files.pop(name, None)
        if old is not None:  # ours, re-allocated (a new optimizer's state): start it afresh
            old.close()
            os.unlink(path)
        f, existed = self._open_locked(path, header)
        if not existed:
            doing = "reserve"
            try:
                os.posix_fallocate(f.fileno(), 0, HEADER_BYTES + 4 * numel)
                doing = "write"
                write_zeros(f.fileno(), HEADER_BYTES, 4 * numel)
            except OSError as e:
                f.close()
                os.unlink(path)
                raise ValueError(
                    f"{self.where}: cannot {doing} {HEADER_BYTES + 4 * numel} bytes for backing file {path!r}: {e}"
                ) from None
        self._files[name] = f
        whole = torch.from_file(path, shared=True, size=HEADER_BYTES // 4 + numel, dtype=torch.float32)
        advise_random(whole, f.fileno(), path, self.where)
        tier_guard.register(whole, path, self.where, f)  # (its rows are copied by tier_guard.copy_rows)
        return whole[HEADER_BYTES // 4 :]

    def log(self, t: int, record_bytes: int) -> RowLog:
        """Table t's write-back log (``tier_log.RowLog``) of records of ``record_bytes``: the one
        open, or a new empty one (a stale log file of the same tables is emptied: its records
        are never read again)."""
        log = self._logs.get(t)
        if log is not None and log.record_bytes == record_bytes:
            return log
        if log is not None:  # another record layout (a new optimizer): only an empty log is replaced
            if log.live:
                raise RuntimeError(f"{self.where}: backing log {log.path!r} still holds rows")
            log.close()
            self._files.pop(f"log{t}").close()
        table = self.tables[t]
        safe = [re.sub(r"[^A-Za-z0-9_.-]", "_", other["name"]) for other in self.tables]
        unique = len(safe[t]) <= 100 and safe.count(safe[t]) == 1
        path = self.path(safe[t] if unique else f"table{t}", kind="log")  # (as the rows files' names)
        f, _ = self._open_locked(path, self._header(f"log:{table['name']}", None))
        max_records = RowLog.max_records(table["capacity"])
        size = HEADER_BYTES + max_records * record_bytes
        try:
            os.truncate(path, HEADER_BYTES)  # stale records gone (and their blocks)
            os.truncate(path, size)  # sparse: blocks are taken as records are appended
        except OSError as e:
            f.close()
            raise ValueError(f"{self.where}: cannot size backing log {path!r} to {size} bytes: {e}") from None
        self._files[f"log{t}"] = f
        whole = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        advise_random(whole, f.fileno(), path, self.where)
        tier_guard.register(whole, path, self.where, f)
        records = whole[HEADER_BYTES:].view(max_records, record_bytes)
        self._logs[t] = RowLog(f.fileno(), path, records, HEADER_BYTES, table["capacity"], self.where)
        return self._logs[t]

    def logs(self) -> dict[int, RowLog]:
        return dict(self._logs)

    def _open_locked(self, path: str, header: dict) -> tuple[object, bool]:
        """``path`` opened and locked, its header checked (an existing file) or written (a new
        one); and whether it existed."""
        exists = os.path.exists(path) and os.path.getsize(path) > 0
        try:
            f = open(path, "r+b" if exists else "w+b")  # noqa: SIM115 - open for the table's life
        except OSError as e:
            raise ValueError(f"{self.where}: cannot open backing file {path!r}: {e}") from None
        try:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                raise ValueError(
                    f"{self.where}: backing file {path!r} is in use by another live module (each "
                    "tiered module needs files of its own: another directory, or free the other "
                    "module first; a module to shard: build it on the meta device, each rank's "
                    "share then has files of its own, named by rank)"
                ) from None
            if exists:
                self._check_header(path, f.read(HEADER_BYTES), header)
            else:
                text = MAGIC + json.dumps(header).encode()
                if len(text) > HEADER_BYTES:
                    raise ValueError(
                        f"{self.where}: the backing file header of {len(self.tables)} tables is longer "
                        f"than {HEADER_BYTES} bytes; give the module fewer tables"
                    )
                f.write(text.ljust(HEADER_BYTES, b"\0"))
                f.flush()
        except BaseException:
            f.close()
            if not exists and os.path.exists(path):
                os.unlink(path)
            raise
        return f, exists

    def _check_header(self, path: str, raw: bytes, want: dict) -> None:
        if not raw.startswith(MAGIC):
            raise ValueError(f"{self.where}: {path!r} is not a tiered table's backing file (no {MAGIC!r} header)")
        try:
            have = json.loads(raw[len(MAGIC) :].rstrip(b"\0").decode())
        except ValueError:
            raise ValueError(f"{self.where}: backing file {path!r} has an unreadable header") from None
        if have.get("layout_version") != LAYOUT_VERSION:
            raise ValueError(
                f"{self.where}: backing file {path!r} has layout version {have.get('layout_version')!r}, "
                f"this build reads version {LAYOUT_VERSION}"
            )
        for key in ("tables", "shard", "buffer", "numel"):
            if have.get(key) != want.get(key):
                raise ValueError(
                    f"{self.where}: backing file {path!r} holds {key} {have.get(key)!r}, not this "
                    f"module's {want.get(key)!r}: a file of other tables; use another directory"
                )
        if want["numel"] is not None and os.path.getsize(path) < HEADER_BYTES + 4 * want["numel"]:
            raise ValueError(
                f"{self.where}: backing file {path!r} is {os.path.getsize(path)} bytes, shorter than "
                f"its header says ({HEADER_BYTES + 4 * want['numel']})"
            )

    def close(self) -> None:
        """Releases the files' locks (the mapped tensors stay valid while referenced)."""
        for log in self._logs.values():
            log.close()
        for f in self._files.values():
            f.close()
        self._files = {}
        self._logs = {}

    def __getstate__(self) -> dict[str, object]:
        # A copy (deepcopy / pickle) gets its buffers as host tensors: it holds no file.
        state = dict(self.__dict__)
        state["_files"], state["_logs"] = {}, {}
        state["directory"] = None
        return state
