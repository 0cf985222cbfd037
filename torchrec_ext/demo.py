"""A short demo of the dynamic hash table on a heavy-tailed id stream.

Streams batches of raw 64-bit ids drawn from a Zipf-like distribution into a table smaller
than the id space, and prints per batch: live rows, load factor, how many ids were new, how
many rows were evicted, and the lookup throughput. Run: ``python -m torchrec_ext.demo``.
"""
from __future__ import annotations

import argparse
import time

import torch

from torchrec_ext import HashTable


def zipf_ids(n: int, vocab: int, alpha: float, gen: torch.Generator) -> torch.Tensor:
    """n ids whose ranks follow p(rank) ~ rank^-alpha over `vocab` ranks, hashed into 2^63."""
    ranks = torch.arange(1, vocab + 1, dtype=torch.float64)
    probs = ranks.pow(-alpha)
    rank = torch.multinomial(probs / probs.sum(), n, replacement=True, generator=gen)
    return (rank * 0x9E3779B97F4A7C15 + 12345) & ((1 << 62) - 1)  # spread over a 2^62 space


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--capacity", type=int, default=1 << 18)
    parser.add_argument("--vocab", type=int, default=4 << 20, help="distinct ids in the stream")
    parser.add_argument("--batch", type=int, default=1 << 17)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--policy", default="lfu")
    args = parser.parse_args()

    gen = torch.Generator().manual_seed(0)
    table = HashTable(args.capacity, policy=args.policy)
    print(f"{table}: {table.metadata_bytes_per_slot():.0f} bytes of index per slot, "
          f"{args.vocab:,} distinct ids in the stream, {args.batch:,} ids per batch")
    print(f"{'step':>4} {'live rows':>10} {'load':>6} {'new ids':>8} {'evicted':>8} {'refused':>8} {'M ids/s':>8}")
    for step in range(args.steps):
        ids = zipf_ids(args.batch, args.vocab, 1.05, gen)
        start = time.perf_counter()
        result = table.find_or_insert(ids)
        seconds = time.perf_counter() - start
        print(f"{step:>4} {table.size():>10,} {table.load_factor():>6.2f} {int(result.inserted.sum()):>8,} "
              f"{result.evicted_keys.numel():>8,} {int((result.rows < 0).sum()):>8,} {args.batch / seconds / 1e6:>8.1f}")
    hot = zipf_ids(10_000, 1000, 1.05, gen)  # the head of the distribution
    print(f"head ids still resident: {float(table.find(hot)[1].float().mean()):.1%}")


if __name__ == "__main__":
    main()
