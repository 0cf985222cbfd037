"""Bad input to every public entry point, as one matrix: each case asserts the error type, that
the message names the argument (and, where there is one, shows the value), and that the object
it was given to is unchanged (state_dict equal before and after).

Cases that build nothing (constructors, configs, Initializer) have no object to compare.
"""

from functools import partial

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec import DataType, EmbeddingBagConfig, EmbeddingConfig, KeyedJaggedTensor, PoolingType
from torchrec.optim import apply_optimizer_in_backward

from torchrec_ext import (
    DynamicEmbeddingBagCollection,
    DynamicEmbeddingBagConfig,
    DynamicEmbeddingCollection,
    DynamicEmbeddingConfig,
    HashTable,
    Initializer,
    device_sync,
)
from torchrec_ext.modules import Ftrl

NAN, INF = float("nan"), float("inf")


def _state(obj):
    """What 'unchanged' compares: the object's state_dict, tensors cloned (a ShardedTensor as
    its local shards: comparing ShardedTensors is a collective that needs an accelerator)."""

    def copy(v):
        if isinstance(v, ShardedTensor):
            return torch.cat([shard.tensor.flatten() for shard in v.local_shards()]).clone()
        return v.clone() if isinstance(v, torch.Tensor) else v

    return {k: copy(v) for k, v in obj.state_dict().items()}


def _assert_unchanged(obj, before):
    after = _state(obj)
    assert before.keys() == after.keys()
    for k, v in before.items():
        same = torch.equal(v, after[k]) if isinstance(v, torch.Tensor) else v == after[k]
        assert same, f"{k} changed"


def _raises_and_unchanged(obj, call, error, match):
    before = _state(obj)
    with pytest.raises(error, match=match):
        call(obj)
    _assert_unchanged(obj, before)


# ---------------------------------------------------------------------------- HashTable

HASH_TABLE_CONSTRUCTOR = [
    (dict(capacity=0), ValueError, "capacity must be > 0, got 0"),
    (dict(capacity=-3), ValueError, "capacity must be > 0, got -3"),
    (dict(capacity=8.0), TypeError, "capacity must be an int, got float"),
    (dict(capacity=True), TypeError, "capacity must be an int, got bool"),
    (dict(capacity="8"), TypeError, "capacity must be an int, got str"),
    (dict(capacity=8, policy="fifo"), ValueError, "policy must be one of .* got 'fifo'"),
    (dict(capacity=8, policy=None), ValueError, "policy must be one of .* got None"),
    (dict(capacity=8, policy=["lru"]), ValueError, r"policy must be one of .* got \['lru'\]"),
    (dict(capacity=8, device="cuda:x"), ValueError, "device must be a torch.device .* got 'cuda:x'"),
    (dict(capacity=8, device=3.5), ValueError, "device must be a torch.device .* got 3.5"),
    (dict(capacity=8, device="meta"), ValueError, "device meta has no torchrec_ext kernels"),
]


@pytest.mark.parametrize(
    "kwargs,error,match", HASH_TABLE_CONSTRUCTOR, ids=lambda x: repr(x) if isinstance(x, dict) else ""
)
def test_hash_table_constructor(kwargs, error, match):
    args = dict(kwargs)
    capacity = args.pop("capacity")
    with pytest.raises(error, match=f"HashTable: {match}"):
        HashTable(capacity, **args)


def _table(policy="lru"):
    # 8 buckets, so that a key may live in only 2 of them (a misplaced row shows).
    table = HashTable(256, policy=policy)
    table.find_or_insert(torch.arange(100), torch.arange(100) if policy == "custom" else None)
    return table


BAD_KEYS = [
    ([1, 2, 3], TypeError, "keys must be a torch.Tensor, got list"),
    (torch.tensor([1.0, 2.0]), TypeError, "keys must be an integer tensor .* got torch.float32"),
    (torch.tensor([True, False]), TypeError, "keys must be an integer tensor .* got torch.bool"),
    (torch.arange(6).reshape(2, 3), ValueError, r"keys must be 1-D, got shape \(2, 3\)"),
    (torch.tensor(5), ValueError, r"keys must be 1-D, got shape \(\)"),
    (torch.arange(3, device="meta"), ValueError, "keys are on meta, the table is on cpu"),
]


@pytest.mark.parametrize("keys,error,match", BAD_KEYS, ids=["list", "float", "bool", "2d", "0d", "meta"])
@pytest.mark.parametrize("op", ["find", "find_or_insert", "insert_or_assign", "erase"])
def test_hash_table_bad_keys(op, keys, error, match):
    _raises_and_unchanged(_table(), lambda t: getattr(t, op)(keys), error, f"HashTable.{op}: {match}")


K = torch.arange(5)
BAD_SCORES = [
    ("lru", "find_or_insert", torch.arange(5), ValueError, "scores are only taken by policies .* policy is 'lru'"),
    ("custom", "find_or_insert", None, ValueError, "the 'custom' policy needs scores, one per key"),
    ("custom", "insert_or_assign", None, ValueError, "the 'custom' policy needs scores, one per key"),
    ("custom", "find_or_insert", torch.ones(5), TypeError, "scores must be an integer tensor, got torch.float32"),
    ("custom", "find_or_insert", [1, 2, 3, 4, 5], TypeError, "scores must be an integer tensor, got list"),
    (
        "custom",
        "insert_or_assign",
        torch.ones(5, dtype=torch.bool),
        TypeError,
        "scores must be an integer tensor, got torch.bool",
    ),
    (
        "custom",
        "find_or_insert",
        torch.arange(4),
        ValueError,
        r"scores must have one entry per key, shape \(5,\), got \(4,\)",
    ),
    (
        "custom",
        "insert_or_assign",
        torch.arange(5).view(5, 1),
        ValueError,
        r"scores must have one entry per key, shape \(5,\), got \(5, 1\)",
    ),
    ("custom", "find_or_insert", torch.arange(5, device="meta"), ValueError, "scores are on meta, the table is on cpu"),
    ("lfu", "find_or_insert", torch.tensor([1, -1, 2, 0, 0]), ValueError, "lfu increments must be >= 0, got -1"),
    (
        "epoch_lfu",
        "find_or_insert",
        torch.tensor([1, -4, 2, 0, 0]),
        ValueError,
        "epoch_lfu increments must be >= 0, got -4",
    ),
]


@pytest.mark.parametrize(
    "policy,op,scores,error,match", BAD_SCORES, ids=[f"{c[0]}-{c[1]}-{i}" for i, c in enumerate(BAD_SCORES)]
)
def test_hash_table_bad_scores(policy, op, scores, error, match):
    _raises_and_unchanged(_table(policy), lambda t: getattr(t, op)(K, scores), error, f"HashTable.{op}: {match}")


@pytest.mark.parametrize("epoch", [-1, 2**31, 1.0, True, "1", None])
def test_hash_table_bad_epoch(epoch):
    _raises_and_unchanged(
        _table("epoch_lru"),
        lambda t: t.set_epoch(epoch),
        ValueError,
        rf"HashTable.set_epoch: epoch must be an int in \[0, 2\*\*31\), got {epoch!r}",
    )


@pytest.mark.parametrize("page_size", [0, -1, 2.0, True, None])
def test_hash_table_bad_export_page_size(page_size):
    # Refused at the call, before any page is read (export returns a lazy iterator).
    _raises_and_unchanged(
        _table(),
        lambda t: t.export(page_size),
        ValueError,
        f"HashTable.export: page_size must be an int > 0, got {page_size!r}",
    )


def _set(**fields):
    return lambda s: s.update(fields)


def _case(name, *values):
    return pytest.param(name, *values, id=name)


HASH_TABLE_STATES = [
    _case("capacity", _set(capacity=512), ValueError, "saved with capacity 512, this table has capacity 256"),
    _case("policy", _set(policy="lfu"), ValueError, "saved with policy 'lfu', this table has policy 'lru'"),
    _case("missing", lambda s: s.pop("rows"), ValueError, r"state is missing \['rows'\]"),
    _case("float keys", lambda s: s.update(keys=s["keys"].float()), TypeError, "keys must be an integer tensor"),
    # (more than the stash's 32 rows outside their keys' buckets: a few would be a full load's stash)
    _case("misplaced rows", lambda s: s.update(rows=s["rows"].flip(0)), ValueError, "cannot live in row"),
    _case(
        "duplicate keys",
        lambda s: s.update(keys=torch.cat([s["keys"][:1], s["keys"][:-1]])),
        ValueError,
        "appears twice",
    ),
    _case(
        "rows out of range", lambda s: s.update(rows=s["rows"] + 1000), ValueError, r"row 10\d\d .* outside \[0, 256\)"
    ),
    _case(
        "short rows",
        lambda s: s.update(rows=s["rows"][:5]),
        ValueError,
        r"rows must have one entry per key, shape \(100,\), got \(5,\)",
    ),
    _case(
        "short scores",
        lambda s: s.update(scores=s["scores"][:5]),
        ValueError,
        r"scores must have one entry per key, shape \(100,\), got \(5,\)",
    ),
    _case(
        "fractional scores",
        lambda s: s.update(scores=s["scores"].float() + 0.5),
        TypeError,
        "scores must be an integer tensor, got torch.float32",
    ),
    _case("str clock", _set(clock="x"), TypeError, "clock must be an int, got 'x'"),
    _case("float clock", _set(clock=1.5), TypeError, r"clock must be an int, got 1\.5"),
    _case("negative clock", _set(clock=-5), ValueError, r"clock must be in \[0, \d+\), got -5"),
    _case("negative epoch", _set(epoch=-1), ValueError, r"epoch must be in \[0, 2147483648\), got -1"),
    _case("epoch too big", _set(epoch=2**40), ValueError, r"epoch must be in \[0, 2147483648\), got 1099511627776"),
    _case("not a dict", None, TypeError, "state must be a dict .* got list"),
]


@pytest.mark.parametrize("name,change,error,match", HASH_TABLE_STATES)
def test_hash_table_load_state_dict(name, change, error, match):
    state = [1, 2]
    if change is not None:
        state = _table().state_dict()
        change(state)
    victim = HashTable(256, policy="lru")
    victim.find_or_insert(torch.tensor([7, 8, 9]))
    _raises_and_unchanged(victim, lambda t: t.load_state_dict(state), error, f"HashTable.load_state_dict: .*{match}")


# ---------------------------------------------------------------------------- Initializer and configs

INITIALIZERS = [
    (dict(kind=3), TypeError, "kind must be a str"),
    (dict(kind="xavier"), ValueError, "kind must be one of .* got 'xavier'"),
    (dict(std=-1.0), ValueError, "std must be >= 0, got -1.0"),
    (dict(low=1.0, high=0.0), ValueError, "low must be <= high, got low=1.0, high=0.0"),
] + [
    (
        dict(kind=kind, **{field: bad}),
        ValueError if isinstance(bad, float) else TypeError,
        f"Initializer: {field} must be a finite number, got {bad!r}",
    )
    for kind, fields in [
        ("uniform", ("low", "high")),
        ("normal", ("mean", "std")),
        ("truncated_normal", ("mean", "std", "low", "high")),
        ("constant", ("value",)),
    ]
    for field in fields
    for bad in (NAN, INF, -INF, "1", True)
]


@pytest.mark.parametrize("kwargs,error,match", INITIALIZERS, ids=lambda x: repr(x) if isinstance(x, dict) else "")
def test_initializer(kwargs, error, match):
    with pytest.raises(error, match=match):
        Initializer(**kwargs)


CONFIG_FIELDS = [
    (dict(num_embeddings=0), ValueError, "num_embeddings .* must be an int >= 1, got 0"),
    (dict(num_embeddings=-8), ValueError, "num_embeddings .* must be an int >= 1, got -8"),
    (dict(num_embeddings=8.0), ValueError, r"num_embeddings .* must be an int >= 1, got 8\.0"),
    (dict(num_embeddings=None), ValueError, "num_embeddings .* must be an int >= 1, got None"),
    (dict(embedding_dim=0), ValueError, "embedding_dim must be an int >= 1, got 0"),
    (dict(embedding_dim=-4), ValueError, "embedding_dim must be an int >= 1, got -4"),
    (dict(embedding_dim=4.5), ValueError, r"embedding_dim must be an int >= 1, got 4\.5"),
    (dict(weight_init_min=NAN), ValueError, "weight_init_min must be a finite number, got nan"),
    (dict(weight_init_max=INF), ValueError, "weight_init_max must be a finite number, got inf"),
    (dict(weight_init_max="1"), TypeError, "weight_init_max must be a finite number, got '1'"),
    (
        dict(weight_init_min=1.0, weight_init_max=0.0),
        ValueError,
        "weight_init_min must be <= weight_init_max, got 1.0 > 0.0",
    ),
    (dict(eviction_policy="fifo"), ValueError, "eviction_policy must be one of .* got 'fifo'"),
    (dict(eviction_policy="custom"), ValueError, "eviction_policy must be one of .* got 'custom'"),
    (dict(eviction_policy=None), ValueError, "eviction_policy must be one of .* got None"),
    (dict(initializer="xavier"), ValueError, "Initializer: kind must be one of .* got 'xavier'"),
    (dict(initializer=3), TypeError, "initializer must be an Initializer, a kind name or None, got 3"),
    (dict(admit_after=0), ValueError, "admit_after must be an int >= 1, got 0"),
    (dict(admit_after=-1), ValueError, "admit_after must be an int >= 1, got -1"),
    (dict(admit_after=1.5), ValueError, r"admit_after must be an int >= 1, got 1\.5"),
    (dict(admit_after=NAN), ValueError, "admit_after must be an int >= 1, got nan"),
    (dict(admission_capacity=0), ValueError, "admission_capacity must be an int >= 1 or None, got 0"),
    (dict(admission_capacity=-2), ValueError, "admission_capacity must be an int >= 1 or None, got -2"),
    (dict(admission_capacity=2.0), ValueError, r"admission_capacity must be an int >= 1 or None, got 2\.0"),
    (dict(ttl_steps=0), ValueError, "ttl_steps must be an int >= 1 or None, got 0"),
    (dict(ttl_steps=-3), ValueError, "ttl_steps must be an int >= 1 or None, got -3"),
    (dict(ttl_steps=INF), ValueError, "ttl_steps must be an int >= 1 or None, got inf"),
    (dict(seed=1.5), TypeError, r"seed must be an int, got 1\.5"),
    (dict(seed="0"), TypeError, "seed must be an int, got '0'"),
]


@pytest.mark.parametrize("config", [DynamicEmbeddingBagConfig, DynamicEmbeddingConfig])
@pytest.mark.parametrize("fields,error,match", CONFIG_FIELDS, ids=lambda x: repr(x) if isinstance(x, dict) else "")
def test_dynamic_config(config, fields, error, match):
    args = dict(name="t", embedding_dim=4, num_embeddings=8, feature_names=["f"])
    args.update(fields)
    where = "" if match.startswith("Initializer") else f"{config.__name__}: "  # a kind name builds an Initializer
    with pytest.raises(error, match=where + match):
        config(**args)


def _bag(**fields):
    return EmbeddingBagConfig(**{"name": "t", "embedding_dim": 4, "num_embeddings": 8, **fields})


EBC, EC = DynamicEmbeddingBagCollection, DynamicEmbeddingCollection
MODULE_CONSTRUCTOR = [
    # (id, module, tables, other arguments, error, message)
    ("not a list", EBC, _bag(), {}, ValueError, "tables must be a list of EmbeddingBagConfig, got EmbeddingBagConfig"),
    ("not a config", EBC, [{"name": "t"}], {}, TypeError, "tables must be EmbeddingBagConfigs, got dict"),
    ("bag config to EC", EC, [_bag()], {}, TypeError, "tables must be EmbeddingConfigs, got EmbeddingBagConfig"),
    ("duplicate name", EBC, [_bag(), _bag()], {}, ValueError, "Duplicate table name t"),
    ("no name", EBC, [_bag(name="")], {}, ValueError, "every table needs a name"),
    (
        "int8",
        EBC,
        [_bag(data_type=DataType.INT8)],
        {},
        ValueError,
        r"table 't' data_type must be one of \['FP32', 'FP16', 'BF16'\] .* got INT8",
    ),
    (
        "int4 EC",
        EC,
        [EmbeddingConfig(name="t", embedding_dim=4, num_embeddings=8, data_type=DataType.INT4)],
        {},
        ValueError,
        r"table 't' data_type must be one of \['FP32', 'FP16', 'BF16'\] .* got INT4",
    ),
    (
        "data_type str",
        EBC,
        [_bag(data_type="FP16")],
        {},
        ValueError,
        r"table 't' data_type must be one of \['FP32', 'FP16', 'BF16'\] \(torchrec.DataType; .* got 'FP16', not a DataType",
    ),
    (
        "pooling none",
        EBC,
        [_bag(pooling=PoolingType.NONE)],
        {},
        ValueError,
        r"table 't' pooling must be SUM or MEAN \(torchrec.PoolingType\), got PoolingType.NONE",
    ),
    (
        "pooling str",
        EBC,
        [_bag(pooling="sum")],
        {},
        ValueError,
        r"table 't' pooling must be SUM or MEAN \(torchrec.PoolingType\), got 'sum', not a PoolingType",
    ),
    (
        "custom init_fn",
        EBC,
        [_bag(init_fn=torch.nn.init.zeros_)],
        {},
        ValueError,
        "table 't': init_fn <function zeros_ .* cannot initialise rows id by id; an init_fn must be "
        "torch.nn.init.uniform_, normal_, trunc_normal_ or constant_",
    ),
    (
        "plain nan bound",
        EBC,
        [_bag(weight_init_min=NAN)],
        {},
        ValueError,
        "table 't' weight_init_min must be a finite number, got nan",
    ),
    (
        "plain zero dim",
        EBC,
        [_bag(embedding_dim=0)],
        {},
        ValueError,
        "table 't' embedding_dim must be an int >= 1, got 0",
    ),
    # A one-sided bound resolved against TorchRec's default other bound (+-1/sqrt(8) = 0.35).
    (
        "inverted resolved bounds",
        EBC,
        [DynamicEmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=8, initializer=Initializer(low=0.5))],
        {},
        ValueError,
        "table 't': its initializer resolves to .* low must be <= high, got low=0.5, high=0.35",
    ),
    (
        "EC dims differ",
        EC,
        [
            EmbeddingConfig(name="a", embedding_dim=4, num_embeddings=8),
            EmbeddingConfig(name="b", embedding_dim=8, num_embeddings=8),
        ],
        {},
        ValueError,
        "same embedding dimension. Violating case: b's embedding_dim 8 != 4",
    ),
    (
        "kwargs without optimizer",
        EBC,
        [_bag()],
        {"optimizer_kwargs": {"lr": 0.1}},
        ValueError,
        "optimizer_kwargs given without an optimizer",
    ),
    (
        "lambda init_fn",
        EBC,
        [_bag(init_fn=lambda w: w)],
        {},
        ValueError,
        "table 't': init_fn <function <lambda> .* cannot initialise rows id by id",
    ),
    (
        "partial of another init",
        EBC,
        [_bag(init_fn=partial(torch.nn.init.xavier_uniform_, gain=2.0))],
        {},
        ValueError,
        "table 't': init_fn functools.partial\\(<function xavier_uniform_ .* cannot initialise rows id by id",
    ),
    (
        "constant_ without val",
        EBC,
        [_bag(init_fn=partial(torch.nn.init.constant_))],
        {},
        TypeError,
        "table 't': init_fn .* does not fit torch.nn.init.constant_'s arguments: missing a required argument: 'val'",
    ),
    (
        "init_fn positional",
        EBC,
        [_bag(init_fn=partial(torch.nn.init.constant_, 0.5))],
        {},
        TypeError,
        "table 't': init_fn .*: a partial's positional arguments come before the tensor, so torch would take 0.5 "
        "for the tensor; pass them by keyword",
    ),
    (
        "init_fn generator",
        EBC,
        [_bag(init_fn=partial(torch.nn.init.normal_, generator=torch.Generator()))],
        {},
        ValueError,
        "table 't': init_fn .*: a generator cannot be honoured",
    ),
    (
        "init_fn negative std",
        EBC,
        [_bag(init_fn=partial(torch.nn.init.normal_, std=-1.0))],
        {},
        ValueError,
        "table 't': init_fn .*: Initializer: std must be >= 0, got -1.0",
    ),
    (
        "init_fn inverted bounds",
        EBC,
        [_bag(init_fn=partial(torch.nn.init.trunc_normal_, a=1.0, b=0.0))],
        {},
        ValueError,
        "table 't': init_fn .*: Initializer: low must be <= high, got low=1.0, high=0.0",
    ),
    (
        "init_fn nan val",
        EBC,
        [_bag(init_fn=partial(torch.nn.init.constant_, val=NAN))],
        {},
        ValueError,
        "table 't': init_fn .*: Initializer: value must be a finite number, got nan",
    ),
    (
        "EC gather hint per sharding",
        EC,
        [EmbeddingConfig(name="a", embedding_dim=4, num_embeddings=8)],
        {"use_gather_select_per_sharding": True},
        TypeError,
        "use_gather_select_per_sharding must be a dict of sharding type -> bool or None, got True",
    ),
]


@pytest.mark.parametrize(
    "module,tables,kwargs,error,match", [pytest.param(*c[1:], id=c[0]) for c in MODULE_CONSTRUCTOR]
)
def test_module_constructor(module, tables, kwargs, error, match):
    with pytest.raises(error, match=match):
        module(tables, **kwargs)


# ---------------------------------------------------------------------------- fused optimizer settings


def _number_cases(kind, names):
    for name in names:
        for bad in (NAN, INF, -1.0):
            yield kind, {name: bad}, ValueError, f"{kind} {name} must be finite and >= 0, got {bad!r}"
        yield kind, {name: "0.1"}, TypeError, f"{kind} {name} must be a finite number, got '0.1'"
        yield kind, {name: True}, TypeError, f"{kind} {name} must be a finite number, got True"


OPTIMIZER_SETTINGS = [
    *_number_cases("sgd", ("lr", "weight_decay")),
    *_number_cases("adagrad", ("lr", "eps", "weight_decay", "lr_decay", "initial_accumulator_value")),
    *_number_cases("rowwise_adagrad", ("lr", "eps", "weight_decay", "lr_decay", "initial_accumulator_value")),
    *_number_cases("adam", ("lr", "eps", "weight_decay")),
    *_number_cases("adamw", ("lr", "eps", "weight_decay")),
    *_number_cases("ftrl", ("l1", "l2", "beta", "initial_accumulator_value")),
    (torch.optim.AdamW, {"betas": (0.9, 1.0)}, ValueError, r"adamw betas\[1\] must be in \[0, 1\), got 1.0"),
    ("adamw", {"betas": (-0.1, 0.9)}, ValueError, r"adamw betas\[0\] must be finite and >= 0, got -0.1"),
    (torch.optim.AdamW, {"amsgrad": True}, ValueError, "fused adamw supports only amsgrad=False, got True"),
    (
        torch.optim.Adam,
        {"decoupled_weight_decay": True, "weight_decay": -0.1},
        ValueError,
        "adamw weight_decay must be finite and >= 0, got -0.1",
    ),
    (Ftrl, {"lr": 0.0}, ValueError, r"ftrl lr must be finite and > 0 \(FTRL divides by it\), got 0.0"),
    ("ftrl", {"lr": -0.1}, ValueError, r"ftrl lr must be finite and > 0 \(FTRL divides by it\), got -0.1"),
    ("ftrl", {"lr": NAN}, ValueError, "ftrl lr must be a finite number, got nan"),
    (
        "ftrl",
        {"lr_power": 0.5},
        ValueError,
        r"ftrl lr_power must be <= 0 \(the accumulator is raised to -lr_power\), got 0.5",
    ),
    ("ftrl", {"lr_power": INF}, ValueError, "ftrl lr_power must be a finite number, got inf"),
    (
        Ftrl,
        {"initial_accumulator_value": 0.0},
        ValueError,
        r"ftrl initial_accumulator_value must be > 0 when lr_power < 0 and beta = l2 = 0 .*got 0.0",
    ),
    ("ftrl", {"weight_decay": 0.1}, TypeError, r"ftrl does not take \['weight_decay'\]"),
    ("adagrad", {"lr": torch.tensor(NAN)}, ValueError, "adagrad lr must be finite and >= 0, got nan"),
    ("adam", {"betas": (NAN, 0.9)}, ValueError, r"adam betas\[0\] must be finite and >= 0, got nan"),
    ("adam", {"betas": (0.9, INF)}, ValueError, r"adam betas\[1\] must be finite and >= 0, got inf"),
    ("adam", {"betas": (-0.1, 0.9)}, ValueError, r"adam betas\[0\] must be finite and >= 0, got -0.1"),
    (torch.optim.Adam, {"betas": (0.9, 1.0)}, ValueError, r"adam betas\[1\] must be in \[0, 1\), got 1.0"),
    ("adam", {"betas": 0.9}, TypeError, r"adam betas must be a pair \(beta1, beta2\), got 0.9"),
    ("adam", {"betas": (0.9,)}, TypeError, r"adam betas must be a pair \(beta1, beta2\), got \(0.9,\)"),
    ("adam", {"betas": ("a", 0.9)}, TypeError, r"adam betas\[0\] must be a finite number, got 'a'"),
    ("sgd", {"betas": (0.9, 0.9)}, TypeError, r"sgd does not take \['betas'\]"),
    (torch.optim.Adagrad, {"momentum": 0.9}, TypeError, r"adagrad does not take \['momentum'\]"),
    ("adam", {"lr_decay": 0.1}, TypeError, r"adam does not take \['lr_decay'\]"),
    (torch.optim.SGD, {"momentum": 0.9}, ValueError, "fused sgd supports only momentum=0, got 0.9"),
    ("sgd", {"nesterov": True}, ValueError, "fused sgd supports only nesterov=False, got True"),
    ("adagrad", {"maximize": True}, ValueError, "fused adagrad supports only maximize=False, got True"),
    (torch.optim.Adam, {"amsgrad": True}, ValueError, "fused adam supports only amsgrad=False, got True"),
    (torch.optim.RMSprop, {}, ValueError, "optimizer must be torch.optim.SGD/Adagrad/Adam.* got .*RMSprop"),
    ("lamb", {}, ValueError, "optimizer must be torch.optim.SGD/Adagrad/Adam.* got 'lamb'"),
]


def _small_tables():
    return [DynamicEmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=16, feature_names=["f"])]


@pytest.mark.parametrize(
    "optimizer,kwargs,error,match",
    OPTIMIZER_SETTINGS,
    ids=[f"{getattr(c[0], '__name__', c[0])}-{c[1]!r}" for c in OPTIMIZER_SETTINGS],
)
def test_fused_optimizer_settings(optimizer, kwargs, error, match):
    with pytest.raises(error, match=f"DynamicEmbeddingBagCollection: {match}"):
        DynamicEmbeddingBagCollection(_small_tables(), optimizer=optimizer, optimizer_kwargs=kwargs)


def _trained_ebc():
    ebc = DynamicEmbeddingBagCollection(_small_tables())
    apply_optimizer_in_backward(torch.optim.SGD, ebc.parameters(), {"lr": 0.1})
    ebc(
        KeyedJaggedTensor(keys=["f"], values=torch.tensor([1, 2, 3]), lengths=torch.tensor([2, 1]))
    ).values().sum().backward()
    return ebc


@pytest.mark.parametrize(
    "cls,kwargs,match",
    [
        # Settings torch's own classes accept (so apply_optimizer_in_backward does) but that turn rows NaN or inf.
        (torch.optim.SGD, {"lr": 0.1, "weight_decay": NAN}, "sgd weight_decay must be finite and >= 0, got nan"),
        (torch.optim.Adagrad, {"lr": INF}, "adagrad lr must be finite and >= 0, got inf"),
    ],
    ids=["sgd weight_decay nan", "adagrad lr inf"],
)
def test_apply_optimizer_in_backward_settings_refused_at_forward(cls, kwargs, match):
    kjt = KeyedJaggedTensor(keys=["f"], values=torch.tensor([1, 9]), lengths=torch.tensor([1, 1]))
    ebc = _trained_ebc()
    apply_optimizer_in_backward(cls, ebc.parameters(), kwargs)
    _raises_and_unchanged(ebc, lambda m: m(kjt), ValueError, f"DynamicEmbeddingBagCollection: {match}")


@pytest.mark.parametrize(
    "name,value,error,match",
    [
        ("lr", NAN, ValueError, r"\['lr'\] must be finite and >= 0, got nan"),
        ("lr", -0.1, ValueError, r"\['lr'\] must be finite and >= 0, got -0.1"),
        ("weight_decay", INF, ValueError, r"\['weight_decay'\] must be finite and >= 0, got inf"),
        ("lr", "0.1", TypeError, r"\['lr'\] must be a finite number, got '0.1'"),
    ],
)
def test_param_groups_written_directly_are_checked_before_the_update(name, value, error, match):
    # An LR scheduler or an optimizer checkpoint writes param_groups; the backward refuses bad
    # values before any row is updated (ids already present: the eval lookup touches nothing).
    ebc = _trained_ebc().eval()
    out = ebc(KeyedJaggedTensor(keys=["f"], values=torch.tensor([1, 2]), lengths=torch.tensor([1, 1]))).values().sum()
    ebc.fused_optimizer.param_groups[0][name] = value
    _raises_and_unchanged(
        ebc, lambda m: out.backward(), error, f"DynamicEmbeddingFusedOptimizer: param_groups\\[0\\]{match}"
    )


def test_settings_accept_any_real_number():
    # NumPy scalars and one-element float tensors are numbers too (stored as plain floats).
    init = Initializer("normal", mean=np.float32(0.5), std=torch.tensor(0.25))
    assert (init.mean, init.std) == (0.5, 0.25) and type(init.std) is float
    module = DynamicEmbeddingBagCollection(
        _small_tables(), optimizer="adagrad", optimizer_kwargs={"lr": np.float64(0.1), "eps": torch.tensor(1e-8)}
    )
    assert module.fused_optimizer.param_groups[0]["lr"] == pytest.approx(0.1)


@pytest.mark.parametrize("name,value", [("lr", NAN), ("weight_decay", -1.0)])
def test_param_groups_written_directly_are_refused_at_the_training_forward(name, value):
    # New ids in a training forward would be inserted before the backward's check: the forward
    # itself refuses the settings first, so no id is inserted.
    ebc = _trained_ebc()
    ebc.fused_optimizer.param_groups[0][name] = value
    kjt = KeyedJaggedTensor(keys=["f"], values=torch.tensor([1001, 1002]), lengths=torch.tensor([1, 1]))
    _raises_and_unchanged(
        ebc,
        lambda m: m(kjt),
        ValueError,
        f"DynamicEmbeddingFusedOptimizer: param_groups\\[0\\]\\['{name}'\\] must be finite",
    )


# ---------------------------------------------------------------------------- module forward


def _ebc(weighted=False):
    module = DynamicEmbeddingBagCollection(
        [DynamicEmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=32, feature_names=["f", "g"])],
        is_weighted=weighted,
        optimizer="adagrad",
    )
    kjt = KeyedJaggedTensor(
        keys=["f", "g"],
        values=torch.tensor([1, 2, 3]),
        lengths=torch.tensor([1, 1, 1, 0]),
        weights=torch.ones(3) if weighted else None,
    )
    module(kjt).values().sum().backward()
    return module


def _ec():
    module = DynamicEmbeddingCollection(
        [DynamicEmbeddingConfig(name="t", embedding_dim=4, num_embeddings=32, feature_names=["f", "g"])],
        optimizer="sgd",
    )
    module(KeyedJaggedTensor(keys=["f", "g"], values=torch.tensor([1, 2, 3]), lengths=torch.tensor([1, 1, 1, 0])))
    return module


I64 = torch.int64
BAD_KJTS = [
    # (name, weighted module, KJT fields, error, message)
    (
        "duplicated key",
        False,
        dict(keys=["f", "g", "f"], values=torch.tensor([1, 2, 3]), lengths=torch.tensor([1, 1, 1])),
        ValueError,
        r"KJT keys must be distinct, got \['f'\] more than once",
    ),
    (
        "missing key",
        False,
        dict(keys=["f"], values=torch.tensor([1, 2]), lengths=torch.tensor([1, 1])),
        ValueError,
        r"KJT lacks the features \['g'\]",
    ),
    (
        "float ids",
        False,
        dict(keys=["f", "g"], values=torch.tensor([1.0, 2.0]), lengths=torch.tensor([1, 0, 1, 0])),
        TypeError,
        r"ids \(KJT values\) must be int64 or int32, got torch.float32",
    ),
    (
        "int16 ids",
        False,
        dict(keys=["f", "g"], values=torch.tensor([1, 2], dtype=torch.int16), lengths=torch.tensor([1, 0, 1, 0])),
        TypeError,
        r"ids \(KJT values\) must be int64 or int32, got torch.int16",
    ),
    (
        "2-D ids",
        False,
        dict(keys=["f", "g"], values=torch.tensor([[1], [2]]), lengths=torch.tensor([1, 0, 1, 0])),
        ValueError,
        r"ids \(KJT values\) must be 1-D, got shape \(2, 1\)",
    ),
    (
        "uint8 lengths",
        False,
        dict(keys=["f", "g"], values=torch.tensor([1, 2]), lengths=torch.tensor([1, 0, 1, 0], dtype=torch.uint8)),
        TypeError,
        "KJT lengths must be integers, got torch.uint8",
    ),
    (
        "negative length",
        False,
        dict(keys=["f", "g"], values=torch.tensor([1, 2]), lengths=torch.tensor([3, -1, 0, 0])),
        ValueError,
        "KJT lengths must be >= 0, got a length of -1",
    ),
    (
        "lengths sum",
        False,
        dict(keys=["f", "g"], values=torch.tensor([1, 2, 3]), lengths=torch.tensor([1, 0, 1, 0])),
        ValueError,
        "KJT lengths sum to 2 but there are 3 ids",
    ),
    (
        "lengths count",
        False,
        dict(keys=["f", "g"], values=torch.tensor([1, 2]), lengths=torch.tensor([1, 1, 0]), stride=2),
        ValueError,
        "KJT lengths must have num_keys \\* batch_size = 4 entries, got 3",
    ),
    (
        "no weights on weighted",
        True,
        dict(keys=["f", "g"], values=torch.tensor([1, 2]), lengths=torch.tensor([1, 0, 1, 0])),
        ValueError,
        r"the module is weighted \(is_weighted=True\) but the KJT has no weights",
    ),
    (
        "int weights",
        True,
        dict(
            keys=["f", "g"],
            values=torch.tensor([1, 2]),
            lengths=torch.tensor([1, 0, 1, 0]),
            weights=torch.ones(2, dtype=I64),
        ),
        TypeError,
        "KJT weights must be floats, got torch.int64",
    ),
    (
        "weights shape",
        True,
        dict(
            keys=["f", "g"], values=torch.tensor([1, 2]), lengths=torch.tensor([1, 0, 1, 0]), weights=torch.ones(2, 1)
        ),
        ValueError,
        r"KJT weights must be one per id, shape \(2,\), got \(2, 1\)",
    ),
    (
        "nan weight",
        True,
        dict(
            keys=["f", "g"],
            values=torch.tensor([1, 2]),
            lengths=torch.tensor([1, 0, 1, 0]),
            weights=torch.tensor([1.0, NAN]),
        ),
        ValueError,
        "KJT weights must be finite",
    ),
    (
        "inf weight",
        True,
        dict(
            keys=["f", "g"],
            values=torch.tensor([1, 2]),
            lengths=torch.tensor([1, 0, 1, 0]),
            weights=torch.tensor([INF, 1.0]),
        ),
        ValueError,
        "KJT weights must be finite",
    ),
    (
        "meta ids",
        False,
        dict(
            keys=["f", "g"],
            values=torch.tensor([1, 2], device="meta"),
            lengths=torch.tensor([1, 0, 1, 0], device="meta"),
        ),
        ValueError,
        "KJT values are on meta, the tables are on cpu",
    ),
    (
        "meta lengths",
        False,
        dict(keys=["f", "g"], values=torch.tensor([1, 2]), lengths=torch.tensor([1, 0, 1, 0], device="meta")),
        ValueError,
        "KJT lengths are on meta, the tables are on cpu",
    ),
]


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("case", BAD_KJTS, ids=[c[0] for c in BAD_KJTS])
def test_ebc_forward_bad_kjt(case, training):
    _, weighted, fields, error, match = case
    module = _ebc(weighted).train(training)
    _raises_and_unchanged(
        module, lambda m: m(KeyedJaggedTensor(**fields)), error, f"DynamicEmbeddingBagCollection: {match}"
    )


# A KJT that knows its ids per key on the host (length_per_key) is checked on the device and
# the error raised at the step's first host read (on a GPU: the count of unique ids), still
# before any table is touched. device_sync.defer_on_cpu runs that order on CPU.
DEFERRED_KJTS = [
    # (name, weighted module, KJT fields, match)
    (
        "negative length",
        False,
        dict(values=torch.tensor([1, 2]), lengths=torch.tensor([3, -1, 0, 0]), length_per_key=[2, 0]),
        "KJT lengths must be >= 0, got a length of -1",
    ),
    (
        "length_per_key disagrees",
        False,
        dict(values=torch.tensor([1, 2, 3]), lengths=torch.tensor([1, 1, 1, 0]), length_per_key=[1, 2]),
        "KJT lengths of key 'f' must sum to its length_per_key entry 1, got 2",
    ),
    (
        "length_per_key sum",
        False,
        dict(values=torch.tensor([1, 2, 3]), lengths=torch.tensor([1, 1, 1, 0]), length_per_key=[2, 2]),
        "KJT length_per_key must sum to the ids' count 3, got 4",
    ),
    (
        "nan weight",
        True,
        dict(
            values=torch.tensor([1, 2]),
            lengths=torch.tensor([1, 0, 1, 0]),
            weights=torch.tensor([1.0, NAN]),
            length_per_key=[1, 1],
        ),
        "KJT weights must be finite",
    ),
]


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("case", DEFERRED_KJTS, ids=[c[0] for c in DEFERRED_KJTS])
def test_ebc_forward_bad_kjt_checked_on_device(case, training, monkeypatch):
    _, weighted, fields, match = case
    module = _ebc(weighted).train(training)
    monkeypatch.setattr(device_sync, "defer_on_cpu", True)
    kjt = KeyedJaggedTensor(keys=["f", "g"], **fields)
    _raises_and_unchanged(module, lambda m: m(kjt), ValueError, f"DynamicEmbeddingBagCollection: {match}")
    device_sync.settle()  # nothing left over for the next step
    good = KeyedJaggedTensor(
        keys=["f", "g"],
        values=torch.tensor([1, 2]),
        lengths=torch.tensor([1, 0, 1, 0]),
        weights=torch.ones(2) if weighted else None,
        length_per_key=[1, 1],
    )
    module(good)  # the module still works


EC_CASES = [c for c in BAD_KJTS if not c[1]]


@pytest.mark.parametrize("case", EC_CASES, ids=[c[0] for c in EC_CASES])
def test_ec_forward_bad_kjt(case):
    _, _, fields, error, match = case
    _raises_and_unchanged(
        _ec(), lambda m: m(KeyedJaggedTensor(**fields)), error, f"DynamicEmbeddingCollection: {match}"
    )


# Were refused, now ignored as TorchRec does (one KJT feeds several modules): keys no table
# reads, and weights an unweighted module does not read. test_dropin_keys_init.py compares
# with TorchRec's own modules; here: the output is that of the KJT without them.
IGNORED = [
    # (name, weighted module, KJT fields, the same KJT without what is ignored)
    (
        "unknown key",
        False,
        dict(keys=["f", "g", "h"], values=torch.tensor([1, 2, 3]), lengths=torch.tensor([1, 1, 1])),
        dict(keys=["f", "g"], values=torch.tensor([1, 2]), lengths=torch.tensor([1, 1])),
    ),
    (
        "weights on unweighted",
        False,
        dict(keys=["f", "g"], values=torch.tensor([1, 2]), lengths=torch.tensor([1, 0, 1, 0]), weights=torch.ones(2)),
        dict(keys=["f", "g"], values=torch.tensor([1, 2]), lengths=torch.tensor([1, 0, 1, 0])),
    ),
    (
        "nan weight of an unknown key",
        True,
        dict(
            keys=["h", "f", "g"],
            values=torch.tensor([7, 1, 2]),
            lengths=torch.tensor([1, 1, 1]),
            weights=torch.tensor([NAN, 2.0, 3.0]),
        ),
        dict(
            keys=["f", "g"], values=torch.tensor([1, 2]), lengths=torch.tensor([1, 1]), weights=torch.tensor([2.0, 3.0])
        ),
    ),
]


@pytest.mark.parametrize("case", IGNORED, ids=[c[0] for c in IGNORED])
def test_ebc_forward_ignores(case):
    _, weighted, fields, reduced = case
    module = _ebc(weighted).eval()
    torch.testing.assert_close(
        module(KeyedJaggedTensor(**fields)).values(), module(KeyedJaggedTensor(**reduced)).values(), rtol=0, atol=0
    )


EC_IGNORED = [c for c in IGNORED if not c[1]]


@pytest.mark.parametrize("case", EC_IGNORED, ids=[c[0] for c in EC_IGNORED])
def test_ec_forward_ignores(case):
    _, _, fields, reduced = case
    module = _ec().eval()
    got, want = module(KeyedJaggedTensor(**fields)), module(KeyedJaggedTensor(**reduced))
    assert list(got) == list(want)
    for name in want:
        torch.testing.assert_close(got[name].values(), want[name].values(), rtol=0, atol=0)
        assert torch.equal(got[name].lengths(), want[name].lengths())


def test_not_a_kjt():
    _raises_and_unchanged(
        _ebc(), lambda m: m({"f": torch.tensor([1])}), TypeError, "features must be a KeyedJaggedTensor, got dict"
    )


@pytest.mark.parametrize("sharding", ["table_wise", "row_wise"])
@pytest.mark.parametrize("bag", [True, False], ids=["ebc", "ec"])
def test_sharded_input_dist_refuses_duplicated_key(one_rank_group, bag, sharding):
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
    from torchrec.distributed.types import ShardingEnv

    from torchrec_ext.distributed import DynamicEmbeddingBagCollectionSharder, DynamicEmbeddingCollectionSharder

    module, sharder = (
        (_ebc(), DynamicEmbeddingBagCollectionSharder()) if bag else (_ec(), DynamicEmbeddingCollectionSharder())
    )
    spec = table_wise(rank=0) if sharding == "table_wise" else row_wise()
    plan = construct_module_sharding_plan(
        module, per_param_sharding={"t": spec}, sharder=sharder, world_size=1, local_size=1, device_type="cpu"
    )
    sharded = sharder.shard(module, plan, ShardingEnv.from_process_group(dist.group.WORLD), torch.device("cpu"))
    kjt = KeyedJaggedTensor(keys=["f", "g", "f"], values=torch.tensor([1, 2, 3]), lengths=torch.tensor([1, 1, 1]))
    _raises_and_unchanged(  # at the input dist's wait, as on every rank (test_input_dist_refusal.py)
        sharded,
        lambda m: m.input_dist(m.create_context(), kjt).wait(),
        ValueError,
        rf"{type(sharded).__name__}: KJT keys must be distinct, got \['f'\] more than once",
    )


# ---------------------------------------------------------------------------- module load_state_dict

P = "embedding_bags.t."


MODULE_STATES = [
    _case(
        "weight shape",
        lambda s: s.update({P + "weight": s[P + "weight"][:, :3]}),
        ValueError,
        r"weight must be \[3, 4\]",
    ),
    _case(
        "weight rows", lambda s: s.update({P + "weight": s[P + "weight"][:2]}), ValueError, r"weight must be \[3, 4\]"
    ),
    _case("row shape", lambda s: s.update({P + "row": s[P + "row"][:1]}), ValueError, r"row must be \[3\], got \[1\]"),
    _case(
        "metadata shape",
        lambda s: s.update({P + "metadata": s[P + "metadata"][:2]}),
        ValueError,
        r"metadata must be \[3\], got \[2\]",
    ),
    _case(
        "optimizer shape",
        lambda s: s.update({P + "optimizer.momentum1": s[P + "optimizer.momentum1"][:, :2]}),
        ValueError,
        r"optimizer.momentum1 must be \[3, 4\]",
    ),
    _case(
        "counters short",
        lambda s: s.update({P + "counters": s[P + "counters"][:2]}),
        ValueError,
        r"counters must be \[5\], got \[2\]",
    ),
    _case(
        "counters negative",
        lambda s: s.update({P + "counters": -s[P + "counters"] - 1}),
        ValueError,
        r"counters\[0\] \(clock\) must be in .* got -",
    ),
    _case(
        "weight int dtype",
        lambda s: s.update({P + "weight": s[P + "weight"].long()}),
        TypeError,
        "weight must be a floating-point tensor, got torch.int64",
    ),
    _case(
        "weight nan", lambda s: s[P + "weight"].__setitem__((0, 0), NAN), ValueError, "weight must be finite, got nan"
    ),
    _case(
        "weight inf", lambda s: s[P + "weight"].__setitem__((1, 2), INF), ValueError, "weight must be finite, got inf"
    ),
    _case(
        "optimizer nan",
        lambda s: s[P + "optimizer.momentum1"].__setitem__((0, 0), NAN),
        ValueError,
        "optimizer.momentum1 must be finite and >= 0, got nan",
    ),
    _case(
        "duplicate weight_id",
        lambda s: s.update({P + "weight_id": torch.tensor([3, 3, 5])}),
        ValueError,
        "weight_id must hold distinct ids, got 3 more than once",
    ),
    _case(
        "float weight_id",
        lambda s: s.update({P + "weight_id": s[P + "weight_id"].float() + 0.5}),
        TypeError,
        "weight_id must be an integer tensor, got torch.float32",
    ),
    _case(
        "float metadata",
        lambda s: s.update({P + "metadata": s[P + "metadata"].float() + 0.5}),
        TypeError,
        "metadata must be an integer tensor, got torch.float32",
    ),
]


@pytest.mark.parametrize("name,change,error,match", MODULE_STATES)
def test_module_load_state_dict(name, change, error, match):
    # Two tables: the good one ("a", loaded first) must not be changed by the bad one's failure.
    def make():
        module = DynamicEmbeddingBagCollection(
            [
                DynamicEmbeddingBagConfig(name=n, embedding_dim=4, num_embeddings=32, feature_names=[f"f{n}"])
                for n in "at"
            ],
            optimizer="adagrad",
        )
        module(
            KeyedJaggedTensor(
                keys=["fa", "ft"], values=torch.tensor([1, 2, 3, 4, 5, 6]), lengths=torch.tensor([1, 2, 1, 2])
            )
        ).values().sum().backward()
        return module

    state = _state(make())
    for key in state:  # the good table's content differs from the victim's, so a partial load shows
        if key.startswith("embedding_bags.a.weight") and state[key].is_floating_point():
            state[key] += 1.0
    change(state)
    assert state[P + "weight_id"].numel() == 3
    _raises_and_unchanged(make(), lambda m: m.load_state_dict(state), error, f"table 't'.*{match}")


def test_ftrl_settings_refused_by_the_class_and_on_param_groups():
    # The class (what apply_optimizer_in_backward builds) refuses as the module does.
    with pytest.raises(ValueError, match=r"Ftrl l1 must be finite and >= 0, got -0.5"):
        Ftrl([torch.nn.Parameter(torch.zeros(2))], l1=-0.5)
    # A zero accumulator is fine where the denominator cannot be 0 (beta or l2 > 0, or lr_power = 0).
    for ok in (
        {"initial_accumulator_value": 0.0, "l2": 0.1},
        {"initial_accumulator_value": 0.0, "beta": 1.0},
        {"initial_accumulator_value": 0.0, "lr_power": 0.0},
    ):
        DynamicEmbeddingBagCollection(_small_tables(), optimizer=Ftrl, optimizer_kwargs=ok)
    # Settings written into param_groups are refused before any row changes.
    ebc = DynamicEmbeddingBagCollection(_small_tables(), optimizer="ftrl", optimizer_kwargs={"lr": 0.1})
    kjt = KeyedJaggedTensor(keys=["f"], values=torch.tensor([1, 2]), lengths=torch.tensor([1, 1]))
    ebc(kjt).values().sum().backward()
    for name, value, match in (
        ("lr_power", 0.5, r"\['lr_power'\] must be <= 0"),
        ("lr", 0.0, r"\['lr'\] must be finite and > 0"),
        ("l2", -1.0, r"\['l2'\] must be finite and >= 0"),
    ):
        ebc.fused_optimizer.param_groups[0][name] = value
        _raises_and_unchanged(
            ebc,
            lambda m: m(kjt).values().sum().backward(),
            ValueError,
            f"DynamicEmbeddingFusedOptimizer: param_groups\\[0\\]{match}",
        )
        ebc.fused_optimizer.param_groups[0][name] = {"lr_power": -0.5, "lr": 0.1, "l2": 0.0}[name]


def test_fused_params_decoupled_weight_decay_only_with_adam():
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    from torchrec_ext.distributed import DynamicEmbeddingBagCollectionSharder

    with pytest.raises(
        ValueError,
        match=r"weight_decay_mode 'DECOUPLE' is not supported by dynamic tables with "
        r"EXACT_ADAGRAD; they support WeightDecayMode.NONE and L2, and DECOUPLE with ADAM",
    ):
        DynamicEmbeddingBagCollectionSharder(
            fused_params={"optimizer": EmbOptimType.EXACT_ADAGRAD, "weight_decay": 0.1, "weight_decay_mode": "DECOUPLE"}
        )
