"""The run directory's lock: one job at a time writes a run directory (its checkpoints, history
and summary). An exclusive ``flock`` on ``<run-dir>/.lock``, taken by rank 0 for the job's life;
the kernel drops it when the process ends, however it ends (SIGKILL included), so a stale lock
file never blocks the next job."""
from __future__ import annotations

import fcntl
import os
from typing import Optional

LOCK_FILE = ".lock"


class RunDirBusy(ValueError):
    """Another job holds the run directory's lock."""


class RunDirLock:
    """Holds the lock of ``run_dir`` until ``release()`` (or the process ends); raises RunDirBusy
    naming the directory and the holder's pid when another process holds it."""

    def __init__(self, run_dir: str):
        path = os.path.join(run_dir, LOCK_FILE)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0), 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RunDirBusy(f"run directory {run_dir} is in use by another job (pid {holder}, holding {path}); "
                             "wait for it to end or pick another --run-dir") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)  # who holds it, for the message above
        self.path: str = path
        self._fd: Optional[int] = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the only descriptor drops the flock
            self._fd = None
