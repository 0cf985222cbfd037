"""Sequence-lookup kernel bandwidth (torchrec_ext/triton_kernels/embedding_lookup.py,
EmbeddingCollection's unpooled gather) on a GPU: the tile sequence_lookup picks against the
tile before the wide-tile change (32 elements a thread from dim 65 on), timed alternately in one
process, with torch's embedding over the same buffer as a baseline.

    PYTHONPATH=. python benchmarks/bench_sequence_lookup.py --dim 128 --no-save
    PYTHONPATH=. python benchmarks/bench_sequence_lookup.py --dim 100 --dtype float16 --no-save
    TRITON_INTERPRET=1 PYTHONPATH=. python benchmarks/bench_sequence_lookup.py --smoke 1 --no-save  # CPU

The case: `num_tables` tables of `rows` x `dim` rows in one flat buffer, one feature per table of
`values` uniform random ids each (rows come from DRAM, not L2). Bytes counted: every distinct
row once (in its storage dtype) + the ids read + the float32 output written. Times: the
profiler's GPU time per call (every kernel a call launches, the output's memset included),
median over `rounds` alternations of the two tiles.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_pooled_lookup
from bench_pooled_lookup import DTYPES, _mirrored, copy_gbps, kernel_seconds, seconds_per_call
from common import markdown_table, parse_config, save, triton_device


@dataclasses.dataclass
class Config:
    num_tables: int = 8
    dim: int = 128
    values: int = 16384  # ids per feature
    rows: int = 1_000_000
    dtype: str = "float32"
    rounds: int = 5  # alternations of the two tiles
    repeats: int = 5
    calls: int = 20
    copy_mib: int = 1024
    smoke: int = 0  # 1: tiny sizes (a CPU run under TRITON_INTERPRET=1 checks the script only)
    seed: int = 0


def make_case(cfg: Config, device: torch.device) -> dict:
    """sequence_lookup's keyword arguments, on `device`: bench_pooled_lookup's tables and ids (bags
    of one id, `values` a feature), the bags' offsets turned into each feature's value range."""
    pooled = bench_pooled_lookup.Config(
        num_tables=cfg.num_tables, dim=cfg.dim, batch_size=cfg.values, min_bag=1, max_bag=1, rows=cfg.rows
    )
    case = bench_pooled_lookup.make_case(dataclasses.replace(pooled, dtype=cfg.dtype, seed=cfg.seed), device)
    keep = ("weights", "table_offsets", "feature_table", "rows", "table_dtypes")
    fvo = _mirrored(torch.arange(cfg.num_tables + 1) * cfg.values, device)
    return dict({k: case[k] for k in keep}, dim=cfg.dim, feature_value_offsets=fvo)


def session14_tile(dim: int):
    """The sequence lookup's tile before the wide-tile change."""
    import triton

    block_d = min(triton.next_power_of_2(max(dim, 1)), 256)
    block_n = max(1, min(32, 4096 // block_d))
    return block_d, block_n, 4 if block_d * block_n >= 2048 else 2


def main() -> None:
    cfg, save_results = parse_config(Config, __doc__)
    if cfg.smoke:
        cfg = dataclasses.replace(
            cfg, num_tables=2, dim=100, values=40, rows=64, rounds=1, repeats=1, calls=1, copy_mib=1
        )
    device = triton_device("bench_sequence_lookup")
    from torchrec_ext.reference import sequence_lookup as reference
    from torchrec_ext.triton_kernels import embedding_lookup

    case = make_case(cfg, device)
    op = lambda: embedding_lookup.sequence_lookup(**case)
    now = embedding_lookup._sequence_blocks
    tiles = {"ours": now, "ours, session-14 tile": session14_tile}
    if cfg.smoke:  # a CPU run is only a check: both tiles against the reference
        for tile in tiles.values():
            embedding_lookup._sequence_blocks = tile
            assert torch.equal(op(), reference(**case))
        embedding_lookup._sequence_blocks = now
    dtype = DTYPES[cfg.dtype]
    table_of_value = torch.arange(cfg.num_tables, device=device).repeat_interleave(cfg.values)
    distinct = int(torch.unique(table_of_value * cfg.rows + case["rows"]).numel())
    n = case["rows"].numel()
    counted = distinct * cfg.dim * dtype.itemsize + n * 8 + n * cfg.dim * 4
    copy_ref = copy_gbps(cfg.copy_mib << 20, dataclasses.replace(cfg, repeats=3), device)

    timed = {name: [] for name in [*tiles, "torch embedding"]}
    table = case["weights"].view(dtype)[: cfg.num_tables * cfg.rows * cfg.dim].view(-1, cfg.dim)
    ids = case["rows"] + table_of_value * cfg.rows
    baseline = lambda: torch.nn.functional.embedding(ids, table)
    for _ in range(cfg.rounds):  # alternated: a drifting clock or neighbour hits both tiles alike
        for name, tile in tiles.items():
            embedding_lookup._sequence_blocks = tile
            timed[name].append(kernel_seconds(op, cfg, device) or seconds_per_call(op, cfg, device))
        embedding_lookup._sequence_blocks = now
        timed["torch embedding"].append(
            kernel_seconds(baseline, cfg, device) or seconds_per_call(baseline, cfg, device)
        )
    results = []
    for name, secs in timed.items():
        sec = statistics.median(secs)
        tile = tiles.get(name, lambda dim: None)(cfg.dim)
        results.append({"system": name, "tile": tile, "us": sec * 1e6, "GBps": counted / sec / 1e9})
        results[-1]["of_copy_1GiB"] = results[-1]["GBps"] / copy_ref
    record = {"config": dataclasses.asdict(cfg), "device": device.type, "copy_GBps_1GiB": copy_ref}
    record.update(bytes_counted=counted, results=results)
    md = (
        f"Sequence lookup, {cfg.num_tables} tables x dim {cfg.dim} ({cfg.dtype}), {cfg.values} ids a feature, "
        f"{cfg.rows:,} rows a table: {counted / 1e6:.1f} MB counted. Copy bandwidth {copy_ref:.0f} GB/s "
        f"({cfg.copy_mib} MiB). Kernel time, median of {cfg.rounds} alternations.\n\n"
        + markdown_table(
            ["system", "(BLOCK_D, BLOCK_N, warps)", "µs", "GB/s", "of 1 GiB copy"],
            [
                [r["system"], str(r["tile"] or ""), f"{r['us']:.1f}", f"{r['GBps']:.0f}", f"{r['of_copy_1GiB']:.1%}"]
                for r in results
            ],
        )
    )
    print(md)
    if save_results:
        save(f"sequence_lookup_{device.type}_dim{cfg.dim}_{cfg.dtype}", record, md)


if __name__ == "__main__":
    main()
