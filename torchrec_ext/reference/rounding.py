"""Writing a float32 step result into a half-precision table: round to nearest even, or
stochastic rounding with bits that are a pure function of (table, id, element, step)."""

from __future__ import annotations

import torch
from torch import Tensor

from torchrec_ext.reference.hashing import _MASK64, _fmix64, _srl, _u64, fmix64_tensor

SR_GOLDEN = 0xD6E8FEB86659FD93  # the rounding stream's counter constant (not the init stream's)


def rounding_seed(table_seed: int) -> int:
    """A table's stochastic-rounding seed (as int64): a stream of its own, not the init stream's,
    and never 0 (which the kernels read as "round to nearest")."""
    h = _fmix64((table_seed ^ SR_GOLDEN) & _MASK64) | 1
    return h - (1 << 64) if h >> 63 else h


def rounding_bits(ids: Tensor, dim: int, seed: int, step: int) -> Tensor:
    """[n, dim] int64 in [0, 2^16): the random bits stochastic rounding adds to element d of the
    row of each id at optimizer step ``step``, for a table whose rounding seed is ``seed``:
        key = fmix64(fmix64(id ^ seed) + step * SR_GOLDEN)
        bits_q = fmix64(key + (q + 1) * SR_GOLDEN), one 64-bit hash per 4 elements (q = d // 4)
        r_d = (bits_q >> 16 * (d % 4)) & 0xFFFF
    A pure function: no generator state to checkpoint, the same bits whatever the world size."""
    key = fmix64_tensor(fmix64_tensor(ids.to(torch.int64) ^ _u64(seed & _MASK64)) + _u64((step * SR_GOLDEN) & _MASK64))
    q = torch.arange((dim + 3) // 4, dtype=torch.int64, device=ids.device) + 1
    bits = fmix64_tensor(key.unsqueeze(1) + q * _u64(SR_GOLDEN))
    return torch.stack([_srl(bits, 16 * e) & 0xFFFF for e in range(4)], dim=2).flatten(1)[:, :dim]


# float32 bit patterns of each half dtype's largest finite value and of the magnitude from which
# round to nearest gives inf (stochastic rounding below it stays finite)
BF16_MAX_BITS, BF16_OVERFLOW_BOUNDARY = 0x7F7F0000, 0x7F7F8000


HALF_MAX_BITS, HALF_OVERFLOW_BOUNDARY = 0x477FE000, 0x477FF000


def round_to_storage(x: Tensor, dtype: torch.dtype, bits: Tensor | None = None) -> Tensor:
    """float32 ``x`` in the storage dtype: round to nearest even (``bits`` None, or float32), else
    stochastic rounding with 16 random bits per element (``rounding_bits``):

    bfloat16: the float32 bit pattern plus r, truncated to its top 16 bits (16 bits are dropped:
    exactly unbiased). float16: |x| + r * g / 2^16 truncated to the float16 grid, g the grid
    spacing at |x| (2^(e - 10) for |x| in [2^e, 2^(e + 1)), 2^-24 in the subnormal range): what
    adding r scaled to the D dropped bits of the pattern and truncating gives (D = 13 for |x| >=
    2^-14, 126 - biased exponent below), and what the CPU kernel computes as one float add and a
    float16 conversion, both rounding toward zero. Below 2^-24 that is 2^-24 when |x| * 2^40 >=
    2^16 - r, else 0. Inf and NaN round to nearest. Truncation is
    toward zero in magnitude; the sign is kept. A finite x below the dtype's overflow boundary
    (where round to nearest turns to inf: 65520 for float16) never rounds up to inf: it takes
    the dtype's largest finite value."""
    if dtype == torch.float32:
        return x.float()
    if bits is None:
        return x.float().to(dtype)
    u = x.float().contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    sign, a = u & 0x80000000, u & 0x7FFFFFFF
    special = a >= 0x7F800000
    if dtype == torch.bfloat16:
        t = (a + bits) & 0xFFFF0000
        t = torch.where((t == 0x7F800000) & (a < BF16_OVERFLOW_BOUNDARY), torch.full_like(a, BF16_MAX_BITS), t)
    else:
        dropped = torch.clamp(126 - (a >> 23), min=13)
        scaled = torch.where(dropped >= 16, bits << (dropped - 16).clamp(min=0), bits >> (16 - dropped).clamp(min=0))
        t = (a + scaled) & ~((torch.ones_like(a) << dropped.clamp(max=62)) - 1)
        tiny = a < 0x33800000
        away = x.double().abs() * 2.0**40 >= (65536 - bits).double()  # |x| + r * 2^-40 >= 2^-24, exactly
        t = torch.where(tiny, torch.where(away, torch.full_like(a, 0x33800000), torch.zeros_like(a)), t)
        t = torch.where((t >= 0x47800000) & (a < HALF_OVERFLOW_BOUNDARY), torch.full_like(a, HALF_MAX_BITS), t)
    rounded = (t | sign).to(torch.int32).view(torch.float32).to(dtype)  # exact: t is on the dtype's grid
    return torch.where(special, x.float().to(dtype), rounded)
