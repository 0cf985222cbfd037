"""Triton forward kernels of the embedding lookups: pooled (EmbeddingBagCollection) and sequence
(EmbeddingCollection), for every table and feature of a module in one launch each.

Storage convention (the same as torchrec_ext.reference and csrc/): all tables of a module live in
one flat buffer of 4-byte words ``weights`` (a float32 tensor); table t's [capacity_t, dim_t]
rows start at word ``table_offsets[t]``, packed in its storage dtype (``table_dtypes[t]``: 0
float32, 1 float16, 2 bfloat16; all float32 when None). The kernels take the buffer three times,
as float32, float16 and bfloat16 pointers (views of the same memory): a half table's element e
is at half-word ``2 * table_offsets[t] + e``. Rows are read as float32 and summed in float32.
A row of -1 means "no row" and reads as zeros. Bags are KJT-ordered: bag
``g = f * batch_size + b`` is sample b of feature f, its ids are ``rows[offsets[g]:offsets[g + 1]]``.

* ``pooled_lookup``: out[b, feature_col[f] : feature_col[f] + dim] is the sum of the rows of bag
  (f, b), each scaled by its per-sample weight when given, divided by the bag's length (-1 rows
  included) where ``feature_mean[f]``. Empty bags are zeros.
* ``sequence_lookup``: out[i] is the row of value i (zeros for -1); the values of feature f are
  ``[feature_value_offsets[f], feature_value_offsets[f + 1])`` and read table ``feature_table[f]``.

The public functions have the signatures and semantics of the references of the same name in
torchrec_ext/reference.py. Every offset is computed in int64: a flat buffer of several tables
easily passes 2**31 elements.

Loops over a bag's ids are ``while`` loops between the bag's own (loaded) bounds: they compile to
scf.while on a GPU and run in TRITON_INTERPRET=1 too, whereas ``range()`` with a non-constexpr
bound does not run in Triton 3.6's interpreter with NumPy 2.4 (even a scalar argument: the
interpreter holds it as a 1-element array, which int() refuses). It also means no host-side
maximum bag length (no device sync) and no idle iterations for short bags.
"""

import contextlib
from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from torchrec_ext import device_sync

from .layout_cache import LayoutCache


@triton.jit
def load_rows(w32_ptr, w16_ptr, wbf_ptr, base, offs, mask, dtype_code, HAS_DTYPES: tl.constexpr):
    """float32 values of the elements ``offs`` of a table starting at word ``base`` whose storage
    dtype is ``dtype_code`` (a scalar, one table per program, or a tensor that broadcasts with
    ``offs``, one table per row of the tile). Two loads an element, not one per dtype: float32,
    and the half's 16 bits (as float16; bfloat16 widened from its bits), which keeps the pooled
    kernel at 80 registers a thread where three loads took 95 (sm_90, dim 64 and 128)."""
    if HAS_DTYPES:
        v32 = tl.load(w32_ptr + base + offs, mask=mask & (dtype_code == 0), other=0.0)
        half = tl.load(w16_ptr + 2 * base + offs, mask=mask & (dtype_code != 0), other=0.0)
        vbf = (half.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
        return tl.where(dtype_code == 1, half.to(tl.float32), tl.where(dtype_code == 2, vbf, v32))
    else:
        return tl.load(w32_ptr + base + offs, mask=mask, other=0.0)


@triton.jit
def _per_slot(per_bag, BLOCK_L: tl.constexpr, BLOCK_B: tl.constexpr):
    """A [BLOCK_B] per-bag value as the [BLOCK_L * BLOCK_B] slots of the pooled kernel's tile
    (slot l * BLOCK_B + b is id l of bag b), broadcast: slots of one bag a thread holds share
    the bag's registers, where loading it per slot gave each its own copy."""
    return tl.reshape(tl.broadcast_to(per_bag[None, :], [BLOCK_L, BLOCK_B]), [BLOCK_L * BLOCK_B])


@triton.jit
def _pooled_lookup_fwd_kernel(
    weights_ptr,  # the flat buffer of all tables, as float32
    weights16_ptr,  # the same, as float16
    weightsbf_ptr,  # the same, as bfloat16
    table_offsets_ptr,  # [T] int: first word of each table
    table_dtypes_ptr,  # [T] int: storage dtype code of each table (HAS_DTYPES only)
    table_dims_ptr,  # [T] int
    feature_table_ptr,  # [F] int
    feature_col_ptr,  # [F] int: first output column of each feature
    feature_mean_ptr,  # [F] bool or int: nonzero = mean pooling, 0 = sum
    rows_ptr,  # [n] int: row of each value inside its table, -1 = none
    offsets_ptr,  # [F * batch_size + 1] int: bag boundaries
    psw_ptr,  # [n] per-sample weights (unused unless HAS_WEIGHTS)
    out_ptr,  # [batch_size, total_dim] float32
    num_bags,
    batch_size,
    total_dim,
    HAS_WEIGHTS: tl.constexpr,
    HAS_DTYPES: tl.constexpr,
    ALIGN: tl.constexpr,  # every table's dim and first word are multiples of it (vector loads)
    BLOCK_B: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One program per (BLOCK_B consecutive bags, block of BLOCK_D columns). Each loop step loads
    # the next BLOCK_L ids of every bag of the tile, then their BLOCK_B x BLOCK_L rows at once:
    # many independent row loads in flight per program (one bag per program left the memory
    # system idle while its few rows' dependent loads ran one after the other). Bags of one tile
    # may belong to different features, hence tables, dims and dtypes: all per-bag vectors.
    # Per-bag values in int32 where they fit (registers bound the warps per SM); addresses and
    # value positions in int64.
    #
    # The rows are gathered as a 2-D tile of BLOCK_L * BLOCK_B "slots" x BLOCK_D columns, slot
    # l * BLOCK_B + b holding id l of bag b, and summed over l as [BLOCK_L, BLOCK_B, BLOCK_D]. A
    # 3-D gather has two dims of no contiguity (bags, ids) and Triton's layout of it depends on
    # how the version breaks that tie: triton 3.6 gave a thread the ids of one bag, 3.7 of two
    # (80 and 106 registers at dim 64, half tables; up to 213 at ALIGN 1). One such dim leaves
    # no tie: both versions lay it out alike.
    pid_d = tl.program_id(1)
    d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    bags = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    bag_ok = bags < num_bags
    feature = bags // batch_size
    table = tl.load(feature_table_ptr + feature, mask=bag_ok, other=0).to(tl.int32)
    bag_dim = tl.load(table_dims_ptr + table, mask=bag_ok, other=0).to(tl.int32)
    bag_base = tl.load(table_offsets_ptr + table, mask=bag_ok, other=0).to(tl.int64)
    bag_start = tl.load(offsets_ptr + bags, mask=bag_ok, other=0).to(tl.int64)
    bag_end = tl.load(offsets_ptr + bags + 1, mask=bag_ok, other=0).to(tl.int64)
    # A column block past a bag's dim (the grid covers the widest table) reads nothing.
    bag_length = tl.where(bag_ok & (pid_d * BLOCK_D < bag_dim), bag_end - bag_start, 0)
    longest = tl.max(bag_length, axis=0)

    pos = tl.arange(0, BLOCK_L * BLOCK_B) // BLOCK_B  # each slot's id in its bag, at the first step
    start = _per_slot(bag_start, BLOCK_L, BLOCK_B)
    length = _per_slot(bag_length, BLOCK_L, BLOCK_B)
    # dim and base as multiples of ALIGN the compiler can see (the host checked every table;
    # tl.multiple_of does not pass a reshape): 16-byte loads of float32 rows from ALIGN 4, of
    # half rows at 8 (a half table's element e is at half-word 2 * base + e: 2 * base keeps it).
    dim = _per_slot(bag_dim // ALIGN, BLOCK_L, BLOCK_B) * ALIGN
    base = _per_slot(bag_base // ALIGN, BLOCK_L, BLOCK_B) * ALIGN
    if HAS_DTYPES:
        bag_code = tl.load(table_dtypes_ptr + table, mask=bag_ok, other=0)
        dtype_code = _per_slot(bag_code, BLOCK_L, BLOCK_B)[:, None]
    else:
        dtype_code = 0
    d_mask = d[None, :] < dim[:, None]  # [slots, D]

    # Software pipeline: the ids of step j + 1 are loaded before the rows of step j, so the id
    # loads' latency hides behind the row loads.
    in_bag = pos < length
    row = tl.load(rows_ptr + start + pos, mask=in_bag, other=-1).to(tl.int64)
    acc = tl.zeros([BLOCK_B, BLOCK_D], dtype=tl.float32)
    j = 0
    while j < longest:
        cur = j + pos
        present = in_bag & (row >= 0)  # -1 rows read as zeros
        nxt = cur + BLOCK_L
        next_in_bag = nxt < length
        next_row = tl.load(rows_ptr + start + nxt, mask=next_in_bag, other=-1).to(tl.int64)
        vals = load_rows(
            weights_ptr,
            weights16_ptr,
            weightsbf_ptr,
            base[:, None],
            (row * dim)[:, None] + d[None, :],
            present[:, None] & d_mask,
            dtype_code,
            HAS_DTYPES,
        )
        if HAS_WEIGHTS:
            w = tl.load(psw_ptr + start + cur, mask=present, other=0.0).to(tl.float32)
            vals = vals * w[:, None]
        acc += tl.sum(tl.reshape(vals, [BLOCK_L, BLOCK_B, BLOCK_D]), axis=0)
        row = next_row
        in_bag = next_in_bag
        j += BLOCK_L

    # Where each bag's sum lands, and its mean's divisor.
    sample = bags - feature * batch_size
    col = tl.load(feature_col_ptr + feature, mask=bag_ok, other=0)
    is_mean = tl.load(feature_mean_ptr + feature, mask=bag_ok, other=0)
    full = bag_end - bag_start
    # Mean divides by the bag's full length, -1 rows included; empty bags stay zero.
    scale = tl.where((is_mean != 0) & (full > 0), tl.maximum(full, 1).to(tl.float32), 1.0)
    acc = tl.div_rn(acc, scale[:, None])
    out = out_ptr + (sample.to(tl.int64) * total_dim + col)[:, None] + d[None, :]
    tl.store(out, acc, mask=bag_ok[:, None] & (d[None, :] < bag_dim[:, None]))


@triton.jit
def _sequence_lookup_fwd_kernel(
    weights_ptr,  # the flat buffer of all tables, as float32
    weights16_ptr,  # as float16
    weightsbf_ptr,  # as bfloat16
    table_offsets_ptr,  # [T] int
    table_dtypes_ptr,  # [T] int (HAS_DTYPES only)
    feature_table_ptr,  # [F] int
    feature_value_offsets_ptr,  # [F + 1] int: values of feature f
    rows_ptr,  # [n] int, -1 = none
    out_ptr,  # [n, dim] float32
    dim,
    HAS_DTYPES: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One program per (block of BLOCK_N values of one feature, feature, block of columns).
    pid_n = tl.program_id(0).to(tl.int64)
    feature = tl.program_id(1).to(tl.int64)
    pid_d = tl.program_id(2).to(tl.int64)

    start = tl.load(feature_value_offsets_ptr + feature).to(tl.int64)
    end = tl.load(feature_value_offsets_ptr + feature + 1).to(tl.int64)
    table = tl.load(feature_table_ptr + feature).to(tl.int64)
    base = tl.load(table_offsets_ptr + table).to(tl.int64)
    dtype_code = tl.load(table_dtypes_ptr + table) if HAS_DTYPES else 0

    idx = start + pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    in_feature = idx < end
    row = tl.load(rows_ptr + idx, mask=in_feature, other=-1).to(tl.int64)
    d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = d < dim
    # A plain copy (half values widen exactly): the output is bit-exact.
    vals = load_rows(
        weights_ptr,
        weights16_ptr,
        weightsbf_ptr,
        base,
        row[:, None] * dim + d[None, :],
        (in_feature & (row >= 0))[:, None] & d_mask[None, :],
        dtype_code,
        HAS_DTYPES,
    )
    tl.store(out_ptr + idx[:, None] * dim + d[None, :], vals, mask=in_feature[:, None] & d_mask[None, :])


# The sequence lookup's tile (elements a program copies) and elements per thread. A gather is
# memory-bound: its registers buy nothing but occupancy. At 32 elements a thread (tile 4096, as
# before) dim 128 took 128 registers a thread on sm_90 and 196 with half tables; at 16, 32-48.
# Module constants so a benchmark can sweep them.
SEQUENCE_TILE = 2048
SEQUENCE_ELEMENTS_PER_THREAD = 16


def _sequence_blocks(dim: int):
    """(BLOCK_D, BLOCK_N, num_warps) of the sequence lookup: a program copies BLOCK_N values x
    BLOCK_D columns (at most SEQUENCE_TILE elements, SEQUENCE_ELEMENTS_PER_THREAD a thread).

    A dim that is not a multiple of 16 (Triton then knows no alignment of ``row * dim``) halves
    both: each element is a scalar load with its own 64-bit address, and 16 of them took 76-107
    registers on sm_90 with half tables (dim 60: 107). Narrow dims keep their tile of 32 values
    and 2 warps (at most 8 elements a thread, 22-54 registers)."""
    aligned = dim % 16 == 0
    tile = SEQUENCE_TILE if aligned else SEQUENCE_TILE // 2
    per_thread = SEQUENCE_ELEMENTS_PER_THREAD if aligned else SEQUENCE_ELEMENTS_PER_THREAD // 2
    block_d = min(triton.next_power_of_2(max(dim, 1)), 256)
    block_n = max(1, min(32, tile // block_d))
    threads = block_n * block_d // per_thread
    num_warps = max(2, min(8, triton.next_power_of_2(max(threads // 32, 1))))
    return block_d, block_n, num_warps


# The pooled lookup's tile (elements a program holds per loop step) and elements per thread
# (16 = four 16-byte loads in flight per thread at ~64 registers on sm_90, 4 programs of 8 warps
# per SM; 32 took ~126, which halves the resident warps). Module constants so a benchmark can sweep them.
POOLED_TILE = 4096
POOLED_ELEMENTS_PER_THREAD = 16


def _pooled_blocks(max_dim: int, mean_bag: float, align: int = 8):
    """(BLOCK_B, BLOCK_L, BLOCK_D, num_warps) of the pooled lookup: a program's tile is BLOCK_B
    bags x BLOCK_L ids x BLOCK_D columns (about POOLED_TILE elements). BLOCK_L follows the
    batch's mean bag length (a host value: rows.numel() / bags), so typical bags take one or two
    loop steps; each distinct value is one compile (at most 5: powers of two 2..32).

    ``align`` is the kernel's ALIGN. Registers grow with the loads and the bags a thread holds, not
    only its elements: below ALIGN 4 every element (or pair) is a load with its own 64-bit
    address, at BLOCK_L 2 a thread holds the state of twice the bags, and at BLOCK_D <= 4 each
    element is its own row. Each of the three halves the tile (the same threads, half the
    elements each, at least 4): at 16 those tiles took 96-232 registers a thread on sm_90 (dim 12,
    ALIGN 1, half tables, bags ~2: 232, two programs of 4 warps an SM), halved at most 80. The
    others (ALIGN >= 4, dims over 4, bags of 3 or more ids) keep their tile (at most 102: half
    tables, ALIGN 8, bags of ~3). Figures of triton 3.6 and 3.7 alike, over every tile:
    benchmarks/count_pooled_registers.py."""
    block_d = min(triton.next_power_of_2(max(max_dim, 1)), 256)
    # At least 2: a tile of one id per bag spreads ~4 bags' values over each thread (~160
    # registers on sm_90 against ~80).
    block_l = min(triton.next_power_of_2(max(int(mean_bag + 0.5), 2)), 32, max(POOLED_TILE // block_d, 1))
    halvings = (block_l <= 2) + (align < 4) + (block_d <= 4)
    halvings = min(halvings, max(POOLED_ELEMENTS_PER_THREAD.bit_length() - 3, 0))  # >= 4 elements
    per_thread = POOLED_ELEMENTS_PER_THREAD >> halvings
    tile = POOLED_TILE >> halvings
    block_b = max(1, min(64, tile // (block_d * block_l)))
    threads = block_b * block_l * block_d // per_thread
    num_warps = max(1, min(8, triton.next_power_of_2(max(threads // 32, 1))))
    return block_b, block_l, block_d, num_warps


def _alignment(dims: list[int], table_offsets: list[int]) -> int:
    """The largest power of two up to 8 dividing every table's dim and first word: the kernel
    may then read a row ALIGN elements at a time (16-byte loads of float32 rows from 4, of half
    rows at 8)."""
    align = 8
    while align > 1 and any(v % align for v in [*dims, *table_offsets]):
        align //= 2
    return align


def _tiles_output(cols: list[int], widths: list[int], total_dim: int) -> bool:
    """Whether the column spans [cols[f], cols[f] + widths[f]) cover [0, total_dim) exactly,
    without overlaps or gaps."""
    spans = sorted(zip(cols, widths))
    at = 0
    for col, width in spans:
        if col != at:
            return False
        at += width
    return at == total_dim


def _meta(t: Tensor, device: torch.device, dtype: torch.dtype = torch.int64) -> Tensor:
    """A small index tensor on the kernel's device, contiguous (a no-op when it already is)."""
    t = torch.as_tensor(t, device=getattr(t, "device", "cpu"))  # (a list: on the host, not the default device)
    return device_sync.to_device(t, device).to(dtype=dtype).contiguous()


def launching_on(device: torch.device):
    """Around a kernel launch: Triton launches on the *current* CUDA device (and its current
    stream), whatever device the tensors are on; so make it ``device`` when it is another (a
    module on cuda:1 of a process whose current device is cuda:0). A no-op otherwise, and on CPU
    (the interpreter)."""
    if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def check_no_new_vectors(new_vectors: Sequence[Tensor], what: str) -> None:
    # Deferred initial vectors are a CPU-kernel path; on GPUs the module writes new rows eagerly.
    if len(new_vectors):
        raise ValueError(
            f"{what}: new_vectors is supported by the CPU kernels only; the GPU kernels read every "
            f"row from the table (got {len(new_vectors)} blocks)"
        )


def _check_weights(weights: Tensor, what: str) -> None:
    if weights.dtype != torch.float32 or not weights.is_contiguous():
        raise ValueError(f"{what}: weights must be a contiguous float32 buffer, got {weights.dtype}")


def typed_views(weights: Tensor):
    """The word buffer as float32, float16 and bfloat16 (the same memory): the kernels' pointers."""
    return weights, weights.view(torch.float16), weights.view(torch.bfloat16)


def dtype_codes(table_dtypes: Tensor | None, device: torch.device):
    """(codes on the device, HAS_DTYPES): None means every table is float32."""
    if table_dtypes is None:
        return torch.zeros(1, dtype=torch.int32, device=device), False  # a dummy, never read
    return _meta(table_dtypes, device, torch.int32), True


# Per layout (the caller's table_offsets tensor): its device copies and dtype codes, made once
# rather than a few small launches each call.
_pooled_layouts = LayoutCache()
_sequence_layouts = LayoutCache()


def _pooled_layout(table_offsets: Tensor, table_dims: Tensor, table_dtypes: Tensor | None, device: torch.device):
    """(offsets, dims, codes or None) on the device; the codes in their own dtype: no cast."""
    return _pooled_layouts.get(
        (table_offsets, table_dims, table_dtypes),
        device,
        lambda: (
            _meta(table_offsets, device),
            _meta(table_dims, device),
            None if table_dtypes is None else _meta(table_dtypes, device, table_dtypes.dtype),
        ),
    )


def _sequence_layout(table_offsets: Tensor, table_dtypes: Tensor | None, device: torch.device):
    """(offsets, codes, HAS_DTYPES) on the device."""
    return _sequence_layouts.get(
        (table_offsets, table_dtypes),
        device,
        lambda: (_meta(table_offsets, device), *dtype_codes(table_dtypes, device)),
    )


def pooled_lookup(
    weights: Tensor,
    table_offsets: Tensor,
    table_dims: Tensor,
    feature_table: Tensor,
    feature_col: Tensor,
    feature_mean: Tensor,
    rows: Tensor,
    offsets: Tensor,
    per_sample_weights: Tensor | None,
    batch_size: int,
    total_dim: int,
    new_vectors: Sequence[Tensor] = (),
    table_dtypes: Tensor | None = None,
) -> Tensor:
    """[batch_size, total_dim] float32 pooled output: feature f's bags land in columns
    feature_col[f]...; sum (or mean where feature_mean[f]) of the rows of each bag, scaled by
    per_sample_weights when given. Rows of -1 read as zeros; empty bags are zeros."""
    # Launcher of _pooled_lookup_fwd_kernel: grid (tiles of bags, column blocks of the widest
    # table). The widest dim is a counted host read, free when the caller mirrors the dims
    # (DynamicTables' layout); the other host values only tune the launch and are read if free.
    _check_weights(weights, "pooled_lookup")
    check_no_new_vectors(new_vectors, "pooled_lookup")
    device = weights.device
    num_bags = feature_table.numel() * batch_size
    host_dims = device_sync.host_list(table_dims, "pooled_lookup: widest table") if num_bags and total_dim else []
    max_dim = max(host_dims, default=0)
    if max_dim == 0:
        return torch.zeros(batch_size, total_dim, dtype=torch.float32, device=device)
    # Columns no feature covers must read as zeros, as in the reference; when the features tile
    # the output (a module's plan) the kernel writes every element: no memset launch. Decided
    # only from free host values (mirrored, as a module's plan is): zeros otherwise, no sync.
    host_tables = device_sync.host_list_if_free(feature_table)
    host_cols = device_sync.host_list_if_free(feature_col)
    covered = (
        host_tables is not None
        and host_cols is not None
        and _tiles_output(host_cols, [host_dims[t] for t in host_tables], total_dim)
    )
    out = (torch.empty if covered else torch.zeros)(batch_size, total_dim, dtype=torch.float32, device=device)
    host_offsets = device_sync.host_list_if_free(table_offsets)  # (the same: scalar loads without)
    align = _alignment(host_dims, host_offsets) if host_offsets is not None else 1
    rows = rows.to(device).contiguous()
    has_weights = per_sample_weights is not None
    psw = per_sample_weights.to(device).contiguous() if has_weights else rows  # dummy, never read
    block_b, block_l, block_d, num_warps = _pooled_blocks(max_dim, rows.numel() / num_bags, align)
    grid = (triton.cdiv(num_bags, block_b), triton.cdiv(max_dim, block_d))
    # The small index tensors are read in their own dtypes (bool means, int64 codes): no cast
    # kernel per call.
    offsets_t, dims_t, codes = _pooled_layout(table_offsets, table_dims, table_dtypes, device)
    has_dtypes = codes is not None
    codes = codes if has_dtypes else rows  # dummy, never read
    with launching_on(device):
        _pooled_lookup_fwd_kernel[grid](
            *typed_views(weights),
            offsets_t,
            codes,
            dims_t,
            _meta(feature_table, device),
            _meta(feature_col, device),
            _meta(feature_mean, device, feature_mean.dtype),
            rows,
            _meta(offsets, device),
            psw,
            out,
            num_bags,
            batch_size,
            total_dim,
            HAS_WEIGHTS=has_weights,
            HAS_DTYPES=has_dtypes,
            ALIGN=align,
            BLOCK_B=block_b,
            BLOCK_L=block_l,
            BLOCK_D=block_d,
            num_warps=num_warps,
        )
    return out


def sequence_lookup(
    weights: Tensor,
    table_offsets: Tensor,
    dim: int,
    feature_table: Tensor,
    feature_value_offsets: Tensor,
    rows: Tensor,
    new_vectors: Sequence[Tensor] = (),
    table_dtypes: Tensor | None = None,
) -> Tensor:
    """[num_values, dim] float32: the row of each id (zeros for -1); values of feature f are
    [feature_value_offsets[f], feature_value_offsets[f + 1]) and read table feature_table[f]."""
    check_no_new_vectors(new_vectors, "sequence_lookup")
    # Grid: (value blocks of the longest feature, features, column blocks); the longest feature
    # is read on the host (free when the caller mirrors the offsets, as check_and_arrange does).
    _check_weights(weights, "sequence_lookup")
    device = weights.device
    n = rows.numel()
    # zeros: values outside every feature's range stay zero, as in the reference.
    out = torch.zeros(n, dim, dtype=torch.float32, device=device)
    num_features = feature_table.numel()
    if n == 0 or dim == 0 or num_features == 0:
        return out
    bounds = device_sync.host_list(feature_value_offsets, "sequence_lookup: longest feature")  # mirrored by the caller
    max_len = max(end - start for start, end in zip(bounds, bounds[1:]))
    fvo = _meta(feature_value_offsets, device)
    if max_len <= 0:
        return out
    block_d, block_n, num_warps = _sequence_blocks(dim)
    # Value blocks on axis 0: the only axis allowed more than 65535 programs.
    grid = (triton.cdiv(max_len, block_n), num_features, triton.cdiv(dim, block_d))
    offsets_t, codes, has_dtypes = _sequence_layout(table_offsets, table_dtypes, device)
    with launching_on(device):
        _sequence_lookup_fwd_kernel[grid](
            *typed_views(weights),
            offsets_t,
            codes,
            _meta(feature_table, device),
            fvo,
            rows.to(device).contiguous(),
            out,
            dim,
            HAS_DTYPES=has_dtypes,
            BLOCK_N=block_n,
            BLOCK_D=block_d,
            num_warps=num_warps,
        )
    return out
