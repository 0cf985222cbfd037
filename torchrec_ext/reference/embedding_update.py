"""``fused_update``: a lookup's backward fused with one optimizer step on each touched row, the
optimizer kinds, their states and hyper-parameters, and FTRL-Proximal's step (``ftrl_step``)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from torchrec_ext.reference.rounding import round_to_storage, rounding_bits
from torchrec_ext.reference.storage import _capacities, _dtypes_of, _table_rows, dense_state_offsets

OPTIMIZERS = {"sgd": 0, "adagrad": 1, "rowwise_adagrad": 2, "adam": 3, "adamw": 4, "ftrl": 5}


# Optimizer state buffers per kind: elementwise ones are shaped like the weights, row-wise ones
# hold one float per row. Adam's moments keep fbgemm's names; FTRL's keep TensorFlow's
# (accumulator n, the sum of squared gradients; linear z).
OPTIMIZER_STATES = {
    "sgd": (),
    "adagrad": ("momentum1",),
    "rowwise_adagrad": ("momentum1",),
    "adam": ("momentum1", "momentum2"),
    "adamw": ("momentum1", "momentum2"),
    "ftrl": ("accumulator", "linear"),
}


# The kernels' hyper-parameters, in order; FTRL's four come after the others' six (which it
# leaves at 0 but lr).
HYPERPARAMS = ("lr", "eps", "beta1", "beta2", "weight_decay", "lr_decay", "lr_power", "l1", "l2", "beta")


ROWWISE_STATE = {"rowwise_adagrad"}


def _bag_of_values(offsets: Tensor, num_values: int) -> Tensor:
    lengths = (offsets[1:] - offsets[:-1]).clamp(min=0)
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=offsets.device), lengths)[:num_values]


def fused_update(
    grad: Tensor,
    weights: Tensor,
    states: list[Tensor],
    table_offsets: Tensor,
    table_dims: Tensor,
    state_row_offsets: Tensor,
    unique_rows: Tensor,
    unique_table: Tensor,
    inverse: Tensor,
    offsets: Tensor | None,
    per_sample_weights: Tensor | None,
    feature_col: Tensor,
    feature_mean: Tensor,
    batch_size: int,
    optimizer: str,
    hparams: Sequence[float],
    step: int,
    new_vectors: Sequence[Tensor] = (),
    unique_new: Tensor | None = None,
    state_init: Sequence[float] = (),
    table_dtypes: Tensor | None = None,
    unique_ids: Tensor | None = None,
    rounding_seeds: Tensor | None = None,
) -> None:
    """Backward of a lookup fused with the optimizer step, in place on weights and states.

    The step runs in float32 on the row read as float32; the result is written in the table's
    storage dtype: round to nearest even, or, for a half-precision table t with
    rounding_seeds[t] != 0, stochastic rounding (``round_to_storage``) with the bits
    ``rounding_bits(unique_ids[u], dim, rounding_seeds[t], step)``.

    New rows first: a unique row u with unique_new[u] = j >= 0 takes new_vectors[t][j] and each
    state its state_init value over that row, then the step below.

    Value i belongs to unique row inverse[i]. Its gradient is, for a pooled lookup (offsets
    given), grad[b, col:col+dim] of its bag g = f * batch_size + b times its per-sample weight
    and 1/len(bag) for mean features; for a sequence lookup (offsets None), grad[i]. Gradients
    are summed per unique row, then each unique row with row >= 0 takes one step of
    ``optimizer`` with hparams (lr, eps, beta1, beta2, weight_decay, lr_decay[, lr_power, l1, l2,
    beta]) (``HYPERPARAMS``; the last four only for FTRL), ``step`` being the 1-based step count
    (Adam's bias correction, Adagrad's lr decay). The update rules are torch.optim's SGD /
    Adagrad / Adam / AdamW and torchrec.optim.RowWiseAdagrad on the touched rows, and
    FTRL-Proximal (``ftrl_step``).
    """
    lr, eps, beta1, beta2, weight_decay, lr_decay = hparams[:6]
    dtypes = _dtypes_of(table_dtypes, table_offsets.numel())
    caps = _capacities(weights, table_offsets, table_dims, dtypes)
    tables = _table_rows(weights, table_offsets, table_dims, caps, dtypes)
    state_offsets = dense_state_offsets(caps, table_dims.tolist())
    if unique_new is not None:
        for u in (unique_new >= 0).nonzero().flatten().tolist():
            r, t, j = int(unique_rows[u]), int(unique_table[u]), int(unique_new[u])
            dim, off = int(table_dims[t]), state_offsets[t]
            tables[t][r] = new_vectors[t][j]
            for state, value in zip(states, state_init):
                if optimizer == "rowwise_adagrad":
                    state[int(state_row_offsets[t]) + r] = value
                else:
                    state[off + r * dim : off + (r + 1) * dim] = value
    n = inverse.numel()
    if offsets is None:
        value_grads = grad[:n].float()
    else:
        bags = _bag_of_values(offsets, n)
        feature, sample = bags // batch_size, bags % batch_size
        lengths = (offsets[1:] - offsets[:-1]).to(torch.float32)
        scale = torch.ones(n, dtype=torch.float32, device=grad.device)
        if per_sample_weights is not None:
            scale = scale * per_sample_weights.float()
        mean = feature_mean[feature]
        scale = torch.where(mean, scale / lengths[bags].clamp(min=1), scale)
        value_grads = [
            scale[i]
            * grad[sample[i], int(feature_col[feature[i]]) :][: int(table_dims[int(unique_table[int(inverse[i])])])]
            for i in range(n)
        ]
    for u in range(unique_rows.numel()):
        r, t = int(unique_rows[u]), int(unique_table[u])
        if r < 0:
            continue
        dim = int(table_dims[t])
        g = torch.zeros(dim, dtype=torch.float32, device=grad.device)
        for i in (inverse == u).nonzero().flatten().tolist():
            g += value_grads[i][:dim]
        w = tables[t][r].float()  # a copy: the step runs in float32, the result is stored below
        elem = slice(state_offsets[t] + r * dim, state_offsets[t] + (r + 1) * dim)
        if weight_decay != 0 and optimizer in ("sgd", "adagrad", "rowwise_adagrad", "adam"):
            g = g + weight_decay * w  # L2: torch's coupled weight decay
        if optimizer == "sgd":
            w.add_(g, alpha=-lr)
        elif optimizer == "adagrad":
            s = states[0][elem]
            s.addcmul_(g, g)
            clr = lr / (1 + (step - 1) * lr_decay)
            w.addcdiv_(g, s.sqrt().add_(eps), value=-clr)
        elif optimizer == "rowwise_adagrad":
            s = states[0][int(state_row_offsets[t]) + r :][:1]
            s += g.pow(2).mean()
            clr = lr / (1 + (step - 1) * lr_decay)
            w.addcdiv_(g, s.sqrt().add_(eps), value=-clr)
        elif optimizer in ("adam", "adamw"):
            if optimizer == "adamw":
                # torch.optim.AdamW: decay the weight first (decoupled from the moments), then Adam.
                w.mul_(1 - lr * weight_decay)
            m, v = states[0][elem], states[1][elem]
            m.lerp_(g, 1 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            bc1, bc2 = 1 - beta1**step, 1 - beta2**step
            w.addcdiv_(m, (v.sqrt() / math.sqrt(bc2)).add_(eps), value=-lr / bc1)
        elif optimizer == "ftrl":
            lr_power, l1, l2, beta = hparams[6:10]
            ftrl_step(w, g, states[0][elem], states[1][elem], lr, lr_power, l1, l2, beta)
        else:
            raise ValueError(f"fused_update: optimizer must be one of {sorted(OPTIMIZERS)}, got {optimizer!r}")
        seed = 0 if rounding_seeds is None else int(rounding_seeds[t])
        bits = (
            None
            if seed == 0 or dtypes[t] == torch.float32
            else rounding_bits(unique_ids[u : u + 1], dim, seed, step)[0]
        )
        tables[t][r] = round_to_storage(w, dtypes[t], bits)


def ftrl_step(
    w: Tensor, g: Tensor, n: Tensor, z: Tensor, lr: float, lr_power: float, l1: float, l2: float, beta: float
) -> None:
    """One FTRL-Proximal step, in place on the weights ``w``, accumulator ``n`` and linear ``z``.

    TensorFlow's update (tf.keras.optimizers.Ftrl, kernel ApplyFtrl with beta folded into l2 as
    l2 + beta / (2 lr), so the denominator below), per element:
        n' = n + g^2
        sigma = (n'^-lr_power - n^-lr_power) / lr
        z' = z + g - sigma * w
        w' = (sign(z') * l1 - z') / ((beta + n'^-lr_power) / lr + 2 * l2)   where |z'| > l1, else 0
    Signs: z accumulates the gradient as it is (McMahan et al. 2013, Algorithm 1), so w' has the
    sign of -z'. TensorFlow's documentation writes the denominator's l2 term as lambda_2, its
    kernel (what it trains with) as 2 * l2: this follows the kernel.
    """
    n_new = n + g * g
    p_new, p_old = n_new.pow(-lr_power), n.pow(-lr_power)
    sigma = (p_new - p_old) / lr
    z.add_(g - sigma * w)
    n.copy_(n_new)
    quadratic = (p_new + beta) / lr + 2 * l2
    w.copy_(torch.where(z.abs() > l1, (torch.sign(z) * l1 - z) / quadratic, torch.zeros_like(w)))
