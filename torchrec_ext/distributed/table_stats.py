"""Per-table stats of sharded dynamic modules, reduced over ranks.

A sharded module's ``table_stats()`` gives this rank's shards (``TableStats`` per table it
holds); ``reduce_table_stats`` gathers every rank's and merges them per table (collective: every
rank calls it), so counters are sums over shards and rates are over the whole table.
``model_table_stats`` does both for every dynamic module of a model (e.g. a DMP-wrapped one).
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from torchrec_ext.modules.table_stats import TableStats, merge_table_stats, total_stats


def reduce_table_stats(stats: dict[str, TableStats], group=None) -> dict[str, TableStats]:
    """Every rank's ``stats`` merged per table (one all_gather_object; collective)."""
    if not dist.is_initialized():
        return dict(stats)
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, stats, group=group)
    return merge_table_stats(everyone)


def model_table_stats(model: nn.Module, reduce: bool = True, group=None) -> dict[str, TableStats]:
    """Stats of every table of the model's dynamic modules (sharded or not), keyed by table name
    (``<module path>/<table>`` where two modules have a table of the same name); reduced over
    ranks when ``reduce`` (collective)."""
    found: dict[str, TableStats] = {}
    clashes: dict[str, int] = {}
    per_module = []
    for path, module in model.named_modules():
        getter = getattr(type(module), "table_stats", None)
        if getter is None or any(path.startswith(p + ".") for p, _ in per_module):
            continue
        per_module.append((path, module.table_stats()))
    for _, stats in per_module:
        for name in stats:
            clashes[name] = clashes.get(name, 0) + 1
    for path, stats in per_module:
        for name, table in stats.items():
            found[name if clashes[name] == 1 else f"{path}/{name}"] = table
    return reduce_table_stats(found, group) if reduce else found


def summarize(stats: dict[str, TableStats]) -> dict[str, float] | None:
    """Totals over tables for a progress line: occupancy, evictions, rejections, refused, fallback
    reads, hit rate; ``cache`` (tables with host or file backing, else None): cache hits, misses,
    hit rate, write-backs, bytes moved between the tiers."""
    if not stats:
        return None
    total = total_stats(stats)
    return {
        "occupancy": total.load_factor,
        "evictions": total.evictions,
        "rejections": total.admission_rejections,
        "refused": total.refused,
        "hit_rate": total.hit_rate,
        "inserts": total.inserts,
        "ttl_expiries": total.ttl_expiries,
        "fallback_reads": total.fallback_reads,
        "cache": None
        if not total.cache_slots
        else {
            "hits": total.cache_hits,
            "misses": total.cache_misses,
            "hit_rate": total.cache_hit_rate,
            "write_backs": total.cache_write_backs,
            "bytes_moved": total.cache_bytes_moved,
        },
    }
