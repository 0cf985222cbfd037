"""New rows written by the fused backward (CPU) instead of by the lookup: never visible.

The oracle is the same module writing new rows at lookup time (``defer_new_rows = False``, the
GPU path): every output, row, optimizer state and counter must be bit-identical, through
eviction, admission, TTL, forwards without backward, and several forwards before one backward.
"""

import copy

import pytest
import torch
from torchrec import KeyedJaggedTensor
from torchrec.optim import RowWiseAdagrad

from torchrec_ext import (
    DynamicEmbeddingBagCollection,
    DynamicEmbeddingBagConfig,
    DynamicEmbeddingCollection,
    DynamicEmbeddingConfig,
)
from torchrec_ext.modules.deltas import delta_token

_OPTIMIZERS = [
    (torch.optim.SGD, {"lr": 0.3}),
    (torch.optim.Adagrad, {"lr": 0.2, "initial_accumulator_value": 0.1}),
    (RowWiseAdagrad, {"lr": 0.2}),
    (torch.optim.Adam, {"lr": 0.05, "weight_decay": 0.1}),
]
_TABLE_OPTIONS = [
    {},  # capacity 64 < the id pool: new ids evict
    {"admit_after": 2},
    {"ttl_steps": 2},
    {"eviction_policy": "lfu"},
]


def _pair(make):
    deferred, eager = make(), make()
    eager._tables.defer_new_rows = False
    return deferred, eager


def _ebc(options, optimizer=torch.optim.Adagrad, kwargs=None):
    configs = [
        DynamicEmbeddingBagConfig(name="a", embedding_dim=8, num_embeddings=64, feature_names=["f1", "f2"], **options),
        DynamicEmbeddingBagConfig(name="b", embedding_dim=4, num_embeddings=64, feature_names=["f3"], **options),
    ]
    return lambda: DynamicEmbeddingBagCollection(
        configs, is_weighted=True, optimizer=optimizer, optimizer_kwargs=kwargs or {"lr": 0.1}
    )


def _batch(step, keys=("f1", "f2", "f3"), batch_size=6, pool=200, weighted=True):
    g = torch.Generator().manual_seed(step)
    lengths = torch.randint(0, 5, (len(keys) * batch_size,), generator=g)
    n = int(lengths.sum())
    return KeyedJaggedTensor(
        keys=list(keys),
        values=torch.randint(0, pool, (n,), generator=g),
        lengths=lengths,
        weights=torch.rand(n, generator=g) if weighted else None,
    )


def _assert_same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


@pytest.mark.parametrize("options", _TABLE_OPTIONS, ids=lambda o: ",".join(o) or "evicting")
@pytest.mark.parametrize("optimizer,kwargs", _OPTIMIZERS, ids=lambda x: getattr(x, "__name__", ""))
def test_training_is_identical_to_writing_new_rows_at_lookup(options, optimizer, kwargs):
    deferred, eager = _pair(_ebc(options, optimizer, kwargs))
    for step in range(8):
        batch = _batch(step)
        out_d, out_e = deferred(batch).values(), eager(batch).values()
        assert torch.equal(out_d, out_e)
        assert deferred._tables._new_rows is not None and not deferred._tables._new_rows.written
        (out_d * torch.arange(out_d.numel()).view_as(out_d).sin()).sum().backward()
        (out_e * torch.arange(out_e.numel()).view_as(out_e).sin()).sum().backward()
        assert deferred._tables._new_rows.written  # the backward wrote them
    _assert_same_state(deferred, eager)


def test_forward_without_backward_then_state_dict_eval_and_training():
    deferred, eager = _pair(_ebc({}))
    for m in (deferred, eager):
        m(_batch(0)).values().sum().backward()
        m(_batch(1))  # grad enabled, a backward could follow, but none does
        m.eval()
    assert torch.equal(deferred(_batch(1)).values(), eager(_batch(1)).values())  # the next lookup writes them
    for m in (deferred, eager):
        m.train()
        m(_batch(2))
    _assert_same_state(deferred, eager)  # so does state_dict
    for m in (deferred, eager):
        m.train()
    for step in (3, 4):
        for m in (deferred, eager):
            m(_batch(step)).values().sum().backward()
    _assert_same_state(deferred, eager)


def test_several_forwards_before_one_backward():
    # Capacity above the id pool: the second lookup must not evict the first's rows mid-step.
    configs = [DynamicEmbeddingBagConfig(name="a", embedding_dim=8, num_embeddings=512, feature_names=["f1"])]
    deferred, eager = _pair(
        lambda: DynamicEmbeddingBagCollection(configs, optimizer="adam", optimizer_kwargs={"lr": 0.05})
    )
    for step in range(3):
        losses = []
        for m in (deferred, eager):
            first = m(_batch(2 * step, keys=("f1",), weighted=False))
            second = m(_batch(2 * step + 1, keys=("f1",), weighted=False))
            losses.append(first.values().sum() + 2 * second.values().sum())
        assert torch.equal(losses[0], losses[1])
        for loss in losses:
            loss.backward()
        _assert_same_state(deferred, eager)


def test_no_grad_and_frozen_training_forwards_write_rows_at_lookup():
    deferred, _ = _pair(_ebc({}))
    with torch.no_grad():
        deferred(_batch(0))
    assert deferred._tables._new_rows is None
    for p in deferred.parameters():
        p.requires_grad_(False)
    deferred(_batch(1))
    assert deferred._tables._new_rows is None


def test_sequence_collection_is_identical_to_writing_new_rows_at_lookup():
    configs = [
        DynamicEmbeddingConfig(name="a", embedding_dim=8, num_embeddings=64, feature_names=["f1", "f2"]),
        DynamicEmbeddingConfig(name="b", embedding_dim=8, num_embeddings=32, feature_names=["f3"]),
    ]
    deferred, eager = _pair(
        lambda: DynamicEmbeddingCollection(configs, optimizer="rowwise_adagrad", optimizer_kwargs={"lr": 0.1})
    )
    for step in range(6):
        batch = _batch(step, weighted=False)
        outs = [m(batch) for m in (deferred, eager)]
        for key in outs[0]:
            assert torch.equal(outs[0][key].values(), outs[1][key].values())
        for out in outs:
            sum((jt.values() * (i + 1)).sum() for i, jt in enumerate(out.values())).backward()
    _assert_same_state(deferred, eager)


def _weights_and_states(tables):
    return [tables.weights.clone()] + [s.clone() for s in tables.states]


# Each public reader of the rows, called while a lookup's new rows are pending (a forward whose
# backward has not run): it must see them written, as the module writing them at lookup sees them.
_READERS = {
    "table_state": lambda tables: tables.table_state(0)["weight"],
    "whole_table_state": lambda tables: tables.whole_table_state(0)["counters"],
    "delta_token": delta_token,
    "set_optimizer": lambda tables: tables.set_optimizer(tables.optimizer),
    "apply": lambda tables: tables.apply(lambda t: t),
    "deepcopy": copy.deepcopy,
    "load_states": lambda tables: tables.load_states({1: tables.table_state(1)}, "test"),
}


@pytest.mark.parametrize("reader", sorted(_READERS))
def test_every_public_reader_writes_the_pending_rows_first(reader):
    deferred, eager = _pair(_ebc({}))
    for m in (deferred, eager):
        m(_batch(0)).values().sum().backward()
        m(_batch(1))  # pending on the deferred module
    assert deferred._tables._new_rows is not None and not deferred._tables._new_rows.written
    _READERS[reader](deferred._tables)
    assert deferred._tables._new_rows is None  # written by the reader's guard
    for a, b in zip(_weights_and_states(deferred._tables), _weights_and_states(eager._tables)):
        assert torch.equal(a, b)
