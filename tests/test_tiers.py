"""Tables larger than fast memory (issue 16, first slice, CPU): host or file backing with a cache
of hot rows (torchrec_ext/modules/tiered_tables.py, tier_store.py).

Oracle: the same module all-resident (backing="device", today's tables), fed the same batches.
A tiered table must give the same outputs, rows, optimizer states, eviction scores and counters,
bit for bit, over many steps with cache misses, write-backs, index evictions, TTL, admission,
half-precision rows and optimizers with state.
"""

import copy
import gc
import os

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torchrec import DataType, KeyedJaggedTensor

from dist_helpers import progress_losses
from modules_helpers import random_kjt
from torchrec_ext import DynamicEmbeddingBagCollection, DynamicEmbeddingBagConfig, DynamicEmbeddingCollection
from torchrec_ext.modules import DynamicEmbeddingConfig, tier_store
from torchrec_ext.modules.features import check_and_arrange
from torchrec_ext.modules.tiered_tables import TieredTables

POOL = torch.randint(-(2**62), 2**62, (900,), generator=torch.Generator().manual_seed(3))


def _bag_configs(tier=None, factor=None, policies=("lru", "lfu")):
    extra = {} if tier is None else {"backing": tier, "cache_load_factor": factor}
    return [
        DynamicEmbeddingBagConfig(
            name="a",
            embedding_dim=8,
            num_embeddings=256,
            feature_names=["f0", "f1"],
            eviction_policy=policies[0],
            ttl_steps=6,
            **extra,
        ),
        DynamicEmbeddingBagConfig(
            name="b",
            embedding_dim=6,
            num_embeddings=320,
            feature_names=["f2"],
            eviction_policy=policies[1],
            data_type=DataType.FP16,
            admit_after=2,
            **extra,
        ),
        DynamicEmbeddingBagConfig(
            name="c",
            embedding_dim=4,
            num_embeddings=200,
            feature_names=["f3"],
            admission="bloom",
            admit_after=2,
            data_type=DataType.BF16,
            **extra,
        ),
    ]


def _seq_configs(tier=None, factor=None):
    extra = {} if tier is None else {"backing": tier, "cache_load_factor": factor}
    return [
        DynamicEmbeddingConfig(
            name="s",
            embedding_dim=8,
            num_embeddings=300,
            feature_names=["g0", "g1"],
            eviction_policy="lfu",
            ttl_steps=5,
            **extra,
        ),
        DynamicEmbeddingConfig(
            name="h",
            embedding_dim=8,
            num_embeddings=200,
            feature_names=["g2"],
            data_type=DataType.FP16,
            admission="counter",
            admit_after=2,
            **extra,
        ),
    ]


def _backing(kind, tmp_path):
    return "host" if kind == "host" else f"file:{tmp_path}"


def _bag_pair(kind, tmp_path, optimizer, factor=0.3, weighted=False):
    make = lambda configs: DynamicEmbeddingBagCollection(
        configs, is_weighted=weighted, optimizer=optimizer, optimizer_kwargs={"lr": 0.05}
    )
    return make(_bag_configs()), make(_bag_configs(_backing(kind, tmp_path), factor))


def _train_step(modules, kjt):
    for module in modules:
        module(kjt).values().sum().backward()


def _assert_same_state(resident, tiered):
    a, b = resident.state_dict(), tiered.state_dict()
    assert list(a) == list(b)
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


def _train_staged(resident, tiered, batches, loss=lambda out: out.square().sum()):
    """Trains both on ``batches``, the tiered module staging each next batch before its step;
    asserts equal outputs every step and equal state at the end."""
    for step, batch in enumerate(batches):
        if step + 1 < len(batches):
            tiered.stage_next(batches[step + 1])
        outs = [m(batch).values() for m in (resident, tiered)]
        assert torch.equal(outs[0], outs[1]), step
        for out in outs:
            loss(out).backward()
    _assert_same_state(resident, tiered)


def _assert_same_stats(resident, tiered):
    for (name, a), b in zip(resident.table_stats().items(), tiered.table_stats().values()):
        b = b.as_dict()
        for key, value in a.as_dict().items():
            if not key.startswith("cache_"):
                assert b[key] == value, (name, key)


@pytest.mark.parametrize(
    "kind,optimizer,weighted", [("host", "adam", False), ("file", "adagrad", True), ("file", "rowwise_adagrad", False)]
)
def test_pooled_tiered_tables_equal_all_resident_tables_bit_for_bit(tmp_path, kind, optimizer, weighted):
    resident, tiered = _bag_pair(kind, tmp_path, optimizer, weighted=weighted)
    assert isinstance(tiered._tables, TieredTables)
    gen = torch.Generator().manual_seed(0)
    for step in range(60):
        kjt = random_kjt(
            ["f0", "f1", "f2", "f3"], 6, POOL[torch.randint(0, 700, (400,), generator=gen)], 5, weighted=weighted
        )
        if step % 11 == 5:  # a training forward without backward: new rows initialised by the lookup itself
            with torch.no_grad():
                assert torch.equal(resident(kjt).values(), tiered(kjt).values()), step
        outs = [m(kjt).values() for m in (resident, tiered)]
        assert torch.equal(outs[0], outs[1]), step
        grad = torch.randn(outs[0].shape, generator=gen)
        for out in outs:
            out.backward(grad)
        if step % 20 == 19:  # a checkpoint mid-training (write-back of dirty rows), training goes on
            _assert_same_state(resident, tiered)
    _assert_same_state(resident, tiered)
    _assert_same_stats(resident, tiered)
    stats = tiered.table_stats()["a"]
    assert stats.cache_misses > stats.cache_slots and stats.cache_write_backs > 0 and stats.evictions > 0
    # The cache (and the index) in place of all rows; the tier's own maps and buffers on top
    # (test_tier_memory.py) outweigh the rows it saves at this size (20-byte FP16 rows).
    assert super(TieredTables, tiered._tables).storage_bytes() < resident.storage_bytes()


@pytest.mark.parametrize("kind", ["host", "file"])
def test_sequence_tiered_tables_equal_all_resident_tables_with_eval_lookups(tmp_path, kind):
    make = lambda configs: DynamicEmbeddingCollection(configs, optimizer="adam", optimizer_kwargs={"lr": 0.05})
    resident, tiered = make(_seq_configs()), make(_seq_configs(_backing(kind, tmp_path), 0.25))
    gen = torch.Generator().manual_seed(1)
    for step in range(50):
        kjt = random_kjt(["g0", "g1", "g2"], 5, POOL[torch.randint(0, 500, (300,), generator=gen)], 6)
        for m in (resident, tiered):
            m.train(step % 7 != 3)  # some eval lookups: nothing inserted, misses still brought in
        outs = [m(kjt) for m in (resident, tiered)]
        for name in outs[0]:
            assert torch.equal(outs[0][name].values(), outs[1][name].values()), (step, name)
        if step % 7 != 3:
            for out in outs:
                sum((jt.values() ** 2).sum() for jt in out.values()).backward()
    _assert_same_state(resident, tiered)
    _assert_same_stats(resident, tiered)


def test_an_eval_mode_lookup_whose_backward_runs_writes_its_rows_back(tmp_path):
    # module.eval() with grad enabled: the lookup inserts nothing, but its backward's fused update
    # still writes every row it read, so those slots are dirty (written back when they leave the
    # cache) and held until the update lands, as a training lookup's. Oracle: all resident.
    resident, tiered = _bag_pair("file", tmp_path, "adagrad", factor=0.2)
    gen = torch.Generator().manual_seed(4)
    for step in range(24):
        if step == 8:  # rows trained, then updated by eval-mode steps only
            resident.eval(), tiered.eval()
        kjt = random_kjt(["f0", "f1", "f2", "f3"], 6, POOL[torch.randint(0, 700, (400,), generator=gen)], 5)
        outs = [m(kjt).values() for m in (resident, tiered)]
        assert torch.equal(outs[0], outs[1]), step
        for out in outs:
            out.square().sum().backward()
    _assert_same_state(resident, tiered)
    assert tiered.table_stats()["a"].cache_write_backs > 0


@pytest.mark.parametrize("kind,through_records", [("file", False), ("file", True), ("host", True)])
def test_an_inference_mode_evaluation_before_training_leaves_the_tier_trainable(
    tmp_path, monkeypatch, kind, through_records
):
    # A restored module evaluated under torch.inference_mode first: the tier's movers (views of
    # the cache and the backing store, a file's log) and its transfer buffers are made in that
    # first lookup and kept. Made as inference tensors, every later step outside inference_mode
    # refused to write them ("Inplace update to inference tensor"). Oracle: all resident.
    monkeypatch.setattr(TieredTables, "copy_through_records", through_records)
    make = lambda configs: DynamicEmbeddingBagCollection(configs, optimizer="adagrad")
    resident, tiered = make(_bag_configs()), make(_bag_configs(_backing(kind, tmp_path), 0.3))
    gen = torch.Generator().manual_seed(8)
    batches = [
        random_kjt(["f0", "f1", "f2", "f3"], 6, POOL[torch.randint(0, 700, (400,), generator=gen)], 5)
        for _ in range(16)
    ]
    for kjt in batches[:8]:
        _train_step([resident], kjt)
    saved = {key: value.clone() for key, value in resident.state_dict().items()}
    for module in (resident, tiered):  # (a loaded admission table orders its entries afresh: both loaded)
        module.load_state_dict(saved)  # the tiered module's rows in its backing store, its cache empty
    resident.eval(), tiered.eval()
    with torch.inference_mode():
        for kjt in batches[8:11]:  # misses read, dirty-free victims: the buffers made here
            outs = [m(kjt).values() for m in (resident, tiered)]
            assert torch.equal(outs[0], outs[1])
    resident.train(), tiered.train()
    for step, kjt in enumerate(batches[11:]):
        outs = [m(kjt).values() for m in (resident, tiered)]
        assert torch.equal(outs[0], outs[1]), step
        for out in outs:
            out.square().sum().backward()
    _assert_same_state(resident, tiered)


def test_rows_of_batches_in_flight_stay_cached_until_their_update_lands(tmp_path):
    # Batch 1's forward, an eval batch, batch 2's forward, then both backwards (as a pipeline may
    # order them). Batch 1's slots are then the least recently used: batch 2's misses would take
    # them, were they not held until batch 1's update lands.
    configs = lambda tier: [
        DynamicEmbeddingBagConfig(
            name="a",
            embedding_dim=4,
            num_embeddings=256,
            feature_names=["f"],
            **({} if tier is None else {"backing": tier, "cache_load_factor": 60 / 256}),
        )
    ]
    make = lambda tier: DynamicEmbeddingBagCollection(configs(tier), optimizer="adagrad", optimizer_kwargs={"lr": 0.1})
    resident, tiered = make(None), make(f"file:{tmp_path}")
    kjt = lambda ids: KeyedJaggedTensor.from_lengths_sync(["f"], ids, torch.tensor([ids.numel()]))
    for start in range(0, 200, 20):  # ids 0..199 get rows
        _train_step((resident, tiered), kjt(torch.arange(start, start + 20)))
    gen = torch.Generator().manual_seed(2)
    for _ in range(12):
        ids = torch.randperm(200, generator=gen)
        first, looked_at, second = ids[:20], ids[20:50], ids[50:70]
        for m in (resident, tiered):
            pending = m(kjt(first)).values().square().sum()
            with torch.no_grad():
                m.eval()
                m(kjt(looked_at))
                m.train()
            m(kjt(second)).values().square().sum().backward()
            pending.backward()
    _assert_same_state(resident, tiered)
    assert not tiered._tables.caches[0].pinned and not tiered._tables._pinned


def test_a_dropped_graph_releases_its_rows(tmp_path):
    resident, tiered = _bag_pair("host", tmp_path, "adam", factor=0.2)
    gen = torch.Generator().manual_seed(4)
    for step in range(25):
        kjt = random_kjt(["f0", "f1", "f2", "f3"], 4, POOL[torch.randint(0, 700, (400,), generator=gen)], 4)
        outs = [m(kjt).values() for m in (resident, tiered)]
        if step % 3:
            for out in outs:
                out.sum().backward()
        del outs  # the other batches' graphs are dropped without a backward
    gc.collect()
    assert not any(c.pinned for c in tiered._tables.caches) and not tiered._tables._pinned
    _assert_same_state(resident, tiered)


def test_a_cache_too_small_for_a_batch_is_a_clear_error_and_changes_nothing(tmp_path):
    configs = [
        DynamicEmbeddingBagConfig(
            name="a", embedding_dim=4, num_embeddings=100, feature_names=["f"], backing="host", cache_load_factor=0.1
        )
    ]
    module = DynamicEmbeddingBagCollection(configs, optimizer="sgd", optimizer_kwargs={"lr": 0.1})
    module(KeyedJaggedTensor.from_lengths_sync(["f"], torch.arange(10), torch.tensor([10]))).values().sum().backward()
    before = module.state_dict()
    step = module._tables.train_step
    ids = torch.arange(100, 111)
    with pytest.raises(
        ValueError,
        match=r"table 'a': the batch has 11 distinct ids, more than the 10 cache slots .*"
        r"cache_load_factor 0.1 of capacity 100",
    ):
        module(KeyedJaggedTensor.from_lengths_sync(["f"], ids, torch.tensor([11])))
    assert module._tables.train_step == step
    after = module.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    # repeated ids count once: 20 ids, 10 distinct, fit
    module(KeyedJaggedTensor.from_lengths_sync(["f"], torch.arange(10).repeat(2), torch.tensor([20])))


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("cache_load_factor", 0.0, r"cache_load_factor must be a number in \(0, 1\]"),
        ("cache_load_factor", 1.5, r"cache_load_factor must be a number in \(0, 1\]"),
        ("cache_load_factor", True, r"cache_load_factor must be a number in \(0, 1\]"),
        ("backing", "disk", r"backing must be \"device\", \"host\" or \"file:<dir>\", got 'disk'"),
        ("backing", "file:", r"backing must be"),
        ("fallback_rows", 4, r"fallback_rows applies to backing=\"device\" tables for now"),
    ],
)
def test_bad_tier_options_are_clear_errors(field, value, message):
    kwargs = {"backing": "host", field: value}
    with pytest.raises(ValueError, match=message):
        DynamicEmbeddingBagConfig(name="a", embedding_dim=4, num_embeddings=10, feature_names=["f"], **kwargs)


def test_cache_load_factor_without_a_backing_is_refused():
    with pytest.raises(ValueError, match="cache_load_factor applies to backing"):
        DynamicEmbeddingBagConfig(name="a", embedding_dim=4, num_embeddings=10, cache_load_factor=0.5)


def test_bad_backings_are_clear_errors(tmp_path, monkeypatch):
    cfg = lambda backing, name="a": DynamicEmbeddingBagConfig(
        name=name, embedding_dim=4, num_embeddings=10, feature_names=[name], backing=backing
    )
    with pytest.raises(ValueError, match="backing directory .*nowhere' does not exist"):
        DynamicEmbeddingBagCollection([cfg(f"file:{tmp_path}/nowhere")])
    monkeypatch.setattr(tier_store.os, "access", lambda path, mode: False)  # as for a non-root user
    with pytest.raises(ValueError, match="is not writable"):
        DynamicEmbeddingBagCollection([cfg(f"file:{tmp_path}")])
    monkeypatch.undo()
    with pytest.raises(ValueError, match="must share one backing"):
        DynamicEmbeddingBagCollection([cfg("host"), cfg("device", "b")])
    # A module to shard is built on the meta device: it holds no rows and opens no file.
    DynamicEmbeddingBagCollection([cfg(f"file:{tmp_path}")], device=torch.device("meta"))
    assert not os.listdir(tmp_path)
    module = DynamicEmbeddingBagCollection([cfg("host")])
    with pytest.raises(ValueError, match="cannot move them to meta"):
        module.to("meta")
    with pytest.raises(ValueError, match="deltas .* are not supported"):
        module.delta_token()
    with pytest.raises(ValueError, match=r"backing_shard must be None or a name of letters.*got '../x'"):
        DynamicEmbeddingBagConfig(name="a", embedding_dim=4, num_embeddings=10, backing="host", backing_shard="../x")


def test_backing_files_name_their_tables_and_are_not_shared(tmp_path, monkeypatch):
    cfg = lambda dim: [
        DynamicEmbeddingBagConfig(
            name="a", embedding_dim=dim, num_embeddings=10, feature_names=["f"], backing=f"file:{tmp_path}"
        )
    ]
    first = DynamicEmbeddingBagCollection(cfg(4), optimizer="adagrad")
    assert sorted(os.listdir(tmp_path)) == ["a.momentum1.rows", "a.weights.rows"]
    with open(tmp_path / "a.weights.rows", "rb") as f:
        assert f.read(8) == tier_store.MAGIC
    with pytest.raises(ValueError, match="in use by another live module"):
        DynamicEmbeddingBagCollection(cfg(4))
    del first
    gc.collect()
    with pytest.raises(ValueError, match=r"holds tables \[\{'name': 'a', 'capacity': 10, 'dim': 4"):
        DynamicEmbeddingBagCollection(cfg(8))  # the file of another table
    monkeypatch.setattr(tier_store, "LAYOUT_VERSION", tier_store.LAYOUT_VERSION + 1)
    with pytest.raises(
        ValueError,
        match=f"has layout version {tier_store.LAYOUT_VERSION - 1}, this build reads "
        f"version {tier_store.LAYOUT_VERSION}",
    ):
        DynamicEmbeddingBagCollection(cfg(4))
    monkeypatch.undo()
    (tmp_path / "a.weights.rows").write_bytes(b"not a table" * 100)
    with pytest.raises(ValueError, match="is not a tiered table's backing file"):
        DynamicEmbeddingBagCollection(cfg(4))

    # a full disk: refused when the file is made (its space is reserved), no file left behind
    def full(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tier_store.os, "posix_fallocate", full)
    with pytest.raises(ValueError, match=r"cannot reserve \d+ bytes for backing file .*No space left on device"):
        DynamicEmbeddingBagCollection(
            [
                DynamicEmbeddingBagConfig(
                    name="z", embedding_dim=4, num_embeddings=10, feature_names=["f"], backing=f"file:{tmp_path}"
                )
            ]
        )
    assert not (tmp_path / "z.weights.rows").exists()
    monkeypatch.undo()
    # A rank's share of a sharded table (backing_shard, set by the sharders): files named by it,
    # and a file of another shard is refused.
    shard = lambda name: [
        DynamicEmbeddingBagConfig(
            name="s",
            embedding_dim=4,
            num_embeddings=10,
            feature_names=["f"],
            backing=f"file:{tmp_path}",
            backing_shard=name,
        )
    ]
    DynamicEmbeddingBagCollection(shard("rank1-of-2"))
    gc.collect()
    assert (tmp_path / "rank1-of-2.s.weights.rows").exists()
    os.rename(tmp_path / "rank1-of-2.s.weights.rows", tmp_path / "rank0-of-2.s.weights.rows")
    with pytest.raises(ValueError, match=r"holds shard 'rank1-of-2', not this module's 'rank0-of-2'"):
        DynamicEmbeddingBagCollection(shard("rank0-of-2"))


def test_checkpoints_round_trip_between_tiered_and_resident_and_a_reopened_file(tmp_path):
    resident, tiered = _bag_pair("file", tmp_path, "adam")
    gen = torch.Generator().manual_seed(5)
    batches = [
        random_kjt(["f0", "f1", "f2", "f3"], 6, POOL[torch.randint(0, 700, (400,), generator=gen)], 5)
        for _ in range(30)
    ]
    for kjt in batches[:20]:
        _train_step((resident, tiered), kjt)
    _assert_same_state(resident, tiered)
    saved = tiered.state_dict()
    del tiered
    gc.collect()
    make = lambda configs: DynamicEmbeddingBagCollection(configs, optimizer="adam", optimizer_kwargs={"lr": 0.05})
    # The oracle: a resident module loaded from the checkpoint (a loaded admission table orders its
    # entries afresh, so it is compared with a module loaded the same way).
    loaded = make(_bag_configs())
    loaded.load_state_dict(saved)
    # reopened from its directory with the checkpoint
    reopened = make(_bag_configs(f"file:{tmp_path}", 0.3))
    reopened.load_state_dict(saved)
    # a resident checkpoint into a host-backed module: the backing store filled, the cache empty
    host = make(_bag_configs("host", 0.2))
    host.load_state_dict(resident.state_dict())
    assert all(int((c.row_of >= 0).sum()) == 0 for c in host._tables.caches)
    for kjt in batches[20:]:
        outs = [m(kjt).values() for m in (loaded, reopened, host)]
        assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
        for out in outs:
            out.sum().backward()
    _assert_same_state(loaded, reopened)
    _assert_same_state(loaded, host)


def test_prefetch_brings_a_batch_in_and_changes_no_result(tmp_path):
    resident, tiered = _bag_pair("file", tmp_path, "adagrad", factor=0.5)
    tables = tiered._tables
    gen = torch.Generator().manual_seed(6)
    for step in range(25):
        kjt = random_kjt(["f0", "f1", "f2", "f3"], 6, POOL[torch.randint(0, 400, (300,), generator=gen)], 5)
        batch = check_and_arrange(kjt, tiered._plan, False, "test", tiered.device)
        tables.prefetch(batch.ids, batch.segment_offsets)  # what a pipeline would run ahead
        bounds = batch.segment_offsets.tolist()
        unknown = 0  # distinct ids holding no live row yet: the only ones the lookup may miss
        for t, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
            keys = batch.ids[s:e].unique()
            rows, found = tables.indexes[t].find(keys)
            unknown += int((tables._mask_expired(t, rows, found) < 0).sum())
        misses = sum(c.misses for c in tables.caches)
        outs = [m(kjt).values() for m in (resident, tiered)]
        assert torch.equal(outs[0], outs[1]), step
        assert sum(c.misses for c in tables.caches) - misses <= unknown
        for out in outs:
            out.sum().backward()
    _assert_same_state(resident, tiered)


def test_table_stats_count_the_tier_traffic():
    configs = [
        DynamicEmbeddingBagConfig(
            name="a", embedding_dim=4, num_embeddings=64, feature_names=["f"], backing="host", cache_load_factor=0.25
        )
    ]
    module = DynamicEmbeddingBagCollection(configs, optimizer="adagrad")
    kjt = lambda ids: KeyedJaggedTensor.from_lengths_sync(["f"], torch.tensor(ids), torch.tensor([len(ids)]))
    row_bytes = 4 * 4 + 4 * 4  # a float32 vector of 4, an Adagrad state of 4
    module(kjt(list(range(16)))).values().sum().backward()  # 16 new rows fill the 16 slots: no miss, no read
    module(kjt(list(range(8)))).values().sum().backward()  # 8 hits
    module(kjt(list(range(16, 24)))).values().sum().backward()  # 8 new rows evict ids 8..15: 8 written back
    module(kjt(list(range(8, 16)))).values().sum().backward()  # 8 misses read; ids 0..7 written back
    s = module.table_stats()["a"]
    assert (s.cache_slots, s.cache_hits, s.cache_misses, s.cache_write_backs) == (16, 8, 8, 16)
    assert s.cache_bytes_moved == (8 + 16) * row_bytes and s.cache_hit_rate == 0.5
    module.state_dict()  # writes back the 16 dirty rows still cached
    s = module.table_stats()["a"]
    assert s.cache_write_backs == 32 and s.cache_bytes_moved == (8 + 32) * row_bytes


def test_a_copy_of_a_file_backed_module_is_independent(tmp_path):
    resident, tiered = _bag_pair("file", tmp_path, "adam")
    kjt = random_kjt(["f0", "f1", "f2", "f3"], 6, POOL[:200], 5)
    _train_step((resident, tiered), kjt)
    twin = copy.deepcopy(tiered)
    assert twin._tables.store._files == {}
    _train_step((resident, tiered, twin), kjt)
    _assert_same_state(resident, tiered)
    _assert_same_state(resident, twin)


def test_reset_parameters_empties_the_cache_as_the_tables(tmp_path):
    resident, tiered = _bag_pair("file", tmp_path, "adagrad")
    batches = [random_kjt(["f0", "f1", "f2", "f3"], 6, POOL[i * 100 : (i + 3) * 100], 5) for i in range(6)]
    for i, kjt in enumerate(batches):
        if i == 3:
            for m in (resident, tiered):
                m.reset_parameters()
            assert not any(bool((c.row_of >= 0).any()) for c in tiered._tables.caches)
        _train_step((resident, tiered), kjt)
    _assert_same_state(resident, tiered)


# ---------------------------------------------------------------- staging the next batch (prefetch)


def _run_inline(monkeypatch):
    """Stages run on the train thread at the end of the lookup that starts them: before that
    batch's update lands, an order a worker thread may also take."""
    from concurrent.futures import Future

    from torchrec_ext.modules import tiered_tables

    pending = []

    def submit(self, stage):
        future = Future()
        pending.append((future, stage))
        return future

    original = tiered_tables.TieredTables.lookup

    def lookup(self, *args, **kwargs):
        try:
            return original(self, *args, **kwargs)
        finally:
            while pending:
                future, stage = pending.pop()
                future.set_result(stage())

    monkeypatch.setattr(tiered_tables._Stager, "_submit", submit)
    monkeypatch.setattr(tiered_tables.TieredTables, "lookup", lookup)


@pytest.mark.parametrize("kind,stager", [("file", "thread"), ("host", "inline"), ("file", "inline")])
def test_staged_tiered_tables_equal_unstaged_and_all_resident_tables(tmp_path, monkeypatch, kind, stager):
    # Eviction, admission (counter and bloom), TTL, half-precision rows; consecutive batches share
    # ids (batch i's update writes rows batch i+1 reads), sometimes all of them.
    if stager == "inline":
        _run_inline(monkeypatch)
    make = lambda configs: DynamicEmbeddingBagCollection(configs, optimizer="adagrad", optimizer_kwargs={"lr": 0.05})
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    resident = make(_bag_configs())
    unstaged = make(_bag_configs(_backing(kind, tmp_path / "a"), 0.3))
    staged = make(_bag_configs(_backing(kind, tmp_path / "b"), 0.3))
    gen = torch.Generator().manual_seed(7)
    batches = []
    for step in range(70):
        if step % 13 == 6:
            batches.append(batches[-1])  # the same ids twice in a row
        else:
            batches.append(
                random_kjt(["f0", "f1", "f2", "f3"], 6, POOL[torch.randint(0, 700, (400,), generator=gen)], 5)
            )
    per_step = []
    for step, kjt in enumerate(batches):
        if step + 1 < len(batches):
            assert staged.stage_next(batches[step + 1])
        outs = [m(kjt).values() for m in (resident, unstaged, staged)]
        assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2]), step
        grad = torch.randn(outs[0].shape, generator=gen)
        for out in outs:
            out.backward(grad)
        per_step.append(staged.tier_step_stats())
        if step % 25 == 24:  # a checkpoint mid-training (joins the stage in flight), training goes on
            _assert_same_state(resident, staged)
    _assert_same_state(resident, unstaged)
    _assert_same_state(resident, staged)
    _assert_same_stats(resident, staged)
    assert not resident.stage_next(batches[0])  # all-resident tables: nothing to stage
    a, b = unstaged.table_stats(), staged.table_stats()
    for name in a:
        assert b[name].cache_staged > 0 and b[name].cache_staged_write_backs > 0, name
        # rows the stage read are found at step time: misses left are rows the stage had no slot for
        assert b[name].cache_misses < a[name].cache_misses / 4, (name, b[name].cache_misses, a[name].cache_misses)
    assert sum(s["staged"] for step in per_step[1:] for s in step.values()) == sum(s.cache_staged for s in b.values())
    assert all(
        set(s) == {"hits", "misses", "staged", "write_backs", "staged_write_backs", "bytes_moved"}
        for step in per_step
        for s in step.values()
    )


def test_a_stage_never_takes_the_slots_of_the_batch_in_flight(tmp_path, monkeypatch):
    # The cache holds 1.5 batches' rows: the stage of batch i+1 must fill and free slots around
    # batch i's, whose update has not landed when the (inline) stage runs.
    _run_inline(monkeypatch)
    configs = lambda tier: [
        DynamicEmbeddingBagConfig(
            name="a",
            embedding_dim=4,
            num_embeddings=256,
            feature_names=["f"],
            **({} if tier is None else {"backing": tier, "cache_load_factor": 30 / 256}),
        )
    ]
    make = lambda tier: DynamicEmbeddingBagCollection(configs(tier), optimizer="adam", optimizer_kwargs={"lr": 0.1})
    resident, tiered = make(None), make(f"file:{tmp_path}")
    kjt = lambda ids: KeyedJaggedTensor.from_lengths_sync(["f"], ids, torch.tensor([ids.numel()]))
    gen = torch.Generator().manual_seed(8)
    batches = [kjt(torch.randperm(150, generator=gen)[:20]) for _ in range(40)]
    _train_staged(resident, tiered, batches)
    assert tiered.table_stats()["a"].cache_staged > 0


class _Ranker(torch.nn.Module):
    """A model the pipeline drives: pooled embeddings and dense features -> a logit; (loss, logits)."""

    def __init__(self, ebc):
        super().__init__()
        self.ebc = ebc
        self.mlp = torch.nn.Sequential(torch.nn.Linear(3 + 8 + 8 + 6 + 4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))

    def forward(self, batch):
        pooled = self.ebc(batch.sparse_features).values()
        logits = self.mlp(torch.cat([batch.dense_features, pooled], dim=1)).squeeze(1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
        return loss, (loss, logits)  # TorchRec pipelines return the second item


def _dlrm(ebc):
    torch.manual_seed(0)
    model = _Ranker(ebc)
    return model, torch.optim.Adagrad(model.mlp.parameters(), lr=0.05)


def _dlrm_batches(n, seed=9):
    from torchrec.datasets.utils import Batch

    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        kjt = random_kjt(["f0", "f1", "f2", "f3"], 8, POOL[torch.randint(0, 700, (500,), generator=gen)], 5)
        out.append(
            Batch(
                dense_features=torch.randn(8, 3, generator=gen),
                sparse_features=kjt,
                labels=torch.randint(0, 2, (8,), generator=gen).float(),
            )
        )
    return out


def _pipeline_losses(model, optimizer, batches, tier_prefetch):
    from torchrec_ext.pipeline import PipelineOptions, TrainPipeline

    options = PipelineOptions(prefetch_threads=0, threaded_input_dist=False, tier_prefetch=tier_prefetch)
    stats = []
    with TrainPipeline(model, optimizer, torch.device("cpu"), options) as pipeline:
        losses = progress_losses(pipeline, batches, stats)
    return losses, stats


@pytest.mark.parametrize("kind", ["file", "host"])
def test_train_pipeline_stages_tiered_tables_and_equals_the_plain_loop_on_resident_tables(tmp_path, kind):
    make = lambda configs: DynamicEmbeddingBagCollection(configs, optimizer="adagrad", optimizer_kwargs={"lr": 0.05})
    batches = _dlrm_batches(40)
    model, optimizer = _dlrm(make(_bag_configs(policies=("lru", "lru"))))
    want = []
    for batch in batches:  # the oracle: a plain loop over the all-resident model
        optimizer.zero_grad()
        loss, _ = model(batch)
        loss.backward()
        optimizer.step()
        want.append(loss.detach().clone())
    results = {}
    for prefetch in (True, False):
        directory = tmp_path / str(prefetch)
        directory.mkdir()
        tiered, tiered_opt = _dlrm(make(_bag_configs(_backing(kind, directory), 0.3, policies=("lru", "lru"))))
        losses, stats = _pipeline_losses(tiered, tiered_opt, batches, prefetch)
        assert len(losses) == len(want)
        for step, (got, expected) in enumerate(zip(losses, want)):
            assert torch.equal(got, expected), (prefetch, step)
        a, b = model.state_dict(), tiered.state_dict()
        assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
        results[prefetch] = stats
    staged = sum(s["staged"] for step in results[True] for s in step.values())
    assert staged > 0 and sum(s["staged"] for step in results[False] for s in step.values()) == 0
    misses = {p: sum(s["misses"] for step in results[p][1:] for s in step.values()) for p in results}
    assert misses[True] < misses[False] / 4, misses


@pytest.mark.parametrize("stager", ["inline", "thread"])
def test_stages_while_the_cache_fills_up_and_overflows(tmp_path, monkeypatch, stager):
    # Mostly new ids each batch: the first stages find free slots (some left free for the next
    # batch's new rows), later ones write back and free the least recently used.
    if stager == "inline":
        _run_inline(monkeypatch)
    configs = lambda tier: [
        DynamicEmbeddingBagConfig(
            name="a",
            embedding_dim=4,
            num_embeddings=512,
            feature_names=["f"],
            **({} if tier is None else {"backing": tier, "cache_load_factor": 0.125}),
        )
    ]
    make = lambda tier: DynamicEmbeddingBagCollection(configs(tier), optimizer="adagrad", optimizer_kwargs={"lr": 0.1})
    resident, tiered = make(None), make(f"file:{tmp_path}")
    kjt = lambda ids: KeyedJaggedTensor.from_lengths_sync(["f"], ids, torch.tensor([ids.numel()]))
    gen = torch.Generator().manual_seed(10)
    # 24 ids a batch: 6 of a hot set, 18 from a wide range (new the first time they come)
    batches = [
        kjt(torch.cat([torch.randperm(10, generator=gen)[:6], 10 + torch.randperm(2000, generator=gen)[:18]]))
        for _ in range(30)
    ]
    _train_staged(resident, tiered, batches)
    stats = tiered.table_stats()["a"]
    assert stats.cache_staged > 0 and stats.cache_staged_write_backs > 0 and stats.cache_misses == 0


@pytest.mark.parametrize("kind,stager", [("host", "inline"), ("file", "thread")])
def test_staged_tables_equal_resident_tables_on_heavy_tailed_ids(tmp_path, monkeypatch, kind, stager):
    # dlrm-small ids (Zipf 1.05): most of each batch's ids are new, the cache fills in a few
    # steps and then every stage writes back and frees slots for the next batch's new rows.
    from torchrec_ext.data import dlrm_small_batch

    if stager == "inline":
        _run_inline(monkeypatch)
    make = lambda extra: DynamicEmbeddingBagCollection(
        [
            DynamicEmbeddingBagConfig(
                name=f"t{t}", embedding_dim=8, num_embeddings=2048, feature_names=[f"f{t}"], **extra
            )
            for t in range(2)
        ],
        optimizer="adagrad",
        optimizer_kwargs={"lr": 0.05},
    )
    resident, staged = make({}), make({"backing": _backing(kind, tmp_path), "cache_load_factor": 0.2})
    batches = [dlrm_small_batch(step, num_tables=2, batch_size=64) for step in range(31)]
    _train_staged(resident, staged, batches, loss=torch.sum)
    stats = staged.table_stats()["t0"]
    assert stats.cache_staged_write_backs > 0 and stats.cache_misses == 0


def test_stages_around_eval_lookups_checkpoints_loads_and_resets_of_sequence_tables(tmp_path):
    # A stage is pending or in flight when the next entry comes: an eval lookup, a state_dict, a
    # load, a reset. Each waits for it; the results are the resident module's.
    make = lambda configs: DynamicEmbeddingCollection(configs, optimizer="adam", optimizer_kwargs={"lr": 0.05})
    resident, staged = make(_seq_configs()), make(_seq_configs(f"file:{tmp_path}", 0.25))
    gen = torch.Generator().manual_seed(11)
    batches = [
        random_kjt(["g0", "g1", "g2"], 5, POOL[torch.randint(0, 500, (300,), generator=gen)], 6) for _ in range(45)
    ]
    saved = None
    for step, kjt in enumerate(batches[:-1]):
        if step == 30:
            saved = staged.state_dict()  # while the stage of batch 30 may still run
        if step == 36:
            for m in (resident, staged):
                m.load_state_dict(saved)
        if step == 40:
            for m in (resident, staged):
                m.reset_parameters()
        staged.stage_next(batches[step + 1])
        for m in (resident, staged):
            m.train(step % 7 != 3)  # eval lookups start stages too
        outs = [m(kjt) for m in (resident, staged)]
        for name in outs[0]:
            assert torch.equal(outs[0][name].values(), outs[1][name].values()), (step, name)
        if step % 7 != 3:
            for out in outs:
                sum((jt.values() ** 2).sum() for jt in out.values()).backward()
    _assert_same_state(resident, staged)
    assert staged.table_stats()["s"].cache_staged > 0


class _CountTorchCalls(TorchFunctionMode):
    """Torch calls that dispatch (a tensor's metadata reads left out: they keep the GIL)."""

    METADATA = {"numel", "dim", "__get__", "size", "element_size", "is_contiguous", "__len__"}

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += getattr(func, "__name__", "") not in self.METADATA
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("maps", ["host", "device"])
def test_a_staged_lookup_hands_each_table_over_once_its_own_upsert_is_done(tmp_path, monkeypatch, maps):
    # With the host maps and a stage waiting, the lookup upserts table by table and hands each
    # over at once, so that the stage overlaps the rest of the lookup; without a stage, or with
    # the device maps (whose stage takes every table at once), all tables upsert in one call.
    from torchrec_ext.modules import tiered_tables

    monkeypatch.setattr(TieredTables, "device_maps", maps == "device")
    resident, tiered = _bag_pair("file", tmp_path, "adagrad")
    events = []
    for name in ("_rows_for", "_rows_for_tables"):
        real = getattr(TieredTables, name)
        monkeypatch.setattr(
            TieredTables, name, lambda self, *a, _real=real, _name=name: events.append(_name) or _real(self, *a)
        )
    release = tiered_tables._Handover.release
    monkeypatch.setattr(
        tiered_tables._Handover, "release", lambda self, t, *a: events.append(f"release {t}") or release(self, t, *a)
    )
    gen = torch.Generator().manual_seed(8)
    batches = [
        random_kjt(["f0", "f1", "f2", "f3"], 6, POOL[torch.randint(0, 700, (400,), generator=gen)], 5) for _ in range(4)
    ]
    _train_step([resident, tiered], batches[0])  # no stage
    assert events == ["_rows_for_tables"]
    events.clear()
    tiered.stage_next(batches[2])
    outs = [m(batches[1]).values() for m in (resident, tiered)]
    assert torch.equal(outs[0], outs[1])
    if maps == "host":
        assert events == ["_rows_for", "release 0", "_rows_for", "release 1", "_rows_for", "release 2"]
    else:
        assert events[0] == "_rows_for_tables" and "_rows_for" not in events
    for out in outs:
        out.sum().backward()
    _train_staged(resident, tiered, batches[2:])


def test_a_stage_makes_few_torch_calls_per_table(tmp_path, monkeypatch):
    # The stage runs on a worker thread beside the train step: each torch call lets the GIL go and
    # waits to take it back, so its wall time follows its number of calls (tier_stage_calls.md).
    _run_inline(monkeypatch)
    from torchrec_ext.modules import tiered_tables

    module = DynamicEmbeddingBagCollection(
        _bag_configs(_backing("file", tmp_path), 0.3), optimizer="adagrad", optimizer_kwargs={"lr": 0.05}
    )
    gen = torch.Generator().manual_seed(5)
    batches = [random_kjt(["f0", "f1", "f2", "f3"], 6, POOL[torch.randint(0, 700, (400,), generator=gen)], 5)]
    for _ in range(12):
        batches.append(random_kjt(["f0", "f1", "f2", "f3"], 6, POOL[torch.randint(0, 700, (400,), generator=gen)], 5))
        module.stage_next(batches[-1])
        module(batches[-2]).values().sum().backward()
    stage, counted = tiered_tables.TieredTables._stage, []

    def counting_stage(self, *args):
        with _CountTorchCalls() as count:
            stage(self, *args)
        counted.append(count.calls)

    monkeypatch.setattr(tiered_tables.TieredTables, "_stage", counting_stage)
    module.stage_next(batches[0])
    module(batches[-1]).values().sum().backward()
    stats = module.tier_step_stats()
    assert sum(s["staged_write_backs"] for s in stats.values()) > 0  # the stage wrote back and read rows
    assert len(counted) == 1 and counted[0] <= 55 * 3, counted  # (143 here; 187 before the stage's calls were cut)


def test_an_optimizer_changed_while_a_stage_runs_waits_for_it_and_trains_as_resident_tables(tmp_path):
    # A new optimizer kind folds the logs and remaps the state files: the stage in flight, reading
    # them, is joined first (else its reads could meet a file closed, or another in its place).
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    make = lambda configs: DynamicEmbeddingBagCollection(configs, optimizer="adagrad", optimizer_kwargs={"lr": 0.05})
    resident, staged = make(_bag_configs()), make(_bag_configs(f"file:{tmp_path}", 0.3))
    gen = torch.Generator().manual_seed(11)
    batches = [
        random_kjt(["f0", "f1", "f2", "f3"], 6, POOL[torch.randint(0, 700, (400,), generator=gen)], 5) for _ in range(8)
    ]
    for step, kjt in enumerate(batches):
        if step == 4:
            assert staged._tables._staging is not None  # (staged at step 3)
            for module in (resident, staged):
                apply_optimizer_in_backward(torch.optim.Adam, module.parameters(), {"lr": 0.02})
        if step + 1 < len(batches):
            staged.stage_next(batches[step + 1])
        outs = [m(kjt).values() for m in (resident, staged)]
        assert torch.equal(outs[0], outs[1]), step
        grad = torch.randn(outs[0].shape, generator=gen)
        for out in outs:
            out.backward(grad)
    _assert_same_state(resident, staged)
