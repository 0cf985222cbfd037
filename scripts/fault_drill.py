"""Fault drill for the training job's checkpoints (opt-in, a few minutes on 2 cores):

    .venv/bin/python scripts/fault_drill.py                 # writes benchmarks/results/fault_drill.md
    .venv/bin/python scripts/fault_drill.py --quick         # 1 rank only

A reference run (30 steps, a checkpoint every 10, keep 2) is trained uninterrupted. Then, for
each scenario, a fresh run directory is trained until a rank is SIGKILLed — at a given step, at a
given point inside a save (before DCP writes, before .metadata, before or after the manifest,
before pruning; with blocking saves and with saves written in the background while training
goes on), or at wall-clock delays into training — and, for the corruption scenarios, a
checkpoint is damaged after the kill. The job is then started again with --resume and must:
resume from the newest checkpoint that verifies (the drill knows which one that is), train to
step 30, and end exactly as the reference: the same per-step losses and evals, and the same
tensors and values in the final checkpoint, bit for bit; no temporary directory may be left.

The kills inside a save are placed by running the job under this script (``--child``), which
wraps the checkpoint module's steps to SIGKILL its own process at the chosen point; nothing in
the package knows about the drill.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS, EVERY = 30, 10
sys.path.insert(0, os.path.join(ROOT, "tests"))
from job_helpers import TINY_BATCHES, TINY_MODEL  # noqa: E402  (the job tests' tiny model)

JOB = (
    ["--steps", str(STEPS), "--checkpoint-every", str(EVERY), "--keep-checkpoints", "2", "--eval-every", "10"]
    + TINY_BATCHES
    + ["--capacity", "8192"]
    + TINY_MODEL
    + ["--device", "cpu"]
)
SAVE_PHASES = ("begin", "metadata", "hashing", "manifest", "rename", "prune")
# Kills by the clock, measured from a line of the job's output: early in training, while
# training after the first checkpoint, and as the second save starts (its eval line comes first).
TIMED = (("step 0: eval", 0.1), ("step 10: checkpoint", 0.05), ("step 20: eval", 0.0))


# ----------------------------------------------------------------------------- the job under a kill hook


def _die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def run_child(kill_at: str, kill_rank: int, job_args: list[str]) -> int:
    """Runs the job, SIGKILLing this process at ``kill_at`` when it is rank ``kill_rank``:
    ``train:N`` (once step N has run) or ``save:N:PHASE`` (inside the save of step N)."""
    import torch.distributed.checkpoint as dcp

    from torchrec_ext.distributed import checkpoint as ckpt
    from torchrec_ext.train import job, resume
    from torchrec_ext.train.progress import Progress

    if int(os.environ.get("RANK", "0")) != kill_rank:
        return job.main(job_args)
    kind, step, *phase = kill_at.split(":")
    step = int(step)
    if kind == "train":
        init, progress_step = Progress.__init__, Progress.step

        def init_hook(self, rt, args, start, log):
            init(self, rt, args, start, log)
            self.drill_start = start

        def step_hook(self, loss):
            progress_step(self, loss)
            if self.drill_start + self.steps_done + self._segment_steps >= step:
                _die()

        Progress.__init__, Progress.step = init_hook, step_hook
        return job.main(job_args)

    (phase,) = phase
    saving: list[int] = []

    def before(fn, name):  # kill on entry to fn during the save of ``step`` at PHASE ``name``
        def hook(*a, **k):
            if phase == name and saving == [step]:
                _die()
            return fn(*a, **k)

        return hook

    save = resume.save_checkpoint
    in_flight: list = []  # the background save last started (its phases run on a worker thread)

    def save_hook(ckpt_dir, at, *a, **k):
        while in_flight:  # one save at a time, so ``saving`` names the one whose phases run
            in_flight.pop().wait()
        saving[:] = [at]
        result = save(ckpt_dir, at, *a, **k)
        if isinstance(result, ckpt.PendingCheckpoint):
            in_flight.append(result)
        return result

    write_manifest = ckpt._write_manifest

    def manifest_hook(*a, **k):
        if phase == "manifest" and saving == [step]:
            _die()
        write_manifest(*a, **k)
        if phase == "rename" and saving == [step]:
            _die()

    resume.save_checkpoint = save_hook
    dcp.save = before(dcp.save, "begin")
    dcp.FileSystemWriter.finish = before(dcp.FileSystemWriter.finish, "metadata")
    ckpt._hash_files = before(ckpt._hash_files, "hashing")
    ckpt._write_manifest = manifest_hook
    ckpt.list_checkpoints = before(ckpt.list_checkpoints, "prune")
    return job.main(job_args)


# ----------------------------------------------------------------------------- the drill


def _launch(ranks: int, args: list[str], kill_at: str | None = None, kill_rank: int = 0) -> list[str]:
    target = (
        [__file__, "--child", kill_at, "--kill-rank", str(kill_rank), "--"] if kill_at else ["-m", "torchrec_ext.train"]
    )
    if ranks == 1:
        return [sys.executable] + target + args
    return (
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)] + target + args
    )


def _read_json(path: str) -> Any:
    with open(path) as f:
        return json.load(f)


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")


def _run(cmd: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)


def _kill_after(cmd: list[str], event: str, delay: float) -> str:
    """Starts the job, SIGKILLs it ``delay`` s after it prints a line starting with ``event``;
    returns its stdout."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    out = []
    for line in proc.stdout:
        out.append(line)
        if line.startswith(event):
            time.sleep(delay)
            proc.send_signal(signal.SIGKILL)
            break
    proc.wait()
    return "".join(out)


def _final_state(run_dir: str) -> dict[str, Any]:
    """Every entry of the run's final checkpoint (tensors whole, values as saved)."""
    import torch
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from torchrec_ext.distributed.checkpoint import load_checkpoint, read_metadata

    path = os.path.join(run_dir, "checkpoints", f"step_{STEPS}")
    stored = read_metadata(path).state_dict_metadata
    state = {
        fqn: torch.empty(0, dtype=md.properties.dtype) if isinstance(md, TensorStorageMetadata) else None
        for fqn, md in stored.items()
    }
    return load_checkpoint(path, state)


def _same_state(a: dict[str, Any], b: dict[str, Any]) -> bool:
    import torch

    if a.keys() != b.keys():
        return False
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, torch.Tensor):
            if not (isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)):
                return False
        elif x != y:
            return False
    return True


def _history(run_dir: str) -> dict[str, Any]:
    """Losses and evals (the tables' totals count lookups since the process started)."""
    with open(os.path.join(run_dir, "history.json")) as f:
        history = json.load(f)
    return {k: history[k] for k in ("train_loss", "evals")}


def _damage(path: str, how: str) -> None:
    if how == "flip":  # 8 bytes inside the first table's weight data
        import torch.distributed.checkpoint as dcp

        metadata = dcp.FileSystemReader(path).read_metadata()
        (info,) = [v for k, v in metadata.storage_data.items() if k.fqn.endswith("embedding_bags.t_cat_0.weight")]
        with open(os.path.join(path, info.relative_path), "r+b") as f:
            f.seek(info.offset + info.length // 2)
            data = f.read(8)
            f.seek(info.offset + info.length // 2)
            f.write(bytes(b ^ 0xFF for b in data))
    elif how == "truncate":
        file = os.path.join(path, ".metadata")
        os.truncate(file, os.path.getsize(file) // 2)
    else:
        raise ValueError(how)


def drill(ranks_list: list[int], out_md: str) -> bool:
    from torchrec_ext.distributed.checkpoint import ensure_process_group

    ensure_process_group()
    work = tempfile.mkdtemp(prefix="fault_drill_")
    rows, all_ok = [], True
    started = time.perf_counter()
    for ranks in ranks_list:
        ref = os.path.join(work, f"ref{ranks}")
        proc = _run(_launch(ranks, JOB + ["--run-dir", ref]))
        if proc.returncode:
            raise RuntimeError(f"reference run failed:\n{proc.stderr[-3000:]}")
        ref_history, ref_state = _history(ref), _final_state(ref)
        kill_rank = ranks - 1  # the last rank: on 2 ranks, not the one that writes .metadata and the manifest
        # (kind, at, damage, expected resume step or None when the timing decides, checkpoint mode):
        # "blocking" runs with --blocking-checkpoints, so a kill after a save finds it complete;
        # "background" kills inside a save written by the worker thread while training goes on.
        scenarios = [("train", "train:15", None, 10, "blocking"), ("train", "train:25", None, 20, "blocking")]
        phases = SAVE_PHASES if kill_rank == 0 else ("begin", "hashing")
        for mode in ("blocking", "background"):
            scenarios += [("save", f"save:20:{p}", None, 20 if p == "prune" else 10, mode) for p in phases]
        if ranks == 1:
            scenarios += [("timed", event, None, None, "blocking") for event in TIMED]
            scenarios += [("corrupt", "train:25", how, 10, "blocking") for how in ("flip", "truncate")]
        crashed: dict[tuple[str, str], str] = {}  # a crash's run directory as it was left, by (kill, mode)
        for kind, at, damage, expect, mode in scenarios:
            run_dir = os.path.join(work, f"r{ranks}_{len(rows)}")
            job = JOB + ["--run-dir", run_dir] + (["--blocking-checkpoints"] if mode == "blocking" else [])
            if kind == "timed":
                _kill_after(_launch(ranks, job), *at)
                where = f"{at[1]:.2f} s after the line '{at[0]}'"
            else:
                where = at.replace(":", " ", 1).replace(":", ", ") + (
                    " (background save)" if mode == "background" else ""
                )
                if (at, mode) in crashed:  # the same crash again: its directory, copied
                    shutil.copytree(crashed[at, mode], run_dir, symlinks=True)
                else:
                    crash = _run(_launch(ranks, job, at, kill_rank))
                    if crash.returncode == 0:
                        raise RuntimeError(f"{at}: the job was not killed")
                    crashed[at, mode] = run_dir + ".crashed"
                    shutil.copytree(run_dir, crashed[at, mode], symlinks=True)
            if damage:
                _damage(os.path.join(run_dir, "checkpoints", "step_20"), damage)
                where += (
                    f", then step_20 {'flipped bytes in t_cat_0.weight' if damage == 'flip' else 'truncated .metadata'}"
                )
            resume = _run(_launch(ranks, JOB + ["--run-dir", run_dir, "--resume"]))
            ok = resume.returncode == 0
            summary = _read_json(os.path.join(run_dir, "summary.json")) if ok else {}
            resumed = summary.get("resumed_from")
            from_step = int(resumed.rsplit("_", 1)[1]) if resumed else 0
            losses_equal = ok and _history(run_dir) == ref_history
            state_equal = ok and _same_state(_final_state(run_dir), ref_state)
            leftovers = (
                sorted(n for n in os.listdir(os.path.join(run_dir, "checkpoints")) if not n.startswith("step_"))
                if os.path.isdir(os.path.join(run_dir, "checkpoints"))
                else []
            )
            expected = expect is None or from_step == expect
            passed = ok and losses_equal and state_equal and expected and not leftovers
            all_ok &= passed
            skipped = summary.get("skipped_checkpoints", [])
            rows.append(
                {
                    "ranks": ranks,
                    "killed": f"rank {kill_rank}" if kind != "timed" else "the job",
                    "where": where,
                    "resumed_from": f"step {from_step}" if resumed else "step 0 (none)",
                    "skipped": "; ".join(s.split(": ", 1)[1] for s in skipped) or "-",
                    "losses": losses_equal,
                    "state": state_equal,
                    "leftovers": leftovers,
                    "passed": passed,
                    "error": "" if ok else resume.stderr[-500:],
                }
            )
            print(
                f"{ranks} rank(s), {where}: resumed from {rows[-1]['resumed_from']}, losses equal {losses_equal}, "
                f"final state equal {state_equal}, leftovers {leftovers or '-'} -> {'PASS' if passed else 'FAIL'}",
                flush=True,
            )
    elapsed = time.perf_counter() - started
    shutil.rmtree(work, ignore_errors=True)
    _write_md(out_md, rows, all_ok, elapsed, ranks_list)
    return all_ok


def _write_md(path: str, rows: list[dict[str, Any]], all_ok: bool, elapsed: float, ranks_list: list[int]) -> None:
    import torch

    command = "python scripts/fault_drill.py" + ("" if ranks_list == [1, 2] else " --quick")
    lines = [
        "# Fault drill: SIGKILL during training and saves, damaged checkpoints, resume",
        "",
        f"`{command}` ({time.strftime('%Y-%m-%d')}, {len(rows)} scenarios in {elapsed / 60:.1f} min on "
        f"{os.cpu_count()} cores, torch {torch.__version__}, CPU/gloo). Job: "
        f"`python -m torchrec_ext.train {' '.join(JOB)}` (plus `--resume` for the second part).",
        "",
        "Each scenario trains a fresh run directory until the named process is SIGKILLed (on 2 ranks torchrun "
        "then stops the other rank), damages a checkpoint where said, and resumes with `--resume` to step "
        f"{STEPS}. Pass: the job resumed from the newest checkpoint that verifies (the one expected), its "
        "per-step losses and evals equal the uninterrupted reference run's exactly, every tensor and value of "
        "its final checkpoint equals the reference's bit for bit, and no `.tmp_step_*` / `.old_step_*` is left.",
        "",
        f"**Result: {'all passed' if all_ok else 'FAILURES'}** ({sum(r['passed'] for r in rows)}/{len(rows)}).",
        "",
        "| ranks | killed | where | resumed from | skipped (why) | losses equal | final state equal | pass |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['ranks']} | {r['killed']} | {r['where']} | {r['resumed_from']} | {r['skipped']} | "
            f"{'yes' if r['losses'] else 'no'} | {'yes' if r['state'] else 'no'} | "
            f"{'PASS' if r['passed'] else 'FAIL ' + ' '.join(r['leftovers']) + r['error']} |"
        )
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="1 rank only")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "fault_drill.md"))
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--kill-rank", type=int, default=0, help=argparse.SUPPRESS)
    args, rest = p.parse_known_args()
    if args.child:
        return run_child(args.child, args.kill_rank, rest[1:] if rest[:1] == ["--"] else rest)
    ok = drill([1] if args.quick else [1, 2], args.out)
    print(f"{'all passed' if ok else 'FAILURES'}; {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
