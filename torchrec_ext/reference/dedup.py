"""``dedup_segments``: unique ids per segment in first-occurrence order, one id at a time."""

from __future__ import annotations

import torch
from torch import Tensor


def dedup_ids(ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(unique ids in first-occurrence order, inverse index of each id, count of each unique)."""
    first: dict[int, int] = {}
    inverse = []
    for v in ids.tolist():
        inverse.append(first.setdefault(v, len(first)))
    unique = torch.tensor(list(first), dtype=torch.int64)
    inv = torch.tensor(inverse, dtype=torch.int64)
    return unique, inv, torch.bincount(inv, minlength=len(first)).to(torch.int64)


def dedup_segments(ids: Tensor, segment_offsets: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``dedup_ids`` within each segment [segment_offsets[s], segment_offsets[s+1]) (one table's ids).

    Returns the segments' unique ids concatenated, each id's index into that concatenation,
    the counts, and unique_offsets (where each segment's uniques start).
    """
    uniques, inverses, counts, unique_offsets = [], [], [], [0]
    bounds = segment_offsets.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        u, inv, c = dedup_ids(ids[start:end])
        uniques.append(u)
        inverses.append(inv + unique_offsets[-1])
        counts.append(c)
        unique_offsets.append(unique_offsets[-1] + u.numel())

    def cat(parts):
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)

    return cat(uniques), cat(inverses), cat(counts), torch.tensor(unique_offsets, dtype=torch.int64)
