"""ShardedDynamicEmbeddingCollection: a DynamicEmbeddingCollection sharded across ranks.

The same routing as ShardedDynamicEmbeddingBagCollection (row-wise by ``ops.route``, table-wise
to the owner, one routed all-to-all: input_dist.py). The lookup rank returns one vector per id, and an
all-to-all brings the vectors back to the rank of their batch, where they are put back in
the input's order: ``forward`` gives, per feature, a JaggedTensor as the unsharded module does.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Type

import torch
from torch import Tensor
from torch.distributed.nn.functional import all_to_all_single
from torchrec.distributed.embedding_sharding import EmbeddingShardingContext, KJTListSplitsAwaitable
from torchrec.distributed.embedding_types import KJTList
from torchrec.distributed.types import LazyAwaitable, ParameterSharding, ShardedModule, ShardingEnv
from torchrec.optim.fused import FusedOptimizerModule
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor
from torchrec.streamable import Multistreamable

from torchrec_ext.distributed.input_dist import transpose_segments
from torchrec_ext.distributed.routing import route_ids
from torchrec_ext.distributed.sharded_base import ShardedDynamicBase
from torchrec_ext.modules.embedding_collection import DynamicEmbeddingCollection
from torchrec_ext.modules.features import check_and_arrange


@dataclass
class SequenceShardingContext(Multistreamable):
    """What the output dist needs from the input dist of the same batch."""

    sharding_contexts: List[EmbeddingShardingContext] = field(default_factory=lambda: [EmbeddingShardingContext()])
    order: Optional[Tensor] = None           # routed position -> input position of each id
    sent_per_rank: List[int] = field(default_factory=list)
    lengths: Optional[Tensor] = None         # input lengths, lookup-slot major
    ids: Optional[Tensor] = None             # input ids (the weights when need_indices)
    batch_size: int = 0
    received_lengths: Optional[Tensor] = None  # [slots, world, batch] lengths of the ids received

    def record_stream(self, stream: torch.Stream) -> None:
        for t in (self.order, self.lengths, self.ids, self.received_lengths):
            if t is not None:
                t.record_stream(stream)


class _SequenceAwaitable(LazyAwaitable[Dict[str, JaggedTensor]]):
    def __init__(self, result: Dict[str, JaggedTensor]):
        super().__init__()
        self._result = result

    def _wait_impl(self) -> Dict[str, JaggedTensor]:
        return self._result


class ShardedDynamicEmbeddingCollection(
    ShardedDynamicBase, ShardedModule[KJTList, List[Tensor], Dict[str, JaggedTensor], SequenceShardingContext],
    FusedOptimizerModule,
):
    def __init__(self, module: DynamicEmbeddingCollection, table_name_to_parameter_sharding: Dict[str, ParameterSharding],
                 env: ShardingEnv, device: Optional[torch.device] = None,
                 fused_params: Optional[Dict[str, Any]] = None) -> None:
        super().__init__()
        configs = module.embedding_configs()
        self._embedding_configs = configs
        self._dim = module.embedding_dim()
        self._need_indices = module.need_indices()
        self._init_sharding(module, configs, table_name_to_parameter_sharding, env, device, "embeddings", pooled=False,
                            fused_params=fused_params)
        self._local_names = [] if self._local is None else [
            name for cfg in self._local.embedding_configs() for name in cfg.feature_names]

    @property
    def unsharded_module_type(self) -> Type[DynamicEmbeddingCollection]:
        return DynamicEmbeddingCollection

    def create_context(self) -> SequenceShardingContext:
        return SequenceShardingContext()

    def input_dist(self, ctx: SequenceShardingContext, features: KeyedJaggedTensor) -> KJTListSplitsAwaitable:
        batch = check_and_arrange(features, self._plan, False, type(self).__name__, self._device)
        routed, ctx.order = route_ids(self._plan.embedding_names, batch.ids, batch.lengths, None, self._slot_owner,
                                      batch.batch_size, self._world_size)
        ctx.sent_per_rank = routed.lengths().view(self._world_size, -1).sum(1).tolist()
        ctx.lengths, ctx.batch_size = batch.lengths, batch.batch_size
        ctx.ids = batch.ids
        return KJTListSplitsAwaitable([self._input_dists[0](routed, ctx.sharding_contexts[0])], ctx)

    def compute(self, ctx: SequenceShardingContext, dist_input: KJTList) -> List[Tensor]:
        received = dist_input[0]  # keys: every slot's output name, feature-major then source rank
        names, stride = self._plan.embedding_names, received.stride()
        lengths = received.lengths().view(len(names), self._world_size, stride // max(self._world_size, 1))
        ctx.received_lengths = lengths
        if self._local is None:
            return [torch.zeros(0, self._dim, device=self._device, requires_grad=True)]
        slots = [names.index(n) for n in self._local_names]
        local_kjt = KeyedJaggedTensor(keys=self._local_names, values=received.values(),
                                      lengths=lengths[slots].reshape(-1), stride=stride)
        self._local.train(self.training)
        out = self._local(local_kjt)
        return [torch.cat([out[n].values() for n in self._local_names])]

    def output_dist(self, ctx: SequenceShardingContext, output: List[Tensor]) -> LazyAwaitable[Dict[str, JaggedTensor]]:
        vectors = output[0]
        # Received ids are slot-major then source-major: regroup by source to send them back.
        per_slot_source = ctx.received_lengths.sum(-1)  # [slots, world]
        back = transpose_segments(per_slot_source)
        send_counts = per_slot_source.sum(0).tolist()
        returned = all_to_all_single(
            vectors.new_empty(sum(ctx.sent_per_rank), self._dim), vectors[back],
            output_split_sizes=ctx.sent_per_rank, input_split_sizes=send_counts, group=self._env.process_group)
        restored = returned[torch.argsort(ctx.order)]  # back to the input's order
        per_slot = (ctx.lengths.view(len(self._plan.embedding_names), ctx.batch_size).sum(1)).tolist()
        pieces = torch.split(restored, per_slot)
        ids = torch.split(ctx.ids, per_slot)
        lengths = ctx.lengths.view(len(per_slot), ctx.batch_size)
        return _SequenceAwaitable({
            name: JaggedTensor(values=pieces[i], lengths=lengths[i], weights=ids[i] if self._need_indices else None)
            for i, name in enumerate(self._plan.embedding_names)
        })

    def compute_and_output_dist(self, ctx: SequenceShardingContext, input: KJTList) -> LazyAwaitable[Dict[str, JaggedTensor]]:
        return self.output_dist(ctx, self.compute(ctx, input))

    def embedding_configs(self):
        return self._embedding_configs

