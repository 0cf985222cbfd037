"""The lookup of a dynamic collection as autograd sees it, both kernels launched here: forward reads
the rows (``ops.pooled_lookup`` / ``ops.sequence_lookup``), backward is the fused optimizer update
(``ops.fused_update``, ``fused_backward``); per-sample weights that require a gradient get theirs.

The functions receive the tables' storage (``DynamicTables``: its buffers and, for the update,
``begin_update`` / ``end_update``), the lookup's rows with the storage's layout and pending rows
(``RowLookup``), the features' layout (``LookupPlan``) and a reader of the optimizer's
hyperparameters, never the module. The
hyperparameters are read when the backward runs, so a setting written between forward and backward
(a scheduler's) applies, as before.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from torchrec_ext import device_sync, ops
from torchrec_ext.modules.dynamic_tables import DynamicTables
from torchrec_ext.modules.features import LookupInput, LookupPlan
from torchrec_ext.modules.ids_to_rows import RowLookup, UpdateBags

# The optimizer's hyperparameters (lr, eps, beta1, beta2, weight_decay, lr_decay), read when called.
Hyperparams = Callable[[], tuple[float, ...]]


def fused_backward(
    tables: DynamicTables, grad: Tensor, lookup: RowLookup, bags: UpdateBags, hyperparams: tuple[float, ...]
) -> None:
    """The fused backward of ``lookup``: per unique row, its ids' gradients summed (through
    ``bags``) and one optimizer step, in place; the lookup's pending rows are written by the
    same pass."""
    update = tables.begin_update(grad, lookup, bags)
    ops.fused_update(
        grad,
        update.weights,
        update.states,
        update.table_offsets,
        update.table_dims,
        update.state_row_offsets,
        update.unique_rows,
        lookup.unique_table,
        lookup.inverse,
        *bags,
        update.optimizer,
        hyperparams,
        update.step,
        *update.pending,
        table_dtypes=update.table_dtypes,
        unique_ids=lookup.unique_ids,
        rounding_seeds=update.rounding_seeds,
    )
    tables.end_update(lookup, update, hyperparams)


class PooledLookupFunction(torch.autograd.Function):
    """Pooled lookup whose backward is the fused optimizer update; the tables get no gradient,
    per-sample weights that require one (a feature processor's) get theirs. ``weights`` is
    ``batch.weights``, passed apart so that autograd sees it."""

    @staticmethod
    def forward(
        ctx,
        tables: DynamicTables,
        plan: LookupPlan,
        hyperparams: Hyperparams,
        lookup: RowLookup,
        batch: LookupInput,
        weights: Tensor | None,
        *params: Tensor,
    ) -> Tensor:
        layout = lookup.layout
        feature_table, feature_col, feature_mean = plan.tensors(tables.weights.device)
        offsets = torch.zeros(batch.lengths.numel() + 1, dtype=torch.int64, device=batch.lengths.device)
        torch.cumsum(batch.lengths, 0, out=offsets[1:])
        ctx.tables, ctx.plan, ctx.hyperparams = tables, plan, hyperparams
        ctx.lookup, ctx.batch, ctx.offsets = lookup, batch, offsets
        ctx.num_params = len(params)
        return ops.pooled_lookup(
            tables.weights,
            layout.table_offsets,
            layout.table_dims,
            feature_table,
            feature_col,
            feature_mean,
            lookup.rows,
            offsets,
            batch.weights,
            batch.batch_size,
            plan.total_dim,
            lookup.new_vectors,
            layout.table_dtypes,
        )

    @staticmethod
    def backward(ctx, grad: Tensor):
        tables, plan, batch = ctx.tables, ctx.plan, ctx.batch
        # Before the update: the weights' gradient reads the rows as the forward did.
        needs_weights = ctx.needs_input_grad[5]
        grad_weights = per_sample_weight_grad(tables, plan, ctx.lookup, batch, grad) if needs_weights else None
        _, feature_col, feature_mean = plan.tensors(tables.weights.device)
        bags = UpdateBags(ctx.offsets, batch.weights, feature_col, feature_mean, batch.batch_size)
        fused_backward(tables, grad, ctx.lookup, bags, ctx.hyperparams())
        return (None, None, None, None, None, grad_weights) + (None,) * ctx.num_params


def per_sample_weight_grad(
    tables: DynamicTables, plan: LookupPlan, lookup: RowLookup, batch: LookupInput, grad: Tensor
) -> Tensor:
    """d loss / d weight of each id: its row (as the lookup read it) dotted with the gradient of
    its bag's output columns, divided by the bag's length under mean pooling. One sequence
    lookup per distinct embedding dim."""
    feature_table, feature_col, feature_mean = plan.tensors(tables.weights.device)
    n, bags = batch.ids.numel(), batch.lengths.numel()
    bag = torch.repeat_interleave(torch.arange(bags, device=grad.device), batch.lengths, output_size=n)
    feature, sample = bag // batch.batch_size, bag % batch.batch_size
    scale = torch.where(feature_mean[feature], 1.0 / batch.lengths[bag].clamp(min=1).float(), 1.0)
    starts = [0]
    for count in batch.value_counts:
        starts.append(starts[-1] + count)
    out = grad.new_zeros(n)
    for dim in sorted(set(plan.dims)):
        features = [i for i, d in enumerate(plan.dims) if d == dim]
        at = torch.cat([torch.arange(starts[i], starts[i + 1], device=grad.device) for i in features])
        counts = device_sync.to_device(
            torch.tensor([0] + [batch.value_counts[i] for i in features], device="cpu"), grad.device
        )
        counts = counts.cumsum(0)
        # (the op takes one dim: other tables' pending vectors are not read, so stand in empty)
        pending = [v if v.shape[1] == dim else v.new_zeros(0, dim) for v in lookup.new_vectors]
        rows = ops.sequence_lookup(
            tables.weights,
            lookup.layout.table_offsets,
            dim,
            feature_table[features],
            counts,
            lookup.rows[at],
            pending,
            lookup.layout.table_dtypes,
        )
        cols = feature_col[feature[at]].unsqueeze(1) + torch.arange(dim, device=grad.device)
        out[at] = (grad[sample[at].unsqueeze(1), cols] * rows).sum(1) * scale[at]
    return out


class SequenceLookupFunction(torch.autograd.Function):
    """Sequence lookup ([num_ids, dim]) whose backward is the fused optimizer update."""

    @staticmethod
    def forward(
        ctx,
        tables: DynamicTables,
        plan: LookupPlan,
        hyperparams: Hyperparams,
        lookup: RowLookup,
        batch: LookupInput,
        *params: Tensor,
    ) -> Tensor:
        feature_table, _, _ = plan.tensors(tables.weights.device)
        ctx.tables, ctx.hyperparams, ctx.lookup = tables, hyperparams, lookup
        ctx.num_params = len(params)
        return ops.sequence_lookup(
            tables.weights,
            lookup.layout.table_offsets,
            plan.dims[0] if plan.dims else 1,
            feature_table,
            batch.feature_value_offsets,
            lookup.rows,
            lookup.new_vectors,
            lookup.layout.table_dtypes,
        )

    @staticmethod
    def backward(ctx, grad: Tensor):
        fused_backward(ctx.tables, grad, ctx.lookup, UpdateBags.sequence(grad.device), ctx.hyperparams())
        return (None, None, None, None, None) + (None,) * ctx.num_params
