"""The sharded modules' input dist: each rank's routed ids go to their lookup ranks with
``all_to_all_single`` and are regrouped with torch ops, so our sharded path runs no fbgemm
kernel. (TorchRec's ``KJTAllToAll`` regroups with fbgemm's ``permute_2D_sparse_data``, which
a torch + fbgemm-gpu-cpu installation has for CPU tensors only.)

Two phases, as TorchRec's, so a pipeline can start batch i+1's first phase during batch i:

    counts   one all_to_all_single of [batch size, ids per key] per destination; a rank whose
             batch was refused (its checks raised, or a check deferred on the device will) sends
             a batch size of -1 instead, and every rank raises at this phase's wait, before any
             id moves or any table is touched (the refusing rank its own error, the others a
             ``BatchRefusedError`` naming it): no rank is left waiting in the data exchange
    data     one all_to_all_single of lengths and ids (packed), one of weights, with the
             splits the counts give; what arrives is source-major and is regrouped key-major:
             per key, every source's samples in rank order, exactly what
             ``KJTAllToAll(splits=[num_keys] * world_size)`` hands out.

What TorchRec's ``TrainPipelineSparseDist`` asks of an input dist: ``_input_dists[i]._dist``,
where present, must be a ``KJTAllToAll`` (it asserts so, then swaps that module's ``forward``
for one whose splits it fuses across modules and whose data it regroups with fbgemm); the
request's ``.awaitables`` it fuses are only those that swapped forward made, and any other
awaitable it waits twice as it is (splits, then data). So ``RoutedInputDist`` holds a
``KJTAllToAll`` subclass as ``_dist`` but never calls its ``forward``, and hands out plain
two-phase awaitables. Our TrainPipeline moves ``_dist._pg`` to a helper thread's group: the
exchange reads it at each call.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torchrec.distributed.dist_data import KJTAllToAll
from torchrec.distributed.embedding_sharding import EmbeddingShardingContext
from torchrec.distributed.types import Awaitable
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_ext import device_sync


def transpose_segments(sizes: Tensor, total: int | None = None) -> Tensor:
    """Gather index that lists a buffer of segments laid out row-major by ``sizes[a, b]``
    column-major instead (b outer, a inner). total: ``sizes.sum()`` when the caller knows it
    (saves a device sync)."""
    rows, cols = sizes.shape
    flat = sizes.reshape(-1)
    starts = (torch.cumsum(flat, 0) - flat).view(rows, cols).t().reshape(-1)  # row-major starts, listed by column
    listed = sizes.t().reshape(-1)
    total = int(listed.sum()) if total is None else total
    listed_starts = torch.cumsum(listed, 0) - listed
    return torch.repeat_interleave(starts - listed_starts, listed, output_size=total) + torch.arange(
        total, device=sizes.device
    )


REFUSED = -1  # the batch size a rank whose batch was refused sends in the counts exchange


class BatchRefusedError(ValueError):
    """Raised on every rank whose own batch was fine when another rank refused its batch."""


class RoutedShardingContext(EmbeddingShardingContext):
    """TorchRec's sharding context plus the exchange's sizes, known on the host once the counts
    phase is waited for: ids sent to each rank and received from each (what the sequence output
    dist sends back and receives), so the output dist reads nothing from the device."""

    def __init__(self) -> None:
        super().__init__()
        self.sent_per_rank: list[int] = []
        self.received_per_rank: list[int] = []


class RoutedAllToAll(KJTAllToAll):
    """The exchange of routed KJTs (keys ``keys * world_size``, block r bound for rank r).

    A ``KJTAllToAll`` by type, as TorchRec's pipelines expect of ``_input_dists[i]._dist``,
    whose ``_pg`` our TrainPipeline moves to a helper thread's group. Those pipelines replace
    ``_dist.forward`` by their fused-splits forward, which regroups with fbgemm: RoutedInputDist
    calls ``exchange``, which that replacement leaves alone."""

    def __init__(self, pg: dist.ProcessGroup, num_keys: int, world_size: int):
        super().__init__(pg, splits=[num_keys] * world_size)
        self._num_keys = num_keys

    def forward(self, routed: KeyedJaggedTensor) -> RoutedCountsAwaitable:
        return self.exchange(routed)

    def exchange(
        self, routed: KeyedJaggedTensor, sharding_ctx: EmbeddingShardingContext | None = None
    ) -> RoutedCountsAwaitable:
        return RoutedCountsAwaitable(self._pg, routed, self._num_keys, sharding_ctx)

    def refuse(self, error: Exception, device: torch.device) -> RoutedCountsAwaitable:
        """This rank's side of the counts exchange for a batch it refused (``error``: why)."""
        return RoutedCountsAwaitable(self._pg, None, self._num_keys, None, (error, device))


class RoutedCountsAwaitable(Awaitable[Awaitable[KeyedJaggedTensor]]):
    """Phase one: every rank learns, per source, its batch size and ids per key (or that the
    source refused its batch: every rank raises here)."""

    def __init__(
        self,
        pg: dist.ProcessGroup,
        routed: KeyedJaggedTensor | None,
        num_keys: int,
        sharding_ctx: EmbeddingShardingContext | None,
        refused: tuple[Exception, torch.device] | None = None,
    ):
        """refused: (why this rank refused its batch, the device of the exchange), routed None."""
        super().__init__()
        self._pg, self._routed, self._num_keys, self._sharding_ctx = pg, routed, num_keys, sharding_ctx
        self._error = None if refused is None else refused[0]
        self._work, self._checks = None, None
        if pg.size() == 1:
            return
        # This batch's deferred checks (check_and_arrange's), raised at this exchange's wait, the
        # point every rank reaches together: not by another read of this thread first (a pipeline
        # runs the previous batch's forward between, whose collectives the peers would wait in).
        self._checks = device_sync.take_pending()
        world, width = pg.size(), 1 + num_keys
        with torch.no_grad():
            if refused is not None:
                self._checks = None  # (the refused batch's: done with, its error raised at the wait)
                self._counts = torch.full((world * width,), REFUSED, dtype=torch.int64, device=refused[1])
            else:
                batch = routed.stride()
                # ids per destination and key (int64 on every rank: a refusing rank sends int64 too)
                self._sent = routed.lengths().view(world, num_keys, batch).sum(2).to(torch.int64)
                sizes = self._sent.new_full((world, 1), batch)
                failed = self._checks.failed()  # a check deferred on the device will raise at the wait
                if failed is not None:
                    sizes = torch.where(failed, REFUSED, sizes)
                self._counts = torch.cat([sizes, self._sent], 1).reshape(-1)
            self._received = torch.empty_like(self._counts)  # both kept until the exchange is done
            self._work = dist.all_to_all_single(self._received, self._counts, group=pg, async_op=True)

    def _wait_impl(self) -> Awaitable[KeyedJaggedTensor]:
        if self._work is not None:
            self._work.wait()  # (a refusing rank too: its peers need its counts)
        if self._error is not None:
            raise self._error
        if self._work is None:  # one rank: nothing moves
            batches, data = [self._routed.stride()], Ready(self._routed)
            sent = received_ids = [self._routed.values().numel()]
        else:
            world, width = self._pg.size(), 1 + self._num_keys
            received = self._received.view(world, width)
            # The step's one read of the exchange: what arrives (the splits of phase two) and what
            # this rank sends, in one copy to the host.
            host = device_sync.host_list(
                torch.cat([self._received, self._sent.sum(1)]), "input dist: the splits of the data exchange"
            )
            self._checks.settle()  # (read free: the read above drained the stream)
            counts = [host[r * width : (r + 1) * width] for r in range(world)]
            batches = [row[0] for row in counts]
            refusing = [r for r, b in enumerate(batches) if b == REFUSED]
            if refusing:
                raise BatchRefusedError(
                    f"input dist: rank(s) {refusing} refused their batch (see the error raised there); "
                    f"rank {self._pg.rank()} looked nothing up, every table is unchanged on every rank"
                )
            sent, received_ids = host[world * width :], [sum(row[1:]) for row in counts]
            data = RoutedDataAwaitable(
                self._pg,
                self._routed,
                self._num_keys,
                sent,
                batches,
                received[:, 1:],
                received_ids,
                [sum(row[1 + k] for row in counts) for k in range(self._num_keys)],
            )
        if self._sharding_ctx is not None:  # the output dist's reduce-scatter splits
            self._sharding_ctx.batch_size_per_rank = batches
        if isinstance(self._sharding_ctx, RoutedShardingContext):
            self._sharding_ctx.sent_per_rank, self._sharding_ctx.received_per_rank = sent, received_ids
        return data


class RoutedDataAwaitable(Awaitable[KeyedJaggedTensor]):
    """Phase two: the lengths, ids and weights; waiting regroups them into the received KJT."""

    def __init__(
        self,
        pg: dist.ProcessGroup,
        routed: KeyedJaggedTensor,
        num_keys: int,
        sent_ids: list[int],
        batches: list[int],
        ids_per_key: Tensor,
        received_ids: list[int],
        received_per_key: list[int],
    ):
        """``received_per_key``: the ids of each key this rank receives, summed over the sources
        (the received KJT's ``length_per_key``, known on the host: its consumers need not read
        the lengths)."""
        super().__init__()
        values, lengths, weights = routed.values(), routed.lengths(), routed.weights_or_none()
        world, batch = pg.size(), routed.stride()
        self._keys = routed.keys()[:num_keys]
        self._lengths_dtype = lengths.dtype
        self._batches, self._ids_per_key = batches, ids_per_key  # per source (and key)
        self._received_per_key = received_per_key
        with torch.no_grad():
            # Per destination, its lengths then its ids, in one buffer of the ids' dtype.
            ids_per_rank = torch.split(values, sent_ids)
            lengths_per_rank = lengths.to(values.dtype).view(world, num_keys * batch)
            self._send = torch.cat([t for r in range(world) for t in (lengths_per_rank[r], ids_per_rank[r])])
            self._send_weights = weights  # kept until the exchange is done
            self._received_ints = values.new_empty(num_keys * sum(batches) + sum(received_ids))
            self._works = [
                dist.all_to_all_single(
                    self._received_ints,
                    self._send,
                    [num_keys * b + n for b, n in zip(batches, received_ids)],
                    [num_keys * batch + n for n in sent_ids],
                    group=pg,
                    async_op=True,
                )
            ]
            self._received_weights = None
            if weights is not None:
                self._received_weights = weights.new_empty(sum(received_ids))
                self._works.append(
                    dist.all_to_all_single(
                        self._received_weights, weights, received_ids, sent_ids, group=pg, async_op=True
                    )
                )

    def _wait_impl(self) -> KeyedJaggedTensor:
        for work in self._works:
            work.wait()
        world, num_keys = self._ids_per_key.shape
        stride = sum(self._batches)
        with torch.no_grad():
            # Each source sent its lengths per key (a batch each), then its ids per key: listed
            # key-major over the sources, all lengths come first, then all ids.
            batches = device_sync.to_device(torch.tensor(self._batches, device="cpu"), self._ids_per_key.device)
            segments = torch.cat([batches.view(world, 1).expand(world, num_keys), self._ids_per_key], 1)
            ints = self._received_ints[transpose_segments(segments, self._received_ints.numel())]
            weights = None
            if self._received_weights is not None:
                weights = self._received_weights[transpose_segments(self._ids_per_key, self._received_weights.numel())]
            return KeyedJaggedTensor(
                keys=self._keys,
                values=ints[num_keys * stride :],
                lengths=ints[: num_keys * stride].to(self._lengths_dtype),
                weights=weights,
                stride=stride,
                length_per_key=self._received_per_key,
            )


class Ready(Awaitable):
    """An awaitable of a result already there."""

    def __init__(self, result):
        super().__init__()
        self._result = result

    def _wait_impl(self):
        return self._result


class RoutedInputDist(nn.Module):
    """The sharded modules' ``_input_dists[0]``: holds the exchange as ``_dist`` (where TorchRec's
    pipelines look) and passes the sharding context, whose ``batch_size_per_rank`` the counts
    phase fills for the output dist."""

    def __init__(self, pg: dist.ProcessGroup, num_keys: int, world_size: int):
        super().__init__()
        self._dist = RoutedAllToAll(pg, num_keys, world_size)

    def forward(
        self, routed: KeyedJaggedTensor, sharding_ctx: EmbeddingShardingContext | None = None
    ) -> RoutedCountsAwaitable:
        return self._dist.exchange(routed, sharding_ctx)

    def refuse(self, error: Exception, device: torch.device) -> RoutedCountsAwaitable:
        """For a batch this rank refused: takes part in the counts exchange, so that every rank
        raises at its wait (this one ``error``)."""
        return self._dist.refuse(error, device)
