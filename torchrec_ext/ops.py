"""Typed wrappers over ``torch.ops.torchrec_ext.*`` and their fake kernels.

The schemas live in ``csrc/ops.cpp``. Hash table ops: CPU kernels in ``csrc/hash_table_cpu.cpp``,
CUDA kernels in ``csrc/hash_table_cuda.cu``; the placement search of a load (``hash_place``) is
CPU only, in ``csrc/placement_cpu.cpp``. The counting Bloom filter of the bloom admission
(``bloom_admit``): ``csrc/bloom_cpu.cpp`` and ``csrc/bloom_cuda.cu``. Embedding ops: CPU kernels in
``csrc/<op family>_cpu.cpp``; their CUDA kernels are the Triton ones in the ``triton_kernels``
subpackage, the torch ones in ``torch_kernels.py`` and, for ``init_rows_tables`` (every table's
new rows in one launch), ``csrc/init_rows_cuda.cu``. Each backend exports a table
``KERNELS = {op: {device_type: kernel}}`` (``csrc_kernels`` lists what the C++ library registers
itself); ``register_python_kernels`` below registers the Python ones in one loop when a GPU is
present. The fake kernels give output
shapes and dtypes without data so the ops trace under ``torch.fx`` / ``torch.compile``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from torchrec_ext import (
    _C,  # noqa: F401  (loads the library: registers the ops and their C++ kernels)
    csrc_kernels,
    device_sync,
    torch_kernels,
)

_ops = torch.ops.torchrec_ext


def has_kernel(op_name: str, device: torch.device) -> bool:
    """Whether op ``torchrec_ext::<op_name>`` has a kernel for ``device``'s backend."""
    key = "CUDA" if device.type == "cuda" else device.type.upper()
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"torchrec_ext::{op_name}", key)


def copy_rows(dst: Tensor, dst_rows: Tensor | None, src: Tensor, src_rows: Tensor | None = None) -> None:
    """``dst[dst_rows[i]] = src[src_rows[i]]`` for each i, whole rows, in place: a tiered
    table's moves between its cache and its backing store. On CPU one ``memcpy`` a row (where
    ``index_copy_`` walks the elements), every row number checked before any row is written.

    Args:
        dst: 1-D or 2-D (rows; each row's elements contiguous, rows may be strided), written.
        dst_rows: int64 ``[n]``, rows of ``dst``; None: rows ``0 .. n-1``.
        src: as ``dst``: its dtype and row size; no memory shared with ``dst``.
        src_rows: int64 ``[n]``, rows of ``src``; None: rows ``0 .. n-1`` (``n``: ``dst_rows``'
            length, or ``src``'s rows when both are None).
    """
    _ops.copy_rows.default(dst, dst_rows, src, src_rows)


def guarded_copy_rows(dst: Tensor, dst_rows: Tensor | None, src: Tensor, src_rows: Tensor | None) -> int:
    """:func:`copy_rows` where ``dst`` or ``src`` may be a file mapping: a SIGBUS raised while the
    copy touches it (a page that cannot be read: a disk I/O error, the file truncated) ends the
    copy instead of the process. CPU only (``csrc/copy_rows_cpu.cpp``; ``modules/tier_guard.py``
    turns the fault into an ``OSError`` naming the file). Runs without the GIL. Arguments as
    :func:`copy_rows`'s.

    Returns:
        0 when every row was copied; else the address of the SIGBUS that stopped the copy (some
        rows may be copied, on this thread before the fault or on another, the others not).
    """
    return int(_ops.guarded_copy_rows.default(dst, dst_rows, src, src_rows))


def pread_rows(
    dst: Tensor, dst_rows: Tensor | None, src: Tensor, src_rows: Tensor | None, fd: int, src_offset: int
) -> tuple[int, int]:
    """:func:`copy_rows` from a file mapping ``src`` without touching it: each run of consecutive
    rows is one ``pread(2)`` of the file (``fd``; ``src``'s first byte at ``src_offset`` of it), so
    the process maps none of the file's pages, and a page that cannot be read is an errno, not a
    SIGBUS. CPU only (``csrc/copy_rows_cpu.cpp``). Arguments otherwise as :func:`copy_rows`'s.

    Returns:
        ``(-1, 0)`` when every row was read; else ``(file offset, errno)`` of the read that failed
        (errno 0: the file ended there; rows before it may be read).
    """
    offset, errno_ = _ops.pread_rows.default(dst, dst_rows, src, src_rows, fd, src_offset).tolist()
    return offset, errno_


def hash_find(digests: Tensor, slot_keys: Tensor, keys: Tensor, capacity: int) -> tuple[Tensor, Tensor]:
    """Row of each key. Read-only.

    Args:
        digests: uint8, the table's slot digests (0 = empty), then its stash's
            (``vocabulary.index_lengths``: ``num_slots + stash + num_buckets`` entries).
        slot_keys: int64, the key held by each slot, then the stash's rows and keys
            (``num_slots + 2 * stash`` entries).
        keys: int64 ``[n]``, any values.
        capacity: the table's rows; ``num_slots`` = 32 * ceil(capacity / 32).

    Returns:
        rows: int64 ``[n]``, the key's row, -1 when absent.
        found: bool ``[n]``.
    """
    return _ops.hash_find.default(digests, slot_keys, keys, capacity)


def hash_find_tables(
    digests: Sequence[Tensor],
    slot_keys: Sequence[Tensor],
    keys: Tensor,
    key_offsets: Sequence[int],
    capacities: Sequence[int],
) -> tuple[Tensor, Tensor]:
    """:func:`hash_find` of T tables in one call (CUDA: one launch for all tables). Read-only.

    Args:
        digests, slot_keys: ``[T]`` lists, table t's uint8 / int64 arrays (as ``hash_find``'s).
        keys: int64 ``[n]``, every table's keys back to back: table t's are
            ``keys[key_offsets[t]:key_offsets[t + 1]]``.
        key_offsets: ``T + 1`` host ints, ascending from 0 to n.
        capacities: ``T`` ints, table t's rows.

    Returns:
        rows: int64 ``[n]``, each key's row in its table, -1 when absent.
        found: bool ``[n]``. Both equal :func:`hash_find` table by table, concatenated.
    """
    return _ops.hash_find_tables.default(
        list(digests), list(slot_keys), keys, [int(o) for o in key_offsets], [int(c) for c in capacities]
    )


def serving_index_update(index: Tensor, erase_keys: Tensor, keys: Tensor, rows: Tensor) -> Tensor:
    """A new read-only serving index: ``index`` without ``erase_keys`` (absent ones skipped), then
    each of ``keys`` mapped to its row (inserted, or re-assigned; in order: a repeated key keeps
    its last row). ``index`` is left as it was (lookups may be reading it).

    Args:
        index: int64 ``[8 * num_buckets]`` (64-byte buckets, layout in csrc/serving_index_cpu.cpp);
            all zeros is an empty index of ``num_buckets`` buckets of 5 keys.
        erase_keys, keys: int64 ``[m]``, ``[n]``, any values.
        rows: int64 ``[n]``, each key's row, in ``[0, 2^31)``.

    Returns:
        int64, ``index``'s shape: the new index. Refused (nothing changed) when it would hold more
        than ``5 * num_buckets`` keys.
    """
    return _ops.serving_index_update.default(index, erase_keys, keys, rows)


def serving_find(indexes: Sequence[Tensor], ids: Tensor, id_offsets: Tensor, default_rows: Sequence[int]) -> Tensor:
    """Row of each id in its table's serving index (one pipeline across all tables). Read-only.

    Args:
        indexes: ``[T]`` serving indexes (as ``serving_index_update`` returns).
        ids: int64 ``[n]``, every table's ids back to back: table t's are
            ``ids[id_offsets[t]:id_offsets[t + 1]]``.
        id_offsets: int64 ``[T + 1]``, ascending from 0 to n.
        default_rows: ``T`` ints, the row table t's absent ids read (-1 allowed).

    Returns:
        rows: int64 ``[n]``, each id's row, or its table's default row when absent.
    """
    return _ops.serving_find.default(list(indexes), ids, id_offsets, [int(r) for r in default_rows])


def hash_upsert(
    digests: Tensor,
    slot_keys: Tensor,
    slot_scores: Tensor,
    size: Tensor,
    keys: Tensor,
    scores: Tensor | None,
    capacity: int,
    policy: int,
    clock: int,
    epoch: int,
    assign: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """find_or_insert (``assign=False``) or insert_or_assign (``assign=True``), in place.

    Every key of the call that already has a row is touched and pinned before any insertion, so
    the call never evicts the row of one of its own keys; new keys then go in in batch order.

    Args:
        digests, slot_keys, slot_scores: the table's uint8 / int64 / int64 arrays (``index_lengths``; mutated).
        size: int64 ``[1]``, live keys (mutated).
        keys: int64 ``[n]``.
        scores: int64 ``[n]`` or None: custom scores, or increments for lfu/epoch_lfu; stored
            as given when ``assign``.
        capacity: the table's rows.
        policy: index into ``vocabulary.POLICIES``.
        clock, epoch: the logical clock and epoch the touched scores take.
        assign: insert_or_assign semantics.

    Returns:
        rows: int64 ``[n]``, -1 where refused (full pair of buckets and nothing evictable).
        inserted: bool ``[n]``, True at the first occurrence of each key that got a new row.
        evicted_keys, evicted_rows: int64 ``[m]``, the keys evicted to make room and their rows.
    """
    return _ops.hash_upsert.default(
        digests, slot_keys, slot_scores, size, keys, scores, capacity, policy, clock, epoch, assign
    )


def hash_upsert_fixed(
    digests: Tensor,
    slot_keys: Tensor,
    slot_scores: Tensor,
    size: Tensor,
    keys: Tensor,
    scores: Tensor | None,
    pending: Tensor | None,
    capacity: int,
    policy: int,
    clock: int,
    epoch: int,
    assign: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`hash_upsert` with outputs of one entry per key, so that no output size is read on
    the host (on a GPU: no sync), and a pending mask.

    Args:
        pending: bool ``[n]`` or None (all keys): the keys not pending take no part (row -1, not
            inserted), exactly as if the call had been made on the pending keys alone.
        others: as :func:`hash_upsert`.

    Returns:
        rows, inserted: as :func:`hash_upsert`.
        evicted: bool ``[n]``, True where key i took the row of an evicted key.
        evicted_keys: int64 ``[n]``, that evicted key (0 elsewhere).
    """
    return _ops.hash_upsert_fixed.default(
        digests, slot_keys, slot_scores, size, keys, scores, pending, capacity, policy, clock, epoch, assign
    )


def hash_upsert_tables(
    digests: Sequence[Tensor],
    slot_keys: Sequence[Tensor],
    slot_scores: Sequence[Tensor],
    sizes: Sequence[Tensor],
    keys: Tensor,
    key_offsets: Sequence[int],
    scores: Tensor | None,
    pending: Tensor | None,
    capacities: Sequence[int],
    policies: Sequence[int],
    clocks: Sequence[int],
    epochs: Sequence[int],
    assign: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`hash_upsert_fixed` of T tables in one call, in place: the launches (on a GPU: one
    grid over every table's stripes per pass) do not grow with T, and nothing is read on the host.
    Results, table contents and sizes are bit for bit those of calling :func:`hash_upsert_fixed`
    table by table with each table's slice of the batch.

    Args:
        digests, slot_keys, slot_scores, sizes: ``[T]`` lists, table t's arrays as
            :func:`hash_upsert` takes them (mutated); T distinct tables.
        keys: int64 ``[n]``, every table's keys back to back: table t's are
            ``keys[key_offsets[t]:key_offsets[t + 1]]``.
        key_offsets: ``T + 1`` host ints, ascending from 0 to n.
        scores: int64 ``[n]`` or None (all tables); sliced as ``keys``.
        pending: bool ``[n]`` or None (all keys); sliced as ``keys``.
        capacities, policies, clocks, epochs: ``T`` ints, table t's as :func:`hash_upsert` takes them.
        assign: insert_or_assign semantics, for every table.

    Returns:
        rows, inserted, evicted, evicted_keys: ``[n]`` each, as :func:`hash_upsert_fixed`'s,
        position for position.
    """
    return _ops.hash_upsert_tables.default(
        list(digests),
        list(slot_keys),
        list(slot_scores),
        list(sizes),
        keys,
        [int(o) for o in key_offsets],
        scores,
        pending,
        [int(c) for c in capacities],
        [int(p) for p in policies],
        [int(c) for c in clocks],
        [int(e) for e in epochs],
        assign,
    )


def hash_slot_rows(rows: Tensor, key_offsets: Sequence[int], slot_rows: Sequence[Tensor | None]) -> None:
    """Slots to rows, in place, for the tables whose index maps them (a growing table's).

    Args:
        rows: int64 ``[n]``: table t's slots (``hash_upsert_tables`` / ``hash_find`` output) at
            ``[key_offsets[t]:key_offsets[t + 1]]``, -1 where none (kept).
        key_offsets: ``len(slot_rows) + 1`` ascending ints from 0 to ``n``.
        slot_rows: per table, its slot -> row map (int32 or int64, one entry per slot of
            ``[0, capacity)``), or None where the table's slots are its rows.
    """
    _ops.hash_slot_rows.default(rows, list(key_offsets), list(slot_rows))


def hash_erase(digests: Tensor, slot_keys: Tensor, size: Tensor, keys: Tensor, capacity: int) -> Tensor:
    """Removes keys, in place.

    Args:
        digests: uint8 (``index_lengths``; mutated: a removed key's slot becomes empty).
        slot_keys: int64 (``index_lengths``).
        size: int64 ``[1]``, live keys (mutated).
        keys: int64 ``[n]``, any values (absent ones are no-ops).
        capacity: the table's rows.

    Returns:
        bool ``[n]``: True at the position that removed each key (the first of duplicates).
    """
    return _ops.hash_erase.default(digests, slot_keys, size, keys, capacity)


def hash_export(
    digests: Tensor, slot_keys: Tensor, slot_scores: Tensor, capacity: int, start: int, end: int
) -> tuple[Tensor, Tensor, Tensor]:
    """The live entries among slots ``[start, end)``. Read-only.

    Args:
        digests, slot_keys, slot_scores: the table's uint8 / int64 / int64 arrays (``index_lengths``).
        capacity: the table's rows.
        start, end: the slot range, ``0 <= start <= end <= num_slots`` (pages of a large table).

    Returns:
        keys, rows, scores: int64 ``[live]`` each, in row order.
    """
    return _ops.hash_export.default(digests, slot_keys, slot_scores, capacity, start, end)


def hash_restore(
    digests: Tensor,
    slot_keys: Tensor,
    slot_scores: Tensor,
    size: Tensor,
    keys: Tensor,
    rows: Tensor,
    scores: Tensor,
    capacity: int,
) -> None:
    """Places ``keys`` at ``rows`` with ``scores`` in an empty table, in place. Validates
    everything first (each row one of the key's candidate slots, no duplicate key or row, the
    table empty) and writes nothing on error.

    Args:
        digests, slot_keys, slot_scores: the table's uint8 / int64 / int64 arrays (``index_lengths``; mutated).
        size: int64 ``[1]`` (mutated: set to n).
        keys: int64 ``[n]``, distinct.
        rows: int64 ``[n]``, each key's row (:func:`hash_place` finds them).
        scores: int64 ``[n]``, each key's score.
        capacity: the table's rows.
    """
    _ops.hash_restore.default(digests, slot_keys, slot_scores, size, keys, rows, scores, capacity)


def hash_place(keys: Tensor, scores: Tensor, capacity: int, start_rows: Tensor | None = None) -> Tensor:
    """Rows for distinct ``keys`` in an empty table of ``capacity`` rows, each in one of the
    key's two buckets or, for the few a full table leaves no row there, a free row outside them
    (the stash; what ``hash_restore`` accepts). CPU kernel (``csrc/placement_cpu.cpp``).

    Keys are taken by priority, higher ``scores`` first (ties: lower position first): a free slot
    of their buckets, else augmenting paths that move placed keys to their other bucket, else a
    trade for a placed key of lower priority. So a key is left out exactly when it cannot be
    placed beside the higher-priority keys that are placed: every key is placed whenever some placement holds them all, and otherwise the
    most keys the buckets allow, the highest-priority ones kept; then the left-out keys of highest
    priority, up to ``stash_slots(capacity)``, go to the stash (cut to ``capacity`` keys in all, by
    priority). Deterministic.

    Args:
        keys: int64 ``[n]``, distinct.
        scores: int64 ``[n]``, each key's priority.
        capacity: the table's rows (> 0).
        start_rows: optional int64 ``[n]``, a starting placement (-1: none; else a row < capacity,
            distinct; a row outside the key's buckets, a stashed key's, is placed afresh): those in
            their buckets are put there first and move only along the
            augmenting paths (or trades) that make room for the others. Every key is still placed
            whenever some placement holds them all; otherwise the most keys the buckets allow.

    Returns:
        rows: int64 ``[n]``, each key's row, -1 where it was left out.
    """
    return _ops.hash_place.default(keys, scores, capacity, start_rows)


def route(keys: Tensor, world_size: int) -> Tensor:
    """Owning rank of each key under row-wise sharding. The hash is independent of the table's
    bucket hash, so the keys one rank owns spread over all of that rank's buckets.

    Args:
        keys: int64 ``[n]``.
        world_size: ranks (>= 1).

    Returns:
        int64 ``[n]``, each key's rank in ``[0, world_size)``.
    """
    if not isinstance(keys, Tensor):
        raise TypeError(f"route: keys must be a torch.Tensor, got {type(keys).__name__}")
    if keys.dtype != torch.int64:
        raise TypeError(f"route: keys must be int64, got {keys.dtype}")
    if keys.dim() != 1:
        raise ValueError(f"route: keys must be 1-D, got shape {tuple(keys.shape)}")
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"route: world_size must be an int >= 1, got {world_size!r}")
    return _ops.route.default(keys, world_size)


def bloom_admit(
    counters: Tensor,
    keys: Tensor,
    counts: Tensor,
    pending: Tensor | None,
    hash_seed: int,
    hashes: int,
    admit_after: int,
) -> Tensor:
    """One batch of a counting Bloom filter of 4-bit saturating counters, in place.

    Adds each pending key's count to its ``hashes`` counters (``min(counter + count, 15)``),
    then decides each pending key: admitted when the smallest of its counters, after every
    increment of the call, is >= ``admit_after``. CPU kernel ``csrc/bloom_cpu.cpp`` (parallel
    over keys, compare-and-swap on a counter's byte), CUDA kernel ``csrc/bloom_cuda.cu``.

    Args:
        counters: uint8 ``[bytes]`` (a power of two), two counters per byte, low nibble first (mutated).
        keys: int64 ``[n]``.
        counts: int64 ``[n]``, each key's sightings (>= 0).
        pending: bool ``[n]``, the keys to count and decide, or None for all.
        hash_seed: int64 bit pattern; a key's cells are double hashing of ``fmix64(key ^ hash_seed)``
            (``modules.admission.bloom_cells``).
        hashes: counters per key, in [1, 16].
        admit_after: in [1, 15].

    Returns:
        bool ``[n]``: admitted (False where not pending).
    """
    return _ops.bloom_admit.default(counters, keys, counts, pending, hash_seed, hashes, admit_after)


def dedup_segments(ids: Tensor, segment_offsets: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Unique ids of each segment, in first-occurrence order.

    Args:
        ids: int64 ``[n]``.
        segment_offsets: int64 ``[S + 1]``, segment s is ``ids[segment_offsets[s]:segment_offsets[s + 1]]``.

    Returns:
        unique: int64 ``[u]``, each segment's uniques, concatenated.
        inverse: int64 ``[n]``, each id's index into ``unique``.
        counts: int64 ``[u]``, occurrences of each unique.
        unique_offsets: int64 ``[S + 1]``, where each segment's uniques start.

    One counted host read (``device_sync``) per call on either device. On a GPU the kernel
    (``csrc/dedup_cuda.cu``) reads the unique counts back to size its outputs; given the offsets
    on the host it returns unique_offsets there, the values it read. So this passes the host
    copy of segment_offsets (their mirror: free on the step path), counts the kernel's read and
    returns unique_offsets on the GPU, mirrored: the caller's read of them costs nothing more.
    Under ``torch.inference_mode`` too (``device_sync.to_device`` makes mirrorable copies there).
    On CPU the kernel reads nothing and the caller's read of unique_offsets is the one counted.
    """
    if ids.device.type != "cuda" or torch.compiler.is_compiling():
        return _ops.dedup_segments.default(ids, segment_offsets)
    return dedup_segments_read_once(_ops.dedup_segments.default, ids, segment_offsets)


def dedup_segments_read_once(
    kernel: Callable, ids: Tensor, segment_offsets: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``kernel`` (the CUDA ``dedup_segments``, or its emulation in tests) given the offsets on the
    host, its read counted and its host unique_offsets mirrored on ids' device."""
    host_offsets = device_sync.to_host(segment_offsets, "dedup_segments: segment offsets")
    unique, inverse, counts, host_unique_offsets = kernel(ids, host_offsets)
    # Already on the host: counted (the kernel's read) and settles the deferred checks, no copy.
    device_sync.to_host(host_unique_offsets, "dedup_segments: unique count")
    return unique, inverse, counts, device_sync.to_device(host_unique_offsets, ids.device)


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
    """Writes each id's initial vector into its row, in place.

    Args:
        table: float32, float16 or bfloat16 ``[capacity, dim]`` (half tables take the vector rounded to nearest even).
        rows: int64 ``[n]``, -1 to skip.
        ids: int64 ``[n]``; the vector is a pure function of (seed, id, element).
        seed: the table's seed (``hashing.table_seed``).
        kind, params: initializer index into ``vocabulary.INITIALIZERS`` and its parameters,
            optionally followed by the first column (any): the table is a column shard whose
            vectors are columns first.. of its whole table's.
        states, state_values: optimizer states, float32 ``[capacity, width]``, whose rows are reset to the value.
    """
    _ops.init_rows.default(
        table, rows, ids, seed, kind, [float(p) for p in params], list(states), [float(v) for v in state_values]
    )


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
    """:func:`init_rows` of all tables of a module in one call, in the flat storage: launches
    independent of the table count, no host read. The C++ op where the device has its kernel
    (CPU: csrc/init_rows_cpu.cpp; CUDA: one launch, csrc/init_rows_cuda.cu, bit for bit the CPU
    kernel's), else a torch composite (``torch_kernels.init_rows_tables``); each vector is the one
    :func:`init_rows` draws for (seed, id).

    Args:
        weights, table_offsets, table_dims, table_dtypes: the module's storage, as in
            :func:`pooled_lookup` (mutated).
        rows, tables, ids: int64 ``[n]``, each new id's row (-1: skip), table and id.
        table_seeds, table_kinds: int64 ``[T]``, each table's seed (bit pattern) and initializer
            (index into ``vocabulary.INITIALIZERS``).
        table_params: float64 ``[T, 4]``, each table's initializer parameters.
        kinds: the initializer kinds present (host ints).
        max_dim: the widest table's dim (host int).
        states: flat float32 optimizer states (mutated): table t's rows from ``state_offsets[t]``
            (int64 ``[T]``), one value per row when ``rowwise``, else ``dim_t``; reset to ``state_values``.
    """
    layout = (
        weights,
        table_offsets,
        table_dims,
        table_dtypes,
        rows,
        tables,
        ids,
        table_seeds,
        table_kinds,
        table_params,
    )
    if _init_tables_kernel(weights.device):
        _ops.init_rows_tables.default(
            *layout, max_dim, list(states), state_offsets, rowwise, [float(v) for v in state_values]
        )
    else:
        torch_kernels.init_rows_tables(*layout, kinds, max_dim, states, state_offsets, rowwise, state_values)


_INIT_TABLES_KERNEL: dict[str, bool] = {}


def _init_tables_kernel(device: torch.device) -> bool:
    """Whether ``init_rows_tables`` has a C++ kernel for ``device`` (asked once per device type:
    the dispatcher query is on every training step's path)."""
    if device.type not in _INIT_TABLES_KERNEL:
        _INIT_TABLES_KERNEL[device.type] = has_kernel("init_rows_tables", device)
    return _INIT_TABLES_KERNEL[device.type]


def pooled_lookup(
    weights: Tensor,
    table_offsets: Tensor,
    table_dims: Tensor,
    feature_table: Tensor,
    feature_col: Tensor,
    feature_mean: Tensor,
    rows: Tensor,
    offsets: Tensor,
    per_sample_weights: Tensor | None,
    batch_size: int,
    total_dim: int,
    new_vectors: Sequence[Tensor] = (),
    table_dtypes: Tensor | None = None,
) -> Tensor:
    """Pooled (sum or mean) lookup of every bag of every feature, across tables in one call.

    Args:
        weights: all tables in one flat buffer of 4-byte words (a float32 tensor); table t's
            ``[capacity_t, dim_t]`` rows start at word ``table_offsets[t]``, in the table's
            storage dtype (``table_dtypes``), packed (``vocabulary.table_words`` words).
        table_offsets, table_dims: int64 ``[T]``.
        feature_table: int64 ``[F]``, each feature's table.
        feature_col: int64 ``[F]``, each feature's first column in the output.
        feature_mean: bool ``[F]``, mean pooling (else sum).
        rows: int64 ``[n]``, each id's row; -1 reads zeros; ``vocabulary.pending_row(j)`` reads
            ``new_vectors[t][j]`` (the pending-row protocol: ``vocabulary.PENDING_ROW_BASE``).
        offsets: int64 ``[F * batch_size + 1]``, bag b = f * batch_size + sample.
        per_sample_weights: float32 ``[n]`` or None.
        table_dtypes: int64 ``[T]``, each table's storage dtype (``vocabulary.STORAGE_DTYPES``
            index: 0 float32, 1 float16, 2 bfloat16); None: all float32. ``new_vectors[t]`` has
            table t's dtype.

    Returns:
        float32 ``[batch_size, total_dim]`` (rows are read as float32 and summed in float32).
    """
    return _ops.pooled_lookup.default(
        weights,
        table_offsets,
        table_dims,
        feature_table,
        feature_col,
        feature_mean,
        rows,
        offsets,
        per_sample_weights,
        batch_size,
        total_dim,
        list(new_vectors),
        table_dtypes,
    )


def sequence_lookup(
    weights: Tensor,
    table_offsets: Tensor,
    dim: int,
    feature_table: Tensor,
    feature_value_offsets: Tensor,
    rows: Tensor,
    new_vectors: Sequence[Tensor] = (),
    table_dtypes: Tensor | None = None,
) -> Tensor:
    """Each id's row, unpooled (the sequence lookup of an embedding collection).

    Args:
        weights, table_offsets, table_dtypes: the storage, as in :func:`pooled_lookup`.
        dim: the one dim of every table looked up.
        feature_table: int64 ``[F]``, each feature's table.
        feature_value_offsets: int64 ``[F + 1]``, feature f's ids are ``rows[offsets[f]:offsets[f + 1]]``.
        rows, new_vectors: int64 ``[n]``, each id's row, as in :func:`pooled_lookup` (-1: zeros).

    Returns:
        float32 ``[n, dim]``.
    """
    return _ops.sequence_lookup.default(
        weights, table_offsets, dim, feature_table, feature_value_offsets, rows, list(new_vectors), table_dtypes
    )


def fused_update(
    grad: Tensor,
    weights: Tensor,
    states: list[Tensor],
    table_offsets: Tensor,
    table_dims: Tensor,
    state_row_offsets: Tensor,
    unique_rows: Tensor,
    unique_table: Tensor,
    inverse: Tensor,
    offsets: Tensor | None,
    per_sample_weights: Tensor | None,
    feature_col: Tensor,
    feature_mean: Tensor,
    batch_size: int,
    optimizer: int,
    hparams: Sequence[float],
    step: int,
    new_vectors: Sequence[Tensor] = (),
    unique_new: Tensor | None = None,
    state_init: Sequence[float] = (),
    table_dtypes: Tensor | None = None,
    unique_ids: Tensor | None = None,
    rounding_seeds: Tensor | None = None,
) -> None:
    """Backward of a lookup fused with one optimizer step on each unique row, in place.

    Args:
        grad: float32 ``[batch_size, total_dim]`` (pooled, ``offsets`` given) or ``[n, dim]`` (sequence).
        weights, table_offsets, table_dims: the storage, as in :func:`pooled_lookup` (mutated).
        states: optimizer states, flat float32 (mutated): element-wise ones hold every table's
            ``[capacity_t, dim_t]`` back to back, row-wise ones (one float per row) from ``state_row_offsets[t]``.
        unique_rows, unique_table: int64 ``[u]``, the (table, row) of each unique; row -1 takes no step.
        inverse: int64 ``[n]``, each id's unique.
        offsets, per_sample_weights, feature_col, feature_mean, batch_size: the pooled lookup's (None / empty for sequence).
        optimizer: index into ``vocabulary.OPTIMIZERS``.
        hparams: ``(lr, eps, beta1, beta2, weight_decay, lr_decay)``, as ``reference.fused_update`` reads them.
        step: the optimizer step (Adam's bias correction).
        new_vectors, unique_new, state_init: pending rows, written before their step (the
            pending-row protocol: ``vocabulary.PENDING_ROW_BASE``).
        table_dtypes: the storage dtype of each table, as in :func:`pooled_lookup`. Steps run in
            float32; half rows are written back rounded to nearest even, or stochastically where
            ``rounding_seeds[t]`` (int64 ``[T]``) is not 0, with ``reference.rounding_bits`` of
            (that seed, ``unique_ids[u]`` (int64 ``[u]``, the id of each unique row), element, step).
    """
    _ops.fused_update.default(
        grad,
        weights,
        states,
        table_offsets,
        table_dims,
        state_row_offsets,
        unique_rows,
        unique_table,
        inverse,
        offsets,
        per_sample_weights,
        feature_col,
        feature_mean,
        batch_size,
        optimizer,
        [float(h) for h in hparams],
        step,
        list(new_vectors),
        unique_new,
        [float(v) for v in state_init],
        table_dtypes,
        unique_ids,
        rounding_seeds,
    )


def route_bucketize(
    ids: Tensor, lengths: Tensor, slot_owner: Sequence[int], world_size: int, batch_size: int
) -> tuple[Tensor, Tensor, Tensor]:
    """The input routing of sharded dynamic tables in one pass: ids regrouped by destination rank,
    then bag, keeping their order within a bag (the layout an all-to-all sends). CPU kernel
    ``csrc/route_cpu.cpp``; CUDA kernel ``torch_kernels.route_bucketize`` (torch ops).

    Args:
        ids: int64 ``[n]``.
        lengths: int64 ``[S * batch_size]``, bag b = slot * batch_size + sample; sums to n.
        slot_owner: ``S`` host ints, each slot's rank (table-wise) or -1 (row-wise: each id goes
            to ``route(id, world_size)``).
        world_size: ranks (>= 1).
        batch_size: samples per slot (>= 0).

    Returns:
        values: int64 ``[n]``, the ids, destination-major then bag.
        lengths: int64 ``[world_size * S * batch_size]``, the routed bags' lengths, destination-major.
        order: int64 ``[n]``, each routed id's position in ``ids``.
    """
    return _ops.route_bucketize.default(ids, lengths, list(slot_owner), world_size, batch_size)


# ----------------------------------------------------------------------------- fake kernels


@torch.library.register_fake("torchrec_ext::copy_rows")
def _copy_rows_fake(dst, dst_rows, src, src_rows):
    return None


@torch.library.register_fake("torchrec_ext::guarded_copy_rows")
def _guarded_copy_rows_fake(dst, dst_rows, src, src_rows):
    return dst.new_zeros((), dtype=torch.int64)


@torch.library.register_fake("torchrec_ext::pread_rows")
def _pread_rows_fake(dst, dst_rows, src, src_rows, fd, src_offset):
    return dst.new_empty((2,), dtype=torch.int64)


@torch.library.register_fake("torchrec_ext::hash_find")
def _hash_find_fake(digests, slot_keys, keys, capacity):
    return torch.empty_like(keys), torch.empty_like(keys, dtype=torch.bool)


@torch.library.register_fake("torchrec_ext::hash_find_tables")
def _hash_find_tables_fake(digests, slot_keys, keys, key_offsets, capacities):
    return torch.empty_like(keys), torch.empty_like(keys, dtype=torch.bool)


@torch.library.register_fake("torchrec_ext::serving_index_update")
def _serving_index_update_fake(index, erase_keys, keys, rows):
    return torch.empty_like(index)


@torch.library.register_fake("torchrec_ext::serving_find")
def _serving_find_fake(indexes, ids, id_offsets, default_rows):
    return torch.empty_like(ids)


@torch.library.register_fake("torchrec_ext::hash_upsert")
def _hash_upsert_fake(digests, slot_keys, slot_scores, size, keys, scores, capacity, policy, clock, epoch, assign):
    num_evicted = torch.library.get_ctx().new_dynamic_size()
    return (
        torch.empty_like(keys),
        torch.empty_like(keys, dtype=torch.bool),
        keys.new_empty(num_evicted),
        keys.new_empty(num_evicted),
    )


@torch.library.register_fake("torchrec_ext::hash_upsert_fixed")
def _hash_upsert_fixed_fake(
    digests, slot_keys, slot_scores, size, keys, scores, pending, capacity, policy, clock, epoch, assign
):
    return (
        torch.empty_like(keys),
        torch.empty_like(keys, dtype=torch.bool),
        torch.empty_like(keys, dtype=torch.bool),
        torch.empty_like(keys),
    )


@torch.library.register_fake("torchrec_ext::hash_upsert_tables")
def _hash_upsert_tables_fake(
    digests,
    slot_keys,
    slot_scores,
    sizes,
    keys,
    key_offsets,
    scores,
    pending,
    capacities,
    policies,
    clocks,
    epochs,
    assign,
):
    return (
        torch.empty_like(keys),
        torch.empty_like(keys, dtype=torch.bool),
        torch.empty_like(keys, dtype=torch.bool),
        torch.empty_like(keys),
    )


@torch.library.register_fake("torchrec_ext::hash_slot_rows")
def _hash_slot_rows_fake(rows, key_offsets, slot_rows):
    return None


@torch.library.register_fake("torchrec_ext::hash_erase")
def _hash_erase_fake(digests, slot_keys, size, keys, capacity):
    return torch.empty_like(keys, dtype=torch.bool)


@torch.library.register_fake("torchrec_ext::hash_export")
def _hash_export_fake(digests, slot_keys, slot_scores, capacity, start, end):
    live = torch.library.get_ctx().new_dynamic_size()
    return slot_keys.new_empty(live), slot_keys.new_empty(live), slot_keys.new_empty(live)


@torch.library.register_fake("torchrec_ext::hash_restore")
def _hash_restore_fake(digests, slot_keys, slot_scores, size, keys, rows, scores, capacity):
    return None


@torch.library.register_fake("torchrec_ext::hash_place")
def _hash_place_fake(keys, scores, capacity, start_rows=None):
    return torch.empty_like(keys)


@torch.library.register_fake("torchrec_ext::route")
def _route_fake(keys, world_size):
    return torch.empty_like(keys)


@torch.library.register_fake("torchrec_ext::route_bucketize")
def _route_bucketize_fake(ids, lengths, slot_owner, world_size, batch_size):
    return torch.empty_like(ids), lengths.new_empty(world_size * lengths.shape[0]), torch.empty_like(ids)


@torch.library.register_fake("torchrec_ext::bloom_admit")
def _bloom_admit_fake(counters, keys, counts, pending, hash_seed, hashes, admit_after):
    return torch.empty_like(keys, dtype=torch.bool)


@torch.library.register_fake("torchrec_ext::dedup_segments")
def _dedup_segments_fake(ids, segment_offsets):
    num_unique = torch.library.get_ctx().new_dynamic_size()
    return (
        ids.new_empty(num_unique),
        torch.empty_like(ids),
        ids.new_empty(num_unique),
        torch.empty_like(segment_offsets),
    )


@torch.library.register_fake("torchrec_ext::init_rows")
def _init_rows_fake(table, rows, ids, seed, kind, params, states, state_values):
    return None


@torch.library.register_fake("torchrec_ext::init_rows_tables")
def _init_rows_tables_fake(*args):
    return None


@torch.library.register_fake("torchrec_ext::pooled_lookup")
def _pooled_lookup_fake(
    weights,
    table_offsets,
    table_dims,
    feature_table,
    feature_col,
    feature_mean,
    rows,
    offsets,
    per_sample_weights,
    batch_size,
    total_dim,
    new_vectors=(),
    table_dtypes=None,
):
    return weights.new_empty(batch_size, total_dim)


@torch.library.register_fake("torchrec_ext::sequence_lookup")
def _sequence_lookup_fake(
    weights, table_offsets, dim, feature_table, feature_value_offsets, rows, new_vectors=(), table_dtypes=None
):
    return weights.new_empty(rows.shape[0], dim)


@torch.library.register_fake("torchrec_ext::fused_update")
def _fused_update_fake(
    grad,
    weights,
    states,
    table_offsets,
    table_dims,
    state_row_offsets,
    unique_rows,
    unique_table,
    inverse,
    offsets,
    per_sample_weights,
    feature_col,
    feature_mean,
    batch_size,
    optimizer,
    hparams,
    step,
    new_vectors=(),
    unique_new=None,
    state_init=(),
    table_dtypes=None,
    unique_ids=None,
    rounding_seeds=None,
):
    return None


# ----------------------------------------------------------------------------- kernels in Python


def python_kernel_tables() -> list[dict[str, dict[str, Callable]]]:
    """The Python backends' ``KERNELS`` tables (op -> device type -> kernel): torch ops, then
    Triton (imported only where Triton is installed; empty otherwise)."""
    from torchrec_ext import triton_kernels

    return [torch_kernels.KERNELS, triton_kernels.KERNELS]


def register_python_kernels(device_type: str = "cuda") -> None:
    """Registers every Python kernel for ``device_type`` with ``torch.library.register_kernel``:
    the one loop over the backends' tables. A (op, device) the C++ library serves
    (``csrc_kernels.KERNELS``) or two Python backends both claim is an error, not an override."""
    claimed: dict[str, Callable] = {}
    for table in python_kernel_tables():
        for op_name, by_device in table.items():
            kernel = by_device.get(device_type)
            if kernel is None:
                continue
            other = csrc_kernels.KERNELS.get(op_name, {}).get(device_type) or _qualified(claimed.get(op_name))
            if other:
                raise RuntimeError(
                    f"torchrec_ext::{op_name} has two {device_type} kernels: {other} and {_qualified(kernel)}"
                )
            claimed[op_name] = kernel
    for op_name, kernel in claimed.items():  # all checked first: an error registers nothing
        torch.library.register_kernel(f"torchrec_ext::{op_name}", device_type, kernel)


def _qualified(kernel: Callable | None) -> str:
    return "" if kernel is None else f"{kernel.__module__}.{kernel.__name__}"


if torch.cuda.is_available():
    register_python_kernels("cuda")
