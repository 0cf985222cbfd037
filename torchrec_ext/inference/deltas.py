"""Applying a training module's deltas (``torchrec_ext.modules.deltas``) to a serving module
while it serves.

Each delta is checked as a training replica checks it (order, stream, table names, dims, the
source's dtype, tensors). Several deltas (a sharded source's shares of one export, one per rank
stream, their ids disjoint) may be applied as one: their tables are merged, then every table's
new index is built on a copy of its index (tombstoned ids erased, the deltas' ids inserted or
re-assigned: a serving replica follows training, new ids included; or, in a full table, the
table re-placed: ``modules/delta_placement.py``), its read index updated alike
(``read_index.py``) and its rows encoded in the table's serving dtype, all aside from the tables
(``prepare_deltas``). Only then (``commit_deltas``), under the tables' write lock, the moved and
changed rows are copied in and the new indexes and read indexes swapped in: lookups, which hold
the read lock, see the deltas wholly or not at all, and a refused delta changes nothing. A
caller that serves more than the tables (the dense layers of a
model, see torchrec_ext.serve) commits under its own lock too.

Tombstones: a source tombstones only ids live at the delta's ``since``, so a tombstone of an id
this module does not hold is refused (a delta is missing), except the ids the conversion left
out as expired (TTL): the source still held them, and removes them later.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from torchrec_ext.inference.read_index import ReadIndex, updated_read_index
from torchrec_ext.inference.storage import InferenceTables
from torchrec_ext.modules.delta_placement import NoRowError, place_delta
from torchrec_ext.modules.deltas import Delta, DeltaError, DeltaToken, TableDelta, check_delta, unheld_tombstones
from torchrec_ext.modules.state_checks import _check_distinct
from torchrec_ext.table import HashTable


class _SourceShape:
    """What ``check_delta`` reads of a module: its tables' names and dims, the dtype their
    deltas carry (the trained table's storage dtype) and no optimizer state."""

    def __init__(self, tables: InferenceTables):
        self.meta = tables.meta
        self._views = [torch.empty(0, m.dim, dtype=m.source_dtype, device="cpu") for m in tables.meta]

    def table_view(self, t: int) -> Tensor:
        return self._views[t]

    def state_views(self, t: int, fallback: bool = False) -> dict[str, Tensor]:
        return {}


@dataclass
class PreparedDeltas:
    """What ``commit_deltas`` publishes: per table its new index, changed rows and their encoded
    vectors, and the tokens the module follows after."""

    generation: int  # the tables' commit count when prepared: a commit in between voids this
    # (t, index, read index, rows, encoded, left_out, moved): moved = (rows to, their stored rows)
    # of held ids a re-placement moved, read when prepared (None: none moved)
    tables: list[tuple[int, HashTable, ReadIndex, Tensor, Tensor, Tensor | None, tuple[Tensor, Tensor] | None]]
    fallback: list[tuple[int, Tensor, Tensor]]  # (t, fallback rows, encoded vectors)
    followed: dict[str, DeltaToken]
    rows: int  # rows written


def _merged(deltas: Sequence[Delta]) -> dict[str, list[TableDelta]]:
    out: dict[str, list[TableDelta]] = {}
    for delta in deltas:
        for name, table in delta.tables.items():
            out.setdefault(name, []).append(table)
    return out


def prepare_deltas(tables: InferenceTables, followed: dict[str, DeltaToken], deltas: Sequence[Delta]) -> PreparedDeltas:
    """Checks ``deltas`` (in order; at most one per stream) and builds their effect aside."""
    if not deltas:
        raise ValueError("apply_deltas: deltas must hold at least one Delta, got none")
    shape = _SourceShape(tables)
    after = dict(followed)
    for delta in deltas:  # each in its stream's order, as if applied one after the other
        check_delta(shape, after, delta)
        after[delta.since.stream] = delta.token
    names = {m.name: t for t, m in enumerate(tables.meta)}
    prepared = PreparedDeltas(tables.generation, [], [], after, 0)
    for name, shares in _merged(deltas).items():
        t = names[name]
        ids = torch.cat([s.ids.cpu() for s in shares])
        tombstones = torch.cat([s.tombstones.cpu() for s in shares])
        if len(shares) > 1:  # each share was checked alone: its ids distinct; across shares too
            _check_distinct(
                f"apply_deltas: table {name!r}", "ids and tombstones of the shares", torch.cat([ids, tombstones])
            )
        index, left_out = tables.indexes[t], tables.left_out[t]
        _, found = index.find(tombstones)
        if left_out is not None and not bool(found.all()):
            found = found | torch.isin(tombstones, left_out)
        unheld_tombstones(name, tombstones, found)
        try:
            placed = place_delta(index, ids, tombstones)
        except NoRowError as e:
            raise DeltaError(
                f"apply_delta: table {name!r}: {e}: their buckets are full of live ids in any placement; "
                f"nothing was applied: convert with more capacity (capacity=...)"
            ) from None
        if left_out is not None:  # tombstoned now, or held again
            left_out = left_out[~torch.isin(left_out, torch.cat([ids, tombstones]))]
        weights = torch.cat([s.weights.cpu() for s in shares])
        # A re-placement moves held ids' stored rows as they are (no re-encoding), read now: rows
        # change only in commits, and a commit in between voids this preparation (generation).
        moved = None if placed.moved_from is None else (placed.moved_to, tables.row_view(t)[placed.moved_from])
        read = updated_read_index(
            tables.read_indexes[t], placed.index, tombstones, ids, placed.rows, placed.moved_from is not None
        )
        prepared.tables.append((t, placed.index, read, placed.rows, tables.encode(t, weights), left_out, moved))
        prepared.rows += ids.numel()
        for share in shares:
            if share.fallback_slots is not None and share.fallback_slots.numel():
                rows = tables.meta[t].capacity + share.fallback_slots.cpu().to(torch.int64)
                prepared.fallback.append((t, rows, tables.encode(t, share.fallback_weights.cpu().float())))
    return prepared


def commit_deltas(tables: InferenceTables, followed: dict[str, DeltaToken], prepared: PreparedDeltas) -> None:
    """Publishes ``prepared`` (under the tables' write lock); refused if another commit came first."""
    with tables.applying:
        if prepared.generation != tables.generation:
            raise DeltaError(
                "apply_deltas: the module changed since these deltas were prepared (another apply_delta "
                "committed in between); prepare them again"
            )
        with tables.lock.write():  # nothing below can fail
            for t, index, read, rows, encoded, left_out, moved in prepared.tables:
                if moved is not None:
                    tables.row_view(t)[moved[0]] = moved[1]
                tables.row_view(t)[rows] = encoded
                tables.indexes[t] = index
                tables.read_indexes[t] = read
                tables.left_out[t] = left_out
            for t, rows, encoded in prepared.fallback:
                tables.row_view(t)[rows] = encoded
            tables.generation += 1
        followed.clear()
        followed.update(prepared.followed)


def apply_deltas(tables: InferenceTables, followed: dict[str, DeltaToken], deltas: Sequence[Delta]) -> None:
    """Makes ``tables`` hold the deltas' rows and drop their tombstones: all of them or none."""
    with tables.applying:  # one at a time: a concurrent one would void this one's preparation
        commit_deltas(tables, followed, prepare_deltas(tables, followed, deltas))
