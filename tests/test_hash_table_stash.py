"""The stash (csrc/hash_table_layout.h): at load exactly 1 a few buckets may be chosen by fewer
keys than they hold, so no placement puts every key in its buckets (issue 11, finding 6: a 1M-row
table lost ~85 ids). Here ids are picked so that a bucket of each target table is chosen by only
20 of them (12 of its rows stay empty in any placement): without the stash a full reshard loses
12 ids per table; with it every id is kept, with its score, vectors and optimizer state, and the
kernels (CPU, the CUDA kernels under the warp emulator) find, touch, evict and erase stashed keys
exactly as the dict model (reference.ReferenceHashTable) does."""

import random

import pytest
import torch
from torchrec import KeyedJaggedTensor

from torchrec_ext import DynamicEmbeddingBagCollection, DynamicEmbeddingBagConfig, HashTable, reference
from torchrec_ext.table import place_keys
from torchrec_ext.vocabulary import LAYOUT_VERSION, index_lengths, stash_slots

STARVED_CHOOSERS = 20  # keys that may use a starved bucket: 32 - 20 rows of it stay empty


def _starved(capacity, n, buckets=(0,), pool=None, seed=0):
    """``n`` distinct ids of which only STARVED_CHOOSERS have a bucket in ``buckets`` (one each),
    drawn from ``pool`` (default: random ids), in random order."""
    gen = torch.Generator().manual_seed(seed)
    if pool is None:
        pool = torch.randint(-(2**62), 2**62, (4 * n,), generator=gen).unique()
        pool = pool[torch.randperm(pool.numel(), generator=gen)]
    b1, b2 = reference.bucket_pairs(pool, capacity)
    starved = torch.tensor(list(buckets))
    hits = torch.isin(b1, starved).to(torch.int64) + torch.isin(b2, starved).to(torch.int64)
    picked = [pool[hits == 0][: n - STARVED_CHOOSERS * len(buckets)]]
    for b in buckets:
        picked.append(pool[(hits == 1) & ((b1 == b) | (b2 == b))][:STARVED_CHOOSERS])
    keys = torch.cat(picked)
    assert keys.numel() == n
    return keys[torch.randperm(n, generator=gen)]


def _load(table, keys, scores):
    rows = place_keys(keys, scores, table.capacity)
    keep = rows >= 0
    table.load_state_dict(
        {
            "capacity": table.capacity,
            "policy": table.policy,
            "clock": 0,
            "epoch": 0,
            "layout": LAYOUT_VERSION,
            "keys": keys[keep],
            "rows": rows[keep],
            "scores": scores[keep],
        }
    )
    return rows


def test_stash_size_grows_like_the_square_root_of_the_capacity():
    assert [stash_slots(c) for c in (1, 2048, 16384, 16385, 2**20, 10**8)] == [32, 32, 32, 64, 256, 2528]
    assert [stash_slots(c) for c in (1, 2048, 16384, 16385, 2**20, 10**8)] == [
        reference.stash_slots(c) for c in (1, 2048, 16384, 16385, 2**20, 10**8)
    ]
    assert HashTable(40).metadata_bytes() == sum(index_lengths(40)[i] * w for i, w in enumerate((1, 8, 8)))


@pytest.mark.parametrize("capacity", [2048, 4096, 6144])
def test_a_full_starved_table_keeps_every_id(capacity):
    """One starved bucket: 12 ids have no row in their buckets in any placement; the stash holds them."""
    keys = _starved(capacity, capacity)
    scores = torch.randint(0, 100, (capacity,), generator=torch.Generator().manual_seed(1))
    table = HashTable(capacity)
    rows = _load(table, keys, scores)
    assert bool((rows >= 0).all()), f"{int((rows < 0).sum())} ids left out"
    assert table.size() == capacity and table.stash_size() == 32 - STARVED_CHOOSERS
    found_rows, found = table.find(keys)
    assert bool(found.all()) and torch.equal(found_rows, rows)
    got = table.state_dict()
    order = torch.argsort(got["keys"])
    want = torch.argsort(keys)
    assert torch.equal(got["keys"][order], keys[want]) and torch.equal(got["scores"][order], scores[want])
    assert torch.equal(got["rows"][order], rows[want])
    twin = HashTable(capacity)  # its state loads as it is: stashed rows included
    twin.load_state_dict(got)
    assert torch.equal(twin.find(keys)[0], rows) and twin.stash_size() == table.stash_size()


def test_the_kept_ids_are_the_references_when_the_stash_overflows():
    """Three starved buckets (36 ids without a row in their buckets, the stash holds 32): the
    4 dropped are the lowest-priority ones, as the oracle (placement matroid + stash) says."""
    capacity = 4096
    keys = _starved(capacity, capacity, buckets=(0, 50, 100), seed=3)
    scores = torch.randint(0, 4, (capacity,), generator=torch.Generator().manual_seed(4))
    rows = place_keys(keys, scores, capacity)
    kept = reference.place_keys(keys.tolist(), scores.tolist(), capacity)
    assert (rows >= 0).tolist() == kept
    assert int((rows < 0).sum()) == 3 * (32 - STARVED_CHOOSERS) - 32


@pytest.mark.parametrize("capacity, n", [(100, 130), (2048, 2100)])
def test_more_ids_than_rows_keep_the_references_ids(capacity, n):
    gen = torch.Generator().manual_seed(n)
    keys = torch.randint(-(2**62), 2**62, (n,), generator=gen).unique()
    scores = torch.randint(0, 5, (keys.numel(),), generator=gen)
    rows = place_keys(keys, scores, capacity)
    assert (rows >= 0).tolist() == reference.place_keys(keys.tolist(), scores.tolist(), capacity)
    assert int((rows >= 0).sum()) == capacity


# ----------------------------------------------------------------------------- resharding


def _reshard_ids(src, dst, share, seed):
    """Ids that fill ``src`` source tables and ``dst`` target tables of ``share`` rows exactly,
    each target table starved in bucket 0. (Routing nests: rank r of 4 lies in rank r // 2 of 2,
    so a target rank's ids come from the sources it shares ids with, as many from each.)"""
    total = dst * share
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randint(-(2**62), 2**62, (8 * total,), generator=gen).unique()
    pool = pool[torch.randperm(pool.numel(), generator=gen)]
    at_src = torch.tensor([reference.route(k, src) for k in pool.tolist()])
    at_dst = torch.tensor([reference.route(k, dst) for k in pool.tolist()])
    ids = []
    for r in range(dst):
        sources = [s for s in range(src) if bool(((at_dst == r) & (at_src == s)).any())]
        per_source = share // len(sources)
        starved_per_source = STARVED_CHOOSERS // len(sources)
        for s in sources:
            mine = pool[(at_dst == r) & (at_src == s)]
            b1, b2 = reference.bucket_pairs(mine, share)
            starved = (b1 == 0) | (b2 == 0)
            ids += [mine[starved][:starved_per_source], mine[~starved][: per_source - starved_per_source]]
    ids = torch.cat(ids)
    assert ids.numel() == total
    return ids


@pytest.mark.parametrize("src, dst", [(2, 1), (1, 2), (2, 4), (4, 2)])
def test_reshard_of_full_tables_places_every_row(src, dst):
    """Full tables on ``src`` ranks re-placed on ``dst`` ranks whose tables the ids fill exactly:
    every id is placed on its new rank, with its score (the tables of both sides are full)."""
    share = 4096  # a target rank's rows (2 stripes)
    ids = _reshard_ids(src, dst, share, seed=src * 10 + dst)
    scores = torch.randint(0, 1000, (ids.numel(),), generator=torch.Generator().manual_seed(7))
    capacity_src = ids.numel() // src
    saved = []
    for s in range(src):  # each source table full, its state saved
        mine = torch.tensor([reference.route(k, src) == s for k in ids.tolist()])
        table = HashTable(capacity_src)
        assert bool((_load(table, ids[mine], scores[mine]) >= 0).all()) and table.size() == capacity_src
        saved.append(table.state_dict())
    keys = torch.cat([st["keys"] for st in saved])
    key_scores = torch.cat([st["scores"] for st in saved])
    for r in range(dst):
        mine = torch.tensor([reference.route(k, dst) == r for k in keys.tolist()])
        table = HashTable(share)
        rows = _load(table, keys[mine], key_scores[mine])
        assert int((rows < 0).sum()) == 0, f"rank {r} lost {int((rows < 0).sum())} of {int(mine.sum())} ids"
        assert table.size() == share and table.stash_size() > 0
        found_rows, found = table.find(keys[mine])
        assert bool(found.all())
        state = table.state_dict()
        assert dict(zip(state["keys"].tolist(), state["scores"].tolist())) == dict(
            zip(keys[mine].tolist(), key_scores[mine].tolist())
        )


def _module(capacity):
    config = DynamicEmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=capacity, feature_names=["f"])
    return DynamicEmbeddingBagCollection([config], optimizer="adam", optimizer_kwargs={"lr": 0.05})


def _step(module, ids):
    kjt = KeyedJaggedTensor(keys=["f"], values=ids, lengths=torch.ones(ids.numel(), dtype=torch.int64))
    module(kjt).values().pow(2).sum().backward()


def _rows_by_id(module):
    sd = module.state_dict()
    p = "embedding_bags.t."
    values = torch.cat([sd[p + "weight"], sd[p + "optimizer.momentum1"], sd[p + "optimizer.momentum2"]], dim=1)
    return {i: (v, s) for i, v, s in zip(sd[p + "weight_id"].tolist(), values.tolist(), sd[p + "metadata"].tolist())}


def test_a_module_reloaded_full_at_half_the_capacity_keeps_every_row_and_trains_its_stash():
    """2 -> 1 in one process: a table of 2C rows trained on C starved ids loads into a table of C
    rows: every id keeps its vector, Adam state and score; then training finds the stashed ids
    (their vectors move, no row is new) and evicts them by LRU like any row."""
    capacity = 2048
    ids = _starved(capacity, capacity, seed=5)
    trained = _module(2 * capacity)
    for chunk in ids.split(512):
        _step(trained, chunk)
    _step(trained, ids[:300])
    want = _rows_by_id(trained)
    assert len(want) == capacity
    resumed = _module(capacity)
    resumed.load_state_dict(trained.state_dict())
    assert _rows_by_id(resumed) == want
    index = resumed._tables.indexes[0]
    stashed = index._stash_entries()[0]
    assert stashed.numel() == 32 - STARVED_CHOOSERS
    _step(resumed, stashed)  # found: trained in place, nothing inserted
    after = _rows_by_id(resumed)
    assert set(after) == set(want)
    assert all(after[i][0] != want[i][0] for i in stashed.tolist())
    assert all(after[i][0] == want[i][0] for i in set(want) - set(stashed.tolist()))
    # New ids evict by LRU: the stashed ids were just touched, so the least recent go first.
    gen = torch.Generator().manual_seed(9)
    _step(resumed, torch.randint(2**62, 2**63 - 1, (capacity // 2,), generator=gen))
    assert set(stashed.tolist()) <= set(_rows_by_id(resumed))
    for _ in range(4):  # batches of new ids: every row of the loaded ids goes, the stashed ones too
        _step(resumed, torch.randint(2**62, 2**63 - 1, (capacity,), generator=gen))
    assert not set(stashed.tolist()) & set(_rows_by_id(resumed)) and index.stash_size() == 0


# ----------------------------------------------------------------------------- kernels vs reference


def _stashed_table(capacity, policy, seed):
    keys = _starved(capacity, capacity, seed=seed)
    scores = torch.randint(0, 50, (capacity,), generator=torch.Generator().manual_seed(seed))
    table = HashTable(capacity, policy=policy)
    _load(table, keys, scores)
    assert table.stash_size() == 32 - STARVED_CHOOSERS
    model = reference.ReferenceHashTable(capacity, policy)
    model.load(list(zip(*[t.tolist() for t in (lambda s: (s["keys"], s["rows"], s["scores"]))(table.state_dict())])))
    return table, model, keys


@pytest.mark.parametrize("policy", ["lru", "lfu", "none"])
def test_cpu_kernels_match_the_reference_with_a_stash(policy):
    capacity = 2048
    table, model, keys = _stashed_table(capacity, policy, seed=11)
    stashed = table._stash_entries()[0].tolist()
    rng = random.Random(policy)
    universe = keys.tolist() + [rng.randrange(-(2**63), 2**63) for _ in range(capacity)]
    seen_stash_evicted = False
    for step in range(14):
        n = rng.choice([1, 40, 300, 700])
        batch = [rng.choice(stashed) for _ in range(n // 20 + 1)] + [rng.choice(universe) for _ in range(n)]
        rng.shuffle(batch)
        batch_t = torch.tensor(batch)
        op = rng.choice(["upsert", "upsert", "find", "erase"]) if step > 1 else "find"
        if op == "upsert":
            got = table.find_or_insert(batch_t)
            rows, inserted, ek, er = model.upsert(batch)
            assert got.rows.tolist() == rows and got.inserted.tolist() == inserted
            assert got.evicted_keys.tolist() == ek and got.evicted_rows.tolist() == er
            seen_stash_evicted |= bool(set(ek) & set(stashed))
        elif op == "find":
            rows, found = table.find(batch_t)
            assert (rows.tolist(), found.tolist()) == tuple(model.find(batch))
        else:
            assert table.erase(batch_t[:5]).tolist() == model.erase(batch[:5])
        state = table.state_dict()
        assert list(zip(*[state[k].tolist() for k in ("keys", "rows", "scores")])) == model.export()
        assert table.size() == model.size()
    if policy != "none":
        assert seen_stash_evicted, "no stashed key was evicted: the test did not exercise it"
