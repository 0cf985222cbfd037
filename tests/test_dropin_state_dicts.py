"""State dicts, the TorchRec way (issue 14, item 9).

Sharded and unsharded state_dicts have the same keys and logical shapes (``counters`` is [5] in
both), so an unsharded module's state_dict loads into a sharded one and a sharded one, made whole
with ``full_state_dict``, back into an unsharded one, on 2 gloo ranks; a shard's clock counts
the same training batches as the unsharded table's, so eviction scores and counters agree too.
And ``from_ebc_state_dict`` switches a trained TorchRec EBC / EC to dynamic tables: id k reads
row k's vector, outputs and further SGD training equal TorchRec's for ids < N.
"""

import pytest
import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    KeyedJaggedTensor,
)
from torchrec.modules.embedding_configs import PoolingType

from dist_helpers import ModelWith, run_ranks
from torchrec_ext import DynamicEmbeddingBagCollection, DynamicEmbeddingBagConfig, DynamicEmbeddingCollection
from torchrec_ext.modules import from_ebc_state_dict

WORLD, BATCH, KEYS = 2, 4, ["f1", "f2"]


def _tables():
    return [
        DynamicEmbeddingBagConfig(
            name="t1", embedding_dim=4, num_embeddings=256, feature_names=["f1"], eviction_policy="lru"
        ),
        DynamicEmbeddingBagConfig(
            name="t2", embedding_dim=4, num_embeddings=128, feature_names=["f2"], eviction_policy="lfu"
        ),
    ]


def _module():
    return DynamicEmbeddingBagCollection(_tables(), optimizer=torch.optim.Adagrad, optimizer_kwargs={"lr": 0.1})


def _batch(step, rank):
    gen = torch.Generator().manual_seed(step * 10 + rank)
    lengths = torch.randint(0, 3, (len(KEYS) * BATCH,), generator=gen)
    lengths[:BATCH] = 0 if step == 1 else lengths[:BATCH]  # a step where t1 gets no id at all
    values = torch.randint(-(1 << 40), 1 << 40, (int(lengths.sum()),), generator=gen) % 40
    return KeyedJaggedTensor(keys=KEYS, values=values, lengths=lengths, stride=BATCH)


def _global(kjts):
    per_key = [k.to_dict() for k in kjts]
    return KeyedJaggedTensor(
        keys=KEYS,
        values=torch.cat([jt[key].values() for key in KEYS for jt in per_key]),
        lengths=torch.cat([jt[key].lengths() for key in KEYS for jt in per_key]),
        stride=BATCH * len(kjts),
    )


def _by_id(state, table):
    """id -> (vector, score, optimizer state) of one table's rows."""
    p = f"embedding_bags.{table}."
    ids = state[p + "weight_id"].tolist()
    return {
        i: (state[p + "weight"][j], int(state[p + "metadata"][j]), state[p + "optimizer.momentum1"][j])
        for j, i in enumerate(ids)
    }


def _sharded(rank, world_size):
    from torchrec.distributed import DistributedModelParallel

    from torchrec_ext.distributed import get_sharders

    return DistributedModelParallel(ModelWith("ebc", _module()), device=torch.device("cpu"), sharders=get_sharders())


def _round_trip(rank, world_size):
    from torchrec_ext.distributed import full_state_dict

    # Scores and counters: the sharded module counts what the unsharded one counts.
    unsharded, dmp = _module(), _sharded(rank, world_size)
    for step in range(4):
        kjts = [_batch(step, r) for r in range(world_size)]
        unsharded(_global(kjts)).values().sum().backward()
        dmp(kjts[rank]).values().sum().backward()
    want, got = unsharded.state_dict(), dmp.module.ebc.state_dict()
    assert sorted(got) == sorted(want), (sorted(got), sorted(want))
    for key in want:  # the same logical shapes, counters [5] included
        assert tuple(got[key].size()) == tuple(want[key].shape), key
    full = full_state_dict(got)
    for table in ("t1", "t2"):
        torch.testing.assert_close(
            full[f"embedding_bags.{table}.counters"], want[f"embedding_bags.{table}.counters"], rtol=0, atol=0
        )
        mine, theirs = _by_id(full, table), _by_id(want, table)
        assert set(mine) == set(theirs)
        assert {i: v[1] for i, v in mine.items()} == {i: v[1] for i, v in theirs.items()}  # eviction scores

    # Unsharded -> sharded: a fresh sharded module loads the unsharded state_dict and computes
    # (and trains) as the unsharded module does.
    fresh = _sharded(rank, world_size)
    fresh.module.ebc.load_state_dict(want)
    reference = _module()
    reference.load_state_dict(want)
    for step in range(4, 6):
        kjts = [_batch(step, r) for r in range(world_size)]
        out, expected = fresh(kjts[rank]).values(), reference(_global(kjts)).values()
        torch.testing.assert_close(out, expected[rank * BATCH : (rank + 1) * BATCH])
        # TorchRec's output dist divides the tables' gradient by the world size: scale the loss back.
        (out.sum() * world_size).backward()
        expected.sum().backward()

    # Sharded -> unsharded: made whole on every rank, it loads into an unsharded module exactly.
    back = _module()
    back.load_state_dict(full_state_dict(fresh.module.ebc.state_dict()))
    after, expected_state = back.state_dict(), reference.state_dict()
    for table in ("t1", "t2"):
        torch.testing.assert_close(
            after[f"embedding_bags.{table}.counters"],
            expected_state[f"embedding_bags.{table}.counters"],
            rtol=0,
            atol=0,
        )
        mine, theirs = _by_id(after, table), _by_id(expected_state, table)
        assert set(mine) == set(theirs)
        for i in theirs:
            torch.testing.assert_close(mine[i][0], theirs[i][0])
            torch.testing.assert_close(mine[i][2], theirs[i][2])
            assert mine[i][1] == theirs[i][1]

    # The earlier sharded layout, counters [world_size, 4] (one row per rank), still loads.
    legacy = dict(full_state_dict(fresh.module.ebc.state_dict()))
    for table in ("t1", "t2"):
        key = f"embedding_bags.{table}.counters"
        assert not isinstance(legacy[key], ShardedTensor)
        legacy[key] = legacy[key][:4].repeat(world_size, 1)  # before the layout version too
    again = _sharded(rank, world_size)
    again.module.ebc.load_state_dict(legacy)
    kjts = [_batch(9, r) for r in range(world_size)]
    torch.testing.assert_close(again(kjts[rank]).values(), fresh(kjts[rank]).values())


def test_sharded_and_unsharded_state_dicts_share_shapes_and_load_into_each_other():
    run_ranks(_round_trip, WORLD)


# ------------------------------------------------------------------ migration from TorchRec

N1, N2 = 50, 30


def _stock_ebc():
    torch.manual_seed(0)
    return EmbeddingBagCollection(
        [
            EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=N1, feature_names=["f1", "f2"]),
            EmbeddingBagConfig(
                name="t2", embedding_dim=8, num_embeddings=N2, feature_names=["f2"], pooling=PoolingType.MEAN
            ),
        ]
    )


def _stock_ec():
    torch.manual_seed(0)
    return EmbeddingCollection(
        [
            EmbeddingConfig(name="t1", embedding_dim=4, num_embeddings=N1, feature_names=["f1", "f2"]),
            EmbeddingConfig(name="t2", embedding_dim=4, num_embeddings=N2, feature_names=["f3"]),
        ]
    )


def _dynamic_like(stock, capacity=64):
    """Our module with the stock module's tables, each of ``capacity`` rows, trained by SGD."""
    if isinstance(stock, EmbeddingBagCollection):
        configs = [
            EmbeddingBagConfig(
                name=c.name,
                embedding_dim=c.embedding_dim,
                num_embeddings=capacity,
                feature_names=list(c.feature_names),
                pooling=c.pooling,
            )
            for c in stock.embedding_bag_configs()
        ]
        return DynamicEmbeddingBagCollection(configs, optimizer="sgd", optimizer_kwargs={"lr": 0.1})
    configs = [
        EmbeddingConfig(
            name=c.name, embedding_dim=c.embedding_dim, num_embeddings=capacity, feature_names=list(c.feature_names)
        )
        for c in stock.embedding_configs()
    ]
    return DynamicEmbeddingCollection(configs, optimizer="sgd", optimizer_kwargs={"lr": 0.1})


def _old_ids_kjt(keys, step, high=N2):
    """Ids below every table's N (as the old pipeline's modulo made them)."""
    gen = torch.Generator().manual_seed(step)
    lengths = torch.randint(0, 4, (len(keys) * 3,), generator=gen)
    values = torch.randint(0, high, (int(lengths.sum()),), generator=gen)
    return KeyedJaggedTensor(keys=keys, values=values, lengths=lengths, stride=3)


def _flat(out):
    return out.values() if hasattr(out, "length_per_key") else torch.cat([jt.values() for jt in out.values()])


@pytest.mark.parametrize("make, keys", [(_stock_ebc, ["f1", "f2"]), (_stock_ec, ["f1", "f2", "f3"])], ids=["ebc", "ec"])
def test_from_ebc_state_dict_switches_a_trained_torchrec_module(make, keys):
    stock = make()
    optimizer = torch.optim.SGD(stock.parameters(), lr=0.1)
    for step in range(3):  # trained by TorchRec first
        optimizer.zero_grad()
        _flat(stock(_old_ids_kjt(keys, step))).sum().backward()
        optimizer.step()
    ours = from_ebc_state_dict(_dynamic_like(stock), stock.state_dict())
    assert ours.num_live_rows() == N1 + N2  # every row, trained or not: id k is row k
    ours.eval()
    torch.testing.assert_close(_flat(ours(_old_ids_kjt(keys, 7))), _flat(stock(_old_ids_kjt(keys, 7))))
    ours.train()
    for step in range(3, 6):  # and trains on as TorchRec's module with torch.optim.SGD does
        optimizer.zero_grad()
        got, want = _flat(ours(_old_ids_kjt(keys, step))), _flat(stock(_old_ids_kjt(keys, step)))
        torch.testing.assert_close(got, want)
        got.sum().backward()
        want.sum().backward()
        optimizer.step()
    assert ours.num_live_rows() == N1 + N2
    # An id >= N is an id of its own, not row id % N: zeros in eval (no row yet).
    ours.eval()
    beyond = KeyedJaggedTensor(
        keys=keys, values=torch.full((len(keys),), N1 + 3), lengths=torch.ones(len(keys), dtype=torch.int64)
    )
    assert not _flat(ours(beyond)).any()


def test_from_ebc_state_dict_under_a_prefix_and_through_a_model():
    """A whole model's state_dict: the module's prefix picks its tables."""
    stock = _stock_ebc()
    state = {f"sparse.ebc.{k}": v for k, v in stock.state_dict().items()}
    state["dense.weight"] = torch.zeros(2)
    ours = from_ebc_state_dict(_dynamic_like(stock), state, prefix="sparse.ebc.")
    ours.eval()
    kjt = _old_ids_kjt(["f1", "f2"], 0)
    torch.testing.assert_close(ours(kjt).values(), stock(kjt).values())


@pytest.mark.parametrize(
    "change, error, match",
    [
        (lambda s: s.pop("embedding_bags.t2.weight"), ValueError, r"lacks 'embedding_bags.t2.weight'"),
        (lambda s: s.update({"embedding_bags.t3.weight": torch.zeros(2, 4)}), ValueError, r"no table .* takes.*t3"),
        (
            lambda s: s.update({"embedding_bags.t2.weight": torch.zeros(N2, 5)}),
            ValueError,
            r"float \[N, 8\].*\[30, 5\]",
        ),
        (lambda s: s.update({"embedding_bags.t2.weight": torch.zeros(N2, 8, dtype=torch.int64)}), ValueError, "float"),
        (
            lambda s: s.update({"embedding_bags.t1.weight": torch.zeros(65, 4)}),
            ValueError,
            r"65 rows, more than .*capacity.* 64",
        ),
        (lambda s: s["embedding_bags.t2.weight"].__setitem__((3, 1), float("nan")), ValueError, "finite"),
    ],
    ids=["missing", "unknown", "dim", "dtype", "capacity", "nan"],
)
def test_from_ebc_state_dict_refuses_bad_state_and_changes_nothing(change, error, match):
    state = {k: v.clone() for k, v in _stock_ebc().state_dict().items()}
    change(state)
    ours = _dynamic_like(_stock_ebc())
    with pytest.raises(error, match=match):
        from_ebc_state_dict(ours, state)
    assert ours.num_live_rows() == 0  # no table loaded, the valid one included
    with pytest.raises(TypeError, match="DynamicEmbeddingBagCollection or DynamicEmbeddingCollection"):
        from_ebc_state_dict(_stock_ebc(), state)


@pytest.mark.parametrize("make, keys", [(_stock_ebc, ["f1", "f2"]), (_stock_ec, ["f1", "f2", "f3"])], ids=["ebc", "ec"])
def test_load_state_dict_of_a_torchrec_module_names_from_ebc_state_dict(make, keys):
    """What a migrating user tries first, ``ours.load_state_dict(torchrec_module.state_dict())``,
    is refused (strict) or warned about (strict=False) naming from_ebc_state_dict, the tables
    unchanged; that function then gives TorchRec's outputs."""
    stock = make()
    ours = _dynamic_like(stock)
    ours(_old_ids_kjt(keys, 0))  # some live rows
    before = {k: v.clone() for k, v in ours.state_dict().items()}

    def unchanged():
        after = ours.state_dict()
        return after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())

    with pytest.raises(RuntimeError, match=r"'weight' but no 'weight_id'.*from_ebc_state_dict"):
        ours.load_state_dict(stock.state_dict())
    assert unchanged()
    with pytest.warns(UserWarning, match=r"from_ebc_state_dict.*not loaded"):
        result = ours.load_state_dict(stock.state_dict(), strict=False)
    assert any(k.endswith("weight_id") for k in result.missing_keys)
    assert unchanged()
    from_ebc_state_dict(ours, stock.state_dict())
    ours.eval()
    torch.testing.assert_close(_flat(ours(_old_ids_kjt(keys, 7))), _flat(stock(_old_ids_kjt(keys, 7))))
