"""Tables larger than fast memory: every row in a backing store, the hot ones in a cache.

``TieredTables`` is ``DynamicTables`` whose tables (``backing="host"`` or ``"file:<dir>"``) keep
all their rows, vectors and optimizer state, in a ``BackingStore`` (tier_store.py) and
``ceil(cache_load_factor * capacity)`` of them in the module's buffer: the cache. The hash-table
index (ids -> rows), eviction scores, ``last_seen`` and admission stay whole in fast memory (they
are small), so which id holds which row, and which id is evicted, expired or admitted, is decided
exactly as in an all-resident table: only where a row's payload sits changes.

Per lookup, each table's rows are translated to cache slots (``RowCache.hold``) before the
kernels run: a row not in the cache takes the least recently used slot that no batch in flight
holds (with ``cache_algorithm="lfu"``, TorchRec's ``CacheAlgorithm.LFU``: the least often looked
up, ties by least recent use; tier_device_maps.py) (its row written back first when dirty) and is read from the backing store, unless it is
new to its id (then it is initialised in the slot, as the all-resident table initialises its row).
The kernels then run unchanged on the cache, with slots for rows. A lookup's slots (a training
lookup's, or an eval-mode one's with grad on: a fused update follows either) stay dirty and
pinned until that update lands (or its autograd graph is dropped), so an update always
finds its rows. ``stage_next`` stages the next batch's rows on a worker thread while the
current batch's backward runs (what ``TrainPipeline`` calls): it fills the next batch's misses
and writes back and frees slots for its new rows, around the slots of the batch in flight, so
the next lookup reads and writes nothing in the backing store. ``prefetch`` does the filling
synchronously, between steps.

A lookup that fails after its upsert (a read or write-back of the backing store raising an OS
error: with file backing also a mapped page that fails, ``tier_guard``: OSError, not SIGBUS)
leaves no id reading a row not its own: the ids it made new leave the indexes again
(``_forget_new_ids``, which says what else stays as the lookup left it), the slots it took go
back (``RowCache._give_back``, ``DeviceSlotMaps._give_back``), and victims whose write-back
raised stay cached and dirty; the module trains on. A stage's failed read likewise. Sharded,
only the failing rank's lookup raises: its peers go on into the output dist and wait there for
it, so the step must fail on every rank (``TrainPipeline`` refuses to go on after a forward that
raised; a plain loop must not catch the error and go on alone, its next collectives would pair
with its peers' of the failed step).

``table_view`` / ``state_views`` (the tables' parameters, loading) are views of the backing
store, current after ``flush``. ``state_dict`` writes the dirty rows back first, then gathers
each row's newest copy (with file backing, a row written back since the last ``flush`` is in its
table's log: tier_log.py); loading fills the backing store and empties the cache (and the log).

Where the cache lives and where the backing lives are separate. The cache (the module's
buffers: vectors and optimizer state, which the kernels take) and the index live on the module's
device; the backing store always on the host (host memory or files). The cache's maps (row ->
slot, slot -> row, each slot's last use, dirty flags, pins) live on the host (``RowCache``, the
CPU's default: a lookup's rows are host tensors there) or on the cache's device
(``tier_device_maps.DeviceSlotMaps``, the default on a CUDA device; ``device_maps`` forces either
kind, tests run the device kind on the CPU). With the device maps a lookup translates rows to
slots on the device for all tables at once (slots = row_to_slot[rows]), touches, pins and marks
dirty by device scatters, and gives its new rows free slots on the device: what reaches the host
is one small read of per-table counts (rows without a slot, misses), whatever the table count. A
table with misses, or without free slots for its new rows, takes the host path for its missing
rows (victims: its least recently used unpinned slots, a ``topk`` over the slots' clocks). With
the pipeline's prefetch (``stage_next``) the stage makes the next batch's rows hot and frees slots
for its new rows, so the training lookup finds no miss. On a CUDA device rows move between the
tiers as records through a host buffer (tier_copies.py): a fill gathers the rows' fields on the
host, from host memory or from the files (the base file or the log), into a pinned buffer, which
goes to the device in one asynchronous DMA on the current stream and is scattered into the slots
there (with the device maps, all tables' rows of a fill or a stage packed in one buffer: one DMA
whatever the table count); a write-back gathers the slots into device records, one DMA into a
pinned buffer, and the host waits for that copy's event (it writes the backing store from those
bytes), then writes them to the store or appends them to the log (with the device maps, all
tables' victims of a fill or a stage packed the same way: one DMA and one wait whatever the
table count). The stage does this on its worker, on a side stream: the train step
waits only for the stage's event. (Not UVA zero-copy: a batch's misses are scattered rows, and one
DMA of the gathered rows costs the PCIe link no more than the kernels' reads of them would,
without the kernels' reading host memory at every lookup; a UVA gather kernel is a later option.)
``copy_through_records`` runs that same path with the cache on the CPU (tests: the GPU's path
without a GPU, plain copies in place of the DMA).

Host syncs on a GPU, per training lookup: the lookup's ids per table (``IdsToRows.lookup``), then
with the device maps one read of the per-table counts (benchmarks/results/tier_maps_host_work.md:
the bookkeeping's torch calls stay flat with the table count, where the host maps' grow ~32 a
table); misses, write-backs and flushes add reads of their own (a write-back waits for its DMA);
the stage's reads are on its worker and side stream. With the host maps all tables' rows (and
which are new) come to the host in one copy instead, their slots going back in one, and the host
does each table's bookkeeping (hold: LRU touches, pins, dirty flags), ~1-1.5 ms a table a step on
an H100's host, and the stage as much on its worker (benchmarks/results/gpu/tiers_gpu.md, session
12: 4x the all-resident step).
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch import Tensor
from torchrec.modules.embedding_configs import BaseEmbeddingConfig

from torchrec_ext import device_gate, device_sync, ops
from torchrec_ext.modules import tier_guard
from torchrec_ext.modules.configs import DEFAULT_CACHE_LOAD_FACTOR, cache_slots, options_of, storage_dtype_of
from torchrec_ext.modules.dynamic_tables import DynamicTables, RowLookup
from torchrec_ext.modules.table_stats import TableStats
from torchrec_ext.modules.table_storage import allocate_filled
from torchrec_ext.modules.tier_copies import (
    MAX_ROWS,
    DeviceCopies,
    RecordsBuffer,
    field_view,
    record_fields,
    row_column,
)
from torchrec_ext.modules.tier_device_maps import LFU_MAX_COUNT, DeviceSlotMaps
from torchrec_ext.modules.tier_log import ROW_BYTES, RowLog, at_crash_point
from torchrec_ext.modules.tier_lru import SlotOrder
from torchrec_ext.modules.tier_store import BackingStore
from torchrec_ext.vocabulary import (
    INITIALIZER_NAMES,
    INITIALIZER_PARAM_COUNTS,
    OPTIMIZER_STATES,
    ROWWISE_STATE,
    dense_state_offsets,
    table_words,
)


def tables_for(configs: Sequence[BaseEmbeddingConfig], device: torch.device) -> DynamicTables:
    """A module's tables: ``TieredTables`` when its tables have host or file backing."""
    if any(options_of(cfg).backing != "device" for cfg in configs):
        return TieredTables(configs, device)
    return DynamicTables(configs, device)


class _Mover:
    """Copies rows of one table between its cache slots and the backing store: the vectors and
    each optimizer state, in their storage dtypes (bit for bit). Slots and rows are host tensors
    (the device maps bring a miss's slots and rows to the host). With ``copies`` (a cache on another device than the
    backing store's host, or ``TieredTables.copy_through_records``) rows travel as records
    (tier_copies.py): gathered on the host into a records buffer (pinned on a GPU), one copy to
    the device, scattered into their slots there; written back the other way round."""

    def __init__(self, pairs: list[tuple[Tensor, Tensor]], copies: DeviceCopies | None = None):
        self.pairs = pairs  # (cache view, backing view), rows first
        widths = [c.element_size() * (c.shape[1] if c.dim() == 2 else 1) for c, _ in pairs]
        self.row_bytes = sum(widths)
        # Per pair: (first byte in the record, bytes); each field 8-byte aligned, so that the
        # records' columns are views of any dtype (no copy to read them).
        self.fields, self.record_bytes = record_fields(widths)
        self.copies = copies
        self._transfer: RecordsBuffer | None = None  # host records of transfers to and from the device

    # Whether the host path moves rows in ascending order: in a file (a file backing's base rows,
    # read by pread, written through the mapping) neighbouring rows share a page and runs of rows
    # are one read, and the file is read front to back; host memory gains nothing from it, and a
    # sort of a table's ~7k write-backs a step costs about what copying them does
    # (benchmarks/results/tier_copy_rows.md).
    ROWS_IN_ORDER = False

    def buffer_bytes(self) -> int:
        """Bytes of the host records buffer of transfers to and from the device (pinned on a GPU;
        made at the first transfer, up to ``MAX_ROWS`` records)."""
        return 0 if self._transfer is None else self._transfer.nbytes()

    def _transfer_buffer(self) -> RecordsBuffer:
        if self._transfer is None:
            self._transfer = self.copies.buffer(self.record_bytes)
        return self._transfer

    def _pair_field(self, records: Tensor, k: int) -> Tensor:
        return field_view(records, self.fields[k], self.pairs[k][0])

    @staticmethod
    def _copy(dst: Tensor, dst_rows: Tensor | None, src: Tensor, src_rows: Tensor | None, doing: str) -> None:
        """``dst[dst_rows] = src[src_rows]`` (rows None: all, in order), every copy between the
        cache or records and the backing store: ``ops.copy_rows`` on host backing (anonymous
        memory); a file's mapping takes ``tier_guard.copy_rows`` (a page that fails: OSError, not
        SIGBUS)."""
        ops.copy_rows(dst, dst_rows, src, src_rows)

    def backing_rows(self, rows: Tensor) -> list[Tensor]:
        """Copies of the backing store's ``rows`` (host tensors), per pair (the vectors, then
        each optimizer state): as the backing store holds them, not patched from a log."""
        out = []
        for _, backing in self.pairs:
            out.append(torch.empty((rows.numel(), *backing.shape[1:]), dtype=backing.dtype, device="cpu"))
            self._copy(out[-1], None, backing, rows, "read")
        return out

    def read(self, slots: Tensor, rows: Tensor) -> None:
        """The backing store's ``rows`` into the cache's ``slots`` (with ``copies``: through this
        table's own records buffer; the device maps read all tables' at once: ``copies.to_caches``)."""
        if rows.numel() == 0:
            return
        if self.copies is not None:
            self.copies.to_caches([(self, slots, rows)], self._transfer_buffer())
            return
        if self.ROWS_IN_ORDER:
            order = rows.argsort()
            slots, rows = slots[order], rows[order]
        self._read_here(slots, rows)

    def _read_here(self, slots: Tensor, rows: Tensor) -> None:
        """``read`` with the cache on the backing store's host (no records)."""
        for cache, backing in self.pairs:
            self._copy(cache, slots, backing, rows, "read")

    def gather(self, records: Tensor, slots: Tensor, rows: Tensor) -> None:
        """Host ``records`` ([n, record_bytes]) of the backing store's ``rows`` (ascending), each
        with its cache slot in the row column: one copy then takes everything to the device."""
        for k, (_, backing) in enumerate(self.pairs):
            self._copy(self._pair_field(records, k), None, backing, rows, "read")
        row_column(records).copy_(slots)

    def scatter(self, records: Tensor) -> None:
        """``gather``'s records, on the device, into their slots in the cache."""
        at = row_column(records).contiguous()
        for k, (cache, _) in enumerate(self.pairs):
            ops.copy_rows(cache, at, self._pair_field(records, k))

    def gather_cache(self, records: Tensor, at: Tensor) -> None:
        """Device ``records`` ([n, record_bytes], zeroed) of the cache's slots ``at`` (on the
        device): each field filled, the row column left for ``store``."""
        for k, (cache, _) in enumerate(self.pairs):
            self._pair_field(records, k).copy_(cache.index_select(0, at))

    def _from_cache(self, slots: Tensor) -> Tensor:
        """The cache's ``slots`` as host records (of the transfer buffer; row column unset)."""
        on_device = self.copies.empty(slots.numel(), self.record_bytes)
        self.gather_cache(
            on_device, device_sync.to_device(slots, self.copies.device)
        )  # (not .to(): a blocking copy waits for the stream)
        return self.copies.to_host(on_device, self._transfer_buffer())

    def write(self, slots: Tensor, rows: Tensor, once: bool = False, defer: bool = False) -> None:
        """Writes the rows of ``slots`` back (``once``: a flush's, not a step's: a log mover
        keeps no buffer of that size; ``defer``: a log's writes may wait for ``land``)."""
        if rows.numel() == 0:
            return
        if self.ROWS_IN_ORDER:
            order = rows.argsort()
            slots, rows = slots[order], rows[order]
        if self.copies is None:
            for cache, backing in self.pairs:
                self._copy(backing, rows, cache, slots, "write")
                at_crash_point("home")
            return
        for start in range(0, rows.numel(), MAX_ROWS):
            these = rows[start : start + MAX_ROWS]
            _Mover.store(self, self._from_cache(slots[start : start + MAX_ROWS]), these)

    write_home = write  # (host backing: the backing store is home)

    def store(self, records: Tensor, rows: Tensor) -> None:
        """A write-back's host records of ``rows`` into the backing store."""
        for k, (_, backing) in enumerate(self.pairs):
            self._copy(backing, rows, self._pair_field(records, k), None, "write")

    def land(self) -> None:
        """Writes what ``write(defer=True)`` left to write (a log's appends)."""

    def fold(self) -> None:
        pass

    def patch(self, rows: Tensor, values: list[Tensor]) -> None:
        pass


class _LogMover(_Mover):
    """``_Mover`` of a file-backed table: write-backs appended to the table's log as records (the
    row's number, then its vector and each optimizer state: ``tier_log.RowLog``), reads from each
    row's newest copy (the log's or the base file's); ``write_home`` / ``fold`` write rows to the
    base file itself (a checkpoint's flush)."""

    BUFFER_ROWS = 1 << 15  # write-backs up to this many rows reuse a records buffer (16 MiB of 512-byte records)
    ROWS_IN_ORDER = True  # (reads of the base file by pread, writes home through its mapping)
    _copy = staticmethod(tier_guard.copy_rows)  # (the backing files are mapped: a failed page is an OSError)

    def __init__(
        self, pairs: list[tuple[Tensor, Tensor]], store: BackingStore, t: int, copies: DeviceCopies | None = None
    ):
        super().__init__(pairs, copies)
        self.log = store.log(t, self.record_bytes)
        self.log.home = self._write_records_home
        # (records, rows, columns) kept: _columns' of reads and write-backs, and of deferred write-backs
        self._buffers: list[tuple[Tensor, Tensor, list[Tensor]] | None] = [None, None]

    def step_buffer_bytes(self) -> int:
        """Bytes of the records buffers of the CPU path's write-backs (a step's IO buffers)."""
        return sum(0 if kept is None else kept[0].numel() for kept in self._buffers)

    def land(self) -> None:
        self.log.land()

    def _field(self, records: Tensor, k: int, like: Tensor) -> Tensor:
        return field_view(records, self.fields[k], like)

    def _columns(self, n: int, deferred: bool = False) -> tuple[Tensor, Tensor, list[Tensor]]:
        """Records for n write-backs or reads: [n, record_bytes] uint8, its row numbers' column (int64) and
        each pair's column (as the cache's rows). A buffer kept across write-backs (its columns'
        views made once, its pads zeroed once): the log's append copies the records out
        (``pwrite``) before the next write-back refills them. ``deferred``: a second one, the
        log's until it lands (``RowLog.append(defer=True)``; the stage's, landed before the next
        stage writes)."""
        if n > self.BUFFER_ROWS or (deferred and self.log.unwritten()):  # (records of their own, not kept)
            return self._make_columns(n)
        kept = self._buffers[deferred]
        if kept is None or kept[0].shape[0] < n:
            kept = self._buffers[deferred] = self._make_columns(
                min(self.BUFFER_ROWS, max(n, 2 * kept[0].shape[0] if kept else n))
            )
        records, rows, columns = kept
        if records.shape[0] == n:
            return kept
        return records[:n], rows[:n], [column[:n] for column in columns]

    @torch.inference_mode(False)  # (the buffer kept is refilled by later write-backs outside inference_mode)
    def _make_columns(self, n: int) -> tuple[Tensor, Tensor, list[Tensor]]:
        records = torch.zeros(n, self.log.record_bytes, dtype=torch.uint8, device="cpu")
        rows = records[:, :ROW_BYTES].view(torch.int64).squeeze(1)
        return records, rows, [self._field(records, k, cache) for k, (cache, _) in enumerate(self.pairs)]

    def _read_here(self, slots: Tensor, rows: Tensor) -> None:
        where = self.log.locate(rows)
        in_log = where >= 0
        logged = int(in_log.sum())
        if logged == 0:
            return super()._read_here(slots, rows)
        if logged < rows.numel():
            in_base = ~in_log
            super()._read_here(slots[in_base], rows[in_base])
            where, slots = where[in_log], slots[in_log]
        order = where.argsort()  # the log read front to back
        slots = slots[order]
        records, _, columns = self._columns(where.numel())
        self.log.read(where[order], out=records)
        for (cache, _), column in zip(self.pairs, columns):
            ops.copy_rows(cache, slots, column)

    def gather(self, records: Tensor, slots: Tensor, rows: Tensor) -> None:
        """``_Mover.gather`` from each row's newest copy: the base file's rows first, then the
        log's records as the log holds them (read front to back), each with its slot."""
        where = self.log.locate(rows)
        in_log = where >= 0
        logged = int(in_log.sum())
        if logged < rows.numel():
            in_base = ~in_log
            super().gather(records[: rows.numel() - logged], slots[in_base], rows[in_base])
        if logged:
            where, slots = where[in_log], slots[in_log]
            order = where.argsort()
            records = records[rows.numel() - logged :]
            self.log.read(where[order], out=records)
            row_column(records).copy_(slots[order])

    def write(self, slots: Tensor, rows: Tensor, once: bool = False, defer: bool = False) -> None:
        n = rows.numel()
        if n == 0:
            return
        if self.copies is not None:  # the records made on the device, then appended from the host
            for start in range(0, n, MAX_ROWS):
                self.store(self._from_cache(slots[start : start + MAX_ROWS]), rows[start : start + MAX_ROWS])
            return
        # Each field gathered straight into its column of the records (no copy of the columns to join).
        # A flush's records are its own: the buffer kept is sized by the steps' write-backs.
        records, row_column_, columns = self._make_columns(n) if once else self._columns(n, defer)
        row_column_.copy_(rows)
        for (cache, _), column in zip(self.pairs, columns):
            ops.copy_rows(column, None, cache, slots)
        self.log.append(rows, records, defer)

    def store(self, records: Tensor, rows: Tensor) -> None:
        """A write-back's host records of ``rows``, appended to the log."""
        row_column(records).copy_(rows)
        self.log.append(rows, records)

    def write_home(self, slots: Tensor, rows: Tensor) -> None:
        super().write(slots, rows)
        self.log.forget(rows)

    def _write_records_home(self, rows: Tensor, records: Tensor) -> None:
        for k, (cache, backing) in enumerate(self.pairs):
            self._copy(backing, rows, self._field(records, k, cache), None, "write")
            at_crash_point("fold")

    def patch(self, rows: Tensor, values: list[Tensor], chunk: int = 1 << 16) -> None:
        """``values`` (per pair, gathered from the backing store at ``rows``): entries whose
        newest copy is in the log replaced by it (a chunk of records at a time)."""
        where = self.log.locate(rows)
        logged = (where >= 0).nonzero().squeeze(1)
        for start in range(0, logged.numel(), chunk):
            at = logged[start : start + chunk]
            records = self.log.read(where.index_select(0, at))
            for k, ((cache, _), out) in enumerate(zip(self.pairs, values)):
                ops.copy_rows(out, at, self._field(records, k, cache))

    def fold(self, chunk: int = 1 << 16) -> None:
        """Writes every row whose newest copy is in the log to the base file (ascending rows, a
        chunk at a time) and empties the log."""
        rows = self.log.live_rows()
        for start in range(0, rows.numel(), chunk):
            these = rows[start : start + chunk]
            self._write_records_home(these, self.log.read(self.log.locate(these)))
        self.log.reset()


class RowCache:
    """The host maps of a table's cache (``TieredTables.device_maps``; tier_device_maps.py keeps
    them on the device). Which rows of one table sit in its cache slots: row -> slot, slot -> row, the clock of
    each slot's last use (least recently used goes first), dirty slots (newer than the backing
    store) and pins (batches in flight holding the slot), plus the tier's counters: hits (rows
    a lookup found in the cache), misses (rows a lookup read from the backing store; a row new
    to its id is neither), staged (rows read ahead of their lookup by ``stage``/``prefetch``),
    write-backs (dirty rows written to the backing store; ``staged_write_backs`` of them by a
    stage, off the step) and bytes moved both ways. ``lfu``: victims by fewest lookups, then
    least recent use (``uses``, per row, as tier_device_maps.py counts them), a ``topk`` over all
    slots (the LRU order's queue is kept for the clocks only)."""

    def __init__(self, capacity: int, slots: int, lfu: bool = False):
        self.slots = slots
        self.uses = torch.zeros(capacity, dtype=torch.int32, device="cpu") if lfu else None  # LFU: lookups per row
        self.slot_of = torch.full((capacity,), -1, dtype=torch.int32, device="cpu")  # 4 bytes per row of the table
        self.row_of = torch.full((slots,), -1, dtype=torch.int64, device="cpu")
        self.last_used = torch.zeros(slots, dtype=torch.int64, device="cpu")
        self.dirty = torch.zeros(slots, dtype=torch.bool, device="cpu")
        # Slots left free (by a stage, or never filled): a lookup takes them without scanning
        # every slot for the least recently used. May name slots filled since (checked on use).
        self.free = torch.arange(slots, device="cpu")
        self.order = SlotOrder(slots)  # occupied slots, least recently used first (tier_lru.py)
        # Slots held by batches in flight, per batch (usually none between steps: a training
        # step's update lands before the next lookup). Kept as lists, not counts per slot, so a
        # step pays nothing to pin and unpin.
        self.pinned: dict[int, Tensor] = {}
        self._next_pin = 0
        self.hits = self.misses = self.write_backs = self.bytes_moved = 0
        self.staged = self.staged_write_backs = 0

    def nbytes(self) -> int:
        maps = (self.slot_of, self.row_of, self.last_used, self.dirty) + ((self.uses,) if self.lfu else ())
        free = self.free.untyped_storage().nbytes()  # (a view of its list's storage: at most 8 bytes a slot)
        return sum(t.numel() * t.element_size() for t in maps) + self.order.nbytes() + free

    @property
    def lfu(self) -> bool:
        return self.uses is not None

    def _oldest(self, k: int, clock: int, pinned: Tensor | None) -> Tensor:
        """Up to k occupied slots to take, not used at ``clock`` nor ``pinned``: the least
        recently used (out of the order), or with LFU the fewest used, then least recent."""
        if not self.lfu:
            return self.order.oldest(k, self.last_used, self.row_of, clock, pinned)
        if k <= 0:
            return torch.empty(0, dtype=torch.int64, device="cpu")
        takeable = (self.row_of >= 0) & (self.last_used < clock)
        if pinned is not None:
            takeable &= ~pinned
        n = min(k, int(takeable.sum()))
        uses = self.uses.index_select(0, self.row_of.clamp(min=0)).to(torch.int64)
        key = torch.where(takeable, (uses << 32) | self.last_used, torch.iinfo(torch.int64).max)
        return torch.topk(key, n, largest=False, sorted=True).indices

    def pinned_at_most(self) -> int:
        """A bound on the slots batches in flight hold (exact when they share none)."""
        return sum(slots.numel() for slots in self.pinned.values())

    def pinned_mask(self) -> Tensor:
        mask = torch.zeros(self.slots, dtype=torch.bool, device="cpu")
        for slots in self.pinned.values():
            mask[slots] = True
        return mask

    def pinned_slots(self) -> list[Tensor]:
        """The slots batches in flight hold now, per batch (a snapshot: each is a tensor no one
        writes): a stage's hand-over carries these and makes the mask on its worker
        (``mask_of``), off the train thread (a mask is a pass over every slot)."""
        return list(self.pinned.values())

    def mask_of(self, pinned: list[Tensor]) -> Tensor | None:
        """The mask of ``pinned`` (``pinned_slots``); None when it holds none."""
        if not pinned:
            return None
        mask = torch.zeros(self.slots, dtype=torch.bool, device="cpu")
        for slots in pinned:
            mask[slots] = True
        return mask

    def hold(
        self, rows: Tensor, fresh: Tensor | None, modifies: bool, clock: int, mover: _Mover, best_effort: bool = False
    ) -> Tensor:
        """The slots of ``rows`` (distinct; -1: none), missing ones brought in. ``fresh``: rows
        new to their id (initialised in the slot, not read); ``modifies``: the batch's update
        will write every row (else only fresh ones are written). best_effort: bring in only what
        fits in the slots no batch holds (a prefetch); otherwise not fitting is an error."""
        # index_select / index_fill_ / index_copy_ rather than t[idx] (index_put_): this runs in the step.
        every = rows.numel() == 0 or int(rows.min()) >= 0
        live = None if every else (rows >= 0).nonzero().squeeze(1)
        r = rows if every else rows.index_select(0, live)
        s = self.slot_of.index_select(0, r).to(torch.int64)
        missing = (s < 0).nonzero().squeeze(1)
        if not best_effort:
            self.hits += r.numel() - missing.numel()
            if self.lfu:  # one more lookup of each row (saturating); a row new to its id starts at 1
                more = self.uses.index_select(0, r).add_(1).clamp_(max=LFU_MAX_COUNT)
                if fresh is not None:
                    more = torch.where(fresh if every else fresh.index_select(0, live), 1, more).to(torch.int32)
                self.uses.index_copy_(0, r, more)
        # The batch's hits are used now (first: victims are slots last used before this clock).
        self.order.touch(s if not missing.numel() else s[s >= 0], clock, self.last_used, self.row_of)
        if missing.numel():
            victims, free = self._victims(missing.numel(), clock, best_effort)
            missing = missing[: victims.numel()]
            want = r.index_select(0, missing)
            try:
                if not free:
                    self._evict(victims, mover, ahead=best_effort)
                if fresh is None:
                    reads = want.numel()
                    mover.read(victims, want)
                else:
                    new = fresh if every else fresh.index_select(0, live)
                    read = ~new.index_select(0, missing)
                    reads = int(read.sum())  # rows new to their id take a slot but are not misses: nothing is read
                    if reads:
                        mover.read(victims[read], want[read])
            except BaseException:
                self._give_back(victims)
                raise
            if best_effort:
                self.staged += reads
            else:
                self.misses += reads
            self.bytes_moved += reads * mover.row_bytes
            self.row_of.index_copy_(0, victims, want)
            self.slot_of.index_copy_(0, want, victims.to(torch.int32))
            self.dirty.index_fill_(0, victims, False)
            self.order.touch(victims, clock, self.last_used, self.row_of)
            s.index_copy_(0, missing, victims)
            if best_effort:
                kept = (s >= 0).nonzero().squeeze(1)
                live = kept if every else live.index_select(0, kept)
                every, s = False, s.index_select(0, kept)
        if modifies:
            self.dirty.index_fill_(0, s, True)
        elif fresh is not None:
            new = fresh if every else fresh.index_select(0, live)
            self.dirty.index_fill_(0, s[new], True)
        if every:
            return s
        return torch.full_like(rows, -1).index_copy_(0, live, s)

    def _victims(self, k: int, clock: int, best_effort: bool) -> tuple[Tensor, bool]:
        """k slots to take, free ones first, then the least recently used, never a pinned slot
        or one used at ``clock`` (the batch's own hits); and whether all of them are free."""
        free = self._take_free(k)
        if free.numel() == k:
            return free, True
        pinned = self.pinned_mask() if self.pinned else None
        lru = self._oldest(k - free.numel(), clock, pinned)
        if free.numel() + lru.numel() < k and not best_effort:  # TieredTables.lookup checked the room first
            if not self.lfu:  # (LFU took nothing out of the order)
                self.order.give_back(lru, clock - 1, self.last_used)
            self.free = torch.cat([free, self.free])
            raise RuntimeError(f"tiered table cache: {k} rows to bring in, fewer free slots of {self.slots}")
        return (lru if not free.numel() else torch.cat([free, lru])), False

    def _give_back(self, victims: Tensor) -> None:
        """Undoes the taking of ``victims`` (``_victims``' slots: free ones, then the least
        recently used) by a hold or stage whose write-back or read raised (an OS error of the
        backing store): a slot still holding its row (its write-back did not run) goes back into
        the LRU order as it was, still dirty if it was; the others (free ones, and those whose
        rows were written back and left the cache) are empty, clean and free again. Without
        this they would hold their old row number, maybe dirty, with no row pointing at them:
        out of the order and the free list for good, and a later write-back of that stale copy
        over the row's newer one."""
        rows = self.row_of.index_select(0, victims)
        kept = (rows >= 0) & (self.slot_of.index_select(0, rows.clamp(min=0)).to(torch.int64) == victims)
        if not self.lfu:  # (LFU's victims are a top-k: they never left the order)
            back = victims[kept]
            self.order.put_back(back, self.last_used.index_select(0, back))
        emptied = victims[~kept]
        self.row_of.index_fill_(0, emptied, -1)
        self.dirty.index_fill_(0, emptied, False)
        self.free = torch.cat([emptied, self.free])

    def _take_free(self, k: int) -> Tensor:
        """Up to k free slots, out of the free list: checked from its front as far as needed
        (a cache far from full holds a long list: not a pass over all of it per call)."""
        taken = []
        while k > 0 and self.free.numel():
            head, self.free = self.free[:k], self.free[k:]
            head = head[self.row_of.index_select(0, head) < 0]
            taken.append(head)
            k -= head.numel()
        if not taken:
            return self.free[:0]
        return taken[0] if len(taken) == 1 else torch.cat(taken)

    def _evict(
        self, victims: Tensor, mover: _Mover, ahead: bool = False, occupied: bool = False, defer: bool = False
    ) -> None:
        """The rows of ``victims`` (slots, some maybe empty unless ``occupied``) leave the cache,
        dirty ones written back (``defer``: a log's writes may land later: ``_Mover.land``)."""
        old = self.row_of.index_select(0, victims)
        if not occupied:
            gone = old >= 0
            if not bool(gone.all()):
                victims, old = victims[gone], old[gone]
        back = self.dirty.index_select(0, victims).nonzero(as_tuple=True)[0]
        n = back.numel()
        if n:
            mover.write(victims.index_select(0, back), old.index_select(0, back), defer=defer)
            self.write_backs += n
            if ahead:
                self.staged_write_backs += n
            self.bytes_moved += n * mover.row_bytes
        self.slot_of.index_fill_(0, old, -1)

    def stage(self, rows: Tensor, new_rows: int, pinned: Tensor | None, clock: int, mover: _Mover) -> None:
        """Ahead of a lookup (a stage: see ``TieredTables.stage_next``): brings the live ``rows``
        (distinct) into the cache and frees ``new_rows`` more slots (their dirty rows written
        back) for the rows the lookup will initialise, as far as slots not ``pinned`` (a mask of
        the batches in flight when the table was handed over, None: none) and not holding ``rows`` go. Moves data
        between the tiers only: which id holds which row is the index's, decided in the steps."""
        # Boolean-mask selections (one torch call each, where nonzero + index_select take two or
        # three): the stage runs on a worker thread, and each call lets the GIL go and waits to
        # take it back from the train thread (benchmarks/results/tier_stage_profile.md).
        s = self.slot_of.index_select(0, rows)
        hit = s >= 0
        missing_rows = rows[~hit]
        # The hits are used now: the least recently used slots taken below are last used before
        # (those the lookup of this clock used, the batch in flight's, are touched already).
        hits = s[hit].to(torch.int64)
        self.order.touch(hits[self.last_used.index_select(0, hits) != clock], clock, self.last_used, self.row_of)
        missing = missing_rows.numel()
        want_slots = missing + new_rows
        if want_slots == 0:
            return
        # Free slots first, then the least recently used; which of them get filled and which
        # are left free does not matter: all are taken.
        free = self._take_free(want_slots)
        lru = self._oldest(want_slots - free.numel(), clock, pinned)
        victims = lru if not free.numel() else torch.cat([free, lru])
        filled = min(missing, victims.numel())
        fill, freed = (victims, None) if filled == victims.numel() else (victims[:filled], victims[filled:])
        want = missing_rows if filled == missing else missing_rows[:filled]
        try:
            if lru.numel():  # (oldest takes occupied slots only; the writes land at the next stage's start)
                self._evict(lru, mover, ahead=True, occupied=True, defer=True)
            mover.read(fill, want)
        except BaseException:
            self._give_back(victims)
            raise
        self.staged += filled
        self.bytes_moved += filled * mover.row_bytes
        self.row_of.index_copy_(0, fill, want)
        self.slot_of.index_copy_(0, want, fill.to(torch.int32))
        if freed is not None:
            self.row_of.index_fill_(0, freed, -1)
        self.dirty.index_fill_(0, victims, False)
        self.order.touch(fill, clock, self.last_used, self.row_of)
        if freed is not None:  # (each slot once in the free list: these were taken out of it or out of the order)
            self.free = freed if not self.free.numel() else torch.cat([self.free, freed])

    def flush(self, mover: _Mover, home: bool = True) -> None:
        """Writes every dirty row back (``home``: to the rows file itself, not a log); rows held
        by a batch in flight stay dirty (their update is still to land)."""
        dirty = (self.dirty & (self.row_of >= 0)).nonzero().squeeze(1)
        if dirty.numel():
            if home:
                mover.write_home(dirty, self.row_of[dirty])
            else:
                mover.write(dirty, self.row_of[dirty], once=True)
            self.write_backs += dirty.numel()
            self.bytes_moved += dirty.numel() * mover.row_bytes
            self.dirty[dirty] = self.pinned_mask()[dirty] if self.pinned else False

    def pin(self, slots: Tensor) -> int:
        """Holds ``slots`` until ``unpin`` of the token returned."""
        self._next_pin += 1
        self.pinned[self._next_pin] = slots
        return self._next_pin

    def unpin(self, token: int) -> None:
        self.pinned.pop(token, None)  # gone already when the cache was emptied since

    def forget(self) -> None:
        """Empties the cache without writing back (its rows were replaced or reset)."""
        self.slot_of.fill_(-1)
        self.row_of.fill_(-1)
        self.dirty.zero_()
        self.free = torch.arange(self.slots, device="cpu")
        self.order.clear()
        if self.lfu:
            self.uses.zero_()
        self.pinned = {}

    def __getstate__(self) -> dict[str, object]:
        # A copy has no batch in flight.
        return dict(self.__dict__, pinned={})


class _LoadWriteFailed(Exception):
    """A load's write into a backing file failed (``error``: the OSError to raise once every
    table of the load is emptied)."""

    def __init__(self, error: OSError):
        super().__init__(str(error))
        self.error = error


class _Stager:
    """Runs a module's stages one at a time on a worker thread. On a GPU (a device cache; the
    stage's misses and write-backs go through the host) each stage runs on a side stream after an event
    recorded on the train stream when it was submitted (the next batch's ids, made there, are
    ready; per table it then waits for the handover's event: the slots it evicts were last
    written by kernels queued before), and the stream that joins it waits for the stage's event
    (the next lookup reads the rows it brought in); the worker also waits for the side stream,
    so the host sees the written-back rows once the stage is joined.

    The worker holds the process's capture gate (``device_gate.DEVICE_WORK``) around each stage, so
    a CUDA graph capture (the pipeline's, or a user's inside ``device_gate.quiesced()``) waits for
    the stage under way and a stage submitted meanwhile starts after it. Never a deadlock: the
    stage's own waits are for the lookup's hand-over (complete once that lookup returns, and no
    capture runs inside a lookup) and for an input dist in flight (``TrainPipeline`` waits for it
    stepped aside from the gate)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="torchrec_ext-tier-stage")
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.busy_s = 0.0  # seconds the worker spent staging (not counting waits for the lookup's hand-over)
        # of them on a CPU (thread time): busy_s well above it means the stage was kept off a core
        # or blocked in the kernel (a write throttled, a fault reading its page from disk)
        self.cpu_s = 0.0
        self.handover_s = 0.0  # seconds the worker waited for the lookup to hand tables over
        self.waited_s = 0.0  # seconds the train thread waited for a stage to land

    def submit(self, stage) -> Future:
        def timed():
            start, cpu, handover = time.perf_counter(), time.thread_time(), self.handover_s
            try:
                return stage()
            finally:
                self.busy_s += time.perf_counter() - start - (self.handover_s - handover)
                self.cpu_s += time.thread_time() - cpu

        return self._submit(timed)

    def _submit(self, stage) -> Future:
        gate = device_gate.DEVICE_WORK
        if self._stream is None:

            def gated():
                with gate.working():
                    return stage()

            return self._pool.submit(gated)
        side = self._stream
        submitted = torch.cuda.current_stream(self.device).record_event()  # the next batch's ids are ready

        def on_side_stream():
            # The gate: the side stream drained before a capture may start. The module's device
            # made the worker's current one explicitly, not left to the stream context: the
            # stage's calls that take the current device (a module on cuda:1 while the thread's
            # default is cuda:0) must name this one.
            with gate.working(), torch.cuda.device(self.device), torch.cuda.stream(side):
                side.wait_event(submitted)
                try:
                    stage()  # waits, table by table, for the train stream's event of the handover
                    done = side.record_event()
                finally:
                    # A stage that raised too: what it queued (rows read, slots given back) lands
                    # before the train thread, which then gets no event to wait for, goes on, and
                    # before the gate lets a capture start.
                    side.synchronize()
            return done

        return self._pool.submit(on_side_stream)

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def wait(self, staging: Future) -> None:
        start = time.perf_counter()
        try:
            done = staging.result()
        finally:
            self.waited_s += time.perf_counter() - start
        if done is not None:
            torch.cuda.current_stream(self.device).wait_event(done)


class _Handover:
    """Tables passed from a lookup on the train thread to the stage on the worker, one at a
    time, as the lookup is done with each: with the table's slots pinned then (the batches in
    flight, ``RowCache.pinned_slots``), the training step the next lookup will run at and, on a GPU, an event of
    the train stream that the stage's side stream waits for (the slots it evicts were last written
    by kernels queued before)."""

    def __init__(self, tables: int, device: torch.device):
        self._ready: list[tuple[list[Tensor], int] | None] = [None] * tables
        self._cancelled = False
        self._cond = threading.Condition()
        self._device = device
        self._cuda = device.type == "cuda"
        self._events: dict[int, object] = {}

    def release(self, t: int, pinned: list[Tensor], step: int) -> None:
        if self._cuda:
            self._events[t] = torch.cuda.current_stream(self._device).record_event()
        with self._cond:
            self._ready[t] = (pinned, step)
            self._cond.notify_all()

    def released(self, t: int) -> bool:
        return self._ready[t] is not None

    def cancel(self) -> None:
        with self._cond:
            self._cancelled = True
            self._cond.notify_all()

    def take(self, t: int) -> tuple[list[Tensor], int] | None:
        """Table t's (pinned slots, step) once handed over; None when the lookup failed."""
        with self._cond:
            while self._ready[t] is None and not self._cancelled:
                self._cond.wait()
            if self._cancelled:
                return None
            taken = self._ready[t]
        if self._cuda:
            torch.cuda.current_stream(self._device).wait_event(self._events[t])  # the worker's side stream
        return taken


def _distinct_count(ids: Tensor) -> Tensor:
    """How many distinct values ``ids`` holds, as a tensor on its device (no size read on the host)."""
    if ids.numel() == 0:
        return torch.zeros((), dtype=torch.int64, device=ids.device)
    ordered = ids.sort().values
    return (ordered[1:] != ordered[:-1]).sum() + 1


def _segments(bounds: list[int]) -> list[tuple[int, int, int]]:
    """(table, start, end) of each table with ids between the per-table ``bounds``."""
    return [(t, start, end) for t, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])) if end > start]


class TieredTables(DynamicTables):
    """``DynamicTables`` over a backing store, the hot rows cached (see the module docstring)."""

    def __init__(self, configs: Sequence[BaseEmbeddingConfig], device: torch.device):
        device = torch.device(device)
        names = [cfg.name for cfg in configs]
        where = f"tables {names}"
        backings = {cfg.name: options_of(cfg).backing for cfg in configs}
        if len(set(backings.values())) > 1:
            raise ValueError(
                f"{where}: the tables of one module must share one backing (put tables of other "
                f"backings in a module of their own), got {backings}"
            )
        backing = next(iter(backings.values()))
        # (meta: a module to shard, which holds no rows and opens no file)
        self._check_cache_device(device, where, backing)
        shards = {options_of(cfg).backing_shard for cfg in configs}
        if len(shards) > 1:
            raise ValueError(f"{where}: the tables of one module must be one shard's (backing_shard), got {shards}")
        self.store = BackingStore(
            backing,
            [(cfg.name, cfg.num_embeddings, cfg.embedding_dim, storage_dtype_of(cfg)) for cfg in configs],
            where,
            shard=next(iter(shards)),
        )
        factors = [options_of(cfg).cache_load_factor for cfg in configs]
        self.cache_load_factors = [DEFAULT_CACHE_LOAD_FACTOR if f is None else float(f) for f in factors]
        self.slots = [cache_slots(cfg.num_embeddings, f) for cfg, f in zip(configs, self.cache_load_factors)]
        self.cache_algorithms = [options_of(cfg).cache_algorithm or "lru" for cfg in configs]
        self.backing: dict[str, Tensor] = {}
        self._movers: list[_Mover] | None = None
        super().__init__(configs, device)
        # The parent laid out the tables at full capacity: that is the backing store's layout.
        # The cache (self.weights / self.states, which the kernels take) holds slots per table.
        self._backing_layout = (self.table_offsets, self.state_row_offsets, self.dense_state_offsets)
        dims = [m.dim for m in self.meta]
        words = [table_words(s, m.dim, m.dtype) for s, m in zip(self.slots, self.meta)]
        self.table_offsets = torch.tensor([0] + words[:-1], dtype=torch.int64, device="cpu").cumsum(0)
        self.state_row_offsets = torch.tensor([0] + self.slots[:-1], dtype=torch.int64, device="cpu").cumsum(0)
        self.dense_state_offsets = dense_state_offsets(self.slots, dims)
        self._device_layout = {}
        self._maps: DeviceSlotMaps | None = None  # the caches' maps on the device (device_maps)
        self._build_caches(self.device)
        self._clock = 0
        # the lookup in progress: (modifies, pin records, the stage waiting for its tables, its own traffic)
        self._holding: tuple[bool, list, _Handover | None, dict[int, dict[str, int]]] | None = None
        self._pinned: dict[int, weakref.finalize] = {}  # lookups whose update is pending -> their pins
        # the lookup in progress's upserts: (first table, bounds of its tables' entries, rows, which
        # are new, their ids), their new ids taken out of the indexes again should the lookup fail
        self._upserts: list[tuple[int, list[int], Tensor, Tensor, Tensor]] | None = None
        # an eval lookup's tables with the device maps: (table, rows), held together at its end
        self._eval_rows: list[tuple[int, int]] | None = None
        self._stager: _Stager | None = None  # made at the first stage
        # the next batch's ids (a call giving them), staged after the next lookup
        self._stage_request: Callable[[], tuple[Tensor, Tensor] | None] | None = None
        self._staging: Future | None = None  # the stage running now
        self._stage_stats: dict[int, dict[str, int]] = {}  # per table, the traffic of the stage that ran last
        self.last_step_stats: dict[str, dict[str, int]] = {}

    # ------------------------------------------------------------------ storage

    # Rows between the cache and the backing store travel as records through a host buffer
    # (tier_copies.py): None (the default) where the cache is not on the CPU; True on the CPU
    # too (tests: the path a GPU takes, run without one).
    copy_through_records: bool | None = None

    # The caches' maps (row -> slot, slot -> row, LRU clocks, dirty flags, pins) on the cache's
    # device (tier_device_maps.py): None (the default) on a CUDA device, where a lookup whose rows
    # are cached then reads nothing on the host but one count; True on the CPU too (tests: the
    # path a GPU takes); False: on the host (``RowCache``), as on the CPU by default.
    device_maps: bool | None = None

    def _wants_device_maps(self, device: torch.device) -> bool:
        if device.type == "meta":
            return False
        return device.type == "cuda" if self.device_maps is None else bool(self.device_maps)

    def _build_caches(self, device: torch.device) -> None:
        """Empty caches' maps for ``device`` (the counters carried over from the old ones, if any)."""
        old = getattr(self, "caches", None)
        if self._wants_device_maps(device):
            capacities = [m.capacity for m in self.meta]
            self._maps = DeviceSlotMaps(capacities, self.slots, device, self.cache_algorithms)
            self.caches = self._maps.tables
        else:
            self._maps = None
            lfu = [a == "lfu" for a in self.cache_algorithms]
            self.caches = [RowCache(m.capacity, s, f) for m, s, f in zip(self.meta, self.slots, lfu)]
        for new, before in zip(self.caches, old or ()):
            for name in ("hits", "misses", "write_backs", "bytes_moved", "staged", "staged_write_backs"):
                setattr(new, name, getattr(before, name))
        # Pin tokens go on from the old maps' (a lookup in flight unpins its old token: no new pin's).
        last = max((getattr(c, "maps", c)._next_pin for c in old or ()), default=0)
        for owner in [self._maps] if self._maps is not None else self.caches:
            owner._next_pin = last

    @staticmethod
    def _check_cache_device(device: torch.device, where: str, backing: str) -> None:
        if device.type not in ("cpu", "cuda", "meta"):
            raise ValueError(
                f"{where}: tables with backing={backing!r} keep their cache on the CPU or a CUDA device, "
                f"got device {device}"
            )

    def _copies(self) -> DeviceCopies | None:
        through = self.copy_through_records
        return DeviceCopies(self.device) if (self.device.type != "cpu" if through is None else through) else None

    def _allocate_buffer(
        self, name: str, numel: int, value: float, device: torch.device, untouched: bool = False
    ) -> Tensor:  # (always a new buffer, filled)
        # numel is the buffer at full capacity: the backing store's. Its contents matter only
        # where rows are live (new rows are initialised): a fresh file needs no filling.
        live = bool(getattr(self, "indexes", None)) and device.type != "meta" and self.num_live_rows() > 0
        self._fold_logs()  # the logs' records have the old buffers' layout: their rows go home first
        if device.type == "meta":
            self.backing[name] = allocate_filled(numel, value, device)
        elif self.store.directory is None:  # host memory, on huge pages where offered (rows are touched at random)
            self.backing[name] = allocate_filled(numel, value, torch.device("cpu"))
        else:
            self.backing[name] = self.store.map(name, numel, value, fill=live)
        self._movers = None
        if name == "weights":
            cached = sum(table_words(s, m.dim, m.dtype) for s, m in zip(self.slots, self.meta))
        else:
            rowwise = self.optimizer.kind in ROWWISE_STATE
            cached = sum(s * (1 if rowwise else m.dim) for s, m in zip(self.slots, self.meta))
        return allocate_filled(cached, value, device)

    def _views(self, t: int, cached: bool) -> tuple[Tensor, dict[str, Tensor]]:
        """Table t's rows and optimizer states: of the cache ([slots, dim]) or the backing store
        ([capacity, dim]); row-wise states 1-D."""
        m = self.meta[t]
        n = self.slots[t] if cached else m.capacity
        offsets, row_offsets, dense = (
            (self.table_offsets, self.state_row_offsets, self.dense_state_offsets) if cached else self._backing_layout
        )
        words = self.weights if cached else self.backing["weights"]
        start = int(offsets[t])
        table = words[start : start + table_words(n, m.dim, m.dtype)].view(m.dtype)[: n * m.dim].view(n, m.dim)
        states = {}
        if self.optimizer is not None:
            names = OPTIMIZER_STATES[self.optimizer.kind]
            buffers = self.states if cached else [self.backing[name] for name in names]
            for name, buf in zip(names, buffers):
                if self.optimizer.kind in ROWWISE_STATE:
                    states[name] = buf[int(row_offsets[t]) : int(row_offsets[t]) + n]
                else:
                    states[name] = buf[dense[t] : dense[t] + n * m.dim].view(n, m.dim)
        return table, states

    def table_view(self, t: int) -> Tensor:
        """Table t's [capacity, dim] rows in the backing store (current after ``flush``)."""
        return self._views(t, cached=False)[0]

    def state_views(self, t: int) -> dict[str, Tensor]:
        """Table t's optimizer state in the backing store (current after ``flush``)."""
        return self._views(t, cached=False)[1]

    def _init_view(self, t: int) -> tuple[Tensor, list[Tensor], list[float]]:
        # New rows are initialised where the kernels will read them: in their cache slots.
        if self._init_views is None:
            self._init_views = []
            for i in range(len(self.meta)):
                table, states = self._views(i, cached=True)
                self._init_views.append(
                    (
                        table,
                        [v if v.dim() == 2 else v.unsqueeze(1) for v in states.values()],
                        self._initial_state_values(),
                    )
                )
        return self._init_views[t]

    def _flat_init(self) -> bool:
        """Whether a training lookup writes every table's new rows in one call (on a GPU by
        default; ``flat_init`` chooses): the cache has the flat buffers' layout, slots for rows,
        so the one call writes the new rows into their slots (the parent declines because this
        class keeps its own ``_init_view``, of the cache)."""
        if any(len(m.init_params) > INITIALIZER_PARAM_COUNTS[INITIALIZER_NAMES[m.init_kind]] for m in self.meta):
            return False  # a column shard's vectors start at a column of its table's: per table
        chosen = getattr(self, "flat_init", None)
        return self.device.type == "cuda" if chosen is None else bool(chosen)

    def _mover(self, t: int) -> _Mover:
        if self._movers is None:
            self._make_movers()
        return self._movers[t]

    # Outside inference_mode: kept across steps, views and logs made in a lookup under it would
    # refuse the in-place writes of every later step outside it.
    @torch.inference_mode(False)
    def _make_movers(self) -> None:
        self._movers = []
        copies = self._copies()  # (one for all tables: the device maps read their rows in one copy)
        for i in range(len(self.meta)):
            (cache, cache_states), (backing, backing_states) = self._views(i, True), self._views(i, False)
            pairs = [(cache, backing)] + [(cache_states[k], backing_states[k]) for k in cache_states]
            # file backing: write-backs appended to a log (tier_log.py), not scattered over the file
            self._movers.append(
                _Mover(pairs, copies) if self.store.directory is None else _LogMover(pairs, self.store, i, copies)
            )
        if copies is not None:  # the device maps' packed reads: at most a cache's slots of each table a copy
            rounds = [min(s, MAX_ROWS) * mover.record_bytes for s, mover in zip(self.slots, self._movers)]
            copies.pack_reads(sum(rounds))

    def _fold_logs(self) -> None:
        """Every row whose newest copy is in a log written to the base file (logs emptied)."""
        store = self.__dict__.get("store")
        for t, log in ({} if store is None else store.logs()).items():
            if log.live:
                self._mover(t).fold()

    def set_optimizer(self, spec) -> None:
        if self.__dict__.get("_staging") is not None:  # (its reads must not meet the files replaced below)
            self._join_stage()
        if self.optimizer is None or self.optimizer.kind != spec.kind:
            self._fold_logs()  # (while the movers still have the old states' layout)
        super().set_optimizer(spec)
        self._movers = None

    def apply(self, fn) -> None:
        """Moves the cache (and the index) with ``fn``; the backing store stays on the host."""
        probe = fn(torch.zeros(1, device="cpu"))
        if probe.device.type not in ("cpu", "cuda"):  # (meta: the rows would be lost; the files stay open)
            raise ValueError(
                f"tables {[m.name for m in self.meta]}: tables with backing={self.store.backing!r} keep their "
                f"cache on the CPU or a CUDA device; cannot move them to {probe.device}"
            )
        self._join_stage()
        self.write_new_rows()
        materialising = self.device.type == "meta"  # (to_empty: the backing store is made now too)
        switching = (self._maps is not None) != self._wants_device_maps(probe.device)
        if (
            switching and self.device.type != "meta"
        ):  # the maps change kind: the dirty rows go home, the new maps start empty
            self.flush()
        super().apply(fn)
        if materialising:
            self.weights = self._allocate_buffer("weights", self._buffer_numel("weights"), 0.0, self.device)
            if self.optimizer is not None:
                spec, self.optimizer = self.optimizer, None
                self.set_optimizer(spec)
        self._movers = None
        if switching:
            self._build_caches(self.device)
        elif self._maps is not None:
            self._maps.to(self.device)
        if self._stager is not None and self._stager.device != self.device:
            self._stager.close()  # (its side stream is the old device's)
            self._stager = None

    def reset(self) -> None:
        self._join_stage()
        self._stage_request = None
        for log in self.store.logs().values():
            log.reset()  # no id stays live: no record is read again
        super().reset()
        for cache in self.caches:
            cache.forget()

    def flush(self, tables: Sequence[int] | None = None) -> None:
        """Writes the cache's dirty rows (and pending new rows) to the backing store."""
        self._join_stage()
        self.write_new_rows()
        for t in range(len(self.meta)) if tables is None else tables:
            self.caches[t].flush(self._mover(t))
            self._mover(t).fold()  # the base file then holds every row (what the views show)

    # ------------------------------------------------------------------ ids -> slots

    def write_new_rows(self) -> None:
        if self._holding is None:  # (a lookup joined before its stage began)
            self._join_stage()  # whatever reads or moves rows waits for the stage first
        super().write_new_rows()

    def lookup(self, ids: Tensor, segment_offsets: Tensor, training: bool, backward_follows: bool = False) -> RowLookup:
        self._join_stage()
        self._check_room(ids, segment_offsets)
        self._clock += 1
        modifies = backward_follows  # (an eval-mode lookup with grad on: its backward writes its rows too)
        staged, self._stage_stats = self._stage_stats, {}
        self.write_new_rows()  # the last batch's pending new rows, into their slots before any moves
        # The next batch's stage starts now and takes each table once this lookup is done with it.
        handover = self._start_stage() if self._stage_request is not None else None
        self._holding = (modifies, [], handover, {})
        self._upserts = []
        if self._maps is not None and not training and not torch.compiler.is_compiling():
            self._eval_rows = []
        try:
            result = super().lookup(ids, segment_offsets, training, backward_follows)
            if self._eval_rows:
                self._hold_eval_rows(result)
        except BaseException:
            self._forget_new_ids(self._upserts)
            self._unpin(self._holding[1])
            if handover is not None:
                handover.cancel()
            raise
        finally:
            _, held, _, own = self._holding
            self._holding, self._eval_rows, self._upserts = None, None, None
        if modifies:  # pinned until the update lands, or the lookup (its autograd graph) is dropped
            key = id(result.unique_rows)
            self._pinned[key] = weakref.finalize(result.unique_rows, self._release, key, held)
        else:
            self._unpin(held)
        if handover is not None:  # the tables this lookup did not reach
            unreached = [t for t in range(len(self.meta)) if not handover.released(t)]
            if self._maps is None:
                for t in unreached:
                    handover.release(t, self.caches[t].pinned_slots(), self.train_step + 1)
            elif unreached:
                self._release_tables(handover, unreached)
        self._count_step(staged, own)
        return result

    def _forget_new_ids(self, upserts: list[tuple[int, list[int], Tensor, Tensor, Tensor]]) -> None:
        """A failed lookup's undo of its upserts (``_upserts``): the ids they made new (inserted,
        or expired and to be initialised again) leave the indexes again, erased by their rows.

        A lookup fails after its upsert when a read or write-back of the backing store raises (an
        OS error of a file; the caches' maps give back what the lookup took: ``RowCache.hold``,
        ``DeviceSlotMaps._fill``). The new ids' rows were never initialised (that comes after
        the caches' holds), so an id left in its index would read a row not its own (an evicted
        id's, or garbage) as a row it holds. Erased, a later lookup of it inserts it again, its
        initial row as an all-resident table's. What stays as the lookup left it: the ids its
        upsert evicted to make room are gone (their rows were given to the new ids; a later
        lookup of one is a new id, as in an all-resident table that evicted it); the ids it
        held keep their rows and optimizer state bit for bit, but their touch stays: eviction
        scores and the index's clock, ``last_seen`` (TTL), admission's sightings (the ids taken
        out are admitted at their next sighting: ``Admission.readmit``; counter admission
        forgot them when it admitted them, and an expired id was held), the step
        (``train_step``), the caches' clocks, LFU counts and hit counters, and the table counters
        of the upsert's evictions. Slots a table's hold gave its new rows before another table's
        failed keep those (now unnamed) rows until evicted: their copies are never read."""
        for first, bounds, rows, fresh, keys in upserts:
            for t, (start, end) in enumerate(zip(bounds[:-1], bounds[1:]), first):
                if end > start:
                    capacity = self.meta[t].capacity
                    erased = torch.zeros(capacity + 1, dtype=torch.bool, device=rows.device)
                    erased.index_fill_(0, torch.where(fresh[start:end], rows[start:end], capacity), True)
                    self.indexes[t].erase_rows(erased[:capacity])
                    if self.admission[t] is not None:
                        self.admission[t].readmit(keys[start:end][fresh[start:end]])

    def _rows_for(self, t: int, keys: Tensor, counts: Tensor, training: bool) -> tuple[Tensor, Tensor | None]:
        rows, fresh = super()._rows_for(t, keys, counts, training)
        if fresh is not None and self._upserts is not None:
            self._upserts.append((t, [0, rows.numel()], rows, fresh, keys))
        if self._eval_rows is not None:  # (an eval lookup with the device maps: held with all its tables')
            self._eval_rows.append((t, rows.numel()))
            return rows, fresh
        if self._maps is not None:
            table_of = torch.full_like(rows, t)
            return self._hold_on_device(rows, fresh, table_of, [(t, 0, rows.numel())]), fresh
        slots = self._hold(t, *self._on_host(rows, fresh))
        return (slots if slots.device == rows.device else slots.to(rows.device)), fresh

    def _batched_upsert(self) -> bool:
        """Whether a training lookup upserts every table in one call, then brings each table's
        rows into its cache (``_rows_for_tables``), or each table in turn (``_rows_for``).
        ``batched_upsert`` None (the default): in one call, but on the CPU with the host maps
        while a stage waits for the tables (``stage_next``): there each table is handed over as
        soon as its own upsert and hold are done, and the stage overlaps the rest of the lookup;
        in one call it got the first table only once every table's upsert was done, and the next
        lookup waited for it (dlrm-small, file backing: 1.40x -> 1.31x the resident step in one
        process, tiers_cpu.md). On a GPU each table's hold would cost a host sync."""
        if not self.indexes:
            return False
        chosen = getattr(self, "batched_upsert", None)
        if chosen is not None:
            return bool(chosen)
        staging = self._holding is not None and self._holding[2] is not None
        return not (staging and self._maps is None and self.device.type == "cpu")

    def _rows_for_tables(
        self, unique: Tensor, counts: Tensor, bounds: list[int], unique_table: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Every table's upsert in one call, then each table's rows held in its cache: on a GPU
        all tables' rows come to the host in one copy (one sync a lookup, not one a table)."""
        rows, inserted = super()._rows_for_tables(unique, counts, bounds, unique_table)
        if self._upserts is not None:
            self._upserts.append((0, bounds, rows, inserted, unique))
        if self._maps is not None:  # (the maps on the device: the rows stay there)
            segments = _segments(bounds)
            every = list(range(len(self.meta)))  # (all handed over at once: the empty tables too)
            return self._hold_on_device(rows, inserted, unique_table, segments, every), inserted
        host_rows, host_fresh = self._on_host(rows, inserted)
        slots = torch.empty_like(host_rows)
        for t, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
            slots[start:end] = self._hold(t, host_rows[start:end], host_fresh[start:end])
        return (slots if slots.device == rows.device else slots.to(rows.device)), inserted

    def _hold(self, t: int, rows: Tensor, fresh: Tensor | None) -> Tensor:
        """Table t's cache slots of the lookup in progress's ``rows`` (host tensors; ``fresh``:
        which are new to their id), pinned for the lookup, the traffic counted; the table then
        handed over to the stage waiting for it."""
        modifies, held, handover, own = self._holding if self._holding is not None else (False, None, None, {})
        cache = self.caches[t]
        before = (cache.hits, cache.misses, cache.write_backs, cache.bytes_moved)
        slots = cache.hold(rows, fresh, modifies, self._clock, self._mover(t))
        own[t] = {
            k: now - then
            for k, now, then in zip(
                ("hits", "misses", "write_backs", "bytes_moved"),
                (cache.hits, cache.misses, cache.write_backs, cache.bytes_moved),
                before,
            )
        }
        if held is not None:
            held.append((t, cache.pin(slots[slots >= 0])))
        if handover is not None:  # the index and cache of table t are done with: the stage may take it
            handover.release(t, cache.pinned_slots(), self.train_step + 1)
        return slots

    def _hold_on_device(
        self,
        rows: Tensor,
        fresh: Tensor | None,
        table_of: Tensor,
        segments: list[tuple[int, int, int]],
        release: list[int] | None = None,
    ) -> Tensor:
        """``_hold`` of the device maps, for the tables of ``segments`` at once: the slots of
        the lookup in progress's ``rows`` (on the device: a hit never leaves it), pinned for the
        lookup, the traffic counted; the tables (``release``, default those of ``segments``) then
        handed over to the stage waiting for them."""
        modifies, held, handover, own = self._holding if self._holding is not None else (False, None, None, {})
        movers = [self._mover(t) for t in range(len(self.meta))]
        names = ("hits", "misses", "write_backs", "bytes_moved")
        before = {t: [getattr(self.caches[t], k) for k in names] for t, _, _ in segments}
        slots, token = self._maps.hold(rows, fresh, table_of, segments, modifies, self._clock, movers)
        for t, then in before.items():
            own[t] = {k: getattr(self.caches[t], k) - v for k, v in zip(names, then)}
        if held is not None:
            held.append((None, token))
        else:
            self._maps.unpin(token)
        if handover is not None:
            self._release_tables(handover, [t for t, _, _ in segments] if release is None else release)
        return slots

    def _hold_eval_rows(self, result: RowLookup) -> None:
        """An eval lookup's rows (found table by table: no upsert to batch) held in their caches
        for all its tables at once, as a training lookup's are (one count read, not one a
        table): ``result``'s rows become slots in place (what waits for a lookup's update is
        keyed by its tensors)."""
        segments, first = [], 0
        for t, n in self._eval_rows:
            segments.append((t, first, first + n))
            first += n
        slots = self._hold_on_device(result.unique_rows, None, result.unique_table, segments)
        result.unique_rows.copy_(slots)
        torch.index_select(slots, 0, result.inverse, out=result.rows)

    def _release_tables(self, handover: _Handover, tables: list[int]) -> None:
        """Hands ``tables`` over to the stage, with the device maps' pins as a mask (made on the
        train stream now: the stage's side stream waits for the handover's event)."""
        mask = self._maps.pinned_mask()
        for t in tables:
            handover.release(t, mask, self.train_step + 1)

    @staticmethod
    def _on_host(
        rows: Tensor, fresh: Tensor | None, reason: str = "tiered tables: rows to cache slots"
    ) -> tuple[Tensor, Tensor | None]:
        """A table's rows (and which are new) on the host, where the cache's maps are: on a GPU
        one copy (a sync, counted: the rows come from the index's kernels), free on the CPU (and
        not counted: the stage's worker makes no more torch calls there for it)."""
        if rows.device.type == "cpu":
            return rows, fresh
        if fresh is None:
            return device_sync.to_host(rows, reason), None
        both = device_sync.to_host(torch.stack([rows, fresh.to(torch.int64)]), reason)
        return both[0], both[1].bool()

    def _check_room(self, ids: Tensor, segment_offsets: Tensor) -> None:
        """Each table's cache must hold a batch's distinct ids next to the batches in flight:
        checked before anything changes (a count of ids bounds the distinct ones; exact only
        when that bound does not fit, ``_room_for``). Nothing is read on the host while the
        batch's whole id count fits every table's cache next to the batches in flight."""
        if ids.numel() <= min((cache.slots - cache.pinned_at_most() for cache in self.caches), default=0):
            return
        bounds = device_sync.host_list(segment_offsets, "tiered tables: ids per table (cache room)")
        for t, cache in enumerate(self.caches):
            start, end = bounds[t], bounds[t + 1]
            if end - start <= cache.slots - cache.pinned_at_most():
                continue
            distinct, room = self._room_for(t, ids[start:end])
            if distinct > room:
                m = self.meta[t]
                held = (
                    f", {cache.slots - room} of them held by batches whose update is pending"
                    if room < cache.slots
                    else ""
                )
                raise ValueError(
                    f"table {m.name!r}: the batch has {distinct} distinct ids, more than the {room} cache slots free "
                    f"for it (the cache holds {cache.slots} rows: cache_load_factor {self.cache_load_factors[t]} of "
                    f"capacity {m.capacity}{held}); raise cache_load_factor or split the batch"
                )

    def _room_for(self, t: int, ids: Tensor) -> tuple[int, int]:
        """Table t's (distinct ``ids``, cache slots free for them): the slots no batch in flight
        holds, and those holding rows of these ids (a batch sharing rows with a batch in flight
        takes no new slot for them; an id new to the table counts as needing one). Read on the
        host: only when the batch may not fit."""
        cache = self.caches[t]
        rows, found = self.indexes[t].find(ids)
        if self._maps is None:  # (the host maps: the rows on the host)
            both = device_sync.to_host(torch.stack([rows, found.to(torch.int64)]), "tiered tables: rows (cache room)")
            rows, found = both[0], both[1] == 1
        pinned = cache.pinned_mask() if cache.pinned else None
        held = 0
        if pinned is not None:
            cached = cache.slot_of.index_select(0, rows.clamp(min=0)).to(torch.int64)
            own = torch.zeros(cache.slots + 1, dtype=torch.bool, device=cached.device)
            own.index_fill_(0, torch.where(found & (cached >= 0), cached, cache.slots), True)
            held = int(
                device_sync.to_host((pinned & ~own[: cache.slots]).sum(), "tiered tables: held slots (cache room)")
            )
        distinct = int(device_sync.to_host(_distinct_count(ids), "tiered tables: distinct ids (cache room)"))
        return distinct, cache.slots - held

    def _unpin(self, held: list) -> None:
        for t, record in held:
            (self._maps if t is None else self.caches[t]).unpin(record)

    def _release(self, key: int, held: list) -> None:
        self._pinned.pop(key, None)
        self._unpin(held)

    def end_update(self, lookup: RowLookup, *args, **kwargs) -> None:
        super().end_update(lookup, *args, **kwargs)
        release = self._pinned.get(id(lookup.unique_rows))
        if release is not None:
            release()

    # ------------------------------------------------------------------ staging the next batch

    def stage_next(self, ids: Tensor, segment_offsets: Tensor) -> None:
        """Stages the rows of the next batch (``ids`` by table, as ``lookup`` takes them) into the
        cache on a worker thread, started with the next lookup (the current batch's), taking each
        table as that lookup is done with it, so that it overlaps the rest of that batch's step
        and whatever runs until the next batch's lookup, which then finds its rows cached. What
        ``TrainPipeline`` calls for the batch after the one it is about to run.

        Exact by construction: the stage reads the index (no id inserted, no score moved, no
        eviction: those stay in the steps, in step order), and only moves rows between the
        tiers: it takes a table only once the current lookup is done with its index and cache,
        takes no slot pinned then (the current batch's, whose kernels and update may still read
        and write rows the next batch also reads, and earlier batches in flight), and brings in
        rows the index names for the next batch's ids, which nothing changes before the next
        lookup (the index is touched by lookups only). Every other entry to the tables (a
        lookup, a checkpoint, stats, loading) waits for the stage first; the lookup kernels and
        the fused update do not (they touch only pinned slots, which the stage leaves alone)."""
        self.check_ready("stage_next")
        self._check_stage_segments(segment_offsets)
        self._stage_request = lambda: (ids, segment_offsets)

    def stage_next_when_known(self, resolve: Callable[[], tuple[Tensor, Tensor] | None]) -> None:
        """``stage_next`` of ids not known yet: ``resolve()``, called on the stage's worker thread
        before it stages anything, gives (ids, segment_offsets), or None to stage nothing. A
        sharded module's next batch: its ids arrive by the input dist in flight, waited for there."""
        self.check_ready("stage_next")
        self._stage_request = resolve

    def _check_stage_segments(self, segment_offsets: Tensor) -> None:
        if segment_offsets.numel() != len(self.meta) + 1:
            raise ValueError(
                f"tables {[m.name for m in self.meta]}: stage_next takes segment_offsets of "
                f"{len(self.meta) + 1} entries (one segment per table), got {segment_offsets.numel()}"
            )

    def _start_stage(self) -> _Handover:
        resolve, self._stage_request = self._stage_request, None
        if self._stager is None:
            self._stager = _Stager(self.device)
        handover = _Handover(len(self.meta), self.device)
        movers = [self._mover(t) for t in range(len(self.meta))]  # built here, on the train thread
        clock = self._clock
        self._staging = self._stager.submit(lambda: self._stage(resolve, handover, movers, clock))
        return handover

    def _stage(
        self, resolve: Callable[[], tuple[Tensor, Tensor] | None], handover: _Handover, movers: list[_Mover], clock: int
    ) -> None:
        """The worker's part: per table, once the train thread has handed it over (its lookup
        done with the table's index and cache), the rows of the next batch's ids brought in and
        slots freed for its new rows, around the slots pinned at the handover."""
        request = resolve()
        if request is None:
            return
        ids, segment_offsets = request
        self._check_stage_segments(segment_offsets)
        unique, _, _, unique_offsets = ops.dedup_segments(ids, segment_offsets)  # overlaps the lookup
        bounds = device_sync.host_list(unique_offsets, "tiered tables: the staged batch's ids per table")
        # The last stage's deferred write-backs (RowCache.stage), written while this thread waits
        # for the lookup to hand the tables over: off the stage's critical path.
        for mover in movers:
            mover.land()
        if self._maps is not None:
            return self._stage_on_device(unique, unique_offsets, bounds, handover, movers, clock)
        for t, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
            began = time.perf_counter()
            taken = handover.take(t)
            self._stager.handover_s += time.perf_counter() - began
            if taken is None:  # the lookup failed: nothing more to stage
                return
            if end == start:
                continue
            pinned, step = taken
            rows, found = self.indexes[t].find(unique[start:end])
            rows = self._mask_expired(t, rows, found, step)  # expired: re-initialised by the lookup, not read
            rows = self._on_host(rows, None, "tiered tables: rows to stage")[0]  # (the host maps)
            live = rows[rows >= 0]
            cache = self.caches[t]
            before = (cache.staged, cache.staged_write_backs, cache.bytes_moved)
            cache.stage(live, rows.numel() - live.numel(), cache.mask_of(pinned), clock, movers[t])
            self._stage_stats[t] = {
                "staged": cache.staged - before[0],
                "staged_write_backs": cache.staged_write_backs - before[1],
                "bytes_moved": cache.bytes_moved - before[2],
            }

    def _stage_on_device(
        self,
        unique: Tensor,
        unique_offsets: Tensor,
        bounds: list[int],
        handover: _Handover,
        movers: list[_Mover],
        clock: int,
    ) -> None:
        """``_stage`` with the device maps: once every table is handed over (a lookup hands them
        over together), all tables' rows staged in one pass of the maps (``DeviceSlotMaps.stage``)."""
        mask, step = None, 0
        for t in range(len(self.meta)):
            began = time.perf_counter()
            taken = handover.take(t)
            self._stager.handover_s += time.perf_counter() - began
            if taken is None:  # the lookup failed: nothing to stage
                return
            mask, step = taken  # (the last table's: the pins of every batch in flight then)
        if mask is not None and mask.device.type == "cuda":
            mask.record_stream(torch.cuda.current_stream(mask.device))  # made on the train stream
        segments = _segments(bounds)
        if not segments:
            return
        rows, table_of = self._found_rows(unique, unique_offsets, segments, step)
        names = ("staged", "staged_write_backs", "bytes_moved")
        before = {t: [getattr(self.caches[t], k) for k in names] for t, _, _ in segments}
        self._maps.stage(rows, table_of, segments, mask, clock, movers)
        for t, then in before.items():
            self._stage_stats[t] = {k: getattr(self.caches[t], k) - v for k, v in zip(names, then)}

    def _found_rows(
        self, unique: Tensor, unique_offsets: Tensor, segments: list[tuple[int, int, int]], step: int
    ) -> tuple[Tensor, Tensor]:
        """The rows the tables hold for ``unique`` (ids by table; -1: none, or expired at ``step``:
        re-initialised by the lookup, not read), and the table of each. Reads the indexes only."""
        parts = []
        for t, start, end in segments:
            rows, found = self.indexes[t].find(unique[start:end])
            parts.append(self._mask_expired(t, rows, found, step))
        table_of = torch.repeat_interleave(
            torch.arange(len(self.meta), device=unique.device),
            unique_offsets[1:] - unique_offsets[:-1],
            output_size=unique.numel(),
        )
        return (parts[0] if len(parts) == 1 else torch.cat(parts)), table_of

    def wait_for_stage(self) -> None:
        """Returns once the stage in flight (if any) has landed (benchmarks time it with this)."""
        self._join_stage()

    def stage_seconds(self) -> tuple[float, float]:
        """(seconds the worker spent staging, seconds the train thread waited for stages) so far."""
        return (0.0, 0.0) if self._stager is None else (self._stager.busy_s, self._stager.waited_s)

    def stage_cpu_seconds(self) -> float:
        """CPU seconds (the worker's thread time) of the stages so far: of ``stage_seconds()[0]``."""
        return 0.0 if self._stager is None else self._stager.cpu_s

    def _join_stage(self) -> None:
        """Waits for the stage in flight (re-raising its error)."""
        if self._staging is not None:
            staging, self._staging = self._staging, None
            self._stager.wait(staging)

    def _count_step(self, staged: dict[int, dict[str, int]], own: dict[int, dict[str, int]]) -> None:
        """Per table, the tier's traffic of this lookup (hits, misses, its write-backs and bytes)
        and of the stage that ran for it (rows staged, its write-backs and bytes)."""
        stats = {}
        for t, m in enumerate(self.meta):
            mine = own.get(t, {})
            ahead = staged.get(t, {})
            stats[m.name] = {
                "hits": mine.get("hits", 0),
                "misses": mine.get("misses", 0),
                "staged": ahead.get("staged", 0),
                "write_backs": mine.get("write_backs", 0) + ahead.get("staged_write_backs", 0),
                "staged_write_backs": ahead.get("staged_write_backs", 0),
                "bytes_moved": mine.get("bytes_moved", 0) + ahead.get("bytes_moved", 0),
            }
        self.last_step_stats = stats

    def prefetch(self, ids: Tensor, segment_offsets: Tensor) -> None:
        """Brings the rows of ``ids`` that their tables hold into the cache (as much as fits
        next to the batches in flight), so that their lookup finds them there. Reads the index
        only (no id is inserted, no eviction score moves): lookups give the same results with
        or without it. Call it between steps or before a forward, not concurrently with one (the
        cache is not locked)."""
        self.check_ready("prefetch")
        self.write_new_rows()  # (after the stage in flight)  # pending new rows are written to their slots before any slot moves
        unique, _, _, unique_offsets = ops.dedup_segments(ids, segment_offsets)
        bounds = device_sync.host_list(unique_offsets, "tiered tables: prefetched ids per table")
        self._clock += 1
        if self._maps is not None:
            segments = _segments(bounds)
            if segments:
                rows, table_of = self._found_rows(unique, unique_offsets, segments, self.train_step)
                movers = [self._mover(t) for t in range(len(self.meta))]
                self._maps.stage(rows, table_of, segments, self._maps.pinned_mask(), self._clock, movers, False)
            return
        for t, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
            if end > start:
                rows, found = self.indexes[t].find(unique[start:end])
                rows = self._mask_expired(t, rows, found)  # an expired row is re-initialised, not read
                rows = self._on_host(rows, None, "tiered tables: rows to prefetch")[0]  # (the host maps)
                self.caches[t].hold(rows, None, False, self._clock, self._mover(t), best_effort=True)

    # ------------------------------------------------------------------ checkpoint

    def table_state(self, t: int) -> dict[str, Tensor]:
        if self.device.type != "meta":
            self._join_stage()
            self.write_new_rows()
            self.caches[t].flush(self._mover(t), home=False)  # (a file's dirty rows appended to its log)
        return super().table_state(t)

    def rows_state(self, t: int, rows: Tensor) -> dict[str, Tensor]:
        """The rows' newest copies: the backing store's, those in a log patched in (a checkpoint
        reads the log rather than folding it home: no random writes to the rows files). Current
        once the cache's dirty rows are written back (``table_state`` does). Gathered on the host
        (the backing store's side), then on the tables' device as every other key."""
        if self.device.type == "meta":
            return super().rows_state(t, rows)
        at = rows.cpu()
        values = self._mover(t).backing_rows(at)  # (the mover's pairs: the vectors, then state_views' order)
        out = dict(zip(["weight"] + [f"optimizer.{name}" for name in self.state_views(t)], values))
        self._mover(t).patch(at, values)
        out = {key: value.to(self.device) for key, value in out.items()}
        if self.meta[t].ttl_steps is not None:
            out["last_seen"] = self.last_seen[t].index_select(0, rows)
        return out

    def load_states(self, states: dict[int, dict[str, Tensor]], where: str) -> None:
        try:
            super().load_states(states, where)
        except _LoadWriteFailed as failed:
            # A page of a backing file failed mid-load (tier_guard): the tables written before it
            # hold the checkpoint's rows, this one part of them, the rest their own. Every table
            # of the load is left empty: no id reads a row not its own, and none is half loaded.
            for t in states:
                self._empty(t)
            names = [self.meta[t].name for t in states]
            e = failed.error
            raise OSError(e.errno, f"{e.strerror}; every table it loads is left empty ({names})") from None

    def _replace_table(self, t: int, table) -> None:
        self._join_stage()
        try:
            super()._replace_table(t, table)  # into the backing store
        except OSError as e:
            raise _LoadWriteFailed(e) from None
        self._empty(t, index=False)

    def _empty(self, t: int, index: bool = True) -> None:
        """Table t's cache emptied without writing back, its log emptied (its records are of rows
        a load replaced), and with ``index`` its ids too."""
        if index:
            self.indexes[t].clear()
        self.caches[t].forget()
        log = self.store.logs().get(t)
        if log is not None:
            log.reset()

    def _write_rows(self, view: Tensor, at: Tensor, values: Tensor | None, fill: float = 0.0) -> None:
        if self.store.directory is None:  # (host memory: torch's ops)
            return super()._write_rows(view, at, values, fill)
        if values is None:  # one row of the fill, read for every row written
            values = torch.full((1, *view.shape[1:]), fill, dtype=view.dtype, device="cpu").expand(
                at.numel(), *view.shape[1:]
            )
        tier_guard.copy_rows(view, at, values, None, "write", consequence="the load stopped")

    def __getstate__(self) -> dict[str, object]:
        self._join_stage()
        self._fold_logs()  # a copy gets the base store's tensors, without the logs
        state = super().__getstate__()
        state["_pinned"], state["_movers"], state["_holding"], state["_upserts"] = {}, None, None, None
        state["_stager"], state["_staging"], state["_stage_request"], state["_stage_stats"] = None, None, None, {}
        return state

    @property
    def delta_log(self):
        return self.__dict__.get("_delta_log")

    @delta_log.setter
    def delta_log(self, value) -> None:
        if value is not None:
            raise ValueError(
                f"tables {[m.name for m in self.meta]}: deltas (delta_token / export_delta) of tables with "
                f"backing={self.store.backing!r} are not supported in this version"
            )
        self.__dict__["_delta_log"] = None

    # ------------------------------------------------------------------ accounting

    def storage_bytes(self, maximum: bool = False) -> int:
        """Bytes of the tier but its backing store (``backing_bytes``): the cache, the index and its
        metadata (on the tables' device), and the tier's own host memory: the cache's maps and
        its LRU queue and free list, the logs' maps, the records buffers of transfers between the
        host and a device cache (pinned, page-locked: made at the first transfer, up to 16 MiB a
        table; and the buffer of all tables' packed reads, up to a cache's slots of records a
        table) and the CPU path's write-back buffers of a file's log (``io_buffer_bytes``: kept
        from step to step, up to 16 MiB each, two a table). As allocated now: the buffers grow with the
        largest write-back so far. Tiered tables do not grow: ``maximum`` is the same."""
        logs = 0 if self.store.directory is None else sum(RowLog.map_bytes(m.capacity) for m in self.meta)
        buffers = sum(mover.buffer_bytes() for mover in self._movers or ()) + self.io_buffer_bytes()
        copies = self._movers[0].copies if self._movers else None
        buffers += 0 if copies is None else copies.buffer_bytes()  # (the tables' packed reads)
        return super().storage_bytes() + sum(cache.nbytes() for cache in self.caches) + logs + buffers

    def io_buffer_bytes(self) -> int:
        """Bytes of the CPU path's write-back records buffers (file backing: up to 16 MiB each, two a table)."""
        return sum(getattr(mover, "step_buffer_bytes", lambda: 0)() for mover in self._movers or ())

    def backing_bytes(self) -> int:
        return sum(buf.numel() * buf.element_size() for buf in self.backing.values())

    def table_stats(self) -> dict[str, TableStats]:
        self._join_stage()
        stats = super().table_stats()
        for m, cache in zip(self.meta, self.caches):
            s = stats[m.name]
            s.cache_slots, s.cache_hits, s.cache_misses = cache.slots, cache.hits, cache.misses
            s.cache_write_backs, s.cache_bytes_moved = cache.write_backs, cache.bytes_moved
            s.cache_staged, s.cache_staged_write_backs = cache.staged, cache.staged_write_backs
        return stats
