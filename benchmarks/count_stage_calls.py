"""Counts the torch calls (and the log's writes) one prefetch stage of a tiered module makes:
the figure of the stage's Python-level work that does not move with the machine's load (each
call lets the GIL go and takes it back, which the train thread's Python then delays).

    PYTHONPATH=$PWD python benchmarks/count_stage_calls.py --capacity 65536 --batch-size 512

dlrm-small modules of ``bench_tiers.py`` (file and host backing, +prefetch), warmed up, then per
step: torch calls seen by a ``TorchFunctionMode`` on the stage's worker thread, ``os.pwrite``
calls, and the top call names.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import sys
import tempfile

import torch
from torch.overrides import TorchFunctionMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_tiers

from torchrec_ext.modules import tier_log

# Calls that read a tensor's metadata only (no dispatch to a kernel, the GIL kept)
METADATA = {"numel", "dim", "__get__", "size", "element_size", "is_contiguous", "__len__"}


class _Count(TorchFunctionMode):
    def __init__(self, counts: collections.Counter, callers: collections.Counter | None = None):
        super().__init__()
        self.counts, self.callers = counts, callers

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.counts[getattr(func, "__name__", str(func))] += 1
        if self.callers is not None and getattr(func, "__name__", "") not in METADATA:
            self.callers[sys._getframe(1).f_code.co_name] += 1
        return func(*args, **(kwargs or {}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--capacity", type=int, default=65536)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--warmup-steps", type=int, default=20)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    cfg = bench_tiers.Config(capacity=args.capacity, batch_size=args.batch_size)
    total = args.warmup_steps + args.steps + 1
    batches = bench_tiers.make_batches(cfg, total)
    directory = tempfile.mkdtemp(prefix="count_stage_")
    try:
        for backing in (f"file:{directory}", "host"):
            module = bench_tiers._build(cfg, backing)
            for i in range(args.warmup_steps):
                bench_tiers._step(module, batches[i], batches[i + 1])
            tables = module._tables
            tables.wait_for_stage()
            counts: collections.Counter = collections.Counter()
            callers: collections.Counter = collections.Counter()
            writes = [0]
            stage, pwrite = tables._stage, os.pwrite

            def counted(*a, **k):
                with _Count(counts, callers):
                    return stage(*a, **k)

            def counted_pwrite(*a):
                writes[0] += 1
                return pwrite(*a)

            tables._stage = counted
            tier_log.os.pwrite = counted_pwrite  # (the stage's appends; the train thread writes none here)
            try:
                for i in range(args.warmup_steps, args.warmup_steps + args.steps):
                    bench_tiers._step(module, batches[i], batches[i + 1])
                tables.wait_for_stage()
            finally:
                tier_log.os.pwrite = pwrite
                del tables._stage
            n = args.steps
            name = backing.split(":")[0]
            print(
                f"{name}: {sum(counts.values()) / n:,.0f} torch calls a stage ({len(tables.meta)} tables; "
                f"{sum(v for k, v in counts.items() if k not in METADATA) / n:,.0f} of them beyond metadata), "
                f"{writes[0] / n:.1f} pwrite a stage"
            )
            print("   calls:", ", ".join(f"{k} {v / n:.0f}" for k, v in counts.most_common(12)))
            print("   beyond metadata, made in:", ", ".join(f"{k} {v / n:.0f}" for k, v in callers.most_common(14)))
            del module
    finally:
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
