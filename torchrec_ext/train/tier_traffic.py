"""The tiered tables' traffic over the job's training steps (``--backing host`` / ``file:<dir>``):
each step's ``tier_step_stats()`` (cache hits and misses at step time, rows staged ahead by the
pipeline, write-backs, bytes moved between the tiers) summed per table, then over ranks.

Evals and checkpoints are not training steps: their lookups and flushes are left out here (the
tables' own cumulative ``cache_*`` counters, in ``table_stats``, include them)."""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

COUNTERS = ("hits", "misses", "staged", "write_backs", "staged_write_backs", "bytes_moved")


class TierTraffic:
    """Per table, the tier traffic of the steps ``add``-ed so far (this rank's shares)."""

    def __init__(self) -> None:
        self.per_table: dict[str, dict[str, int]] = {}
        self.steps = 0
        self._at_window: tuple[dict[str, dict[str, int]], int] = ({}, 0)  # per_table and steps at window()

    def add(self, step_stats: dict[str, dict[str, int]]) -> None:
        """One training step's ``tier_step_stats()`` (empty without tiered tables, or on a rank
        holding no tiered share: its steps still count, every rank's window spans the same steps)."""
        self.steps += 1
        for name, stats in step_stats.items():
            totals = self.per_table.setdefault(name, dict.fromkeys(COUNTERS, 0))
            for key in COUNTERS:
                totals[key] += int(stats.get(key, 0))

    def reduced(self) -> dict[str, dict[str, int]]:
        """Every rank's per-table sums added up per table (a table's shares on several ranks
        together; collective: every rank calls it), with each table's hit rate."""
        return _over_ranks(self.per_table)

    def window(self) -> tuple[int, dict[str, dict]]:
        """The steps ``add``-ed since the last call, and each table's traffic in them added up over
        ranks as ``reduced`` (collective: every rank calls it at the same step)."""
        before, steps_before = self._at_window
        since = {
            name: {key: stats[key] - before.get(name, {}).get(key, 0) for key in COUNTERS}
            for name, stats in self.per_table.items()
        }
        self._at_window = ({name: dict(stats) for name, stats in self.per_table.items()}, self.steps)
        return self.steps - steps_before, _over_ranks(since)


def _over_ranks(per_table: dict[str, dict[str, int]]) -> dict[str, dict]:
    everyone = [per_table]
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, per_table)
    merged: dict[str, dict[str, int]] = {}
    for rank_tables in everyone:
        for name, stats in rank_tables.items():
            totals = merged.setdefault(name, dict.fromkeys(COUNTERS, 0))
            for key in COUNTERS:
                totals[key] += stats[key]
    return {name: with_hit_rate(merged[name]) for name in sorted(merged)}


def with_hit_rate(stats: dict[str, int]) -> dict:
    """``stats`` with its step-time hit rate, and ``held_hit_rate``: the share of the lookups'
    rows the cache already held before the prefetch staged any (the rows staged ahead of a step
    counted as its misses, as TorchRec's UVM cache counts a prefetch's; a staged row evicted
    again before its lookup is counted twice, so this is a lower bound). With the pipeline's
    prefetch the step's own rate is ~1.0 by construction: this one says how hot the cache is."""
    seen = stats["hits"] + stats["misses"]
    held = max(0, stats["hits"] - stats.get("staged", 0))
    return {
        **stats,
        "hit_rate": stats["hits"] / seen if seen else None,
        "held_hit_rate": held / seen if seen else None,
    }


def total(per_table: dict[str, dict]) -> dict | None:
    """The per-table traffic summed over tables (None without tiered tables)."""
    if not per_table:
        return None
    return with_hit_rate({key: sum(stats[key] for stats in per_table.values()) for key in COUNTERS})


def model_tier_step_stats(model: nn.Module) -> dict[str, dict[str, int]]:
    """The last step's ``tier_step_stats()`` of the model's outermost modules that have one
    (a sharded module's covers its local module): for the train loops without TrainPipeline."""
    stats: dict[str, dict[str, int]] = {}
    found: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(f + ".") for f in found) or not callable(getattr(module, "tier_step_stats", None)):
            continue
        found.append(name)
        stats.update(module.tier_step_stats())
    return stats


def table_cache_text(name: str, stats: dict) -> str:
    """'t3 95.6% hits (87.5% before staging), 78 write-backs, 1.2 MiB': one table's window."""
    if stats["hit_rate"] is None:
        return f"{name} no lookups"
    before = f" ({stats['held_hit_rate']:.1%} before staging)" if stats.get("staged") else ""
    return (
        f"{name} {stats['hit_rate']:.1%} hits{before}, {stats['write_backs'] + stats['staged_write_backs']:,} "
        f"write-backs, {_bytes_text(stats['bytes_moved'])}"
    )


def _bytes_text(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def cache_text(stats: dict) -> str:
    """'1,234 hits, 56 misses (hit rate 95.6%), 78 write-backs, 1.2 MiB moved' of totals with
    the keys of ``TierTraffic`` (or TableStats' ``cache_*`` without the prefix); with rows staged
    ahead, the rate before them too ('hit rate 100.0%; 87.5% before the 3,287 rows staged ahead')."""
    rate = "n/a" if stats["hit_rate"] is None else f"{stats['hit_rate']:.1%}"
    if stats.get("staged") and stats.get("held_hit_rate") is not None:  # (TableStats' totals have no staged rows)
        rate += f"; {stats['held_hit_rate']:.1%} before the {stats['staged']:,} rows staged ahead"
    return (
        f"{stats['hits']:,} hits, {stats['misses']:,} misses (hit rate {rate}), "
        f"{stats['write_backs']:,} write-backs, {stats['bytes_moved'] / 2**20:.1f} MiB moved"
    )
