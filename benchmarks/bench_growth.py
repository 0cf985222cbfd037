"""Growing tables (issue 15 item 3): train dlrm-small from empty tables whose storage starts at
``initial_capacity`` = capacity / ``initial_divisor`` (64) rows and doubles up to the capacity,
against the same run with the tables preallocated; goal: total time <= 1.15x, memory following
the live rows.

Workload: ``common.DlrmSmall`` (8 tables, dim 64, 4096 bags per table, bag lengths 1..7, raw ids
Zipf(1.05) over 2^40, ``torchrec_ext.data.dlrm_small_batch``); fused Adagrad; one step = forward +
backward of sum(output) + the fused update. Each run is a fresh process (so that its resident
memory is its own): it builds the module (timed: the preallocated module writes all of its
storage here) and trains from empty tables. The first growing run trains until every table is
at its capacity and holds ``fill`` of it in live rows, and fixes the number of steps; every other
run trains that many steps. ``repeats`` runs of each system, alternating; reported: the median
total time of each, their ratio, per-step times, and, at each growth of the last growing run
(and at its end), live rows, capacity, ``storage_bytes()`` and the process's resident memory
(VmRSS), beside the preallocated run's at the same step.

On this VM (virtio-balloon free page reporting) memory a process frees goes back to the host
within seconds, and a first touch of memory the host took back costs several times more (huge
pages ~2 s/GiB against ~0.1 s/GiB for memory freed just before, benchmarks/results/growth_cpu.md):
a run started right after another touches the previous run's memory cheaply during its first
seconds, which is where the preallocated run writes all of its storage and the growing run only
its first capacities. ``settle_s`` waits before each run so that both start from memory the host
took back.

    python benchmarks/bench_growth.py --threads 1                     # saves results/growth_cpu.{md,jsonl}
    python benchmarks/bench_growth.py --threads 1 --settle-s 30       # each run from memory the host took back
    python benchmarks/bench_growth.py --capacity 16384 --batch-size 256 --repeats 1 --no-save   # smoke
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import DlrmSmall, markdown_table, parse_config, print_and_save, small_tables


@dataclasses.dataclass
class Config(DlrmSmall):
    capacity: int = 1 << 20  # rows per table (num_embeddings)
    initial_divisor: int = 64  # initial_capacity = capacity / this
    growth_load_factor: float = 0.75
    fill: float = 0.95  # the first growing run trains until every table holds this fraction of its capacity
    max_steps: int = 2000
    lr: float = 0.01
    repeats: int = 3
    seed: int = 0
    threads: int = 0  # torch threads (0: torch's default); 1 steadies the timing on a loaded machine
    # Seconds to wait before each timed run, so that it starts from memory the host has taken back
    # (see below); 0: right after the previous run, as the readings before session 12.
    settle_s: float = 0.0
    populate_ahead: int = 0  # 1: (growing) each growth faults in the next doubling's pages in the background


def _vm_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def child(cfg: Config, system: str, steps: int) -> dict[str, object]:
    """One run in this process: build, train ``steps`` steps (0: until full), report."""
    from torchrec_ext import DynamicEmbeddingBagCollection, DynamicEmbeddingBagConfig
    from torchrec_ext.data import dlrm_small_batch

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    make = lambda i: dlrm_small_batch(
        i, cfg.num_tables, cfg.batch_size, cfg.max_bag, cfg.seed, alpha=cfg.alpha, id_bits=cfg.id_bits
    )
    prefetched = [make(i) for i in range(steps)] if steps else []
    rss_start = _vm_rss()
    start = time.perf_counter()
    tables = small_tables(cfg, DynamicEmbeddingBagConfig, cfg.capacity)
    for table in tables:
        table.growth_load_factor = cfg.growth_load_factor
        if system == "growing":
            table.initial_capacity = max(1, cfg.capacity // cfg.initial_divisor)
    module = DynamicEmbeddingBagCollection(tables, optimizer=torch.optim.Adagrad, optimizer_kwargs={"lr": cfg.lr})
    module._tables.populate_ahead = bool(cfg.populate_ahead)
    built = time.perf_counter() - start
    samples, step_s, step, capacities = [], [], 0, None
    while True:
        if steps and step >= steps:
            break
        kjt = prefetched[step] if steps else make(step)
        t0 = time.perf_counter()
        module(kjt).values().sum().backward()
        step_s.append(time.perf_counter() - t0)
        step += 1
        stats = module.table_stats().values()
        now = [s.capacity for s in stats]
        live = sum(s.live_rows for s in stats)
        if now != capacities or (steps and step == steps) or step % 10 == 0:
            samples.append(
                {
                    "step": step,
                    "live_rows": live,
                    "capacity_rows": sum(now),
                    "storage_bytes": module.storage_bytes(),
                    "vm_rss": _vm_rss() - rss_start,
                }
            )
            capacities = now
        if not steps and (all(s.live_rows >= cfg.fill * cfg.capacity for s in stats) or step >= cfg.max_steps):
            break
    total = time.perf_counter() - start
    return {
        "system": system,
        "steps": step,
        "total_s": total,
        "build_s": built,
        "step_ms": [s * 1e3 for s in step_s],
        "samples": samples,
        "max_storage_bytes": module.storage_bytes(maximum=True),
        "evictions": sum(s.evictions for s in module.table_stats().values()),
    }


def _spawn(cfg: Config, system: str, steps: int) -> dict[str, object]:
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--child",
        system,
        "--child-steps",
        str(steps),
        "--child-config",
        json.dumps(dataclasses.asdict(cfg)),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode:
        raise RuntimeError(f"bench_growth child {system} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(cfg: Config) -> dict[str, object]:
    uptime_before = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    first = _spawn(cfg, "growing", 0)
    steps = first["steps"]
    runs: dict[str, list[dict[str, object]]] = {"growing": [], "preallocated": []}
    for r in range(cfg.repeats):
        order = ("preallocated", "growing") if r % 2 == 0 else ("growing", "preallocated")
        for system in order:
            time.sleep(cfg.settle_s)
            runs[system].append(_spawn(cfg, system, steps))
    uptime_after = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    total = {k: statistics.median(x["total_s"] for x in v) for k, v in runs.items()}
    return {
        "steps": steps,
        "total_s": total,
        "ratio": total["growing"] / total["preallocated"],
        "total_s_each": {k: [x["total_s"] for x in v] for k, v in runs.items()},
        "build_s": {k: statistics.median(x["build_s"] for x in v) for k, v in runs.items()},
        "step_ms_median": {k: statistics.median(statistics.median(x["step_ms"]) for x in v) for k, v in runs.items()},
        "samples": {k: v[-1]["samples"] for k, v in runs.items()},
        "max_storage_bytes": runs["growing"][-1]["max_storage_bytes"],
        "evictions": {k: v[-1]["evictions"] for k, v in runs.items()},
        "first_growing_run": {k: first[k] for k in ("steps", "total_s", "evictions")},
        "uptime_before": uptime_before,
        "uptime_after": uptime_after,
    }


def report(cfg: Config, r: dict[str, object]) -> str:
    mib = lambda b: f"{b / 2**20:,.1f}"
    title = (
        f"Growing vs preallocated dynamic tables, dlrm-small from empty tables on cpu: {cfg.num_tables} tables x dim "
        f"{cfg.dim}, capacity {cfg.capacity:,} rows each (growing: initial_capacity {cfg.capacity // cfg.initial_divisor:,}"
        f", growth_load_factor {cfg.growth_load_factor}), batch {cfg.batch_size} per table, bags 1..{cfg.max_bag}, ids "
        f"Zipf({cfg.alpha}) over 2^{cfg.id_bits}, fused Adagrad; {r['steps']} steps (until every table held "
        f"{cfg.fill:.0%} of its capacity), each run a fresh process, build included; median of {cfg.repeats} runs "
        f"each, alternating; {cfg.settle_s:g} s before each run"
    )
    rows = [
        [
            k,
            f"{r['total_s'][k]:.2f}",
            f"{r['total_s'][k] / r['total_s']['preallocated']:.3f}",
            f"{r['build_s'][k]:.2f}",
            f"{r['step_ms_median'][k]:.1f}",
            str(r["evictions"][k]),
        ]
        for k in r["total_s"]
    ]
    lines = [
        title,
        "",
        markdown_table(
            ["system", "total s", "× preallocated", "build s", "median step ms", "evictions (last run)"], rows
        ),
        "",
    ]
    pre = {s["step"]: s for s in r["samples"]["preallocated"]}
    mem_rows = []
    for s in r["samples"]["growing"]:
        p = pre.get(s["step"])
        mem_rows.append(
            [
                s["step"],
                f"{s['live_rows']:,}",
                f"{s['capacity_rows']:,}",
                mib(s["storage_bytes"]),
                mib(s["vm_rss"]),
                mib(p["storage_bytes"]) if p else "",
                mib(p["vm_rss"]) if p else "",
            ]
        )
    lines += [
        "Memory vs live rows (growing run; VmRSS growth since the process started, its batches already built):",
        "",
        markdown_table(
            [
                "step",
                "live rows",
                "capacity rows",
                "storage MiB",
                "VmRSS MiB",
                "preallocated storage MiB",
                "preallocated VmRSS MiB",
            ],
            mem_rows,
        ),
        "",
        f"- maximum storage (storage_bytes(maximum=True)): {mib(r['max_storage_bytes'])} MiB; goal: total time "
        f"<= 1.15x preallocated: {r['ratio']:.3f}x",
        f"- machine load: before `{r['uptime_before']}`; after `{r['uptime_after']}`",
    ]
    return "\n".join(lines)


def main() -> None:
    if "--child" in sys.argv:
        argv = sys.argv
        system = argv[argv.index("--child") + 1]
        steps = int(argv[argv.index("--child-steps") + 1])
        cfg = Config(**json.loads(argv[argv.index("--child-config") + 1]))
        print(json.dumps(child(cfg, system, steps)))
        return
    cfg, save_results = parse_config(Config, __doc__)
    result = run(cfg)
    text = report(cfg, result)
    print_and_save("growth_cpu", cfg, result, text, save_results)


if __name__ == "__main__":
    main()
