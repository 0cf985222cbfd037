"""Applying a training module's deltas (``torchrec_ext.modules.deltas``) to a serving module
while it serves.

The delta is checked as a training replica checks it (order, stream, table names, dims, the
source's dtype, tensors), then every table's new index is built on a copy of its index
(tombstoned ids erased, the delta's ids inserted or re-assigned: a serving replica follows
training, new ids included) and its rows encoded in the table's serving dtype, all aside from the
tables. Only then, under the tables' write lock, the changed rows are copied in and the new
indexes swapped in: lookups, which hold the read lock, see the delta wholly or not at all, and a
refused delta changes nothing.
"""

from __future__ import annotations

import torch
from torch import Tensor

from torchrec_ext.inference.storage import InferenceTables
from torchrec_ext.modules.deltas import Delta, DeltaError, DeltaToken, check_delta
from torchrec_ext.table import HashTable


class _SourceShape:
    """What ``check_delta`` reads of a module: its tables' names and dims, the dtype their
    deltas carry (the trained table's storage dtype) and no optimizer state."""

    def __init__(self, tables: InferenceTables):
        self.meta = tables.meta
        self._views = [torch.empty(0, m.dim, dtype=m.source_dtype) for m in tables.meta]

    def table_view(self, t: int) -> Tensor:
        return self._views[t]

    def state_views(self, t: int, fallback: bool = False) -> dict[str, Tensor]:
        return {}


def apply_delta(tables: InferenceTables, followed: dict[str, DeltaToken], delta: Delta) -> None:
    """Makes ``tables`` hold the delta's rows and drop its tombstones: all tables or none."""
    with tables.applying:  # one apply_delta at a time builds its copies of the indexes
        check_delta(_SourceShape(tables), followed, delta)
        names = {m.name: t for t, m in enumerate(tables.meta)}
        prepared: list[tuple[int, HashTable, Tensor, Tensor]] = []
        fallback: list[tuple[int, Tensor, Tensor]] = []  # (table, fallback rows, encoded vectors)
        for name, table in delta.tables.items():
            t = names[name]
            index = tables.indexes[t].clone()
            if table.tombstones.numel():
                index.erase(table.tombstones.cpu())  # an id not held here: nothing to remove
            result = index.insert_or_assign(table.ids.cpu())
            lost = int((result.rows < 0).sum())
            if lost:
                raise DeltaError(
                    f"apply_delta: table {name!r}: {lost} of the delta's {table.ids.numel()} ids find no row at "
                    f"capacity {tables.meta[t].capacity} (their buckets are full of live ids); nothing was "
                    f"applied: convert with more capacity (capacity=...)"
                )
            prepared.append((t, index, result.rows, tables.encode(t, table.weights.cpu())))
            if table.fallback_slots is not None and table.fallback_slots.numel():
                rows = tables.meta[t].capacity + table.fallback_slots.cpu().to(torch.int64)
                fallback.append((t, rows, tables.encode(t, table.fallback_weights.cpu().float())))
        with tables.lock.write():  # nothing below can fail
            for t, index, rows, encoded in prepared:
                tables.row_view(t)[rows] = encoded
                tables.indexes[t] = index
            for t, rows, encoded in fallback:
                tables.row_view(t)[rows] = encoded
        followed[delta.since.stream] = delta.token
