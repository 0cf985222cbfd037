"""The checkpoint's file I/O: DCP's file writer with each file's SHA-256 computed as it is
written, and file hashing spread over threads.

Hashing is what a save and a verification cost beyond the bytes moved (SHA-256 runs at ~1.8 GB/s
per core, about a page-cache read's fifth). Hashing the bytes on their way to the file spares
the save a second pass over them, and DCP's writer threads (one file each) hash in parallel;
``hashlib`` releases the GIL on large buffers, so threads hashing different files run on as many
cores. A file whose stream was ever moved backwards (no writer of DCP's does) is left unhashed,
and the save hashes it from disk instead.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystem

HASH_CHUNK = 1 << 20
# DCP writer threads (one file each) and hashing threads per rank: what a host's cores give,
# at most 4 (beyond that the disk, not the hash, bounds a save).
IO_THREADS = max(1, min(4, os.cpu_count() or 1))


class _HashingStream:
    """A binary file opened for writing that hashes what is written through it."""

    def __init__(self, raw, on_close):
        self._raw, self._on_close = raw, on_close
        self._digest, self._size, self._sequential = hashlib.sha256(), 0, True

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        written = self._raw.write(view)
        self._digest.update(view[:written] if written is not None and written < len(view) else view)
        self._size += len(view) if written is None else written
        return written

    def seek(self, *args):
        self._sequential = False  # the digest no longer follows the file's bytes
        return self._raw.seek(*args)

    def tell(self) -> int:
        return self._raw.tell()

    def close(self) -> None:
        if not self._raw.closed:
            self._raw.close()
            self._on_close(self._size, self._digest.hexdigest() if self._sequential else None)

    @property
    def closed(self) -> bool:
        return self._raw.closed

    def __getattr__(self, name):  # flush, fileno, writable, ...
        return getattr(self._raw, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _HashingFileSystem(FileSystem):
    """DCP's local file system, recording (size, SHA-256) of every file written, by file name."""

    def __init__(self) -> None:
        super().__init__()
        self.digests: dict[str, tuple[int, str]] = {}
        self._lock = threading.Lock()

    @contextmanager
    def create_stream(self, path, mode: str) -> Iterator:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        name = os.path.basename(str(path))
        with self._lock:
            self.digests.pop(name, None)

        def record(size: int, digest):
            if digest is not None:
                with self._lock:
                    self.digests[name] = (size, digest)

        with super().create_stream(path, mode) as raw:
            stream = _HashingStream(raw, record)
            try:
                yield stream
            finally:
                stream.close()

    def rename(self, path, new_path) -> None:  # DCP writes .metadata aside, then renames it
        super().rename(path, new_path)
        with self._lock:
            digest = self.digests.pop(os.path.basename(str(path)), None)
            if digest is not None:
                self.digests[os.path.basename(str(new_path))] = digest


class HashingWriter(dcp.FileSystemWriter):
    """DCP's FileSystemWriter (one file per writer thread per rank, fsynced) whose ``digests``
    hold {file name: (size, SHA-256)} of the files this process wrote."""

    def __init__(self, path: str, thread_count: int | None = None):
        super().__init__(path, thread_count=thread_count or IO_THREADS)
        self.fs = _HashingFileSystem()

    @property
    def digests(self) -> dict[str, tuple[int, str]]:
        return dict(self.fs.digests)


def file_digest(path: str) -> tuple[int, str]:
    """(size, SHA-256 hex digest) of a regular file, opened without following a symlink."""
    digest, size = hashlib.sha256(), 0
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    with os.fdopen(fd, "rb", buffering=0) as f:
        buffer = memoryview(bytearray(HASH_CHUNK))
        while True:
            n = f.readinto(buffer)
            if not n:
                break
            digest.update(buffer[:n])
            size += n
    return size, digest.hexdigest()


def file_digests(directory: str, names: list[str]) -> dict[str, tuple[int, str]]:
    """{name: (size, SHA-256)} of files ``names`` in ``directory``, hashed on up to IO_THREADS
    threads (largest first, so the threads finish together). Raises the first OSError."""
    if len(names) <= 1 or IO_THREADS == 1:
        return {name: file_digest(os.path.join(directory, name)) for name in names}

    def size(name: str) -> int:
        try:
            return os.lstat(os.path.join(directory, name)).st_size
        except OSError:
            return 0

    ordered = sorted(names, key=size, reverse=True)
    with ThreadPoolExecutor(min(IO_THREADS, len(names)), thread_name_prefix="checkpoint-hash") as pool:
        results = list(pool.map(lambda name: file_digest(os.path.join(directory, name)), ordered))
    return dict(zip(ordered, results))
