"""The hashes production code computes in Python: MurmurHash3's fmix64 on ints and on int64
tensors, and the per-table seeds derived from a user's seed and a table's name.

The kernels compute the same hashes in C++ / Triton (``csrc/hash_table_layout.h``'s ``fmix64``);
the test oracle ``torchrec_ext.reference`` has its own copies. Seeds and salts come from
``vocabulary``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from torchrec_ext.vocabulary import FALLBACK_GOLDEN, INIT_GOLDEN, ROUNDING_GOLDEN

MASK64 = (1 << 64) - 1
_FNV_OFFSET = 0xCBF29CE484222325
_FNV_PRIME = 0x100000001B3


def fmix64(k: int) -> int:
    """MurmurHash3's 64-bit finaliser of a Python int (taken mod 2^64)."""
    k &= MASK64
    k ^= k >> 33
    k = (k * 0xFF51AFD7ED558CCD) & MASK64
    k ^= k >> 33
    k = (k * 0xC4CEB9FE1A85EC53) & MASK64
    return k ^ (k >> 33)


def as_int64(x: int) -> int:
    """A uint64 bit pattern as the int64 with the same bits."""
    x &= MASK64
    return x - (1 << 64) if x >> 63 else x


def u64(x: int) -> Tensor:
    """A uint64 constant as the int64 tensor with the same bits."""
    return torch.tensor(as_int64(x), dtype=torch.int64, device="cpu")  # (not the default device)


def srl(x: Tensor, s: int) -> Tensor:
    """Logical right shift of int64 bit patterns."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def fmix64_tensor(x: Tensor) -> Tensor:
    """MurmurHash3's 64-bit finaliser on int64 bit patterns (wrapping arithmetic)."""
    x = x ^ srl(x, 33)
    x = x * u64(0xFF51AFD7ED558CCD)
    x = x ^ srl(x, 33)
    x = x * u64(0xC4CEB9FE1A85EC53)
    return x ^ srl(x, 33)


def table_seed(seed: int, table_name: str) -> int:
    """64-bit seed of one table: FNV-1a of its name mixed with the user's seed (as int64)."""
    h = _FNV_OFFSET
    for byte in table_name.encode():
        h = ((h ^ byte) * _FNV_PRIME) & MASK64
    return as_int64(fmix64(h ^ fmix64((seed & MASK64) ^ INIT_GOLDEN)))


def rounding_seed(table_seed: int) -> int:
    """A table's stochastic-rounding seed (as int64): a stream of its own, not the init stream's,
    and never 0 (which the kernels read as "round to nearest")."""
    return as_int64(fmix64((table_seed ^ ROUNDING_GOLDEN) & MASK64) | 1)


def fallback_seed(table_seed: int) -> int:
    """A table's fallback-row hash seed (as int64): from the table seed, so the choice of
    fallback row is a stream of its own, independent of the bucket hash and of the routing hash,
    and the same for every shard of the table."""
    return as_int64(fmix64((table_seed ^ FALLBACK_GOLDEN) & MASK64))


def fallback_slots(ids: Tensor, seeds: Tensor, num_rows: Tensor) -> Tensor:
    """Which of its table's ``num_rows`` fallback rows each id reads: ``fmix64(id ^ seed) >> 1``
    modulo num_rows (``seeds``: ``fallback_seed`` of each id's table; both broadcast with ids)."""
    return srl(fmix64_tensor(ids.to(torch.int64) ^ seeds), 1) % num_rows
