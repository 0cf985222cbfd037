"""The tables' stats as a TorchRec state metric, so ``RecMetricModule`` reports them beside its
NE / AUC / throughput (and whatever sink the trainer feeds from ``compute()``: logs, TensorBoard)::

    metrics = RecMetricModule(batch_size, world_size, rec_metrics=...,
                              state_metrics={"table_stats": TableStatsMetric(model)})
    metrics.compute()  # {..., "table_stats|t_cat_0/load_factor": tensor(0.43),
                       #      "table_stats|evictions": tensor(1234.), ...}

Keys: ``<table>/<stat>`` per table (every figure of ``TableStats.as_dict()``) and ``<stat>`` for
the totals over tables (``TableStats.merge``: counters summed, rates over all tables); a figure
that is undefined yet (a hit rate before any lookup, ages before any eviction) is left out.
``get_metrics`` reduces over ranks when the model is sharded, so ``compute()`` is then collective
(every rank calls it, as TorchRec's own metrics require) and every rank gets the same values.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torchrec.metrics.metric_module import StateMetric

from torchrec_ext.distributed.table_stats import model_table_stats
from torchrec_ext.modules.table_stats import TableStats, total_stats


def table_stats_scalars(stats: dict[str, TableStats]) -> dict[str, float]:
    """Every defined figure of each table's stats (``<table>/<stat>``) and of their totals (``<stat>``)."""
    out: dict[str, float] = {}
    for name, table in sorted(stats.items()):
        out.update({f"{name}/{key}": float(value) for key, value in table.as_dict().items() if value is not None})
    if stats:
        out.update({key: float(value) for key, value in total_stats(stats).as_dict().items() if value is not None})
    return out


class TableStatsMetric(StateMetric):
    """``model``'s dynamic tables (sharded or not, e.g. a DMP) as a ``StateMetric``.

    Args:
        model: a module holding dynamic embedding modules (``torchrec_ext.distributed.model_table_stats``
            finds them, as the training job's progress line does).
        reduce: merge every rank's shards (collective); False gives this rank's shards only.
        group: the process group to reduce over (default: the default group).

    ``last`` holds the per-table ``TableStats`` the latest ``get_metrics`` read, for callers that
    want the objects (e.g. a progress line) without reading the tables twice.
    """

    def __init__(self, model: nn.Module, reduce: bool = True, group: dist.ProcessGroup | None = None):
        self.model, self.reduce, self.group = model, reduce, group
        self.last: dict[str, TableStats] = {}

    def get_metrics(self) -> dict[str, torch.Tensor]:
        self.last = model_table_stats(self.model, reduce=self.reduce, group=self.group)
        return {
            key: torch.tensor(value, dtype=torch.float64, device="cpu")
            for key, value in table_stats_scalars(self.last).items()
        }
