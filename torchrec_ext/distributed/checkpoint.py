"""Checkpoints through ``torch.distributed.checkpoint`` (DCP), in ``<dir>/step_<k>``.

A save is written to ``<dir>/.tmp_step_<k>`` and renamed once every rank has finished and the
metadata is on disk, so an interrupted save leaves the previous checkpoint loadable; only the
newest ``keep`` checkpoints are kept.

Loading handles state whose tensor shapes change as training goes: a dynamic table's
``state_dict()`` holds its live rows (``weight`` [n, dim], ``weight_id``, ``metadata``,
``optimizer.*`` ...), so the tensors of the model being resumed have other sizes than the
checkpoint's. ``load_checkpoint`` reads the checkpoint's metadata first and replaces every
plain tensor of the destination whose stored size (or dtype) differs by an empty tensor of the
stored size, and every ShardedTensor of a sharded dynamic table (``dynamic_rows``, rows per
rank vary) by a full tensor of the stored size, then lets DCP fill the destination (the sharded
module's load hook keeps the rows this rank owns, whatever the world size at save time). Values
DCP stores as bytes (ints, strings, lists and dicts without tensors) come back as they were
saved; keep such values terminal (e.g. JSON strings): a list that held dicts at save time and is
empty in the destination has another structure to DCP.

    state = {"model": dmp.state_dict(), "optim": optimizer.state_dict(), "step": step}
    save_checkpoint(ckpt_dir, step, state, keep=2)
    ...
    found = latest_checkpoint(ckpt_dir)                 # (step, path) or None
    state = load_checkpoint(found[1], {"model": dmp.state_dict(), "optim": optimizer.state_dict(), "step": 0})
    dmp.load_state_dict(state["model"]); optimizer.load_state_dict(state["optim"])

Every rank calls these collectively (all ranks see the same directory). Without a process
group a gloo group of one process is created, so a single process works too.
"""
from __future__ import annotations

import os
import re
import shutil
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint._traverse import set_element, traverse_state_dict
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

_NAME = re.compile(r"^step_(\d+)$")
_METADATA_FILE = ".metadata"  # what FileSystemWriter writes last, once every rank's data is in


def ensure_process_group() -> dist.ProcessGroup:
    """The default process group; a gloo group of this one process when none exists."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return dist.group.WORLD


def checkpoint_path(ckpt_dir: str, step: int) -> str:
    return os.path.join(ckpt_dir, f"step_{step}")


def list_checkpoints(ckpt_dir: str) -> List[Tuple[int, str]]:
    """Complete checkpoints under ckpt_dir as (step, path), oldest first."""
    if not os.path.isdir(ckpt_dir):
        return []
    found = []
    for name in os.listdir(ckpt_dir):
        match = _NAME.match(name)
        path = os.path.join(ckpt_dir, name)
        if match and os.path.isfile(os.path.join(path, _METADATA_FILE)):
            found.append((int(match.group(1)), path))
    return sorted(found)


def latest_checkpoint(ckpt_dir: str) -> Optional[Tuple[int, str]]:
    """(step, path) of the newest complete checkpoint under ckpt_dir, or None."""
    found = list_checkpoints(ckpt_dir)
    return found[-1] if found else None


def save_checkpoint(ckpt_dir: str, step: int, state: Dict[str, Any], keep: int = 2,
                    process_group: Optional[dist.ProcessGroup] = None) -> str:
    """Saves ``state`` as ``<ckpt_dir>/step_<step>`` (collective); keeps the newest ``keep``
    checkpoints (0: all). Returns the checkpoint's path."""
    if keep < 0:
        raise ValueError(f"save_checkpoint: keep must be >= 0, got {keep}")
    pg = process_group or ensure_process_group()
    rank = dist.get_rank(pg)
    final = checkpoint_path(ckpt_dir, step)
    tmp = os.path.join(ckpt_dir, f".tmp_step_{step}")
    if rank == 0:
        os.makedirs(ckpt_dir, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # left by an interrupted save
    dist.barrier(pg)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp), process_group=pg)
    dist.barrier(pg)  # every rank's files and the metadata are written
    if rank == 0:
        if os.path.exists(final):  # saving a step again (e.g. after resuming from it)
            old = os.path.join(ckpt_dir, f".old_step_{step}")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        _fsync_dir(ckpt_dir)
        if keep:
            for _, path in list_checkpoints(ckpt_dir)[:-keep]:
                shutil.rmtree(path, ignore_errors=True)
    dist.barrier(pg)
    return final


def read_metadata(path: str) -> Metadata:
    """The DCP metadata of a checkpoint directory (clear error when it is not one)."""
    if not os.path.isfile(os.path.join(path, _METADATA_FILE)):
        raise FileNotFoundError(f"load_checkpoint: {path!r} is not a complete checkpoint (no {_METADATA_FILE})")
    return dcp.FileSystemReader(path).read_metadata()


def fit_to_checkpoint(state: Dict[str, Any], metadata: Metadata) -> Dict[str, Any]:
    """Replaces, in place, every plain tensor of ``state`` whose checkpointed size or dtype
    differs by an empty tensor of the stored size and dtype (same device), so DCP can load into
    it. Returns ``state``. Raises KeyError naming entries the checkpoint lacks."""
    stored = metadata.state_dict_metadata
    replace: List[Tuple[Tuple, torch.Tensor]] = []
    missing: List[str] = []

    def visit(path, value) -> None:
        fqn = ".".join(map(str, path))
        if fqn not in stored:
            missing.append(fqn)
            return
        md = stored[fqn]
        if not isinstance(md, TensorStorageMetadata):
            return
        if isinstance(value, ShardedTensor):
            # Rows of a sharded dynamic table (dynamic_rows): how many each rank held at save time
            # need not match now, so read the whole tensor; the module's load hook keeps this
            # rank's rows (by routing). Other ShardedTensors load as they are when sizes match.
            if getattr(value, "dynamic_rows", False) or tuple(value.size()) != tuple(md.size):
                replace.append((path, torch.empty(tuple(md.size), dtype=md.properties.dtype)))
        elif type(value) is torch.Tensor:
            if tuple(value.shape) != tuple(md.size) or value.dtype != md.properties.dtype:
                replace.append((path, torch.empty(tuple(md.size), dtype=md.properties.dtype, device=value.device)))

    traverse_state_dict(state, visit)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise KeyError(f"load_checkpoint: the checkpoint has no {shown}")
    for path, tensor in replace:
        set_element(state, path, tensor)
    return state


def load_checkpoint(path: str, state: Dict[str, Any],
                    process_group: Optional[dist.ProcessGroup] = None) -> Dict[str, Any]:
    """Loads checkpoint ``path`` into ``state`` (collective) and returns it: tensors resized to
    the stored sizes where they differ, then filled; non-tensor values replaced by the saved ones."""
    pg = process_group or ensure_process_group()
    fit_to_checkpoint(state, read_metadata(path))
    dcp.load(state, storage_reader=dcp.FileSystemReader(path), process_group=pg)
    return state


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
