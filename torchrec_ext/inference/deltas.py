"""Applying a training module's deltas (``torchrec_ext.modules.deltas``) to a serving module
while it serves.

The delta is checked as a training replica checks it (order, stream, table names, dims, the
source's dtype, tensors), then every table's new index is built on a copy of its index
(tombstoned ids erased, the delta's ids inserted or re-assigned: a serving replica follows
training, new ids included; or, in a full table, the whole table re-placed:
``modules/delta_placement.py``) and its rows encoded in the table's serving dtype, all aside
from the tables. Only then, under the tables' write lock, the moved and changed rows are copied
in and the new indexes swapped in: lookups, which hold the read lock, see the delta wholly or not
at all, and a refused delta changes nothing.
"""

from __future__ import annotations

import torch
from torch import Tensor

from torchrec_ext.inference.storage import InferenceTables
from torchrec_ext.modules.delta_placement import DeltaRows, NoRowError, place_delta
from torchrec_ext.modules.deltas import Delta, DeltaError, DeltaToken, check_delta


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
        prepared: list[tuple[int, DeltaRows, Tensor, Tensor | None]] = []
        fallback: list[tuple[int, Tensor, Tensor]] = []  # (table, fallback rows, encoded vectors)
        for name, table in delta.tables.items():
            t = names[name]
            try:
                placed = place_delta(tables.indexes[t], table.ids.cpu(), table.tombstones.cpu())
            except NoRowError as e:
                raise DeltaError(
                    f"apply_delta: table {name!r}: {e}: their buckets are full of live ids in any placement; "
                    f"nothing was applied: convert with more capacity (capacity=...)"
                ) from None
            # A re-placement moves held ids' stored rows as they are (no re-encoding): read now, as
            # nothing else writes rows while this call holds ``applying``.
            moved = None if placed.moved_from is None else tables.row_view(t)[placed.moved_from]
            prepared.append((t, placed, tables.encode(t, table.weights.cpu()), moved))
            if table.fallback_slots is not None and table.fallback_slots.numel():
                rows = tables.meta[t].capacity + table.fallback_slots.cpu().to(torch.int64)
                fallback.append((t, rows, tables.encode(t, table.fallback_weights.cpu().float())))
        with tables.lock.write():  # nothing below can fail
            for t, placed, encoded, moved in prepared:
                if moved is not None:
                    tables.row_view(t)[placed.moved_to] = moved
                tables.row_view(t)[placed.rows] = encoded
                tables.indexes[t] = placed.index
            for t, rows, encoded in fallback:
                tables.row_view(t)[rows] = encoded
        followed[delta.since.stream] = delta.token
