"""A module's training step with every table's upsert in one call (``batched_upsert``, the
default; issue 13 item 6): the same outputs, tables and counters as the per-table calls, for
every table option the step handles (ttl, admission, growth, lfu, half rows, the delta log), and a
number of dispatched ops per step that does not grow with the table count."""

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from test_sync_budget import VARIANTS, _batch, _configs, _step
from torchrec_ext import DynamicEmbeddingBagCollection, DynamicEmbeddingBagConfig, DynamicEmbeddingCollection
from torchrec_ext.modules.admission import CounterAdmission
from torchrec_ext.modules.configs import DynamicEmbeddingConfig

TABLES = 6


class _CountOps(TorchDispatchMode):
    """Counts every op dispatched (ATen and torchrec_ext): on a GPU each is at least a launch."""

    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _module(options, batched, tables=TABLES, new_rows=(False, True), cls=DynamicEmbeddingBagCollection):
    module = cls(_configs(options, tables=tables), optimizer="adagrad")
    module._tables.defer_new_rows, module._tables.flat_init = new_rows
    module._tables.batched_upsert = batched
    return module


def _state(module):
    tables = module._tables
    return [t.clone() for t in (tables.weights, *tables.states, tables.counters.counts)] + [
        x.clone()
        for index in tables.indexes
        for x in (index._digests, index._slot_keys, index._slot_scores, index._size)
    ]


@pytest.mark.parametrize("new_rows", [(False, True), (True, False)], ids=["one_init_call", "deferred_rows"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_batched_step_equals_per_table_step(variant, new_rows, monkeypatch):
    monkeypatch.setattr(CounterAdmission, "compact_on_cpu", False)
    per_table = _module(VARIANTS[variant], False, new_rows=new_rows)
    batched = _module(VARIANTS[variant], True, new_rows=new_rows)
    for step in range(8):
        kjt = _batch(step, TABLES)
        outs = [m(kjt) for m in (per_table, batched)]
        for name in outs[0].keys():
            assert torch.equal(outs[0][name], outs[1][name]), f"step {step}: output {name}"
        for out in outs:
            out.values().sum().backward()
        for i, (a, b) in enumerate(zip(_state(per_table), _state(batched))):
            assert torch.equal(a, b), f"step {step}: state {i}"
    assert per_table._tables.table_stats() == batched._tables.table_stats()


@pytest.mark.parametrize(
    "options",
    [{"eviction_policy": "lru"}, {"ttl_steps": 2}, {"admission": "counter", "admit_after": 2, "initial_capacity": 8}],
    ids=["lru", "ttl", "admission_growth"],
)
def test_batched_step_with_a_delta_log_equals_per_table_step(options, monkeypatch):
    """The delta log lists each table's inserted, evicted and written rows from the one call's
    results; tables growing for their admitted ids relayout before any table is upserted."""
    monkeypatch.setattr(CounterAdmission, "compact_on_cpu", False)
    modules = [_module(options, batched) for batched in (False, True)]
    tokens = [m.delta_token() for m in modules]
    for step in range(8):
        if step == 3:  # tables full by now: ids live at this token are evicted after it
            tokens = [m.delta_token() for m in modules]
        kjt = _batch(step, TABLES)
        for m in modules:
            m(kjt).values().sum().backward()
        for a, b in zip(_state(modules[0]), _state(modules[1])):
            assert torch.equal(a, b), f"step {step}"
    deltas = [
        m.export_delta(token, include_optimizer_state=True, include_scores=True) for m, token in zip(modules, tokens)
    ]
    assert deltas[0].tables.keys() == deltas[1].tables.keys()
    for name, table in deltas[0].tables.items():
        other = deltas[1].tables[name]
        for field in ("ids", "weights", "tombstones", "scores"):
            assert torch.equal(getattr(table, field), getattr(other, field)), f"{name}: {field}"
    if "initial_capacity" not in options:  # (growing tables make room instead of evicting)
        assert any(t.tombstones.numel() for t in deltas[0].tables.values())  # removals were logged


def test_batched_sequence_module_step_equals_per_table_step():
    configs = [
        DynamicEmbeddingConfig(
            name=f"t{i}",
            embedding_dim=8,
            num_embeddings=64,
            feature_names=[f"f{i}"],
            ttl_steps=3,
            eviction_policy="lfu",
        )
        for i in range(TABLES)
    ]
    modules = [DynamicEmbeddingCollection(configs, optimizer="adam") for _ in range(2)]
    modules[0]._tables.batched_upsert, modules[1]._tables.batched_upsert = False, True
    for step in range(6):
        kjt = _batch(step, TABLES)
        outs = [m(kjt) for m in modules]
        for name in outs[0]:
            assert torch.equal(outs[0][name].values(), outs[1][name].values())
        for out in outs:
            sum(v.values().sum() for v in out.values()).backward()
    for a, b in zip(_state(modules[0]), _state(modules[1])):
        assert torch.equal(a, b)


def _ops_per_step(tables, batched):
    module = _module({}, batched, tables=tables)
    _step(module, _batch(0, tables))  # warm-up: cached layouts
    with _CountOps() as counted:
        _step(module, _batch(1, tables))
    return counted.ops


def test_dispatched_ops_per_step_do_not_grow_with_the_table_count():
    """With the GPU's step path (one init call, one upsert call), a step of 26 tables dispatches
    exactly the ops of a step of 2; per-table upserts dispatch more with more tables."""
    few, many = _ops_per_step(2, True), _ops_per_step(26, True)
    assert few == many, {op: (few[op], many[op]) for op in set(few) | set(many) if few[op] != many[op]}
    assert many["torchrec_ext.hash_upsert_tables.default"] == 1
    assert sum(_ops_per_step(26, False).values()) > sum(many.values())


def test_tiered_tables_hold_every_tables_rows_after_one_batched_upsert():
    """The tiered tables follow the upsert with their caches' work (``_rows_for_tables``): one
    upsert of every table, then each table's rows held in its cache (on a GPU: one copy of the
    rows to the host); ``batched_upsert = False`` goes table by table, with the same rows."""
    configs = [
        DynamicEmbeddingBagConfig(
            name=f"t{i}",
            embedding_dim=4,
            num_embeddings=64,
            feature_names=[f"f{i}"],
            backing="host",
            cache_load_factor=0.5,
        )
        for i in range(3)
    ]
    outputs = {}
    for batched in (True, False):
        module = DynamicEmbeddingBagCollection(configs, optimizer="sgd")
        module._tables.batched_upsert = batched
        assert module._tables._batched_upsert() == batched
        with _CountOps() as counted:
            _step(module, _batch(1, 3))
        assert counted.ops["torchrec_ext.hash_upsert_fixed.default"] == (0 if batched else 3)
        assert counted.ops["torchrec_ext.hash_upsert_tables.default"] == (1 if batched else 0)
        caches = module._tables.caches
        assert sum(int((cache.row_of >= 0).sum()) for cache in caches) == module.num_live_rows() > 0
        outputs[batched] = module(_batch(2, 3)).values()
    assert torch.equal(outputs[True], outputs[False])
