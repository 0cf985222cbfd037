"""Input routing of sharded dynamic tables: which rank looks each id up, and the KJT that the
input dist (input_dist.py) sends there.

Row-wise tables send an id to rank ``route(id) % world_size`` (our hash, independent of the
tables' bucket hash; raw ids are kept); a table-row-wise table to ``group[route(id) % len(group)]``
among its node's ranks. Table-wise tables send all their ids to the table's rank. Column-wise
tables send all their ids to every rank holding one of their column shards. Routing works per
routing slot: a lookup slot (a table's feature) once per destination (a column table's slot once
per rank of its shards), so a feature read by tables of several types is routed once for each.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_ext import device_sync, ops

Destination = int | tuple[int, ...]  # a rank, or the group of ranks ids are spread over by hash


def _route_to_groups(
    ids: Tensor, lengths: Tensor, dest: Sequence[Destination], world_size: int, batch_size: int
) -> tuple[Tensor, Tensor, Tensor]:
    """``ops.route_bucketize`` for slots spread over a group of ranks: a stable sort by
    destination, then bag (torch ops)."""
    bags = len(dest) * batch_size
    bag = torch.repeat_interleave(torch.arange(bags, device=ids.device), lengths, output_size=ids.numel())
    slot = bag // max(batch_size, 1)
    where = torch.empty_like(ids)
    for s, d in enumerate(dest):
        mine = slot == s
        if isinstance(d, int):
            where[mine] = d
        else:
            group = torch.tensor(d, dtype=torch.int64, device=ids.device)
            where[mine] = group[ops.route(ids[mine].contiguous(), len(d))]
    bucket = where * bags + bag
    order = torch.argsort(bucket, stable=True)
    return ids[order], torch.bincount(bucket, minlength=world_size * bags), order


@dataclass
class SlotRouting:
    """The routing slots of a sharded module: per routing slot, its lookup slot (``source``),
    where its ids go (``dest``) and its key (the lookup slot's output name); ``lookup_slots``: how
    many lookup slots the input has (its lengths are [lookup_slots, batch_size], even when the
    batch is empty)."""

    source: list[int]
    dest: list[Destination]
    names: list[str]
    world_size: int
    lookup_slots: int

    @staticmethod
    def of(embedding_names: Sequence[str], slot_placements: Sequence, world_size: int) -> SlotRouting:
        """slot_placements: each lookup slot's table's ``TablePlacement``."""
        source, dest = [], []
        for s, placement in enumerate(slot_placements):
            if placement.kind == "row" and len(placement.ranks) > 1:
                targets = [placement.ranks]
            else:
                targets = placement.lookup_ranks()
            for d in targets:
                source.append(s)
                dest.append(tuple(d) if isinstance(d, tuple) else int(d))
        return SlotRouting(source, dest, [embedding_names[s] for s in source], world_size, len(embedding_names))

    @property
    def expands(self) -> bool:
        """Whether some lookup slot is routed more than once (a column table on several ranks)."""
        return self.source != list(range(len(self.source)))

    def slots_on(self, rank: int) -> list[int]:
        """The routing slots whose ids may come to ``rank`` (one per lookup slot it holds)."""
        return [i for i, d in enumerate(self.dest) if (rank in d if isinstance(d, tuple) else d == rank)]

    def route(
        self, ids: Tensor, lengths: Tensor, weights: Tensor | None, batch_size: int
    ) -> tuple[KeyedJaggedTensor, Tensor, Tensor | None]:
        """(the routed KJT: keys ``names * world_size``, block r holding, per key and sample, the
        ids bound for rank r in their original order, what the input dist sends (laid out as for
        TorchRec's ``KJTAllToAll(splits=[len(names)] * world_size)``); each routed id's position
        among the routing slots' ids; each of those ids' position in ``ids``, None when no slot is
        routed twice)."""
        expand = None
        if self.expands:
            per_slot = device_sync.host_list(
                lengths.view(self.lookup_slots, batch_size).sum(1), "routing: the ids of each slot routed twice"
            )
            starts = [sum(per_slot[:s]) for s in range(len(per_slot))]
            expand = (
                torch.cat([torch.arange(starts[s], starts[s] + per_slot[s], device=ids.device) for s in self.source])
                if self.source
                else ids.new_empty(0)
            )
            ids = ids[expand]
            weights = None if weights is None else weights[expand]
            lengths = lengths.view(self.lookup_slots, batch_size)[self.source].reshape(-1)
        whole = tuple(range(self.world_size))
        if all(isinstance(d, int) or d == whole for d in self.dest):  # one kernel (-1: row-wise slots)
            owners = [d if isinstance(d, int) else -1 for d in self.dest]
            values, routed_lengths, order = ops.route_bucketize(ids, lengths, owners, self.world_size, batch_size)
        else:
            values, routed_lengths, order = _route_to_groups(ids, lengths, self.dest, self.world_size, batch_size)
        routed = KeyedJaggedTensor(
            keys=list(self.names) * self.world_size,
            values=values,
            lengths=routed_lengths,
            stride=batch_size,
            weights=None if weights is None else weights[order],
        )
        return routed, order, expand
