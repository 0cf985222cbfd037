"""A file-backed tiered table larger than this machine's free RAM trains (issue 16): one module of
``num_tables`` tables whose backing files (vectors + Adagrad state) together exceed
``MemAvailable``, trained a few dlrm-small steps with the pipeline's prefetch (``stage_next``).
Reports the sizes (backing files, free RAM before, fast memory), the time to make the files (they
are written whole once: tier_store.py), each step's time and the process's resident memory.
A short run, not a timing: the steps' times depend on the disk (rows not in the page cache are
read from it, write-backs are throttled to its write rate).

    python benchmarks/bench_tier_big_file.py --backing-dir /path/on/local/disk   # saves results/tier_big_file.{md,jsonl}
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import DlrmSmall, parse_config, print_and_save, process_memory, small_tables

from torchrec_ext import DynamicEmbeddingBagCollection, DynamicEmbeddingBagConfig
from torchrec_ext.data import dlrm_small_batch

GIB = 2**30


@dataclasses.dataclass
class Config(DlrmSmall):
    num_tables: int = 4
    capacity: int = 12 << 20  # rows per table: 4 x 12 Mi rows x (256 B vector + 256 B Adagrad state) = 24 GiB
    cache_load_factor: float = 0.003  # 38k slots a table: rows leave the cache (written back) from step 5 on
    steps: int = 30
    backing_dir: str = ""  # default: a fresh directory under the system's temp dir
    threads: int = 0


def _meminfo() -> dict[str, int]:
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            out[key] = int(value.split()[0]) * 1024
    return out


def run(cfg: Config) -> dict[str, object]:
    directory = cfg.backing_dir or tempfile.mkdtemp(prefix="bench_tier_big_file_")
    os.makedirs(directory, exist_ok=True)
    try:
        return _run(cfg, directory)
    finally:
        for name in os.listdir(directory):
            if name.endswith(".rows"):
                os.unlink(os.path.join(directory, name))
        if not cfg.backing_dir:
            shutil.rmtree(directory, ignore_errors=True)


def _run(cfg: Config, directory: str) -> dict[str, object]:
    available = _meminfo()["MemAvailable"]
    disk = shutil.disk_usage(directory)
    tables = small_tables(cfg, DynamicEmbeddingBagConfig, cfg.capacity)
    for table in tables:
        table.backing, table.cache_load_factor = f"file:{directory}", cfg.cache_load_factor
    start = time.perf_counter()
    module = DynamicEmbeddingBagCollection(tables, optimizer=torch.optim.Adagrad, optimizer_kwargs={"lr": 0.01})
    made_s = time.perf_counter() - start
    files = sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory) if f.endswith(".rows"))
    make = lambda i: dlrm_small_batch(
        i, cfg.num_tables, cfg.batch_size, cfg.max_bag, 0, alpha=cfg.alpha, id_bits=cfg.id_bits
    )
    batches = [make(i) for i in range(cfg.steps + 1)]
    step_ms = []
    for i in range(cfg.steps):
        start = time.perf_counter()
        module.stage_next(batches[i + 1])
        module(batches[i]).values().sum().backward()
        step_ms.append(1e3 * (time.perf_counter() - start))
    module._tables.wait_for_stage()
    start = time.perf_counter()
    state = module.state_dict()  # every row of both tiers (dirty rows written back first)
    checkpoint_s = time.perf_counter() - start
    weights = sum(v.numel() for k, v in state.items() if k.endswith(".weight"))
    stats = module.table_stats().values()
    return {
        "backing_file_bytes": files,
        "mem_available_before": available,
        "mem_total": _meminfo()["MemTotal"],
        "disk_free_before": disk.free,
        "files_made_s": made_s,
        "step_ms": step_ms,
        "fast_memory_bytes": module.storage_bytes(),
        "live_rows": module.num_live_rows(),
        "state_dict_s": checkpoint_s,
        "state_dict_weight_elements": weights,
        "cache_slots": sum(s.cache_slots for s in stats),
        "capacity_rows": cfg.capacity * cfg.num_tables,
        "process_memory": process_memory(),
        "finite": bool(all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point())),
    }


def report(cfg: Config, r: dict[str, object]) -> str:
    gib = lambda b: f"{b / GIB:.1f} GiB"
    mem = r["process_memory"]
    steps = ", ".join(f"{ms:.0f}" for ms in r["step_ms"])
    return "\n".join(
        [
            f"A file-backed table larger than free RAM, trained (cpu, {torch.get_num_threads()} threads): {cfg.num_tables} "
            f"tables x dim {cfg.dim} x {cfg.capacity:,} rows, fused Adagrad, cache_load_factor {cfg.cache_load_factor}, "
            f"dlrm-small batches ({cfg.batch_size} bags per table), the next batch staged each step",
            "",
            f"- backing files {gib(r['backing_file_bytes'])} (vectors + Adagrad state, {r['capacity_rows']:,} rows) vs "
            f"MemAvailable {gib(r['mem_available_before'])} before the run (MemTotal {gib(r['mem_total'])}): larger "
            f"than free RAM: {r['backing_file_bytes'] > r['mem_available_before']}; disk free "
            f"before {gib(r['disk_free_before'])}; files made (reserved, written with zeros, synced) in {r['files_made_s']:.1f} s",
            f"- {len(r['step_ms'])} steps trained, ms each: {steps}; {r['live_rows']:,} live rows; cache "
            f"{r['cache_slots']:,} slots; state_dict (all rows of both tiers) in {r['state_dict_s']:.1f} s, all values finite: "
            f"{r['finite']}",
            f"- fast memory (cache + index) {gib(r['fast_memory_bytes'])}; process memory at the end: VmRSS "
            f"{gib(mem.get('VmRSS', 0))} = anonymous {gib(mem.get('RssAnon', 0))} + file pages {gib(mem.get('RssFile', 0))}",
        ]
    )


def main() -> None:
    cfg, save_results = parse_config(Config, __doc__)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    result = run(cfg)
    text = report(cfg, result)
    print_and_save("tier_big_file", cfg, result, text, save_results)


if __name__ == "__main__":
    main()
