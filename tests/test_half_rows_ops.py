"""Half-precision rows in the C++ CPU embedding kernels (csrc/half_rows.h, row_storage.h): float16 and
bfloat16 tables, alone and mixed with float32 ones in one call, against the pure-PyTorch
references (torchrec_ext/reference/) and against torch's own conversions; stochastic rounding
bit for bit, unbiased and deterministic.

Layout: one buffer of 4-byte words, each table's rows packed in its storage dtype from word
table_offsets[t] (reference.table_words words); element-wise optimizer state float32, the tables
back to back.
"""

import math

import pytest
import torch

from torchrec_ext import ops
from torchrec_ext import reference as ref

HALF = [torch.float16, torch.bfloat16]
DTYPE_SETS = {  # (cap, dim) per table, with its dtype; odd dims make spans end mid-word
    "fp16": [torch.float16] * 3,
    "bf16": [torch.bfloat16] * 3,
    "mixed": [torch.float16, torch.float32, torch.bfloat16],
}
CAPS, DIMS = [11, 5, 9], [5, 12, 8]


def _layout(caps, dims, dtypes, gen):
    """(weights, table_offsets, table_dims, table_dtypes, views): random rows in each table's dtype."""
    offsets, total = [], 0
    for cap, dim, dtype in zip(caps, dims, dtypes):
        offsets.append(total)
        total += ref.table_words(cap, dim, dtype)
    weights = torch.zeros(total)
    table_offsets, table_dims = torch.tensor(offsets), torch.tensor(dims)
    table_dtypes = torch.tensor([ref.dtype_code(d) for d in dtypes])
    views = ref._table_rows(weights, table_offsets, table_dims, caps, dtypes)
    for view in views:
        view.copy_(torch.randn(view.shape, generator=gen))
    return weights, table_offsets, table_dims, table_dtypes, views


def _as_float32(caps, dims, views):
    """The same tables in an all-float32 buffer (half values convert exactly)."""
    weights = torch.cat([v.float().flatten() for v in views])
    offsets = torch.tensor([0] + [c * d for c, d in zip(caps, dims)][:-1]).cumsum(0)
    return weights, offsets


def _pooled_case(dtypes, weighted, gen, batch_size=6):
    weights, table_offsets, table_dims, table_dtypes, views = _layout(CAPS, DIMS, dtypes, gen)
    feature_table = torch.tensor([0, 1, 2, 0])
    feature_dims = table_dims[feature_table]
    feature_col = torch.cat([torch.zeros(1, dtype=torch.int64), feature_dims.cumsum(0)[:-1]])
    lengths = torch.randint(0, 5, (4 * batch_size,), generator=gen)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    n = int(offsets[-1])
    value_table = feature_table.repeat_interleave(batch_size).repeat_interleave(lengths)
    rows = (torch.rand(n, generator=gen) * torch.tensor(CAPS)[value_table]).long()
    rows[torch.rand(n, generator=gen) < 0.15] = -1
    case = dict(
        weights=weights,
        table_offsets=table_offsets,
        table_dims=table_dims,
        feature_table=feature_table,
        feature_col=feature_col,
        feature_mean=torch.tensor([False, True, False, True]),
        rows=rows,
        offsets=offsets,
        per_sample_weights=torch.rand(n, generator=gen) if weighted else None,
        batch_size=batch_size,
        total_dim=int(feature_dims.sum()),
        table_dtypes=table_dtypes,
    )
    return case, views, value_table


# ---------------------------------------------------------------------------- lookups


@pytest.mark.parametrize("name", list(DTYPE_SETS))
@pytest.mark.parametrize("weighted", [False, True])
def test_pooled_lookup_half_tables(name, weighted):
    gen = torch.Generator().manual_seed(1)
    case, views, _ = _pooled_case(DTYPE_SETS[name], weighted, gen)
    got = ops.pooled_lookup(**case)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ref.pooled_lookup(**case))
    # Independently: the rows converted to float32 first (exact), looked up by the float32 path.
    weights, offsets = _as_float32(CAPS, DIMS, views)
    plain = dict(case, weights=weights, table_offsets=offsets, table_dtypes=None)
    assert torch.equal(got, ops.pooled_lookup(**plain))


@pytest.mark.parametrize("name", list(DTYPE_SETS))
def test_sequence_lookup_half_tables(name):
    gen = torch.Generator().manual_seed(2)
    dtypes = DTYPE_SETS[name][:2]
    caps, dims = [6, 9], [7, 7]
    weights, table_offsets, _, table_dtypes, views = _layout(caps, dims, dtypes, gen)
    feature_table, fvo = torch.tensor([1, 0, 1]), torch.tensor([0, 4, 4, 11])
    rows = (torch.rand(11, generator=gen) * 6).long()
    rows[[2, 7]] = -1
    rows[5] = -2  # table 0's new vector 0 (feature 2 reads table 1: rows 4..10)
    new_vectors = [torch.randn(1, 7, generator=gen).to(dtypes[0]), torch.randn(1, 7, generator=gen).to(dtypes[1])]
    got = ops.sequence_lookup(weights, table_offsets, 7, feature_table, fvo, rows, new_vectors, table_dtypes)
    want = ref.sequence_lookup(weights, table_offsets, 7, feature_table, fvo, rows, new_vectors, table_dtypes)
    assert torch.equal(got, want)
    assert torch.equal(got[0], views[1][rows[0]].float()) and torch.equal(got[5], new_vectors[1][0].float())
    assert torch.equal(got[2], torch.zeros(7))


@pytest.mark.parametrize("dtype", HALF)
def test_pooled_lookup_reads_half_new_vectors(dtype):
    gen = torch.Generator().manual_seed(3)
    case, views, value_table = _pooled_case([dtype, torch.float32, dtype], False, gen)
    counts = [2, 1, 3]
    case["new_vectors"] = [
        torch.randn(n, d, generator=gen).to(dt) for n, d, dt in zip(counts, DIMS, [dtype, torch.float32, dtype])
    ]
    rows = case["rows"].clone()
    for t, n in enumerate(counts):
        pick = (value_table == t) & (torch.rand(rows.numel(), generator=gen) < 0.4)
        rows[pick] = -2 - torch.randint(0, n, (int(pick.sum()),), generator=gen)
    case["rows"] = rows
    torch.testing.assert_close(ops.pooled_lookup(**case), ref.pooled_lookup(**case))


def test_init_rows_half_table_is_the_rounded_initial_vector():
    ids = torch.tensor([5, -1, 2**63 - 1, 77, 12])
    rows = torch.tensor([0, 3, -1, 6, 2])
    for dtype in HALF:
        table = torch.zeros(8, 9, dtype=dtype)
        ops.init_rows(table, rows, ids, 1234, ref.INITIALIZERS["normal"], (0.0, 0.3))
        want = ref.init_vectors(ids, 9, 1234, "normal", (0.0, 0.3)).to(dtype)
        keep = rows >= 0
        assert torch.equal(table[rows[keep]], want[keep])


# ---------------------------------------------------------------------- fused update


def _update_case(dtypes, optimizer, gen, pooled=True):
    case, views, value_table = _pooled_case(dtypes, True, gen)
    rows = case["rows"]
    if not pooled:  # a sequence lookup over tables of one dim: one gradient row per id
        dims = [8, 8, 8]
        case["weights"], case["table_offsets"], case["table_dims"], _, views = _layout(CAPS, dims, dtypes, gen)
    uniq, inverse = torch.unique(value_table * 1000 + rows + 1, return_inverse=True)
    unique_table, unique_rows = uniq // 1000, uniq % 1000 - 1
    caps = CAPS
    dims = case["table_dims"].tolist()
    num_states = len(ref.OPTIMIZER_STATES[optimizer])
    state_size = sum(caps) if optimizer in ref.ROWWISE_STATE else sum(c * d for c, d in zip(caps, dims))
    states = [
        torch.rand(state_size, generator=gen) * 0.1 + (0.01 if optimizer == "ftrl" else 0) for _ in range(num_states)
    ]
    common = dict(
        table_offsets=case["table_offsets"],
        table_dims=case["table_dims"],
        state_row_offsets=torch.tensor([0] + caps[:-1]).cumsum(0),
        unique_rows=unique_rows,
        unique_table=unique_table,
        inverse=inverse,
        hparams=(0.05, 1e-3, 0.9, 0.999, 0.01, 0.1) + ((-0.5, 0.01, 0.01, 0.1) if optimizer == "ftrl" else ()),
        table_dtypes=case["table_dtypes"],
        unique_ids=unique_rows * 7919 + unique_table * 31 - 5,
    )
    if pooled:
        grad = torch.randn(case["batch_size"], case["total_dim"], generator=gen)
        common.update(
            offsets=case["offsets"],
            per_sample_weights=case["per_sample_weights"],
            feature_col=case["feature_col"],
            feature_mean=case["feature_mean"],
            batch_size=case["batch_size"],
        )
    else:
        grad = torch.randn(rows.numel(), 8, generator=gen)
        common.update(
            offsets=None,
            per_sample_weights=None,
            feature_col=torch.zeros(0, dtype=torch.int64),
            feature_mean=torch.zeros(0, dtype=torch.bool),
            batch_size=0,
        )
    return grad, case["weights"], states, common


def _ulp_tolerance(dtypes):
    # A float32 step that differs in its last bit may round (either way) to the neighbouring value.
    return dict(rtol=1e-2 if torch.bfloat16 in dtypes else 2e-3, atol=1e-5)


@pytest.mark.parametrize("name", list(DTYPE_SETS))
@pytest.mark.parametrize("optimizer", list(ref.OPTIMIZERS))
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("pooled", [True, False], ids=["pooled", "sequence"])
def test_fused_update_half_tables_match_reference(name, optimizer, rounding, pooled):
    gen = torch.Generator().manual_seed(len(name) * 10 + list(ref.OPTIMIZERS).index(optimizer))
    grad, weights, states, common = _update_case(DTYPE_SETS[name], optimizer, gen, pooled)
    if rounding == "stochastic":
        common["rounding_seeds"] = torch.tensor([11, 22, 33])
    w_got, s_got = weights.clone(), [s.clone() for s in states]
    w_want, s_want = weights.clone(), [s.clone() for s in states]
    for step in (1, 2, 3):
        ops.fused_update(grad, w_got, s_got, optimizer=ref.OPTIMIZERS[optimizer], step=step, **common)
        ref.fused_update(grad, w_want, s_want, optimizer=optimizer, step=step, **common)
    caps, dtypes = CAPS, DTYPE_SETS[name]
    got = ref._table_rows(w_got, common["table_offsets"], common["table_dims"], caps, dtypes)
    want = ref._table_rows(w_want, common["table_offsets"], common["table_dims"], caps, dtypes)
    for a, b, dtype in zip(got, want, dtypes):
        assert a.dtype == dtype
        torch.testing.assert_close(a.float(), b.float(), **_ulp_tolerance(dtypes))
        if dtype != torch.float32:  # nearly all bit for bit: only a float32 last-bit difference flips one
            assert (a.float() == b.float()).float().mean() > 0.97
    for a, b in zip(s_got, s_want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert not torch.equal(w_got, weights)


def _sgd_lr1_update(grad, weights, table_offsets, table_dims, unique_rows, unique_table, step, **kwargs):
    """ops.fused_update as SGD with lr 1 after a sequence lookup of one id per unique row: each row
    takes row - its grad row (exact in float32), then is stored in its table's dtype."""
    n = unique_rows.numel()
    ops.fused_update(
        grad,
        weights,
        [],
        table_offsets,
        table_dims,
        torch.zeros(table_offsets.numel(), dtype=torch.int64),
        unique_rows,
        unique_table,
        torch.arange(n),
        None,
        None,
        torch.zeros(0, dtype=torch.int64),
        torch.zeros(0, dtype=torch.bool),
        0,
        ref.OPTIMIZERS["sgd"],
        (1.0, 0, 0, 0, 0, 0),
        step,
        **kwargs,
    )


def _stochastic_case(x, dtype, ids, seed, step):
    """Rows of zeros stepped by SGD with lr 1 and gradient -x: the kernel stores exactly round(x)."""
    n, dim = ids.numel(), x.numel()
    weights = torch.zeros(ref.table_words(n, dim, dtype))
    _sgd_lr1_update(
        -x.expand(n, dim).contiguous(),
        weights,
        torch.tensor([0]),
        torch.tensor([dim]),
        torch.arange(n),
        torch.zeros(n, dtype=torch.int64),
        step,
        table_dtypes=torch.tensor([ref.dtype_code(dtype)]),
        unique_ids=ids,
        rounding_seeds=None if seed is None else torch.tensor([seed]),
    )
    return weights.view(dtype)[: n * dim].view(n, dim)


VALUES = torch.tensor(
    [
        1.0,
        1.0 + 2**-12,
        -3.3,
        0.1,
        -7.77e-4,
        6.1e-5,
        -1e-5,
        3.1e-6,
        -2e-7,
        4e-8,
        -1e-8,
        3e-10,
        65500.0,
        -65519.0,
        65510.0,
        70000.0,
        1e30,
        3.3892e38,
        -3.3895e38,
        0.0,
        2.0**-24,
        float("inf"),
    ]
)  # (-0.0: 0 - (-0.0) is +0.0)


@pytest.mark.parametrize("dtype", HALF)
def test_round_to_nearest_when_disabled_equals_torch(dtype):
    got = _stochastic_case(VALUES, dtype, torch.arange(4), None, 1)
    assert torch.equal(got, VALUES.to(dtype).expand(4, -1))
    assert torch.equal(ref.round_to_storage(VALUES, dtype), VALUES.to(dtype))


@pytest.mark.parametrize("dtype", HALF)
def test_stochastic_rounding_is_the_reference_bit_for_bit(dtype):
    ids = torch.tensor([0, -1, 2**63 - 1, -(2**63), 12345] + list(range(200)))
    for step in (1, 7):
        got = _stochastic_case(VALUES, dtype, ids, 99, step)
        want = ref.round_to_storage(
            VALUES.expand(ids.numel(), -1), dtype, ref.rounding_bits(ids, VALUES.numel(), 99, step)
        )
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("dim", [1, 7, 15, 16, 17, 33, 64])
def test_stochastic_rounding_is_the_reference_at_every_row_width(dtype, dim):
    """Rows of every width (the vector loops' whole blocks and tails, 8 and 16 wide), values of
    every magnitude (normal, subnormal, below 2^-24, near the largest finite value) and the
    specials: the reference's bits; NaN stays NaN (its payload is not specified)."""
    gen = torch.Generator().manual_seed(dim)
    n = 48
    x = torch.randn(n, dim, generator=gen) * 10.0 ** torch.randint(-10, 6, (n, dim), generator=gen).float()
    specials = torch.tensor([float("inf"), -float("inf"), float("nan"), 65519.0, -(2.0**-25), 2.0**-24, 0.0])
    x.view(-1)[torch.randperm(n * dim, generator=gen)[:n]] = specials[torch.randint(0, 7, (n,), generator=gen)]
    ids = torch.arange(n) * 101 - 7
    weights = torch.zeros(ref.table_words(n, dim, dtype))
    ops.fused_update(
        -x,
        weights,
        [],
        torch.tensor([0]),
        torch.tensor([dim]),
        torch.tensor([0]),  # SGD, lr 1, from 0: x
        torch.arange(n),
        torch.zeros(n, dtype=torch.int64),
        torch.arange(n),
        None,
        None,
        torch.zeros(0, dtype=torch.int64),
        torch.zeros(0, dtype=torch.bool),
        0,
        ref.OPTIMIZERS["sgd"],
        (1.0, 0, 0, 0, 0, 0),
        4,
        table_dtypes=torch.tensor([ref.dtype_code(dtype)]),
        unique_ids=ids,
        rounding_seeds=torch.tensor([77]),
    )
    got = weights.view(dtype)[: n * dim].view(n, dim)
    want = ref.round_to_storage(x, dtype, ref.rounding_bits(ids, dim, 77, 4))
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan) and int(nan.sum()) > 0
    assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))


def _float16_truncation_of_the_noisy_sum(x: float, r: int) -> float:
    """The float16 stochastic-rounding definition, in exact rational arithmetic: |x| + r * g / 2^16
    (g the float16 grid spacing at |x|) truncated to the float16 grid, the sign kept; past 65504
    the largest finite value below the overflow boundary (65520), inf from it."""
    from fractions import Fraction

    def spacing(v):  # the float16 grid spacing at v >= 0
        return Fraction(2) ** -24 if v < 2**-14 else Fraction(2) ** (math.frexp(v)[1] - 11)

    ax = abs(x)
    y = Fraction(ax) + Fraction(r, 65536) * spacing(ax)
    if y >= 65536:
        t = 65504.0 if ax < 65520 else math.inf
    else:
        t = float(math.floor(y / spacing(float(y))) * spacing(float(y)))
    return math.copysign(t, x)


def test_float16_stochastic_rounding_is_the_truncated_noisy_sum():
    """The reference (which the C++ and Triton kernels match bit for bit) against its definition
    computed independently, at every magnitude: normal, float16-subnormal, below 2^-24 (where
    |x| + r * 2^-40 >= 2^-24 picks 2^-24), float32-subnormal, near and past the largest value."""
    gen = torch.Generator().manual_seed(15)
    n = 1500
    x = torch.randn(n, generator=gen) * 2.0 ** torch.randint(-40, 18, (n,), generator=gen).float()
    edges = [0.0, -0.0, 2.0**-24, 2.0**-25, 2.0**-14, 2.0**-14 - 2.0**-38, 1e-44, 65504.0, 65519.0, 65520.0, 65535.0]
    x = torch.cat([x, torch.tensor(edges)]).float()
    bits = torch.randint(0, 65536, (x.numel(),), generator=gen)
    bits[-len(edges) :] = torch.tensor([65535, 0, 1, 32768, 65535, 65535, 65535, 65535, 65535, 1, 0])
    got = ref.round_to_storage(x.unsqueeze(0), torch.float16, bits.unsqueeze(0))[0].double().tolist()
    want = [_float16_truncation_of_the_noisy_sum(float(v), int(r)) for v, r in zip(x.tolist(), bits.tolist())]
    assert got == want, [(float(v), a, b) for v, a, b in zip(x.tolist(), got, want) if a != b][:5]


@pytest.mark.parametrize("dtype", HALF)
def test_stochastic_rounding_is_unbiased_and_picks_a_neighbour(dtype):
    n = 40000
    x = VALUES[:12]  # finite, in range: normal, float16-subnormal and tiny values
    got = _stochastic_case(x, dtype, torch.arange(n) * 3 + 1, 2024, 5).double()
    # Each result is one of the two neighbours of x in the dtype.
    nearest = x.to(dtype).double()
    ulp = (
        torch.where(x.abs() < 2.0**-14, torch.full_like(x, 2.0**-24), x.abs() * 2.0**-10).double()
        if dtype == torch.float16
        else (x.abs() * 2.0**-7).double()
    )
    assert bool(((got - x.double()).abs() <= ulp * 1.01).all())
    assert bool(((got == nearest) | ((got - nearest).abs() <= ulp * 1.01)).all())
    # Unbiased: the mean of n independent roundings is x within 5 standard errors (p * (1 - p)
    # <= 1/4 of the gap squared); fixed seeds, so the check is deterministic, never flaky.
    gap = ulp
    assert bool(((got.mean(0) - x.double()).abs() <= 5 * gap * 0.5 / n**0.5).all()), got.mean(0) - x.double()
    # Round to nearest, by contrast, is biased on these values: its error is far larger on average.
    assert float((got.mean(0) - x.double()).abs().mean()) < float((nearest - x.double()).abs().mean()) / 4


@pytest.mark.parametrize("dtype", HALF)
def test_stochastic_rounding_stays_finite_where_round_to_nearest_does(dtype):
    """Just below the largest finite value's rounding boundary, round to nearest gives the largest
    finite value; stochastic rounding must not round up to inf there (it has no finite neighbour
    above): every result is finite and one of the two grid values around x."""
    top = torch.finfo(dtype).max
    x = torch.tensor([top * (1 + 2.0**-12), -top * (1 + 2.0**-11), top * (1 + 2.0**-9 - 2.0**-20)])
    if dtype == torch.float16:
        x = torch.tensor([65505.0, -65510.0, 65519.9])
    assert bool(x.to(dtype).isfinite().all())  # the premise: round to nearest keeps them finite
    got = _stochastic_case(x, dtype, torch.arange(4000), 7, 3).float()
    assert bool(got.isfinite().all())
    assert bool((got.abs() == top).all())  # the neighbour below; the one above would be inf
    beyond = torch.tensor([65520.0 if dtype == torch.float16 else 3.397e38])
    above = _stochastic_case(beyond, dtype, torch.arange(64), 7, 3).float()  # where round to nearest gives inf
    assert bool(above.isinf().any()) and bool(((above == top) | above.isinf()).all())


@pytest.mark.parametrize("dtype", HALF)
def test_stochastic_rounding_is_deterministic_per_seed_step_and_id(dtype):
    x = torch.full((64,), 0.1234567)
    ids = torch.arange(50)
    a = _stochastic_case(x, dtype, ids, 5, 3)
    assert torch.equal(a, _stochastic_case(x, dtype, ids, 5, 3))  # same seed, step: same bits
    assert not torch.equal(a, _stochastic_case(x, dtype, ids, 5, 4))  # another step
    assert not torch.equal(a, _stochastic_case(x, dtype, ids, 6, 3))  # another seed
    # a row's bits depend on its id, not on its position in the call
    assert torch.equal(a.flip(0), _stochastic_case(x, dtype, ids.flip(0), 5, 3))


def test_new_rows_of_half_tables_take_their_step_rounded():
    gen = torch.Generator().manual_seed(8)
    dtypes = DTYPE_SETS["mixed"]
    grad, weights, states, common = _update_case(dtypes, "adam", gen)
    common["rounding_seeds"] = torch.tensor([3, 0, 4])
    unique_rows, unique_table = common["unique_rows"], common["unique_table"]
    unique_new = torch.full_like(unique_rows, -1)
    counts = [0, 0, 0]
    for u in range(0, unique_rows.numel(), 2):
        if unique_rows[u] >= 0:
            t = int(unique_table[u])
            unique_new[u], counts[t] = counts[t], counts[t] + 1
    new_vectors = [torch.randn(n, d, generator=gen).to(dt) for n, d, dt in zip(counts, DIMS, dtypes)]
    new = dict(new_vectors=new_vectors, unique_new=unique_new, state_init=[0.25, 0.5])
    w_got, s_got = weights.clone(), [s.clone() for s in states]
    w_want, s_want = weights.clone(), [s.clone() for s in states]
    ops.fused_update(grad, w_got, s_got, optimizer=ref.OPTIMIZERS["adam"], step=1, **common, **new)
    ref.fused_update(grad, w_want, s_want, optimizer="adam", step=1, **common, **new)
    for a, b in zip(
        ref._table_rows(w_got, common["table_offsets"], common["table_dims"], CAPS, dtypes),
        ref._table_rows(w_want, common["table_offsets"], common["table_dims"], CAPS, dtypes),
    ):
        torch.testing.assert_close(a.float(), b.float(), **_ulp_tolerance(dtypes))


@pytest.mark.parametrize("dtype", HALF)
def test_new_rows_store_their_stochastic_step_whatever_the_row_alignment(dtype):
    """A new row's stepped vector, stochastically rounded, is the reference's bit for bit, whether
    the kernel streams it straight into the row (rows 32-byte aligned, whole 16-value blocks) or
    through a scratch row (a table starting mid-line): tables of dims 2, 16 (at byte 4), 14 and 64
    (at a 32-byte boundary). SGD with lr 1 on new vector v and gradient g stores round(v - g)."""
    gen = torch.Generator().manual_seed(16)
    caps, dims = [1, 6, 1, 6], [2, 16, 14, 64]
    dtypes = [dtype] * 4
    weights, table_offsets, table_dims, table_dtypes, _ = _layout(caps, dims, dtypes, gen)
    assert int(table_offsets[1]) * 4 % 32 != 0 and int(table_offsets[3]) * 4 % 32 == 0
    unique_table = torch.tensor([1] * 6 + [3] * 6)
    unique_rows = torch.tensor([4, 0, 5, 2, 1, 3] * 2)
    n = unique_rows.numel()
    new_vectors = [
        torch.zeros(0, d).to(dtype) if c == 1 else torch.randn(6, d, generator=gen).to(dtype)
        for c, d in zip(caps, dims)
    ]
    unique_new = torch.tensor([0, 1, 2, 3, 4, 5] * 2)
    grad = torch.randn(n, 64, generator=gen) * 10.0 ** torch.randint(-6, 2, (n, 64), generator=gen).float()
    ids = torch.arange(n) * 7919 - 3
    _sgd_lr1_update(
        grad,
        weights,
        table_offsets,
        table_dims,
        unique_rows,
        unique_table,
        5,
        new_vectors=new_vectors,
        unique_new=unique_new,
        state_init=[],
        table_dtypes=table_dtypes,
        unique_ids=ids,
        rounding_seeds=torch.tensor([0, 41, 0, 43]),
    )
    tables = ref._table_rows(weights, table_offsets, table_dims, caps, dtypes)
    for t, seed, span in ((1, 41, slice(0, 6)), (3, 43, slice(6, 12))):
        d = dims[t]
        stepped = new_vectors[t][unique_new[span]].float() - grad[span, :d]
        want = ref.round_to_storage(stepped, dtype, ref.rounding_bits(ids[span], d, seed, 5))
        got = tables[t][unique_rows[span]]
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("dim", [7, 16, 33])
def test_round_to_nearest_is_torchs_at_every_row_width(dtype, dim):
    """Stochastic rounding off: rows of whole 16-value blocks and tails, values of every magnitude
    and the specials (inf, NaN, ties) are torch's .to(dtype) (NaN stays NaN)."""
    gen = torch.Generator().manual_seed(dim)
    n = 24
    x = torch.randn(n, dim, generator=gen) * 10.0 ** torch.randint(-10, 6, (n, dim), generator=gen).float()
    specials = torch.tensor([float("inf"), -float("inf"), float("nan"), 65519.0, 1.0 + 2**-11, 1.0 + 2**-8, 3.3895e38])
    x.view(-1)[torch.randperm(n * dim, generator=gen)[:n]] = specials[torch.randint(0, 7, (n,), generator=gen)]
    got = torch.stack([_stochastic_case(row, dtype, torch.arange(1), None, 1)[0] for row in x])
    want = x.to(dtype)
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan) and int(nan.sum()) > 0
    assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))


# ------------------------------------------------------------------------- bad input


def test_bad_dtype_layout_is_a_clear_error():
    gen = torch.Generator().manual_seed(9)
    case, _, _ = _pooled_case(DTYPE_SETS["mixed"], False, gen)
    with pytest.raises(RuntimeError, match=r"table_dtypes\[1\] = 3 is not a storage dtype"):
        ops.pooled_lookup(**dict(case, table_dtypes=torch.tensor([1, 3, 2])))
    with pytest.raises(RuntimeError, match="not the words of a whole number of rows"):  # a span one word too long
        ops.pooled_lookup(**dict(case, table_offsets=case["table_offsets"] + torch.tensor([0, 1, 1])))
    with pytest.raises(RuntimeError, match=r"new_vectors\[0\] must be a contiguous float16"):
        ops.pooled_lookup(**dict(case, new_vectors=[torch.zeros(1, 5), torch.zeros(1, 12), torch.zeros(1, 8)]))
    grad, weights, states, common = _update_case(DTYPE_SETS["mixed"], "sgd", gen)
    common["rounding_seeds"], common["unique_ids"] = torch.tensor([1, 1, 1]), None
    before = weights.clone()
    with pytest.raises(RuntimeError, match="needs unique_ids"):
        ops.fused_update(grad, weights, states, optimizer=0, step=1, **common)
    assert torch.equal(weights, before)


@pytest.mark.parametrize("switch", ["TORCHREC_EXT_NO_AVX512", "TORCHREC_EXT_NO_F16C"])
def test_portable_conversions_give_the_hardware_bits(switch):
    """The AVX-512, F16C and portable float16 paths: this file's half-row tests again with
    TORCHREC_EXT_NO_AVX512=1 (F16C) and TORCHREC_EXT_NO_F16C=1 (portable), in a child process
    (the choice is made when the library loads)."""
    import os
    import subprocess
    import sys

    if os.environ.get("TORCHREC_EXT_NO_F16C") or os.environ.get("TORCHREC_EXT_NO_AVX512"):
        pytest.skip("this is the child run")
    here = os.path.abspath(__file__)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-x",
            "-p",
            "no:cacheprovider",
            here,
            "-k",
            "half or stochastic or nearest",
        ],
        cwd=os.path.dirname(os.path.dirname(here)),
        env=dict(os.environ, **{switch: "1"}),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0 and " passed" in proc.stdout, proc.stdout[-4000:]
