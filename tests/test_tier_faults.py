"""A tiered lookup whose read or write-back of the backing store fails (an OS error) after the
batch's upsert (issue 16 item 6, never silent corruption): the ids it inserted leave the index
again, every id left keeps its own row (a victim whose write-back failed stays cached, dirty),
the caches' maps stay consistent and the module trains on; a stage's failed read likewise.

Calls fail by fault injection (the failing table's mover raises ``EIO``), with the host maps
(``RowCache``, the CPU's default) and the device maps (``DeviceSlotMaps``, run on the CPU), host
and file backing, one upsert for all tables or one a table, and the GPU's records path.

Oracles: the same module all-resident, trained on the same batches but the failed one (the
rows and optimizer state of every id left, bit for bit); the same all-resident module once
more, given the failed batch, for which ids its upsert evicts; and a fresh all-resident module
for the initial rows of ids new to a table.
"""

import copy
import threading

import pytest
import torch
from torchrec import KeyedJaggedTensor

from test_tiers_device_maps import _check_maps
from torchrec_ext import DynamicEmbeddingBagCollection, DynamicEmbeddingBagConfig
from torchrec_ext.modules.tiered_tables import TieredTables

BAGS = 20  # ids a table a batch, one a bag: a bag's output is its id's row


def _configs(backing=None):
    tier = {} if backing is None else {"backing": backing, "cache_load_factor": 0.5}
    return [
        DynamicEmbeddingBagConfig(name="a", embedding_dim=4, num_embeddings=64, feature_names=["f0"], **tier),
        DynamicEmbeddingBagConfig(
            name="b",
            embedding_dim=6,
            num_embeddings=64,
            feature_names=["f1"],
            **(dict(tier, cache_algorithm="lfu") if tier else {}),
        ),
    ]


def _module(backing=None):
    return DynamicEmbeddingBagCollection(_configs(backing), optimizer="adagrad", optimizer_kwargs={"lr": 0.05})


def _kjt(per_table):
    """One bag per id, table a's ids then table b's (as many each)."""
    values = torch.cat([torch.as_tensor(ids, dtype=torch.int64) for ids in per_table])
    return KeyedJaggedTensor.from_lengths_sync(["f0", "f1"], values, torch.ones(values.numel(), dtype=torch.int64))


def _random_batches(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [_kjt([torch.randperm(150, generator=gen)[:BAGS] for _ in range(2)]) for _ in range(n)]


def _rows(module):
    """Per table, id -> (its row, its optimizer state), from the module's state."""
    state = module.state_dict()
    out = []
    for name in ("a", "b"):
        ids = state[f"embedding_bags.{name}.weight_id"].tolist()
        weight, moment = state[f"embedding_bags.{name}.weight"], state[f"embedding_bags.{name}.optimizer.momentum1"]
        out.append({i: (weight[k], moment[k]) for k, i in enumerate(ids)})
    return out


def _check_host_maps(caches):
    """Each table's host maps: every slot holds a row (row -> slot -> row agree, and an entry of
    the LRU order at its clock) or is empty and in the free list."""
    for cache in caches:
        held = (cache.row_of >= 0).nonzero().squeeze(1)
        assert torch.equal(cache.slot_of[cache.row_of[held]].long(), held)
        cached = (cache.slot_of >= 0).nonzero().squeeze(1)
        assert torch.equal(cache.row_of[cache.slot_of[cached].long()], cached)
        empty = set((cache.row_of < 0).nonzero().squeeze(1).tolist())
        assert empty <= set(cache.free.tolist())
        if not cache.lfu:  # (LFU takes its victims by a top-k over every slot, not out of the order)
            current = {
                int(s) for chunk, clock in cache.order._chunks for s in chunk.tolist() if cache.last_used[s] == clock
            }
            assert set(held.tolist()) <= current


def _check_maps_of(module):
    tables = module._tables
    if tables._maps is not None:
        _check_maps(tables._maps)
    else:
        _check_host_maps(tables.caches)


def _fail(monkeypatch, tables, t, call, staged=False):
    """Table t's mover's ``call`` raises EIO: ``read`` (a miss's read of the backing store),
    ``gather`` (the same on the records path), ``write`` (a write-back), ``store`` (the same on
    the records path); ``staged``: the stage's only, on its worker thread."""
    mover = tables._mover(t)
    real = getattr(mover, call)
    calls = [0]

    def refuse(*args, **kwargs):
        if staged and threading.current_thread() is threading.main_thread():
            return real(*args, **kwargs)
        calls[0] += 1
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(mover, call, refuse)
    return calls, lambda: monkeypatch.setattr(mover, call, real)


def _trains_alike(resident, tiered, kjts):
    """Both modules trained on ``kjts`` give equal outputs; then every id's row and optimizer
    state equal bit for bit, the maps consistent, no pin left."""
    for kjt in kjts:
        outs = [m(kjt).values() for m in (resident, tiered)]
        assert torch.equal(outs[0], outs[1])
        for out in outs:
            out.square().sum().backward()
    for theirs, mine in zip(_rows(resident), _rows(tiered)):
        assert set(theirs) == set(mine)
        assert all(torch.equal(theirs[i][0], mine[i][0]) and torch.equal(theirs[i][1], mine[i][1]) for i in mine)
    _check_maps_of(tiered)
    maps_ = tiered._tables._maps
    assert not (maps_.pinned if maps_ is not None else any(c.pinned for c in tiered._tables.caches))


VARIANTS = [
    # (maps, backing, records, batched upsert, the call that fails)
    ("host", "host", False, True, "read"),
    ("host", "file", False, True, "read"),
    ("host", "host", False, False, "read"),
    ("device", "host", False, True, "read"),
    ("device", "file", False, True, "read"),
    ("device", "host", True, True, "gather"),
    ("device", "file", False, False, "read"),
    ("host", "file", False, True, "write"),
    ("device", "host", False, True, "write"),
    ("device", "file", True, True, "store"),
]


@pytest.mark.parametrize("maps,backing,records,batched,call", VARIANTS)
def test_a_failed_read_or_write_back_takes_the_new_ids_of_its_batch_out_of_the_index(
    tmp_path, monkeypatch, maps, backing, records, batched, call
):
    monkeypatch.setattr(TieredTables, "device_maps", maps == "device")
    monkeypatch.setattr(TieredTables, "copy_through_records", records)
    monkeypatch.setattr(TieredTables, "batched_upsert", batched, raising=False)
    resident, tiered = _module(), _module("host" if backing == "host" else f"file:{tmp_path}")
    for kjt in _random_batches(12):
        outs = [m(kjt).values() for m in (resident, tiered)]
        assert torch.equal(outs[0], outs[1])
        for out in outs:
            out.square().sum().backward()
    before = _rows(resident)
    # The failed batch: per table 10 ids it holds (some cached, some to read) and 10 new ones,
    # which evict as many (every table is full).
    gen = torch.Generator().manual_seed(1)
    held = [torch.tensor(sorted(rows))[torch.randperm(len(rows), generator=gen)[:10]] for rows in before]
    new = [torch.arange(10) + 1000 * (t + 1) for t in range(2)]
    failed = _kjt([torch.cat([h, n]) for h, n in zip(held, new)])
    told = copy.deepcopy(resident)
    told(failed)  # (training: the upsert the failed lookup made)
    evicted = [set(b) - set(a) for a, b in zip(_rows(told), before)]
    assert all(len(e) == 10 for e in evicted)
    calls, restore = _fail(monkeypatch, tiered._tables, 1, call)
    with pytest.raises(OSError, match="Input/output error"):
        tiered(failed)
    assert calls[0] >= 1
    restore()
    _check_maps_of(tiered)

    # The index as the lookup found it, but the ids its upsert evicted; every id's row and
    # optimizer state its own, bit for bit.
    after = _rows(tiered)
    for t in range(2):
        assert not set(after[t]) & set(new[t].tolist()), "an id the failed lookup inserted is left in the index"
        assert set(after[t]) == set(before[t]) - evicted[t]
        for i, (weight, moment) in after[t].items():
            assert torch.equal(weight, before[t][i][0]) and torch.equal(moment, before[t][i][1]), (t, i)

    # A later lookup: the failed batch's new ids and the evicted ones are new ids (their initial
    # rows, as a fresh table gives), the others read their own rows.
    untouched = [sorted(set(before[t]) - evicted[t] - set(held[t].tolist()))[:6] for t in range(2)]
    later = _kjt(
        [torch.tensor(new[t].tolist()[:7] + sorted(evicted[t])[:7] + untouched[t], dtype=torch.int64) for t in range(2)]
    )
    mine, theirs, initial = tiered(later).values(), resident(later).values(), _module()(later).values()
    for t, (first, last) in enumerate([(0, 4), (4, 10)]):
        assert torch.equal(mine[:14, first:last], initial[:14, first:last]), t
        assert torch.equal(mine[14:, first:last], theirs[14:, first:last]), t
    mine.square().sum().backward()
    for kjt in _random_batches(4, seed=2):  # and it trains on
        tiered(kjt).values().square().sum().backward()
    _check_maps_of(tiered)


@pytest.mark.parametrize("maps", ["host", "device"])
def test_a_failed_read_of_a_stage_changes_nothing_but_which_rows_are_cached(tmp_path, monkeypatch, maps):
    # The stage's read fails on its worker: the error comes with the next lookup, before it
    # changes anything; the maps stay consistent and the module goes on as the resident one.
    monkeypatch.setattr(TieredTables, "device_maps", maps == "device")
    resident, tiered = _module(), _module(f"file:{tmp_path}")
    batches = _random_batches(16, seed=3)
    for kjt in batches[:10]:
        for m in (resident, tiered):
            m(kjt).values().square().sum().backward()
    calls, restore = _fail(monkeypatch, tiered._tables, 0, "read", staged=True)
    tiered.stage_next(batches[11])
    for m in (resident, tiered):
        m(batches[10]).values().square().sum().backward()
    with pytest.raises(OSError, match="Input/output error"):
        tiered(batches[11])
    assert calls[0] >= 1
    restore()
    _check_maps_of(tiered)
    for kjt in batches[11:]:
        outs = [m(kjt).values() for m in (resident, tiered)]
        assert torch.equal(outs[0], outs[1])
        for out in outs:
            out.square().sum().backward()
    _check_maps_of(tiered)
    a, b = resident.state_dict(), tiered.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("maps,batched", [("host", True), ("host", False), ("device", True)])
def test_ids_a_failed_lookup_took_out_of_a_counter_admitted_table_are_admitted_at_their_next_sighting(
    monkeypatch, maps, batched
):
    # Counter admission forgets an id once it admits it. An id the failed lookup admitted (N),
    # or found expired (X, by ttl), then left the index again: its sightings must stay (their
    # next sighting admits them, as the lookup never failing would have had them: N seen twice,
    # X held), not be lost with the id (it would read zeros until seen admit_after times more).
    monkeypatch.setattr(TieredTables, "device_maps", maps == "device")
    monkeypatch.setattr(TieredTables, "batched_upsert", batched, raising=False)
    admitted = {"admission": "counter", "admit_after": 2, "ttl_steps": 3}

    def module(tier):
        tier = {"backing": "host", "cache_load_factor": 0.5} if tier else {}
        configs = [
            DynamicEmbeddingBagConfig(
                name="a", embedding_dim=4, num_embeddings=64, feature_names=["f0"], **admitted, **tier
            ),
            DynamicEmbeddingBagConfig(name="b", embedding_dim=6, num_embeddings=64, feature_names=["f1"], **tier),
        ]
        return DynamicEmbeddingBagCollection(configs, optimizer="adagrad", optimizer_kwargs={"lr": 0.05})

    # The oracle: the same module all-resident, not given the failed batch.
    resident, tiered = module(False), module(True)
    X, N = 7, 9
    fill = list(range(300, 318))  # (table a's other ids: the same each step)
    steps = [[X, N] + fill, [X, 8] + fill] + [[1, 2] + fill] * 3
    for step, ids in enumerate(steps):  # table b: 40 distinct ids, more than its 32 slots
        for m in (resident, tiered):
            m(_kjt([ids, torch.arange(20) + 100 + 20 * (step % 2)])).values().square().sum().backward()
    tables = tiered._tables
    rows_b = tables.indexes[1].find(torch.arange(100, 140))[0]
    slots_b = tables.caches[1].slot_of[rows_b] if tables._maps is None else tables._maps.tables[1].slot_of[rows_b]
    uncached = int(torch.arange(100, 140)[slots_b < 0][0])
    calls, restore = _fail(monkeypatch, tables, 1, "read")
    with pytest.raises(OSError, match="Input/output error"):
        tiered(_kjt([[X, N], [uncached, 100 if uncached != 100 else 101]]))  # step 6: N admitted, X expired
    assert calls[0] == 1
    restore()
    _check_maps_of(tiered)
    assert not bool(tables.indexes[0].find(torch.tensor([X, N]))[1].any())  # taken out again

    later = _kjt([[X, N], [110, 111]])
    theirs, mine = resident(later).values(), tiered(later).values()
    assert bool(theirs[:, :4].ne(0).all())  # (both admitted there: N seen twice, X held, expired)
    assert torch.equal(mine[:, :4], theirs[:, :4]), "an id the failed lookup admitted or held is refused later"


@pytest.mark.parametrize("maps", ["host", "device"])
def test_a_failed_read_counts_no_miss_and_no_byte_it_did_not_move(monkeypatch, maps):
    # A cache miss is a row read from the backing store: rows whose read failed (their slots
    # given back) are not misses, nor bytes moved, with either maps (the host maps count after
    # the read, the write-backs that ran before it are counted).
    monkeypatch.setattr(TieredTables, "device_maps", maps == "device")
    tiered = _module("host")
    for kjt in _random_batches(12):
        tiered(kjt).values().square().sum().backward()
    names = ("cache_misses", "cache_write_backs", "cache_bytes_moved")
    before = {t: [getattr(s, k) for k in names] for t, s in tiered.table_stats().items()}
    calls, restore = _fail(monkeypatch, tiered._tables, 1, "read")
    with pytest.raises(OSError, match="Input/output error"):
        tiered(_random_batches(1, seed=5)[0])
    assert calls[0] == 1
    restore()
    after = {t: [getattr(s, k) for k in names] for t, s in tiered.table_stats().items()}
    for t, name in enumerate(("a", "b")):
        misses, write_backs, moved = (now - then for now, then in zip(after[name], before[name]))
        assert moved == (misses + write_backs) * tiered._tables._mover(t).row_bytes, (name, misses, write_backs, moved)
    assert after["b"][0] == before["b"][0], "the failed read's rows counted as misses"
    if maps == "device":  # (all tables' misses read together: every table's slots given back)
        assert after["a"][0] == before["a"][0], "rows given back counted as misses"
    _check_maps_of(tiered)


@pytest.mark.parametrize("maps,call", [("host", "read"), ("host", "write"), ("device", "read"), ("device", "write")])
def test_a_batch_failing_twice_then_landing_trains_as_if_given_once(monkeypatch, maps, call):
    # Failures in a row, a stage in flight (the next batch's, on the worker) and an eval-mode
    # lookup with grad on: the batch that then lands leaves every id's row and optimizer state
    # as the all-resident module given it once, and the module trains on alike; no pin is left.
    monkeypatch.setattr(TieredTables, "device_maps", maps == "device")
    batches = _random_batches(20, seed=7)

    def twins():
        resident, tiered = _module(), _module("host")
        for kjt in batches[:12]:
            for m in (resident, tiered):
                m(kjt).values().square().sum().backward()
        return resident, tiered

    def fails(tiered, lookup):
        restore = _fail(monkeypatch, tiered._tables, 1, call)[1]
        with pytest.raises(OSError, match="Input/output error"):
            lookup()
        restore()

    resident, tiered = twins()
    for _ in range(2):
        fails(tiered, lambda: tiered(batches[12]))
    _trains_alike(resident, tiered, batches[12:])

    resident, tiered = twins()
    segments = torch.tensor([0, BAGS, 2 * BAGS])
    fails(tiered, lambda: (tiered._tables.stage_next(batches[12].values(), segments), tiered(batches[12])))
    _trains_alike(resident, tiered, batches[12:])

    resident, tiered = twins()
    for m in (resident, tiered):
        m.eval()
    fails(tiered, lambda: tiered(batches[12]).values().sum().backward())
    for m in (resident, tiered):
        m(batches[12]).values().square().sum().backward()
        m.train()
    _trains_alike(resident, tiered, batches[13:])
