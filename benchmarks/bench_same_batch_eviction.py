"""Resident ids lost by their own call: of the ids of a find_or_insert batch that already had a
row before the call, the share whose row the call took away (evicted for a new id of the same
batch, then re-inserted as new or refused). The contract (DESIGN.md) is zero: every resident key
of a batch is pinned before any key of the batch is inserted.

Workload: a HashTable kept full (filled with fresh ids until size == capacity), then calls of
`batch` distinct ids (a module deduplicates per table), half drawn from the resident ids and half
new, in random order. Measured: lost resident ids / resident ids of the batch over `calls` calls
(the table stays full: every new id evicts or is refused). Each (policy, batch, capacity) case
starts from a fresh table. Speed is bench_hash_table.py's job.

    python benchmarks/bench_same_batch_eviction.py                       # saves results/same_batch_eviction_cpu.*
    python benchmarks/bench_same_batch_eviction.py --label before-fix    # tag a run (kept as a row in the report)
    python benchmarks/bench_same_batch_eviction.py --calls 5 --no-save   # smoke
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import RESULTS_DIR, markdown_table, parse_config, print_and_save

from torchrec_ext import HashTable

# (batch, capacity) cases of issue 11.
CASES = ((4096, 4096), (4096, 65536), (512, 65536))


@dataclasses.dataclass
class Config:
    policies: str = "lru,lfu"
    calls: int = 200
    warmup_calls: int = 5
    seed: int = 0
    label: str = "current"
    device: str = "cpu"


def random_keys(n: int, gen: torch.Generator, device: str) -> torch.Tensor:
    return torch.randint(-(2**63), 2**63 - 1, (n,), generator=gen, dtype=torch.int64).to(device)


def full_table(capacity: int, policy: str, gen: torch.Generator, device: str) -> HashTable:
    table = HashTable(capacity, policy=policy, device=device)
    while table.size() < capacity:  # two-choice hashing reaches load factor 1.0
        table.find_or_insert(random_keys(max(capacity // 4, 64), gen, device))
    return table


def measure(policy: str, batch: int, capacity: int, cfg: Config, gen: torch.Generator) -> dict[str, object]:
    table = full_table(capacity, policy, gen, cfg.device)
    lost = resident_seen = 0
    for call in range(cfg.warmup_calls + cfg.calls):
        live = torch.cat([page[0] for page in table.export()])
        hits = live[torch.randperm(live.numel(), generator=gen)[: batch // 2].to(live.device)]
        keys = torch.cat([hits, random_keys(batch - hits.numel(), gen, cfg.device)])
        keys = keys[torch.randperm(batch, generator=gen).to(keys.device)]
        rows_before, resident = table.find(keys)
        result = table.find_or_insert(keys)
        if call < cfg.warmup_calls:
            continue
        moved = resident & ((result.rows != rows_before) | result.inserted)
        lost += int(moved.sum())
        resident_seen += int(resident.sum())
    assert table.size() == capacity, "the table must stay full"
    return {
        "policy": policy,
        "batch": batch,
        "capacity": capacity,
        "calls": cfg.calls,
        "resident_ids": resident_seen,
        "lost_ids": lost,
        "lost_percent": 100.0 * lost / resident_seen,
    }


def run(cfg: Config) -> list[dict[str, object]]:
    gen = torch.Generator().manual_seed(cfg.seed)
    results = []
    for policy in cfg.policies.split(","):
        for batch, capacity in CASES:
            r = measure(policy, batch, capacity, cfg, gen)
            results.append(r)
            print(
                f"{policy} batch {batch} / capacity {capacity}: {r['lost_percent']:.2f}% of resident ids lost "
                f"per call ({r['lost_ids']} of {r['resident_ids']})",
                flush=True,
            )
    return results


def results_name(cfg: Config) -> str:
    return f"same_batch_eviction_{cfg.device.split(':')[0]}"


def earlier_runs(cfg: Config) -> list[dict[str, object]]:
    """The newest saved run of every other label, so the report compares them side by side."""
    path = os.path.join(RESULTS_DIR, f"{results_name(cfg)}.jsonl")
    newest: dict[str, dict[str, object]] = {}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                record = json.loads(line)
                if record["config"]["label"] != cfg.label:
                    newest[record["config"]["label"]] = record
    return list(newest.values())


def report(cfg: Config, results: list[dict[str, object]], earlier: list[dict[str, object]]) -> str:
    header = ["run", "policy", "batch", "capacity", "resident ids lost per call", "lost / resident ids"]
    runs = [(r["config"]["label"], r["time"], r["results"]) for r in earlier] + [(cfg.label, "this run", results)]
    rows = [
        [
            f"{label} ({when})",
            r["policy"],
            f"{r['batch']:,}",
            f"{r['capacity']:,}",
            f"{r['lost_percent']:.2f}%",
            f"{r['lost_ids']:,} / {r['resident_ids']:,}",
        ]
        for label, when, rs in runs
        for r in rs
    ]
    where = f"{cfg.device} ({torch.get_num_threads()} threads)" if cfg.device == "cpu" else torch.cuda.get_device_name()
    title = (
        f"Resident ids lost to their own find_or_insert call, full HashTable on {where}: batches of distinct ids, half resident and half new in random order, "
        f"{cfg.calls} calls per case after {cfg.warmup_calls} warm-up calls"
    )
    return "\n".join([title, "", markdown_table(header, rows)])


def main() -> None:
    cfg, save_results = parse_config(Config, __doc__)
    results = run(cfg)
    text = report(cfg, results, earlier_runs(cfg))
    print_and_save(results_name(cfg), cfg, results, text, save_results)


if __name__ == "__main__":
    main()
