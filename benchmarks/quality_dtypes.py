"""Held-out AUC of the training job on the Criteo sample with FP32, FP16 and BF16 rows, stochastic
rounding on and off (issue 15's quality figure: half rows within 0.003 of FP32).

Each arm runs `python -m torchrec_ext.train` on ../shared/data/criteo_kaggle_sample/train.tsv for
`steps` steps of `batch` (going round the file), evaluating at the end on its last `holdout`
batches (held out from training), for `seeds` seeds;
the seed sets the model's initialisation and the tables' seeds, so for one seed the arms differ
only in how rows are stored and rounded. Reported: mean AUC over seeds, and the mean and largest
paired difference from FP32 (same seed).

    python benchmarks/quality_dtypes.py            # writes results/quality_dtypes_cpu.*
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import markdown_table, parse_config, save

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLE = os.path.join(ROOT, "..", "shared", "data", "criteo_kaggle_sample")
ARMS = (
    ("fp32", []),
    ("fp16", ["--data-type", "fp16"]),
    ("fp16, to nearest", ["--data-type", "fp16", "--round-to-nearest"]),
    ("bf16", ["--data-type", "bf16"]),
    ("bf16, to nearest", ["--data-type", "bf16", "--round-to-nearest"]),
)


@dataclasses.dataclass
class Config:
    steps: int = 138  # 3 passes over the 46 training batches
    batch: int = 128
    dim: int = 16
    capacity: int = 4096
    holdout: int = 10  # the last batches of train.tsv, held out
    seeds: int = 5


def final_auc(cfg: Config, flags: list[str], seed: int) -> float:
    """The job's held-out AUC at its last step."""
    with tempfile.TemporaryDirectory() as run_dir:
        args = [
            "--data",
            f"criteo-tsv:{os.path.join(SAMPLE, 'train.tsv')}",
            "--eval-batches",
            str(cfg.holdout),
            "--steps",
            str(cfg.steps),
            "--eval-every",
            "0",
            "--batch-size",
            str(cfg.batch),
            "--embedding-dim",
            str(cfg.dim),
            "--capacity",
            str(cfg.capacity),
            "--seed",
            str(seed),
            "--threads",
            "1",
            "--no-progress",
            "--device",
            "cpu",
            "--run-dir",
            run_dir,
        ]
        proc = subprocess.run(
            [sys.executable, "-m", "torchrec_ext.train", *args, *flags],
            cwd=ROOT,
            capture_output=True,
            text=True,
            env=dict(os.environ, OMP_NUM_THREADS="1"),
        )
        if proc.returncode != 0:
            sys.exit(f"quality_dtypes: the job failed ({flags}):\n{proc.stderr[-3000:]}")
        with open(os.path.join(run_dir, "summary.json")) as f:
            return float(json.load(f)["final_eval"]["auc"])


def main() -> None:
    cfg, save_results = parse_config(Config, __doc__)
    if not os.path.isfile(os.path.join(SAMPLE, "train.tsv")):
        sys.exit(f"quality_dtypes: the Criteo sample is not here ({SAMPLE})")
    aucs = {name: [final_auc(cfg, flags, seed) for seed in range(cfg.seeds)] for name, flags in ARMS}
    base = aucs["fp32"]
    rows = []
    for name, _ in ARMS:
        diffs = [a - b for a, b in zip(aucs[name], base)]
        rows.append(
            [
                name,
                f"{statistics.mean(aucs[name]):.4f}",
                f"{statistics.mean(diffs):+.4f}",
                f"{max(diffs, key=abs):+.4f}",
            ]
        )
    text = [
        f"# Row precision: held-out AUC of the job on the Criteo sample ({cfg.steps} steps of {cfg.batch}, "
        f"dim {cfg.dim}, capacity {cfg.capacity}, {cfg.holdout * cfg.batch} lines held out; {cfg.seeds} seeds)",
        "",
        markdown_table(["rows", "mean AUC", "mean paired diff vs fp32", "largest paired diff"], rows),
        "",
        f"`python benchmarks/quality_dtypes.py {' '.join(sys.argv[1:])}`".replace(" `", "`"),
    ]
    print("\n".join(text))
    if save_results:
        save("quality_dtypes_cpu", dict(config=dataclasses.asdict(cfg), aucs=aucs), "\n".join(text))


if __name__ == "__main__":
    main()
