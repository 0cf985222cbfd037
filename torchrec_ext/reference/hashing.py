"""The hashes of the specification, one value at a time (``_fmix64`` on ints) and on int64
tensors (``fmix64_tensor``): MurmurHash3's 64-bit finaliser and the fastrange reduction."""

from __future__ import annotations

import torch
from torch import Tensor

_MASK64 = (1 << 64) - 1


_INT64_MAX = (1 << 63) - 1


def _fmix64(k: int) -> int:
    k ^= k >> 33
    k = (k * 0xFF51AFD7ED558CCD) & _MASK64
    k ^= k >> 33
    k = (k * 0xC4CEB9FE1A85EC53) & _MASK64
    k ^= k >> 33
    return k


def _fastrange32(x: int, n: int) -> int:
    return ((x & 0xFFFFFFFF) * n) >> 32


def _u64(x: int) -> Tensor:
    """A uint64 constant as the int64 tensor with the same bits."""
    return torch.tensor(x - (1 << 64) if x >> 63 else x, dtype=torch.int64)


def _srl(x: Tensor, s: int) -> Tensor:
    """Logical right shift of int64 bit patterns."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def fmix64_tensor(x: Tensor) -> Tensor:
    """MurmurHash3's 64-bit finaliser on int64 bit patterns (wrapping arithmetic)."""
    x = x ^ _srl(x, 33)
    x = x * _u64(0xFF51AFD7ED558CCD)
    x = x ^ _srl(x, 33)
    x = x * _u64(0xC4CEB9FE1A85EC53)
    return x ^ _srl(x, 33)
