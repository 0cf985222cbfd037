"""Rows placed on load: every row the target's capacity can hold is placed (a plain insert of a
full table's ids refuses ~1% of them), also when resharding full tables of several stripes
2 -> 1 -> 2 -> 4 -> 2 ranks (issue 11, finding 6); where a rank is given more ids than it holds,
the warning gives the true numbers."""
import os
import re
import warnings

import pytest
import torch
import torch.distributed as dist
from torchrec import DataType, KeyedJaggedTensor

from dist_helpers import ModelWith, run_ranks
from torchrec_ext import DynamicEmbeddingBagCollection, DynamicEmbeddingBagConfig
from torchrec_ext import HashTable, reference


def _most_placeable(keys, capacity):
    """Oracle: no placement holds more than min(keys, rows); with each key's second bucket in the
    next stripe on the ring, that bound is reached (w.h.p.) whatever the stripe count."""
    return min(keys.numel(), capacity)


@pytest.mark.parametrize("capacity", [1, 33, 2048, 4096, 5000, 6144, 3 * 2**21 + 7])
def test_bucket_pairs_equal_the_reference_placement(capacity):
    from torchrec_ext.table import bucket_pairs

    keys = torch.cat([torch.randint(-(2**63), 2**63 - 1, (500,), generator=torch.Generator().manual_seed(capacity)),
                      torch.tensor([0, -1, 2**63 - 1, -(2**63)])])
    b1, b2 = bucket_pairs(keys, capacity)
    assert list(zip(b1.tolist(), b2.tolist())) == [reference.place(k, capacity)[:2] for k in keys.tolist()]


# Full tables of 1 stripe (256, 2000, 2048 rows), 2 (4096), 3 (6144: an odd ring), 4 (8192), 32
# (65536) and 48 (100000) stripes; and more ids than rows.
@pytest.mark.parametrize("capacity, n", [(256, 256), (2048, 2048), (2000, 2000), (2048, 2100), (4096, 4096),
                                         (6144, 6144), (8192, 8192), (8192, 8500), (65536, 65536), (100000, 100000)])
def test_place_keys_places_every_key_that_fits(capacity, n):
    from torchrec_ext.table import place_keys

    gen = torch.Generator().manual_seed(capacity + n)
    keys = torch.randint(-(2**62), 2**62, (n,), generator=gen)
    assert keys.unique().numel() == n
    scores = torch.randint(0, 1000, (n,), generator=gen)
    rows = place_keys(keys, scores, capacity)
    placed = rows >= 0
    assert int(placed.sum()) == _most_placeable(keys, capacity)  # the upper bound, reached
    table = HashTable(capacity)  # the placement is valid: each key in one of its buckets, rows distinct
    table.load_state_dict({"capacity": capacity, "policy": "lru", "clock": 0, "epoch": 0,
                           "keys": keys[placed], "rows": rows[placed], "scores": scores[placed]})
    found_rows, found = table.find(keys)
    assert torch.equal(found, placed) and torch.equal(found_rows[placed], rows[placed])
    if n > capacity and capacity <= 2048:  # one stripe: what is left out has the lowest scores
        assert int(scores[~placed].max()) <= int(scores[placed].min())


def _full_module(capacity, seed=0):
    module = DynamicEmbeddingBagCollection(
        [DynamicEmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=capacity, feature_names=["f"])],
        optimizer="adagrad", optimizer_kwargs={"lr": 0.1})
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
    target = DynamicEmbeddingBagCollection(source.embedding_bag_configs(), optimizer="adagrad", optimizer_kwargs={"lr": 0.1})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "do not fit" warning
        target.load_state_dict(state, strict=False)
    got, want = target.state_dict(), source.state_dict()
    assert got["embedding_bags.t.weight_id"].numel() == 2048
    order_got, order_want = (torch.argsort(s["embedding_bags.t.weight_id"]) for s in (got, want))
    for key in ("weight_id", "weight", "metadata", "optimizer.momentum1"):
        assert torch.equal(got[f"embedding_bags.t.{key}"][order_got], want[f"embedding_bags.t.{key}"][order_want]), key


# ----------------------------------------------------------------------------- resharding on ranks

# Row-wise t1: a rank's share is 16384 / 8192 / 4096 rows (8 / 4 / 2 stripes) on 1 / 2 / 4 ranks;
# table-wise t2: 6144 rows (3 stripes, an odd ring). Full, each overflows some stripe when its
# ids are re-routed: rows must flow to the neighbour stripes for every row to be placed.
CAPACITY = {"t1": 16384, "t2": 6144}
KEYS = ["f1", "f2"]


def _dmp(world_size, optimizer="adam", data_types=("FP32", "FP32")):
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
    from torchrec.distributed.types import ShardingEnv, ShardingPlan

    from torchrec_ext.distributed import DynamicEmbeddingBagCollectionSharder, get_sharders

    configs = [DynamicEmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=CAPACITY["t1"], feature_names=["f1"],
                                         data_type=DataType[data_types[0]]),
               DynamicEmbeddingBagConfig(name="t2", embedding_dim=4, num_embeddings=CAPACITY["t2"], feature_names=["f2"],
                                         eviction_policy="lfu", data_type=DataType[data_types[1]])]
    model = ModelWith("ebc", DynamicEmbeddingBagCollection(configs, optimizer=optimizer, optimizer_kwargs={"lr": 0.05}))
    gens = {"t1": row_wise(compute_kernel="customized_kernel"), "t2": table_wise(rank=world_size - 1, compute_kernel="customized_kernel")}
    plan = construct_module_sharding_plan(model.ebc, gens, sharder=DynamicEmbeddingBagCollectionSharder(),
                                          local_size=world_size, world_size=world_size, device_type="cpu")
    return DistributedModelParallel(model, env=ShardingEnv.from_process_group(dist.group.WORLD), device=torch.device("cpu"),
                                    plan=ShardingPlan({"ebc": plan}), sharders=get_sharders())


def _local_rows(dmp):
    """{table: {id: weight + optimizer state}} of this rank (float32: half weights widen exactly),
    and its tables' capacities."""
    local = dmp.module.ebc.local_module
    rows, capacity = {}, {}
    if local is not None:
        state = local.state_dict()
        for cfg in local.embedding_bag_configs():
            p = f"embedding_bags.{cfg.name}."
            assert state[p + "weight"].dtype == {"FP32": torch.float32, "FP16": torch.float16,
                                                  "BF16": torch.bfloat16}[cfg.data_type.name]
            kind = local.fused_optimizer.spec.kind
            values = torch.cat([state[p + k] for k in ["weight"] + [f"optimizer.{n}" for n in reference.OPTIMIZER_STATES[kind]]],
                               dim=1)
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


def _reshard_step(rank, world_size, root, load_from, save_as, optimizer="adam", data_types=("FP32", "FP32"),
                  saved_types=None):
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
        converted = {t for t in CAPACITY for w in caught if f"table {t!r}" in str(w.message) and "converted" in str(w.message)}
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
                    mine[0]), mine
            else:
                assert not mine


def test_reshard_full_tables_2_1_2_4_2(tmp_path):
    root = str(tmp_path)
    run_ranks(_reshard_step, 2, root, None, 1)  # full tables on 2 ranks
    run_ranks(_reshard_step, 1, root, 1, 2)     # 2 -> 1: every row fits
    run_ranks(_reshard_step, 2, root, 2, 3)     # 1 -> 2: a rank given more ids than its share keeps its share
    run_ranks(_reshard_step, 4, root, 3, 4)     # 2 -> 4
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
