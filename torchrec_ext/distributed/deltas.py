"""Deltas of the sharded dynamic modules (see torchrec_ext/modules/deltas.py for the format).

As a source, each rank exports its own share: its local module's delta, a stream of its own
(``delta_token()`` gives this rank's token; a replica follows one token per source rank). As a
replica, at any world size, each rank applies every share of the source, keeping the rows it
owns (``route(id) == rank`` for row-wise tables, all or none for table-wise ones).

A sharded replica applies all or nothing across its ranks: each rank checks its part and builds
it aside, the ranks exchange whether they could (one all_gather, so ``apply_delta`` is
collective: every rank calls it with the same delta), and only then each commits; a refusal on
any rank is raised on every rank, naming it.

Fallback rows: every rank holds an equal copy of a row-wise table's, so only rank 0's share
carries them (a replica following the ranks' streams in any interleaving never takes an older
copy over a newer one); every replica rank keeps them whole.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist

from torchrec_ext.distributed.sharded_state import owned_mask
from torchrec_ext.modules.deltas import (
    Delta,
    DeltaError,
    DeltaToken,
    TableDelta,
    check_table_delta,
    commit_delta,
    prepare_delta,
)


class ShardedDeltaMixin:
    """The delta API of the sharded modules (host: ``ShardedDynamicBase``)."""

    def _delta_local(self, where: str):
        columns = sorted(name for name, table in self._owners.items() if table.kind == "column")
        if columns:
            raise DeltaError(f"{where}: tables {columns} are sharded column-wise; deltas of column shards are not "
                             f"supported yet (shard them table_wise / row_wise to export or apply deltas)")
        if self._local is None:
            raise DeltaError(f"{where}: rank {self._rank} holds no table of this module: it has no rows to track")
        return self._local

    def delta_token(self, max_tombstones: int | None = None) -> DeltaToken:
        """This rank's token (each rank's share is its own stream)."""
        return self._delta_local("delta_token").delta_token(max_tombstones)

    def export_delta(
        self, since: DeltaToken, include_optimizer_state: bool = False, include_scores: bool = False
    ) -> Delta:
        """This rank's share of the delta since ``since`` (this rank's token)."""
        delta = self._delta_local("export_delta").export_delta(since, include_optimizer_state, include_scores)
        if self._rank != 0:
            for name, table in delta.tables.items():
                if self._owners[name].kind == "row":  # rank 0 exports the copy every rank holds
                    table.fallback_slots, table.fallback_weights, table.fallback_optimizer = None, None, {}
        delta.source.update(module=type(self).__name__, rank=self._rank, world_size=self._world_size)
        return delta

    def release_deltas(self, before: DeltaToken) -> None:
        self._delta_local("release_deltas").release_deltas(before)

    def follow_deltas(self, since: DeltaToken | Sequence[DeltaToken]) -> None:
        """Replica: the source's tokens at the base checkpoint, one per source rank."""
        self._delta_local("follow_deltas").follow_deltas(since)

    def apply_delta(self, delta: Delta) -> None:
        """Replica: applies one share of the source's delta, keeping the rows this rank owns; all
        ranks or none (collective)."""
        prepared, error = None, None
        try:
            local, mine = self._my_share(delta)
            if local is not None:
                prepared = (local, mine, prepare_delta(local._tables, local._followed_deltas(), mine))
        except (DeltaError, TypeError, ValueError) as e:
            error = e
        errors: list = [None] * self._world_size
        dist.all_gather_object(errors, None if error is None else str(error), group=self._env.process_group)
        refused = {rank: text for rank, text in enumerate(errors) if text is not None}
        if error is not None:
            raise error
        if refused:
            raise DeltaError(
                f"apply_delta: refused on rank(s) {sorted(refused)} (e.g. {next(iter(refused.values()))}); "
                f"nothing was applied on any rank"
            )
        if prepared is not None:
            local, mine, parts = prepared
            commit_delta(local._tables, local._followed_deltas(), mine, parts)

    def _my_share(self, delta: object):
        """(this rank's local module or None, the part of ``delta`` it keeps)."""
        if not isinstance(delta, Delta):
            raise TypeError(
                f"apply_delta: delta must be a Delta (export_delta / load_delta), got {type(delta).__name__}"
            )
        unknown = sorted(set(delta.tables) - set(self._owners))
        if unknown:
            raise DeltaError(f"apply_delta: delta has tables {unknown}, this module has tables {sorted(self._owners)}")
        local = self._delta_local("apply_delta") if self._local is not None else None
        if local is None:  # this rank holds no table of the module: nothing to keep
            return None, None
        local_index = {m.name: t for t, m in enumerate(local._tables.meta)}
        mine: dict[str, TableDelta] = {}
        for name, table in delta.tables.items():
            owner = self._owners[name]
            if not owner.holds(self._rank):
                continue
            check_table_delta(local._tables, local_index[name], table, f"apply_delta: table {name!r}")  # before masking
            keep = owned_mask(table.ids, owner, self._rank, self._world_size)
            gone = owned_mask(table.tombstones, owner, self._rank, self._world_size)
            mine[name] = TableDelta(
                ids=table.ids[keep],
                weights=table.weights[keep],
                tombstones=table.tombstones[gone],
                optimizer={k: v[keep] for k, v in table.optimizer.items()},
                scores=None if table.scores is None else table.scores[keep],
                fallback_slots=table.fallback_slots,
                fallback_weights=table.fallback_weights,
                fallback_optimizer=table.fallback_optimizer,
            )
        return local, Delta(
            since=delta.since,
            token=delta.token,
            source=delta.source,
            tables=mine,
            format_version=delta.format_version,
        )
