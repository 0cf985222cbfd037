"""Ranks feeding batches of different sizes in a step, through the pipelines, on 2 real gloo
ranks: our TrainPipeline (input dist threaded and inline) and TorchRec's TrainPipelineSparseDist
give the losses and tables of a plain loop over the same batches (which
test_sharded_uneven_batch.py holds to the unsharded module)."""

import torch

from dist_helpers import local_state, make_batches, make_dmp_dlrm, plain_loop, progress_losses, run_ranks

WORLD, TIMEOUT_S = 2, 60
# Each step's batch size on rank 0 and rank 1: uneven, even, one rank with a single sample.
SIZES = [(4, 6), (5, 5), (3, 1), (6, 2), (2, 7)]


def _uneven_pipelines_as_plain_loop(rank, world_size, column_wise):
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    from torchrec_ext.pipeline import PipelineOptions, TrainPipeline

    batches = [make_batches(rank, batch_size=s[rank], num_full=1, last=0, seed=i)[0] for i, s in enumerate(SIZES)]
    reference, reference_optimizer = make_dmp_dlrm(world_size, dynamic=True, t1_column_wise=column_wise)
    want_losses, want_state = plain_loop(reference, reference_optimizer, batches), local_state(reference)
    makers = {
        "threaded": lambda m, o: TrainPipeline(
            m, o, torch.device("cpu"), PipelineOptions(threaded_input_dist=True, prefetch_threads=0)
        ),
        "inline": lambda m, o: TrainPipeline(
            m, o, torch.device("cpu"), PipelineOptions(threaded_input_dist=False, prefetch_threads=0)
        ),
        "torchrec": lambda m, o: TrainPipelineSparseDist(m, o, torch.device("cpu")),
    }
    for name, make in makers.items():
        model, optimizer = make_dmp_dlrm(world_size, dynamic=True, t1_column_wise=column_wise)
        pipeline = make(model, optimizer)
        losses = progress_losses(pipeline, batches)
        assert pipeline._pipelined_modules, f"{name}: the sharded module's input dist ran in the pipeline"
        if hasattr(pipeline, "close"):
            pipeline.close()
        assert len(losses) == len(want_losses), name
        for step, (got, want) in enumerate(zip(losses, want_losses)):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=f"{name}: loss of step {step}")
        state = local_state(model)
        assert state.keys() == want_state.keys(), name
        for key in want_state:
            torch.testing.assert_close(state[key], want_state[key], rtol=1e-6, atol=1e-6, msg=f"{name}: {key}")


def test_uneven_batches_through_the_pipelines_train_as_a_plain_loop():
    run_ranks(_uneven_pipelines_as_plain_loop, WORLD, False, timeout_s=TIMEOUT_S)


def test_uneven_batches_through_the_pipelines_column_wise():
    run_ranks(_uneven_pipelines_as_plain_loop, WORLD, True, timeout_s=TIMEOUT_S)
