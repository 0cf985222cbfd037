"""ShardedDynamicEmbeddingCollection: a DynamicEmbeddingCollection sharded across ranks.

The same routing as ShardedDynamicEmbeddingBagCollection (row-wise by ``ops.route``, table-wise
to the owner, column-wise to every column shard, one routed all-to-all: input_dist.py). The
lookup rank returns one vector per id (a column shard: its columns, zeros elsewhere), and an
all-to-all brings the vectors back to the rank of their batch, where they are put back in the
input's order (a column table's shards' vectors summed): ``forward`` gives, per feature, a
JaggedTensor as the unsharded module does.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Type

import torch
from torch import Tensor, nn
from torch.distributed.nn.functional import all_to_all_single
from torchrec.distributed.embedding_sharding import EmbeddingShardingContext, KJTListSplitsAwaitable
from torchrec.distributed.embedding_types import KJTList
from torchrec.distributed.types import LazyAwaitable, ParameterSharding, ShardedModule, ShardingEnv
from torchrec.optim.fused import FusedOptimizerModule
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor
from torchrec.streamable import Multistreamable

from torchrec_ext.distributed.input_dist import transpose_segments
from torchrec_ext.distributed.sharded_base import ShardedDynamicBase
from torchrec_ext.modules.embedding_collection import DynamicEmbeddingCollection
from torchrec_ext.modules.features import check_and_arrange


@dataclass
class SequenceShardingContext(Multistreamable):
    """What the output dist needs from the input dist of the same batch."""

    sharding_contexts: List[EmbeddingShardingContext] = field(default_factory=lambda: [EmbeddingShardingContext()])
    order: Optional[Tensor] = None           # routed position -> position among the routing slots' ids
    expand: Optional[Tensor] = None          # routing slots' id position -> input position (None: the same)
    sent_per_rank: List[int] = field(default_factory=list)
    lengths: Optional[Tensor] = None         # input lengths, lookup-slot major
    ids: Optional[Tensor] = None             # input ids (the weights when need_indices)
    batch_size: int = 0
    received_lengths: Optional[Tensor] = None  # [slots, world, batch] lengths of the ids received

    def record_stream(self, stream: torch.Stream) -> None:
        for t in (self.order, self.expand, self.lengths, self.ids, self.received_lengths):
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
        # This rank's routing slots (one per lookup slot whose table it holds) and, per slot, the
        # columns its table holds here (a column shard's vectors are padded to the whole dim).
        self._local_slots = self._routing.slots_on(self._rank)
        self._local_columns = [self._owners[configs[self._plan.tables[self._routing.source[i]]].name]
                               .local_columns(self._rank) for i in self._local_slots]

    @property
    def unsharded_module_type(self) -> Type[DynamicEmbeddingCollection]:
        return DynamicEmbeddingCollection

    def create_context(self) -> SequenceShardingContext:
        return SequenceShardingContext()

    def input_dist(self, ctx: SequenceShardingContext, features: KeyedJaggedTensor) -> KJTListSplitsAwaitable:
        batch = check_and_arrange(features, self._plan, False, type(self).__name__, self._device)
        routed, ctx.order, ctx.expand = self._routing.route(batch.ids, batch.lengths, None, batch.batch_size)
        ctx.sent_per_rank = routed.lengths().view(self._world_size, -1).sum(1).tolist()
        ctx.lengths, ctx.batch_size = batch.lengths, batch.batch_size
        ctx.ids = batch.ids
        return KJTListSplitsAwaitable([self._input_dists[0](routed, ctx.sharding_contexts[0])], ctx)

    def compute(self, ctx: SequenceShardingContext, dist_input: KJTList) -> List[Tensor]:
        ctx.received_lengths = self._received_lengths(dist_input[0])
        if self._local is None:
            return [torch.zeros(0, self._dim, device=self._device, requires_grad=True)]
        slots, names = self._local_slots, self._routing.names
        self._local.train(self.training)
        out = self._local(self._local_features(dist_input))
        # A column shard's vectors padded with zeros to the whole dim: the output dist sums the
        # shards' vectors of each id.
        return [torch.cat([nn.functional.pad(out[names[i]].values(), (first, self._dim - first - width))
                           for i, (first, width) in zip(slots, self._local_columns)])]

    def _received_lengths(self, received: KeyedJaggedTensor) -> Tensor:
        """[slots, world, batch] lengths of the ids received (keys: every routing slot's output
        name, slot-major then source rank)."""
        return received.lengths().view(len(self._routing.names), self._world_size,
                                       received.stride() // max(self._world_size, 1))

    def _local_features(self, dist_input: KJTList) -> KeyedJaggedTensor:
        """The local module's input: the received ids of the slots of its tables."""
        received, names, slots = dist_input[0], self._routing.names, self._local_slots
        return KeyedJaggedTensor(keys=[names[i] for i in slots], values=received.values(),
                                 lengths=self._received_lengths(received)[slots].reshape(-1), stride=received.stride())

    def output_dist(self, ctx: SequenceShardingContext, output: List[Tensor]) -> LazyAwaitable[Dict[str, JaggedTensor]]:
        vectors = output[0]
        # Received ids are slot-major then source-major: regroup by source to send them back.
        per_slot_source = ctx.received_lengths.sum(-1)  # [slots, world]
        back = transpose_segments(per_slot_source)
        send_counts = per_slot_source.sum(0).tolist()
        returned = all_to_all_single(
            vectors.new_empty(sum(ctx.sent_per_rank), self._dim), vectors[back],
            output_split_sizes=ctx.sent_per_rank, input_split_sizes=send_counts, group=self._env.process_group)
        if ctx.expand is None:
            restored = returned[torch.argsort(ctx.order)]  # back to the input's order
        else:  # ids routed to several column shards: their partial vectors summed in the input's order
            restored = returned.new_zeros(ctx.ids.numel(), self._dim).index_add(0, ctx.expand[ctx.order], returned)
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

