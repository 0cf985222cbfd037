"""The device maps of the GPU tier (torchrec_ext/modules/tier_device_maps.py) run on the CPU.

On a CUDA device a tiered module keeps its caches' maps (row -> slot, slot -> row, LRU clocks,
dirty flags, pins) on the device, so that a lookup whose rows are cached reads nothing on the
host but one count. ``TieredTables.device_maps = True`` takes that path with the cache on the
CPU: the tier's tests below run on it (imported, so each runs again here under the fixture).
Oracle, as there: the same module all-resident, bit for bit (outputs, rows, optimizer states,
evictions), with eviction, admission, TTL, the pipeline's stage, checkpoints and loads.
"""

import pytest
import torch

from matrix import FULL_MATRIX, REASON
from test_tier_edges import test_a_batch_sharing_the_rows_of_a_batch_in_flight_needs_no_more_slots  # noqa: F401
from test_tiers import (  # noqa: F401  (collected here again, with the device maps)
    POOL,
    _backing,
    _bag_configs,
    _train_staged,
    test_a_cache_too_small_for_a_batch_is_a_clear_error_and_changes_nothing,
    test_a_copy_of_a_file_backed_module_is_independent,
    test_a_dropped_graph_releases_its_rows,
    test_a_stage_never_takes_the_slots_of_the_batch_in_flight,
    test_an_eval_mode_lookup_whose_backward_runs_writes_its_rows_back,
    test_an_inference_mode_evaluation_before_training_leaves_the_tier_trainable,
    test_checkpoints_round_trip_between_tiered_and_resident_and_a_reopened_file,
    test_pooled_tiered_tables_equal_all_resident_tables_bit_for_bit,
    test_prefetch_brings_a_batch_in_and_changes_no_result,
    test_reset_parameters_empties_the_cache_as_the_tables,
    test_rows_of_batches_in_flight_stay_cached_until_their_update_lands,
    test_sequence_tiered_tables_equal_all_resident_tables_with_eval_lookups,
    test_staged_tables_equal_resident_tables_on_heavy_tailed_ids,
    test_staged_tiered_tables_equal_unstaged_and_all_resident_tables,
    test_stages_around_eval_lookups_checkpoints_loads_and_resets_of_sequence_tables,
    test_stages_while_the_cache_fills_up_and_overflows,
    test_table_stats_count_the_tier_traffic,
)
from test_tiers_device import (  # noqa: F401
    test_a_device_cache_over_host_memory_equals_all_resident_tables,
    test_a_device_cache_round_trips_its_state_dict,
    test_a_tiered_module_moves_to_the_device_and_back,
    test_the_pipeline_prefetches_into_a_device_cache,
    through_records,
)
from torchrec_ext import DynamicEmbeddingBagCollection, device_sync
from torchrec_ext.modules import tiered_tables
from torchrec_ext.modules.tier_device_maps import DeviceSlotMaps
from torchrec_ext.modules.tiered_tables import TieredTables

# Run in CI (the others, seconds each, where the full matrix runs: TORCHREC_EXT_FULL_MATRIX=1).
CI = {
    "test_a_device_cache_over_host_memory_equals_all_resident_tables",
    "test_the_pipeline_prefetches_into_a_device_cache",
    "test_a_tiered_module_moves_to_the_device_and_back",
    "test_staged_tiered_tables_equal_unstaged_and_all_resident_tables[file-thread]",
    "test_staged_tables_equal_resident_tables_on_heavy_tailed_ids[file-thread]",
    "test_a_stage_never_takes_the_slots_of_the_batch_in_flight",
    "test_stages_while_the_cache_fills_up_and_overflows[thread]",
    "test_stages_around_eval_lookups_checkpoints_loads_and_resets_of_sequence_tables",
    "test_rows_of_batches_in_flight_stay_cached_until_their_update_lands",
    "test_an_eval_mode_lookup_whose_backward_runs_writes_its_rows_back",
    "test_an_inference_mode_evaluation_before_training_leaves_the_tier_trainable",
    "test_a_cache_too_small_for_a_batch_is_a_clear_error_and_changes_nothing",
    "test_table_stats_count_the_tier_traffic",
    "test_a_copy_of_a_file_backed_module_is_independent",
    "test_a_batch_sharing_the_rows_of_a_batch_in_flight_needs_no_more_slots",
}


@pytest.fixture(autouse=True)
def device_maps(monkeypatch, request):
    params = getattr(getattr(request.node, "callspec", None), "params", {})
    if params.get("device") == "cuda":
        pytest.skip("on CUDA the device maps are the default: test_tiers_device.py runs these there")
    node = request.node
    chosen = node.originalname in CI or node.name in CI
    if node.function.__module__ != __name__ and not chosen and not FULL_MATRIX:
        pytest.skip(REASON)
    monkeypatch.setattr(TieredTables, "device_maps", True)


def test_the_fixture_puts_the_maps_on_the_device():
    module = DynamicEmbeddingBagCollection(_bag_configs("host", 0.3), optimizer="adagrad")
    assert isinstance(module._tables._maps, DeviceSlotMaps)
    assert all(c.maps is module._tables._maps for c in module._tables.caches)


def _module_and_batches(tables, device_maps, batches, seed=0, device="cpu", tiered=True):
    """A module of ``tables`` tables (host backing, a quarter of the rows cached; ``device_maps``
    as TieredTables takes it; not ``tiered``: all resident) and ``batches`` batches of mostly new
    ids a step."""
    from torchrec import KeyedJaggedTensor

    from torchrec_ext import DynamicEmbeddingBagConfig

    chosen, TieredTables.device_maps = TieredTables.device_maps, device_maps
    configs = [
        DynamicEmbeddingBagConfig(
            name=f"t{t}",
            embedding_dim=4,
            num_embeddings=1024,
            feature_names=[f"f{t}"],
            **({"backing": "host", "cache_load_factor": 0.25} if tiered else {}),
        )
        for t in range(tables)
    ]
    try:
        module = DynamicEmbeddingBagCollection(configs, optimizer="adagrad", device=device)
    finally:
        TieredTables.device_maps = chosen
    gen = torch.Generator().manual_seed(seed)
    return module, [
        KeyedJaggedTensor.from_lengths_sync(
            [f"f{t}" for t in range(tables)],
            torch.randint(0, 600, (48 * tables,), generator=gen),
            torch.full((tables,), 48),
        ).to(device)
        for _ in range(batches)
    ]


def _staged_steps(tables, device_maps, steps=12, seed=0, device="cpu"):
    """Trains a module of ``tables`` tables (``_module_and_batches``), staging each next batch;
    per step after the first two: (torch calls in the lookup's cache bookkeeping, host reads by
    reason during the step)."""
    from test_tiers import _CountTorchCalls
    from torchrec_ext.modules import tier_device_maps, tiered_tables

    module, batches = _module_and_batches(tables, device_maps, steps + 1, seed, device)
    # The bookkeeping of one lookup: the device maps' hold (all tables), or each table's host hold.
    on_device = module._tables._maps is not None
    owner, name = (tier_device_maps.DeviceSlotMaps, "hold") if on_device else (tiered_tables.TieredTables, "_hold")
    original, calls = getattr(owner, name), []

    def counted(*args, **kwargs):
        with _CountTorchCalls() as count:
            out = original(*args, **kwargs)
        calls[-1] += count.calls
        return out

    setattr(owner, name, counted)
    try:
        out = []
        for step in range(steps):
            module.stage_next(batches[step + 1])
            calls.append(0)
            with device_sync.recording() as seen:
                module(batches[step]).values().sum().backward()
                module._tables.wait_for_stage()
            if step >= 2:
                out.append((calls[-1], seen))
    finally:
        setattr(owner, name, original)
    stats = module.table_stats()["t0"]
    assert stats.cache_staged > 0 and stats.cache_staged_write_backs > 0  # the cache full: the stage evicts
    if on_device:
        _check_maps(module._tables._maps)
    return out


def _check_maps(maps):
    """Each table's slots: every one either holds a row (row -> slot -> row agree) or is free, on
    its free stack once; every cached row's slot holds it."""
    for t, cache in enumerate(maps.tables):
        row_of = cache.row_of
        free = maps.free_stack[maps.slot_base_host[t] :][: maps.free_count[t]].long()
        assert int(maps.free_top[t]) == maps.free_count[t]
        assert free.unique().numel() == free.numel() and bool((row_of[free] == -1).all())
        held = (row_of >= 0).nonzero().squeeze(1)
        assert held.numel() + free.numel() == cache.slots
        assert torch.equal(cache.slot_of[row_of[held]].long(), held)
        cached = (cache.slot_of >= 0).nonzero().squeeze(1)
        assert cached.numel() == held.numel() and torch.equal(row_of[cache.slot_of[cached].long()], cached)


def test_a_staged_lookup_reads_one_count_and_its_host_work_does_not_grow_with_tables():
    # The stage made the rows hot and freed slots for the new ones: the lookup's maps work stays
    # on the device (one count read for all tables, no miss path), in as many torch calls for 6
    # tables as for 2; the host maps' bookkeeping grows with the tables.
    few, many = _staged_steps(2, True), _staged_steps(6, True)
    for steps in (few, many):
        for _, seen in steps:
            assert seen["tiered tables: rows without a cache slot"] == 1, seen
            assert not seen["tiered tables: cache misses"] and not seen["tiered tables: rows to read"], seen
    assert [c for c, _ in few] == [c for c, _ in many] and few[0][0] <= 70
    host_few, host_many = _staged_steps(2, False), _staged_steps(6, False)
    assert min(c for c, _ in host_many) > 2 * max(c for c, _ in host_few)


def _unstaged_reads(tables, device="cpu"):
    """Host reads by reason of a training lookup that misses and evicts in every table (no
    stage: the lookup's host path), after 16 steps."""
    module, batches = _module_and_batches(tables, True, 17, device=device)
    for kjt in batches[:16]:
        module(kjt).values().sum().backward()
    with device_sync.recording() as seen:
        module(batches[16]).values().sum().backward()
    stats = module.tier_step_stats()
    assert all(s["misses"] > 0 and s["write_backs"] > 0 for s in stats.values()), stats
    _check_maps(module._tables._maps)
    return seen


def test_a_lookup_that_misses_in_every_table_reads_them_all_at_once():
    # The miss path (no stage ahead): every table's missing rows in one read, every table's
    # victims in one, whatever the table count (the lookup's count read before them).
    few, many = _unstaged_reads(2), _unstaged_reads(6)
    for seen in (few, many):
        assert seen["tiered tables: rows to read"] == 1 and seen["tiered tables: slots to evict"] == 1, seen
        assert seen["tiered tables: rows without a cache slot"] == 1 and not seen["tiered tables: cache misses"], seen
    assert few == many


def _eval_reads(tables, device="cpu"):
    """Host reads by reason of two eval lookups after 16 training steps: one that misses in every
    table (a batch not seen yet), then the same batch again (all hits); their outputs equal the
    all-resident module's, trained alike."""
    module, batches = _module_and_batches(tables, True, 17, device=device)
    resident, _ = _module_and_batches(tables, True, 0, device=device, tiered=False)
    for kjt in batches[:16]:
        for m in (module, resident):
            m(kjt).values().sum().backward()
    module.eval()
    resident.eval()
    reads = []
    with torch.no_grad():
        for misses in (True, False):
            with device_sync.recording() as seen:
                out = module(batches[16]).values()
            reads.append(seen)
            assert torch.equal(out, resident(batches[16]).values())
            assert all((s["misses"] > 0) == misses for s in module.tier_step_stats().values())
    _check_maps(module._tables._maps)
    return reads


def test_an_eval_lookup_reads_one_count_for_all_tables():
    # An eval lookup finds its rows table by table (no upsert to batch), then holds them in the
    # caches for all its tables at once, as a training lookup does: one count read whatever the
    # table count, with misses (one read of them, one of the victims) or without.
    few, many = _eval_reads(2), _eval_reads(6)
    for misses, hits in (few, many):
        for seen in (misses, hits):
            assert seen["tiered tables: rows without a cache slot"] == 1, seen
        assert misses["tiered tables: rows to read"] == 1 and not hits["tiered tables: rows to read"], misses
    assert few == many


def test_the_maps_stay_whole_through_misses_checkpoints_loads_and_resets(tmp_path):
    # No stage: every lookup fills its misses and evicts on the host path. The maps stay whole
    # and the module equals the all-resident one, through a checkpoint, a load and a reset.
    from modules_helpers import random_kjt

    make = lambda configs: DynamicEmbeddingBagCollection(configs, optimizer="adagrad", optimizer_kwargs={"lr": 0.05})
    resident, tiered = make(_bag_configs()), make(_bag_configs(_backing("file", tmp_path), 0.3))
    maps = tiered._tables._maps
    gen = torch.Generator().manual_seed(12)
    saved = None
    for step in range(16):
        kjt = random_kjt(["f0", "f1", "f2", "f3"], 6, POOL[torch.randint(0, 700, (400,), generator=gen)], 5)
        if step == 6:
            saved = {k: v.clone() for k, v in tiered.state_dict().items()}  # dirty rows written back
            assert not bool(maps.dirty[: maps.total_slots].any())
        if step == 9:
            for m in (resident, tiered):
                m.load_state_dict(saved)  # the caches emptied
            assert not bool((maps.row_of[: maps.total_slots] >= 0).any())
        if step == 13:
            for m in (resident, tiered):
                m.reset_parameters()
        outs = [m(kjt).values() for m in (resident, tiered)]
        assert torch.equal(outs[0], outs[1]), step
        for out in outs:
            out.square().sum().backward()
        _check_maps(maps)
    a, b = resident.state_dict(), tiered.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    stats = tiered.table_stats()["a"]
    assert stats.cache_misses > 0 and stats.cache_write_backs > 0


@pytest.mark.parametrize("records", [False, True], ids=["plain", "records"])
def test_storage_bytes_counts_the_device_maps_as_allocated(tmp_path, monkeypatch, records):
    # (test_tier_memory.py's oracle: the bytes of the tensors reachable from the tier's objects;
    # records: the GPU's path, its buffers of transfers and of the tables' packed reads counted)
    from modules_helpers import random_kjt
    from test_tier_memory import _configs, _tier_bytes_allocated

    monkeypatch.setattr(TieredTables, "copy_through_records", records)
    module = DynamicEmbeddingBagCollection(_configs(f"file:{tmp_path}"), optimizer="adagrad")
    tables = module._tables
    gen = torch.Generator().manual_seed(3)
    zipf = (torch.rand(1200, generator=gen) ** 3 * 900).long()  # hot ids and a tail: evicted rows come back
    batches = [random_kjt(["f0", "f1"], 8, zipf[i * 100 : i * 100 + 100], 6) for i in range(12)]
    for kjt, next_kjt in zip(batches[:-1], batches[1:]):
        module.stage_next(next_kjt)
        module(kjt).values().sum().backward()
        tables.wait_for_stage()
        assert tables.storage_bytes() - super(TieredTables, tables).storage_bytes() == _tier_bytes_allocated(tables)
    if records:
        assert tables._movers[0].copies.buffer_bytes() > 0


def test_per_table_upserts_hold_their_rows_table_by_table(tmp_path, through_records, monkeypatch):  # noqa: F811
    # (batched_upsert=False: each table's rows held on their own, one count read a table)
    monkeypatch.setattr(TieredTables, "batched_upsert", False, raising=False)
    test_a_device_cache_over_host_memory_equals_all_resident_tables(tmp_path, through_records, "host", True)


def test_forgetting_one_tables_cache_keeps_the_other_tables_pins():
    """A table's forget (its rows replaced by a load) drops only its own slots from the pins of
    the batches in flight, as a host ``RowCache`` (one per table) does: another table's pinned
    slots stay held, so no stage evicts a row a batch in flight still updates."""
    from torchrec_ext.modules.tier_device_maps import DeviceSlotMaps

    maps = DeviceSlotMaps([10, 10], [4, 4], torch.device("cpu"))
    token = maps.pin(torch.tensor([1, 2, 4 + 3]), [2, 1])  # table 0's slots 1 and 2, table 1's slot 3
    maps.tables[0].forget()
    held = maps.pinned_mask()
    assert held is not None and held[:8].nonzero().squeeze(1).tolist() == [7]  # (held[8]: the spare entry)
    assert maps.tables[1].pinned_at_most() == 1 and maps.tables[0].pinned_at_most() == 0
    maps.unpin(token)
    assert maps.pinned_mask() is None


def test_a_stage_copies_to_the_device_the_same_for_any_table_count(monkeypatch):
    # The stage's maps work for all tables at once: the slots it takes and frees reach the device
    # in a few copies a stage (each an H2D copy on a GPU), not two a table.
    from torchrec_ext.modules import tier_device_maps

    class Counted:
        copies = 0

        def __getattr__(self, name):
            return getattr(device_sync, name)

        def to_device(self, *args):
            Counted.copies += 1
            return device_sync.to_device(*args)

    monkeypatch.setattr(tier_device_maps, "device_sync", Counted())
    counts = []
    for tables in (2, 6):
        Counted.copies = 0
        _staged_steps(tables, True)
        counts.append(Counted.copies)
    assert counts[0] == counts[1], counts


@pytest.mark.parametrize("records", [False, True], ids=["plain", "records"])
def test_a_failed_write_back_of_one_table_leaves_the_others_written(monkeypatch, records):
    """One table's write-back raises (an OS error writing the backing store): the lookup raises
    it, and the other tables' evicted rows, already gone from the maps, are still written back;
    their rows stay equal to the all-resident module's."""
    monkeypatch.setattr(TieredTables, "copy_through_records", records)
    module, batches = _module_and_batches(2, True, 12)
    resident, _ = _module_and_batches(2, True, 0, tiered=False)
    for kjt in batches[:10]:
        for m in (module, resident):
            m(kjt).values().sum().backward()
    failing = module._tables._mover(0)

    def refuse(*args):
        raise OSError("no space left on device")

    monkeypatch.setattr(failing, "store", refuse)
    monkeypatch.setattr(failing, "write", refuse)
    with pytest.raises(OSError, match="no space left"):
        module(batches[10])
    monkeypatch.undo()
    assert module._tables.caches[1].write_backs > 0
    mine, theirs = module.state_dict(), resident.state_dict()
    prefix = "embedding_bags.t1."
    # (the failed lookup had added its new ids to the index: the resident module's ids compared)
    at = {int(i): r for r, i in enumerate(mine[prefix + "weight_id"].tolist())}
    rows = torch.tensor([at[int(i)] for i in theirs[prefix + "weight_id"]])
    for name in ("weight", "optimizer.momentum1"):
        assert torch.equal(mine[prefix + name][rows], theirs[prefix + name]), name


def _copies_to_the_device(tables, staged, device="cpu"):
    """On the records path a GPU takes: the copies to the device (each an H2D DMA on a GPU:
    ``DeviceCopies.to_device``) of a module of ``tables`` tables trained with the stage ahead
    (``staged``: ``_staged_steps``) or without (``_unstaged_reads``: the lookup's misses), and
    the tables' reads of rows into their caches (each table's rows read by a miss or a stage)."""
    from torchrec_ext.modules.tier_copies import DeviceCopies
    from torchrec_ext.modules.tiered_tables import _Mover

    copies, reads = [], []
    to_device, gather = DeviceCopies.to_device, _Mover.gather
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(TieredTables, "copy_through_records", True)
        patch.setattr(DeviceCopies, "to_device", lambda *a: copies.append(1) or to_device(*a))
        patch.setattr(_Mover, "gather", lambda *a: reads.append(1) or gather(*a))
        if staged:
            _staged_steps(tables, True, device=device)
        else:
            _unstaged_reads(tables, device)
    return len(copies), len(reads)


def test_reading_rows_into_the_caches_is_one_copy_for_all_tables(device="cpu"):
    # With the device maps the rows every table misses (or the stage brings in) are gathered on
    # the host together, packed in one buffer, and reach the device in one copy: as many copies
    # for 6 tables as for 2, while the tables' reads grow with them (test_tiers_device.py: on CUDA).
    for staged in (True, False):
        (few, few_reads), (many, many_reads) = [_copies_to_the_device(n, staged, device) for n in (2, 6)]
        assert few == many and few_reads < many_reads, (staged, few, many, few_reads, many_reads)
        assert many_reads > 2 * many, (staged, many, many_reads)  # (several tables a copy)


def _copies_to_the_host(tables, staged, device="cpu"):
    """On the records path a GPU takes: the write-backs' copies to the host (each a D2H DMA on a
    GPU: ``DeviceCopies.to_host_queued``), their waits (``landed``), their slots' copies to the
    device, and the tables' parts written to their backing stores, of a module of ``tables``
    tables trained as ``_copies_to_the_device`` trains it."""
    from torchrec_ext.modules import tier_copies
    from torchrec_ext.modules.tier_copies import DeviceCopies

    counts = {"to host": 0, "waits": 0, "slots to device": 0, "stores": 0}

    def counted(key, call):
        def counting(*args):
            counts[key] += 1
            return call(*args)

        return counting

    class SlotCopies:
        def __getattr__(self, name):
            return getattr(device_sync, name)

        to_device = staticmethod(counted("slots to device", device_sync.to_device))

    to_stores = DeviceCopies.to_stores
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(TieredTables, "copy_through_records", True)
        patch.setattr(tier_copies, "device_sync", SlotCopies())
        patch.setattr(DeviceCopies, "to_host_queued", counted("to host", DeviceCopies.to_host_queued))
        patch.setattr(DeviceCopies, "landed", counted("waits", DeviceCopies.landed))
        patch.setattr(
            DeviceCopies, "to_stores", lambda self, w, b, store: to_stores(self, w, b, counted("stores", store))
        )
        if staged:
            _staged_steps(tables, True, device=device)
        else:
            _unstaged_reads(tables, device)
    return counts


def test_writing_rows_back_from_the_caches_is_one_copy_for_all_tables(device="cpu"):
    # With the device maps the rows every table evicts dirty are gathered on the device into one
    # buffer (their slots sent there in one copy) and reach the host in one copy, with one wait:
    # as many copies for 6 tables as for 2, while the tables' stores grow with them
    # (test_tiers_device.py: on CUDA).
    for staged in (True, False):
        few, many = [_copies_to_the_host(n, staged, device) for n in (2, 6)]
        assert few["to host"] == many["to host"] and few["stores"] < many["stores"], (staged, few, many)
        for counts in (few, many):
            assert counts["to host"] == counts["waits"] == counts["slots to device"] > 0, (staged, counts)
        assert many["stores"] > 2 * many["to host"], (staged, many)  # (several tables a copy)


def test_packed_reads_of_tables_of_other_widths_and_dtypes_equal_all_resident_tables(tmp_path, monkeypatch):
    # FP32 x 8, FP16 x 6 and BF16 x 4 rows (records of 3 widths) read in one packed copy, from a
    # file's base and its log, and written back to its log in one packed copy, in rounds of 7
    # rows a table (the through_records fixture's chunks); the oracle test: bit for bit against
    # the all-resident module.
    from torchrec_ext.modules import tier_copies

    monkeypatch.setattr(TieredTables, "copy_through_records", True)
    monkeypatch.setattr(tiered_tables, "MAX_ROWS", 7)
    monkeypatch.setattr(tier_copies, "MAX_ROWS", 7)
    widths, to_caches = [], tier_copies.DeviceCopies.to_caches

    def packed(self, reads, buffer):
        if buffer is self.packed:
            widths.append({mover.record_bytes for mover, _, rows in reads if rows.numel()})
        return to_caches(self, reads, buffer)

    monkeypatch.setattr(tier_copies.DeviceCopies, "to_caches", packed)
    written, to_stores = [], tier_copies.DeviceCopies.to_stores

    def packed_back(self, writes, buffer, store):
        written.append({mover.record_bytes for mover, _, rows in writes if rows.numel()})
        return to_stores(self, writes, buffer, store)

    monkeypatch.setattr(tier_copies.DeviceCopies, "to_stores", packed_back)
    sources, gather = [], tiered_tables._LogMover.gather

    def from_base_and_log(self, records, slots, rows):
        logged = self.log.locate(rows) >= 0
        sources.append((bool((~logged).any()), bool(logged.any())))
        return gather(self, records, slots, rows)

    monkeypatch.setattr(tiered_tables._LogMover, "gather", from_base_and_log)
    test_a_device_cache_over_host_memory_equals_all_resident_tables(tmp_path, torch.device("cpu"), "file", True)
    (tmp_path / "reloaded").mkdir()  # (a loaded file's rows in its base, written-back rows in its log)
    test_a_device_cache_round_trips_its_state_dict(tmp_path / "reloaded", torch.device("cpu"))
    assert widths and max(len(w) for w in widths) == 3, widths
    assert written and max(len(w) for w in written) == 3, written  # (the write-backs packed the same way)
    assert (True, True) in sources, sources  # one table's read from both


class _FakeEvent:
    """A CUDA event's stand-in: its waits logged (``synchronize``), never done by itself."""

    def __init__(self, log: list):
        self.log, self.number = log, sum(kind == "record" for kind, _ in log)
        log.append(("record", self.number))

    def synchronize(self) -> None:
        self.log.append(("wait", self.number))

    def query(self) -> bool:
        return False


def test_each_copy_records_its_own_event_and_a_write_back_waits_for_its_copy_alone(monkeypatch):
    """The GPU's control flow on the CPU: the copies taken as asynchronous, with stand-in events.
    Every copy (to the device, or a write-back's to the host) records an event right after it;
    a write-back's wait (``landed``) is for its own copy's event, not for the stream (a copy
    queued after it would lengthen that); a buffer is refilled after its last copy's event. The
    module still equals the all-resident one."""
    from torchrec_ext.modules.tier_copies import DeviceCopies

    log: list[tuple[str, int]] = []
    made = DeviceCopies.__init__

    def asynchronous(self, device):
        made(self, device)
        self.asynchronous = True

    monkeypatch.setattr(DeviceCopies, "__init__", asynchronous)
    monkeypatch.setattr(DeviceCopies, "_copied", lambda self: _FakeEvent(log))
    to_device, queued, landed = DeviceCopies.to_device, DeviceCopies.to_host_queued, DeviceCopies.landed

    def logged_to_device(self, records, buffer):
        out = to_device(self, records, buffer)
        log.append(("to_device", buffer._in_flight.number))
        return out

    def logged_queued(self, records, buffer):
        host, copied = queued(self, records, buffer)
        log.append(("queued", copied.number))
        return host, copied

    monkeypatch.setattr(DeviceCopies, "to_device", logged_to_device)
    monkeypatch.setattr(DeviceCopies, "to_host_queued", logged_queued)
    monkeypatch.setattr(DeviceCopies, "landed", lambda self, e: log.append(("landed", e.number)) or landed(self, e))
    monkeypatch.setattr(TieredTables, "copy_through_records", True)
    module, batches = _module_and_batches(3, True, 16)
    resident, _ = _module_and_batches(3, True, 0, tiered=False)
    _train_staged(resident, module, batches, loss=lambda out: out.sum())
    # Each copy its own event, recorded right after it.
    copies = [(i, n) for i, (kind, n) in enumerate(log) if kind in ("to_device", "queued")]
    assert copies and all(log[i - 1] == ("record", n) for i, n in copies)
    assert len({n for _, n in copies}) == len(copies) == sum(kind == "record" for kind, _ in log)
    # A write-back's wait: its own copy's event, even with other tables' copies queued after it.
    waits = [(i, n) for i, (kind, n) in enumerate(log) if kind == "landed"]
    assert {n for _, n in waits} == {n for i, n in copies if log[i][0] == "queued"}
    assert all(log[i + 1] == ("wait", n) for i, n in waits)
    # All tables' write-backs in one copy: nothing queued between it and its wait.
    assert waits and all(log[i - 1] == ("queued", n) for i, n in waits), log


@pytest.mark.parametrize(
    "maps, records, fail_at", [(True, False, 0), (True, True, 0), (True, True, 2), (False, False, 0)]
)
def test_a_failed_read_leaves_the_maps_as_before_the_lookup(monkeypatch, maps, records, fail_at):
    """One table's read of its backing store raises (an OS error) in the first round of a
    lookup's packed reads, or a later one (rounds of 7 rows a table): the lookup raises it and
    every table's slots taken for it are given back, none left assigned but unfilled; the
    module's next steps equal the all-resident module's that never saw the failed batch (of ids
    seen before; a failed batch with new ids: tests/test_tier_faults.py)."""
    module, resident, batches = _trained_pair(monkeypatch, maps, records)
    calls, restore = _failing_reads(monkeypatch, module, records, lambda n: n > fail_at)
    with pytest.raises(OSError, match="input/output error"):  # (ids seen before: misses, none new)
        module(batches[0])
    assert calls[0] == fail_at + 1
    restore()
    _assert_trains_on_as_resident(module, resident, batches[9:], maps)


def _trained_pair(monkeypatch, maps, records):
    """A tiered module of 2 tables (``maps``: the device maps, else the host maps; ``records``:
    rows through records, as on a GPU; rounds of 7 rows a table) and the all-resident one, both
    trained on 8 batches; and the 16 batches."""
    from torchrec_ext.modules import tier_copies

    monkeypatch.setattr(TieredTables, "copy_through_records", records)
    monkeypatch.setattr(tiered_tables, "MAX_ROWS", 7)
    monkeypatch.setattr(tier_copies, "MAX_ROWS", 7)
    module, batches = _module_and_batches(2, maps, 16)  # (not maps: the host maps, tiered_tables.py)
    resident, _ = _module_and_batches(2, True, 0, tiered=False)
    for kjt in batches[:8]:
        for m in (module, resident):
            m(kjt).values().sum().backward()
    return module, resident, batches


def _failing_reads(monkeypatch, module, records, fails):
    """Table 1's reads of its backing store raise an OS error where ``fails(n)`` (n: the read's
    number, from 1); returns (the count of reads in a list, what puts the real read back)."""
    failing, name = module._tables._mover(1), "gather" if records else "read"
    calls, real = [0], getattr(failing, name)

    def refuse(*args):
        calls[0] += 1
        if fails(calls[0]):
            raise OSError("input/output error")
        return real(*args)

    monkeypatch.setattr(failing, name, refuse)
    return calls, lambda: monkeypatch.setattr(failing, name, real)


def _assert_trains_on_as_resident(module, resident, batches, maps):
    if maps:
        _check_maps(module._tables._maps)
    for kjt in batches:
        mine, theirs = module(kjt), resident(kjt)
        assert torch.equal(mine.values(), theirs.values())
        mine.values().sum().backward()
        theirs.values().sum().backward()


@pytest.mark.parametrize("maps, records", [(True, False), (True, True), (False, False)])
def test_a_stage_whose_read_fails_leaves_no_slot_it_did_not_fill(monkeypatch, maps, records):
    """The stage's read (on its worker) of one table's rows raises: the error reaches the train
    thread (the next join), and every slot the stage took for the rows it was reading goes back,
    as a lookup's failed read gives them back; the module's next steps equal the all-resident
    module's. (Before: the device maps kept those slots as holding rows never read, and the next
    lookups took them for hits: wrong outputs from the next step on.)"""
    import threading

    module, resident, batches = _trained_pair(monkeypatch, maps, records)
    on_worker = lambda n: threading.current_thread().name.startswith("torchrec_ext-tier-stage")
    calls, restore = _failing_reads(monkeypatch, module, records, on_worker)
    module.stage_next(batches[9])  # (staged during batch 8's lookup, which reads on the train thread)
    for m in (module, resident):
        m(batches[8]).values().sum().backward()
    with pytest.raises(OSError, match="input/output error"):
        module._tables.wait_for_stage()
    assert calls[0] > 0
    restore()
    _assert_trains_on_as_resident(module, resident, batches[9:], maps)
