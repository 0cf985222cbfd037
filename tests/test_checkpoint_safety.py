"""Checkpoint safety and integrity, on the real job's files (python -m torchrec_ext.train, tiny
settings, --device cpu):

- a crafted pickle (a config entry, or DCP's .metadata) is refused without running it, even
  under a manifest that matches it;
- damaged files (flipped bytes in a table's weight / weight_id data, a truncated .metadata, a
  zero-filled data file, a symlink in the directory) are refused by a clear error naming the
  file, and --resume falls back to the newest checkpoint that verifies (saying so), ending
  exactly like the uninterrupted run;
- a pre-existing .tmp_step_K symlink is never written through;
- a second job on a run directory whose lock a running job holds is refused, naming the holder.
"""
import hashlib
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--batch-size", "128", "--capacity", "2048", "--embedding-dim", "8", "--dense-arch", "32",
        "--over-arch", "32", "--dcn-rank", "8", "--eval-batch-size", "512", "--eval-batches", "2",
        "--threads", "1", "--no-progress", "--device", "cpu"]
JOB = ["--eval-every", "10", "--checkpoint-every", "10", "--keep-checkpoints", "2"] + TINY
TABLE = "model.model.sparse_arch.embedding_bag_collection.embedding_bags.t_cat_0"
DATA_FILE = "__0_0.distcp"


def _run(args, timeout=120):
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "torchrec_ext.train"] + args, cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _ok(proc):
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}"
    return proc


def _refused(proc):
    assert proc.returncode == 2, f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return proc.stderr


def _history(run_dir):
    with open(os.path.join(run_dir, "history.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """A finished 20-step run with checkpoints step_10 and step_20 (never modified: tests copy it)."""
    run_dir = str(tmp_path_factory.mktemp("reference") / "run")
    _ok(_run(["--steps", "20", "--run-dir", run_dir] + JOB))
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


def test_crafted_config_entry_is_refused_without_running_it(run_copy, tmp_path):
    marker = str(tmp_path / "ran")
    crafted = _ckpt(run_copy, 30)
    # A newest "checkpoint" whose config entry is a pickle that calls os.mkdir, with a matching manifest.
    dcp.save({"config": _Payload(marker)}, storage_writer=dcp.FileSystemWriter(crafted), no_dist=True)
    _rewrite_manifest(crafted, 30)
    stderr = _refused(_run(["--steps", "40", "--run-dir", run_copy, "--resume"] + JOB))
    assert not os.path.exists(marker), "the checkpoint's pickle ran"
    assert "step_30" in stderr and "'config'" in stderr and "not plain data" in stderr, stderr[-2000:]


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
        return DATA_FILE
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


@pytest.mark.parametrize("kind, problem", [
    ("flipped weight", "SHA-256 differs"),
    ("flipped weight_id", "SHA-256 differs"),
    ("truncated .metadata", "truncated"),
    ("zero-filled data file", "SHA-256 differs"),
    ("symlinked data file", "is a symlink"),
])
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
    _damage(_ckpt(run_copy, 20), "flipped weight")
    proc = _ok(_run(["--steps", "20", "--run-dir", run_copy, "--resume"] + JOB))
    out = proc.stdout
    assert f"skipping checkpoint {_ckpt(run_copy, 20)}: {DATA_FILE}: its SHA-256 differs" in out, out[-2000:]
    assert f"resumed from {_ckpt(run_copy, 10)} at step 10 (the newest checkpoint that verifies; 1 newer skipped)" in out
    # Steps 10..20 trained again from step_10: the same losses and evals as the uninterrupted run, bit for bit.
    assert _history(run_copy) == _history(reference)
    with open(os.path.join(run_copy, "summary.json")) as f:
        summary = json.load(f)
    assert summary["resumed_from"] == _ckpt(run_copy, 10) and len(summary["skipped_checkpoints"]) == 1


def test_resume_with_no_checkpoint_that_verifies_is_a_clear_error(run_copy):
    shutil.rmtree(_ckpt(run_copy, 10))
    _damage(_ckpt(run_copy, 20), "zero-filled data file")
    stderr = _refused(_run(["--steps", "30", "--run-dir", run_copy, "--resume"] + JOB))
    assert "no checkpoint in" in stderr and f"step_20: {DATA_FILE}: its SHA-256 differs" in stderr, stderr[-2000:]


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


def test_second_job_on_a_locked_run_dir_is_refused(tmp_path):
    run_dir = str(tmp_path / "run")
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    first = subprocess.Popen([sys.executable, "-m", "torchrec_ext.train", "--steps", "1000000", "--eval-every", "0",
                              "--run-dir", run_dir] + TINY, cwd=ROOT, env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        lock_file = os.path.join(run_dir, ".lock")
        deadline = time.monotonic() + 90
        while not (os.path.exists(lock_file) and open(lock_file).read().strip() == str(first.pid)):
            assert first.poll() is None and time.monotonic() < deadline, "the first job did not take the lock"
            time.sleep(0.2)
        stderr = _refused(_run(["--steps", "5", "--run-dir", run_dir] + TINY))
        assert f"run directory {run_dir} is in use by another job (pid {first.pid}" in stderr, stderr[-2000:]
        assert first.poll() is None  # the first job still runs
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    # Killed, it holds nothing: the lock file left behind does not block the next job.
    from torchrec_ext.train_utils.run_lock import RunDirLock

    RunDirLock(run_dir).release()
