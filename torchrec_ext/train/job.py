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
SHA-256 of every file), written in the background while training goes on (the state is copied at
the step; ``--blocking-checkpoints`` waits instead; the last one always blocks); ``--resume`` continues from the newest one that verifies, data stream
position included, and says which newer ones it skipped and why. ``--export-deltas-every N
--serve-dir D`` feeds a serving replica (``python -m torchrec_ext.serve D``): a base checkpoint at
the start, then every N steps each rank's row delta and the dense parameters (see serve_export). A checkpoint directory must come
from a trusted writer (see torchrec_ext.distributed.checkpoint). While the job runs it holds the
lock of ``<run-dir>/.lock``: a second job on the same run directory is refused. At the end
``<run-dir>`` holds ``summary.json``, ``history.json`` (loss per step, evals) and ``curves.png``.

The job in steps: ``build`` (data, model, sharding, optimizer), ``restore`` (``--resume``),
``train_steps`` (segments of training between evals and checkpoints), ``summarize`` and
``write_report``; ``train`` runs them holding the run directory's lock, ``main`` adds the
process group and the exit status.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import platform
import sys
import time
import traceback
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torchrec.metrics.metric_module import RecMetricModule

from torchrec_ext.distributed.checkpoint import PendingCheckpoint
from torchrec_ext.distributed.checkpoint_incremental import IncrementalCheckpoints
from torchrec_ext.distributed.table_metrics import TableStatsMetric
from torchrec_ext.distributed.table_stats import model_table_stats
from torchrec_ext.distributed.table_stats import summarize as summarize_table_stats
from torchrec_ext.train.args import build_parser, parse_args
from torchrec_ext.train.board import Board
from torchrec_ext.train.data import StreamConfig, TrainStream, eval_batches
from torchrec_ext.train.loop import global_mean, run_segment
from torchrec_ext.train.metrics import evaluate, oracle_auc
from torchrec_ext.train.model import ModelConfig, build_model, live_rows, make_optimizer, plan_summary, shard_model
from torchrec_ext.train.progress import Log, Progress
from torchrec_ext.train.report import plot_curves, write_json
from torchrec_ext.train.resume import load_job_state, newest_verified, resume_config, save_job_state
from torchrec_ext.train.run_lock import claim_run_dir
from torchrec_ext.train.runtime import Runtime, exit_now, init_runtime, shutdown
from torchrec_ext.train.serve_export import DeltaExporter
from torchrec_ext.train.tier_traffic import TierTraffic, cache_text, table_cache_text
from torchrec_ext.train.tier_traffic import total as total_tier_traffic


@dataclasses.dataclass
class Run:
    """One run of the job: what ``build`` made and what training adds to it."""

    args: argparse.Namespace
    rt: Runtime
    run_dir: str
    log: Log
    stream: TrainStream
    held_out: list
    ceiling: float | None  # held-out AUC of the synthetic data's hidden model (None for real data)
    dmp: torch.nn.Module
    optimizer: torch.optim.Optimizer
    config: dict[str, Any]  # the arguments a checkpoint records (resume.resume_config)
    start: int = 0  # the step this run starts from (a checkpoint's when resumed)
    position: int = 0  # global batches consumed (one per rank per step): where the data stream stands
    train_loss: list[float] = dataclasses.field(default_factory=list)
    evals: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    tables: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # table totals at each segment's end
    checkpoints: list[str] = dataclasses.field(default_factory=list)
    resumed_from: str | None = None
    skipped: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    pending_save: tuple[int, PendingCheckpoint, float] | None = None  # (step, its save, when it began)
    incremental: IncrementalCheckpoints | None = None  # --checkpoint-incremental's chain, from the first save
    model_config: ModelConfig | None = None
    exporter: DeltaExporter | None = None  # --export-deltas-every
    metrics: RecMetricModule | None = None  # TorchRec's metrics module, holding the tables' stats
    board: Board = dataclasses.field(default_factory=lambda: Board(None, 0))  # --tensorboard (rank 0)
    tier_traffic: TierTraffic = dataclasses.field(default_factory=TierTraffic)  # --backing host / file: per step

    @property
    def ckpt_dir(self) -> str:
        return os.path.join(self.run_dir, "checkpoints")

    def data_text(self) -> str:
        spec, eval_spec = self.args.data_spec, self.args.eval_spec
        return spec.describe() + ("" if eval_spec == spec else f", eval {eval_spec.describe()}")

    def ranks_text(self) -> str:
        return f"{self.rt.world_size} rank{'s' if self.rt.world_size > 1 else ''}"


# ----------------------------------------------------------------------------- the steps


def build(args: argparse.Namespace, rt: Runtime, run_dir: str) -> Run:
    """The data streams, the sharded model and its optimizer (collective)."""
    cfg = StreamConfig(
        batch_size=args.batch_size,
        eval_batch_size=args.eval_batch_size,
        eval_batches=args.eval_batches,
        seed=args.seed,
        eval_seed=args.eval_seed,
        truth_seed=args.truth_seed,
        rank=rt.rank,
        world_size=rt.world_size,
    )
    holdout = args.eval_batches if (args.data_spec.kind == "criteo-tsv" and args.eval_spec == args.data_spec) else 0
    stream = TrainStream(args.data_spec, cfg, args.steps, holdout=holdout)
    held_out, hidden_logits = eval_batches(args.eval_spec, cfg, stream)
    ceiling = oracle_auc(hidden_logits, held_out, rt.device) if hidden_logits else None

    model_config = ModelConfig(
        embedding_dim=args.embedding_dim,
        capacity=args.capacity,
        eviction_policy=args.eviction,
        dense_arch=tuple(args.dense_arch),
        over_arch=tuple(args.over_arch),
        dcn_layers=args.dcn_layers,
        dcn_rank=args.dcn_rank,
        embedding_lr=args.embedding_lr,
        seed=args.seed,
        table_options=args.table_options,
    )
    model = build_model(model_config)
    dmp = shard_model(model, rt.device, args.batch_size)
    return Run(
        model_config=model_config,
        args=args,
        rt=rt,
        run_dir=run_dir,
        log=Log(rt),
        stream=stream,
        held_out=held_out,
        ceiling=ceiling,
        dmp=dmp,
        optimizer=make_optimizer(dmp, args.lr),
        config=resume_config(args, rt.world_size),
        metrics=RecMetricModule(
            batch_size=args.batch_size, world_size=rt.world_size, state_metrics={"table_stats": TableStatsMetric(dmp)}
        ),
    )


def restore(run: Run) -> None:
    """``--resume``: model, optimizer, step, data position and history from the newest
    checkpoint that verifies (none: the run starts from step 0)."""
    path, run.skipped = newest_verified(run.ckpt_dir, run.log)
    if path is None:
        return
    state = load_job_state(path, run.dmp, run.optimizer, run.config, run.log)
    run.start = int(state["step"])
    if run.start > run.args.steps:
        raise ValueError(f"--resume: checkpoint {path} is at step {run.start}, past --steps {run.args.steps}")
    saved_position = int(state["data_position"])
    run.position = run.stream.aligned(saved_position)
    if run.position != saved_position:
        run.log(
            f"--resume: {run.position - saved_position} batch(es) skipped so that each of the "
            f"{run.rt.world_size} ranks starts on a batch of its own"
        )
    run.train_loss = state["train_loss"].tolist()
    run.evals = state["evals"]
    run.resumed_from = path
    run.log(
        f"resumed from {path} at step {run.start}"
        + (f" (the newest checkpoint that verifies; {len(run.skipped)} newer skipped)" if run.skipped else "")
    )


def announce(run: Run) -> None:
    args, rt = run.args, run.rt
    run.log(
        f"torchrec_ext.train: {run.ranks_text()} on {rt.device} ({rt.backend}), pipeline {args.pipeline}, "
        f"data {run.data_text()}, batch {args.batch_size}/rank, steps {run.start}->{args.steps}, "
        f"run dir {run.run_dir}"
    )
    run.log(f"sharding plan: {plan_summary(run.dmp)}")
    if run.ceiling is not None:
        run.log(f"held-out AUC of the data's hidden click model (the ceiling): {run.ceiling:.4f}")


def run_eval(run: Run, step: int) -> None:
    """Scores the held-out data (all ranks) and records the result at ``step``."""
    if not run.held_out:
        return
    result = evaluate(run.dmp, run.held_out, run.rt.device)
    result["step"] = step
    run.evals.append(result)
    run.board.eval(result)
    run.log(
        f"step {step}: eval AUC {result['auc']:.4f}, log loss {result['logloss']:.4f} ({result['samples']:,} samples)"
    )


def save(run: Run, step: int, blocking: bool) -> None:
    """Checkpoints the run at ``step`` (all ranks): in the background unless ``blocking`` (the
    state is copied now; ``finish_save`` logs it once written). Waits for the previous one first."""
    finish_save(run)
    began = time.perf_counter()
    if run.args.checkpoint_incremental and run.incremental is None:
        run.incremental = IncrementalCheckpoints(
            run.ckpt_dir, run.dmp, full_every=run.args.checkpoint_incremental, keep=run.args.keep_checkpoints
        )
    result = save_job_state(
        run.ckpt_dir,
        step,
        run.dmp,
        run.optimizer,
        data_position=run.position,
        train_loss=run.train_loss,
        evals=run.evals,
        config=run.config,
        keep=run.args.keep_checkpoints,
        blocking=blocking or run.incremental is not None,
        incremental=run.incremental,
    )
    if isinstance(result, str):
        _saved(run, step, result, began)
    else:
        run.pending_save = (step, result, began)
        run.log(
            f"step {step}: checkpoint {result.path} copied in {time.perf_counter() - began:.2f} s, "
            "writing in the background"
        )


def finish_save(run: Run) -> None:
    """Waits for the background checkpoint in flight, if any, and logs it (all ranks)."""
    if run.pending_save is not None:
        step, pending, began = run.pending_save
        run.pending_save = None
        _saved(run, step, pending.wait(), began)


def _saved(run: Run, step: int, path: str, began: float) -> None:
    run.checkpoints.append(path)
    size = sum(entry.stat().st_size for entry in os.scandir(path)) if run.rt.is_main else 0
    run.log(f"step {step}: checkpoint {path} ({size / 2**20:.1f} MiB in {time.perf_counter() - began:.2f} s)")


def train_steps(run: Run, progress: Progress) -> None:
    """Trains from ``run.start`` to ``--steps`` in segments that end at each eval and checkpoint
    step, evaluating and saving between them."""
    args, step = run.args, run.start
    while step < args.steps:
        end = args.steps
        for every in (args.eval_every, args.checkpoint_every, args.export_deltas_every):
            if every:
                end = min(end, (step // every + 1) * every)
        progress.start_segment()
        batches = run.stream.batches(run.position, end - step)
        losses = run_segment(args.pipeline, run.dmp, run.optimizer, batches, run.rt.device, progress, run.tier_traffic)
        progress.end_segment(run.rt.device)
        if len(losses) != end - step:
            raise RuntimeError(
                f"training segment of steps {step}..{end} ran {len(losses)} steps: the data stream ended early"
            )
        step_losses = global_mean(losses, run.rt.device)
        run.train_loss.extend(step_losses)
        run.board.losses(step + 1, step_losses)
        run.position += (end - step) * run.rt.world_size
        step = end
        _log_tables(run, step)
        if args.export_deltas_every and step % args.export_deltas_every == 0:
            export_deltas(run, step)
        if args.eval_every and step % args.eval_every == 0 and step < args.steps:
            run_eval(run, step)
        if args.checkpoint_every and step % args.checkpoint_every == 0 and step < args.steps:
            save(run, step, blocking=args.blocking_checkpoints)


def start_exports(run: Run) -> None:
    """``--export-deltas-every``: the serve directory's base at the start step (collective)."""
    began = time.perf_counter()
    run.exporter = DeltaExporter(run.args.serve_dir, run.dmp, run.model_config, run.rt.rank, run.rt.world_size)
    base = run.exporter.start(run.start)
    run.log(
        f"step {run.start}: serving base {base} (generation {run.exporter.generation}) in "
        f"{time.perf_counter() - began:.2f} s; deltas every {run.args.export_deltas_every} steps"
    )


def export_deltas(run: Run, step: int) -> None:
    """The next export of deltas and dense parameters into the serve directory (collective)."""
    if run.exporter is None or run.exporter.last_step == step:
        return
    began = time.perf_counter()
    rows = run.exporter.export(step)
    run.log(
        f"step {step}: serving export {run.exporter.seq} ({rows:,} rows on rank {run.rt.rank}) in "
        f"{time.perf_counter() - began:.2f} s"
    )


def _log_tables(run: Run, step: int) -> None:
    """One line of the tables' totals over ranks, one of each tiered table's cache traffic in the
    segment's steps, and TorchRec's metrics module's values to ``--tensorboard`` (collective: every
    rank ends its segment here)."""
    values = run.metrics.compute()
    run.board.scalars(values, step)
    totals = summarize_table_stats(run.metrics.state_metrics["table_stats"].last)
    tiered = run.args.backing != "device"  # (the same on every rank)
    steps, cache_tables = run.tier_traffic.window() if tiered else (0, {})  # collective
    if totals is not None:
        window = {"cache_steps": steps, "cache_tables": cache_tables} if cache_tables else {}
        run.tables.append({"step": step, **totals, **window})
        hit = "n/a" if totals["hit_rate"] is None else f"{totals['hit_rate']:.1%}"
        run.log(
            f"step {step}: tables {totals['occupancy']:.1%} full, {totals['inserts']:,} inserts, "
            f"{totals['evictions']:,} evictions, {totals['rejections']:,} admission rejections, "
            f"{totals['refused']:,} refused, {totals['fallback_reads']:,} fallback reads, lookup hit rate {hit}"
            + (f"; cache {cache_text(totals['cache'])}" if totals.get("cache") else "")
        )
    if cache_tables:
        texts = [table_cache_text(name, stats) for name, stats in cache_tables.items()]
        run.log(f"step {step}: cache per table over the last {steps} steps: " + "; ".join(texts))


def summarize(run: Run, progress: Progress, wall_start: float) -> dict[str, Any]:
    """The run's ``summary.json`` (collective: it counts the live rows of every rank)."""
    args, rt, train_loss, evals = run.args, run.rt, run.train_loss, run.evals
    rate = progress.steps_done / progress.train_time if progress.train_time > 0 and progress.steps_done else None
    window = max(1, min(50, len(train_loss) // 5)) if train_loss else 1
    initial = next((e for e in evals if e["step"] == 0), None)
    stats = model_table_stats(run.dmp)  # collective
    tier_steps = run.tier_traffic.reduced()  # collective
    return {
        "status": "completed",
        "steps": args.steps,
        "start_step": run.start,
        "steps_this_run": progress.steps_done,
        "world_size": rt.world_size,
        "device": str(rt.device),
        "backend": rt.backend,
        "pipeline": args.pipeline,
        "batch_size_per_rank": args.batch_size,
        "global_batch_size": args.batch_size * rt.world_size,
        "train_time_s": progress.train_time,
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
        "oracle_auc": run.ceiling,
        "evals": evals,
        "live_rows": live_rows(run.dmp),
        "table_stats": {name: s.as_dict() for name, s in sorted(stats.items())},
        "table_totals": summarize_table_stats(stats),
        # --backing host / file: each table's cache traffic summed over this run's training steps
        "tier_steps": tier_steps,
        "tier_steps_total": total_tier_traffic(tier_steps),
        "sharding_plan": plan_summary(run.dmp),
        "checkpoints": run.checkpoints,
        "resumed_from": run.resumed_from,
        "skipped_checkpoints": [reason for _, reason in run.skipped],
        "run_dir": run.run_dir,
        "args": {k: v for k, v in vars(args).items() if k not in ("data_spec", "eval_spec")},
        "versions": _versions(),
    }


def write_report(run: Run, summary: dict[str, Any]) -> None:
    """Rank 0 writes ``history.json``, ``curves.png`` and ``summary.json`` and says it is done."""
    if not run.rt.is_main:
        return
    write_json(
        os.path.join(run.run_dir, "history.json"),
        {"train_loss": run.train_loss, "evals": run.evals, "tables": run.tables},
        indent=None,
    )
    plot_curves(
        os.path.join(run.run_dir, "curves.png"),
        run.train_loss,
        run.evals,
        f"DLRM_DCN on dynamic tables: {run.data_text()}, {run.ranks_text()}, {run.args.pipeline} pipeline",
        run.ceiling,
        run.tables,
    )
    write_json(os.path.join(run.run_dir, "summary.json"), summary)
    final, rate = summary["final_eval"], summary["steps_per_s"]
    speed = f" ({rate:.1f} steps/s, {summary['samples_per_s']:,.0f} samples/s)" if rate else ""
    run.log(
        f"done: {summary['steps_this_run']} steps in {summary['train_time_s']:.1f} s of training{speed}"
        + (f", eval AUC {final['auc']:.4f}, log loss {final['logloss']:.4f}" if final else "")
        + f"; {os.path.join(run.run_dir, 'summary.json')}"
    )
    if summary["tier_steps"]:
        run.log(f"cache over the training steps: {cache_text(summary['tier_steps_total'])}; per table:")
        for name, stats in summary["tier_steps"].items():
            run.log(f"  {name}: {cache_text(stats)}, {stats['staged']:,} staged ahead")


# ----------------------------------------------------------------------------- the job


def train(args: argparse.Namespace, rt: Runtime) -> dict[str, Any]:
    """The job, holding the run directory's lock; returns the summary (every rank)."""
    wall_start = time.perf_counter()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    run_dir, lock = claim_run_dir(args.run_dir, rt)
    try:
        return _train_in(run_dir, args, rt, wall_start)
    finally:
        if lock is not None:
            lock.release()


def _train_in(run_dir: str, args: argparse.Namespace, rt: Runtime, wall_start: float) -> dict[str, Any]:
    run = build(args, rt, run_dir)
    if args.resume:
        restore(run)
    announce(run)
    if args.tensorboard and rt.is_main:
        run.board = Board(args.tensorboard, run.start)
    if args.export_deltas_every:
        start_exports(run)
    if run.start == 0 and not any(e["step"] == 0 for e in run.evals):
        run_eval(run, 0)
    progress = Progress(rt, args, run.start, run.log)
    try:
        train_steps(run, progress)
    finally:
        progress.close()
        run.log.bar = None
    if args.export_deltas_every:
        export_deltas(run, args.steps)  # the final state, when the last export was before it
    if not run.evals or run.evals[-1]["step"] != args.steps:
        run_eval(run, args.steps)
    if args.checkpoint_every and run.start < args.steps:
        save(run, args.steps, blocking=True)
    finish_save(run)
    summary = summarize(run, progress, wall_start)
    write_report(run, summary)
    run.board.close()
    dist.barrier()
    return summary


def _versions() -> dict[str, str]:
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


def main(argv: list[str] | None = None) -> int:
    """The job with its process group: 0 when it completes, 2 on bad input found after start-up."""
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


def command_line() -> None:
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
