"""``init_rows``: the initializer kinds, a table's seed, the pure function of (seed, id, element)
every kernel draws (``init_vectors``) and the op's oracle (``init_rows``: those vectors written to
their rows)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from torchrec_ext.reference.hashing import _MASK64, _fmix64, _srl, _u64, fmix64_tensor

GOLDEN = 0x9E3779B97F4A7C15


INITIALIZERS = {"uniform": 0, "normal": 1, "truncated_normal": 2, "constant": 3}


INITIALIZER_NAMES = {kind: name for name, kind in INITIALIZERS.items()}


PARAM_COUNTS = {"uniform": 2, "normal": 2, "truncated_normal": 4, "constant": 1}


TRUNC_NORMAL_ATTEMPTS = 16


def table_seed(seed: int, table_name: str) -> int:
    """64-bit seed of one table: FNV-1a of its name mixed with the user's seed (as int64)."""
    h = 0xCBF29CE484222325
    for byte in table_name.encode():
        h = ((h ^ byte) * 0x100000001B3) & _MASK64
    h = _fmix64(h ^ _fmix64((seed & _MASK64) ^ GOLDEN))
    return h - (1 << 64) if h >> 63 else h


def pair_bits(ids: Tensor, num_pairs: int, seed: int, attempt: int = 0) -> Tensor:
    """[n, num_pairs] int64 random bits; pair p of id k feeds its elements 2p and 2p+1:
    fmix64(fmix64(k ^ seed) + (attempt * 2^32 + p + 1) * GOLDEN)."""
    row_key = fmix64_tensor(ids.to(torch.int64) ^ _u64(seed & _MASK64)).unsqueeze(1)
    counters = torch.arange(num_pairs, dtype=torch.int64, device=ids.device) + (attempt << 32) + 1
    return fmix64_tensor(row_key + counters * _u64(GOLDEN))


def _box_muller(bits: Tensor) -> Tensor:
    """[n, 2 * pairs] normals: r cos(theta), r sin(theta) from each pair's high and low 32 bits."""
    u1 = (_srl(bits, 32).double() + 0.5) * 2.0**-32
    u2 = (bits & 0xFFFFFFFF).double() * 2.0**-32
    r = torch.sqrt(-2.0 * torch.log(u1))
    return torch.stack([r * torch.cos(2.0 * math.pi * u2), r * torch.sin(2.0 * math.pi * u2)], dim=2).flatten(1)


def init_vectors(ids: Tensor, dim: int, seed: int, kind: str, params: Sequence[float]) -> Tensor:
    """Initial [n, dim] float32 vectors of ``ids``: a pure function of (seed, id, element).

    kind/params: uniform (low, high), normal (mean, std), truncated_normal (mean, std, low, high:
    an element out of range is redrawn from its pair's next attempts, up to 16 draws, then
    clamped), constant (value,). One 64-bit hash feeds two elements; float64, then cast.
    """
    if kind == "constant":
        return torch.full((ids.numel(), dim), params[0], dtype=torch.float32, device=ids.device)
    num_pairs = (dim + 1) // 2
    bits = pair_bits(ids, num_pairs, seed)
    if kind == "uniform":
        low, high = params[0], params[1]
        u = torch.stack([_srl(bits, 40), (bits & 0xFFFFFFFF) >> 8], dim=2).flatten(1).double() * 2.0**-24
        return (low + (high - low) * u)[:, :dim].float()
    mean, std = params[0], params[1]
    values = mean + std * _box_muller(bits)
    if kind == "truncated_normal":
        low, high = params[2], params[3]
        for attempt in range(1, TRUNC_NORMAL_ATTEMPTS):
            outside = (values < low) | (values > high)
            if not bool(outside.any()):
                break
            redraw = mean + std * _box_muller(pair_bits(ids, num_pairs, seed, attempt))
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
    states: Sequence[Tensor] = (),
    state_values: Sequence[float] = (),
) -> None:
    """Oracle of ``ops.init_rows``, in place: each id's ``init_vectors`` vector (cast to the table's
    dtype, rounding to nearest even) into its row (-1: skipped), its optimizer states' rows set to
    ``state_values``. A parameter past the initializer's own is the first column: the table is a
    column shard, its vectors columns first.. of the whole table's."""
    name = INITIALIZER_NAMES[kind]
    count = PARAM_COUNTS[name]
    first = int(params[count]) if len(params) > count else 0
    vectors = init_vectors(ids, first + table.shape[1], seed, name, list(params[:count]))[:, first:]
    keep = rows >= 0
    table[rows[keep]] = vectors[keep].to(table.dtype)
    for state, value in zip(states, state_values):
        state[rows[keep]] = value
