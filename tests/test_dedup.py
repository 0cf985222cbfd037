"""dedup_segments (C++ CPU kernel) against the reference ``reference/dedup.py``; its CUDA kernel
against the CPU kernel: tests/test_dedup_cuda_emulated.py."""

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
