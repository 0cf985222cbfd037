"""Train-step time of a tiered table on a GPU (issue 16's GPU goal): our cache in HBM over host
memory, with the pipeline's prefetch, against TorchRec's EmbeddingBagCollection sharded with
FUSED_UVM_CACHING (fbgemm's HBM cache over UVM host memory), at the same cache ratios, on the
same data. Goal: ours <= TorchRec at cache ratio 1.0 and 0.8 (NVIDIA dynamicemb, the figure to
beat on an H100, 10 tables x dim 128: 12.3 ms vs TorchRec's 14.4 at 1.0, 24.3 vs 15.0 at 0.8).

Workload: ``num_tables`` tables of ``rows`` rows x dim ``dim`` (10 x 1M x 128 by default),
``batch_size`` bags per table per step, bag lengths uniform in 1..``max_bag``, ids Zipf(``alpha``)
taken modulo ``rows`` (``torchrec_ext.data.dlrm_small_batch(modulo=rows)``: ids TorchRec's
fixed-size tables take, fed unchanged to ours); fused row-wise Adagrad on both; one step =
forward + backward of sum(output) + the fused update. Systems, per cache ratio r in ``ratios``:

- ours:     DynamicEmbeddingBagCollection, backing="host", cache_load_factor r (the cache,
            vectors + optimizer state, in HBM; every row in host memory; rows move through
            pinned records buffers), each step calling ``stage_next(next batch)`` first (what
            ``TrainPipeline(tier_prefetch=True)`` does): the next batch's misses staged on a side
            stream while this step computes. The stage in flight at the end of a timed chunk is
            waited for inside it.
- torchrec: TorchRec's EmbeddingBagCollection under DistributedModelParallel (one rank), each
            table table-wise with compute kernel FUSED_UVM_CACHING and the sharder's
            ``cache_load_factor`` r; a plain loop (fbgemm fills its cache inside the forward).
- resident: ours all in HBM (backing="device"), once: the floor the tier is measured against.

``maps`` picks where ours keeps its caches' maps (row -> slot, LRU clocks, dirty flags, pins):
"device" (the default on CUDA: tier_device_maps.py; a lookup whose rows are cached reads one
count on the host), "host" (``RowCache``: the bookkeeping on the host, session 12's figures), or
both ("device,host": ours and ours-hostmaps, timed interleaved).

Before the warm-up (``fill``, on by default), one pass over every row id of every table makes all
rows live, so that a cache ratio below 1 holds fewer rows than the table (a short run of Zipf ids
alone leaves a fifth of the rows unused: ratio 0.8 would evict nothing). After ``warmup_steps``
(caches full), the systems are timed in turn chunk by chunk, the order
rotating per repeat (interleaved, so all see the same machine): median ms per step of ``repeats``
chunks of ``steps_per_repeat`` steps, each chunk between two ``torch.cuda.synchronize()``. Also
reported for ours, per timed step: the cache hit rate at step time (rows found at step time over
rows that held values; ~1.0 with the prefetch, by construction), the hit rate before staging
(``held_hit_rate``: the rows staged ahead counted as misses, as TorchRec counts a UVM prefetch's),
misses and rows staged, write-backs, the rows live against the cache's slots after the fill (a
ratio below 1 must leave rows outside the cache: the run stops otherwise), and bytes in HBM
(``torch.cuda.max_memory_allocated`` per system, reset before each build).

Needs a CUDA device (and fbgemm-gpu's CUDA build for the TorchRec system); exits with a clear
message otherwise. ``--device cpu`` runs ours and resident on the CPU (a smoke test of the
benchmark itself: the caches' maps forced onto the device path, ``TieredTables.device_maps``;
no HBM figures, no TorchRec system).

    python benchmarks/bench_tiers_gpu.py                      # saves results/tiers_gpu.{md,jsonl}
    python benchmarks/bench_tiers_gpu.py --ratios 0.8 --systems ours,torchrec
    python benchmarks/bench_tiers_gpu.py --systems ours,resident --maps device,host  # device vs host maps
    python benchmarks/bench_tiers_gpu.py --rows 65536 --batch-size 1024 --warmup-steps 3 --repeats 2 --no-save  # smoke
    python benchmarks/bench_tiers_gpu.py --device cpu --systems ours,resident --num-tables 2 --rows 4096 \
        --dim 16 --batch-size 256 --warmup-steps 3 --repeats 2 --steps-per-repeat 2 --no-save  # CPU smoke
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import every_row_batches, fbgemm_cuda_reason, markdown_table, parse_config, print_and_save

from torchrec_ext import DynamicEmbeddingBagCollection, DynamicEmbeddingBagConfig
from torchrec_ext.data import dlrm_small_batch
from torchrec_ext.modules.tiered_tables import TieredTables


@dataclasses.dataclass
class Config:
    num_tables: int = 10
    dim: int = 128
    rows: int = 1 << 20  # per table (ours: its capacity; TorchRec: num_embeddings)
    batch_size: int = 8192
    max_bag: int = 7
    alpha: float = 1.05
    ratios: str = "1.0,0.8"  # cache_load_factor values, comma-separated
    lr: float = 0.01
    warmup_steps: int = 30
    repeats: int = 7
    steps_per_repeat: int = 5
    seed: int = 0
    # 1: before the warm-up, one training pass over every row id (ids 0..rows-1, one per bag), so
    # that every row is live and a cache ratio below 1 holds fewer rows than the table: misses and
    # evictions in the timed steps (without it a short run fills < 80% of the rows: nothing evicts)
    fill: int = 1
    systems: tuple[str, ...] = ("ours", "torchrec", "resident")
    maps: str = "device"  # ours: where the caches' maps live, "device" and/or "host", comma-separated
    device: str = "cuda"  # "cpu": a smoke test of the benchmark (ours and resident only)
    cache_algorithm: str = "lru"  # "lru" or "lfu": ours' cache_algorithm and TorchRec's fused_params cache_algorithm


SYSTEMS = ("ours", "torchrec", "resident")


def _check_device(cfg: Config) -> torch.device:
    if cfg.device == "cpu":
        if "torchrec" in cfg.systems:
            sys.exit("bench_tiers_gpu.py: --device cpu runs ours and resident only (--systems ours,resident)")
        return torch.device("cpu")
    if cfg.device != "cuda":
        sys.exit(f"bench_tiers_gpu.py: --device takes cuda or cpu, got {cfg.device!r}")
    if not torch.cuda.is_available():
        sys.exit(
            "bench_tiers_gpu.py: needs a CUDA device (torch.cuda.is_available() is False); "
            "the CPU tier's benchmark is benchmarks/bench_tiers.py"
        )
    return torch.device("cuda", torch.cuda.current_device())


def _batches(cfg: Config, count: int, device: torch.device) -> list:
    return [
        dlrm_small_batch(
            step, cfg.num_tables, cfg.batch_size, cfg.max_bag, cfg.seed, alpha=cfg.alpha, modulo=cfg.rows
        ).to(device)
        for step in range(count)
    ]


def _ours(cfg: Config, device: torch.device, backing: str, ratio: float | None, maps: str = "device"):
    tables = [
        DynamicEmbeddingBagConfig(
            name=f"t{t}", embedding_dim=cfg.dim, num_embeddings=cfg.rows, feature_names=[f"f{t}"], backing=backing
        )
        for t in range(cfg.num_tables)
    ]
    if ratio is not None:
        for table in tables:
            table.cache_load_factor = ratio
            table.cache_algorithm = cfg.cache_algorithm
    chosen, TieredTables.device_maps = TieredTables.device_maps, maps == "device"
    try:
        module = DynamicEmbeddingBagCollection(
            tables, optimizer="rowwise_adagrad", optimizer_kwargs={"lr": cfg.lr}, device=device
        )
    finally:
        TieredTables.device_maps = chosen
    staged = backing != "device"
    if staged:
        module._tables.device_maps = maps == "device"  # (kept if the module moves)

    def step(kjt, next_kjt) -> None:
        if staged and next_kjt is not None:
            module.stage_next(next_kjt)  # staged once this step's lookup has its rows
        module(kjt).values().sum().backward()

    def settle() -> None:
        if staged:
            module._tables.wait_for_stage()

    return module, step, settle


def _torchrec(cfg: Config, device: torch.device, ratio: float):
    import torch.distributed as dist
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
    from torchrec.distributed.types import CacheAlgorithm, ShardingPlan
    from torchrec.optim import RowWiseAdagrad
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    if not dist.is_initialized():
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    tables = [
        EmbeddingBagConfig(name=f"t{t}", embedding_dim=cfg.dim, num_embeddings=cfg.rows, feature_names=[f"f{t}"])
        for t in range(cfg.num_tables)
    ]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    apply_optimizer_in_backward(RowWiseAdagrad, ebc.parameters(), {"lr": cfg.lr})
    kernel = EmbeddingComputeKernel.FUSED_UVM_CACHING.value
    algorithm = CacheAlgorithm.LFU if cfg.cache_algorithm == "lfu" else CacheAlgorithm.LRU
    sharder = EmbeddingBagCollectionSharder(fused_params={"cache_load_factor": ratio, "cache_algorithm": algorithm})
    plan = construct_module_sharding_plan(
        ebc,
        per_param_sharding={t.name: table_wise(rank=0, compute_kernel=kernel) for t in tables},
        local_size=1,
        world_size=1,
        device_type="cuda",
        sharder=sharder,
    )
    kernels = {ps.compute_kernel for ps in plan.values()}
    if kernels != {kernel}:
        raise RuntimeError(f"bench_tiers_gpu.py: TorchRec planned compute kernels {kernels}, wanted {kernel}")
    model = torch.nn.ModuleDict({"ebc": ebc})  # (the plan names the sharded module by its path)
    dmp = DistributedModelParallel(model, device=device, sharders=[sharder], plan=ShardingPlan({"ebc": plan}))
    sharded = dmp.module["ebc"]

    def step(kjt, next_kjt) -> None:
        sharded(kjt).values().sum().backward()

    return dmp, step, lambda: None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed_chunk(step, settle, batches: list, first: int, count: int, device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    for i in range(first, first + count):
        step(batches[i], batches[i + 1] if i + 1 < len(batches) else None)
    settle()
    _sync(device)
    return (time.perf_counter() - start) / count


def _tier_counters(module) -> dict[str, int]:
    stats = module.table_stats().values()
    keys = ("cache_hits", "cache_misses", "cache_staged", "cache_write_backs", "cache_bytes_moved", "cache_slots")
    keys += ("live_rows",)
    return {k: sum(getattr(s, k) for s in stats) for k in keys}


def _check_filled(key: str, module, ratio: float | None) -> None:
    """A cache ratio below 1 must leave live rows outside the cache before timing, or the timed
    steps evict nothing (the first H100 run's ratio 0.8 timed bookkeeping only)."""
    counters = _tier_counters(module)
    if ratio is not None and ratio < 1 and counters["live_rows"] <= counters["cache_slots"]:
        sys.exit(
            f"bench_tiers_gpu.py: {key}: {counters['live_rows']:,} live rows fit the {counters['cache_slots']:,} "
            "cache slots after the warm-up: nothing would be evicted (keep --fill 1)"
        )


def run(cfg: Config) -> dict[str, object]:
    device = _check_device(cfg)
    cuda = device.type == "cuda"
    ratios = [float(r) for r in cfg.ratios.split(",") if r]
    if "torchrec" in cfg.systems:
        reason = fbgemm_cuda_reason()
        if reason:
            sys.exit(
                f"bench_tiers_gpu.py: the torchrec system needs fbgemm-gpu's CUDA build: {reason} "
                "(or leave it out: --systems ours,resident)"
            )
    count = cfg.warmup_steps + cfg.repeats * cfg.steps_per_repeat + 1
    batches = _batches(cfg, count, device)
    fill = [kjt.to(device) for kjt in every_row_batches(cfg.num_tables, cfg.rows, cfg.batch_size)] if cfg.fill else []
    ids_per_step = sum(int(b.values().numel()) for b in batches) / len(batches)
    built = {}
    hbm = {}
    maps = [m for m in cfg.maps.split(",") if m]
    if not maps or set(maps) - {"device", "host"}:
        sys.exit(f"bench_tiers_gpu.py: --maps takes device and/or host, comma-separated, got {cfg.maps!r}")
    variants = [(name, m) for name in cfg.systems for m in (maps if name == "ours" else [None])]
    for name, where in variants:
        for ratio in [None] if name == "resident" else ratios:
            label = name if where in (None, "device") else f"{name}-{where}maps"
            key = label if ratio is None else f"{label}@{ratio}"
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device) if cuda else 0
            if name == "ours":
                built[key] = _ours(cfg, device, "host", ratio, where)
            elif name == "resident":
                built[key] = _ours(cfg, device, "device", None)
            else:
                built[key] = _torchrec(cfg, device, ratio)
            module, step, settle = built[key]
            if fill:
                _timed_chunk(step, settle, fill, 0, len(fill), device)  # every row live
            _timed_chunk(step, settle, batches, 0, cfg.warmup_steps, device)  # caches full before timing
            hbm[key] = torch.cuda.max_memory_allocated(device) - base if cuda else 0
            print(f"built and warmed {key}" + (f": {hbm[key] / 2**30:.2f} GiB of HBM" if cuda else ""), flush=True)
            if name == "ours":
                _check_filled(key, module, ratio)
    before = {k: _tier_counters(m) for k, (m, _, _) in built.items() if k.startswith("ours")}
    times: dict[str, list[float]] = {k: [] for k in built}
    names = list(built)
    for r in range(cfg.repeats):
        first = cfg.warmup_steps + r * cfg.steps_per_repeat
        shift = r % len(names)
        for key in names[shift:] + names[:shift]:
            _, step, settle = built[key]
            times[key].append(_timed_chunk(step, settle, batches, first, cfg.steps_per_repeat, device))
        print(f"repeat {r}: " + ", ".join(f"{k} {t[-1] * 1e3:.2f} ms" for k, t in times.items()), flush=True)
    timed_steps = cfg.repeats * cfg.steps_per_repeat
    tier = {}
    for key, counters in before.items():
        after = _tier_counters(built[key][0])
        d = {k: after[k] - counters[k] for k in counters if k not in ("cache_slots", "live_rows")}
        looked = d["cache_hits"] + d["cache_misses"]
        tier[key] = {
            "hit_rate": d["cache_hits"] / looked if looked else 1.0,
            # the rows staged ahead counted as misses (train/tier_traffic.py's held_hit_rate)
            "held_hit_rate": max(0, d["cache_hits"] - d["cache_staged"]) / looked if looked else 1.0,
            "misses_per_step": d["cache_misses"] / timed_steps,
            "staged_per_step": d["cache_staged"] / timed_steps,
            "write_backs_per_step": d["cache_write_backs"] / timed_steps,
            "mb_moved_per_step": d["cache_bytes_moved"] / timed_steps / 1e6,
            "cache_slots": after["cache_slots"],
            "live_rows": after["live_rows"],
        }
    return {
        "ms_per_step": {k: statistics.median(t) * 1e3 for k, t in times.items()},
        "all_ms": {k: [x * 1e3 for x in t] for k, t in times.items()},
        "hbm_bytes": hbm,
        "tier": tier,
        "ids_per_step": ids_per_step,
        "device": torch.cuda.get_device_name(device) if cuda else "CPU (smoke)",
    }


def report(cfg: Config, r: dict[str, object]) -> str:
    ms = r["ms_per_step"]
    rows = []
    for key, value in ms.items():
        name, _, ratio = key.partition("@")
        versus = ms.get(f"torchrec@{ratio}") if name.startswith("ours") else None
        tier = r["tier"].get(key, {})
        rows.append(
            [
                name,
                ratio or "-",
                f"{value:.2f}",
                f"{value / versus:.2f}" if versus else "",
                f"{tier['hit_rate']:.3f}" if tier else "",
                f"{tier['held_hit_rate']:.3f}" if tier else "",
                f"{tier['live_rows']:,} / {tier['cache_slots']:,}" if tier else "",
                f"{tier['misses_per_step']:.0f} / {tier['staged_per_step']:.0f}" if tier else "",
                f"{tier['write_backs_per_step']:.0f}" if tier else "",
                f"{r['hbm_bytes'][key] / 2**30:.2f}" if r["hbm_bytes"][key] else "",
            ]
        )
    return "\n".join(
        [
            f"Tiered tables on {r['device']}: {cfg.num_tables} tables x {cfg.rows:,} rows x dim {cfg.dim}, "
            f"batch {cfg.batch_size} bags per table (bags 1..{cfg.max_bag}, ~{r['ids_per_step']:,.0f} ids a step), "
            f"Zipf({cfg.alpha}) ids mod rows, row-wise Adagrad; median of {cfg.repeats} interleaved chunks of "
            f"{cfg.steps_per_repeat} steps after {cfg.warmup_steps} warm-up steps"
            + (" (before them, a pass over every row id: all rows live)" if cfg.fill else "")
            + f". Cache algorithm {cfg.cache_algorithm.upper()}"
            + '. ours: backing="host" + '
            "stage_next prefetch, the caches' maps on the device (ours-hostmaps: on the host); "
            "torchrec: EBC, FUSED_UVM_CACHING, the same cache_load_factor.",
            "",
            markdown_table(
                [
                    "system",
                    "cache ratio",
                    "ms / step",
                    "x torchrec",
                    "hit rate",
                    "hit rate before staging",
                    "live rows / cache slots",
                    "misses / staged a step",
                    "write-backs a step",
                    "peak HBM GiB",
                ],
                rows,
            ),
            "",
            "Goal (issue 16): ours <= torchrec at both ratios (x torchrec <= 1.00).",
        ]
    )


def main() -> None:
    cfg, save_results = parse_config(Config, __doc__, systems=SYSTEMS)
    result = run(cfg)
    text = report(cfg, result)
    print_and_save("tiers_gpu", cfg, result, text, save_results)


if __name__ == "__main__":
    main()
