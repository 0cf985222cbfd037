"""Rows a reshard can place: the share of distinct ids that `place_keys` (the row placement of
`load_state_dict` when rows are re-inserted, as after a change of world size) leaves out of an
empty table of `capacity` rows, at a given load (ids / capacity).

A key's first bucket lies in its stripe of ~2,048 slots and its second in the next stripe on the
ring, so the ids a reshard routes in, which fill stripes unevenly (binomially), flow to the
neighbour stripes: place_keys places the most the buckets allow (augmenting paths, which may cross
stripes), and with no more ids than rows that is every id (w.h.p.). Exactly full tables are the
slow case (the last ids need long paths).

    python benchmarks/bench_reshard_placement.py              # saves results/reshard_placement_cpu.*
    python benchmarks/bench_reshard_placement.py --no-save    # print only
"""
from __future__ import annotations

import dataclasses
import os
import sys
import time
from typing import Dict, List

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import markdown_table, parse_config, save  # noqa: E402

from torchrec_ext.table import place_keys  # noqa: E402


@dataclasses.dataclass
class Config:
    capacities: str = "2048,65536,1048576"
    loads: str = "1.0,0.99,0.97,0.95,0.93,0.9"
    seed: int = 0


def measure(capacity: int, load: float, gen: torch.Generator) -> Dict[str, object]:
    keys = torch.randint(-2**62, 2**62, (int(capacity * load),), dtype=torch.int64, generator=gen).unique()
    scores = torch.randint(0, 1 << 20, (keys.numel(),), dtype=torch.int64, generator=gen)
    start = time.perf_counter()
    rows = place_keys(keys, scores, capacity)
    seconds = time.perf_counter() - start
    lost = int((rows < 0).sum())
    return {"capacity": capacity, "load": load, "ids": keys.numel(), "lost_ids": lost,
            "lost_percent": 100.0 * lost / keys.numel(), "seconds": seconds}


def main() -> None:
    cfg, save_results = parse_config(Config, __doc__)
    gen = torch.Generator().manual_seed(cfg.seed)
    results: List[Dict[str, object]] = []
    for capacity in (int(c) for c in cfg.capacities.split(",")):
        for load in (float(x) for x in cfg.loads.split(",")):
            results.append(measure(capacity, load, gen))
            r = results[-1]
            print(f"capacity {capacity:,} load {load}: {r['lost_ids']:,} of {r['ids']:,} ids not placed "
                  f"({r['lost_percent']:.3f}%, {r['seconds']:.2f} s)", flush=True)
    rows = [[f"{r['capacity']:,}", r["load"], f"{r['ids']:,}", f"{r['lost_ids']:,}", f"{r['lost_percent']:.3f}%",
             f"{r['seconds']:.2f}"] for r in results]
    text = "\n".join([
        "Ids left out when re-placing random distinct ids into an empty table (place_keys, as a reshard's "
        "load_state_dict does), by capacity and load",
        "", markdown_table(["capacity", "load", "ids", "not placed", "share", "seconds"], rows)])
    print(text)
    if save_results:
        save("reshard_placement_cpu", {"config": dataclasses.asdict(cfg), "results": results}, text)


if __name__ == "__main__":
    main()
