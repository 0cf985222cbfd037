"""ShardedDynamicEmbeddingBagCollection: a DynamicEmbeddingBagCollection sharded across ranks.

Each rank holds a local DynamicEmbeddingBagCollection with its share of the tables: a 1/W
slice (by capacity) of every row-wise table and the whole of each table-wise table placed on it.
One step:

    input_dist   ids routed per lookup slot (ops.route for row-wise, the owner for table-wise),
                 then TorchRec's KJTAllToAll: each rank receives its ids from all W ranks
    compute      the local module pools them (sum; mean is applied after the reduce) and inserts
                 unseen ids in training, exactly as the unsharded module does
    output_dist  TorchRec's row-wise reduce-scatter sums the partial pools back to their batch's
                 rank; its backward all-gathers the gradient for the local fused update

Table-wise tables ride the same path with all their ids sent to one rank, so a model mixing
both types runs one all-to-all and one reduce-scatter per step.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Type

import torch
from torch import Tensor, nn
from torchrec.distributed.dist_data import KJTAllToAll
from torchrec.distributed.embedding_sharding import EmbeddingShardingContext, KJTListSplitsAwaitable
from torchrec.distributed.embedding_types import KJTList
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionContext
from torchrec.distributed.sharding.rw_sharding import RwPooledEmbeddingDist
from torchrec.distributed.types import Awaitable, LazyAwaitable, ParameterSharding, ShardedModule, ShardingEnv
from torchrec.modules.embedding_configs import PoolingType
from torchrec.optim.fused import FusedOptimizerModule
from torchrec.optim.keyed import KeyedOptimizer
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from torchrec_ext.distributed.routing import route_ids
from torchrec_ext.distributed.sharded_state import ShardedDynamicState
from torchrec_ext.modules.configs import (
    DynamicEmbeddingBagConfig, DynamicEmbeddingConfig, Initializer, initializer_of, options_of,
)
from torchrec_ext.modules.embedding_bag_collection import DynamicEmbeddingBagCollection
from torchrec_ext.modules.features import LookupPlan, check_and_arrange
from torchrec_ext.reference import INITIALIZERS

SUPPORTED_SHARDING_TYPES = ("table_wise", "row_wise")
_INITIALIZER_NAMES = {v: k for k, v in INITIALIZERS.items()}


def local_capacity(capacity: int, world_size: int) -> int:
    """Rows a rank holds of a row-wise table: an even share (ids spread evenly under the hash)."""
    return -(-capacity // world_size)


def check_plan(where: str, configs, plan: Dict[str, ParameterSharding], world_size: int) -> Dict[str, int]:
    """Owner rank per table (-1: row-wise); clear errors for what the plan asks that we cannot do."""
    owners = {}
    for cfg in configs:
        sharding = plan.get(cfg.name)
        if sharding is None:
            raise ValueError(f"{where}: the sharding plan has no entry for table {cfg.name!r}")
        if sharding.sharding_type not in SUPPORTED_SHARDING_TYPES:
            raise ValueError(f"{where}: table {cfg.name!r} asks for sharding type {sharding.sharding_type!r}; "
                             f"dynamic tables support {list(SUPPORTED_SHARDING_TYPES)}")
        ranks = sharding.ranks or []
        if any(r < 0 or r >= world_size for r in ranks):
            raise ValueError(f"{where}: table {cfg.name!r} is planned on ranks {ranks}, but the process group has "
                             f"world size {world_size}: the plan was made for another world size")
        if sharding.sharding_type == "table_wise":
            if len(ranks) != 1:
                raise ValueError(f"{where}: table-wise table {cfg.name!r} needs exactly one rank, got {ranks}")
            owners[cfg.name] = ranks[0]
        else:
            if ranks and sorted(ranks) != list(range(world_size)):
                raise ValueError(f"{where}: row-wise table {cfg.name!r} must span all {world_size} ranks, got {ranks}")
            owners[cfg.name] = -1
    return owners


def _local_config(cfg, share: int, feature_names: List[str], pooled: bool):
    """The config of this rank's share: same name, seed and initial vectors, its own capacity,
    features renamed to their output names, sum pooling (mean is applied after the reduce)."""
    opts = options_of(cfg)
    kind, params = initializer_of(cfg)  # resolved against the global capacity: same vectors as unsharded
    names = ("low", "high") if kind == INITIALIZERS["uniform"] else ("mean", "std", "low", "high")
    init = Initializer(_INITIALIZER_NAMES[kind], **dict(zip(names, params))) if kind != INITIALIZERS["constant"] \
        else Initializer("constant", value=params[0])
    fields = dict(
        name=cfg.name, embedding_dim=cfg.embedding_dim, num_embeddings=local_capacity(cfg.num_embeddings, share),
        feature_names=feature_names, eviction_policy=opts.eviction_policy, initializer=init,
        admit_after=opts.admit_after,
        admission_capacity=None if opts.admission_capacity is None else local_capacity(opts.admission_capacity, share),
        ttl_steps=opts.ttl_steps, seed=opts.seed,
    )
    return DynamicEmbeddingBagConfig(pooling=PoolingType.SUM, **fields) if pooled else DynamicEmbeddingConfig(**fields)


def local_configs_for(module, configs, owners: Dict[str, int], plan: LookupPlan, rank: int, world_size: int,
                      device: Optional[torch.device], pooled: bool):
    """(configs of this rank's tables, the module's optimizer spec, the device to build on)."""
    local = []
    for t, cfg in enumerate(configs):
        owner = owners[cfg.name]
        if owner >= 0 and owner != rank:
            continue
        slots = [plan.embedding_names[i] for i, tt in enumerate(plan.tables) if tt == t]
        local.append(_local_config(cfg, 1 if owner >= 0 else world_size, slots, pooled))
    fused = module._ensure_optimizer()
    device = torch.device(device) if device is not None else module.device
    if device.type == "meta":
        device = torch.device("cpu")
    return local, None if fused is None else fused.spec, device


class _RoutedInputDist(nn.Module):
    """Holds the KJTAllToAll (TorchRec's pipelines look for ``_dist`` and fuse its splits)."""

    def __init__(self, pg, num_keys: int, world_size: int):
        super().__init__()
        self._dist = KJTAllToAll(pg, splits=[num_keys] * world_size)

    def forward(self, routed: KeyedJaggedTensor) -> Awaitable[Awaitable[KeyedJaggedTensor]]:
        return self._dist(routed)


class _PooledAwaitable(LazyAwaitable[KeyedTensor]):
    def __init__(self, reduced: Awaitable[Tensor], divisor: Optional[Tensor], keys: List[str], dims: List[int]):
        super().__init__()
        self._reduced, self._divisor, self._keys, self._dims = reduced, divisor, keys, dims

    def _wait_impl(self) -> KeyedTensor:
        pooled = self._reduced.wait()
        if self._divisor is not None:
            pooled = pooled * self._divisor
        return KeyedTensor(keys=self._keys, length_per_key=self._dims, values=pooled, key_dim=1)


class ShardedDynamicEmbeddingBagCollection(
    ShardedDynamicState, ShardedModule[KJTList, List[Tensor], KeyedTensor, EmbeddingBagCollectionContext],
    FusedOptimizerModule,
):
    def __init__(self, module: DynamicEmbeddingBagCollection, table_name_to_parameter_sharding: Dict[str, ParameterSharding],
                 env: ShardingEnv, device: Optional[torch.device] = None) -> None:
        super().__init__()
        where = type(self).__name__
        self._env = env
        self._world_size, self._rank = env.world_size, env.rank
        configs = module.embedding_bag_configs()
        self._owners = check_plan(where, configs, table_name_to_parameter_sharding, self._world_size)
        self._table_sharding = {name: table_name_to_parameter_sharding[name] for name in self._owners}
        self._embedding_bag_configs = configs
        self._is_weighted = module.is_weighted()
        self._plan = LookupPlan.of(configs)
        self._slot_owner = [self._owners[configs[t].name] for t in self._plan.tables]
        self._slot_local = [o < 0 or o == self._rank for o in self._slot_owner]
        local_configs, spec, device = local_configs_for(module, configs, self._owners, self._plan, self._rank,
                                                        self._world_size, device, pooled=True)
        # The local tables: a plain module (not a child), whose per-table submodules are ours, so
        # state_dict keys stay "embedding_bags.<table>.*" as in the unsharded module.
        self._local: Optional[DynamicEmbeddingBagCollection] = None
        if local_configs:
            local = DynamicEmbeddingBagCollection(
                local_configs, is_weighted=self._is_weighted, device=device,
                optimizer=None if spec is None else spec.kind,
                optimizer_kwargs=None if spec is None else spec.torch_kwargs())
            object.__setattr__(self, "_local", local)
            self.embedding_bags = local.embedding_bags
        else:
            self.embedding_bags = nn.ModuleDict()
        local_slots = [i for i, is_local in enumerate(self._slot_local) if is_local]
        self._local_slots = local_slots
        local_cols = [c for i in local_slots for c in range(self._plan.cols[i], self._plan.cols[i] + self._plan.dims[i])]
        self._all_local = local_cols == list(range(self._plan.total_dim))
        self._local_cols = torch.tensor(local_cols, dtype=torch.int64, device=device)
        self._device = device
        self._input_dists = nn.ModuleList([_RoutedInputDist(env.process_group, len(self._plan.embedding_names), self._world_size)])
        self._output_dist = RwPooledEmbeddingDist(env.process_group, self._plan.dims)
        self._init_sharded_state("embedding_bags", configs, None if spec is None else spec.kind)

    # ------------------------------------------------------------------ TorchRec contract

    @property
    def unsharded_module_type(self) -> Type[DynamicEmbeddingBagCollection]:
        return DynamicEmbeddingBagCollection

    def create_context(self) -> EmbeddingBagCollectionContext:
        return EmbeddingBagCollectionContext(sharding_contexts=[EmbeddingShardingContext()])

    def input_dist(self, ctx: EmbeddingBagCollectionContext, features: KeyedJaggedTensor) -> KJTListSplitsAwaitable:
        batch = check_and_arrange(features, self._plan, self._is_weighted, type(self).__name__)
        routed, _ = route_ids(self._plan.embedding_names, batch.ids, batch.lengths, batch.weights, self._slot_owner,
                              batch.batch_size, self._world_size)
        ctx.divisor = self._mean_divisor(batch.lengths, batch.batch_size)
        return KJTListSplitsAwaitable([self._input_dists[0](routed)], ctx)

    def compute(self, ctx: EmbeddingBagCollectionContext, dist_input: KJTList) -> List[Tensor]:
        received = dist_input[0]  # keys: every slot's output name; stride: batch_size * world_size
        stride = received.stride()
        if self._local is None:
            # Requires grad so this rank's backward still joins the reduce-scatter's all-gather.
            return [torch.zeros(stride, self._plan.total_dim, device=self._device, requires_grad=True)]
        names = self._plan.embedding_names
        if len(self._local_slots) == len(names):
            local_kjt = received
        else:  # slots of other ranks' tables carry no ids here: keep the local slots' lengths
            lengths = received.lengths().view(len(names), stride)[self._local_slots].reshape(-1)
            local_kjt = KeyedJaggedTensor(keys=[names[i] for i in self._local_slots], values=received.values(),
                                          weights=received.weights_or_none(), lengths=lengths, stride=stride)
        self._local.train(self.training)
        pooled = self._local(local_kjt).values()
        if self._all_local:
            return [pooled]
        full = pooled.new_zeros(stride, self._plan.total_dim)
        return [full.index_copy(1, self._local_cols, pooled)]

    def output_dist(self, ctx: EmbeddingBagCollectionContext, output: List[Tensor]) -> LazyAwaitable[KeyedTensor]:
        reduced = self._output_dist(output[0], ctx.sharding_contexts[0])
        return _PooledAwaitable(reduced, ctx.divisor, self._plan.embedding_names, self._plan.dims)

    def compute_and_output_dist(self, ctx: EmbeddingBagCollectionContext, input: KJTList) -> LazyAwaitable[KeyedTensor]:
        return self.output_dist(ctx, self.compute(ctx, input))

    def _mean_divisor(self, lengths: Tensor, batch_size: int) -> Optional[Tensor]:
        if not any(self._plan.mean):
            return None
        per_slot = lengths.view(len(self._plan.mean), batch_size).t().float().clamp(min=1)
        scale = torch.where(torch.tensor(self._plan.mean, device=lengths.device), 1.0 / per_slot, torch.ones_like(per_slot))
        return torch.repeat_interleave(scale, torch.tensor(self._plan.dims, device=lengths.device), dim=1)

    # ------------------------------------------------------------------ optimizer, state

    @property
    def fused_optimizer(self) -> KeyedOptimizer:
        from torchrec.optim.fused import EmptyFusedOptimizer

        return self._local.fused_optimizer if self._local is not None else EmptyFusedOptimizer()

    def embedding_bag_configs(self):
        return self._embedding_bag_configs

    def is_weighted(self) -> bool:
        return self._is_weighted

    @property
    def local_module(self) -> Optional[DynamicEmbeddingBagCollection]:
        """This rank's share of the tables, as a plain DynamicEmbeddingBagCollection."""
        return self._local
