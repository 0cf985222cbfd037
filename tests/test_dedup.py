"""dedup_segments (C++ CPU kernel; torch kernel for CUDA, run on CPU here) against the reference
``reference/dedup.py``."""

import pytest
import torch

from embedding_ops_helpers import EXTREME_IDS
from torchrec_ext import ops
from torchrec_ext import reference as ref


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
