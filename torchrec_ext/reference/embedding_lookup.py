"""``pooled_lookup`` and ``sequence_lookup``: each bag's pooled rows and each id's row, one
value at a time (storage convention in ``reference.storage``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from torchrec_ext.reference.storage import _capacities, _dtypes_of, _table_rows


def pooled_lookup(
    weights: Tensor,
    table_offsets: Tensor,
    table_dims: Tensor,
    feature_table: Tensor,
    feature_col: Tensor,
    feature_mean: Tensor,
    rows: Tensor,
    offsets: Tensor,
    per_sample_weights: Tensor | None,
    batch_size: int,
    total_dim: int,
    new_vectors: Sequence[Tensor] = (),
    table_dtypes: Tensor | None = None,
) -> Tensor:
    """[batch_size, total_dim] float32 pooled output: feature f's bags land in columns feature_col[f]...

    Each bag sums (or, where feature_mean[f], averages over its length) the rows of its ids,
    scaled by per_sample_weights when given. Rows of -1 read as zeros; empty bags are zeros.
    Row -2 - j of table t reads new_vectors[t][j] (a new row's initial vector, not yet written, in
    the table's storage dtype). Rows are read as float32 and summed in float32.
    """
    dtypes = _dtypes_of(table_dtypes, table_offsets.numel())
    tables = _table_rows(
        weights, table_offsets, table_dims, _capacities(weights, table_offsets, table_dims, dtypes), dtypes
    )
    out = torch.zeros(batch_size, total_dim, dtype=torch.float32, device=weights.device)
    for f in range(feature_table.numel()):
        t, col = int(feature_table[f]), int(feature_col[f])
        dim = int(table_dims[t])
        for b in range(batch_size):
            start, end = int(offsets[f * batch_size + b]), int(offsets[f * batch_size + b + 1])
            acc = torch.zeros(dim, dtype=torch.float32, device=weights.device)
            for i in range(start, end):
                r = int(rows[i])
                if r != -1:
                    scale = 1.0 if per_sample_weights is None else float(per_sample_weights[i])
                    acc += scale * (tables[t][r] if r >= 0 else new_vectors[t][-2 - r]).float()
            if bool(feature_mean[f]) and end > start:
                acc /= end - start
            out[b, col : col + dim] = acc
    return out


def sequence_lookup(
    weights: Tensor,
    table_offsets: Tensor,
    dim: int,
    feature_table: Tensor,
    feature_value_offsets: Tensor,
    rows: Tensor,
    new_vectors: Sequence[Tensor] = (),
    table_dtypes: Tensor | None = None,
) -> Tensor:
    """[num_values, dim] float32: the row of each id (zeros for -1; new_vectors[t][j] for -2 - j);
    values of feature f are [feature_value_offsets[f], feature_value_offsets[f + 1]) and read table
    feature_table[f]."""
    dtypes = _dtypes_of(table_dtypes, table_offsets.numel())
    dims = torch.full_like(table_offsets, dim)
    tables = _table_rows(weights, table_offsets, dims, _capacities(weights, table_offsets, dims, dtypes), dtypes)
    out = torch.zeros(rows.numel(), dim, dtype=torch.float32, device=weights.device)
    for f in range(feature_table.numel()):
        t = int(feature_table[f])
        for i in range(int(feature_value_offsets[f]), int(feature_value_offsets[f + 1])):
            r = int(rows[i])
            if r >= 0:
                out[i] = tables[t][r].float()
            elif r <= -2:
                out[i] = new_vectors[t][-2 - r].float()
    return out
