"""Pending rows (CPU only): the rows of a training lookup's new ids, not written yet.

When a backward will follow, a CPU lookup does not write its new ids' rows: their initial vectors
go to a small dense block (``NewRows``) that the lookup kernels read, and the fused update writes
each one to its row with the row's first step. New ids are most of a batch's distinct ids on
heavy-tailed data, and their rows are scattered over gigabytes: this saves two of the three passes
over them. GPU lookups write their rows themselves (``defer_new_rows`` off does the same on CPU).

The protocol, all of it; the kernels' side is documented once, at ``vocabulary.PENDING_ROW_BASE``:

- the lookup kernels read pending row j of table t, named ``pending_row(j)`` in ``rows``, from
  ``new_vectors[t][j]`` (``NewRows.read_rows`` encodes them, ``RowLookup.new_vectors`` hands the
  blocks over);
- the fused update takes ``(new_vectors, unique_new, state_init)`` (``NewRows.update_args``) and
  writes each new unique row's vector and initial optimizer state before its step;
- anything else that reads or moves the rows writes the pending ones first: the methods marked
  ``@pending_rows_written`` (the one guard) and ``write_new_rows`` itself, so the deferral is
  never visible.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import Tensor

from torchrec_ext.vocabulary import pending_row

_F = TypeVar("_F", bound=Callable)


def pending_rows_written(method: _F) -> _F:
    """The guard: ``method`` (of the tables, or a function whose first argument is them) runs
    after the last lookup's pending rows are written (``write_new_rows``)."""

    @functools.wraps(method)
    def guarded(tables, *args, **kwargs):
        tables.write_new_rows()
        return method(tables, *args, **kwargs)

    return guarded  # type: ignore[return-value]


@dataclass
class NewRows:
    """New ids' rows from one training lookup, their initial values not yet written there.

    vectors[t]: [n_t, dim_t] initial vectors of table t's new ids; rows[t]: their rows;
    unique_new: per unique id of the lookup, its index into its table's vectors (-1: not new).
    """

    vectors: list[Tensor]
    rows: list[Tensor]
    unique_new: Tensor
    written: bool = False

    def read_rows(self, unique_rows: Tensor) -> Tensor:
        """Each unique id's row as the lookup kernels read it: pending rows by their code."""
        return torch.where(self.unique_new >= 0, pending_row(self.unique_new), unique_rows)

    def update_args(self, state_init: list[float]) -> tuple[list[Tensor], Tensor, list[float]]:
        """``ops.fused_update``'s (new_vectors, unique_new, state_init)."""
        return self.vectors, self.unique_new, state_init

    def write(self, init_view: Callable[[int], tuple[Tensor, list[Tensor], list[float]]]) -> None:
        """Writes the rows (initial vectors and optimizer state) where the fused update has not;
        ``init_view(t)``: table t's rows, states and their initial values."""
        if self.written:
            return
        for t, (rows, vectors) in enumerate(zip(self.rows, self.vectors)):
            if rows.numel():
                table, states, fills = init_view(t)
                table[rows] = vectors
                for state, fill in zip(states, fills):
                    state[rows] = fill
        self.written = True
