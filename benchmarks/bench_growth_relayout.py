"""Time a growing module spends in its growths' relayouts (``DynamicTables._relayout``: giving
the tables their new capacities; on CPU no row moves and the new rows' pages are first touched
by the steps that write them, elsewhere the rows are copied into new buffers), in one process: 8
tables x dim 64 of ``capacity`` rows each, fused Adagrad, ``initial_capacity`` = capacity / 64,
trained on fresh random ids (4 per bag, 4096 bags per table) until full. A quick, in-process
companion to bench_growth.py (which times whole runs in fresh processes): wall and CPU seconds
in relayouts, minor page faults there, and the process's peak resident memory. Prints only.

    PYTHONPATH=. python benchmarks/bench_growth_relayout.py --capacity 262144
"""

from __future__ import annotations

import dataclasses
import os
import resource
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import parse_config


@dataclasses.dataclass
class Config:
    capacity: int = 1 << 18
    num_tables: int = 8
    dim: int = 64
    batch_size: int = 4096
    threads: int = 1
    seed: int = 0


def main() -> None:
    from torchrec import KeyedJaggedTensor

    from torchrec_ext import DynamicEmbeddingBagCollection, DynamicEmbeddingBagConfig
    from torchrec_ext.modules import dynamic_tables

    cfg, _ = parse_config(Config, __doc__)
    torch.set_num_threads(cfg.threads)
    spent = {"wall": 0.0, "cpu": 0.0, "faults": 0, "relayouts": 0}
    relayout = dynamic_tables.DynamicTables._relayout

    def timed(self, *args, **kwargs):
        faults, wall, cpu = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter(), time.process_time()
        relayout(self, *args, **kwargs)
        spent["wall"] += time.perf_counter() - wall
        spent["cpu"] += time.process_time() - cpu
        spent["faults"] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        spent["relayouts"] += 1

    dynamic_tables.DynamicTables._relayout = timed
    features = [f"f{i}" for i in range(cfg.num_tables)]
    module = DynamicEmbeddingBagCollection(
        [
            DynamicEmbeddingBagConfig(
                name=f"t{i}",
                embedding_dim=cfg.dim,
                num_embeddings=cfg.capacity,
                feature_names=[f],
                initial_capacity=max(cfg.capacity // 64, 1),
            )
            for i, f in enumerate(features)
        ],
        optimizer="adagrad",
        optimizer_kwargs={"lr": 0.01},
    )
    gen = torch.Generator().manual_seed(cfg.seed)
    start, steps = time.perf_counter(), 0
    while module.table_stats()["t0"].capacity < cfg.capacity:
        ids = torch.randint(0, 2**62, (cfg.num_tables * cfg.batch_size * 4,), generator=gen)
        lengths = torch.full((cfg.num_tables * cfg.batch_size,), 4)
        module(KeyedJaggedTensor.from_lengths_sync(features, ids, lengths)).values().sum().backward()
        steps += 1
    total = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    print(
        f"{spent['relayouts']} relayouts: {spent['wall']:.2f} s wall, {spent['cpu']:.2f} s CPU, "
        f"{spent['faults']} minor faults; {steps} steps in {total:.2f} s; peak RSS {peak} MiB"
    )


if __name__ == "__main__":
    main()
