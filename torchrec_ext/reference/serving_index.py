"""The read-only serving index's specification: what an index tensor holds (``serving_index_entries``
decodes its buckets into a dict, with no hashing: where a key sits is the kernel's business),
the dict model of ``serving_index_update`` and ``serving_find``, and the probe invariant that
makes a find correct (``serving_index_reachable``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from torchrec_ext.reference.hashing import _MASK64

SERVING_BUCKET_WORDS = 8  # 64 bytes
SERVING_KEYS_PER_BUCKET = 5  # words 0..4; int32 rows at int32 positions 10..14; meta at 15
SERVING_OVERFLOW_BIT = 0x100
SERVING_SEED = 0x2545F4914F6CDD1D
SERVING_MULTIPLIER = 0x9E3779B97F4A7C15


def _buckets(index: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(keys [B, 5], rows [B, 5], meta [B]) of an index tensor."""
    words = index.view(-1, SERVING_BUCKET_WORDS)
    halves = words.view(torch.int32)  # [B, 16]
    return words[:, :SERVING_KEYS_PER_BUCKET], halves[:, 10:15].to(torch.int64), halves[:, 15].to(torch.int64)


def serving_index_entries(index: Tensor) -> dict[int, int]:
    """key -> row of every key an index holds (a bucket's first ``count`` keys)."""
    keys, rows, meta = _buckets(index)
    out: dict[int, int] = {}
    for b in range(keys.shape[0]):
        for i in range(int(meta[b]) & 0xFF):
            key = int(keys[b, i])
            assert key not in out, f"key {key} held twice"
            out[key] = int(rows[b, i])
    return out


def serving_index_update(index: Tensor, erase_keys: Tensor, keys: Tensor, rows: Tensor) -> dict[int, int]:
    """The entries of the index ``serving_index_update`` returns: ``index``'s, less
    ``erase_keys``, then each key mapped to its row (the last one for a repeated key)."""
    out = serving_index_entries(index)
    for key in erase_keys.tolist():
        out.pop(key, None)
    for key, row in zip(keys.tolist(), rows.tolist()):
        out[key] = row
    return out


def serving_find(indexes: Sequence[Tensor], ids: Tensor, id_offsets: Tensor, default_rows: Sequence[int]) -> Tensor:
    """Row of each id in its table's index, else its table's default row."""
    rows = []
    bounds = id_offsets.tolist()
    for t, index in enumerate(indexes):
        entries = serving_index_entries(index)
        rows += [entries.get(i, int(default_rows[t])) for i in ids[bounds[t] : bounds[t + 1]].tolist()]
    return torch.tensor(rows, dtype=torch.int64)


def serving_home_bucket(key: int, num_buckets: int) -> int:
    """A key's home bucket: fastrange32 of the high 32 bits of (key ^ seed) * golden (mod 2^64)."""
    h = (((key & _MASK64) ^ SERVING_SEED) * SERVING_MULTIPLIER) & _MASK64
    return ((h >> 32) * num_buckets) >> 32


def serving_index_reachable(index: Tensor) -> bool:
    """Whether every key can be found: every bucket from its home up to (not including) the one
    holding it says some key overflowed it."""
    keys, _, meta = _buckets(index)
    num_buckets = keys.shape[0]
    for b in range(num_buckets):
        for i in range(int(meta[b]) & 0xFF):
            at = serving_home_bucket(int(keys[b, i]), num_buckets)
            while at != b:
                if not int(meta[at]) & SERVING_OVERFLOW_BIT:
                    return False
                at = (at + 1) % num_buckets
    return True
