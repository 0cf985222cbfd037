"""A growth moves rows only as whole blocks (issue 15, growth): a grown table keeps its rows'
numbers (its index maps slots to rows), so each table's rows move with its span, in place, by
remapping pages where they can (``ReservedBuffer.remap``) and copying the rest.

Oracles: the block's values before the move (``_move_block``), and the same module preallocated
fed the same batches (whole modules, tables large enough that spans shift by whole pages).
"""

import pytest
import torch
from torchrec import KeyedJaggedTensor

from torchrec_ext import DynamicEmbeddingBagCollection, DynamicEmbeddingBagConfig
from torchrec_ext.modules import reserved_buffers
from torchrec_ext.modules.reserved_buffers import ReservedBuffer
from torchrec_ext.modules.table_growth import _move_block

MIB = 1 << 18  # float32 elements per MiB


@pytest.mark.parametrize("reserved", [True, False])
@pytest.mark.parametrize(
    "start, shift, length",
    [
        (1000, 5 * MIB, 24 * MIB),  # up, overlapping, whole pages apart: remapped in the middle
        (1000, 5 * MIB + 3, 24 * MIB),  # up, not whole pages apart: copied
        (6 * MIB + 1000, -4 * MIB, 20 * MIB),  # down, overlapping
        (1000, 40 * MIB, 8 * MIB),  # apart
        (1000, 1000, 4 * MIB),  # a short shift
    ],
)
def test_a_block_moves_within_its_buffer(reserved, start, shift, length):
    reservation = ReservedBuffer(64 * MIB)
    buf = reservation.view(56 * MIB) if reserved else torch.empty(56 * MIB)
    buf.copy_(torch.arange(buf.numel(), dtype=torch.float32))
    before = buf.clone()
    new = buf[start + shift : start + shift + length]
    _move_block(buf, buf[start : start + length], new, reservation if reserved else None)
    assert torch.equal(new, before[start : start + length])
    # Outside the source and the destination nothing changed.
    lo, hi = min(start, start + shift), max(start, start + shift) + length
    assert torch.equal(buf[:lo], before[:lo]) and torch.equal(buf[hi:], before[hi:])


def _module(initial):
    configs = [
        DynamicEmbeddingBagConfig(
            name=f"t{i}",
            embedding_dim=64,
            num_embeddings=1 << 16,
            feature_names=[f"f{i}"],
            initial_capacity=initial,
            fallback_rows=2 if i == 1 else None,
        )
        for i in range(3)
    ]
    return DynamicEmbeddingBagCollection(configs, optimizer="adagrad", optimizer_kwargs={"lr": 0.05})


def test_growths_remap_the_rows_of_shifted_tables_and_equal_the_preallocated_module(monkeypatch):
    remapped = []
    remap = ReservedBuffer.remap

    def spy(self, src, dst, nbytes):
        done = remap(self, src, dst, nbytes)
        remapped.append(nbytes if done else 0)
        return done

    monkeypatch.setattr(reserved_buffers.ReservedBuffer, "remap", spy)
    growing, full = _module(1 << 12), _module(None)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        lengths = torch.full((3 * 4000,), 4)
        ids = torch.randint(0, 2**40, (int(lengths.sum()),), generator=gen)
        kjt = KeyedJaggedTensor.from_lengths_sync(["f0", "f1", "f2"], ids, lengths)
        out = [m(kjt).values() for m in (growing, full)]
        torch.testing.assert_close(out[0], out[1], rtol=0, atol=0)
        for o in out:
            o.sum().backward()
    assert growing.table_stats()["t0"].capacity == 1 << 16
    assert sum(remapped) >= 4 << 20  # the later tables' rows moved by their pages
    got, want = growing.state_dict(), full.state_dict()
    for name in ("t0", "t1", "t2"):
        g, w = (
            {k.split(".", 2)[2]: v for k, v in sd.items() if k.startswith(f"embedding_bags.{name}.")}
            for sd in (got, want)
        )
        go, wo = g["weight_id"].argsort(), w["weight_id"].argsort()
        for key in ("weight_id", "weight", "optimizer.momentum1", "metadata"):
            assert torch.equal(g[key][go], w[key][wo]), (name, key)
        if name == "t1":
            assert torch.equal(g["fallback_weight"], w["fallback_weight"])
