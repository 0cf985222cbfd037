"""Process group and device of the training job: one process, or one per rank under torchrun.

A failure on one rank must end every rank, quickly: collectives have a timeout the job sets
(not gloo's 30 minutes), a failing rank aborts its process groups instead of waiting for its
peers at a barrier (their pending collectives then fail at once), and a rank whose torchrun
agent dies is killed with it."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import datetime
import logging
import os
import re
import signal
import sys
from typing import NoReturn

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


@dataclasses.dataclass(frozen=True)
class Runtime:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def resolve_device(name: str, local_rank: int, local_world_size: int = 1) -> torch.device:
    """``auto`` (CUDA when present, else CPU), ``cpu``, ``cuda`` (GPU ``local_rank`` of this node)
    or ``cuda:N`` (one rank per node). Each rank of a node needs a GPU of its own: two ranks on one
    GPU fail in NCCL or silently share it, so more ranks per node than visible GPUs is refused,
    unless the launcher bound each rank to one GPU (``CUDA_VISIBLE_DEVICES`` naming one device, as
    Slurm's ``--gpus-per-task=1`` does): then each rank's only GPU is ``cuda:0``."""
    given = name
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return torch.device("cpu")
    if not re.fullmatch(r"cuda(:\d+)?", name):
        raise ValueError(f"--device: expected auto, cpu, cuda or cuda:N, got {name!r}")
    if not torch.cuda.is_available():
        raise ValueError(f"--device {given}: CUDA is not available here (torch {torch.__version__})")
    gpus = torch.cuda.device_count()
    if name == "cuda":
        ranks = max(local_world_size, local_rank + 1)
        if ranks > gpus:
            if gpus == 1 and _bound_to_one_gpu():
                return torch.device("cuda", 0)
            raise ValueError(
                f"--device {given}: {ranks} ranks on this node but {gpus} visible GPU(s); "
                f"start at most {gpus} per node (torchrun --nproc_per_node), one GPU each, "
                f"or bind each rank to its own GPU (CUDA_VISIBLE_DEVICES naming one device)"
            )
        return torch.device("cuda", local_rank)
    index = int(name.split(":")[1])
    if index >= gpus:
        raise ValueError(f"--device {given}: this node has {gpus} visible GPU(s), cuda:0 to cuda:{gpus - 1}")
    if local_world_size > 1 and not (gpus == 1 and _bound_to_one_gpu()):
        raise ValueError(
            f"--device {given} puts all {local_world_size} ranks of this node on one GPU; "
            f"use --device cuda (local rank i takes GPU i)"
        )
    return torch.device(name)


def _bound_to_one_gpu() -> bool:
    """The launcher gave this rank one GPU of its own: ``CUDA_VISIBLE_DEVICES`` names exactly one
    device. Two ranks bound to the same one are then caught by NCCL ("Duplicate GPU detected")."""
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return len(visible) == 1


def _die_with_launcher() -> None:
    """Under torchrun, asks the kernel to SIGKILL this rank when the agent that started it dies.
    The agent stops its ranks when it is stopped by a signal it can catch; killed outright, it
    would leave them running, each blocked on the others (holding GPUs, the run directory's lock)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        logger.warning(
            "prctl(PR_SET_PDEATHSIG) failed (errno %d): this rank outlives a killed torchrun", ctypes.get_errno()
        )
    elif os.getppid() == 1:  # the agent died before the request was in place
        os.kill(os.getpid(), signal.SIGKILL)


def init_runtime(device_name: str, collective_timeout_s: float = 300.0) -> Runtime:
    """Initialises the default process group: from torchrun's environment when WORLD_SIZE > 1
    (gloo on CPU; on CUDA nccl for CUDA tensors and gloo for host-side ones: NCCL has no CPU
    backend), else an in-process group of one. A collective that waits longer than
    ``collective_timeout_s`` for a peer fails. Returns rank, sizes, device."""
    if not collective_timeout_s > 0:
        raise ValueError(f"collective_timeout_s must be > 0, got {collective_timeout_s}")
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    device = resolve_device(device_name, local_rank, local_world_size)
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    _die_with_launcher()
    timeout = datetime.timedelta(seconds=collective_timeout_s)
    if not dist.is_initialized():
        if world_size > 1:
            dist.init_process_group(backend, timeout=timeout, device_id=device if device.type == "cuda" else None)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return Runtime(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=local_rank,
        local_world_size=local_world_size,
        device=device,
        backend=backend,
    )


def shutdown(failed: bool = False) -> None:
    """Ends this process's process groups, if any. After a clean run: destroys them once every
    rank has reached this point (tearing one down under a peer's last collective aborts that
    peer). After a failure: aborts them at once, without waiting for peers that may never get
    here; their pending and later collectives fail, so they end too."""
    if not dist.is_initialized():
        return
    if not failed:
        dist.barrier()
        dist.destroy_process_group()
        return
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)  # torch >= 2.4, private
    try:
        if abort is not None:
            abort()
        else:
            dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001 - the process is ending on an earlier error: keep that one
        logger.warning("aborting the process groups failed: %s", e)


def exit_now(code: int) -> NoReturn:
    """Ends the process with ``code`` at once, stdout and stderr flushed, skipping interpreter
    teardown: after a failure, destructors of aborted process groups (and of threads still
    blocked in them) can hang the exit or end it in SIGABRT."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed pipe must not change the exit code
            stream.flush()
    os._exit(code)
