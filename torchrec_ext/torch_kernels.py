"""Device-agnostic torch implementations of the ops that need no dedicated GPU kernel.

They serve as the CUDA kernels of ``init_rows``, ``route_bucketize`` and ``hash_slot_rows``
(``KERNELS`` below, registered by ``torchrec_ext.ops``): on a GPU, drawing new rows' vectors,
regrouping ids by destination and mapping slots to rows are a few fused elementwise passes, so
plain torch ops do it well (``dedup_segments`` has its own CUDA kernel, csrc/dedup_cuda.cu). On
CPU the C++ kernels are used. Kernel layer: imports
only the vocabulary, the hashing helpers, ``device_sync`` and the C++ library's ops (never ``ops.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from torchrec_ext import device_sync
from torchrec_ext.hashing import MASK64, fmix64_tensor, srl, u64
from torchrec_ext.vocabulary import (
    INIT_GOLDEN,
    INITIALIZER_NAMES,
    INITIALIZER_PARAM_COUNTS,
    STORAGE_DTYPES,
    TRUNC_NORMAL_ATTEMPTS,
)


def _pair_bits(ids: Tensor, num_pairs: int, seed: int, attempt: int = 0) -> Tensor:
    """[n, num_pairs] int64 random bits; pair p of id k feeds its elements 2p and 2p+1:
    fmix64(fmix64(k ^ seed) + (attempt * 2^32 + p + 1) * INIT_GOLDEN)."""
    row_key = fmix64_tensor(ids.to(torch.int64) ^ u64(seed & MASK64)).unsqueeze(1)
    counters = torch.arange(num_pairs, dtype=torch.int64, device=ids.device) + (attempt << 32) + 1
    return fmix64_tensor(row_key + counters * u64(INIT_GOLDEN))


def _box_muller(bits: Tensor) -> Tensor:
    """[n, 2 * pairs] normals: r cos(theta), r sin(theta) from each pair's high and low 32 bits."""
    u1 = (srl(bits, 32).double() + 0.5) * 2.0**-32
    u2 = (bits & 0xFFFFFFFF).double() * 2.0**-32
    r = torch.sqrt(-2.0 * torch.log(u1))
    return torch.stack([r * torch.cos(2.0 * math.pi * u2), r * torch.sin(2.0 * math.pi * u2)], dim=2).flatten(1)


def init_vectors(ids: Tensor, dim: int, seed: int, kind: str, params: Sequence[float]) -> Tensor:
    """Initial [n, dim] float32 vectors of ``ids``, on ids' device: a pure function of (seed, id,
    element), vectorised (the C++ kernel draws the same bits one row at a time).

    kind/params: uniform (low, high), normal (mean, std), truncated_normal (mean, std, low, high:
    an element out of range is redrawn from its pair's next attempts, up to 16 draws, then
    clamped), constant (value,). One 64-bit hash feeds two elements; float64, then cast.
    """
    if kind == "constant":
        return torch.full((ids.numel(), dim), params[0], dtype=torch.float32, device=ids.device)
    num_pairs = (dim + 1) // 2
    bits = _pair_bits(ids, num_pairs, seed)
    if kind == "uniform":
        low, high = params[0], params[1]
        u = torch.stack([srl(bits, 40), (bits & 0xFFFFFFFF) >> 8], dim=2).flatten(1).double() * 2.0**-24
        return (low + (high - low) * u)[:, :dim].float()
    mean, std = params[0], params[1]
    values = mean + std * _box_muller(bits)
    if kind == "truncated_normal":
        low, high = params[2], params[3]
        # Every attempt runs (no early exit: testing for one would read the device); an element
        # in range keeps its value, so the result is the same.
        for attempt in range(1, TRUNC_NORMAL_ATTEMPTS):
            outside = (values < low) | (values > high)
            redraw = mean + std * _box_muller(_pair_bits(ids, num_pairs, seed, attempt))
            values = torch.where(outside, redraw, values)
        values = values.clamp(low, high)
    return values[:, :dim].float()


def init_rows(
    table: Tensor,
    rows: Tensor,
    ids: Tensor,
    seed: int,
    kind: int,
    params: Sequence[float],
    states: Sequence[Tensor],
    state_values: Sequence[float],
) -> None:
    """Same contract as the C++ op, through the vectorised RNG above (an optional last
    parameter: the first column of a column shard's vectors in its whole table's); no boolean
    mask (whose output size would be read on the host): see ``_write_rows``."""
    if rows.numel() == 0:
        return
    name = INITIALIZER_NAMES[kind]
    first = int(params[INITIALIZER_PARAM_COUNTS[name]]) if len(params) > INITIALIZER_PARAM_COUNTS[name] else 0
    target, source, kept = _skip_to_first_kept(rows)
    vectors = init_vectors(ids.index_select(0, source), first + table.shape[1], seed, name, params)[:, first:]
    _write_rows(table, target, kept, vectors.to(table.device, table.dtype))
    for state, value in zip(states, state_values):
        _write_rows(state, target, kept, torch.full((1, state.shape[1]), value, dtype=state.dtype, device=state.device))


def init_rows_tables(
    weights: Tensor,
    table_offsets: Tensor,
    table_dims: Tensor,
    table_dtypes: Tensor | None,
    rows: Tensor,
    tables: Tensor,
    ids: Tensor,
    table_seeds: Tensor,
    table_kinds: Tensor,
    table_params: Tensor,
    kinds: Sequence[int],
    max_dim: int,
    states: Sequence[Tensor] = (),
    state_offsets: Tensor | None = None,
    rowwise: bool = False,
    state_values: Sequence[float] = (),
) -> None:
    """``init_rows`` of every table of a module at once, in the flat storage: a number of
    launches that does not depend on the table count, and no host read. Arguments: see
    ``ops.init_rows_tables``. Each vector is the one ``init_vectors`` draws for (seed, id) (bit
    for bit: every element is a function of its pair)."""
    n = rows.numel()
    if n == 0 or max_dim == 0:
        return
    device = weights.device
    dim = table_dims.index_select(0, tables)
    seed, kind = table_seeds.index_select(0, tables), table_kinds.index_select(0, tables)
    p = table_params.index_select(0, tables).unsqueeze(2)  # [n, 4, 1]: per row, broadcast over elements
    num_pairs = (max_dim + 1) // 2
    if len(kinds) == 1:  # one initializer for every table (the usual case): no selection
        values = _family(INITIALIZER_NAMES[kinds[0]], ids, seed, num_pairs, p)
    else:
        values = torch.zeros(n, 2 * num_pairs, dtype=torch.float64, device=device)
        for k in kinds:  # each family over every row, the row's own kind kept
            values = torch.where(
                (kind == k).unsqueeze(1), _family(INITIALIZER_NAMES[k], ids, seed, num_pairs, p), values
            )
    vectors = values[:, :max_dim].float()
    col = torch.arange(max_dim, device=device)
    valid = (rows >= 0).unsqueeze(1) & (col < dim.unsqueeze(1))
    every_element = _flat_selection(valid)  # shared by the float32 rows and element-wise states
    dtype_of = table_dtypes.index_select(0, tables) if table_dtypes is not None else None
    start = table_offsets.index_select(0, tables)
    for code, dtype in enumerate(STORAGE_DTYPES):
        if code != 0 and table_dtypes is None:
            break
        view = weights if dtype == torch.float32 else weights.view(dtype)
        per_word = 4 // view.element_size()
        index = (start * per_word + rows * dim).unsqueeze(1) + col
        selected = every_element if dtype_of is None else _flat_selection(valid & (dtype_of == code).unsqueeze(1))
        _write_flat(view, index, selected, vectors.to(dtype))
    every_row = _flat_selection((rows >= 0).unsqueeze(1)) if rowwise and states else None
    base = state_offsets.index_select(0, tables) if states else None
    for state, value in zip(states, state_values):
        if rowwise:
            index, selected = (base + rows).unsqueeze(1), every_row
        else:
            index, selected = (base + rows * dim).unsqueeze(1) + col, every_element
        _write_flat(state, index, selected, value)


def _family(name: str, ids: Tensor, seed: Tensor, num_pairs: int, p: Tensor) -> Tensor:
    """[n, 2 * num_pairs] float64 values of initializer ``name`` with per-row parameters
    ``p`` ([n, 4, 1]), as ``init_vectors`` computes them with scalar ones."""
    if name == "constant":
        return p[:, 0].expand(ids.numel(), 2 * num_pairs)
    bits = _pair_bits_seeded(ids, num_pairs, seed)
    if name == "uniform":
        u = torch.stack([srl(bits, 40), (bits & 0xFFFFFFFF) >> 8], dim=2).flatten(1).double() * 2.0**-24
        return p[:, 0] + (p[:, 1] - p[:, 0]) * u
    values = p[:, 0] + p[:, 1] * _box_muller(bits)
    if name == "truncated_normal":
        low, high = p[:, 2], p[:, 3]
        for attempt in range(1, TRUNC_NORMAL_ATTEMPTS):
            outside = (values < low) | (values > high)
            redraw = p[:, 0] + p[:, 1] * _box_muller(_pair_bits_seeded(ids, num_pairs, seed, attempt))
            values = torch.where(outside, redraw, values)
        values = torch.minimum(torch.maximum(values, low), high)
    return values


def _pair_bits_seeded(ids: Tensor, num_pairs: int, seed: Tensor, attempt: int = 0) -> Tensor:
    """``_pair_bits`` with one seed per id (int64 bit patterns)."""
    row_key = fmix64_tensor(ids.to(torch.int64) ^ seed).unsqueeze(1)
    counters = torch.arange(num_pairs, dtype=torch.int64, device=ids.device) + (attempt << 32) + 1
    return fmix64_tensor(row_key + counters * u64(INIT_GOLDEN))


def _flat_selection(where: Tensor) -> tuple[Tensor, Tensor]:
    """(source, kept) of a fixed-size masked write of ``where`` ([n, w]): each entry written
    stands for itself, the others for the first written one (``source``); ``kept`` is False only
    when none is written. One selection serves every buffer written under the same mask."""
    where = where.flatten()
    first = torch.argmax(where.to(torch.uint8))
    source = torch.where(where, torch.arange(where.numel(), device=where.device), first)
    return source, where.index_select(0, source)


def _write_flat(buffer: Tensor, index: Tensor, selection: tuple[Tensor, Tensor], values: Tensor | float) -> None:
    """buffer[index] = values where selected (``_flat_selection``; ``index`` and a tensor of
    ``values`` [n, w], a float: every entry's), fixed-size: the other entries stand in for the
    first written one (same element, same value), or write an element's own value back when
    none is written."""
    source, kept = selection
    target = index.flatten().index_select(0, source).clamp(0, buffer.numel() - 1)  # in range when none is written
    chosen = values.flatten().index_select(0, source) if isinstance(values, Tensor) else values
    buffer.index_put_((target,), torch.where(kept, chosen, buffer.index_select(0, target)))


def _skip_to_first_kept(rows: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Fixed-size writes for ``rows`` where -1 means skip: each skipped entry stands in for the
    first kept one (same row, same source), so every write of a row carries the same bytes and
    no compaction is needed. Returns (target rows, source entry, kept); ``kept`` is False only
    when no entry is kept, and then the entries write their row's own values back."""
    keep = rows >= 0
    first = torch.argmax(keep.to(torch.uint8))  # the first kept entry (0 when none)
    source = torch.where(keep, torch.arange(rows.numel(), device=rows.device), first)
    return rows.index_select(0, source).clamp(min=0), source, keep.index_select(0, source)


def _write_rows(buffer: Tensor, target: Tensor, kept: Tensor, values: Tensor) -> None:
    """buffer[target] = values where kept, else the row's own values (see ``_skip_to_first_kept``)."""
    old = buffer.index_select(0, target)
    buffer.index_put_((target,), torch.where(kept.unsqueeze(1), values, old))


def route_bucketize(
    ids: Tensor, lengths: Tensor, slot_owner: Sequence[int], world_size: int, batch_size: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Same contract as the C++ op (a stable sort by destination, then bag); the row-wise owner
    is the ``route`` op's (its CUDA kernel in csrc/hash_table_cuda.cu)."""
    bags = len(slot_owner) * batch_size
    bag = torch.repeat_interleave(torch.arange(bags, device=ids.device), lengths, output_size=ids.numel())
    owner = device_sync.to_device(torch.tensor(list(slot_owner), dtype=torch.int64, device="cpu"), ids.device)[
        bag // max(batch_size, 1)
    ]
    dest = torch.where(owner < 0, torch.ops.torchrec_ext.route.default(ids, world_size), owner)
    bucket = dest * bags + bag
    order = torch.argsort(bucket, stable=True)
    return ids[order], torch.bincount(bucket, minlength=world_size * bags), order


def hash_slot_rows(rows: Tensor, key_offsets: Sequence[int], slot_rows: Sequence[Tensor | None]) -> None:
    """Same contract as the C++ op (slots to rows in place, -1 kept); a gather per mapped table."""
    for t, slot_map in enumerate(slot_rows):
        if slot_map is None:
            continue
        part = rows[key_offsets[t] : key_offsets[t + 1]]
        part.copy_(torch.where(part >= 0, slot_map.index_select(0, part.clamp(min=0)).to(part.dtype), part))


def copy_rows(dst: Tensor, dst_rows: Tensor | None, src: Tensor, src_rows: Tensor | None) -> None:
    """``copy_rows`` on a GPU: torch's row gather and scatter (a GPU copies rows in parallel). As
    the C++ kernel, without ``src_rows`` it takes rows 0 .. n-1 of ``src`` (which may hold more).
    (A row out of range is a device-side assert here, where the C++ kernel raises first.)"""
    if src_rows is not None:
        values = src.index_select(0, src_rows)
    elif dst_rows is not None:
        values = src[: dst_rows.numel()]
    else:
        values = src
    if dst_rows is None:
        dst[: values.shape[0]].copy_(values)
    else:
        dst.index_copy_(0, dst_rows, values)


# op name -> device type -> kernel, registered by torchrec_ext.ops (torch.library.register_kernel).
KERNELS: dict[str, dict[str, Callable]] = {
    "hash_slot_rows": {"cuda": hash_slot_rows},
    "init_rows": {"cuda": init_rows},
    "route_bucketize": {"cuda": route_bucketize},
    "copy_rows": {"cuda": copy_rows},
}
