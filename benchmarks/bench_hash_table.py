"""Keys per second of HashTable.find / find_or_insert / insert_or_assign against load factor,
beside a Python dict and a sorted-array (torch.searchsorted) index in the same process.

Workload (as HierarchicalKV's benchmark): a table of `capacity` slots filled with random int64
keys to each load factor, then calls of `batch` keys. find: all keys present. find_or_insert
and insert_or_assign: half present, half new; each timed call starts from a copy of the table
at that load factor (the copy is not timed), so every repeat sees the same state.

    python benchmarks/bench_hash_table.py                    # 16M slots, 1M keys per call
    python benchmarks/bench_hash_table.py --load-factors 1.0   # full tables only (every new key evicts)
    python benchmarks/bench_hash_table.py --capacity 65536 --batch 4096 --no-save   # smoke
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Dict, List, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import markdown_table, median_seconds, save  # noqa: E402

from torchrec_ext import HashTable  # noqa: E402

OPS = ("find", "find_or_insert", "insert_or_assign")


@dataclasses.dataclass
class Config:
    capacity: int = 1 << 24
    batch: int = 1 << 20
    load_factors: Tuple[float, ...] = (0.25, 0.5, 0.75, 1.0)
    repeats: int = 5
    baseline_repeats: int = 3
    device: str = "cpu"
    seed: int = 0


def random_keys(n: int, gen: torch.Generator, device: str) -> torch.Tensor:
    return torch.randint(-(2**63), 2**63 - 1, (n,), generator=gen, dtype=torch.int64).to(device)


def fill(table: HashTable, load_factor: float, batch: int, gen: torch.Generator) -> None:
    """Inserts fresh keys until the table holds load_factor * capacity keys (LRU: at 1.0 the
    last free slots fill as new keys keep arriving)."""
    target = int(load_factor * table.capacity)
    while table.size() < target:
        # Below 1.0 insert exactly the missing count; at 1.0 keep full batches coming.
        n = batch if load_factor >= 1.0 else min(batch, target - table.size())
        table.find_or_insert(random_keys(n, gen, str(table.device)))


class DictIndex:
    """The naive way: a Python dict id -> row, fed through .tolist()."""

    def __init__(self, keys: torch.Tensor):
        self.rows = {k: i for i, k in enumerate(keys.tolist())}

    def find(self, keys):
        get = self.rows.get
        return torch.tensor([get(k, -1) for k in keys.tolist()])

    def find_or_insert(self, keys):
        rows, setdefault = self.rows, self.rows.setdefault
        return torch.tensor([setdefault(k, len(rows)) for k in keys.tolist()])

    insert_or_assign = find_or_insert


class SortedIndex:
    """A sorted key array searched with torch.searchsorted; inserts merge and re-sort."""

    def __init__(self, keys: torch.Tensor):
        self.keys, order = torch.sort(keys)
        self.rows = order

    def find(self, keys):
        pos = torch.searchsorted(self.keys, keys).clamp_(max=self.keys.numel() - 1)
        hit = self.keys[pos] == keys
        return torch.where(hit, self.rows[pos], -1)

    def find_or_insert(self, keys):
        rows = self.find(keys)
        missing = torch.unique(keys[rows < 0])
        new_rows = torch.arange(self.rows.numel(), self.rows.numel() + missing.numel())
        merged, order = torch.sort(torch.cat([self.keys, missing]))
        self.keys, self.rows = merged, torch.cat([self.rows, new_rows])[order]
        return self.find(keys)

    insert_or_assign = find_or_insert


def run(cfg: Config) -> List[Dict[str, object]]:
    gen = torch.Generator().manual_seed(cfg.seed)
    results = []
    for lf in cfg.load_factors:
        table = HashTable(cfg.capacity, policy="lru", device=cfg.device)
        fill(table, lf, cfg.batch, gen)
        resident = torch.cat([p[0] for p in table.export()])
        hits = resident[torch.randint(0, resident.numel(), (cfg.batch,), generator=gen).to(resident.device)]
        mixed = torch.cat([hits[: cfg.batch // 2], random_keys(cfg.batch - cfg.batch // 2, gen, cfg.device)])
        mixed = mixed[torch.randperm(cfg.batch, generator=gen).to(mixed.device)]
        queries = {"find": hits, "find_or_insert": mixed, "insert_or_assign": mixed}
        row = {"load_factor": round(table.load_factor(), 4)}
        for op in OPS:
            if op == "find":
                sec = median_seconds(lambda: table.find(hits), cfg.repeats)
            else:
                sec = median_seconds(lambda t, op=op: getattr(t, op)(queries[op]), cfg.repeats, setup=table.clone)
            row[f"{op}_keys_per_s"] = cfg.batch / sec
        resident_cpu = resident.cpu()
        for name, make in (("dict", DictIndex), ("sorted", SortedIndex)):
            for op in OPS:
                q = queries[op].cpu()
                if op == "find":
                    index = make(resident_cpu)
                    sec = median_seconds(lambda: index.find(q), cfg.baseline_repeats)
                else:
                    sec = median_seconds(lambda ix, op=op: getattr(ix, op)(q), cfg.baseline_repeats,
                                         setup=lambda: make(resident_cpu))
                row[f"{name}_{op}_keys_per_s"] = cfg.batch / sec
        results.append(row)
        print(f"load factor {row['load_factor']:.2f}: " + ", ".join(
            f"{op} {row[f'{op}_keys_per_s'] / 1e6:.1f} M/s ({row[f'{op}_keys_per_s'] / row[f'dict_{op}_keys_per_s']:.0f}x dict)"
            for op in OPS), flush=True)
        del table
    return results


def report(cfg: Config, results: List[Dict[str, object]]) -> str:
    header = ["load factor"] + [f"{op} M keys/s (× dict, × sorted)" for op in OPS]
    rows = []
    for r in results:
        cells = [f"{r['load_factor']:.2f}"]
        for op in OPS:
            ours = r[f"{op}_keys_per_s"]
            cells.append(f"{ours / 1e6:.1f} ({ours / r[f'dict_{op}_keys_per_s']:.0f}×, {ours / r[f'sorted_{op}_keys_per_s']:.1f}×)")
        rows.append(cells)
    base = ["", "Baselines, M keys/s (dict / sorted):"]
    for r in results:
        base.append(f"- load factor {r['load_factor']:.2f}: " + "; ".join(
            f"{op} {r[f'dict_{op}_keys_per_s'] / 1e6:.2f} / {r[f'sorted_{op}_keys_per_s'] / 1e6:.2f}" for op in OPS))
    title = (f"HashTable on {cfg.device} ({torch.get_num_threads()} threads): capacity {cfg.capacity:,} slots, "
             f"{cfg.batch:,} keys per call, LRU, median of {cfg.repeats}")
    return "\n".join([title, "", markdown_table(header, rows)] + base)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--capacity", type=int, default=Config.capacity)
    parser.add_argument("--batch", type=int, default=Config.batch)
    parser.add_argument("--repeats", type=int, default=Config.repeats)
    parser.add_argument("--load-factors", type=float, nargs="+", default=list(Config.load_factors))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--no-save", action="store_true", help="print only; write nothing under results/")
    args = parser.parse_args()
    cfg = Config(capacity=args.capacity, batch=args.batch, repeats=args.repeats, device=args.device,
                 load_factors=tuple(args.load_factors))
    results = run(cfg)
    text = report(cfg, results)
    print(text)
    if not args.no_save:
        save(f"hash_table_{cfg.device}", {"config": dataclasses.asdict(cfg), "results": results}, text)


if __name__ == "__main__":
    main()
