"""Shared benchmark plumbing: median-of-repeats timing, results files, machine description."""
from __future__ import annotations

import json
import os
import platform
import statistics
import time
from typing import Callable, Dict, List, Optional

import torch

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def median_seconds(fn: Callable[[], object], repeats: int, warmup: int = 1,
                   setup: Optional[Callable[[], object]] = None) -> float:
    """Median wall time of fn() over `repeats` runs after `warmup` runs; `setup` runs untimed
    before each call (and its result is passed to fn when fn takes one argument)."""
    times = []
    for i in range(warmup + repeats):
        arg = setup() if setup is not None else None
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn(arg) if setup is not None else fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def machine() -> Dict[str, object]:
    info = {
        "host_cpu": platform.processor() or platform.machine(),
        "cpu_threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name()
    return info


def markdown_table(header: List[str], rows: List[List[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def save(name: str, record: Dict[str, object], markdown: str) -> None:
    """Appends `record` as a JSON line to results/<name>.jsonl and writes results/<name>.md."""
    os.makedirs(RESULTS_DIR, exist_ok=True)
    record = dict(record, time=time.strftime("%Y-%m-%dT%H:%M:%S"), machine=machine())
    with open(os.path.join(RESULTS_DIR, f"{name}.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\n")
    with open(os.path.join(RESULTS_DIR, f"{name}.md"), "w") as f:
        f.write(markdown + "\n")


def tensor_bytes(*objs) -> int:
    """Bytes of the distinct storages under tensors, ShardedTensors (local shards), dicts, lists."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    seen: Dict[int, int] = {}

    def visit(o) -> None:
        if isinstance(o, ShardedTensor):
            for shard in o.local_shards():
                visit(shard.tensor)
        elif isinstance(o, torch.Tensor):
            if o.device.type != "meta":
                storage = o.untyped_storage()
                seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
        elif isinstance(o, dict):
            for v in o.values():
                visit(v)
        elif isinstance(o, (list, tuple)):
            for v in o:
                visit(v)

    for o in objs:
        visit(o)
    return sum(seen.values())
