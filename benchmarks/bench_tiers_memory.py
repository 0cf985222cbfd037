"""Resident memory of each system of bench_tiers.py, each in a process of its own (issue 16:
"resident memory <= cache + working set"; bench_tiers.py reads one VmRSS for all its systems
together).

Each system (resident, file, host, file+prefetch, host+prefetch: as in bench_tiers.py, same flags,
same batches) runs in a fresh child process: it makes every batch, reads its memory (the base:
interpreter, torch, batches), builds its tables, makes every row live (``fill``: a pass over
every row id, so the table holds 1 / cache_load_factor = 5x the cache's rows), trains
``warmup_steps`` (the cache full and evicting), reads its memory again (after warm-up), resets the kernel's peak (``/proc/self/clear_refs``)
and trains the timed steps (``repeats`` x ``steps_per_repeat``), then reads its peak (VmHWM) and its
memory at the end, split into anonymous and file pages (a file-backed table's mapped pages are
file pages: the rows read by pread map none, ``--pread 0`` reads them through the mapping, and
each copy through a mapping unmaps its pages after it, ``--release-pages 0`` keeps them: the A/Bs). Reported above the base, next to the module's fast memory (``storage_bytes``: the
cache's rows and index; all rows for resident) and the working set: what the all-resident step
needs beyond its rows (its peak above the base, less its fast memory; run ``resident`` too).
Host backing keeps every row in host memory: its resident memory holds the whole table by design.

    python benchmarks/bench_tiers_memory.py --threads 1    # saves results/tiers_memory_cpu.{md,jsonl}
    python benchmarks/bench_tiers_memory.py --threads 1 --systems resident,file+prefetch --no-save
    python benchmarks/bench_tiers_memory.py --capacity 65536 --batch-size 512 --warmup-steps 5 --repeats 3 --no-save  # smoke
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_tiers import SYSTEMS, Config, _build, _step, set_file_options
from common import every_row_batches, markdown_table, parse_config, print_and_save, process_memory

from torchrec_ext.data import dlrm_small_batch


@dataclasses.dataclass
class MemoryConfig(Config):
    # 1: before the warm-up, one pass over every row id of every table (every_row_batches): all
    # rows live, so a tiered table holds 1 / cache_load_factor (5) times its cache's rows
    fill: int = 1


CHILD = "BENCH_TIERS_MEMORY_CHILD"  # set in a child: it measures the one system it is given


def _reset_peak() -> bool:
    """VmHWM back to the current VmRSS (Linux >= 4.0); False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def measure_one(cfg: MemoryConfig, name: str) -> dict[str, object]:
    """One system's memory, in this process (the child's job)."""
    n = cfg.steps_per_repeat
    total = cfg.warmup_steps + cfg.repeats * n
    batches = [
        dlrm_small_batch(i, cfg.num_tables, cfg.batch_size, cfg.max_bag, cfg.seed, alpha=cfg.alpha, id_bits=cfg.id_bits)
        for i in range(total)
    ]
    directory = cfg.backing_dir or tempfile.mkdtemp(prefix="bench_tiers_memory_")
    try:
        backing = "device" if name == "resident" else "host" if name.startswith("host") else f"file:{directory}"
        prefetch = name.endswith("+prefetch")
        set_file_options(cfg)
        gc.collect()
        base = process_memory()
        module = _build(cfg, backing)
        built = process_memory()
        if cfg.fill:  # every row live: the table holds 1 / cache_load_factor times the cache's rows
            for kjt in every_row_batches(cfg.num_tables, cfg.capacity, cfg.batch_size):
                _step(module, kjt)
        for i in range(total):
            if i == cfg.warmup_steps:
                if prefetch:
                    module._tables.wait_for_stage()
                gc.collect()
                warm = process_memory()
                peak_reset = _reset_peak()
            ahead = batches[i + 1] if prefetch and i + 1 < total else None
            _step(module, batches[i], ahead)
        if prefetch:
            module._tables.wait_for_stage()
        end = process_memory()
        return {
            "system": name,
            "base": base,
            "built": built,
            "after_warmup": warm,
            "end": end,
            "peak_reset": peak_reset,
            "fast_memory_bytes": module.storage_bytes(),
            "live_rows": module.num_live_rows(),
            "cache_slots": sum(s.cache_slots for s in module.table_stats().values()),
        }
    finally:
        if not cfg.backing_dir:
            shutil.rmtree(directory, ignore_errors=True)


def _child_argv(name: str) -> list[str]:
    """This command line with ``--systems name`` (the last --systems wins) and nothing saved."""
    return [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--systems", name, "--no-save"]


def run(cfg: MemoryConfig) -> dict[str, dict]:
    """Every system of ``cfg.systems`` measured in a child process of its own, in turn."""
    results = {}
    for name in cfg.systems:
        proc = subprocess.run(_child_argv(name), env=dict(os.environ, **{CHILD: "1"}), capture_output=True, text=True)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            raise RuntimeError(f"system {name}: child exited {proc.returncode}\n{proc.stderr[-3000:]}")
        results[name] = json.loads(lines[-1][len("RESULT ") :])
    return results


def report(cfg: MemoryConfig, results: dict[str, dict]) -> str:
    mib = lambda b: f"{b / 2**20:,.0f}"
    resident = results.get("resident")
    working = None
    if resident is not None:  # what a step needs beyond its rows
        working = max(0, resident["end"]["VmHWM"] - resident["base"]["VmRSS"] - resident["fast_memory_bytes"])
    rows = []
    for name, r in results.items():
        base = r["base"]["VmRSS"]
        peak = r["end"]["VmHWM"] - base
        bound = r["fast_memory_bytes"] + (working or 0)
        rows.append(
            [
                name,
                mib(base),
                mib(r["after_warmup"]["VmRSS"] - base),
                mib(peak),
                mib(r["end"]["RssAnon"] - r["base"]["RssAnon"]),
                mib(r["end"]["RssFile"] - r["base"]["RssFile"]),
                mib(r["fast_memory_bytes"]),
                f"{r['live_rows'] / r['cache_slots']:.2f}" if r.get("cache_slots") else "",
                mib(working) if working is not None else "",
                f"{peak / bound:.2f}" if working is not None and bound else "",
            ]
        )
    title = (
        f"Resident memory of each system in a process of its own, dlrm-small on cpu: {cfg.num_tables} tables x dim "
        f"{cfg.dim}, capacity {cfg.capacity:,} rows each, batch {cfg.batch_size} per table, cache_load_factor "
        f"{cfg.cache_load_factor}, rows read by pread {'on' if cfg.pread else 'off'}, pages released after each "
        f"mapped copy {'on' if cfg.release_pages else 'off'}; "
        f"{'a pass over every row id (all rows live), then ' if cfg.fill else ''}"
        f"{cfg.warmup_steps} warm-up steps, then {cfg.repeats * cfg.steps_per_repeat} "
        "steps whose peak is read (MiB; all but the base are above the base: interpreter, torch, the batches)"
    )
    headers = [
        "system",
        "base",
        "after warm-up",
        "peak, timed steps",
        "anonymous at end",
        "file pages at end",
        "fast memory (cache)",
        "live rows / cache rows",
        "working set",
        "peak / (cache + working set)",
    ]
    notes = [
        "- working set: the all-resident step's peak above its base less its rows (fast memory)"
        if working is not None
        else "- working set: not measured (run the resident system too)",
        "- host backing keeps every row in host memory (its backing store), so its resident memory holds the "
        "whole table by design",
    ]
    if not all(r["peak_reset"] for r in results.values()):
        notes.append("- the kernel refused to reset the peak: peaks include the warm-up")
    return "\n".join([title, "", markdown_table(headers, rows), "", *notes])


def main() -> None:
    cfg, save_results = parse_config(MemoryConfig, __doc__, systems=SYSTEMS)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if os.environ.get(CHILD):
        print("RESULT " + json.dumps(measure_one(cfg, cfg.systems[-1])), flush=True)
        return
    results = run(cfg)
    text = report(cfg, results)
    print_and_save("tiers_memory_cpu", cfg, results, text, save_results)


if __name__ == "__main__":
    main()
