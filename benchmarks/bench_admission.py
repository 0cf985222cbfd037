"""Admission strategies (issue 18): decision throughput, bytes per tracked id, and the dlrm-small
train step with each strategy against no admission; plus the cost of reading ``table_stats()``.

1. Decisions per second on CPU: one strategy's ``admit(keys, counts, unseen, step)`` on batches
   of ``decision_batch`` distinct ids (all unseen; ids of the dlrm-small stream), the strategy's
   state carried from batch to batch as in training.
2. Bytes per tracked id at a 1% false-positive rate: the Bloom filter sized for
   ``tracked_ids`` ids (``bloom_geometry``) against the exact counter's side table for as many
   ids (17 B index slot + 8 B count, whole buckets); both as the planner counts them.
3. dlrm-small step (the workload of bench_lookup.py: 8 tables x dim 64, 4096 bags of 1..7 ids
   per table, Zipf(1.05) ids over 2^40; capacity 2^20, fused Adagrad) with admission none /
   counter (admit_after 2) / bloom (admit_after 2, 1% FPR for the capacity's ids, decay every
   100 steps) / probabilistic (p 0.5). Systems are timed in rounds, in rotated order, each round
   a median of repeats (the machine is shared: rounds smooth out other load); the ratio is each
   round's step time over the no-admission one of the same round, the median over rounds.
4. ``table_stats()`` read cost: median time of one call on the no-admission module after its
   steps, against its step time.

    python benchmarks/bench_admission.py                  # saves results/admission_cpu.*
    python benchmarks/bench_admission.py --rounds 1 --repeats 2 --warmup 1 --batch-size 512 --no-save   # smoke
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import DlrmSmall, markdown_table, median_seconds, parse_config, save, small_tables

from torchrec_ext.data import dlrm_small_batch
from torchrec_ext.modules.admission import (
    BloomAdmission,
    CounterAdmission,
    ProbabilisticAdmission,
    admission_bytes,
    bloom_geometry,
)
from torchrec_ext.modules.configs import DynamicTableOptions

STRATEGIES = {
    "none": {},
    "counter": dict(admission="counter", admit_after=2),
    "bloom": dict(admission="bloom", admit_after=2, bloom_fpr=0.01, bloom_decay_steps=100),
    "probabilistic": dict(admission="probabilistic", admit_probability=0.5),
}


@dataclasses.dataclass
class Config(DlrmSmall):
    capacity: int = 1 << 20
    lr: float = 0.01
    rounds: int = 3
    repeats: int = 5
    warmup: int = 2
    steps_per_repeat: int = 3
    decision_batch: int = 1 << 16
    decision_batches: int = 20
    tracked_ids: int = 1 << 20
    stats_reads: int = 200
    seed: int = 0


def decisions_per_second(cfg: Config) -> dict[str, float]:
    """Distinct unseen ids decided per second by each strategy's admit(), state carried over."""
    gen = torch.Generator().manual_seed(cfg.seed)
    batches = [
        torch.randint(0, 1 << cfg.id_bits, (cfg.decision_batch,), generator=gen).unique()
        for _ in range(cfg.decision_batches)
    ]
    cpu = torch.device("cpu")
    strategies = {
        "counter": CounterAdmission(2, cfg.tracked_ids, cpu),
        "bloom": BloomAdmission(2, bloom_geometry(cfg.tracked_ids, None, 0.01, "bench"), 100, 7, cpu),
        "probabilistic": ProbabilisticAdmission(0.5, 7),
    }
    out = {}
    for name, strategy in strategies.items():
        it = iter(range(10**9))

        def one() -> None:
            step = next(it)
            keys = batches[step % len(batches)]
            strategy.admit(keys, torch.ones_like(keys), torch.ones_like(keys, dtype=torch.bool), step + 1)

        sec = median_seconds(one, repeats=cfg.decision_batches, warmup=3)
        out[name] = sum(b.numel() for b in batches) / len(batches) / sec
    return out


def bytes_per_tracked_id(cfg: Config) -> dict[str, float]:
    n = cfg.tracked_ids
    bloom = DynamicTableOptions(admission="bloom", admit_after=2, bloom_fpr=0.01, bloom_expected_ids=n)
    counter = DynamicTableOptions(admission="counter", admit_after=2, admission_capacity=n)
    geometry = bloom_geometry(n, None, 0.01, "bench")
    # At its design load a filter of this size holds more ids than n (it was rounded up to a power
    # of two counters): the ids it holds at 1% is the figure per id the strategy really costs.
    at_one_percent = geometry.counters * (torch.log(torch.tensor(2.0)) ** 2 / -torch.log(torch.tensor(0.01))).item()
    return {
        "bloom_bytes": admission_bytes(bloom, "bloom", n),
        "counter_bytes": admission_bytes(counter, "counter", n),
        "bloom_per_id": admission_bytes(bloom, "bloom", n) / n,
        "bloom_per_id_at_design_load": geometry.nbytes / at_one_percent,
        "counter_per_id": admission_bytes(counter, "counter", n) / n,
        "bloom_hashes": geometry.hashes,
        "bloom_fpr_at_n": geometry.fpr,
    }


def build(cfg: Config, strategy: str):
    from torchrec_ext import DynamicEmbeddingBagCollection, DynamicEmbeddingBagConfig

    tables = small_tables(cfg, functools.partial(DynamicEmbeddingBagConfig, **STRATEGIES[strategy]), cfg.capacity)
    module = DynamicEmbeddingBagCollection(tables, optimizer=torch.optim.Adagrad, optimizer_kwargs={"lr": cfg.lr})
    module.train()
    return module


def step_times(cfg: Config) -> dict[str, object]:
    steps = (cfg.warmup + cfg.repeats) * cfg.steps_per_repeat
    batches = [
        dlrm_small_batch(i, cfg.num_tables, cfg.batch_size, cfg.max_bag, cfg.seed, alpha=cfg.alpha, id_bits=cfg.id_bits)
        for i in range(steps)
    ]
    names = list(STRATEGIES)
    per_round: list[dict[str, float]] = []
    stats_ms: list[float] = []
    for r in range(cfg.rounds):
        times = {}
        for name in names[r % len(names) :] + names[: r % len(names)]:
            module = build(cfg, name)
            chunks = iter([batches[i : i + cfg.steps_per_repeat] for i in range(0, steps, cfg.steps_per_repeat)])

            def run(chunk) -> None:
                for kjt in chunk:
                    module(kjt).values().sum().backward()

            times[name] = (
                median_seconds(run, cfg.repeats, warmup=cfg.warmup, setup=lambda: next(chunks))
                / cfg.steps_per_repeat
                * 1e3
            )
            if name == "none":
                stats_ms.append(median_seconds(module.table_stats, cfg.stats_reads, warmup=5) * 1e3)
            module = None  # freed before the next strategy's module is built
            gc.collect()
        per_round.append(times)
        print(f"round {r}: " + ", ".join(f"{n} {t:.1f} ms" for n, t in times.items()), flush=True)
    ratios = {n: statistics.median(t[n] / t["none"] for t in per_round) for n in names}
    ms = {n: statistics.median(t[n] for t in per_round) for n in names}
    return {
        "ms_per_step": ms,
        "ratio_to_none": ratios,
        "per_round": per_round,
        "table_stats_ms": statistics.median(stats_ms),
        "ids_per_step": int(batches[0].values().numel()),
    }


def main() -> None:
    cfg, save_results = parse_config(Config, __doc__)
    load_before = os.getloadavg()
    decisions = decisions_per_second(cfg)
    memory = bytes_per_tracked_id(cfg)
    steps = step_times(cfg)
    load_after = os.getloadavg()
    stats_fraction = steps["table_stats_ms"] / steps["ms_per_step"]["none"]
    lines = [
        f"Admission strategies on CPU ({torch.get_num_threads()} threads); load average (1, 5, 15 min) "
        f"{tuple(round(x, 2) for x in load_before)} before, {tuple(round(x, 2) for x in load_after)} after "
        "(2 cores shared with other work).",
        "",
        f"Decisions: batches of {cfg.decision_batch:,} distinct unseen ids, median of {cfg.decision_batches}.",
        "",
        markdown_table(
            ["strategy", "M decisions / s", "× counter"],
            [[n, f"{v / 1e6:.2f}", f"{v / decisions['counter']:.2f}"] for n, v in decisions.items()],
        ),
        "",
        f"Memory for {cfg.tracked_ids:,} tracked ids at 1% false positives: bloom {memory['bloom_bytes']:,} B "
        f"({memory['bloom_per_id']:.2f} B/id, {memory['bloom_hashes']} hashes, {memory['bloom_fpr_at_n']:.4f} FPR at "
        f"that load; {memory['bloom_per_id_at_design_load']:.2f} B/id at the load where it reaches 1%), counter "
        f"{memory['counter_bytes']:,} B ({memory['counter_per_id']:.2f} B/id): bloom / counter = "
        f"{memory['bloom_per_id'] / memory['counter_per_id']:.3f} "
        f"({memory['bloom_per_id_at_design_load'] / memory['counter_per_id']:.3f} at design load).",
        "",
        f"dlrm-small train step ({cfg.num_tables} tables x dim {cfg.dim}, {steps['ids_per_step']:,} ids/step, capacity "
        f"{cfg.capacity:,} per table, fused Adagrad), {cfg.rounds} rounds x median of {cfg.repeats} repeats x "
        f"{cfg.steps_per_repeat} steps:",
        "",
        markdown_table(
            ["admission", "settings", "ms / step (median of rounds)", "× none (median of per-round ratios)"],
            [
                [
                    n,
                    str(STRATEGIES[n]) if STRATEGIES[n] else "-",
                    f"{steps['ms_per_step'][n]:.1f}",
                    f"{steps['ratio_to_none'][n]:.3f}",
                ]
                for n in STRATEGIES
            ],
        ),
        "",
        f"`table_stats()` read: {steps['table_stats_ms'] * 1e3:.0f} µs = {stats_fraction:.2%} of a no-admission step.",
    ]
    text = "\n".join(lines)
    print(text)
    if save_results:
        save(
            "admission_cpu",
            {
                "config": dataclasses.asdict(cfg),
                "decisions_per_s": decisions,
                "memory": memory,
                "steps": steps,
                "load_before": load_before,
                "load_after": load_after,
            },
            text,
        )


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"({time.perf_counter() - t0:.0f} s)")
