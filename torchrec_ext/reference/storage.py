"""The embedding storage convention the lookup and update references read: storage dtypes and
the flat buffer's layout.

Storage convention shared with csrc/row_storage.h and triton_kernels/: all tables of a
module live in one flat buffer of 4-byte words (a float32 tensor); table t's [capacity_t,
dim_t] rows start at word table_offsets[t] and are stored in the table's storage dtype
(table_dtypes[t]: 0 float32, 1 float16, 2 bfloat16; all float32 when not given), packed, its
span rounded up to whole words. Optimizer state is float32: element-wise states hold every
table's [capacity_t, dim_t] back to back in table order (dense_state_offsets), row-wise ones
one float per row from state_row_offsets[t].
A row of -1 means "no row" (refused, not admitted, or unseen in eval): it reads as zeros and
takes no update. Bags are KJT-ordered: bag g = f * batch_size + b is sample b of feature f.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

STORAGE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # index = the kernels' dtype code


def dtype_code(dtype: torch.dtype) -> int:
    return STORAGE_DTYPES.index(dtype)


def table_words(capacity: int, dim: int, dtype: torch.dtype = torch.float32) -> int:
    """4-byte words of a table's rows in the flat buffer: its bytes rounded up to whole words."""
    return -(-capacity * dim * STORAGE_DTYPES[dtype_code(dtype)].itemsize // 4)


def _dtypes_of(table_dtypes: Tensor | None, num_tables: int) -> list[torch.dtype]:
    codes = [0] * num_tables if table_dtypes is None else table_dtypes.tolist()
    return [STORAGE_DTYPES[c] for c in codes]


def _table_rows(
    weights: Tensor, table_offsets: Tensor, table_dims: Tensor, capacities: Sequence[int], dtypes: Sequence[torch.dtype]
) -> list[Tensor]:
    """[capacity_t, dim_t] views of each table inside the flat buffer, in its storage dtype."""
    views = []
    for t, (cap, dtype) in enumerate(zip(capacities, dtypes)):
        off, dim = int(table_offsets[t]), int(table_dims[t])
        words = weights[off : off + table_words(cap, dim, dtype)]
        views.append(words.view(dtype)[: cap * dim].view(cap, dim))
    return views


def _capacities(weights: Tensor, table_offsets: Tensor, table_dims: Tensor, dtypes: Sequence[torch.dtype]) -> list[int]:
    ends = table_offsets.tolist()[1:] + [weights.numel()]
    return [
        (end - off) * 4 // (dim * dtype.itemsize)
        for off, end, dim, dtype in zip(table_offsets.tolist(), ends, table_dims.tolist(), dtypes)
    ]


def dense_state_offsets(capacities: Sequence[int], dims: Sequence[int]) -> list[int]:
    """Where each table's element-wise optimizer state starts: the tables back to back."""
    out, total = [], 0
    for cap, dim in zip(capacities, dims):
        out.append(total)
        total += cap * dim
    return out
