"""A HashTable moved to a device (``clone(device)``, what a module's ``.to()`` does to its indexes)
copies its arrays as they are, where a move used to export the table and restore it into a new
one (``state_dict`` then ``load_state_dict``): so one index is allocated on the target, none is
built. Oracles: that old path (the same keys at the same rows with the same scores, counters and
placement) and the dict model (``reference.ReferenceHashTable``), fed the same calls as the moved
table and the rebuilt one for a few steps after the move. Tables with evictions and erased keys,
a grown one (slots mapped to rows), and a full one with stashed keys, one of them erased (a stale
stash entry, which the copy keeps and the rebuild drops: the two must still behave alike)."""

import random

import pytest
import torch

from test_device_move_state import _allocated
from test_hash_table_grown import _grown_pair
from test_hash_table_stash import _stashed_table
from torchrec_ext import HashTable, ops
from torchrec_ext.reference import ReferenceHashTable
from torchrec_ext.table import _ARRAYS


def _churned(policy):
    """A 300-row table past full (evictions), with a few keys erased, and its model."""
    table, model = HashTable(300, policy=policy), ReferenceHashTable(300, policy)
    rng = random.Random(policy)
    for step in range(6):
        batch = [rng.randrange(-1000, 1000) for _ in range(150)]
        if policy.startswith("epoch") and step == 3:
            table.set_epoch(2)
            model.epoch = 2
        assert table.find_or_insert(torch.tensor(batch)).rows.tolist() == model.upsert(batch)[0]
        assert table.erase(torch.tensor(batch[:4])).tolist() == model.erase(batch[:4])
    return table, model


def _grown():
    return _grown_pair(96, "lru", torch.Generator().manual_seed(3))


def _stashed():
    table, model, _ = _stashed_table(2048, "lru", seed=5)
    stashed = table._stash_entries()[0][:1]
    assert table.erase(stashed).tolist() == model.erase(stashed.tolist()) == [True]  # a stale entry now
    return table, model


SOURCES = {
    "lru": lambda: _churned("lru"),
    "epoch_lfu": lambda: _churned("epoch_lfu"),
    "grown": _grown,
    "stashed": _stashed,
}


def _rebuilt(table: HashTable, device) -> HashTable:
    """How a move rebuilt an index before: a new table, then the old one's state loaded into it."""
    state = table.state_dict()
    twin = HashTable(table.capacity, policy=table.policy, device=device, mapped_rows=table._slot_rows is not None)
    twin.load_state_dict({k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in state.items()})
    return twin


def _assert_same_tables(a: HashTable, b: HashTable, model: ReferenceHashTable):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]) if isinstance(sa[name], torch.Tensor) else sa[name] == sb[name], name
    assert list(zip(*[sa[k].tolist() for k in ("keys", "rows", "scores")])) == sorted(
        model.export(), key=lambda entry: entry[1]
    )
    assert (a.size(), a.clock, a.epoch) == (b.size(), b.clock, b.epoch) == (model.size(), model.clock, model.epoch)


@pytest.mark.parametrize("source", sorted(SOURCES))
def test_a_moved_table_equals_the_rebuilt_one_and_the_model_for_steps_after(source, device):
    table, model = SOURCES[source]()
    moved, rebuilt = table.clone(device), _rebuilt(table, device)
    assert moved.device.type == device and all(
        getattr(moved, name) is None or getattr(moved, name).device == moved.device for name in _ARRAYS
    )
    _assert_same_tables(moved, rebuilt, model)
    held = moved.state_dict()["keys"]
    assert torch.equal(moved.find(held)[0], rebuilt.find(held)[0])  # every key's row
    assert moved.stash_size() == rebuilt.stash_size()
    rng = random.Random(source)
    universe = held.tolist() + [rng.randrange(-(2**63), 2**63) for _ in range(moved.capacity)]
    evicted = 0
    for step in range(5):  # new keys evict by the scores carried over: the eviction order
        batch = [rng.choice(universe) for _ in range(moved.capacity // 3)]
        keys = torch.tensor(batch, device=device)
        got, again, want = moved.find_or_insert(keys), rebuilt.find_or_insert(keys), model.upsert(batch)
        evicted += len(want[2])
        for name, g, a, w in zip(("rows", "inserted", "evicted keys", "evicted rows"), got, again, want):
            assert g.tolist() == a.tolist() == w, f"step {step}: {name}"
        assert moved.erase(keys[:3]).tolist() == rebuilt.erase(keys[:3]).tolist() == model.erase(batch[:3])
        _assert_same_tables(moved, rebuilt, model)
    assert evicted > 0  # the order of the carried scores was put to use
    assert table.state_dict()["keys"].device.type == "cpu"  # the source is left as it was


@pytest.mark.parametrize("source", sorted(SOURCES))
def test_a_move_back_to_the_cpu_gives_the_same_table(source, device):
    table, model = SOURCES[source]()
    back = table.clone(device).clone("cpu")
    assert back.device == torch.device("cpu")
    _assert_same_tables(back, table, model)


@pytest.mark.parametrize("source", sorted(SOURCES))
def test_a_move_allocates_one_index_and_builds_none(source, monkeypatch):
    """The move's allocations are the index's arrays once (the rebuild made an empty table, an
    export and a second set of arrays); no export, restore or insert runs."""
    table, _ = SOURCES[source]()
    calls = []
    for name in ("hash_export", "hash_restore", "hash_upsert", "hash_upsert_fixed"):
        real = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, real=real, name=name: calls.append(name) or real(*a))
    assert _allocated(lambda: table.clone("cpu")) == table.metadata_bytes() + table.size_tensor().nbytes
    assert calls == []
    assert _allocated(lambda: _rebuilt(table, "cpu")) > 2 * table.metadata_bytes()  # what the move no longer pays
    assert "hash_restore" in calls


def test_a_move_to_a_device_without_kernels_is_refused_and_names_it():
    table = HashTable(40)
    with pytest.raises(ValueError, match=r"HashTable.clone: device meta has no torchrec_ext kernels"):
        table.clone("meta")
    with pytest.raises(ValueError, match=r"HashTable.clone: device must be a torch.device .*got 'nowhere'"):
        table.clone("nowhere")
