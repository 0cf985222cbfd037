"""Device-agnostic torch implementations of the ops that need no dedicated GPU kernel.

They serve as the CUDA kernels of ``dedup_segments`` and ``init_rows`` (registered in
``torchrec_ext.ops``): on a GPU, sorting a step's ids and drawing its new rows' vectors are a
few fused elementwise passes, so plain torch ops do it well. On CPU the C++ kernels are used.
"""
from __future__ import annotations

from typing import Sequence, Tuple

import torch
from torch import Tensor

from torchrec_ext.reference import INITIALIZER_NAMES, init_vectors


def dedup_segments(ids: Tensor, segment_offsets: Tensor) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Same contract as the C++ op: per-segment uniques in first-occurrence order (sort-based)."""
    n, num_segments = ids.numel(), segment_offsets.numel() - 1
    device = ids.device
    offsets = segment_offsets.to(device)
    segment = torch.repeat_interleave(torch.arange(num_segments, device=device), offsets[1:] - offsets[:-1], output_size=n)
    order = torch.argsort(ids, stable=True)
    order = order[torch.argsort(segment[order], stable=True)]  # by (segment, id), ties by position
    sorted_ids, sorted_segment = ids[order], segment[order]
    starts = torch.ones(n, dtype=torch.bool, device=device)
    starts[1:] = (sorted_ids[1:] != sorted_ids[:-1]) | (sorted_segment[1:] != sorted_segment[:-1])
    group = torch.cumsum(starts, 0) - 1
    num_groups = int(group[-1]) + 1 if n else 0
    first = torch.full((num_groups,), n, dtype=torch.int64, device=device).scatter_reduce(0, group, order, "amin")
    # Segments are contiguous, so sorting groups by first position is segment-major, first-occurrence order.
    rank = torch.argsort(first)
    position = torch.empty_like(rank)
    position[rank] = torch.arange(num_groups, device=device)
    inverse = torch.empty(n, dtype=torch.int64, device=device)
    inverse[order] = position[group]
    unique = ids[first[rank]]
    counts = torch.bincount(inverse, minlength=num_groups)
    per_segment = torch.bincount(segment[first[rank]], minlength=num_segments)
    unique_offsets = torch.zeros(num_segments + 1, dtype=torch.int64, device=device)
    torch.cumsum(per_segment, 0, out=unique_offsets[1:])
    return unique, inverse, counts, unique_offsets


def init_rows(table: Tensor, rows: Tensor, ids: Tensor, seed: int, kind: int, params: Sequence[float],
              states: Sequence[Tensor], state_values: Sequence[float]) -> None:
    """Same contract as the C++ op, through the vectorised reference RNG."""
    keep = rows >= 0
    rows, ids = rows[keep], ids[keep]
    table[rows] = init_vectors(ids, table.shape[1], seed, INITIALIZER_NAMES[kind], params).to(table.device)
    for state, value in zip(states, state_values):
        state[rows] = value


def route_bucketize(ids: Tensor, lengths: Tensor, slot_owner: Sequence[int], world_size: int,
                    batch_size: int) -> Tuple[Tensor, Tensor, Tensor]:
    """Same contract as the C++ op (a stable sort by destination, then bag)."""
    from torchrec_ext import ops

    bags = len(slot_owner) * batch_size
    bag = torch.repeat_interleave(torch.arange(bags, device=ids.device), lengths, output_size=ids.numel())
    owner = torch.tensor(list(slot_owner), dtype=torch.int64, device=ids.device)[bag // max(batch_size, 1)]
    dest = torch.where(owner < 0, ops.route(ids, world_size), owner)
    bucket = dest * bags + bag
    order = torch.argsort(bucket, stable=True)
    return ids[order], torch.bincount(bucket, minlength=world_size * bags), order
