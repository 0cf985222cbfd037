"""Keys per second of HashTable.find / find_or_insert / insert_or_assign against load factor,
beside a Python dict and a sorted-array (torch.searchsorted) index in the same process.

Workload (as HierarchicalKV's benchmark): a table of `capacity` slots filled with random int64
keys to each load factor, then calls of `batch` keys. find: all keys present. find_or_insert
and insert_or_assign: half present, half new; each timed call starts from a copy of the table
at that load factor (the copy is not timed), so every repeat sees the same state.

    python benchmarks/bench_hash_table.py                    # 16M slots, 1M keys per call
    python benchmarks/bench_hash_table.py --load-factors 1.0   # full tables only (every new key evicts)
    python benchmarks/bench_hash_table.py --capacity 65536 --batch 4096 --no-save   # smoke
    python benchmarks/bench_hash_table.py --device cuda --hkv   # HierarchicalKV's configuration (below)
    python benchmarks/bench_hash_table.py --mapped-rows   # a growing table's index (slots mapped to rows)
    python benchmarks/bench_hash_table.py --device cuda --hkv --kernels   # + each upsert's kernels

--hkv runs HierarchicalKV's benchmark configuration (benchmark/merlin_hashtable_benchmark.cc.cu):
64M slots, 1M keys per call, load factors 0.5 and 1.0, dims 8 and 64, every call's keys 60%
resident and 40% new (its hit rate 0.6), and each call moves the values as HKV's API does: find
gathers the found keys' vectors into an output buffer, find_or_insert gathers them and writes the
new keys' initial vectors, insert_or_assign writes every key's vector. Our table holds rows, not
values, so the vectors live in a separate [capacity + batch, dim] float32 tensor (row capacity is
read for missing or refused keys; keys that store nothing write rows capacity + position, one
each: writes of one shared row serialise on a GPU); the timed call is the table op plus that
gather or scatter. No dict/sorted baselines there. Figures are in 10^9 keys/s (HKV divides by 2^30:
its numbers are ours x 0.931).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import markdown_table, median_seconds, save

from torchrec_ext import HashTable

OPS = ("find", "find_or_insert", "insert_or_assign")


@dataclasses.dataclass
class Config:
    capacity: int = 1 << 24
    batch: int = 1 << 20
    load_factors: tuple[float, ...] = (0.25, 0.5, 0.75, 1.0)
    repeats: int = 5
    baseline_repeats: int = 3
    device: str = "cpu"
    seed: int = 0
    dims: tuple[int, ...] = (0,)  # value dims moved per call (0: the table op alone)
    hit_rate: float = -1.0  # resident share of every call's keys; < 0: find 1.0, the upserts 0.5
    baselines: bool = True  # also time the dict and sorted-array indexes
    hkv: bool = False  # the --hkv preset (names the results file)
    mapped_rows: bool = False  # the index of a growing table: every call maps its slots to rows
    kernels: bool = False  # also profile one call of each upsert: time per kernel (--dims runs)


def hkv_config(device: str) -> Config:
    return Config(
        capacity=1 << 26,
        batch=1 << 20,
        load_factors=(0.5, 1.0),
        device=device,
        dims=(8, 64),
        hit_rate=0.6,
        baselines=False,
        hkv=True,
    )


# HierarchicalKV on 1x A100 80GB PCIe (its README, /work/shared ANCHORS.md), 10^9 keys/s converted
# from its 2^30 unit: (dim, load factor) -> find, find_or_insert, insert_or_assign.
HKV_A100 = {
    (8, 0.5): (2.470, 1.478, 1.093),
    (8, 1.0): (2.481, 0.612, 0.655),
    (64, 0.5): (1.982, 1.113, 0.834),
    (64, 1.0): (2.021, 0.608, 0.621),
}
HKV_A100 = {k: tuple(v * 2**30 / 1e9 for v in vs) for k, vs in HKV_A100.items()}


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


def with_values(table: HashTable, dim: int, batch: int) -> dict[str, object]:
    """The three ops followed by the value traffic of HKV's API (see the module docstring)."""
    sink = table.capacity  # the values' extra rows: missing or refused keys read row `sink`
    values = torch.zeros(table.capacity + batch, dim, device=table.device)
    incoming = torch.ones(batch, dim, device=table.device)
    # The writes of keys that store nothing (resident, refused) go to a throwaway row of their
    # own (sink + position), never to one shared row: 600k writes of one row per call serialise
    # on that row's cache line (a GPU's L2), which timed the sink rather than the table.
    throwaway = torch.arange(sink, sink + batch, device=table.device)

    def find(t: HashTable, keys):
        rows, found = t.find(keys)
        return values.index_select(0, torch.where(found, rows, sink))

    def find_or_insert(t: HashTable, keys):
        res = t.find_or_insert(keys)
        out = values.index_select(0, torch.where(res.rows >= 0, res.rows, sink))
        values.index_copy_(0, torch.where(res.inserted, res.rows, throwaway), incoming)
        return out

    def insert_or_assign(t: HashTable, keys):
        res = t.insert_or_assign(keys)
        values.index_copy_(0, torch.where(res.rows >= 0, res.rows, throwaway), incoming)

    return {"find": find, "find_or_insert": find_or_insert, "insert_or_assign": insert_or_assign}


def kernel_times(call, setup, top: int = 12) -> list[dict[str, object]]:
    """The `top` kernels (ops on CPU) of one call by their own device time (torch.profiler),
    largest first: which pass of an upsert (sort, touch, insert, release, ...) its time goes to."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    arg = setup()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        call(arg)
        if cuda:
            torch.cuda.synchronize()
    field = "self_device_time_total" if cuda else "self_cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, field), reverse=True)
    return [{"name": e.key, "calls": e.count, "us": round(getattr(e, field), 1)} for e in events[:top]]


def run(cfg: Config) -> list[dict[str, object]]:
    gen = torch.Generator().manual_seed(cfg.seed)
    results = []
    for lf in cfg.load_factors:
        table = HashTable(cfg.capacity, policy="lru", device=cfg.device, mapped_rows=cfg.mapped_rows)
        fill(table, lf, cfg.batch, gen)
        resident = torch.cat([p[0] for p in table.export()])
        hits = resident[torch.randint(0, resident.numel(), (cfg.batch,), generator=gen).to(resident.device)]
        if cfg.hit_rate >= 0:  # one key mix for all ops (HKV's)
            n_hit = int(cfg.hit_rate * cfg.batch)
            mixed = torch.cat([hits[:n_hit], random_keys(cfg.batch - n_hit, gen, cfg.device)])
            mixed = mixed[torch.randperm(cfg.batch, generator=gen).to(mixed.device)]
            queries = dict.fromkeys(OPS, mixed)
        else:
            mixed = torch.cat([hits[: cfg.batch // 2], random_keys(cfg.batch - cfg.batch // 2, gen, cfg.device)])
            mixed = mixed[torch.randperm(cfg.batch, generator=gen).to(mixed.device)]
            queries = {"find": hits, "find_or_insert": mixed, "insert_or_assign": mixed}
        if cfg.dims != (0,):
            for dim in cfg.dims:
                calls = with_values(table, dim, cfg.batch)
                row = {"load_factor": round(table.load_factor(), 4), "dim": dim, "hit_rate": cfg.hit_rate}
                for op in OPS:
                    sec = median_seconds(
                        lambda t, op=op: calls[op](t, queries[op]),
                        cfg.repeats,
                        setup=table.clone if op != "find" else lambda: table,
                    )
                    row[f"{op}_keys_per_s"] = cfg.batch / sec
                    if cfg.kernels and op != "find":
                        row[f"{op}_kernels"] = kernel_times(lambda t, op=op: calls[op](t, queries[op]), table.clone)
                        print(f"{op}, load factor {row['load_factor']:.2f}, dim {dim}: own time per kernel, one call")
                        for k in row[f"{op}_kernels"]:
                            print(f"  {k['us']:10.1f} us  {k['calls']:3d}x  {k['name'][:100]}")
                results.append(row)
                print(
                    f"load factor {row['load_factor']:.2f}, dim {dim}: "
                    + ", ".join(f"{op} {row[f'{op}_keys_per_s'] / 1e9:.3f} B/s" for op in OPS),
                    flush=True,
                )
                del calls
            table = None  # freed before the next table is built
            continue
        row = {"load_factor": round(table.load_factor(), 4)}
        for op in OPS:
            if op == "find":
                sec = median_seconds(lambda: table.find(hits), cfg.repeats)
            else:
                sec = median_seconds(lambda t, op=op: getattr(t, op)(queries[op]), cfg.repeats, setup=table.clone)
            row[f"{op}_keys_per_s"] = cfg.batch / sec
        if not cfg.baselines:
            results.append(row)
            print(
                f"load factor {row['load_factor']:.2f}: "
                + ", ".join(f"{op} {row[f'{op}_keys_per_s'] / 1e6:.1f} M/s" for op in OPS),
                flush=True,
            )
            table = None  # freed before the next table is built
            continue
        resident_cpu = resident.cpu()
        for name, make in (("dict", DictIndex), ("sorted", SortedIndex)):
            for op in OPS:
                q = queries[op].cpu()
                if op == "find":
                    index = make(resident_cpu)
                    sec = median_seconds(lambda: index.find(q), cfg.baseline_repeats)
                else:
                    sec = median_seconds(
                        lambda ix, op=op: getattr(ix, op)(q), cfg.baseline_repeats, setup=lambda: make(resident_cpu)
                    )
                row[f"{name}_{op}_keys_per_s"] = cfg.batch / sec
        results.append(row)
        print(
            f"load factor {row['load_factor']:.2f}: "
            + ", ".join(
                f"{op} {row[f'{op}_keys_per_s'] / 1e6:.1f} M/s ({row[f'{op}_keys_per_s'] / row[f'dict_{op}_keys_per_s']:.0f}x dict)"
                for op in OPS
            ),
            flush=True,
        )
        table = None  # freed before the next table is built
    return results


def report_values(cfg: Config, results: list[dict[str, object]]) -> str:
    """The --hkv / --dims table: 10^9 keys/s per op, beside HKV's A100 figure where it has one."""
    header = ["load factor", "dim"] + [f"{op} B keys/s (× HKV A100)" for op in OPS]
    rows = []
    for r in results:
        anchor = HKV_A100.get((r["dim"], round(r["load_factor"], 2)))
        cells = [f"{r['load_factor']:.2f}", r["dim"]]
        for i, op in enumerate(OPS):
            ours = r[f"{op}_keys_per_s"] / 1e9
            cells.append(f"{ours:.3f}" + (f" ({ours / anchor[i]:.2f}×)" if anchor else ""))
        rows.append(cells)
    device = (
        torch.cuda.get_device_name() if cfg.device.startswith("cuda") else f"cpu ({torch.get_num_threads()} threads)"
    )
    mix = f"{cfg.hit_rate:.0%} resident keys per call" if cfg.hit_rate >= 0 else "find all resident, upserts half"
    title = (
        f"HashTable with values on {device}: capacity {cfg.capacity:,} slots, {cfg.batch:,} keys per call "
        f"({mix}), LRU, float32 values gathered/scattered in the timed call (HierarchicalKV's workload), "
        f"median of {cfg.repeats}"
    )
    note = (
        "HKV A100 figures (1x A100 80GB PCIe, its README) converted to 10^9 keys/s; HKV keeps the values "
        "inside its table, we gather/scatter a separate [capacity + batch, dim] tensor by the returned rows."
    )
    return "\n".join([title, "", markdown_table(header, rows), "", note])


def report(cfg: Config, results: list[dict[str, object]]) -> str:
    if cfg.dims != (0,):
        return report_values(cfg, results)
    header = ["load factor"] + [f"{op} M keys/s (× dict, × sorted)" for op in OPS]
    rows = []
    for r in results if cfg.baselines else []:
        cells = [f"{r['load_factor']:.2f}"]
        for op in OPS:
            ours = r[f"{op}_keys_per_s"]
            cells.append(
                f"{ours / 1e6:.1f} ({ours / r[f'dict_{op}_keys_per_s']:.0f}×, {ours / r[f'sorted_{op}_keys_per_s']:.1f}×)"
            )
        rows.append(cells)
    if not cfg.baselines:
        rows = [[f"{r['load_factor']:.2f}"] + [f"{r[f'{op}_keys_per_s'] / 1e6:.1f}" for op in OPS] for r in results]
        header = ["load factor"] + [f"{op} M keys/s" for op in OPS]
    base = [] if not cfg.baselines else ["", "Baselines, M keys/s (dict / sorted):"]
    for r in results if cfg.baselines else []:
        base.append(
            f"- load factor {r['load_factor']:.2f}: "
            + "; ".join(
                f"{op} {r[f'dict_{op}_keys_per_s'] / 1e6:.2f} / {r[f'sorted_{op}_keys_per_s'] / 1e6:.2f}" for op in OPS
            )
        )
    title = (
        f"HashTable on {cfg.device} ({torch.get_num_threads()} threads): capacity {cfg.capacity:,} slots, "
        f"{cfg.batch:,} keys per call, LRU, median of {cfg.repeats}"
        + (", slots mapped to rows (a growing table's index)" if cfg.mapped_rows else "")
    )
    return "\n".join([title, "", markdown_table(header, rows)] + base)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--capacity", type=int, default=Config.capacity)
    parser.add_argument("--batch", type=int, default=Config.batch)
    parser.add_argument("--repeats", type=int, default=Config.repeats)
    parser.add_argument("--load-factors", type=float, nargs="+", default=list(Config.load_factors))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--hkv",
        action="store_true",
        help="HierarchicalKV's configuration (see above); "
        "--capacity/--batch/--repeats/--load-factors/--dims given explicitly override it",
    )
    parser.add_argument("--dims", type=int, nargs="+", default=None, help="value dims moved per call")
    parser.add_argument("--hit-rate", type=float, default=None, help="resident share of every call's keys")
    parser.add_argument("--no-baselines", action="store_true", help="skip the dict and sorted-array indexes")
    parser.add_argument("--no-save", action="store_true", help="print only; write nothing under results/")
    parser.add_argument("--mapped-rows", action="store_true", help="a growing table's index (slots mapped to rows)")
    parser.add_argument(
        "--kernels", action="store_true", help="also profile one call of each upsert: own time per kernel (--dims runs)"
    )
    args = parser.parse_args()
    base = hkv_config(args.device) if args.hkv else Config(device=args.device)
    given = {
        name: getattr(args, name)
        for name in ("capacity", "batch", "repeats")
        if getattr(args, name) != getattr(Config, name)
    }
    if args.load_factors != list(Config.load_factors):
        given["load_factors"] = tuple(args.load_factors)
    if args.dims is not None:
        given["dims"] = tuple(args.dims)
    if args.hit_rate is not None:
        given["hit_rate"] = args.hit_rate
    if args.no_baselines:
        given["baselines"] = False
    if args.mapped_rows:
        given["mapped_rows"] = True
    if args.kernels:
        given["kernels"] = True
    cfg = dataclasses.replace(base, **given)
    results = run(cfg)
    text = report(cfg, results)
    print(text)
    if not args.no_save:
        save(
            f"hash_table_{cfg.device.split(':')[0]}{'_hkv' if cfg.hkv else ''}{'_mapped' if cfg.mapped_rows else ''}",
            {"config": dataclasses.asdict(cfg), "results": results},
            text,
        )


if __name__ == "__main__":
    main()
