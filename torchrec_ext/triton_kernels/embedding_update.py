"""Triton backward of the embedding lookups fused with the optimizer step (sparse update).

Value i of a lookup belongs to unique row ``inverse[i]``. Its gradient is, for a pooled lookup
(``offsets`` given), ``grad[b, col:col + dim]`` of its bag g = f * batch_size + b, times its
per-sample weight and 1/len(bag) for mean features; for a sequence lookup (``offsets`` None),
``grad[i]``. The gradients are summed per unique row and every unique row >= 0 takes one step of
the optimizer, in place on ``weights`` and the optimizer ``states``: torch.optim's SGD, Adagrad,
Adam, AdamW and torchrec's RowWiseAdagrad restricted to the touched rows, and FTRL-Proximal
(TensorFlow's), with hparams (lr, eps, beta1, beta2, weight_decay, lr_decay[, lr_power, l1, l2,
beta]) and 1-based ``step``. Same signature and
semantics as torchrec_ext.reference.fused_update; storage convention in embedding_lookup.py.
Half-precision rows are read as float32, stepped in float32 and stored rounded to nearest even,
or stochastically (reference.round_to_storage with reference.rounding_bits: the hash of the
table's rounding seed, the row's id, the element and the step) where the table's rounding seed
is not 0. Element-wise optimizer states hold the tables' [capacity, dim] back to back.

How: the host groups the values by unique row with torch ops (a stable sort of ``inverse``,
then segment bounds by binary search; no device sync, no per-value [n, dim] gradient). Then one
program per (unique row, block of columns) sums its values' gradients straight from ``grad`` and
applies the update. Row-wise Adagrad needs mean(g^2) over the whole row, so it runs with one
block covering the widest table. Per-row sums run in value order, BLOCK_N values at a time.
"""

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from torchrec_ext import device_sync
from torchrec_ext.vocabulary import OPTIMIZERS, ROUNDING_GOLDEN

from .embedding_lookup import check_no_new_vectors, dtype_codes, launching_on, load_rows, typed_views
from .layout_cache import LayoutCache

# The optimizer ids as constants the kernels branch on (vocabulary.OPTIMIZERS).
_SGD, _ADAGRAD, _ROWWISE_ADAGRAD, _ADAM, _ADAMW, _FTRL = (
    OPTIMIZERS[k] for k in ("sgd", "adagrad", "rowwise_adagrad", "adam", "adamw", "ftrl")
)
_NUM_STATES = {_SGD: 0, _ADAGRAD: 1, _ROWWISE_ADAGRAD: 1, _ADAM: 2, _ADAMW: 2, _FTRL: 2}
# How FTRL raises the accumulator to -lr_power: a square root (the default -0.5, as TensorFlow
# computes it), 1 (lr_power = 0), else exp2(-lr_power * log2(n)).
_FTRL_SQRT, _FTRL_ONE, _FTRL_POW = 0, 1, 2
_MASK64 = (1 << 64) - 1
_SR_GOLDEN = ROUNDING_GOLDEN


def _step_term(step: int) -> int:
    """step * SR_GOLDEN mod 2**64 as a signed 64-bit int: the kernel's ``step_term``. Triton's
    launcher types a Python int by its value (i32 below 2**31, i64 up to 2**63, u64 above), so a
    term from 2**63 up would compile a u64 variant of the kernel; signed, it is i64 but for the
    rare term in [-2**31, 2**31) (i32, which the kernel widens with its sign: the same bits)."""
    term = (step * _SR_GOLDEN) & _MASK64
    return term - (1 << 64) if term >> 63 else term


@triton.jit
def _fmix64(x):
    x ^= x >> 33
    x *= 0xFF51AFD7ED558CCD
    x ^= x >> 33
    x *= 0xC4CEB9FE1A85EC53
    x ^= x >> 33
    return x


@triton.jit
def _round_stochastic(w, r, TO_HALF: tl.constexpr):
    """float32 ``w`` stochastically rounded with 16-bit randoms ``r`` (int64), returned as the
    float32 value of the result (exactly on the target grid): reference.round_to_storage."""
    u = w.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
    sign = u & 0x80000000
    a = u & 0x7FFFFFFF
    if TO_HALF:
        dropped = tl.minimum(tl.maximum(126 - (a >> 23), 13), 24)  # (24: only the tiny case below)
        scaled = tl.where(dropped >= 16, r << tl.maximum(dropped - 16, 0), r >> tl.maximum(16 - dropped, 0))
        t = (a + scaled) & ~((tl.full(a.shape, 1, tl.int64) << dropped) - 1)
        away = tl.abs(w) * 1099511627776.0 >= (65536 - r).to(tl.float32)  # |w| + r * 2^-40 >= 2^-24
        t = tl.where(a < 0x33800000, tl.where(away, 0x33800000, 0), t)
        t = tl.where((t >= 0x47800000) & (a < 0x477FF000), 0x477FE000, t)  # finite stays finite
    else:
        t = (a + r) & 0xFFFF0000
        t = tl.where((t == 0x7F800000) & (a < 0x7F7F8000), 0x7F7F0000, t)  # (reference.BF16_MAX_BITS)
    rounded = (t | sign).to(tl.int32).to(tl.float32, bitcast=True)
    return tl.where(a >= 0x7F800000, w, rounded)  # inf, NaN: to nearest (the cast below)


@triton.jit
def _round_bf16_nearest(w):
    """float32 ``w`` rounded to the nearest bfloat16 (ties to even), as float32: in integer
    operations, so every backend (the interpreter's cast truncates) gives torch's bits."""
    u = w.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
    t = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).to(tl.int32).to(tl.float32, bitcast=True)
    return tl.where((u & 0x7F800000) == 0x7F800000, w, t)  # inf, NaN: the cast


# step_term: not specialised on its value (a new term divisible by 16 would compile another variant).
@triton.jit(do_not_specialize=["step_term"])
def _fused_update_bwd_kernel(
    grad_ptr,  # pooled: [batch_size, total_dim]; sequence: [n, >= dim]; any float dtype
    grad_stride,  # elements between two rows of grad
    weights_ptr,  # the flat buffer of all tables (as float32), updated in place
    weights16_ptr,  # the same, as float16
    weightsbf_ptr,  # the same, as bfloat16
    table_dtypes_ptr,  # [T] int32: storage dtype code of each table (HAS_DTYPES only)
    rounding_seeds_ptr,  # [T] int64: stochastic rounding seed per table, 0 = to nearest (STOCHASTIC only)
    unique_ids_ptr,  # [U] int64: the id of each unique row (STOCHASTIC only)
    step_term,  # step * SR_GOLDEN mod 2^64, signed: i64, or i32 when small (STOCHASTIC only)
    state1_ptr,  # momentum1 / accumulator: like weights (adagrad, adam kinds, ftrl) or one float per row (rowwise)
    state2_ptr,  # momentum2 (adam kinds) / linear (ftrl), like weights
    table_offsets_ptr,  # [T] int
    table_dims_ptr,  # [T] int
    state_row_offsets_ptr,  # [T] int: first row-wise state of each table
    state_offsets_ptr,  # [T] int64: first element-wise state of each table (the tables back to back)
    unique_rows_ptr,  # [U] int, < 0 = skip
    unique_table_ptr,  # [U] int
    seg_ptr,  # [U + 1] int64: values of unique u are order[seg[u]:seg[u + 1]]
    order_ptr,  # [n] int64: value indices, grouped by unique row, ascending within a group
    bag_ptr,  # [n] int64: bag of order[k] (pooled only)
    offsets_ptr,  # [num_bags + 1] int (pooled only)
    psw_ptr,  # [n] per-sample weights (HAS_WEIGHTS only)
    feature_col_ptr,  # [F] int (pooled only)
    feature_mean_ptr,  # [F] int32 (pooled only)
    batch_size,
    lr,  # sgd / adam: lr; adagrads: lr already decayed for this step
    eps,
    lerp_weight,  # adam: 1 - beta1
    beta2,
    one_minus_beta2,
    adam_step_size,  # lr / (1 - beta1^step)
    sqrt_bc2,  # sqrt(1 - beta2^step)
    weight_decay,
    adamw_decay,  # 1 - lr * weight_decay
    lr_power,  # ftrl
    l1,
    two_l2,
    beta,
    OPTIMIZER: tl.constexpr,
    FTRL_POWER: tl.constexpr,
    POOLED: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    HAS_WEIGHT_DECAY: tl.constexpr,
    HAS_DTYPES: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    u = tl.program_id(0).to(tl.int64)
    pid_d = tl.program_id(1).to(tl.int64)
    row = tl.load(unique_rows_ptr + u).to(tl.int64)
    table = tl.load(unique_table_ptr + u).to(tl.int64)
    live = row >= 0  # unique rows < 0 take no update
    safe_table = tl.where(live, table, 0)  # tables of skipped rows may be anything
    dim = tl.load(table_dims_ptr + safe_table).to(tl.int64)
    base = tl.load(table_offsets_ptr + safe_table).to(tl.int64)
    state_base = tl.load(state_offsets_ptr + safe_table).to(tl.int64)
    dtype_code = tl.load(table_dtypes_ptr + safe_table) if HAS_DTYPES else 0
    d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = (d < dim) & live

    # ---- sum of the gradients of this row's values -------------------------------------
    seg_start = tl.load(seg_ptr + u)
    seg_end = tl.load(seg_ptr + u + 1)
    seg_end = tl.where(live & (pid_d * BLOCK_D < dim), seg_end, seg_start)  # nothing to read
    g = tl.zeros([BLOCK_D], dtype=tl.float32)
    k = seg_start
    while k < seg_end:
        kk = k + tl.arange(0, BLOCK_N)
        k_mask = kk < seg_end
        value = tl.load(order_ptr + kk, mask=k_mask, other=0)
        if POOLED:
            bag = tl.load(bag_ptr + kk, mask=k_mask, other=0)
            feature = bag // batch_size
            sample = bag - feature * batch_size
            col = tl.load(feature_col_ptr + feature, mask=k_mask, other=0).to(tl.int64)
            if HAS_WEIGHTS:
                scale = tl.load(psw_ptr + value, mask=k_mask, other=0.0).to(tl.float32)
            else:
                scale = tl.full([BLOCK_N], 1.0, tl.float32)
            is_mean = tl.load(feature_mean_ptr + feature, mask=k_mask, other=0)
            length = tl.load(offsets_ptr + bag + 1, mask=k_mask, other=1) - tl.load(
                offsets_ptr + bag, mask=k_mask, other=0
            )
            length = tl.maximum(length, 1).to(tl.float32)
            scale = tl.where(is_mean != 0, tl.div_rn(scale, length), scale)
            src = grad_ptr + sample * grad_stride + col
        else:
            src = grad_ptr + value * grad_stride
        vals = tl.load(src[:, None] + d[None, :], mask=k_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
        if POOLED:
            vals = scale[:, None] * vals
        g += tl.sum(vals, axis=0)
        k += BLOCK_N

    # ---- optimizer step, in the reference's operation order ----------------------------
    elem = state_base + row * dim + d  # element-wise state
    w = load_rows(weights_ptr, weights16_ptr, weightsbf_ptr, base, row * dim + d, d_mask, dtype_code, HAS_DTYPES)
    if HAS_WEIGHT_DECAY:  # torch's coupled (L2) decay; AdamW decays the weight below, FTRL has none
        g = g + weight_decay * w
    if OPTIMIZER == 4:  # adamw: decay the weight, then Adam's step
        w = w * adamw_decay
    if OPTIMIZER == 0:  # sgd
        w = w - lr * g
    elif OPTIMIZER == 1:  # adagrad: state += g^2; w -= clr * g / (sqrt(state) + eps)
        s = tl.load(state1_ptr + elem, mask=d_mask, other=0.0)
        s = s + g * g
        tl.store(state1_ptr + elem, s, mask=d_mask)
        w = w - tl.div_rn(lr * g, tl.sqrt_rn(s) + eps)
    elif OPTIMIZER == 2:  # rowwise_adagrad: state += mean(g^2) over the row (one block holds it)
        state_at = tl.load(state_row_offsets_ptr + safe_table).to(tl.int64) + row
        s = tl.load(state1_ptr + state_at, mask=live, other=0.0)
        s = s + tl.div_rn(tl.sum(g * g, axis=0), tl.maximum(dim, 1).to(tl.float32))
        tl.store(state1_ptr + state_at, s, mask=live)
        w = w - tl.div_rn(lr * g, tl.sqrt_rn(s) + eps)
    elif OPTIMIZER == 5:  # ftrl: TensorFlow's ApplyFtrl (reference.ftrl_step)
        n = tl.load(state1_ptr + elem, mask=d_mask, other=1.0)  # (masked lanes: no log2(0))
        z = tl.load(state2_ptr + elem, mask=d_mask, other=0.0)
        n_new = n + g * g
        if FTRL_POWER == 0:
            p_new = tl.sqrt_rn(n_new)
            p_old = tl.sqrt_rn(n)
        elif FTRL_POWER == 1:
            p_new = tl.full([BLOCK_D], 1.0, tl.float32)
            p_old = p_new
        else:  # n > 0 here (lr_power < 0 with a zero n gives exp2(-inf) = 0, as pow does)
            p_new = tl.exp2(-lr_power * tl.log2(n_new))
            p_old = tl.exp2(-lr_power * tl.log2(n))
        sigma = tl.div_rn(p_new - p_old, lr)
        z = z + (g - sigma * w)
        tl.store(state1_ptr + elem, n_new, mask=d_mask)
        tl.store(state2_ptr + elem, z, mask=d_mask)
        quadratic = tl.div_rn(p_new + beta, lr) + two_l2
        w = tl.where(tl.abs(z) > l1, tl.div_rn(tl.where(z > 0, l1, -l1) - z, quadratic), 0.0)
    else:  # adam, adamw
        m = tl.load(state1_ptr + elem, mask=d_mask, other=0.0)
        v = tl.load(state2_ptr + elem, mask=d_mask, other=0.0)
        # torch.lerp's two formulas, picked by the weight as torch does.
        m = tl.where(lerp_weight < 0.5, m + lerp_weight * (g - m), g - (g - m) * (1.0 - lerp_weight))
        v = v * beta2 + one_minus_beta2 * g * g
        tl.store(state1_ptr + elem, m, mask=d_mask)
        tl.store(state2_ptr + elem, v, mask=d_mask)
        w = w - tl.div_rn(adam_step_size * m, tl.div_rn(tl.sqrt_rn(v), sqrt_bc2) + eps)
    if HAS_DTYPES:
        # Half rows: stochastic rounding where the table has a seed (then an exact cast), else
        # the casts round to nearest even.
        if STOCHASTIC:
            seed = tl.load(rounding_seeds_ptr + safe_table).to(tl.uint64, bitcast=True)
            rid = tl.load(unique_ids_ptr + u).to(tl.uint64, bitcast=True)
            key = _fmix64(_fmix64(rid ^ seed) + step_term.to(tl.int64).to(tl.uint64, bitcast=True))
            # vocabulary.ROUNDING_GOLDEN, as a literal (a jit kernel reads no Python globals)
            bits = _fmix64(key + (d // 4 + 1).to(tl.uint64) * 0xD6E8FEB86659FD93)
            r = ((bits >> ((d % 4) * 16).to(tl.uint64)) & 0xFFFF).to(tl.int64)
            on = (seed != 0) & (dtype_code != 0)
            w = tl.where(
                on & (dtype_code == 1),
                _round_stochastic(w, r, True),
                tl.where(
                    on & (dtype_code == 2),
                    _round_stochastic(w, r, False),
                    tl.where(dtype_code == 2, _round_bf16_nearest(w), w),
                ),
            )
        else:
            w = tl.where(dtype_code == 2, _round_bf16_nearest(w), w)
        tl.store(weights_ptr + base + row * dim + d, w, mask=d_mask & (dtype_code == 0))
        tl.store(weights16_ptr + 2 * base + row * dim + d, w.to(tl.float16), mask=d_mask & (dtype_code == 1))
        tl.store(weightsbf_ptr + 2 * base + row * dim + d, w.to(tl.bfloat16), mask=d_mask & (dtype_code == 2))
    else:
        tl.store(weights_ptr + base + row * dim + d, w, mask=d_mask)


def _optimizer_id(optimizer: str | int) -> int:
    if isinstance(optimizer, str) and optimizer in OPTIMIZERS:
        return OPTIMIZERS[optimizer]
    if isinstance(optimizer, int) and not isinstance(optimizer, bool) and optimizer in OPTIMIZERS.values():
        return optimizer
    raise ValueError(f"fused_update: optimizer must be one of {sorted(OPTIMIZERS)}, got {optimizer!r}")


def _meta(t: Tensor, device: torch.device, dtype: torch.dtype = torch.int64) -> Tensor:
    t = torch.as_tensor(t, device=getattr(t, "device", "cpu"))  # (a list: on the host, not the default device)
    return device_sync.to_device(t, device).to(dtype=dtype).contiguous()


class _DerivedLayout(NamedTuple):
    """What the update derives from the tables' layout, on the kernel's device."""

    offsets: Tensor  # word offset of each table
    dims: Tensor
    state_row_offsets: Tensor
    state_offsets: Tensor  # first element of each table's element-wise state ([capacity, dim] back to back)
    codes: Tensor  # dtype code of each table (int32; a dummy without table_dtypes)
    has_dtypes: bool
    max_dim: int


# Per layout (the caller's table_offsets tensor): ~10 small ops a call computed once.
_derived_layouts = LayoutCache()


def _derive_layout(
    table_offsets: Tensor,
    table_dims: Tensor,
    state_row_offsets: Tensor,
    table_dtypes: Tensor | None,
    weights: Tensor,
) -> _DerivedLayout:
    device = weights.device
    max_dim = int(device_sync.to_host(table_dims, "fused_update: widest table").max())
    offsets_t, dims_t = _meta(table_offsets, device), _meta(table_dims, device)
    codes, has_dtypes = dtype_codes(table_dtypes, device)
    # Capacities from the word spans (device ops: no sync).
    ends = torch.cat([offsets_t[1:], offsets_t.new_full((1,), weights.numel())])
    elem_bytes = torch.where(codes.to(torch.int64) == 0, 4, 2) if has_dtypes else 4
    caps = (ends - offsets_t) * 4 // (dims_t * elem_bytes)
    return _DerivedLayout(
        offsets_t,
        dims_t,
        _meta(state_row_offsets, device),
        torch.cumsum(caps * dims_t, 0) - caps * dims_t,
        codes,
        has_dtypes,
        max_dim,
    )


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
    optimizer: str | int,
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

    ``optimizer``: a name of OPTIMIZERS ("sgd", "adagrad", "rowwise_adagrad", "adam", "adamw",
    "ftrl") or its id. hparams: (lr, eps, beta1, beta2, weight_decay, lr_decay[, lr_power, l1,
    l2, beta]), the last four for ftrl; ``step`` is 1-based.
    """
    # Groups the values by unique row, then one program per (unique row, column block).
    check_no_new_vectors(new_vectors, "fused_update")
    if unique_new is not None:
        raise ValueError("fused_update: unique_new is supported by the CPU kernels only")
    opt = _optimizer_id(optimizer)
    hparams = [float(h) for h in hparams]
    if len(hparams) not in (6, 10) or (opt == _FTRL and len(hparams) != 10):
        raise ValueError(
            "fused_update: hparams must be (lr, eps, beta1, beta2, weight_decay, lr_decay"
            f"[, lr_power, l1, l2, beta]) (the last four for ftrl), got {len(hparams)} values"
        )
    lr, eps, beta1, beta2, weight_decay, lr_decay = hparams[:6]
    lr_power, l1, l2, beta = hparams[6:] if len(hparams) == 10 else (0.0,) * 4
    if weights.dtype != torch.float32 or not weights.is_contiguous():
        raise ValueError("fused_update: weights must be a contiguous float32 buffer")
    if len(states) < _NUM_STATES[opt]:
        raise ValueError(f"fused_update: {optimizer!r} needs {_NUM_STATES[opt]} state buffers, got {len(states)}")
    for s in states[: _NUM_STATES[opt]]:
        if s.dtype != torch.float32 or not s.is_contiguous() or s.device != weights.device:
            raise ValueError("fused_update: states must be contiguous float32 buffers on the weights' device")
    num_unique = unique_rows.numel()
    if num_unique == 0:
        return
    device = weights.device
    layout_tensors = (table_offsets, table_dims, state_row_offsets, table_dtypes)
    layout = _derived_layouts.get(
        layout_tensors, (weights.numel(), device), lambda: _derive_layout(*layout_tensors, weights)
    )
    max_dim = layout.max_dim  # (table_dims mirrored by the caller: no sync)
    if max_dim <= 0:
        return

    # Group values by unique row: a stable sort keeps each row's values in ascending order, and
    # seg[u] = first position of u in the sorted inverse (searchsorted: no bincount, no sync).
    inverse = inverse.to(device=device, dtype=torch.int64)
    sorted_inverse, order = torch.sort(inverse, stable=True)
    seg = torch.searchsorted(sorted_inverse, torch.arange(num_unique + 1, device=device, dtype=torch.int64))

    pooled = offsets is not None
    has_weights = pooled and per_sample_weights is not None
    if pooled:
        offsets = _meta(offsets, device)
        # Bag of each value, as the reference's repeat_interleave of the bag lengths: value i
        # lies in the bag whose [offsets[g], offsets[g + 1]) holds offsets[0] + i.
        bag = torch.searchsorted(offsets, offsets[:1] + order, right=True) - 1
        feature_col_t = _meta(feature_col, device)
        feature_mean_t = _meta(feature_mean, device, torch.int32)
    else:
        bag = offsets = feature_col_t = feature_mean_t = order  # dummies, never read
    psw = per_sample_weights.to(device).contiguous() if has_weights else order
    if grad.stride(-1) != 1:
        grad = grad.contiguous()
    grad_stride = grad.stride(0) if grad.dim() > 1 else 1

    if opt in (_ADAGRAD, _ROWWISE_ADAGRAD):
        lr = lr / (1 + (step - 1) * lr_decay)
    bc1, bc2 = 1 - beta1**step, 1 - beta2**step
    adam_step_size = lr / bc1 if opt in (_ADAM, _ADAMW) else 0.0
    sqrt_bc2 = math.sqrt(bc2) if opt in (_ADAM, _ADAMW) else 1.0
    ftrl_power = _FTRL_SQRT if lr_power == -0.5 else _FTRL_ONE if lr_power == 0 else _FTRL_POW

    if opt == _ROWWISE_ADAGRAD:
        block_d = triton.next_power_of_2(max_dim)  # the whole row in one block, for mean(g^2)
    else:
        block_d = min(triton.next_power_of_2(max_dim), 256)
    block_n = max(1, min(16, 4096 // block_d))
    num_warps = 8 if block_d >= 1024 else 4 if block_d >= 256 else 2
    state1 = states[0] if _NUM_STATES[opt] >= 1 else weights  # dummies, never read
    state2 = states[1] if _NUM_STATES[opt] >= 2 else weights
    offsets_t, dims_t, state_offsets, codes, has_dtypes = (
        layout.offsets,
        layout.dims,
        layout.state_offsets,
        layout.codes,
        layout.has_dtypes,
    )
    stochastic = has_dtypes and rounding_seeds is not None
    if stochastic and unique_ids is None:
        raise ValueError("fused_update: stochastic rounding (rounding_seeds given) needs unique_ids")
    seeds = _meta(rounding_seeds, device) if stochastic else order
    ids = unique_ids.to(device=device, dtype=torch.int64).contiguous() if stochastic else order
    grid = (num_unique, triton.cdiv(max_dim, block_d))
    with launching_on(device):
        _fused_update_bwd_kernel[grid](
            grad,
            grad_stride,
            *typed_views(weights),
            codes,
            seeds,
            ids,
            _step_term(step),
            state1,
            state2,
            offsets_t,
            dims_t,
            layout.state_row_offsets,
            state_offsets,
            unique_rows.to(device).contiguous(),
            unique_table.to(device).contiguous(),
            seg,
            order,
            bag,
            offsets,
            psw,
            feature_col_t,
            feature_mean_t,
            batch_size,
            lr,
            eps,
            1.0 - beta1,
            beta2,
            1.0 - beta2,
            adam_step_size,
            sqrt_bc2,
            weight_decay,
            1.0 - lr * weight_decay,
            lr_power,
            l1,
            2.0 * l2,
            beta,
            OPTIMIZER=opt,
            FTRL_POWER=ftrl_power,
            POOLED=pooled,
            HAS_WEIGHTS=has_weights,
            HAS_WEIGHT_DECAY=weight_decay != 0 and opt not in (_ADAMW, _FTRL),
            HAS_DTYPES=has_dtypes,
            STOCHASTIC=stochastic,
            BLOCK_N=block_n,
            BLOCK_D=block_d,
            num_warps=num_warps,
        )
