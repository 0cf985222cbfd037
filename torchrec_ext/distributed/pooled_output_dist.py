"""The sharded EBC's output dist: each rank's partial pools of every rank's batch (rows
source-major: ``batch_size_per_rank[r]`` rows of rank r's batch, then the next rank's) summed on
the batch's own rank.

Every rank's batch as large: TorchRec's row-wise reduce-scatter (``RwPooledEmbeddingDist``).
Batches of different sizes (an uneven last batch, drop_last=False): TorchRec reduce-scatters them
with per-rank splits (reduce-scatter-v), whose backward all-gathers gradients of different
sizes, which gloo refuses. Here instead one ``all_to_all_single`` with per-rank splits: rank r's
rows of each batch go to that batch's rank, which sums what every rank sent it. Its backward is
the all-to-all back (each rank gets the gradient of the rows it sent), divided by the world size
as TorchRec's reduce-scatter divides it (``comm_ops.get_gradient_division``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.nn.functional import all_to_all_single
from torchrec.distributed.comm_ops import get_gradient_division
from torchrec.distributed.embedding_sharding import EmbeddingShardingContext
from torchrec.distributed.sharding.rw_sharding import RwPooledEmbeddingDist
from torchrec.distributed.types import Awaitable

from torchrec_ext.distributed.input_dist import Ready


class ScaleGradient(torch.autograd.Function):
    """The identity, whose backward scales the gradient by ``scale``."""

    @staticmethod
    def forward(ctx, x: Tensor, scale: float) -> Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return grad * ctx.scale, None


class PooledOutputDist:
    """Sums the partial pools onto their batch's rank: ``__call__(local_embs, sharding_ctx)``
    -> an awaitable of this rank's [its batch size, total dim] pools. The batch sizes are the
    sharding context's (the input dist's counts put them there; none: every rank's the same)."""

    def __init__(self, pg: dist.ProcessGroup, dims: list[int]):
        self._pg = pg
        self._even = RwPooledEmbeddingDist(pg, dims)

    def __call__(self, local_embs: Tensor, sharding_ctx: EmbeddingShardingContext | None) -> Awaitable[Tensor]:
        batches = list(getattr(sharding_ctx, "batch_size_per_rank", None) or [])
        if len(set(batches)) <= 1:
            return self._even(local_embs, sharding_ctx)
        world, mine = self._pg.size(), batches[self._pg.rank()]
        if get_gradient_division():
            local_embs = ScaleGradient.apply(local_embs, 1.0 / world)
        received = all_to_all_single(
            local_embs.new_empty(world * mine, local_embs.shape[1]),
            local_embs,
            output_split_sizes=[mine] * world,
            input_split_sizes=batches,
            group=self._pg,
        )
        return Ready(received.view(world, mine, local_embs.shape[1]).sum(0))
