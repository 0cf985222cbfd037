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

Column tables: every column shard holds the same ids (and writes the same rows) but only its
columns, so ``export_delta`` gathers the shards' columns (``export_delta`` is then collective:
every rank calls it together) and the table's first shard's rank exports whole rows, the others
nothing of it. A replica keeps whole rows, or, holding column shards, its columns of them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

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
        if self._local is None:
            raise DeltaError(f"{where}: rank {self._rank} holds no table of this module: it has no rows to track")
        return self._local

    def delta_token(self, max_tombstones: int | None = None, consumer: str | None = None) -> DeltaToken:
        """This rank's token (each rank's share is its own stream)."""
        return self._delta_local("delta_token").delta_token(max_tombstones, consumer)

    def export_delta(
        self, since: DeltaToken, include_optimizer_state: bool = False, include_scores: bool = False
    ) -> Delta:
        """This rank's share of the delta since ``since`` (this rank's token); collective when
        some table is sharded column-wise (its first shard's rank exports its whole rows)."""
        if any(table.kind == "column" for table in self._owners.values()):
            delta = self._export_with_whole_columns(since, include_optimizer_state, include_scores)
        else:
            delta = self._delta_local("export_delta").export_delta(since, include_optimizer_state, include_scores)
        if self._rank != 0:
            for name, table in delta.tables.items():
                if self._owners[name].kind == "row":  # rank 0 exports the copy every rank holds
                    table.fallback_slots, table.fallback_weights, table.fallback_optimizer = None, None, {}
        delta.source.update(module=type(self).__name__, rank=self._rank, world_size=self._world_size)
        return delta

    def _export_with_whole_columns(
        self, since: DeltaToken, include_optimizer_state: bool, include_scores: bool
    ) -> Delta:
        """This rank's export, its column tables' rows made whole from every shard's columns (an
        all_gather of the shards' columns; a refusal on any rank is raised on every rank)."""
        delta, error = None, None
        try:
            delta = self._delta_local("export_delta").export_delta(since, include_optimizer_state, include_scores)
        except (DeltaError, TypeError, ValueError) as e:
            error = e
        columns = [name for name in (delta.tables if delta is not None else ()) if self._owners[name].kind == "column"]
        mine = {name: _to_cpu(delta.tables[name]) for name in columns} if delta is not None else {}
        everyone = self._unless_refused("export_delta", error, mine)
        for name in columns:
            placement = self._owners[name]
            if placement.first_rank != self._rank:
                del delta.tables[name]  # the first shard's rank exports the whole rows
                del delta.source["tables"][name]
                continue
            ranks = sorted(placement.lookup_ranks(), key=lambda r: placement.local_columns(r)[0])
            parts = [everyone[r][name] for r in ranks]
            device = delta.tables[name].weights.device
            delta.tables[name] = _whole_rows(name, parts, device)
            delta.source["tables"][name]["dim"] = int(delta.tables[name].weights.shape[1])
        return delta

    def release_deltas(self, before: DeltaToken, consumer: str | None = None) -> None:
        self._delta_local("release_deltas").release_deltas(before, consumer)

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
        self._unless_refused("apply_delta", error, consequence="; nothing was applied on any rank")
        if prepared is not None:
            local, mine, parts = prepared
            commit_delta(local._tables, local._followed_deltas(), mine, parts)

    def _unless_refused(self, where: str, error: Exception | None, mine: object = None, consequence: str = "") -> list:
        """Every rank's ``mine`` when no rank refused (collective: each rank's error, or None, goes
        with it). This rank's own error is raised as it is; another's as a DeltaError naming the
        ranks that refused, then ``consequence``."""
        everyone: list = [None] * self._world_size
        text = None if error is None else str(error)
        dist.all_gather_object(everyone, (text, mine), group=self._env.process_group)
        refused = {rank: text for rank, (text, _) in enumerate(everyone) if text is not None}
        if error is not None:
            raise error
        if refused:
            raise DeltaError(
                f"{where}: refused on rank(s) {sorted(refused)} (e.g. {next(iter(refused.values()))}){consequence}"
            )
        return [part for _, part in everyone]

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
        source = delta.source
        if isinstance(source, dict):  # a column table's described dim: this rank's columns (below)
            source = {**source, "tables": dict(source.get("tables", {}))}
        for name, table in delta.tables.items():
            owner = self._owners[name]
            if not owner.holds(self._rank):
                continue
            if owner.kind == "column":  # this rank's columns of the whole rows
                dim = sum(size for _, size in owner.columns)
                if not isinstance(table.weights, Tensor) or table.weights.dim() != 2 or table.weights.shape[1] != dim:
                    raise DeltaError(
                        f"apply_delta: table {name!r} is sharded column-wise here: its delta must hold "
                        f"whole rows [n, {dim}], got weights of shape "
                        f"{tuple(getattr(table.weights, 'shape', ()))}"
                    )
                first, width = owner.local_columns(self._rank)
                table = _columns_of(table, first, width)
                if isinstance(source, dict) and name in source["tables"]:
                    source["tables"][name] = {**source["tables"][name], "dim": width}
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
            source=source,
            tables=mine,
            format_version=delta.format_version,
        )


def _to_cpu(table: TableDelta) -> TableDelta:
    """A column share as all_gather_object sends it (host tensors)."""

    def cpu(t: Tensor | None) -> Tensor | None:
        return None if t is None else t.cpu()

    return TableDelta(
        ids=table.ids.cpu(),
        weights=table.weights.cpu(),
        tombstones=table.tombstones.cpu(),
        optimizer={k: v.cpu() for k, v in table.optimizer.items()},
        scores=cpu(table.scores),
        fallback_slots=cpu(table.fallback_slots),
        fallback_weights=cpu(table.fallback_weights),
        fallback_optimizer={k: v.cpu() for k, v in table.fallback_optimizer.items()},
    )


def _whole_rows(name: str, parts: Sequence[TableDelta], device: torch.device) -> TableDelta:
    """One table's delta of whole rows from its column shards' deltas (in column order): the
    shards hold the same ids, written at the same steps, so their rows line up."""
    first = parts[0]
    for part in parts[1:]:
        if not (torch.equal(part.ids, first.ids) and torch.equal(part.tombstones, first.tombstones)):
            raise DeltaError(
                f"export_delta: the column shards of table {name!r} hold different ids; their "
                f"hash tables should be identical (was a shard loaded from another checkpoint?)"
            )

    def side(key: str) -> list[Tensor]:
        return [getattr(p, key) for p in parts]

    def join(values: Sequence[Tensor]) -> Tensor:
        # Element-wise states are split by columns as the weights are ([n, width]); a row-wise
        # state ([n]) is never split (placement refuses it), so every shard's is the same.
        return (torch.cat(values, dim=1) if values[0].dim() == 2 else values[0]).to(device)

    return TableDelta(
        ids=first.ids.to(device),
        weights=join(side("weights")),
        tombstones=first.tombstones.to(device),
        optimizer={k: join([p.optimizer[k] for p in parts]) for k in first.optimizer},
        scores=None if first.scores is None else first.scores.to(device),
        fallback_slots=None if first.fallback_slots is None else first.fallback_slots.to(device),
        fallback_weights=None if first.fallback_weights is None else join(side("fallback_weights")),
        fallback_optimizer={k: join([p.fallback_optimizer[k] for p in parts]) for k in first.fallback_optimizer},
    )


def _columns_of(table: TableDelta, first: int, width: int) -> TableDelta:
    """Columns first..first + width of a delta of whole rows (a replica's column shard)."""

    def cut(t: Tensor | None) -> Tensor | None:
        return t[:, first : first + width].contiguous() if t is not None and t.dim() == 2 else t

    return TableDelta(
        ids=table.ids,
        weights=cut(table.weights),
        tombstones=table.tombstones,
        optimizer={k: cut(v) for k, v in table.optimizer.items()},
        scores=table.scores,
        fallback_slots=table.fallback_slots,
        fallback_weights=cut(table.fallback_weights),
        fallback_optimizer={k: cut(v) for k, v in table.fallback_optimizer.items()},
    )
