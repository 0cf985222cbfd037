"""pooled_lookup and sequence_lookup (C++ CPU kernels) against the reference
``reference/embedding_lookup.py``, pending rows included."""

import pytest
import torch

from embedding_ops_helpers import (
    layout_of,
    pooled_case,
    random_new_vectors,
)
from torchrec_ext import ops
from torchrec_ext import reference as ref


@pytest.mark.parametrize("weighted", [False, True])
def test_pooled_lookup_matches_reference(weighted):
    case = pooled_case(weighted)
    got = ops.pooled_lookup(**case)
    torch.testing.assert_close(got, ref.pooled_lookup(**case))


def test_pooled_lookup_empty_batch():
    case = pooled_case(False, batch_size=0)
    assert ops.pooled_lookup(**case).shape == (0, case["total_dim"])


def test_pooled_lookup_rejects_rows_out_of_range():
    case = pooled_case(False)
    case["rows"] = case["rows"].clone()
    case["rows"][0] = 10**6
    with pytest.raises(RuntimeError, match="out of range"):
        ops.pooled_lookup(**case)


def test_sequence_lookup_matches_reference():
    caps, dim = [6, 9], 8
    table_offsets, _, total, _ = layout_of(caps, [dim, dim])
    weights = torch.randn(total)
    feature_table = torch.tensor([1, 0, 1])
    fvo = torch.tensor([0, 4, 4, 11])
    value_caps = torch.tensor([9] * 4 + [9] * 7)
    rows = (torch.rand(11) * value_caps).long()
    rows[2] = -1
    got = ops.sequence_lookup(weights, table_offsets, dim, feature_table, fvo, rows)
    assert torch.equal(got, ref.sequence_lookup(weights, table_offsets, dim, feature_table, fvo, rows))


@pytest.mark.parametrize("weighted", [False, True])
def test_pooled_lookup_reads_new_rows_fromrandom_new_vectors(weighted):
    case = pooled_case(weighted)
    counts = [3, 0, 2]
    case["new_vectors"] = random_new_vectors(case["table_dims"], counts)
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


def test_sequence_lookup_reads_new_rows_fromrandom_new_vectors():
    caps, dim = [6, 9], 8
    table_offsets, table_dims, total, _ = layout_of(caps, [dim, dim])
    weights = torch.randn(total)
    feature_table, fvo = torch.tensor([1, 0, 1]), torch.tensor([0, 4, 4, 11])
    rows = (torch.rand(11) * 9).long()
    rows[[1, 5, 9]] = torch.tensor([-2, -3, -2])
    rows[2] = -1
    new_vectors = random_new_vectors(table_dims, [0, 2])
    got = ops.sequence_lookup(weights, table_offsets, dim, feature_table, fvo, rows, new_vectors)
    assert torch.equal(got, ref.sequence_lookup(weights, table_offsets, dim, feature_table, fvo, rows, new_vectors))
    assert torch.equal(got[1], new_vectors[1][0]) and torch.equal(got[5], new_vectors[1][1])


def test_pending_rows_bad_input_is_a_clear_error():
    case = pooled_case(False)
    with pytest.raises(RuntimeError, match="out of range"):  # -2 without new_vectors
        ops.pooled_lookup(**dict(case, rows=torch.where(case["rows"] == 0, -2, case["rows"])))
    vectors = random_new_vectors(case["table_dims"], [1, 1, 1])
    with pytest.raises(RuntimeError, match="out of range"):  # vector 1 of a 1-vector block
        ops.pooled_lookup(**dict(case, rows=torch.full_like(case["rows"], -3), new_vectors=vectors))
    with pytest.raises(RuntimeError, match="one block per table"):
        ops.pooled_lookup(**dict(case, new_vectors=vectors[:2]))
    with pytest.raises(RuntimeError, match=r"new_vectors\[1\] must be a contiguous float32 \[n, 12\]"):
        ops.pooled_lookup(**dict(case, new_vectors=[vectors[0], torch.zeros(1, 4), vectors[2]]))
