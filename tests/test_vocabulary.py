"""The vocabulary three ways: ``torchrec_ext.vocabulary`` / ``hashing`` (what production imports),
the test oracle ``torchrec_ext.reference`` (its own copies, written from the specification) and
the C++ kernels (enums and constants parsed from ``csrc/``). Each pair must agree, so a constant
changed in one place and not the others fails here instead of silently desynchronising a
checkpoint, a hash or a kernel's branch.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from torchrec_ext import hashing, ops, torch_kernels
from torchrec_ext import reference as ref
from torchrec_ext import vocabulary as voc
from torchrec_ext.modules import ftrl as ftrl_module

CSRC = Path(__file__).resolve().parents[1] / "csrc"


def _csrc(name: str) -> str:
    return (CSRC / name).read_text()


def _constexpr(source: str, name: str) -> int:
    """The value of ``constexpr <type> <name> = <int literal or 1 << n>;``."""
    m = re.search(rf"constexpr\s+[\w:]+\s+{name}\s*=\s*([^;]+);", source)
    assert m, f"{name} not found"
    value = m.group(1).strip().replace("ull", "").replace("u", "")
    shift = re.fullmatch(r"(\d+)\s*<<\s*(\d+)", value)
    return int(shift.group(1)) << int(shift.group(2)) if shift else int(value, 0)


def _enum(source: str, name: str) -> dict[str, int]:
    """``enum class <name> : int64_t { kA = 0, ... }`` as {"A": 0, ...} (comments dropped)."""
    m = re.search(rf"enum class {name}\s*:\s*int64_t\s*\{{(.*?)\}};", source, re.S)
    assert m, f"enum {name} not found"
    body = re.sub(r"//[^\n]*", "", m.group(1))
    return {k: int(v) for k, v in re.findall(r"k(\w+)\s*=\s*(\d+)", body)}


def _snake(camel: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", camel).lower()


# ----------------------------------------------------------------------------- vocabulary == reference


def test_policies_optimizers_initializers_agree_with_the_reference():
    assert list(voc.POLICIES) == list(ref.POLICIES)
    assert list(voc.POLICIES.values()) == list(range(len(ref.POLICIES)))
    assert voc.OPTIMIZERS == ref.OPTIMIZERS
    assert voc.OPTIMIZER_STATES == ref.OPTIMIZER_STATES
    assert voc.ROWWISE_STATE == ref.ROWWISE_STATE
    assert voc.HYPERPARAMS == ref.HYPERPARAMS
    assert voc.COMMON_HYPERPARAMS + voc.FTRL_HYPERPARAMS == ref.HYPERPARAMS
    assert voc.INITIALIZERS == ref.INITIALIZERS
    assert voc.INITIALIZER_NAMES == ref.INITIALIZER_NAMES
    assert voc.INITIALIZER_PARAM_COUNTS == ref.PARAM_COUNTS
    assert voc.TRUNC_NORMAL_ATTEMPTS == ref.TRUNC_NORMAL_ATTEMPTS
    assert voc.STORAGE_DTYPES == ref.STORAGE_DTYPES
    assert voc.BLOOM_COUNTER_MAX == ref.BLOOM_COUNTER_MAX
    # the states checked non-negative on load are states of their kind, and all squared ones
    assert all(state in voc.OPTIMIZER_STATES[kind] for kind, state in voc.SQUARED_STATES)
    assert {kind for kind, _ in voc.SQUARED_STATES} == set(voc.OPTIMIZERS) - {"sgd"}


def test_seeds_and_salts_agree_with_the_reference():
    assert voc.INIT_GOLDEN == ref.GOLDEN
    assert voc.ROUNDING_GOLDEN == ref.SR_GOLDEN
    assert voc.FALLBACK_GOLDEN == ref.FALLBACK_GOLDEN
    # The reference writes the bucket, stripe and route seeds inline in place() / route(): the
    # vocabulary's seeds must give the same buckets and owners.
    for key in [0, 1, -1, 2**63 - 1, -(2**63), 123456789, 0x5DEECE66D]:
        h = ref._fmix64((key & ref._MASK64) ^ voc.BUCKET_SEED)
        h2 = ref._fmix64(h ^ voc.STRIPE_SEED)
        for capacity in (1, 33, 4096, 3 * 2048 + 5):
            _, stripes = voc.table_geometry(capacity)
            assert ref.stripe_of(key, capacity) == ref._fastrange32(h2, stripes)
            assert ref.place(key, capacity)[2] == (h >> 57) % 127 + 1  # the tag
        for world in (1, 3, 8):
            assert ref.route(key, world) == ref._fastrange32(
                ref._fmix64((key & ref._MASK64) ^ voc.ROUTE_SEED) >> 32, world
            )


@pytest.mark.parametrize("capacity", [1, 31, 32, 33, 2047, 2048, 2049, 64 * 32 * 7 + 1, (1 << 16) * 64 * 32 * 2])
def test_geometry_and_layout_arithmetic_agree_with_the_reference(capacity):
    assert voc.table_geometry(capacity) == ref.geometry(capacity)
    assert voc.SLOTS_PER_BUCKET == ref.SLOTS
    assert voc.stash_slots(capacity) == ref.stash_slots(capacity)
    for dtype in voc.STORAGE_DTYPES:
        assert voc.dtype_code(dtype) == ref.dtype_code(dtype)
        for dim in (1, 3, 8):
            assert voc.table_words(capacity, dim, dtype) == ref.table_words(capacity, dim, dtype)
    assert voc.dense_state_offsets([capacity, 5, 7], [3, 2, 1]) == ref.dense_state_offsets([capacity, 5, 7], [3, 2, 1])


def test_hashing_agrees_with_the_reference():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(-(2**63), 2**63 - 1, (257,), dtype=torch.int64, generator=g)
    assert torch.equal(hashing.fmix64_tensor(ids), ref.fmix64_tensor(ids))
    for seed in (0, 1, -5, 2**63 - 1, -(2**63)):
        for name in ("", "t0", "user_id", "é"):
            assert hashing.table_seed(seed, name) == ref.table_seed(seed, name)
        assert hashing.rounding_seed(seed) == ref.rounding_seed(seed)
        assert hashing.fallback_seed(seed) == ref.fallback_seed(seed)
        assert hashing.fmix64(seed) == ref._fmix64(seed & ref._MASK64)
    seeds = torch.tensor([hashing.fallback_seed(s) for s in (3, -7, 11)], dtype=torch.int64).repeat_interleave(86)[:257]
    rows = torch.tensor([1, 5, 64], dtype=torch.int64).repeat_interleave(86)[:257]
    assert torch.equal(hashing.fallback_slots(ids, seeds, rows), ref.fallback_slots(ids, seeds, rows))


@pytest.mark.parametrize(
    "kind,params",
    [
        ("uniform", (-0.5, 0.25)),
        ("normal", (0.1, 2.0)),
        ("truncated_normal", (0.0, 1.0, -0.3, 0.4)),
        ("constant", (0.75,)),
    ],
)
def test_the_torch_initializer_draws_the_reference_vectors(kind, params):
    """torch_kernels' vectorised RNG (the init_rows CUDA kernel) is its own code, not the
    oracle's: it must draw the same bits, and take exactly the parameters the vocabulary says."""
    assert len(params) == voc.INITIALIZER_PARAM_COUNTS[kind] == len(voc.INITIALIZER_PARAMS[kind])
    ids = torch.tensor([0, 1, -3, 2**62, 977, -(2**63)], dtype=torch.int64)
    for dim in (1, 4, 7):
        got = torch_kernels.init_vectors(ids, dim, 12345, kind, params)
        assert torch.equal(got, ref.init_vectors(ids, dim, 12345, kind, params))


def test_the_ftrl_step_matches_the_reference():
    g = torch.Generator().manual_seed(1)
    w, grad = torch.randn(64, generator=g), torch.randn(64, generator=g)
    n, z = torch.rand(64, generator=g) + 0.1, torch.randn(64, generator=g)
    args = (0.05, -0.5, 0.01, 0.02, 0.1)
    mine = [t.clone() for t in (w, grad, n, z)]
    theirs = [t.clone() for t in (w, grad, n, z)]
    ftrl_module.ftrl_step(*mine, *args)
    ref.ftrl_step(*theirs, *args)
    for a, b in zip(mine, theirs):
        assert torch.equal(a, b)


def test_a_pending_row_reads_its_new_vector():
    """Rows PENDING_ROW_BASE - j read new vector j, in the oracle and in the C++ kernel."""
    assert voc.pending_row(0) == voc.PENDING_ROW_BASE == -2 and voc.pending_row(3) == -5
    assert torch.equal(voc.pending_row(torch.tensor([0, 2])), torch.tensor([-2, -4]))
    weights = torch.arange(8, dtype=torch.float32)  # one table [4, 2]
    new = [torch.tensor([[10.0, 11.0], [20.0, 21.0], [30.0, 31.0]])]
    rows = torch.tensor([1, voc.pending_row(2), voc.NO_ROW, voc.pending_row(0)], dtype=torch.int64)
    args = (weights, torch.tensor([0]), 2, torch.tensor([0]), torch.tensor([0, 4]), rows)
    want = torch.tensor([[2.0, 3.0], [30.0, 31.0], [0.0, 0.0], [10.0, 11.0]])
    assert torch.equal(ref.sequence_lookup(*args, new_vectors=new), want)
    assert torch.equal(ops.sequence_lookup(*args, new_vectors=new), want)


# ----------------------------------------------------------------------------- C++ == vocabulary


def test_hash_table_header_agrees():
    layout = _csrc("hash_table_layout.h")
    assert _constexpr(layout, "kSlotsPerBucket") == voc.SLOTS_PER_BUCKET
    assert _constexpr(layout, "kBucketsPerStripeTarget") == voc.BUCKETS_PER_STRIPE_TARGET
    assert _constexpr(layout, "kMaxStripes") == voc.MAX_STRIPES
    assert _constexpr(layout, "kStashSqrtPerBlock") == voc.STASH_SQRT_PER_BLOCK
    assert _constexpr(layout, "kBucketSeed") == voc.BUCKET_SEED
    assert _constexpr(layout, "kStripeSeed") == voc.STRIPE_SEED
    assert _constexpr(layout, "kRouteSeed") == voc.ROUTE_SEED
    assert {_snake(k): v for k, v in _enum(layout, "Policy").items()} == voc.POLICIES


def test_embedding_kernel_enums_and_constants_agree():
    # The embedding kernels, one file per op family, and the row storage headers they share.
    source = "\n".join(
        _csrc(name)
        for name in (
            "row_storage.h",
            "half_rows.h",
            "init_rows_math.h",
            "init_rows_cpu.cpp",
            "embedding_update_cpu.cpp",
        )
    )
    # kAdamW: the vocabulary spells it "adamw" (torch.optim.AdamW's name, lowered)
    assert {_snake(k).replace("adam_w", "adamw"): v for k, v in _enum(source, "Optim").items()} == voc.OPTIMIZERS
    assert {_snake(k): v for k, v in _enum(source, "Init").items()} == voc.INITIALIZERS
    storage = _enum(source, "Storage")
    assert [voc.STORAGE_DTYPES[v] for v in storage.values()] == [torch.float32, torch.float16, torch.bfloat16]
    assert list(storage) == ["Float", "Half", "BFloat16"]
    assert _constexpr(source, "kGolden") == voc.INIT_GOLDEN
    assert _constexpr(source, "kRoundingGolden") == voc.ROUNDING_GOLDEN
    assert _constexpr(source, "kTruncNormalAttempts") == voc.TRUNC_NORMAL_ATTEMPTS
    # init_rows' parameter count per kind: `need = kind == 3 ? 1 : kind == 2 ? 4 : 2`
    m = re.search(r"need = kind == (\d) \? (\d) : kind == (\d) \? (\d) : (\d);", source)
    assert m, "init_rows' parameter count not found"
    counts = {int(m.group(1)): int(m.group(2)), int(m.group(3)): int(m.group(4))}
    for name, kind in voc.INITIALIZERS.items():
        assert counts.get(kind, int(m.group(5))) == voc.INITIALIZER_PARAM_COUNTS[name], name
    # The half-precision rounding bounds are the reference's.
    assert _constexpr(source, "kBf16OverflowBoundary") == ref.BF16_OVERFLOW_BOUNDARY
    assert _constexpr(source, "kHalfOverflowBoundary") == ref.HALF_OVERFLOW_BOUNDARY
    assert _constexpr(source, "kHalfMax") == ref.HALF_MAX_BITS


def test_bloom_header_agrees():
    source = _csrc("bloom_layout.h")
    assert _constexpr(source, "kBloomCounterMax") == voc.BLOOM_COUNTER_MAX
    assert _constexpr(source, "kBloomMaxHashes") == voc.BLOOM_MAX_HASHES


def test_the_kernels_take_the_vocabulary_ids():
    """The ids are not only written alike: the C++ op reads them so. An ``Init`` id past the enum
    is refused; each id draws its kind's vectors from exactly its kind's parameter count, and one
    parameter fewer is refused."""
    table = torch.zeros(2, 3)
    with pytest.raises(RuntimeError, match="initializer kind"):
        ops.init_rows(table, torch.tensor([0]), torch.tensor([5]), 1, max(voc.INITIALIZERS.values()) + 1, (0.0, 1.0))
    for name, kind in voc.INITIALIZERS.items():  # each id takes exactly its parameter count
        params = (0.0, 1.0, -1.0, 1.0)[: voc.INITIALIZER_PARAM_COUNTS[name]]
        ops.init_rows(table, torch.tensor([0]), torch.tensor([5]), 1, kind, params)
        want = ref.init_vectors(torch.tensor([5]), 3, 1, name, params)[0]
        torch.testing.assert_close(table[0], want, rtol=1e-6, atol=1e-6)
        with pytest.raises(RuntimeError, match=f"needs {len(params)} parameters"):
            ops.init_rows(table, torch.tensor([0]), torch.tensor([5]), 1, kind, params[:-1])
