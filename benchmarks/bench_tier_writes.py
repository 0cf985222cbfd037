"""Write-backs into a tiered table's backing file: scattered rows written through the memory
map (``index_copy_``, what ``tiered_tables._Mover`` does; rows unsorted or sorted by offset)
against explicit I/O (``os.pwrite`` of each run of consecutive rows, sorted). Each trial first
syncs the file, so that its pages are clean and write-protected, as after the kernel's
writeback: the mapping then takes a fault per page it writes. Prints the best of ``repeats``
trials per size (no results saved: a smoke measurement behind the choice of the mapped write).

Then the first writes into a new file, the case the trials above miss (their file is filled
first): a file only reserved (``posix_fallocate``: unwritten extents, whose first write through
the mapping converts them, a fault per page) against one written whole when made
(``tier_store.write_zeros``, what a new backing file gets).

    python benchmarks/bench_tier_writes.py                      # 1 GiB file, 2k..60k rows of dim 64
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch

from torchrec_ext.modules.tier_store import write_zeros


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1 << 22, help="rows in the file")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--writes", default="2000,8000,60000", help="rows written per trial")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    writes = [int(w) for w in args.writes.split(",")]
    directory = tempfile.mkdtemp(prefix="bench_tier_writes_")
    path = os.path.join(directory, "rows")
    row_bytes = args.dim * 4
    with open(path, "wb") as f:
        os.posix_fallocate(f.fileno(), 0, args.rows * row_bytes)
    mapped = torch.from_file(path, shared=True, size=args.rows * args.dim, dtype=torch.float32).view(
        args.rows, args.dim
    )
    mapped.fill_(1.0)
    fd = os.open(path, os.O_RDWR)
    source = torch.randn(max(writes), args.dim)
    gen = torch.Generator().manual_seed(0)

    def trial(k: int, how: str) -> float:
        rows = torch.randperm(args.rows, generator=gen)[:k]
        if how != "mmap unsorted":
            rows = rows.sort().values
        data = source[:k]
        os.sync()
        start = time.perf_counter()
        if how.startswith("mmap"):
            mapped.index_copy_(0, rows, data)
        else:
            array, r, i = data.numpy(), rows.tolist(), 0
            while i < k:  # one pwrite per run of consecutive rows
                j = i + 1
                while j < k and r[j] == r[j - 1] + 1:
                    j += 1
                os.pwrite(fd, array[i:j].tobytes(), r[i] * row_bytes)
                i = j
        return time.perf_counter() - start

    def first_writes(k: int, written: bool) -> float:
        fresh = os.path.join(directory, "fresh")
        with open(fresh, "wb") as f:
            os.posix_fallocate(f.fileno(), 0, args.rows * row_bytes)
            if written:
                write_zeros(f.fileno(), 0, args.rows * row_bytes)
        rows = torch.randperm(args.rows, generator=gen)[:k].sort().values
        target = torch.from_file(fresh, shared=True, size=args.rows * args.dim, dtype=torch.float32)
        start = time.perf_counter()
        target.view(args.rows, args.dim).index_copy_(0, rows, source[:k])
        elapsed = time.perf_counter() - start
        del target
        os.unlink(fresh)
        return elapsed

    try:
        for k in writes:
            print(
                f"{k:>6} rows, first writes into a new file: "
                + ", ".join(
                    f"{how} {first_writes(k, how == 'written whole') * 1e3:.1f} ms"
                    for how in ("reserved only", "written whole")
                )
            )
        for k in writes:
            best = {
                how: min(trial(k, how) for _ in range(args.repeats))
                for how in ("mmap sorted", "mmap unsorted", "pwrite sorted runs")
            }
            print(f"{k:>6} rows: " + ", ".join(f"{how} {t * 1e3:.1f} ms" for how, t in best.items()))
    finally:
        os.close(fd)
        mapped = None  # unmapped before the file goes
        os.unlink(path)
        os.rmdir(directory)


if __name__ == "__main__":
    main()
