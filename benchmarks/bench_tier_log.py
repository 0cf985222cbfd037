"""Write-backs of a file-backed tiered table: in place (each row's vector and optimizer state
written through the mapping of the base files, ``tiered_tables._Mover``, what file backing did
before the log) against appended to the table's log (``tiered_tables._LogMover``, one record a
row, one ``pwrite`` a batch: tier_log.py), and, for scale, host memory (``backing="host"``). Rounds of ``--rows-per-round`` distinct random rows
(the dlrm-small stage writes back ~7k rows a table a step) of one table (dim 64, fused Adagrad:
a 256-byte vector + a 256-byte state a row). Before each round the files are synced, so that
their pages are clean and write-protected, as the kernel's flusher leaves them once the dirty
pages pass its background limit (what a full-size table does: results/tier_file_writes.md,
section 5): an in-place write-back then takes a write fault per page it touches, two a row.
Timed: the write-back call only; then the reads of rows from their newest copies (what a
stage's misses cost). Smoke-size by default (64 MiB files); prints, saves nothing.

    PYTHONPATH=$PWD python benchmarks/bench_tier_log.py
    PYTHONPATH=$PWD python benchmarks/bench_tier_log.py --capacity 1048576 --rounds 40  # the dlrm-small table
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch

from torchrec_ext import DynamicEmbeddingBagCollection, DynamicEmbeddingBagConfig
from torchrec_ext.modules.tiered_tables import _Mover


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--capacity", type=int, default=1 << 18, help="rows of the table")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--rows-per-round", type=int, default=7000)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--no-sync", action="store_true", help="leave the pages dirty between rounds")
    args = parser.parse_args()
    torch.set_num_threads(1)
    directory = tempfile.mkdtemp(prefix="bench_tier_log_")
    try:
        config = DynamicEmbeddingBagConfig(
            name="t",
            embedding_dim=args.dim,
            num_embeddings=args.capacity,
            feature_names=["f"],
            backing=f"file:{directory}",
            cache_load_factor=0.2,
        )
        module = DynamicEmbeddingBagCollection([config], optimizer=torch.optim.Adagrad, optimizer_kwargs={"lr": 0.01})
        tables = module._tables
        log_mover = tables._mover(0)
        in_place = _Mover(log_mover.pairs)
        host = _Mover([(cache, torch.zeros_like(backing)) for cache, backing in log_mover.pairs])  # backing="host"
        slots = tables.caches[0].slots
        for cache, _ in log_mover.pairs:
            cache.copy_(torch.randn(cache.shape).to(cache.dtype))
        gen = torch.Generator().manual_seed(0)
        fds = [os.open(os.path.join(directory, name), os.O_RDWR) for name in sorted(os.listdir(directory))]
        print(
            f"table: {args.capacity:,} rows x dim {args.dim} + Adagrad state ({in_place.row_bytes} bytes a row); "
            f"{args.rows_per_round:,} rows written back a round, {args.rounds} rounds, files "
            f"{'left dirty' if args.no_sync else 'synced before each round'}"
        )
        for name, mover in (("host memory", host), ("in place (mapped)", in_place), ("log (appended)", log_mover)):
            write_us, read_us = [], []
            for _ in range(args.rounds):
                rows = torch.randperm(args.capacity, generator=gen)[: args.rows_per_round]
                cache_slots = torch.randint(0, slots, (rows.numel(),), generator=gen)
                if not args.no_sync:
                    for fd in fds:
                        os.fdatasync(fd)
                start = time.perf_counter()
                mover.write(cache_slots, rows)
                write_us.append((time.perf_counter() - start) * 1e6 / rows.numel())
                back = rows[: args.rows_per_round // 8]
                start = time.perf_counter()
                mover.read(torch.arange(back.numel()), back)
                read_us.append((time.perf_counter() - start) * 1e6 / back.numel())
            log = log_mover.log
            print(
                f"  {name:18s} write-back {statistics.median(write_us):6.2f} us/row (median of rounds; first "
                f"{write_us[0]:.2f}), read {statistics.median(read_us):5.2f} us/row"
                + (
                    f"; log: {log.live:,} live records, {int(log.in_use.sum())} segments used, "
                    f"{log.segments_cleaned} cleaned"
                    if mover is log_mover
                    else ""
                )
            )
        for fd in fds:
            os.close(fd)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
