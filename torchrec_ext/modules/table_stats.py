"""Per-table counters of a module's dynamic tables, kept as the training lookups run.

``TableCounters`` is updated by ``DynamicTables.lookup`` from what the lookup computes anyway
(each distinct id's row, whether it was inserted, its count in the batch): one count over all
tables per training batch, no pass over the tables and no host sync. Evictions come from the
upsert's per-key eviction flags, counted on the device; ages of evicted rows from
``last_seen`` (the training step a row was last read), which tables with ``ttl_steps`` keep —
other tables report no ages (their eviction scores are not returned by the upsert).

``TableStats`` is what ``module.table_stats()`` returns per table; ``merge`` adds the stats of
several shards of one table (e.g. one per rank), so the rates of the merged stats are exact.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
from torch import Tensor

# Columns of TableCounters.counts. Codes of a distinct id in a batch: 0 no row (not admitted or
# refused), 1 hit (it had a row), 2 inserted (a new row, or its expired row re-initialised).
_CODES = 3
_OCCURRENCES, _DISTINCT, _REJECTED, _EXPIRED, _EVICTED = 0, _CODES, 2 * _CODES, 2 * _CODES + 1, 2 * _CODES + 2
_COLUMNS = 2 * _CODES + 3
MAX_AGE_BINS = 1 << 16


@dataclass
class TableStats:
    """One table's (or shard's) counters since the module was built (they are not checkpointed).

    capacity / max_capacity: rows of storage now / what the table may grow to (num_embeddings;
    the same unless ``initial_capacity`` < num_embeddings); load_factor is live_rows / capacity.
    lookups / hits: training id occurrences, and those whose id had a row (hit_rate = hits /
    lookups). inserts: rows given to ids (new ids, and ids whose row had expired).
    evictions: rows taken from an id for another. ttl_expiries: rows freed by ttl_steps (read
    after expiry or swept). admission_rejections: distinct ids of a batch the admission refused
    (counted once per batch they appear in). refused: distinct ids of a batch a full table
    refused a row (policy ``none``, or every slot of their buckets pinned by the batch).
    fallback_reads: training id occurrences read from a fallback row (``fallback_rows``): those
    of ids without a row (not admitted, refused); 0 for a table without fallback rows.
    evicted_ages: count of evicted rows per age in training steps since last read (the last
    bin holds the older ones), or None when the table keeps no last-read step (no ttl_steps).
    cache_*: tables with host or file backing (``tiered_tables``): cache slots, rows a lookup
    found in the cache / read from the backing store (rows new to their id are neither;
    cache_hit_rate), rows staged (read ahead of their lookup by the pipeline's prefetch),
    dirty rows written back (cache_staged_write_backs of them by a stage, off the step), bytes
    moved between the tiers; 0 for all-resident tables.
    """

    live_rows: int = 0
    capacity: int = 0
    max_capacity: int = 0
    lookups: int = 0
    hits: int = 0
    inserts: int = 0
    evictions: int = 0
    ttl_expiries: int = 0
    admission_rejections: int = 0
    refused: int = 0
    fallback_reads: int = 0
    cache_slots: int = 0
    cache_hits: int = 0
    cache_misses: int = 0
    cache_write_backs: int = 0
    cache_bytes_moved: int = 0
    cache_staged: int = 0
    cache_staged_write_backs: int = 0
    evicted_ages: list[int] | None = field(default=None, repr=False)

    @property
    def load_factor(self) -> float:
        return self.live_rows / self.capacity if self.capacity else 0.0

    @property
    def hit_rate(self) -> float | None:
        return self.hits / self.lookups if self.lookups else None

    @property
    def cache_hit_rate(self) -> float | None:
        seen = self.cache_hits + self.cache_misses
        return self.cache_hits / seen if seen else None

    def _age_quantile(self, q: float) -> int | None:
        if not self.evicted_ages or not sum(self.evicted_ages):
            return None
        rank, seen = q * sum(self.evicted_ages), 0
        for age, n in enumerate(self.evicted_ages):
            seen += n
            if seen >= rank and n:
                return age
        return len(self.evicted_ages) - 1

    @property
    def evicted_age_mean(self) -> float | None:
        if not self.evicted_ages or not sum(self.evicted_ages):
            return None
        return sum(a * n for a, n in enumerate(self.evicted_ages)) / sum(self.evicted_ages)

    @property
    def evicted_age_p50(self) -> int | None:
        return self._age_quantile(0.5)

    @property
    def evicted_age_p99(self) -> int | None:
        return self._age_quantile(0.99)

    def merge(self, other: TableStats) -> TableStats:
        """The stats of both shards together (sums; age histograms added bin by bin)."""
        ages = self.evicted_ages
        if other.evicted_ages is not None:
            width = max(len(ages or []), len(other.evicted_ages))
            ages = [
                (ages[i] if ages and i < len(ages) else 0)
                + (other.evicted_ages[i] if i < len(other.evicted_ages) else 0)
                for i in range(width)
            ]
        fields = {k: getattr(self, k) + getattr(other, k) for k in asdict(self) if k != "evicted_ages"}
        return TableStats(**fields, evicted_ages=ages)

    def as_dict(self) -> dict[str, object]:
        """Counters and derived figures as plain numbers (for logs and JSON; no histogram)."""
        out = {k: v for k, v in asdict(self).items() if k != "evicted_ages"}
        out.update(
            load_factor=self.load_factor,
            hit_rate=self.hit_rate,
            evicted_age_mean=self.evicted_age_mean,
            evicted_age_p50=self.evicted_age_p50,
            evicted_age_p99=self.evicted_age_p99,
            cache_hit_rate=self.cache_hit_rate,
        )
        return out


def total_stats(stats: dict[str, TableStats]) -> TableStats:
    """Every table's stats together (``merge``: counters summed, rates over all tables)."""
    return merge_table_stats([{"": s} for s in stats.values()])[""]


def merge_table_stats(per_shard: list[dict[str, TableStats]]) -> dict[str, TableStats]:
    """Stats of several shards (e.g. ``table_stats()`` of every rank) merged per table name."""
    out: dict[str, TableStats] = {}
    for stats in per_shard:
        for name, table in stats.items():
            out[name] = out[name].merge(table) if name in out else table
    return out


class TableCounters:
    """The running counters of a module's tables, on the storage's device."""

    def __init__(self, num_tables: int, age_bins: list[int | None], device: torch.device):
        self.counts = torch.zeros(num_tables, _COLUMNS, dtype=torch.int64, device=device)
        # Every table's age histogram is a view of one flat tensor, which ends in a sink for the
        # tables that keep none, so that one op counts the ages of all tables' evictions.
        sizes = [bins or 0 for bins in age_bins]
        starts = [sum(sizes[:t]) for t in range(len(sizes))]
        sink = sum(sizes)
        self._ages_flat = torch.zeros(sink + 1, dtype=torch.int64, device=device)
        self.ages = [None if bins is None else self._ages_flat[s : s + bins] for s, bins in zip(starts, age_bins)]
        self._age_start = torch.tensor([s if bins else sink for s, bins in zip(starts, age_bins)], device=device)
        self._age_last = torch.tensor([bins - 1 if bins else 0 for bins in age_bins], dtype=torch.int64, device=device)

    def __setstate__(self, state: dict) -> None:
        # Plain pickle copies each view's storage apart: the histograms made views of the flat
        # tensor again, or the one-op counting (into the flat tensor) would no longer reach them.
        self.__dict__.update(state)
        self._view_ages()

    def to(self, device: torch.device) -> TableCounters:
        """The counters moved to ``device`` (the module moved), in place."""
        for name in ("counts", "_ages_flat", "_age_start", "_age_last"):
            setattr(self, name, getattr(self, name).to(device))
        self._view_ages()
        return self

    def _view_ages(self) -> None:
        start = 0
        for t, ages in enumerate(self.ages):
            if ages is not None:
                self.ages[t] = self._ages_flat[start : start + ages.numel()]
                start += ages.numel()

    # Every count is a device op of a fixed size (index_add_, not bincount, which reads its
    # input's max on the host): nothing is read until ``stats``.

    def count_batch(self, unique_rows: Tensor, inserted: Tensor, unique_table: Tensor, counts: Tensor) -> None:
        """One training batch: each distinct id's row (-1: none), whether it was inserted, its table and count."""
        # Added straight into the counters (their flat view): each id's occurrences and its one
        # distinct id, at its table's column of its code (no per-step buffers to add after).
        at = unique_table * _COLUMNS + (unique_rows >= 0).to(torch.int64) + inserted.to(torch.int64)
        flat = self.counts.view(-1)
        flat.index_add_(0, at + _OCCURRENCES, counts)
        flat.index_add_(0, at + _DISTINCT, torch.ones_like(at))

    def count_rejected(self, t: int, rejected: Tensor) -> None:
        self.counts[t, _REJECTED] += rejected.sum()

    def count_expired(self, t: int, expired: Tensor) -> None:
        self.counts[t, _EXPIRED] += expired.sum()

    def count_swept(self, t: int, swept: Tensor) -> None:
        """Rows freed by the ttl sweep (expiries too)."""
        self.counts[t, _EXPIRED] += swept.sum()

    def count_evicted(self, t: int, evicted: Tensor, ages: Tensor | None, counted: bool = False) -> None:
        """Evictions in table t: ``evicted`` flags the keys that took an evicted key's row;
        ``ages``: each key's row's steps since last read (read where evicted), when known;
        ``counted``: the evictions are counted already (``count_evicted_tables``), the ages not."""
        if not counted:
            self.counts[t, _EVICTED] += evicted.sum()
        if ages is not None and self.ages[t] is not None and ages.numel():
            bins = self.ages[t].numel()
            self.ages[t].index_add_(0, ages.clamp(0, bins - 1), evicted.to(torch.int64))

    def count_evicted_ages_tables(self, key_table: Tensor, evicted: Tensor, ages: Tensor) -> None:
        """``count_evicted``'s ages of every table keeping them, at once (the evictions are
        counted by ``count_evicted_tables``): ``ages`` is each key's row's steps since last read
        (any value where its table keeps no ages), ``key_table`` each key's table."""
        at = self._age_start.index_select(0, key_table) + torch.minimum(
            ages.clamp(min=0), self._age_last.index_select(0, key_table)
        )
        self._ages_flat.index_add_(0, at, evicted.to(torch.int64))

    def count_expired_tables(self, key_table: Tensor, expired: Tensor) -> None:
        """``count_expired`` of every table at once: ``key_table`` is each key's table."""
        self.counts[:, _EXPIRED].index_add_(0, key_table, expired.to(torch.int64))

    def count_evicted_tables(self, key_table: Tensor, evicted: Tensor) -> None:
        """Evictions in every table at once: ``evicted`` flags the keys that took an evicted key's
        row, ``key_table`` is each key's table."""
        self.counts[:, _EVICTED].index_add_(0, key_table, evicted.to(torch.int64))

    def stats(
        self, names: list[str], capacities: list[int], live_rows: list[int], fallback_rows: list[int]
    ) -> dict[str, TableStats]:
        counts = self.counts.tolist()  # the one read of the device counters
        out = {}
        for t, name in enumerate(names):
            c = counts[t]
            no_row = c[_DISTINCT]
            out[name] = TableStats(
                live_rows=live_rows[t],
                capacity=capacities[t],
                lookups=sum(c[_OCCURRENCES : _OCCURRENCES + _CODES]),
                hits=c[_OCCURRENCES + 1],
                inserts=c[_DISTINCT + 2],
                evictions=c[_EVICTED],
                ttl_expiries=c[_EXPIRED],
                admission_rejections=c[_REJECTED],
                refused=no_row - c[_REJECTED],
                fallback_reads=c[_OCCURRENCES] if fallback_rows[t] else 0,
                evicted_ages=None if self.ages[t] is None else self.ages[t].tolist(),
            )
        return out
