"""Fallback rows of a row-wise sharded table: every rank holds a copy (``DynamicTables.replicated_fallback``,
set by the sharded module). Each rank's fused update leaves those rows out; their gradients are
summed over the ranks first, and every copy then takes the step the unsharded table takes.
"""

from __future__ import annotations

import torch
from torch import Tensor

from torchrec_ext import ops
from torchrec_ext.modules.ids_to_rows import RowLookup
from torchrec_ext.vocabulary import OPTIMIZERS

# SGD hyper-parameters (lr, eps, beta1, beta2, weight_decay, lr_decay) whose step on a zeroed row
# leaves the row's summed gradient in it.
_MINUS_ONE_SGD = (-1.0, 0.0, 0.0, 0.0, 0.0, 0.0)


class ReplicatedFallback:
    """The replicated-fallback part of ``DynamicTables`` (see the module docstring)."""

    def _replicated_fallback_layout(self) -> tuple[list[int], list[int], int]:
        """Where each table's fallback gradients go in the buffer the ranks sum: (word start,
        row start of the read counts after the gradients, words of gradients); tables whose
        fallback rows are not replicated take no room."""
        tables = set(self.replicated_fallback[0])
        rows = [m.fallback_rows if t in tables else 0 for t, m in enumerate(self.meta)]
        words = [k * m.dim for k, m in zip(rows, self.meta)]
        word_starts = [sum(words[:t]) for t in range(len(words))]
        return word_starts, [sum(rows[:t]) for t in range(len(rows))], sum(words)

    def _sum_replicated_fallback_gradients(
        self,
        grad: Tensor,
        lookup: RowLookup,
        offsets: Tensor | None,
        per_sample_weights: Tensor | None,
        feature_col: Tensor,
        feature_mean: Tensor,
        batch_size: int,
    ) -> tuple[Tensor, Tensor]:
        """Which uniques read a replicated fallback row, and the buffer holding, summed over the
        ranks, each such row's gradient and how many ranks read it (0: it takes no step).

        The gradients are the fused kernel's own sums: a plain SGD step of learning rate -1 on a
        zeroed copy of those rows leaves each row's summed gradient in it."""
        tables, all_reduce = self.replicated_fallback
        word_starts, row_starts, words = self._replicated_fallback_layout()
        device = self.device
        flags = torch.zeros(len(self.meta), dtype=torch.bool, device=device)
        flags[tables] = True
        capacity = self._on_device()[5][:, 0]
        table = lookup.unique_table
        replicated = (lookup.unique_rows >= capacity[table]) & flags[table]
        local = torch.where(replicated, lookup.unique_rows - capacity[table], -1)
        reads = sum(self.meta[t].fallback_rows for t in tables)
        buffer = torch.zeros(words + reads, dtype=torch.float32, device=device)
        ops.fused_update(
            grad,
            buffer[:words],
            [],
            torch.tensor(word_starts, dtype=torch.int64, device=device),
            self.layout()[1],
            torch.zeros(len(self.meta), dtype=torch.int64, device=device),
            local,
            table,
            lookup.inverse,
            offsets,
            per_sample_weights,
            feature_col,
            feature_mean,
            batch_size,
            OPTIMIZERS["sgd"],
            _MINUS_ONE_SGD,
            1,
        )
        read = replicated.nonzero().squeeze(1)
        starts = torch.tensor(row_starts, dtype=torch.int64, device=device)
        buffer[words + starts[table[read]] + local[read]] = 1.0
        all_reduce(buffer)
        return replicated, buffer

    def _step_replicated_fallback(self, summed: Tensor, hyperparams: tuple[float, ...]) -> None:
        """One optimizer step of each replicated fallback row some rank read, on the summed
        gradient: every rank takes the same step, the one the unsharded table takes."""
        table_offsets, table_dims, state_row_offsets = self.layout()
        table_dtypes, rounding_seeds = self.dtype_layout()
        word_starts, row_starts, words = self._replicated_fallback_layout()
        device = self.device
        for t in self.replicated_fallback[0]:
            m = self.meta[t]
            read = summed[words + row_starts[t] : words + row_starts[t] + m.fallback_rows].nonzero().squeeze(1)
            if read.numel() == 0:
                continue
            grad = summed[word_starts[t] : word_starts[t] + m.fallback_rows * m.dim].view(m.fallback_rows, m.dim)[read]
            rows, n = m.capacity + read, read.numel()
            no_features = torch.zeros(0, dtype=torch.int64, device=device)
            # A sequence-shaped update: gradient row i is fallback row read[i]'s whole gradient;
            # its id for stochastic rounding is its slot, as in the unsharded lookup.
            ops.fused_update(
                grad,
                self.weights,
                self.states,
                table_offsets,
                table_dims,
                state_row_offsets,
                rows,
                torch.full((n,), t, dtype=torch.int64, device=device),
                torch.arange(n, device=device),
                None,
                None,
                no_features,
                no_features.bool(),
                0,
                self.optimizer.kind_id,
                hyperparams,
                int(self.optimizer_step),
                table_dtypes=table_dtypes,
                unique_ids=read,
                rounding_seeds=rounding_seeds,
            )
            if self.delta_log is not None:
                self.delta_log.updated(rows, torch.full((n,), t, dtype=torch.int64, device=device))
