"""The bloom_admit op (issue 18: the counting Bloom filter of the bloom admission): its CPU kernel
(csrc/bloom_cpu.cpp) and its CUDA kernel run under the warp emulator (csrc/bloom_cuda.cu) against
the one-key-at-a-time oracle of torchrec_ext/reference/, on random streams: duplicate cells in
a batch, saturation at 15, both counters of a byte hit by concurrent threads, tiny and unaligned
filters, the empty batch; the kernels hash as admission.bloom_cells does; bad input is refused
naming the argument, with the filter unchanged; BloomAdmission decides as the oracle does."""

import random

import pytest
import torch

from cuda_emulation.build import build, cuda_include_dir
from torchrec_ext import ops
from torchrec_ext import reference as ref
from torchrec_ext.modules import admission as adm

I64MIN, I64MAX = -(2**63), 2**63 - 1


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    if cuda_include_dir() is None:
        pytest.skip("needs the CUDA toolkit headers")
    return build(str(tmp_path_factory.mktemp("torchrec_emu")))


@pytest.fixture(params=["cpu", "emulated_cuda"])
def bloom_admit(request):
    """The op under test: the CPU kernel, or the CUDA kernel under the warp emulator."""
    if request.param == "cpu":
        return torch.ops.torchrec_ext.bloom_admit
    return request.getfixturevalue("emulated").bloom_admit


def _oracle(packed, keys, counts, pending, hash_seed, hashes, admit_after):
    return ref.bloom_admit(
        packed.tolist(),
        keys.tolist(),
        counts.tolist(),
        None if pending is None else pending.tolist(),
        hash_seed,
        hashes,
        admit_after,
    )


def _run_and_compare(op, packed, keys, counts, pending, hash_seed, hashes, admit_after, what):
    want_bytes, want_admitted = _oracle(packed, keys, counts, pending, hash_seed, hashes, admit_after)
    got = op(packed, keys, counts, pending, hash_seed, hashes, admit_after)
    assert got.dtype == torch.bool and got.tolist() == want_admitted, what
    assert packed.tolist() == want_bytes, what


@pytest.mark.parametrize("nbytes, hashes", [(1, 3), (2, 1), (64, 4), (1 << 12, 3), (1 << 12, 16)])
def test_op_matches_the_oracle_over_a_random_stream(bloom_admit, nbytes, hashes):
    rng = random.Random(nbytes * 31 + hashes)
    hash_seed = rng.randrange(I64MIN, I64MAX)
    universe = [rng.randrange(I64MIN, I64MAX) for _ in range(3 * nbytes + 40)] + [I64MIN, -1, 0, 1, I64MAX]
    packed = torch.zeros(nbytes, dtype=torch.uint8)
    for step in range(8):
        n = rng.choice([0, 1, 7, 300, 2000])
        keys = torch.tensor([rng.choice(universe) for _ in range(n)], dtype=torch.int64)  # repeats too
        counts = torch.tensor([rng.choice([0, 1, 1, 2, 3, 14, 15, 16, 1000]) for _ in range(n)], dtype=torch.int64)
        pending = None if step % 3 == 0 else torch.tensor([rng.random() < 0.7 for _ in range(n)], dtype=torch.bool)
        admit_after = rng.choice([1, 2, 3, 8, 15])
        _run_and_compare(bloom_admit, packed, keys, counts, pending, hash_seed, hashes, admit_after, f"step {step}")
    if nbytes <= 64:
        assert (packed == 0xFF).any(), "the stream never saturated a byte"


def test_kernels_hash_keys_as_bloom_cells_does(bloom_admit):
    """One key with count 1 into an empty filter raises exactly the cells admission.bloom_cells
    gives (a repeated cell twice), and those are the reference's cells."""
    geometry = adm.BloomGeometry(counters=1 << 13, hashes=7, expected_ids=100)
    for seed in (0, 11, -5, 2**63 - 1):
        keys = torch.tensor([I64MIN, -1, 0, 1, 12345, I64MAX], dtype=torch.int64)
        cells = adm.bloom_cells(keys, seed, geometry)
        hash_seed = adm.bloom_hash_seed(seed)
        for key, key_cells in zip(keys.tolist(), cells.tolist()):
            assert key_cells == ref.bloom_key_cells(key, hash_seed, geometry.counters, geometry.hashes)
            packed = torch.zeros(geometry.nbytes, dtype=torch.uint8)
            bloom_admit(
                packed, torch.tensor([key]), torch.ones(1, dtype=torch.int64), None, hash_seed, geometry.hashes, 1
            )
            want = torch.bincount(torch.tensor(key_cells), minlength=geometry.counters).to(torch.uint8)
            assert torch.equal(adm.unpack_counters(packed), want)


def test_empty_batch_and_nothing_pending_leave_the_filter_unchanged(bloom_admit):
    packed = torch.arange(16, dtype=torch.uint8) * 17
    before = packed.clone()
    empty = torch.empty(0, dtype=torch.int64)
    got = bloom_admit(packed, empty, empty, None, 3, 4, 2)
    assert got.shape == (0,) and got.dtype == torch.bool and torch.equal(packed, before)
    keys = torch.arange(50, dtype=torch.int64)
    got = bloom_admit(packed, keys, torch.full((50,), 3), torch.zeros(50, dtype=torch.bool), 3, 4, 2)
    assert not got.any() and torch.equal(packed, before)


def test_a_filter_that_is_a_view_changes_only_its_own_bytes(bloom_admit):
    """Filters of 1 and 2 bytes and ones at an odd offset of a larger buffer (not 4-byte aligned:
    the CUDA binding works on a padded copy) update exactly their bytes."""
    rng = random.Random(5)
    for offset, nbytes in ((0, 1), (1, 1), (3, 2), (1, 8), (5, 64)):
        buffer = torch.full((offset + nbytes + 9,), 0x5A, dtype=torch.uint8)
        packed = buffer[offset : offset + nbytes]
        packed.zero_()
        keys = torch.tensor([rng.randrange(I64MIN, I64MAX) for _ in range(40)], dtype=torch.int64)
        _run_and_compare(
            bloom_admit,
            packed,
            keys,
            torch.ones(40, dtype=torch.int64),
            None,
            77,
            2,
            3,
            f"offset {offset}, {nbytes} bytes",
        )
        assert (buffer[:offset] == 0x5A).all() and (buffer[offset + nbytes :] == 0x5A).all()


@pytest.mark.parametrize("threads", [2, 4])
def test_concurrent_increments_of_both_counters_of_a_byte_are_never_lost(threads):
    """Enough keys for several threads (the CPU kernel then increments by compare-and-swap) into
    a filter small enough that every byte is hit by many keys (16 on average), most counters
    below saturation: the counters must be exactly the saturated counts of hits. (With plain
    read-modify-writes instead, most runs of this test lose increments on 2 cores.)"""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        geometry = adm.BloomGeometry(counters=1 << 14, hashes=2, expected_ids=1)
        gen = torch.Generator().manual_seed(threads)
        for trial in range(10):
            keys = torch.randint(I64MIN, I64MAX, (1 << 16,), generator=gen)
            cells = adm.bloom_cells(keys, trial, geometry).flatten()
            want = torch.bincount(cells, minlength=geometry.counters).clamp(max=15).to(torch.uint8)
            packed = torch.zeros(geometry.nbytes, dtype=torch.uint8)
            ops.bloom_admit(packed, keys, torch.ones_like(keys), None, adm.bloom_hash_seed(trial), geometry.hashes, 2)
            assert torch.equal(adm.unpack_counters(packed), want), f"trial {trial}: an increment was lost"
            assert (want < 15).float().mean() > 0.9
    finally:
        torch.set_num_threads(before)


def test_large_batch_on_several_threads_matches_the_oracle():
    """A batch split over threads: increments of every thread land before any decision."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        rng = random.Random(9)
        packed = torch.zeros(1 << 10, dtype=torch.uint8)
        for step in range(3):
            keys = torch.tensor([rng.randrange(0, 30_000) for _ in range(20_000)], dtype=torch.int64)
            counts = torch.tensor([rng.choice([1, 2, 5]) for _ in range(20_000)], dtype=torch.int64)
            _run_and_compare(ops.bloom_admit, packed, keys, counts, None, -99, 3, 6, f"step {step}")
    finally:
        torch.set_num_threads(before)


def _bad_cases():
    keys, counts = torch.arange(6, dtype=torch.int64), torch.ones(6, dtype=torch.int64)
    filt = torch.zeros(8, dtype=torch.uint8)
    good = dict(counters=filt, keys=keys, counts=counts, pending=None, hash_seed=1, hashes=3, admit_after=2)
    yield dict(good, keys=keys.to(torch.int32)), r"keys must be a 1-D int64 tensor, got Int"
    yield (
        dict(good, keys=keys.view(2, 3), counts=counts.view(2, 3)),
        r"keys must be a 1-D int64 tensor, got Long of shape \[2, 3\]",
    )
    yield dict(good, counts=counts.double()), r"counts must be a 1-D int64 tensor, got Double"
    yield dict(good, counts=counts[:5]), r"counts must have one entry per key \(6\), got 5"
    yield dict(good, counts=torch.tensor([1, 1, -3, 1, 1, 1])), r"counts must be >= 0, got -3 at entry 2"
    yield (
        dict(good, pending=torch.ones(6, dtype=torch.int64)),
        r"pending must be a 1-D bool tensor with one entry per key \(6\), got Long",
    )
    yield dict(good, pending=torch.ones(4, dtype=torch.bool)), r"pending must be .* got Bool of shape \[4\]"
    yield dict(good, hashes=0), r"hashes must be in \[1, 16\], got 0"
    yield dict(good, hashes=17), r"hashes must be in \[1, 16\], got 17"
    yield dict(good, admit_after=0), r"admit_after must be in \[1, 15\] \(4-bit counters\), got 0"
    yield dict(good, admit_after=16), r"admit_after must be in \[1, 15\] \(4-bit counters\), got 16"
    yield (
        dict(good, counters=torch.zeros(8, dtype=torch.int64)),
        r"counters must be a contiguous 1-D uint8 tensor .* got Long",
    )
    yield (
        dict(good, counters=torch.zeros(12, dtype=torch.uint8)),
        r"counters must hold a power-of-two number of bytes .* got 12",
    )
    yield (
        dict(good, counters=torch.zeros(16, dtype=torch.uint8)[::2]),
        r"counters must be a contiguous .*\(not contiguous\)",
    )


@pytest.mark.parametrize("case", range(len(list(_bad_cases()))))
def test_bad_input_is_refused_naming_the_argument_and_the_filter_is_unchanged(bloom_admit, case):
    args, message = list(_bad_cases())[case]
    args["counters"].fill_(0x31)
    before = args["counters"].clone()
    with pytest.raises(RuntimeError, match=r"bloom_admit: " + message):
        bloom_admit(*args.values())
    assert torch.equal(args["counters"], before)


def test_bloom_admission_decides_as_the_oracle_over_a_stream_with_decay():
    """BloomAdmission.admit (the op plus decay) against the oracle: unseen ids only, counts past
    15, halving every 3 steps."""
    geometry = adm.BloomGeometry(counters=256, hashes=3, expected_ids=60)
    bloom = adm.BloomAdmission(4, geometry, 3, seed=21, device=torch.device("cpu"))
    rng = random.Random(2)
    state = [0] * geometry.nbytes
    for step in range(1, 13):
        keys = torch.tensor(rng.sample(range(-500, 500), 120), dtype=torch.int64)
        counts = torch.tensor([rng.choice([1, 1, 2, 4, 20]) for _ in range(120)], dtype=torch.int64)
        unseen = torch.tensor([rng.random() < 0.8 for _ in range(120)], dtype=torch.bool)
        if step % 3 == 0:
            state = [(b >> 1) & 0x77 for b in state]
        state, want = ref.bloom_admit(state, keys.tolist(), counts.tolist(), unseen.tolist(), bloom.hash_seed, 3, 4)
        assert bloom.admit(keys, counts, unseen, step).tolist() == want, f"step {step}"
        assert bloom.packed.tolist() == state, f"step {step}"


def test_emulated_cuda_kernel_does_not_depend_on_the_order_of_warps(emulated, monkeypatch):
    """The same stream with each launch's warps run last to first (a result that changed would be
    a race on a GPU): the same filter and decisions."""
    rng = random.Random(4)
    keys = [torch.tensor([rng.randrange(-3000, 3000) for _ in range(1500)], dtype=torch.int64) for _ in range(3)]
    counts = [torch.tensor([rng.choice([1, 2, 9]) for _ in range(1500)], dtype=torch.int64) for _ in range(3)]
    runs = []
    for reverse in (False, True):
        if reverse:
            monkeypatch.setenv("TORCHREC_EMU_REVERSE_WARPS", "1")
        packed = torch.zeros(256, dtype=torch.uint8)
        runs.append(
            [emulated.bloom_admit(packed, k, c, None, 5, 3, 7).tolist() for k, c in zip(keys, counts)]
            + [packed.tolist()]
        )
    assert runs[0] == runs[1]
