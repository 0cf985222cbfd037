"""Sharded dynamic tables through torch.distributed.checkpoint: a 2-rank checkpoint reloads on
2 ranks (identical lookups and training after), on 1 rank and back to 2 (rows re-routed); a
checkpoint of other tables is refused. (Interrupted saves: tests/test_train.py.)"""

import os

import pytest
import torch
import torch.distributed as dist
from torchrec import KeyedJaggedTensor

from dist_helpers import ModelWith, dmp_t1_row_t2_table_wise, run_ranks
from torchrec_ext import DynamicEmbeddingBagCollection, DynamicEmbeddingBagConfig

BATCH, KEYS = 6, ["f1", "f2"]


def _configs(dim=8):
    return [
        DynamicEmbeddingBagConfig(
            name="t1", embedding_dim=dim, num_embeddings=512, feature_names=["f1"], eviction_policy="lfu"
        ),
        DynamicEmbeddingBagConfig(name="t2", embedding_dim=4, num_embeddings=256, feature_names=["f2"], ttl_steps=50),
    ]


def _batch(step, rank):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    lengths = torch.randint(0, 4, (len(KEYS) * BATCH,), generator=gen)
    values = torch.randint(-(2**40), 2**40, (int(lengths.sum()),), generator=gen) % 97 * (2**33) - 5
    return KeyedJaggedTensor(keys=KEYS, values=values, lengths=lengths, stride=BATCH)


def _dmp(world_size, dim=8):
    from torchrec.optim.keyed import CombinedOptimizer

    model = ModelWith(
        "ebc", DynamicEmbeddingBagCollection(_configs(dim), optimizer="adam", optimizer_kwargs={"lr": 0.05})
    )
    dmp = dmp_t1_row_t2_table_wise(model, world_size)
    return dmp, CombinedOptimizer([dmp.fused_optimizer])


def _eval_global(dmp, rank, world_size, steps=(100, 101)):
    """This rank's outputs on fixed eval batches, each rank taking the samples of the ranks
    it stands for (on 1 rank: all 2 ranks' samples)."""
    dmp.eval()
    outs = []
    for step in steps:
        parts = [_batch(step, r) for r in range(2)]
        mine = parts if world_size == 1 else [parts[rank]]
        kjt = KeyedJaggedTensor.from_jt_dict({k: _cat([p.to_dict()[k] for p in mine]) for k in KEYS})
        outs.append(dmp(kjt).values().detach().clone())
    dmp.train()
    return outs


def _cat(jts):
    from torchrec import JaggedTensor

    return JaggedTensor(values=torch.cat([j.values() for j in jts]), lengths=torch.cat([j.lengths() for j in jts]))


def _train(dmp, optimizer, rank, steps):
    for step in steps:
        optimizer.zero_grad()
        dmp(_batch(step, rank)).values().sum().backward()
        optimizer.step()


def _rows(dmp):
    local = dmp.module.ebc.local_module
    sd = local.state_dict() if local is not None else {}
    mine = {k: v for k, v in sd.items() if k.endswith((".weight", ".weight_id"))}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    rows = {}
    for part in everyone:
        for t in ("t1", "t2"):
            if f"embedding_bags.{t}.weight_id" in part:
                rows.setdefault(t, {}).update(
                    zip(part[f"embedding_bags.{t}.weight_id"].tolist(), part[f"embedding_bags.{t}.weight"].tolist())
                )
    return rows


def _save_on_two(rank, world_size, root):
    from torchrec_ext.distributed.checkpoint import save_checkpoint

    dmp, opt = _dmp(world_size)
    _train(dmp, opt, rank, range(4))
    save_checkpoint(root, 4, {"model": dmp.state_dict(), "optim": opt.state_dict()})
    torch.save(_eval_global(dmp, rank, world_size), os.path.join(root, f"eval_{rank}.pt"))
    _train(dmp, opt, rank, range(4, 7))
    rows = _rows(dmp)
    if rank == 0:
        torch.save(rows, os.path.join(root, "rows_after.pt"))


def _load_on_two(rank, world_size, root, step):
    from torchrec_ext.distributed.checkpoint import load_checkpoint

    dmp, opt = _dmp(world_size)
    state = load_checkpoint(os.path.join(root, f"step_{step}"), {"model": dmp.state_dict(), "optim": opt.state_dict()})
    dmp.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])
    want = torch.load(os.path.join(root, f"eval_{rank}.pt"))
    for got, expected in zip(_eval_global(dmp, rank, world_size), want):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    if step == 4:
        _train(dmp, opt, rank, range(4, 7))
        want_rows = torch.load(os.path.join(root, "rows_after.pt"))
        got_rows = _rows(dmp)
        for t in want_rows:
            assert got_rows[t].keys() == want_rows[t].keys()
            for k in want_rows[t]:
                torch.testing.assert_close(torch.tensor(got_rows[t][k]), torch.tensor(want_rows[t][k]))


def _load_on_one_then_save(rank, world_size, root):
    from torchrec_ext.distributed.checkpoint import load_checkpoint, save_checkpoint

    dmp, opt = _dmp(world_size)
    state = load_checkpoint(os.path.join(root, "step_4"), {"model": dmp.state_dict(), "optim": opt.state_dict()})
    dmp.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])
    got = _eval_global(dmp, rank, world_size)
    want = [torch.load(os.path.join(root, f"eval_{r}.pt")) for r in range(2)]
    for i, out in enumerate(got):  # one rank's output: rank 0's samples, then rank 1's
        torch.testing.assert_close(out, torch.cat([want[0][i], want[1][i]]), rtol=0, atol=0)
    save_checkpoint(root, 5, {"model": dmp.state_dict(), "optim": opt.state_dict()})


def _mismatched_tables(rank, world_size, root):
    from torchrec_ext.distributed.checkpoint import load_checkpoint

    dmp, opt = _dmp(world_size, dim=16)
    state = load_checkpoint(os.path.join(root, "step_4"), {"model": dmp.state_dict(), "optim": opt.state_dict()})
    with pytest.raises(ValueError, match=r"table .t1. weight must be \[\d+, 16\]"):
        dmp.load_state_dict(state["model"])


def test_checkpoint_reloads_on_two_ranks_one_rank_and_back(tmp_path):
    root = str(tmp_path)
    run_ranks(_save_on_two, 2, root)
    run_ranks(_load_on_two, 2, root, 4)  # same world: lookups and further training identical
    run_ranks(_load_on_one_then_save, 1, root)  # 2 -> 1: rows re-routed to the one rank
    run_ranks(_load_on_two, 2, root, 5)  # 1 -> 2: re-routed again, same lookups
    run_ranks(_mismatched_tables, 1, root)


def _plain_dcp_save_on_two(rank, world_size, root):
    import torch.distributed.checkpoint as dcp

    dmp, opt = _dmp(world_size)
    _train(dmp, opt, rank, range(4))
    dcp.save({"model": dmp.state_dict(), "optim": opt.state_dict()}, checkpoint_id=os.path.join(root, "plain"))
    torch.save(_eval_global(dmp, rank, world_size), os.path.join(root, f"plain_eval_{rank}.pt"))
    _train(dmp, opt, rank, range(4, 7))
    if rank == 0:
        torch.save(_rows(dmp), os.path.join(root, "plain_rows_after.pt"))
    else:
        _rows(dmp)  # collective


def _plain_dcp_load(rank, world_size, root):
    """A TorchRec user's own dcp.load (no manifest, no save_checkpoint), with the planner that
    resizes the tables' live-row entries, into a fresh model: same outputs as the saving model, on
    2 ranks and resharded onto 1; on 2, further training gives the saving model's rows."""
    import torch.distributed.checkpoint as dcp

    from torchrec_ext.distributed.checkpoint import DynamicTablesLoadPlanner

    dmp, opt = _dmp(world_size)
    state = {"model": dmp.state_dict(), "optim": opt.state_dict()}
    dcp.load(state, checkpoint_id=os.path.join(root, "plain"), planner=DynamicTablesLoadPlanner())
    dmp.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])
    want = [torch.load(os.path.join(root, f"plain_eval_{r}.pt")) for r in range(2)]
    for i, got in enumerate(_eval_global(dmp, rank, world_size)):
        expected = want[rank][i] if world_size == 2 else torch.cat([want[0][i], want[1][i]])
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    if world_size == 2:
        _train(dmp, opt, rank, range(4, 7))
        got_rows, want_rows = _rows(dmp), torch.load(os.path.join(root, "plain_rows_after.pt"))
        assert got_rows.keys() == want_rows.keys()
        for t in want_rows:
            assert got_rows[t] == want_rows[t]


def test_plain_dcp_load_with_the_dynamic_tables_planner(tmp_path):
    root = str(tmp_path)
    run_ranks(_plain_dcp_save_on_two, 2, root)
    run_ranks(_plain_dcp_load, 2, root)
    run_ranks(_plain_dcp_load, 1, root)


def test_plain_dcp_load_unsharded_module(tmp_path):
    """Unsharded, one process: DCP's own planner refuses the fresh module's state (its tables
    hold no rows yet); the dynamic tables planner loads it, the outputs equal the saved module's."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    from torchrec_ext.distributed.checkpoint import DynamicTablesLoadPlanner

    def build():
        return DynamicEmbeddingBagCollection(_configs(), optimizer="adagrad", optimizer_kwargs={"lr": 0.1})

    trained = build()
    for step in range(3):
        trained(_batch(step, 0)).values().sum().backward()
    path = str(tmp_path / "ckpt")
    with pytest.warns(UserWarning):  # DCP: no process group, loading in one process
        dcp.save(trained.state_dict(), checkpoint_id=path)
    fresh = build()
    with pytest.warns(UserWarning), pytest.raises(CheckpointException, match="Size mismatch"):
        dcp.load(fresh.state_dict(), checkpoint_id=path)
    state = fresh.state_dict()
    with pytest.warns(UserWarning):
        dcp.load(state, checkpoint_id=path, planner=DynamicTablesLoadPlanner())
    fresh.load_state_dict(state)
    trained.eval(), fresh.eval()
    for step in (10, 11):
        torch.testing.assert_close(fresh(_batch(step, 0)).values(), trained(_batch(step, 0)).values(), rtol=0, atol=0)
