"""fbgemm's ``output_dtype`` fused_param on our sharders (2 gloo ranks): FP16 / BF16 outputs are
the float32 module's outputs cast once, and training on them equals training the float32 module
with the gradient cast through the output dtype (the update itself stays float32)."""

import pytest
import torch
from fbgemm_gpu.split_embedding_configs import SparseType
from torchrec import KeyedJaggedTensor, PoolingType

from dist_helpers import ModelWith, dmp_of, run_ranks
from torchrec_ext import (
    DynamicEmbeddingBagCollection,
    DynamicEmbeddingBagConfig,
    DynamicEmbeddingCollection,
    DynamicEmbeddingConfig,
)
from torchrec_ext.distributed import DynamicEmbeddingBagCollectionSharder, DynamicEmbeddingCollectionSharder

WORLD, BATCH, KEYS = 2, 4, ["f1", "f2"]


def _batch(step, rank):
    gen = torch.Generator().manual_seed(step * 10 + rank)
    lengths = torch.randint(0, 4, (len(KEYS) * BATCH,), generator=gen)
    values = torch.randint(0, 50, (int(lengths.sum()),), generator=gen)
    return KeyedJaggedTensor(keys=KEYS, values=values, lengths=lengths, stride=BATCH)


def _dmp(module, name, sharder, generator, world_size):
    tables = {t: generator(compute_kernel="customized_kernel") for t in ("t1", "t2")}
    return dmp_of(ModelWith(name, module), name, tables, sharder, world_size)


def _ebc():
    return DynamicEmbeddingBagCollection(
        [
            DynamicEmbeddingBagConfig(name="t1", embedding_dim=8, num_embeddings=64, feature_names=["f1"]),
            DynamicEmbeddingBagConfig(
                name="t2", embedding_dim=4, num_embeddings=64, feature_names=["f2"], pooling=PoolingType.MEAN
            ),
        ],
        optimizer="adagrad",
        optimizer_kwargs={"lr": 0.3},
    )


def _ec():
    return DynamicEmbeddingCollection(
        [
            DynamicEmbeddingConfig(name="t1", embedding_dim=4, num_embeddings=64, feature_names=["f1"]),
            DynamicEmbeddingConfig(name="t2", embedding_dim=4, num_embeddings=64, feature_names=["f2"]),
        ],
        optimizer="adagrad",
        optimizer_kwargs={"lr": 0.3},
    )


def _values(kind, out):
    if kind == "ebc":
        return out.values()
    return torch.cat([out[k].values() for k in sorted(out.keys())])  # an EC's JaggedTensors


def _check(rank, world_size, kind, sparse_type):
    from torchrec.distributed.sharding_plan import column_wise, row_wise

    dtype = sparse_type.as_dtype()
    if kind == "ebc":
        make, name, sharder_cls, generator = _ebc, "ebc", DynamicEmbeddingBagCollectionSharder, row_wise
    else:  # column-wise: each rank sends back its columns of every vector
        make, name, sharder_cls = _ec, "ec", DynamicEmbeddingCollectionSharder
        generator = lambda **kw: column_wise(ranks=[0, 1], **kw)
    full = _dmp(make(), name, sharder_cls(), generator, world_size)
    half = _dmp(make(), name, sharder_cls(fused_params={"output_dtype": sparse_type}), generator, world_size)
    for step in range(3):
        kjt = _batch(step, rank)
        want, got = _values(kind, full(kjt)), _values(kind, half(kjt))
        assert want.dtype == torch.float32 and got.dtype == dtype
        torch.testing.assert_close(got, want.to(dtype), rtol=0, atol=0)
        grad = torch.randn(got.shape, generator=torch.Generator().manual_seed(step * 3 + rank)).to(dtype)
        (got * grad).sum().backward()
        (want * grad.float()).sum().backward()  # the oracle: the same gradient, cast through the dtype
    sd_full, sd_half = full.module.state_dict(), half.module.state_dict()
    weights = [key for key in sd_full if key.endswith(".weight")]
    assert len(weights) == 2
    for key in weights:
        shards = lambda sd: [s.tensor for s in sd[key].local_shards()]
        torch.testing.assert_close(shards(sd_half), shards(sd_full), rtol=0, atol=0)


def _check_both(rank, world_size):
    _check(rank, world_size, "ebc", SparseType.FP16)
    _check(rank, world_size, "ec", SparseType.BF16)


def test_output_dtype_is_the_float32_output_cast_and_trains_alike():
    run_ranks(_check_both, WORLD)  # one spawn for both modules: the spawn is most of the time


@pytest.mark.parametrize("sharder_cls", [DynamicEmbeddingBagCollectionSharder, DynamicEmbeddingCollectionSharder])
def test_unsupported_output_dtype_is_refused(sharder_cls):
    with pytest.raises(ValueError, match=r"output_dtype <SparseType.INT8.*FP16"):
        sharder_cls(fused_params={"output_dtype": SparseType.INT8})
    with pytest.raises(ValueError, match=r"output_dtype torch.float64"):
        sharder_cls(fused_params={"output_dtype": torch.float64})
