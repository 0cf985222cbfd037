"""Planning models that hold dynamic tables with TorchRec's ``EmbeddingShardingPlanner``.

TorchRec's planner enumerates sharding options from the sharders, then asks its estimators for
each shard's storage and perf. Its stock estimators do not know our tables: a dynamic table's
``num_embeddings`` is a hash-table capacity with index metadata, per-row extras and an optional
admission side table, and TorchRec's perf estimator refuses the ``customized_kernel`` our
sharders use. The two estimators here handle the options of our modules and hand every other
option to TorchRec's own estimators, so a model mixing dynamic and stock tables plans in one go:

    planner = make_planner(Topology(world_size=2, compute_device="cpu"), batch_size=512)
    plan = planner.plan(model, get_sharders())

Storage of one rank's share of a table (``rows``: the capacity for table_wise and for each
column shard of column_wise / table_column_wise (``dim``: the shard's columns; every shard
keeps its own index), ``ceil(capacity / world_size)`` for row_wise and ``ceil(capacity /
ranks of the node)`` for table_row_wise, as ``ops.route`` spreads ids evenly):

    4 * ceil(rows * dim * e / 4)                      vectors in the table's data_type (e = 4 FP32,
                                                      2 FP16 / BF16), packed in 4-byte words
    + rows * optimizer state per row                  float32 state: sgd / none 0, adagrad dim*4,
                                                      rowwise_adagrad 4, adam / adamw / ftrl 2*dim*4, of
                                                      the optimizer the sharded module trains with (the
                                                      module's, else its sharder's fused_params')
    + index_bytes(rows)                               index: digest (1 B) + key (8) + score (8) per slot,
                                                      17 B per stash entry, 1 B per bucket (vocabulary)
    + row_map_bytes(rows)        if it grows          slot -> row and row -> slot maps (4 + 4 B per row)
    + 8 * rows                   if ttl_steps         last-seen step per row
    + admission state                                 ``counter``: a side table of ``a`` ids (the
                                                      table's admission_capacity, default its capacity,
                                                      split like the rows), index_bytes(a) + 8 * a;
                                                      ``bloom``: the shard's filter, half a byte per
                                                      counter (``modules.admission.local_bloom_geometry``);
                                                      ``probabilistic``: none
    + ids * 8 (12 if weighted) + outputs * dim * 4    input / output buffers of a training step: ids
                                                      the shard looks up, output rows it writes

on the compute device's memory (ddr on CPU, hbm on CUDA). The perf model is described above
``DynamicEmbeddingPerfEstimator``.

A tiered table (``backing="host"`` or ``"file:<dir>"``: modules/tiered_tables.py) keeps ``slots =
cache_slots(rows, load_factor)`` rows in a cache on the compute device and every row in its
backing store on the host or on disk; one rank's share is planned as (``tiered_table_bytes``):

    the compute device (hbm on CUDA, ddr on CPU):
      4 * ceil(slots * dim * e / 4) + slots * state   the cache's vectors and optimizer state
      + index_bytes(rows) + ttl + admission state     the index and metadata stay whole (as above)
      + CUDA: min(slots, 32768) * record              a transfer's records (record: the row's number,
                                                      vector and states, each 8-byte aligned)
      + CUDA: 4 * rows + slots * 17 + 41              the cache's maps on the device (device maps, the
        (+ LFU: 4 * rows + 12)                        CUDA default: tier_device_maps.py; an LFU table's
                                                      lookups per row, its base and a spare count); the
                                                      host then holds only their free stack's mirror (4 a slot)
      + the step's IO buffers (as above)
    host memory (ddr; on CPU the same memory as the device's):
      4 * rows + slots * (25 + 16)                    the cache's host maps (the CPU default): slot of
                                                      each row (int32); row, last use and dirty bit of
                                                      each slot, its free
                                                      list (int64, made whole when the cache is
                                                      emptied); its LRU queue (at most 2 int32
                                                      entries a slot, and the rest of the tensors
                                                      they are views of: LRU_QUEUE_BYTES_PER_SLOT)
      + file: RowLog.map_bytes(rows)                  the write-back log's maps
      + LFU: 4 * rows                                 the cache's lookups per row (cache_algorithm)
      + CUDA: min(2 * slots, 32768) * record          the pinned buffer of transfers
      + CUDA: min(slots, 32768) * record              (device maps) its share of the pinned buffer
                                                      where all tables' reads, and in turn their
                                                      write-backs, are packed (one copy each)
        CPU, file: min(2 * slots, 32768) * record     the write-back buffer
      + host: 4 * ceil(rows * dim * e / 4) + rows * state     the backing store
    disk (ssd), file: the same bytes in the backing files + the log's bound, RowLog.max_records(rows) * record

The load factor, in TorchRec's convention, is ``ParameterConstraints(cache_params=CacheParams(
load_factor=f))``, else the config's ``cache_load_factor`` (both set and different: an error),
else the sharder's ``fused_params["cache_load_factor"]`` (tier_plan.py). When none is set the
planner chooses it from the memory budget: one load
factor ``k / 100`` shared by all such tables, the largest k in [0, 100] whose plan TorchRec's
planner finds (bisection: a plan that fits at a factor fits at any smaller one, as every shard's
storage grows with it), each table's cache at least its smallest: ``minimum_cache_slots`` = one
step's ids of the shard (batch size x pooling factors x num_poolings, every rank's for
table_wise and column shards), each counted distinct, at most the share's rows (k = 0: every
table at its smallest). When even the smallest caches do not fit, ``plan()`` raises a
``PlannerError`` naming the tables, the bytes they need and the budget. The factor planned
(given or chosen) is written into each tiered table's ``cache_params`` in the plan, which the
sharders build the table's shares with.

Growing tables (``initial_capacity`` < num_embeddings) are planned at their maximum, num_embeddings,
by default, as TorchRec reserves a table's whole ``num_embeddings``: a plan then stays valid once
the tables are full. ``plan_capacity="initial"`` (``make_planner`` / the storage estimator; or a dict
of table name -> "maximum" / "initial") plans with the rows the tables start with (their admission
state still at the maximum), for jobs that know their tables will not fill.

On CUDA a growth also holds its module's storage twice for a moment: one flat buffer per
optimizer state (and one for the vectors) holds all the module's tables of a rank, and a growth
copies it into new buffers beside the old (modules/table_growth.py; on CPU the tables' spans sit in
reserved address space and nothing is copied). So a growing table planned at its maximum on hbm
adds, to each shard of its module on the rank, ``growth_peak_bytes``: the shard's vectors and
optimizer state at the maximum (the new buffers), and, for a shard that grows, its new index, row
maps and last-seen steps and the last doubling's row moves (8 + 4 * 8 B per row of the capacity
before it). That is what ``TableGrowth._relaid`` allocates at the module's last doubling, all its
growing tables at once; for several modules on a rank it is an upper bound (each module grows on
its own). A plan that could not grow its tables to num_embeddings is refused up front, the error
naming each table and the bytes of its growth; ``plan_capacity="initial"`` plans without growth.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.planner.constants import BIGINT_DTYPE, DDR_MEM_BW, NUM_POOLINGS
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.planners import EmbeddingShardingPlanner
from torchrec.distributed.planner.shard_estimators import EmbeddingPerfEstimator, EmbeddingStorageEstimator
from torchrec.distributed.planner.stats import EmbeddingStats
from torchrec.distributed.planner.types import (
    CollectiveType,
    ParameterConstraints,
    Perf,
    PlannerError,
    PlannerErrorType,
    SharderDataMap,
    ShardEstimator,
    ShardingOption,
    Stats,
    Storage,
    Topology,
)
from torchrec.distributed.planner.utils import extract_comm_data_type_size
from torchrec.distributed.sharding_plan import get_default_sharders
from torchrec.distributed.types import CacheParams, ModuleSharder, PipelineType, ShardingPlan, ShardingType
from torchrec.modules.embedding_tower import EmbeddingTower, EmbeddingTowerCollection
from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection
from torchrec.modules.mc_embedding_modules import BaseManagedCollisionEmbeddingCollection

from torchrec_ext.distributed.placement import (
    COLUMN_TYPES,
    DATA_PARALLEL_REFUSAL,
    SUPPORTED_SHARDING_TYPES,
    column_sharding_refusal,
)
from torchrec_ext.distributed.sharded_base import local_capacity, sharded_optimizer
from torchrec_ext.distributed.sharders import FeatureProcessedDynamicEmbeddingBagCollectionSharder, over_dynamic_ebc
from torchrec_ext.distributed.tier_plan import (
    planned_cache_algorithm,
    planned_cache_load_factor,
    sharder_cache_algorithm,
    sharder_cache_load_factor,
)
from torchrec_ext.modules.admission import admission_bytes
from torchrec_ext.modules.configs import (
    DEFAULT_CACHE_LOAD_FACTOR,
    DynamicTableOptions,
    cache_slots,
    options_of,
    storage_dtype_of,
)
from torchrec_ext.modules.embedding_bag_collection import DynamicEmbeddingBagCollection
from torchrec_ext.modules.embedding_collection import DynamicEmbeddingCollection
from torchrec_ext.modules.fused_optimizer import stochastic_rounding_of
from torchrec_ext.modules.tier_copies import MAX_ROWS as MAX_TRANSFER_ROWS
from torchrec_ext.modules.tier_copies import record_fields
from torchrec_ext.modules.tier_log import RowLog
from torchrec_ext.modules.tiered_tables import _LogMover
from torchrec_ext.vocabulary import OPTIMIZER_STATES, ROWWISE_STATE, index_bytes, row_map_bytes

__all__ = [
    "DynamicEmbeddingPerfEstimator",
    "DynamicEmbeddingStorageEstimator",
    "dynamic_table_bytes",
    "growth_peak_bytes",
    "minimum_cache_slots",
    "tiered_table_bytes",
    "is_dynamic_option",
    "check_dynamic_modules_have_sharders",
    "install_default_planner_hook",
    "make_planner",
    "GrowingTableStats",
]

logger = logging.getLogger(__name__)

DYNAMIC_MODULE_TYPES = (DynamicEmbeddingBagCollection, DynamicEmbeddingCollection)
# TorchRec modules whose sharders cannot take a dynamic collection inside them.
_UNSHARDABLE_CONTAINERS = (BaseManagedCollisionEmbeddingCollection, EmbeddingTower, EmbeddingTowerCollection)
# TorchRec 1.6 hands estimators the sharders themselves (name -> ModuleSharder) and its
# extract_comm_data_type_size takes (sharder, option); from 1.7 on they get picklable snapshots
# (SharderDataMap) and it takes (option, sharder_data). Both go through unchanged.
_COMM_SIZES_TAKE_SHARDER_FIRST = next(iter(inspect.signature(extract_comm_data_type_size).parameters)) == "sharder"

# ---------------------------------------------------------------------------- byte model
FLOAT_BYTES = 4  # float32: optimizer state, outputs and gradients (vectors: their table's data_type)
TTL_BYTES_PER_ROW = 8  # int64 last-seen training step per row
ID_BYTES = BIGINT_DTYPE  # ids travel and are buffered as int64
WEIGHT_BYTES = 4  # per-id float32 weight of a weighted EBC


def optimizer_state_bytes_per_row(kind: str | None, dim: int) -> int:
    """Bytes of fused-optimizer state per row for an optimizer kind (None: no optimizer)."""
    if kind is None:
        return 0
    if kind not in OPTIMIZER_STATES:
        raise ValueError(
            f"dynamic table planner: unknown optimizer kind {kind!r}; "
            f"expected one of {sorted(OPTIMIZER_STATES)} or None"
        )
    per_state = FLOAT_BYTES if kind in ROWWISE_STATE else dim * FLOAT_BYTES
    return len(OPTIMIZER_STATES[kind]) * per_state


def dynamic_table_bytes(
    capacity: int,
    dim: int,
    optimizer_kind: str | None,
    *,
    ttl: bool = False,
    admit_after: int = 1,
    admission_capacity: int | None = None,
    parts: int = 1,
    admission: DynamicTableOptions | None = None,
    element_bytes: int = FLOAT_BYTES,
    rows_now: int | None = None,
    initial_capacity: int | None = None,
) -> int:
    """Bytes one rank holds of a dynamic table split over ``parts`` ranks (1: table_wise), without
    the step's IO buffers: what ``DynamicEmbeddingBagCollection.storage_bytes()`` reports for a
    module holding that share. ``admission``: the table's options, whose admission strategy is
    counted; without them, ``admit_after`` > 1 means the counter of ``admission_capacity`` ids.
    ``element_bytes``: of the table's data_type (4 FP32, 2 FP16/BF16). ``rows_now``: the table's
    capacity now when it grows (``initial_capacity``; default ``capacity``): its rows are counted at
    that capacity, its admission state (sized from num_embeddings) at ``capacity``.
    ``initial_capacity``: the table's, when it grows (its index then maps slots to rows)."""
    if admission is None:
        admission = DynamicTableOptions(admit_after=admit_after, admission_capacity=admission_capacity)
    rows = local_capacity(capacity if rows_now is None else rows_now, parts)
    stored = rows + (admission.fallback_rows or 0)  # every shard holds the table's fallback rows
    total = 4 * -(-stored * dim * element_bytes // 4) + stored * optimizer_state_bytes_per_row(optimizer_kind, dim)
    total += index_bytes(rows)
    if initial_capacity is not None and local_capacity(initial_capacity, parts) < local_capacity(capacity, parts):
        total += row_map_bytes(rows)
    if ttl:
        total += TTL_BYTES_PER_ROW * rows
    return total + admission_bytes(admission, admission.admission_strategy, capacity, parts)


GROWTH_MOVE_BYTES_PER_ROW = 8 + 4 * 8  # a growth's row map (int64 per old row) and its row moves (4 x int64)


def growth_peak_bytes(
    capacity: int,
    dim: int,
    optimizer_kind: str | None,
    *,
    grows: bool,
    ttl: bool = False,
    parts: int = 1,
    fallback_rows: int = 0,
    element_bytes: int = FLOAT_BYTES,
    initial_capacity: int | None = None,
) -> int:
    """Bytes one rank's share of a dynamic table adds to its device's memory while its module grows on
    CUDA, beside ``dynamic_table_bytes`` at the maximum (module docstring): its vectors and optimizer
    state at the maximum, copied into new buffers; if it grows itself (``grows``), its new index and
    row maps (``row_map_bytes``), last-seen steps (``ttl``), and the last doubling's moves of the rows
    of the capacity before it (doubling from ``initial_capacity``)."""
    rows = local_capacity(capacity, parts)
    stored = rows + fallback_rows
    total = 4 * -(-stored * dim * element_bytes // 4) + stored * optimizer_state_bytes_per_row(optimizer_kind, dim)
    before = local_capacity(initial_capacity or capacity, parts)
    if grows and before < rows:
        while 2 * before < rows:
            before *= 2
        total += index_bytes(rows) + row_map_bytes(rows) + (TTL_BYTES_PER_ROW * rows if ttl else 0)
        total += GROWTH_MOVE_BYTES_PER_ROW * before
    return total


# tier_lru.SlotOrder's storages: at most 2 int32 entries a slot (rebuilt past that), plus the rest
# of a rebuild's one tensor (at most a slot each) and of the one chunk partly taken (a touch's: at
# most a slot each), which their views keep allocated
LRU_QUEUE_BYTES_PER_SLOT = 8 + 4 + 4
CACHE_MAP_BYTES_PER_SLOT = (
    8 + 8 + 1 + 8
)  # RowCache: row of the slot, its last use (int64), dirty bit, free list (int64)
SLOT_OF_ROW_BYTES = 4  # RowCache.slot_of: int32 per row of the table
# tier_device_maps.DeviceSlotMaps (a CUDA cache's default maps), on the device: row of the slot
# (int64), its last use, its free stack entry (int32) and dirty bit; on the host: the free stack's mirror
DEVICE_MAP_BYTES_PER_SLOT = 8 + 4 + 4 + 1
# and a table's row and slot bases and free top (int64), plus (counted for each table, held once)
# a spare entry of each map
DEVICE_MAP_BYTES_PER_TABLE = 3 * 8 + DEVICE_MAP_BYTES_PER_SLOT
DEVICE_MAP_HOST_BYTES_PER_SLOT = 4
LFU_COUNT_BYTES_PER_ROW = 4  # an LFU cache's lookups per row (RowCache.uses / DeviceSlotMaps.uses): int32
# DeviceSlotMaps.uses_base (int64) and, counted for each LFU table, held once, the spare count
DEVICE_MAP_LFU_BYTES_PER_TABLE = 8 + LFU_COUNT_BYTES_PER_ROW


@dataclass(frozen=True)
class TierBytes:
    """Bytes of one rank's share of a tiered table, per place they are held."""

    device: int  # the cache's device (the compute device): the cache, the index and its metadata
    host: int  # host memory: the cache's maps, the tier's buffers, and host backing's store
    disk: int  # the files of backing="file:<dir>" (base files and the log's bound)


def log_record_bytes(dim: int, optimizer_kind: str | None, element_bytes: int = FLOAT_BYTES) -> int:
    """Bytes of one record of rows moving between a tiered table's tiers (tier_copies.py): the row's
    number, then its vector and each optimizer state, each 8-byte aligned."""
    widths = [dim * element_bytes]
    if optimizer_kind is not None:
        per_state = FLOAT_BYTES if optimizer_kind in ROWWISE_STATE else dim * FLOAT_BYTES
        widths += [per_state] * len(OPTIMIZER_STATES[optimizer_kind])
    return record_fields(widths)[1]


def tiered_table_bytes(
    capacity: int,
    dim: int,
    optimizer_kind: str | None,
    load_factor: float,
    *,
    file: bool,
    cuda: bool = False,
    parts: int = 1,
    options: DynamicTableOptions | None = None,
    element_bytes: int = FLOAT_BYTES,
    cache_algorithm: str | None = None,
    device_maps: bool | None = None,
) -> TierBytes:
    """One rank's share (of ``parts``) of a tiered table caching ``load_factor`` of its rows, its
    cache on a CUDA device (``cuda``) or the CPU (the byte model in the module docstring): what
    ``storage_bytes()`` of a module holding that share reports when built, plus the bounds of its
    LRU queue and of the records buffers it makes as rows move (a CUDA cache: the pinned host
    buffer of transfers, its share of the packed reads' and write-backs' with the device maps, and a transfer's
    records on the device; a CPU cache over a file: the
    write-back buffer); with ``backing_bytes()`` on the host (host) or on disk (file, with the
    log's bound). ``cache_algorithm``: the plan's (None: the options'). ``device_maps``: the cache's
    maps on the device (``TieredTables.device_maps``; None: its default, on a CUDA cache)."""
    opts = options or DynamicTableOptions()
    rows = local_capacity(capacity, parts)
    slots = cache_slots(rows, load_factor)
    state = optimizer_state_bytes_per_row(optimizer_kind, dim)

    def vectors(n: int) -> int:
        return 4 * -(-n * dim * element_bytes // 4)

    device = vectors(slots) + slots * state + index_bytes(rows)
    device += TTL_BYTES_PER_ROW * rows if opts.ttl_steps is not None else 0
    device += admission_bytes(opts, opts.admission_strategy, capacity, parts)
    lfu = (cache_algorithm or opts.cache_algorithm) == "lfu"
    maps = SLOT_OF_ROW_BYTES * rows + (LFU_COUNT_BYTES_PER_ROW * rows if lfu else 0)
    on_device_maps = cuda if device_maps is None else device_maps
    if on_device_maps:
        device += maps + slots * DEVICE_MAP_BYTES_PER_SLOT + DEVICE_MAP_BYTES_PER_TABLE
        device += DEVICE_MAP_LFU_BYTES_PER_TABLE if lfu else 0
        host = slots * DEVICE_MAP_HOST_BYTES_PER_SLOT
    else:
        host = maps + slots * (CACHE_MAP_BYTES_PER_SLOT + LRU_QUEUE_BYTES_PER_SLOT)
    host += RowLog.map_bytes(rows) if file else 0
    record = log_record_bytes(dim, optimizer_kind, element_bytes)
    if cuda:
        host += min(2 * slots, MAX_TRANSFER_ROWS) * record
        device += min(slots, MAX_TRANSFER_ROWS) * record
        if on_device_maps:  # its share of the pinned buffer of all tables' packed reads and write-backs
            host += min(slots, MAX_TRANSFER_ROWS) * record
    elif file:  # (reads' and write-backs' records, and the stage's deferred write-backs')
        host += 2 * min(2 * slots, _LogMover.BUFFER_ROWS) * record
    backing = vectors(rows) + rows * state
    if not file:
        return TierBytes(device=device, host=host + backing, disk=0)
    return TierBytes(device=device, host=host, disk=backing + RowLog.max_records(rows) * record)


def minimum_cache_slots(rows: int, step_ids: float) -> int:
    """The smallest cache the planner gives a share of ``rows`` rows that looks up ``step_ids`` ids
    a step: one step's ids, each counted distinct (a lookup needs a slot for each distinct row of
    its batch), at most the rows."""
    return min(rows, max(1, math.ceil(step_ids)))


def load_factor_for_slots(rows: int, slots: int) -> float:
    """The smallest load factor that caches ``slots`` of ``rows`` rows (``cache_slots``)."""
    factor = slots / rows
    while cache_slots(rows, factor) < slots:
        factor = math.nextafter(factor, 2.0)
    return min(factor, 1.0)


# ---------------------------------------------------------------------------- option helpers

PLAN_CAPACITIES = ("maximum", "initial")


def check_plan_capacity(value: Any) -> Any:
    """``plan_capacity``: "maximum" / "initial", or a dict of table name -> one of them."""
    values = value.values() if isinstance(value, dict) else [value]
    bad = [v for v in values if not isinstance(v, str) or v not in PLAN_CAPACITIES]
    if bad or (isinstance(value, dict) and not all(isinstance(k, str) for k in value)):
        raise ValueError(
            f"dynamic table planner: plan_capacity must be one of {list(PLAN_CAPACITIES)} or a dict of "
            f"table name -> one of them, got {value!r}"
        )
    return dict(value) if isinstance(value, dict) else value


def dynamic_module_of(module: nn.Module) -> nn.Module | None:
    """The dynamic module whose tables sharding ``module`` shards: itself, or the dynamic EBC of
    a FeatureProcessedEmbeddingBagCollection; None for any other module."""
    if isinstance(module, DYNAMIC_MODULE_TYPES):
        return module
    return module._embedding_bag_collection if over_dynamic_ebc(module) else None


def is_dynamic_option(option: ShardingOption) -> bool:
    """Whether a sharding option belongs to one of our dynamic modules (or an FP-EBC over one)."""
    return dynamic_module_of(option.module[1]) is not None


def _configs(module: nn.Module) -> Sequence[Any]:
    if isinstance(module, DynamicEmbeddingCollection):
        return module.embedding_configs()
    return module.embedding_bag_configs()


@dataclass(frozen=True)
class _TableInfo:
    name: str
    capacity: int
    dim: int
    optimizer_kind: str | None
    ttl: bool
    admit_after: int
    admission_capacity: int | None
    pooled: bool
    weighted: bool
    options: DynamicTableOptions | None = field(default=None, compare=False)
    element_bytes: int = FLOAT_BYTES  # of the vectors' data_type
    initial_capacity: int | None = None  # rows a growing table starts with (None: capacity)
    module_growing: tuple[str, ...] = ()  # the growing tables of its module (itself included)

    @property
    def tiered(self) -> bool:
        """Whether the table caches its rows over a backing store (host or file backing)."""
        return self.options is not None and self.options.backing != "device"


class _TableCache:
    """Per-estimate cache of what the byte and perf models need about each dynamic table."""

    def __init__(self) -> None:
        self._modules: dict[int, tuple[str | None, dict[str, Any]]] = {}

    def info(self, option: ShardingOption, sharder_data: Any = None) -> _TableInfo:
        """``sharder_data``: the module's sharder (TorchRec 1.6) or its SharderData snapshot, whose
        fused_params choose the optimizer when the module chose none, as in the sharded module."""
        module = dynamic_module_of(option.module[1])
        if id(module) not in self._modules:
            fused_params = getattr(sharder_data, "fused_params", None)
            kind = sharded_optimizer(module, fused_params, "dynamic table planner").kind
            self._modules[id(module)] = (kind, {c.name: c for c in _configs(module)})
        kind, configs = self._modules[id(module)]
        config = configs.get(option.name)
        if config is None:
            raise ValueError(
                f"dynamic table planner: module {option.path or '<root>'!r} "
                f"({type(module).__name__}) has no table named {option.name!r}"
            )
        opts = options_of(config)
        return _TableInfo(
            name=option.name,
            capacity=int(config.num_embeddings),
            dim=int(config.embedding_dim),
            optimizer_kind=kind,
            ttl=opts.ttl_steps is not None,
            admit_after=opts.admit_after,
            admission_capacity=opts.admission_capacity,
            pooled=not isinstance(module, DynamicEmbeddingCollection),
            weighted=bool(getattr(module, "is_weighted", lambda: False)()),
            options=opts,
            element_bytes=storage_dtype_of(config).itemsize,
            initial_capacity=opts.initial_capacity,
            module_growing=tuple(
                c.name
                for c in configs.values()
                if options_of(c).initial_capacity is not None and options_of(c).initial_capacity < c.num_embeddings
            ),
        )


def _resident_shard_bytes(table: _TableInfo, dim: int, parts: int, at_initial: bool) -> int:
    """A shard's resident bytes (``dynamic_table_bytes``): at the table's initial capacity, or its maximum."""
    return dynamic_table_bytes(
        table.capacity,
        dim,
        table.optimizer_kind,
        ttl=table.ttl,
        admit_after=table.admit_after,
        admission_capacity=table.admission_capacity,
        parts=parts,
        admission=table.options,
        element_bytes=table.element_bytes,
        rows_now=table.initial_capacity if at_initial else None,
        initial_capacity=table.initial_capacity,
    )


def _row_parts(option: ShardingOption, world_size: int) -> int:
    """Ranks a table's rows are spread over: every rank (row_wise), its node's (table_row_wise:
    one shard each), else 1."""
    if option.sharding_type == ShardingType.ROW_WISE.value:
        return world_size
    if option.sharding_type == ShardingType.TABLE_ROW_WISE.value:
        return max(len(option.shards), 1)
    return 1


def _shard_dims(option: ShardingOption, table: _TableInfo) -> list[int]:
    """Each shard's width: a column shard's columns (TorchRec's shard sizes), else the table's dim."""
    if option.sharding_type in COLUMN_TYPES:
        return [int(shard.size[1]) for shard in option.shards]
    return [table.dim] * len(option.shards)


def _check_sharding_type(option: ShardingOption) -> None:
    if option.sharding_type not in SUPPORTED_SHARDING_TYPES:
        raise ValueError(
            f"dynamic table planner: table {option.name!r} ({option.path or '<root>'}) has sharding type "
            f"{option.sharding_type!r}; dynamic tables support {list(SUPPORTED_SHARDING_TYPES)}"
        )


@dataclass(frozen=True)
class _StepVolume:
    """Per-step volumes of one table as one shard sees them (counts of ids / output rows)."""

    local_ids: float  # ids of this table in one rank's batch: sum(pooling factor * num_poolings * batch size)
    shard_ids: float  # ids this shard looks up: every rank's ids (table_wise, column shards) or a share (row types)
    shard_outputs: float  # output rows this shard writes (pooled: one per bag of the global batch)


def _step_volume(
    option: ShardingOption, constraints: dict[str, ParameterConstraints] | None, world_size: int, pooled: bool
) -> _StepVolume:
    constraint = constraints.get(option.name) if constraints else None
    input_lengths = list(option.input_lengths)
    num_poolings = (
        list(option.num_poolings)
        if option.num_poolings is not None and len(option.num_poolings) == len(input_lengths)
        else list(constraint.num_poolings)
        if constraint is not None and constraint.num_poolings
        else [NUM_POOLINGS] * len(input_lengths)
    )
    batch_sizes = (
        list(constraint.batch_sizes)
        if constraint is not None and constraint.batch_sizes
        else [option.batch_size] * len(input_lengths)
    )
    if not len(input_lengths) == len(num_poolings) == len(batch_sizes):
        raise ValueError(
            f"dynamic table planner: table {option.name!r}: pooling_factors, num_poolings and "
            f"batch_sizes constraints must have the same length, got {len(input_lengths)}, "
            f"{len(num_poolings)}, {len(batch_sizes)}"
        )
    local_ids = sum(il * npool * bs for il, npool, bs in zip(input_lengths, num_poolings, batch_sizes))
    # A pooled bag yields one output row if it can hold an id at all (TorchRec's min(1, length)).
    local_bags = sum(min(1.0, il) * npool * bs for il, npool, bs in zip(input_lengths, num_poolings, batch_sizes))
    if option.sharding_type in (ShardingType.TABLE_WISE.value,) + COLUMN_TYPES:
        # table_wise: one shard takes every rank's ids; column_wise: so does each column shard
        shard_ids = local_ids * world_size
        shard_outputs = (local_bags if pooled else local_ids) * world_size
    else:  # row_wise / table_row_wise: ids spread evenly over the group's ranks (every rank's for
        # row_wise, a node's for table_row_wise); pooled partial sums cover every rank's bags
        shard_ids = local_ids * world_size / _row_parts(option, world_size)
        shard_outputs = local_bags * world_size if pooled else shard_ids
    return _StepVolume(local_ids=local_ids, shard_ids=shard_ids, shard_outputs=shard_outputs)


# ---------------------------------------------------------------------------- storage


def _ours_after_delegating(sharding_options, delegate, sharder_data_map):
    """TorchRec's estimator takes the stock tables' options; yields ours with their table info."""
    others = [o for o in sharding_options if not is_dynamic_option(o)]
    if others:
        delegate.estimate(others, sharder_data_map)  # positional: the parameter's name differs in TorchRec 1.6
    cache = _TableCache()
    for option in sharding_options:
        if is_dynamic_option(option):
            _check_sharding_type(option)
            sharder_data = sharder_data_map.get(option.module_type_key) if sharder_data_map else None
            yield option, cache.info(option, sharder_data)


class DynamicEmbeddingStorageEstimator(ShardEstimator):
    """Per-shard storage of dynamic tables from the byte model in this module's docstring; any
    other sharding option goes to TorchRec's ``EmbeddingStorageEstimator``.

    Args:
        topology: the planner's topology: its compute device decides hbm (cuda, mtia) or ddr (cpu).
        constraints: per-table ``ParameterConstraints`` (pooling_factors, num_poolings, batch_sizes
            size the IO buffers).
        pipeline_type, run_embedding_at_peak_memory: passed to TorchRec's estimator for stock tables.
        is_inference: no IO buffers are counted (as TorchRec does for inference).
        plan_capacity: the capacity growing tables (``initial_capacity``) are planned with:
            "maximum" (num_embeddings, the default) or "initial"; or a dict of table name -> either
            (tables not named: "maximum").

    Tiered tables cache the load factor of their constraint's ``cache_params`` or their config;
    those with neither cache ``auto_load_factor`` (set by the planner's search, see the module
    docstring; default 0.2), at least ``minimum_cache_slots``. The factor is written into each
    tiered option's ``cache_params``; ``chose_cache_for`` names the tables whose factor was chosen.
    """

    def __init__(
        self,
        topology: Topology,
        constraints: dict[str, ParameterConstraints] | None = None,
        pipeline_type: PipelineType = PipelineType.NONE,
        run_embedding_at_peak_memory: bool = False,
        is_inference: bool = False,
        plan_capacity: Any = "maximum",
    ) -> None:
        self._plan_capacity = check_plan_capacity(plan_capacity)
        self.auto_load_factor: float | None = None  # the planner's search sets it (None: 0.2)
        self.chose_cache_for: set[str] = set()
        self._topology = topology
        self._constraints = constraints
        self._is_inference = is_inference
        self._delegate = EmbeddingStorageEstimator(
            topology=topology,
            constraints=constraints,
            pipeline_type=pipeline_type,
            run_embedding_at_peak_memory=run_embedding_at_peak_memory,
            is_inference=is_inference,
        )

    def estimate(self, sharding_options: list[ShardingOption], sharder_data_map: SharderDataMap | None = None) -> None:
        for option, table in _ours_after_delegating(sharding_options, self._delegate, sharder_data_map):
            if table.tiered:
                sharder_data = sharder_data_map.get(option.module_type_key) if sharder_data_map else None
                storages = self._tiered_storages(option, table, getattr(sharder_data, "fused_params", None))
            else:
                # a constraint's cache_params on a table without a tier is refused, naming it
                planned_cache_load_factor(table.options, self._cache_params(option), _where(option))
                planned_cache_algorithm(table.options, self._cache_params(option), _where(option))
                storages = [self._on_device(nbytes) for nbytes in self._shard_bytes(option, table)]
            for shard, storage in zip(option.shards, storages):
                shard.storage = storage

    def _cache_params(self, option: ShardingOption) -> CacheParams | None:
        # The constraint's, not the option's: the option's may hold what an earlier estimate wrote.
        constraint = self._constraints.get(option.name) if self._constraints else None
        return constraint.cache_params if constraint is not None else None

    def _io_bytes(self, volume: _StepVolume, table: _TableInfo, dim: int) -> int:
        """The step's input / output buffers of a shard of width ``dim`` (none for inference)."""
        if self._is_inference:
            return 0
        id_bytes = ID_BYTES + (WEIGHT_BYTES if table.weighted else 0)
        return math.ceil(volume.shard_ids * id_bytes) + math.ceil(volume.shard_outputs * dim * FLOAT_BYTES)

    def _tiered_storages(
        self, option: ShardingOption, table: _TableInfo, fused_params: dict[str, Any] | None
    ) -> list[Storage]:
        world_size = self._topology.world_size
        parts = _row_parts(option, world_size)
        volume = _step_volume(option, self._constraints, world_size, table.pooled)
        cache_params = self._cache_params(option)
        # the constraint's, the config's, else the sharder's fused_params' (as the sharded module reads them)
        sharder_factor = sharder_cache_load_factor(fused_params, _where(option))
        factor = planned_cache_load_factor(table.options, cache_params, _where(option), sharder_factor)
        # (checked here, as the sharded module will; an LFU cache's counts: 4 bytes a row, in tiered_table_bytes)
        algorithm = planned_cache_algorithm(
            table.options, cache_params, _where(option), sharder_cache_algorithm(fused_params, _where(option))
        )
        if factor is None:  # the planner's to choose: the search's factor, at least one step's ids
            self.chose_cache_for.add(option.name)
            rows = local_capacity(table.capacity, parts)
            factor = DEFAULT_CACHE_LOAD_FACTOR if self.auto_load_factor is None else self.auto_load_factor
            least = minimum_cache_slots(rows, volume.shard_ids)
            if cache_slots(rows, factor) < least:
                factor = load_factor_for_slots(rows, least)
        # The plan carries the factor to the sharders (TorchRec copies the option's cache_params).
        option.cache_params = (
            CacheParams(load_factor=factor)
            if cache_params is None
            else dataclasses.replace(cache_params, load_factor=factor)
        )
        storages = []
        for dim in _shard_dims(option, table):
            on_hbm = _tier(self._topology) == "hbm"
            tier = tiered_table_bytes(
                table.capacity,
                dim,
                table.optimizer_kind,
                factor,
                file=table.options.backing.startswith("file:"),
                cuda=on_hbm,
                parts=parts,
                options=table.options,
                element_bytes=table.element_bytes,
                cache_algorithm=algorithm,
            )
            device = tier.device + self._io_bytes(volume, table, dim)
            if self._module_grows(table):  # its cache's buffers are copied too
                device += growth_peak_bytes(
                    cache_slots(local_capacity(table.capacity, parts), factor),
                    dim,
                    table.optimizer_kind,
                    grows=False,
                    fallback_rows=table.options.fallback_rows or 0,
                    element_bytes=table.element_bytes,
                )
            if on_hbm:
                storages.append(Storage(hbm=device, ddr=tier.host, ssd=tier.disk))
            else:
                storages.append(Storage(hbm=0, ddr=device + tier.host, ssd=tier.disk))
        return storages

    def _shard_bytes(self, option: ShardingOption, table: _TableInfo) -> list[int]:
        world_size = self._topology.world_size
        parts = _row_parts(option, world_size)
        initial = self._planned_at(table.name) == "initial"
        volume = _step_volume(option, self._constraints, world_size, table.pooled)
        out = []
        # Every rank of a row_wise table holds an even share, whatever sizes TorchRec's row split
        # gave the shards: ids are spread by hash, not by row range. A column shard is a table of
        # its width with the whole capacity, and its own index.
        for dim in _shard_dims(option, table):
            resident = _resident_shard_bytes(table, dim, parts, at_initial=initial)
            out.append(resident + self.growth_peak(table, dim, parts) + self._io_bytes(volume, table, dim))
        return out

    def _planned_at(self, name: str) -> str:
        """The capacity table ``name`` is planned at (if it grows): "maximum" or "initial"."""
        plan = self._plan_capacity
        return plan if isinstance(plan, str) else plan.get(name, "maximum")

    def _module_grows(self, table: _TableInfo) -> bool:
        """Whether ``table``'s module grows on this plan's device with its buffers copied (CUDA):
        one of its growing tables is planned at its maximum."""
        return _tier(self._topology) == "hbm" and any(self._planned_at(n) == "maximum" for n in table.module_growing)

    def growth_peak(self, table: _TableInfo, dim: int, parts: int) -> int:
        """Bytes a (non-tiered) shard of ``table`` of width ``dim`` adds while its module grows
        (``growth_peak_bytes``; 0 where the module does not grow on hbm)."""
        if not self._module_grows(table):
            return 0
        at_maximum = self._planned_at(table.name) == "maximum"
        return growth_peak_bytes(
            table.capacity if at_maximum or table.initial_capacity is None else table.initial_capacity,
            dim,
            table.optimizer_kind,
            grows=at_maximum and table.name in table.module_growing,
            ttl=table.ttl,
            parts=parts,
            fallback_rows=table.options.fallback_rows or 0,
            element_bytes=table.element_bytes,
            initial_capacity=table.initial_capacity,
        )

    def _on_device(self, nbytes: int) -> Storage:
        if _tier(self._topology) == "hbm":
            return Storage(hbm=nbytes, ddr=0)
        return Storage(hbm=0, ddr=nbytes)


def _where(option: ShardingOption) -> str:
    return f"dynamic table planner: table {option.name!r} ({option.path or '<root>'})"


# ---------------------------------------------------------------------------- perf
#
# Times are in ms, like TorchRec's (its bandwidths are bytes/ms). Each per-id cost is expressed
# as "bytes-equivalent": the bytes the compute device's memory bandwidth would stream in that
# time, so costs scale with Topology.ddr_mem_bw (cpu) / hbm_mem_bw (cuda) as TorchRec's do.
# They are calibrated so that at TorchRec's default DDR_MEM_BW (51 GB/s) they reproduce what our
# CPU module does on a 2-core machine:
#   hash find_or_insert ~20 M keys/s (50 ns/id), find ~70 M keys/s (14 ns/id);
#   training step (lookup + fused update) ~5 M ids/s at dim 64 with adagrad, and measured as
#   85 ns + 1.77 ns * dim per id for dims 16..128 (adagrad).
# The 85 ns intercept is the find_or_insert (50 ns) plus ~35 ns of per-id work in the update
# (dedup of touched rows, bookkeeping). The slope moves 24 B per dim with adagrad (4 B row read
# forward; grad 4 + row read/write 8 + state read/write 8 backward): 1.77 ns / 24 B is 4x the
# streaming cost at 51 GB/s, the price of touching rows at random.

_REFERENCE_BW = DDR_MEM_BW  # bytes/ms the constants below were normalised to


def _ns_as_bytes(ns: float) -> float:
    return ns * _REFERENCE_BW / 1e6


HASH_INSERT_BYTES = _ns_as_bytes(50.0)  # find_or_insert per id (training lookups): ~20 M keys/s on 2 cores
HASH_FIND_BYTES = _ns_as_bytes(14.0)  # find per id (inference lookups): ~70 M keys/s on 2 cores
UPDATE_OVERHEAD_BYTES = _ns_as_bytes(35.0)  # per id in the fused update besides the row/state bytes
ROUTE_BYTES = _ns_as_bytes(15.0)  # row_wise: route(id) hash + bucketing by rank on the sender (~13 ns/id measured)
RANDOM_ROW_FACTOR = 4.0  # row / state bytes touched at random cost 4x streamed bytes


class DynamicEmbeddingPerfEstimator(ShardEstimator):
    """Per-shard perf of dynamic tables from a bandwidth model; any other sharding option goes to
    TorchRec's ``EmbeddingPerfEstimator``.

    Per shard and step (``ids``: ids the shard looks up: all ranks' for table_wise and for each
    column shard, 1/world_size of them for row_wise, 1/(ranks of a node) for table_row_wise;
    ``outs``: output rows it writes; ``dim``: the shard's width; ``bw``: the device memory bandwidth):

        fwd_compute = (ids * (8 + probe + 4 * dim*4) + outs * dim*4 [+ row types: local ids * route]) / bw
        bwd_compute = (outs * dim*4 + ids * (update overhead + 4 * (dim*4 + 2 * (dim*4 + state)))) / bw
        fwd_comms   = outs * dim * comm dtype size / reduce-scatter (pooled) or all-to-all bw
        bwd_comms   = the same volume / all-gather (pooled) or all-to-all bw
        input_dist_comms = ids * 8 (+4 if weighted) / all-to-all bw

    ``probe`` is find_or_insert in training and find for inference (no backward then). Comms are 0
    with one rank. The constants are justified above their definitions.

    A tiered table's shard also moves rows between its tiers, as TorchRec prices UVM caching's
    fetches (``prefetch_compute``, counted as blocking as TorchRec counts it):

        prefetch_compute = ids * (1 - load_factor) * row * (2 in training: a dirty victim written back)
                           * 4 (random rows) / backing bw

    with ``row`` the vector and optimizer state, ``load_factor`` the one the storage estimator
    planned (it runs first in ``make_planner``; else the constraint's / config's / sharder's, else
    0.2), and the backing's bandwidth: ddr_mem_bw (host backing, CPU), hbm_to_ddr_mem_bw (host
    backing, CUDA), ssd_mem_bw (file backing). Misses at ``1 - load_factor`` of the ids is uniform
    access, a bound: skewed ids miss far less (the pipeline's prefetch hides the rest).
    """

    def __init__(
        self, topology: Topology, constraints: dict[str, ParameterConstraints] | None = None, is_inference: bool = False
    ) -> None:
        self._topology = topology
        self._constraints = constraints
        self._is_inference = is_inference
        self._delegate = EmbeddingPerfEstimator(topology=topology, constraints=constraints, is_inference=is_inference)

    def estimate(self, sharding_options: list[ShardingOption], sharder_data_map: SharderDataMap | None = None) -> None:
        for option, table in _ours_after_delegating(sharding_options, self._delegate, sharder_data_map):
            sharder_data = sharder_data_map.get(option.module_type_key) if sharder_data_map else None
            for shard, dim in zip(option.shards, _shard_dims(option, table)):
                shard.perf = self._shard_perf(option, table, sharder_data, dim)

    def _device_bw(self) -> float:
        if self._topology.compute_device in ("cuda", "mtia"):
            return self._topology.hbm_mem_bw
        return self._topology.ddr_mem_bw

    def _comms_bw(self, collective: CollectiveType) -> float:
        return self._topology.comms_bandwidths.get_bw(
            local_world_size=self._topology.local_world_size,
            world_size=self._topology.world_size,
            collective_type=collective,
        )

    def _comm_sizes(self, option: ShardingOption, sharder_data: Any) -> tuple[float, float, float, float]:
        # (fwd a2a, bwd a2a, fwd reduce-scatter, bwd reduce-scatter) element sizes, honouring the
        # sharder's qcomm codecs as TorchRec does; float32 without them.
        if sharder_data is None:
            return (FLOAT_BYTES,) * 4
        if _COMM_SIZES_TAKE_SHARDER_FIRST:
            return extract_comm_data_type_size(sharder_data, option)
        return extract_comm_data_type_size(option, sharder_data)

    def _shard_perf(
        self, option: ShardingOption, table: _TableInfo, sharder_data: Any = None, dim: int | None = None
    ) -> Perf:
        """One shard's perf; ``dim``: its width (a column shard's columns; default the table's)."""
        world_size = self._topology.world_size
        dim = table.dim if dim is None else dim
        volume = _step_volume(option, self._constraints, world_size, table.pooled)
        row_bytes = dim * table.element_bytes  # a stored row, in its data_type
        out_bytes = dim * FLOAT_BYTES  # an output (or gradient) row: float32
        id_bytes = ID_BYTES + (WEIGHT_BYTES if table.weighted else 0)
        bw = self._device_bw()
        probe = HASH_FIND_BYTES if self._is_inference else HASH_INSERT_BYTES
        fwd_bytes = (
            volume.shard_ids * (id_bytes + probe + RANDOM_ROW_FACTOR * row_bytes) + volume.shard_outputs * out_bytes
        )
        if _row_parts(option, world_size) > 1:
            fwd_bytes += volume.local_ids * ROUTE_BYTES
        fwd_compute = fwd_bytes / bw
        bwd_compute = 0.0
        if not self._is_inference:
            state = optimizer_state_bytes_per_row(table.optimizer_kind, table.dim)
            update_bytes = out_bytes + 2 * (row_bytes + state)  # grad in, row and state read + written
            bwd_compute = (
                volume.shard_outputs * out_bytes
                + volume.shard_ids * (UPDATE_OVERHEAD_BYTES + RANDOM_ROW_FACTOR * update_bytes)
            ) / bw
        fwd_comms = bwd_comms = input_dist = 0.0
        if world_size > 1:
            fwd_a2a, bwd_a2a, fwd_rs, bwd_rs = self._comm_sizes(option, sharder_data)
            a2a_bw = self._comms_bw(CollectiveType.ALL_TO_ALL)
            # A column shard sends its own columns only, pooled or not (embedding.py).
            out_elems = volume.shard_outputs * dim
            if table.pooled:  # partial pools are reduce-scattered to their batch's rank; grads all-gathered back
                fwd_comms = out_elems * fwd_rs / self._comms_bw(CollectiveType.REDUCE_SCATTER)
                if not self._is_inference:
                    bwd_comms = out_elems * bwd_rs / self._comms_bw(CollectiveType.ALL_GATHER)
            else:  # looked-up rows go back to the requesting ranks, gradients come the other way
                fwd_comms = out_elems * fwd_a2a / a2a_bw
                bwd_comms = 0.0 if self._is_inference else out_elems * bwd_a2a / a2a_bw
            input_dist = volume.shard_ids * id_bytes / a2a_bw
        return Perf(
            fwd_compute=fwd_compute,
            fwd_comms=fwd_comms,
            bwd_compute=bwd_compute,
            bwd_comms=bwd_comms,
            input_dist_comms=input_dist,
            prefetch_compute=self._tier_moves(option, table, sharder_data, volume, dim),
        )

    def _tier_moves(
        self, option: ShardingOption, table: _TableInfo, sharder_data: Any, volume: _StepVolume, dim: int
    ) -> float:
        """ms a step a tiered shard of width ``dim`` spends moving rows between its tiers (class docstring)."""
        if not table.tiered:
            return 0.0
        factor = option.cache_params.load_factor if option.cache_params is not None else None
        if factor is None:
            constraint = self._constraints.get(option.name) if self._constraints else None
            sharder_factor = sharder_cache_load_factor(getattr(sharder_data, "fused_params", None), _where(option))
            factor = planned_cache_load_factor(
                table.options, constraint.cache_params if constraint else None, _where(option), sharder_factor
            )
        factor = DEFAULT_CACHE_LOAD_FACTOR if factor is None else factor
        moved = dim * table.element_bytes + optimizer_state_bytes_per_row(table.optimizer_kind, dim)
        moved *= volume.shard_ids * (1.0 - factor) * (1 if self._is_inference else 2)
        if table.options.backing.startswith("file:"):
            bw = self._topology.ssd_mem_bw
        elif _tier(self._topology) == "hbm":
            bw = self._topology.hbm_to_ddr_mem_bw
        else:
            bw = self._topology.ddr_mem_bw
        return RANDOM_ROW_FACTOR * moved / bw


# ---------------------------------------------------------------------------- planner


def _tier(topology: Topology) -> str:
    return "hbm" if topology.compute_device in ("cuda", "mtia") else "ddr"


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1024**3:.3f} GB"


class _DynamicEmbeddingShardingPlanner(EmbeddingShardingPlanner):
    """TorchRec's planner; when it finds no plan, it names the tables that fit on no rank."""

    def plan(self, module: nn.Module, sharders: list[ModuleSharder[nn.Module]]) -> ShardingPlan:
        _warn_unknown_constraint_tables(self._constraints, module)
        try:
            return super().plan(module, sharders)
        except PlannerError as error:
            if getattr(error, "_names_tables", False):  # (the cache search's: it names them already)
                raise
            detail = _oversized_tables(self, module, sharders) or _growth_peaks(self, module, sharders)
            if not detail:
                raise
            raise PlannerError(
                detail + "\n\nTorchRec's planner reported:\n" + str(error),
                error_type=PlannerErrorType.INSUFFICIENT_STORAGE,
            ) from error


def _warn_unknown_constraint_tables(constraints: dict[str, ParameterConstraints] | None, module: nn.Module) -> None:
    """TorchRec's planner ignores constraints keyed by a name no table has (a typo constrains
    nothing, silently): say so. A warning, not an error: one planner may serve several models."""
    names: set[str] = set()
    for m in module.modules():
        for getter in ("embedding_bag_configs", "embedding_configs"):
            if callable(getattr(m, getter, None)):
                names.update(config.name for config in getattr(m, getter)())
    unknown = sorted(set(constraints or {}) - names)
    if unknown:
        logger.warning(
            "dynamic table planner: constraints name tables the model does not have, so they constrain "
            "nothing: %s (its tables: %s)",
            unknown,
            sorted(names),
        )


_TIERS = ("hbm", "ddr", "ssd")


def _budgets(planner: EmbeddingShardingPlanner) -> dict[str, tuple[int, int]]:
    """Per storage tier: (the largest rank's bytes, the largest left after the storage reservation)."""
    reserved = planner._storage_reservation.last_reserved_topology or planner._topology
    return {
        tier: (
            max(getattr(d.storage, tier) for d in planner._topology.devices),
            max(getattr(d.storage, tier) for d in reserved.devices),
        )
        for tier in _TIERS
    }


def _oversized_tables(
    planner: EmbeddingShardingPlanner, module: nn.Module, sharders: list[ModuleSharder[nn.Module]]
) -> str | None:
    """Lines naming each table whose smallest option needs more of a storage tier on one rank than
    any rank has (the compute device's tier first; a tiered table's backing in ddr or ssd), or None."""
    options = planner._enumerator.enumerate(module=module, sharders=sharders)  # cached by the enumerator
    budgets = _budgets(planner)
    compute = _tier(planner._topology)
    tiers = [compute] + [t for t in _TIERS if t != compute]
    too_big = []
    for fqn in dict.fromkeys(o.fqn for o in options):
        mine = [o for o in options if o.fqn == fqn]
        for tier in tiers:
            need, option = min(((max(getattr(s.storage, tier) for s in o.shards), o) for o in mine), key=lambda x: x[0])
            if need > budgets[tier][1]:
                too_big.append((fqn, tier, need, option))
                break
    if not too_big:
        return None
    lines = [f"Insufficient memory: {len(too_big)} table(s) fit on no rank ({planner._topology.compute_device}):"]
    for fqn, tier, need, option in sorted(too_big, key=lambda x: x[0]):
        hardware, capacity = budgets[tier]
        cache = option.cache_params.load_factor if option.cache_params is not None else None
        growth = _growth_peak_of(planner, option, sharders) if tier == compute else 0
        lines.append(
            f"  table {option.name!r} ({fqn}): needs {need} B = {_gb(need)} of {tier} on one rank even with its "
            f"smallest option ({option.sharding_type}, {option.compute_kernel}, {len(option.shards)} shard(s)"
            + (f", cache_load_factor {cache:.4g}" if cache is not None and is_dynamic_option(option) else "")
            + (f"; {growth} B of it held while its module grows: {_GROWTH_PEAK}" if growth else "")
            + f"); {tier} per rank {hardware} B = {_gb(hardware)}, {capacity} B = {_gb(capacity)} left after the "
            "storage reservation"
        )
    hint = "Reduce the table's capacity (num_embeddings) or dimension, use a lighter optimizer"
    if any(option.sharding_type != ShardingType.ROW_WISE.value for _, _, _, option in too_big):
        hint += ", allow row_wise sharding (constraints)"
    lines.append(hint + ", or add ranks / memory per rank.")
    return "\n".join(lines)


_GROWTH_PEAK = (
    "on CUDA a growth copies the module's storage into new buffers beside the old, planned at the last "
    "doubling; plan_capacity='initial' plans tables that will not fill without it"
)


def _growth_peak_of(planner: EmbeddingShardingPlanner, option: ShardingOption, sharders) -> int:
    """The bytes of ``option``'s largest shard held only while its module grows (0: none)."""
    estimators = _storage_estimators(planner)
    if not estimators or not is_dynamic_option(option):
        return 0
    table = _TableCache().info(option, {s.module_type: s for s in sharders}.get(type(option.module[1])))
    if table.tiered:
        return 0
    parts = _row_parts(option, planner._topology.world_size)
    return max(estimators[0].growth_peak(table, dim, parts) for dim in _shard_dims(option, table))


def _growth_peaks(
    planner: EmbeddingShardingPlanner, module: nn.Module, sharders: list[ModuleSharder[nn.Module]]
) -> str | None:
    """When every table fits on a rank but the plan does not, lines naming each table whose planned
    bytes hold a growth's peak and those bytes (its smallest option's), or None (no such table)."""
    options = planner._enumerator.enumerate(module=module, sharders=sharders)
    lines = []
    for fqn in dict.fromkeys(o.fqn for o in options):
        growth, option = min(
            ((_growth_peak_of(planner, o, sharders) * len(o.shards), o) for o in options if o.fqn == fqn),
            key=lambda x: x[0],
        )
        if growth:
            lines.append(f"  table {option.name!r} ({fqn}): {growth} B = {_gb(growth)} over its shards")
    if not lines:
        return None
    tier = _tier(planner._topology)
    hardware, capacity = _budgets(planner)[tier]
    return (
        f"No plan with the growth peak of these tables' modules ({planner._topology.compute_device}: {tier} per "
        f"rank {hardware} B = {_gb(hardware)}, {capacity} B = {_gb(capacity)} left after the storage reservation; "
        f"{_GROWTH_PEAK}):\n" + "\n".join(lines)
    )


# ---------------------------------------------------------------------------- cache sizes of tiered tables

CACHE_FACTOR_STEPS = 100  # the planner's load factors: k / 100


def _storage_estimators(planner: EmbeddingShardingPlanner) -> list[DynamicEmbeddingStorageEstimator]:
    """Our storage estimators in the planner's enumerator: the ones it was given, or (TorchRec's
    default enumerator) those install_default_planner_hook added."""
    enumerator = getattr(planner, "_enumerator", None)
    given = list(getattr(enumerator, "_estimators", None) or [])
    given += list(getattr(enumerator, "_dynamic_estimators", None) or [])
    return [e for e in given if isinstance(e, DynamicEmbeddingStorageEstimator)]


def _forget_search_space(planner: EmbeddingShardingPlanner) -> None:
    # TorchRec's enumerator keeps the last module's options, with their estimates, and hands back
    # copies for the same module: estimated at another load factor, they must be enumerated anew.
    enumerator = getattr(planner, "_enumerator", None)
    if hasattr(enumerator, "_last_stored_module"):
        enumerator._last_stored_module = None


def plan_choosing_caches(
    planner: EmbeddingShardingPlanner, module: nn.Module, sharders: list[ModuleSharder[nn.Module]], plan_once: Any
) -> ShardingPlan:
    """``plan_once()`` (TorchRec's ``plan``), after choosing the load factor of the tiered tables
    whose cache size nobody gave: the largest ``k / CACHE_FACTOR_STEPS`` whose plan fits, by
    bisection (see the module docstring). Without such tables, one ``plan_once()``."""
    estimators = _storage_estimators(planner)

    def attempt(level: int) -> tuple[ShardingPlan | None, PlannerError | None]:
        for estimator in estimators:
            estimator.auto_load_factor = level / CACHE_FACTOR_STEPS
            estimator.chose_cache_for = set()
        _forget_search_space(planner)
        try:
            return plan_once(), None
        except PlannerError as error:
            # (TorchRec says STRICT_CONSTRAINTS when the tables' sum fits but no packing of them does)
            if error.error_type not in (PlannerErrorType.INSUFFICIENT_STORAGE, PlannerErrorType.STRICT_CONSTRAINTS):
                raise
            return None, error

    if not estimators:
        return plan_once()
    plan, error = attempt(CACHE_FACTOR_STEPS)
    if plan is not None:
        return plan
    if not any(estimator.chose_cache_for for estimator in estimators):
        raise error
    best, error = attempt(0)
    if best is None:
        raise _smallest_caches_error(planner, module, sharders, estimators, error)
    low, high = 0, CACHE_FACTOR_STEPS  # a plan at low, none at high
    while high - low > 1:
        middle = (low + high) // 2
        plan, _ = attempt(middle)
        if plan is None:
            high = middle
        else:
            low, best = middle, plan
    for estimator in estimators:  # left at the factor planned with (later enumerations estimate it)
        estimator.auto_load_factor = low / CACHE_FACTOR_STEPS
    _forget_search_space(planner)
    return best


def _smallest_caches_error(
    planner: EmbeddingShardingPlanner,
    module: nn.Module,
    sharders: list[ModuleSharder[nn.Module]],
    estimators: list[DynamicEmbeddingStorageEstimator],
    error: PlannerError,
) -> PlannerError:
    """The error when even the smallest caches of the tiered tables the planner sizes leave no plan:
    the tables that fit on no rank alone (``_oversized_tables``), else every such table's smallest
    need over all ranks against the ranks' budget."""
    detail = _oversized_tables(planner, module, sharders)
    if detail is None:
        chosen = set().union(*(estimator.chose_cache_for for estimator in estimators))
        options = [o for o in planner._enumerator.enumerate(module=module, sharders=sharders) if o.name in chosen]
        tier = _tier(planner._topology)
        hardware, capacity = _budgets(planner)[tier]
        ranks = len(planner._topology.devices)
        lines = [
            "No plan even with the smallest caches of the tiered tables the planner sizes "
            f"({planner._topology.compute_device}: {tier} per rank {hardware} B = {_gb(hardware)}, {capacity} B = "
            f"{_gb(capacity)} left after the storage reservation, {ranks * capacity} B over {ranks} rank(s)):"
        ]
        for fqn in sorted(dict.fromkeys(o.fqn for o in options)):
            need, option = min(
                ((sum(getattr(s.storage, tier) for s in o.shards), o) for o in options if o.fqn == fqn),
                key=lambda x: x[0],
            )
            lines.append(
                f"  table {option.name!r} ({fqn}): needs {need} B = {_gb(need)} of {tier} over all ranks with its "
                f"smallest cache (cache_load_factor {option.cache_params.load_factor:.4g}, {option.sharding_type})"
            )
        detail = "\n".join(lines)
    detail += (
        "\nA tiered table's smallest cache holds one step's ids (batch size x pooling factors); give "
        "cache_params=CacheParams(load_factor=...) to size it yourself, or add memory / ranks."
    )
    failure = PlannerError(
        detail + "\n\nTorchRec's planner reported:\n" + str(error),
        error_type=PlannerErrorType.INSUFFICIENT_STORAGE,
    )
    failure._names_tables = True
    return failure


def make_planner(
    topology: Topology, batch_size: int, constraints: dict[str, ParameterConstraints] | None = None, **kwargs: Any
) -> EmbeddingShardingPlanner:
    """TorchRec's ``EmbeddingShardingPlanner`` with our estimators, for models holding dynamic
    tables, stock TorchRec tables, or both.

    ``constraints`` (per table name: sharding_types, compute_kernels, pooling_factors,
    num_poolings, batch_sizes, ...) are applied by TorchRec's enumerator and passed to both
    estimators. Other keyword arguments go to ``EmbeddingShardingPlanner`` (proposer, partitioner,
    storage_reservation, performance_model, stats, debug, callbacks, timeout_seconds, ...);
    ``is_inference``, ``pipeline_type`` and ``plan_capacity`` (growing tables planned at their
    "maximum", the default, or "initial" capacity; see the module docstring) go to the estimators. When no plan exists because a
    table fits on no rank, ``plan()`` raises ``PlannerError`` naming the table, its bytes and the
    per-rank capacity. Tiered tables cache the load factor of their constraint's ``cache_params``
    or config, else the largest the budget allows (``plan_choosing_caches``); the plan's
    ``cache_params`` carry it to the sharders.
    """
    if "enumerator" in kwargs:
        raise TypeError(
            "make_planner builds the enumerator itself (with the dynamic-table estimators); "
            "use EmbeddingShardingPlanner directly to pass your own"
        )
    is_inference = bool(kwargs.pop("is_inference", False))
    pipeline_type = kwargs.pop("pipeline_type", PipelineType.NONE)
    plan_capacity = kwargs.pop("plan_capacity", "maximum")
    stats = kwargs.pop("stats", None)
    stats = [EmbeddingStats()] if stats is None else list(stats) if isinstance(stats, list) else [stats]
    kwargs["stats"] = [*stats, GrowingTableStats(plan_capacity)]
    enumerator = EmbeddingEnumerator(
        topology=topology,
        batch_size=batch_size,
        constraints=constraints,
        estimator=[  # storage first: it plans the tiered tables' load factors, which perf prices
            DynamicEmbeddingStorageEstimator(
                topology,
                constraints,
                pipeline_type=pipeline_type,
                is_inference=is_inference,
                plan_capacity=plan_capacity,
            ),
            DynamicEmbeddingPerfEstimator(topology, constraints, is_inference=is_inference),
        ],
    )
    return _DynamicEmbeddingShardingPlanner(
        topology=topology, batch_size=batch_size, enumerator=enumerator, constraints=constraints, **kwargs
    )


@dataclass(frozen=True)
class GrowingTableBytes:
    """A growing table of a plan: its rows and resident bytes (all its shards) now and at its maximum."""

    path: str
    table: str
    initial_rows: int
    maximum_rows: int
    initial_bytes: int
    maximum_bytes: int
    planned_at: str  # "maximum" or "initial": the capacity the plan reserved

    def __str__(self) -> str:
        return (
            f"{self.path or '<root>'}.{self.table}: initial {self.initial_rows} rows {_gb(self.initial_bytes)}, "
            f"maximum {self.maximum_rows} rows {_gb(self.maximum_bytes)}, planned at its {self.planned_at}"
        )


class GrowingTableStats(Stats):
    """The planner stats of growing tables (``initial_capacity`` < num_embeddings): each one's
    bytes at its initial capacity and at its maximum, the two figures ``storage_bytes()`` /
    ``storage_bytes(maximum=True)`` give, whichever of them the plan reserved (``plan_capacity``).
    ``make_planner`` logs them after TorchRec's ``EmbeddingStats`` table; the last plan's are in
    ``.tables``."""

    def __init__(self, plan_capacity: Any = "maximum") -> None:
        self._plan_capacity = check_plan_capacity(plan_capacity)
        self.tables: list[GrowingTableBytes] = []

    def log(self, sharding_plan, topology, batch_size, storage_reservation, num_proposals, num_plans, run_time,
            best_plan, constraints=None, sharders=None, enumerator=None, debug=False, debug_stats=None) -> None:  # fmt: skip
        sharder_of = {sharder.module_type: sharder for sharder in sharders or []}
        cache, self.tables = _TableCache(), []
        for option in best_plan:
            if not is_dynamic_option(option):
                continue
            table = cache.info(option, sharder_of.get(type(option.module[1])))
            if table.tiered or table.initial_capacity is None or table.initial_capacity >= table.capacity:
                continue
            parts = _row_parts(option, topology.world_size)
            at = {
                at_initial: sum(
                    _resident_shard_bytes(table, dim, parts, at_initial) for dim in _shard_dims(option, table)
                )
                for at_initial in (True, False)
            }
            plan = self._plan_capacity
            planned_at = plan if isinstance(plan, str) else plan.get(table.name, "maximum")
            self.tables.append(
                GrowingTableBytes(
                    option.path, table.name, table.initial_capacity, table.capacity, at[True], at[False], planned_at
                )
            )
        if self.tables:
            logger.info("Growing tables (bytes of all shards):\n" + "\n".join(f"  {t}" for t in self.tables))


# ---------------------------------------------------------------------------- TorchRec's default planner
#
# DistributedModelParallel(model, sharders=...) without a plan, and any EmbeddingShardingPlanner
# built without an enumerator, enumerate with TorchRec's default estimators, which refuse our
# ``customized_kernel`` (and would under-count our tables' storage). TorchRec 1.8 has no registry
# for estimators (its perf-estimator factory only swaps hardware coefficients), so the hook below
# wraps ``EmbeddingEnumerator``: when it was built with the default estimators, the options of our
# modules go to our estimators and every other option to TorchRec's, exactly as before. It also
# refuses, at planning time, a model holding our modules when the sharders cannot shard them
# (TorchRec would silently leave them out of the plan and DDP-wrap them), and adds the planner
# callback that makes each rank's column shards of a dynamic table adjacent.

_MISSING_SHARDER_HINT = (
    "pass sharders=torchrec_ext.distributed.get_sharders() (our sharders plus TorchRec's "
    "defaults) to DistributedModelParallel / the planner"
)


def check_dynamic_modules_have_sharders(module: nn.Module, sharders: Sequence[ModuleSharder[nn.Module]]) -> None:
    """Raise if ``module`` holds a dynamic module that none of ``sharders`` shards (it would be
    left out of the plan and wrapped by DDP)."""
    sharder_of = {sharder.module_type: sharder for sharder in sharders}  # the last one wins, as in DMP
    missing = [
        f"{path or '<root>'} ({type(child).__name__})"
        for path, child in module.named_modules()
        if isinstance(child, DYNAMIC_MODULE_TYPES) and type(child) not in sharder_of
    ]
    # TorchRec's FP-EBC sharder would shard the dynamic EBC inside with TorchRec's EBC sharder.
    missing += [
        f"{path or '<root>'} ({type(child).__name__} over DynamicEmbeddingBagCollection, sharded by "
        f"{type(sharder_of[type(child)]).__name__})"
        for path, child in module.named_modules()
        if over_dynamic_ebc(child)
        and type(child) in sharder_of
        and not isinstance(sharder_of[type(child)], FeatureProcessedDynamicEmbeddingBagCollectionSharder)
    ]
    # TorchRec's MC sharder finds no kernel for ours (an opaque planner error), and a tower's
    # dynamic module would be sharded alone, then called by the tower with two KJTs.
    containers = [(p, m) for p, m in module.named_modules() if isinstance(m, _UNSHARDABLE_CONTAINERS)]
    inside = []
    for path, child in module.named_modules():
        outer = next((c for c in containers if path.startswith(f"{c[0]}.") or (path and not c[0])), None)
        if isinstance(child, DYNAMIC_MODULE_TYPES) and outer is not None:
            inside.append(f"{path} ({type(child).__name__} inside {type(outer[1]).__name__} {outer[0] or '<root>'})")
    if inside:
        raise PlannerError(
            f"dynamic table planner: TorchRec's managed-collision and tower modules cannot be sharded over "
            f"a dynamic collection: {', '.join(inside)}. Dynamic tables take raw ids (no managed collision "
            "needed): shard the dynamic collection outside such modules, or keep the model unsharded.",
            error_type=PlannerErrorType.OTHER,
        )
    if missing:
        raise PlannerError(
            f"dynamic table planner: no sharder for {', '.join(missing)}; TorchRec would leave "
            f"it out of the plan and wrap it in DistributedDataParallel. {_MISSING_SHARDER_HINT}.",
            error_type=PlannerErrorType.OTHER,
        )


def _column_refusals(
    module: nn.Module, constraints: dict[str, ParameterConstraints] | None, sharders: Sequence[ModuleSharder[nn.Module]]
) -> dict[tuple[str, str], str]:
    """(module path, table) -> why its dynamic table cannot be split into column shards, with what
    the module's sharder's fused_params change (as the sharded module will apply them); raises
    PlannerError when a table's constraints allow only data_parallel, saying why."""
    refusals = {}
    fused_params = {sharder.module_type: getattr(sharder, "fused_params", None) for sharder in sharders}
    for path, child in module.named_modules():
        dynamic = dynamic_module_of(child)
        if dynamic is None:
            continue
        # The optimizer the sharded module will train with: the module's, else the sharder's.
        kind = sharded_optimizer(dynamic, fused_params.get(type(child)), "dynamic table planner").kind
        stochastic_rounding = stochastic_rounding_of(fused_params.get(type(child)), "dynamic table planner")
        for cfg in _configs(dynamic):
            allowed = (constraints or {}).get(cfg.name)
            allowed = list(allowed.sharding_types) if allowed is not None and allowed.sharding_types else None
            where = f"dynamic table planner: table {cfg.name!r} ({path or '<root>'})"
            if (
                allowed
                and ShardingType.DATA_PARALLEL.value in allowed
                and not set(allowed) & set(SUPPORTED_SHARDING_TYPES)
            ):
                raise PlannerError(
                    f"{where} is constrained to data_parallel: {DATA_PARALLEL_REFUSAL}",
                    error_type=PlannerErrorType.OTHER,
                )
            refusal = column_sharding_refusal(cfg, kind, stochastic_rounding)
            if refusal is None:
                continue
            refusals[(path, cfg.name)] = (
                f"{where} is constrained to {allowed}, but it cannot be split into column shards: it {refusal}"
            )
    return refusals


def _drop_split_column_options(
    options: list[ShardingOption], refusals: dict[tuple[str, str], str]
) -> list[ShardingOption]:
    """``options`` without the column options of ``refusals``' tables that split their columns (a
    single column shard holds the whole table: exact); PlannerError when a table is left with none
    (its constraints allowed nothing else), saying why."""
    if not refusals:
        return options
    kept = [
        o
        for o in options
        if not (
            is_dynamic_option(o)
            and o.sharding_type in COLUMN_TYPES
            and (o.path, o.name) in refusals
            and len(o.shards) > 1
        )
    ]
    left = {(o.path, o.name) for o in kept if is_dynamic_option(o)}
    for table, reason in refusals.items():
        if table not in left and any((o.path, o.name) == table for o in options):
            raise PlannerError(reason, error_type=PlannerErrorType.OTHER)
    return kept


def _rank_widths(shards: Sequence[Any], ranks: Sequence[int]) -> list[tuple[int, int]]:
    """Each rank's total column width when ``shards[i]`` goes to ``ranks[i]``."""
    return sorted((r, sum(int(s.size[1]) for s, x in zip(shards, ranks) if x == r)) for r in set(ranks))


def _options_of_their_kind(options: list[ShardingOption]) -> list[ShardingOption]:
    """``options`` without those our FP-EBC sharder offers for the other kind of EBC: it offers
    TorchRec's kernels and ours (one sharder per module type), but an FP-EBC over a dynamic EBC
    takes only ``customized_kernel`` and our sharding types, one over TorchRec's EBC only TorchRec's kernels."""
    custom = EmbeddingComputeKernel.CUSTOMIZED_KERNEL.value

    def fits(option: ShardingOption) -> bool:
        if not isinstance(option.module[1], FeatureProcessedEmbeddingBagCollection):
            return True
        if is_dynamic_option(option):
            return option.compute_kernel == custom and option.sharding_type in SUPPORTED_SHARDING_TYPES
        return option.compute_kernel != custom

    return [o for o in options if fits(o)]


def adjacent_column_shards(best_plan: list[ShardingOption]) -> list[ShardingOption]:
    """A planner callback: each rank's column shards of a dynamic table made adjacent columns.

    TorchRec's partitioner deals a wide table's column shards out over the ranks (4 shards on 2
    ranks: ranks [0, 1, 0, 1]), but a rank holds one run of adjacent columns of a dynamic table
    (placement.py). Its shards are equal-sized (only the last may be wider), so the ranks are
    reordered, each rank keeping its count of shards, in the order the ranks first appear, the
    last shard's rank last: every rank keeps its columns' count, hence its storage and perf.
    """
    for option in best_plan:
        if not is_dynamic_option(option) or option.sharding_type not in COLUMN_TYPES or len(option.shards) < 3:
            continue
        shards = sorted(option.shards, key=lambda shard: shard.offset[1])
        ranks = [shard.rank for shard in shards]
        order = list(dict.fromkeys(ranks))
        order.remove(ranks[-1])
        order.append(ranks[-1])
        regrouped = [r for r in order for _ in range(ranks.count(r))]
        if regrouped != ranks and _rank_widths(shards, regrouped) == _rank_widths(shards, ranks):
            for shard, rank in zip(shards, regrouped):
                shard.rank = rank
    return best_plan


def _default_planner_estimators(
    topology: Topology, constraints: dict[str, ParameterConstraints] | None
) -> list[ShardEstimator]:
    return [  # storage first: it plans the tiered tables' load factors, which perf prices
        DynamicEmbeddingStorageEstimator(topology, constraints),
        DynamicEmbeddingPerfEstimator(topology, constraints),
    ]


def install_default_planner_hook() -> None:
    """Let TorchRec's default ``EmbeddingEnumerator`` (hence ``EmbeddingShardingPlanner()`` and
    ``DistributedModelParallel`` without a plan) cost our tables with our estimators, and refuse
    models whose dynamic modules have no sharder; every ``EmbeddingShardingPlanner`` gets the
    ``adjacent_column_shards`` callback. Idempotent; runs on ``import torchrec_ext.distributed``."""
    if getattr(EmbeddingEnumerator, "_torchrec_ext_hooked", False):
        return
    original_init, original_enumerate = EmbeddingEnumerator.__init__, EmbeddingEnumerator.enumerate
    original_populate = EmbeddingEnumerator.populate_estimates

    def __init__(self, topology, batch_size, constraints=None, estimator=None, *args, **kwargs):
        original_init(self, topology, batch_size, constraints, estimator, *args, **kwargs)
        # Only the defaults are extended; estimators a caller passes are theirs to choose.
        self._dynamic_estimators = None if estimator else _default_planner_estimators(topology, constraints)

    def enumerate(self, module, sharders):
        check_dynamic_modules_have_sharders(module, sharders)
        refusals = _column_refusals(module, self._constraints, sharders)
        # Column options of tables that cannot be split exactly are dropped, so the planner never
        # picks them.
        return _drop_split_column_options(original_enumerate(self, module, sharders), refusals)

    def populate_estimates(self, sharding_options):
        # In place, before any estimator sees them: enumerate returns this list.
        sharding_options[:] = _options_of_their_kind(sharding_options)
        ours = getattr(self, "_dynamic_estimators", None)
        if not ours or not any(is_dynamic_option(o) for o in sharding_options):
            return original_populate(self, sharding_options)
        original_populate(self, [o for o in sharding_options if not is_dynamic_option(o)])
        dynamic = [o for o in sharding_options if is_dynamic_option(o)]
        # What TorchRec's own populate_estimates hands its estimators: from 1.7 the sharders'
        # snapshots (_sharder_data_map), in 1.6 the sharders themselves (_sharder_map).
        sharders = getattr(self, "_sharder_data_map", None)
        for estimator in ours:
            estimator.estimate(dynamic, self._sharder_map if sharders is None else sharders)

    original_planner_init = EmbeddingShardingPlanner.__init__

    def planner_init(self, *args, **kwargs):
        original_planner_init(self, *args, **kwargs)
        # A copy: the caller's callback list is left as it was.
        self._callbacks = list(self._callbacks) + [adjacent_column_shards]

    original_plan = EmbeddingShardingPlanner.plan

    def plan(self, module, sharders):
        # Tiered tables without a cache size get the largest that fits (plan_choosing_caches).
        return plan_choosing_caches(self, module, sharders, lambda: original_plan(self, module, sharders))

    original_collective_plan = EmbeddingShardingPlanner.collective_plan

    def collective_plan(self, module, sharders=None, pg=None):
        # Every rank checks before rank 0 plans: an error raised on rank 0 alone would leave the
        # others waiting for its broadcast.
        check_dynamic_modules_have_sharders(module, sharders if sharders is not None else get_default_sharders())
        return original_collective_plan(self, module, sharders, pg)

    EmbeddingEnumerator.__init__ = __init__
    EmbeddingEnumerator.enumerate = enumerate
    EmbeddingShardingPlanner.collective_plan = collective_plan
    EmbeddingShardingPlanner.plan = plan
    EmbeddingShardingPlanner.__init__ = planner_init
    EmbeddingEnumerator.populate_estimates = populate_estimates
    EmbeddingEnumerator._torchrec_ext_hooked = True
