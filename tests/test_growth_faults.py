"""A growth whose memory runs out anywhere (issue 15 item 5): on a GPU, any allocation of a growth
(the new index, the row maps, the buffers, the last-seen steps, the delta log's map) may raise
``torch.OutOfMemoryError``. Whichever one does, the lookup raises ``GrowthError`` naming the
tables and the bytes, the tables are unchanged, and they keep training as if it never happened.

The allocations are made to fail one at a time by a dispatch mode that raises
``torch.OutOfMemoryError`` at the k-th operator of the growth that returns a new tensor, for every k
until a growth runs through. The buffers are plain ones, as on a GPU (no reserved address space).
Oracle: the same module preallocated, fed the same stream.
"""

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torchrec import KeyedJaggedTensor
from torchrec.modules.embedding_configs import DataType

from matrix import FULL_MATRIX
from torchrec_ext import DynamicEmbeddingBagCollection, DynamicEmbeddingBagConfig
from torchrec_ext.modules import GrowthError, table_growth, table_storage

NUM_EMBEDDINGS = 1024


def _no_address_space(numel_max):
    raise OSError(12, "Cannot allocate memory")


class _OutOfMemoryAt(TorchDispatchMode):
    """Raises torch.OutOfMemoryError at the ``at``-th operator (1-based) that returns a tensor
    of its own (not a view or an in-place result): an allocation."""

    def __init__(self, at: int):
        super().__init__()
        self.at, self.seen = at, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        returns = func._schema.returns
        if any(r.alias_info is None and "Tensor" in str(r.type) for r in returns):
            self.seen += 1
            if self.seen == self.at:
                raise torch.OutOfMemoryError(f"CUDA out of memory (injected at {func})")
        return func(*args, **(kwargs or {}))


def _configs(initial):
    """float32 with TTL (last-seen steps), fp16 with fallback rows (rows that move at a growth)."""
    kinds = [
        dict(embedding_dim=8, ttl_steps=50),
        dict(embedding_dim=6, data_type=DataType.FP16, fallback_rows=3),
    ]
    return [
        DynamicEmbeddingBagConfig(
            name=f"t{i}", num_embeddings=NUM_EMBEDDINGS, feature_names=[f"f{i}"], initial_capacity=initial, **kind
        )
        for i, kind in enumerate(kinds)
    ]


def _batch(seed, spread):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 5, (2 * 24,), generator=gen)
    ids = torch.randint(0, spread, (int(lengths.sum()),), generator=gen) * 7919 - 2**40
    return KeyedJaggedTensor.from_lengths_sync(["f0", "f1"], ids, lengths)


def _rows_by_id(module):
    sd = module.state_dict()
    out = {}
    for name in ("t0", "t1"):
        prefix = f"embedding_bags.{name}."
        order = sd[prefix + "weight_id"].argsort()
        out[name] = {
            k[len(prefix) :]: (v[order] if v.dim() and v.shape[0] == order.numel() else v)
            for k, v in sd.items()
            if k.startswith(prefix)
        }
    return out


def _step(module, kjt):
    out = module(kjt).values()
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return out.detach()


def _modules():
    return [
        DynamicEmbeddingBagCollection(_configs(initial), optimizer="adam", optimizer_kwargs={"lr": 0.05})
        for initial in (16, None)
    ]


def test_an_allocation_that_fails_anywhere_in_a_growth_leaves_the_tables_unchanged_and_training(monkeypatch):
    monkeypatch.setattr(table_storage, "ReservedBuffer", _no_address_space)
    warm, full = _modules()
    assert not warm._tables._reserved
    tokens = [m.delta_token() for m in (warm, full)]  # the delta log's row map moves too
    for m in (warm, full):
        _step(m, _batch(0, 40))
    before = _rows_by_id(warm)
    capacities, step = [m.capacity for m in warm._tables.meta], warm._tables.train_step
    batches = [_batch(1, 400)]  # ~200 ids a table: a growth from 64 rows
    want = [_step(full, batches[0])]
    want_delta = full.export_delta(since=tokens[1])
    # Every allocation in the full matrix; every STRIDE-th in CI (~90 in all: ~0.25 s each).
    stride = 1 if FULL_MATRIX else 5
    at, failures = 1, 0
    while True:
        grown = copy.deepcopy(warm)
        tables = grown._tables
        real_grow, mode = tables.grow, _OutOfMemoryAt(at)

        def failing_grow(*args, _grow=real_grow, _mode=mode, **kwargs):
            with _mode:
                return _grow(*args, **kwargs)

        tables.grow = failing_grow
        try:
            _step(grown, batches[0])
            injected = False
        except GrowthError as e:
            injected = True
            assert mode.seen == at
            assert isinstance(e.__cause__, torch.OutOfMemoryError), (at, repr(e.__cause__))
            message = str(e)
            assert "'t0'" in message and "'t1'" in message and "unchanged" in message, message
            assert " bytes" in message, message
        finally:
            del tables.grow
        if not injected:
            assert mode.seen < at
            break
        failures += 1
        assert [m.capacity for m in tables.meta] == capacities and tables.train_step == step, at
        after = _rows_by_id(grown)
        for name in before:
            for key, value in before[name].items():
                assert torch.equal(after[name][key], value), (at, name, key)
        # The same stream as the preallocated module from here on: nothing of the failure shows.
        torch.testing.assert_close(_step(grown, batches[0]), want[0], rtol=0, atol=0, msg=f"allocation {at}")
        assert all(m.capacity > 64 for m in tables.meta)
        got = grown.export_delta(since=tokens[0])
        for name in want_delta.tables:
            ids = [d.tables[name].ids.sort().values for d in (got, want_delta)]
            assert torch.equal(*ids), (at, name)
        at += stride
    assert failures * stride > 40  # the index, the row maps, the buffers, last-seen, the delta log's map


@pytest.mark.parametrize("reserved", [True, False])
def test_an_index_that_cannot_be_allocated_is_a_growth_error(monkeypatch, reserved):
    """The new index of a growing table (``grown_tables``) is allocated before its buffers: an
    out-of-memory there is the same GrowthError, the tables unchanged."""
    if not reserved:
        monkeypatch.setattr(table_storage, "ReservedBuffer", _no_address_space)
    grown, _ = _modules()
    _step(grown, _batch(0, 40))
    before = _rows_by_id(grown)
    real = table_growth.grown_tables

    def no_memory(tables, capacities, sizes):
        raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {capacities[0] * 48} bytes")

    monkeypatch.setattr(table_growth, "grown_tables", no_memory)
    with pytest.raises(GrowthError, match=r"tables \['t0', 't1'\].* \d+ bytes.*unchanged, at capacities \[64, 64\]"):
        _step(grown, _batch(1, 400))
    monkeypatch.setattr(table_growth, "grown_tables", real)
    after = _rows_by_id(grown)
    assert all(torch.equal(after[n][k], v) for n in before for k, v in before[n].items())
    _step(grown, _batch(1, 400))
    assert all(m.capacity > 64 for m in grown._tables.meta)


def test_an_error_that_is_not_an_allocation_passes_through_and_the_layout_is_put_back(monkeypatch):
    """A growth reports as GrowthError only what an allocation raises; another error (a kernel's)
    is raised as it is, after the tables took their layout back."""
    monkeypatch.setattr(table_storage, "ReservedBuffer", _no_address_space)
    grown, _ = _modules()
    _step(grown, _batch(0, 40))
    tables = grown._tables
    before, offsets = _rows_by_id(grown), tables.table_offsets.clone()

    real = tables._compute_layout

    def layout_then_fail():
        real()
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(tables, "_compute_layout", layout_then_fail)
    with pytest.raises(RuntimeError, match="illegal memory access") as raised:
        _step(grown, _batch(1, 400))
    assert not isinstance(raised.value, GrowthError)
    monkeypatch.undo()
    assert torch.equal(tables.table_offsets, offsets) and all(m.capacity == 64 for m in tables.meta)
    after = _rows_by_id(grown)
    assert all(torch.equal(after[n][k], v) for n in before for k, v in before[n].items())
    _step(grown, _batch(1, 400))
    assert all(m.capacity > 64 for m in tables.meta)


def test_a_growth_error_from_within_a_growth_is_raised_as_it_is(monkeypatch):
    """A GrowthError raised inside a growth (its message says "allocate") already names its
    tables: it is not wrapped in a second one."""
    grown, _ = _modules()
    _step(grown, _batch(0, 40))
    inner = GrowthError("could not allocate the index of table 't0'")

    def fails(tables, capacities, sizes):
        raise inner

    monkeypatch.setattr(table_growth, "grown_tables", fails)
    with pytest.raises(GrowthError) as raised:
        _step(grown, _batch(1, 400))
    assert raised.value is inner
