"""The backing files of file-backed tiered tables (torchrec_ext/modules/tier_store.py): written
whole when they are made, so that no write-back through the mapping later allocates or converts
a block, and every failure of that making is a clear error naming the file and the tables.

Oracles: the file system's own extent map (FIEMAP: no hole, no unwritten extent), the file's
bytes, and an all-resident module trained on the same batches.
"""

import fcntl
import os
import struct

import pytest
import torch

import smaps
from modules_helpers import random_kjt
from torchrec_ext import DynamicEmbeddingBagCollection, DynamicEmbeddingBagConfig
from torchrec_ext.modules import tier_store

FS_IOC_FIEMAP = 0xC020660B
FIEMAP_FLAG_SYNC = 0x1
FIEMAP_EXTENT_LAST = 0x1
FIEMAP_EXTENT_UNWRITTEN = 0x800
EXTENTS_PER_CALL = 256
POOL = torch.randint(-(2**62), 2**62, (600,), generator=torch.Generator().manual_seed(11))


def _extents(path):
    """(offset, length, flags) of each extent of ``path``, from the FIEMAP ioctl."""
    out, start = [], 0
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        while start < size:
            request = bytearray(
                struct.pack("=QQIIII", start, size - start, FIEMAP_FLAG_SYNC, 0, EXTENTS_PER_CALL, 0)
                + bytes(56 * EXTENTS_PER_CALL)
            )
            try:
                fcntl.ioctl(f.fileno(), FS_IOC_FIEMAP, request)
            except OSError as e:
                pytest.skip(f"the file system of {path} does not answer FIEMAP: {e}")
            mapped = struct.unpack_from("=I", request, 20)[0]
            extents = [struct.unpack_from("=QQQQQI", request, 32 + 56 * i) for i in range(mapped)]
            out += [(logical, length, flags) for logical, _, length, _, _, flags in extents]
            if not extents or extents[-1][5] & FIEMAP_EXTENT_LAST:
                break
            start = out[-1][0] + out[-1][1]
    return out


def _configs(directory, name="a", capacity=3000):
    return [
        DynamicEmbeddingBagConfig(
            name=name,
            embedding_dim=16,
            num_embeddings=capacity,
            feature_names=["f0"],
            backing=f"file:{directory}",
            cache_load_factor=0.25,
        )
    ]


def _module(configs):
    return DynamicEmbeddingBagCollection(configs, optimizer="adagrad", optimizer_kwargs={"lr": 0.05})


def test_a_new_backing_file_is_written_whole_not_only_reserved(tmp_path):
    module = _module(_configs(tmp_path))
    names = sorted(os.listdir(tmp_path))
    assert names == ["a.momentum1.rows", "a.weights.rows"]
    for name in names:
        path = tmp_path / name
        size = os.path.getsize(path)
        assert size == tier_store.HEADER_BYTES + 4 * 3000 * 16
        extents = _extents(path)
        covered = 0
        for offset, length, flags in extents:
            assert offset == covered, f"{name}: a hole at {covered}"
            assert not flags & FIEMAP_EXTENT_UNWRITTEN, f"{name}: extent at {offset} reserved, never written"
            covered = offset + length
        assert covered >= size
        assert not any(path.read_bytes()[tier_store.HEADER_BYTES :])  # zeros: the rows of no id
    del module


def _mapping_flags(path):
    """The VmFlags of each mapping of ``path`` in this process."""
    return [fields["VmFlags:"] for mapped, fields in smaps.mappings() if mapped == str(path)]


def test_backing_files_are_mapped_for_random_reads(tmp_path):
    module = _module(_configs(tmp_path))
    for name in ("a.weights.rows", "a.momentum1.rows"):
        flags = _mapping_flags(tmp_path / name)
        assert flags, name  # mapped
        assert all("rr" in f for f in flags), (name, flags)  # MADV_RANDOM: no readahead on a fault
    del module


KPF_COMPOUND_HEAD, KPF_COMPOUND_TAIL = 15, 16


def _compound_pages(tensor):
    """How many of the pages under ``tensor`` (resident) belong to a folio of more than one page,
    from /proc/self/pagemap and /proc/kpageflags; None without the privilege to read them."""
    page = tier_store.PAGE_BYTES
    first, count = tensor.data_ptr() // page, tensor.numel() * tensor.element_size() // page
    try:
        with open("/proc/self/pagemap", "rb") as pagemap, open("/proc/kpageflags", "rb") as kpageflags:
            pagemap.seek(8 * first)
            entries = struct.unpack(f"={count}Q", pagemap.read(8 * count))
            compound = 0
            for entry in entries:
                pfn = entry & ((1 << 55) - 1)
                if not entry >> 63 or pfn == 0:  # not present, or PFNs hidden from this process
                    return None
                kpageflags.seek(8 * pfn)
                flags = struct.unpack("=Q", kpageflags.read(8))[0]
                compound += bool(flags & ((1 << KPF_COMPOUND_HEAD) | (1 << KPF_COMPOUND_TAIL)))
            return compound
    except OSError:
        return None


def test_backing_files_are_cached_in_single_pages(tmp_path):
    """A written-back row must dirty one page, not a large folio the kernel then writes whole."""
    module = _module(_configs(tmp_path, capacity=1 << 16))  # 4 MiB a file: room for 2 MiB folios
    for name, backing in module._tables.backing.items():
        backing.view(-1, tier_store.PAGE_BYTES // 4)[:, 0].sum()  # maps every page (cached since made)
        compound = _compound_pages(backing)
        if compound is None:
            pytest.skip("/proc/kpageflags is not readable here")
        assert compound == 0, (
            f"{name}: {compound} pages of {backing.numel() * 4 // tier_store.PAGE_BYTES} in large folios"
        )
    del module


def _train(modules, steps=8):
    gen = torch.Generator().manual_seed(4)
    for _ in range(steps):
        kjt = random_kjt(["f0"], 8, POOL[torch.randint(0, 600, (200,), generator=gen)], 5)
        outs = [m(kjt).values() for m in modules]
        for out in outs:
            assert torch.equal(out, outs[0])
            out.sum().backward()


def test_short_writes_are_continued(tmp_path, monkeypatch):
    real = os.pwrite
    calls = []

    def short(fd, data, offset):  # at most 1000 bytes a call
        written = real(fd, data[:1000], offset)
        calls.append((offset, written))
        return written

    monkeypatch.setattr(tier_store.os, "pwrite", short)
    tiered = _module(_configs(tmp_path))
    monkeypatch.undo()
    end = tier_store.HEADER_BYTES + 4 * 3000 * 16
    for _file in range(2):  # each file's rows written once each, to the end, no gap
        covered = tier_store.HEADER_BYTES
        while covered < end:
            offset, written = calls.pop(0)
            assert offset == covered and 0 < written <= 1000
            covered += written
    assert calls == []
    resident = DynamicEmbeddingBagCollection(
        [DynamicEmbeddingBagConfig(name="a", embedding_dim=16, num_embeddings=3000, feature_names=["f0"])],
        optimizer="adagrad",
        optimizer_kwargs={"lr": 0.05},
    )
    _train([resident, tiered])
    a, b = resident.state_dict(), tiered.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def _enospc(*args):
    raise OSError(28, "No space left on device")


def _eio(*args):
    raise OSError(5, "Input/output error")


@pytest.mark.parametrize(
    "call,fault,message",
    [
        ("pwrite", _enospc, r"\[Errno 28\] No space left on device"),
        ("pwrite", lambda fd, data, offset: 0, r"\[Errno 5\] wrote 0 of 192000 bytes at offset 4096"),
        ("fdatasync", _eio, r"\[Errno 5\] Input/output error"),
    ],
)
def test_a_failed_write_of_a_new_file_is_a_clear_error_and_the_last_checkpoint_loads(
    tmp_path, monkeypatch, call, fault, message
):
    (tmp_path / "old").mkdir()
    (tmp_path / "new").mkdir()
    trained = _module(_configs(tmp_path / "old"))
    _train([trained])
    checkpoint = trained.state_dict()
    monkeypatch.setattr(tier_store.os, call, fault)
    path = tmp_path / "new" / "b.weights.rows"
    with pytest.raises(
        ValueError,
        match=rf"tables \['b'\]: cannot write {tier_store.HEADER_BYTES + 4 * 3000 * 16} "
        rf"bytes for backing file '{path}': {message}",
    ):
        _module(_configs(tmp_path / "new", name="b"))
    assert os.listdir(tmp_path / "new") == []  # nothing half-made left behind
    monkeypatch.undo()
    restored = _module(_configs(tmp_path / "new"))
    restored.load_state_dict(checkpoint)
    again = restored.state_dict()
    assert all(torch.equal(checkpoint[k], again[k]) for k in checkpoint)
