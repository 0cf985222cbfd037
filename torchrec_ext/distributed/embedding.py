"""ShardedDynamicEmbeddingCollection: a DynamicEmbeddingCollection sharded across ranks.

The same routing as ShardedDynamicEmbeddingBagCollection (row-wise by ``ops.route``, table-wise
to the owner, column-wise to every column shard, one routed all-to-all: input_dist.py). The
lookup rank returns one vector per id (a column shard: only its own columns, as TorchRec's
column-wise sequence sharding sends them), and an all-to-all brings the vectors back to the rank
of their batch, where they are put back in the input's order (a column table's shards' columns
placed side by side): ``forward`` gives, per feature, a JaggedTensor as the unsharded module does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.distributed.nn.functional import all_to_all_single
from torchrec.distributed.embedding_sharding import KJTListSplitsAwaitable
from torchrec.distributed.embedding_types import KJTList
from torchrec.distributed.types import LazyAwaitable, ParameterSharding, ShardedModule, ShardingEnv
from torchrec.optim.fused import FusedOptimizerModule
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor
from torchrec.streamable import Multistreamable

from torchrec_ext import device_sync
from torchrec_ext.distributed.input_dist import RoutedShardingContext, transpose_segments
from torchrec_ext.distributed.sharded_base import ShardedDynamicBase
from torchrec_ext.modules.embedding_collection import DynamicEmbeddingCollection
from torchrec_ext.modules.features import check_and_arrange


@dataclass
class SequenceShardingContext(Multistreamable):
    """What the output dist needs from the input dist of the same batch."""

    # (the exchange's sizes, on the host once its counts arrive: ids sent to / received from each rank)
    sharding_contexts: list[RoutedShardingContext] = field(default_factory=lambda: [RoutedShardingContext()])
    order: Tensor | None = None  # routed position -> position among the routing slots' ids
    expand: Tensor | None = None  # routing slots' id position -> input position (None: the same)
    value_counts: list[int] = field(default_factory=list)  # input ids per lookup slot (host side)
    lengths: Tensor | None = None  # input lengths, lookup-slot major
    ids: Tensor | None = None  # input ids (the weights when need_indices)
    batch_size: int = 0
    received_lengths: Tensor | None = None  # [slots, sum of the sources' batches] lengths of the ids received
    received_batches: list[int] = field(default_factory=list)  # each source's batch size (host side)
    routed_lengths: Tensor | None = None  # [world, slots, batch] (flat) lengths of the ids sent

    def record_stream(self, stream: torch.Stream) -> None:
        for t in (self.order, self.expand, self.lengths, self.ids, self.received_lengths, self.routed_lengths):
            if t is not None:
                t.record_stream(stream)

    def routed_counts(self, world_size: int, slots: int) -> Tensor:
        """[world, slots] ids sent to each rank per routing slot: summed only by the output dists
        that read them (column shards, expanded ids, another input dist), not every step."""
        return self.routed_lengths.view(world_size, slots, self.batch_size).sum(-1)


class _SequenceAwaitable(LazyAwaitable[dict[str, JaggedTensor]]):
    def __init__(self, result: dict[str, JaggedTensor]):
        super().__init__()
        self._result = result

    def _wait_impl(self) -> dict[str, JaggedTensor]:
        return self._result


class ShardedDynamicEmbeddingCollection(
    ShardedDynamicBase,
    ShardedModule[KJTList, list[Tensor], dict[str, JaggedTensor], SequenceShardingContext],
    FusedOptimizerModule,
):
    def __init__(
        self,
        module: DynamicEmbeddingCollection,
        table_name_to_parameter_sharding: dict[str, ParameterSharding],
        env: ShardingEnv,
        device: torch.device | None = None,
        fused_params: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        configs = module.embedding_configs()
        self._embedding_configs = configs
        self._dim = module.embedding_dim()
        self._need_indices = module.need_indices()
        self._init_sharding(
            module,
            configs,
            table_name_to_parameter_sharding,
            env,
            device,
            "embeddings",
            pooled=False,
            fused_params=fused_params,
        )
        # This rank's routing slots (one per lookup slot whose table it holds).
        self._local_slots = self._routing.slots_on(self._rank)
        # What each rank sends back per id: its tables' columns (an EC's tables on a rank are as
        # wide: checked on each rank), and per routing slot the first of them in the whole vector.
        slot_tables = [self._owners[configs[self._plan.tables[s]].name] for s in self._routing.source]
        held = [[p for p in self._owners.values() if p.holds(r)] for r in range(self._world_size)]
        self._rank_widths = [p[0].local_columns(r)[1] if p else self._dim for r, p in enumerate(held)]
        self._slot_first = torch.tensor(
            [[p.local_columns(r)[0] if p.holds(r) else 0 for p in slot_tables] for r in range(self._world_size)],
            dtype=torch.int64,
            device="cpu",
        ).reshape(-1)

    @property
    def unsharded_module_type(self) -> type[DynamicEmbeddingCollection]:
        return DynamicEmbeddingCollection

    def create_context(self) -> SequenceShardingContext:
        return SequenceShardingContext()

    def input_dist(self, ctx: SequenceShardingContext, features: KeyedJaggedTensor) -> KJTListSplitsAwaitable:
        ctx.vbe_strides = None
        try:  # refused here: every rank raises at the wait (sharded_base._refused_input)
            if isinstance(features, KeyedJaggedTensor) and features.variable_stride_per_key():
                # as TorchRec's sharded EC: pad, then trim each feature's output
                ctx.vbe_strides = dict(zip(features.keys(), features.stride_per_key()))
                features = _padded_to_one_batch_size(features, type(self).__name__)
            batch = check_and_arrange(features, self._plan, False, type(self).__name__, self._device)
            routed, ctx.order, ctx.expand = self._routing.route(batch.ids, batch.lengths, None, batch.batch_size)
        except Exception as error:  # noqa: BLE001 - raised at the wait, on every rank
            return self._refused_input(ctx, error)
        ctx.routed_lengths = routed.lengths()
        ctx.value_counts = batch.value_counts
        ctx.lengths, ctx.batch_size = batch.lengths, batch.batch_size
        ctx.ids = batch.ids
        return KJTListSplitsAwaitable([self._input_dists[0](routed, ctx.sharding_contexts[0])], ctx)

    def compute(self, ctx: SequenceShardingContext, dist_input: KJTList) -> list[Tensor]:
        ctx.received_lengths = self._received_lengths(dist_input[0])
        # Each source's batch size: our input dist's counts gave them; another's, even batches.
        stride = dist_input[0].stride()
        batches = list(getattr(ctx.sharding_contexts[0], "batch_size_per_rank", None) or [])
        ctx.received_batches = batches or [stride // max(self._world_size, 1)] * self._world_size
        if self._local is None:
            return [torch.zeros(0, self._dim, device=self._device, requires_grad=True)]
        slots, names = self._local_slots, self._routing.names
        self._local.train(self.training)
        out = self._local(self._local_features(dist_input))
        # A column shard's vectors hold its columns only: the output dist places them.
        return [torch.cat([out[names[i]].values() for i in slots])]

    def _received_lengths(self, received: KeyedJaggedTensor) -> Tensor:
        """[slots, sum of the sources' batches] lengths of the ids received (keys: every routing
        slot's output name; within a slot, each source's batch in rank order)."""
        return received.lengths().view(len(self._routing.names), received.stride())

    def _local_features(self, dist_input: KJTList) -> KeyedJaggedTensor:
        """The local module's input: the received ids of the slots of its tables."""
        received, names, slots = dist_input[0], self._routing.names, self._local_slots
        per_key = received.length_per_key_or_none()  # known on the host: the module reads no lengths
        return KeyedJaggedTensor(
            keys=[names[i] for i in slots],
            values=received.values(),
            lengths=self._received_lengths(received)[slots].reshape(-1),
            stride=received.stride(),
            length_per_key=None if per_key is None else [per_key[i] for i in slots],
        )

    def output_dist(self, ctx: SequenceShardingContext, output: list[Tensor]) -> LazyAwaitable[dict[str, JaggedTensor]]:
        # In the output dtype before the exchange (each id's vector comes from one rank, column
        # shards fill disjoint columns: no sum, so the cast is exact either way, and moves fewer bytes).
        vectors = output[0].to(self._output_dtype)
        # Received ids are slot-major then source-major: regroup by source to send them back.
        per_slot_source = self._per_slot_source(ctx)  # [slots, world]
        sent_per_rank, send_counts = self._exchange_sizes(ctx, per_slot_source)
        back = transpose_segments(per_slot_source, sum(send_counts))
        if ctx.expand is None and all(w == self._dim for w in self._rank_widths):  # whole vectors, each id once
            returned = all_to_all_single(
                vectors.new_empty(sum(sent_per_rank), self._dim),
                vectors[back],
                output_split_sizes=sent_per_rank,
                input_split_sizes=send_counts,
                group=self._env.process_group,
            )
            restored = returned[torch.argsort(ctx.order)]  # back to the input's order
        else:
            restored = self._placed_columns(ctx, vectors[back], sent_per_rank, send_counts)
        per_slot = ctx.value_counts
        pieces = torch.split(restored, per_slot)
        ids = torch.split(ctx.ids, per_slot)
        lengths = ctx.lengths.view(len(per_slot), ctx.batch_size)
        if getattr(ctx, "vbe_strides", None) is not None:  # each feature's own bags: drop the padding
            lengths = [lengths[i, : ctx.vbe_strides[f]] for i, f in enumerate(self._plan.features)]
        return _SequenceAwaitable(
            {
                name: JaggedTensor(values=pieces[i], lengths=lengths[i], weights=ids[i] if self._need_indices else None)
                for i, name in enumerate(self._plan.embedding_names)
            }
        )

    def _per_slot_source(self, ctx: SequenceShardingContext) -> Tensor:
        """[slots, world] ids received per routing slot from each source."""
        batches, lengths = ctx.received_batches, ctx.received_lengths
        if len(set(batches)) <= 1:
            return lengths.view(lengths.shape[0], len(batches), batches[0]).sum(-1)
        return torch.stack([part.sum(1) for part in lengths.split(batches, 1)], 1)  # uneven batches

    @staticmethod
    def _exchange_sizes(ctx: SequenceShardingContext, per_slot_source: Tensor) -> tuple[list[int], list[int]]:
        """(ids this rank sent to each rank, ids it received from each): what returns and what goes
        back. Our input dist left them on the host (``RoutedShardingContext``); another one did not,
        and they are read."""
        exchange = ctx.sharding_contexts[0]
        if getattr(exchange, "sent_per_rank", None):
            return exchange.sent_per_rank, exchange.received_per_rank
        slots, world_size = per_slot_source.shape
        sent = device_sync.host_list(
            ctx.routed_counts(world_size, slots).sum(1), "sequence output dist: ids sent to each rank"
        )
        return sent, device_sync.host_list(per_slot_source.sum(0), "sequence output dist: ids received from each rank")

    def _placed_columns(
        self, ctx: SequenceShardingContext, vectors: Tensor, sent_per_rank: list[int], send_counts: list[int]
    ) -> Tensor:
        """[ids, dim]: the vectors of the input's ids, in its order, from each rank's columns of
        them (``vectors``: this rank's, [sent back, its width], rows in the order they go)."""
        widths = self._rank_widths
        sizes = [n * w for n, w in zip(sent_per_rank, widths)]
        # Flat, as ranks send rows of different widths.
        received = all_to_all_single(
            vectors.new_empty(sum(sizes)),
            vectors.reshape(-1),
            output_split_sizes=sizes,
            input_split_sizes=[n * vectors.shape[1] for n in send_counts],
            group=self._env.process_group,
        )
        # Each returned row (routed order: rank-major, then routing slot): its input position and first column.
        target = ctx.order if ctx.expand is None else ctx.expand[ctx.order]
        first = torch.repeat_interleave(
            device_sync.to_device(self._slot_first, target.device),
            ctx.routed_counts(self._world_size, len(self._routing.names)).reshape(-1),
            output_size=target.numel(),
        )
        start = (target * self._dim + first).split(sent_per_rank)
        index = torch.cat(
            [(s.unsqueeze(1) + torch.arange(w, device=s.device)).reshape(-1) for s, w in zip(start, widths)]
        )
        whole = received.new_zeros(ctx.ids.numel() * self._dim).index_add(0, index, received)
        return whole.view(ctx.ids.numel(), self._dim)

    def compute_and_output_dist(
        self, ctx: SequenceShardingContext, input: KJTList
    ) -> LazyAwaitable[dict[str, JaggedTensor]]:
        return self.output_dist(ctx, self.compute(ctx, input))

    def embedding_configs(self):
        return self._embedding_configs


def _padded_to_one_batch_size(features: KeyedJaggedTensor, where: str) -> KeyedJaggedTensor:
    """A variable-batch KJT as one of the rank's batch size (its ``inverse_indices``' width, which
    the ranks share as they do a stride), each feature's bags followed by
    empty ones, as TorchRec's sharded EC pads them: the ids, hence the vectors, are unchanged."""
    strides = features.stride_per_key()
    inverse = features.inverse_indices_or_none()
    if inverse is None:  # as the unsharded modules: without it no rank knows the batch size
        raise ValueError(
            f"{where}: a KJT with a variable batch size per feature needs inverse_indices (which "
            "of its bags each sample reads), got none"
        )
    batch = max([*strides, inverse[1].shape[-1]])
    lengths = features.lengths().new_zeros(len(strides), batch)
    for i, part in enumerate(torch.split(features.lengths(), strides)):
        lengths[i, : strides[i]] = part
    return KeyedJaggedTensor(
        keys=features.keys(), values=features.values(), lengths=lengths.reshape(-1), weights=features.weights_or_none()
    )
