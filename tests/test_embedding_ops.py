"""The C++ CPU embedding kernels against the pure-PyTorch references in torchrec_ext/reference/."""

import math

import pytest
import torch

from torchrec_ext import ops
from torchrec_ext import reference as ref

EXTREME_IDS = [0, -1, 2**63 - 1, -(2**63), 12345]


def _layout(caps, dims):
    offsets, total = [], 0
    for cap, dim in zip(caps, dims):
        offsets.append(total)
        total += cap * dim
    row_offsets = torch.tensor([0] + list(torch.tensor(caps).cumsum(0)[:-1].tolist()), dtype=torch.int64)
    return torch.tensor(offsets, dtype=torch.int64), torch.tensor(dims, dtype=torch.int64), total, row_offsets


def _bags(num_bags, max_len, allow_empty=True):
    lengths = torch.randint(0 if allow_empty else 1, max_len + 1, (num_bags,))
    return torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])


def test_dedup_segments_matches_reference():
    ids = torch.cat([torch.randint(-5, 5, (50,)), torch.tensor(EXTREME_IDS * 3), torch.randint(-(2**62), 2**62, (40,))])
    segments = torch.tensor([0, 0, 20, 20, 75, ids.numel()])
    got = ops.dedup_segments(ids, segments)
    want = ref.dedup_segments(ids, segments)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_dedup_segments_rejects_bad_offsets():
    with pytest.raises(RuntimeError, match="segment_offsets must run from 0"):
        ops.dedup_segments(torch.arange(4), torch.tensor([0, 3]))
    with pytest.raises(RuntimeError, match="non-decreasing"):
        ops.dedup_segments(torch.arange(4), torch.tensor([0, 3, 2, 4]))


@pytest.mark.parametrize(
    "kind,params",
    [
        ("uniform", (-0.3, 0.7)),
        ("normal", (0.5, 2.0)),
        ("truncated_normal", (0.0, 1.0, -0.5, 0.25)),
        ("constant", (0.125,)),
    ],
)
def test_init_rows_matches_reference(kind, params):
    cap, dim = 40, 13
    ids = torch.tensor(EXTREME_IDS + list(range(100, 120)))
    rows = torch.randperm(cap)[: ids.numel()]
    rows[3] = -1
    table = torch.full((cap, dim), 7.0)
    seed = ref.table_seed(42, "table_a")
    ops.init_rows(table, rows, ids, seed, ref.INITIALIZERS[kind], params)
    want = ref.init_vectors(ids, dim, seed, kind, params)
    keep = rows >= 0
    torch.testing.assert_close(table[rows[keep]], want[keep], rtol=1e-6, atol=1e-6)
    untouched = torch.ones(cap, dtype=torch.bool)
    untouched[rows[keep]] = False
    assert torch.all(table[untouched] == 7.0)
    if kind == "truncated_normal":
        assert table[rows[keep]].min() >= -0.5 and table[rows[keep]].max() <= 0.25


def test_init_is_a_function_of_seed_and_id_only():
    ids = torch.tensor([5, 9, 5])
    seed = ref.table_seed(0, "t")
    a, b = torch.zeros(3, 8), torch.zeros(3, 8)
    ops.init_rows(a, torch.tensor([0, 1, 2]), ids, seed, 1, (0.0, 1.0))
    ops.init_rows(b, torch.tensor([2, 0, 1]), ids.flip(0), seed, 1, (0.0, 1.0))
    assert torch.equal(a[0], a[2]) and torch.equal(a[0], b[1]) and torch.equal(a[1], b[0])
    assert not torch.equal(a[0], a[1])
    other = torch.zeros(1, 8)
    ops.init_rows(other, torch.tensor([0]), torch.tensor([5]), ref.table_seed(0, "u"), 1, (0.0, 1.0))
    assert not torch.equal(other[0], a[0])


def _pooled_case(weighted, batch_size=7):
    caps, dims = [11, 5, 9], [4, 12, 8]
    table_offsets, table_dims, total, _ = _layout(caps, dims)
    weights = torch.randn(total)
    feature_table = torch.tensor([0, 0, 1, 2])
    feature_dims = table_dims[feature_table]
    feature_col = torch.cat([torch.zeros(1, dtype=torch.int64), feature_dims.cumsum(0)[:-1]])
    feature_mean = torch.tensor([False, True, False, True])
    offsets = _bags(4 * batch_size, 5)
    n = int(offsets[-1])
    bag_table = feature_table.repeat_interleave(batch_size)
    value_table = bag_table.repeat_interleave(offsets[1:] - offsets[:-1])
    caps_t = torch.tensor(caps)
    rows = (torch.rand(n) * caps_t[value_table]).long()
    rows[torch.rand(n) < 0.15] = -1
    psw = torch.rand(n) if weighted else None
    return dict(
        weights=weights,
        table_offsets=table_offsets,
        table_dims=table_dims,
        feature_table=feature_table,
        feature_col=feature_col,
        feature_mean=feature_mean,
        rows=rows,
        offsets=offsets,
        per_sample_weights=psw,
        batch_size=batch_size,
        total_dim=int(feature_dims.sum()),
    )


@pytest.mark.parametrize("weighted", [False, True])
def test_pooled_lookup_matches_reference(weighted):
    case = _pooled_case(weighted)
    got = ops.pooled_lookup(**case)
    torch.testing.assert_close(got, ref.pooled_lookup(**case))


def test_pooled_lookup_empty_batch():
    case = _pooled_case(False, batch_size=0)
    assert ops.pooled_lookup(**case).shape == (0, case["total_dim"])


def test_pooled_lookup_rejects_rows_out_of_range():
    case = _pooled_case(False)
    case["rows"] = case["rows"].clone()
    case["rows"][0] = 10**6
    with pytest.raises(RuntimeError, match="out of range"):
        ops.pooled_lookup(**case)


def test_sequence_lookup_matches_reference():
    caps, dim = [6, 9], 8
    table_offsets, _, total, _ = _layout(caps, [dim, dim])
    weights = torch.randn(total)
    feature_table = torch.tensor([1, 0, 1])
    fvo = torch.tensor([0, 4, 4, 11])
    value_caps = torch.tensor([9] * 4 + [9] * 7)
    rows = (torch.rand(11) * value_caps).long()
    rows[2] = -1
    got = ops.sequence_lookup(weights, table_offsets, dim, feature_table, fvo, rows)
    assert torch.equal(got, ref.sequence_lookup(weights, table_offsets, dim, feature_table, fvo, rows))


def _update_case(optimizer, pooled):
    """A fused_update case: grad, weights, states and the op's other arguments but step."""
    torch.manual_seed(3)
    if pooled:
        case = _pooled_case(weighted=True)
        caps = [11, 5, 9]
        table_offsets, table_dims, total, row_offsets = _layout(caps, [4, 12, 8])
        bag_table = case["feature_table"].repeat_interleave(case["batch_size"])
        offsets = case["offsets"]
        value_table = bag_table.repeat_interleave(offsets[1:] - offsets[:-1])
        grad = torch.randn(case["batch_size"], case["total_dim"])
        extra = dict(
            offsets=offsets,
            per_sample_weights=case["per_sample_weights"],
            feature_col=case["feature_col"],
            feature_mean=case["feature_mean"],
            batch_size=case["batch_size"],
        )
        rows = case["rows"]
    else:
        caps = [6, 9]
        table_offsets, table_dims, total, row_offsets = _layout(caps, [8, 8])
        value_table = torch.tensor([1] * 4 + [0] * 7)
        rows = (torch.rand(11) * torch.tensor(caps)[value_table]).long()
        grad = torch.randn(11, 8)
        extra = dict(
            offsets=None,
            per_sample_weights=None,
            feature_col=torch.zeros(0, dtype=torch.int64),
            feature_mean=torch.zeros(0, dtype=torch.bool),
            batch_size=0,
        )
    # Unique (table, row) pairs, as the module's dedup produces them (a -1 row is a unique too).
    uniq, inverse = torch.unique(value_table * 1000 + rows + 1, return_inverse=True)
    unique_table, unique_rows = uniq // 1000, uniq % 1000 - 1
    weights = torch.randn(total)
    num_states = len(ref.OPTIMIZER_STATES[optimizer])
    state_size = sum(caps) if optimizer in ref.ROWWISE_STATE else total
    states = [torch.rand(state_size) for _ in range(num_states)]
    common = dict(
        table_offsets=table_offsets,
        table_dims=table_dims,
        state_row_offsets=row_offsets,
        unique_rows=unique_rows,
        unique_table=unique_table,
        inverse=inverse,
        hparams=(0.05, 1e-8, 0.9, 0.999, 0.01, 0.1) + (FTRL_SETTINGS[0] if optimizer == "ftrl" else ()),
        **extra,
    )
    return grad, weights, states, common


# FTRL's (lr_power, l1, l2, beta): TensorFlow's default power (a square root) with all three
# regularisers, a general power (l1 large enough to zero some weights), and power 0 (n^0 = 1).
FTRL_SETTINGS = [(-0.5, 0.02, 0.01, 0.5), (-0.3, 0.3, 0.1, 0.0), (0.0, 0.01, 0.0, 0.0)]


@pytest.mark.parametrize("settings", FTRL_SETTINGS, ids=["sqrt", "pow", "power0"])
@pytest.mark.parametrize("pooled", [True, False])
def test_fused_update_ftrl_settings_match_reference(settings, pooled):
    grad, weights, states, common = _update_case("ftrl", pooled)
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
    grad, weights, states, common = _update_case(optimizer, pooled)
    w_got, s_got = weights.clone(), [s.clone() for s in states]
    w_want, s_want = weights.clone(), [s.clone() for s in states]
    for step in (1, 2, 3):
        ops.fused_update(grad, w_got, s_got, optimizer=ref.OPTIMIZERS[optimizer], step=step, **common)
        ref.fused_update(grad, w_want, s_want, optimizer=optimizer, step=step, **common)
    torch.testing.assert_close(w_got, w_want)
    for a, b in zip(s_got, s_want):
        torch.testing.assert_close(a, b)
    assert not torch.equal(w_got, weights)


# ------------------------------------------------ new rows: initial vectors read from new_vectors


def _new_vectors(table_dims, counts):
    return [torch.randn(n, int(d)) for n, d in zip(counts, table_dims)]


@pytest.mark.parametrize("weighted", [False, True])
def test_pooled_lookup_reads_new_rows_from_new_vectors(weighted):
    case = _pooled_case(weighted)
    counts = [3, 0, 2]
    case["new_vectors"] = _new_vectors(case["table_dims"], counts)
    bag_table = case["feature_table"].repeat_interleave(case["batch_size"])
    value_table = bag_table.repeat_interleave(case["offsets"][1:] - case["offsets"][:-1])
    rows = case["rows"].clone()
    for t, n in enumerate(counts):
        pick = (value_table == t) & (torch.rand(rows.numel()) < 0.4)
        if n:
            rows[pick] = -2 - torch.randint(0, n, (int(pick.sum()),))
    case["rows"] = rows
    assert bool((rows <= -2).any())
    got = ops.pooled_lookup(**case)
    torch.testing.assert_close(got, ref.pooled_lookup(**case))
    # Independently: the same as a plain lookup in tables that hold those vectors after their rows.
    blocks, starts, moved = [], [], rows.clone()
    for t, cap in enumerate([11, 5, 9]):
        base, dim = int(case["table_offsets"][t]), int(case["table_dims"][t])
        starts.append(sum(b.numel() for b in blocks))
        blocks.append(torch.cat([case["weights"][base : base + cap * dim], case["new_vectors"][t].flatten()]))
        virtual = (value_table == t) & (rows <= -2)
        moved[virtual] = cap + (-2 - rows[virtual])
    plain = dict(case, weights=torch.cat(blocks), table_offsets=torch.tensor(starts), rows=moved, new_vectors=())
    torch.testing.assert_close(got, ops.pooled_lookup(**plain))


def test_sequence_lookup_reads_new_rows_from_new_vectors():
    caps, dim = [6, 9], 8
    table_offsets, table_dims, total, _ = _layout(caps, [dim, dim])
    weights = torch.randn(total)
    feature_table, fvo = torch.tensor([1, 0, 1]), torch.tensor([0, 4, 4, 11])
    rows = (torch.rand(11) * 9).long()
    rows[[1, 5, 9]] = torch.tensor([-2, -3, -2])
    rows[2] = -1
    new_vectors = _new_vectors(table_dims, [0, 2])
    got = ops.sequence_lookup(weights, table_offsets, dim, feature_table, fvo, rows, new_vectors)
    assert torch.equal(got, ref.sequence_lookup(weights, table_offsets, dim, feature_table, fvo, rows, new_vectors))
    assert torch.equal(got[1], new_vectors[1][0]) and torch.equal(got[5], new_vectors[1][1])


@pytest.mark.parametrize("optimizer", list(ref.OPTIMIZERS))
@pytest.mark.parametrize("pooled", [True, False])
def test_fused_update_writes_new_rows_then_steps(optimizer, pooled):
    grad, weights, states, common = _update_case(optimizer, pooled)
    unique_rows, unique_table, dims = common["unique_rows"], common["unique_table"], common["table_dims"]
    # Every other unique row with a row is new; each table numbers its new rows from 0.
    unique_new = torch.full_like(unique_rows, -1)
    counts = [0] * dims.numel()
    for u in range(0, unique_rows.numel(), 2):
        if unique_rows[u] >= 0:
            t = int(unique_table[u])
            unique_new[u], counts[t] = counts[t], counts[t] + 1
    new_vectors = _new_vectors(dims, counts)
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


def test_new_rows_bad_input_is_a_clear_error():
    case = _pooled_case(False)
    with pytest.raises(RuntimeError, match="out of range"):  # -2 without new_vectors
        ops.pooled_lookup(**dict(case, rows=torch.where(case["rows"] == 0, -2, case["rows"])))
    vectors = _new_vectors(case["table_dims"], [1, 1, 1])
    with pytest.raises(RuntimeError, match="out of range"):  # vector 1 of a 1-vector block
        ops.pooled_lookup(**dict(case, rows=torch.full_like(case["rows"], -3), new_vectors=vectors))
    with pytest.raises(RuntimeError, match="one block per table"):
        ops.pooled_lookup(**dict(case, new_vectors=vectors[:2]))
    with pytest.raises(RuntimeError, match=r"new_vectors\[1\] must be a contiguous float32 \[n, 12\]"):
        ops.pooled_lookup(**dict(case, new_vectors=[vectors[0], torch.zeros(1, 4), vectors[2]]))
    grad, weights, states, common = _update_case("adagrad", True)
    unique_new = torch.full_like(common["unique_rows"], -1)
    with pytest.raises(RuntimeError, match="unique_new needs new_vectors"):
        ops.fused_update(grad, weights, states, optimizer=1, step=1, **common, unique_new=unique_new, state_init=[0.0])
    vectors = _new_vectors(common["table_dims"], [1, 1, 1])
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


# ------------------------------------------------ torch kernels (the CUDA implementations), run on CPU here


def test_torch_dedup_segments_matches_reference():
    from torchrec_ext import torch_kernels

    ids = torch.cat([torch.randint(-5, 5, (60,)), torch.tensor(EXTREME_IDS * 2), torch.randint(-(2**62), 2**62, (30,))])
    for segments in (torch.tensor([0, 0, 20, 20, 75, ids.numel()]), torch.tensor([0, ids.numel()])):
        for got, want in zip(torch_kernels.dedup_segments(ids, segments), ref.dedup_segments(ids, segments)):
            assert torch.equal(got, want)
    empty = torch.zeros(0, dtype=torch.int64)
    for got, want in zip(
        torch_kernels.dedup_segments(empty, torch.tensor([0, 0])), ops.dedup_segments(empty, torch.tensor([0, 0]))
    ):
        assert torch.equal(got, want)


def test_torch_init_rows_matches_cpu_kernel():
    from torchrec_ext import torch_kernels

    ids = torch.tensor(EXTREME_IDS + list(range(7)))
    rows = torch.randperm(20)[: ids.numel()]
    rows[1] = -1
    for kind, params in (("uniform", (-1.0, 1.0)), ("truncated_normal", (0.0, 1.0, -0.3, 0.6))):
        a, b = torch.zeros(20, 9), torch.zeros(20, 9)
        sa, sb = torch.ones(20, 9), torch.ones(20, 9)
        ops.init_rows(a, rows, ids, 11, ref.INITIALIZERS[kind], params, [sa], [0.25])
        torch_kernels.init_rows(b, rows, ids, 11, ref.INITIALIZERS[kind], params, [sb], [0.25])
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        assert torch.equal(sa, sb)
