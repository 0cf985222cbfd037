"""Input routing of sharded dynamic tables: which rank looks each id up, and the KJT that the
input dist (input_dist.py) sends there.

Row-wise tables send an id to rank ``route(id) % world_size`` (our hash, independent of the
tables' bucket hash; raw ids are kept). Table-wise tables send all their ids to the table's
rank. Routing works per lookup slot (a table's feature), so a feature read by a row-wise and a
table-wise table is routed once for each.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

from torch import Tensor
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_ext import ops


def route_ids(keys: Sequence[str], ids: Tensor, lengths: Tensor, weights: Optional[Tensor], slot_owner: Sequence[int],
              batch_size: int, world_size: int) -> Tuple[KeyedJaggedTensor, Tensor]:
    """(KJT with keys ``keys * world_size`` whose block r holds, per key and sample, the ids bound
    for rank r in their original order: what the input dist sends (laid out as for TorchRec's
    ``KJTAllToAll(splits=[len(keys)] * world_size)``); each routed id's position in ``ids``).
    slot_owner: -1 for row-wise slots."""
    values, routed_lengths, order = ops.route_bucketize(ids, lengths, slot_owner, world_size, batch_size)
    routed = KeyedJaggedTensor(keys=list(keys) * world_size, values=values, lengths=routed_lengths, stride=batch_size,
                               weights=None if weights is None else weights[order])
    return routed, order
