"""Serving modules (issue 17, item 2): torchrec_ext.inference.

Oracles: the trained model in eval mode (float32 rows: bit for bit), TorchRec's quantized
EmbeddingBagCollection holding the same rows (int8), the source module a replica follows through
its deltas, and rows written whole (every element equal) that a torn read would show.
"""

import json
import os
import subprocess
import sys
import threading

import pytest
import torch
from torch.export import Dim
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingConfig, KeyedJaggedTensor, PoolingType
from torchrec.models.dlrm import DLRM_DCN
from torchrec.modules.embedding_configs import DataType
from torchrec.quant.embedding_modules import EmbeddingBagCollection as QuantEmbeddingBagCollection

from modules_helpers import remap_kjt
from torchrec_ext import DynamicEmbeddingBagCollection, DynamicEmbeddingBagConfig, DynamicEmbeddingCollection
from torchrec_ext.inference import (
    InferenceEmbeddingBagCollection,
    InferenceEmbeddingCollection,
    convert_to_inference,
    load_inference_checkpoint,
)
from torchrec_ext.inference.storage import dequantize_rows, quantize_rows
from torchrec_ext.modules import DeltaError
from torchrec_ext.modules.deltas import Delta, DeltaToken, TableDelta

FEATURES = ["f0", "f1", "f2"]
DENSE_IN = 3
TOLERANCE = {torch.float16: dict(rtol=2e-3, atol=2e-3), "int8": dict(rtol=0.02, atol=0.02)}


def _tables(dim=8, capacity=128, cls=DynamicEmbeddingBagConfig, **kwargs):
    pooled = cls is DynamicEmbeddingBagConfig
    extra = [dict(pooling=PoolingType.SUM), dict(pooling=PoolingType.MEAN)] if pooled else [{}, {}]
    return [
        cls(name="t0", embedding_dim=dim, num_embeddings=capacity, feature_names=["f0"], **extra[0], **kwargs),
        cls(name="t1", embedding_dim=dim, num_embeddings=capacity, feature_names=["f1", "f2"], **extra[1], **kwargs),
    ]


def _dlrm(capacity=128):
    torch.manual_seed(0)
    ebc = DynamicEmbeddingBagCollection(
        _tables(capacity=capacity, eviction_policy="lru"), optimizer="adagrad", optimizer_kwargs={"lr": 0.1}
    )
    return DLRM_DCN(
        embedding_bag_collection=ebc,
        dense_in_features=DENSE_IN,
        dense_arch_layer_sizes=[16, 8],
        over_arch_layer_sizes=[8, 1],
        dcn_num_layers=2,
        dcn_low_rank_dim=4,
    )


def _kjt(seed, batch, pool=300, max_len=4):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, max_len, (len(FEATURES) * batch,), generator=g)
    values = torch.randint(0, pool, (int(lengths.sum()),), generator=g) * 7919 - 5  # seen ids and unseen ones
    return KeyedJaggedTensor(keys=FEATURES, values=values, lengths=lengths, stride=batch)


def _batch(seed, batch=4):
    return torch.randn(batch, DENSE_IN, generator=torch.Generator().manual_seed(seed)), _kjt(seed, batch)


def _trained_dlrm(steps=6, capacity=128):
    model = _dlrm(capacity)
    dense = torch.optim.SGD([p for n, p in model.named_parameters() if "embedding_bags" not in n], lr=0.1)
    for step in range(steps):
        labels = torch.randint(0, 2, (16,), generator=torch.Generator().manual_seed(step)).float()
        torch.nn.functional.binary_cross_entropy_with_logits(model(*_batch(step, 16)).squeeze(1), labels).backward()
        dense.step()
        dense.zero_grad()
    return model.eval()


def _ebc_of(model):
    return model.sparse_arch.embedding_bag_collection


# ----------------------------------------------------------------------------- conversion


@pytest.mark.parametrize("data_type", [None, torch.float16, "int8"], ids=["fp32", "fp16", "int8"])
def test_served_dlrm_gives_the_trained_models_eval_outputs(data_type):
    model = _trained_dlrm()
    live = _ebc_of(model).num_live_rows()
    served = convert_to_inference(model, data_type=data_type)
    assert isinstance(_ebc_of(served), InferenceEmbeddingBagCollection) and not served.training
    assert _ebc_of(model) is not _ebc_of(served) and isinstance(_ebc_of(model), DynamicEmbeddingBagCollection)
    tol = TOLERANCE.get(data_type, dict(rtol=0, atol=0))  # float32: bit for bit
    with torch.no_grad():
        for seed in (1, 2, 50):  # ids seen in training and never seen (zeros)
            want = model(*_batch(seed, 8))
            torch.testing.assert_close(served(*_batch(seed, 8)), want, **tol)
            kjt = _kjt(seed, 8)
            torch.testing.assert_close(_ebc_of(served)(kjt).values(), _ebc_of(model)(kjt).values(), **tol)
    assert _ebc_of(served).num_live_rows() == live == _ebc_of(model).num_live_rows()  # nothing inserted


@pytest.mark.parametrize("data_type", [None, "int8"], ids=["fp32", "int8"])
def test_served_sequence_collection_gives_the_trained_outputs(data_type):
    torch.manual_seed(0)
    ec = DynamicEmbeddingCollection(
        _tables(cls=EmbeddingConfig), optimizer="sgd", optimizer_kwargs={"lr": 0.5}, need_indices=True
    )
    for step in range(4):
        sum(jt.values().sum() for jt in ec(_kjt(step, 16)).values()).backward()
    ec.eval()
    served = convert_to_inference(ec, data_type=data_type)
    assert isinstance(served, InferenceEmbeddingCollection)
    tol = TOLERANCE.get(data_type, dict(rtol=0, atol=0))
    for seed in (1, 40):
        want, got = ec(_kjt(seed, 8)), served(_kjt(seed, 8))
        assert want.keys() == got.keys()
        for key in want:
            torch.testing.assert_close(got[key].values(), want[key].values(), **tol)
            assert torch.equal(got[key].lengths(), want[key].lengths())
            assert torch.equal(got[key].weights(), want[key].weights())


def test_int8_rows_read_as_torchrecs_quantized_ebc_holding_the_same_rows():
    model = _trained_dlrm()
    ours = _ebc_of(convert_to_inference(model, data_type=torch.int8))
    trained = _ebc_of(model)
    # TorchRec's EBC holding our live rows (+ a zero row for unseen ids), quantized by TorchRec.
    configs, maps = [], {}
    float_ebc_rows = {}
    for cfg in trained.embedding_bag_configs():
        sd = trained.state_dict()
        ids, vectors = sd[f"embedding_bags.{cfg.name}.weight_id"], sd[f"embedding_bags.{cfg.name}.weight"]
        maps[cfg.name] = {k: i for i, k in enumerate(ids.tolist())}
        float_ebc_rows[cfg.name] = torch.cat([vectors, torch.zeros(1, cfg.embedding_dim)])
        configs.append(
            EmbeddingBagConfig(
                name=cfg.name,
                embedding_dim=cfg.embedding_dim,
                num_embeddings=ids.numel() + 1,
                feature_names=list(cfg.feature_names),
                pooling=cfg.pooling,
            )
        )
    float_ebc = EmbeddingBagCollection(configs)
    with torch.no_grad():
        for name, rows in float_ebc_rows.items():
            float_ebc.embedding_bags[name].weight.copy_(rows)
    float_ebc.qconfig = torch.quantization.QConfig(
        activation=torch.quantization.PlaceholderObserver,
        weight=torch.quantization.PlaceholderObserver.with_args(dtype=torch.qint8),
    )
    theirs = QuantEmbeddingBagCollection.from_float(float_ebc)
    feature_table = {"f0": "t0", "f1": "t1", "f2": "t1"}
    for seed in (3, 4, 60):
        kjt = _kjt(seed, 32)
        want = theirs(remap_kjt(kjt, feature_table, maps)).to_dict()
        got = ours(kjt).to_dict()
        for key in FEATURES:
            # Same quantized bytes, same fbgemm kernel (t1 is mean-pooled): equal up to float rounding.
            torch.testing.assert_close(got[key], want[key], rtol=1e-6, atol=1e-6)


def test_unseen_ids_read_the_configured_default():
    model = _trained_dlrm()
    default = torch.arange(8, dtype=torch.float32)
    served = _ebc_of(convert_to_inference(model, defaults={"t0": default}))
    unseen = KeyedJaggedTensor(
        keys=FEATURES, values=torch.tensor([1, 3, 5, 7]), lengths=torch.tensor([2, 1, 1]), stride=1
    )
    out = served(unseen).to_dict()
    torch.testing.assert_close(out["f0"][0], 2 * default)  # two unseen ids, summed
    assert torch.equal(out["f1"], torch.zeros(1, 8)) and torch.equal(out["f2"], torch.zeros(1, 8))
    with pytest.raises(ValueError, match=r"defaults\['t0'\] must be one finite value or 8"):
        convert_to_inference(model, defaults={"t0": torch.ones(3)})
    with pytest.raises(ValueError, match=r"defaults names tables \['t9'\]"):
        convert_to_inference(model, defaults={"t9": 1.0})


def test_state_dict_and_checkpoint_give_the_same_served_model(tmp_path, one_rank_group):
    from torchrec_ext.distributed.checkpoint import save_checkpoint

    model = _trained_dlrm()
    from_module = convert_to_inference(model)
    from_state = convert_to_inference(_dlrm(), state_dict=model.state_dict())
    path = save_checkpoint(str(tmp_path), 6, {"model": model.state_dict(), "step": 6})
    with torch.device("meta"):
        skeleton = _dlrm()  # structure only
    from_checkpoint = load_inference_checkpoint(path, skeleton, data_type="int8")
    with torch.no_grad():
        for seed in (1, 2):
            want = model(*_batch(seed, 8))
            torch.testing.assert_close(from_module(*_batch(seed, 8)), want, rtol=0, atol=0)
            torch.testing.assert_close(from_state(*_batch(seed, 8)), want, rtol=0, atol=0)
            torch.testing.assert_close(from_checkpoint(*_batch(seed, 8)), want, **TOLERANCE["int8"])


def test_a_state_or_checkpoint_of_another_model_is_refused_naming_the_table(tmp_path):
    from torchrec_ext.distributed.checkpoint import save_checkpoint

    model = _trained_dlrm()
    sd = model.state_dict()
    prefix = "sparse_arch.embedding_bag_collection.embedding_bags."
    missing = {k: v for k, v in sd.items() if not k.startswith(prefix + "t1.")}
    with pytest.raises(ValueError, match=r"table 't1'.*no 'weight'"):
        convert_to_inference(_dlrm(), state_dict=missing)
    wider = dict(sd, **{prefix + "t0.weight": torch.zeros(sd[prefix + "t0.weight"].shape[0], 16)})
    with pytest.raises(ValueError, match=r"table 't0'.*weight has dim 16, the model's table has embedding_dim 8"):
        convert_to_inference(_dlrm(), state_dict=wider)
    extra = dict(sd, **{prefix + "t9.weight": torch.zeros(1, 8)})
    with pytest.raises(ValueError, match=r"tables \['t9'\]"):
        convert_to_inference(_dlrm(), state_dict=extra)
    dense = {k: v for k, v in sd.items() if "over_arch" not in k}
    with pytest.raises(ValueError, match=r"dense part: missing \['over_arch"):
        convert_to_inference(_dlrm(), state_dict=dense)
    with pytest.raises(ValueError, match=r"table 't0' capacity must be an int >= its"):
        convert_to_inference(model, capacity={"t0": 2})
    # A checkpoint of a model with other tables
    other = DLRM_DCN(
        embedding_bag_collection=DynamicEmbeddingBagCollection(
            [DynamicEmbeddingBagConfig(name="u0", embedding_dim=8, num_embeddings=16, feature_names=FEATURES)]
        ),
        dense_in_features=DENSE_IN,
        dense_arch_layer_sizes=[16, 8],
        over_arch_layer_sizes=[8, 1],
        dcn_num_layers=2,
        dcn_low_rank_dim=4,
    )
    path = save_checkpoint(str(tmp_path), 1, {"model": other.state_dict()})
    with pytest.raises(ValueError, match=r"table 't0'.*not in checkpoint"):
        load_inference_checkpoint(path, _dlrm())


def test_a_serving_module_refuses_to_train():
    served = convert_to_inference(_trained_dlrm())
    served.train()
    with pytest.raises(RuntimeError, match="InferenceEmbeddingBagCollection is read-only: it does not insert ids"):
        served(*_batch(1))
    with pytest.raises(RuntimeError, match="read-only: it has no optimizer"):
        _ = _ebc_of(served).fused_optimizer
    assert list(_ebc_of(served).parameters()) == []  # nothing for an optimizer to step


# ----------------------------------------------------------------------------- torch.export

_FRESH_PROCESS = r"""
import json, sys, torch
import torchrec_ext  # registers our ops and their fake kernels (and, through torchrec, fbgemm's)
from torchrec import KeyedJaggedTensor
results = []
for name in sys.argv[1:]:
    with torch.serialization.safe_globals([KeyedJaggedTensor]):
        program = torch.export.load(name + ".pt2")
    io = torch.load(name + ".io", weights_only=False)
    for args, want in zip(io["inputs"], io["outputs"]):
        results.append(torch.equal(program.module()(*args), want))
print(json.dumps(results))
"""


def test_exported_model_runs_after_load_in_a_fresh_process(tmp_path):
    model = _trained_dlrm()
    names = []
    for data_type in (None, "int8"):
        served = convert_to_inference(model, data_type=data_type)
        dynamic = ({0: Dim.AUTO}, [{0: Dim.AUTO}, None, {0: Dim.AUTO}, None, None, None])  # batch and id counts
        # Size-oblivious: batch 1 must not be a special case (export otherwise guards batch != 1).
        with torch.fx.experimental._config.patch(backed_size_oblivious=True):
            program = torch.export.export(served, _batch(0, 4), dynamic_shapes=dynamic, strict=False)
        name = str(tmp_path / f"dlrm_{data_type}")
        torch.export.save(program, name + ".pt2")
        inputs = [_batch(seed, batch) for seed, batch in ((7, 1), (8, 64), (9, 5))]  # other batch sizes
        with torch.no_grad():
            outputs = [served(*args) for args in inputs]
        for args, want in zip(inputs, outputs):
            torch.testing.assert_close(program.module()(*args), want, rtol=0, atol=0)
        torch.save({"inputs": inputs, "outputs": outputs}, name + ".io")
        names.append(name)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd()] + sys.path))
    done = subprocess.run(
        [sys.executable, "-c", _FRESH_PROCESS, *names], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [True] * 6


# ----------------------------------------------------------------------------- deltas


def test_a_serving_replica_follows_the_training_source_through_its_deltas():
    model = _trained_dlrm(capacity=64)  # LRU, small: training evicts (tombstones)
    source = _ebc_of(model)
    token = source.delta_token()
    replica = _ebc_of(convert_to_inference(model))
    replica.follow_deltas(token)
    source.train()
    tombstones = 0
    for step in range(6, 12):
        source(_kjt(step, 16, pool=600)).values().pow(2).sum().backward()  # new ids: inserted, evicting
        delta = source.export_delta(since=token)
        token = delta.token
        tombstones += sum(t.tombstones.numel() for t in delta.tables.values())
        replica.apply_delta(delta)
    source.eval()
    assert tombstones > 0
    assert replica.num_live_rows() == source.num_live_rows()
    for seed in range(5):
        kjt = _kjt(100 + seed, 16, pool=400)
        torch.testing.assert_close(replica(kjt).values(), source(kjt).values(), rtol=0, atol=0)
    with pytest.raises(DeltaError, match="out of order"):
        replica.apply_delta(delta)


def _constant_delta(since, table, ids, values, dim, dtype="float32", tombstones=None):
    weights = values.to(torch.float32).unsqueeze(1).expand(ids.numel(), dim).contiguous()
    return Delta(
        since=DeltaToken("src", since),
        token=DeltaToken("src", since + 1),
        source={"module": "DynamicEmbeddingBagCollection", "tables": {table: {"dim": dim, "dtype": dtype}}},
        tables={
            table: TableDelta(
                ids=ids,
                weights=weights.to(getattr(torch, dtype)),
                tombstones=torch.zeros(0, dtype=torch.int64) if tombstones is None else tombstones,
            )
        },
    )


def _serving_ebc(dim, capacity, data_type=None):
    ebc = DynamicEmbeddingBagCollection(
        [EmbeddingBagConfig(name="t0", embedding_dim=dim, num_embeddings=capacity, feature_names=["f0"])]
    )
    served = convert_to_inference(ebc.eval(), data_type=data_type)
    served.follow_deltas(DeltaToken("src", 1))
    return served


@pytest.mark.parametrize("data_type", [None, "int8"], ids=["fp32", "int8"])
def test_readers_see_each_row_before_or_after_an_update_never_half(data_type):
    dim, n = 512, 2048
    served = _serving_ebc(dim, 4096, data_type)
    ids = torch.arange(n, dtype=torch.int64) * 11
    kjt = KeyedJaggedTensor(keys=["f0"], values=ids, lengths=torch.ones(n, dtype=torch.int64), stride=n)
    torn, mixed, reads, stop = [], [], [0], threading.Event()

    def reader():
        while not stop.is_set():
            rows = served(kjt).values()  # one id per bag: each output row is one id's vector
            spread = rows.max(1).values - rows.min(1).values
            if bool((spread != 0).any()):
                torn.append(int((spread != 0).sum()))
            # Delta k writes k + 1 to the ids it keeps and removes the others (zeros): a read sees
            # one delta wholly, so its rows hold one nonzero value at most.
            if rows[:, 0][rows[:, 0] != 0].unique().numel() > 1:
                mixed.append(rows[:, 0].unique().tolist())
            reads[0] += 1

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    version = 1
    for k in range(40):  # every row rewritten whole (all elements equal), ids removed and back
        keep = ids[k % 2 :: 2] if k % 5 else ids
        gone = ids[(k + 1) % 2 :: 2] if k % 5 else torch.zeros(0, dtype=torch.int64)
        served.apply_delta(
            _constant_delta(version, "t0", keep, torch.full((keep.numel(),), float(k + 1)), dim, tombstones=gone)
        )
        version += 1
    stop.set()
    for t in threads:
        t.join()
    assert reads[0] > 0 and not torn, f"{len(torn)} of {reads[0]} reads saw half-written rows"
    assert not mixed, f"{len(mixed)} of {reads[0]} reads saw rows of two deltas, e.g. values {mixed[0]}"
    assert served.num_live_rows() == n // 2


def test_bad_deltas_are_refused_and_change_nothing():
    served = _serving_ebc(4, 64)
    first = torch.tensor([1, 2, 3])
    served.apply_delta(_constant_delta(1, "t0", first, torch.tensor([1.0, 2.0, 3.0]), 4))
    before = served.vectors("t0", first)
    with pytest.raises(
        DeltaError,
        match=r"table 't0' of the delta's source has dim 8 dtype float32, this module's "
        r"has dim 4 dtype float32",
    ):
        served.apply_delta(_constant_delta(2, "t0", first, torch.zeros(3), 8))
    with pytest.raises(DeltaError, match="dim 4 dtype float16, this module's has dim 4 dtype float32"):
        served.apply_delta(_constant_delta(2, "t0", first, torch.zeros(3), 4, dtype="float16"))
    with pytest.raises(DeltaError, match=r"delta has table 't9'"):
        served.apply_delta(_constant_delta(2, "t9", first, torch.zeros(3), 4))
    with pytest.raises(DeltaError, match="missing delta"):
        served.apply_delta(_constant_delta(5, "t0", first, torch.zeros(3), 4))
    crowded = torch.arange(1000, 1200, dtype=torch.int64)  # more ids than the 64 rows
    with pytest.raises(DeltaError, match=r"ids find no row at capacity 64.*nothing was applied"):
        served.apply_delta(_constant_delta(2, "t0", crowded, torch.zeros(200), 4, tombstones=first))
    assert torch.equal(served.vectors("t0", first), before) and served.num_live_rows() == 3
    served.apply_delta(_constant_delta(2, "t0", torch.tensor([4]), torch.tensor([4.0]), 4, tombstones=first[:1]))
    assert torch.equal(served.vectors("t0", torch.tensor([1, 4])), torch.tensor([[0.0] * 4, [4.0] * 4]))


def test_half_rows_and_expired_ids_serve_as_the_trained_module_reads_them():
    torch.manual_seed(0)
    tables = [
        DynamicEmbeddingBagConfig(
            name="t0", embedding_dim=8, num_embeddings=256, feature_names=["f0"], data_type=DataType.FP16
        ),
        DynamicEmbeddingBagConfig(
            name="t1", embedding_dim=8, num_embeddings=256, feature_names=["f1", "f2"], ttl_steps=2
        ),
    ]
    ebc = DynamicEmbeddingBagCollection(tables, optimizer="sgd", optimizer_kwargs={"lr": 0.1})
    for step in range(7):  # ids drift: t1's old ones expire (masked before they are swept)
        kjt = _kjt(step, 16, pool=40)
        shifted = KeyedJaggedTensor(keys=FEATURES, values=kjt.values() + 1000 * step, lengths=kjt.lengths(), stride=16)
        ebc(shifted).values().sum().backward()
    ebc.eval()
    served = convert_to_inference(ebc)
    assert served._tables.meta[0].dtype == torch.float16  # kept as trained
    for step in range(7):
        kjt = _kjt(step, 16, pool=40)
        shifted = KeyedJaggedTensor(keys=FEATURES, values=kjt.values() + 1000 * step, lengths=kjt.lengths(), stride=16)
        torch.testing.assert_close(served(shifted).values(), ebc(shifted).values(), rtol=0, atol=0)
    assert served.num_live_rows() < ebc.num_live_rows()  # expired ids left out


@pytest.mark.parametrize("data_type", [None, "int8"], ids=["fp32", "int8"])
def test_fallback_rows_serve_and_follow_deltas_as_the_trained_module_reads_them(data_type, tmp_path, one_rank_group):
    """A table with learned fallback rows (issue 18): ids without a row (not admitted, never seen)
    read the same fallback row in serving as in training's eval, converted from the module, a
    state_dict or a checkpoint, and deltas carry the fallback rows' updates to the replica."""
    from torchrec_ext.distributed.checkpoint import save_checkpoint

    torch.manual_seed(0)
    source = DynamicEmbeddingBagCollection(
        _tables(fallback_rows=8, admission="counter", admit_after=3), optimizer="adagrad", optimizer_kwargs={"lr": 0.1}
    )
    for step in range(4):
        source(_kjt(step, 16)).values().pow(2).sum().backward()
    source.eval()
    token = source.delta_token()
    path = save_checkpoint(str(tmp_path), 1, {"model": source.state_dict()})
    skeleton = DynamicEmbeddingBagCollection(
        _tables(fallback_rows=8, admission="counter", admit_after=3),
        optimizer="adagrad",
        optimizer_kwargs={"lr": 0.1},
        device=torch.device("meta"),
    )
    served = [
        convert_to_inference(source, data_type=data_type),
        convert_to_inference(skeleton, state_dict=source.state_dict(), data_type=data_type),
        load_inference_checkpoint(path, skeleton, data_type=data_type),
    ]
    tolerance = dict(rtol=0, atol=0) if data_type is None else TOLERANCE["int8"]
    for seed in range(3):
        kjt = _kjt(50 + seed, 16, pool=900)
        want = source(kjt).values()
        assert want.abs().sum() > 0
        for replica in served:
            torch.testing.assert_close(replica(kjt).values(), want, **tolerance)
    replica = served[0]
    replica.follow_deltas(token)
    source.train()
    for step in range(4, 8):
        source(_kjt(step, 16)).values().pow(2).sum().backward()
        delta = source.export_delta(since=token)
        token = delta.token
        assert any(t.fallback_slots is not None and t.fallback_slots.numel() for t in delta.tables.values())
        replica.apply_delta(delta)
    source.eval()
    for seed in range(3):
        kjt = _kjt(70 + seed, 16, pool=900)
        torch.testing.assert_close(replica(kjt).values(), source(kjt).values(), **tolerance)
    with pytest.raises(ValueError, match="defaults names tables .* learned fallback rows"):
        convert_to_inference(source, defaults={"t0": 1.0})


@pytest.mark.parametrize("data_type", [None, "int8"], ids=["fp32", "int8"])
@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_a_serving_replica_of_a_full_table_follows_every_delta(policy, data_type):
    """The source's table stays full (it evicts at every step): the serving replica, at the same
    capacity, re-places its table when a greedy insert of a delta's new ids finds their buckets
    full, and reads each id as the source does, bit for bit, after every delta."""
    capacity = 128
    source = DynamicEmbeddingBagCollection(
        _tables(dim=4, capacity=capacity, eviction_policy=policy), optimizer="adagrad", optimizer_kwargs={"lr": 0.1}
    )

    def train(step):
        source(_kjt(step, 64, pool=1000)).values().pow(2).sum().backward()

    step = 0
    while source.num_live_rows() < 2 * capacity:
        train(step)
        step += 1
    token = source.delta_token()
    replica = convert_to_inference(source.eval(), data_type=data_type)
    replica.follow_deltas(token)
    source.train()
    # int8: each row as quantizing the source's row gives it, bit for bit
    served = (lambda w: w) if data_type is None else (lambda w: dequantize_rows(quantize_rows(w)))
    for k in range(10):
        train(step + k)
        delta = source.export_delta(since=token)
        token = delta.token
        assert source.num_live_rows() == 2 * capacity and delta.tables["t0"].tombstones.numel() > 0
        replica.apply_delta(delta)
        assert replica.num_live_rows() == source.num_live_rows()
        state = source.state_dict()
        for t in ("t0", "t1"):
            ids = state[f"embedding_bags.{t}.weight_id"]
            assert torch.equal(replica.vectors(t, ids), served(state[f"embedding_bags.{t}.weight"])), (k, t)


def test_readers_see_held_ids_through_re_placements(monkeypatch):
    """A full serving table that re-places its rows for a delta moves every held id's row while
    readers read: each read of the ids no delta touches still gives their vectors."""
    from torchrec_ext.modules import delta_placement

    replaced = []
    exact = delta_placement.place_exactly
    monkeypatch.setattr(delta_placement, "place_exactly", lambda *a: replaced.append(1) or exact(*a))
    capacity, dim = 128, 16
    served = _serving_ebc(dim, capacity)
    stable = torch.arange(100, dtype=torch.int64) * 31 + 7  # never tombstoned: they read their id
    churn = torch.arange(1_000_000, 1_000_028, dtype=torch.int64)
    served.apply_delta(_constant_delta(1, "t0", torch.cat([stable, churn]), torch.cat([stable, churn]).float(), dim))
    assert served.num_live_rows() == capacity
    kjt = KeyedJaggedTensor(keys=["f0"], values=stable, lengths=torch.ones(100, dtype=torch.int64), stride=100)
    want = stable.float().unsqueeze(1).expand(100, dim)
    wrong, reads, stop = [], [0], threading.Event()

    def reader():
        while not stop.is_set():
            if not torch.equal(served(kjt).values(), want):
                wrong.append(reads[0])
            reads[0] += 1

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    for k in range(30):  # the churned ids replaced by as many new ones: the table stays full
        fresh = torch.arange(28, dtype=torch.int64) * 7919 + 2_000_000 + 1000 * k
        served.apply_delta(_constant_delta(2 + k, "t0", fresh, fresh.float(), dim, tombstones=churn))
        churn = fresh
    stop.set()
    for t in threads:
        t.join()
    assert served.num_live_rows() == capacity
    assert torch.equal(served.vectors("t0", churn), churn.float().unsqueeze(1).expand(28, dim))
    assert replaced, "no delta needed a re-placement: the test does not test it"
    assert reads[0] > 0 and not wrong, f"{len(wrong)} of {reads[0]} reads saw a held id's row wrong"


@pytest.mark.parametrize("data_type", [None, "int8"], ids=["fp32", "int8"])
def test_lookups_read_every_held_id_as_deltas_grow_and_shrink_the_read_index(data_type):
    """The read index lookups use (read_index.py) is sized by live ids: deltas that add ids past
    its load limit, erase most of them, re-assign rows and add more go through updates in place
    and rebuilds; every lookup still reads what the table's own index (``vectors``) says, and
    unseen and tombstoned ids read zeros."""
    from torchrec_ext.inference import read_index

    dim, served = 4, _serving_ebc(4, 4096, data_type)
    sizes = []
    live: dict[int, float] = {}
    gen = torch.Generator().manual_seed(0)
    for version in range(1, 9):
        held = torch.tensor(sorted(live), dtype=torch.int64)
        gone = held[torch.rand(held.numel(), generator=gen) < (0.7 if version in (4, 7) else 0.05)]
        fresh = torch.randint(-(2**62), 2**62, (150 * version,), generator=gen).unique()
        again = held[~torch.isin(held, gone)][:20]  # re-assigned rows of held ids
        ids = torch.cat([fresh, again])
        values = torch.randint(1, 100, (ids.numel(),), generator=gen).float()
        served.apply_delta(_constant_delta(version, "t0", ids, values, dim, tombstones=gone))
        for i in gone.tolist():
            del live[i]
        live.update(zip(ids.tolist(), values.tolist()))
        sizes.append((len(live), served._tables.read_indexes[0].key_slots))
        probe = torch.cat([torch.tensor(sorted(live), dtype=torch.int64), gone, torch.tensor([12345, -(2**63)])])
        kjt = KeyedJaggedTensor(keys=["f0"], values=probe, lengths=torch.ones(probe.numel(), dtype=torch.int64))
        got = served(kjt).values()
        want = torch.tensor([live.get(i, 0.0) for i in probe.tolist()]).unsqueeze(1).expand(-1, dim)
        torch.testing.assert_close(got, want, **({} if data_type is None else TOLERANCE["int8"]))
        torch.testing.assert_close(got, served.vectors("t0", probe), rtol=0, atol=0)
    assert len({slots for _, slots in sizes}) > 2, f"the read index was never rebuilt: (live, key slots) {sizes}"
    assert max(n / slots for n, slots in sizes) <= read_index.MAX_LOAD
