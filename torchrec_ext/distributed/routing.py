"""Input routing of sharded dynamic tables: which rank looks each id up, and the KJT that a
``KJTAllToAll`` sends there.

Row-wise tables send an id to rank ``route(id) % world_size`` (our hash, independent of the
tables' bucket hash; raw ids are kept). Table-wise tables send all their ids to the table's
rank. Routing works per lookup slot (a table's feature), so a feature read by a row-wise and a
table-wise table is routed once for each.
"""
from __future__ import annotations

from typing import List, Sequence

import torch
from torch import Tensor
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_ext import ops


def destination_ranks(ids: Tensor, slot_value_counts: Sequence[int], slot_owner: Sequence[int], world_size: int) -> Tensor:
    """Rank of each id: ``route(id)`` for slots whose owner is -1 (row-wise), else the owner."""
    parts: List[Tensor] = []
    start = 0
    for count, owner in zip(slot_value_counts, slot_owner):
        chunk = ids[start:start + count]
        parts.append(ops.route(chunk, world_size) if owner < 0 else torch.full_like(chunk, owner))
        start += count
    return torch.cat(parts) if parts else ids.new_empty(0)


def bucketize(keys: Sequence[str], ids: Tensor, lengths: Tensor, weights: Tensor | None, destinations: Tensor,
              batch_size: int, world_size: int) -> KeyedJaggedTensor:
    """KJT with keys ``keys * world_size``: block r holds, per key and sample, the ids bound for
    rank r, in their original order (what ``KJTAllToAll(splits=[len(keys)] * world_size)`` sends)."""
    num_bags = len(keys) * batch_size
    bag = torch.repeat_interleave(torch.arange(num_bags, device=ids.device), lengths, output_size=ids.numel())
    bucket = destinations * num_bags + bag
    order = torch.argsort(bucket, stable=True)
    new_lengths = torch.bincount(bucket, minlength=num_bags * world_size)
    return KeyedJaggedTensor(
        keys=list(keys) * world_size,
        values=ids[order],
        weights=None if weights is None else weights[order],
        lengths=new_lengths,
        stride=batch_size,
    )
