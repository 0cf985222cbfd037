"""Loading state: a fresh module with a fused optimizer loads a trained checkpoint (the resume
flow), a module without one loads it for eval, and a bad state (module or HashTable) raises a
clear error naming the key and value and leaves every table as it was (all or nothing)."""

import re

import pytest
import torch
from torchrec import KeyedJaggedTensor
from torchrec.optim import RowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

from torchrec_ext import DynamicEmbeddingBagCollection, DynamicEmbeddingBagConfig, HashTable

KEYS = ["f1", "f2"]


def _configs():
    return [
        DynamicEmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=128, feature_names=["f1"]),
        DynamicEmbeddingBagConfig(
            name="t2",
            embedding_dim=4,
            num_embeddings=64,
            feature_names=["f2"],
            eviction_policy="lfu",
            ttl_steps=50,
            admit_after=2,
        ),
    ]


def _batch(seed, batch_size=8):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (len(KEYS) * batch_size,), generator=gen)
    values = torch.randint(0, 40, (int(lengths.sum()),), generator=gen) * (2**35) - 7
    return KeyedJaggedTensor(keys=KEYS, values=values, lengths=lengths, stride=batch_size)


def _train(module, seeds):
    for seed in seeds:
        module(_batch(seed)).values().square().sum().backward()


def _snapshot(module):
    """state_dict with each table's pending admissions in id order (the admission counter is
    rebuilt on load, so its rows, hence its export order, may differ)."""
    state = {k: v.clone() for k, v in module.state_dict().items()}
    for k in [k for k in state if k.endswith(".admission_id")]:
        order = torch.argsort(state[k])
        count = k.replace("admission_id", "admission_count")
        state[k], state[count] = state[k][order], state[count][order]
    return state


def _assert_same_state(got, want):
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k


def _assert_module_unchanged(module, before, counters):
    _assert_same_state(_snapshot(module), before)
    assert (module._tables.train_step, int(module._tables.optimizer_step), module.num_live_rows()) == counters


def _counters(module):
    return module._tables.train_step, int(module._tables.optimizer_step), module.num_live_rows()


# ----------------------------------------------------------------------------- resume (finding 2)


@pytest.mark.parametrize("optimizer", [torch.optim.SGD, torch.optim.Adagrad, RowWiseAdagrad, torch.optim.Adam])
def test_fresh_module_with_optimizer_in_backward_loads_a_trained_checkpoint(optimizer):
    def build():
        module = DynamicEmbeddingBagCollection(_configs())
        apply_optimizer_in_backward(optimizer, module.parameters(), {"lr": 0.05})
        return module

    trained = build()
    _train(trained, range(4))
    checkpoint = _snapshot(trained)
    resumed = build()  # no step taken: its optimizer state is not allocated yet
    resumed.load_state_dict(checkpoint)
    _assert_same_state(_snapshot(resumed), checkpoint)
    _train(trained, range(4, 8))  # oracle: the run that was never interrupted
    _train(resumed, range(4, 8))
    _assert_same_state(_snapshot(resumed), _snapshot(trained))


def test_module_without_optimizer_loads_a_training_checkpoint_ignoring_optimizer_state():
    trained = DynamicEmbeddingBagCollection(_configs(), optimizer="adam", optimizer_kwargs={"lr": 0.05})
    _train(trained, range(4))
    checkpoint = _snapshot(trained)
    assert any(".optimizer." in k for k in checkpoint)
    serving = DynamicEmbeddingBagCollection(_configs())
    serving.load_state_dict(checkpoint)  # strict=True
    _assert_same_state(_snapshot(serving), {k: v for k, v in checkpoint.items() if ".optimizer." not in k})
    serving.eval(), trained.eval()
    for seed in (10, 11):
        torch.testing.assert_close(serving(_batch(seed)).values(), trained(_batch(seed)).values(), rtol=0, atol=0)

    # Other unexpected keys are still errors under strict=True, and nothing is loaded.
    fresh = DynamicEmbeddingBagCollection(_configs())
    before, counters = _snapshot(fresh), _counters(fresh)
    with pytest.raises(RuntimeError, match=r'Unexpected key\(s\).*"embedding_bags.t2.bogus"'):
        fresh.load_state_dict(dict(checkpoint, **{"embedding_bags.t2.bogus": torch.zeros(1)}))
    _assert_module_unchanged(fresh, before, counters)
    result = fresh.load_state_dict(dict(checkpoint, **{"embedding_bags.t2.bogus": torch.zeros(1)}), strict=False)
    assert result.unexpected_keys == ["embedding_bags.t2.bogus"] and result.missing_keys == []
    _assert_same_state(_snapshot(fresh), _snapshot(serving))


def test_checkpoint_without_optimizer_state_into_a_module_with_one():
    trained = DynamicEmbeddingBagCollection(_configs())
    with torch.no_grad():
        trained(_batch(0))
    checkpoint = _snapshot(trained)
    module = DynamicEmbeddingBagCollection(
        _configs(), optimizer="adagrad", optimizer_kwargs={"lr": 0.1, "initial_accumulator_value": 0.5}
    )
    before, counters = _snapshot(module), _counters(module)
    with pytest.raises(RuntimeError, match=r'Missing key\(s\).*"embedding_bags.t1.optimizer.momentum1"'):
        module.load_state_dict(checkpoint)
    _assert_module_unchanged(module, before, counters)
    result = module.load_state_dict(checkpoint, strict=False)  # fresh optimizer state for the loaded rows
    assert sorted(result.missing_keys) == [
        "embedding_bags.t1.optimizer.momentum1",
        "embedding_bags.t2.optimizer.momentum1",
    ]
    state = module.state_dict()
    for t in ("t1", "t2"):
        assert torch.equal(state[f"embedding_bags.{t}.weight"], checkpoint[f"embedding_bags.{t}.weight"])
        assert bool((state[f"embedding_bags.{t}.optimizer.momentum1"] == 0.5).all())


def test_nested_load_never_leaves_the_tables_silently_unloaded():
    """A collection inside another module is not told the load's strictness: incomplete state
    must raise (saying why) and change nothing, under strict=False too; complete state loads."""
    trained = DynamicEmbeddingBagCollection(_configs())
    with torch.no_grad():
        trained(_batch(0))
    checkpoint = {f"0.{k}": v for k, v in _snapshot(trained).items()}  # no optimizer state
    model = torch.nn.Sequential(
        DynamicEmbeddingBagCollection(_configs(), optimizer="adagrad", optimizer_kwargs={"lr": 0.1})
    )
    before, counters = _snapshot(model[0]), _counters(model[0])
    for strict in (True, False):
        with pytest.raises(RuntimeError, match=r"not loaded: .*nested in another module"):
            model.load_state_dict(checkpoint, strict=strict)
        _assert_module_unchanged(model[0], before, counters)

    serving = torch.nn.Sequential(DynamicEmbeddingBagCollection(_configs()))  # optimizer.* not expected
    serving.load_state_dict(checkpoint, strict=False)
    _assert_same_state({f"0.{k}": v for k, v in _snapshot(serving[0]).items()}, checkpoint)


# ----------------------------------------------------------------------------- bad module states (finding 7)


def _dup(v):
    v = v.clone()
    v[1] = v[0]
    return v


def _set(index, value):
    def corrupt(v):
        v = v.clone()
        v[index] = value
        return v

    return corrupt


# (case, key of table t2, corruption, error, message): the message names the key and the value.
BAD_STATES = [
    (
        "duplicate weight_id",
        "weight_id",
        _dup,
        ValueError,
        r"table 't2' weight_id must hold distinct ids, got {v0} more than once",
    ),
    (
        "float weight_id",
        "weight_id",
        lambda v: v.double(),
        TypeError,
        r"table 't2' weight_id must be an integer tensor, got torch.float64",
    ),
    (
        "nan weight",
        "weight",
        _set((2, 1), float("nan")),
        ValueError,
        r"table 't2' weight must be finite, got nan at \[2, 1\]",
    ),
    (
        "inf momentum1",
        "optimizer.momentum1",
        _set((0, 3), float("inf")),
        ValueError,
        r"table 't2' optimizer.momentum1 must be finite, got inf",
    ),
    (
        "negative momentum2",
        "optimizer.momentum2",
        _set((1, 0), -1.0),
        ValueError,
        r"table 't2' optimizer.momentum2 must be finite and >= 0, got -1.0 at \[1, 0\]",
    ),
    (
        "epoch 2^40",
        "counters",
        _set(1, 2**40),
        ValueError,
        r"table 't2' counters\[1\] \(epoch\) must be in \[0, 2147483648\), got 1099511627776",
    ),
    (
        "negative clock",
        "counters",
        _set(0, -3),
        ValueError,
        r"table 't2' counters\[0\] \(clock\) must be in \[0, \d+\), got -3",
    ),
    (
        "float counters",
        "counters",
        lambda v: v.float(),
        TypeError,
        r"table 't2' counters must be an integer tensor, got torch.float32",
    ),
    (
        "float metadata",
        "metadata",
        lambda v: v.double(),
        TypeError,
        r"table 't2' metadata must be an integer tensor, got torch.float64",
    ),
    (
        "short weight",
        "weight",
        lambda v: v[:-1],
        ValueError,
        r"table 't2' weight must be \[\d+, 4\] \(one row per weight_id\)",
    ),
    (
        "last_seen ahead",
        "last_seen",
        _set(0, 10**6),
        ValueError,
        r"table 't2' last_seen must be in \[0, training step \d+\], got 1000000",
    ),
    (
        "duplicate admission_id",
        "admission_id",
        _dup,
        ValueError,
        r"table 't2' admission_id must hold distinct ids, got {a0} more than once",
    ),
    (
        "negative admission_count",
        "admission_count",
        _set(0, -1),
        ValueError,
        r"table 't2' admission_count must be >= 0, got -1",
    ),
]


@pytest.mark.parametrize("case", BAD_STATES, ids=[c[0] for c in BAD_STATES])
def test_bad_module_state_is_rejected_and_no_table_changes(case):
    _, key, corrupt, error, message = case
    source = DynamicEmbeddingBagCollection(_configs(), optimizer="adam", optimizer_kwargs={"lr": 0.05})
    _train(source, range(6))
    checkpoint = _snapshot(source)
    module = DynamicEmbeddingBagCollection(_configs(), optimizer="adam", optimizer_kwargs={"lr": 0.05})
    _train(module, range(100, 103))  # other ids and counters: a partial load would show
    before, counters = _snapshot(module), _counters(module)
    full = f"embedding_bags.t2.{key}"
    assert checkpoint[full].numel() >= 2, "the case needs at least two entries"
    bad = dict(checkpoint, **{full: corrupt(checkpoint[full])})
    message = message.format(
        v0=int(checkpoint["embedding_bags.t2.weight_id"][0]), a0=int(checkpoint["embedding_bags.t2.admission_id"][0])
    )
    with pytest.raises(Exception) as raised:
        module.load_state_dict(bad)
    _assert_module_unchanged(module, before, counters)  # checked first: also when the error is not the one wanted
    assert raised.type is error and re.search(message, str(raised.value)), raised.value
    module.load_state_dict(checkpoint)  # the good checkpoint does change it: the check above is not vacuous
    _assert_same_state(_snapshot(module), checkpoint)


# ----------------------------------------------------------------------------- bad HashTable states (finding 7)


def _table_state(table):
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in table.state_dict().items()}


def _assert_table_unchanged(table, before):
    after = table.state_dict()
    assert after.keys() == before.keys()
    for k in before:
        same = torch.equal(after[k], before[k]) if isinstance(before[k], torch.Tensor) else after[k] == before[k]
        assert same, k
    assert table.size() == before["keys"].numel()


BAD_TABLE_STATES = [
    ("clock 'x'", "clock", lambda v: "x", TypeError, r"clock must be an int, got 'x'"),
    ("negative clock", "clock", lambda v: -1, ValueError, r"clock must be in \[0, \d+\), got -1"),
    ("epoch 2^40", "epoch", lambda v: 2**40, ValueError, r"epoch must be in \[0, 2147483648\), got 1099511627776"),
    ("float rows", "rows", lambda v: v.float(), TypeError, r"rows must be an integer tensor, got torch.float32"),
    (
        "float scores",
        "scores",
        lambda v: v.double() + 0.5,
        TypeError,
        r"scores must be an integer tensor, got torch.float64",
    ),
    ("short scores", "scores", lambda v: v[:-1], ValueError, r"scores must have one entry per key"),
    ("duplicate key", "keys", _dup, ValueError, r"key -?\d+ appears twice"),
]


@pytest.mark.parametrize("case", BAD_TABLE_STATES, ids=[c[0] for c in BAD_TABLE_STATES])
def test_bad_hash_table_state_is_rejected_and_table_unchanged(case):
    _, key, corrupt, error, message = case
    source = HashTable(256, policy="epoch_lru")
    source.set_epoch(3)
    source.find_or_insert(torch.arange(100) * 7919)
    state = _table_state(source)
    table = HashTable(256, policy="epoch_lru")
    table.find_or_insert(torch.arange(50) - 25)
    table.find_or_insert(torch.arange(5))
    before = _table_state(table)
    with pytest.raises(error, match=rf"HashTable.load_state_dict: .*{message}"):
        table.load_state_dict(dict(state, **{key: corrupt(state[key])}))
    _assert_table_unchanged(table, before)
    table.load_state_dict(state)
    _assert_table_unchanged(table, state)
    assert (table.clock, table.epoch) == (source.clock, source.epoch)
