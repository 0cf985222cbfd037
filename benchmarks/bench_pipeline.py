"""Step time of DLRM_DCN under DistributedModelParallel with torchrec_ext's TrainPipeline vs
TorchRec's TrainPipelineSparseDist and TrainPipelineBase and a plain loop, on the same model
shape and data, launched on 2 ranks with torchrun (CPU: gloo; GPU: NCCL).

Workload ("dlrm-small" of ANCHORS.md): 8 tables x 1M rows x dim 64 sharded row-wise with fused
Adagrad, ids heavy-tailed over 2^40 taken mod 1M, bags of 1..7 ids, 13 dense features, dense
arch 128-64, 2 DCN cross layers of rank 64, over arch 256-128-1, dense Adagrad, batch 2048 per
rank. Each loop runs `warmup` steps, then `steps` timed steps; rounds interleave the loops and
the median round is reported. The DDP-based loops share one model; ours (which takes over DDP's
all-reduce) gets its own, built identically.

    python benchmarks/bench_pipeline.py                 # re-launches itself under torchrun, 2 ranks
    python benchmarks/bench_pipeline.py --rows 10000 --batch 256 --steps 5 --rounds 1 --no-save   # smoke
"""

import dataclasses
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import markdown_table, parse_config, save


@dataclasses.dataclass
class Config:
    tables: int = 8
    rows: int = 1_000_000
    dim: int = 64
    batch: int = 2048
    max_bag: int = 7
    dense_in: int = 13
    steps: int = 20
    warmup: int = 5
    rounds: int = 3
    seed: int = 0
    ablation: int = 0  # 1: also time ours with each stage switched off
    in_memory: int = 0  # 1: batches built before timing (0: built as the loop asks, like a reader)


def batch_stream(cfg: Config, rank: int, count: int) -> Iterator:
    """`count` synthetic batches built as they are asked for, as a real reader builds them
    (costing the loop a few ms each unless something overlaps it)."""
    from torchrec.datasets.utils import Batch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    gen = torch.Generator().manual_seed(cfg.seed * 7919 + rank)
    for _ in range(count):
        lengths = torch.randint(1, cfg.max_bag + 1, (cfg.tables * cfg.batch,), generator=gen)
        u = torch.rand(int(lengths.sum()), generator=gen, dtype=torch.float64)
        zipf_rank = torch.floor((1.0 - u).pow(-1.0 / 0.05)).clamp(max=2.0**40).long()  # tail ~ rank^-1.05
        ids = (zipf_rank * 0x9E3779B97F4A7C15) & ((1 << 40) - 1)
        yield Batch(
            dense_features=torch.randn(cfg.batch, cfg.dense_in, generator=gen),
            sparse_features=KeyedJaggedTensor.from_lengths_sync(
                keys=[f"f{i}" for i in range(cfg.tables)], values=ids % cfg.rows, lengths=lengths
            ),
            labels=torch.randint(0, 2, (cfg.batch,), generator=gen).float(),
        )


def make_model(cfg: Config, device: torch.device):
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
    from torchrec.distributed.types import ShardingPlan
    from torchrec.models.dlrm import DLRM_DCN, DLRMTrain
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    torch.manual_seed(cfg.seed)
    tables = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=cfg.dim, num_embeddings=cfg.rows, feature_names=[f"f{i}"])
        for i in range(cfg.tables)
    ]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    model = DLRMTrain(
        DLRM_DCN(
            embedding_bag_collection=ebc,
            dense_in_features=cfg.dense_in,
            dense_arch_layer_sizes=[128, cfg.dim],
            over_arch_layer_sizes=[256, 128, 1],
            dcn_num_layers=2,
            dcn_low_rank_dim=64,
            dense_device=device,
        )
    )
    apply_optimizer_in_backward(torch.optim.Adagrad, model.model.sparse_arch.parameters(), {"lr": 0.01})
    world = dist.get_world_size()
    plan = construct_module_sharding_plan(
        ebc,
        per_param_sharding={t.name: row_wise() for t in tables},
        local_size=world,
        world_size=world,
        device_type=device.type,
    )
    dmp = DistributedModelParallel(
        model,
        device=device,
        sharders=[EmbeddingBagCollectionSharder()],
        plan=ShardingPlan({"model.sparse_arch.embedding_bag_collection": plan}),
    )
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())), lambda params: torch.optim.Adagrad(params, lr=0.01)
    )
    return dmp, CombinedOptimizer([dmp.fused_optimizer, dense])


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    dist.barrier()


def time_loop(step: Callable, source: Callable[[], Iterator], warmup: int) -> float:
    """Seconds per step after `warmup` steps, `step` consuming one iterator from `source()`."""
    it = source()
    for _ in range(warmup):
        step(it)
    synchronize()
    start = time.perf_counter()
    n = 0
    try:
        while True:
            step(it)
            n += 1
    except StopIteration:
        pass
    synchronize()
    return (time.perf_counter() - start) / max(n, 1)


def plain_loop(model, optimizer, device) -> Callable:
    def step(it):
        batch = next(it).to(device, non_blocking=True)
        optimizer.zero_grad()
        loss, _ = model(batch)
        loss.backward()
        optimizer.step()

    return step


def time_candidates(cfg: Config, device, source, shared, ours, round_index: int) -> dict[str, float]:
    """One round: seconds per step of each loop. TorchRec's pipelines are detached after their
    run (they rewrite the shared model's sharded forwards). The loops take turns in an order
    rotated every round, so none always runs first after the other model warmed the caches."""
    from torchrec.distributed.train_pipeline import TrainPipelineBase, TrainPipelineSparseDist

    from torchrec_ext.pipeline import PipelineOptions, TrainPipeline

    def torchrec_loop(cls):
        def run() -> float:
            pipeline = cls(shared[0], shared[1], device)
            seconds = time_loop(pipeline.progress, source, cfg.warmup)
            if hasattr(pipeline, "detach"):
                pipeline.detach()
            return seconds

        return run

    def our_loop(options):
        def run() -> float:
            with TrainPipeline(ours[0], ours[1], device, options) as pipeline:
                return time_loop(pipeline.progress, source, cfg.warmup)

        return run

    loops = {
        "plain loop": lambda: time_loop(plain_loop(*shared, device), source, cfg.warmup),
        "TorchRec TrainPipelineBase": torchrec_loop(TrainPipelineBase),
        "TorchRec TrainPipelineSparseDist": torchrec_loop(TrainPipelineSparseDist),
        "torchrec_ext TrainPipeline": our_loop(PipelineOptions()),
    }
    if cfg.ablation:  # each thread stage forced on and off, whatever the defaults chose here
        # (no input-dist thread on NCCL with peers: the pipeline refuses it there)
        dist_thread = device.type != "cuda" or dist.get_world_size() == 1
        loops.update(
            {
                "  ours, prefetch threads only": our_loop(
                    PipelineOptions(prefetch_threads=2, threaded_input_dist=False)
                ),
                "  ours, no threads": our_loop(PipelineOptions(prefetch_threads=0, threaded_input_dist=False)),
            }
        )
        if dist_thread:
            loops.update(
                {
                    "  ours, prefetch + input-dist threads": our_loop(
                        PipelineOptions(prefetch_threads=2, threaded_input_dist=True)
                    ),
                    "  ours, input-dist thread only": our_loop(
                        PipelineOptions(prefetch_threads=0, threaded_input_dist=True)
                    ),
                }
            )
    names = list(loops)
    shift = round_index % len(names)
    timed = {name: loops[name]() for name in names[shift:] + names[:shift]}
    return {name: timed[name] for name in names}


def worker(cfg: Config, save_results: bool) -> None:
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else torch.device("cpu")
    )
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // dist.get_world_size()))
    rank = dist.get_rank()
    count = cfg.warmup + cfg.steps
    if cfg.in_memory:
        batches = list(batch_stream(cfg, rank, count))
        source = lambda: iter(batches)
    else:
        source = lambda: batch_stream(cfg, rank, count)
    shared, ours = make_model(cfg, device), make_model(cfg, device)
    times: dict[str, list[float]] = {}
    for r in range(cfg.rounds):
        for name, seconds in time_candidates(cfg, device, source, shared, ours, r).items():
            times.setdefault(name, []).append(seconds)
        if rank == 0:
            print(f"round {r}: " + ", ".join(f"{n} {t[-1] * 1e3:.1f} ms" for n, t in times.items()), flush=True)
    if rank == 0:
        med = {name: statistics.median(t) for name, t in times.items()}
        base = med["TorchRec TrainPipelineSparseDist"]
        rows = [[name, f"{ms * 1e3:.1f}", f"{ms / base:.3f}"] for name, ms in med.items()]
        text = (
            f"DLRM_DCN step time, {dist.get_world_size()} ranks on {device.type} ({backend}), "
            f"{cfg.tables} tables x {cfg.rows:,} rows x dim {cfg.dim} row-wise, batch {cfg.batch} per rank, "
            f"median of {cfg.rounds} rounds of {cfg.steps} steps, batches "
            f"{'prebuilt in memory' if cfg.in_memory else 'built as the loop asks (a reader)'}\n\n"
            + markdown_table(["loop", "ms / step", "× TrainPipelineSparseDist"], rows)
        )
        print(text)
        if save_results:
            save(
                f"pipeline_{device.type}{'_in_memory' if cfg.in_memory else ''}",
                {
                    "config": dataclasses.asdict(cfg),
                    "ms_per_step": {k: v * 1e3 for k, v in med.items()},
                    "world_size": dist.get_world_size(),
                },
                text,
            )
    dist.destroy_process_group()


def main() -> None:
    cfg, save_results = parse_config(Config, __doc__, ranks=True)
    worker(cfg, save_results)


if __name__ == "__main__":
    main()
