"""fused_update (C++ CPU kernel) against the reference ``reference/embedding_update.py``,
pending rows included."""

import math

import pytest
import torch

from embedding_ops_helpers import (
    FTRL_SETTINGS,
    random_new_vectors,
    update_case,
)
from torchrec_ext import ops
from torchrec_ext import reference as ref


@pytest.mark.parametrize("settings", FTRL_SETTINGS, ids=["sqrt", "pow", "power0"])
@pytest.mark.parametrize("pooled", [True, False])
def test_fused_update_ftrl_settings_match_reference(settings, pooled):
    grad, weights, states, common = update_case("ftrl", pooled)
    common["hparams"] = common["hparams"][:6] + settings
    w_got, s_got = weights.clone(), [s.clone() for s in states]
    w_want, s_want = weights.clone(), [s.clone() for s in states]
    for step in (1, 2, 3):
        ops.fused_update(grad * step, w_got, s_got, optimizer=ref.OPTIMIZERS["ftrl"], step=step, **common)
        ref.fused_update(grad * step, w_want, s_want, optimizer="ftrl", step=step, **common)
    torch.testing.assert_close(w_got, w_want)
    for a, b in zip(s_got, s_want):
        torch.testing.assert_close(a, b)
    if settings[1] > 0.1:
        assert bool((w_got == 0).any()) and bool((w_got != 0).any())  # l1 zeroes the small |z|


def _ftrl_scalar(w, n, z, grads, lr, lr_power, l1, l2, beta):
    """FTRL-Proximal on one coordinate in Python floats, as TensorFlow's ApplyFtrl writes it
    (l2 adjusted by beta / (2 lr)): the oracle of reference.ftrl_step."""
    l2_adjusted = l2 + beta / (2 * lr)
    for g in grads:
        n_new = n + g * g
        z += g - (n_new**-lr_power - n**-lr_power) / lr * w
        quadratic = 1 / (n_new**lr_power * lr) + 2 * l2_adjusted
        w = (math.copysign(l1, z) - z) / quadratic if abs(z) > l1 else 0.0
        n = n_new
    return w, n, z


@pytest.mark.parametrize("settings", FTRL_SETTINGS, ids=["sqrt", "pow", "power0"])
def test_reference_ftrl_step_is_tensorflows_update(settings):
    gen = torch.Generator().manual_seed(7)
    w0, n0, z0 = (
        torch.randn(16, generator=gen, dtype=torch.float64),
        torch.rand(16, generator=gen, dtype=torch.float64) + 0.1,
        torch.randn(16, generator=gen, dtype=torch.float64) * 0.1,
    )
    grads = torch.randn(4, 16, generator=gen, dtype=torch.float64)
    w, n, z = w0.clone(), n0.clone(), z0.clone()
    for g in grads:
        ref.ftrl_step(w, g, n, z, 0.05, *settings)
    for i in range(16):
        want = _ftrl_scalar(float(w0[i]), float(n0[i]), float(z0[i]), grads[:, i].tolist(), 0.05, *settings)
        assert (float(w[i]), float(n[i]), float(z[i])) == pytest.approx(want, rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("optimizer", list(ref.OPTIMIZERS))
@pytest.mark.parametrize("pooled", [True, False])
def test_fused_update_matches_reference(optimizer, pooled):
    grad, weights, states, common = update_case(optimizer, pooled)
    w_got, s_got = weights.clone(), [s.clone() for s in states]
    w_want, s_want = weights.clone(), [s.clone() for s in states]
    for step in (1, 2, 3):
        ops.fused_update(grad, w_got, s_got, optimizer=ref.OPTIMIZERS[optimizer], step=step, **common)
        ref.fused_update(grad, w_want, s_want, optimizer=optimizer, step=step, **common)
    torch.testing.assert_close(w_got, w_want)
    for a, b in zip(s_got, s_want):
        torch.testing.assert_close(a, b)
    assert not torch.equal(w_got, weights)


@pytest.mark.parametrize("optimizer", list(ref.OPTIMIZERS))
@pytest.mark.parametrize("pooled", [True, False])
def test_fused_update_writes_new_rows_then_steps(optimizer, pooled):
    grad, weights, states, common = update_case(optimizer, pooled)
    unique_rows, unique_table, dims = common["unique_rows"], common["unique_table"], common["table_dims"]
    # Every other unique row with a row is new; each table numbers its new rows from 0.
    unique_new = torch.full_like(unique_rows, -1)
    counts = [0] * dims.numel()
    for u in range(0, unique_rows.numel(), 2):
        if unique_rows[u] >= 0:
            t = int(unique_table[u])
            unique_new[u], counts[t] = counts[t], counts[t] + 1
    new_vectors = random_new_vectors(dims, counts)
    state_init = [0.25, 0.5][: len(states)]  # (Adam with v = 0 would amplify float rounding)
    new = dict(new_vectors=new_vectors, unique_new=unique_new, state_init=state_init)
    w_got, s_got = weights.clone(), [s.clone() for s in states]
    w_want, s_want = weights.clone(), [s.clone() for s in states]
    ops.fused_update(grad, w_got, s_got, optimizer=ref.OPTIMIZERS[optimizer], step=1, **common, **new)
    ref.fused_update(grad, w_want, s_want, optimizer=optimizer, step=1, **common, **new)
    torch.testing.assert_close(w_got, w_want)
    for a, b in zip(s_got, s_want):
        torch.testing.assert_close(a, b)
    # Independently: identical bits to writing the new rows first, then a plain update.
    w_eager, s_eager = weights.clone(), [s.clone() for s in states]
    for u in (unique_new >= 0).nonzero().flatten().tolist():
        t, r, j = int(unique_table[u]), int(unique_rows[u]), int(unique_new[u])
        dim, base = int(dims[t]), int(common["table_offsets"][t])
        w_eager[base + r * dim : base + (r + 1) * dim] = new_vectors[t][j]
        for state, value in zip(s_eager, state_init):
            if optimizer in ref.ROWWISE_STATE:
                state[int(common["state_row_offsets"][t]) + r] = value
            else:
                state[base + r * dim : base + (r + 1) * dim] = value
    ops.fused_update(grad, w_eager, s_eager, optimizer=ref.OPTIMIZERS[optimizer], step=1, **common)
    assert torch.equal(w_got, w_eager)
    for a, b in zip(s_got, s_eager):
        assert torch.equal(a, b)


def test_pending_rows_bad_input_is_a_clear_error():
    grad, weights, states, common = update_case("adagrad", True)
    unique_new = torch.full_like(common["unique_rows"], -1)
    with pytest.raises(RuntimeError, match="unique_new needs new_vectors"):
        ops.fused_update(grad, weights, states, optimizer=1, step=1, **common, unique_new=unique_new, state_init=[0.0])
    vectors = random_new_vectors(common["table_dims"], [1, 1, 1])
    with pytest.raises(RuntimeError, match="state_init must give one initial value per state"):
        ops.fused_update(
            grad,
            weights,
            states,
            optimizer=1,
            step=1,
            **common,
            new_vectors=vectors,
            unique_new=unique_new,
            state_init=[],
        )
    missing = common["unique_rows"].eq(-1).nonzero().flatten()[:1]
    assert missing.numel() == 1
    unique_new[missing] = 0
    before = weights.clone()
    with pytest.raises(RuntimeError, match="for a row >= 0"):  # a new vector needs a row to go to
        ops.fused_update(
            grad,
            weights,
            states,
            optimizer=1,
            step=1,
            **common,
            new_vectors=vectors,
            unique_new=unique_new,
            state_init=[0.0],
        )
    assert torch.equal(weights, before)
