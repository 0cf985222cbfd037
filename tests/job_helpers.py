"""The training job (python -m torchrec_ext.train) in a subprocess, at the tiny size the job
tests and the fault drill share: ~0.1 s of training per 10 steps on one core."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]

# The model (tables sized apart: --capacity), small batches and evals, and all three. Later
# occurrences of a flag win, so a test may append overrides.
TINY_MODEL = [
    "--embedding-dim",
    "8",
    "--dense-arch",
    "32",
    "--over-arch",
    "32",
    "--dcn-rank",
    "8",
    "--threads",
    "1",
    "--no-progress",
]
TINY_BATCHES = ["--batch-size", "128", "--eval-batch-size", "512", "--eval-batches", "2"]
TINY = ["--capacity", "2048"] + TINY_MODEL + TINY_BATCHES


def run_job(args, timeout=120, launcher=None):
    """The job with ``args``, on CPU unless they name a --device (the default, auto, would pick a
    GPU where there is one); ``launcher`` replaces the interpreter (e.g. TORCHRUN)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    device = [] if "--device" in args else ["--device", "cpu"]
    cmd = (launcher or [sys.executable]) + ["-m", "torchrec_ext.train"] + args + device
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def job_ok(proc):
    """``proc`` exited 0 (else its output tails, to read why)."""
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-6000:]}"
    )
    return proc
