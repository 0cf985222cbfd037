"""The pipelined train loop: multithreaded prefetch, threaded input dist on its own process
group, flat dense all-reduce (CUDA-graph captured on GPU) and pinned device-to-host outputs."""

from torchrec_ext.pipeline.prefetch import BatchPrefetcher
from torchrec_ext.pipeline.train_pipeline import PipelineOptions, TrainPipeline

__all__ = ["BatchPrefetcher", "PipelineOptions", "TrainPipeline"]
