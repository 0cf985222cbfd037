"""torch.compile of models holding our collections (issue 14, item 4).

Eval forward under torch.no_grad() / torch.inference_mode() compiles with fullgraph=True (the
hash-table lookup is traced as its op; the table's lock is not, see HashTable.find) and gives the
eager outputs, eval ids never inserted. A training forward of a model over our EBC (a DLRM, a
position-weighted FP-EBC) or EC compiles with fullgraph=True too (the lookup is one opaque op
whose backward is the fused update, modules/compiled_lookup.py) and trains exactly as eager
does: outputs, tables, optimizer state and position weights. Oracle: the same model trained
eagerly.
"""

import copy

import pytest
import torch
from torchrec import EmbeddingBagConfig, EmbeddingConfig, KeyedJaggedTensor
from torchrec.models.dlrm import DLRM
from torchrec.modules.feature_processor_ import PositionWeightedModule
from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection

from torchrec_ext import DynamicEmbeddingBagCollection, DynamicEmbeddingCollection


def _dlrm():
    torch.manual_seed(0)
    tables = [
        EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=64, feature_names=["f0"]),
        EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=64, feature_names=["f1"]),
    ]
    return DLRM(
        embedding_bag_collection=DynamicEmbeddingBagCollection(tables, optimizer="sgd", optimizer_kwargs={"lr": 0.1}),
        dense_in_features=3,
        dense_arch_layer_sizes=[4],
        over_arch_layer_sizes=[4, 1],
    )


class _SeqModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ec = DynamicEmbeddingCollection(
            [EmbeddingConfig(name="t0", embedding_dim=4, num_embeddings=64, feature_names=["f0", "f1"])],
            optimizer="sgd",
            optimizer_kwargs={"lr": 0.1},
        )
        self.out = torch.nn.Linear(4, 1)

    def forward(self, dense, kjt):
        jts = self.ec(kjt)
        pooled = jts["f0"].to_padded_dense(desired_length=3).sum(1) + jts["f1"].to_padded_dense(desired_length=3).sum(1)
        return self.out(pooled) + dense.sum(1, keepdim=True)


def _batch(step, batch=2):
    gen = torch.Generator().manual_seed(step)
    lengths = torch.randint(1, 3, (2 * batch,), generator=gen)
    values = torch.randint(0, 1 << 40, (int(lengths.sum()),), generator=gen)
    return torch.randn(batch, 3, generator=gen), KeyedJaggedTensor(
        keys=["f0", "f1"], values=values, lengths=lengths, stride=batch
    )


def _train(model, steps):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        model(*_batch(step)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.parametrize(
    "make, no_grad",
    [(_dlrm, torch.no_grad), (_SeqModel, torch.inference_mode)],
    ids=["dlrm-no_grad", "ec-inference_mode"],
)
def test_eval_forward_compiles_with_fullgraph(make, no_grad):
    model = make()
    _train(model, 3)
    model.eval()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    module = model.ec if isinstance(model, _SeqModel) else model.sparse_arch.embedding_bag_collection
    rows = module.num_live_rows()
    with no_grad():
        for step in (1, 2, 7):  # seen ids, then unseen ones (zeros, never inserted)
            torch.testing.assert_close(compiled(*_batch(step)), model(*_batch(step)))
    assert module.num_live_rows() == rows


class _PositionWeighted(torch.nn.Module):
    """TorchRec's FP-EBC (position weights) over a weighted EBC of ours, then a linear layer."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        tables = [EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=64, feature_names=["f0", "f1"])]
        ebc = DynamicEmbeddingBagCollection(tables, is_weighted=True, optimizer="adagrad", optimizer_kwargs={"lr": 0.1})
        processors = {f: PositionWeightedModule(max_feature_length=3) for f in ("f0", "f1")}
        self.fp_ebc = FeatureProcessedEmbeddingBagCollection(ebc, processors)
        self.out = torch.nn.Linear(8, 1)

    def forward(self, dense, kjt):
        return self.out(self.fp_ebc(kjt).values()) + dense.sum(1, keepdim=True)


@pytest.mark.parametrize("make", [_dlrm, _PositionWeighted, _SeqModel], ids=["dlrm", "position-weighted", "ec"])
def test_training_compiles_with_fullgraph_and_trains_as_eager(make):
    eager = make()
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model, fullgraph=True, backend="aot_eager")
    opt_eager = torch.optim.SGD(eager.parameters(), lr=0.1)
    opt_compiled = torch.optim.SGD(compiled_model.parameters(), lr=0.1)
    for step in range(4):
        want, got = eager(*_batch(step % 3)), compiled(*_batch(step % 3))
        torch.testing.assert_close(got, want)
        (want * torch.linspace(-1, 1, want.numel()).view_as(want)).sum().backward()
        (got * torch.linspace(-1, 1, got.numel()).view_as(got)).sum().backward()
        opt_eager.step()
        opt_compiled.step()
        opt_eager.zero_grad()
        opt_compiled.zero_grad()
    want, got = eager.state_dict(), compiled_model.state_dict()  # rows, ids, optimizer state, position weights
    assert want.keys() == got.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], msg=key)
    ours = next(m for m in compiled_model.modules() if hasattr(m, "num_live_rows"))
    assert ours.num_live_rows() > 0


def test_compiled_training_forward_without_backward_drops_its_oldest_lookups(monkeypatch):
    from torchrec_ext.modules import compiled_lookup

    monkeypatch.setattr(compiled_lookup, "MAX_PENDING", 2)
    model = _dlrm()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    outputs = [compiled(*_batch(0)) for _ in range(4)]  # forwards whose backward has not run
    assert len(compiled_lookup._PENDING) == 2
    outputs[-1].sum().backward()  # the newest still trains
    with pytest.raises(RuntimeError, match="its forward's lookup was dropped"):
        outputs[0].sum().backward()
