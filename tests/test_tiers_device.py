"""The GPU tier of issue 16: a tiered table's cache on the module's device, its backing store on
the host, rows moving between them as records through a host buffer (pinned on a GPU:
torchrec_ext/modules/tier_copies.py).

Each test runs twice (the ``device`` fixture): on the CPU with ``copy_through_records`` forced
on (the records path a GPU takes, with plain copies: the logic covered without a GPU), and on
CUDA (skipped without one), where the caches' maps are on the device too (tier_device_maps.py;
tests/test_tiers_device_maps.py runs these with the device maps on the CPU). Oracle: the same module all-resident on the same device, fed the
same batches: equal outputs, rows, optimizer states and eviction scores (bit for bit on the CPU;
on CUDA ids, rows, scores and counters exactly, floats to 1e-6, as the device's kernels may sum
in another order).
"""

import contextlib
import threading

import pytest
import torch

from dist_helpers import progress_losses
from modules_helpers import random_kjt
from test_tiers import POOL, _backing, _bag_configs, _dlrm_batches, _Ranker
from torchrec_ext import DynamicEmbeddingBagCollection
from torchrec_ext.modules import tier_copies, tiered_tables
from torchrec_ext.modules.tiered_tables import TieredTables


@pytest.fixture
def through_records(monkeypatch, device):
    """On the CPU: the tier copies rows through records, as on a GPU; transfers cut every 7 rows
    (many chunks per transfer)."""
    if device == "cpu":
        monkeypatch.setattr(TieredTables, "copy_through_records", True)
        monkeypatch.setattr(tiered_tables, "MAX_ROWS", 7)
        monkeypatch.setattr(tier_copies, "MAX_ROWS", 7)  # (rounds of the tables' packed reads)
    return torch.device(device)


def _assert_same(a: torch.Tensor, b: torch.Tensor, what) -> None:
    assert a.dtype == b.dtype and a.device == b.device, what
    if a.device.type == "cpu" or not a.is_floating_point():
        assert torch.equal(a, b), what
    else:
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=lambda m: f"{what}: {m}")


def _assert_same_state(resident, tiered) -> None:
    a, b = resident.state_dict(), tiered.state_dict()
    assert list(a) == list(b)
    for key in a:
        _assert_same(a[key], b[key], key)


def _make(configs, device, optimizer="adagrad"):
    module = DynamicEmbeddingBagCollection(configs, optimizer=optimizer, optimizer_kwargs={"lr": 0.05}, device=device)
    if isinstance(module._tables, TieredTables) and torch.device(device).type == "cpu":
        # As on a GPU: each training lookup writes its new rows, all tables' in one call.
        module._tables.defer_new_rows, module._tables.flat_init = False, True
    return module


def _batches(n, seed, device):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = POOL[torch.randint(0, 700, (400,), generator=gen)]
        out.append(random_kjt(["f0", "f1", "f2", "f3"], 6, ids, 5).to(device))
    return out


@pytest.mark.parametrize("kind,staged", [("host", True), ("file", False), ("file", True)])
def test_a_device_cache_over_host_memory_equals_all_resident_tables(tmp_path, through_records, kind, staged):
    # Eviction, admission, TTL, half-precision rows; misses filled through records, dirty rows
    # written back through them, a stage on the worker (a side stream on a GPU) moving rows ahead.
    device = through_records
    resident = _make(_bag_configs(), device)
    tiered = _make(_bag_configs(_backing(kind, tmp_path), 0.3), device)
    assert isinstance(tiered._tables, TieredTables) and tiered._tables.weights.device.type == device.type
    assert all(buf.device.type == "cpu" for buf in tiered._tables.backing.values())
    batches = _batches(36, seed=4, device=device)
    gen = torch.Generator().manual_seed(5)
    for step, kjt in enumerate(batches):
        if staged and step + 1 < len(batches):
            assert tiered.stage_next(batches[step + 1])
        outs = [m(kjt).values() for m in (resident, tiered)]
        _assert_same(outs[0], outs[1], step)
        grad = torch.randn(outs[0].shape, generator=gen).to(device)
        for out in outs:
            out.backward(grad)
        if step == 17:  # a checkpoint mid-training (dirty rows written back through records), training goes on
            _assert_same_state(resident, tiered)
    _assert_same_state(resident, tiered)
    stats = tiered.table_stats()
    assert stats["a"].cache_misses + stats["a"].cache_staged > stats["a"].cache_slots
    assert stats["a"].cache_write_backs > 0 and stats["a"].evictions > 0
    if staged:
        assert all(s.cache_staged > 0 for s in stats.values())
    movers = tiered._tables._movers
    buffers = sum(mover.buffer_bytes() for mover in movers) + movers[0].copies.buffer_bytes()
    assert buffers > 0  # the transfer buffers, counted in storage_bytes
    if device.type == "cuda":  # (each table's write-backs' buffer; with the device maps, their packed reads')
        made = [m._transfer._records for m in movers if m._transfer is not None] + [movers[0].copies.packed._records]
        assert all(records is None or records.is_pinned() for records in made) and made[0] is not None


def test_a_device_cache_round_trips_its_state_dict(tmp_path, through_records):
    device = through_records
    tiered = _make(_bag_configs(_backing("file", tmp_path), 0.3), device)
    for kjt in _batches(12, seed=6, device=device):
        tiered(kjt).values().sum().backward()
    state = {k: v.clone() for k, v in tiered.state_dict().items()}
    # Into an all-resident module and a fresh tiered one (the load fills the backing store).
    resident = _make(_bag_configs(), device)
    resident.load_state_dict(state)
    (tmp_path / "b").mkdir()
    reloaded = _make(_bag_configs(_backing("file", tmp_path / "b"), 0.3), device)
    reloaded.load_state_dict(state)
    _assert_same_state(resident, reloaded)
    # And they train on alike from there.
    for kjt in _batches(8, seed=7, device=device):
        outs = [m(kjt).values() for m in (tiered, resident, reloaded)]
        _assert_same(outs[0], outs[1], "tiered vs resident")
        _assert_same(outs[0], outs[2], "tiered vs reloaded")
        for out in outs:
            out.sum().backward()
    _assert_same_state(resident, reloaded)  # (the trained module's admission counters list ids in another order)


def test_the_pipeline_prefetches_into_a_device_cache(tmp_path, through_records):
    device = through_records

    def model_on_device(configs):
        torch.manual_seed(0)
        model = _Ranker(_make(configs, device))
        model.mlp.to(device)  # (before the optimizer: Adagrad makes its state at construction)
        return model, torch.optim.Adagrad(model.mlp.parameters(), lr=0.05)

    batches = _dlrm_batches(20)
    model, optimizer = model_on_device(_bag_configs(policies=("lru", "lru")))
    want = []
    for batch in batches:  # the oracle: a plain loop over the all-resident model
        optimizer.zero_grad()
        loss, _ = model(batch.to(device))
        loss.backward()
        optimizer.step()
        want.append(loss.detach().clone())
    tiered, tiered_opt = model_on_device(_bag_configs(_backing("host", tmp_path), 0.3, policies=("lru", "lru")))
    from torchrec_ext.pipeline import PipelineOptions, TrainPipeline

    options = PipelineOptions(prefetch_threads=0, threaded_input_dist=False, tier_prefetch=True)
    stats = []
    with TrainPipeline(tiered, tiered_opt, device, options) as pipeline:
        losses = progress_losses(pipeline, batches, stats)
    assert len(losses) == len(want)
    for step, (got, expected) in enumerate(zip(losses, want)):
        _assert_same(got, expected, step)
    _assert_same_state(model, tiered)
    assert sum(s["staged"] for step in stats for s in step.values()) > 0


def test_records_buffers_are_bounded_and_reused():
    fields, record_bytes = tier_copies.record_fields([32, 4, 6])
    assert fields == [(8, 32), (40, 4), (48, 6)] and record_bytes == 56  # each field 8-byte aligned
    buffer = tier_copies.RecordsBuffer(record_bytes, pinned=False, max_rows=10)
    first = buffer.take(3)
    assert first.shape == (3, 56) and buffer.nbytes() == 3 * 56
    assert buffer.take(2).data_ptr() == first.data_ptr()  # reused
    buffer.take(5)
    assert buffer.nbytes() == 6 * 56  # doubled
    buffer.take(10)
    assert buffer.nbytes() == 10 * 56  # up to its bound
    with pytest.raises(ValueError, match="11 rows in one transfer, at most 10"):
        buffer.take(11)


def test_a_device_cache_refuses_other_devices(monkeypatch):
    from torchrec_ext import DynamicEmbeddingBagConfig

    cfg = DynamicEmbeddingBagConfig(name="a", embedding_dim=4, num_embeddings=10, feature_names=["a"], backing="host")
    with pytest.raises(ValueError, match="keep their cache on the CPU or a CUDA device, got device xpu"):
        TieredTables([cfg], torch.device("xpu"))


def test_a_tiered_module_moves_to_the_device_and_back(tmp_path, through_records):
    # Built on the CPU, moved (.to: the cache and the index move, the backing store stays on the
    # host), trained there, moved back: as the all-resident module moved alike.
    device = through_records
    resident = _make(_bag_configs(), "cpu")
    tiered = _make(_bag_configs(_backing("file", tmp_path), 0.3), "cpu")
    batches = _batches(24, seed=9, device="cpu")
    for step, kjt in enumerate(batches):
        if step in (8, 16):
            where = device if step == 8 else torch.device("cpu")
            for m in (resident, tiered):
                m.to(where)
            assert tiered._tables.weights.device.type == where.type
            assert all(buf.device.type == "cpu" for buf in tiered._tables.backing.values())
        kjt = kjt.to(resident.device)
        outs = [m(kjt).values() for m in (resident, tiered)]
        _assert_same(outs[0], outs[1], step)
        for out in outs:
            out.square().sum().backward()
    _assert_same_state(resident, tiered)
    assert tiered.table_stats()["a"].cache_write_backs > 0


def test_a_device_cache_with_its_maps_on_the_host_equals_all_resident_tables(tmp_path, through_records, monkeypatch):
    # On CUDA the maps are on the device by default; the host maps (device_maps=False) stay a path.
    if through_records.type == "cpu":
        pytest.skip("the CPU's default maps: the tests above")
    monkeypatch.setattr(TieredTables, "device_maps", False)
    test_a_device_cache_over_host_memory_equals_all_resident_tables(tmp_path, through_records, "host", True)


def test_a_staged_lookup_on_the_device_reads_one_count(device):
    # The stage made the rows hot and freed slots for the new ones: one count read a lookup, for
    # all tables, and as many torch calls for 6 tables as for 2 (on the CPU: test_tiers_device_maps.py).
    from test_tiers_device_maps import _staged_steps

    if device == "cpu":
        pytest.skip("the device maps on the CPU: test_tiers_device_maps.py")
    few, many = _staged_steps(2, None, device=device), _staged_steps(6, None, device=device)
    for _, seen in few + many:
        assert seen["tiered tables: rows without a cache slot"] == 1, seen
        assert not seen["tiered tables: cache misses"] and not seen["tiered tables: rows to read"], seen
    assert [c for c, _ in few] == [c for c, _ in many]


def test_the_stage_reads_its_rows_through_device_sync(device):
    # The stage's read of the next batch's rows is a sync of its side stream on a GPU, counted
    # as the lookup's reads are: one for all tables with the device maps, one a table with the
    # host maps (whose rows are on the host already on the CPU: nothing to read there).
    from test_tiers_device_maps import _staged_steps

    for device_maps, reads in ((True, 1), (False, 0 if device == "cpu" else 3)):
        for _, seen in _staged_steps(3, device_maps, device=device):
            assert seen["tiered tables: rows to stage"] == reads, (device_maps, seen)


def test_the_device_maps_read_every_tables_rows_in_one_copy(device):
    # (on the CPU: test_tiers_device_maps.py) The misses and stages of all tables: one H2D copy.
    from test_tiers_device_maps import test_reading_rows_into_the_caches_is_one_copy_for_all_tables

    if device == "cpu":
        pytest.skip("the device maps on the CPU: test_tiers_device_maps.py")
    test_reading_rows_into_the_caches_is_one_copy_for_all_tables(device)


def test_the_device_maps_write_every_tables_rows_back_in_one_copy(device):
    # (on the CPU: test_tiers_device_maps.py) The write-backs of all tables: one D2H copy, one wait.
    from test_tiers_device_maps import test_writing_rows_back_from_the_caches_is_one_copy_for_all_tables

    if device == "cpu":
        pytest.skip("the device maps on the CPU: test_tiers_device_maps.py")
    test_writing_rows_back_from_the_caches_is_one_copy_for_all_tables(device)


class _FakeCuda:
    """torch.cuda's current device and streams as the stage worker meets them, without a GPU: a
    current device and current streams per thread (device 0 and its default stream at first), and
    a stream context that leaves the current device alone, so that only an explicit device guard
    puts a thread on another device."""

    def __init__(self):
        self.local = threading.local()

    def _index(self, device) -> int:
        return device if isinstance(device, int) else torch.device(device).index

    def current_device(self) -> int:
        return getattr(self.local, "device", 0)

    def current_stream(self, device=None):
        streams = self.local.__dict__.setdefault("streams", {})
        index = self.current_device() if device is None else self._index(device)
        return streams.setdefault(index, _FakeStream(index, "default"))

    @contextlib.contextmanager
    def device(self, device):
        before, self.local.device = self.current_device(), self._index(device)
        try:
            yield
        finally:
            self.local.device = before

    @contextlib.contextmanager
    def stream(self, stream):
        streams = self.local.__dict__.setdefault("streams", {})
        before, streams[stream.index] = streams.get(stream.index), stream
        try:
            yield
        finally:
            streams[stream.index] = before


class _FakeStream:
    def __init__(self, device, name="side"):
        self.index = device if isinstance(device, int) else torch.device(device).index
        self.name, self.waited, self.synchronized = name, [], 0

    def record_event(self):
        return (self.name, self.index)

    def wait_event(self, event) -> None:
        self.waited.append(event)

    def synchronize(self) -> None:
        self.synchronized += 1


def _fake_cuda(monkeypatch) -> _FakeCuda:
    """torch.cuda's device and stream calls answered by a ``_FakeCuda`` (streams: ``_FakeStream``)."""
    fake = _FakeCuda()
    for name in ("current_device", "current_stream", "device", "stream"):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
    monkeypatch.setattr(torch.cuda, "Stream", _FakeStream)
    return fake


def test_the_stage_worker_runs_on_the_modules_device_whatever_the_threads(monkeypatch):
    # A module on cuda:1: its stage's worker thread starts on cuda:0 (every new thread's current
    # device); the worker sets cuda:1 itself around each stage, so the stage's calls that take the
    # current device or stream (the hand-over's wait) are on the side stream of cuda:1.
    fake = _fake_cuda(monkeypatch)
    device = torch.device("cuda", 1)
    stager, handover = tiered_tables._Stager(device), tiered_tables._Handover(1, device)
    seen = []

    def stage():
        handover.take(0)
        seen.append((fake.current_device(), fake.current_stream()))

    handover.release(0, [], 1)
    stager.wait(stager.submit(stage))
    stager.close()
    assert seen == [(1, stager._stream)], seen
    # The side stream waited for the train stream's events (on cuda:1): the submission's, the hand-over's.
    assert stager._stream.waited == [("default", 1), ("default", 1)], stager._stream.waited


def test_a_stage_that_raises_drains_its_side_stream_before_the_train_thread_sees_the_error(monkeypatch):
    # A stage that fails midway (a read of the backing store) has queued work on its side stream
    # (rows read, slots given back): the train thread gets its error and no event to wait for, so
    # the worker drains the side stream first, else the next lookup's kernels would race that work.
    _fake_cuda(monkeypatch)
    stager = tiered_tables._Stager(torch.device("cuda", 0))
    drained = []

    def stage():
        raise OSError("input/output error")

    failed = stager.submit(stage)
    with pytest.raises(OSError, match="input/output error"):
        stager.wait(failed)
    drained.append(stager._stream.synchronized)
    stager.wait(stager.submit(lambda: None))  # (a stage that runs through: drained as before)
    stager.close()
    assert drained + [stager._stream.synchronized] == [1, 2]
