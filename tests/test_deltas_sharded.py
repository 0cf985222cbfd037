"""Deltas of a sharded source (2 gloo ranks, each exporting its own share): an unsharded
replica and sharded replicas on 1 and 2 ranks, each loading the source's checkpoint and applying every
share of every delta in order, hold the source's live rows bit for bit (oracle: the source's
full state_dict at the end, as id -> vector maps), through LRU evictions and TTL expiry."""

import json
import os

import pytest
import torch
import torch.distributed as dist
from torchrec import KeyedJaggedTensor

from dist_helpers import ModelWith, dmp_of, run_ranks
from torchrec_ext import DynamicEmbeddingBagCollection, DynamicEmbeddingBagConfig
from torchrec_ext.modules import DeltaError, DeltaToken, load_delta, save_delta

BATCH, KEYS, ROUNDS = 8, ["f1", "f2"], 5


def _configs(t1_capacity=64):
    return [
        DynamicEmbeddingBagConfig(
            name="t1", embedding_dim=8, num_embeddings=t1_capacity, feature_names=["f1"], eviction_policy="lru"
        ),
        DynamicEmbeddingBagConfig(name="t2", embedding_dim=4, num_embeddings=256, feature_names=["f2"], ttl_steps=3),
    ]


def _batch(step, rank):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    lengths = torch.randint(0, 4, (len(KEYS) * BATCH,), generator=gen)
    per_key = lengths.view(len(KEYS), BATCH).sum(1).tolist()
    f1 = torch.randint(0, 300, (per_key[0],), generator=gen) * 104729 - 11  # more ids than rows: evictions
    f2 = torch.randint(0, 30, (per_key[1],), generator=gen) + 7 * step  # drifting: old ids expire
    return KeyedJaggedTensor(keys=KEYS, values=torch.cat([f1, f2]), lengths=lengths, stride=BATCH)


def _dmp(world_size, optimizer="adagrad", t1_capacity=64, t1_columns=None):
    """t1 row_wise, or column_wise in shards of ``t1_columns`` columns (one per rank)."""
    from torchrec.distributed.sharding_plan import column_wise, row_wise, table_wise

    from torchrec_ext.distributed import DynamicEmbeddingBagCollectionSharder

    kwargs = {"optimizer": optimizer, "optimizer_kwargs": {"lr": 0.1}} if optimizer else {}
    model = ModelWith("ebc", DynamicEmbeddingBagCollection(_configs(t1_capacity), **kwargs))
    gens = {
        "t1": row_wise(compute_kernel="customized_kernel"),
        "t2": table_wise(rank=world_size - 1, compute_kernel="customized_kernel"),
    }
    if t1_columns:
        gens["t1"] = column_wise(size_per_rank=t1_columns, compute_kernel="customized_kernel")
    return dmp_of(model, "ebc", gens, DynamicEmbeddingBagCollectionSharder(), world_size)


def _full(dmp):
    from torchrec_ext.distributed import full_state_dict

    return dict(full_state_dict(dmp.module.ebc.state_dict()))


def _source(rank, world_size, root, t1_columns=None):
    dmp = _dmp(world_size, t1_columns=t1_columns)
    ebc = dmp.module.ebc
    for step in range(3):
        dmp(_batch(step, rank)).values().sum().backward()
    base = _full(dmp)  # collective: every rank gets the whole state
    token = ebc.delta_token()
    if rank == 0:
        torch.save(base, os.path.join(root, "base.pt"))
    with open(os.path.join(root, f"token_{rank}.json"), "w") as f:
        json.dump(token.to_dict(), f)
    tombstones = 0
    for k in range(ROUNDS):
        for step in (3 + 2 * k, 4 + 2 * k):
            dmp(_batch(step, rank)).values().sum().backward()
        delta = ebc.export_delta(since=token)
        # (a column table's whole rows come in its first shard's rank's share)
        shares = ({"t1"}, {"t2"}) if t1_columns else ({"t1"}, {"t1", "t2"})
        assert delta.source["rank"] == rank and set(delta.tables) == shares[rank]
        tombstones += sum(t.tombstones.numel() for t in delta.tables.values())
        save_delta(delta, os.path.join(root, f"delta_{k}_{rank}.delta"))
        previous, token = token, delta.token
    final = _full(dmp)
    if t1_columns:  # with optimizer state: the shards' columns of it joined as the weights' are
        delta = ebc.export_delta(since=previous, include_optimizer_state=True, include_scores=True)
        if rank == 0:
            t1 = delta.tables["t1"]
            where = {int(i): n for n, i in enumerate(final["embedding_bags.t1.weight_id"].tolist())}
            rows = torch.tensor([where[int(i)] for i in t1.ids])
            assert t1.ids.numel() and t1.weights.shape[1] == 8 and t1.optimizer and t1.scores is not None
            assert torch.equal(t1.weights, final["embedding_bags.t1.weight"][rows])
            for key, value in t1.optimizer.items():
                assert torch.equal(value, final[f"embedding_bags.t1.optimizer.{key}"][rows]), key
    counts = [None] * world_size
    dist.all_gather_object(counts, tombstones)
    if rank == 0:
        assert all(c > 0 for c in counts), counts
        torch.save(final, os.path.join(root, "final.pt"))


def _tokens(root, world_size=2):
    out = []
    for r in range(world_size):
        with open(os.path.join(root, f"token_{r}.json")) as f:
            out.append(DeltaToken.from_dict(json.load(f)))
    return out


def _by_id(state, table):
    ids, vectors = state[f"embedding_bags.{table}.weight_id"], state[f"embedding_bags.{table}.weight"]
    order = ids.argsort()
    return ids[order], vectors[order]


def _assert_same(got, want):
    for table in ("t1", "t2"):
        (gi, gv), (wi, wv) = _by_id(got, table), _by_id(want, table)
        assert torch.equal(gi, wi), table
        assert torch.equal(gv, wv), table


def _apply_all(replica, root):
    for k in range(ROUNDS):
        for r in (1, 0):  # a step's shares in any order: their ids are disjoint
            replica.apply_delta(load_delta(os.path.join(root, f"delta_{k}_{r}.delta")))


def _sharded_replica(rank, world_size, root, t1_columns=None):
    dmp = _dmp(world_size, optimizer=None, t1_capacity=128, t1_columns=t1_columns)
    ebc = dmp.module.ebc
    base = torch.load(os.path.join(root, "base.pt"))  # sharded without optimizer: SGD, no optimizer state
    ebc.load_state_dict({k: v for k, v in base.items() if ".optimizer." not in k})
    ebc.follow_deltas(_tokens(root))
    try:
        ebc.apply_delta(load_delta(os.path.join(root, "delta_1_0.delta")))
        raise AssertionError("a delta after a missing one was applied")
    except DeltaError as e:
        assert "missing" in str(e)
    if world_size == 2 and not t1_columns:
        _refused_on_one_rank_applies_nowhere(dmp, root)
    if t1_columns:  # a column replica takes whole rows only (not a shard's columns)
        delta = load_delta(os.path.join(root, "delta_0_0.delta"))
        delta.tables["t1"].weights = delta.tables["t1"].weights[:, :3].contiguous()
        try:
            ebc.apply_delta(delta)
            raise AssertionError("a delta of partial rows was applied to a column-sharded table")
        except DeltaError as e:
            assert "must hold whole rows [n, 8], got weights of shape" in str(e), str(e)
    _apply_all(ebc, root)
    _assert_same(_full(dmp), torch.load(os.path.join(root, "final.pt")))


def _refused_on_one_rank_applies_nowhere(dmp, root):
    """A share only rank 1 must refuse (a tombstone of an id it does not hold, routed to it):
    rank 0, which could apply its part, applies nothing either (all-or-nothing across ranks)."""
    from torchrec_ext.distributed.sharded_state import owned_mask

    ebc = dmp.module.ebc
    delta = load_delta(os.path.join(root, "delta_0_0.delta"))  # source rank 0: ids routed to rank 0
    candidates = torch.arange(10**12, 10**12 + 64, dtype=torch.int64)
    stranger = candidates[owned_mask(candidates, -1, 1, 2)][:1]
    table = delta.tables["t1"]
    table.tombstones = torch.cat([table.tombstones, stranger])
    assert table.ids.numel() and owned_mask(table.ids, -1, 0, 2).any()  # rank 0 has rows to take from it
    before = _full(dmp)
    try:
        ebc.apply_delta(delta)
        raise AssertionError("a delta refused on rank 1 was applied")
    except DeltaError as e:
        assert "does not hold" in str(e) or "refused on rank(s) [1]" in str(e), str(e)
    _assert_same(_full(dmp), before)


@pytest.mark.parametrize("source_columns,replica_columns", [(None, None), ([3, 5], [5, 3])])
def test_sharded_source_replicas_unsharded_and_on_one_and_two_ranks(tmp_path, source_columns, replica_columns):
    """t1 row-wise, or split by columns (3 + 5) on the source: then its first shard's rank exports
    whole rows (gathered from both shards), and the 2-rank replica splits it otherwise (5 + 3)."""
    root = str(tmp_path)
    run_ranks(_source, 2, root, source_columns)
    base, final = torch.load(os.path.join(root, "base.pt")), torch.load(os.path.join(root, "final.pt"))

    replica = DynamicEmbeddingBagCollection(_configs(t1_capacity=256))
    replica.load_state_dict(base)
    replica.follow_deltas(_tokens(root))
    _apply_all(replica, root)
    _assert_same(replica.state_dict(), final)

    run_ranks(_sharded_replica, 1, root)
    run_ranks(_sharded_replica, 2, root, replica_columns)  # each rank keeps the rows (columns) it holds of every share


# ---------------------------------------------------------------------- full tables

FULL_CAPACITY, FULL_ROUNDS = 256, 6


def _crowding_batch(step, rank):
    """f1: 128 ids a step per rank from 16 tables' worth: t1 fills, then evicts every step."""
    gen = torch.Generator().manual_seed(5000 + 1000 * step + rank)
    lengths = torch.cat([torch.full((BATCH,), 16), torch.randint(0, 4, (BATCH,), generator=gen)])
    f1 = torch.randint(0, 16 * FULL_CAPACITY, (16 * BATCH,), generator=gen) * 104729 - 11
    f2 = torch.randint(0, 30, (int(lengths[BATCH:].sum()),), generator=gen) + 7 * step
    return KeyedJaggedTensor(keys=KEYS, values=torch.cat([f1, f2]), lengths=lengths, stride=BATCH)


def _full_source(rank, world_size, root):
    dmp = _dmp(world_size, t1_capacity=FULL_CAPACITY)
    ebc = dmp.module.ebc
    for step in range(6):
        dmp(_crowding_batch(step, rank)).values().sum().backward()
    base = _full(dmp)
    assert base["embedding_bags.t1.weight_id"].numel() == FULL_CAPACITY  # every rank's share is full
    token = ebc.delta_token()
    if rank == 0:
        torch.save(base, os.path.join(root, "base.pt"))
    with open(os.path.join(root, f"token_{rank}.json"), "w") as f:
        json.dump(token.to_dict(), f)
    for k in range(FULL_ROUNDS):
        dmp(_crowding_batch(6 + k, rank)).values().sum().backward()
        delta = ebc.export_delta(since=token)
        assert delta.tables["t1"].tombstones.numel() > 0
        save_delta(delta, os.path.join(root, f"delta_{k}_{rank}.delta"))
        token = delta.token
        final = _full(dmp)
        if rank == 0:
            assert final["embedding_bags.t1.weight_id"].numel() == FULL_CAPACITY
            torch.save(final, os.path.join(root, f"after_{k}.pt"))


def _apply_full_rounds(replica, root, state):
    """Applies every share, round by round; the replica holds the source's rows after each."""
    for k in range(FULL_ROUNDS):
        for r in (0, 1):
            replica.apply_delta(load_delta(os.path.join(root, f"delta_{k}_{r}.delta")))
        _assert_same(state(), torch.load(os.path.join(root, f"after_{k}.pt")))


def _full_sharded_replica(rank, world_size, root):
    from torchrec_ext.modules import delta_placement

    replaced = []
    exact = delta_placement.place_exactly
    delta_placement.place_exactly = lambda *a: replaced.append(1) or exact(*a)
    dmp = _dmp(world_size, optimizer=None, t1_capacity=FULL_CAPACITY)  # the source's capacity
    ebc = dmp.module.ebc
    base = torch.load(os.path.join(root, "base.pt"))
    ebc.load_state_dict({k: v for k, v in base.items() if ".optimizer." not in k})
    ebc.follow_deltas(_tokens(root))
    _apply_full_rounds(ebc, root, lambda: _full(dmp))
    counts = [None] * world_size
    dist.all_gather_object(counts, len(replaced))
    assert sum(counts) > 0, "no delta needed a re-placement: the test does not test it"


def test_replicas_of_a_full_sharded_table_follow_every_delta(tmp_path, monkeypatch):
    """Each source rank's share of t1 is full and evicts every step, so its buckets hold what its
    history left there: replicas at the same total capacity (unsharded, on 1 and on 2 ranks)
    re-place their tables where a greedy insert of a share's new ids finds their buckets full,
    and hold the source's rows bit for bit after every round."""
    from torchrec_ext.modules import delta_placement

    root = str(tmp_path)
    run_ranks(_full_source, 2, root)
    replaced = []
    exact = delta_placement.place_exactly
    monkeypatch.setattr(delta_placement, "place_exactly", lambda *a: replaced.append(1) or exact(*a))
    replica = DynamicEmbeddingBagCollection(_configs(t1_capacity=FULL_CAPACITY))
    replica.load_state_dict(torch.load(os.path.join(root, "base.pt")))
    replica.follow_deltas(_tokens(root))
    _apply_full_rounds(replica, root, replica.state_dict)
    assert replaced, "no delta needed a re-placement: the test does not test it"

    run_ranks(_full_sharded_replica, 1, root)  # another world size
    run_ranks(_full_sharded_replica, 2, root)
