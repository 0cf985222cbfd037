"""Checkpoint safety and integrity, on the real job's files (python -m torchrec_ext.train, tiny
settings, --device cpu) or on small checkpoints saved in-process on a one-rank group:

- a crafted pickle (a config entry, or DCP's .metadata) is refused without running it, even
  under a manifest that matches it; so is a .metadata whose entries point outside the
  checkpoint's own files (another run's file, '..', past a file's end);
- damaged files (flipped bytes in a table's weight / weight_id data, a truncated .metadata, a
  zero-filled data file, a symlink in the directory) are refused by a clear error naming the
  file, and --resume falls back to the newest checkpoint that verifies (saying so), ending
  exactly like the uninterrupted run;
- a pre-existing .tmp_step_K symlink is never written through; rotation never deletes the
  checkpoint just saved, whatever later (damaged) checkpoints lie beside it; a rank's stale
  listing of a save's files leaves none unhashed (2 ranks);
- a second job on a run directory whose lock a running job holds is refused, naming the holder;
  a filesystem that cannot lock is a clear error.
"""

import dataclasses
import errno
import hashlib
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
import types

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from dist_helpers import run_ranks
from job_helpers import ROOT, TINY, job_ok, run_job

JOB = ["--eval-every", "10", "--checkpoint-every", "10", "--keep-checkpoints", "2"] + TINY
TABLE = "model.model.sparse_arch.embedding_bag_collection.embedding_bags.t_cat_0"
DATA_FILE = "__0_0.distcp"


def _refused(proc):
    assert proc.returncode == 2, (
        f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}"
    )
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return proc.stderr


def _history(run_dir):
    """Losses and evals: what a resume reproduces exactly (the tables' totals count lookups since
    the process started, as table_stats() does)."""
    with open(os.path.join(run_dir, "history.json")) as f:
        history = json.load(f)
    return {k: history[k] for k in ("train_loss", "evals")}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """A finished 20-step run with checkpoints step_10 and step_20 (never modified: tests copy it)."""
    run_dir = str(tmp_path_factory.mktemp("reference") / "run")
    job_ok(run_job(["--steps", "20", "--run-dir", run_dir] + JOB))
    assert sorted(os.listdir(os.path.join(run_dir, "checkpoints"))) == ["step_10", "step_20"]
    return run_dir


@pytest.fixture
def run_copy(reference, tmp_path):
    run_dir = str(tmp_path / "run")
    shutil.copytree(reference, run_dir, symlinks=True)
    return run_dir


@pytest.fixture
def process_group():
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if created:
        dist.destroy_process_group()


def _ckpt(run_dir, step):
    return os.path.join(run_dir, "checkpoints", f"step_{step}")


def _rewrite_manifest(path, step):
    """What a writer who knows the format would do: a manifest that matches the directory as it is."""
    manifest_path = os.path.join(path, "MANIFEST.json")
    fmt = "torchrec_ext.checkpoint.manifest/1"
    if os.path.exists(manifest_path):
        with open(manifest_path) as f:
            fmt = json.load(f)["format"]
    files = {}
    for name in sorted(os.listdir(path)):
        if name != "MANIFEST.json":
            with open(os.path.join(path, name), "rb") as f:
                data = f.read()
            files[name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    with open(manifest_path, "w") as f:
        json.dump({"format": fmt, "step": step, "files": files}, f)


class _Payload:
    """Unpickled, it creates the directory ``marker``: proof that a checkpoint ran code."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def _storage(path, fqn):
    """(file, offset, length) of entry ``fqn`` in checkpoint ``path``, from DCP's own reader."""
    metadata = dcp.FileSystemReader(path).read_metadata()
    (info,) = [v for k, v in metadata.storage_data.items() if k.fqn == fqn]
    return os.path.join(path, info.relative_path), info.offset, info.length


def _flip(file, offset, count=8):
    with open(file, "r+b") as f:
        f.seek(offset)
        data = f.read(count)
        f.seek(offset)
        f.write(bytes(b ^ 0xFF for b in data))


# ----------------------------------------------------------------------------- crafted pickles


def test_crafted_config_entry_is_refused_without_running_it(tmp_path, process_group):
    from torchrec_ext.distributed.checkpoint import find_checkpoint, load_checkpoint

    marker, ckpt_dir = str(tmp_path / "ran"), str(tmp_path / "checkpoints")
    crafted = os.path.join(ckpt_dir, "step_30")
    # A "checkpoint" whose config entry is a pickle that calls os.mkdir, with a matching manifest.
    dcp.save({"config": _Payload(marker)}, storage_writer=dcp.FileSystemWriter(crafted), no_dist=True)
    _rewrite_manifest(crafted, 30)
    assert find_checkpoint(ckpt_dir) == ((30, crafted), [])  # it verifies: the manifest matches
    with pytest.raises(ValueError, match=r"step_30: entry 'config' is not plain data"):
        load_checkpoint(crafted, {"config": ""}, verify=False)  # as the job reads it
    assert not os.path.exists(marker), "the checkpoint's pickle ran"


@pytest.mark.parametrize("manifest", ["stale", "matching"])
def test_crafted_metadata_is_refused_without_running_it(run_copy, tmp_path, process_group, manifest):
    from torchrec_ext.distributed.checkpoint import latest_checkpoint, load_checkpoint

    marker = str(tmp_path / "ran")
    newest = _ckpt(run_copy, 20)
    with open(os.path.join(newest, ".metadata"), "wb") as f:
        pickle.dump(_Payload(marker), f)
    if manifest == "matching":  # the writer knew the format: the restricted unpickler refuses it
        _rewrite_manifest(newest, 20)
        with pytest.raises(ValueError, match=r"step_20: \.metadata: refers to (posix|os)\.mkdir.*refused"):
            load_checkpoint(newest, {"step": 0})
    else:  # the manifest no longer matches: refused before unpickling, the previous one is the newest
        with pytest.raises(ValueError, match=r"step_20: \.metadata is \d+ bytes, the manifest says"):
            load_checkpoint(newest, {"step": 0})
        assert latest_checkpoint(os.path.join(run_copy, "checkpoints")) == (10, _ckpt(run_copy, 10))
    assert not os.path.exists(marker), "the checkpoint's pickle ran"


# ----------------------------------------------------------------------------- damaged files


def _damage(path, kind):
    """Damages checkpoint ``path`` (a real one of the job); returns the file it names."""
    if kind in ("flipped weight", "flipped weight_id"):
        file, offset, length = _storage(path, f"{TABLE}.{kind.split()[1]}")
        _flip(file, offset + length // 2)  # inside the tensor's data
        return os.path.basename(file)  # one of the rank's data files (one per writer thread)
    if kind == "truncated .metadata":
        file = os.path.join(path, ".metadata")
        os.truncate(file, os.path.getsize(file) // 2)
        return ".metadata"
    if kind == "zero-filled data file":
        file = os.path.join(path, DATA_FILE)
        size = os.path.getsize(file)
        with open(file, "wb") as f:
            f.write(bytes(size))
        return DATA_FILE
    if kind == "symlinked data file":  # same bytes, through a link that could point anywhere
        file = os.path.join(path, DATA_FILE)
        outside = os.path.join(os.path.dirname(os.path.dirname(path)), "outside.distcp")
        os.replace(file, outside)
        os.symlink(outside, file)
        return DATA_FILE
    raise AssertionError(kind)


@pytest.mark.parametrize(
    "kind, problem",
    [
        ("flipped weight", "SHA-256 differs"),
        ("flipped weight_id", "SHA-256 differs"),
        ("truncated .metadata", "truncated"),
        ("zero-filled data file", "SHA-256 differs"),
        ("symlinked data file", "is a symlink"),
    ],
)
def test_damaged_checkpoint_is_a_clear_error_naming_the_file(run_copy, process_group, kind, problem):
    from torchrec_ext.distributed.checkpoint import latest_checkpoint, load_checkpoint

    newest = _ckpt(run_copy, 20)
    name = _damage(newest, kind)
    with pytest.raises(ValueError) as info:
        load_checkpoint(newest, {"step": 0, f"{TABLE}.weight": torch.empty(0), f"{TABLE}.weight_id": torch.empty(0)})
    message = str(info.value)
    assert f"step_20: {name}" in message and problem in message, message
    # The newest checkpoint that verifies is the previous one.
    assert latest_checkpoint(os.path.join(run_copy, "checkpoints")) == (10, _ckpt(run_copy, 10))


def test_resume_falls_back_to_the_previous_verified_checkpoint_and_continues_exactly(reference, run_copy):
    name = _damage(_ckpt(run_copy, 20), "flipped weight")
    proc = job_ok(run_job(["--steps", "20", "--run-dir", run_copy, "--resume"] + JOB))
    out = proc.stdout
    assert f"skipping checkpoint {_ckpt(run_copy, 20)}: {name}: its SHA-256 differs" in out, out[-2000:]
    assert (
        f"resumed from {_ckpt(run_copy, 10)} at step 10 (the newest checkpoint that verifies; 1 newer skipped)" in out
    )
    # Steps 10..20 trained again from step_10: the same losses and evals as the uninterrupted run, bit for bit.
    assert _history(run_copy) == _history(reference)
    with open(os.path.join(run_copy, "summary.json")) as f:
        summary = json.load(f)
    assert summary["resumed_from"] == _ckpt(run_copy, 10) and len(summary["skipped_checkpoints"]) == 1


def test_no_checkpoint_that_verifies_is_none_with_the_reason(run_copy, process_group):
    from torchrec_ext.distributed.checkpoint import find_checkpoint

    shutil.rmtree(_ckpt(run_copy, 10))
    _damage(_ckpt(run_copy, 20), "zero-filled data file")
    found, skipped = find_checkpoint(os.path.join(run_copy, "checkpoints"))
    newest = _ckpt(run_copy, 20)
    assert found is None and skipped == [
        (newest, f"checkpoint {newest}: {DATA_FILE}: its SHA-256 differs from the manifest's (the file is corrupted)")
    ]


def test_symlinked_checkpoint_directory_is_skipped(run_copy, process_group):
    from torchrec_ext.distributed.checkpoint import latest_checkpoint

    ckpt_dir = os.path.join(run_copy, "checkpoints")
    elsewhere = os.path.join(run_copy, "elsewhere")
    shutil.copytree(_ckpt(run_copy, 20), elsewhere)
    os.symlink(elsewhere, os.path.join(ckpt_dir, "step_30"))
    assert latest_checkpoint(ckpt_dir) == (20, _ckpt(run_copy, 20))


def test_preexisting_tmp_step_symlink_is_not_written_through(tmp_path, process_group):
    from torchrec_ext.distributed.checkpoint import save_checkpoint

    ckpt_dir, victim = str(tmp_path / "checkpoints"), tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("mine")
    os.makedirs(ckpt_dir)
    os.symlink(victim, os.path.join(ckpt_dir, ".tmp_step_10"))
    with pytest.raises(ValueError, match=r"\.tmp_step_10 is a symlink"):
        save_checkpoint(ckpt_dir, 10, {"step": 10, "rows": torch.arange(6.0)})
    assert sorted(os.listdir(victim)) == ["keep.txt"] and (victim / "keep.txt").read_text() == "mine"
    assert sorted(os.listdir(ckpt_dir)) == [".tmp_step_10"]


# ----------------------------------------------------------------------------- the run directory's lock


def _lock_holder(lock_file):
    try:
        with open(lock_file) as f:
            return f.read().strip()
    except FileNotFoundError:
        return None


def test_second_job_on_a_locked_run_dir_is_refused(tmp_path):
    run_dir = str(tmp_path / "run")
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    first = subprocess.Popen(
        [sys.executable, "-m", "torchrec_ext.train", "--steps", "1000000", "--eval-every", "0", "--run-dir", run_dir]
        + TINY
        + ["--device", "cpu"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        lock_file = os.path.join(run_dir, ".lock")
        deadline = time.monotonic() + 90
        while _lock_holder(lock_file) != str(first.pid):
            assert first.poll() is None and time.monotonic() < deadline, "the first job did not take the lock"
            time.sleep(0.2)
        stderr = _refused(run_job(["--steps", "5", "--run-dir", run_dir] + TINY))
        assert f"run directory {run_dir} is in use by another job (pid {first.pid}" in stderr, stderr[-2000:]
        assert first.poll() is None  # the first job still runs
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    # Killed, it holds nothing: the lock file left behind does not block the next job.
    from torchrec_ext.train.run_lock import RunDirLock

    RunDirLock(run_dir).release()


def test_filesystem_that_cannot_lock_is_a_clear_error_on_every_rank(tmp_path, process_group, monkeypatch):
    from torchrec_ext.train import run_lock

    def no_flock(fd, operation):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(run_lock.fcntl, "flock", no_flock)
    run_dir = str(tmp_path / "run")
    # The job's own path: rank 0 takes the lock, every rank raises its message (the job exits 2).
    with pytest.raises(
        ValueError,
        match=rf"run directory {run_dir}: its filesystem cannot lock .*No locks available.*"
        r"TORCHREC_EXT_UNLOCKED_RUN_DIR=1",
    ):
        run_lock.claim_run_dir(run_dir, types.SimpleNamespace(is_main=True))
    monkeypatch.setenv("TORCHREC_EXT_UNLOCKED_RUN_DIR", "1")  # the way out it names: no lock taken
    assert run_lock.claim_run_dir(run_dir, types.SimpleNamespace(is_main=True))[0] == run_dir


# ----------------------------------------------------------------------------- small in-process checkpoints


def _rows(value):
    return torch.arange(4.0) + value


def _save(ckpt_dir, step, keep=0):
    from torchrec_ext.distributed.checkpoint import save_checkpoint

    return save_checkpoint(ckpt_dir, step, {"step": step, "rows": _rows(step)}, keep=keep)


def _rewrite_entry(path, step, fqn, change):
    """Rewrites the storage record of entry ``fqn`` in DCP's .metadata (change(info) -> fields),
    then the manifest: a forged checkpoint that verifies."""
    file = os.path.join(path, ".metadata")
    with open(file, "rb") as f:
        metadata = pickle.load(f)  # our own file: a plain unpickle is fine here
    metadata.storage_data = {
        index: dataclasses.replace(info, **change(info)) if index.fqn == fqn else info
        for index, info in metadata.storage_data.items()
    }
    with open(file, "wb") as f:
        pickle.dump(metadata, f)
    _rewrite_manifest(path, step)


@pytest.mark.parametrize(
    "forgery, problem",
    [
        ("another run's file, absolute", r" is stored at '/.*', not a file name of the checkpoint"),
        ("another run's file through ..", r" is stored at '\.\./.*', not a file name of the checkpoint"),
        ("a file the checkpoint lacks", r" is stored in __9_0\.distcp, which the checkpoint does not hold"),
        ("a length past the file's end", r": bytes \d+\.\.\d+ lie beyond the end of __0_0\.distcp"),
    ],
)
def test_metadata_entry_outside_the_checkpoint_files_is_refused(tmp_path, process_group, forgery, problem):
    from torchrec_ext.distributed.checkpoint import load_checkpoint

    ours, theirs = _save(str(tmp_path / "ours"), 10), _save(str(tmp_path / "theirs"), 20)
    change = {
        "another run's file, absolute": lambda info: {"relative_path": os.path.join(theirs, info.relative_path)},
        "another run's file through ..": lambda info: {
            "relative_path": os.path.join("..", "..", "theirs", "step_20", info.relative_path)
        },
        "a file the checkpoint lacks": lambda info: {"relative_path": "__9_0.distcp"},
        "a length past the file's end": lambda info: {"length": 1 << 40},
    }[forgery]
    _rewrite_entry(ours, 10, "rows", change)
    destination = {"step": 0, "rows": torch.zeros(4)}
    with pytest.raises(ValueError, match=rf"step_10: \.metadata: entry 'rows'{problem}"):
        load_checkpoint(ours, destination)
    assert torch.equal(destination["rows"], torch.zeros(4)) and destination["step"] == 0  # nothing read


@pytest.mark.parametrize(
    "step, keep, left",
    [
        (15, 2, [10, 15, 20, 30]),  # a resume fell back to step_10 past damaged step_20 and step_30
        (15, 1, [15, 20, 30]),
        (20, 1, [20, 30]),  # step_20 saved again, replacing the damaged one
    ],
)
def test_rotation_never_deletes_the_checkpoint_just_saved(tmp_path, process_group, step, keep, left):
    from torchrec_ext.distributed.checkpoint import latest_checkpoint, load_checkpoint

    ckpt_dir = str(tmp_path / "checkpoints")
    for saved in (10, 20, 30):
        _save(ckpt_dir, saved)
    for damaged in (20, 30):
        _flip(os.path.join(ckpt_dir, f"step_{damaged}", DATA_FILE), 0)
    path = _save(ckpt_dir, step, keep=keep)
    assert sorted(int(name.split("_")[1]) for name in os.listdir(ckpt_dir)) == left
    assert latest_checkpoint(ckpt_dir) == (step, path)  # the damaged step_30 is skipped
    state = load_checkpoint(path, {"step": 0, "rows": torch.zeros(4)})
    assert state["step"] == step and torch.equal(state["rows"], _rows(step))


def _save_with_a_stale_listing(rank, world_size, ckpt_dir):
    from torchrec_ext.distributed.checkpoint import load_checkpoint, save_checkpoint, verify_checkpoint

    if rank == 1:  # this rank lists the save's directory before the metadata (written last) is there
        real_listdir = os.listdir
        os.listdir = lambda path=".": [
            name for name in real_listdir(path) if not (".tmp_step_" in str(path) and name == ".metadata")
        ]
    path = save_checkpoint(ckpt_dir, 10, {"step": 10, "rows": _rows(10)})
    verify_checkpoint(path)  # every file the directory holds is in the manifest, with its digest
    state = load_checkpoint(path, {"step": 0, "rows": torch.zeros(4)}, verify=False)
    assert state["step"] == 10 and torch.equal(state["rows"], _rows(10))


def test_a_rank_with_a_stale_listing_leaves_no_file_unhashed(tmp_path):
    run_ranks(_save_with_a_stale_listing, 2, str(tmp_path / "checkpoints"))


def test_pathlib_classes_of_python_3_13_are_admitted(monkeypatch):
    import io
    import pathlib

    from torchrec_ext.distributed.checkpoint import _MetadataUnpickler

    if "pathlib._local" not in sys.modules:  # Python < 3.13: stand in for the module 3.13 pickles them from
        local = types.ModuleType("pathlib._local")
        local.__dict__.update({name: getattr(pathlib, name) for name in ("Path", "PosixPath", "PurePosixPath")})
        monkeypatch.setitem(sys.modules, "pathlib._local", local)
    for name in ("Path", "PosixPath", "PurePosixPath"):
        # GLOBAL pathlib._local.<name>, MARK, BINUNICODE 'ckpt', TUPLE, REDUCE, STOP: <name>('ckpt') as 3.13 pickles it
        data = b"cpathlib._local\n" + name.encode() + b"\n(X\x04\x00\x00\x00ckpttR."
        assert _MetadataUnpickler(io.BytesIO(data), "test").load() == getattr(pathlib, name)("ckpt")
