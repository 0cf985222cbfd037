"""Growing tables (issue 15 item 3, unsharded): ``initial_capacity`` < num_embeddings.

Oracle: the same module preallocated (initial_capacity = num_embeddings) fed the same stream.
Growth moves rows, never values, so every output, and every live id's vector, optimizer state,
score, last-seen step and delta, equal the preallocated module's; eviction begins only at the
maximum capacity; memory (storage_bytes, RSS) follows the current capacity.
"""

import gc
import os

import pytest
import torch
from torchrec import KeyedJaggedTensor
from torchrec.modules.embedding_configs import DataType

from torchrec_ext import (
    DynamicEmbeddingBagCollection,
    DynamicEmbeddingBagConfig,
    DynamicEmbeddingCollection,
    DynamicEmbeddingConfig,
    HashTable,
)
from torchrec_ext.modules import GrowthError, table_storage
from torchrec_ext.reference import ReferenceHashTable
from torchrec_ext.vocabulary import row_map_bytes

NUM_EMBEDDINGS = 2048


def _configs(initial, cls=DynamicEmbeddingBagConfig, **extra):
    """Three tables: float32 with TTL, fp16 with fallback rows and Bloom admission, lfu bf16 of
    another dim with counter admission."""
    kinds = [
        dict(embedding_dim=8, ttl_steps=50),
        dict(embedding_dim=8, data_type=DataType.FP16, fallback_rows=4, admission="bloom", admit_after=2),
        dict(embedding_dim=4, data_type=DataType.BF16, eviction_policy="lfu", admit_after=2),
    ]
    return [
        cls(
            name=f"t{i}",
            num_embeddings=NUM_EMBEDDINGS,
            feature_names=[f"f{i}"],
            initial_capacity=None if initial is None else initial,
            **kind,
            **extra,
        )
        for i, kind in enumerate(kinds)
    ]


def _batch(gen, batch_size=32, spread=1400, tables=3):
    lengths = torch.randint(0, 6, (tables * batch_size,), generator=gen)
    ids = torch.randint(0, spread, (int(lengths.sum()),), generator=gen) * 7919 - 2**40
    return KeyedJaggedTensor.from_lengths_sync([f"f{i}" for i in range(tables)], ids, lengths)


def _by_id(module, container="embedding_bags"):
    """table -> {key: tensor sorted by weight_id} of the module's state_dict."""
    sd, out = module.state_dict(), {}
    for name in {k.split(".")[1] for k in sd if k.startswith(container + ".")}:
        prefix = f"{container}.{name}."
        mine = {k[len(prefix) :]: v for k, v in sd.items() if k.startswith(prefix) and k[len(prefix) :] != "row"}
        order = mine["weight_id"].argsort()
        pending = mine["admission_id"].argsort() if "admission_id" in mine else None
        out[name] = {
            k: v[order]
            if k in ("weight", "weight_id", "metadata", "last_seen") or k.startswith("optimizer.")
            else v[pending]
            if k.startswith("admission_") and pending is not None
            else v
            for k, v in mine.items()
        }
    return out


def _assert_same_tables(got, want):
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].keys() == want[name].keys(), name
        for key in want[name]:
            torch.testing.assert_close(got[name][key], want[name][key], rtol=0, atol=0, msg=f"{name}.{key}")


@pytest.mark.parametrize(
    "optimizer, kwargs, reserved",
    [
        ("adagrad", {}, True),
        ("rowwise_adagrad", {"initial_accumulator_value": 0.1}, True),  # (a nonzero fill)
        ("adam", {}, True),
        ("rowwise_adagrad", {"initial_accumulator_value": 0.1}, False),  # new buffers per growth, as on GPUs
    ],
)
def test_growing_bag_collection_equals_the_preallocated_one(optimizer, kwargs, reserved, monkeypatch):
    if not reserved:  # no address space to reserve: the buffers are copied into new ones at each growth
        monkeypatch.setattr(table_storage, "ReservedBuffer", _no_address_space)
    modules = [
        DynamicEmbeddingBagCollection(_configs(initial), optimizer=optimizer, optimizer_kwargs={"lr": 0.05, **kwargs})
        for initial in (40, None)
    ]
    grown, full = modules
    assert bool(grown._tables._reserved) == reserved
    tokens = [m.delta_token() for m in modules]
    gen = torch.Generator().manual_seed(3)
    capacities = set()
    for step in range(25):
        kjt = _batch(gen, spread=700)  # up to 700 live ids: capacity 1024 of 2048
        outs = []
        for m in modules:
            out = m(kjt).values()
            (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
            outs.append(out.detach())
        torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0, msg=f"step {step}")
        capacities.add(tuple(s.capacity for s in grown.table_stats().values()))
    stats = grown.table_stats()
    assert len(capacities) > 3  # it grew, several times
    assert all(s.max_capacity == NUM_EMBEDDINGS and s.evictions == 0 for s in stats.values())
    assert any(s.capacity < NUM_EMBEDDINGS for s in stats.values())  # storage still below the maximum
    for name, s in full.table_stats().items():  # counters survive growth
        assert {k: v for k, v in s.as_dict().items() if k not in ("capacity", "load_factor")} == {
            k: v for k, v in stats[name].as_dict().items() if k not in ("capacity", "load_factor")
        }
    _assert_same_tables(_by_id(grown), _by_id(full))
    # The rows written since the token follow their rows through the growths.
    deltas = [m.export_delta(since=t, include_optimizer_state=True) for m, t in zip(modules, tokens)]
    for name in deltas[1].tables:
        got, want = deltas[0].tables[name], deltas[1].tables[name]
        og, ow = got.ids.argsort(), want.ids.argsort()
        assert torch.equal(got.ids[og], want.ids[ow]) and got.ids.numel() > 100
        assert torch.equal(got.weights[og], want.weights[ow])
        assert torch.equal(
            got.fallback_slots if got.fallback_slots is not None else torch.zeros(0),
            want.fallback_slots if want.fallback_slots is not None else torch.zeros(0),
        )
        for k in want.optimizer:
            assert torch.equal(got.optimizer[k][og], want.optimizer[k][ow])


def test_growing_sequence_collection_equals_the_preallocated_one():
    def configs(initial):
        return [
            DynamicEmbeddingConfig(
                name=f"t{i}",
                embedding_dim=8,
                num_embeddings=NUM_EMBEDDINGS,
                feature_names=[f"f{i}"],
                initial_capacity=initial,
            )
            for i in range(2)
        ]

    modules = [
        DynamicEmbeddingCollection(configs(initial), optimizer="adagrad", optimizer_kwargs={"lr": 0.1})
        for initial in (33, None)
    ]  # not a whole number of buckets
    gen = torch.Generator().manual_seed(5)
    for step in range(15):
        kjt = _batch(gen, tables=2)
        outs = []
        for m in modules:
            out = m(kjt)
            torch.cat([jt.values() for jt in out.values()]).pow(2).sum().backward()
            outs.append({k: jt.values().detach() for k, jt in out.items()})
        for key in outs[1]:
            torch.testing.assert_close(outs[0][key], outs[1][key], rtol=0, atol=0, msg=f"step {step} {key}")
    assert modules[0].table_stats()["t0"].capacity > 33
    _assert_same_tables(_by_id(modules[0], "embeddings"), _by_id(modules[1], "embeddings"))


def test_eviction_begins_only_at_the_maximum_capacity():
    cfg = DynamicEmbeddingBagConfig(
        name="t", embedding_dim=4, num_embeddings=512, feature_names=["f"], initial_capacity=16, growth_load_factor=0.5
    )
    module = DynamicEmbeddingBagCollection([cfg], optimizer="sgd", optimizer_kwargs={"lr": 0.1})
    gen, seen = torch.Generator().manual_seed(1), []
    for _ in range(40):
        ids = torch.randint(0, 10**6, (40,), generator=gen)
        module(KeyedJaggedTensor.from_lengths_sync(["f"], ids, torch.full((10,), 4))).values().sum().backward()
        s = module.table_stats()["t"]
        seen.append((s.capacity, s.evictions, s.live_rows))
        assert s.live_rows <= s.capacity
    assert [c for c, _, _ in seen] == sorted(c for c, _, _ in seen)  # capacities only double
    assert {c for c, _, _ in seen} >= {128, 256, 512}  # 16 -> 128 for the first 40 ids at once
    first_eviction = next(i for i, (_, e, _) in enumerate(seen) if e)
    assert all(c == 512 for c, _, _ in seen[first_eviction:]) and first_eviction > 0
    assert all(live <= 0.5 * c for c, _, live in seen if c < 512)  # within the load factor until full


def test_storage_bytes_and_rss_follow_the_current_capacity():
    def build(initial):
        cfg = DynamicEmbeddingBagConfig(
            name="t",
            embedding_dim=32,
            num_embeddings=1 << 20,
            feature_names=["f"],
            initial_capacity=initial,
            ttl_steps=100,
        )
        return DynamicEmbeddingBagCollection([cfg], optimizer="adagrad", optimizer_kwargs={"lr": 0.1})

    def rss():
        gc.collect()
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    before = rss()
    grown = build(1 << 14)
    after_small = rss()
    full = build(None)
    after_full = rss()
    maximum = full.storage_bytes()
    assert maximum == full.storage_bytes(maximum=True)
    # A growing table's index also maps its slots to rows (so that a growth moves no row).
    assert grown.storage_bytes(maximum=True) == maximum + row_map_bytes(1 << 20)
    assert grown.storage_bytes() * 50 < maximum  # 1/64 of the rows
    assert after_small - before < 0.1 * maximum < 0.9 * (after_full - after_small)
    # Every growth keeps storage_bytes at the byte model of the current capacity.
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        ids = torch.randint(0, 2**62, (20000,), generator=gen)
        grown(KeyedJaggedTensor.from_lengths_sync(["f"], ids, torch.full((5000,), 4))).values().sum().backward()
        tables = grown._tables
        assert grown.storage_bytes() == tables._bytes_at([m.capacity for m in tables.meta])
    assert grown.table_stats()["t"].capacity == 1 << 17  # 60K live ids within 0.75


def test_growth_rewrites_the_buffers_in_their_reserved_memory_and_reset_returns_it():
    """On CPU a growing module's buffers live in address space reserved for num_embeddings: a
    growth keeps them where they are (only the pages past the old size are new) and a reset
    gives the pages past the initial size back (resident memory follows the capacity)."""
    cfg = DynamicEmbeddingBagConfig(
        name="t", embedding_dim=32, num_embeddings=1 << 20, feature_names=["f"], initial_capacity=1 << 12
    )
    module = DynamicEmbeddingBagCollection([cfg], optimizer="adagrad", optimizer_kwargs={"lr": 0.1})
    tables = module._tables
    where = [b.data_ptr() for b in [tables.weights] + tables.states]
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        ids = torch.randint(0, 2**62, (40000,), generator=gen)
        module(KeyedJaggedTensor.from_lengths_sync(["f"], ids, torch.full((10000,), 4))).values().sum().backward()
    assert module.table_stats()["t"].capacity == 1 << 18
    assert [b.data_ptr() for b in [tables.weights] + tables.states] == where
    grown_rss = _rss()
    module.reset_parameters()
    assert module.table_stats()["t"].capacity == 1 << 12
    assert [b.data_ptr() for b in [tables.weights] + tables.states] == where
    freed = (1 << 18) * 32 * 4 * 2 * 0.9  # vectors and Adagrad state past the initial capacity
    assert grown_rss - _rss() > freed, (grown_rss, _rss())


def test_a_growth_on_cpu_moves_no_row_and_writes_none_of_the_rows_it_adds():
    """On CPU each table's span is laid out for num_embeddings in reserved address space: a growth
    leaves the buffers, the table offsets and every table's rows where they were, and writes none
    of the pages of the rows it adds (they take memory once a row there is written)."""
    configs = [
        DynamicEmbeddingBagConfig(
            name=f"t{i}", embedding_dim=32, num_embeddings=1 << 20, feature_names=[f"f{i}"], initial_capacity=1 << 12
        )
        for i in range(2)
    ]
    module = DynamicEmbeddingBagCollection(configs, optimizer="adagrad", optimizer_kwargs={"lr": 0.1})
    gen = torch.Generator().manual_seed(8)
    kjt = KeyedJaggedTensor.from_lengths_sync(
        ["f0", "f1"], torch.randint(0, 2**62, (4000,), generator=gen), torch.full((1000,), 4)
    )
    module(kjt).values().sum().backward()
    tables, before = module._tables, _by_id(module)
    where = (
        [b.data_ptr() for b in [tables.weights] + tables.states],
        tables.table_offsets.tolist(),
        tables.state_row_offsets.tolist(),
        [tables.table_view(t).data_ptr() for t in range(2)],
    )
    rss = _rss()
    assert tables.grow({0: 1 << 19, 1: 1 << 19}) == [0, 1]
    added = 2 * ((1 << 20) - (1 << 12)) * 32 * 4 * 2  # vectors and Adagrad state of the rows added
    assert _rss() - rss < added / 4, (_rss() - rss, added)  # (the grown indexes are most of it)
    assert [s.capacity for s in module.table_stats().values()] == [1 << 20, 1 << 20]
    assert where == (
        [b.data_ptr() for b in [tables.weights] + tables.states],
        tables.table_offsets.tolist(),
        tables.state_row_offsets.tolist(),
        [tables.table_view(t).data_ptr() for t in range(2)],
    )
    _assert_same_tables(_by_id(module), before)
    module(kjt).values().sum().backward()  # trains on in the grown tables
    assert module.num_live_rows() == 4000


def test_populate_ahead_backs_the_next_doublings_pages_in_the_background_and_changes_no_value():
    """``populate_ahead``: each growth has a background thread fault in the pages of the rows the
    next doubling adds (their values stay zeros)."""
    import time

    cfg = DynamicEmbeddingBagConfig(
        name="t", embedding_dim=64, num_embeddings=1 << 20, feature_names=["f"], initial_capacity=1 << 12
    )
    module = DynamicEmbeddingBagCollection([cfg], optimizer="adagrad", optimizer_kwargs={"lr": 0.1})
    tables = module._tables
    tables.populate_ahead = True
    gen = torch.Generator().manual_seed(6)
    kjt = KeyedJaggedTensor.from_lengths_sync(
        ["f"], torch.randint(0, 2**62, (4000,), generator=gen), torch.full((1000,), 4)
    )
    module(kjt).values().sum().backward()
    before, rss = _by_id(module), _rss()
    assert tables.grow({0: 1 << 17}) == [0] and module.table_stats()["t"].capacity == 1 << 18
    ahead = (1 << 18) * 64 * 4 * 2  # the next doubling's rows: vectors and Adagrad state
    deadline = time.monotonic() + 60
    while _rss() - rss < 0.9 * ahead and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _rss() - rss >= 0.9 * ahead, (_rss() - rss, ahead)
    _assert_same_tables(_by_id(module), before)
    nxt = tables.table_view(0).shape[0]
    assert nxt == 1 << 18
    assert not tables.weights[
        int(tables.table_offsets[0]) + nxt * 64 : int(tables.table_offsets[0]) + 2 * nxt * 64
    ].any()
    module(kjt).values().sum().backward()
    assert module.num_live_rows() == 4000


def test_a_saved_growing_module_holds_its_rows_not_its_reserved_range():
    import io

    cfg = DynamicEmbeddingBagConfig(
        name="t", embedding_dim=32, num_embeddings=1 << 22, feature_names=["f"], initial_capacity=1 << 10
    )
    module = DynamicEmbeddingBagCollection([cfg], optimizer="adagrad", optimizer_kwargs={"lr": 0.1})
    gen = torch.Generator().manual_seed(5)
    kjt = KeyedJaggedTensor.from_lengths_sync(
        ["f"], torch.randint(0, 2**62, (400,), generator=gen), torch.full((100,), 4)
    )
    module(kjt).values().sum().backward()
    buffer = io.BytesIO()
    torch.save(module, buffer)
    assert buffer.tell() < 4 * module.storage_bytes()  # the reserved range is (1 << 22) * 32 * 4 * 2 bytes
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert loaded.embedding_bags["t"].weight.shape == module.embedding_bags["t"].weight.shape
    _assert_same_tables(_by_id(loaded), _by_id(module))
    for m in (module, loaded):
        m(kjt).values().sum().backward()
    _assert_same_tables(_by_id(loaded), _by_id(module))


def test_without_address_space_to_reserve_a_module_grows_by_reallocating():
    """Where num_embeddings' worth of address space cannot be reserved (a limit on it, strict
    overcommit), the buffers are plain ones and growths reallocate them (in a child process, whose
    address space is limited below the reservation)."""
    import subprocess
    import sys

    code = """
import resource, torch
from torchrec import KeyedJaggedTensor
from torchrec_ext import DynamicEmbeddingBagCollection, DynamicEmbeddingBagConfig
resource.setrlimit(resource.RLIMIT_AS, (12 << 30, 12 << 30))  # the reservation: 2^26 x 64 x 4 B = 16 GiB
cfg = DynamicEmbeddingBagConfig(name="t", embedding_dim=64, num_embeddings=1 << 26, feature_names=["f"],
                                initial_capacity=1 << 10)
m = DynamicEmbeddingBagCollection([cfg], optimizer="adagrad", optimizer_kwargs={"lr": 0.1})
assert not m._tables._reserved
gen = torch.Generator().manual_seed(0)
m(KeyedJaggedTensor.from_lengths_sync(["f"], torch.randint(0, 2 ** 62, (8000,), generator=gen),
                                      torch.full((2000,), 4))).values().sum().backward()
assert m.table_stats()["t"].capacity == 1 << 14 and m.num_live_rows() == 8000
print("ok")
"""
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


def _no_address_space(numel_max):
    raise OSError(12, "Cannot allocate memory")


def _rss():
    gc.collect()
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_rows_never_move_while_a_backward_is_pending():
    cfg = DynamicEmbeddingBagConfig(
        name="t", embedding_dim=4, num_embeddings=4096, feature_names=["f"], initial_capacity=32
    )
    module = DynamicEmbeddingBagCollection([cfg], optimizer="sgd", optimizer_kwargs={"lr": 0.1})
    tables = module._tables

    def kjt(lo):
        return KeyedJaggedTensor.from_lengths_sync(["f"], torch.arange(lo, lo + 100), torch.full((25,), 4))

    first = module(kjt(0)).values()  # grows for its 100 ids first, then pends
    capacity, weight = tables.meta[0].capacity, module.embedding_bags["t"].weight
    assert capacity == 256 and tables.pending_backward == 1
    second = module(kjt(1000)).values()  # 200 ids > 0.75 * 256, but a lookup is pending: no growth
    assert tables.meta[0].capacity == capacity and tables.pending_backward == 2
    first.sum().backward()
    assert tables.meta[0].capacity == capacity  # one still pending
    second.sum().backward()  # the last update: the growth put off happens now
    assert tables.meta[0].capacity == 512 and tables.pending_backward == 0
    assert module.embedding_bags["t"].weight is weight and weight.shape[0] == 512  # the same parameter, re-pointed
    # A dropped graph releases its lookup too.
    module(kjt(2000)).values()
    assert tables.pending_backward == 0
    with torch.no_grad():
        module(kjt(3000))
    assert tables.pending_backward == 0
    # The rows equal a preallocated module's after the same calls.
    full = DynamicEmbeddingBagCollection(
        [DynamicEmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=4096, feature_names=["f"])],
        optimizer="sgd",
        optimizer_kwargs={"lr": 0.1},
    )
    a, b = full(kjt(0)).values(), full(kjt(1000)).values()
    a.sum().backward()
    b.sum().backward()
    full(kjt(2000))
    with torch.no_grad():
        full(kjt(3000))
    _assert_same_tables(_by_id(module), _by_id(full))


def test_a_grown_checkpoint_loads_into_fresh_modules():
    grown = DynamicEmbeddingBagCollection(_configs(40), optimizer="adagrad", optimizer_kwargs={"lr": 0.05})
    gen = torch.Generator().manual_seed(9)
    for _ in range(12):
        grown(_batch(gen)).values().sum().backward()
    state = grown.state_dict()
    want = _by_id(grown)
    probe = _batch(gen)
    grown.eval()
    out = grown(probe).values()
    for initial in (40, None, 1024):
        fresh = DynamicEmbeddingBagCollection(_configs(initial), optimizer="adagrad", optimizer_kwargs={"lr": 0.05})
        fresh.load_state_dict(state)
        _assert_same_tables(_by_id(fresh), want)
        caps = {n: s.capacity for n, s in fresh.table_stats().items()}
        if initial == 40:  # grows to the capacity the saving table had: its rows are kept
            assert caps == {n: s.capacity for n, s in grown.table_stats().items()}
            for name in caps:
                assert torch.equal(
                    fresh.state_dict()[f"embedding_bags.{name}.row"], state[f"embedding_bags.{name}.row"]
                )
        fresh.eval()
        torch.testing.assert_close(fresh(probe).values(), out, rtol=0, atol=0)
    # A preallocated table's checkpoint loads into a growing one (which fits its ids).
    full = DynamicEmbeddingBagCollection(_configs(None), optimizer="adagrad", optimizer_kwargs={"lr": 0.05})
    full.load_state_dict(state)
    back = DynamicEmbeddingBagCollection(_configs(40), optimizer="adagrad", optimizer_kwargs={"lr": 0.05})
    back.load_state_dict(full.state_dict())
    _assert_same_tables(_by_id(back), want)
    assert all(s.capacity < NUM_EMBEDDINGS for s in back.table_stats().values())


def test_a_copy_of_a_growing_module_grows_on_its_own():
    import copy

    module = DynamicEmbeddingBagCollection(_configs(40), optimizer="adagrad", optimizer_kwargs={"lr": 0.05})
    gen = torch.Generator().manual_seed(12)
    module(_batch(gen)).values().sum().backward()
    twin = copy.deepcopy(module)
    for buf in [twin._tables.weights] + twin._tables.states:  # not the whole reserved range of the original's
        assert buf.untyped_storage().nbytes() == buf.numel() * 4
    weight = twin.embedding_bags["t0"].weight
    before = weight.shape[0]
    kjt = _batch(gen, spread=10**6)
    for m in (module, twin):
        m(kjt).values().sum().backward()
    assert twin.embedding_bags["t0"].weight is weight and weight.shape[0] > before  # re-pointed at its own storage
    assert weight.data_ptr() != module.embedding_bags["t0"].weight.data_ptr()
    _assert_same_tables(_by_id(twin), _by_id(module))


def test_reset_returns_to_the_initial_capacity():
    module = DynamicEmbeddingBagCollection(_configs(40), optimizer="adagrad", optimizer_kwargs={"lr": 0.05})
    small = module.storage_bytes()
    gen = torch.Generator().manual_seed(2)
    for _ in range(5):
        module(_batch(gen)).values().sum().backward()
    assert module.storage_bytes() > small
    module.reset_parameters()
    assert module.storage_bytes() == small and module.num_live_rows() == 0
    assert all(m.weight.shape[0] == 40 for m in module.embedding_bags.values())


def test_growth_that_cannot_allocate_leaves_the_tables_unchanged_and_usable(monkeypatch):
    module = DynamicEmbeddingBagCollection(_configs(40), optimizer="adagrad", optimizer_kwargs={"lr": 0.05})
    gen = torch.Generator().manual_seed(4)
    module(_batch(gen)).values().sum().backward()
    before, caps = _by_id(module), {n: s.capacity for n, s in module.table_stats().items()}
    tables = module._tables
    step = tables.train_step

    def no_memory(name, numel, value, device, untouched=False):
        raise RuntimeError(f"DefaultCPUAllocator: not enough memory: you tried to allocate {numel * 4} bytes.")

    monkeypatch.setattr(tables, "_allocate_buffer", no_memory)
    with pytest.raises(GrowthError, match=r"tables \['t0'.*needs new storage of \d+ bytes.*unchanged"):
        module(_batch(gen, spread=10**6)).values().sum().backward()
    _assert_same_tables(_by_id(module), before)
    assert {n: s.capacity for n, s in module.table_stats().items()} == caps and tables.train_step == step
    module.eval()
    module(_batch(gen))  # eval lookups need no growth
    module.train()
    monkeypatch.undo()
    module(_batch(gen, spread=10**6)).values().sum().backward()
    assert module.table_stats()["t0"].capacity > caps["t0"]


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("initial_capacity", 0, r"initial_capacity must be an int in \[1, num_embeddings=2048\].*got 0"),
        ("initial_capacity", 4096, r"initial_capacity must be an int in \[1, num_embeddings=2048\].*got 4096"),
        ("initial_capacity", 2.5, r"initial_capacity .*got 2.5"),
        ("growth_load_factor", 0.0, r"growth_load_factor must be a number in \(0, 1\].*got 0.0"),
        ("growth_load_factor", 1.5, r"growth_load_factor must be a number in \(0, 1\].*got 1.5"),
        ("growth_load_factor", "x", r"growth_load_factor .*got 'x'"),
    ],
)
def test_bad_growth_settings_are_refused_by_name(field, value, match):
    with pytest.raises(ValueError, match=match):
        DynamicEmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=2048, **{field: value})
    cfg = DynamicEmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=2048)
    setattr(cfg, field, value)  # changed after the config was built: the module checks again
    with pytest.raises(ValueError, match=match):
        DynamicEmbeddingBagCollection([cfg])


def test_growing_tiered_tables_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"initial_capacity < num_embeddings .*not supported with backing='host'"):
        DynamicEmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=2048, backing="host", initial_capacity=64)
    DynamicEmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=64, backing="host", initial_capacity=64)


def test_hash_table_grown_keeps_keys_and_scores_and_maps_rows():
    gen = torch.Generator().manual_seed(0)
    for capacity, policy in ((100, "lru"), (64, "lfu"), (3000, "epoch_lfu")):
        table = HashTable(capacity, policy=policy)
        ref = ReferenceHashTable(capacity, policy)
        for _ in range(3):
            keys = torch.randint(-(2**63), 2**63 - 1, (capacity // 4,), generator=gen)
            table.find_or_insert(keys)
            ref.upsert(keys.tolist())
        old = table.state_dict()
        twin, row_map = table.grown(2 * capacity)
        new = twin.state_dict()
        assert table.state_dict()["rows"].equal(old["rows"])  # unchanged
        assert (twin.capacity, twin.clock, twin.epoch, twin.size()) == (
            2 * capacity,
            table.clock,
            table.epoch,
            ref.size(),
        )
        o, n = old["keys"].argsort(), new["keys"].argsort()
        assert torch.equal(old["keys"][o], new["keys"][n]) and torch.equal(old["scores"][o], new["scores"][n])
        assert torch.equal(row_map[old["rows"][o]], new["rows"][n])
        assert int((row_map >= 0).sum()) == ref.size()
        assert sorted(new["keys"].tolist()) == sorted(ref.row_of)
    with pytest.raises(ValueError, match="capacity must hold the table's"):
        table.grown(10)


@pytest.mark.parametrize("world", [1, 2])
def test_planner_plans_growing_tables_at_the_maximum_or_initial_capacity(world):
    """Storage of a growing table's shard: by default what a module holding that share reports at
    its maximum (the preallocated share's storage_bytes()); with plan_capacity="initial", what it
    reports when built (its rows at the initial capacity, its admission side table at the maximum)."""
    from torchrec.distributed.planner import Topology

    from test_planner import _enumerate
    from torchrec_ext.distributed.planner import DynamicEmbeddingStorageEstimator, make_planner

    cases = [(1000, 16, 64, None), (4097, 8, 100, 10), (2048, 4, 2048, None)]  # capacity, dim, initial, ttl
    configs = [
        DynamicEmbeddingBagConfig(
            name=f"t{i}",
            embedding_dim=dim,
            num_embeddings=cap,
            feature_names=[f"f{i}"],
            initial_capacity=initial,
            ttl_steps=ttl,
            admit_after=2,
        )
        for i, (cap, dim, initial, ttl) in enumerate(cases)
    ]
    ebc = DynamicEmbeddingBagCollection(
        configs, device=torch.device("meta"), optimizer="adagrad", optimizer_kwargs={"lr": 0.1}
    )
    topology = Topology(world_size=world, compute_device="cpu")
    for plan_capacity in ("maximum", "initial", {"t0": "initial"}):
        estimator = DynamicEmbeddingStorageEstimator(topology, is_inference=True, plan_capacity=plan_capacity)
        for o in _enumerate(ebc, world, estimators=[estimator]):
            cap, dim, initial, ttl = cases[int(o.name[1:])]
            parts = world if o.sharding_type == "row_wise" else 1
            share = DynamicEmbeddingBagCollection(
                [
                    DynamicEmbeddingBagConfig(
                        name="x",
                        embedding_dim=dim,
                        num_embeddings=-(-cap // parts),
                        feature_names=["x"],
                        initial_capacity=-(-initial // parts),
                        ttl_steps=ttl,
                        admit_after=2,
                    )
                ],
                optimizer="adagrad",
                optimizer_kwargs={"lr": 0.1},
            )
            initial_here = plan_capacity == "initial" or (isinstance(plan_capacity, dict) and o.name == "t0")
            want = share.storage_bytes(maximum=not initial_here)
            assert (want == share.storage_bytes()) == (initial_here or initial == cap)
            assert all(s.storage.ddr == want for s in o.shards), (plan_capacity, o.name, o.sharding_type)
    with pytest.raises(ValueError, match=r"plan_capacity must be one of \['maximum', 'initial'\].*got 'minimum'"):
        DynamicEmbeddingStorageEstimator(topology, plan_capacity="minimum")
    with pytest.raises(ValueError, match=r"plan_capacity must be one of .*got \{'t0': 'max'\}"):
        make_planner(topology, batch_size=8, plan_capacity={"t0": "max"})


def test_a_growing_replica_follows_the_deltas_of_a_preallocated_source():
    source = DynamicEmbeddingBagCollection(_configs(None), optimizer="adagrad", optimizer_kwargs={"lr": 0.05})
    replica = DynamicEmbeddingBagCollection(_configs(16), optimizer="adagrad", optimizer_kwargs={"lr": 0.05})
    token = source.delta_token()
    replica.load_state_dict(source.state_dict())
    replica.follow_deltas(token)
    gen = torch.Generator().manual_seed(6)
    for _ in range(4):
        for _ in range(3):
            source(_batch(gen, spread=600)).values().sum().backward()
        delta = source.export_delta(since=token, include_optimizer_state=True, include_scores=True)
        replica.apply_delta(delta)
        token = delta.token
    want = _by_id(source)
    got = _by_id(replica)
    for name in want:  # counters (training step, clocks) are the source's own
        for key in ("weight_id", "weight", "metadata", "optimizer.momentum1"):
            torch.testing.assert_close(got[name][key], want[name][key], rtol=0, atol=0, msg=f"{name}.{key}")
    assert all(16 < s.capacity < NUM_EMBEDDINGS for s in replica.table_stats().values())


def test_tombstones_of_a_growing_source_equal_the_preallocated_ones():
    """Born versions follow their rows through growths: a token taken mid-stream, then growths and
    TTL expiries; tombstones (ids live at the token, gone now) equal the preallocated module's."""

    def configs(initial):
        return [
            DynamicEmbeddingBagConfig(
                name=f"t{i}",
                embedding_dim=4,
                num_embeddings=NUM_EMBEDDINGS,
                feature_names=[f"f{i}"],
                initial_capacity=initial,
                ttl_steps=3,
            )
            for i in range(3)
        ]

    modules = [
        DynamicEmbeddingBagCollection(configs(initial), optimizer="sgd", optimizer_kwargs={"lr": 0.05})
        for initial in (32, None)
    ]
    gen = torch.Generator().manual_seed(8)
    tokens, spread = [None, None], 40
    for step in range(16):
        if step == 4:
            tokens = [m.delta_token() for m in modules]
        kjt = _batch(gen, spread=spread)
        spread += 60  # new ids keep arriving (growths) while older ones expire (tombstones)
        for m in modules:
            m(kjt).values().sum().backward()
    grown, full = (m.export_delta(since=t) for m, t in zip(modules, tokens))
    assert all(s.capacity < NUM_EMBEDDINGS for s in modules[0].table_stats().values())
    total = 0
    for name in full.tables:
        want, got = full.tables[name].tombstones.sort().values, grown.tables[name].tombstones.sort().values
        assert torch.equal(got, want), name
        total += want.numel()
    assert total > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_growth_on_cuda_equals_the_preallocated_module_and_stays_on_the_device():
    device = torch.device("cuda")
    modules = [
        DynamicEmbeddingBagCollection(
            _configs(initial), device=device, optimizer="adagrad", optimizer_kwargs={"lr": 0.05}
        )
        for initial in (40, None)
    ]
    gen = torch.Generator().manual_seed(8)
    for step in range(10):
        kjt = _batch(gen, spread=700).to(device)
        outs = []
        for m in modules:
            out = m(kjt).values()
            out.pow(2).sum().backward()
            outs.append(out.detach())
        torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0, msg=f"step {step}")
    tables = modules[0]._tables
    assert tables.weights.device.type == "cuda" and all(s.device.type == "cuda" for s in tables.states)
    assert all(i.device.type == "cuda" for i in tables.indexes)
    assert all(40 < s.capacity < NUM_EMBEDDINGS for s in modules[0].table_stats().values())
    _assert_same_tables(_by_id(modules[0]), _by_id(modules[1]))
