"""Rows placed on load: every row the target's capacity can hold is placed (a plain insert of a
full table's ids refuses ~1% of them), also when resharding full tables of several stripes
2 -> 1 -> 2 -> 4 -> 2 ranks (issue 11, finding 6); where a rank is given more ids than it holds,
the warning gives the true numbers. The placement (the C++ op hash_place) keeps exactly the ids
the pure-Python oracle keeps (by score, highest first), deterministically; checkpoints of the
per-stripe layout (before the ring: no layout in their counters) still load, saying so."""

import os
import random
import re
import warnings

import pytest
import torch
import torch.distributed as dist
from torchrec import DataType, KeyedJaggedTensor

from dist_helpers import ModelWith, dmp_t1_row_t2_table_wise, run_ranks
from torchrec_ext import DynamicEmbeddingBagCollection, DynamicEmbeddingBagConfig, HashTable, reference
from torchrec_ext.table import LAYOUT_VERSION, stash_slots


def _most_placeable(keys, capacity):
    """Oracle: no placement holds more than min(keys, rows); with each key's second bucket in the
    next stripe on the ring, that bound is reached (w.h.p.) whatever the stripe count."""
    return min(keys.numel(), capacity)


@pytest.mark.parametrize("capacity", [1, 33, 2048, 4096, 5000, 6144, 3 * 2**21 + 7])
def test_bucket_pairs_equal_the_reference_placement(capacity):
    from torchrec_ext.reference import bucket_pairs

    keys = torch.cat(
        [
            torch.randint(-(2**63), 2**63 - 1, (500,), generator=torch.Generator().manual_seed(capacity)),
            torch.tensor([0, -1, 2**63 - 1, -(2**63)]),
        ]
    )
    b1, b2 = bucket_pairs(keys, capacity)
    assert list(zip(b1.tolist(), b2.tolist())) == [reference.place(k, capacity)[:2] for k in keys.tolist()]


# Full tables of 1 stripe (256, 2000, 2048 rows), 2 (4096), 3 (6144: an odd ring), 4 (8192), 32
# (65536) and 48 (100000) stripes; and more ids than rows.
@pytest.mark.parametrize(
    "capacity, n",
    [
        (256, 256),
        (2048, 2048),
        (2000, 2000),
        (2048, 2100),
        (4096, 4096),
        (6144, 6144),
        (8192, 8192),
        (8192, 8500),
        (65536, 65536),
        (100000, 100000),
        (262144, 262144),
    ],
)
def test_place_keys_places_every_key_that_fits(capacity, n):
    from torchrec_ext.table import place_keys

    gen = torch.Generator().manual_seed(capacity + n)
    keys = torch.randint(-(2**62), 2**62, (n,), generator=gen)
    assert keys.unique().numel() == n
    scores = torch.randint(0, 1000, (n,), generator=gen)
    rows = place_keys(keys, scores, capacity)
    placed = rows >= 0
    assert int(placed.sum()) == _most_placeable(keys, capacity)  # the upper bound, reached
    table = _table_of_placement(keys, rows, scores, capacity)
    found_rows, found = table.find(keys)
    assert torch.equal(found, placed) and torch.equal(found_rows[placed], rows[placed])
    if n > capacity and capacity <= 2048:  # one stripe: what is left out has the lowest scores
        assert int(scores[~placed].max()) <= int(scores[placed].min())


# Ids the kernel's placement must keep exactly as the oracle does (its kept set is unique): full
# and overfull tables of 1, 2 and 3 stripes, and ids crowded into stripes 0-1 of a 4-stripe table
# (their buckets hold 4,096 rows: 404 are left out although the table has 8,192), with scores
# drawn from few values so that ties are decided by position.
def _crowded(capacity, n, gen):
    keys = torch.randint(-(2**62), 2**62, (8 * n,), generator=gen).unique()
    b1, _ = reference.bucket_pairs(keys, capacity)
    return keys[b1 < 64][:n]  # bucket1 in stripe 0 (64 buckets), bucket2 in stripe 1


def _table_of_placement(keys, rows, scores, capacity) -> HashTable:
    """A table holding ``place_keys``' placement (the keys with a row >= 0): its state loads only
    when the placement is valid (each key in one of its buckets, rows distinct)."""
    placed = rows >= 0
    table = HashTable(capacity)
    table.load_state_dict(
        {
            "capacity": capacity,
            "policy": "lru",
            "clock": 0,
            "epoch": 0,
            "layout": LAYOUT_VERSION,
            "keys": keys[placed],
            "rows": rows[placed],
            "scores": scores[placed],
        }
    )
    return table


@pytest.mark.parametrize(
    "capacity, n, crowded",
    [
        (100, 130, False),
        (2048, 2048, False),
        (2048, 2300, False),
        (4096, 4400, False),
        (6144, 6144, False),
        (8192, 4500, True),
    ],
)
def test_place_keys_keeps_what_the_reference_keeps(capacity, n, crowded):
    gen = torch.Generator().manual_seed(capacity + n)
    keys = _crowded(capacity, n, gen) if crowded else torch.randint(-(2**62), 2**62, (n,), generator=gen).unique()
    assert keys.numel() == n
    scores = torch.randint(0, 5, (n,), generator=gen)
    kept = _placed_like_the_reference(keys, scores, capacity)
    # crowded: 404 ids find no row in their buckets, the stash holds 32 of them
    assert sum(kept) == min(n, capacity) - (404 - stash_slots(capacity) if crowded else 0)


def _placed_like_the_reference(keys, scores, capacity) -> list[bool]:
    """``place_keys``' placement: it keeps the keys the reference keeps (returned: a flag per key), at
    rows a table takes as its state (a valid placement)."""
    from torchrec_ext.table import place_keys

    rows = place_keys(keys, scores, capacity)
    kept = reference.place_keys(keys.tolist(), scores.tolist(), capacity)
    assert (rows >= 0).tolist() == kept
    _table_of_placement(keys, rows, scores, capacity)
    return kept


@pytest.mark.parametrize("capacity", [1, 2, 33, 100, 500, 4100])
def test_place_keys_keeps_what_the_reference_keeps_small_and_crowded(capacity):
    """Tables of one bucket, a part-usable last bucket and 2 stripes, with random loads up to 1.3,
    ties, and ids crowded into the lower half of the buckets."""
    rng = random.Random(capacity)
    for _ in range(10):
        n = rng.randint(0, int(capacity * 1.3) + 2)
        keys = torch.tensor(rng.sample(range(-(2**40), 2**40), n), dtype=torch.int64)
        if rng.random() < 0.4 and n:
            b1, _ = reference.bucket_pairs(keys, capacity)
            keys = keys[b1 <= b1.median()]
        scores = torch.randint(0, rng.choice([1, 3, 1000]), (keys.numel(),))
        _placed_like_the_reference(keys, scores, capacity)


def test_place_keys_is_deterministic_whatever_the_thread_count():
    from torchrec_ext.table import place_keys

    gen = torch.Generator().manual_seed(5)
    keys = torch.randint(-(2**62), 2**62, (70000,), generator=gen).unique()
    scores = torch.randint(0, 100, (keys.numel(),), generator=gen)
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2, 1):
            torch.set_num_threads(n)
            results.append(place_keys(keys, scores, 65536))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(r, results[0]) for r in results)
    assert int((results[0] >= 0).sum()) == 65536


@pytest.mark.parametrize(
    "change, error, match",
    [
        (
            lambda k, s, c: (torch.cat([k, k[:1]]), torch.cat([s, s[:1]]), c),
            ValueError,
            r"place_keys: .*key -?\d+ appears twice",
        ),
        (lambda k, s, c: (k, s[:-1], c), ValueError, r"place_keys: scores must have one entry per key"),
        (
            lambda k, s, c: (k.float(), s, c),
            TypeError,
            r"place_keys: keys must be an integer tensor, got torch.float32",
        ),
        (lambda k, s, c: (k, s, 0), ValueError, r"place_keys: capacity must be an int > 0, got 0"),
        (lambda k, s, c: (k.view(2, -1), s, c), ValueError, r"place_keys: keys must be 1-D"),
    ],
)
def test_place_keys_refuses_bad_input(change, error, match):
    from torchrec_ext.table import place_keys

    keys = torch.arange(10) * 7919
    with pytest.raises(error, match=match):
        place_keys(*change(keys, torch.zeros(10, dtype=torch.int64), 64))


def _full_module(capacity, seed=0):
    module = DynamicEmbeddingBagCollection(
        [DynamicEmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=capacity, feature_names=["f"])],
        optimizer="adagrad",
        optimizer_kwargs={"lr": 0.1},
    )
    gen = torch.Generator().manual_seed(seed)
    while module.num_live_rows() < capacity:
        ids = torch.randint(-(2**62), 2**62, (capacity,), generator=gen)
        module(KeyedJaggedTensor(keys=["f"], values=ids, lengths=torch.tensor([capacity]))).values().sum().backward()
    return module


def test_full_table_reloaded_without_its_rows_keeps_every_row():
    """What a reshard does (placement saved for another table: rows placed afresh) on one table
    of capacity 2048 holding 2048 ids."""
    source = _full_module(2048)
    state = {k: v for k, v in source.state_dict().items() if not k.endswith(".row")}
    target = DynamicEmbeddingBagCollection(
        source.embedding_bag_configs(), optimizer="adagrad", optimizer_kwargs={"lr": 0.1}
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "do not fit" warning
        target.load_state_dict(state, strict=False)
    got, want = target.state_dict(), source.state_dict()
    assert got["embedding_bags.t.weight_id"].numel() == 2048
    order_got, order_want = (torch.argsort(s["embedding_bags.t.weight_id"]) for s in (got, want))
    for key in ("weight_id", "weight", "metadata", "optimizer.momentum1"):
        assert torch.equal(got[f"embedding_bags.t.{key}"][order_got], want[f"embedding_bags.t.{key}"][order_want]), key


# ----------------------------------------------------------------------------- layout versions


def _layout1_buckets(key, capacity):
    """Where layout 1 (per-stripe buckets, before the ring) let a key live: both buckets in its stripe."""
    buckets, stripes = reference.geometry(capacity)
    h = reference._fmix64((key & reference._MASK64) ^ 0x9E3779B97F4A7C15)
    h2 = reference._fmix64(h ^ 0xC2B2AE3D27D4EB4F)
    begin, width = reference._stripe_span(reference._fastrange32(h2, stripes), buckets, stripes)
    off1 = reference._fastrange32(h, width)
    off2 = reference._fastrange32(h2 >> 32, width - 1) if width > 1 else off1
    return begin + off1, begin + off2 + int(width > 1 and off2 >= off1)


def _layout1_state(module, capacity, marker):
    """``module``'s state as a layout-1 checkpoint: each id in the first free row of its layout-1
    buckets (ids finding none left out), counters without the layout (``marker`` None) or with
    layout ``marker``."""
    state, p = module.state_dict(), "embedding_bags.t."
    taken, keep, rows = set(), [], []
    for i, key in enumerate(state[p + "weight_id"].tolist()):
        free = [
            r
            for b in _layout1_buckets(key, capacity)
            for r in range(32 * b, min(32 * b + 32, capacity))
            if r not in taken
        ]
        if free:
            taken.add(free[0])
            keep.append(i)
            rows.append(free[0])
    old = {k: v[torch.tensor(keep)] for k, v in state.items() if not k.endswith("counters")}
    old[p + "row"] = torch.tensor(rows)
    old[p + "counters"] = (
        state[p + "counters"][:4] if marker is None else torch.cat([state[p + "counters"][:4], torch.tensor([marker])])
    )
    return old


def _module_with(capacity, n):
    module = DynamicEmbeddingBagCollection(
        [DynamicEmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=capacity, feature_names=["f"])],
        optimizer="adagrad",
        optimizer_kwargs={"lr": 0.1},
    )
    ids = torch.randint(-(2**62), 2**62, (n,), generator=torch.Generator().manual_seed(n))
    module(KeyedJaggedTensor(keys=["f"], values=ids, lengths=torch.tensor([n]))).values().sum().backward()
    return module


@pytest.mark.parametrize("capacity, marker", [(8192, None), (8192, 1), (2048, None)])
def test_checkpoint_of_the_per_stripe_layout_loads_and_says_its_rows_were_renewed(capacity, marker):
    """A checkpoint written before the ring (counters without a layout, or layout 1) loads: every
    id keeps its vector, score and optimizer state; where its rows do not fit the ring (4 stripes)
    the ids get new rows and one warning names the table and both layouts. A table of one stripe
    has the same buckets in both layouts: its rows load as saved, silently."""

    old = _layout1_state(_module_with(capacity, capacity * 3 // 4), capacity, marker)
    target = DynamicEmbeddingBagCollection(
        [DynamicEmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=capacity, feature_names=["f"])],
        optimizer="adagrad",
        optimizer_kwargs={"lr": 0.1},
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        target.load_state_dict(old)
    said = [str(w.message) for w in caught if "layout" in str(w.message)]
    p = "embedding_bags.t."
    got = target.state_dict()
    if capacity > 2048:
        assert len(said) == 1 and re.search(
            r"table 't'.* rows follow hash-table layout 1 \(per-stripe buckets.*"
            rf"this table's layout is {LAYOUT_VERSION} \(ring of stripes",
            said[0],
        ), said
        assert not torch.equal(got[p + "row"].sort().values, old[p + "row"].sort().values)
    else:
        assert said == []
        assert torch.equal(got[p + "row"], old[p + "row"][torch.argsort(old[p + "row"])])
    order_got, order_old = torch.argsort(got[p + "weight_id"]), torch.argsort(old[p + "weight_id"])
    for key in ("weight_id", "weight", "metadata", "optimizer.momentum1"):
        assert torch.equal(got[p + key][order_got], old[p + key][order_old]), key
    assert got[p + "counters"].tolist() == old[p + "counters"][:4].tolist() + [LAYOUT_VERSION]


def test_dcp_checkpoint_of_the_per_stripe_layout_loads(tmp_path, one_rank_group):
    """The same through a DCP checkpoint, as a resumed job reads it: its counters [4] are read
    as stored (the module's own are [5]), then the ids are given new rows, said once."""
    from torchrec_ext.distributed.checkpoint import load_checkpoint, save_checkpoint

    old = _layout1_state(_module_with(8192, 6000), 8192, None)
    save_checkpoint(str(tmp_path), 1, {"model": old})
    target = DynamicEmbeddingBagCollection(
        [DynamicEmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=8192, feature_names=["f"])],
        optimizer="adagrad",
        optimizer_kwargs={"lr": 0.1},
    )
    state = load_checkpoint(os.path.join(str(tmp_path), "step_1"), {"model": target.state_dict()})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        target.load_state_dict(state["model"])
    assert [str(w.message).count("table 't'") for w in caught if "layout 1" in str(w.message)] == [1]
    p = "embedding_bags.t."
    got = target.state_dict()
    order_got, order_old = torch.argsort(got[p + "weight_id"]), torch.argsort(old[p + "weight_id"])
    for key in ("weight_id", "weight", "metadata", "optimizer.momentum1"):
        assert torch.equal(got[p + key][order_got], old[p + key][order_old]), key


def test_hash_table_state_names_its_layout():
    """A table's state says which layout its rows follow; rows of another layout that do not fit
    are refused naming both layouts (place_keys re-places them)."""

    table = HashTable(8192)
    table.find_or_insert(torch.randint(-(2**62), 2**62, (6000,), generator=torch.Generator().manual_seed(1)))
    state = table.state_dict()
    assert state["layout"] == LAYOUT_VERSION
    HashTable(8192).load_state_dict(state)
    # A key in its layout-1 bucket2, which the ring does not give it.
    i = next(
        i
        for i, k in enumerate(state["keys"].tolist())
        if _layout1_buckets(k, 8192)[1] not in reference.place(k, 8192)[:2]
    )
    key = int(state["keys"][i])
    old = dict(
        state,
        layout=1,
        keys=state["keys"][i : i + 1],
        scores=state["scores"][i : i + 1],
        rows=torch.tensor([32 * _layout1_buckets(key, 8192)[1]]),
    )
    fresh = HashTable(8192)
    with pytest.raises(
        ValueError,
        match=rf"key {key} cannot live in row .*the state's rows follow layout 1, this "
        rf"table's is {LAYOUT_VERSION}: re-place its keys with place_keys",
    ):
        fresh.load_state_dict(old)
    assert fresh.size() == 0


# ----------------------------------------------------------------------------- resharding on ranks

# Row-wise t1: a rank's share is 16384 / 8192 / 4096 rows (8 / 4 / 2 stripes) on 1 / 2 / 4 ranks;
# table-wise t2: 6144 rows (3 stripes, an odd ring). Full, each overflows some stripe when its
# ids are re-routed: rows must flow to the neighbour stripes for every row to be placed.
CAPACITY = {"t1": 16384, "t2": 6144}
KEYS = ["f1", "f2"]


def _dmp(world_size, optimizer="adam", data_types=("FP32", "FP32")):
    configs = [
        DynamicEmbeddingBagConfig(
            name="t1",
            embedding_dim=4,
            num_embeddings=CAPACITY["t1"],
            feature_names=["f1"],
            data_type=DataType[data_types[0]],
        ),
        DynamicEmbeddingBagConfig(
            name="t2",
            embedding_dim=4,
            num_embeddings=CAPACITY["t2"],
            feature_names=["f2"],
            eviction_policy="lfu",
            data_type=DataType[data_types[1]],
        ),
    ]
    model = ModelWith("ebc", DynamicEmbeddingBagCollection(configs, optimizer=optimizer, optimizer_kwargs={"lr": 0.05}))
    return dmp_t1_row_t2_table_wise(model, world_size)


def _local_rows(dmp):
    """{table: {id: weight + optimizer state}} of this rank (float32: half weights widen exactly),
    and its tables' capacities."""
    local = dmp.module.ebc.local_module
    rows, capacity = {}, {}
    if local is not None:
        state = local.state_dict()
        for cfg in local.embedding_bag_configs():
            p = f"embedding_bags.{cfg.name}."
            assert (
                state[p + "weight"].dtype
                == {"FP32": torch.float32, "FP16": torch.float16, "BF16": torch.bfloat16}[cfg.data_type.name]
            )
            kind = local.fused_optimizer.spec.kind
            values = torch.cat(
                [state[p + k] for k in ["weight"] + [f"optimizer.{n}" for n in reference.OPTIMIZER_STATES[kind]]], dim=1
            )
            # Lists, not row views: pickling a view (all_gather_object) copies its whole storage.
            rows[cfg.name] = dict(zip(state[p + "weight_id"].tolist(), values.tolist()))
            capacity[cfg.name] = cfg.num_embeddings
    return rows, capacity


def _fill(dmp, rank, seed):
    """Trains on fresh ids until every table of every rank is full."""
    gen = torch.Generator().manual_seed(seed * 100 + rank)
    for _ in range(20):
        rows, capacity = _local_rows(dmp)
        full = all(len(rows[t]) == capacity[t] for t in rows)
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, full)
        if all(everyone):
            return
        lengths = torch.tensor([2 * CAPACITY["t1"] // 8] * 8 + [CAPACITY["t2"] // 8] * 8)
        values = torch.randint(-(2**62), 2**62, (int(lengths.sum()),), generator=gen)
        dmp(KeyedJaggedTensor(keys=KEYS, values=values, lengths=lengths, stride=8)).values().sum().backward()
    raise AssertionError("tables did not fill up")


def _reshard_step(
    rank, world_size, root, load_from, save_as, optimizer="adam", data_types=("FP32", "FP32"), saved_types=None
):
    """Loads checkpoint ``load_from`` (if any) and checks every rank's rows (vectors and optimizer
    state) against the saved ones; fills the tables; saves ``save_as`` with the saved rows beside it.
    ``saved_types``: the checkpoint's data_types, when other than the tables' (rows then convert)."""
    from torchrec_ext.distributed.checkpoint import load_checkpoint, save_checkpoint

    dmp = _dmp(world_size, optimizer, data_types)
    if load_from is not None:
        state = load_checkpoint(os.path.join(root, f"step_{load_from}"), {"model": dmp.state_dict()})
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            dmp.load_state_dict(state["model"])
        said = [str(w.message) for w in caught if "placed" in str(w.message)]
        converted = {
            t for t in CAPACITY for w in caught if f"table {t!r}" in str(w.message) and "converted" in str(w.message)
        }
        local = dmp.module.ebc.local_module
        held = {c.name for c in local.embedding_bag_configs() if local_rows_of(local, c.name)} if local else set()
        changed = {t for t, a, b in zip(("t1", "t2"), data_types, saved_types or data_types) if a != b}
        assert converted == changed & held, (converted, changed, held)
        everyone = [None] * world_size
        dist.all_gather_object(everyone, (_local_rows(dmp), said))
        saved = torch.load(os.path.join(root, f"rows_{load_from}.pt"))
        for t, dt in zip(("t1", "t2"), data_types):  # what the tables hold: the saved weight in their dtype
            dtype = {"FP32": torch.float32, "FP16": torch.float16, "BF16": torch.bfloat16}[dt]
            saved[t] = {i: torch.tensor(v[:4]).to(dtype).float().tolist() + v[4:] for i, v in saved[t].items()}
        _check_resharded(saved, everyone, world_size)
    if save_as is None:
        return
    _fill(dmp, rank, save_as)
    save_checkpoint(root, save_as, {"model": dmp.state_dict()})
    everyone = [None] * world_size
    dist.all_gather_object(everyone, _local_rows(dmp)[0])
    if rank == 0:
        saved = {t: {} for t in CAPACITY}
        for rows in everyone:
            for t, r in rows.items():
                saved[t].update(r)
        torch.save(saved, os.path.join(root, f"rows_{save_as}.pt"))


def local_rows_of(local, table):
    return local.state_dict()[f"embedding_bags.{table}.weight_id"].numel()


def _check_resharded(saved, everyone, world_size):
    for t, rows in saved.items():
        for rank, ((got_rows, capacity), said) in enumerate(everyone):
            if t == "t1":  # row-wise: the ids the reference routing sends to this rank
                routed = {i for i in rows if reference.route(i, world_size) == rank}
            else:  # table-wise, on the last rank
                routed = set(rows) if rank == world_size - 1 else set()
            if not routed:
                assert t not in got_rows or not got_rows[t]
                continue
            got, cap = got_rows[t], capacity[t]
            assert set(got) <= routed
            assert len(got) == min(len(routed), cap), (t, rank, len(got), len(routed), cap)  # all that fit
            for i, value in got.items():
                assert value == rows[i], (t, i)  # weight and optimizer state, bit for bit
            mine = [s for s in said if f"table {t!r}" in s]
            if len(routed) > cap:
                assert len(mine) == 1 and re.search(
                    rf"placed {cap} of the checkpoint's {len(routed)} ids in capacity {cap};.*\({len(routed)} ids > capacity {cap}\)",
                    mine[0],
                ), mine
            else:
                assert not mine


def test_reshard_full_tables_2_1_2_4_2(tmp_path):
    root = str(tmp_path)
    run_ranks(_reshard_step, 2, root, None, 1)  # full tables on 2 ranks
    run_ranks(_reshard_step, 1, root, 1, 2)  # 2 -> 1: every row fits
    run_ranks(_reshard_step, 2, root, 2, 3)  # 1 -> 2: a rank given more ids than its share keeps its share
    run_ranks(_reshard_step, 4, root, 3, 4)  # 2 -> 4
    run_ranks(_reshard_step, 2, root, 4, None)  # 4 -> 2


@pytest.mark.parametrize("optimizer", ["ftrl"])  # AdamW's state is Adam's (same names), which the test above carries
def test_reshard_carries_each_optimizers_state_2_1(tmp_path, optimizer):
    """FTRL's accumulator and linear travel with their rows, as Adam's moments do."""
    root = str(tmp_path)
    run_ranks(_reshard_step, 2, root, None, 1, optimizer)
    run_ranks(_reshard_step, 1, root, 1, None, optimizer)


def test_reshard_half_tables_2_1_2_and_convert_dtypes(tmp_path):
    """FP16 (row-wise) and BF16 (table-wise) tables keep their rows bit for bit through DCP
    checkpoints 2 -> 1 -> 2 ranks; loaded into FP32 / FP16 tables (and back), the rows convert
    to the table's dtype, with a warning per converted table on the ranks holding it."""
    root, half = str(tmp_path), ("FP16", "BF16")
    run_ranks(_reshard_step, 2, root, None, 1, "adagrad", half)
    run_ranks(_reshard_step, 1, root, 1, 2, "adagrad", half)
    run_ranks(_reshard_step, 2, root, 2, 3, "adagrad", ("FP32", "FP16"), half)
    run_ranks(_reshard_step, 1, root, 3, None, "adagrad", half, ("FP32", "FP16"))
