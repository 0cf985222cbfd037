"""The CUDA kernel of init_rows_tables (csrc/init_rows_cuda.cu and its binding), run on CPU under
the warp emulator (tests/cuda_emulation), against the CPU kernel: every byte of the flat weights
and optimizer states must match (untouched bytes included), over many tables of every
initializer, storage dtype and optimizer state layout, dims that are not multiples of 4 or 2,
tables with no new rows, skipped rows and extreme ids. The CPU kernel itself is checked against
the per-table init_rows (another C++ kernel, one table at a time) and the torch composite that
served CUDA before. What the emulator cannot show: CUDA's double log / sin / cos (the emulated
kernel takes glibc's), which the GPU test of this file compares on a real device."""

import itertools
import random

import pytest
import torch

from cuda_emulation.build import build, cuda_include_dir
from torchrec_ext import ops, torch_kernels
from torchrec_ext.hashing import as_int64
from torchrec_ext.vocabulary import STORAGE_DTYPES, table_words

I64MIN, I64MAX = -(2**63), 2**63 - 1
UNIFORM, NORMAL, TRUNCATED, CONSTANT = 0, 1, 2, 3
# Per kind: parameter sets (constants that are subnormal in float16, round to its largest finite
# value, or overflow it and bfloat16's grid).
PARAMS = {
    UNIFORM: [(-0.5, 0.25), (-1e-3, 1e-3)],
    NORMAL: [(0.0, 1.0), (0.1, 0.3)],
    TRUNCATED: [(0.0, 1.0, -0.4, 0.6), (0.0, 2.0, -2.0, 2.0)],
    # 1 + 3 * 2^-8 and 1 + 3 * 2^-11: ties of bfloat16 and float16 whose even neighbour is above
    CONSTANT: [(0.125,), (1e-6,), (65519.0,), (70000.0,), (-3.4e38,), (1.01171875,), (1.00146484375,)],
}


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    if cuda_include_dir() is None:
        pytest.skip("needs the CUDA toolkit headers")
    return build(str(tmp_path_factory.mktemp("torchrec_emu")))


def _case(seed: int, num_tables: int, dtypes: str, states: str, device="cpu", constants=False):
    """A module-like flat storage of num_tables tables and a batch of new rows over them: the
    op's arguments, and each table's capacity."""
    rng = random.Random(seed)
    dims = [rng.choice([1, 2, 3, 4, 5, 7, 8, 13, 16, 33]) for _ in range(num_tables)]
    caps = [rng.choice([1, 4, 9, 17]) for _ in range(num_tables)]
    codes = [0 if dtypes == "fp32" else rng.randrange(3) for _ in range(num_tables)]
    kinds = [t % 4 for t in range(num_tables)]  # every initializer
    params = [rng.choice(PARAMS[k]) for k in kinds]
    if constants:  # every constant in both half dtypes
        every = len(PARAMS[CONSTANT])
        kinds, params = [CONSTANT] * num_tables, [PARAMS[CONSTANT][t % every] for t in range(num_tables)]
        codes = [1 + (t // every) % 2 for t in range(num_tables)]
    words = [table_words(c, d, STORAGE_DTYPES[code]) for c, d, code in zip(caps, dims, codes)]
    offsets = torch.tensor([0] + words[:-1]).cumsum(0)
    rowwise = states == "rowwise"
    span = [c if rowwise else c * d for c, d in zip(caps, dims)]
    state_offsets = torch.tensor([0] + span[:-1]).cumsum(0)
    rows, tables, ids = [], [], []
    for t in range(num_tables):
        if t % 3 == 2:
            continue  # tables with no new rows
        chosen = rng.sample(range(caps[t]), rng.randint(1, caps[t]))
        rows += chosen
        tables += [t] * len(chosen)
        ids += [rng.choice([rng.randrange(I64MIN, I64MAX), 0, -1, I64MIN, I64MAX]) for _ in chosen]
    rows += [-1, -1]  # skipped entries
    tables += [0, num_tables - 1]
    ids += [5, 6]
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed))
    weights = torch.randn(sum(words), generator=torch.Generator().manual_seed(seed))  # garbage: kept where not new
    count = {"none": 0, "elementwise": 2, "rowwise": 1}[states]
    state = [torch.full((sum(span),), 9.0 + s) for s in range(count)]
    args = [
        weights,
        offsets,
        torch.tensor(dims),
        None if dtypes == "fp32" else torch.tensor(codes),
        torch.tensor(rows)[order],
        torch.tensor(tables)[order],
        torch.tensor(ids, dtype=torch.int64)[order],
        torch.tensor([as_int64(rng.randrange(0, 2**64)) for _ in range(num_tables)]),
        torch.tensor(kinds),
        torch.tensor([list(p) + [0.0] * (4 - len(p)) for p in params], dtype=torch.float64),
        max(dims),
        state,
        state_offsets if count else None,
        rowwise,
        [0.5 + s for s in range(count)],
    ]
    return [
        a.to(device)
        if isinstance(a, torch.Tensor)
        else [s.to(device) for s in a]
        if isinstance(a, list) and a and isinstance(a[0], torch.Tensor)
        else a
        for a in args
    ], caps


def _clone(args):
    def one(a):
        return a.clone() if isinstance(a, torch.Tensor) else a

    return [[one(s) for s in a] if isinstance(a, list) else one(a) for a in args]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)  # bit patterns: NaN-safe, -0.0 distinct


# Every case in CI: each takes ~0.05 s once the emulated library is built (shared with
# tests/test_cuda_kernels_emulated.py, one build per process).
@pytest.mark.parametrize(
    "num_tables, dtypes, states",
    itertools.product([1, 7, 26], ["fp32", "mixed"], ["none", "elementwise", "rowwise"]),
)
def test_emulated_cuda_init_is_bit_identical_to_the_cpu_kernel(emulated, num_tables, dtypes, states):
    for seed in range(2):
        args, _ = _case(seed * 100 + num_tables, num_tables, dtypes, states)
        cpu, emu = _clone(args), _clone(args)
        torch.ops.torchrec_ext.init_rows_tables(*cpu)
        emulated.init_rows_tables(*emu)
        assert torch.equal(_bits(cpu[0]), _bits(emu[0])), "weights"
        assert not torch.equal(_bits(cpu[0]), _bits(args[0])), "nothing was written"
        for a, b in zip(cpu[11], emu[11]):
            assert torch.equal(_bits(a), _bits(b)), "optimizer state"


def test_emulated_cuda_init_rounds_half_rows_to_nearest_even(emulated):
    """Constants at float16 / bfloat16 ties, subnormals and overflow, in both half dtypes."""
    args, _ = _case(5, 2 * len(PARAMS[CONSTANT]), "mixed", "none", constants=True)
    cpu, emu = _clone(args), _clone(args)
    torch.ops.torchrec_ext.init_rows_tables(*cpu)
    emulated.init_rows_tables(*emu)
    assert torch.equal(_bits(cpu[0]), _bits(emu[0]))


def test_emulated_cuda_init_with_no_rows_writes_nothing(emulated):
    args, _ = _case(3, 5, "mixed", "elementwise")
    for empty in (args[4][:0], torch.full_like(args[4], -1)):
        emu = _clone(args)
        emu[4] = empty
        emu[5], emu[6] = emu[5][: empty.numel()], emu[6][: empty.numel()]
        emulated.init_rows_tables(*emu)
        assert torch.equal(_bits(emu[0]), _bits(args[0])) and torch.equal(emu[11][0], args[11][0])


def test_emulated_cuda_init_refuses_bad_arguments_before_writing(emulated):
    args, _ = _case(4, 3, "fp32", "rowwise")
    bad = _clone(args)
    bad[9] = bad[9][:, :3]
    with pytest.raises(RuntimeError, match=r"init_rows_tables: table_params must be a contiguous float64 \[3, 4\]"):
        emulated.init_rows_tables(*bad)
    bad = _clone(args)
    bad[6] = bad[6][1:]
    with pytest.raises(RuntimeError, match="init_rows_tables: ids must have"):
        emulated.init_rows_tables(*bad)
    assert torch.equal(bad[0], args[0])


@pytest.mark.parametrize("states", ["none", "elementwise", "rowwise"])
def test_cpu_kernel_matches_init_rows_per_table(states):
    """The multi-table CPU kernel (the oracle above) against init_rows one table at a time, on
    2-D views of each table's rows and state: bit for bit."""
    args, caps = _case(7, 9, "mixed", states)
    got = _clone(args)
    torch.ops.torchrec_ext.init_rows_tables(*got)
    weights, offsets, dims, codes, rows, tables, ids, seeds, kinds, params = args[:10]
    state_offsets, rowwise = args[12], args[13]
    want_weights, want_states = args[0].clone(), [s.clone() for s in args[11]]
    for t in range(offsets.numel()):
        dtype, dim = STORAGE_DTYPES[int(codes[t])], int(dims[t])
        view = want_weights if dtype == torch.float32 else want_weights.view(dtype)
        start = int(offsets[t]) * (4 // view.element_size())
        cap = caps[t]
        width = 1 if rowwise else dim
        table_states = [
            s[int(state_offsets[t]) : int(state_offsets[t]) + cap * width].view(cap, width) for s in want_states
        ]
        mine = tables == t
        kind = int(kinds[t])
        p = params[t, : {0: 2, 1: 2, 2: 4, 3: 1}[kind]].tolist()
        ops.init_rows(
            view[start : start + cap * dim].view(cap, dim),
            rows[mine],
            ids[mine],
            int(seeds[t]),
            kind,
            p,
            table_states,
            args[14],
        )
    assert torch.equal(_bits(got[0]), _bits(want_weights))
    for a, b in zip(got[11], want_states):
        assert torch.equal(_bits(a), _bits(b))


def test_torch_composite_matches_the_cpu_kernel():
    """The torch stand-in (still the kernel of devices without one) against the C++ op: uniform
    and constant bit for bit, the normals to float32 rounding (torch's log / cos against libm's)."""
    args, _ = _case(11, 8, "mixed", "elementwise")
    a, b = _clone(args), _clone(args)
    torch.ops.torchrec_ext.init_rows_tables(*a)
    kinds = sorted(set(args[8].tolist()))
    torch_kernels.init_rows_tables(*b[:10], kinds, b[10], b[11], b[12], b[13], b[14])
    torch.testing.assert_close(a[0], b[0], rtol=1e-6, atol=1e-7, equal_nan=True)
    for x, y in zip(a[11], b[11]):
        assert torch.equal(x, y)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("states", ["none", "elementwise", "rowwise"])
def test_cuda_init_is_bit_identical_to_the_cpu_kernel_on_a_gpu(states):
    """On a real GPU (CUDA's own log / sin / cos): the one-launch kernel against the CPU kernel."""
    assert ops.has_kernel("init_rows_tables", torch.device("cuda"))
    for num_tables in (7, 26):
        args, _ = _case(num_tables, num_tables, "mixed", states)
        cpu, gpu = _clone(args), _case(num_tables, num_tables, "mixed", states, device="cuda")[0]
        torch.ops.torchrec_ext.init_rows_tables(*cpu)
        torch.ops.torchrec_ext.init_rows_tables(*gpu)
        assert torch.equal(_bits(cpu[0]), _bits(gpu[0].cpu()))
        for a, b in zip(cpu[11], gpu[11]):
            assert torch.equal(_bits(a), _bits(b.cpu()))
