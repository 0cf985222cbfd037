"""The read-only index a serving table's lookups use (``ops.serving_index_update`` /
``ops.serving_find``): built from the table's HashTable at conversion and kept in step with it
by each delta, aside, then published with it.

The HashTable stays the table's truth (deltas are placed in it, ``vectors`` and tombstone checks
read it); the read index maps the same ids to the same rows with one cache line per id instead of
the training table's digests, tags and two buckets. Sized by live ids, not capacity: about
``TARGET_LOAD`` of its key slots are used after a build; an update that would pass
``MAX_LOAD``, or that follows many erases (their probe hints stay behind) or a re-placement
(every held id may have moved), rebuilds it from the HashTable instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from torchrec_ext import ops
from torchrec_ext.table import HashTable

KEYS_PER_BUCKET = 5
BUCKET_WORDS = 8  # int64 words of a 64-byte bucket
# Of key slots. Lower loads mean shorter probes (fewer keys past their home bucket): at 8 x 500K
# keys a find took ~11.5 / 13 / 16 ns per id at loads 0.4 / 0.5 / 0.6, at 32 / 26 / 21 bytes per key.
TARGET_LOAD = 0.45  # after a build
MAX_LOAD = 0.65  # an update past it rebuilds


@dataclass
class ReadIndex:
    """One table's read index and the erases applied to it since it was built."""

    words: Tensor  # int64 [BUCKET_WORDS * buckets]
    erased: int = 0

    @property
    def key_slots(self) -> int:
        return self.words.numel() // BUCKET_WORDS * KEYS_PER_BUCKET

    def nbytes(self) -> int:
        return self.words.numel() * self.words.element_size()


def build_read_index(table: HashTable) -> ReadIndex:
    """A read index holding every live id of ``table`` at its row."""
    pages = list(table.export())
    keys = torch.cat([p[0] for p in pages]) if pages else torch.zeros(0, dtype=torch.int64, device="cpu")
    rows = torch.cat([p[1] for p in pages]) if pages else torch.zeros(0, dtype=torch.int64, device="cpu")
    buckets = max(1, -(-int(keys.numel() / TARGET_LOAD) // KEYS_PER_BUCKET))
    empty = torch.zeros(buckets * BUCKET_WORDS, dtype=torch.int64, device="cpu")
    return ReadIndex(ops.serving_index_update(empty, keys[:0], keys, rows))


def updated_read_index(
    current: ReadIndex, table: HashTable, erased: Tensor, ids: Tensor, rows: Tensor, re_placed: bool
) -> ReadIndex:
    """The read index of ``table`` (already updated) after a delta that erased ``erased`` and put
    ``ids`` at ``rows``; ``current`` is left as it is (lookups may be reading it)."""
    erases = current.erased + erased.numel()
    if re_placed or table.size() > MAX_LOAD * current.key_slots or erases > table.size() // 2:
        return build_read_index(table)
    return ReadIndex(ops.serving_index_update(current.words, erased, ids, rows), erases)
