"""The ops have fake kernels: they trace under FakeTensorMode / make_fx / torch.compile."""
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import torchrec_ext  # noqa: F401  (registers the ops)
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
