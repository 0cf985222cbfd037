"""The job's checkpoints: what a save holds (model, optimizer, step, data stream position, loss
history, evals and the arguments that shaped the run) and how ``--resume`` reads it back from
the newest checkpoint that verifies, refusing one written by a differently shaped model.

Saving and verifying are ``torchrec_ext.distributed.checkpoint``'s; this module decides the
entries and checks them."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from typing import Any

import torch

from torchrec_ext.distributed.checkpoint import (
    PendingCheckpoint,
    ensure_process_group,
    find_checkpoint,
    load_checkpoint,
    load_dcp,
    read_manifest,
    save_checkpoint,
)
from torchrec_ext.distributed.checkpoint_incremental import IncrementalCheckpoints
from torchrec_ext.distributed.checkpoint_template import state_template

# Arguments a resumed run must share with the checkpoint (they shape the model or its tables).
MODEL_ARGS = (
    "embedding_dim",
    "capacity",
    "eviction",
    "dense_arch",
    "over_arch",
    "dcn_layers",
    "dcn_rank",
    "data_type",
    "admission",
    "admit_after",
    "admit_probability",
    "bloom_fpr",
    "fallback_rows",
)
# Arguments that decide what the data stream yields at a given step: a change is allowed but warned about.
STREAM_ARGS = ("data", "batch_size", "seed", "truth_seed")


def resume_config(args: argparse.Namespace, world_size: int) -> dict[str, Any]:
    """The arguments a checkpoint records, to be compared when a run resumes from it."""
    config = {name: getattr(args, name) for name in MODEL_ARGS}
    config.update(
        data=args.data_spec.describe(),
        batch_size=args.batch_size,
        seed=args.seed,
        truth_seed=args.truth_seed,
        world_size=world_size,
    )
    return config


def check_resume_config(saved: dict[str, Any], now: dict[str, Any], path: str, log: Callable[[str], None]) -> None:
    """Refuses a checkpoint of another model shape; warns when the data stream will differ."""
    differ = [k for k in MODEL_ARGS if k in saved and saved[k] != now[k]]
    if differ:
        raise ValueError(
            f"--resume: checkpoint {path} was written by a model with "
            + ", ".join(f"--{k.replace('_', '-')} {saved[k]}" for k in differ)
            + "; this run has "
            + ", ".join(f"{now[k]}" for k in differ)
        )
    changed = [k for k in STREAM_ARGS if k in saved and saved[k] != now[k]]
    if changed:
        log(
            "warning: resuming with "
            + ", ".join(f"{k} {saved[k]} -> {now[k]}" for k in changed)
            + ": the data stream does not continue exactly where the checkpoint left it"
        )


def json_entry(value: Any, name: str, path: str) -> Any:
    """A checkpoint entry the job stored as JSON text, decoded (clear error when it is not)."""
    try:
        if not isinstance(value, str):
            raise TypeError(type(value).__name__)
        return json.loads(value)
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"--resume: checkpoint {path}: entry {name!r} is not the JSON text the job writes ({e})"
        ) from None


def newest_verified(ckpt_dir: str, log: Callable[[str], None]) -> tuple[str | None, list[tuple[str, str]]]:
    """The newest checkpoint of ``ckpt_dir`` that verifies against its manifest (None when there
    is none: the run starts from step 0), and the newer ones skipped with why. Raises when there
    are checkpoints but none verifies."""
    found, skipped = find_checkpoint(ckpt_dir)
    for _, reason in skipped:
        log(f"--resume: skipping {reason}")
    if found is None and skipped:
        raise ValueError(
            f"--resume: no checkpoint in {ckpt_dir} verifies (the newest: {skipped[0][1]}); "
            "move the damaged ones away to start from step 0"
        )
    if found is None:
        log(f"--resume: no checkpoint in {ckpt_dir}; starting from step 0")
        return None, skipped
    return found[1], skipped


def load_job_state(
    path: str,
    dmp: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    config: dict[str, Any],
    log: Callable[[str], None],
) -> dict[str, Any]:
    """Loads a verified checkpoint into ``dmp`` and ``optimizer`` (after checking its config
    against this run's) and returns its other entries: step, data_position, train_loss, evals."""
    # Verified just now: read without hashing again. Config first, before the model is read.
    incremental = "incremental" in read_manifest(path)  # a link of an incremental chain (--checkpoint-incremental)
    if incremental:
        saved = load_dcp(path, {"config": ""}, ensure_process_group())["config"]
    else:
        saved = load_checkpoint(path, {"config": ""}, verify=False)["config"]
    check_resume_config(json_entry(saved, "config", path), config, path, log)
    rest = {
        "optim": optimizer.state_dict(),
        "step": 0,
        "data_position": 0,
        "train_loss": torch.zeros(0, dtype=torch.float64, device="cpu"),
        "evals": "",
    }
    if incremental:  # the chain it builds on was verified with it
        state = IncrementalCheckpoints(os.path.dirname(os.path.abspath(path)), dmp).load(path, rest, verify=False)
    else:
        # The tables' rows are sized from the checkpoint, not gathered.
        state = load_checkpoint(path, {"model": state_template(dmp), **rest}, verify=False)
        dmp.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optim"])
    state["evals"] = json_entry(state["evals"], "evals", path)
    return state


def save_job_state(
    ckpt_dir: str,
    step: int,
    dmp: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    data_position: int,
    train_loss: list[float],
    evals: list[dict[str, Any]],
    config: dict[str, Any],
    keep: int,
    blocking: bool = True,
    incremental: IncrementalCheckpoints | None = None,
) -> str | PendingCheckpoint:
    """Saves the job at ``step`` (collective) and returns the checkpoint's path, or with
    ``blocking=False`` the PendingCheckpoint writing it in the background. ``incremental``: as
    the next link of its chain (blocking; the model's state is its to write)."""
    state = {
        "optim": optimizer.state_dict(),
        "step": step,
        "data_position": data_position,
        "train_loss": torch.tensor(train_loss, dtype=torch.float64, device="cpu"),
        "evals": json.dumps(evals),
        "config": json.dumps(config),
    }
    if incremental is not None:
        return incremental.save(step, state)
    return save_checkpoint(ckpt_dir, step, {"model": dmp.state_dict(), **state}, keep=keep, blocking=blocking)
