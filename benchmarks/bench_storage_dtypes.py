"""Bytes per live row of a dynamic table by storage dtype (``data_type`` FP32 / FP16 / BF16) and
fused optimizer, at dim 64: vectors in the table's dtype + float32 optimizer state + index
metadata (17 B per slot), over the rows that hold an id once the table has been filled by
training on fresh ids. Goal (issue 15): FP16 + RowWiseAdagrad <= 0.55x the FP32 figure.

    python benchmarks/bench_storage_dtypes.py               # saves results/storage_dtypes_cpu.*
    python benchmarks/bench_storage_dtypes.py --capacity 4096 --no-save
"""

from __future__ import annotations

import dataclasses
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import markdown_table, parse_config, save

DATA_TYPES = ("FP32", "FP16", "BF16")
OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad", "adam", "adamw", "ftrl")


@dataclasses.dataclass
class Config:
    dim: int = 64
    capacity: int = 1 << 16
    batch_ids: int = 1 << 14  # fresh ids per training step while filling
    seed: int = 0


def measure(cfg: Config, data_type: str, optimizer: str) -> dict[str, float]:
    from torchrec import DataType, KeyedJaggedTensor

    from torchrec_ext import DynamicEmbeddingBagCollection, DynamicEmbeddingBagConfig

    table = DynamicEmbeddingBagConfig(
        name="t",
        embedding_dim=cfg.dim,
        num_embeddings=cfg.capacity,
        feature_names=["f"],
        data_type=DataType[data_type],
        seed=cfg.seed,
    )
    module = DynamicEmbeddingBagCollection([table], optimizer=optimizer, optimizer_kwargs={"lr": 0.01})
    gen = torch.Generator().manual_seed(cfg.seed)
    for _ in range(cfg.capacity // cfg.batch_ids):  # as many fresh ids as rows
        ids = torch.randint(-(2**62), 2**62, (cfg.batch_ids,), generator=gen)
        kjt = KeyedJaggedTensor(keys=["f"], values=ids, lengths=torch.ones(cfg.batch_ids, dtype=torch.int64))
        module(kjt).values().sum().backward()
    live = module.num_live_rows()
    return {
        "bytes": module.storage_bytes(),
        "live_rows": live,
        "bytes_per_live_row": module.storage_bytes() / live,
        "bytes_per_row_of_capacity": module.storage_bytes() / cfg.capacity,
    }


def main() -> None:
    cfg, save_results = parse_config(Config, __doc__)
    results: dict[tuple[str, str], dict[str, float]] = {}
    for optimizer in OPTIMIZERS:
        for data_type in DATA_TYPES:
            results[(optimizer, data_type)] = measure(cfg, data_type, optimizer)
            r = results[(optimizer, data_type)]
            print(
                f"{optimizer} {data_type}: {r['bytes_per_live_row']:.1f} B / live row ({r['live_rows']:,} live)",
                flush=True,
            )
    rows = []
    for optimizer in OPTIMIZERS:
        base = results[(optimizer, "FP32")]["bytes_per_live_row"]
        rows.append(
            [optimizer]
            + [f"{results[(optimizer, d)]['bytes_per_live_row']:.1f}" for d in DATA_TYPES]
            + [f"{results[(optimizer, d)]['bytes_per_live_row'] / base:.3f}" for d in DATA_TYPES[1:]]
        )
    live = results[("rowwise_adagrad", "FP16")]["live_rows"]
    text = "\n".join(
        [
            f"Bytes per live row of one dynamic table, dim {cfg.dim}, capacity {cfg.capacity:,}, filled by training on "
            f"{cfg.capacity:,} fresh ids ({live:,} hold a row): vectors in the data_type + float32 optimizer state + "
            "17 B index metadata per slot, over the live rows.",
            "",
            markdown_table(
                ["optimizer"] + [f"{d} B / live row" for d in DATA_TYPES] + [f"{d} / FP32" for d in DATA_TYPES[1:]],
                rows,
            ),
            "",
            "Goal: FP16 + rowwise_adagrad <= 0.55x FP32: "
            f"{results[('rowwise_adagrad', 'FP16')]['bytes_per_live_row'] / results[('rowwise_adagrad', 'FP32')]['bytes_per_live_row']:.3f}x.",
        ]
    )
    print(text)
    if save_results:
        save(
            "storage_dtypes_cpu",
            {"config": dataclasses.asdict(cfg), "results": {f"{o}/{d}": r for (o, d), r in results.items()}},
            text,
        )


if __name__ == "__main__":
    main()
