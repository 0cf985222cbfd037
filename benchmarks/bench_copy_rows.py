"""Row copies of a tiered table's moves between its cache and its backing store: ``ops.copy_rows``
(one ``memcpy`` a row, the rows ahead prefetched: csrc/copy_rows_cpu.cpp) against what
tiered_tables.py did: torch's ``index_copy_`` (and ``index_select`` before it where both sides
are indexed), ``index_select`` into a records buffer's field. Per stage
at dlrm-small scale a table writes back ~7k rows and reads ~1k (dim 64: a 256-byte vector and a
256-byte Adagrad state a row), between a cache of 210k slots and a backing store of 1M rows.
Median of ``--repeats`` after a warm-up, one thread, the ratio to torch in the same process.

    PYTHONPATH=. python benchmarks/bench_copy_rows.py            # saves results/tier_copy_rows.{md,jsonl}
    PYTHONPATH=. python benchmarks/bench_copy_rows.py --repeats 5 --no-save  # smoke
"""

from __future__ import annotations

import argparse

import torch
from common import markdown_table, median_seconds, save

from torchrec_ext import ops, torch_kernels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=7000, help="rows a copy moves")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--cache-rows", type=int, default=209_715)
    parser.add_argument("--backing-rows", type=int, default=1 << 20)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    results, table = [], []
    for dtype in (torch.float32, torch.float16):
        cache = torch.randn(args.cache_rows, args.dim, generator=g).to(dtype)
        backing = torch.zeros(args.backing_rows, args.dim, dtype=dtype)
        slots = torch.randperm(args.cache_rows, generator=g)[: args.rows]
        rows = torch.randperm(args.backing_rows, generator=g)[: args.rows].sort().values
        field = torch.randn(args.rows, args.dim, generator=g).to(dtype)
        cases = {
            # a host-backed write-back: cache slots -> backing rows
            "write-back (both indexed)": (
                lambda: torch_kernels.copy_rows(backing, rows, cache, slots),
                lambda: ops.copy_rows(backing, rows, cache, slots),
            ),
            # a log read's records into the cache: a field -> cache slots
            "records into the cache": (
                lambda: torch_kernels.copy_rows(cache, slots, field, None),
                lambda: ops.copy_rows(cache, slots, field, None),
            ),
            # a file-backed write-back's records: cache slots -> a field of the log's records
            "cache into records": (
                lambda: torch.index_select(cache, 0, slots, out=field),
                lambda: ops.copy_rows(field, None, cache, slots),
            ),
        }
        for name, (theirs, ours) in cases.items():
            torch_s = median_seconds(theirs, args.repeats)
            ours_s = median_seconds(ours, args.repeats)
            kind = str(dtype).replace("torch.", "")
            results.append({"case": name, "dtype": kind, "torch_ms": torch_s * 1e3, "copy_rows_ms": ours_s * 1e3})
            table.append([name, kind, f"{torch_s * 1e3:.3f}", f"{ours_s * 1e3:.3f}", f"{torch_s / ours_s:.2f}"])
        # What host backing's write-back no longer does first (``_Mover.ROWS_IN_ORDER``): sort by row.
        unsorted = (backing, torch.randperm(args.backing_rows, generator=g)[: args.rows], cache, slots)

        def sorted_copy(a=unsorted):
            order = a[1].argsort()
            ops.copy_rows(a[0], a[1][order], a[2], a[3][order])

        sorted_s = median_seconds(sorted_copy, args.repeats)
        unsorted_s = median_seconds(lambda a=unsorted: ops.copy_rows(*a), args.repeats)
        results.append(
            {
                "case": "write-back sorted by row first",
                "dtype": kind,
                "sorted_ms": sorted_s * 1e3,
                "copy_rows_ms": unsorted_s * 1e3,
            }
        )
        table.append(
            [
                "write-back: rows sorted first / not",
                kind,
                f"{sorted_s * 1e3:.3f}",
                f"{unsorted_s * 1e3:.3f}",
                f"{sorted_s / unsorted_s:.2f}",
            ]
        )
    text = (
        f"Row copies of {args.rows:,} rows of dim {args.dim} (cache {args.cache_rows:,} slots, backing "
        f"{args.backing_rows:,} rows), median of {args.repeats}, 1 thread\n\n"
        + markdown_table(["copy", "dtype", "torch ms (or sorted first)", "copy_rows ms", "speed-up"], table)
    )
    print(text)
    if not args.no_save:
        save("tier_copy_rows", {"config": vars(args), "results": results}, text)


if __name__ == "__main__":
    main()
