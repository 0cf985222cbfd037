"""A real crash in the middle of a file-backed tiered table's write-back (issue 16, item 6): the
last checkpoint stays loadable and resumes exactly, and the directory reopened without a
checkpoint is a consistent (empty) table, never a corrupt one.

The drill: a child process (a real process of its own, forked from a multiprocessing forkserver
that imported torch once) trains a file-backed module with a small cache (write-backs every
step), saves a checkpoint (``state_dict`` with ``torch.save``, and the project's DCP checkpoint,
``save_checkpoint``), trains on, and is killed with SIGKILL while a write-back is under way:
``tier_log.crash_probe`` (the write-back's seam) tells the parent through a pipe from inside the
write-back, and the child waits there for its kill. Points: a log append cut short (its first
records on file, the rest not), the log being folded home (``flush``: a row's vector written
home, its optimizer state not yet), the cache's dirty rows being written home (``flush``,
likewise), and an append of the dirty rows a second checkpoint's ``state_dict`` makes (the
checkpoint being saved never appears). Then this process reopens the same directory.

Oracles: a fresh all-resident module (the directory reopened without a checkpoint), and an
all-resident module loaded from the same checkpoint and trained on the same batches (bit for bit).
"""

import gc
import multiprocessing
import os
import signal
import time

import pytest
import torch

from dist_helpers import start_forkserver
from matrix import ci_subset
from modules_helpers import random_kjt
from test_tier_log import POOL, _assert_same_state, _configs, _module, _train
from torchrec_ext.distributed.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from torchrec_ext.modules import tier_log

SAVED, AFTER, RESUMED = 12, 4, 10  # steps before the checkpoint, after it before the kill, resumed
PROBE_TIMEOUT_S = 120  # the child reaches its write-back in ~1 s; a hang fails instead of blocking CI


def _batches(n: int) -> list:
    """The same batches in every process (random_kjt draws from the global generator)."""
    with torch.random.fork_rng():
        torch.manual_seed(23)
        gen = torch.Generator().manual_seed(5)
        return [random_kjt(["f0", "f1"], 8, POOL[torch.randint(0, 600, (300,), generator=gen)], 5) for _ in range(n)]


def _drill(directory: str, ckpt: str, point: str, conn) -> None:
    """The child: train, checkpoint, train on, then start the write-back of ``point`` and wait
    inside it for the parent's SIGKILL."""
    torch.set_num_threads(1)
    module = _module(_configs(directory))
    batches = _batches(SAVED + AFTER + 1)
    _train([module], batches[:SAVED])
    state = module.state_dict()
    torch.save(state, os.path.join(ckpt, "state.pt"))
    save_checkpoint(ckpt, 1, {"model": state})
    _train([module], batches[SAVED : SAVED + AFTER])  # the logs hold records newer than the checkpoint
    assert all(log.live for log in module._tables.store.logs().values())
    target = "append" if point.startswith("append") else point
    last_write = {}
    if target == "append":  # each write of an append stops halfway: records cut short on file
        real_pwrite = os.pwrite

        def half_pwrite(fd, data, offset):
            written = real_pwrite(fd, data[: max(1, len(data) // 2)], offset)
            last_write.update(path=os.readlink(f"/proc/self/fd/{fd}"), offset=offset, written=written, asked=len(data))
            return written

        tier_log.os.pwrite = half_pwrite  # (this process only: it dies in the write-back)

    def probe(where: str) -> None:
        if where == target:
            conn.send((where, dict(last_write)))
            time.sleep(PROBE_TIMEOUT_S)  # killed here

    tier_log.crash_probe = probe
    if point == "append":
        _train([module], batches[SAVED + AFTER :])  # the step's evictions append
    elif point == "append-in-save":
        save_checkpoint(ckpt, 2, {"model": module.state_dict()})  # state_dict appends the dirty rows
    else:
        module._tables.flush()  # dirty rows home ("home"), then the logs folded home ("fold")
    conn.send(("never reached", {}))


def _kill_inside(directory, ckpt, point) -> dict:
    """Runs the drill's child to ``point`` and SIGKILLs it there; what the child said at the probe."""
    start_forkserver("test_tiers_crash")  # (imported once per session)
    ctx = multiprocessing.get_context("forkserver")
    here, there = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_drill, args=(str(directory), str(ckpt), point, there), daemon=True)
    child.start()
    there.close()
    try:
        if not here.poll(PROBE_TIMEOUT_S):
            pytest.fail(f"the drill's child did not reach the {point!r} write-back in {PROBE_TIMEOUT_S} s")
        try:
            where, said = here.recv()
        except EOFError:
            child.join()
            pytest.fail(f"the drill's child died before the {point!r} write-back (exit code {child.exitcode})")
        assert where == point.split("-")[0], where
    finally:
        child.kill()
        child.join()
    assert child.exitcode == -signal.SIGKILL
    return said


def _resume_matches_the_resident_oracle(directory, ckpt, load) -> None:
    """The directory reopened, the checkpoint loaded with ``load(module)``, trained on: bit for
    bit the all-resident module loaded from the same checkpoint, on the same batches."""
    reopened = _module(_configs(directory))
    load(reopened)
    resident = _module(_configs())
    resident.load_state_dict(torch.load(os.path.join(ckpt, "state.pt")))
    _assert_same_state(resident, reopened)
    batches = _batches(SAVED + RESUMED)
    _train([resident, reopened], batches[SAVED:], stage=reopened)
    _assert_same_state(resident, reopened)
    del reopened
    gc.collect()  # (its files' locks go with it)


@pytest.mark.parametrize("point", ["append", "fold", "home", "append-in-save"])
def test_a_kill_inside_a_write_back_leaves_the_last_checkpoint_loadable(tmp_path, point):
    directory, ckpt = tmp_path / "tier", tmp_path / "ckpt"
    directory.mkdir()
    ckpt.mkdir()
    said = _kill_inside(directory, ckpt, point)
    if point.startswith("append"):  # the kill found a record cut short on file: half written, half a hole
        with open(said["path"], "rb") as f:
            f.seek(said["offset"])
            on_file = f.read(said["asked"])
        assert 0 < said["written"] < said["asked"] and said["path"].endswith(".log")
        assert any(on_file[: said["written"]]) and not any(on_file[said["written"] :])

    # Reopened without a checkpoint: an empty table, as over a new directory (what the dead
    # process left is never read), training as a fresh all-resident module does.
    reopened, fresh = _module(_configs(directory)), _module(_configs())
    _assert_same_state(fresh, reopened)
    assert reopened.num_live_rows() == 0
    _train([fresh, reopened], _batches(RESUMED), stage=reopened)
    _assert_same_state(fresh, reopened)
    del reopened
    gc.collect()

    # The last checkpoint (DCP: the one saved before the kill, never the one cut short) and the
    # state_dict saved with it resume exactly.
    step, path = latest_checkpoint(str(ckpt))
    assert step == 1 and not os.path.exists(os.path.join(ckpt, "step_2"))
    _resume_matches_the_resident_oracle(
        directory, ckpt, lambda m: m.load_state_dict(load_checkpoint(path, {"model": m.state_dict()})["model"])
    )
    _resume_matches_the_resident_oracle(
        directory, ckpt, lambda m: m.load_state_dict(torch.load(os.path.join(ckpt, "state.pt")))
    )


# ---------------------------------------------------------------- kills at random times (opt-in)

RANDOM_STEPS, RANDOM_EVERY = 120, 15  # the child's steps, and a DCP checkpoint every RANDOM_EVERY
RANDOM_TRIALS = 16


def _train_and_checkpoint(directory: str, ckpt: str, step, saving, conn) -> None:
    """The child of a random kill: trains, a DCP checkpoint every RANDOM_EVERY steps (the log
    cleaned and sent home often: 8-record segments), ``step`` and ``saving`` (shared) telling
    the parent where it is, until killed."""
    torch.set_num_threads(1)
    tier_log.SEGMENT_RECORDS = 8
    module = _module(_configs(directory))
    batches = _batches(RANDOM_STEPS)
    conn.send("started")
    for i, kjt in enumerate(batches):
        step.value = i
        if i + 1 < len(batches):
            module.stage_next(batches[i + 1])
        module(kjt).values().square().sum().backward()
        if (i + 1) % RANDOM_EVERY == 0:
            saving.value = 1
            save_checkpoint(ckpt, i + 1, {"model": module.state_dict()}, keep=2)
            saving.value = 0
    step.value = len(batches)
    time.sleep(PROBE_TIMEOUT_S)


@pytest.mark.parametrize("trial", ci_subset(range(RANDOM_TRIALS), lambda trial: False))
def test_a_kill_at_a_random_time_leaves_the_last_checkpoint_loadable(tmp_path, trial):
    directory, ckpt = tmp_path / "tier", tmp_path / "ckpt"
    directory.mkdir()
    ckpt.mkdir()
    start_forkserver("test_tiers_crash")
    ctx = multiprocessing.get_context("forkserver")
    here, there = ctx.Pipe(duplex=False)
    step, saving = ctx.Value("i", -1, lock=False), ctx.Value("i", 0, lock=False)
    child = ctx.Process(
        target=_train_and_checkpoint, args=(str(directory), str(ckpt), step, saving, there), daemon=True
    )
    child.start()
    there.close()
    try:
        assert here.poll(PROBE_TIMEOUT_S) and here.recv() == "started"
        # A kill at a random step, a random time into it (a step takes ~10 ms, a checkpoint ~0.1 s).
        gen = torch.Generator().manual_seed(trial)
        target, delay = int(torch.randint(1, RANDOM_STEPS, (1,), generator=gen)), float(torch.rand(1, generator=gen))
        while step.value < target and child.is_alive():
            time.sleep(0.001)
        time.sleep(delay * 0.1)
    finally:
        child.kill()
        child.join()
    assert child.exitcode == -signal.SIGKILL
    killed_at, in_save = step.value, bool(saving.value)

    reopened, fresh = _module(_configs(directory)), _module(_configs())
    _train([fresh, reopened], _batches(RESUMED), stage=reopened)
    _assert_same_state(fresh, reopened)
    del reopened
    gc.collect()
    found = latest_checkpoint(str(ckpt))
    print(
        f"trial {trial}: killed in step {killed_at}{' (saving)' if in_save else ''}, last checkpoint {found and found[0]}"
    )
    if found is None:  # killed before the first checkpoint
        assert killed_at <= RANDOM_EVERY
        return
    saved, path = found
    assert saved <= killed_at + 1
    reopened = _module(_configs(directory))
    reopened.load_state_dict(load_checkpoint(path, {"model": reopened.state_dict()})["model"])
    resident = _module(_configs())
    resident.load_state_dict(load_checkpoint(path, {"model": resident.state_dict()})["model"])
    _assert_same_state(resident, reopened)
    _train([resident, reopened], _batches(saved + RESUMED)[saved:], stage=reopened)
    _assert_same_state(resident, reopened)
