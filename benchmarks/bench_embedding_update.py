"""CPU cost per row of the fused update op (ops.fused_update, fused Adagrad) by storage dtype, with
the rows in cache (compute-bound: the conversions and stochastic rounding show, not DRAM): one
table of `rows` rows x dim, `unique` of them stepped per call, CPU seconds per call, the best of
`chunks` chunks of `calls` calls (CPU time, so a loaded machine counts less), one thread.

The float16 path is chosen when the library loads (AVX-512, else F16C, else portable): compare
them by running again with TORCHREC_EXT_NO_AVX512=1 or TORCHREC_EXT_NO_F16C=1.

    PYTHONPATH=. python benchmarks/bench_embedding_update.py
    TORCHREC_EXT_NO_AVX512=1 PYTHONPATH=. python benchmarks/bench_embedding_update.py   # the F16C two-pass path
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import parse_config

CASES = (
    ("FP32", torch.float32, False),
    ("FP16 stochastic", torch.float16, True),
    ("FP16 nearest", torch.float16, False),
    ("BF16 stochastic", torch.bfloat16, True),
    ("BF16 nearest", torch.bfloat16, False),
)


@dataclasses.dataclass
class Config:
    rows: int = 4096
    unique: int = 4000
    ids: int = 6000
    dim: int = 64
    calls: int = 50
    chunks: int = 15
    seed: int = 0


def ns_per_row(cfg: Config, dtype: torch.dtype, stochastic: bool) -> float:
    from torchrec_ext import ops, vocabulary

    gen = torch.Generator().manual_seed(cfg.seed)
    rows = torch.randperm(cfg.rows, generator=gen)[: cfg.unique]
    grad = torch.randn(cfg.ids, cfg.dim, generator=gen) * 1e-3
    weights = torch.zeros(vocabulary.table_words(cfg.rows, cfg.dim, dtype))
    weights.view(dtype)[: cfg.rows * cfg.dim].copy_(torch.randn(cfg.rows * cfg.dim, generator=gen))
    states = [torch.rand(cfg.rows * cfg.dim, generator=gen)]
    kwargs = dict(
        table_offsets=torch.tensor([0]),
        table_dims=torch.tensor([cfg.dim]),
        state_row_offsets=torch.tensor([0]),
        unique_rows=rows,
        unique_table=torch.zeros(cfg.unique, dtype=torch.int64),
        inverse=torch.randint(0, cfg.unique, (cfg.ids,), generator=gen),
        offsets=None,
        per_sample_weights=None,
        feature_col=torch.zeros(0, dtype=torch.int64),
        feature_mean=torch.zeros(0, dtype=torch.bool),
        batch_size=0,
        optimizer=vocabulary.OPTIMIZERS["adagrad"],
        hparams=(0.01, 1e-8, 0.9, 0.999, 0.0, 0.0),
        step=3,
        table_dtypes=torch.tensor([vocabulary.dtype_code(dtype)]),
        unique_ids=rows * 7 + 1,
        rounding_seeds=torch.tensor([12345 if stochastic else 0]),
    )
    best = float("inf")
    for _ in range(cfg.chunks):
        start = time.process_time()
        for _ in range(cfg.calls):
            ops.fused_update(grad, weights, states, **kwargs)
        best = min(best, (time.process_time() - start) / cfg.calls)
    return best * 1e9 / cfg.unique


def main() -> None:
    cfg, _ = parse_config(Config, __doc__)
    torch.set_num_threads(1)
    switches = [k for k in ("TORCHREC_EXT_NO_AVX512", "TORCHREC_EXT_NO_F16C") if k in os.environ]
    print(
        f"fused Adagrad update, {cfg.unique:,} of {cfg.rows:,} rows x dim {cfg.dim} per call, in cache, "
        f"1 thread{', ' + ', '.join(switches) if switches else ''}"
    )
    for name, dtype, stochastic in CASES:
        print(f"{name:16s} {ns_per_row(cfg, dtype, stochastic):6.1f} ns / row", flush=True)


if __name__ == "__main__":
    main()
