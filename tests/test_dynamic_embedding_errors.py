"""Bad input to the dynamic modules: a clear error naming the problem, and tables unchanged."""
import pytest
import torch
from torchrec import DataType, EmbeddingBagConfig, EmbeddingConfig, KeyedJaggedTensor

from torchrec_ext import DynamicEmbeddingBagCollection, DynamicEmbeddingBagConfig, DynamicEmbeddingCollection, Initializer


def _module(weighted=False):
    module = DynamicEmbeddingBagCollection(
        [DynamicEmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=64, feature_names=["f", "g"])],
        is_weighted=weighted, optimizer="adagrad")
    kjt = KeyedJaggedTensor(keys=["f", "g"], values=torch.tensor([1, 2, 3]), lengths=torch.tensor([1, 1, 1, 0]),
                            weights=torch.ones(3) if weighted else None)
    module(kjt).values().sum().backward()
    return module


def _snapshot(module):
    return {k: v.clone() for k, v in module.state_dict().items()}


def _unchanged(module, before):
    after = module.state_dict()
    return before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


BAD_INPUTS = [
    ("unknown key", False, dict(keys=["f", "g", "h"], values=torch.tensor([1, 2, 3]), lengths=torch.tensor([1, 1, 1])),
     ValueError, r"\['h'\] are not a feature of any table"),
    ("missing key", False, dict(keys=["f"], values=torch.tensor([1, 2]), lengths=torch.tensor([1, 1])),
     ValueError, r"lacks the features \['g'\]"),
    ("float ids", False, dict(keys=["f", "g"], values=torch.tensor([1.0, 2.0]), lengths=torch.tensor([1, 0, 1, 0])),
     TypeError, "ids .* must be int64 or int32, got torch.float32"),
    ("lengths sum", False, dict(keys=["f", "g"], values=torch.tensor([1, 2, 3]), lengths=torch.tensor([1, 0, 1, 0])),
     ValueError, "lengths sum to 2 but there are 3 ids"),
    ("negative length", False, dict(keys=["f", "g"], values=torch.tensor([1, 2]), lengths=torch.tensor([3, -1, 0, 0])),
     ValueError, "lengths must be >= 0, got a length of -1"),
    ("weights to unweighted", False, dict(keys=["f", "g"], values=torch.tensor([1, 2]), lengths=torch.tensor([1, 0, 1, 0]),
                                          weights=torch.ones(2)), ValueError, r"unweighted \(is_weighted=False\)"),
    ("no weights for weighted", True, dict(keys=["f", "g"], values=torch.tensor([1, 2]), lengths=torch.tensor([1, 0, 1, 0])),
     ValueError, r"is_weighted=True\) but the KJT has no weights"),
    ("nan weight", True, dict(keys=["f", "g"], values=torch.tensor([1, 2]), lengths=torch.tensor([1, 0, 1, 0]),
                              weights=torch.tensor([1.0, float("nan")])), ValueError, "weights must be finite"),
    ("inf weight", True, dict(keys=["f", "g"], values=torch.tensor([1, 2]), lengths=torch.tensor([1, 0, 1, 0]),
                              weights=torch.tensor([float("inf"), 1.0])), ValueError, "weights must be finite"),
]


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_kjt_is_rejected_and_tables_unchanged(case, training):
    _, weighted, kjt_args, error, message = case
    module = _module(weighted)
    module.train(training)
    before = _snapshot(module)
    with pytest.raises(error, match=message):
        module(KeyedJaggedTensor(**kjt_args))
    assert _unchanged(module, before)


def test_not_a_kjt():
    with pytest.raises(TypeError, match="features must be a KeyedJaggedTensor, got Tensor"):
        _module()(torch.tensor([1, 2]))


def test_ec_rejects_bad_input_too():
    ec = DynamicEmbeddingCollection([EmbeddingConfig(name="t", embedding_dim=4, num_embeddings=8)])
    with pytest.raises(ValueError, match="lengths sum to 1 but there are 2 ids"):
        ec(KeyedJaggedTensor(keys=["t"], values=torch.tensor([1, 2]), lengths=torch.tensor([1])))


BAD_CONFIGS = [
    (dict(eviction_policy="fifo"), ValueError, "eviction_policy must be one of"),
    (dict(eviction_policy="custom"), ValueError, "eviction_policy must be one of"),
    (dict(admit_after=0), ValueError, "admit_after must be an int >= 1, got 0"),
    (dict(ttl_steps=0), ValueError, "ttl_steps must be an int >= 1 or None, got 0"),
    (dict(initializer="xavier"), ValueError, "kind must be one of"),
    (dict(seed=1.5), TypeError, "seed must be an int"),
]


@pytest.mark.parametrize("fields,error,message", BAD_CONFIGS)
def test_bad_config_fields(fields, error, message):
    with pytest.raises(error, match=message):
        DynamicEmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=8, **fields)


def test_initializer_rejects_inverted_bounds():
    with pytest.raises(ValueError, match="low must be <= high, got low=1.0, high=0.0"):
        Initializer("uniform", low=1.0, high=0.0)


@pytest.mark.parametrize("tables,error,message", [
    ([], ValueError, "non-empty list"),
    ([EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=8)] * 2, ValueError, "Duplicate table name t"),
    ([EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=8, data_type=DataType.FP16)], ValueError, "data_type must be FP32"),
    ([EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=8, init_fn=torch.nn.init.zeros_)], ValueError,
     "custom init_fn cannot initialise rows id by id"),
])
def test_bad_tables(tables, error, message):
    with pytest.raises(error, match=message):
        DynamicEmbeddingBagCollection(tables)


@pytest.mark.parametrize("optimizer,kwargs,error,message", [
    (torch.optim.RMSprop, {}, ValueError, "optimizer must be torch.optim.SGD/Adagrad/Adam"),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, ValueError, "supports only momentum=0"),
    (torch.optim.Adam, {"amsgrad": True}, ValueError, "supports only amsgrad=False"),
    (torch.optim.Adagrad, {"betas": (0.9, 0.9)}, TypeError, r"adagrad does not take \['betas'\]"),
    (torch.optim.Adagrad, {"lr": -1.0}, ValueError, "lr must be a float >= 0"),
    (torch.optim.Adam, {"betas": (1.5, 0.9)}, ValueError, "betas must be in"),
])
def test_bad_optimizer(optimizer, kwargs, error, message):
    with pytest.raises(error, match=message):
        DynamicEmbeddingBagCollection([EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=8)],
                                      optimizer=optimizer, optimizer_kwargs=kwargs)
