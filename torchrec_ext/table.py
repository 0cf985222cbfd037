"""One dynamic table's index: a hash table from raw int64 ids to rows in ``[0, capacity)``.

The index owns no embedding vectors: rows address value storage (vectors, optimizer state)
kept by the caller, which must (re)initialise the rows reported as inserted.

A key lives in a slot of its buckets (the kernels' space); its row is that slot's row id. A fresh
table's slot i holds row i (no map is kept). A grown table (``grown``) keeps a permutation of
[0, capacity) over its slots: each live key keeps the row it had, and the rows no key holds lie in
the empty slots, so an insert takes its slot's row and an eviction hands the victim's row on. A
growth then rebuilds only the index: the caller's vectors and optimizer state stay where they are.

Concurrency: a ``HashTable`` may be shared by threads. Lookups (``find``, ``export``, ``size``)
run concurrently with each other; mutations (``find_or_insert``, ``insert_or_assign``,
``erase``, ``clear``, ``load_state_dict``, ``set_epoch``) run one at a time and exclude lookups
while they run. So every call is atomic: a ``find`` overlapping an insert sees the table as it
was before that insert or after it, never half of it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from typing import NamedTuple

import torch
from torch import Tensor

from torchrec_ext import device_sync, ops
from torchrec_ext.vocabulary import (  # noqa: F401
    LAYOUT_VERSION,
    LAYOUTS,
    POLICIES,
    SAME_BUCKET_LAYOUTS,
    SLOTS_PER_BUCKET,
    STASH_LAYOUT,
    index_lengths,
    row_map_dtype,
    stash_slots,
    table_geometry,
)

# Policies whose find_or_insert takes caller scores (custom: the score; lfu kinds: increments).
_SCORED_TOUCH = {"custom", "lfu", "epoch_lfu"}
INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


# Exclusive upper bounds of a table's counters: the clock is stored in int64 scores and the
# next mutating call adds one; the epoch is shifted left by 32 in epoch_* scores.
CLOCK_LIMIT = 2**63 - 1
EPOCH_LIMIT = 2**31
LAYOUT_LIMIT = 2**31


def check_counter(where: str, name: str, value: object, limit: int) -> int:
    """``value`` as an int in [0, limit): a Python int or a one-element integer tensor."""
    if isinstance(value, Tensor) and value.numel() == 1 and value.dtype in INT_DTYPES:
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{where}: {name} must be an int, got {value!r} ({type(value).__name__})")
    if not 0 <= value < limit:
        raise ValueError(f"{where}: {name} must be in [0, {limit}), got {value}")
    return value


def place_keys(keys: Tensor, scores: Tensor, capacity: int, start_rows: Tensor | None = None) -> Tensor:
    """Rows for distinct ``keys`` in an empty table of ``capacity`` rows (-1: left out), on
    ``keys``' device: how a load places a checkpoint's ids whose saved rows do not fit the table
    (saved at another capacity or world size, or with another ``LAYOUT_VERSION``).

    Every key is placed in its buckets whenever some placement holds them all, which with no
    more keys than rows is the case w.h.p. (a key's second bucket lies in the next stripe on the
    ring, so keys of a crowded stripe move on to its neighbours). Otherwise the most keys the
    buckets allow are placed, by priority: higher ``scores`` first, then earlier in ``keys``, and
    then the left-out keys of highest priority, up to the stash's entries (``stash_slots``), take
    free rows outside their buckets (the stash: at load exactly 1 a few buckets are chosen by
    fewer keys than they hold); with more keys than rows the kept keys are cut to ``capacity`` by
    priority. A key is left out exactly when it cannot be placed beside the higher-priority keys
    kept, so with more keys than rows the left-out keys are the lowest-priority ones, but for keys
    whose buckets filled up with higher-priority keys once the stash is full. The search (a free slot of the emptier bucket, then
    Hopcroft-Karp augmenting paths, then trades of left-out keys for placed ones of lower
    priority) is ``ops.hash_place``, on the CPU: 1M keys in 0.3 s up to load 0.99, under 3 s
    full (``benchmarks/results/reshard_placement_cpu.md``). ``reference.place_keys`` is its oracle.

    ``start_rows`` (-1: none) starts from a placement, as a delta replica re-placing its table
    does: those keys are put at their rows first and move only along the augmenting paths that
    make room for the others, so few rows move (a start row outside its key's buckets, a stashed
    key's, is placed afresh). Every key is still placed whenever some placement holds them all;
    otherwise the most keys the buckets and the stash allow (not by priority among the held).
    """
    where = "place_keys"
    named = (("keys", keys), ("scores", scores)) + ((("start_rows", start_rows),) if start_rows is not None else ())
    for name, value in named:
        if not isinstance(value, Tensor) or value.dtype not in INT_DTYPES:
            raise TypeError(
                f"{where}: {name} must be an integer tensor, got {getattr(value, 'dtype', type(value).__name__)}"
            )
        if value.dim() != 1:
            raise ValueError(f"{where}: {name} must be 1-D, got shape {tuple(value.shape)}")
    for name, value in named[1:]:
        if value.shape != keys.shape:
            raise ValueError(
                f"{where}: {name} must have one entry per key, shape {tuple(keys.shape)}, got {tuple(value.shape)}"
            )
    if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity <= 0:
        raise ValueError(f"{where}: capacity must be an int > 0, got {capacity!r}")
    host = [value.to("cpu", torch.int64).contiguous() for _, value in named]
    try:
        rows = ops.hash_place(host[0], host[1], capacity, host[2] if len(host) > 2 else None)
    except RuntimeError as e:  # duplicate keys, start rows a key may not hold
        raise ValueError(f"{where}: {e}") from None
    return rows.to(keys.device)


class InsertResult(NamedTuple):
    """What ``find_or_insert`` / ``insert_or_assign`` did.

    rows: row of each key, -1 where it was refused (its buckets full and nothing evictable).
    inserted: True where the key was new (at its first occurrence in the batch only), so
        ``rows[inserted]`` are exactly the rows the caller must initialise.
    evicted_keys / evicted_rows: keys pushed out to make room, and the rows they held (now
        given to a new key of this batch).
    """

    rows: Tensor
    inserted: Tensor
    evicted_keys: Tensor
    evicted_rows: Tensor


class FixedInsertResult(NamedTuple):
    """What ``find_or_insert_fixed`` did, one entry per key (no output size read on the host).

    rows / inserted: as ``InsertResult``'s (-1 / False for the keys not pending).
    evicted: True where the key took the row of an evicted key; evicted_keys: that key (0 elsewhere).
    """

    rows: Tensor
    inserted: Tensor
    evicted: Tensor
    evicted_keys: Tensor


def find_or_insert_tables(
    indexes: Sequence[HashTable],
    keys: Tensor,
    key_offsets: Sequence[int],
    scores: Tensor | None = None,
    pending: Tensor | None = None,
) -> FixedInsertResult:
    """``find_or_insert_fixed`` of several tables in one call (``ops.hash_upsert_tables``): table
    t's keys, scores and pending flags are ``[key_offsets[t]:key_offsets[t + 1]]`` of the shared
    tensors. Each table gets exactly what its own ``find_or_insert_fixed`` on its slice would give
    (its clock advances the same), in one dispatch: on a GPU the launches do not grow with the
    table count. ``scores`` are taken by the tables whose policy takes them (lfu, epoch_lfu:
    increments; custom: the scores) and ignored by the others (their touches set the clock)."""
    where = "find_or_insert_tables"
    if not indexes:
        raise ValueError(f"{where}: indexes must name at least one table")
    if len({id(index) for index in indexes}) != len(indexes):
        raise ValueError(f"{where}: a table appears twice in indexes")
    first = indexes[0]
    keys = first._check_keys(where, keys)
    offsets = [int(o) for o in key_offsets]
    if (
        len(offsets) != len(indexes) + 1
        or offsets[0] != 0
        or offsets[-1] != keys.numel()
        or any(a > b for a, b in zip(offsets, offsets[1:]))
    ):
        raise ValueError(
            f"{where}: key_offsets must be {len(indexes) + 1} ascending ints from 0 to {keys.numel()}, got {offsets}"
        )
    for t, index in enumerate(indexes):
        if index.device != first.device:
            raise ValueError(f"{where}: table {t} is on {index.device}, table 0 on {first.device}")
    if scores is not None:
        scores = first._check_entries(f"HashTable.{where}", "scores", scores, keys)
    first._check_pending(where, pending, keys)
    if scores is None and any(index.policy == "custom" for index in indexes):
        raise ValueError(f"HashTable.{where}: the 'custom' policy needs scores, one per key")
    return _upsert_tables(indexes, keys, offsets, scores, pending, assign=False)


def _upsert_tables(
    indexes: Sequence[HashTable],
    keys: Tensor,
    offsets: list[int],
    scores: Tensor | None,
    pending: Tensor | None,
    assign: bool,
) -> FixedInsertResult:
    """One ``ops.hash_upsert_tables`` call over checked arguments, each table locked for writing
    and its clock advanced as its own call would."""
    with ExitStack() as locks:
        for index in sorted(indexes, key=id):  # one order for every caller: no deadlock
            locks.enter_context(index._lock.write())
        for index in indexes:
            index._clock += 1
        rows, inserted, evicted, evicted_keys = ops.hash_upsert_tables(
            [i._digests for i in indexes],
            [i._slot_keys for i in indexes],
            [i._slot_scores for i in indexes],
            [i._size for i in indexes],
            keys,
            offsets,
            scores,
            pending,
            [i._capacity for i in indexes],
            [POLICIES[i.policy] for i in indexes],
            [i._clock for i in indexes],
            [i._epoch for i in indexes],
            assign,
        )
        maps = [index._row_map() for index in indexes]
        if any(m is not None for m in maps):
            ops.hash_slot_rows(rows, offsets, maps)
        return FixedInsertResult(rows, inserted, evicted, evicted_keys)


class _ReadWriteLock:
    """Many readers or one writer; a waiting writer blocks new readers (no writer starvation)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._writer = False
        self._writers_waiting = 0

    @contextmanager
    def read(self):
        with self._cond:
            while self._writer or self._writers_waiting:
                self._cond.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                if self._readers == 0:
                    self._cond.notify_all()

    @contextmanager
    def write(self):
        with self._cond:
            self._writers_waiting += 1
            while self._writer or self._readers:
                self._cond.wait()
            self._writers_waiting -= 1
            self._writer = True
        try:
            yield
        finally:
            with self._cond:
                self._writer = False
                self._cond.notify_all()


def _table_device(where: str, device: object) -> torch.device:
    """``device`` as a table's: one with the kernels, a CUDA device with its index."""
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"{where}: device must be a torch.device or a device string, got {device!r}") from None
    if device.type not in ("cpu", "cuda") or not ops.has_kernel("hash_find", device):
        raise ValueError(
            f"{where}: device {device} has no torchrec_ext kernels in this build "
            "(CUDA kernels are built only when torch has CUDA and nvcc is found, or FORCE_CUDA=1)"
        )
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())  # tensors made on "cuda" say cuda:N
    return device


# A table's tensors: its whole state but for the counters and the geometry.
_ARRAYS = ("_digests", "_slot_keys", "_slot_scores", "_size", "_slot_rows", "_row_slots")


class HashTable:
    """Maps raw int64 keys to rows in ``[0, capacity)``, evicting by score when full.

    Every int64 is a valid key (-1, 0, INT64_MIN, INT64_MAX included). Duplicates in one batch
    get one row; a key keeps its row until erased or evicted. A key may live in one of two
    buckets of 32 slots (the first in its stripe of ~2,048 slots, the second in the next stripe
    on the ring); when both are full an insert evicts the lowest-score slot of the two (the first
    on ties) if the new key's score is not lower, else it is refused (row -1). A load of a full
    table may put a few keys in rows outside their buckets (the stash, ``place_keys``): lookups
    find them there, and inserts evict them as any row of the bucket they lie in. A call never
    evicts its own keys: every key of the batch that already holds a row is touched and pinned
    first, then the new keys are inserted one at a time, window by window of the batch and phase
    by phase of stripes within a window, in batch order within a phase
    (``torchrec_ext.reference.insert_order`` states it exactly).

    Policies (the score a touch leaves):
      ``lru``       logical clock of the last touch (advances by one per mutating call)
      ``lfu``       touch count (1 per occurrence, or the caller's ``scores`` as increments)
      ``epoch_lru`` ``epoch << 32 | clock``; ``set_epoch`` moves the epoch
      ``epoch_lfu`` ``epoch << 32 | count within the epoch``
      ``custom``    the caller's ``scores`` (required)
      ``none``      clock as ``lru``, but nothing is evicted: inserts into full buckets are refused
    Results are deterministic for a given sequence of calls, whatever the thread count.
    """

    def __init__(
        self,
        capacity: int,
        *,
        policy: str = "lru",
        device: str | torch.device | None = None,
        mapped_rows: bool = False,
    ):
        if not isinstance(capacity, int) or isinstance(capacity, bool):
            raise TypeError(f"HashTable: capacity must be an int, got {type(capacity).__name__}")
        if capacity <= 0:
            raise ValueError(f"HashTable: capacity must be > 0, got {capacity}")
        if not isinstance(policy, str) or policy not in POLICIES:
            raise ValueError(f"HashTable: policy must be one of {sorted(POLICIES)}, got {policy!r}")
        device = _table_device("HashTable", "cpu" if device is None else device)
        self._capacity = capacity
        self.policy = policy
        self.device = device
        self.num_buckets, self.num_stripes = table_geometry(capacity)
        self._num_slots = self.num_buckets * SLOTS_PER_BUCKET
        # Main slots, then the stash (csrc/hash_table_layout.h): its entries and per-bucket counts.
        digest_len, key_len, score_len = index_lengths(capacity)
        self._digests = torch.zeros(digest_len, dtype=torch.uint8, device=device)
        self._slot_keys = torch.zeros(key_len, dtype=torch.int64, device=device)
        self._slot_scores = torch.zeros(score_len, dtype=torch.int64, device=device)
        self._size = torch.zeros(1, dtype=torch.int64, device=device)
        # Row of each slot of [0, capacity) and its inverse (None: slot i holds row i): see the
        # module docstring. Kept from the start with ``mapped_rows`` (a table that will grow: its
        # memory is then what ``row_map_bytes`` says throughout); set by ``grown``.
        self._slot_rows: Tensor | None = None
        self._row_slots: Tensor | None = None
        if mapped_rows:
            self._set_slot_rows(
                torch.zeros(0, dtype=torch.int64, device=device), torch.zeros(0, dtype=torch.int64, device=device)
            )
        self._clock = 0
        self._epoch = 0
        self._lock = _ReadWriteLock()

    # ------------------------------------------------------------------ properties

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def clock(self) -> int:
        """Logical clock: the number of ``find_or_insert`` / ``insert_or_assign`` calls so far."""
        return self._clock

    @property
    def epoch(self) -> int:
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        if not isinstance(epoch, int) or isinstance(epoch, bool) or not 0 <= epoch < 2**31:
            raise ValueError(f"HashTable.set_epoch: epoch must be an int in [0, 2**31), got {epoch!r}")
        with self._lock.write():
            self._epoch = epoch

    def size(self) -> int:
        with self._lock.read():
            return int(self._size)

    def size_tensor(self) -> Tensor:
        """Live keys as an int64 ``[1]`` tensor on the table's device: ``size()`` without the host
        read (the table's own counter, changed by later calls: copy or read it at once)."""
        return self._size

    def load_factor(self) -> float:
        return self.size() / self._capacity

    def stash_size(self) -> int:
        """Keys held in rows outside their two buckets (the stash: a few keys of a full load)."""
        with self._lock.read():
            return int(self._stash_entries()[0].numel())

    def _stash_entries(self) -> tuple[Tensor, Tensor]:
        """(keys, rows) of the stash's live entries (an entry whose row lost its key is stale)."""
        s, t = self._num_slots, stash_slots(self._capacity)
        used = self._digests[s : s + t] != 0
        rows, keys = self._slot_keys[s : s + t][used], self._slot_keys[s + t : s + 2 * t][used]
        live = (self._digests[rows] != 0) & (self._slot_keys[rows] == keys)
        return keys[live], self._rows_of_slots(rows[live])

    def metadata_bytes(self) -> int:
        """Bytes of the index: the digest, key and score arrays (1 + 8 + 8 B per slot), and the
        slot <-> row maps of a grown or growing table (``row_map_bytes``)."""
        arrays = (self._digests, self._slot_keys, self._slot_scores, self._slot_rows, self._row_slots)
        return sum(t.numel() * t.element_size() for t in arrays if t is not None)

    def __repr__(self) -> str:
        return f"HashTable(capacity={self._capacity}, policy={self.policy!r}, device={self.device}, size={self.size()})"

    # ------------------------------------------------------------------ operations

    def find(self, keys: Tensor) -> tuple[Tensor, Tensor]:
        """Rows of ``keys`` (-1 where absent) and a bool mask of which were found. Read-only."""
        keys = self._check_keys("find", keys)
        if torch.compiler.is_compiling():
            # torch.compile cannot trace a lock (as torch.export, it would not put one in the
            # program either): a compiled program's lookups run unlocked, so nothing may mutate
            # the table from another thread while one runs.
            slots, found = ops.hash_find(self._digests, self._slot_keys, keys, self._capacity)
            return self._rows_of_slots(slots), found
        with self._lock.read():
            slots, found = ops.hash_find(self._digests, self._slot_keys, keys, self._capacity)
            return self._rows_of_slots(slots), found

    def lookup_arrays(self) -> tuple[Tensor, Tensor]:
        """(digests, slot_keys), as ``ops.hash_find`` takes them, for a caller that keeps mutations
        away itself: a serving module never mutates an index it published (it swaps in a new one).
        ``ops.hash_find`` gives slots: the rows of a table that never grew (a grown one refuses)."""
        if self._slot_rows is not None:
            raise ValueError("HashTable.lookup_arrays: a grown table's rows are not its slots; use find")
        return self._digests, self._slot_keys

    def find_or_insert(self, keys: Tensor, scores: Tensor | None = None) -> InsertResult:
        """Rows of ``keys``, inserting the missing ones; touches every key's score by the policy.

        ``scores``: required for ``custom`` (the score to store); for ``lfu`` / ``epoch_lfu``
        optional non-negative increments (default 1 per occurrence); not accepted otherwise.
        """
        keys = self._check_keys("find_or_insert", keys)
        if scores is not None and self.policy not in _SCORED_TOUCH:
            raise ValueError(
                f"HashTable.find_or_insert: scores are only taken by policies {sorted(_SCORED_TOUCH)}, "
                f"this table's policy is {self.policy!r}"
            )
        scores = self._check_scores("find_or_insert", scores, keys, increments=self.policy != "custom")
        return self._upsert(keys, scores, assign=False)

    def find_or_insert_fixed(
        self, keys: Tensor, scores: Tensor | None = None, pending: Tensor | None = None
    ) -> FixedInsertResult:
        """``find_or_insert`` for a training step: outputs of one entry per key, so that nothing is
        read on the host (on a GPU: no sync), and ``pending`` (bool, one per key; None: all): the
        keys not pending take no part, as if the call had been made on the pending keys alone.
        ``scores`` are checked by type and shape only: their values (increments >= 0) are the
        caller's to vouch for (a batch's dedup counts), since reading them would sync."""
        keys = self._check_keys("find_or_insert_fixed", keys)
        if scores is not None and self.policy not in _SCORED_TOUCH:
            raise ValueError(
                f"HashTable.find_or_insert_fixed: scores are only taken by policies {sorted(_SCORED_TOUCH)}, "
                f"this table's policy is {self.policy!r}"
            )
        scores = self._check_scores("find_or_insert_fixed", scores, keys, increments=False)
        self._check_pending("find_or_insert_fixed", pending, keys)
        with self._lock.write():
            self._clock += 1
            slots, inserted, evicted, evicted_keys = ops.hash_upsert_fixed(
                self._digests,
                self._slot_keys,
                self._slot_scores,
                self._size,
                keys,
                scores,
                pending,
                self._capacity,
                POLICIES[self.policy],
                self._clock,
                self._epoch,
                False,
            )
            return FixedInsertResult(self._rows_of_slots(slots), inserted, evicted, evicted_keys)

    def erase_rows(self, rows: Tensor) -> Tensor:
        """Removes the keys held at the rows where ``rows`` (bool ``[capacity]``) is True, as
        ``erase`` of those keys would, without listing them (nothing read on the host); returns
        which rows held a live key (those removed)."""
        if not isinstance(rows, Tensor) or rows.dtype != torch.bool or rows.shape != (self._capacity,):
            raise ValueError(
                f"HashTable.erase_rows: rows must be a bool tensor of shape ({self._capacity},), got "
                f"{getattr(rows, 'dtype', type(rows).__name__)} of shape {tuple(getattr(rows, 'shape', ()))}"
            )
        with self._lock.write():
            digests = self._digests[: self._capacity]  # slots of [0, capacity); erasing clears a digest
            in_slots = rows if self._slot_rows is None else rows.index_select(0, self._slot_rows)
            removed = (digests != 0) & in_slots
            digests.masked_fill_(removed, 0)
            self._size -= removed.sum()
        return removed if self._row_slots is None else removed.index_select(0, self._row_slots)

    def insert_or_assign(self, keys: Tensor, scores: Tensor | None = None) -> InsertResult:
        """Like ``find_or_insert``, but given ``scores`` are stored as they are, for any policy."""
        keys = self._check_keys("insert_or_assign", keys)
        scores = self._check_scores("insert_or_assign", scores, keys, increments=False)
        return self._upsert(keys, scores, assign=True)

    def new_key_score(self) -> int:
        """The score a key new to the next ``find_or_insert`` / ``insert_or_assign`` without
        ``scores`` gets (csrc/hash_table_layout.h's touched_score): what a caller that places keys
        itself (``place_keys``) gives new keys so later evictions rank them as an insert would."""
        if self.policy == "custom":
            raise ValueError("HashTable.new_key_score: the 'custom' policy takes every score from the caller")
        clock = self._clock + 1  # the next mutating call's
        return {
            "none": clock,
            "lru": clock,
            "lfu": 1,
            "epoch_lru": (self._epoch << 32) | (clock & 0xFFFFFFFF),
            "epoch_lfu": (self._epoch << 32) | 1,
        }[self.policy]

    def erase(self, keys: Tensor) -> Tensor:
        """Removes ``keys``; returns a bool mask, True where a key was removed (first occurrence)."""
        keys = self._check_keys("erase", keys)
        with self._lock.write():
            return ops.hash_erase(self._digests, self._slot_keys, self._size, keys, self._capacity)

    def entries_at(self, rows: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The key and score at each of ``rows`` (int64, in [0, capacity)), and a mask of the rows
        that hold a live key. Read-only; costs a lookup per row, not a scan of the table."""
        with self._lock.read():
            # A row lies in one slot: its key is live there iff looking the key up finds this slot
            # (an empty slot keeps the key it last held, which then lives elsewhere or nowhere).
            slots = rows if self._row_slots is None else self._row_slots.index_select(0, rows)
            keys, scores = self._slot_keys.index_select(0, slots), self._slot_scores.index_select(0, slots)
            found_slots, found = ops.hash_find(self._digests, self._slot_keys, keys, self._capacity)
        return keys, scores, found & (found_slots == slots)

    def export(self, page_size: int = 1 << 20) -> Iterator[tuple[Tensor, Tensor, Tensor]]:
        """Pages of live ``(keys, rows, scores)`` in slot order (row order unless the table grew),
        each scanning ``page_size`` slots.

        Each page is read atomically; a table mutated between pages gives pages of different
        moments, as any paged scan does.
        """
        if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size <= 0:
            raise ValueError(f"HashTable.export: page_size must be an int > 0, got {page_size!r}")
        return self._pages(page_size)  # checked at the call, not at the first page

    def _pages(self, page_size: int) -> Iterator[tuple[Tensor, Tensor, Tensor]]:
        for start in range(0, self._capacity, page_size):
            # The lock is released before yielding: a caller may mutate the table between pages.
            with self._lock.read():
                keys, slots, scores = ops.hash_export(
                    self._digests,
                    self._slot_keys,
                    self._slot_scores,
                    self._capacity,
                    start,
                    min(start + page_size, self._num_slots),
                )
            yield keys, self._rows_of_slots(slots), scores

    def __getstate__(self) -> dict[str, object]:
        # A lock cannot be pickled or deep-copied; a copy gets a fresh one (``__setstate__``).
        with self._lock.read():
            state = dict(self.__dict__)
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self._lock = _ReadWriteLock()

    def clone(self, device: str | torch.device | None = None) -> HashTable:
        """An independent copy (same keys, rows, scores, clock and epoch), on ``device`` (None:
        this table's): a device move. The arrays are copied as they are, since their layout
        (csrc/hash_table_layout.h) is every device's: the copy behaves exactly as this table, and a
        move builds no index (no export, no restore) and allocates the index once."""
        device = self.device if device is None else _table_device("HashTable.clone", device)
        twin = HashTable.__new__(HashTable)
        with self._lock.read():
            twin.__dict__.update(self.__dict__)
            for name in _ARRAYS:
                value = getattr(self, name)
                setattr(twin, name, None if value is None else value.to(device, copy=True))
        twin.device = device
        twin._lock = _ReadWriteLock()
        return twin

    def grown(self, capacity: int) -> tuple[HashTable, Tensor]:
        """This table's entries rebuilt in a new table of ``capacity`` rows (>= ``size()``), and
        the row map: ``row_map[old_row]`` is the new row of the key at ``old_row`` (-1: no live key
        there). Keys, scores, clock and epoch are kept. Growing (``capacity`` >= this capacity),
        every key keeps its row (``row_map`` is the identity on the live rows): only the index is
        rebuilt, each key in a slot of its new buckets that takes the key's row (the free rows go
        to the empty slots); shrinking, the keys take the rows of their new slots. On the table's
        device, with no host copy of the entries: the keys are inserted with their scores by one
        fixed-size upsert; should some not fit (only in tiny tables, both buckets full), every key
        is re-placed by ``place_keys`` instead. Two counted host reads: the size, and whether every
        key was placed. This table is unchanged. (``grown_tables``: many at once.)
        """
        return grown_tables([self], [capacity])[0]

    def clear(self) -> None:
        with self._lock.write():
            self._digests.zero_()
            self._size.zero_()

    def state_dict(self) -> dict[str, object]:
        """Live keys, their rows and scores in row order, plus what reproduces placement and
        scoring (a table that maps slots to rows: each key's slot too, under ``slots``)."""
        with self._lock.read():
            keys, slots, scores = ops.hash_export(
                self._digests, self._slot_keys, self._slot_scores, self._capacity, 0, self._num_slots
            )
            rows, extra = slots, {}
            if self._slot_rows is not None:  # in row order, as a table whose rows are its slots
                rows, order = self._rows_of_slots(slots.clone()).sort()
                keys, scores, extra = keys[order], scores[order], {"slots": slots[order]}
            return extra | {
                "capacity": self._capacity,
                "policy": self.policy,
                "clock": self._clock,
                "epoch": self._epoch,
                "layout": LAYOUT_VERSION,
                "keys": keys,
                "rows": rows,
                "scores": scores,
            }

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restores a ``state_dict`` of a table of the same capacity: same keys at the same rows.

        Everything is checked (types, ranges, duplicate keys, rows each key may hold) before the
        table changes: a bad state raises and leaves the table as it was. A state without
        ``layout`` predates it (layout 1); rows of another layout load only where each still lies
        in one of its key's buckets (else re-place the keys: ``place_keys``). A grown table's
        state (with ``slots``) puts each key at its slot and gives that slot the key's row.
        """
        where = "HashTable.load_state_dict"
        if not isinstance(state, Mapping):
            raise TypeError(f"{where}: state must be a dict (from state_dict()), got {type(state).__name__}")
        missing = {"capacity", "policy", "clock", "epoch", "keys", "rows", "scores"} - set(state)
        if missing:
            raise ValueError(f"{where}: state is missing {sorted(missing)}")
        if state["capacity"] != self._capacity:
            raise ValueError(
                f"{where}: state was saved with capacity {state['capacity']}, "
                f"this table has capacity {self._capacity}; rows are only valid for the same capacity"
            )
        if state["policy"] != self.policy:
            raise ValueError(
                f"{where}: state was saved with policy {state['policy']!r}, this table has policy {self.policy!r}"
            )
        clock = check_counter(where, "clock", state["clock"], CLOCK_LIMIT)
        epoch = check_counter(where, "epoch", state["epoch"], EPOCH_LIMIT)
        layout = check_counter(where, "layout", state.get("layout", 1), LAYOUT_LIMIT)
        keys = self._check_keys("load_state_dict", state["keys"])
        rows = self._check_entries(where, "rows", state["rows"], keys)
        scores = self._check_entries(where, "scores", state["scores"], keys)
        slots = None
        if state.get("slots") is not None:  # a grown table's: keys at their slots, rows mapped
            slots, row_ids = self._check_entries(where, "slots", state["slots"], keys), rows
            bad = (row_ids < 0) | (row_ids >= self._capacity)
            if bool(bad.any()):
                i = int(bad.nonzero()[0])
                raise ValueError(f"{where}: rows must be in [0, {self._capacity}), got {int(row_ids[i])} at entry {i}")
            if torch.unique(row_ids).numel() != row_ids.numel():
                raise ValueError(f"{where}: rows must be distinct (one row per key)")
            rows = slots
        # Build into fresh storage and swap only on success: a bad state leaves the table as it was.
        digests = torch.zeros_like(self._digests)
        slot_keys = torch.zeros_like(self._slot_keys)
        slot_scores = torch.zeros_like(self._slot_scores)
        size = torch.zeros_like(self._size)
        try:
            ops.hash_restore(digests, slot_keys, slot_scores, size, keys, rows, scores, self._capacity)
        except RuntimeError as e:
            other = (
                ""
                if layout == LAYOUT_VERSION
                else (
                    f" (the state's rows follow layout {layout}, this table's is {LAYOUT_VERSION}: re-place its keys with place_keys)"
                )
            )
            raise ValueError(f"{where}: {e}{other}") from None
        if layout < STASH_LAYOUT and bool(digests[self._num_slots] != 0):  # before the stash: rows in buckets only
            s, t = self._num_slots, stash_slots(self._capacity)
            key, row = int(slot_keys[s + t]), int(slot_keys[s])
            raise ValueError(
                f"{where}: key {key} cannot live in row {row} (not one of its buckets; the state's rows "
                f"follow layout {layout}, this table's is {LAYOUT_VERSION}: re-place its keys with place_keys)"
            )
        with self._lock.write():
            self._digests, self._slot_keys, self._slot_scores = digests, slot_keys, slot_scores
            self._size = size
            self._clock, self._epoch = clock, epoch
            if slots is not None:
                self._set_slot_rows(slots, row_ids)
            elif self._slot_rows is not None:  # rows are slots: the identity
                self._set_slot_rows(keys[:0], keys[:0])

    # ------------------------------------------------------------------ internals

    def _rows_of_slots(self, slots: Tensor) -> Tensor:
        """The rows of ``slots`` (-1 stays -1): ``slots`` itself, mapped in place (a kernel's output)."""
        if self._row_map() is not None:
            ops.hash_slot_rows(slots, [0, slots.numel()], [self._slot_rows])
        return slots

    # Whether the slot -> row map is the identity (a growing table before its first growth: the
    # map is kept for its memory, but no pass over a call's slots is needed).
    _rows_are_slots: bool = False

    def _row_map(self) -> Tensor | None:
        """The slot -> row map a call's slots go through (None: rows are slots)."""
        return None if self._rows_are_slots else self._slot_rows

    def _set_slot_rows(self, slots: Tensor, rows: Tensor) -> None:
        """Makes ``rows`` (distinct, in [0, capacity)) the rows of the keys at ``slots``, and gives
        the other rows to the other slots, both in ascending order (deterministic)."""
        n, dtype = self._capacity, row_map_dtype(self._capacity)
        ramp = torch.arange(n, dtype=dtype, device=self.device)
        if slots.numel() == 0:  # the identity (a table that will grow, before it does)
            self._slot_rows, self._row_slots, self._rows_are_slots = ramp, ramp.clone(), True
            return
        slot_rows = torch.full((n,), -1, dtype=dtype, device=self.device)
        slot_rows[slots] = rows.to(dtype)
        used = torch.zeros(n, dtype=torch.bool, device=self.device)
        used[rows] = True
        # The free rows, ascending; their count is known here, so no read of it back from the device.
        free_rows = torch.nonzero_static(~used, size=n - rows.numel()).view(-1).to(dtype)
        slot_rows.masked_scatter_(slot_rows < 0, free_rows)
        row_slots = torch.empty_like(slot_rows)
        row_slots[slot_rows.long()] = ramp
        self._slot_rows, self._row_slots, self._rows_are_slots = slot_rows, row_slots, False

    def _upsert(self, keys: Tensor, scores: Tensor | None, assign: bool) -> InsertResult:
        with self._lock.write():
            self._clock += 1
            slots, inserted, evicted_keys, evicted_slots = ops.hash_upsert(
                self._digests,
                self._slot_keys,
                self._slot_scores,
                self._size,
                keys,
                scores,
                self._capacity,
                POLICIES[self.policy],
                self._clock,
                self._epoch,
                assign,
            )
            return InsertResult(self._rows_of_slots(slots), inserted, evicted_keys, self._rows_of_slots(evicted_slots))

    def _check_keys(self, op: str, keys: object) -> Tensor:
        if not isinstance(keys, Tensor):
            raise TypeError(f"HashTable.{op}: keys must be a torch.Tensor, got {type(keys).__name__}")
        if keys.dtype not in INT_DTYPES:
            raise TypeError(f"HashTable.{op}: keys must be an integer tensor (int64 preferred), got {keys.dtype}")
        if keys.dim() != 1:
            raise ValueError(f"HashTable.{op}: keys must be 1-D, got shape {tuple(keys.shape)}")
        if keys.device != self.device:
            raise ValueError(f"HashTable.{op}: keys are on {keys.device}, the table is on {self.device}")
        return keys.to(torch.int64).contiguous()

    def _check_pending(self, op: str, pending: object, keys: Tensor) -> None:
        """``pending`` of a fixed-size upsert: None (all keys) or one bool flag per key, here."""
        if pending is not None and (
            not isinstance(pending, Tensor)
            or pending.dtype != torch.bool
            or pending.shape != keys.shape
            or pending.device != self.device
        ):
            raise ValueError(
                f"HashTable.{op}: pending must be a bool tensor of one flag per key on {self.device}, "
                f"got {getattr(pending, 'dtype', type(pending).__name__)} of shape "
                f"{tuple(getattr(pending, 'shape', ()))}"
            )

    def _check_entries(self, where: str, name: str, values: object, keys: Tensor) -> Tensor:
        """A state's per-key ``rows`` / ``scores``: an integer tensor with one entry per key."""
        if not isinstance(values, Tensor) or values.dtype not in INT_DTYPES:
            raise TypeError(
                f"{where}: {name} must be an integer tensor, got {getattr(values, 'dtype', type(values).__name__)}"
            )
        if values.shape != keys.shape:
            raise ValueError(
                f"{where}: {name} must have one entry per key, shape {tuple(keys.shape)}, got {tuple(values.shape)}"
            )
        return values.to(self.device, torch.int64).contiguous()

    def _check_scores(self, op: str, scores: Tensor | None, keys: Tensor, increments: bool) -> Tensor | None:
        if scores is None:
            if self.policy == "custom":
                raise ValueError(f"HashTable.{op}: the 'custom' policy needs scores, one per key")
            return None
        if not isinstance(scores, Tensor) or scores.dtype not in INT_DTYPES:
            raise TypeError(
                f"HashTable.{op}: scores must be an integer tensor, got {getattr(scores, 'dtype', type(scores).__name__)}"
            )
        if scores.shape != keys.shape:
            raise ValueError(
                f"HashTable.{op}: scores must have one entry per key, shape {tuple(keys.shape)}, got {tuple(scores.shape)}"
            )
        if scores.device != self.device:
            raise ValueError(f"HashTable.{op}: scores are on {scores.device}, the table is on {self.device}")
        scores = scores.to(torch.int64).contiguous()
        if increments and scores.numel() and int(scores.min()) < 0:
            raise ValueError(f"HashTable.{op}: {self.policy} increments must be >= 0, got {int(scores.min())}")
        return scores


class _Exported(NamedTuple):
    """A table's live entries as ``grown_tables`` reads them (under the table's read lock)."""

    keys: Tensor
    rows: Tensor
    scores: Tensor
    held: Tensor  # the count of its live slots, on the device (checked against the size read)
    clock: int
    epoch: int


def grown_tables(
    tables: Sequence[HashTable], capacities: Sequence[int], sizes: Sequence[int] | None = None
) -> list[tuple[HashTable, Tensor]]:
    """``[t.grown(c) for t, c in zip(tables, capacities)]`` (see ``HashTable.grown``) for many
    tables at once, with no host read per table. ``sizes``: each table's live keys as the caller
    read them on the host (``size_tensor``; a growth reads them for its plan), else read here in
    one counted read. With the sizes known, a table's live slots are found by ``nonzero_static``
    (no read of their count) and every twin's keys are placed by one ``hash_upsert_tables`` call
    (fixed-size outputs); one counted read for all tables then says whether any key missed its slot
    and whether each table held the keys its size says (else a RuntimeError: the table changed
    since its size was read). Every table is unchanged."""
    for capacity in capacities:
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity <= 0:
            raise ValueError(f"HashTable.grown: capacity must be an int > 0, got {capacity!r}")
    if sizes is None:
        sizes = device_sync.host_list(torch.cat([t.size_tensor() for t in tables]), "growth: live rows")
    for size, capacity in zip(sizes, capacities):
        if size > capacity:
            raise ValueError(f"HashTable.grown: capacity must hold the table's {size} keys, got {capacity}")
    exported, twins = [], []
    for table, size, capacity in zip(tables, sizes, capacities):
        with table._lock.read():
            # hash_export's live slots, ascending, without its read of their count: rows past
            # the capacity are never used.
            occupied = table._digests[: min(table._num_slots, table._capacity)] != 0
            slots = torch.nonzero_static(occupied, size=size).view(-1)
            keys, scores = table._slot_keys[slots], table._slot_scores[slots]
            rows = table._rows_of_slots(slots)
            exported.append(_Exported(keys, rows, scores, occupied.sum(), table._clock, table._epoch))
        twin = HashTable(capacity, policy=table.policy, device=table.device, mapped_rows=table._slot_rows is not None)
        twin._epoch = exported[-1].epoch
        twins.append(twin)
    filled = [t for t, size in enumerate(sizes) if size]
    new_slots = [e.keys for e in exported]  # (the empty tables': no keys, no slots)
    if filled:
        offsets = [0]
        for t in filled:
            offsets.append(offsets[-1] + sizes[t])
        placed = _upsert_tables(
            [twins[t] for t in filled],
            torch.cat([exported[t].keys for t in filled]),
            offsets,
            torch.cat([exported[t].scores for t in filled]),
            None,
            assign=True,
        ).rows
        for t, begin, end in zip(filled, offsets, offsets[1:]):
            new_slots[t] = placed[begin:end]
    # Per table: whether a key missed its slot, and the live keys it held.
    checks = [torch.stack([(new_slots[t] < 0).any().long(), exported[t].held]) for t in range(len(tables))]
    read = device_sync.host_list(torch.stack(checks).view(-1), "growth: keys placed")
    missed, held = read[0::2], read[1::2]
    for t, (size, live) in enumerate(zip(sizes, held)):
        if live != size:
            raise RuntimeError(
                f"HashTable.grown: table {t} holds {live} live keys where its size read {size} before the "
                "growth (it changed since): no table was changed"
            )
    out = []
    for t, (table, capacity, twin) in enumerate(zip(tables, capacities, twins)):
        keys, rows, scores, _, clock, epoch = exported[t]
        if missed[t]:  # both buckets full at this capacity: an exact placement
            twin = HashTable(
                capacity, policy=table.policy, device=table.device, mapped_rows=twin._slot_rows is not None
            )
            new_slots[t] = place_keys(keys, scores, capacity)
            unplaced = int(device_sync.to_host((new_slots[t] < 0).sum(), "growth: keys placed exactly"))
            if unplaced:
                raise ValueError(
                    f"HashTable.grown: {unplaced} of {keys.numel()} keys cannot be placed in capacity {capacity}"
                )
            twin.load_state_dict(
                {
                    "capacity": capacity,
                    "policy": table.policy,
                    "clock": clock,
                    "epoch": epoch,
                    "layout": LAYOUT_VERSION,
                    "keys": keys,
                    "rows": new_slots[t],
                    "scores": scores,
                }
            )
        twin._clock, twin._epoch = clock, epoch
        row_map = torch.full((table._capacity,), -1, dtype=torch.int64, device=table.device)
        if capacity >= table._capacity:
            twin._set_slot_rows(new_slots[t], rows)
            row_map[rows] = rows
        else:
            row_map[rows] = new_slots[t]
        out.append((twin, row_map))
    return out
