"""Train-step time of a tiered table (issue 16: host or file backing, a cache of hot rows) against
the same table all-resident, in one process, on the "dlrm-small" workload of bench_lookup.py.

Workload: 8 tables, dim 64, 4096 bags per table, bag lengths uniform in 1..7 (~131k ids per step),
raw ids Zipf(1.05) over 2^40 (``torchrec_ext.data.dlrm_small_batch``); fused Adagrad; one step =
forward + backward of sum(output) + the fused update. Systems, built side by side:

- resident: DynamicEmbeddingBagCollection, capacity rows per table (backing="device").
- file:     the same with backing="file:<dir>" (files on local disk: the rows memory-mapped,
            write-backs appended to a log per table, tier_log.py) and
            cache_load_factor (0.2: the table holds 5x the cache's rows); no prefetch: every
            miss is filled, every dirty victim written back, inside the step.
- host:     the same with backing="host" (the backing store a host tensor): what the tier's
            bookkeeping and copies cost without the file's page-cache writes.
- file+prefetch, host+prefetch: the same, with the pipeline's prefetch: before each step,
            ``module.stage_next(next batch)`` (what ``TrainPipeline`` calls), so the next batch's
            misses are filled and slots for its new rows freed (dirty rows written back) on a
            worker thread while this step's backward runs. The stage in flight at the end of
            a timed chunk is waited for inside it.

Both train on the same batches; after ``warmup_steps`` (40: the cache full and evicting, the
tables still filling, every step's ~55k new ids new rows of the backing store too, which the
file's log writes to new pages; 450: the tables full as well, each new id evicting an old one
and the log reusing the segments it cleaned: the state a long run spends its time in),
the two are timed in turn chunk by chunk (rotating order, so both see the same machine load):
median ms per step of ``repeats`` chunks of ``steps_per_repeat`` steps. Reported for the timed
steps: the tiered tables' cache hit rate (rows found in the cache over rows that held values;
rows new to their id are neither), rows read / written back and bytes moved per step; fast
memory (``storage_bytes``: rows in the module's buffer + index) of each, the backing file's size,
and the process's resident memory split into anonymous and file pages (both modules included).

    python benchmarks/bench_tiers.py --threads 1          # saves results/tiers_cpu.{md,jsonl}
    python benchmarks/bench_tiers.py --threads 1 --systems resident,file+prefetch,host+prefetch --warmup-steps 450
    python benchmarks/bench_tiers.py --threads 1 --systems resident,file+prefetch,host+prefetch,file
    python benchmarks/bench_tiers.py --capacity 65536 --batch-size 512 --warmup-steps 5 --repeats 3 --no-save  # smoke
    python benchmarks/bench_tiers.py --capacity 65536 --batch-size 512 --flusher-ms 20 --no-save  # smoke, files cleaned
    python benchmarks/bench_tiers.py --threads 1 --systems resident,file+prefetch --write-behind 1 --no-save  # A/B
    python benchmarks/bench_tiers.py --threads 1 --systems resident,file+prefetch --pread 0 --no-save  # A/B
"""

from __future__ import annotations

import dataclasses
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import DlrmSmall, markdown_table, parse_config, print_and_save, process_memory, small_tables

from torchrec_ext import DynamicEmbeddingBagCollection, DynamicEmbeddingBagConfig
from torchrec_ext.data import dlrm_small_batch
from torchrec_ext.modules import tier_guard, tier_log


@dataclasses.dataclass
class Config(DlrmSmall):
    capacity: int = 1 << 20  # rows per table
    cache_load_factor: float = 0.2
    lr: float = 0.01
    warmup_steps: int = 40
    repeats: int = 10
    steps_per_repeat: int = 3
    seed: int = 0
    backing_dir: str = ""  # default: a fresh directory under the system's temp dir (local disk here)
    threads: int = 0  # torch threads (0: torch's default); 1 steadies the timing on a machine other sessions load
    systems: tuple[str, ...] = ("resident", "file", "host", "file+prefetch", "host+prefetch")
    # >0: a thread syncs every backing file each so many ms during the timed steps: the kernel's
    # flusher past its background dirty limit (a full-size table's files here), at smoke size
    flusher_ms: float = 0.0
    # 1: file backing's log hands each append's pages to the disk at once (tier_log.WRITE_BEHIND);
    # 0 (the library's default): they stay dirty until the kernel's flusher takes them
    write_behind: int = 0
    # 1 (the library's default): file backing unmaps the pages each copy through a mapping touched
    # (tier_guard.RELEASE_AFTER_COPY); 0 keeps them mapped: the A/B of that release
    release_pages: int = 1
    # 1 (the library's default): rows read from the backing files by pread (tier_guard.READ_WITH_PREAD);
    # 0: read through the files' mappings
    pread: int = 1


SYSTEMS = ("resident", "file", "host", "file+prefetch", "host+prefetch")


def _build(cfg: Config, backing: str) -> DynamicEmbeddingBagCollection:
    tables = small_tables(cfg, DynamicEmbeddingBagConfig, cfg.capacity)
    if backing != "device":
        for table in tables:
            table.backing, table.cache_load_factor = backing, cfg.cache_load_factor
    return DynamicEmbeddingBagCollection(tables, optimizer=torch.optim.Adagrad, optimizer_kwargs={"lr": cfg.lr})


def make_batches(cfg: Config, count: int) -> list:
    """The run's first ``count`` dlrm-small batches (the same for every system)."""
    return [
        dlrm_small_batch(i, cfg.num_tables, cfg.batch_size, cfg.max_bag, cfg.seed, alpha=cfg.alpha, id_bits=cfg.id_bits)
        for i in range(count)
    ]


def _step(module: DynamicEmbeddingBagCollection, kjt, next_kjt=None) -> None:
    if next_kjt is not None:
        module.stage_next(next_kjt)  # staged once this step's lookup has its rows
    module(kjt).values().sum().backward()


def _tier_counters(module) -> dict[str, int]:
    stats = module.table_stats().values()
    return {
        k: sum(getattr(s, k) for s in stats)
        for k in (
            "cache_hits",
            "cache_misses",
            "cache_write_backs",
            "cache_bytes_moved",
            "cache_slots",
            "inserts",
            "cache_staged",
            "cache_staged_write_backs",
        )
    }


def _log_counters(module) -> dict[str, int]:
    """File backing's write-back logs (tier_log.py), summed over the tables."""
    logs = module._tables.store.logs().values() if hasattr(module._tables.store, "logs") else []
    return {
        "appended": sum(log.appended for log in logs),
        "cleaned": sum(log.cleaned for log in logs),
        "segments_cleaned": sum(log.segments_cleaned for log in logs),
        "live": sum(log.live for log in logs),
        "map_bytes": sum(log.nbytes() for log in logs),
        "write_s": sum(log.write_s for log in logs),
    }


class _Flusher:
    """Syncs every file under ``directory`` each ``every_ms`` on a thread: their dirty pages are
    written back and write-protected again, as the kernel's flusher does once dirty pages pass
    ``vm.dirty_background_ratio`` (what a full-size file-backed table's write-backs reach here)."""

    def __init__(self, directory: str, every_ms: float):
        self.directory, self.every_s, self.syncs = directory, every_ms / 1e3, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            for root, _, files in os.walk(self.directory):
                for name in files:
                    fd = os.open(os.path.join(root, name), os.O_RDONLY)
                    try:
                        os.fdatasync(fd)
                    finally:
                        os.close(fd)
            self.syncs += 1

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.syncs


def _dirty_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Dirty:"):
                return int(line.split()[1]) * 1024
    return 0


def set_file_options(cfg: Config) -> None:
    """The file backing's switches this run A/Bs (module-level in the library)."""
    tier_log.WRITE_BEHIND = bool(cfg.write_behind)
    tier_guard.RELEASE_AFTER_COPY = bool(cfg.release_pages)
    tier_guard.READ_WITH_PREAD = bool(cfg.pread)


def run(cfg: Config) -> dict[str, object]:
    set_file_options(cfg)
    directory = cfg.backing_dir or tempfile.mkdtemp(prefix="bench_tiers_")
    made = not cfg.backing_dir
    try:
        return _run(cfg, directory)
    finally:
        if made:
            shutil.rmtree(directory, ignore_errors=True)


def _run(cfg: Config, directory: str) -> dict[str, object]:
    n = cfg.steps_per_repeat
    total = cfg.warmup_steps + cfg.repeats * n
    batches = make_batches(cfg, total)
    for name in cfg.systems:  # each file-backed system in a directory of its own
        if name.startswith("file"):
            os.makedirs(os.path.join(directory, name), exist_ok=True)
    backing = lambda name: (
        "device"
        if name == "resident"
        else "host"
        if name.startswith("host")
        else f"file:{os.path.join(directory, name)}"
    )
    systems = {name: _build(cfg, backing(name)) for name in cfg.systems}
    prefetch = {name: name.endswith("+prefetch") for name in systems}
    tiered = [name for name in systems if name != "resident"]
    uptime_before = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    for i, kjt in enumerate(batches[: cfg.warmup_steps]):
        for name, module in systems.items():
            _step(module, kjt, batches[i + 1] if prefetch[name] else None)
    before = {name: _tier_counters(systems[name]) for name in tiered}
    logs_before = {name: _log_counters(systems[name]) for name in tiered}
    stage_before = {name: systems[name]._tables.stage_seconds() for name in tiered}
    stage_cpu_before = {name: systems[name]._tables.stage_cpu_seconds() for name in tiered}
    flusher = _Flusher(directory, cfg.flusher_ms) if cfg.flusher_ms > 0 else None
    faults_before = resource.getrusage(resource.RUSAGE_SELF).ru_majflt
    times: dict[str, list[float]] = {name: [] for name in systems}
    names = list(systems)
    for r in range(cfg.repeats):
        chunk = batches[cfg.warmup_steps + r * n : cfg.warmup_steps + (r + 1) * n]
        for k in range(len(names)):
            name = names[(r + k) % len(names)]
            first = cfg.warmup_steps + r * n
            start = time.perf_counter()
            for i, kjt in enumerate(chunk):
                ahead = first + i + 1
                _step(systems[name], kjt, batches[ahead] if prefetch[name] and ahead < total else None)
            if prefetch[name]:
                systems[name]._tables.wait_for_stage()  # the stage in flight counts in the chunk
            times[name].append((time.perf_counter() - start) / n)
    major_faults = resource.getrusage(resource.RUSAGE_SELF).ru_majflt - faults_before
    dirty = _dirty_bytes()  # the machine's dirty page cache after the timed steps (the kernel's writes to come)
    syncs = flusher.stop() if flusher is not None else 0
    uptime_after = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    timed = cfg.repeats * n
    tiers = {}
    for name in tiered:
        after = _tier_counters(systems[name])
        delta = {k: after[k] - before[name][k] for k in after}
        seen = delta["cache_hits"] + delta["cache_misses"]
        logs = _log_counters(systems[name])
        log = {
            "live_records": logs["live"],
            "map_bytes": logs["map_bytes"],
            **{
                f"{k}_per_step": (logs[k] - logs_before[name][k]) / timed
                for k in ("appended", "cleaned", "segments_cleaned")
            },
            "write_ms_per_step": 1e3 * (logs["write_s"] - logs_before[name]["write_s"]) / timed,
        }
        tiers[name] = {
            "hit_rate": delta["cache_hits"] / seen if seen else None,
            "cache_rows": after["cache_slots"],
            "backing_bytes": systems[name]._tables.backing_bytes(),
            "log": log,
            "per_step": {
                "hits": delta["cache_hits"] / timed,
                "misses_read": delta["cache_misses"] / timed,
                "write_backs": delta["cache_write_backs"] / timed,
                "staged": delta["cache_staged"] / timed,
                "staged_write_backs": delta["cache_staged_write_backs"] / timed,
                "new_rows": delta["inserts"] / timed,
                "bytes_moved": delta["cache_bytes_moved"] / timed,
                "stage_ms": 1e3 * (systems[name]._tables.stage_seconds()[0] - stage_before[name][0]) / timed,
                "stage_wait_ms": 1e3 * (systems[name]._tables.stage_seconds()[1] - stage_before[name][1]) / timed,
                "stage_cpu_ms": 1e3 * (systems[name]._tables.stage_cpu_seconds() - stage_cpu_before[name]) / timed,
            },
        }
    ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    # blocks on disk (a log file is sparse: sized for twice its table's rows, filled as appended)
    backing_file_bytes = {
        name: sum(
            os.stat(os.path.join(directory, name, f)).st_blocks * 512 for f in os.listdir(os.path.join(directory, name))
        )
        for name in systems
        if name.startswith("file")
    }
    return {
        "ms_per_step": ms,
        "ms_per_step_each_repeat": {k: [x * 1e3 for x in v] for k, v in times.items()},
        "tiers": tiers,
        "capacity_rows": cfg.capacity * cfg.num_tables,
        "live_rows": {name: m.num_live_rows() for name, m in systems.items()},
        "fast_memory_bytes": {name: m.storage_bytes() for name, m in systems.items()},
        "backing_file_bytes": backing_file_bytes,
        "process_memory": process_memory(),
        "ids_per_step": int(batches[0].values().numel()),
        "uptime_before": uptime_before,
        "uptime_after": uptime_after,
        "backing_dir": directory,
        "flusher_syncs": syncs,
        "major_faults": major_faults,
        "dirty_bytes": dirty,
    }


def report(cfg: Config, r: dict[str, object]) -> str:
    mib = lambda b: f"{b / 2**20:,.0f}"
    title = (
        f"Tiered vs all-resident dynamic tables, dlrm-small train step on cpu ({torch.get_num_threads()} "
        f"thread{'s' if torch.get_num_threads() > 1 else ''}): {cfg.num_tables} tables x dim {cfg.dim}, capacity "
        f"{cfg.capacity:,} rows each, batch {cfg.batch_size} per table, bags 1..{cfg.max_bag}, ids Zipf({cfg.alpha}) "
        f"over 2^{cfg.id_bits} ({r['ids_per_step']:,} ids/step), fused Adagrad; tiered: cache_load_factor "
        f"{cfg.cache_load_factor}, file backing's log write-behind {'on' if cfg.write_behind else 'off'}, rows read by pread {'on' if cfg.pread else 'off'}, pages released after each mapped copy {'on' if cfg.release_pages else 'off'}, +prefetch: the next batch staged on a worker thread. {cfg.warmup_steps} warm-up "
        f"steps, then median of {cfg.repeats} chunks "
        f"x {cfg.steps_per_repeat} steps, the systems timed in turn (rotating order) on the same batches"
    )
    base = r["ms_per_step"].get("resident")
    rows = []
    for name, ms in r["ms_per_step"].items():
        tier = r["tiers"].get(name)
        rows.append(
            [
                name,
                f"{ms:.1f}",
                f"{ms / base:.2f}" if base else "",
                f"{r['live_rows'][name]:,}",
                mib(r["fast_memory_bytes"][name]),
                mib(tier["backing_bytes"]) if tier else "",
                f"{tier['hit_rate']:.3f}" if tier else "",
            ]
        )
    lines = [
        title,
        "",
        markdown_table(
            ["system", "ms / step", "× resident", "live rows", "fast memory MiB", "backing MiB", "cache hit rate"], rows
        ),
        "",
    ]
    for name, tier in r["tiers"].items():
        per = tier["per_step"]
        lines.append(
            f"- {name}: cache {tier['cache_rows']:,} rows of {r['capacity_rows']:,} "
            f"({r['capacity_rows'] / tier['cache_rows']:.1f}x fewer than the tables hold); per timed step "
            f"{per['hits']:,.0f} rows found in the cache, {per['misses_read']:,.0f} read from the backing store "
            f"in the step, {per['staged']:,.0f} staged ahead of it, {per['new_rows']:,.0f} new rows initialised in "
            f"the cache, {per['write_backs']:,.0f} written back ({per['staged_write_backs']:,.0f} of them by the "
            f"stage), {per['bytes_moved'] / 2**20:.1f} MiB moved"
            + (
                f"; the stage took {per['stage_ms']:.1f} ms on its thread ({per['stage_cpu_ms']:.1f} ms of it on a "
                f"CPU), the step waited {per['stage_wait_ms']:.1f} ms for it"
                if per["staged"]
                else ""
            )
            + (
                f"; write-back log: {tier['log']['appended_per_step']:,.0f} records appended and "
                f"{tier['log']['cleaned_per_step']:,.0f} moved by cleaning a step "
                f"({tier['log']['segments_cleaned_per_step']:.2f} segments cleaned), "
                f"{tier['log']['write_ms_per_step']:.1f} ms a step in its writes, "
                f"{tier['log']['live_records']:,} rows' newest copies in it at the end, its maps "
                f"{mib(tier['log']['map_bytes'])} MiB"
                if tier["log"]["appended_per_step"]
                else ""
            )
        )
    mem = r["process_memory"]
    files = ", ".join(f"{name} {mib(b)} MiB" for name, b in r["backing_file_bytes"].items()) or "none"
    lines += [
        f"- backing files on disk (rows files with headers, logs): {files}; process memory at the end (all "
        f"systems): VmRSS {mib(mem.get('VmRSS', 0))} MiB = anonymous {mib(mem.get('RssAnon', 0))} + file pages "
        f"{mib(mem.get('RssFile', 0))} MiB; during the timed steps {r['major_faults']:,} page faults read from "
        f"disk (all systems); {mib(r['dirty_bytes'])} MiB of the machine's page cache dirty after them",
        *(
            [
                f"- a flusher thread synced the backing files every {cfg.flusher_ms:g} ms during the timed steps "
                f"({r['flusher_syncs']} rounds): their pages clean and write-protected, as past the kernel's "
                "background dirty limit"
            ]
            if cfg.flusher_ms > 0
            else []
        ),
        f"- machine load: before `{r['uptime_before']}`; after `{r['uptime_after']}` (2 cores shared with other "
        "sessions: only the ratios of this run mean anything)",
    ]
    return "\n".join(lines)


def main() -> None:
    cfg, save_results = parse_config(Config, __doc__, systems=SYSTEMS)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    result = run(cfg)
    text = report(cfg, result)
    print_and_save("tiers_cpu", cfg, result, text, save_results)


if __name__ == "__main__":
    main()
