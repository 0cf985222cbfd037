"""The write-back log of file-backed tiered tables (torchrec_ext/modules/tier_log.py): dirty rows
leaving the cache appended as records, each row read from its newest copy, segments cleaned,
the log folded home at checkpoints, emptied on reopen, and failed appends clear errors that
leave the last checkpoint loadable.

Oracles: a dict of each row's newest bytes (the log alone), and an all-resident module trained
on the same batches (the log under a tiered module), bit for bit.
"""

import gc
import os
import threading

import pytest
import torch

from modules_helpers import random_kjt
from torchrec_ext import DynamicEmbeddingBagCollection, DynamicEmbeddingBagConfig
from torchrec_ext.modules import fuse_embedding_optimizer, tier_log, tier_store

POOL = torch.randint(-(2**62), 2**62, (900,), generator=torch.Generator().manual_seed(13))


def _open_log(tmp_path, capacity, record_bytes):
    store = tier_store.BackingStore(f"file:{tmp_path}", [("t", capacity, 4, torch.float32)], "tables ['t']")
    return store, store.log(0, record_bytes)


def _records(rows, gen, record_bytes):
    data = torch.randint(0, 256, (rows.numel(), record_bytes), dtype=torch.uint8, generator=gen)
    data[:, : tier_log.ROW_BYTES] = rows.view(torch.uint8).view(-1, tier_log.ROW_BYTES)
    return data


def _assert_newest(log, newest, base, capacity):
    rows = torch.arange(capacity)
    where = log.locate(rows)
    for row in range(capacity):
        if row in newest and row not in base:
            assert int(where[row]) >= 0, row
            assert torch.equal(log.read(where[row : row + 1])[0], newest[row]), row
        else:
            assert int(where[row]) == -1, row
    assert log.live == int((where >= 0).sum()) == int(log.segment_live.sum())


def test_reads_after_many_appends_see_each_rows_newest_copy_and_cleaning_bounds_the_log(tmp_path, monkeypatch):
    monkeypatch.setattr(tier_log, "SEGMENT_RECORDS", 4)
    capacity, width = 40, 24
    store, log = _open_log(tmp_path, capacity, width)
    newest, base = {}, {}
    log.home = lambda rows, data: pytest.fail("cleaning kept up: nothing goes home")
    gen = torch.Generator().manual_seed(2)
    for step in range(300):
        rows = torch.randperm(capacity, generator=gen)[: int(torch.randint(1, 12, (1,), generator=gen))]
        data = _records(rows, gen, width)
        log.append(rows, data)
        for row, record in zip(rows.tolist(), data):
            newest[row] = record.clone()
        if step % 50 == 49:  # some rows written home (a checkpoint's flush of dirty rows)
            home = rows[:2]
            log.forget(home)
            for row in home.tolist():
                newest.pop(row)
        _assert_newest(log, newest, base, capacity)
        used = int(log.in_use.sum())
        assert used == log.used
        # dead records never outnumber live ones by more than the append in progress allows
        assert used <= log.max_segments and used * 4 <= 2 * log.live + 3 * 4 + 12, (step, used, log.live)
    assert log.cleaned > 0 and log.segments_cleaned > 0 and log.appended > 300
    store.close()


def _assert_file_holds(log, newest, capacity):
    """The log's file itself (its mapping, read without landing anything) holds each row's
    newest copy."""
    where = log.locate(torch.arange(capacity))
    for row, record in newest.items():
        assert torch.equal(log.records[int(where[row])], record), row


def test_deferred_appends_are_read_as_placed_and_land_where_they_were_placed(tmp_path, monkeypatch):
    # The prefetch stage's write-backs: placed at once, written later (land), or first by a read
    # that names them. Cleaning (4-record segments) moves and frees segments with deferred
    # records in them: a freed segment's dead ones must never land over its next use.
    monkeypatch.setattr(tier_log, "SEGMENT_RECORDS", 4)
    capacity, width = 40, 24
    store, log = _open_log(tmp_path, capacity, width)
    log.home = lambda rows, data: pytest.fail("cleaning kept up: nothing goes home")
    writes = []
    real_pwrite = os.pwrite
    monkeypatch.setattr(
        tier_log.os, "pwrite", lambda fd, data, offset: writes.append(1) or real_pwrite(fd, data, offset)
    )
    newest, held_back = {}, 0
    gen = torch.Generator().manual_seed(21)
    for step in range(400):
        rows = torch.randperm(capacity, generator=gen)[: int(torch.randint(1, 12, (1,), generator=gen))]
        data = _records(rows, gen, width)
        defer = bool(torch.rand(1, generator=gen) < 0.7)
        before = len(writes)
        log.append(rows, data, defer=defer)
        for row, record in zip(rows.tolist(), data):
            newest[row] = record.clone()
        if defer and len(writes) == before:
            assert log.unwritten()
            held_back += 1
        if step % 7 == 6:
            log.land()
            assert not log.unwritten()
            _assert_file_holds(log, newest, capacity)
        if step % 11 == 10:
            _assert_newest(log, newest, {}, capacity)  # (reads land what they name)
    log.land()
    _assert_file_holds(log, newest, capacity)
    assert held_back > 100 and log.segments_cleaned > 0
    store.close()


def test_a_deferred_write_that_fails_keeps_its_records_for_the_next_landing(tmp_path, monkeypatch):
    store, log = _open_log(tmp_path, 40, 16)
    gen = torch.Generator().manual_seed(22)
    rows = torch.tensor([3, 9, 4])
    data = _records(rows, gen, 16)
    expected = data.clone()
    log.append(rows, data, defer=True)

    def full(fd, data, offset):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tier_log.os, "pwrite", full)
    message = r"tables \['t'\]: cannot append 3 rows \(48 bytes\) to backing log '.*': No space left on device"
    with pytest.raises(OSError, match=message):
        log.land()
    assert log.unwritten()
    with pytest.raises(OSError, match=message):  # a read of them lands them first
        log.read(log.locate(rows))
    monkeypatch.undo()
    assert torch.equal(log.read(log.locate(rows)), expected)
    assert not log.unwritten()
    _assert_file_holds(log, dict(zip(rows.tolist(), expected)), 40)
    store.close()


@pytest.mark.parametrize("write_behind", [True, False])
def test_write_behind_hands_each_appended_range_to_the_disk(tmp_path, monkeypatch, write_behind):
    # The kernel is asked to start writing exactly the bytes each append wrote (one range per
    # segment's share), so that the log's dirty pages never pile up; without write-behind, never.
    monkeypatch.setattr(tier_log, "SEGMENT_RECORDS", 4)
    monkeypatch.setattr(tier_log, "WRITE_BEHIND", write_behind)
    written, ranges = [], []
    real_pwrite, real_libc = os.pwrite, tier_log._libc

    class Libc:
        def __getattr__(self, name):
            return getattr(real_libc, name)

        def sync_file_range(self, fd, offset, length, flags):
            ranges.append((offset.value, length.value))
            return real_libc.sync_file_range(fd, offset, length, flags)

    def pwrite(fd, data, offset):
        written.append((offset, len(data)))
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(tier_log, "_libc", Libc())
    monkeypatch.setattr(tier_log.os, "pwrite", pwrite)
    store, log = _open_log(tmp_path, 40, 16)
    gen = torch.Generator().manual_seed(5)
    for n in (3, 6, 1, 9):
        rows = torch.randperm(40, generator=gen)[:n]
        log.append(rows, _records(rows, gen, 16))
    log.settle()
    assert sum(length for _, length in written) == 19 * 16 and len(written) > 4  # (appends cross segments)
    assert ranges == (written if write_behind else [])
    store.close()


def test_write_behind_in_a_forked_child_neither_waits_for_the_parents_requests_nor_uses_its_thread(
    tmp_path, monkeypatch
):
    # A fork's child has none of its parent's threads: its requests go to a thread of its own,
    # and closing a log waits only for them (a parent's request left pending would hang it).
    from concurrent.futures import Future

    monkeypatch.setattr(tier_log, "WRITE_BEHIND", True)
    store, log = _open_log(tmp_path, 40, 16)
    gen = torch.Generator().manual_seed(6)
    rows = torch.arange(5)
    log.append(rows, _records(rows, gen, 16))
    parent_pool = tier_log._behind_pool
    log._behind.append(Future())  # a request the parent's thread would have run: never done in the child
    monkeypatch.setattr(tier_log.os, "getpid", lambda: -7)  # now "in the child"
    log.append(rows, _records(rows, gen, 16))
    assert tier_log._behind_pool[0] == -7 and tier_log._behind_pool[1] is not parent_pool[1]
    assert len(log._behind) == 1
    store.close()  # settles: returns
    monkeypatch.undo()
    tier_log._behind_pool = parent_pool


def test_a_full_log_sends_the_emptiest_segments_rows_home(tmp_path, monkeypatch):
    monkeypatch.setattr(tier_log, "SEGMENT_RECORDS", 4)
    monkeypatch.setattr(tier_log.RowLog, "_dead_outnumber_live", lambda self: False)  # appends outrun cleaning
    monkeypatch.setattr(tier_log.RowLog, "_cleanable", lambda self: False)
    capacity, width = 12, 16
    store, log = _open_log(tmp_path, capacity, width)
    newest, home = {}, {}

    def send_home(rows, data):
        for row, record in zip(rows.tolist(), data):
            assert torch.equal(record, newest[row])  # its newest copy, not an older one
            home[row] = record.clone()

    log.home = send_home
    gen = torch.Generator().manual_seed(3)
    for _ in range(100):
        rows = torch.randperm(capacity, generator=gen)[:5]
        data = _records(rows, gen, width)
        log.append(rows, data)
        for row, record in zip(rows.tolist(), data):
            newest[row] = record.clone()
            home.pop(row, None)
        assert int(log.in_use.sum()) <= log.max_segments
        _assert_newest(log, {r: v for r, v in newest.items() if r not in home}, {}, capacity)
    assert log.sent_home > 0
    store.close()


@pytest.mark.parametrize("defer", [False, True])
def test_cleaning_a_full_logs_segment_into_itself_keeps_every_rows_newest_copy(tmp_path, monkeypatch, defer):
    # Every segment in use, the head full: cleaning's re-append needs a head, and the full log's
    # emptiest segment, sent home for it, is the segment being cleaned. Its records land in that
    # segment (now the head): it stays in use, and nothing it holds is dropped or lost.
    monkeypatch.setattr(tier_log, "SEGMENT_RECORDS", 4)
    capacity, width = 12, 16
    store, log = _open_log(tmp_path, capacity, width)
    newest, home = {}, {}

    def send_home(rows, data):
        for row, record in zip(rows.tolist(), data):
            assert torch.equal(record, newest[row])
            home[row] = record.clone()

    log.home = send_home
    gen = torch.Generator().manual_seed(23)
    with monkeypatch.context() as m:  # appends outrun cleaning until every segment is used
        m.setattr(tier_log.RowLog, "_dead_outnumber_live", lambda self: False)
        m.setattr(tier_log.RowLog, "_cleanable", lambda self: False)
        for segment in range(log.max_segments):  # each segment keeps one live record: row `segment`'s
            rows = torch.tensor([8, 9, 10, segment])  # (row `segment` last: cleaning moves it to the front)
            data = _records(rows, gen, width)
            log.append(rows, data, defer=defer)
            newest.update({row: record.clone() for row, record in zip(rows.tolist(), data)})
    assert log.used == log.max_segments == 8 and log.head_fill == tier_log.SEGMENT_RECORDS
    victim = log._victim()
    assert int(log.segment_live[victim]) == 1
    log._clean(victim, defer)
    assert log.head == victim and bool(log.in_use[victim]) and log.used == int(log.in_use.sum())
    log.land()
    _assert_newest(log, newest, {}, capacity)
    _assert_file_holds(log, newest, capacity)
    assert list(home) == [victim]  # (sent home first by the full log's path)
    store.close()


def _configs(directory=None, capacity=300):
    extra = {} if directory is None else {"backing": f"file:{directory}", "cache_load_factor": 0.2}
    return [
        DynamicEmbeddingBagConfig(
            name="a", embedding_dim=8, num_embeddings=capacity, feature_names=["f0"], eviction_policy="lfu", **extra
        ),
        DynamicEmbeddingBagConfig(name="b", embedding_dim=4, num_embeddings=200, feature_names=["f1"], **extra),
    ]


def _module(configs, optimizer="adagrad"):
    return DynamicEmbeddingBagCollection(configs, optimizer=optimizer, optimizer_kwargs={"lr": 0.05})


def _batches(n, seed=5):
    gen = torch.Generator().manual_seed(seed)
    return [random_kjt(["f0", "f1"], 8, POOL[torch.randint(0, 600, (300,), generator=gen)], 5) for _ in range(n)]


def _assert_same_state(a, b):
    a, b = a.state_dict(), b.state_dict()
    assert list(a) == list(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key


def _train(modules, batches, stage=None):
    for i, kjt in enumerate(batches):
        if stage is not None and i + 1 < len(batches):
            stage.stage_next(batches[i + 1])
        outs = [m(kjt).values() for m in modules]
        for out in outs:
            assert torch.equal(out, outs[0]), i
            out.square().sum().backward()


def test_a_logged_table_equals_the_resident_table_through_cleaning_checkpoints_folds_and_an_optimizer_change(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(tier_log, "SEGMENT_RECORDS", 8)
    resident, tiered = _module(_configs()), _module(_configs(tmp_path))
    batches = _batches(70)
    _train([resident, tiered], batches[:45], stage=tiered)
    logs = tiered._tables.store.logs()
    assert sorted(os.listdir(tmp_path)) == ["a+b.a.log", "a+b.b.log", "a+b.momentum1.rows", "a+b.weights.rows"]
    assert all(log.live > 0 for log in logs.values()) and any(log.segments_cleaned for log in logs.values())
    live = [log.live for log in logs.values()]
    _assert_same_state(resident, tiered)  # a checkpoint reads the logs (the cache's dirty rows appended)
    assert all(log.live >= before for log, before in zip(logs.values(), live))
    _train([resident, tiered], batches[45:52], stage=tiered)
    tiered._tables.flush()  # the rows files then hold every row: the logs folded home
    assert all(log.live == 0 for log in logs.values())
    for t in range(2):
        rows = resident._tables.indexes[t].state_dict()["rows"]
        assert torch.equal(resident._tables.table_view(t)[rows], tiered._tables.table_view(t)[rows])
        for (name, a), b in zip(resident._tables.state_views(t).items(), tiered._tables.state_views(t).values()):
            assert torch.equal(a[rows], b[rows]), name
    _train([resident, tiered], batches[52:60], stage=tiered)
    assert all(log.live > 0 for log in logs.values())
    for module in (resident, tiered):  # the records' layout changes (two states): the logs go home first
        fuse_embedding_optimizer(module, torch.optim.Adam, {"lr": 0.05}, torch.device("cpu"))
    assert all(log.live == 0 for log in logs.values())
    _train([resident, tiered], batches[60:])
    _assert_same_state(resident, tiered)
    assert [log.nbytes() for log in logs.values()] == [tier_log.RowLog.map_bytes(c) for c in (300, 200)]
    records = (
        logs[0].max_segments * tier_log.SEGMENT_RECORDS
    )  # (row -> record, record -> row: 4 bytes each, and per segment)
    assert logs[0].nbytes() == 4 * (300 + records) + 9 * logs[0].max_segments
    (tmp_path / "other").mkdir()
    fresh = _module(_configs(tmp_path / "other"))
    before = fresh._tables.storage_bytes()  # logs not open yet: counted all the same
    fresh._tables._mover(0), fresh._tables._mover(1)
    assert len(fresh._tables.store.logs()) == 2 and fresh._tables.storage_bytes() == before


def test_a_reopened_directory_starts_with_an_empty_log_and_resumes_from_the_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setattr(tier_log, "SEGMENT_RECORDS", 8)
    resident, tiered = _module(_configs()), _module(_configs(tmp_path))
    batches = _batches(40)
    _train([resident, tiered], batches[:20])
    checkpoint = tiered.state_dict()
    _train([tiered], batches[20:30])  # records after the checkpoint: stale once the module is gone
    assert any(log.live for log in tiered._tables.store.logs().values())
    del tiered
    gc.collect()
    logged = os.path.getsize(tmp_path / "a+b.a.log")
    reopened = _module(_configs(tmp_path))
    reopened.load_state_dict(checkpoint)
    loaded = _module(_configs())
    loaded.load_state_dict(checkpoint)
    _train([loaded, reopened], batches[20:], stage=reopened)
    _assert_same_state(loaded, reopened)
    assert os.path.getsize(tmp_path / "a+b.a.log") == logged  # (sized for the table, sparse)


@pytest.mark.parametrize(
    "fault,message",
    [
        ("crash", r"\[Errno 5\] (.*): Input/output error"),  # a record cut short, then the write fails
        ("full", r"\[Errno 28\] (.*): No space left on device"),
    ],
)
def test_a_failed_append_is_a_clear_error_and_the_last_checkpoint_loads(tmp_path, monkeypatch, fault, message):
    monkeypatch.setattr(tier_log, "SEGMENT_RECORDS", 8)
    resident, tiered = _module(_configs()), _module(_configs(tmp_path))
    batches = _batches(40)
    _train([resident, tiered], batches[:15])
    checkpoint = tiered.state_dict()
    real = os.pwrite
    state = {"calls": 0}

    def failing(fd, data, offset):
        state["calls"] += 1
        if fault == "crash" and state["calls"] == 1:
            return real(fd, data[: len(data) // 2 + 3], offset)  # a record cut short
        raise OSError(
            5 if fault == "crash" else 28, "Input/output error" if fault == "crash" else "No space left on device"
        )

    monkeypatch.setattr(tier_log.os, "pwrite", failing)
    with pytest.raises(
        OSError,
        match=message.replace(
            "(.*)",
            rf"tables \['a', 'b'\]: cannot append \d+ rows "
            rf"\(\d+ bytes\) to backing log '{tmp_path}/a\+b\.\w\.log'",
        ),
    ):
        _train([tiered], batches[15:])
    for log in tiered._tables.store.logs().values():  # the record cut short (at the head) is named by no row
        if log.head is not None:
            cut = log.head * tier_log.SEGMENT_RECORDS + log.head_fill
            assert not bool((log.locate(torch.arange(log.capacity)) == cut).any())
    monkeypatch.undo()
    del tiered
    gc.collect()
    reopened = _module(_configs(tmp_path))  # the directory with the cut record
    reopened.load_state_dict(checkpoint)
    loaded = _module(_configs())
    loaded.load_state_dict(checkpoint)
    _train([loaded, reopened], batches[15:])
    _assert_same_state(loaded, reopened)


def test_a_stage_whose_deferred_writes_fail_fails_the_next_lookup_which_then_trains_as_if_given_once(
    tmp_path, monkeypatch
):
    # The stage's write-backs land at the next stage's start, on its worker thread: a disk
    # that refuses them fails that stage, and the lookup joining it raises before it changes
    # anything. Retried once the disk takes writes again, the batch trains as if given once.
    monkeypatch.setattr(tier_log, "SEGMENT_RECORDS", 8)
    resident, tiered = _module(_configs()), _module(_configs(tmp_path))
    batches = _batches(40)
    _train([resident, tiered], batches[:15], stage=tiered)
    real = os.pwrite
    refused = []

    def full_on_the_worker(fd, data, offset):
        if threading.current_thread() is threading.main_thread():
            return real(fd, data, offset)
        refused.append(offset)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tier_log.os, "pwrite", full_on_the_worker)
    failed_at = None
    for i in range(15, 25):
        tiered.stage_next(batches[i + 1])
        try:
            out = tiered(batches[i]).values()
        except OSError as e:
            assert "No space left on device" in str(e) and "backing log" in str(e)
            failed_at = i
            break
        theirs = resident(batches[i]).values()
        assert torch.equal(out, theirs), i
        out.square().sum().backward()
        theirs.square().sum().backward()
    assert failed_at is not None and refused
    assert any(log.unwritten() for log in tiered._tables.store.logs().values())
    monkeypatch.setattr(tier_log.os, "pwrite", real)
    _train([resident, tiered], batches[failed_at:], stage=tiered)  # the failed batch given again
    _assert_same_state(resident, tiered)


def test_a_log_of_other_tables_or_another_layout_version_is_refused(tmp_path, monkeypatch):
    module = _module(_configs(tmp_path))
    _train([module], _batches(3))
    del module
    gc.collect()
    monkeypatch.setattr(tier_store, "LAYOUT_VERSION", tier_store.LAYOUT_VERSION + 1)
    for name in ("a+b.weights.rows", "a+b.momentum1.rows"):  # (the rows files are checked first)
        os.unlink(tmp_path / name)
    module = _module(_configs(tmp_path))
    with pytest.raises(
        ValueError,
        match=rf"'{tmp_path}/a\+b\.a\.log' has layout version "
        rf"{tier_store.LAYOUT_VERSION - 1}, this build reads version "
        rf"{tier_store.LAYOUT_VERSION}",
    ):
        _train([module], _batches(3))


def test_log_files_are_named_by_table_safely(tmp_path):
    configs = [
        DynamicEmbeddingBagConfig(
            name=name,
            embedding_dim=4,
            num_embeddings=50,
            feature_names=[f"f{i}"],
            backing=f"file:{tmp_path}",
            cache_load_factor=0.5,
        )
        for i, name in enumerate(["up/x", "x/y", "x_y"])
    ]
    module = _module(configs)
    for t in range(3):
        module._tables._mover(t)
    logs = sorted(name for name in os.listdir(tmp_path) if name.endswith(".log"))
    assert logs == ["up_x+x_y+x_y.table1.log", "up_x+x_y+x_y.table2.log", "up_x+x_y+x_y.up_x.log"]
