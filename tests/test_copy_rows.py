"""``ops.copy_rows`` (csrc/copy_rows_cpu.cpp): whole-row copies between a tiered table's cache
and backing store, against torch's ``index_select`` / ``index_copy_`` as the oracle; bad input
refused before any row is written. ``ops.guarded_copy_rows`` (the same copy through a file's
mapping, a SIGBUS an error: tests/test_tier_sigbus.py) and ``ops.pread_rows`` (the same rows read
from the file behind the mapping) alike."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

from torchrec_ext import ops, torch_kernels


def _guarded(dst, dst_rows, src, src_rows=None):
    assert ops.guarded_copy_rows(dst, dst_rows, src, src_rows) == 0


def _pread(dst, dst_rows, src, src_rows=None):
    """ops.pread_rows from a file holding src's bytes (src's storage from its first element on)."""
    whole = torch.empty(0, dtype=torch.uint8).set_(src.untyped_storage())
    with tempfile.NamedTemporaryFile() as f:
        f.write(whole[src.storage_offset() * src.element_size() :].numpy().tobytes())
        f.flush()
        assert ops.pread_rows(dst, dst_rows, src, src_rows, f.fileno(), 0) == (-1, 0)


COPIES = pytest.mark.parametrize(
    "copy", [ops.copy_rows, _guarded, _pread], ids=["copy_rows", "guarded_copy_rows", "pread_rows"]
)


def _oracle(dst, dst_rows, src, src_rows):
    out = dst.clone()
    torch_kernels.copy_rows(out, dst_rows, src, src_rows)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.uint8])
@pytest.mark.parametrize("shape", [(300,), (300, 1), (300, 64), (300, 7)])
@COPIES
def test_copy_rows_matches_index_select_and_index_copy(copy, dtype, shape):
    g = torch.Generator().manual_seed(0)
    dst = (torch.rand(shape, generator=g) * 100).to(dtype)
    src = (torch.rand((500,) + shape[1:], generator=g) * 100).to(dtype)
    n = 120
    dst_rows = torch.randperm(shape[0], generator=g)[:n]
    src_rows = torch.randint(0, 500, (n,), generator=g)  # (repeated source rows are fine)
    for d, s in ((dst_rows, src_rows), (dst_rows, None), (None, src_rows)):
        want = _oracle(dst, d, src if s is not None else src[:n], s)
        got = dst.clone()
        copy(got, d, src if s is not None else src[:n], s)
        assert torch.equal(got, want)


@COPIES
def test_copy_rows_between_fields_of_records(copy):
    """Rows strided as a records buffer's fields are (tier_copies.field_view): into and out of them."""
    g = torch.Generator().manual_seed(1)
    records = torch.zeros(50, 8 + 256 + 16, dtype=torch.uint8)
    field = records[:, 8 : 8 + 256].view(torch.float32)  # [50, 64], rows 280 bytes apart
    cache = torch.randn(400, 64, generator=g)
    slots = torch.randperm(400, generator=g)[:50]
    copy(field, None, cache, slots)
    assert torch.equal(field, cache.index_select(0, slots))
    assert not records[:, :8].any() and not records[:, 8 + 256 :].any()  # nothing outside the field
    back = torch.zeros(400, 64)
    copy(back, slots, field)
    assert torch.equal(back.index_select(0, slots), cache.index_select(0, slots))
    assert back.abs().sum(1).ne(0).sum() == 50


def _refused(copy, match, dst, *args):
    before = dst.clone()
    with pytest.raises(RuntimeError, match=match):
        copy(dst, *args)
    assert torch.equal(dst, before)  # checked before any row is written


@COPIES
def test_bad_rows_are_refused_before_any_row_is_written(copy):
    dst, src = torch.zeros(10, 4), torch.ones(10, 4)
    _refused(
        copy, r"dst_rows\[2\] = 10 is out of range: the tensor has 10 rows", dst, torch.tensor([0, 1, 10]), src, None
    )
    _refused(copy, r"src_rows\[1\] = -1 is out of range", dst, torch.tensor([0, 1]), src, torch.tensor([3, -1]))
    _refused(copy, r"dst_rows must be a contiguous CPU int64", dst, torch.tensor([0, 1], dtype=torch.int32), src, None)
    _refused(
        copy,
        r"dst_rows and src_rows must have one length, got 2 and 3",
        dst,
        torch.tensor([0, 1]),
        src,
        torch.tensor([0, 1, 2]),
    )
    _refused(copy, r"12 rows to copy, dst has 10", dst, None, torch.ones(12, 4), None)


@COPIES
def test_mismatched_tensors_are_refused(copy):
    dst = torch.zeros(10, 4)
    _refused(copy, "one dtype", dst, None, torch.ones(10, 4, dtype=torch.float64), None)
    _refused(copy, "rows must be the same size", dst, None, torch.ones(10, 5), None)
    _refused(copy, "elements of each row of src must be contiguous", dst, None, torch.ones(4, 10).t(), None)
    _refused(copy, "1-D or 2-D", dst, None, torch.ones(10, 2, 2), None)
    _refused(copy, "must not share memory", dst, torch.tensor([1]), dst, torch.tensor([0]))


def test_pread_rows_reads_up_to_where_a_cut_file_ends_and_names_that_offset():
    src = torch.arange(40 * 6, dtype=torch.float32).view(40, 6)
    with tempfile.NamedTemporaryFile() as f:
        f.write(src.numpy().tobytes())
        f.flush()
        os.truncate(f.name, 24 * 10 + 8)  # rows 0-9 whole, row 10 in part
        dst = torch.full((3, 6), -1.0)
        assert ops.pread_rows(dst, None, src, torch.tensor([4, 9, 10]), f.fileno(), 0) == (24 * 10 + 8, 0)
        assert torch.equal(dst[:2], src[[4, 9]])  # the rows before the cut
        assert ops.pread_rows(dst, None, src, torch.tensor([0]), 1 << 20, 0)[1] == 9  # EBADF: a closed descriptor


def test_pread_rows_reads_runs_of_rows_in_one_call_each_as_a_copy_does():
    src = torch.randn(64, 5)
    runs = torch.cat([torch.arange(3, 20), torch.arange(40, 41), torch.arange(50, 64)])  # 3 runs
    for dst_rows in (None, torch.arange(runs.numel()).flip(0), torch.arange(runs.numel())):
        dst, want = torch.zeros(runs.numel(), 5), torch.zeros(runs.numel(), 5)
        _pread(dst, dst_rows, src, runs)
        ops.copy_rows(want, dst_rows, src, runs)
        assert torch.equal(dst, want)
    whole = torch.zeros(64, 5)
    _pread(whole, None, src, None)  # every row: one read
    assert torch.equal(whole, src)


@pytest.mark.parametrize(
    "dst, dst_rows, src, src_rows",
    [
        (torch.zeros(12, 5), torch.tensor([2, 7]), torch.randn(12, 5), None),  # src holds more rows than n
        (torch.zeros(4, 5), None, torch.randn(12, 5), torch.tensor([3, 0, 11, 3])),
        (torch.zeros(12), torch.tensor([1, 4]), torch.arange(12.0), torch.tensor([5, 6])),
        (torch.zeros(6, 3), None, torch.randn(4, 3), None),
    ],
)
def test_the_gpu_kernel_of_copy_rows_keeps_the_ops_contract(dst, dst_rows, src, src_rows):
    """torch_kernels.copy_rows (the op's CUDA kernel), run on CPU tensors, copies what the C++
    kernel copies: without src_rows, rows 0 .. n-1 of a src that may hold more."""
    want, got = dst.clone(), dst.clone()
    ops.copy_rows(want, dst_rows, src, src_rows)
    torch_kernels.copy_rows(got, dst_rows, src, src_rows)
    assert torch.equal(got, want)
