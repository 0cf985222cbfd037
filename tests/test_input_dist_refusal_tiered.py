"""A batch refused on one rank while a tiered table's stage (TrainPipeline's tier prefetch)
waits for that batch's input dist, on 2 real gloo ranks: every rank raises (none hangs: a 20 s
collective timeout), and the module, given back by close(), trains on as a plain loop that never
saw the refused batch (the stage left no error behind, nor rows it should not have moved)."""

import os

import torch
import torch.distributed as dist

from dist_helpers import local_state, make_batches, make_dmp_dlrm, plain_loop, run_ranks, tiered_dlrm_tables
from test_input_dist_refusal import _float_ids, progress_until_raised

WORLD, BAD_RANK, BAD_STEP, TIMEOUT_S = 2, 1, 3, 20


def _tiered_refusal(rank, world_size, root):
    from torchrec_ext.distributed import BatchRefusedError
    from torchrec_ext.pipeline import PipelineOptions, TrainPipeline

    batches = make_batches(rank, batch_size=4, num_full=8, last=0)
    fed = list(batches)
    if rank == BAD_RANK:
        fed[BAD_STEP] = _float_ids(fed[BAD_STEP])
    for threaded in (True, False):
        directory = os.path.join(root, f"{threaded}")
        oracle_dir = os.path.join(root, f"{threaded}-oracle")
        os.makedirs(directory, exist_ok=True)
        os.makedirs(oracle_dir, exist_ok=True)
        model, optimizer = make_dmp_dlrm(
            world_size, dynamic=True, tables=tiered_dlrm_tables(f"file:{directory}"), ebc_device=torch.device("meta")
        )
        options = PipelineOptions(prefetch_threads=0, threaded_input_dist=threaded, tier_prefetch=True, timeout_s=30)
        pipeline = TrainPipeline(model, optimizer, torch.device("cpu"), options)
        done, got = progress_until_raised(pipeline, iter(fed), f"threaded={threaded}")
        if rank == BAD_RANK:
            assert isinstance(got, TypeError) and "must be int64 or int32" in str(got), (threaded, repr(got))
        else:
            assert isinstance(got, BatchRefusedError), (threaded, repr(got))
        steps = [None] * world_size
        dist.all_gather_object(steps, done)
        assert steps == [done] * world_size and done <= BAD_STEP, (threaded, steps)
        pipeline.close()
        oracle, oracle_optimizer = make_dmp_dlrm(
            world_size, dynamic=True, tables=tiered_dlrm_tables(f"file:{oracle_dir}"), ebc_device=torch.device("meta")
        )
        plain_loop(oracle, oracle_optimizer, batches[:done])
        # The module trains on (its stage's wait for the refused batch left nothing behind).
        torch.testing.assert_close(
            plain_loop(model, optimizer, batches[BAD_STEP + 1 :]),
            plain_loop(oracle, oracle_optimizer, batches[BAD_STEP + 1 :]),
            msg=f"threaded={threaded}",
        )
        got_state, want_state = local_state(model), local_state(oracle)
        assert got_state.keys() == want_state.keys(), threaded
        for key in want_state:
            torch.testing.assert_close(got_state[key], want_state[key], rtol=0, atol=0, msg=f"{threaded}: {key}")


def test_a_refused_batch_while_a_tiered_stage_waits_on_its_input_dist(tmp_path):
    run_ranks(_tiered_refusal, WORLD, str(tmp_path), timeout_s=TIMEOUT_S)
