"""The dlrm-small train step's kernels one at a time, by storage dtype: where a FP16 / BF16 step pays
more or less than the FP32 one, and whether a kernel regressed between two builds.

Each system of `bench_lookup.py` (ours, ours-fp16, ours-bf16) trains `warmup` steps on the dlrm-small
batches; the kernel calls of the next `steps` steps (pooled_lookup, fused_update, init_rows, with
their real rows, new rows and tables) are recorded, then replayed alone, the dtypes in turn (rotating
order), `repeats` times: the median and the least of the step's time in each kernel. `threads` 1 and
`clock` cpu (the process's CPU seconds) make the figures hold up on a loaded machine; compare two
builds by running this from each tree in turn (old, new, old, new).

    PYTHONPATH=. python benchmarks/bench_step_kernels.py                        # FP32, FP16, BF16
    PYTHONPATH=. python benchmarks/bench_step_kernels.py --systems ours --capacity 65536 --warmup 3 \\
        --steps 2 --repeats 2                                                     # smoke
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_lookup import Config as LookupConfig
from bench_lookup import build_ours
from common import markdown_table, parse_config

from torchrec_ext import ops
from torchrec_ext.data import dlrm_small_batch

SYSTEMS = {"ours": "FP32", "ours-fp16": "FP16", "ours-bf16": "BF16"}
KERNELS = ("pooled_lookup", "fused_update", "init_rows")


@dataclasses.dataclass
class Config(LookupConfig):
    capacity: int = 1 << 19  # rows per table (bench_lookup's --capacity of the dtype runs)
    warmup: int = 30  # steps trained before recording
    steps: int = 6  # steps whose kernel calls are recorded
    repeats: int = 9
    threads: int = 1
    clock: str = "cpu"  # or "wall"
    systems: tuple[str, ...] = tuple(SYSTEMS)


def record_calls(cfg: Config, system: str) -> dict[str, list]:
    """The kernel calls (args, kwargs) of `cfg.steps` steps after `cfg.warmup`, each holding the
    module's tables (the replays write into them as the steps did)."""
    batches = [
        dlrm_small_batch(i, cfg.num_tables, cfg.batch_size, cfg.max_bag, cfg.seed, alpha=cfg.alpha, id_bits=cfg.id_bits)
        for i in range(cfg.warmup + cfg.steps)
    ]
    built = build_ours(cfg, data_type=SYSTEMS[system])
    calls: dict[str, list] = {k: [] for k in KERNELS}
    originals = {k: getattr(ops, k) for k in KERNELS}

    def recording(kernel):
        def call(*args, **kwargs):
            calls[kernel].append((args, kwargs))
            return originals[kernel](*args, **kwargs)

        return call

    for kjt in batches[: cfg.warmup]:
        built.step(built.batch_of(kjt))
    for k in KERNELS:
        setattr(ops, k, recording(k))
    try:
        for kjt in batches[cfg.warmup :]:
            built.step(built.batch_of(kjt))
    finally:
        for k in KERNELS:
            setattr(ops, k, originals[k])
    return calls


def main() -> None:
    cfg, _ = parse_config(Config, __doc__, systems=tuple(SYSTEMS))
    calls = {s: record_calls(cfg, s) for s in cfg.systems}
    torch.set_num_threads(cfg.threads)
    clock = time.process_time if cfg.clock == "cpu" else time.perf_counter
    kernel = {k: getattr(ops, k) for k in KERNELS}
    times = {(s, k): [] for s in cfg.systems for k in KERNELS}
    for r in range(cfg.repeats):
        for k in KERNELS:
            for i in range(len(cfg.systems)):
                s = cfg.systems[(r + i) % len(cfg.systems)]
                start = clock()
                for args, kwargs in calls[s][k]:
                    kernel[k](*args, **kwargs)
                times[(s, k)].append((clock() - start) / cfg.steps * 1e3)
    for s in cfg.systems:  # the step's kernels together, repeat by repeat
        times[(s, "sum")] = [sum(per_kernel) for per_kernel in zip(*(times[(s, k)] for k in KERNELS))]
    base = cfg.systems[0]
    rows = []
    for k in KERNELS + ("sum",):
        med0, least0 = statistics.median(times[(base, k)]), min(times[(base, k)])
        for s in cfg.systems:
            med, least = statistics.median(times[(s, k)]), min(times[(s, k)])
            rows.append([k, SYSTEMS[s], f"{med:.2f}", f"{med / med0:.3f}", f"{least:.2f}", f"{least / least0:.3f}"])
    print(
        f"dlrm-small step kernels, replayed: capacity {cfg.capacity:,} per table, {cfg.steps} steps after "
        f"{cfg.warmup}, {cfg.repeats} repeats, {cfg.threads} thread(s), {cfg.clock} clock; ms per step\n"
    )
    print(markdown_table(["kernel", "rows", "median", f"× {SYSTEMS[base]}", "least", f"× {SYSTEMS[base]}"], rows))


if __name__ == "__main__":
    main()
