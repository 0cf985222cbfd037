"""Process group and device of the training job: one process, or one per rank under torchrun."""
from __future__ import annotations

import dataclasses
import os
import re

import torch
import torch.distributed as dist


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
    GPU fail in NCCL or silently share it, so more ranks per node than visible GPUs is refused."""
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
            raise ValueError(f"--device {given}: {ranks} ranks on this node but {gpus} visible GPU(s); "
                             f"start at most {gpus} per node (torchrun --nproc_per_node), one GPU each")
        return torch.device("cuda", local_rank)
    index = int(name.split(":")[1])
    if index >= gpus:
        raise ValueError(f"--device {given}: this node has {gpus} visible GPU(s), cuda:0 to cuda:{gpus - 1}")
    if local_world_size > 1:
        raise ValueError(f"--device {given} puts all {local_world_size} ranks of this node on one GPU; "
                         f"use --device cuda (local rank i takes GPU i)")
    return torch.device(name)


def init_runtime(device_name: str) -> Runtime:
    """Initialises the default process group: from torchrun's environment when WORLD_SIZE > 1
    (gloo on CPU, nccl on CUDA), else an in-process group of one. Returns rank, sizes, device."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    device = resolve_device(device_name, local_rank, local_world_size)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        if world_size > 1:
            dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return Runtime(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank,
                   local_world_size=local_world_size, device=device, backend=backend)


def shutdown() -> None:
    """Destroys the default process group, if any, once every rank has reached this point
    (tearing it down under a peer's last collective aborts that peer)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
