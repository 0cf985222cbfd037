"""Where each table of a sharded dynamic module lives: the plan's ``ParameterSharding`` read
into one ``TablePlacement`` per table, with clear errors for what we cannot serve.

Three kinds cover TorchRec's sharding types:

    table    table_wise: the whole table on one rank
    row      row_wise (every rank) and table_row_wise (the ranks of one node): ids spread over
             the group by ``ops.route(id, len(group))``, each rank a 1/len(group) share of the
             capacity (ids are hashed, not split by row range as TorchRec's row blocks are)
    column   column_wise and table_column_wise: the table's dim split into column shards
             (TorchRec's convention: offsets and sizes from the plan's shard metadata, one
             rank per shard, a rank may hold several); every column shard sees every id of
             the table, so its hash table (ids, slots, scores, evictions) is the same as every
             other shard's, and the shards together hold exactly the unsharded table

``data_parallel`` is refused: each rank would insert the ids of its own batch, so replicas of
a dynamic table would hold different ids (and evict different rows) and drift apart; no
gradient all-reduce can make them equal.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from torchrec.distributed.types import ParameterSharding, ShardingType

from torchrec_ext import ops
from torchrec_ext.modules.configs import options_of, storage_dtype_of
from torchrec_ext.vocabulary import ROWWISE_STATE

ROW_TYPES = (ShardingType.ROW_WISE.value, ShardingType.TABLE_ROW_WISE.value)
COLUMN_TYPES = (ShardingType.COLUMN_WISE.value, ShardingType.TABLE_COLUMN_WISE.value)
SUPPORTED_SHARDING_TYPES = (ShardingType.TABLE_WISE.value,) + ROW_TYPES + COLUMN_TYPES

DATA_PARALLEL_REFUSAL = (
    "data_parallel cannot serve a dynamic table: each rank would insert the ids of its own batch, so the "
    "replicas would hold different ids (and evict different rows) and drift apart, which no gradient "
    "all-reduce repairs; shard it table_wise (a small table on one rank) or row_wise instead"
)
ROWWISE_OPTIMIZER_REFUSAL = (
    "a row-wise optimizer state (rowwise_adagrad averages the squared gradient over the whole row) cannot be "
    "split into column shards, each of which sees only its columns; use an element-wise optimizer (adagrad, "
    "adam, sgd, ...) or shard the table table_wise / row_wise"
)


@dataclass(frozen=True)
class TablePlacement:
    """One table's placement; ``ranks``: the owner (table), the group the ids are spread over
    (row), or each column shard's rank (column); ``columns``: (offset, size) of each column
    shard (column), else the whole dim."""

    kind: str
    ranks: tuple[int, ...]
    columns: tuple[tuple[int, int], ...]

    def holds(self, rank: int) -> bool:
        return rank in self.ranks

    @property
    def parts(self) -> int:
        """How many shares the rows are split into (row: the group's size)."""
        return len(self.ranks) if self.kind == "row" else 1

    @property
    def first_rank(self) -> int:
        """The rank that speaks for the table's per-row data (ids, scores) in checkpoints: the
        first column shard's for a column table (every shard holds the same)."""
        return self.ranks[0]

    def local_columns(self, rank: int) -> tuple[int, int]:
        """(first column, width) of the table's columns on ``rank`` (its shards, adjacent)."""
        mine = [c for r, c in zip(self.ranks, self.columns) if r == rank] if self.kind == "column" else self.columns
        return mine[0][0], sum(size for _, size in mine)

    def lookup_ranks(self) -> list[int]:
        """Where the table's ids go, each rank once: a column table's ids go to all its shards."""
        return list(dict.fromkeys(self.ranks))

    def owns(self, ids: Tensor, rank: int) -> Tensor:
        """Which of ``ids`` this rank holds a row of."""
        if self.kind == "row":
            group = torch.tensor(self.ranks, dtype=torch.int64, device="cpu")
            return group[ops.route(ids.to(torch.int64).contiguous(), len(self.ranks)).cpu()].to(ids.device) == rank
        return torch.full((ids.numel(),), self.holds(rank), dtype=torch.bool, device=ids.device)


def _column_shards(sharding: ParameterSharding, dim: int) -> tuple[tuple[int, ...], tuple[tuple[int, int], ...]]:
    spec = sharding.sharding_spec
    shards = sorted(getattr(spec, "shards", None) or [], key=lambda m: m.shard_offsets[1])
    if not shards:  # no shard metadata: one shard per listed rank, TorchRec's even split
        ranks = list(sharding.ranks or [])
        size = dim // max(len(ranks), 1)
        last = len(ranks) - 1
        return tuple(ranks), tuple((i * size, size if i < last else dim - i * size) for i in range(len(ranks)))
    return (
        tuple(m.placement.rank() for m in shards),
        tuple((int(m.shard_offsets[1]), int(m.shard_sizes[1])) for m in shards),
    )


def read_plan(
    where: str,
    configs,
    plan: dict[str, ParameterSharding],
    world_size: int,
    optimizer_kind=None,
    stochastic_rounding: bool | None = None,
) -> dict[str, TablePlacement]:
    """Each table's placement; clear errors for what the plan asks that we cannot do.
    ``stochastic_rounding``: the sharder's fused_params' (None: each config's)."""
    placements = {}
    for cfg in configs:
        sharding = plan.get(cfg.name)
        if sharding is None:
            raise ValueError(f"{where}: the sharding plan has no entry for table {cfg.name!r}")
        kind = sharding.sharding_type
        if kind == ShardingType.DATA_PARALLEL.value:
            raise ValueError(
                f"{where}: table {cfg.name!r} asks for sharding type 'data_parallel': {DATA_PARALLEL_REFUSAL}"
            )
        if kind not in SUPPORTED_SHARDING_TYPES:
            raise ValueError(
                f"{where}: table {cfg.name!r} asks for sharding type {kind!r}; "
                f"dynamic tables support {list(SUPPORTED_SHARDING_TYPES)}"
            )
        ranks = list(sharding.ranks or [])
        if kind in COLUMN_TYPES:
            shard_ranks, columns = _column_shards(sharding, cfg.embedding_dim)
            ranks = list(shard_ranks)
        if any(r < 0 or r >= world_size for r in ranks):
            raise ValueError(
                f"{where}: table {cfg.name!r} is planned on ranks {ranks}, but the process group has "
                f"world size {world_size}: the plan was made for another world size"
            )
        whole = ((0, cfg.embedding_dim),)
        if kind == ShardingType.TABLE_WISE.value:
            if len(ranks) != 1:
                raise ValueError(f"{where}: table-wise table {cfg.name!r} needs exactly one rank, got {ranks}")
            placements[cfg.name] = TablePlacement("table", (ranks[0],), whole)
        elif kind == ShardingType.ROW_WISE.value:
            if ranks and sorted(ranks) != list(range(world_size)):
                raise ValueError(f"{where}: row-wise table {cfg.name!r} must span all {world_size} ranks, got {ranks}")
            placements[cfg.name] = TablePlacement("row", tuple(range(world_size)), whole)
        elif kind == ShardingType.TABLE_ROW_WISE.value:
            if not ranks or len(set(ranks)) != len(ranks):
                raise ValueError(f"{where}: table-row-wise table {cfg.name!r} needs distinct ranks, got {ranks}")
            if len(ranks) < world_size and options_of(cfg).fallback_rows:
                raise ValueError(
                    f"{where}: table-row-wise table {cfg.name!r} has fallback_rows: their copies are kept "
                    f"equal by an all-reduce over every rank, so it must span all {world_size} ranks "
                    f"(row_wise) or have no fallback rows"
                )
            placements[cfg.name] = TablePlacement("row", tuple(sorted(ranks)), whole)
        else:
            placements[cfg.name] = _column_placement(where, cfg, ranks, columns, optimizer_kind, stochastic_rounding)
    return placements


def _column_placement(
    where: str, cfg, ranks: Sequence[int], columns, optimizer_kind, stochastic_rounding: bool | None
) -> TablePlacement:
    name = f"{where}: column-sharded table {cfg.name!r}"
    covered = [c for offset, size in columns for c in range(offset, offset + size)]
    if covered != list(range(cfg.embedding_dim)):
        raise ValueError(f"{name}: its column shards {list(columns)} must tile its {cfg.embedding_dim} columns")
    if len(set(ranks)) == 1:  # every column on one rank (TorchRec's plan for a narrow table): table-wise
        return TablePlacement("table", (ranks[0],), ((0, cfg.embedding_dim),))
    for rank in set(ranks):
        mine = [c for r, c in zip(ranks, columns) if r == rank]
        if any(a[0] + a[1] != b[0] for a, b in zip(mine, mine[1:])):
            raise ValueError(
                f"{name}: rank {rank} holds column shards {mine} that are not adjacent; a rank's "
                f"shards of one table must be adjacent columns: list a rank's shards together "
                f"(column_wise(ranks=[0, 0, 1, 1]), not [0, 1, 0, 1]); plans of "
                f"EmbeddingShardingPlanner are regrouped so"
            )
    # A rank holding all of the table's columns updates and rounds whole rows, as unsharded.
    split = any(
        sum(size for r, (_, size) in zip(ranks, columns) if r == rank) < cfg.embedding_dim for rank in set(ranks)
    )
    refusal = column_sharding_refusal(cfg, optimizer_kind, stochastic_rounding) if split else None
    if refusal:
        raise ValueError(f"{name} {refusal}")
    return TablePlacement("column", tuple(ranks), tuple(columns))


def column_sharding_refusal(cfg, optimizer_kind, stochastic_rounding: bool | None = None) -> str | None:
    """Why the table cannot be split into column shards exactly (None: it can; a rank holding all
    its columns is always exact). ``stochastic_rounding``:
    the sharder's fused_params', which overrides the config's (None: the config's)."""
    if optimizer_kind in ROWWISE_STATE:
        return f"has optimizer {optimizer_kind!r}: {ROWWISE_OPTIMIZER_REFUSAL}"
    if stochastic_rounding is None:
        stochastic_rounding = options_of(cfg).stochastic_rounding
    if storage_dtype_of(cfg) != torch.float32 and stochastic_rounding:
        return (
            f"is {storage_dtype_of(cfg)} with stochastic_rounding: a shard's rounding bits are drawn per column "
            f"of the shard, not of the table; use stochastic_rounding=False (the table's config, or the sharder's "
            f"fused_params when they set it) or shard it table_wise / row_wise"
        )
    return None
