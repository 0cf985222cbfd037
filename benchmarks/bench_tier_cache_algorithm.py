"""Hit rate of a tiered table's cache under LRU and LFU (``cache_algorithm``, TorchRec's
``CacheParams.algorithm``) on dlrm-small ids (Zipf 1.05 over 2^40: ``torchrec_ext.data.dlrm_small_batch``).

Both modules (backing="host", ``cache_load_factor`` 0.2 by default, fused Adagrad) train on the
same batches, interleaved step by step, each step staging the next batch first (``stage_next``,
what ``TrainPipeline(tier_prefetch=True)`` does). After ``warmup_steps`` the counters of the
remaining steps give, per algorithm, the hit rate before staging (``held_hit_rate`` of
train/tier_traffic.py: rows the cache held when the step's ids were known, the rows the stage
read counted as misses, as TorchRec counts a UVM prefetch's) and the step-time rate (~1.0: the
stage made them hot). Rows new to their id are neither (they are initialised in the cache). The
rates are counts, not timings: the load on the machine changes them not at all. Also reported:
the median ms a counted step (stage_next + forward + backward, the stage of the step before
waited for inside it; interleaved, so both see the same machine, but a loaded machine's timings
are noise beyond a large gap).

    python benchmarks/bench_tier_cache_algorithm.py --capacity 65536 --batch-size 256 --num-tables 2 --no-save  # smoke
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import DlrmSmall, markdown_table, parse_config, print_and_save

from torchrec_ext import DynamicEmbeddingBagCollection, DynamicEmbeddingBagConfig
from torchrec_ext.data import dlrm_small_batch
from torchrec_ext.train.tier_traffic import with_hit_rate


@dataclasses.dataclass
class Config(DlrmSmall):
    capacity: int = 1 << 20  # rows per table
    cache_load_factor: float = 0.2
    lr: float = 0.01
    warmup_steps: int = 40
    steps: int = 30  # counted after the warm-up
    seed: int = 0
    systems: tuple[str, ...] = ("lru", "lfu")


SYSTEMS = ("lru", "lfu")
KEYS = ("cache_hits", "cache_misses", "cache_staged", "cache_write_backs")


def _module(cfg: Config, algorithm: str) -> DynamicEmbeddingBagCollection:
    tables = [
        DynamicEmbeddingBagConfig(
            name=f"t{t}",
            embedding_dim=cfg.dim,
            num_embeddings=cfg.capacity,
            feature_names=[f"f{t}"],
            backing="host",
            cache_load_factor=cfg.cache_load_factor,
            cache_algorithm=algorithm,
        )
        for t in range(cfg.num_tables)
    ]
    return DynamicEmbeddingBagCollection(tables, optimizer="adagrad", optimizer_kwargs={"lr": cfg.lr})


def _counters(module) -> dict[str, int]:
    stats = module.table_stats().values()
    return {k: sum(getattr(s, k) for s in stats) for k in KEYS}


def run(cfg: Config) -> dict[str, object]:
    batch = lambda step: dlrm_small_batch(
        step, cfg.num_tables, cfg.batch_size, cfg.max_bag, cfg.seed, alpha=cfg.alpha, id_bits=cfg.id_bits
    )
    modules = {name: _module(cfg, name) for name in cfg.systems}
    total = cfg.warmup_steps + cfg.steps
    before = {}
    times: dict[str, list[float]] = {name: [] for name in modules}
    current = batch(0)
    for step in range(total):
        if step == cfg.warmup_steps:
            before = {name: _counters(m) for name, m in modules.items()}
        following = batch(step + 1)
        names = list(modules) if step % 2 == 0 else list(reversed(modules))
        for name in names:  # interleaved: each algorithm's step on the same batch in turn
            module = modules[name]
            start = time.perf_counter()
            module.stage_next(following)
            module(current).values().sum().backward()
            if step >= cfg.warmup_steps:
                times[name].append(time.perf_counter() - start)
        current = following
    rates = {}
    for name, module in modules.items():
        module._tables.wait_for_stage()
        after = _counters(module)
        d = {k: after[k] - before[name][k] for k in KEYS}
        r = with_hit_rate({"hits": d["cache_hits"], "misses": d["cache_misses"], "staged": d["cache_staged"]})
        rates[name] = {
            "held_hit_rate": r["held_hit_rate"],
            "hit_rate": r["hit_rate"],
            "per_step": {k: v / cfg.steps for k, v in d.items()},
            "ms_per_step": statistics.median(times[name]) * 1e3,
        }
    return {"rates": rates}


def report(cfg: Config, r: dict[str, object]) -> str:
    rows = [
        [
            name,
            f"{v['held_hit_rate']:.1%}",
            f"{v['hit_rate']:.1%}",
            f"{v['per_step']['cache_hits']:,.0f}",
            f"{v['per_step']['cache_staged']:,.0f}",
            f"{v['per_step']['cache_write_backs']:,.0f}",
            f"{v['ms_per_step']:.1f}",
        ]
        for name, v in r["rates"].items()
    ]
    return "\n".join(
        [
            f"{cfg.num_tables} tables x {cfg.capacity:,} rows x dim {cfg.dim}, cache_load_factor {cfg.cache_load_factor}, "
            f"backing host, stage_next prefetch; batch {cfg.batch_size} bags a table (1..{cfg.max_bag} ids), "
            f"Zipf({cfg.alpha}) ids over 2^{cfg.id_bits}; counted over {cfg.steps} steps after {cfg.warmup_steps}.",
            "",
            markdown_table(
                [
                    "cache_algorithm",
                    "hit rate before staging",
                    "hit rate at step time",
                    "hits a step",
                    "staged a step",
                    "write-backs a step",
                    "ms a step (median)",
                ],
                rows,
            ),
        ]
    )


def main() -> None:
    cfg, save_results = parse_config(Config, __doc__, systems=SYSTEMS)
    result = run(cfg)
    text = report(cfg, result)
    print_and_save("tier_cache_algorithm", cfg, result, text, save_results)


if __name__ == "__main__":
    main()
