"""Non-blocking checkpoints (save_checkpoint(..., blocking=False)): the saved state equals a
blocking save at the same step although training changed the tables during the write; the
previous checkpoint stays the newest loadable one until the new one is complete; a process
killed mid-write leaves nothing that latest_checkpoint picks; errors reach wait()."""

import os
import subprocess
import sys
import threading

import pytest
import torch
import torch.distributed as dist

from dist_helpers import local_state, make_batches, make_dmp_dlrm, plain_loop, run_ranks
from test_sharded_checkpoint import _dmp, _train


def _state(dmp, opt, step):
    return {"model": dmp.state_dict(), "optim": opt.state_dict(), "step": step}


def _save_both_ways(rank, world_size, root):
    from torchrec_ext.distributed import checkpoint as ckpt

    dmp, opt = make_dmp_dlrm(world_size, dynamic=True)
    batches = make_batches(rank, batch_size=8, num_full=6, last=0)
    plain_loop(dmp, opt, batches[:3])
    at_step_3 = local_state(dmp)
    ckpt.save_checkpoint(os.path.join(root, "blocking"), 3, _state(dmp, opt, 3))
    # The worker starts writing only after training has gone on (dense parameters and optimizer
    # state change in place): what it writes must still be step 3.
    release = threading.Event()
    real_save = ckpt._save
    ckpt._save = lambda *args, **kwargs: release.wait() and real_save(*args, **kwargs)
    pending = ckpt.save_checkpoint(os.path.join(root, "background"), 3, _state(dmp, opt, 3), blocking=False)
    assert isinstance(pending, ckpt.PendingCheckpoint)
    plain_loop(dmp, opt, batches[3:])
    release.set()
    assert pending.wait() == os.path.join(root, "background", "step_3")
    assert any(not torch.equal(v, at_step_3[k]) for k, v in local_state(dmp).items())

    loaded = []
    for name in ("blocking", "background"):
        fresh, fresh_opt = make_dmp_dlrm(world_size, seed=1, dynamic=True)
        step, path = ckpt.latest_checkpoint(os.path.join(root, name))
        state = ckpt.load_checkpoint(path, _state(fresh, fresh_opt, 0))
        assert step == 3 and state["step"] == 3
        fresh.load_state_dict(state["model"])
        fresh_opt.load_state_dict(state["optim"])
        loaded.append((local_state(fresh), _tensors(fresh_opt.state_dict()), plain_loop(fresh, fresh_opt, batches[3:])))
    (model_a, optim_a, losses_a), (model_b, optim_b, losses_b) = loaded
    assert model_a.keys() == model_b.keys() == at_step_3.keys()
    assert all(torch.equal(model_a[k], model_b[k]) for k in model_a)
    assert optim_a.keys() == optim_b.keys() and all(torch.equal(optim_a[k], optim_b[k]) for k in optim_a)
    assert all(torch.equal(a, b) for a, b in zip(losses_a, losses_b))
    for k, v in at_step_3.items():
        if "sparse_arch" not in k:
            assert torch.equal(model_b[k], v), k


def _tensors(state, prefix=""):
    out = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out.update(_tensors(v, f"{prefix}{k}."))
        elif isinstance(v, torch.Tensor):
            out[f"{prefix}{k}"] = v.local_tensor() if hasattr(v, "local_tensor") else v
    return out


def test_background_save_equals_blocking_save_on_two_ranks(tmp_path):
    run_ranks(_save_both_ways, 2, str(tmp_path))


def _previous_stays_loadable(rank, world_size, root):
    from torchrec_ext.distributed import checkpoint as ckpt

    dmp, opt = _dmp(world_size)
    _train(dmp, opt, rank, range(2))
    ckpt.save_checkpoint(root, 2, _state(dmp, opt, 2), keep=1)
    _train(dmp, opt, rank, range(2, 4))
    # Hold the worker once the data files are written, before the manifest: mid-write.
    written, release = threading.Event(), threading.Event()
    real_hash = ckpt._hash_files

    def held(directory, names, pg, **kwargs):
        if os.path.basename(directory) == ".tmp_step_4":
            written.set()
            release.wait()
        return real_hash(directory, names, pg, **kwargs)

    ckpt._hash_files = held
    pending = ckpt.save_checkpoint(root, 4, _state(dmp, opt, 4), keep=1, blocking=False)
    assert written.wait(120)
    assert not pending.done()
    assert ckpt.latest_checkpoint(root) == (2, os.path.join(root, "step_2"))
    fresh, fresh_opt = _dmp(world_size)
    state = ckpt.load_checkpoint(os.path.join(root, "step_2"), _state(fresh, fresh_opt, 0))
    assert state["step"] == 2
    release.set()
    assert pending.wait() == os.path.join(root, "step_4")
    assert ckpt.latest_checkpoint(root) == (4, os.path.join(root, "step_4"))
    assert sorted(os.listdir(root)) == ["step_4"]  # keep=1 rotated step_2 out only now


def _previous_stays_loadable_and_errors_reach_wait(rank, world_size, root):
    _previous_stays_loadable(rank, world_size, os.path.join(root, "held"))
    _error_reaches_wait(rank, world_size, os.path.join(root, "symlinked"))


def test_previous_checkpoint_is_newest_until_background_save_completes(tmp_path):
    """Also: a background save's error is raised by wait() on every rank."""
    run_ranks(_previous_stays_loadable_and_errors_reach_wait, 2, str(tmp_path))


_KILLED_MID_WRITE = r"""
import os, sys, torch, torch.distributed as dist
sys.path.insert(0, {tests!r})
dist.init_process_group("gloo", init_method="file://" + os.path.join({root!r}, "init"), rank=0, world_size=1)
from torchrec_ext.distributed import checkpoint as ckpt
from test_sharded_checkpoint import _dmp, _train
dmp, opt = _dmp(1)
_train(dmp, opt, 0, range(2))
ckpt.save_checkpoint({root!r} + "/ckpt", 2, {{"model": dmp.state_dict(), "step": 2}}, keep=1)
_train(dmp, opt, 0, range(2, 4))
ckpt._hash_files = lambda *a, **k: os._exit(9)   # the process dies with the data written, no manifest yet
pending = ckpt.save_checkpoint({root!r} + "/ckpt", 4, {{"model": dmp.state_dict(), "step": 4}}, keep=1, blocking=False)
_train(dmp, opt, 0, range(4, 8))  # training goes on while the worker writes ...
pending.wait()                     # ... until the worker's process dies under it
"""


def test_process_killed_mid_background_write_leaves_previous_checkpoint(tmp_path, one_rank_group):
    from torchrec_ext.distributed.checkpoint import find_checkpoint, load_checkpoint

    root = str(tmp_path)
    script = _KILLED_MID_WRITE.format(tests=os.path.dirname(__file__), root=root)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 9, result.stderr[-2000:]
    assert os.path.isdir(os.path.join(root, "ckpt", ".tmp_step_4"))  # it did die mid-write
    found, skipped = find_checkpoint(os.path.join(root, "ckpt"))
    assert found == (2, os.path.join(root, "ckpt", "step_2")) and skipped == []
    dmp, _ = _dmp(1)
    assert load_checkpoint(found[1], {"model": dmp.state_dict(), "step": 0})["step"] == 2


def _error_reaches_wait(rank, world_size, root):
    from torchrec_ext.distributed.checkpoint import CheckpointError, save_checkpoint

    dmp, opt = _dmp(world_size)
    os.makedirs(root, exist_ok=True)
    if rank == 0:
        os.symlink(os.path.join(root, "elsewhere"), os.path.join(root, ".tmp_step_1"))
    dist.barrier()
    pending = save_checkpoint(root, 1, _state(dmp, opt, 1), blocking=False)
    with pytest.raises(CheckpointError, match="is a symlink"):
        pending.wait()
    with pytest.raises(TypeError, match="blocking must be a bool, got 'no'"):
        save_checkpoint(root, 1, _state(dmp, opt, 1), blocking="no")
