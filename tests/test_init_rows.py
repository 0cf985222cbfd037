"""init_rows (C++ CPU kernel; torch kernel for CUDA, run on CPU here) against the reference
``reference/init_rows.py``."""

import pytest
import torch

from embedding_ops_helpers import EXTREME_IDS
from torchrec_ext import ops
from torchrec_ext import reference as ref


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
    table, want = torch.full((cap, dim), 7.0), torch.full((cap, dim), 7.0)
    state, want_state = torch.full((cap, 1), 3.0), torch.full((cap, 1), 3.0)
    seed = ref.table_seed(42, "table_a")
    ops.init_rows(table, rows, ids, seed, ref.INITIALIZERS[kind], params, [state], [0.5])
    ref.init_rows(want, rows, ids, seed, ref.INITIALIZERS[kind], params, [want_state], [0.5])
    torch.testing.assert_close(table, want, rtol=1e-6, atol=1e-6)  # untouched rows stay 7.0 in both
    assert torch.equal(state, want_state)
    keep = rows >= 0
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
