"""Clones of process groups for collectives issued from helper threads, kept per process.

A pipeline whose helper thread issues collectives needs a group of its own (two threads
interleaving collectives on one group mismatch across ranks). Each gloo/nccl group holds threads,
sockets and buffers until the process ends (destroying one while a peer may still be in its last
collective on it aborts that peer), and a job builds a pipeline per train segment. So a pipeline
borrows a clone here and gives it back at close(): the next pipeline reuses it, and only
pipelines alive at the same time get different clones.

Borrowing may create a group, which is a collective call: every rank must borrow and give back
in the same order, as SPMD code building the same pipelines does. A group whose helper thread did
not stop (a close that timed out, on this rank only maybe) is ``abandon``-ed instead: it is never
reused, and borrowing for its source then raises, since this rank's pool may now differ from its
peers' (one creating a group, a collective, while another reuses one would pair mismatched calls).
"""

from __future__ import annotations

import threading
import weakref

import torch
import torch.distributed as dist

_lock = threading.Lock()
# source group -> its clones not borrowed now (weak: a destroyed world's groups are not kept alive)
_idle: weakref.WeakKeyDictionary[dist.ProcessGroup, list[dist.ProcessGroup]] = weakref.WeakKeyDictionary()
# source group -> why its pool is closed (a clone was abandoned)
_closed: weakref.WeakKeyDictionary[dist.ProcessGroup, str] = weakref.WeakKeyDictionary()


def _registered(group: dist.ProcessGroup) -> bool:
    """False once destroy_process_group() has dropped the group."""
    try:
        dist.get_process_group_ranks(group)
    except (KeyError, ValueError, RuntimeError):
        return False
    return True


def _timeout(group: dist.ProcessGroup):
    """The group's collective timeout (a clone keeps the job's bound, not the backend default)."""
    device = torch.device("cuda" if dist.get_backend(group) == "nccl" else "cpu")
    try:
        return group._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):
        return None  # new_group's default


def borrow(source: dist.ProcessGroup) -> dist.ProcessGroup:
    """A group with the ranks, backend and timeout of ``source`` that no other borrower holds."""
    check_pools_open()
    with _lock:
        idle = _idle.setdefault(source, [])
        while idle:
            group = idle.pop()
            if _registered(group):
                return group
    return dist.new_group(
        ranks=dist.get_process_group_ranks(source), backend=dist.get_backend(source), timeout=_timeout(source)
    )


def give_back(source: dist.ProcessGroup, group: dist.ProcessGroup) -> None:
    """Returns a borrowed group; the next borrow for ``source`` gets it."""
    with _lock:
        if _registered(source) and _registered(group):
            _idle.setdefault(source, []).append(group)


def check_pools_open() -> None:
    """Raises once a group was abandoned (while its source group lives): see ``abandon``."""
    with _lock:
        why = next((why for source, why in _closed.items() if _registered(source)), None)
    if why is not None:
        raise RuntimeError(
            f"cannot borrow a process group for the input dist: {why}, so this rank's pool of groups may "
            "differ from its peers' and a new group could pair mismatched collectives; the process group "
            "must be destroyed and created again (restart the job)"
        )


def abandon(source: dist.ProcessGroup, why: str) -> None:
    """A clone of ``source`` that a helper thread may still use (``why``: what happened) is
    never given back: later borrows raise, naming ``why``."""
    with _lock:
        _closed[source] = why
