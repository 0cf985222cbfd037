"""ShardedDynamicEmbeddingBagCollection: a DynamicEmbeddingBagCollection sharded across ranks.

Each rank holds a local DynamicEmbeddingBagCollection with its share of the tables (see
sharded_base). One step:

    input_dist   ids routed per lookup slot (ops.route for row-wise, the owner for table-wise),
                 then exchanged by all_to_all_single and regrouped with torch ops (input_dist.py,
                 no fbgemm kernel): each rank receives its ids from all W ranks
    compute      the local module pools them (sum; mean is applied after the reduce) and inserts
                 unseen ids in training, exactly as the unsharded module does
    output_dist  TorchRec's row-wise reduce-scatter sums the partial pools back to their batch's
                 rank; its backward all-gathers the gradient for the local fused update,
                 divided by the world size (TorchRec's gradient division: the ranks train
                 on the mean of their losses). Ranks whose batches differ in size: an
                 all-to-all with per-rank splits instead (pooled_output_dist.py)

Table-wise tables ride the same path with all their ids sent to one rank, table-row-wise ones
spread over their node's ranks, and column-wise ones with all their ids sent to each rank of
their column shards, each of which pools its columns (the others' are zeros in its partial
output, so the reduce-scatter's sum assembles the whole vector): a model mixing every type runs
one all-to-all and one reduce-scatter per step.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import register_pytree_node
from torchrec.distributed.embedding_sharding import EmbeddingShardingContext, KJTListSplitsAwaitable
from torchrec.distributed.embedding_types import KJTList
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionContext
from torchrec.distributed.types import Awaitable, LazyAwaitable, ParameterSharding, ShardedModule, ShardingEnv
from torchrec.optim.fused import FusedOptimizerModule
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from torchrec_ext import device_sync
from torchrec_ext.distributed.pooled_output_dist import PooledOutputDist
from torchrec_ext.distributed.sharded_base import ShardedDynamicBase
from torchrec_ext.modules.embedding_bag_collection import DynamicEmbeddingBagCollection
from torchrec_ext.modules.features import check_and_arrange


class _PooledAwaitable(LazyAwaitable[KeyedTensor]):
    def __init__(
        self, reduced: Awaitable[Tensor], divisor: Tensor | None, keys: list[str], dims: list[int], dtype: torch.dtype
    ):
        super().__init__()
        self._reduced, self._divisor, self._keys, self._dims, self._dtype = reduced, divisor, keys, dims, dtype

    def _wait_impl(self) -> KeyedTensor:
        pooled = self._reduced.wait()
        if self._divisor is not None:
            pooled = pooled * self._divisor
        # The sum and the mean in float32, then one cast (its backward casts the gradient back).
        pooled = pooled.to(self._dtype)
        return KeyedTensor(keys=self._keys, length_per_key=self._dims, values=pooled, key_dim=1)


# DDP (DMP wraps the dense part in it, static_graph=True) finds the tensors of a model's output by
# pytree in its first iteration and routes them through _DDPSink, whose backward enqueues that
# iteration's all-reduce and builds the static graph. A model returning this awaitable itself (an
# FP-EBC's KeyedTensor) was a pytree leaf without tensors: no all-reduce ever ran, so the position
# weights trained on each rank's own gradient. Flattened, it is its (waited, cached) KeyedTensor.
register_pytree_node(
    _PooledAwaitable,
    lambda awaitable: ([LazyAwaitable._wait_async(awaitable)], None),
    lambda children, _context: children[0],
)


class ShardedDynamicEmbeddingBagCollection(
    ShardedDynamicBase,
    ShardedModule[KJTList, list[Tensor], KeyedTensor, EmbeddingBagCollectionContext],
    FusedOptimizerModule,
):
    def __init__(
        self,
        module: DynamicEmbeddingBagCollection,
        table_name_to_parameter_sharding: dict[str, ParameterSharding],
        env: ShardingEnv,
        device: torch.device | None = None,
        fused_params: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        configs = module.embedding_bag_configs()
        self._embedding_bag_configs = configs
        self._is_weighted = module.is_weighted()
        self._init_sharding(
            module,
            configs,
            table_name_to_parameter_sharding,
            env,
            device,
            "embedding_bags",
            pooled=True,
            is_weighted=self._is_weighted,
            fused_params=fused_params,
        )
        # This rank's routing slots (one per lookup slot whose table it holds, in lookup order, as
        # its local module pools them) and the output columns their pools fill.
        self._local_slots = self._routing.slots_on(self._rank)
        local_cols = []
        for i in self._local_slots:
            s = self._routing.source[i]
            first, width = self._owners[configs[self._plan.tables[s]].name].local_columns(self._rank)
            local_cols.extend(range(self._plan.cols[s] + first, self._plan.cols[s] + first + width))
        self._all_local = local_cols == list(range(self._plan.total_dim))
        self._local_cols = torch.tensor(local_cols, dtype=torch.int64, device=self._device)
        # A plain list, not a submodule, as the input dists (sharded_base.py).
        self._output_dists = [PooledOutputDist(env.process_group, self._plan.dims)]

    # ------------------------------------------------------------------ TorchRec contract

    @property
    def unsharded_module_type(self) -> type[DynamicEmbeddingBagCollection]:
        return DynamicEmbeddingBagCollection

    def create_context(self) -> EmbeddingBagCollectionContext:
        return EmbeddingBagCollectionContext(sharding_contexts=[EmbeddingShardingContext()])

    def input_dist(self, ctx: EmbeddingBagCollectionContext, features: KeyedJaggedTensor) -> KJTListSplitsAwaitable:
        # A variable batch size per feature: each feature's bags repeated into the full batch, as
        # routing sends one batch of every feature (the output is what TorchRec's expansion gives).
        try:  # refused here: every rank raises at the wait (sharded_base._refused_input)
            batch = check_and_arrange(
                features, self._plan, self._is_weighted, type(self).__name__, self._device, variable_batch="expand"
            )
            routed, _, _ = self._routing.route(batch.ids, batch.lengths, batch.weights, batch.batch_size)
            ctx.divisor = self._mean_divisor(batch.lengths, batch.batch_size)
        except Exception as error:  # noqa: BLE001 - raised at the wait, on every rank
            return self._refused_input(ctx, error)
        return KJTListSplitsAwaitable([self._input_dists[0](routed, ctx.sharding_contexts[0])], ctx)

    def compute(self, ctx: EmbeddingBagCollectionContext, dist_input: KJTList) -> list[Tensor]:
        received = dist_input[0]  # keys: every slot's output name; stride: batch_size * world_size
        stride = received.stride()
        if self._local is None:
            # Requires grad so this rank's backward still joins the reduce-scatter's all-gather.
            return [torch.zeros(stride, self._plan.total_dim, device=self._device, requires_grad=True)]
        self._local.train(self.training)
        pooled = self._local(self._local_features(dist_input)).values()
        if self._all_local:
            return [pooled]
        full = pooled.new_zeros(stride, self._plan.total_dim)
        return [full.index_copy(1, self._local_cols, pooled)]

    def _local_features(self, dist_input: KJTList) -> KeyedJaggedTensor:
        """The local module's input: the received ids of the slots of its tables."""
        received = dist_input[0]
        names, stride = self._routing.names, received.stride()
        if len(self._local_slots) == len(names):
            return received
        # slots of other ranks' tables carry no ids here: keep the local slots' lengths
        lengths = received.lengths().view(len(names), stride)[self._local_slots].reshape(-1)
        per_key = received.length_per_key_or_none()  # known on the host: the module reads no lengths
        return KeyedJaggedTensor(
            keys=[names[i] for i in self._local_slots],
            values=received.values(),
            weights=received.weights_or_none(),
            lengths=lengths,
            stride=stride,
            length_per_key=None if per_key is None else [per_key[i] for i in self._local_slots],
        )

    def output_dist(self, ctx: EmbeddingBagCollectionContext, output: list[Tensor]) -> LazyAwaitable[KeyedTensor]:
        reduced = self._output_dists[0](output[0], ctx.sharding_contexts[0])
        return _PooledAwaitable(reduced, ctx.divisor, self._plan.embedding_names, self._plan.dims, self._output_dtype)

    def compute_and_output_dist(self, ctx: EmbeddingBagCollectionContext, input: KJTList) -> LazyAwaitable[KeyedTensor]:
        return self.output_dist(ctx, self.compute(ctx, input))

    def _mean_divisor(self, lengths: Tensor, batch_size: int) -> Tensor | None:
        if not any(self._plan.mean):
            return None
        per_slot = lengths.view(len(self._plan.mean), batch_size).t().float().clamp(min=1)
        _, _, mean = self._plan.tensors(lengths.device)
        scale = torch.where(mean, 1.0 / per_slot, torch.ones_like(per_slot))
        dims = device_sync.to_device(
            torch.tensor(self._plan.dims, device="cpu"), lengths.device
        )  # no blocking copy on a GPU
        # output_size: the width is known on the host (without it, a GPU reads dims' sum back: a sync)
        return torch.repeat_interleave(scale, dims, dim=1, output_size=self._plan.total_dim)

    # ------------------------------------------------------------------ module interface

    def embedding_bag_configs(self):
        return self._embedding_bag_configs

    def is_weighted(self) -> bool:
        return self._is_weighted
