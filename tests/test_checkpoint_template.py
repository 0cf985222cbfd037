"""state_template (torchrec_ext/distributed/checkpoint_template.py): a load template that gathers
no row. Oracle: the source's own state_dict, which a load through the template must restore bit
for bit (unsharded, and on 2 gloo ranks against a load through dmp.state_dict())."""

import torch

from test_deltas import _module, _train


def _assert_same(actual, expected):
    assert list(actual) == list(expected)
    for key in expected:
        assert actual[key].dtype == expected[key].dtype and torch.equal(actual[key], expected[key]), key


def test_a_load_through_the_template_restores_the_state_and_gathers_no_row(tmp_path, one_rank_group, monkeypatch):
    from torchrec_ext.distributed.checkpoint import load_checkpoint, save_checkpoint
    from torchrec_ext.distributed.checkpoint_template import state_template
    from torchrec_ext.modules.dynamic_tables import DynamicTables

    source = _module("ebc")
    _train(source, range(6))
    path = save_checkpoint(str(tmp_path), 6, {"model": source.state_dict()})
    fresh = _module("ebc")

    def no_gather(*args):
        raise AssertionError("a row was gathered for the template")

    with monkeypatch.context() as patch:
        patch.setattr(DynamicTables, "rows_state", no_gather)
        template = state_template(fresh)
    assert all(template[k].shape[0] == 0 for k in template if k.endswith((".weight", ".weight_id", ".optimizer.sum")))
    fresh.load_state_dict(load_checkpoint(path, {"model": template})["model"])
    _assert_same(fresh.state_dict(), source.state_dict())
    # The template leaves the module as it was: its state_dict() is whole again after it.
    assert state_template(fresh)["embedding_bags.t_lru.weight"].shape[0] == 0
    assert fresh.state_dict()["embedding_bags.t_lru.weight"].shape[0] > 0


def _sharded(rank, world_size, root):
    from test_deltas_sharded import _batch, _dmp, _full
    from torchrec_ext.distributed.checkpoint import load_checkpoint, save_checkpoint
    from torchrec_ext.distributed.checkpoint_template import state_template

    source = _dmp(world_size)
    for step in range(4):
        source(_batch(step, rank)).values().sum().backward()
    path = save_checkpoint(root, 4, {"model": source.state_dict()})
    fresh = _dmp(world_size)
    fresh.load_state_dict(load_checkpoint(path, {"model": state_template(fresh)})["model"])
    got, want = _full(fresh), _full(source)
    assert list(got) == list(want)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_two_ranks_load_through_the_template(tmp_path):
    from dist_helpers import run_ranks

    run_ranks(_sharded, 2, str(tmp_path))
