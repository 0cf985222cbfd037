"""The CUDA kernel of dedup_segments (csrc/dedup_cuda.cu and its binding), run on CPU under the
warp emulator (tests/cuda_emulation), against the CPU kernel: every output must be equal (values,
dtypes, shapes) over batches of many, empty and single segments, all-duplicate and all-distinct
ids, no ids, extreme and negative ids, the same id in several segments; also with the emulator's
warps and lanes run in reverse (what the kernel computes must not depend on which thread wins a
race), and bad offsets refused with the CPU kernel's message. The CPU kernel is itself checked
against the pure-PyTorch reference. What the emulator cannot show (warps running concurrently,
speed) the CUDA tests at the end check on a GPU."""

import contextlib
import random
import warnings

import pytest
import torch

from cuda_emulation.build import build, cuda_include_dir, reversed_warps
from embedding_ops_helpers import EXTREME_IDS
from torchrec_ext import device_sync, ops
from torchrec_ext import reference as ref

I64MIN, I64MAX = -(2**63), 2**63 - 1
needs_headers = pytest.mark.skipif(cuda_include_dir() is None, reason="needs the CUDA toolkit headers")
needs_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or not ops.has_kernel("dedup_segments", torch.device("cuda")),
    reason="needs a GPU and a CUDA build of torchrec_ext",
)


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    return build(str(tmp_path_factory.mktemp("torchrec_emu")))


def _batch(rng: random.Random, lengths: list[int], universe: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    ids = [rng.choice(universe) for _ in range(offsets[-1])]
    return torch.tensor(ids, dtype=torch.int64), torch.tensor(offsets, dtype=torch.int64)


def _cases():
    """(name, ids, segment_offsets): every shape the kernel must get right."""
    rng = random.Random(13)
    wide = [rng.randrange(I64MIN, I64MAX) for _ in range(600)] + EXTREME_IDS
    yield "many segments, some empty", *_batch(rng, [rng.choice([0, 0, 1, 7, 40, 90]) for _ in range(26)], wide)
    yield "hot ids across warps", *_batch(rng, [rng.randrange(0, 300) for _ in range(9)], list(range(-3, 5)))
    yield "one segment", *_batch(rng, [1500], wide)
    yield "all duplicates", torch.full((1000,), -7, dtype=torch.int64), torch.tensor([0, 1000])
    yield "all duplicates, split", torch.full((700,), I64MIN, dtype=torch.int64), torch.tensor([0, 3, 3, 400, 700])
    yield (
        "all distinct",
        torch.randperm(2000, generator=torch.Generator().manual_seed(1)) - 1000,
        torch.tensor([0, 777, 2000]),
    )
    yield "extreme ids", torch.tensor(EXTREME_IDS * 9), torch.tensor([0, 5, 20, 45])
    yield "same ids in every segment", torch.arange(40).repeat(5) * -(2**40), torch.tensor([0, 40, 80, 120, 160, 200])
    yield "no ids, one segment", torch.zeros(0, dtype=torch.int64), torch.tensor([0, 0])
    yield "no ids, no segment", torch.zeros(0, dtype=torch.int64), torch.tensor([0])
    yield "no ids, empty segments", torch.zeros(0, dtype=torch.int64), torch.tensor([0, 0, 0, 0])
    yield "one id", torch.tensor([I64MAX]), torch.tensor([0, 0, 1, 1])
    # hash collisions: ids that differ only in the high bits, in segments of 2 (table of 32 slots)
    yield "small segments", torch.tensor([5, 5 + 2**60, 5, 5 + 2**61, 5 + 2**60, 5]), torch.tensor([0, 2, 4, 6])


CASES = list(_cases())


def _assert_same(got, want, what):
    for name, g, w in zip(("unique", "inverse", "counts", "unique_offsets"), got, want):
        assert g.dtype == w.dtype and g.shape == w.shape and torch.equal(g, w), f"{what}: {name}"


def test_cpu_kernel_matches_the_reference():
    for name, ids, offsets in CASES:
        _assert_same(torch.ops.torchrec_ext.dedup_segments(ids, offsets), ref.dedup_segments(ids, offsets), name)


@needs_headers
@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reversed warps"])
def test_emulated_cuda_kernel_matches_the_cpu_kernel(emulated, reverse):
    with reversed_warps() if reverse else contextlib.nullcontext():
        for name, ids, offsets in CASES:
            got = emulated.dedup_segments(ids, offsets)
            _assert_same(got, torch.ops.torchrec_ext.dedup_segments(ids, offsets), name)


@needs_headers
def test_emulated_cuda_kernel_on_random_batches(emulated):
    rng = random.Random(5)
    for trial in range(12):
        universe = rng.choice(
            [[rng.randrange(-50, 50) for _ in range(20)], [rng.randrange(I64MIN, I64MAX) for _ in range(3000)]]
        )
        lengths = [rng.choice([0, 1, 2, 33, 100, 257]) for _ in range(rng.choice([1, 2, 26, 60]))]
        ids, offsets = _batch(rng, lengths, universe)
        with reversed_warps() if trial % 2 else contextlib.nullcontext():
            got = emulated.dedup_segments(ids, offsets)
        _assert_same(got, torch.ops.torchrec_ext.dedup_segments(ids, offsets), f"trial {trial}")


@needs_headers
def test_dedup_costs_one_counted_read_and_mirrors_unique_offsets(emulated):
    """ops.dedup_segments' GPU path (host offsets in, the kernel's read counted, unique_offsets
    mirrored), driven here by the emulated kernel: one counted read per call, and the caller's
    read of unique_offsets is free, as the CPU path's one read is the caller's."""
    name, ids, offsets = CASES[0]
    host = offsets.clone()
    device_offsets = device_sync.mirror(offsets.clone(), host)  # as check_and_arrange hands them over
    with device_sync.recording() as seen:
        got = ops.dedup_segments_read_once(emulated.dedup_segments.default, ids, device_offsets)
        bounds = device_sync.host_list(got[3], "the caller's bounds")
    assert dict(seen) == {"dedup_segments: unique count": 1}
    _assert_same(got, torch.ops.torchrec_ext.dedup_segments(ids, offsets), name)
    assert bounds == got[3].tolist()


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_dedup_costs_one_counted_read_under_inference_mode_too(mode):
    """Under ``torch.inference_mode`` every tensor made is an inference tensor, which has no
    version counter for a mirror to watch: the offsets as check_and_arrange hands them over
    (``to_device``, then mirrored) and the unique_offsets the GPU path returns must still be
    free to read, so a call costs one counted read as under no_grad (it cost 3). The GPU path's
    kernel here is the CPU kernel, which given host offsets answers as the CUDA one does."""
    name, ids, offsets = CASES[0]
    want = torch.ops.torchrec_ext.dedup_segments(ids, offsets)
    with torch.inference_mode() if mode == "inference_mode" else torch.no_grad():
        host = offsets.tolist()
        host = torch.tensor(host + host, dtype=torch.int64)  # (check_and_arrange's two offsets in one copy)
        both = device_sync.to_device(host, ids.device)
        device_offsets = device_sync.mirror(both[: offsets.numel()], host[: offsets.numel()])
        with device_sync.recording() as seen:
            got = ops.dedup_segments_read_once(torch.ops.torchrec_ext.dedup_segments.default, ids, device_offsets)
            bounds = device_sync.host_list(got[3], "the caller's bounds")
            assert device_sync.host_list(got[3], "read again") == bounds
    assert dict(seen) == {"dedup_segments: unique count": 1}
    _assert_same(got, want, name)
    assert bounds == want[3].tolist()


BAD_OFFSETS = [
    ("segment_offsets must run from 0", torch.arange(4), torch.tensor([0, 3])),
    ("segment_offsets must run from 0", torch.arange(4), torch.tensor([1, 2, 4])),
    ("non-decreasing", torch.arange(4), torch.tensor([0, 3, 2, 4])),
    ("non-decreasing", torch.arange(6), torch.tensor([0, 9, -9, 6])),  # values far outside the ids
    ("non-decreasing", torch.arange(3), torch.tensor([0, I64MAX, I64MIN, 3])),
    ("segment_offsets needs at least one entry", torch.arange(0), torch.zeros(0, dtype=torch.int64)),
    ("segment_offsets must be a contiguous 1-D int64", torch.arange(4), torch.tensor([0, 4], dtype=torch.int32)),
    ("ids must be a 1-D int64", torch.arange(4, dtype=torch.int32), torch.tensor([0, 4])),
    ("ids must be a 1-D int64", torch.arange(4).view(2, 2), torch.tensor([0, 4])),
]


def _message(call) -> str:
    with pytest.raises(RuntimeError) as error:
        call()
    return str(error.value).splitlines()[0]


@needs_headers
@pytest.mark.parametrize(
    "match, ids, offsets", BAD_OFFSETS, ids=[f"{b[0][:24]} {i}" for i, b in enumerate(BAD_OFFSETS)]
)
def test_emulated_cuda_kernel_refuses_what_the_cpu_kernel_refuses(emulated, match, ids, offsets):
    """Offsets on the ids' device: checked on the copy the kernel reads back (after kernels that
    must stay in bounds whatever the offsets), with the CPU kernel's message."""
    cpu = _message(lambda: torch.ops.torchrec_ext.dedup_segments(ids, offsets))
    assert match in cpu
    assert _message(lambda: emulated.dedup_segments(ids, offsets)) == cpu


# ------------------------------------------------------------------------- on a GPU


def _on_gpu(ids, offsets):
    host = offsets.clone()
    return ids.cuda(), device_sync.mirror(offsets.cuda(), host)


@needs_gpu
def test_cuda_kernel_matches_the_cpu_kernel_on_a_gpu():
    rng = random.Random(7)
    cases = CASES + [("large", *_batch(rng, [rng.randrange(0, 40000) for _ in range(26)], list(range(30000))))]
    for name, ids, offsets in cases:
        want = torch.ops.torchrec_ext.dedup_segments(ids, offsets)
        gpu_ids, gpu_offsets = _on_gpu(ids, offsets)
        with device_sync.recording() as seen:
            got = ops.dedup_segments(gpu_ids, gpu_offsets)
            device_sync.host_list(got[3], "the caller's bounds")
        assert dict(seen) == {"dedup_segments: unique count": 1}, name
        assert all(t.device == gpu_ids.device for t in got), name
        _assert_same([t.cpu() for t in got], want, name)
        # the op itself: unique_offsets where segment_offsets are (the GPU, or the host)
        direct = torch.ops.torchrec_ext.dedup_segments(gpu_ids, offsets.cuda())
        assert direct[3].is_cuda
        _assert_same([t.cpu() for t in direct], want, name)
        from_host = torch.ops.torchrec_ext.dedup_segments(gpu_ids, offsets)
        assert from_host[3].device.type == "cpu" and from_host[0].is_cuda
        _assert_same([t.cpu() for t in from_host], want, name)


@needs_gpu
@pytest.mark.parametrize(
    "match, ids, offsets", BAD_OFFSETS, ids=[f"{b[0][:24]} {i}" for i, b in enumerate(BAD_OFFSETS)]
)
def test_cuda_kernel_refuses_what_the_cpu_kernel_refuses_on_a_gpu(match, ids, offsets):
    cpu = _message(lambda: torch.ops.torchrec_ext.dedup_segments(ids, offsets))
    assert _message(lambda: torch.ops.torchrec_ext.dedup_segments(ids.cuda(), offsets.cuda())) == cpu
    assert _message(lambda: torch.ops.torchrec_ext.dedup_segments(ids.cuda(), offsets)) == cpu
    torch.cuda.synchronize()  # nothing was left running out of bounds


@needs_gpu
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_cuda_dedup_synchronizes_once_on_a_gpu(mode):
    """The one counted read is the one real sync: torch's sync debug mode sees one per call (the
    kernel's read back), none for the pinned copies or the caller's read of unique_offsets; under
    inference_mode too, the offsets handed over as check_and_arrange does (``to_device``)."""
    _, ids, offsets = CASES[0]
    with torch.inference_mode() if mode == "inference_mode" else torch.no_grad():
        ids, offsets = ids.cuda(), device_sync.to_device(offsets.clone(), torch.device("cuda"))
        ops.dedup_segments(ids, offsets)  # (warm: the caching allocators hold their blocks)
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                unique_offsets = ops.dedup_segments(ids, offsets)[3]
                device_sync.host_list(unique_offsets, "the caller's bounds")
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert len([w for w in caught if "synchroniz" in str(w.message)]) == 1, [str(w.message) for w in caught]
