"""Rows a reshard can place: the share of distinct ids that `place_keys` (the row placement of
`load_state_dict` when saved rows do not fit, as after a change of world size) leaves out of an
empty table of `capacity` rows, at a given load (ids / capacity), and the time it takes.

A key's first bucket lies in its stripe of ~2,048 slots and its second in the next stripe on the
ring, so the ids a reshard routes in, which fill stripes unevenly (binomially), flow to the
neighbour stripes: place_keys (the C++ op hash_place: a free slot of the emptier bucket, else
Hopcroft-Karp augmenting paths, which may cross stripes) places the most the buckets allow, and
with no more ids than rows that is every id (w.h.p.; the table says how few any placement can
leave out). Exactly full tables are the slow case (the
last ids need long paths); at load 1.1 the ids beyond the rows are dropped, lowest scores first.

    python benchmarks/bench_reshard_placement.py              # saves results/reshard_placement_cpu.*
    python benchmarks/bench_reshard_placement.py --no-save    # print only
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import markdown_table, parse_config, save

from torchrec_ext.reference import bucket_pairs
from torchrec_ext.table import place_keys, stash_slots


@dataclasses.dataclass
class Config:
    capacities: str = "2048,65536,1048576"
    loads: str = "1.1,1.0,0.99,0.97,0.95,0.93,0.9"
    seed: int = 0


def fewest_lost(keys: torch.Tensor, rows: torch.Tensor, capacity: int) -> int:
    """A lower bound on the ids any placement leaves out, from the left-out ones (Hall's
    condition): the buckets they reach, moving placed keys to their other bucket, form a closed
    set; the ids whose two buckets both lie in it, beyond its rows, fit in no placement."""
    first, second = bucket_pairs(keys, capacity)
    region = torch.zeros(-(-capacity // 32), dtype=torch.bool)
    out = rows < 0
    region[first[out]] = True
    region[second[out]] = True
    bucket = torch.where(rows >= 0, rows // 32, 0)
    other = torch.where(bucket == first, second, first)
    while True:
        grow = (rows >= 0) & region[bucket] & ~region[other]
        if not bool(grow.any()):
            break
        region[other[grow]] = True
    slots = torch.clamp(capacity - 32 * region.nonzero().squeeze(1), max=32).sum()
    return max(0, int((region[first] & region[second]).sum()) - int(slots))


def measure(capacity: int, load: float, gen: torch.Generator) -> dict[str, object]:
    keys = torch.randint(-(2**62), 2**62, (int(capacity * load),), dtype=torch.int64, generator=gen).unique()
    scores = torch.randint(0, 1 << 20, (keys.numel(),), dtype=torch.int64, generator=gen)
    start = time.perf_counter()
    rows = place_keys(keys, scores, capacity)
    seconds = time.perf_counter() - start
    lost = int((rows < 0).sum())
    # Ids in rows outside their buckets went to the stash; the bound on what any placement leaves
    # out is Hall's on the buckets alone, less the stash's entries (and at least the ids beyond the rows).
    first, second = bucket_pairs(keys, capacity)
    in_buckets = (rows >= 0) & ((rows // 32 == first) | (rows // 32 == second))
    stashed = int(((rows >= 0) & ~in_buckets).sum())
    bound = (
        max(
            keys.numel() - capacity,
            fewest_lost(keys, torch.where(in_buckets, rows, -1), capacity) - stash_slots(capacity),
        )
        if lost
        else 0
    )
    return {
        "capacity": capacity,
        "load": load,
        "ids": keys.numel(),
        "lost_ids": lost,
        "stashed_ids": stashed,
        "fewest_lost": max(0, bound),
        "lost_percent": 100.0 * lost / keys.numel(),
        "seconds": seconds,
    }


def main() -> None:
    cfg, save_results = parse_config(Config, __doc__)
    gen = torch.Generator().manual_seed(cfg.seed)
    load_before = os.getloadavg()
    results: list[dict[str, object]] = []
    for capacity in (int(c) for c in cfg.capacities.split(",")):
        for load in (float(x) for x in cfg.loads.split(",")):
            results.append(measure(capacity, load, gen))
            r = results[-1]
            print(
                f"capacity {capacity:,} load {load}: {r['lost_ids']:,} of {r['ids']:,} ids not placed "
                f"({r['lost_percent']:.3f}%, no placement fewer than {r['fewest_lost']:,}; "
                f"{r['stashed_ids']:,} in the stash; {r['seconds']:.2f} s)",
                flush=True,
            )
    rows = [
        [
            f"{r['capacity']:,}",
            r["load"],
            f"{r['ids']:,}",
            f"{r['lost_ids']:,}",
            f"{r['fewest_lost']:,}",
            f"{r['stashed_ids']:,}",
            f"{r['lost_percent']:.3f}%",
            f"{r['seconds']:.2f}",
        ]
        for r in results
    ]
    load_after = os.getloadavg()
    text = "\n".join(
        [
            "Ids left out when re-placing random distinct ids into an empty table (place_keys, as a reshard's "
            "load_state_dict does), by capacity and load, and the seconds it took "
            f"(CPU, {torch.get_num_threads()} threads; the search is sequential). Load average (1, 5, 15 min) "
            f"{tuple(round(x, 2) for x in load_before)} before, {tuple(round(x, 2) for x in load_after)} after "
            '(2 cores shared with other work). "fewest possible": the ids no placement can hold, proved by Hall\'s '
            "condition (the buckets the left-out ids reach hold fewer rows than the ids whose two buckets lie in them), "
            'less the stash\'s entries; "in the stash": ids placed in rows outside their buckets.',
            "",
            markdown_table(
                ["capacity", "load", "ids", "not placed", "fewest possible", "in the stash", "share", "seconds"], rows
            ),
        ]
    )
    print(text)
    if save_results:
        save(
            "reshard_placement_cpu",
            {
                "config": dataclasses.asdict(cfg),
                "results": results,
                "load_average": {"before": load_before, "after": load_after},
            },
            text,
        )


if __name__ == "__main__":
    main()
