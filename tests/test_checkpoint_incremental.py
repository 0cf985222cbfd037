"""Incremental checkpoints (torchrec_ext/distributed/checkpoint_incremental.py): a base, then
deltas. Oracle: a full save at the same step (save_checkpoint + load_checkpoint) and the source's
own state_dict then: loading a link gives both bit for bit, through LRU evictions and TTL expiry
(tombstones), unsharded and on 2 gloo ranks. A missing or damaged link is refused and
latest_checkpoint falls back to the newest checkpoint whose chain verifies."""

import copy
import os

import pytest
import torch
from torch import nn

from test_deltas import _batch, _module

SAVES = [2, 4, 6, 8, 10]  # full_every=3: base at 2, deltas at 4 and 6, base at 8, delta at 10


class _Model(nn.Module):
    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.ebc = _module("ebc")
        self.dense = nn.Linear(8, 1)

    def loss(self, step):
        out = self.ebc(_batch(step)).to_dict()
        return self.dense(out["f_lru"]).pow(2).sum() + out["f_ttl"].pow(2).sum()


def _state(model, opt):
    return {k: v.clone() for k, v in model.state_dict().items()}, copy.deepcopy(opt.state_dict())


def _assert_same(actual, expected):
    assert list(actual) == list(expected)
    for key in expected:
        a, e = actual[key], expected[key]
        assert a.dtype == e.dtype and a.shape == e.shape and torch.equal(a, e), key


def _train_and_save(tmp_path, full_every=3, keep=0):
    from torchrec_ext.distributed.checkpoint import save_checkpoint
    from torchrec_ext.distributed.checkpoint_incremental import IncrementalCheckpoints

    model = _Model(0)
    opt = torch.optim.Adagrad(model.dense.parameters(), lr=0.1)
    ckpts = IncrementalCheckpoints(str(tmp_path / "inc"), model, full_every=full_every, keep=keep)
    seen = {}
    for step in range(1, SAVES[-1] + 1):
        opt.zero_grad()
        model.loss(step).backward()
        opt.step()
        if step % 3 == 0:  # eval lookups between saves (ids seen and unseen): they change no state
            model.eval()
            with torch.no_grad():
                model.ebc(_batch(step + 100))
            model.train()
        if step in SAVES:
            ckpts.save(step, {"optim": opt.state_dict(), "step": step})
            # The next link starts at the token just taken: the log keeps nothing older.
            assert model.ebc._tables.delta_log.logged == 0
            save_checkpoint(
                str(tmp_path / "full"), step, {"model": model.state_dict(), "optim": opt.state_dict()}, keep=0
            )
            seen[step] = _state(model, opt)
    return ckpts, seen


def _load_incremental(tmp_path, step, **kwargs):
    from torchrec_ext.distributed.checkpoint_incremental import IncrementalCheckpoints

    model = _Model(1)  # other dense weights, empty tables: everything must come from the chain
    opt = torch.optim.Adagrad(model.dense.parameters(), lr=0.1)
    loaded = IncrementalCheckpoints(str(tmp_path / "inc"), model).load(
        str(tmp_path / "inc" / f"step_{step}"), {"optim": opt.state_dict(), "step": 0}, **kwargs
    )
    opt.load_state_dict(loaded["optim"])
    assert loaded["step"] == step
    return model, opt


def test_every_link_loads_exactly_the_full_save_of_its_step(tmp_path, one_rank_group):
    from torchrec_ext.distributed.checkpoint import load_checkpoint

    _, seen = _train_and_save(tmp_path)
    for step in SAVES:
        model, opt = _load_incremental(tmp_path, step)
        full = _Model(2)
        full_opt = torch.optim.Adagrad(full.dense.parameters(), lr=0.1)
        state = load_checkpoint(
            str(tmp_path / "full" / f"step_{step}"), {"model": full.state_dict(), "optim": full_opt.state_dict()}
        )
        full.load_state_dict(state["model"])
        full_opt.load_state_dict(state["optim"])
        _assert_same(model.state_dict(), full.state_dict())
        _assert_same(model.state_dict(), seen[step][0])
        assert opt.state_dict()["state"].keys() == seen[step][1]["state"].keys()
        for k, v in seen[step][1]["state"].items():
            assert all(torch.equal(opt.state_dict()["state"][k][n], v[n]) for n in v)
    # The deltas held far less than the tables: tombstones and changed rows only.
    kinds = {}
    for step in SAVES:
        payload = torch.load(tmp_path / "inc" / f"step_{step}" / "tables.rank0-of-1.pt", weights_only=True)
        kinds[step] = payload["kind"]
        if payload["kind"] == "delta":
            assert any(t["tombstones"].numel() for t in payload["modules"]["ebc"].values())
    assert kinds == {2: "base", 4: "delta", 6: "delta", 8: "base", 10: "delta"}


def test_a_link_serves_as_the_full_save_of_its_step(tmp_path, one_rank_group):
    """load_inference_checkpoint of a delta link (tables replayed from the base, expired ids left
    out) gives the serving model that the full save of the same step gives: same lookups, same
    dense layer."""
    from torchrec_ext.inference import load_inference_checkpoint

    _train_and_save(tmp_path)
    for step in (6, 10):  # base 2 + deltas 4, 6; base 8 + delta 10
        from_chain = load_inference_checkpoint(str(tmp_path / "inc" / f"step_{step}"), _Model(1))
        from_full = load_inference_checkpoint(str(tmp_path / "full" / f"step_{step}"), _Model(2))
        assert from_chain.ebc.num_live_rows() == from_full.ebc.num_live_rows() > 0
        for seed in (step, step + 100, step + 1000):  # held, evicted and unseen ids
            assert torch.equal(from_chain.ebc(_batch(seed)).values(), from_full.ebc(_batch(seed)).values())
        assert torch.equal(from_chain.dense.weight, from_full.dense.weight)
    with pytest.raises(ValueError, match="incremental checkpoint keeps the model under key 'model', got key='net'"):
        load_inference_checkpoint(str(tmp_path / "inc" / "step_6"), _Model(1), key="net")


def test_a_damaged_or_missing_link_is_refused_and_the_newest_verified_one_is_found(tmp_path, one_rank_group):
    import shutil

    from torchrec_ext.distributed.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint

    _train_and_save(tmp_path)
    root = tmp_path / "inc"
    with pytest.raises(CheckpointError, match="is a link of an incremental chain"):
        load_checkpoint(str(root / "step_6"), {"step": 0})
    file = root / "step_4" / "tables.rank0-of-1.pt"
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))
    with pytest.raises(
        CheckpointError,
        match=r"step_6: a link of its incremental chain is damaged: .*step_4: "
        r"tables\.rank0-of-1\.pt: its SHA-256 differs",
    ):
        _load_incremental(tmp_path, 6)
    assert latest_checkpoint(str(root)) == (10, str(root / "step_10"))  # its chain starts at step_8
    shutil.rmtree(root / "step_8")
    with pytest.raises(CheckpointError, match=r"step_10: the link it builds on, .*step_8, cannot be read"):
        _load_incremental(tmp_path, 10)
    assert latest_checkpoint(str(root)) == (2, str(root / "step_2"))  # 10 lacks 8; 6 and 4 build on the damaged 4


def test_rotation_keeps_the_links_kept_checkpoints_build_on(tmp_path, one_rank_group):
    _, seen = _train_and_save(tmp_path, full_every=3, keep=1)
    assert sorted(os.listdir(tmp_path / "inc")) == ["step_10", "step_8"]  # 10 is a delta on the base 8
    model, _ = _load_incremental(tmp_path, 10)
    _assert_same(model.state_dict(), seen[10][0])


def test_bad_arguments_are_clear_errors(tmp_path, one_rank_group):
    from torchrec_ext.distributed.checkpoint_incremental import IncrementalCheckpoints

    model = _Model(0)
    with pytest.raises(ValueError, match="full_every must be an int >= 1, got 0"):
        IncrementalCheckpoints(str(tmp_path), model, full_every=0)
    with pytest.raises(ValueError, match="holds no dynamic embedding module"):
        IncrementalCheckpoints(str(tmp_path), nn.Linear(2, 2))
    with pytest.raises(ValueError, match="must not hold the key 'model'"):
        IncrementalCheckpoints(str(tmp_path), model).save(1, {"model": 1})


def _sharded(rank, world_size, root):
    from test_deltas_sharded import _batch as sharded_batch
    from test_deltas_sharded import _dmp, _full
    from torchrec_ext.distributed.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
    from torchrec_ext.distributed.checkpoint_incremental import IncrementalCheckpoints

    dmp = _dmp(world_size)  # t1 row-wise over both ranks, t2 table-wise on rank 1: evictions, expiry
    ckpts = IncrementalCheckpoints(os.path.join(root, "inc"), dmp, full_every=3, keep=0)
    seen = {}
    for step in range(1, 11):
        dmp(sharded_batch(step, rank)).values().sum().backward()
        if step % 2 == 0:
            ckpts.save(step, {"step": step})
            save_checkpoint(os.path.join(root, "full"), step, {"model": dmp.state_dict()}, keep=0)
            seen[step] = _full(dmp)
    for step in (6, 10):  # base 2, deltas 4 and 6; base 8, delta 10
        fresh = _dmp(world_size)
        loaded = IncrementalCheckpoints(os.path.join(root, "inc"), fresh).load(
            os.path.join(root, "inc", f"step_{step}"), {"step": 0}
        )
        assert loaded["step"] == step
        full = _dmp(world_size)
        state = load_checkpoint(os.path.join(root, "full", f"step_{step}"), {"model": full.state_dict()})
        full.load_state_dict(state["model"])
        got, want = _full(fresh), _full(full)
        _assert_same(got, want)
        _assert_same(got, seen[step])
    assert latest_checkpoint(os.path.join(root, "inc")) == (10, os.path.join(root, "inc", "step_10"))
    # Served from the chain (both ranks' shares merged) as from the full save of the step.
    from test_deltas_sharded import ModelWith, _configs
    from torchrec_ext import DynamicEmbeddingBagCollection
    from torchrec_ext.inference import load_inference_checkpoint

    served = [
        load_inference_checkpoint(
            os.path.join(root, kind, "step_10"), ModelWith("ebc", DynamicEmbeddingBagCollection(_configs()))
        )
        for kind in ("inc", "full")
    ]
    assert served[0].ebc.num_live_rows() == served[1].ebc.num_live_rows() > 0
    for seed in (9, 10, 50):
        kjt = sharded_batch(seed, rank)
        assert torch.equal(served[0].ebc(kjt).values(), served[1].ebc(kjt).values())


def test_two_ranks_load_exactly_the_full_save_of_the_step(tmp_path):
    from dist_helpers import run_ranks

    run_ranks(_sharded, 2, str(tmp_path))


def test_the_job_resumes_from_a_delta_link_exactly(tmp_path):
    """--checkpoint-incremental: a run resumed from a delta link continues as the uninterrupted
    run did, bit for bit (losses and evals)."""
    import json
    import shutil

    from job_helpers import TINY, job_ok, run_job

    args = [
        "--eval-every",
        "10",
        "--checkpoint-every",
        "5",
        "--checkpoint-incremental",
        "3",
        "--keep-checkpoints",
        "0",
    ] + TINY
    reference = str(tmp_path / "reference")
    job_ok(run_job(["--steps", "20", "--run-dir", reference] + args))
    ckpts = os.path.join(reference, "checkpoints")
    assert sorted(os.listdir(ckpts)) == ["step_10", "step_15", "step_20", "step_5"]
    kinds = {
        step: torch.load(os.path.join(ckpts, f"step_{step}", "tables.rank0-of-1.pt"), weights_only=True)["kind"]
        for step in (5, 10, 15, 20)
    }
    assert kinds == {5: "base", 10: "delta", 15: "delta", 20: "base"}
    resumed = str(tmp_path / "resumed")
    shutil.copytree(reference, resumed)
    shutil.rmtree(os.path.join(resumed, "checkpoints", "step_20"))
    out = job_ok(run_job(["--steps", "20", "--run-dir", resumed, "--resume"] + args)).stdout
    assert f"resumed from {os.path.join(resumed, 'checkpoints', 'step_15')} at step 15" in out, out[-2000:]

    def history(run_dir):
        with open(os.path.join(run_dir, "history.json")) as f:
            saved = json.load(f)
        return {k: saved[k] for k in ("train_loss", "evals")}

    assert history(resumed) == history(reference)
