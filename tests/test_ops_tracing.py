"""The ops have fake kernels: they trace under FakeTensorMode / make_fx / torch.compile."""

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import torchrec_ext
from torchrec_ext import HashTable


def test_fake_kernels_give_shapes_and_dtypes():
    table = HashTable(100)
    with FakeTensorMode(allow_non_fake_inputs=True):
        keys = torch.empty(7, dtype=torch.int64)
        rows, found = torch.ops.torchrec_ext.hash_find(table._digests, table._slot_keys, keys, 100)
        assert rows.shape == (7,) and rows.dtype == torch.int64 and found.dtype == torch.bool
        ranks = torch.ops.torchrec_ext.route(keys, 4)
        assert ranks.shape == (7,)


def test_find_traces_with_make_fx():
    table = HashTable(100)
    table.find_or_insert(torch.arange(10))

    def lookup(digests, slot_keys, keys):
        rows, found = torch.ops.torchrec_ext.hash_find(digests, slot_keys, keys, 100)
        return torch.where(found, rows, torch.zeros_like(rows))

    gm = make_fx(lookup, tracing_mode="fake")(table._digests, table._slot_keys, torch.arange(5))
    assert "torchrec_ext.hash_find" in gm.code
    keys = torch.arange(5, 15)
    assert torch.equal(gm(table._digests, table._slot_keys, keys), lookup(table._digests, table._slot_keys, keys))


def test_route_under_torch_compile():
    fn = torch.compile(lambda k: torchrec_ext.ops.route(k, 8) * 2, backend="eager", fullgraph=True)
    keys = torch.randint(-(2**62), 2**62, (100,))
    assert torch.equal(fn(keys), torchrec_ext.ops.route(keys, 8) * 2)


def test_embedding_op_fake_kernels():
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from torchrec_ext import ops

    with FakeTensorMode(shape_env=ShapeEnv()):  # dedup_segments' output size is data-dependent
        weights = torch.empty(10 * 4 + 5 * 8)
        offs, dims = torch.tensor([0, 40]), torch.tensor([4, 8])
        out = ops.pooled_lookup(
            weights,
            offs,
            dims,
            torch.tensor([0, 1]),
            torch.tensor([0, 4]),
            torch.tensor([False, True]),
            torch.empty(9, dtype=torch.int64),
            torch.empty(7, dtype=torch.int64),
            None,
            3,
            12,
        )
        assert out.shape == (3, 12) and out.dtype == torch.float32
        seq = ops.sequence_lookup(
            weights[:40], offs[:1], 4, torch.tensor([0]), torch.tensor([0, 9]), torch.empty(9, dtype=torch.int64)
        )
        assert seq.shape == (9, 4)
        unique, inverse, counts, unique_offsets = ops.dedup_segments(
            torch.empty(9, dtype=torch.int64), torch.tensor([0, 4, 9])
        )
        assert inverse.shape == (9,) and unique_offsets.shape == (3,) and unique.shape == counts.shape


def test_pooled_lookup_traces_with_make_fx():
    from torchrec_ext import ops

    inputs = (
        torch.randn(6 * 4),
        torch.tensor([0]),
        torch.tensor([4]),
        torch.tensor([0]),
        torch.tensor([0]),
        torch.tensor([False]),
        torch.tensor([1, 5, 2]),
        torch.tensor([0, 2, 3]),
    )

    def pooled(*tensors):
        return ops.pooled_lookup(*tensors, None, 2, 4) * 2

    gm = make_fx(pooled, tracing_mode="fake")(*inputs)
    assert "torchrec_ext.pooled_lookup" in gm.code
    assert torch.equal(gm(*inputs), pooled(*inputs))
