"""Row-wise sharding's routing: a key's owning rank (``route``) and the input routing of sharded
tables (``route_bucketize``), one id at a time."""

from __future__ import annotations

from collections.abc import Sequence

from torchrec_ext.reference.hashing import _MASK64, _fastrange32, _fmix64


def route(key: int, world_size: int) -> int:
    """Owning rank of ``key`` under row-wise sharding."""
    return _fastrange32(_fmix64((key & _MASK64) ^ 0x165667B19E3779F9) >> 32, world_size)


def route_bucketize(
    ids: Sequence[int], lengths: Sequence[int], slot_owner: Sequence[int], world_size: int, batch_size: int
) -> tuple[list[int], list[int], list[int]]:
    """Input routing of sharded tables, one id at a time: bag g (slot g // batch_size) sends each
    of its ids to its slot's owner, or to ``route(id)`` when the owner is -1 (row-wise). Returns
    the ids regrouped destination-major then by bag (batch order within a bag), the
    ``[world_size * bags]`` lengths, and each routed id's input position."""
    bags = len(slot_owner) * batch_size
    blocks: list[list[int]] = [[] for _ in range(world_size * bags)]
    position = 0
    for bag, length in enumerate(lengths):
        owner = slot_owner[bag // batch_size]
        for _ in range(length):
            dest = owner if owner >= 0 else route(ids[position], world_size)
            blocks[dest * bags + bag].append(position)
            position += 1
    order = [p for block in blocks for p in block]
    return [ids[p] for p in order], [len(block) for block in blocks], order
