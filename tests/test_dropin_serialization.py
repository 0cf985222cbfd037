"""Copying, tracing and exporting modules that hold our collections, as TorchRec users do with
theirs (issue 14, item 4).

- copy.deepcopy, pickle and torch.save(module) of a trained DynamicEmbeddingBagCollection /
  DynamicEmbeddingCollection / TorchRec DLRM over ours: the copy has the same state (rows,
  optimizer state, counters, index), its fused optimizer holds the copy's parameters, and it
  trains identically to the original, and independently of it. Oracle: the original module.
"""

import copy
import io
import pickle
import threading

import pytest
import torch
import torch.fx
import torchrec
import torchrec.fx as torchrec_fx
from torchrec import EmbeddingBagConfig, EmbeddingConfig, KeyedJaggedTensor
from torchrec.models.deepfm import SimpleDeepFMNN
from torchrec.models.dlrm import DLRM
from torchrec.optim import apply_optimizer_in_backward
from torchrec.optim.optimizers import in_backward_optimizer_filter

from modules_helpers import random_kjt
from torchrec_ext import DynamicEmbeddingBagCollection, DynamicEmbeddingCollection, HashTable

FEATURES = ["f0", "f1", "f2"]
DIM, CAPACITY, BATCH, DENSE_IN = 4, 64, 8, 5
ID_POOL = torch.randint(-(2**62), 2**62, (200,), generator=torch.Generator().manual_seed(3))


def _ebc(**kwargs) -> DynamicEmbeddingBagCollection:
    tables = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=DIM, num_embeddings=CAPACITY, feature_names=[f])
        for i, f in enumerate(FEATURES)
    ]
    return DynamicEmbeddingBagCollection(tables, **kwargs)


def _ec() -> DynamicEmbeddingCollection:
    tables = [
        EmbeddingConfig(name=f"t{i}", embedding_dim=DIM, num_embeddings=CAPACITY, feature_names=[f])
        for i, f in enumerate(FEATURES)
    ]
    return DynamicEmbeddingCollection(tables, optimizer=torch.optim.Adam, optimizer_kwargs={"lr": 0.05})


def _dlrm(ebc) -> DLRM:
    return DLRM(
        embedding_bag_collection=ebc,
        dense_in_features=DENSE_IN,
        dense_arch_layer_sizes=[8, DIM],
        over_arch_layer_sizes=[8, 1],
    )


class _Model:
    """A module under test with one training step: forward, loss, backward (fused update),
    and for the DLRM a dense optimizer step over the copy's own parameters."""

    def __init__(self, kind: str, module: torch.nn.Module):
        self.kind, self.module = kind, module
        self.dense = None
        if kind == "dlrm":
            params = [p for _, p in in_backward_optimizer_filter(module.named_parameters())]
            self.dense = torch.optim.SGD(params, lr=0.1)

    def forward(self, batch):
        dense, kjt = batch
        if self.kind in ("dlrm", "seq"):
            return self.module(dense, kjt)
        out = self.module(kjt)
        if self.kind == "ebc":
            return out.values()
        return torch.cat([jt.values() for jt in out.values()])

    def step(self, batch) -> torch.Tensor:
        self.module.train()
        if self.dense is not None:
            self.dense.zero_grad()
        out = self.forward(batch)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        if self.dense is not None:
            self.dense.step()
        return out.detach()


def _make(kind: str) -> _Model:
    torch.manual_seed(0)
    if kind == "ebc":
        return _Model(kind, _ebc(optimizer=torch.optim.Adagrad, optimizer_kwargs={"lr": 0.1}))
    if kind == "ec":
        return _Model(kind, _ec())
    ebc = _ebc()  # the optimizer the TorchRec way: markers on the parameters
    apply_optimizer_in_backward(torch.optim.Adagrad, ebc.parameters(), {"lr": 0.1})
    return _Model(kind, _dlrm(ebc))


def _batch(seed: int):
    torch.manual_seed(seed)
    return torch.randn(BATCH, DENSE_IN), random_kjt(FEATURES, BATCH, ID_POOL)


def _collection(model: _Model):
    return model.module.sparse_arch.embedding_bag_collection if model.kind == "dlrm" else model.module


def _state(model: _Model):
    return {k: v.clone() for k, v in model.module.state_dict().items()}


def _assert_same_state(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _deepcopy(m):
    return copy.deepcopy(m)


def _pickle(m):
    return pickle.loads(pickle.dumps(m))


def _torch_save(m):
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


COPIES = {"deepcopy": _deepcopy, "pickle": _pickle, "torch.save": _torch_save}


@pytest.mark.parametrize("how", list(COPIES))
@pytest.mark.parametrize("kind", ["ebc", "ec", "dlrm"])
def test_copy_of_trained_module_trains_identically_and_independently(kind, how):
    original = _make(kind)
    for seed in range(4):
        original.step(_batch(seed))
    # Copied between a training forward and its backward: the new rows of that batch are
    # pending (CPU defers their write to the fused update); the copy must hold them too.
    # (Its backward is then dropped: both go on from the same state.)
    pending = original.forward(_batch(4))
    assert _collection(original)._tables._new_rows is not None
    copied = _Model(kind, COPIES[how](original.module))
    del pending
    ours, theirs = _collection(original), _collection(copied)
    assert theirs is not ours and theirs._tables is not ours._tables
    assert theirs.num_live_rows() == ours.num_live_rows() > 0
    assert theirs._tables._new_rows is None  # written before copying, not carried as pending
    _assert_same_state(_state(copied), _state(original))  # rows, ids, scores, optimizer state, counters

    # The copy's fused optimizer holds the copy's parameters, and its parameters view its storage.
    copy_params = dict(theirs.named_parameters())
    fused = theirs.fused_optimizer
    assert fused is not ours.fused_optimizer
    assert all(any(p is q for q in copy_params.values()) for p in fused.params.values())
    for table in theirs._table_modules():
        assert table.weight.data_ptr() >= theirs._tables.weights.data_ptr()
        assert table.weight._in_backward_optimizers == [theirs._fused]

    # Same next step, same outputs and state.
    for seed in (5, 6):
        torch.testing.assert_close(copied.step(_batch(seed)), original.step(_batch(seed)), rtol=0, atol=0)
    _assert_same_state(_state(copied), _state(original))

    # Independent: training the copy leaves the original as it was.
    before = _state(original)
    copied.step(_batch(7))
    _assert_same_state(_state(original), before)
    assert any(not torch.equal(v, before[k]) for k, v in _state(copied).items())


def test_copy_keeps_a_changed_learning_rate():
    original = _make("ebc")
    original.step(_batch(0))
    original.module.fused_optimizer.param_groups[0]["lr"] = 0.5  # as an LR scheduler does
    copied = _Model("ebc", copy.deepcopy(original.module))
    assert copied.module.fused_optimizer.param_groups[0]["lr"] == 0.5
    torch.testing.assert_close(copied.step(_batch(1)), original.step(_batch(1)), rtol=0, atol=0)
    _assert_same_state(_state(copied), _state(original))


@pytest.mark.parametrize("how", list(COPIES))
def test_hash_table_copies_with_its_own_lock(how):
    table = HashTable(256, policy="lfu")
    table.find_or_insert(ID_POOL[:100])
    table.set_epoch(3)
    twin = COPIES[how](table)
    want, got = table.state_dict(), twin.state_dict()
    assert {k: v for k, v in got.items() if not torch.is_tensor(v)} == {
        k: v for k, v in want.items() if not torch.is_tensor(v)
    }
    for k in ("keys", "rows", "scores"):
        assert torch.equal(got[k], want[k])
    assert twin._lock is not table._lock
    # Each lock works on its own: the copy is usable while the original's lock is held.
    with table._lock.write():
        done = threading.Event()
        threading.Thread(target=lambda: (twin.find_or_insert(ID_POOL[100:110]), done.set())).start()
        assert done.wait(10)
    assert twin.size() == 110 and table.size() == 100


# ----------------------------------------------------------------------------- torch.fx / torchrec.fx

TRACERS = {"torch.fx": torch.fx.symbolic_trace, "torchrec.fx": torchrec_fx.symbolic_trace}


def _deepfm(ebc) -> SimpleDeepFMNN:
    return SimpleDeepFMNN(
        num_dense_features=DENSE_IN, embedding_bag_collection=ebc, hidden_layer_size=8, deep_fm_dimension=4
    )


class _SequenceModel(torch.nn.Module):
    """A model over an EmbeddingCollection: the mean of each feature's vectors."""

    def __init__(self, ec):
        super().__init__()
        self.ec = ec

    def forward(self, dense: torch.Tensor, kjt: KeyedJaggedTensor) -> torch.Tensor:
        per_feature = self.ec(kjt)
        return dense.sum(1, keepdim=True) + torch.cat([per_feature[f].values() for f in FEATURES]).sum()


def _traceable(arch: str, ours: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    if arch == "sequence":
        ec = (
            _ec()
            if ours
            else torchrec.EmbeddingCollection(
                tables=[
                    EmbeddingConfig(name=f"t{i}", embedding_dim=DIM, num_embeddings=CAPACITY, feature_names=[f])
                    for i, f in enumerate(FEATURES)
                ]
            )
        )
        return _SequenceModel(ec)
    ebc = (
        _ebc(optimizer=torch.optim.Adagrad, optimizer_kwargs={"lr": 0.1})
        if ours
        else torchrec.EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(name=f"t{i}", embedding_dim=DIM, num_embeddings=CAPACITY, feature_names=[f])
                for i, f in enumerate(FEATURES)
            ]
        )
    )
    return _dlrm(ebc) if arch == "dlrm" else _deepfm(ebc)


@pytest.mark.parametrize("tracer", list(TRACERS))
@pytest.mark.parametrize("arch", ["dlrm", "deepfm", "sequence"])
def test_symbolic_trace_of_model_holding_ours_gives_its_outputs(arch, tracer):
    # TorchRec's own modules trace in the same models with the same tracer (ids < num_embeddings).
    theirs = _traceable(arch, ours=False).eval()
    small = (torch.randn(BATCH, DENSE_IN), random_kjt(FEATURES, BATCH, torch.arange(CAPACITY)))
    torch.testing.assert_close(TRACERS[tracer](theirs)(*small), theirs(*small))

    model = _traceable(arch, ours=True)
    trained = _Model("dlrm" if arch != "sequence" else "seq", model)
    for seed in range(3):
        trained.step(_batch(seed))
    twin = copy.deepcopy(model)
    gm = TRACERS[tracer](model)
    assert isinstance(gm, torch.fx.GraphModule)
    leaves = [n.target for n in gm.graph.nodes if n.op == "call_module"]
    assert any(t.endswith("embedding_bag_collection") or t == "ec" for t in leaves), leaves

    # Eval: ids seen in training and never seen, same outputs as the module (and no insertion).
    model.eval(), gm.eval(), twin.eval()
    live = sum(m.num_live_rows() for m in model.modules() if hasattr(m, "num_live_rows"))
    for seed in (10, 11):
        batch = _batch(seed)
        torch.testing.assert_close(gm(*batch), twin(*batch), rtol=0, atol=0)
    assert sum(m.num_live_rows() for m in model.modules() if hasattr(m, "num_live_rows")) == live

    # Training through the traced graph inserts and updates rows as the module itself does.
    gm.train(), twin.train()
    for seed in (12, 13):
        batch = _batch(seed)
        a, b = gm(*batch), twin(*batch)
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        a.sum().backward(), b.sum().backward()
    traced = {k: v for k, v in gm.state_dict().items() if not k.startswith("_tensor_constant")}  # DLRM's triu indices
    _assert_same_state(traced, twin.state_dict())


# ----------------------------------------------------------------------------- torch.export


def _same_shapes_batch(seed: int, pool: torch.Tensor):
    """A batch of the shapes of ``_batch(0)`` (ids count, batch size) with other ids and lengths."""
    dense, kjt = _batch(0)
    g = torch.Generator().manual_seed(seed)
    lengths = torch.zeros(kjt.lengths().numel(), dtype=torch.int64)
    for _ in range(kjt.values().numel()):
        lengths[torch.randint(0, lengths.numel(), (1,), generator=g)] += 1
    values = pool[torch.randint(0, pool.numel(), (kjt.values().numel(),), generator=g)]
    return torch.randn(dense.shape, generator=g), KeyedJaggedTensor(
        keys=FEATURES, values=values, lengths=lengths, stride=BATCH
    )


@pytest.mark.parametrize("arch", ["dlrm", "sequence"])
def test_export_in_eval_gives_the_models_outputs(arch):
    model = _traceable(arch, ours=True)
    trained = _Model("dlrm" if arch != "sequence" else "seq", model)
    for seed in range(3):
        trained.step(_batch(seed))
    model.eval()
    collection = next(m for m in model.modules() if hasattr(m, "num_live_rows"))
    live = collection.num_live_rows()
    seen = torch.cat([ids for ids, _, _ in collection._tables.indexes[0].export()])
    ep = torch.export.export(model, _batch(0), strict=False)
    exported = ep.module()
    for seed in (20, 21, 22):
        # Ids seen in training (rows) and never seen (zeros), lengths other than the example's.
        batch = _same_shapes_batch(seed, torch.cat([seen, ID_POOL]))
        torch.testing.assert_close(exported(*batch), model(*batch), rtol=0, atol=0)
    assert collection.num_live_rows() == live  # eval: nothing inserted, when exporting or running
    buf = io.BytesIO()  # torch.export.save / load: the same program, tables included
    torch.export.save(ep, buf)
    buf.seek(0)
    with torch.serialization.safe_globals([KeyedJaggedTensor]):  # the saved example inputs hold a KJT
        loaded = torch.export.load(buf)
    torch.testing.assert_close(loaded.module()(*batch), model(*batch), rtol=0, atol=0)

    # The KJT checks are the program's runtime asserts: negative lengths are still refused.
    dense, kjt = _batch(0)
    lengths = kjt.lengths().clone()
    lengths[0], lengths[1] = lengths[0] + lengths[1] + 1, -1
    bad = KeyedJaggedTensor(keys=FEATURES, values=kjt.values(), lengths=lengths, stride=BATCH)
    with pytest.raises(RuntimeError, match="u0 >= 0|lengths must be >= 0"):
        exported(dense, bad)


# ----------------------------------------------------------------------------- torch.jit.script


@pytest.mark.parametrize("arch", ["dlrm", "sequence"])
def test_jit_script_refuses_with_a_message_pointing_to_export(arch):
    model = _traceable(arch, ours=True)
    name = "DynamicEmbeddingBagCollection" if arch == "dlrm" else "DynamicEmbeddingCollection"
    with pytest.raises(TypeError, match=rf"{name} cannot be compiled by torch.jit.script.*torch.export.export"):
        torch.jit.script(model)
