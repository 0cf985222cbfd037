"""The upsert of a training step's tables: table by table (``hash_upsert_fixed`` per table) against
one call for all tables (``hash_upsert_tables``), and a module's training step either way.

op: T tables of `capacity` rows each, filled to `load` with random int64 keys; each timed call
gives every table `keys` distinct keys, half of them resident and half new (the new ones evict
once the table is full). Every repeat starts from a copy of the filled tables (not timed).
step: a DynamicEmbeddingBagCollection of T tables (`capacity` rows, dim 16, one feature each,
`batch` samples of 2 ids drawn from 4 x capacity), a training step (forward, sum, fused backward)
with ``batched_upsert`` off and on; the tables fill and evict over the warm-up steps.

    python benchmarks/bench_upsert_tables.py                       # 26 tables of 100k rows, 4096 keys each
    python benchmarks/bench_upsert_tables.py --device cuda
    python benchmarks/bench_upsert_tables.py --tables 2 --capacity 4096 --keys 256 --batch 64 --repeats 3 --no-save  # smoke
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import markdown_table, median_seconds, save
from torchrec import KeyedJaggedTensor

from torchrec_ext import DynamicEmbeddingBagCollection, DynamicEmbeddingBagConfig, HashTable, ops
from torchrec_ext.vocabulary import POLICIES


def _filled_tables(args, device):
    g = torch.Generator().manual_seed(0)
    tables, resident = [], []
    for _ in range(args.tables):
        table = HashTable(args.capacity, policy="lru", device=device)
        keys = torch.randint(-(2**62), 2**62, (int(args.load * args.capacity),), generator=g).to(device)
        table.find_or_insert(keys)
        tables.append(table)
        resident.append(keys)
    batch = []
    for keys in resident:
        half = args.keys // 2
        old = keys[torch.randperm(keys.numel(), generator=g)[:half].to(device)]
        new = torch.randint(-(2**62), 2**62, (args.keys - half,), generator=g).to(device)
        batch.append(torch.cat([old, new]))
    return tables, torch.cat(batch)


def _copies(tables):
    return [[t._digests.clone(), t._slot_keys.clone(), t._slot_scores.clone(), t._size.clone()] for t in tables]


def bench_op(args, device):
    tables, keys = _filled_tables(args, device)
    offsets = [t * args.keys for t in range(args.tables + 1)]
    lru = POLICIES["lru"]

    def per_table(state):
        for t, s in enumerate(state):
            ops.hash_upsert_fixed(*s, keys[offsets[t] : offsets[t + 1]], None, None, args.capacity, lru, 2, 0, False)

    def one_call(state):
        ops.hash_upsert_tables(
            *[[s[i] for s in state] for i in range(4)],
            keys,
            offsets,
            None,
            None,
            [args.capacity] * args.tables,
            [lru] * args.tables,
            [2] * args.tables,
            [0] * args.tables,
            False,
        )

    setup = lambda: _copies(tables)
    return {
        name: median_seconds(fn, args.repeats, setup=setup)
        for name, fn in (("per_table", per_table), ("one_call", one_call))
    }


def _kjt(args, step, device):
    g = torch.Generator().manual_seed(step)
    values = torch.randint(0, 4 * args.capacity, (args.tables * args.batch * 2,), generator=g)
    return KeyedJaggedTensor(
        keys=[f"f{t}" for t in range(args.tables)],
        values=values.to(device),
        lengths=torch.full((args.tables * args.batch,), 2, device=device),
        stride=args.batch,
    )


def bench_step(args, device):
    out = {}
    for batched in (False, True):
        configs = [
            DynamicEmbeddingBagConfig(
                name=f"t{t}", embedding_dim=16, num_embeddings=args.capacity, feature_names=[f"f{t}"]
            )
            for t in range(args.tables)
        ]
        module = DynamicEmbeddingBagCollection(configs, optimizer="adagrad", device=device)
        module._tables.batched_upsert = batched
        batches = [_kjt(args, step, device) for step in range(4)]
        state = {"i": 0}

        def step():
            kjt = batches[state["i"] % len(batches)]
            state["i"] += 1
            module(kjt).values().sum().backward()

        for _ in range(4):
            step()
        out["batched" if batched else "per_table"] = median_seconds(step, args.repeats)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tables", type=int, default=26)
    parser.add_argument("--capacity", type=int, default=100_000)
    parser.add_argument("--load", type=float, default=1.0)
    parser.add_argument("--keys", type=int, default=4096, help="keys per table per op call")
    parser.add_argument("--batch", type=int, default=2048, help="samples per module step")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args()
    device = torch.device(args.device)
    op, step = bench_op(args, device), bench_step(args, device)
    rows = [
        [
            "op: upsert of all tables",
            f"{op['per_table'] * 1e3:.3f}",
            f"{op['one_call'] * 1e3:.3f}",
            f"{op['per_table'] / op['one_call']:.2f}x",
        ],
        [
            "module training step",
            f"{step['per_table'] * 1e3:.3f}",
            f"{step['batched'] * 1e3:.3f}",
            f"{step['per_table'] / step['batched']:.2f}x",
        ],
    ]
    table = markdown_table(["", "per table (ms)", "one call (ms)", "speed-up"], rows)
    text = (
        f"# Upsert of {args.tables} tables: per table vs one call ({device})\n\n"
        f"`python benchmarks/bench_upsert_tables.py --tables {args.tables} --capacity {args.capacity} "
        f"--keys {args.keys} --batch {args.batch} --device {args.device}`: {args.tables} tables of "
        f"{args.capacity} rows at load {args.load}, {args.keys} keys per table per call (half new); "
        f"module step: batch {args.batch}, 2 ids per sample per table, dim 16, adagrad.\n\n{table}"
    )
    print(text)
    if not args.no_save:
        save(f"upsert_tables_{device.type}", {"args": vars(args), "op": op, "step": step}, text)


if __name__ == "__main__":
    main()
