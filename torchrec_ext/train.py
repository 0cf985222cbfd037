"""The main training job: TorchRec's ``DLRM_DCN`` on ``torchrec_ext.DynamicEmbeddingBagCollection``
(26 dynamic tables, one per sparse feature, keyed by raw 64-bit ids), wrapped in
``DistributedModelParallel``, trained with fused Adagrad on the tables and dense Adagrad.

    python -m torchrec_ext.train                                # one process, synthetic Criteo
    torchrun --nproc_per_node=2 -m torchrec_ext.train           # 2 ranks (gloo on CPU, nccl on CUDA)
    python -m torchrec_ext.train --data criteo-tsv:day_0.tsv --eval-data criteo-tsv:day_1.tsv
    python -m torchrec_ext.train --run-dir runs/a --checkpoint-every 100      # later: ... --resume

Each rank reads its own shard of the data. The loop is ``--pipeline ours`` (torchrec_ext's
TrainPipeline, the default), ``torchrec`` (TorchRec's TrainPipelineSparseDist) or ``plain``
(forward, backward, step). Rank 0 shows a progress bar (steps/s, global samples/s, loss).
Every ``--eval-every`` steps all ranks score their share of the held-out data and AUC / log loss
are computed over all of it. ``--checkpoint-every`` saves model, optimizer and step with
torch.distributed.checkpoint into ``<run-dir>/checkpoints/step_<k>`` with a manifest (size and
SHA-256 of every file); ``--resume`` continues from the newest one that verifies, data stream
position included, and says which newer ones it skipped and why. A checkpoint directory must come
from a trusted writer (see torchrec_ext.distributed.checkpoint). While the job runs it holds the
lock of ``<run-dir>/.lock``: a second job on the same run directory is refused. At the end
``<run-dir>`` holds ``summary.json``, ``history.json`` (loss per step, evals) and ``curves.png``.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
import sys
import time
import traceback
import warnings
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from torchrec_ext.distributed.checkpoint import find_checkpoint, load_checkpoint, save_checkpoint
from torchrec_ext.train_utils.data import StreamConfig, TrainStream, eval_batches, parse_data_spec
from torchrec_ext.train_utils.metrics import evaluate, oracle_auc
from torchrec_ext.train_utils.model import ModelConfig, build_model, make_optimizer, shard_model
from torchrec_ext.train_utils.report import plot_curves, write_json
from torchrec_ext.train_utils.run_lock import RunDirLock, RunDirLockError
from torchrec_ext.train_utils.runtime import Runtime, exit_now, init_runtime, shutdown

PIPELINES = ("ours", "torchrec", "plain")
# Arguments a resumed run must share with the checkpoint (they shape the model or its tables).
_MODEL_ARGS = ("embedding_dim", "capacity", "eviction", "dense_arch", "over_arch", "dcn_layers", "dcn_rank")
# Arguments that decide what the data stream yields at a given step: a change is allowed but warned about.
_STREAM_ARGS = ("data", "batch_size", "seed", "truth_seed")


# ----------------------------------------------------------------------------- arguments

def _sizes(text: str) -> List[int]:
    try:
        sizes = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer sizes, got {text!r}") from None
    if any(s < 1 for s in sizes):
        raise argparse.ArgumentTypeError(f"layer sizes must be >= 1, got {text!r}")
    return sizes


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m torchrec_ext.train", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("data")
    g.add_argument("--data", default="synthetic", help="'synthetic' or 'criteo-tsv:PATH[,PATH...]'")
    g.add_argument("--eval-data", default=None,
                   help="held-out data, same forms as --data (default: synthetic: a held-out stream of the same "
                        "hidden model; criteo-tsv: the last --eval-batches batches of each rank's share of --data)")
    g.add_argument("--batch-size", type=int, default=512, help="samples per step per rank")
    g.add_argument("--eval-batch-size", type=int, default=2048,
                   help="samples per eval batch per rank (criteo-tsv held out of --data: --batch-size)")
    g.add_argument("--eval-batches", type=int, default=8, help="eval batches per rank (0: no eval)")
    g.add_argument("--truth-seed", type=int, default=0, help="synthetic: the hidden click model")
    g.add_argument("--eval-seed", type=int, default=999_999, help="synthetic: the held-out stream")
    g = p.add_argument_group("model")
    g.add_argument("--embedding-dim", type=int, default=16)
    g.add_argument("--capacity", type=int, default=100_000, help="rows per dynamic table")
    g.add_argument("--eviction", default="lru", choices=("lru", "lfu", "epoch_lru", "epoch_lfu", "none"))
    g.add_argument("--dense-arch", type=_sizes, default=[64], help="dense arch hidden sizes (then embedding-dim)")
    g.add_argument("--over-arch", type=_sizes, default=[128, 64], help="over arch hidden sizes (then 1)")
    g.add_argument("--dcn-layers", type=int, default=2)
    g.add_argument("--dcn-rank", type=int, default=16, help="DCN low-rank dimension")
    g = p.add_argument_group("training")
    g.add_argument("--steps", type=int, default=2000, help="total training steps (a resumed run continues to it)")
    g.add_argument("--lr", type=float, default=0.02, help="dense Adagrad learning rate")
    g.add_argument("--embedding-lr", type=float, default=None, help="fused Adagrad learning rate (default: --lr)")
    g.add_argument("--seed", type=int, default=0, help="model initialisation and the synthetic train stream")
    g.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda or cuda:N")
    g.add_argument("--pipeline", default="ours", choices=PIPELINES,
                   help="ours: torchrec_ext.pipeline.TrainPipeline; torchrec: TrainPipelineSparseDist; "
                        "plain: forward, backward, step")
    g.add_argument("--threads", type=int, default=None, help="torch intra-op threads per rank (default: torch's)")
    g.add_argument("--collective-timeout", type=float, default=300.0,
                   help="seconds a rank waits in a collective for its peers before the job fails")
    g = p.add_argument_group("evaluation, checkpoints, output")
    g.add_argument("--eval-every", type=int, default=250, help="eval every N steps (0: only at start and end)")
    g.add_argument("--run-dir", default=None, help="output directory (default: runs/<timestamp>)")
    g.add_argument("--checkpoint-every", type=int, default=0, help="checkpoint every N steps and at the end (0: never)")
    g.add_argument("--keep-checkpoints", type=int, default=2, help="newest checkpoints kept (0: all)")
    g.add_argument("--resume", action="store_true",
                   help="continue from the newest checkpoint in --run-dir (from step 0 when there is none)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument("--verbose", action="store_true", help="keep TorchRec's and torch's advisory warnings")
    return p


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name, low in (("steps", 0), ("batch_size", 1), ("eval_batch_size", 1), ("eval_batches", 0),
                      ("embedding_dim", 1), ("capacity", 1), ("dcn_layers", 0), ("dcn_rank", 1),
                      ("eval_every", 0), ("checkpoint_every", 0), ("keep_checkpoints", 0)):
        if getattr(args, name) < low:
            parser.error(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(args, name)}")
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    if not (math.isfinite(args.collective_timeout) and args.collective_timeout > 0):
        parser.error(f"--collective-timeout must be a finite number > 0, got {args.collective_timeout}")
    for name in ("lr", "embedding_lr"):
        value = getattr(args, name)
        if value is not None and not (math.isfinite(value) and value >= 0):
            parser.error(f"--{name.replace('_', '-')} must be a finite number >= 0, got {value}")
    if args.embedding_lr is None:
        args.embedding_lr = args.lr
    try:
        args.data_spec = parse_data_spec(args.data, "--data")
        args.eval_spec = parse_data_spec(args.eval_data, "--eval-data") if args.eval_data else None
    except ValueError as e:
        parser.error(str(e))
    if args.data_spec.kind == "synthetic":
        if args.eval_spec is None:
            args.eval_spec = args.data_spec
        if args.eval_spec == args.data_spec and args.eval_seed == args.seed:
            parser.error(f"--eval-seed must differ from --seed (the held-out stream would be the train stream), "
                         f"both are {args.seed}")
    elif args.eval_spec is None:
        args.eval_spec = args.data_spec  # held out: the last --eval-batches batches of each rank
    if args.resume and args.run_dir is None:
        parser.error("--resume needs --run-dir (the directory of the run to continue)")
    return args


# ----------------------------------------------------------------------------- helpers

class _Log:
    """Prints on rank 0, around the progress bar."""

    def __init__(self, rt: Runtime):
        self.rt, self.bar = rt, None

    def __call__(self, message: str) -> None:
        if not self.rt.is_main:
            return
        if self.bar is not None:
            self.bar.write(message, file=sys.stdout)
        else:
            print(message, flush=True)


def _resolve_run_dir(args: argparse.Namespace, rt: Runtime) -> Tuple[str, Optional[RunDirLock]]:
    """The run directory, created, and its lock (held by rank 0; None on other ranks). Every
    rank raises RunDirLockError when another job holds it or it cannot be taken."""
    run_dir = args.run_dir
    if run_dir is None:
        holder: List[Any] = [None]
        if rt.is_main:
            base = os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))
            run_dir, n = base, 1
            while os.path.exists(run_dir):
                n += 1
                run_dir = f"{base}-{n}"
            holder[0] = run_dir
        dist.broadcast_object_list(holder, src=0)
        run_dir = holder[0]
    lock, busy = None, [None]
    if rt.is_main:
        os.makedirs(run_dir, exist_ok=True)
        try:
            lock = RunDirLock(run_dir)
        except RunDirLockError as e:  # rank 0 alone: every rank ends with its message
            busy[0] = str(e)
    dist.broadcast_object_list(busy, src=0)
    if busy[0]:
        raise RunDirLockError(busy[0])
    return run_dir, lock


def _resume_config(args: argparse.Namespace, rt: Runtime) -> Dict[str, Any]:
    config = {name: getattr(args, name) for name in _MODEL_ARGS}
    config.update(data=args.data_spec.describe(), batch_size=args.batch_size, seed=args.seed,
                  truth_seed=args.truth_seed, world_size=rt.world_size)
    return config


def _check_resume_config(saved: Dict[str, Any], now: Dict[str, Any], path: str, log: _Log) -> None:
    differ = [k for k in _MODEL_ARGS if k in saved and saved[k] != now[k]]
    if differ:
        raise ValueError(f"--resume: checkpoint {path} was written by a model with "
                         + ", ".join(f"--{k.replace('_', '-')} {saved[k]}" for k in differ)
                         + "; this run has " + ", ".join(f"{now[k]}" for k in differ))
    changed = [k for k in _STREAM_ARGS if k in saved and saved[k] != now[k]]
    if changed:
        log("warning: resuming with " + ", ".join(f"{k} {saved[k]} -> {now[k]}" for k in changed)
            + ": the data stream does not continue exactly where the checkpoint left it")


def _json_entry(value: Any, name: str, path: str) -> Any:
    """A checkpoint entry the job stored as JSON text, decoded (clear error when it is not)."""
    try:
        if not isinstance(value, str):
            raise TypeError(type(value).__name__)
        return json.loads(value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"--resume: checkpoint {path}: entry {name!r} is not the JSON text the job writes "
                         f"({e})") from None


def _plan_summary(dmp: torch.nn.Module) -> str:
    """'26 tables: 20 table_wise, 6 row_wise' (or 'not sharded')."""
    counts: Dict[str, int] = {}
    for module_plan in dmp.plan.plan.values():
        for sharding in module_plan.values():
            counts[sharding.sharding_type] = counts.get(sharding.sharding_type, 0) + 1
    if not counts:
        return "not sharded"
    return f"{sum(counts.values())} tables: " + ", ".join(f"{n} {kind}" for kind, n in sorted(counts.items()))


def _live_rows(dmp: torch.nn.Module) -> int:
    """Rows held by the dynamic tables, summed over ranks (outermost modules that count them)."""
    total, counted = 0, []
    for name, module in dmp.module.named_modules():
        if any(name.startswith(c + ".") for c in counted):
            continue
        # A sharded module holds this rank's tables in a plain module: its local_module.
        counter = module if hasattr(module, "num_live_rows") else getattr(module, "local_module", None)
        if callable(getattr(counter, "num_live_rows", None)):
            counted.append(name)
            total += int(counter.num_live_rows())
    t = torch.tensor([total], dtype=torch.int64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t)
    return int(t.item())


class _Progress:
    """The progress bar (rank 0): steps/s and global samples/s of training time, latest loss."""

    def __init__(self, rt: Runtime, args: argparse.Namespace, start: int, log: _Log):
        from tqdm import tqdm

        self.samples_per_step = args.batch_size * rt.world_size
        self.bar = tqdm(total=args.steps, initial=start, unit="step", dynamic_ncols=True, mininterval=1.0,
                        disable=args.no_progress or not rt.is_main, file=sys.stderr, desc="train")
        log.bar = None if self.bar.disable else self.bar
        self.train_time, self.steps_done = 0.0, 0
        self._segment_start, self._segment_steps = 0.0, 0
        self._last_post = 0.0
        self._latest = None

    def start_segment(self) -> None:
        self._segment_start, self._segment_steps = time.perf_counter(), 0

    def step(self, loss: Optional[torch.Tensor]) -> None:
        self._segment_steps += 1
        if loss is not None:
            self._latest = loss
        now = time.perf_counter()
        if not self.bar.disable and now - self._last_post >= 0.5:
            self._post(self.train_time + (now - self._segment_start), self.steps_done + self._segment_steps)
            self._last_post = now
        self.bar.update(1)

    def _post(self, elapsed: float, steps: int) -> None:
        rate = steps / elapsed if elapsed > 0 else 0.0
        loss_text = f", loss {float(self._latest):.4f}" if self._latest is not None else ""  # a sync: twice a second
        self.bar.set_postfix_str(f"{rate:.1f} steps/s, {rate * self.samples_per_step:,.0f} samples/s{loss_text}",
                                 refresh=False)

    def end_segment(self, device: torch.device) -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        self.train_time += time.perf_counter() - self._segment_start
        self.steps_done += self._segment_steps
        if not self.bar.disable:
            self._post(self.train_time, self.steps_done)
            self.bar.refresh()

    def close(self) -> None:
        self.bar.close()


def _run_segment(kind: str, dmp: torch.nn.Module, optimizer: torch.optim.Optimizer, batches: Iterator,
                 device: torch.device, progress: _Progress) -> List[torch.Tensor]:
    """Trains on every batch of ``batches``; returns each step's (local) loss, in order. The
    pipelines are built per segment and closed at its end, so evals and checkpoints see a model
    with no batch in flight."""
    losses: List[torch.Tensor] = []
    if kind == "plain":
        for batch in batches:
            batch = batch.to(device, non_blocking=True)
            optimizer.zero_grad()
            loss, _ = dmp(batch)
            loss.backward()
            optimizer.step()
            losses.append(loss.detach())
            progress.step(loss.detach())
        return losses
    if kind == "torchrec":
        from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

        pipeline = TrainPipelineSparseDist(dmp, optimizer, device, execute_all_batches=True)
        try:
            while True:
                try:
                    loss, _, _ = pipeline.progress(batches)
                except StopIteration:
                    break
                losses.append(loss.detach())
                progress.step(loss.detach())
        finally:
            pipeline.detach()  # the model's original forwards back, for eval and the next segment
        return losses

    from torchrec_ext.pipeline import TrainPipeline

    host: Dict[int, torch.Tensor] = {}
    with TrainPipeline(dmp, optimizer, device) as pipeline:
        while True:
            try:
                pipeline.progress(batches)
            except StopIteration:
                break
            latest = None
            for step, (loss, _, _) in pipeline.pop_host_outputs():  # copied to host without a sync
                host[step] = loss
                latest = loss
            progress.step(latest)
        for step, (loss, _, _) in pipeline.drain_host_outputs():
            host[step] = loss
    return [host[i] for i in range(len(host))]


def _global_mean(losses: List[torch.Tensor], device: torch.device) -> List[float]:
    """Per step, the mean over ranks of the ranks' losses."""
    if not losses:
        return []
    t = torch.stack([l.to(device) for l in losses]).double()
    dist.all_reduce(t)
    return (t / dist.get_world_size()).tolist()


# ----------------------------------------------------------------------------- the job

def train(args: argparse.Namespace, rt: Runtime) -> Dict[str, Any]:
    wall_start = time.perf_counter()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    run_dir, lock = _resolve_run_dir(args, rt)
    try:
        return _train(args, rt, run_dir, wall_start)
    finally:
        if lock is not None:
            lock.release()


def _train(args: argparse.Namespace, rt: Runtime, run_dir: str, wall_start: float) -> Dict[str, Any]:
    """The job in ``run_dir`` (whose lock this job holds)."""
    log = _Log(rt)
    ckpt_dir = os.path.join(run_dir, "checkpoints")

    cfg = StreamConfig(batch_size=args.batch_size, eval_batch_size=args.eval_batch_size,
                       eval_batches=args.eval_batches, seed=args.seed, eval_seed=args.eval_seed,
                       truth_seed=args.truth_seed, rank=rt.rank, world_size=rt.world_size)
    holdout = args.eval_batches if (args.data_spec.kind == "criteo-tsv" and args.eval_spec == args.data_spec) else 0
    stream = TrainStream(args.data_spec, cfg, args.steps, holdout=holdout)
    held_out, hidden_logits = eval_batches(args.eval_spec, cfg, stream)
    ceiling = oracle_auc(hidden_logits, held_out, rt.device) if hidden_logits else None

    model = build_model(ModelConfig(
        embedding_dim=args.embedding_dim, capacity=args.capacity, eviction_policy=args.eviction,
        dense_arch=tuple(args.dense_arch), over_arch=tuple(args.over_arch), dcn_layers=args.dcn_layers,
        dcn_rank=args.dcn_rank, embedding_lr=args.embedding_lr, seed=args.seed))
    dmp = shard_model(model, rt.device, args.batch_size)
    optimizer = make_optimizer(dmp, args.lr)
    plan_text = _plan_summary(dmp)

    train_loss: List[float] = []
    evals: List[Dict[str, Any]] = []
    checkpoints: List[str] = []
    start = 0
    position = 0  # global batches consumed (one per rank per step): where the data stream stands
    resume_config = _resume_config(args, rt)
    resumed_from: Optional[str] = None
    skipped: List[Tuple[str, str]] = []
    if args.resume:
        found, skipped = find_checkpoint(ckpt_dir)  # the newest that verifies against its manifest
        for _, reason in skipped:
            log(f"--resume: skipping {reason}")
        if found is None and skipped:
            raise ValueError(f"--resume: no checkpoint in {ckpt_dir} verifies (the newest: {skipped[0][1]}); "
                             "move the damaged ones away to start from step 0")
        if found is None:
            log(f"--resume: no checkpoint in {ckpt_dir}; starting from step 0")
        else:
            # Verified just now: read without hashing again. Config first, before the model is read.
            saved = load_checkpoint(found[1], {"config": ""}, verify=False)["config"]
            _check_resume_config(_json_entry(saved, "config", found[1]), resume_config, found[1], log)
            state = load_checkpoint(found[1], {
                "model": dmp.state_dict(), "optim": optimizer.state_dict(), "step": 0, "data_position": 0,
                "train_loss": torch.zeros(0, dtype=torch.float64), "evals": ""}, verify=False)
            dmp.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optim"])
            start = int(state["step"])
            if start > args.steps:
                raise ValueError(f"--resume: checkpoint {found[1]} is at step {start}, past --steps {args.steps}")
            position = stream.aligned(int(state["data_position"]))
            if position != state["data_position"]:
                log(f"--resume: {position - state['data_position']} batch(es) skipped so that each of the "
                    f"{rt.world_size} ranks starts on a batch of its own")
            train_loss = state["train_loss"].tolist()
            evals = _json_entry(state["evals"], "evals", found[1])
            resumed_from = found[1]
            log(f"resumed from {found[1]} at step {start}"
                + (f" (the newest checkpoint that verifies; {len(skipped)} newer skipped)" if skipped else ""))

    data_text = args.data_spec.describe() + ("" if args.eval_spec == args.data_spec else
                                             f", eval {args.eval_spec.describe()}")
    ranks = f"{rt.world_size} rank{'s' if rt.world_size > 1 else ''}"
    log(f"torchrec_ext.train: {ranks} on {rt.device} ({rt.backend}), pipeline {args.pipeline}, data {data_text}, "
        f"batch {args.batch_size}/rank, steps {start}->{args.steps}, run dir {run_dir}")
    log(f"sharding plan: {plan_text}")
    if ceiling is not None:
        log(f"held-out AUC of the data's hidden click model (the ceiling): {ceiling:.4f}")

    def run_eval(step: int) -> None:
        if not held_out:
            return
        result = evaluate(dmp, held_out, rt.device)
        result["step"] = step
        evals.append(result)
        log(f"step {step}: eval AUC {result['auc']:.4f}, log loss {result['logloss']:.4f} "
            f"({result['samples']:,} samples)")

    def save(step: int) -> None:
        state = {"model": dmp.state_dict(), "optim": optimizer.state_dict(), "step": step, "data_position": position,
                 "train_loss": torch.tensor(train_loss, dtype=torch.float64), "evals": json.dumps(evals),
                 "config": json.dumps(resume_config)}
        began = time.perf_counter()
        path = save_checkpoint(ckpt_dir, step, state, keep=args.keep_checkpoints)
        checkpoints.append(path)
        size = sum(entry.stat().st_size for entry in os.scandir(path)) if rt.is_main else 0
        log(f"step {step}: checkpoint {path} ({size / 2**20:.1f} MiB in {time.perf_counter() - began:.2f} s)")

    if start == 0 and not any(e["step"] == 0 for e in evals):
        run_eval(0)
    progress = _Progress(rt, args, start, log)
    step = start
    try:
        while step < args.steps:
            end = args.steps
            for every in (args.eval_every, args.checkpoint_every):
                if every:
                    end = min(end, (step // every + 1) * every)
            progress.start_segment()
            batches = stream.batches(position, end - step)
            losses = _run_segment(args.pipeline, dmp, optimizer, batches, rt.device, progress)
            progress.end_segment(rt.device)
            if len(losses) != end - step:
                raise RuntimeError(f"training segment of steps {step}..{end} ran {len(losses)} steps: the data "
                                   "stream ended early")
            train_loss.extend(_global_mean(losses, rt.device))
            position += (end - step) * rt.world_size
            step = end
            if args.eval_every and step % args.eval_every == 0 and step < args.steps:
                run_eval(step)
            if args.checkpoint_every and step % args.checkpoint_every == 0 and step < args.steps:
                save(step)
    finally:
        progress.close()
        log.bar = None
    if not evals or evals[-1]["step"] != args.steps:
        run_eval(args.steps)
    if args.checkpoint_every and start < args.steps:
        save(args.steps)

    steps_run = progress.steps_done
    train_time = progress.train_time
    rate = steps_run / train_time if train_time > 0 and steps_run else None
    window = max(1, min(50, len(train_loss) // 5)) if train_loss else 1
    initial = next((e for e in evals if e["step"] == 0), None)
    summary: Dict[str, Any] = {
        "status": "completed",
        "steps": args.steps,
        "start_step": start,
        "steps_this_run": steps_run,
        "world_size": rt.world_size,
        "device": str(rt.device),
        "backend": rt.backend,
        "pipeline": args.pipeline,
        "batch_size_per_rank": args.batch_size,
        "global_batch_size": args.batch_size * rt.world_size,
        "train_time_s": train_time,
        "wall_time_s": time.perf_counter() - wall_start,
        "steps_per_s": rate,
        "samples_per_s": rate * args.batch_size * rt.world_size if rate else None,
        "train_loss": {
            "first": sum(train_loss[:window]) / window if train_loss else None,
            "last": sum(train_loss[-window:]) / window if train_loss else None,
            "window": window,
            "final_step": train_loss[-1] if train_loss else None,
        },
        "initial_eval": initial,
        "final_eval": evals[-1] if evals else None,
        "auc_gain": (evals[-1]["auc"] - initial["auc"]) if (initial and evals) else None,
        "oracle_auc": ceiling,
        "evals": evals,
        "live_rows": _live_rows(dmp),
        "sharding_plan": plan_text,
        "checkpoints": checkpoints,
        "resumed_from": resumed_from,
        "skipped_checkpoints": [reason for _, reason in skipped],
        "run_dir": run_dir,
        "args": {k: v for k, v in vars(args).items() if k not in ("data_spec", "eval_spec")},
        "versions": _versions(),
    }
    if rt.is_main:
        write_json(os.path.join(run_dir, "history.json"), {"train_loss": train_loss, "evals": evals}, indent=None)
        plot_curves(os.path.join(run_dir, "curves.png"), train_loss, evals,
                    f"DLRM_DCN on dynamic tables: {data_text}, {ranks}, {args.pipeline} pipeline", ceiling)
        write_json(os.path.join(run_dir, "summary.json"), summary)
        final = summary["final_eval"]
        speed = f" ({rate:.1f} steps/s, {summary['samples_per_s']:,.0f} samples/s)" if rate else ""
        log(f"done: {steps_run} steps in {train_time:.1f} s of training{speed}"
            + (f", eval AUC {final['auc']:.4f}, log loss {final['logloss']:.4f}" if final else "")
            + f"; {os.path.join(run_dir, 'summary.json')}")
    dist.barrier()
    return summary


def _versions() -> Dict[str, str]:
    import torchrec

    return {"python": platform.python_version(), "torch": torch.__version__, "torchrec": torchrec.__version__}


def _quiet_third_party() -> None:
    """Silences advisory warnings of TorchRec / torch that say nothing about this run (planner
    advice on Topology construction and storage reservation, deprecations, FX notes)."""
    for name in ("torchrec.distributed.planner", "torch.fx._symbolic_trace"):
        logging.getLogger(name).setLevel(logging.ERROR)
    for module in ("torchrec", "torch.distributed", "fbgemm_gpu"):
        warnings.filterwarnings("ignore", category=FutureWarning, module=module)
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=module)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    if not args.verbose:
        _quiet_third_party()
    try:
        rt = init_runtime(args.device, collective_timeout_s=args.collective_timeout)
    except ValueError as e:
        build_parser().error(str(e))
    failed = True
    try:
        train(args, rt)
        failed = False
    except ValueError as e:  # bad input found after start-up (e.g. too little data, a malformed data line)
        if args.verbose:
            raise
        print(f"torchrec_ext.train: error: {e} (--verbose shows where)", file=sys.stderr, flush=True)
        return 2
    finally:
        # A failed rank (its own error, or a peer's seen as a failed collective) aborts its process
        # groups rather than wait for peers that may never come: every rank then ends within seconds.
        shutdown(failed=failed)
    return 0


def _command_line() -> None:
    """``python -m torchrec_ext.train``: main(), and a failed run ends the process at once (its
    process groups already aborted by main; see runtime.exit_now)."""
    try:
        code = main()
    except SystemExit:
        raise  # argument errors, found before any process group
    except BaseException:  # noqa: BLE001 - reported, then the process ends
        traceback.print_exc()
        exit_now(1)
    if code:
        exit_now(code)
    sys.exit(code)


if __name__ == "__main__":
    _command_line()
