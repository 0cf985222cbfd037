"""The checkpoint's file I/O (torchrec_ext/distributed/checkpoint_io.py): files hashed as they
are written, against hashlib over the bytes on disk (the oracle); nothing read back to hash it;
a stream moved backwards is hashed from disk instead."""

import hashlib
import json
import os
import threading

import pytest
import torch

from torchrec_ext.distributed import checkpoint_io
from torchrec_ext.distributed.checkpoint import MANIFEST_FILE, load_checkpoint, save_checkpoint


@pytest.fixture
def state():
    gen = torch.Generator().manual_seed(0)
    return {
        "a": torch.randn(1000, 64, generator=gen),
        "b": torch.randint(0, 1 << 40, (5000,), generator=gen),
        "c": torch.randn(333, generator=gen).half(),
        "step": 7,
        "note": "plain data",
    }


def _manifest(path):
    with open(os.path.join(path, MANIFEST_FILE)) as f:
        return json.load(f)["files"]


def test_digests_computed_while_writing_equal_the_files_bytes_and_nothing_is_read_back(
    tmp_path, state, monkeypatch, one_rank_group
):
    def no_reading(path):
        raise AssertionError(f"{path} was read back to be hashed")

    monkeypatch.setattr(checkpoint_io, "file_digest", no_reading)
    monkeypatch.setattr(checkpoint_io, "IO_THREADS", 2)  # two writer threads, one data file each
    path = save_checkpoint(str(tmp_path), 3, state)
    monkeypatch.undo()
    files = _manifest(path)
    assert sorted(files) == sorted(set(os.listdir(path)) - {MANIFEST_FILE})
    assert sum(name.endswith(".distcp") for name in files) == 2
    for name, entry in files.items():
        with open(os.path.join(path, name), "rb") as f:
            data = f.read()
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}, name
    loaded = load_checkpoint(
        path, {"a": torch.empty(0), "b": torch.empty(0), "c": torch.empty(0), "step": 0, "note": ""}
    )
    for key in ("a", "b", "c"):
        assert torch.equal(loaded[key], state[key]) and loaded[key].dtype == state[key].dtype
    assert loaded["step"] == 7 and loaded["note"] == "plain data"


def test_a_stream_moved_backwards_is_hashed_from_disk(tmp_path, state, monkeypatch, one_rank_group):
    fs = checkpoint_io._HashingFileSystem()
    with fs.create_stream(str(tmp_path / "f.bin"), "wb") as stream:
        stream.write(b"x" * 100)
        stream.seek(10)
        stream.write(b"y" * 5)
    assert "f.bin" not in fs.digests  # the digest no longer follows the file
    with fs.create_stream(str(tmp_path / "g.bin"), "wb") as stream:
        stream.write(b"z" * 100)
    assert fs.digests["g.bin"] == (100, hashlib.sha256(b"z" * 100).hexdigest())

    # A save whose writer moves its streams still gets a manifest that matches the files.
    real = checkpoint_io._HashingStream.write

    def write_then_seek(self, data):
        written = real(self, data)
        self.seek(self.tell())  # harmless to the file, but the stream was moved
        return written

    monkeypatch.setattr(checkpoint_io._HashingStream, "write", write_then_seek)
    path = save_checkpoint(str(tmp_path / "ckpt"), 1, state)
    for name, entry in _manifest(path).items():
        with open(os.path.join(path, name), "rb") as f:
            assert entry["sha256"] == hashlib.sha256(f.read()).hexdigest(), name


def test_verification_hashes_files_on_several_threads_and_names_a_corrupted_one(
    tmp_path, state, monkeypatch, one_rank_group
):
    from torchrec_ext.distributed.checkpoint import CheckpointError, verify_checkpoint

    monkeypatch.setattr(checkpoint_io, "IO_THREADS", 2)
    path = save_checkpoint(str(tmp_path), 3, state)
    together = threading.Barrier(2, timeout=60)  # passes only when two files are hashed at once
    real = checkpoint_io.file_digest

    def recording(file):
        if file.endswith(".distcp"):
            together.wait()
        return real(file)

    monkeypatch.setattr(checkpoint_io, "file_digest", recording)
    verify_checkpoint(path)
    assert not together.broken
    victim = sorted(name for name in os.listdir(path) if name.endswith(".distcp"))[-1]
    with open(os.path.join(path, victim), "r+b") as f:
        f.seek(os.path.getsize(os.path.join(path, victim)) // 2)
        f.write(b"\xff\xfe")
    with pytest.raises(CheckpointError, match=f"{victim}: its SHA-256 differs"):
        verify_checkpoint(path)


def test_a_background_save_writes_on_one_thread(tmp_path, state, monkeypatch, one_rank_group):
    monkeypatch.setattr(checkpoint_io, "IO_THREADS", 2)
    path = save_checkpoint(str(tmp_path), 3, state, blocking=False).wait()
    files = _manifest(path)
    assert sum(name.endswith(".distcp") for name in files) == 1  # training keeps the other cores
    for name, entry in files.items():
        with open(os.path.join(path, name), "rb") as f:
            assert entry["sha256"] == hashlib.sha256(f.read()).hexdigest(), name
