"""Serving lookups: our InferenceEmbeddingBagCollection against TorchRec's quantized
EmbeddingBagCollection holding the same rows, in one process (issue 17: p50 at batch 512 <= 1.5x
theirs; ours includes the id -> row hash step, theirs reads a precomputed index).

Tables: `num_tables` tables of `rows` live ids (random int64; ours at load factor 0.8) x `dim`, one feature each, sum
pooling, `pooling` ids per bag (a fraction `unseen` of them ids no table holds). Systems:

- torchrec_int8: TorchRec's quantized EBC (int8 rows, fbgemm's CPU TBE), fed KJTs whose ids were
  mapped to row indices beforehand (unseen ids to a zero row), untimed;
- ours_int8 / ours_fp16 / ours_fp32: convert_to_inference of the same rows, fed the raw ids;
- ours_hash_step: of ours_int8's work, the KJT checks and the id -> row step alone (one
  ``serving_find`` over every table's read index), to show where the time goes.

Per batch size (1, 64, 512), every system runs the same `calls` batches in turn (interleaved, so
load from other processes falls on all alike); each call's wall time gives p50 / p99 latency and
QPS (samples per second at the p50 latency). Modules called under torch.inference_mode().

    python benchmarks/bench_inference.py                     # saves results/inference_cpu.*
    python benchmarks/bench_inference.py --rows 20000 --calls 50 --no-save   # smoke
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import markdown_table, parse_config, save

SYSTEMS = ("torchrec_int8", "ours_int8", "ours_fp16", "ours_fp32", "ours_hash_step")


@dataclasses.dataclass
class Config:
    num_tables: int = 8
    rows: int = 500_000
    dim: int = 64
    pooling: int = 16
    unseen: float = 0.05
    batch_sizes: str = "1,64,512"
    calls: int = 300
    warmup: int = 20
    seed: int = 0
    threads: int = 1  # torch threads: 1 keeps OpenMP regions out of the way of other processes' load
    systems: tuple = SYSTEMS


def build(cfg: Config):
    """(our float EBC configs, state_dict of our tables, ids per table, TorchRec's quantized EBC)."""
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.quant.embedding_modules import EmbeddingBagCollection as QuantEmbeddingBagCollection

    g = torch.Generator().manual_seed(cfg.seed)
    configs, float_configs, state, ids_of = [], [], {}, []
    float_ebc_rows = []
    for t in range(cfg.num_tables):
        ids = torch.randint(-(2**62), 2**62, (cfg.rows,), generator=g).unique()
        vectors = torch.randn(ids.numel(), cfg.dim, generator=g) * 0.1
        configs.append(
            EmbeddingBagConfig(
                name=f"t{t}", embedding_dim=cfg.dim, num_embeddings=cfg.rows * 5 // 4, feature_names=[f"f{t}"]
            )
        )
        float_configs.append(
            EmbeddingBagConfig(
                name=f"t{t}", embedding_dim=cfg.dim, num_embeddings=ids.numel() + 1, feature_names=[f"f{t}"]
            )
        )
        state[f"embedding_bags.t{t}.weight"], state[f"embedding_bags.t{t}.weight_id"] = vectors, ids
        ids_of.append(ids)  # sorted (unique): searchsorted maps an id to its TorchRec row
        float_ebc_rows.append(torch.cat([vectors, torch.zeros(1, cfg.dim)]))
    float_ebc = EmbeddingBagCollection(float_configs)
    with torch.no_grad():
        for t, rows in enumerate(float_ebc_rows):
            float_ebc.embedding_bags[f"t{t}"].weight.copy_(rows)
    float_ebc.qconfig = torch.quantization.QConfig(
        activation=torch.quantization.PlaceholderObserver,
        weight=torch.quantization.PlaceholderObserver.with_args(dtype=torch.qint8),
    )
    return configs, state, ids_of, QuantEmbeddingBagCollection.from_float(float_ebc)


def batches(cfg: Config, ids_of, batch_size: int, count: int):
    """(raw-id KJT, row-index KJT) pairs: the same bags for both kinds of module."""
    from torchrec import KeyedJaggedTensor

    g = torch.Generator().manual_seed(cfg.seed + batch_size)
    keys = [f"f{t}" for t in range(cfg.num_tables)]
    out = []
    for _ in range(count):
        raw, index = [], []
        for ids in ids_of:
            n = batch_size * cfg.pooling
            picked = ids[torch.randint(0, ids.numel(), (n,), generator=g)]
            unseen = torch.rand(n, generator=g) < cfg.unseen
            picked = torch.where(unseen, torch.randint(-(2**62), 2**62, (n,), generator=g), picked)
            at = torch.searchsorted(ids, picked).clamp(max=ids.numel() - 1)
            raw.append(picked)
            index.append(torch.where(ids[at] == picked, at, ids.numel()))  # unseen: the zero row
        lengths = torch.full((len(keys) * batch_size,), cfg.pooling, dtype=torch.int64)
        out.append(
            (
                KeyedJaggedTensor(keys=keys, values=torch.cat(raw), lengths=lengths, stride=batch_size),
                KeyedJaggedTensor(keys=keys, values=torch.cat(index), lengths=lengths, stride=batch_size),
            )
        )
    return out


def main() -> None:
    cfg, save_results = parse_config(Config, __doc__, systems=SYSTEMS)
    from torchrec_ext import DynamicEmbeddingBagCollection
    from torchrec_ext.inference import convert_to_inference
    from torchrec_ext.modules.features import check_and_arrange

    torch.set_num_threads(cfg.threads)
    start = time.perf_counter()
    configs, state, ids_of, theirs = build(cfg)
    with torch.device("meta"):
        skeleton = DynamicEmbeddingBagCollection(configs)
    ours = {
        f"ours_{name}": convert_to_inference(skeleton, state_dict=state, data_type=name)
        for name in ("int8", "fp16", "fp32")
        if f"ours_{name}" in cfg.systems
    }
    systems = {"torchrec_int8": (theirs, 1)} if "torchrec_int8" in cfg.systems else {}
    systems.update({name: (module, 0) for name, module in ours.items()})
    if "ours_hash_step" in cfg.systems:  # the id -> row step alone: KJT checks and one serving_find
        tables = convert_to_inference(skeleton, state_dict=state, data_type="int8")._tables
        systems["ours_hash_step"] = (
            lambda kjt: tables.rows_of(check_and_arrange(kjt, tables.plan, False, "", None)),
            0,
        )
    print(
        f"built {cfg.num_tables} x {cfg.rows} rows x dim {cfg.dim} in {time.perf_counter() - start:.1f} s; "
        f"load {os.getloadavg()[0]:.2f}"
    )

    results = {}
    for batch_size in [int(b) for b in cfg.batch_sizes.split(",")]:
        pairs = batches(cfg, ids_of, batch_size, min(cfg.calls, 64))
        with torch.inference_mode():
            if "torchrec_int8" in systems and "ours_int8" in systems:  # the same rows: the same outputs
                want, got = theirs(pairs[0][1]).values(), ours["ours_int8"](pairs[0][0]).values()
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            times = {name: [] for name in systems}
            for i in range(cfg.warmup + cfg.calls):
                pair = pairs[i % len(pairs)]
                for name, (module, which) in systems.items():
                    t0 = time.perf_counter()
                    module(pair[which])
                    if i >= cfg.warmup:
                        times[name].append(time.perf_counter() - t0)
        for name, ts in times.items():
            ts.sort()
            p50, p99 = statistics.median(ts), ts[min(len(ts) - 1, int(0.99 * len(ts)))]
            results[f"{name}@{batch_size}"] = {
                "system": name,
                "batch": batch_size,
                "p50_ms": p50 * 1e3,
                "p99_ms": p99 * 1e3,
                "qps": batch_size / p50,
            }
    load = os.getloadavg()
    rows = []
    for r in results.values():
        base = results.get(f"torchrec_int8@{r['batch']}")
        ratio = f"{r['p50_ms'] / base['p50_ms']:.2f}x" if base else ""
        rows.append([r["system"], r["batch"], f"{r['p50_ms']:.3f}", f"{r['p99_ms']:.3f}", f"{r['qps']:,.0f}", ratio])
    text = [
        f"# Serving lookups: {cfg.num_tables} tables x {cfg.rows} rows x dim {cfg.dim}, {cfg.pooling} ids per bag "
        f"({cfg.unseen:.0%} unseen), sum pooling, CPU",
        "",
        markdown_table(["system", "batch", "p50 ms", "p99 ms", "QPS (samples/s at p50)", "p50 vs torchrec_int8"], rows),
        "",
        f"{cfg.calls} calls per system and batch size, interleaved, after {cfg.warmup} warm-up calls; "
        f"torch threads {torch.get_num_threads()}. Load average (1, 5, 15 min) at the end: "
        f"{load[0]:.2f}, {load[1]:.2f}, {load[2]:.2f}.",
        "",
        "`python benchmarks/bench_inference.py`",
    ]
    print("\n".join(text))
    if save_results:
        save(
            "inference_cpu",
            {"config": dataclasses.asdict(cfg), "results": results, "load_average": list(load)},
            "\n".join(text),
        )


if __name__ == "__main__":
    main()
