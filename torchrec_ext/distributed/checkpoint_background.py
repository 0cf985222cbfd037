"""Checkpoints written in the background while training goes on.

``save_checkpoint(..., blocking=False)`` stages a copy of the state in host memory at the call
(the step boundary: later in-place updates of the tables do not reach the checkpoint) and runs
the whole save, DCP write, hashing, manifest and rename, on a worker thread. Its collectives run
on a gloo group of their own (one per training group, created at the first background save):
the worker's collectives never interleave with the training loop's, whatever the backend there.

One save is in flight per group: a later save, blocking or not, first waits for the one before
it, so checkpoints complete in step order and rotation never races a write. Because the
directory only takes its final name after the manifest is written, a crash mid-write leaves at
most a ``.tmp_step_<k>`` that ``latest_checkpoint`` never picks, and the previous checkpoint
stays loadable until the new one is complete.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.staging import BlockingAsyncStager

_groups: dict[dist.ProcessGroup, dist.ProcessGroup] = {}
_in_flight: dict[dist.ProcessGroup, PendingCheckpoint] = {}
_lock = threading.Lock()
WORKER_NICENESS = 10  # the worker thread's nice value (0..19, higher yields more)


class PendingCheckpoint:
    """A checkpoint being written by a worker thread. ``wait()`` returns its path once it is
    complete and verified-loadable, or raises what the save raised (on every rank, as the
    blocking save would)."""

    def __init__(self, path: str, save: Callable[[], str]):
        self.path = path
        self._result: str | None = None
        self._error: BaseException | None = None
        # A daemon: a process that fails while a save is in flight exits (leaving only a
        # .tmp_step_<k>) instead of waiting on a worker whose peers may be gone.
        self._thread = threading.Thread(target=self._run, args=(save,), name=f"checkpoint:{path}", daemon=True)
        self._thread.start()

    def _run(self, save: Callable[[], str]) -> None:
        # Yield the CPU to training: the write can wait, the step cannot (Linux: per thread).
        with contextlib.suppress(AttributeError, OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WORKER_NICENESS)
        try:
            self._result = save()
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits, who raises it
            self._error = e

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> str:
        """Blocks until the save ends; its path, or its error re-raised. ``timeout`` (seconds)
        raises TimeoutError when the save is still running then."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"checkpoint {self.path}: still being written after {timeout} s")
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    def __repr__(self) -> str:
        return f"PendingCheckpoint({self.path!r}, done={self.done()})"


def wait_for_pending(pg: dist.ProcessGroup) -> None:
    """Waits for the background save in flight on training group ``pg``, if any (its error, if
    it failed, is raised here: a later save must not pretend the earlier one landed)."""
    with _lock:
        pending = _in_flight.pop(pg, None)
    if pending is not None:
        pending.wait()


def checkpoint_group(pg: dist.ProcessGroup) -> dist.ProcessGroup:
    """The gloo group background saves of training group ``pg`` run their collectives on.
    Created at the first call, which must therefore be made by every rank of the default group
    (``save_checkpoint`` is collective, so it is)."""
    if pg not in _groups:
        _groups[pg] = dist.new_group(ranks=dist.get_process_group_ranks(pg), backend="gloo")
    return _groups[pg]


def start_background_save(
    pg: dist.ProcessGroup, path: str, state: dict[str, Any], save: Callable[[dict[str, Any], dist.ProcessGroup], str]
) -> PendingCheckpoint:
    """Stages ``state`` in host memory now and runs ``save(staged_state, group)`` on a worker
    thread with the checkpoint group of ``pg``. Waits for the previous background save first."""
    wait_for_pending(pg)
    group = checkpoint_group(pg)
    staged = BlockingAsyncStager().stage(state)
    pending = PendingCheckpoint(path, lambda: save(staged, group))
    with _lock:
        _in_flight[pg] = pending
    return pending
