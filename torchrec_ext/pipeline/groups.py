"""Clones of process groups for collectives issued from helper threads, kept per process.

A pipeline whose helper thread issues collectives needs a group of its own (two threads
interleaving collectives on one group mismatch across ranks). Each gloo/nccl group holds threads,
sockets and buffers until the process ends (destroying one while a peer may still be in its last
collective on it aborts that peer), and a job builds a pipeline per train segment. So a pipeline
borrows a clone here and gives it back at close(): the next pipeline reuses it, and only
pipelines alive at the same time get different clones.

Only where the collectives do not run on NCCL with peers (``runs_on_nccl``): NCCL asks every rank
to launch the collectives of all communicators of a device in one order, and a helper thread's
collectives on a clone race the train thread's on the source group, in a different order on each
rank (a hang when the GPU cannot run both at once). Gloo groups, and a group of one rank, have no
such rule.

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


def nccl_for_cuda(backend: str) -> bool:
    """Whether a group of ``backend`` (``dist.get_backend``: ``nccl``, ``gloo``,
    ``cpu:gloo,cuda:nccl``...) sends CUDA tensors through NCCL."""
    pairs = [pair.split(":", 1) for pair in str(backend).lower().split(",")]
    if len(pairs) == 1 and len(pairs[0]) == 1:
        return pairs[0][0].strip() == "nccl"
    return any(len(pair) == 2 and pair[0].strip() == "cuda" and pair[1].strip() == "nccl" for pair in pairs)


def runs_on_nccl(group: dist.ProcessGroup | None, device: torch.device) -> bool:
    """Whether collectives of tensors on ``device`` over ``group`` (None: the default group) run on
    an NCCL communicator with peers: a CUDA device, more than one rank, NCCL for CUDA tensors."""
    if device.type != "cuda" or not dist.is_initialized():
        return False
    group = group or dist.group.WORLD
    return dist.get_world_size(group) > 1 and nccl_for_cuda(dist.get_backend(group))


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
