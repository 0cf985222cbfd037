"""The Triton embedding kernels (torchrec_ext/triton_kernels/: embedding_lookup.py,
embedding_update.py) against the references in torchrec_ext/reference/: pooled and sequence
lookups, and the backward fused with every optimizer over several steps (weights and optimizer
states).

Each check runs in two variants: `interp`, on CPU tensors under TRITON_INTERPRET=1, and `cuda`, on
a GPU (skipped without one). TRITON_INTERPRET is read when triton is imported, and another test of
the same pytest process may have imported triton already, so test_interpreter_run runs this file
again in a child pytest with TRITON_INTERPRET=1: the `interp` variants exist only there, the
`cuda` ones only in the parent. Gathers are compared bit for bit, sums and updates with assert_close.
"""

import contextlib
import importlib.util
import itertools
import os
import subprocess
import sys

import pytest
import torch

from matrix import FULL_MATRIX, ci_subset
from mixed_dtype_helpers import assert_rows_within_a_rounding, bag_configs, rows_by_id, train_on_stream
from torchrec_ext import DynamicEmbeddingBagCollection
from torchrec_ext import reference as ref

_CHILD_FLAG = "TORCHREC_EXT_TRITON_INTERPRET_CHILD"
_IN_CHILD = os.environ.get(_CHILD_FLAG) == "1"
_HAS_TRITON = importlib.util.find_spec("triton") is not None
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The child run has the `interp` variants only, the parent the `cuda` ones only.
TARGETS = (
    ["interp"]
    if _IN_CHILD
    else [
        pytest.param(
            "cuda",
            marks=pytest.mark.skipif(
                not torch.cuda.is_available() or not _HAS_TRITON, reason="needs a CUDA GPU and triton"
            ),
        )
    ]
)


def test_interpreter_run():
    """Runs every `interp` variant of this file in a child pytest with TRITON_INTERPRET=1."""
    if _IN_CHILD:
        pytest.skip("this is the child run")
    _need_triton()
    env = dict(os.environ, TRITON_INTERPRET="1", **{_CHILD_FLAG: "1"})
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", os.path.abspath(__file__)],
        cwd=_REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, (
        f"child pytest under TRITON_INTERPRET=1 failed:\n{proc.stdout[-8000:]}\n{proc.stderr[-4000:]}"
    )
    assert " passed" in proc.stdout, proc.stdout[-4000:]


def _device(target):
    return torch.device("cpu") if target == "interp" else torch.device("cuda")


def _need_triton():
    # Imported only when a test runs, never at collection: other tests of this process may still
    # want to import triton themselves under TRITON_INTERPRET=1.
    pytest.importorskip("triton", reason="triton is not importable", exc_type=ImportError)


def _need_triton_installed():
    # Without importing it (see _need_triton): for checks that run triton in a child process.
    if not _HAS_TRITON:
        pytest.skip("triton is not installed")


def _lookup():
    _need_triton()
    from torchrec_ext.triton_kernels import embedding_lookup

    return embedding_lookup


def _update():
    _need_triton()
    from torchrec_ext.triton_kernels import embedding_update

    return embedding_update


# ---- fixtures: tables, batches --------------------------------------------------------------

DIMS = [4, 12, 16]  # one non-power-of-two dim
# A table wider than one block of columns (128 for lookups, 256 for updates): several column
# blocks, the ones past a narrow table's dim read and write nothing.
WIDE_DIMS = [4, 12, 260]
CAPS = [6, 5, 4]  # small capacities: many duplicate ids
FEATURE_TABLE = [0, 1, 1, 2, 0]  # several features per table
FEATURE_MEAN = [False, True, False, True, True]


def _tables(gen, dims=DIMS, caps=CAPS):
    offsets = [0]
    for cap, dim in zip(caps, dims):
        offsets.append(offsets[-1] + cap * dim)
    weights = torch.randn(offsets[-1], generator=gen)
    row_offsets = [0]
    for cap in caps:
        row_offsets.append(row_offsets[-1] + cap)
    return (weights, torch.tensor(offsets[:-1]), torch.tensor(dims), torch.tensor(row_offsets[:-1]))


def _features(dims=DIMS, feature_table=FEATURE_TABLE, feature_mean=FEATURE_MEAN, gap=3):
    cols, col = [], 0
    for t in feature_table:
        cols.append(col)
        col += dims[t]
    # `gap` columns no feature writes: they must come out zero.
    return torch.tensor(feature_table), torch.tensor(cols), torch.tensor(feature_mean), col + gap


def _bags(gen, batch_size, feature_table=FEATURE_TABLE, caps=CAPS, max_len=5, weighted=False):
    """KJT-ordered bags: lengths 0..max_len (some empty), rows with duplicates and -1s."""
    num_bags = len(feature_table) * batch_size
    lengths = torch.randint(0, max_len + 1, (num_bags,), generator=gen)
    lengths[::4] = 0  # empty bags for sure
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    bag_of_value = torch.repeat_interleave(torch.arange(num_bags), lengths)
    value_table = torch.tensor(feature_table)[bag_of_value // batch_size]
    cap = torch.tensor(caps)[value_table]
    rows = (torch.rand(bag_of_value.numel(), generator=gen) * (cap + 1)).long() - 1  # -1 .. cap-1
    psw = torch.rand(rows.numel(), generator=gen) + 0.5 if weighted else None
    return rows, offsets, psw, value_table


def _dedup(rows, value_table, gen, caps=CAPS):
    """(unique_rows, unique_table, inverse) in first-occurrence order of (table, row), -1 rows
    included (they must be skipped), plus one unique row no value refers to (an empty group)."""
    first = {}
    inverse = [first.setdefault((t, r), len(first)) for t, r in zip(value_table.tolist(), rows.tolist())]
    t = int(torch.randint(0, len(caps), (1,), generator=gen))
    unused = [r for r in range(caps[t]) if (t, r) not in first]
    if unused:
        first[(t, unused[0])] = len(first)
    keys = list(first)
    return (
        torch.tensor([r for _, r in keys], dtype=torch.int64),
        torch.tensor([t for t, _ in keys], dtype=torch.int64),
        torch.tensor(inverse, dtype=torch.int64),
    )


def _on(device, *tensors):
    return [None if t is None else t.to(device) for t in tensors]


# ---- lookups --------------------------------------------------------------------------------


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("batch_size", [1, 3, 5])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("dims", [DIMS, WIDE_DIMS], ids=["narrow", "wide"])
def test_pooled_lookup(target, batch_size, weighted, dims):
    device = _device(target)
    gen = torch.Generator().manual_seed(batch_size * 2 + weighted)
    weights, table_offsets, table_dims, _ = _tables(gen, dims=dims)
    feature_table, feature_col, feature_mean, total_dim = _features(dims=dims)
    rows, offsets, psw, _ = _bags(gen, batch_size, weighted=weighted)
    args = (table_offsets, table_dims, feature_table, feature_col, feature_mean, rows, offsets, psw)
    expected = ref.pooled_lookup(weights, *args, batch_size, total_dim)
    got = _lookup().pooled_lookup(*_on(device, weights, *args), batch_size, total_dim)
    assert got.shape == (batch_size, total_dim) and got.dtype == torch.float32 and got.device.type == device.type
    torch.testing.assert_close(got.cpu(), expected)


@pytest.mark.parametrize("target", TARGETS)
def test_pooled_lookup_single_ids_exact(target):
    """Bags of at most one id, sum and mean: no rounding anywhere, so bit-exact."""
    device = _device(target)
    gen = torch.Generator().manual_seed(7)
    weights, table_offsets, table_dims, _ = _tables(gen)
    feature_table, feature_col, feature_mean, total_dim = _features()
    rows, offsets, _, _ = _bags(gen, 7, max_len=1)
    args = (table_offsets, table_dims, feature_table, feature_col, feature_mean, rows, offsets, None)
    expected = ref.pooled_lookup(weights, *args, 7, total_dim)
    assert torch.equal(_lookup().pooled_lookup(*_on(device, weights, *args), 7, total_dim).cpu(), expected)


@pytest.mark.parametrize("target", TARGETS)
def test_pooled_lookup_long_bags_and_int32_ids(target):
    """Bags longer than one block of ids; int32 rows and offsets."""
    device = _device(target)
    gen = torch.Generator().manual_seed(11)
    weights, table_offsets, table_dims, _ = _tables(gen)
    feature_table, feature_col, feature_mean, total_dim = _features()
    rows, offsets, psw, _ = _bags(gen, 2, max_len=70, weighted=True)
    args = (table_offsets, table_dims, feature_table, feature_col, feature_mean, rows, offsets, psw)
    expected = ref.pooled_lookup(weights, *args, 2, total_dim)
    args32 = (table_offsets, table_dims, feature_table, feature_col, feature_mean, rows.int(), offsets.int(), psw)
    torch.testing.assert_close(_lookup().pooled_lookup(*_on(device, weights, *args32), 2, total_dim).cpu(), expected)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dim", [12, 16])
def test_sequence_lookup_exact(target, dim):
    device = _device(target)
    gen = torch.Generator().manual_seed(dim)
    caps = [6, 5, 4]
    weights, table_offsets, _, _ = _tables(gen, dims=[dim] * 3, caps=caps)
    feature_table = torch.tensor([0, 2, 1, 0])
    lengths = torch.tensor([3, 0, 37, 4])  # an empty feature; one longer than a block
    fvo = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    cap = torch.tensor(caps)[torch.repeat_interleave(feature_table, lengths)]
    rows = (torch.rand(int(fvo[-1]), generator=gen) * (cap + 1)).long() - 1
    expected = ref.sequence_lookup(weights, table_offsets, dim, feature_table, fvo, rows)
    got = _lookup().sequence_lookup(*_on(device, weights, table_offsets), dim, *_on(device, feature_table, fvo, rows))
    assert got.shape == (rows.numel(), dim) and got.dtype == torch.float32
    assert torch.equal(got.cpu(), expected)
    assert torch.equal(got.cpu()[rows < 0], torch.zeros(int((rows < 0).sum()), dim))


# ---- the pooled lookup's tiling: tiles of bags x ids x columns ------------------------------

# Per table (dim, dtype): aligned dims (16-byte loads), odd dims (scalar loads), dims even but not
# multiples of 4, and a table wider than one block of columns (256).
TILING_DIMS = {"aligned": [64, 32, 64], "odd": [3, 5, 7], "even": [6, 10, 2], "wide": [4, 12, 300]}
TILING_DTYPES = {"fp32": [torch.float32] * 3, "mixed": [torch.float16, torch.float32, torch.bfloat16]}
# Bag lengths: "short" 0..2 (mostly one loop step), "long" up to 40 (several steps of BLOCK_L ids).
TILING_BAGS = {"short": 2, "long": 40}
_TILING_CASES = list(itertools.product(TILING_DIMS, TILING_DTYPES, TILING_BAGS, [False, True]))


def _tiling_case(dims, dtypes, max_len, weighted, gen, gap, batch_size=7, feature_table=(0, 1, 2, 0, 2)):
    """A pooled-lookup case (the reference's keyword arguments): batch_size 7, so the tiles of
    consecutive bags straddle features (hence tables, dims and dtypes); empty bags, -1 rows;
    `gap` output columns no feature writes."""
    caps = [9, 6, 11]
    weights, table_offsets, table_dims, table_dtypes, _ = _half()._layout(caps, dims, dtypes, gen)
    feature_table = torch.tensor(feature_table)
    feature_dims = table_dims[feature_table]
    lengths = torch.randint(0, max_len + 1, (len(feature_table) * batch_size,), generator=gen)
    lengths[::5] = 0
    lengths[1] = max_len  # the longest bag for sure
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    value_table = feature_table.repeat_interleave(batch_size).repeat_interleave(lengths)
    n = int(offsets[-1])
    rows = (torch.rand(n, generator=gen) * torch.tensor(caps)[value_table]).long()
    rows[torch.rand(n, generator=gen) < 0.15] = -1
    return dict(
        weights=weights,
        table_offsets=table_offsets,
        table_dims=table_dims,
        feature_table=feature_table,
        feature_col=torch.cat([torch.zeros(1, dtype=torch.int64), feature_dims.cumsum(0)[:-1]]),
        feature_mean=torch.tensor([i % 2 == 1 for i in range(len(feature_table))]),
        rows=rows,
        offsets=offsets,
        per_sample_weights=torch.rand(n, generator=gen) + 0.5 if weighted else None,
        batch_size=batch_size,
        total_dim=int(feature_dims.sum()) + gap,
        table_dtypes=None if all(d == torch.float32 for d in dtypes) else table_dtypes,
    )


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize(
    "dims, dtypes, bags, weighted",
    # CI: long bags weighted, short ones plain (every dims x dtypes pair both ways in the full matrix).
    ci_subset(_TILING_CASES, lambda dims, dtypes, bags, weighted: (bags == "long") == weighted),
)
def test_pooled_lookup_tiling(target, dims, dtypes, bags, weighted):
    device = _device(target)
    gen = torch.Generator().manual_seed(_TILING_CASES.index((dims, dtypes, bags, weighted)))
    # Odd dims: 2 columns no feature writes (zeros); the others: features tiling the output.
    gap = 2 if dims == "odd" else 0
    case = _tiling_case(TILING_DIMS[dims], TILING_DTYPES[dtypes], TILING_BAGS[bags], weighted, gen, gap)
    want = ref.pooled_lookup(**case)
    on = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in case.items()}
    # Mirrored host values, as a module's layout and plan: the launch reads them (vector width,
    # an output the kernel fills without a memset).
    from torchrec_ext import device_sync

    for name in ("table_offsets", "table_dims", "feature_table", "feature_col"):
        device_sync.mirror(on[name], case[name])
    got = _lookup().pooled_lookup(**on)
    assert got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got.cpu(), want)


@pytest.mark.parametrize("target", TARGETS)
def test_pooled_lookup_many_tables(target):
    """40 tables of mixed dims (one feature each, two more reading tables 0 and 39): one launch."""
    device = _device(target)
    gen = torch.Generator().manual_seed(40)
    dims = [[8, 4, 16, 2, 6][t % 5] for t in range(40)]
    weights, table_offsets, table_dims, _ = _tables(gen, dims=dims, caps=[5] * 40)
    feature_table = list(range(40)) + [0, 39]
    feature_mean = [f % 3 == 0 for f in range(len(feature_table))]
    feature_table, feature_col, feature_mean, total_dim = _features(dims, feature_table, feature_mean)
    rows, offsets, psw, _ = _bags(gen, 3, feature_table.tolist(), caps=[5] * 40, max_len=9, weighted=True)
    args = (table_offsets, table_dims, feature_table, feature_col, feature_mean, rows, offsets, psw)
    want = ref.pooled_lookup(weights, *args, 3, total_dim)
    torch.testing.assert_close(_lookup().pooled_lookup(*_on(device, weights, *args), 3, total_dim).cpu(), want)


@pytest.mark.parametrize("target", TARGETS)  # (in the child: the parent must not import triton)
def test_pooled_lookup_tile_choice(target):
    """The host-side choices: vector width from every table's dim and first word; tiles that
    follow the mean bag length and stay within POOLED_TILE elements."""
    lookup = _lookup()
    assert lookup._alignment([64, 128], [0, 4096]) == 8
    assert lookup._alignment([64, 12], [0, 4096]) == 4
    assert lookup._alignment([64, 6], [0, 4096]) == 2  # one dim not a multiple of 4
    assert lookup._alignment([64, 64], [0, 4098]) == 2  # one table starting mid-vector
    assert lookup._alignment([7], [0]) == 1
    assert lookup._tiles_output([4, 0], [8, 4], 12)  # any order
    assert not lookup._tiles_output([0, 4], [4, 8], 14)  # 2 columns left over
    assert not lookup._tiles_output([0, 2], [4, 8], 10)  # overlapping spans
    assert not lookup._tiles_output([0, 5], [4, 8], 13)  # a gap
    for max_dim, mean_bag in [(64, 4.0), (64, 0.0), (128, 30.0), (300, 2.0), (3, 1.0), (64, 200.0)]:
        block_b, block_l, block_d, num_warps = lookup._pooled_blocks(max_dim, mean_bag)
        assert block_d == min(triton_next_pow2(max_dim), 256)
        assert block_l == min(triton_next_pow2(max(round(mean_bag), 2)), 32, lookup.POOLED_TILE // block_d)
        assert block_b * block_l * block_d <= max(lookup.POOLED_TILE, block_d)
        assert 1 <= num_warps <= 8


# Narrow tables, aligned or not (a dim-3 / dim-6 table between two of dim d: ALIGN 1 / 2), every
# storage dtype, bags of ~1 and ~8 ids: the tile choice changed for these (fewer elements a
# thread), which must change no bit of the output (each bag is summed in the same order).
NARROW_DIMS = [4, 8, 12, 16, 32, 64, 128]
NARROW_MIDDLE = {"aligned": None, "align2": 6, "align1": 3}


def _session13_tile(max_dim, mean_bag, align=8):
    """The pooled lookup's tile before the narrow-tile change (16 elements a thread always)."""
    block_d = min(triton_next_pow2(max_dim), 256)
    block_l = min(triton_next_pow2(max(int(mean_bag + 0.5), 2)), 32, max(4096 // block_d, 1))
    block_b = max(1, min(64, 4096 // (block_d * block_l)))
    threads = block_b * block_l * block_d // 16
    return block_b, block_l, block_d, max(1, min(8, triton_next_pow2(max(threads // 32, 1))))


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize(
    "middle, dtype",
    # CI: each ALIGN once, each dtype once (all 9 pairs in the full matrix; ~3 s each interpreted).
    ci_subset(
        itertools.product(NARROW_MIDDLE, [torch.float32, torch.float16, torch.bfloat16]),
        lambda middle, dtype: (
            (middle, dtype) in {("aligned", torch.float32), ("align2", torch.bfloat16), ("align1", torch.float16)}
        ),
    ),
)
def test_pooled_lookup_narrow_tiles_are_bit_for_bit(target, middle, dtype, monkeypatch):
    device, lookup = _device(target), _lookup()
    for dim, max_len in itertools.product(NARROW_DIMS, [2, 16]):
        gen = torch.Generator().manual_seed(dim * 100 + max_len)
        dims = [dim, NARROW_MIDDLE[middle] or dim, dim]
        case = _tiling_case(dims, [dtype] * 3, max_len, max_len > 2, gen, gap=0)
        on = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in case.items()}
        from torchrec_ext import device_sync

        for name in ("table_offsets", "table_dims", "feature_table", "feature_col"):
            device_sync.mirror(on[name], case[name])
        align = lookup._alignment(case["table_dims"].tolist(), case["table_offsets"].tolist())
        assert align == {"align2": 2, "align1": 1}.get(middle, align), (dim, middle, align)
        got = lookup.pooled_lookup(**on).cpu()
        torch.testing.assert_close(got, ref.pooled_lookup(**case))
        with monkeypatch.context() as m:
            m.setattr(lookup, "_pooled_blocks", _session13_tile)
            before = lookup.pooled_lookup(**on).cpu()
        assert torch.equal(got, before), (dim, middle, dtype, max_len)


def triton_next_pow2(n):
    return 1 << (max(n, 1) - 1).bit_length()


# Compiles the pooled kernel for sm_90 (Triton's own ptxas: no GPU needed) and prints the PTX's
# global load instructions per variant. A child process: TRITON_INTERPRET must be unset for it.
_SM90_COMPILE = r"""
import json, re, sys
sys.path.insert(0, "benchmarks")
from sm90 import compile_pooled_lookup

out = {}
for align, has_weights, has_dtypes in json.loads(sys.argv[1]):
    const = dict(HAS_WEIGHTS=has_weights, HAS_DTYPES=has_dtypes, ALIGN=align, BLOCK_B=16, BLOCK_L=4, BLOCK_D=64)
    compiled = compile_pooled_lookup(const, num_warps=8)
    out[f"{align},{has_weights},{has_dtypes}"] = re.findall(r"ld\.global[\w.]*", compiled.asm["ptx"])
print(json.dumps(out))
"""


def _compile_for_sm90(script: str, variants: list):
    """Runs a compile ``script`` (argv[1]: ``variants`` as JSON) in a child process without
    TRITON_INTERPRET; returns the JSON its last line prints (skips without Triton's ptxas)."""
    import json

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = _REPO + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, "-c", script, json.dumps(variants)],
        cwd=_REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if proc.returncode != 0 and "ptxas" in proc.stderr and "not found" in proc.stderr.lower():
        pytest.skip("triton's ptxas is not installed")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_pooled_lookup_compiles_for_sm90_with_16_byte_row_loads():
    """On the GPU's target, without a GPU: the kernel compiles, and the alignment hint is what
    turns a float32 row's loads into 16-byte ones (scalar 4-byte loads without it)."""
    if _IN_CHILD:
        pytest.skip("the compile runs in its own child process")
    _need_triton_installed()

    variants = [(4, False, False), (1, False, False), (4, True, True), (8, True, True)]
    loads = _compile_for_sm90(_SM90_COMPILE, variants)
    assert "ld.global.v4.b32" in loads["4,False,False"]
    assert "ld.global.v4.b32" not in loads["1,False,False"] and "ld.global.b32" in loads["1,False,False"]
    # Mixed dtypes: float32 tables still 16 bytes a load, half tables 8 (4 halves) at ALIGN 4 and
    # 16 (8 halves) at ALIGN 8.
    assert {"ld.global.v4.b32", "ld.global.v2.b32"} <= set(loads["4,True,True"])
    assert "ld.global.v2.b32" not in loads["8,True,True"]
    assert loads["8,True,True"].count("ld.global.v4.b32") > loads["4,True,True"].count("ld.global.v4.b32")


# Compiles the pooled kernel for sm_90 at the tile pooled_lookup launches for (widest dim, mean bag,
# half tables or not, ALIGN) and prints the registers a thread takes, its warps and the bytes it
# spills (ptxas -v, Triton's own ptxas: benchmarks/sm90.py).
_SM90_REGISTERS = r"""
import json, sys
sys.path.insert(0, "benchmarks")
from sm90 import pooled_lookup_registers

variants = json.loads(sys.argv[1])  # [max_dim, mean_bag, half tables, ALIGN]
print(json.dumps({",".join(map(str, v)): pooled_lookup_registers(*v) for v in variants}))
"""


def test_pooled_lookup_of_half_tables_keeps_three_programs_per_sm():
    """Half tables cost the pooled kernel registers (the dtype of each bag's table is chosen per
    element): at dim 64 and 128 a thread must stay within 65536 / (3 programs x its threads), so
    that three programs of 8 warps share an SM, as float32 tables allow (two loads per element,
    float32 and the raw half bits, where three (float32, float16, bfloat16) took 95 registers:
    two programs). On sm_90, without a GPU."""
    if _IN_CHILD:
        pytest.skip("the compile runs in its own child process")
    _need_triton_installed()
    got = _compile_for_sm90(_SM90_REGISTERS, [(64, 10, True, 8), (128, 20, True, 8)])
    for key, (registers, num_warps, _) in got.items():
        assert registers * 3 * num_warps * 32 <= 65536, (key, registers, num_warps)


def test_pooled_lookup_of_narrow_or_unaligned_tables_stays_within_96_registers():
    """Narrow dims, bags of ~2 ids and tables whose dims or first words are not multiples of 4
    (ALIGN 1 or 2: a load, hence a 64-bit address, per element or pair) took 100-232 registers
    a thread at 16 elements a thread (dim 12, ALIGN 1, half tables, bags ~2: 232, two programs
    of 4 warps an SM); the tile choice gives those fewer elements a thread. Every such tile must
    compile within 96 registers, unspilled (sm_90, without a GPU), whatever way the Triton
    version lays out the gather (triton 3.7 gave a thread the ids of several bags of a 3-D tile:
    213 registers at dim 12, ALIGN 1, bags ~3)."""
    if _IN_CHILD:
        pytest.skip("the compile runs in its own child process")
    _need_triton_installed()
    # (widest dim, mean bag, half tables, ALIGN): the review's two (12 at ALIGN 1, 6 at ALIGN 2),
    # an aligned dim 4 (one vector a row), a wide table beside an odd one, a wide one of short bags,
    # and triton 3.7's worst of the 3-D tile (bags of 3 and 5 at ALIGN 1, of 10 at ALIGN 4).
    variants = [(12, 2, True, 1), (6, 3, True, 2), (4, 8, True, 4), (128, 2, True, 1), (64, 2, True, 8)]
    variants += [(12, 3, True, 1), (6, 5, True, 1), (8, 10, True, 4)]
    got = _compile_for_sm90(_SM90_REGISTERS, variants)
    for key, (registers, num_warps, spilled) in got.items():
        assert registers <= 96 and spilled == 0, (key, registers, num_warps, spilled)


# Compiles the fused update (stochastic rounding on) for sm_90 with ``step_term`` typed as each
# type Triton's launcher may give a Python int: i32 below 2**31 (its launcher types an int by its
# value), i64 above. A child process, as _SM90_COMPILE.
_SM90_COMPILE_UPDATE = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from torchrec_ext.triton_kernels import embedding_update as eu

kernel = eu._fused_update_bwd_kernel
floats = {"lr", "eps", "lerp_weight", "beta2", "one_minus_beta2", "adam_step_size", "sqrt_bc2", "weight_decay",
          "adamw_decay", "lr_power", "l1", "two_l2", "beta"}
pointers = {"grad_ptr": "*fp32", "weights_ptr": "*fp32", "weights16_ptr": "*fp16", "weightsbf_ptr": "*bf16",
            "state1_ptr": "*fp32", "state2_ptr": "*fp32", "psw_ptr": "*fp32", "table_dtypes_ptr": "*i32",
            "feature_mean_ptr": "*i32"}
base = dict(OPTIMIZER=0, FTRL_POWER=0, POOLED=True, HAS_WEIGHTS=False, HAS_WEIGHT_DECAY=False, HAS_DTYPES=True,
            STOCHASTIC=True, BLOCK_N=16, BLOCK_D=64)
out = {}
for variant in json.loads(sys.argv[1]):  # {"const": ..., "step_term": "i32"|"i64", "grad": "*fp32"|..., "num_warps"}
    const = dict(base, **variant.get("const", {}))
    signature = {}
    for name in kernel.arg_names:
        if name in const:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = pointers.get(name, "*i64")
        else:
            signature[name] = "fp32" if name in floats else "i32"
    signature["step_term"] = variant.get("step_term", "i64")
    signature["grad_ptr"] = variant.get("grad", "*fp32")
    src = ASTSource(fn=kernel, signature=signature,
                    constexprs={(kernel.arg_names.index(n),): v for n, v in const.items()})
    try:
        triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": variant.get("num_warps", 2)})
        out[json.dumps(variant, sort_keys=True)] = "ok"
    except Exception as e:  # noqa: BLE001 - reported per variant
        out[json.dumps(variant, sort_keys=True)] = str(e).strip().splitlines()[-1]
print(json.dumps(out))
"""


def test_fused_update_compiles_for_sm90_whatever_type_the_step_term_gets():
    """Stochastic rounding's step term is a Python int, which Triton's launcher types by its value
    (i32 below 2**31, i64 above, u64 from 2**63): the kernel must compile for every type the
    host can pass, and the host passes it signed (never u64). Without a GPU, on sm_90."""
    if _IN_CHILD:
        pytest.skip("the compile runs in its own child process")
    _need_triton_installed()

    from torchrec_ext.triton_kernels.embedding_update import _step_term

    terms = [_step_term(step) for step in (1, 2, 3, 1 << 20, (1 << 40) + 7)]
    assert all(-(2**63) <= t < 2**63 for t in terms) and any(t < 0 for t in terms)
    got = _compile_for_sm90(_SM90_COMPILE_UPDATE, [{"step_term": "i32"}, {"step_term": "i64"}])
    assert list(got.values()) == ["ok", "ok"], got


def _update_variants(full: bool) -> list[dict]:
    """The fused update's specialisations as ``fused_update`` launches them: every optimizer (FTRL
    at its three powers), with and without coupled weight decay where it has one, pooled with or
    without per-sample weights or sequence, float32 tables only or mixed dtypes rounded to nearest
    or stochastically. In CI each (optimizer, decay) meets each input kind and each dtype kind once
    (a Latin square, 36 compiles); all 108 with TORCHREC_EXT_FULL_MATRIX=1. Plus the block widths
    and warps of the widest rows, and a bfloat16 gradient."""
    from torchrec_ext.triton_kernels import embedding_update as eu

    optimizers = [("sgd", 0), ("adagrad", 0), ("rowwise_adagrad", 0), ("adam", 0), ("adamw", 0)]
    optimizers += [("ftrl", power) for power in (eu._FTRL_SQRT, eu._FTRL_ONE, eu._FTRL_POW)]
    inputs = [dict(POOLED=True, HAS_WEIGHTS=True), dict(POOLED=True, HAS_WEIGHTS=False), dict(POOLED=False)]
    dtypes = [
        dict(HAS_DTYPES=False, STOCHASTIC=False),
        dict(HAS_DTYPES=True, STOCHASTIC=False),
        dict(HAS_DTYPES=True, STOCHASTIC=True),
    ]
    variants = []
    for name, power in optimizers:
        opt = eu.OPTIMIZERS[name]
        for decay in (False, True) if name not in ("adamw", "ftrl") else (False,):
            first = dict(OPTIMIZER=opt, FTRL_POWER=power, HAS_WEIGHT_DECAY=decay)
            pairs = (
                [(i, d) for i in range(3) for d in range(3)]
                if full
                else [(i, (i + len(variants)) % 3) for i in range(3)]
            )
            for i, d in pairs:
                variants.append({"const": {**first, **inputs[i], **dtypes[d]}})
    widest = dict(POOLED=True, HAS_WEIGHTS=False, HAS_DTYPES=True, STOCHASTIC=True)
    variants += [
        {"const": dict(widest, OPTIMIZER=eu.OPTIMIZERS["rowwise_adagrad"], BLOCK_N=4, BLOCK_D=1024), "num_warps": 8},
        {"const": dict(widest, OPTIMIZER=eu.OPTIMIZERS["adam"], BLOCK_N=16, BLOCK_D=256), "num_warps": 4},
        {"const": dict(widest, OPTIMIZER=eu.OPTIMIZERS["adagrad"]), "grad": "*bf16"},
    ]
    return variants


def test_fused_update_compiles_for_sm90_in_every_variant_it_launches():
    """The interpreter runs the kernels' Python, not Triton's compiler: a variant that would not
    compile (a type mix in a branch, a constexpr only the GPU takes) shows here, on sm_90, without
    a GPU."""
    if _IN_CHILD:
        pytest.skip("the compile runs in its own child process")
    _need_triton_installed()
    variants = _update_variants(FULL_MATRIX)
    got = _compile_for_sm90(_SM90_COMPILE_UPDATE, variants)
    assert len(got) == len(variants)
    assert {k: v for k, v in got.items() if v != "ok"} == {}


def test_every_kernel_launch_is_on_its_tensors_device():
    """Triton launches on the current CUDA device, whatever device the tensors are on: every
    launch in torchrec_ext/triton_kernels/ runs inside ``launching_on(device)``, which makes the
    tensors' device current when it is another (a module on cuda:1 while cuda:0 is current)."""
    import ast

    folder = os.path.join(_REPO, "torchrec_ext", "triton_kernels")
    launches, guarded = 0, 0
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".py"):
            continue
        with open(os.path.join(folder, name)) as f:
            tree = ast.parse(f.read())
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript):  # kernel[grid](...)
                launches += 1
                up = node
                while up in parents and not isinstance(up, ast.With):
                    up = parents[up]
                guarded += isinstance(up, ast.With) and any(
                    isinstance(item.context_expr, ast.Call)
                    and getattr(item.context_expr.func, "id", "") == "launching_on"
                    for item in up.items
                )
    assert launches == 3 and guarded == launches

    _need_triton()
    from torchrec_ext.triton_kernels.embedding_lookup import launching_on

    current = torch.cuda.current_device
    try:
        torch.cuda.current_device = lambda: 0
        assert isinstance(launching_on(torch.device("cuda", 1)), torch.cuda.device)
        for device in (torch.device("cuda", 0), torch.device("cpu")):
            assert not isinstance(launching_on(device), torch.cuda.device)
    finally:
        torch.cuda.current_device = current


@pytest.mark.parametrize("target", TARGETS)
def test_empty_inputs(target):
    device = _device(target)
    gen = torch.Generator().manual_seed(3)
    weights, table_offsets, table_dims, _ = _tables(gen)
    feature_table, feature_col, feature_mean, total_dim = _features()
    offsets = torch.zeros(len(FEATURE_TABLE) * 3 + 1, dtype=torch.int64)
    rows = torch.zeros(0, dtype=torch.int64)
    got = _lookup().pooled_lookup(
        *_on(device, weights, table_offsets, table_dims, feature_table, feature_col, feature_mean, rows, offsets),
        None,
        3,
        total_dim,
    )
    assert torch.equal(got.cpu(), torch.zeros(3, total_dim))
    got = _lookup().sequence_lookup(
        *_on(device, weights, table_offsets), 4, *_on(device, torch.tensor([0]), torch.tensor([0, 0]), rows)
    )
    assert got.shape == (0, 4)


# ---- fused backward + optimizer -------------------------------------------------------------

HPARAMS = {  # (lr, eps, beta1, beta2, weight_decay, lr_decay)
    "plain": (0.1, 1e-8, 0.9, 0.999, 0.0, 0.0),
    "decayed": (0.05, 1e-3, 0.3, 0.8, 0.01, 0.1),  # weight decay, lr decay, beta1 < 0.5 (other lerp formula)
}
# FTRL's (lr_power, l1, l2, beta) after those: TensorFlow's defaults (a square root), then a
# general power with all three regularisers (l1 zeroes some weights), then power 0.
FTRL_HPARAMS = {"plain": (-0.5, 0.0, 0.0, 0.0), "decayed": (-0.3, 0.2, 0.01, 0.5), "power0": (0.0, 0.05, 0.0, 0.0)}


def _hparams(optimizer, hp):
    return HPARAMS.get(hp, HPARAMS["plain"]) + (FTRL_HPARAMS[hp] if optimizer == "ftrl" else ())


def _states(optimizer, weights, caps, gen):
    if optimizer == "sgd":
        return []
    if optimizer == "adagrad":
        return [torch.rand(weights.numel(), generator=gen) * 0.1]
    if optimizer == "rowwise_adagrad":
        return [torch.rand(sum(caps), generator=gen) * 0.1]
    if optimizer == "ftrl":  # accumulator (> 0), linear
        return [
            torch.rand(weights.numel(), generator=gen) * 0.1 + 0.01,
            torch.randn(weights.numel(), generator=gen) * 0.1,
        ]
    return [torch.randn(weights.numel(), generator=gen) * 0.1, torch.rand(weights.numel(), generator=gen) * 0.01]


_UPDATE_CASES = [(o, hp) for o in ref.OPTIMIZERS for hp in (FTRL_HPARAMS if o == "ftrl" else HPARAMS)]


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("mode", ["pooled", "pooled_weighted", "sequence"])
@pytest.mark.parametrize("optimizer,hp", _UPDATE_CASES, ids=[f"{o}-{hp}" for o, hp in _UPDATE_CASES])
@pytest.mark.parametrize("dims", [DIMS, WIDE_DIMS], ids=["narrow", "wide"])
def test_fused_update(target, optimizer, mode, hp, dims):
    device = _device(target)
    gen = torch.Generator().manual_seed(list(ref.OPTIMIZERS).index(optimizer) * 10 + len(mode))
    weights, table_offsets, table_dims, state_row_offsets = _tables(gen, dims=dims)
    feature_table, feature_col, feature_mean, total_dim = _features(dims=dims)
    states = _states(optimizer, weights, CAPS, gen)
    # Copies: on CPU .to() would return the very tensors the reference updates in place.
    weights_k, states_k = weights.to(device, copy=True), [s.to(device, copy=True) for s in states]
    update = _update()
    batch_size = 3
    for step in (1, 2, 3):
        rows, offsets, psw, value_table = _bags(gen, batch_size, weighted=mode == "pooled_weighted")
        unique_rows, unique_table, inverse = _dedup(rows, value_table, gen)
        if mode == "sequence":
            grad = torch.randn(rows.numel(), max(dims), generator=gen)
            offsets = psw = None
        else:
            grad = torch.randn(batch_size, total_dim, generator=gen)
        args = (
            table_offsets,
            table_dims,
            state_row_offsets,
            unique_rows,
            unique_table,
            inverse,
            offsets,
            psw,
            feature_col,
            feature_mean,
        )
        tail = (batch_size, optimizer, _hparams(optimizer, hp), step)
        ref.fused_update(grad, weights, states, *args, *tail)
        # The int id of the optimizer works as well as its name.
        opt = ref.OPTIMIZERS[optimizer] if step == 2 else optimizer
        update.fused_update(
            grad.to(device), weights_k, states_k, *_on(device, *args), batch_size, opt, _hparams(optimizer, hp), step
        )
        torch.testing.assert_close(weights_k.cpu(), weights, msg=lambda m: f"weights after step {step}: {m}")
        for i, (got, want) in enumerate(zip(states_k, states)):
            torch.testing.assert_close(got.cpu(), want, msg=lambda m: f"state {i} after step {step}: {m}")


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("layout", ["broadcast", "strided"])
def test_fused_update_non_contiguous_grad(target, layout):
    """Gradients of sum() (a broadcast row, stride 0) or every other column of a wider buffer."""
    device = _device(target)
    gen = torch.Generator().manual_seed(13)
    weights, table_offsets, table_dims, state_row_offsets = _tables(gen)
    feature_table, feature_col, feature_mean, total_dim = _features()
    states = _states("adagrad", weights, CAPS, gen)
    weights_k, states_k = weights.to(device, copy=True), [s.to(device, copy=True) for s in states]
    rows, offsets, psw, value_table = _bags(gen, 3, weighted=True)
    unique_rows, unique_table, inverse = _dedup(rows, value_table, gen)
    if layout == "broadcast":
        grad = torch.randn(1, total_dim, generator=gen).expand(3, total_dim)
    else:
        grad = torch.randn(3, 2 * total_dim, generator=gen)[:, ::2]
    args = (
        table_offsets,
        table_dims,
        state_row_offsets,
        unique_rows,
        unique_table,
        inverse,
        offsets,
        psw,
        feature_col,
        feature_mean,
        3,
        "adagrad",
        HPARAMS["decayed"],
        1,
    )
    ref.fused_update(grad, weights, states, *args)
    _update().fused_update(grad.to(device), weights_k, states_k, *_on(device, *args[:10]), *args[10:])
    torch.testing.assert_close(weights_k.cpu(), weights)
    torch.testing.assert_close(states_k[0].cpu(), states[0])


@pytest.mark.parametrize("target", TARGETS)
def test_fused_update_untouched_rows_and_skipped_rows(target):
    """Rows no value touches, and unique rows of -1, keep their weights and states bit for bit."""
    device = _device(target)
    gen = torch.Generator().manual_seed(5)
    weights, table_offsets, table_dims, state_row_offsets = _tables(gen)
    states = _states("adam", weights, CAPS, gen)
    before = [weights.clone()] + [s.clone() for s in states]
    # Copies: on CPU .to() would return the very tensors the reference updates in place.
    weights_k, states_k = weights.to(device, copy=True), [s.to(device, copy=True) for s in states]
    unique_rows, unique_table = torch.tensor([-1, 2, -1]), torch.tensor([0, 1, 2])
    inverse = torch.tensor([0, 1, 2, 1])
    grad = torch.randn(4, 16, generator=gen)
    args = (
        table_offsets,
        table_dims,
        state_row_offsets,
        unique_rows,
        unique_table,
        inverse,
        None,
        None,
        torch.tensor([0]),
        torch.tensor([False]),
    )
    _update().fused_update(grad.to(device), weights_k, states_k, *_on(device, *args), 1, "adam", HPARAMS["plain"], 1)
    touched = torch.zeros(weights.numel(), dtype=torch.bool)
    start = int(table_offsets[1]) + 2 * 12
    touched[start : start + 12] = True
    for got, want in zip([weights_k] + states_k, before):
        assert torch.equal(got.cpu()[~touched], want[~touched])
        assert not torch.equal(got.cpu()[touched], want[touched])


def test_optimizer_ids_match_reference():
    assert _update().OPTIMIZERS == ref.OPTIMIZERS
    with pytest.raises(ValueError, match="optimizer must be one of"):
        _update().fused_update(
            torch.zeros(1, 4),
            torch.zeros(4),
            [],
            torch.tensor([0]),
            torch.tensor([4]),
            torch.tensor([0]),
            torch.tensor([0]),
            torch.tensor([0]),
            torch.tensor([0]),
            None,
            None,
            torch.tensor([0]),
            torch.tensor([False]),
            1,
            "lamb",
            HPARAMS["plain"],
            1,
        )


@pytest.mark.parametrize("target", TARGETS)
def test_new_vectors_are_refused_by_the_gpu_kernels(target):
    # The modules write new rows at lookup time on GPUs; the kernels say so if handed new_vectors.
    device = _device(target)
    on = lambda *ts: _on(device, *ts)
    weights, block = torch.zeros(8, device=device), [torch.zeros(1, 4, device=device)]
    layout = on(torch.tensor([0]), torch.tensor([4]), torch.tensor([0]), torch.tensor([0]), torch.tensor([False]))
    with pytest.raises(ValueError, match="CPU kernels only"):
        _lookup().pooled_lookup(weights, *layout, *on(torch.tensor([-2]), torch.tensor([0, 1])), None, 1, 4, block)
    with pytest.raises(ValueError, match="CPU kernels only"):
        _lookup().sequence_lookup(
            weights, *on(torch.tensor([0])), 4, *on(torch.tensor([0]), torch.tensor([0, 1]), torch.tensor([-2])), block
        )
    with pytest.raises(ValueError, match="CPU kernels only"):
        _update().fused_update(
            torch.zeros(1, 4, device=device),
            weights,
            [],
            *on(
                torch.tensor([0]),
                torch.tensor([4]),
                torch.tensor([0]),
                torch.tensor([0]),
                torch.tensor([0]),
                torch.tensor([0]),
            ),
            None,
            None,
            *on(torch.tensor([0]), torch.tensor([False])),
            1,
            "sgd",
            HPARAMS["plain"],
            1,
            block,
            on(torch.tensor([0]))[0],
            [],
        )


# ---- half-precision rows: float16 / bfloat16 tables, mixed with float32 ones in one call -----


def _half():
    import test_half_rows_ops  # the CPU kernels' half-row cases (layouts, updates, values)

    return test_half_rows_ops


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", ["fp16", "bf16", "mixed"])
def test_lookups_of_half_tables(target, name):
    device, half = _device(target), _half()
    gen = torch.Generator().manual_seed(21)
    case, _, _ = half._pooled_case(half.DTYPE_SETS[name], True, gen)
    want = ref.pooled_lookup(**case)
    on = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in case.items()}
    torch.testing.assert_close(_lookup().pooled_lookup(**on).cpu(), want)
    dtypes = half.DTYPE_SETS[name][:2]
    weights, table_offsets, _, table_dtypes, _ = half._layout([6, 9], [7, 7], dtypes, gen)
    feature_table, fvo = torch.tensor([1, 0, 1]), torch.tensor([0, 4, 4, 11])
    rows = (torch.rand(11, generator=gen) * 6).long()
    rows[[2, 7]] = -1
    want = ref.sequence_lookup(weights, table_offsets, 7, feature_table, fvo, rows, (), table_dtypes)
    got = _lookup().sequence_lookup(
        *_on(device, weights, table_offsets), 7, *_on(device, feature_table, fvo, rows), (), table_dtypes.to(device)
    )
    assert torch.equal(got.cpu(), want)


# In CI: every optimizer on mixed fp16/bf16 tables, and on each single dtype Adagrad and FTRL (whose
# state reads the stored, rounded weight), both roundings; all 36 with TORCHREC_EXT_FULL_MATRIX=1
# (scripts/gpu_check.sh sets it).
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize(
    "name, optimizer, rounding",
    ci_subset(
        itertools.product(["fp16", "bf16", "mixed"], list(ref.OPTIMIZERS), ["nearest", "stochastic"]),
        lambda name, optimizer, rounding: name == "mixed" or optimizer in ("adagrad", "ftrl"),
    ),
)
def test_fused_update_of_half_tables(target, name, optimizer, rounding):
    device, half = _device(target), _half()
    gen = torch.Generator().manual_seed(len(name) + list(ref.OPTIMIZERS).index(optimizer))
    grad, weights, states, common = half._update_case(half.DTYPE_SETS[name], optimizer, gen)
    if rounding == "stochastic":
        common["rounding_seeds"] = torch.tensor([11, 0, 33])
    w_k, s_k = weights.to(device, copy=True), [s.to(device, copy=True) for s in states]
    on = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in common.items()}
    for step in (1, 2):
        ref.fused_update(grad, weights, states, optimizer=optimizer, step=step, **common)
        _update().fused_update(grad.to(device), w_k, s_k, optimizer=optimizer, step=step, **on)
    dtypes = half.DTYPE_SETS[name]
    got = ref._table_rows(w_k.cpu(), common["table_offsets"], common["table_dims"], half.CAPS, dtypes)
    want = ref._table_rows(weights, common["table_offsets"], common["table_dims"], half.CAPS, dtypes)
    for a, b, dtype in zip(got, want, dtypes):
        torch.testing.assert_close(a.float(), b.float(), **half._ulp_tolerance(dtypes))
        if dtype != torch.float32:
            assert (a.float() == b.float()).float().mean() > 0.97
    # FTRL's state reads the stored weight, which may round one ulp apart (the 3% above): its
    # state then differs by that ulp times sigma.
    state_tol = dict(rtol=1e-3, atol=1e-5) if optimizer == "ftrl" else dict(rtol=1e-4, atol=1e-6)
    for a, b in zip(s_k, states):
        torch.testing.assert_close(a.cpu(), b, **state_tol)


def _sgd_lr1_from_zeros(kernel, x, dtype, ids, seed, step, device):
    """Rows of zeros stepped by SGD with lr 1 and gradient -x with ``kernel`` (a fused_update):
    the stored row is the rounding of x itself (no arithmetic rounding before it)."""
    n, dim = x.shape
    weights = torch.zeros(ref.table_words(n, dim, dtype), device=device)
    kernel(
        -x.contiguous().to(device),
        weights,
        [],
        *_on(
            device,
            torch.tensor([0]),
            torch.tensor([dim]),
            torch.tensor([0]),
            torch.arange(n),
            torch.zeros(n, dtype=torch.int64),
            torch.arange(n),
        ),
        None,
        None,
        *_on(device, torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.bool)),
        0,
        ref.OPTIMIZERS["sgd"],
        (1.0, 0, 0, 0, 0, 0),
        step,
        table_dtypes=torch.tensor([ref.dtype_code(dtype)], device=device),
        unique_ids=ids.to(device),
        rounding_seeds=None if seed is None else torch.tensor([seed], device=device),
    )
    return weights.cpu().view(dtype)[: n * dim].view(n, dim)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_stochastic_rounding_of_the_gpu_kernel_is_the_reference_bit_for_bit(target, dtype):
    """Rows of zeros stepped by SGD with lr 1 and gradient -x: the kernel stores exactly round(x)."""
    device, half = _device(target), _half()
    x, ids = half.VALUES, torch.tensor([0, -1, 2**63 - 1, -(2**63), 12345] + list(range(60)))
    n, dim = ids.numel(), x.numel()
    for seed, step in ((None, 1), (99, 1), (99, 6)):
        got = _sgd_lr1_from_zeros(_update().fused_update, x.expand(n, dim), dtype, ids, seed, step, device)
        bits = None if seed is None else ref.rounding_bits(ids, dim, seed, step)
        want = ref.round_to_storage(x.expand(n, dim), dtype, bits)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (seed, step)


# In CI one row width per dtype (the interpreter takes ~1 s a call); all with TORCHREC_EXT_FULL_MATRIX=1.
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize(
    "dtype, dim",
    ci_subset(
        itertools.product([torch.float16, torch.bfloat16], [1, 7, 16, 17, 33]),
        lambda dtype, dim: (dtype, dim) in ((torch.float16, 7), (torch.bfloat16, 17)),
    ),
)
def test_stochastic_rounding_of_the_gpu_kernel_is_the_cpu_kernels_at_every_row_width(target, dtype, dim):
    """The Triton kernel stores the C++ CPU kernel's bits (csrc/half_rows.h: the rows the CPU's
    vector loops write in whole blocks and tails) for values of every magnitude (normal,
    float16-subnormal, below 2^-24, near the largest finite value) and the specials; the same
    seed and step give the same bits twice, another step or seed other bits; NaN stays NaN."""
    from torchrec_ext import ops

    device = _device(target)
    gen = torch.Generator().manual_seed(dim)
    n = 24
    x = torch.randn(n, dim, generator=gen) * 10.0 ** torch.randint(-10, 6, (n, dim), generator=gen).float()
    specials = torch.tensor([float("inf"), -float("inf"), float("nan"), 65519.0, -(2.0**-25), 2.0**-24, 0.0])
    k = n * dim // 4  # a quarter specials
    x.view(-1)[torch.randperm(n * dim, generator=gen)[:k]] = specials[torch.randint(0, 7, (k,), generator=gen)]
    ids = torch.arange(n) * 101 - 7
    nan = x.isnan()

    def same_bits(a, b):
        return torch.equal(a.isnan(), nan) and torch.equal(a[~nan].view(torch.int16), b[~nan].view(torch.int16))

    for seed, step in ((77, 4), (77, 5), (None, 4)):
        got = _sgd_lr1_from_zeros(_update().fused_update, x, dtype, ids, seed, step, device)
        want = _sgd_lr1_from_zeros(ops.fused_update, x, dtype, ids, seed, step, torch.device("cpu"))
        assert same_bits(got, want), (seed, step)
        if step == 4 and seed is not None:
            first = got
            again = _sgd_lr1_from_zeros(_update().fused_update, x, dtype, ids, seed, step, device)
            assert same_bits(again, got)
        elif seed is not None:  # the next step: other bits somewhere (not where x is on the grid)
            assert not same_bits(got, first)


@pytest.mark.parametrize("target", TARGETS)
def test_fused_update_derives_its_layout_once_per_layout_with_the_same_bits(target, monkeypatch):
    """What the update derives from the layout (capacities, element-wise state offsets, int32 dtype
    codes: ~20 small ops) is computed once per layout, as the storage hands the same layout tensors
    until a growth makes new ones: the update writes the same bits with the layout cached as with
    fresh copies of it each call (derived anew), and a layout changed in place is derived again."""
    device, half, upd = _device(target), _half(), _update()
    gen = torch.Generator().manual_seed(5)
    grad, weights, states, common = half._update_case(half.DTYPE_SETS["mixed"], "adam", gen)
    common["rounding_seeds"] = torch.tensor([11, 0, 33])
    on = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in common.items()}
    cached = [weights.to(device, copy=True), [s.to(device, copy=True) for s in states]]
    fresh = [weights.to(device, copy=True), [s.to(device, copy=True) for s in states]]
    for step in (1, 2, 3):
        upd.fused_update(grad.to(device), *cached, optimizer="adam", step=step, **on)
        anew = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in on.items()}
        upd.fused_update(grad.to(device), *fresh, optimizer="adam", step=step, **anew)
    assert torch.equal(cached[0].view(torch.int32), fresh[0].view(torch.int32))
    assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(cached[1], fresh[1]))

    monkeypatch.setattr(upd, "_fused_update_bwd_kernel", _no_launch())
    inputs = (grad.to(device), *cached)
    with _aten_ops() as warm:
        upd.fused_update(*inputs, optimizer="adam", step=4, **on)
    on["table_offsets"].add_(0)  # changed in place (its version): derived again
    with _aten_ops() as changed:
        upd.fused_update(*inputs, optimizer="adam", step=4, **on)
    derived = {"cumsum.default", "cat.default", "where.self", "floor_divide.default"}
    assert not derived & set(warm.names) and derived <= set(changed.names), (warm.names, changed.names)
    assert len(warm.names) <= len(changed.names) - 12


# ---- the sequence lookup's tile: values x columns, fewer elements a thread for wide dims -------

# Aligned (multiples of 16: Triton knows row * dim is) and unaligned dims, narrow to two blocks' worth.
SEQUENCE_DIMS = [4, 6, 12, 16, 30, 32, 60, 64, 100, 128, 200, 256]


def _session14_sequence_tile(dim):
    """The sequence lookup's tile before the wide-tile change (32 elements a thread from dim 65)."""
    block_d = min(triton_next_pow2(dim), 256)
    block_n = max(1, min(32, 4096 // block_d))
    return block_d, block_n, 4 if block_d * block_n >= 2048 else 2


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_sequence_lookup_tiles_are_bit_for_bit(target, dtype, monkeypatch):
    device, lookup, half = _device(target), _lookup(), _half()
    for dim in SEQUENCE_DIMS:
        gen = torch.Generator().manual_seed(dim)
        # The first table one row of an odd dim long: the second's first word is unaligned.
        weights, table_offsets, _, table_dtypes, _ = half._layout([7, 5], [dim, dim], [dtype, dtype], gen)
        feature_table, lengths = torch.tensor([1, 0, 1]), torch.tensor([5, 0, 19])  # 19: several blocks
        fvo = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        rows = (torch.rand(int(fvo[-1]), generator=gen) * 6).long() - 1  # some -1
        codes = None if dtype == torch.float32 else table_dtypes
        want = ref.sequence_lookup(weights, table_offsets, dim, feature_table, fvo, rows, (), codes)
        args = (*_on(device, weights, table_offsets), dim, *_on(device, feature_table, fvo, rows), ())
        on_codes = None if codes is None else codes.to(device)
        got = lookup.sequence_lookup(*args, on_codes).cpu()
        assert torch.equal(got, want), (dim, dtype)
        with monkeypatch.context() as m:
            m.setattr(lookup, "_sequence_blocks", _session14_sequence_tile)
            before = lookup.sequence_lookup(*args, on_codes).cpu()
        assert torch.equal(got, before), (dim, dtype)


# Compiles the sequence kernel for sm_90 at the tile sequence_lookup launches for (dim, half tables
# or not), ``dim`` hinted divisible by 16 where it is (as Triton's launcher specializes it), and
# prints the registers a thread takes, its warps and the bytes it spills.
_SM90_SEQUENCE_REGISTERS = r"""
import json, sys
sys.path.insert(0, "benchmarks")
from sm90 import compile_for_sm90, registers_and_spills
from torchrec_ext.triton_kernels import embedding_lookup as el

kernel = el._sequence_lookup_fwd_kernel
pointers = ["*fp32", "*fp16", "*bf16", "*i64", "*i32", "*i64", "*i64", "*i64", "*fp32"]
signature = dict(zip(kernel.arg_names, pointers), dim="i32")
out = {}
for dim, has_dtypes in json.loads(sys.argv[1]):
    block_d, block_n, num_warps = el._sequence_blocks(dim)
    const = dict(HAS_DTYPES=has_dtypes, BLOCK_N=block_n, BLOCK_D=block_d)
    compiled = compile_for_sm90(kernel, signature, const, num_warps, aligned=("dim",) if dim % 16 == 0 else ())
    registers, spilled = registers_and_spills(compiled)
    out[f"{dim},{has_dtypes}"] = [registers, num_warps, spilled]
print(json.dumps(out))
"""


def test_sequence_lookup_of_wide_tables_stays_within_96_registers():
    """At 32 elements a thread (one scalar load each where dim is not a multiple of 16) wide dims
    took 128 registers a thread on sm_90 and 196 with half tables (dim 100), 104 at 16 (dim 30
    and 60, half tables); the tile choice gives those fewer elements a thread. Each tile must
    compile within 96 registers, unspilled (sm_90, without a GPU)."""
    if _IN_CHILD:
        pytest.skip("the compile runs in its own child process")
    _need_triton_installed()
    # (dim, half tables): unaligned wide dims, aligned ones, and a narrow one that keeps its tile.
    variants = [(30, True), (60, True), (100, True), (100, False), (128, True), (200, True), (256, True), (12, True)]
    got = _compile_for_sm90(_SM90_SEQUENCE_REGISTERS, variants)
    for key, (registers, num_warps, spilled) in got.items():
        assert registers <= 96 and spilled == 0, (key, registers, num_warps, spilled)


@pytest.mark.parametrize("target", TARGETS)
def test_lookups_derive_their_layout_once_per_layout_with_the_same_bits(target, monkeypatch):
    """The lookups' device copies of the layout and their int32 dtype codes (a cast launch or two a
    call) are made once per layout, through the cache fused_update shares (layout_cache.py): the
    same bits with the layout cached as with fresh copies of it each call, and a layout changed in
    place, or a new one (a growth), derived again."""
    from torchrec_ext import device_sync

    device, lookup = _device(target), _lookup()
    gen = torch.Generator().manual_seed(9)
    case = _tiling_case([64, 32, 64], TILING_DTYPES["mixed"], 5, True, gen, 0)
    # int32 layout tensors: each derivation casts (a `_to_copy` the count below sees).
    for name in ("table_offsets", "table_dims", "table_dtypes"):
        case[name] = case[name].to(torch.int32)
    on = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in case.items()}
    for name in ("table_offsets", "table_dims", "feature_table", "feature_col"):
        device_sync.mirror(on[name], case[name])
    fvo, seq_rows, seq_tables = torch.tensor([0, 4, 4, 11]), torch.arange(11) % 9, torch.tensor([1, 0, 2])
    device_sync.mirror(fvo, fvo.clone())

    def sequence(layout):
        return lookup.sequence_lookup(
            on["weights"],
            layout["table_offsets"],
            32,
            *_on(device, seq_tables, fvo, seq_rows),
            (),
            layout["table_dtypes"],
        )

    for _ in range(3):
        anew = {k: (v.clone() if k.startswith("table_") else v) for k, v in on.items()}
        for name in ("table_offsets", "table_dims"):
            device_sync.mirror(anew[name], case[name])
        assert torch.equal(lookup.pooled_lookup(**on).view(torch.int32), lookup.pooled_lookup(**anew).view(torch.int32))
        assert torch.equal(sequence(on).view(torch.int32), sequence(anew).view(torch.int32))

    monkeypatch.setattr(lookup, "_pooled_lookup_fwd_kernel", _no_launch())
    monkeypatch.setattr(lookup, "_sequence_lookup_fwd_kernel", _no_launch())

    def casts(call):
        with _aten_ops() as ops:
            call()
        return ops.names.count("_to_copy.default")

    assert casts(lambda: lookup.pooled_lookup(**on)) == 0 and casts(lambda: sequence(on)) == 0
    on["table_offsets"].add_(0)  # changed in place (its version): derived again
    assert casts(lambda: lookup.pooled_lookup(**on)) >= 2 and casts(lambda: sequence(on)) >= 1
    grown = dict(on, table_offsets=on["table_offsets"].clone(), table_dtypes=on["table_dtypes"].clone())
    device_sync.mirror(grown["table_offsets"], case["table_offsets"])
    assert casts(lambda: lookup.pooled_lookup(**grown)) >= 2 and casts(lambda: sequence(grown)) >= 1
    assert casts(lambda: lookup.pooled_lookup(**grown)) == 0 and casts(lambda: sequence(grown)) == 0


def _aten_ops():
    """A dispatch mode recording the names of the aten ops run under it (``.names``)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.__name__)
            return func(*args, **(kwargs or {}))

    return _Ops()


def _no_launch():
    """A stand-in for a Triton kernel: launches do nothing, so only the wrapper's own ops run."""

    class _NoLaunch:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: None

    return _NoLaunch()


@contextlib.contextmanager
def _the_gpu_kernels_on_cpu(tables, calls):
    """Within it, ``tables`` (a module's ``_tables``) run the module's GPU path on CPU tensors: the
    lookups and the fused update by the Triton kernels (interpreted; ``calls`` counts each one's
    calls), new rows written by the lookup in one call for all tables, the upserts batched, checks
    deferred as a GPU defers them."""
    from torchrec_ext import device_sync, ops

    lookup, update = _lookup(), _update()
    kernels = {
        "pooled_lookup": lookup.pooled_lookup,
        "sequence_lookup": lookup.sequence_lookup,
        "fused_update": update.fused_update,
    }

    def counted(name, kernel):
        def call(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return kernel(*args, **kwargs)

        return call

    saved = {name: getattr(ops, name) for name in kernels} | {"defer_on_cpu": device_sync.defer_on_cpu}
    tables.defer_new_rows, tables.flat_init, tables.batched_upsert = False, True, True
    try:
        for name, kernel in kernels.items():
            setattr(ops, name, counted(name, kernel))
        device_sync.defer_on_cpu = True
        yield
    finally:
        device_sync.defer_on_cpu = saved.pop("defer_on_cpu")
        for name, op in saved.items():
            setattr(ops, name, op)


@pytest.mark.skipif(not _IN_CHILD, reason="runs under the interpreter, in test_interpreter_run's child")
@pytest.mark.parametrize(
    "optimizer, kwargs",
    [
        ("adagrad", {}),
        ("rowwise_adagrad", {}),
        ("adam", {}),
        ("adam", {"betas": (0.3, 0.99)}),  # 1 - beta1 >= 0.5: torch.lerp's other formula
    ],
)
def test_a_mixed_dtype_module_on_the_gpu_kernels_trains_as_on_the_cpu_kernels(optimizer, kwargs):
    """The module's GPU path, short of a GPU: FP32, FP16 and BF16 tables (stochastic rounding) in
    one lookup and one fused update, one table growing, trained by the Triton kernels as the same
    module by the C++ ones. The interpreter's float32 arithmetic is numpy's (no fused multiply-add)
    and the C++ kernels are built without contraction, so rows and optimizer states agree bit for
    bit, and outputs but for the last bits of float32 sums taken in another order (on a GPU, FMAs
    move last bits of rows too: tests/test_storage_cuda.py allows a rounding). Row-wise Adagrad's
    state, a row's mean of squared gradients, is such a sum too: there, within a rounding."""

    def module():
        configs = bag_configs()
        configs[1].initial_capacity = 64  # grows to 128 and 256 as ~300 ids arrive
        torch.manual_seed(0)
        return DynamicEmbeddingBagCollection(configs, optimizer=optimizer, optimizer_kwargs={"lr": 0.05, **kwargs})

    on_cpu_kernels, on_gpu_kernels = module(), module()
    want = train_on_stream(on_cpu_kernels, torch.device("cpu"), steps=6)
    calls = {}
    with _the_gpu_kernels_on_cpu(on_gpu_kernels._tables, calls):
        got = train_on_stream(on_gpu_kernels, torch.device("cpu"), steps=6)
    assert calls == {"pooled_lookup": 6, "fused_update": 6}  # every step's lookup and update by Triton
    assert on_gpu_kernels._tables.meta[1].capacity == on_cpu_kernels._tables.meta[1].capacity > 64
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-8)
    rows, rows_wanted = rows_by_id(on_gpu_kernels), rows_by_id(on_cpu_kernels)
    dtypes = [torch.float32, torch.float16, torch.bfloat16]
    assert_rows_within_a_rounding(rows, rows_wanted, dtypes)
    if optimizer == "rowwise_adagrad":
        return
    for name, wanted in rows_wanted.items():
        assert rows[name].keys() == wanted.keys()
        for key, value in wanted.items():
            assert torch.equal(rows[name][key], value), (name, key)
