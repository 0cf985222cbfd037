"""When a staged lookup hands its tables over: the file-backed dlrm-small step with the lookup
upserting every table in one call, then each table's rows held (the stage gets its first table
only once every upsert is done), against table by table, each handed over at once (the default on
the CPU with a stage waiting: ``TieredTables._batched_upsert``). One process, one file-backed
module (+prefetch) and one all-resident module on the same batches; chunks of steps alternate
the setting (its order too), each followed by the resident module's chunk: the ratios of medians.

    PYTHONPATH=$PWD python benchmarks/bench_tier_handover.py [--warmup-steps 450] [--repeats 16]

450 warm-up steps: the tables full (each new id evicts an old one; ``bench_tiers.py``'s docstring).
Results: benchmarks/results/tiers_cpu.md (session 18).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_tiers

from torchrec_ext.modules.tiered_tables import TieredTables

SETTINGS = ("one call", "per table")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--capacity", type=int, default=bench_tiers.Config.capacity
    )  # rows a table (smaller: a smoke run)
    parser.add_argument("--batch-size", type=int, default=bench_tiers.Config.batch_size)
    parser.add_argument("--warmup-steps", type=int, default=450)
    parser.add_argument("--repeats", type=int, default=16)
    parser.add_argument("--steps-per-repeat", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    cfg = bench_tiers.Config(capacity=args.capacity, batch_size=args.batch_size)
    n = args.steps_per_repeat
    total = args.warmup_steps + args.repeats * len(SETTINGS) * n + 1
    batches = bench_tiers.make_batches(cfg, total)
    directory = tempfile.mkdtemp(prefix="bench_tier_handover_")
    try:
        resident, tiered = bench_tiers._build(cfg, "device"), bench_tiers._build(cfg, f"file:{directory}")
        for i in range(args.warmup_steps):
            bench_tiers._step(resident, batches[i])
            bench_tiers._step(tiered, batches[i], batches[i + 1])
        tiered._tables.wait_for_stage()
        times: dict[str, list[float]] = {name: [] for name in ("resident", *SETTINGS)}
        at = args.warmup_steps
        for r in range(args.repeats):
            for setting in SETTINGS if r % 2 == 0 else reversed(SETTINGS):
                TieredTables.batched_upsert = setting == "one call"
                chunk = batches[at : at + n]
                start = time.perf_counter()
                for j, kjt in enumerate(chunk):
                    bench_tiers._step(tiered, kjt, batches[at + j + 1])
                tiered._tables.wait_for_stage()
                times[setting].append((time.perf_counter() - start) / n)
                start = time.perf_counter()
                for kjt in chunk:
                    bench_tiers._step(resident, kjt)
                times["resident"].append((time.perf_counter() - start) / n)
                at += n
        del TieredTables.batched_upsert
        ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
        print(
            f"dlrm-small, file+prefetch, cache_load_factor {cfg.cache_load_factor}, {args.warmup_steps} warm-up "
            f"steps, median of {args.repeats} chunks x {n} steps each: resident {ms['resident']:.1f} ms; "
            + "; ".join(f"{s}: {ms[s]:.1f} ms, {ms[s] / ms['resident']:.2f}x resident" for s in SETTINGS)
        )
    finally:
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
