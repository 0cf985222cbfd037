"""The host work of a tiered module's cache bookkeeping per training lookup, with the caches' maps
on the host (``RowCache``) or on the cache's device (``DeviceSlotMaps``, here on the CPU: the
path a GPU takes), against the table count: the figure that sets the GPU tier's step time (each
torch call is a kernel launch on a GPU; session 12 measured ~1-1.5 ms a table a step of host
bookkeeping on an H100's host with the host maps).

    PYTHONPATH=$PWD python benchmarks/count_tier_maps.py --tables 2,10,26

``bench_tiers_gpu.py``'s workload at smoke size (dlrm-small ids mod ``rows``, host backing,
``cache_load_factor`` ``ratio``, ``stage_next`` each step), warmed up; per lookup of the timed
steps: torch calls (Python level, beyond metadata reads) and aten ops of the lookup's cache
bookkeeping (``TieredTables._hold`` / ``_on_host`` with the host maps, ``_hold_on_device``
with the device maps), its wall time, the host reads (``device_sync``) of the train thread, and
the torch calls and host reads of the stage (``TieredTables._stage``, on its worker thread; with
the host maps its rows come to the host uncounted, one read a table on a GPU).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_tiers_gpu
from common import markdown_table, save

from torchrec_ext import device_sync
from torchrec_ext.modules.tiered_tables import TieredTables

METADATA = {"numel", "dim", "__get__", "size", "element_size", "is_contiguous", "__len__"}


class _Calls(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += getattr(func, "__name__", "") not in METADATA
        return func(*args, **(kwargs or {}))


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def measure(tables: int, maps: str, args) -> dict[str, float]:
    cfg = bench_tiers_gpu.Config(num_tables=tables, rows=args.rows, batch_size=args.batch_size, dim=args.dim)
    device = torch.device("cpu")
    module, step, settle = bench_tiers_gpu._ours(cfg, device, "host", args.ratio, maps)
    batches = bench_tiers_gpu._batches(cfg, args.warmup_steps + args.steps + 1, device)
    for i in range(args.warmup_steps):
        step(batches[i], batches[i + 1])
    settle()
    t = module._tables
    names = ["_hold_on_device"] if maps == "device" else ["_hold", "_on_host"]
    per = {"calls": 0, "ops": 0, "seconds": 0.0, "stage_calls": 0}
    originals = {name: getattr(t, name) for name in names}
    stage = t._stage

    def counted_stage(*a, **k):
        with _Calls() as calls:
            out = stage(*a, **k)
        per["stage_calls"] += calls.calls
        return out

    t._stage = counted_stage

    def wrap(fn):
        def counted(*a, **k):
            start = time.perf_counter()
            with _Calls() as calls, _Ops() as ops:
                out = fn(*a, **k)
            per["seconds"] += time.perf_counter() - start
            per["calls"] += calls.calls
            per["ops"] += ops.ops
            return out

        return counted

    for name, fn in originals.items():
        setattr(t, name, wrap(fn))
    calls, ops, seconds, reads, stage_calls, stage_reads = [], [], [], [], [], []
    for i in range(args.warmup_steps, args.warmup_steps + args.steps):
        per.update(calls=0, ops=0, seconds=0.0, stage_calls=0)
        with device_sync.recording() as seen:
            step(batches[i], batches[i + 1])
            settle()
        calls.append(per["calls"])
        ops.append(per["ops"])
        seconds.append(per["seconds"])
        staged = sum(n for reason, n in seen.items() if "stage" in reason or "evict" in reason)
        reads.append(sum(seen.values()) - staged)
        stage_calls.append(per["stage_calls"])
        stage_reads.append(staged)
    for name in names + ["_stage"]:
        delattr(t, name)
    hits = sum(c.hits for c in t.caches)
    return {
        "calls": statistics.median(calls),
        "ops": statistics.median(ops),
        "ms": statistics.median(seconds) * 1e3,
        "reads": statistics.median(reads),
        "stage_calls": statistics.median(stage_calls),
        "stage_reads": statistics.median(stage_reads),
        "hits": hits,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tables", default="2,10,26")
    parser.add_argument("--rows", type=int, default=16384)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--warmup-steps", type=int, default=8)
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    results = {}
    for tables in [int(x) for x in args.tables.split(",")]:
        for maps in ("host", "device"):
            r = measure(tables, maps, args)
            results[f"{maps}@{tables}"] = r
            rows.append(
                [maps, tables]
                + [f"{r[k]:.0f}" for k in ("calls", "ops")]
                + [f"{r['ms']:.2f}"]
                + [f"{r[k]:.0f}" for k in ("reads", "stage_calls", "stage_reads")]
            )
            print(rows[-1], flush=True)
    assert TieredTables.device_maps is None
    text = "\n".join(
        [
            f"Cache bookkeeping of one training lookup (CPU, {os.cpu_count()} cores shared: times are noise "
            f"under load; calls and ops are not): tables of {args.rows:,} rows x dim {args.dim}, batch "
            f"{args.batch_size} bags a table, dlrm-small ids, host backing, cache_load_factor {args.ratio}, "
            f"stage_next each step; median of {args.steps} steps after {args.warmup_steps}. "
            "Device maps: the path a GPU takes (tier_device_maps.py), run on the CPU. Host reads: counted "
            "device_sync reads of the train thread (the lookup's ids per table, and the device maps' one "
            "count); on a GPU the host maps read 2 as well (their rows come to the host: free on the CPU).",
            "",
            markdown_table(
                [
                    "maps",
                    "tables",
                    "lookup: torch calls",
                    "aten ops",
                    "ms (host)",
                    "host reads (train thread)",
                    "stage: torch calls",
                    "host reads",
                ],
                rows,
            ),
        ]
    )
    print(text)
    if not args.no_save:
        save("tier_maps_host_work", {"config": vars(args), "results": results}, text)


if __name__ == "__main__":
    main()
