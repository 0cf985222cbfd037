"""Ranks feeding batches of different sizes in a step, through the pipelines, on 2 real gloo
ranks: our TrainPipeline (input dist threaded and inline) and TorchRec's TrainPipelineSparseDist
give the losses and tables of a plain loop over the same batches (which
test_sharded_uneven_batch.py holds to the unsharded module). A DLRM over a sharded dynamic EBC
(row/table-wise, column-wise) and a model over a sharded dynamic EC."""

import pytest
import torch
from torch import nn

from dist_helpers import dmp_of, local_state, make_batches, make_dmp_dlrm, plain_loop, progress_losses, run_ranks

WORLD, TIMEOUT_S = 2, 60
# Each step's batch size on rank 0 and rank 1: uneven, even, one rank with a single sample.
SIZES = [(4, 6), (5, 5), (3, 1), (6, 2), (2, 7)]


class _SequenceModel(nn.Module):
    """A loss over every looked-up vector (each feature's weighted by its own factor) and a dense part."""

    def __init__(self, ec):
        super().__init__()
        self.ec = ec
        self.dense = nn.Linear(4, 1)

    def forward(self, batch):
        out = self.ec(batch.sparse_features)
        sparse = out["f0"].values().sum() + 2 * out["f1"].values().pow(2).sum() + 3 * out["f2"].values().sum()
        loss = sparse + self.dense(batch.dense_features).sum()
        return loss, (loss.detach(),)


def _ec_model(world_size):
    from torchrec.distributed.sharding_plan import row_wise, table_wise

    from torchrec_ext import DynamicEmbeddingCollection, DynamicEmbeddingConfig
    from torchrec_ext.distributed import DynamicEmbeddingCollectionSharder

    torch.manual_seed(0)
    ec = DynamicEmbeddingCollection(
        [
            DynamicEmbeddingConfig(name="t1", embedding_dim=4, num_embeddings=128, feature_names=["f0", "f2"]),
            DynamicEmbeddingConfig(name="t2", embedding_dim=4, num_embeddings=128, feature_names=["f1"]),
        ],
        optimizer="sgd",
        optimizer_kwargs={"lr": 0.05},
    )
    plan = {
        "t1": row_wise(compute_kernel="customized_kernel"),
        "t2": table_wise(rank=1, compute_kernel="customized_kernel"),
    }
    dmp = dmp_of(_SequenceModel(ec), "ec", plan, DynamicEmbeddingCollectionSharder(), world_size)
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())), lambda p: torch.optim.SGD(p, lr=0.05)
    )
    return dmp, CombinedOptimizer([dmp.fused_optimizer, dense])


MODELS = {
    "ebc": lambda world_size: make_dmp_dlrm(world_size, dynamic=True),
    "ebc column-wise": lambda world_size: make_dmp_dlrm(world_size, dynamic=True, t1_column_wise=True),
    "ec": _ec_model,
}


def _uneven_pipelines_as_plain_loop(rank, world_size, model):
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    from torchrec_ext.pipeline import PipelineOptions, TrainPipeline

    batches = [make_batches(rank, batch_size=s[rank], num_full=1, last=0, seed=i)[0] for i, s in enumerate(SIZES)]
    reference, reference_optimizer = MODELS[model](world_size)
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
        trained, optimizer = MODELS[model](world_size)
        pipeline = make(trained, optimizer)
        losses = progress_losses(pipeline, batches)
        assert pipeline._pipelined_modules, f"{name}: the sharded module's input dist ran in the pipeline"
        if hasattr(pipeline, "close"):
            pipeline.close()
        assert len(losses) == len(want_losses), name
        torch.testing.assert_close(torch.stack(losses), torch.stack(want_losses), rtol=1e-6, atol=1e-6, msg=name)
        state = local_state(trained)
        assert state.keys() == want_state.keys(), name
        for key in want_state:
            torch.testing.assert_close(state[key], want_state[key], rtol=1e-6, atol=1e-6, msg=f"{name}: {key}")


@pytest.mark.parametrize("model", list(MODELS))
def test_uneven_batches_through_the_pipelines_train_as_a_plain_loop(model):
    run_ranks(_uneven_pipelines_as_plain_loop, WORLD, model, timeout_s=TIMEOUT_S)
