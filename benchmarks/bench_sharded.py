"""Train-step time of one row-wise sharded embedding layer on 2 ranks (torchrun; CPU: gloo, one
thread per rank): torchrec_ext's ShardedDynamicEmbeddingBagCollection against TorchRec's
ShardedEmbeddingBagCollection (fbgemm CPU TBE, fused Adagrad), both under
DistributedModelParallel with a manual row-wise plan, on the "dlrm-small" tables of ANCHORS.md.

Workload: 8 tables, dim 64, batch 2048 bags per table per rank (the 2-rank setup of ANCHORS.md:
4096 in all, as in the one-process anchor), bag lengths uniform in 1..7 (~65k ids per rank per
step), raw ids Zipf(1.05) over 2^40 (`torchrec_ext.data.dlrm_small_batch`; rank r takes steps
r, W + r, 2W + r, ... of one stream, so the ranks share the hot ids). One step = forward +
backward of sum(output) + the fused Adagrad update (lr 0.01). Every step gets a fresh batch, built
before timing. All systems are built first and held at once (~2 GiB each per rank at the
defaults); each round times `steps_per_repeat` steps of every system in turn (order rotated each
round, every run between two barriers), so drift in a shared machine's load hits them alike; the
median over rounds of the slower rank is reported. Systems (each the only child `.ebc` of a
tiny wrapper that DMP shards):

- ebc:       TorchRec EmbeddingBagCollection, 1M rows per table, ids mod 1M, row_wise / fused
             (a sharder subclass adds row_wise for cpu, which TorchRec's offers only for cuda),
             Adagrad via apply_optimizer_in_backward; checked to be fbgemm TBEs with EXACT_ADAGRAD.
- ours:      torchrec_ext.DynamicEmbeddingBagCollection, capacity 2^20 per table (2^19 per rank),
             row_wise / customized_kernel with torchrec_ext's sharders, raw ids.
- ours-full: the same, every rank's tables first filled to capacity (negative ids, which the
             generator never makes, inserted by no-grad training-mode forwards), so every new
             id evicts.
- ours-cw:   the same module sharded column_wise (not run by default: --systems ours,ours-cw):
             every rank holds half of each table's columns at the whole capacity and looks up
             every rank's ids.

    python benchmarks/bench_sharded.py                       # re-launches itself under torchrun, 2 ranks
    python benchmarks/bench_sharded.py --systems ebc,ours --repeats 5 --no-save
    python benchmarks/bench_sharded.py --systems ours,ours-cw --no-save   # row_wise against column_wise
    python benchmarks/bench_sharded.py --batch-size 256 --rows 10000 --capacity 16384 \
        --repeats 2 --warmup 1 --no-save                     # smoke
"""

from __future__ import annotations

import dataclasses
import gc
import os
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Built, built_batches, markdown_table, parse_config, save, small_tables, tensor_bytes

SYSTEMS = ("ebc", "ours", "ours-full")  # the default; ours-cw on request
LABELS = {
    "ebc": "TorchRec EBC row_wise, fused Adagrad (fbgemm CPU TBE), ids mod rows",
    "ours": "torchrec_ext DynamicEmbeddingBagCollection row_wise, fused Adagrad, raw ids",
    "ours-full": "the same, tables filled to capacity first (every new id evicts)",
    "ours-cw": "torchrec_ext DynamicEmbeddingBagCollection column_wise (half the columns per rank), raw ids",
}


@dataclasses.dataclass
class Config:
    num_tables: int = 8
    dim: int = 64
    batch_size: int = 2048  # bags per table per rank
    max_bag: int = 7
    alpha: float = 1.05
    id_bits: int = 40
    rows: int = 1_000_000  # EBC rows per table (all ranks)
    capacity: int = 1 << 20  # our rows per table (all ranks)
    lr: float = 0.01
    repeats: int = 10
    warmup: int = 3
    steps_per_repeat: int = 5
    systems: tuple[str, ...] = SYSTEMS
    seed: int = 0


class Wrapper(nn.Module):
    """DMP shards a child module: the embedding collection is `.ebc`."""

    def __init__(self, ebc: nn.Module):
        super().__init__()
        self.ebc = ebc

    def forward(self, kjt):
        return self.ebc(kjt)


def build_ebc(cfg: Config) -> Built:
    from torchrec import EmbeddingBagCollection
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
    from torchrec.distributed.types import ShardingPlan
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    class RowWiseCpuSharder(EmbeddingBagCollectionSharder):
        """TorchRec's EBC sharder offers row_wise only for cuda; fbgemm's CPU TBE runs it fine."""

        def sharding_types(self, compute_device_type: str) -> list[str]:
            types = list(super().sharding_types(compute_device_type))
            return types + ["row_wise"] if "row_wise" not in types else types

    world = dist.get_world_size()
    model = Wrapper(EmbeddingBagCollection(tables=small_tables(cfg), device=torch.device("meta")))
    apply_optimizer_in_backward(torch.optim.Adagrad, model.ebc.parameters(), {"lr": cfg.lr})
    sharder = RowWiseCpuSharder()
    plan = construct_module_sharding_plan(
        model.ebc,
        {f"t{t}": row_wise(compute_kernel="fused") for t in range(cfg.num_tables)},
        sharder=sharder,
        local_size=world,
        world_size=world,
        device_type="cpu",
    )
    dmp = DistributedModelParallel(
        model, device=torch.device("cpu"), plan=ShardingPlan({"ebc": plan}), sharders=[sharder]
    )
    sharded = dmp.module.ebc
    picked = sorted({(p.sharding_type, p.compute_kernel) for p in plan.values()})
    # The sharded EBC keeps its lookups in a plain list (not submodules): walk them for the TBEs.
    kernels = [
        getattr(m, "optimizer", None)
        for lookup in getattr(sharded, "_lookups", [])
        for m in lookup.modules()
        if type(m).__name__ == "SplitTableBatchedEmbeddingBagsCodegen"
    ]
    if (
        picked != [("row_wise", "fused")]
        or not kernels
        or any(getattr(o, "name", None) != "EXACT_ADAGRAD" for o in kernels)
    ):
        raise RuntimeError(f"ebc: expected row_wise/fused fbgemm TBEs with EXACT_ADAGRAD, got {picked}, {kernels}")
    note = (
        f"{type(sharded).__name__}, plan {picked}, {len(kernels)} SplitTableBatchedEmbeddingBagsCodegen "
        f"per rank, {kernels[0].name}"
    )

    def step(kjt) -> None:
        dmp(kjt).values().sum().backward()

    def memory() -> tuple[int, int, int]:
        rows = -(-cfg.rows // world) * cfg.num_tables
        return tensor_bytes(dmp.state_dict(), dmp.fused_optimizer.state_dict()["state"]), rows, rows

    def batch_of(kjt):
        return KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values().remainder(cfg.rows), lengths=kjt.lengths())

    return Built(step, memory, batch_of, note)


def build_ours(cfg: Config, prefill: bool = False, sharding: str = "row_wise") -> Built:
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.sharding_plan import column_wise, construct_module_sharding_plan, row_wise
    from torchrec.distributed.types import ShardingPlan
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from torchrec_ext import DynamicEmbeddingBagCollection, DynamicEmbeddingBagConfig
    from torchrec_ext.distributed import DynamicEmbeddingBagCollectionSharder, get_sharders

    world, rank = dist.get_world_size(), dist.get_rank()
    # On meta: the unsharded module never allocates its full tables; each rank's share is
    # allocated on cpu when DMP shards it.
    model = Wrapper(
        DynamicEmbeddingBagCollection(
            small_tables(cfg, DynamicEmbeddingBagConfig, cfg.capacity),
            device=torch.device("meta"),
            optimizer=torch.optim.Adagrad,
            optimizer_kwargs={"lr": cfg.lr},
        )
    )
    generator = {
        "row_wise": lambda: row_wise(compute_kernel="customized_kernel"),
        "column_wise": lambda: column_wise(ranks=list(range(world)), compute_kernel="customized_kernel"),
    }
    plan = construct_module_sharding_plan(
        model.ebc,
        {f"t{t}": generator[sharding]() for t in range(cfg.num_tables)},
        sharder=DynamicEmbeddingBagCollectionSharder(),
        local_size=world,
        world_size=world,
        device_type="cpu",
    )
    dmp = DistributedModelParallel(
        model, device=torch.device("cpu"), plan=ShardingPlan({"ebc": plan}), sharders=get_sharders()
    )
    dmp.train()
    sharded = dmp.module.ebc
    local = sharded.local_module
    local_slots = sum(m.capacity for m in local._tables.meta)
    note = f"{type(sharded).__name__}, {local_slots // cfg.num_tables:,} rows per table per rank"
    if prefill:
        # Rank r sends capacity / W fresh negative ids per table (disjoint across ranks), so the
        # ranks together send each table `capacity` ids: ~its local capacity lands on every rank
        # (routing is a hash); then a top-up of capacity / (4W) more per rank fills what the hash
        # left short. Negative ids never come from the generator ([0, 2^40)): the workload's ids
        # all arrive at full tables and evict these (least recently used) ones.
        keys = [f"f{t}" for t in range(cfg.num_tables)]
        share = -(-cfg.capacity // world)
        with torch.no_grad():
            for base, n in ((0, share), (world * share, max(1, share // 4))):
                ids = -1 - (base + rank * n + torch.arange(n, dtype=torch.int64))
                for t in range(cfg.num_tables):
                    lengths = torch.zeros(cfg.num_tables, dtype=torch.int64)
                    lengths[t] = n
                    dmp(KeyedJaggedTensor(keys=keys, values=ids, lengths=lengths)).values()
        load = min(gather(local.num_live_rows() / local_slots))
        note += f"; load factor {load:.3f} (lowest rank) before timing"

    def step(kjt) -> None:
        dmp(kjt).values().sum().backward()

    def memory() -> tuple[int, int, int]:
        return local.storage_bytes(), local.num_live_rows(), local_slots

    return Built(step, memory, note=note)


BUILDERS = {
    "ebc": build_ebc,
    "ours": build_ours,
    "ours-full": lambda cfg: build_ours(cfg, prefill=True),
    "ours-cw": lambda cfg: build_ours(cfg, sharding="column_wise"),
}


def time_systems(built: dict[str, Built], cfg: Config, raw: list) -> dict[str, dict[str, object]]:
    """This rank's median seconds per step of each system. Rounds interleave the systems (in an
    order rotated every round), so drift in the machine's load hits them alike; each timed repeat
    of `steps_per_repeat` steps starts and ends at a barrier."""
    n = cfg.steps_per_repeat
    rounds = cfg.warmup + cfg.repeats
    batches = {name: [b.batch_of(kjt) for kjt in raw[: rounds * n]] for name, b in built.items()}
    names = list(built)
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(rounds):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            chunk = batches[name][i * n : (i + 1) * n]
            dist.barrier()
            start = time.perf_counter()
            for kjt in chunk:
                built[name].step(kjt)
            dist.barrier()
            if i >= cfg.warmup:
                times[name].append(time.perf_counter() - start)
    out = {}
    for name in names:
        nbytes, live, slots = built[name].memory()
        ids_per_step = sum(int(b.values().numel()) for b in batches[name]) / len(batches[name])
        out[name] = {
            "sec": statistics.median(times[name]) / n,
            "ids_per_step": ids_per_step,
            "bytes": nbytes,
            "live_rows": live,
            "slots": slots,
            "note": built[name].note,
        }
    return out


def gather(obj) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def run(cfg: Config) -> tuple[dict[str, dict[str, object]], dict[str, object]]:
    from torchrec_ext.data import dlrm_small_batch

    world, rank = dist.get_world_size(), dist.get_rank()
    steps = (cfg.warmup + cfg.repeats) * cfg.steps_per_repeat
    make = lambda i: dlrm_small_batch(
        i * world + rank, cfg.num_tables, cfg.batch_size, cfg.max_bag, cfg.seed, alpha=cfg.alpha, id_bits=cfg.id_bits
    )
    raw, gen_ms, unique = built_batches(make, steps)
    first = raw[0]
    data = {
        "ids_per_step_per_rank": int(first.values().numel()),
        "unique_fraction_per_table": unique,
        "batch_build_ms": gen_ms,
        "batches_per_rank": steps,
    }
    if rank == 0:
        print(
            f"{steps} batches per rank of {data['ids_per_step_per_rank']:,} ids ({unique:.0%} distinct per table), "
            f"built in {gen_ms:.1f} ms each",
            flush=True,
        )
    built: dict[str, Built] = {}
    build_s: dict[str, float] = {}
    for name in cfg.systems:  # all held at once (~2 GiB per system per rank at the defaults)
        start = time.perf_counter()
        built[name] = BUILDERS[name](cfg)
        build_s[name] = time.perf_counter() - start
    mine = time_systems(built, cfg, raw)
    del built
    gc.collect()
    per_rank = gather(mine)
    results: dict[str, dict[str, object]] = {}
    for name in cfg.systems:
        ranks = [p[name] for p in per_rank]
        sec = max(r["sec"] for r in ranks)  # the ranks wait on each other: the slower one is the step
        ids = sum(r["ids_per_step"] for r in ranks)
        results[name] = {
            "ms_per_step": sec * 1e3,
            "ms_per_step_per_rank": [r["sec"] * 1e3 for r in ranks],
            "ids_per_s": ids / sec,
            "bytes_per_rank": [r["bytes"] for r in ranks],
            "live_rows": sum(r["live_rows"] for r in ranks),
            "slots": sum(r["slots"] for r in ranks),
            "build_s": build_s[name],
            "note": "; ".join(dict.fromkeys(r["note"] for r in ranks)),
        }
        if rank == 0:
            r = results[name]
            print(
                f"{name}: {r['ms_per_step']:.1f} ms/step (ranks: "
                + ", ".join(f"{ms:.1f}" for ms in r["ms_per_step_per_rank"])
                + f"), built in {r['build_s']:.0f} s, {r['live_rows']:,} / {r['slots']:,} rows live"
                + (f" ({r['note']})" if r["note"] else ""),
                flush=True,
            )
    return results, data


def report(cfg: Config, results: dict[str, dict[str, object]], data: dict[str, object]) -> str:
    world = dist.get_world_size()
    base = results.get("ebc", {}).get("ms_per_step")
    rows = []
    for name, r in results.items():
        ratio = f"{r['ms_per_step'] / base:.2f}" if base else ""
        rows.append(
            [
                name,
                LABELS[name],
                f"{r['ms_per_step']:.1f}",
                ratio,
                f"{r['ids_per_s'] / 1e6:.2f}",
                f"{r['live_rows']:,} / {r['slots']:,}",
                f"{max(r['bytes_per_rank']) / 2**20:,.0f}",
            ]
        )
    title = (
        f"dlrm-small train step, {world} ranks on cpu (torchrun, gloo, {torch.get_num_threads()} thread(s) "
        f"per rank), {'row_wise (ours-cw: column_wise)' if 'ours-cw' in results else 'row_wise'} under "
        f"DistributedModelParallel: {cfg.num_tables} tables x dim {cfg.dim}, "
        f"batch {cfg.batch_size} per table per rank, bags 1..{cfg.max_bag}, "
        f"ids Zipf({cfg.alpha}) over 2^{cfg.id_bits} "
        f"({data['ids_per_step_per_rank']:,} ids/step per rank, {data['unique_fraction_per_table']:.0%} distinct "
        f"per table); median of {cfg.repeats} rounds x {cfg.steps_per_repeat} steps after {cfg.warmup} warm-up "
        f"rounds, the systems interleaved within each round, slower rank; a fresh batch every step"
    )
    header = [
        "system",
        "what",
        "ms / step",
        "× row-wise EBC",
        "M ids/s (all ranks)",
        "live rows / capacity (all ranks)",
        "MiB per rank",
    ]
    notes = [f"- {name}: {r['note']}" for name, r in results.items() if r.get("note")]
    return "\n".join([title, "", markdown_table(header, rows), ""] + notes)


def worker(cfg: Config, save_results: bool) -> None:
    dist.init_process_group("gloo")
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch's deprecation notes on gloo collectives
    torch.set_num_threads(1)  # 2 ranks on 2 cores
    results, data = run(cfg)
    if dist.get_rank() == 0:
        text = report(cfg, results, data)
        print(text)
        if save_results:
            save(
                "sharded_cpu",
                {
                    "config": dataclasses.asdict(cfg),
                    "world_size": dist.get_world_size(),
                    "threads_per_rank": torch.get_num_threads(),
                    "data": data,
                    "results": results,
                },
                text,
            )
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    cfg, save_results = parse_config(Config, __doc__, systems=tuple(BUILDERS), ranks=True)
    worker(cfg, save_results)


if __name__ == "__main__":
    main()
