"""Rows of a tiered table as records, and their copies between the host and the cache's device.

A tiered table's cache (``tiered_tables.TieredTables``) lives on the module's device; its backing
store (``tier_store.BackingStore``) always on the host. Rows move between them as records: one
``[n, record_bytes]`` uint8 tensor per batch of rows, each record the row's number (int64) and
then its vector and each optimizer state in their storage dtypes, each field 8-byte aligned, so
that every field is a strided view of any dtype (tier_log.py's layout: a file-backed table
appends these very records to its log).

``RecordsBuffer`` is the host side: one buffer of records reused across transfers, pinned
(page-locked) when the cache is on a CUDA device, so that a copy to or from the device is DMA,
asynchronous to the host, in one transfer for all the rows' fields. An event of the stream that
last copied from or into it guards its refill (the host waits only if that copy is still in
flight). Transfers are cut in chunks of at most ``MAX_ROWS`` records, so the buffer stays bounded
(16 MiB of 512-byte records) whatever a flush or a prefetch moves.

``DeviceCopies`` sends host records to the device (``to_device``: non-blocking, on the current
stream) and brings device records back (``to_host``: the host waits for the copy: a write-back
must see the bytes before it writes them to the backing store). Each copy records an event on
its stream right after it, and a wait is for that event only: a copy queued later on the stream
(a read) never lengthens it. ``to_caches`` reads the rows of several tables into their caches in
one copy: their records packed one table after another in one host buffer (each table's records
are ``record_bytes`` wide, a multiple of 8, so every table's part, and every field in it, stays
8-byte aligned whatever the tables' widths and dtypes), one copy to the device, then each
table's part scattered into its slots there. ``to_stores`` writes several tables' rows back the
other way round, in the same packed layout: all tables' slots to the device in one copy, each
table's records gathered there into one device buffer, one copy into the host buffer, one wait
for its event, then each table's part written to its backing store.

Lifetimes across streams: a host buffer is refilled only once its last copy's event has passed
(``RecordsBuffer.take``), and a dropped pinned buffer goes back to torch's pinned-memory cache,
which holds it until the copies that used it are done; device records are made on the stream
that copies and reads them and freed there, so the caching allocator hands their memory only to
work queued after them on that stream (no ``record_stream`` needed). The same code runs with the
cache on the CPU when ``TieredTables.copy_through_records`` asks for it (tests: the staging path
covered without a GPU; the copies are then plain copies, without events).
"""

from __future__ import annotations

import torch
from torch import Tensor

from torchrec_ext import device_sync
from torchrec_ext.modules.tier_log import ROW_BYTES

MAX_ROWS = 1 << 15  # records per transfer (of each table, packed): 16 MiB of 512-byte records


def record_fields(widths: list[int]) -> tuple[list[tuple[int, int]], int]:
    """Per field of ``widths`` bytes: (first byte in the record, bytes), after the row number;
    and the record's bytes. Each field starts 8-byte aligned (the pads between them: zeros)."""
    fields, at = [], ROW_BYTES
    for width in widths:
        fields.append((at, width))
        at += width + -width % 8
    return fields, at


def field_view(records: Tensor, field: tuple[int, int], like: Tensor) -> Tensor:
    """The field of ``records`` as rows of ``like`` (its dtype; 1-D when ``like`` is): a view."""
    at, width = field
    values = records[:, at : at + width].view(like.dtype)
    return values.view(-1) if like.dim() == 1 else values


def row_column(records: Tensor) -> Tensor:
    """The records' row numbers (int64): a view."""
    return records[:, :ROW_BYTES].view(torch.int64).squeeze(1)


class RecordsBuffer:
    """Host records reused across transfers (see the module docstring): pinned when ``pinned``,
    grown by doubling up to ``max_rows`` records as transfers need, zeroed when made (the pads
    of a record are defined bytes)."""

    def __init__(self, record_bytes: int, pinned: bool, max_rows: int = MAX_ROWS):
        self.record_bytes = record_bytes
        self.pinned = pinned
        self.max_rows = max_rows
        self._records: Tensor | None = None
        self._in_flight = None  # the CUDA event of the last asynchronous copy from or into it

    def nbytes(self) -> int:
        return 0 if self._records is None else self._records.numel()

    def take(self, n: int) -> Tensor:
        """``[n, record_bytes]`` host records to fill (n <= max_rows), once no copy of the buffer is in flight."""
        if n > self.max_rows:
            raise ValueError(f"tiered table records: {n} rows in one transfer, at most {self.max_rows}")
        if self._in_flight is not None:
            self._in_flight.synchronize()
            self._in_flight = None
        if self._records is None or self._records.shape[0] < n:
            rows = min(self.max_rows, max(n, 2 * self._records.shape[0] if self._records is not None else n))
            with torch.inference_mode(False):  # (kept: refilled by later transfers outside inference_mode)
                self._records = torch.zeros(
                    rows, self.record_bytes, dtype=torch.uint8, device="cpu", pin_memory=self.pinned
                )
        return self._records[:n]

    def take_bytes(self, nbytes: int) -> Tensor:
        """``take`` of ``nbytes`` bytes (whole records), flat: a transfer packing records of several widths."""
        if nbytes % self.record_bytes:
            raise ValueError(
                f"tiered table records: {nbytes} bytes is not a whole number of {self.record_bytes}-byte records"
            )
        return self.take(nbytes // self.record_bytes).view(-1)

    def in_flight(self, event) -> None:
        """An asynchronous copy from or into the buffer was queued: ``event`` marks its end."""
        self._in_flight = event


class DeviceCopies:
    """Records between the host and ``device`` (the cache's), through ``RecordsBuffer``s; one for
    all of a module's tables (``packed``: the buffer of their reads and write-backs packed together)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pinned = device.type == "cuda"
        self.asynchronous = device.type == "cuda"  # copies are queued on a stream, events mark their ends
        self.packed: RecordsBuffer | None = None  # made by ``pack_reads``

    def buffer(self, record_bytes: int) -> RecordsBuffer:
        return RecordsBuffer(record_bytes, pinned=self.pinned)

    def pack_reads(self, max_bytes: int) -> None:
        """Gives the copies a buffer of packed reads and write-backs (8-byte words) of at most
        ``max_bytes``: the most one ``to_caches`` or ``to_stores`` round takes (``MAX_ROWS`` rows
        of each table at most; write-backs and reads take it in turn, never both at once)."""
        self.packed = RecordsBuffer(8, pinned=self.pinned, max_rows=max(1, max_bytes // 8))

    def buffer_bytes(self) -> int:
        return 0 if self.packed is None else self.packed.nbytes()

    def _copied(self):
        """An event recorded now on the current stream: it passes once the copy just queued there
        (and only what was queued before it) is done."""
        return torch.cuda.current_stream(self.device).record_event()

    def to_device(self, records: Tensor, buffer: RecordsBuffer) -> Tensor:
        """``records`` (taken from ``buffer``) on the device, copied on the current stream; the
        host may refill the buffer once that copy is done (``buffer.take`` waits for it)."""
        if not self.asynchronous:
            return records
        on_device = records.to(self.device, non_blocking=True)
        buffer.in_flight(self._copied())
        return on_device

    def to_caches(self, reads: list[tuple[object, Tensor, Tensor]], buffer: RecordsBuffer) -> None:
        """Each (mover, slots, rows) of ``reads``: the backing store's ``rows`` (host, int64) into
        the mover's cache ``slots``, every mover's in one copy to the device a round of at most
        ``MAX_ROWS`` rows of each (tiered_tables.py's ``_Mover``: ``gather`` fills host records,
        the slots in their row column; ``scatter`` writes device records into the cache). Rows
        read in ascending order (a file front to back). ``buffer``: ``packed`` for several
        movers, a mover's own for its reads alone (its records' width)."""
        for parts, sizes in _rounds(reads):
            host = buffer.take_bytes(sum(sizes))
            for (mover, slots, rows), records in zip(parts, _packed(host, parts, sizes)):
                mover.gather(records, slots, rows)
            on_device = self.to_device(host, buffer)  # (one copy for every mover's records)
            for (mover, _, _), records in zip(parts, _packed(on_device, parts, sizes)):
                mover.scatter(records)

    def to_stores(self, writes: list[tuple[object, Tensor, Tensor]], buffer: RecordsBuffer, store) -> None:
        """Each (mover, slots, rows) of ``writes``: the mover's cache ``slots`` written back to
        its backing store's ``rows`` (host, int64), every mover's in one copy to the host a round
        of at most ``MAX_ROWS`` rows of each: all movers' slots to the device in one copy, each
        mover's records gathered there (``mover.gather_cache``) into one device buffer, one copy
        into ``buffer``, one wait for it, then ``store(mover, records, rows)`` for each (the
        caller's: one mover's store failing must not stop the others'). Rows written in ascending
        order. ``buffer``: ``packed``, as ``to_caches``'s."""
        for parts, sizes in _rounds(writes):
            at = device_sync.to_device(torch.cat([slots for _, slots, _ in parts]), self.device)
            on_device, first = self.empty(sum(sizes) // 8, 8), 0
            for (mover, slots, _), records in zip(parts, _packed(on_device.view(-1), parts, sizes)):
                mover.gather_cache(records, at[first : first + slots.numel()])
                first += slots.numel()
            host = self.to_host(on_device, buffer).view(-1)  # (one copy, one wait, for every mover's records)
            for (mover, _, rows), records in zip(parts, _packed(host, parts, sizes)):
                store(mover, records, rows)

    def to_host(self, records: Tensor, buffer: RecordsBuffer) -> Tensor:
        """Device ``records`` copied into ``buffer`` (host), the host waiting for the copy."""
        host, copied = self.to_host_queued(records, buffer)
        self.landed(copied)  # (the write-back's one wait: the backing store is written from these bytes)
        return host

    def to_host_queued(self, records: Tensor, buffer: RecordsBuffer) -> tuple[Tensor, object]:
        """Device ``records`` copied into ``buffer`` (host) without waiting: (the host records,
        the copy's event, None on the CPU); the host reads them after ``landed`` of the event."""
        host = buffer.take(records.shape[0])
        if not self.asynchronous:
            return host.copy_(records), None
        host.copy_(records, non_blocking=True)
        copied = self._copied()
        buffer.in_flight(copied)  # (not refilled before it lands)
        return host, copied

    def landed(self, copied) -> None:
        """Returns once the copy of ``copied`` (``to_host_queued``'s event) has landed: a wait for
        that copy alone, not for what the stream queued after it."""
        if copied is not None:
            copied.synchronize()

    def empty(self, n: int, record_bytes: int) -> Tensor:
        """Zeroed device records (the pads are defined bytes when they reach a log)."""
        return torch.zeros(n, record_bytes, dtype=torch.uint8, device=self.device)


def _rounds(moves: list[tuple[object, Tensor, Tensor]]):
    """The (mover, slots, rows) of ``moves`` in rounds of at most ``MAX_ROWS`` rows of each
    mover, rows ascending (a file read or written front to back): each round's parts and their
    bytes (``[rows, mover.record_bytes]`` records each)."""
    ordered = []
    for mover, slots, rows in moves:
        if rows.numel():
            order = rows.argsort()
            ordered.append((mover, slots[order], rows[order]))
    longest = max((rows.numel() for _, _, rows in ordered), default=0)
    for start in range(0, longest, MAX_ROWS):
        parts = [
            (mover, slots[start : start + MAX_ROWS], rows[start : start + MAX_ROWS])
            for mover, slots, rows in ordered
            if rows.numel() > start
        ]
        yield parts, [rows.numel() * mover.record_bytes for mover, _, rows in parts]


def _packed(flat: Tensor, parts, sizes: list[int]) -> list[Tensor]:
    """Each part's records (``[rows, mover.record_bytes]``) in the ``flat`` bytes, one after another."""
    out, at = [], 0
    for (mover, _, rows), size in zip(parts, sizes):
        out.append(flat[at : at + size].view(rows.numel(), mover.record_bytes))
        at += size
    return out
