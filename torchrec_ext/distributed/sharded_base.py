"""What both sharded dynamic modules share: reading the plan, the configs and construction of
this rank's share of the tables, the input dist holder, and the fused optimizer they expose.

Each rank holds a plain Dynamic* module with its share of the tables (placement.py): a 1/W
slice (by capacity) of every row-wise table (1/len(group) of a table-row-wise one), the whole
of each table-wise table placed on it, and its columns of each column-wise table. Its
per-table submodules are the sharded module's, so state_dict keys stay those of the unsharded
module ("embedding_bags.<table>.*" / "embeddings.<table>.*"; a table another rank holds is an
empty placeholder, ``AbsentTable``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.embedding_sharding import KJTListSplitsAwaitable
from torchrec.distributed.embedding_types import KJTList
from torchrec.distributed.types import ParameterSharding, ShardingEnv
from torchrec.modules.embedding_configs import PoolingType
from torchrec.optim.fused import EmptyFusedOptimizer
from torchrec.optim.keyed import KeyedOptimizer

from torchrec_ext.distributed.deltas import ShardedDeltaMixin
from torchrec_ext.distributed.input_dist import RoutedInputDist
from torchrec_ext.distributed.placement import TablePlacement, read_plan
from torchrec_ext.distributed.routing import SlotRouting
from torchrec_ext.distributed.sharded_state import ShardedDynamicState
from torchrec_ext.distributed.tier_plan import (
    planned_cache_algorithm,
    planned_cache_load_factor,
    sharder_cache_algorithm,
    sharder_cache_load_factor,
)
from torchrec_ext.modules.admission import local_admission_fields
from torchrec_ext.modules.configs import (
    DynamicEmbeddingBagConfig,
    DynamicEmbeddingConfig,
    Initializer,
    initializer_of,
    options_of,
)
from torchrec_ext.modules.features import LookupPlan
from torchrec_ext.modules.fused_optimizer import (
    DEFAULT_OPTIMIZER,
    OptimizerSpec,
    output_dtype_of,
    spec_from_fused_params,
    stochastic_rounding_of,
)
from torchrec_ext.modules.table_modules import DynamicTableDict
from torchrec_ext.modules.table_stats import TableStats


def local_capacity(capacity: int, world_size: int) -> int:
    """Rows a rank holds of a row-wise table: an even share (ids spread evenly under the hash)."""
    return -(-capacity // world_size)


def _local_config(
    cfg,
    placement: TablePlacement,
    rank: int,
    world_size: int,
    feature_names: list[str],
    pooled: bool,
    stochastic_rounding: bool | None = None,
    cache_load_factor: float | None = None,
    cache_algorithm: str | None = None,
):
    """The config of this rank's share: same name, seed, initial vectors, data_type and backing, its
    own capacity (a 1/parts share of a row table's; a tiered one caches ``cache_load_factor`` of
    that share with ``cache_algorithm`` (the plan's: tier_plan.py), over backing files of its own: ``backing_shard``) and
    columns (a column table's shards here), features renamed to their output names, sum pooling
    (mean is applied after the reduce); ``stochastic_rounding`` (the sharder's fused_params')
    overrides the config's."""
    opts = options_of(cfg)
    share = placement.parts
    first_column, width = placement.local_columns(rank)
    # Resolved against the global capacity (TorchRec's default bounds depend on it): the same
    # vectors as the unsharded module (a column shard: its columns of them).
    kind, params = initializer_of(cfg)
    init = dataclasses.replace(Initializer.from_kernel_params(kind, params), first_column=first_column)
    fields = dict(
        name=cfg.name,
        embedding_dim=width,
        num_embeddings=local_capacity(cfg.num_embeddings, share),
        feature_names=feature_names,
        eviction_policy=opts.eviction_policy,
        initializer=init,
        ttl_steps=opts.ttl_steps,
        seed=opts.seed,
        **local_admission_fields(opts, cfg.num_embeddings, share),
        fallback_rows=opts.fallback_rows,
        # each rank's share grows on its own, from its share of the initial capacity
        initial_capacity=None if opts.initial_capacity is None else local_capacity(opts.initial_capacity, share),
        growth_load_factor=opts.growth_load_factor,
        data_type=cfg.data_type,
        stochastic_rounding=opts.stochastic_rounding if stochastic_rounding is None else stochastic_rounding,
        backing=opts.backing,
        cache_load_factor=cache_load_factor,
        cache_algorithm=cache_algorithm,
        backing_shard=None if opts.backing == "device" else f"rank{rank}-of-{world_size}",
    )
    return DynamicEmbeddingBagConfig(pooling=PoolingType.SUM, **fields) if pooled else DynamicEmbeddingConfig(**fields)


def sharded_optimizer(module, fused_params: dict[str, Any] | None, where: str) -> OptimizerSpec:
    """The fused optimizer of a sharded module, in TorchRec's precedence: the one chosen on the
    module (apply_optimizer_in_backward, or its constructor), else the sharder's ``fused_params``,
    else TorchRec's sharded default (fbgemm's EXACT_SGD, learning rate 0.01). ``fused_params`` are
    checked in every case, so an unsupported one is refused at sharding time."""
    from_sharder = spec_from_fused_params(fused_params, where)
    return module._chosen_spec() or from_sharder or DEFAULT_OPTIMIZER


class AbsentTable(nn.Module):
    """``embedding_bags.<table>`` / ``embeddings.<table>`` of a table another rank holds: an
    empty ``weight`` (as TorchRec's sharded modules register), so every rank's sharded module
    has the unsharded module's parameter names. Its state is the sharded module's
    (sharded_state.py): it saves and loads nothing itself."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(0, device="cpu"))
        self.weight._in_backward_optimizers = [EmptyFusedOptimizer()]  # not the dense optimizer's

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        pass

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ) -> None:
        pass


def _sharded_container(local, container: str, configs) -> nn.ModuleDict:
    """The sharded module's ``embedding_bags`` / ``embeddings``: every table of ``configs`` in
    their order, this rank's tables' submodules (``local``'s) and an ``AbsentTable`` for the others."""
    held = getattr(local, container) if local is not None else {}
    if list(held.keys()) == [cfg.name for cfg in configs]:
        return held
    modules = {cfg.name: held[cfg.name] if cfg.name in held else AbsentTable() for cfg in configs}
    return DynamicTableDict(local._tables, modules) if local is not None else nn.ModuleDict(modules)


class ShardedDynamicBase(ShardedDynamicState, ShardedDeltaMixin):
    """The construction both sharded modules share; the host is a ShardedModule that calls
    ``_init_sharding`` in its constructor."""

    def _init_sharding(
        self,
        module,
        configs,
        table_name_to_parameter_sharding: dict[str, ParameterSharding],
        env: ShardingEnv,
        device: torch.device | None,
        container: str,
        pooled: bool,
        fused_params: dict[str, Any] | None = None,
        **local_kwargs,
    ) -> None:
        self._env = env
        self._world_size, self._rank = env.world_size, env.rank
        spec = sharded_optimizer(module, fused_params, type(self).__name__)
        stochastic_rounding = stochastic_rounding_of(fused_params, type(self).__name__)
        # The outputs' dtype (fbgemm's output_dtype): lookups and the reduce stay float32, cast once at the end.
        self._output_dtype = output_dtype_of(fused_params, type(self).__name__)
        self._owners = read_plan(
            type(self).__name__,
            configs,
            table_name_to_parameter_sharding,
            self._world_size,
            spec.kind,
            stochastic_rounding,
        )
        self._plan = LookupPlan.of(configs)
        self._routing = SlotRouting.of(
            self._plan.embedding_names, [self._owners[configs[t].name] for t in self._plan.tables], self._world_size
        )
        sharder_factor = sharder_cache_load_factor(fused_params, type(self).__name__)
        sharder_algorithm = sharder_cache_algorithm(fused_params, type(self).__name__)
        local_configs, replicated = [], []
        for t, cfg in enumerate(configs):
            placement = self._owners[cfg.name]
            if placement.kind == "row" and options_of(cfg).fallback_rows:
                replicated.append(len(local_configs))
            cache_params = table_name_to_parameter_sharding[cfg.name].cache_params
            where = f"{type(self).__name__}: table {cfg.name!r}"
            factor = planned_cache_load_factor(cfg, cache_params, where, sharder_factor)
            algorithm = planned_cache_algorithm(cfg, cache_params, where, sharder_algorithm)
            if placement.holds(self._rank):
                slots = [self._plan.embedding_names[i] for i, tt in enumerate(self._plan.tables) if tt == t]
                local_configs.append(
                    _local_config(
                        cfg,
                        placement,
                        self._rank,
                        self._world_size,
                        slots,
                        pooled,
                        stochastic_rounding,
                        factor,
                        algorithm,
                    )
                )
        widths = {c.name: c.embedding_dim for c in local_configs}
        if not pooled and len(set(widths.values())) > 1:
            raise ValueError(
                f"{type(self).__name__}: rank {self._rank} would hold columns of unequal width {widths}; "
                f"an EmbeddingCollection's tables share one dim, so on each rank every table's columns "
                f"must be as wide (split the column-wise tables alike)"
            )
        device = torch.device(device) if device is not None else module.device
        self._device = torch.device("cpu") if device.type == "meta" else device
        # This rank's tables: a plain module (not a child), whose table submodules are ours.
        self._local = None
        if local_configs:
            local = type(module)(
                local_configs,
                device=self._device,
                optimizer=spec.kind,
                optimizer_kwargs=spec.torch_kwargs(),
                **local_kwargs,
            )
            # This rank's share: its rows are its own (each id has one owner), no replica of the
            # other ranks' tables, so the unsharded module's replica warning does not apply.
            local.per_rank_tables = True
            object.__setattr__(self, "_local", local)
            if replicated and self._world_size > 1:
                # Every rank holds a copy of a row-wise table's fallback rows (an id reads its slot
                # on the rank it routes to); their gradients are summed over the ranks before each
                # step, so the copies stay equal to the unsharded table's rows.
                all_reduce = functools.partial(dist.all_reduce, group=env.process_group)
                local._tables.replicated_fallback = (replicated, all_reduce)
        setattr(self, container, _sharded_container(self._local, container, configs))
        # A plain list, not a submodule (as TorchRec's sharded modules keep their dists): the
        # sharded module's FQNs are the unsharded one's, which torch's composable contract
        # (torchrec.distributed.shard) checks. The dists hold no tensors.
        self._input_dists = [RoutedInputDist(env.process_group, len(self._routing.names), self._world_size)]
        self._init_sharded_state(container, configs, spec.kind)

    def _refused_input(self, ctx, error: Exception) -> KJTListSplitsAwaitable:
        """The input dist of a batch this rank refused (its checks or routing raised ``error``):
        this rank still takes part in the counts exchange, marking the batch refused, so every
        rank raises at the wait (this one ``error``, the others naming this rank), no rank left
        waiting in a collective and no table touched."""
        return KJTListSplitsAwaitable([self._input_dists[0].refuse(error, self._device)], ctx)

    @property
    def fused_optimizer(self) -> KeyedOptimizer:
        return self._local.fused_optimizer if self._local is not None else EmptyFusedOptimizer()

    @property
    def local_module(self):
        """This rank's share of the tables, as a plain Dynamic* module (None: no table here)."""
        return self._local

    def table_stats(self) -> dict[str, TableStats]:
        """This rank's shards' stats (``DynamicEmbeddingBagCollection.table_stats``); merge every
        rank's with ``torchrec_ext.distributed.table_stats.reduce_table_stats`` (collective)."""
        if self._local is None:
            return {}
        # A column table's shards hold the same rows and see the same ids: the first shard's rank
        # reports for the whole table, so the reduce counts it once.
        return {
            name: stats
            for name, stats in self._local.table_stats().items()
            if self._owners[name].kind != "column" or self._owners[name].first_rank == self._rank
        }

    def stage_next_dist(self, dist_input: Callable[[], KJTList | None]) -> bool:
        """This rank's shares of tiered tables: stages the rows of the next batch, whose ids
        ``dist_input()`` gives as the input dist hands them to ``compute`` (None: stage nothing),
        called on the stage's worker thread once this rank's next lookup starts (the input dist
        in flight is waited for there, not on the train thread). What ``TrainPipeline`` calls
        (``DynamicEmbeddingBagCollection.stage_next``); False, doing nothing, without tiered shares."""
        if self._local is None:
            return False

        def local_features():
            received = dist_input()
            return None if received is None else self._local_features(received)

        return self._local.stage_next(local_features)

    def tier_step_stats(self) -> dict[str, dict[str, int]]:
        """This rank's shares of tiered tables (host or file backing): their cache traffic of the
        last step (``DynamicEmbeddingBagCollection.tier_step_stats``), per table; every shard moves
        rows of its own, column shards included."""
        return {} if self._local is None else self._local.tier_step_stats()
