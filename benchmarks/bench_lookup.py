"""Train-step time of one embedding layer on the "dlrm-small" workload of ANCHORS.md, in one
process: torchrec_ext's DynamicEmbeddingBagCollection against TorchRec's fused EBC and TorchRec's
managed-collision EBC, with the memory each keeps per live row.

Workload: 8 tables, dim 64, 4096 bags per table, bag lengths uniform in 1..7 (~131k ids per step),
raw ids Zipf(1.05) over 2^40 (`torchrec_ext.data.dlrm_small_batch`, each table its own hot ids);
one step = forward + backward of sum(output) + the fused optimizer update. Every step gets a fresh
batch, built before timing. Systems:

- ebc:  TorchRec EmbeddingBagCollection, 1M rows per table, ids mod 1M, under
        DistributedModelParallel with world size 1 (gloo, in-process), fused Adagrad given by
        apply_optimizer_in_backward; the planner's pick is checked to be fbgemm's CPU TBE
        (table_wise / fused, EXACT_ADAGRAD).
- mch:  TorchRec ManagedCollisionEmbeddingBagCollection: MCHManagedCollisionModule (LFU,
        1M slots per table, eviction every step) over an unsharded EBC, SGD applied in backward
        (the MC sharder is row-wise only, which TorchRec's EBC sharder does not offer on CPU).
- ours: torchrec_ext.DynamicEmbeddingBagCollection, capacity 2^20 per table, fused Adagrad.
- ours-sgd: the same with fused SGD.
- ours-fp16 / ours-bf16: `ours` with FP16 / BF16 rows (``data_type``; stochastic rounding).
- dense: one torch.nn.EmbeddingBag(rows, dim, mode="sum", sparse=True) per table, ids mod rows,
         torch.optim.SGD over its sparse gradients (the plain-PyTorch way; the GPU baseline when
         fbgemm's CUDA kernels, hence TorchRec's EBC, are absent).

--device cuda runs every system on the GPU (ebc then needs fbgemm's CUDA build and NCCL; mch is
CPU-only here). On the GPU: --systems ours,ours-sgd,dense[,ebc].

Memory per live row: bytes of vectors + optimizer state + index metadata over the rows that hold
an id (a fixed table's rows all count as live).

    python benchmarks/bench_lookup.py                                 # all systems, saves results/lookup_cpu.*
    python benchmarks/bench_lookup.py --systems ebc,ours --repeats 5 --no-save
    python benchmarks/bench_lookup.py --systems ours,ours-fp16,ours-bf16 --results-name lookup_dtypes_cpu \
        --clock cpu --interleave True --capacity 524288          # FP16 / BF16 rows vs FP32, on a loaded machine
    python benchmarks/bench_lookup.py --batch-size 256 --rows 10000 --capacity 16384 \
        --repeats 2 --warmup 1 --no-save                              # smoke
"""

from __future__ import annotations

import dataclasses
import gc
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (
    Built,
    DlrmSmall,
    built_batches,
    markdown_table,
    median_seconds,
    parse_config,
    save,
    small_tables,
    tensor_bytes,
)

from torchrec_ext.data import dlrm_small_batch

SYSTEMS = (
    "ebc",
    "mch",
    "ours",
    "ours-full",
    "ours-sgd",
    "ours-adam",
    "ours-adamw",
    "ours-ftrl",
    "ours-fp16",
    "ours-bf16",
    "dense",
)
LABELS = {
    "ebc": "TorchRec EBC, DMP world 1, fused Adagrad (fbgemm CPU TBE), ids mod rows",
    "mch": "TorchRec ManagedCollision EBC (MCH, LFU), SGD in backward",
    "ours": "torchrec_ext DynamicEmbeddingBagCollection, fused Adagrad",
    "ours-full": "the same, tables filled to capacity first (every new id evicts)",
    "ours-sgd": "torchrec_ext DynamicEmbeddingBagCollection, fused SGD",
    "ours-adam": "torchrec_ext DynamicEmbeddingBagCollection, fused Adam",
    "ours-adamw": "torchrec_ext DynamicEmbeddingBagCollection, fused AdamW",
    "ours-ftrl": "torchrec_ext DynamicEmbeddingBagCollection, fused FTRL-Proximal",
    "ours-fp16": "torchrec_ext DynamicEmbeddingBagCollection, fused Adagrad, FP16 rows (stochastic rounding)",
    "ours-bf16": "torchrec_ext DynamicEmbeddingBagCollection, fused Adagrad, BF16 rows (stochastic rounding)",
    "dense": "torch.nn.EmbeddingBag(sparse=True) per table + torch.optim.SGD, ids mod rows",
}


@dataclasses.dataclass
class Config(DlrmSmall):
    rows: int = 1_000_000  # EBC rows and MCH slots per table
    capacity: int = 1 << 20  # our rows per table
    lr: float = 0.01
    repeats: int = 10
    warmup: int = 3
    steps_per_repeat: int = 5
    mch_repeats: int = 3  # MCH takes ~0.6 s a step
    mch_warmup: int = 1
    mch_eviction_interval: int = 1
    systems: tuple[str, ...] = ("ebc", "mch", "ours", "ours-full")
    seed: int = 0
    device: str = "cpu"
    results_name: str = ""  # results/<name>.{md,jsonl}; default lookup_<device>
    clock: str = "wall"  # or "cpu": the process's CPU seconds per step (all threads), steadier on a loaded machine
    interleave: bool = False  # build every system first, then time them in turn, chunk by chunk (load drift cancels)


def build_ebc(cfg: Config) -> Built:
    import torch.distributed as dist
    from torchrec import EmbeddingBagCollection
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    device = torch.device(cfg.device)
    if not dist.is_initialized():
        store = dist.FileStore(os.path.join(tempfile.mkdtemp(prefix="bench_lookup_"), "store"), 1)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=0, world_size=1)
    configs = small_tables(cfg)
    ebc = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
    apply_optimizer_in_backward(torch.optim.Adagrad, ebc.parameters(), {"lr": cfg.lr})
    sharder = EmbeddingBagCollectionSharder()
    topology = Topology(world_size=1, local_world_size=1, compute_device=device.type)

    def plan_with(constraints):
        planner = EmbeddingShardingPlanner(topology=topology, batch_size=cfg.batch_size, constraints=constraints)
        plan = planner.collective_plan(ebc, [sharder], dist.GroupMember.WORLD)
        return plan, {(p.sharding_type, p.compute_kernel) for p in plan.plan[""].values()}

    plan, picked = plan_with(None)
    note = f"planner picked {sorted(picked)}"
    if picked != {("table_wise", "fused")}:
        plan, picked = plan_with(
            {c.name: ParameterConstraints(sharding_types=["table_wise"], compute_kernels=["fused"]) for c in configs}
        )
        note += f"; constrained to {sorted(picked)}"
    dmp = DistributedModelParallel(ebc, device=device, plan=plan, sharders=[sharder])
    # The sharded EBC keeps its lookups in a plain list (not submodules): walk them for the TBEs.
    kernels = [
        (type(m).__name__, getattr(m, "optimizer", None))
        for lookup in getattr(dmp.module, "_lookups", [])
        for m in lookup.modules()
        if type(m).__name__ == "SplitTableBatchedEmbeddingBagsCodegen"
    ]
    if not kernels or any(getattr(opt, "name", None) != "EXACT_ADAGRAD" for _, opt in kernels):
        raise RuntimeError(f"ebc: expected fbgemm TBEs with EXACT_ADAGRAD, got {kernels} ({note})")
    note += f"; {len(kernels)} SplitTableBatchedEmbeddingBagsCodegen, {kernels[0][1].name}"

    def step(kjt) -> None:
        dmp(kjt).values().sum().backward()

    def memory() -> tuple[int, int, int]:
        rows = cfg.rows * cfg.num_tables
        return tensor_bytes(dmp.state_dict(), dmp.fused_optimizer.state_dict()["state"]), rows, rows

    def batch_of(kjt):
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        return KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values().remainder(cfg.rows), lengths=kjt.lengths()).to(
            device
        )

    return Built(step, memory, batch_of, note)


def build_mch(cfg: Config) -> Built:
    from torchrec import EmbeddingBagCollection
    from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
    from torchrec.modules.mc_modules import LFU_EvictionPolicy, ManagedCollisionCollection, MCHManagedCollisionModule
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    configs = small_tables(cfg)
    mchs = {
        c.name: MCHManagedCollisionModule(
            zch_size=cfg.rows,
            device=torch.device("cpu"),
            eviction_policy=LFU_EvictionPolicy(),
            eviction_interval=cfg.mch_eviction_interval,
        )
        for c in configs
    }
    module = ManagedCollisionEmbeddingBagCollection(
        EmbeddingBagCollection(tables=configs, device=torch.device("cpu")), ManagedCollisionCollection(mchs, configs)
    )
    apply_optimizer_in_backward(torch.optim.SGD, module._embedding_module.parameters(), {"lr": cfg.lr})
    empty = torch.iinfo(torch.int64).max

    def step(kjt) -> None:
        out, _ = module(kjt)
        out.values().sum().backward()

    def memory() -> tuple[int, int, int]:
        history = [m._history_accumulator for m in mchs.values() if hasattr(m, "_history_accumulator")]
        live = sum(int((m._mch_sorted_raw_ids != empty).sum()) for m in mchs.values())
        return tensor_bytes(list(module.parameters()), list(module.buffers()), history), live, cfg.rows * cfg.num_tables

    return Built(step, memory, note=f"eviction every {cfg.mch_eviction_interval} step(s)")


def build_ours(cfg: Config, prefill: bool = False, optimizer=torch.optim.Adagrad, data_type: str = "FP32") -> Built:
    from torchrec import DataType, KeyedJaggedTensor

    from torchrec_ext import DynamicEmbeddingBagCollection, DynamicEmbeddingBagConfig

    device = torch.device(cfg.device)
    tables = small_tables(cfg, DynamicEmbeddingBagConfig, cfg.capacity)
    for table in tables:
        table.data_type = DataType[data_type]
    module = DynamicEmbeddingBagCollection(tables, device=device, optimizer=optimizer, optimizer_kwargs={"lr": cfg.lr})
    module.train()
    note = ""
    if prefill:
        # Negative ids never come from the generator ([0, 2^40)): the workload's ids then all
        # arrive at full tables and evict these (least recently used) ones.
        ids = -1 - torch.arange(cfg.capacity, dtype=torch.int64)
        with torch.no_grad():
            for t in range(cfg.num_tables):
                lengths = torch.zeros(cfg.num_tables, dtype=torch.int64)
                lengths[t] = cfg.capacity
                module(
                    KeyedJaggedTensor(keys=[f"f{i}" for i in range(cfg.num_tables)], values=ids, lengths=lengths).to(
                        device
                    )
                )
        note = f"load factor {module.num_live_rows() / (cfg.capacity * cfg.num_tables):.3f} before timing"

    def step(kjt) -> None:
        module(kjt).values().sum().backward()

    def memory() -> tuple[int, int, int]:
        return module.storage_bytes(), module.num_live_rows(), cfg.capacity * cfg.num_tables

    return Built(step, memory, lambda kjt: kjt.to(device), note=note)


def build_dense(cfg: Config) -> Built:
    """nn.EmbeddingBag(sparse=True) per table + SGD: each step's gradient is a sparse tensor of the
    ids' rows, which SGD applies to those rows only."""
    device = torch.device(cfg.device)
    torch.manual_seed(cfg.seed)
    bags = torch.nn.ModuleList(
        torch.nn.EmbeddingBag(cfg.rows, cfg.dim, mode="sum", sparse=True, device=device) for _ in range(cfg.num_tables)
    )
    optimizer = torch.optim.SGD(bags.parameters(), lr=cfg.lr)

    def batch_of(kjt):  # (ids mod rows, offsets) per table, on the device
        return [
            (jt.values().remainder(cfg.rows).to(device), jt.offsets()[:-1].to(device)) for jt in kjt.to_dict().values()
        ]

    def step(per_table) -> None:
        out = torch.cat([bag(ids, offsets) for bag, (ids, offsets) in zip(bags, per_table)], dim=1)
        out.sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def memory() -> tuple[int, int, int]:
        rows = cfg.rows * cfg.num_tables
        return tensor_bytes(list(bags.parameters())), rows, rows

    return Built(step, memory, batch_of, "no optimizer state (SGD)")


BUILDERS = {
    "ebc": build_ebc,
    "mch": build_mch,
    "ours": build_ours,
    "ours-full": lambda cfg: build_ours(cfg, prefill=True),
    "ours-sgd": lambda cfg: build_ours(cfg, optimizer=torch.optim.SGD),
    "ours-adam": lambda cfg: build_ours(cfg, optimizer=torch.optim.Adam),
    "ours-adamw": lambda cfg: build_ours(cfg, optimizer=torch.optim.AdamW),
    "ours-ftrl": lambda cfg: build_ours(cfg, optimizer="ftrl"),
    "ours-fp16": lambda cfg: build_ours(cfg, data_type="FP16"),
    "ours-bf16": lambda cfg: build_ours(cfg, data_type="BF16"),
    "dense": build_dense,
}


def time_system(name: str, built: Built, cfg: Config, raw: list) -> dict[str, object]:
    repeats, warmup = (cfg.mch_repeats, cfg.mch_warmup) if name == "mch" else (cfg.repeats, cfg.warmup)
    batches = [built.batch_of(kjt) for kjt in raw[: (warmup + repeats) * cfg.steps_per_repeat]]
    n = cfg.steps_per_repeat
    chunks: Iterator[list] = (batches[i : i + n] for i in range(0, len(batches), n))

    def run(chunk: list) -> None:
        for kjt in chunk:
            built.step(kjt)

    clock = time.process_time if cfg.clock == "cpu" else time.perf_counter
    sec = median_seconds(run, repeats, warmup=warmup, setup=lambda: next(chunks), clock=clock) / cfg.steps_per_repeat
    ids_per_step = sum(int(kjt.values().numel()) for kjt in raw[: len(batches)]) / len(batches)
    return _result(built, sec, ids_per_step, repeats, warmup)


def _result(built: Built, sec: float, ids_per_step: float, repeats: int, warmup: int) -> dict[str, object]:
    """A system's results: ``sec`` per step (the median), its throughput and its memory after."""
    nbytes, live, slots = built.memory()
    return {
        "ms_per_step": sec * 1e3,
        "ids_per_s": ids_per_step / sec,
        "bytes": nbytes,
        "live_rows": live,
        "slots": slots,
        "bytes_per_live_row": nbytes / live if live else None,
        "repeats": repeats,
        "warmup": warmup,
        "note": built.note,
    }


def time_interleaved(builts: dict[str, Built], cfg: Config, raw: list) -> dict[str, dict[str, object]]:
    """Every system's steps timed in turn, chunk by chunk (the order rotating), each on the same
    batches: on a machine whose load drifts, each system sees the same load."""
    clock = time.process_time if cfg.clock == "cpu" else time.perf_counter
    n, names = cfg.steps_per_repeat, list(builts)
    batches = {name: [b.batch_of(kjt) for kjt in raw[: (cfg.warmup + cfg.repeats) * n]] for name, b in builts.items()}
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(cfg.warmup + cfg.repeats):
        for k in range(len(names)):
            name = names[(i + k) % len(names)]
            start = clock()
            for batch in batches[name][i * n : (i + 1) * n]:
                builts[name].step(batch)
            if i >= cfg.warmup:
                times[name].append((clock() - start) / n)
    ids_per_step = sum(int(kjt.values().numel()) for kjt in raw[: (cfg.warmup + cfg.repeats) * n]) / (
        (cfg.warmup + cfg.repeats) * n
    )
    results = {}
    for name, built in builts.items():
        sec = statistics.median(times[name])
        results[name] = {
            **_result(built, sec, ids_per_step, cfg.repeats, cfg.warmup),
            "interleaved": True,
            "ms_per_step_each_repeat": [t * 1e3 for t in times[name]],
        }
    return results


def run(cfg: Config) -> tuple[dict[str, dict[str, object]], dict[str, object]]:
    steps = (max(cfg.warmup + cfg.repeats, cfg.mch_warmup + cfg.mch_repeats)) * cfg.steps_per_repeat
    make = lambda i: dlrm_small_batch(
        i, cfg.num_tables, cfg.batch_size, cfg.max_bag, cfg.seed, alpha=cfg.alpha, id_bits=cfg.id_bits
    )
    raw, gen_ms, unique = built_batches(make, steps)
    first = raw[0]
    data = {
        "ids_per_step": int(first.values().numel()),
        "unique_fraction_per_table": unique,
        "batch_build_ms": gen_ms,
        "batches": steps,
    }
    print(
        f"{steps} batches of {data['ids_per_step']:,} ids ({unique:.0%} distinct per table), "
        f"built in {gen_ms:.1f} ms each",
        flush=True,
    )
    results: dict[str, dict[str, object]] = {}
    if cfg.interleave:
        results = time_interleaved({name: BUILDERS[name](cfg) for name in cfg.systems}, cfg, raw)
        for name, r in results.items():
            print(f"{name}: {r['ms_per_step']:.1f} ms/step (interleaved)", flush=True)
        return results, data
    for name in cfg.systems:
        built = BUILDERS[name](cfg)
        results[name] = time_system(name, built, cfg, raw)
        del built
        gc.collect()  # free one system's tables before building the next
        r = results[name]
        print(
            f"{name}: {r['ms_per_step']:.1f} ms/step, {r['bytes'] / 2**20:,.0f} MiB over {r['live_rows']:,} live rows"
            + (f" ({r['note']})" if r["note"] else ""),
            flush=True,
        )
    return results, data


def report(cfg: Config, results: dict[str, dict[str, object]], data: dict[str, object]) -> str:
    base = results.get("ebc", {}).get("ms_per_step")
    dense = results.get("dense", {}).get("ms_per_step")
    rows = []
    for name, r in results.items():
        ratio = f"{r['ms_per_step'] / base:.2f}" if base else ""
        per_row = f"{r['bytes_per_live_row']:.0f}" if r["bytes_per_live_row"] else ""
        rows.append(
            [
                name,
                LABELS[name],
                f"{r['ms_per_step']:.1f}",
                ratio,
                f"{r['ids_per_s'] / 1e6:.2f}",
                per_row,
                f"{r['bytes'] / r['slots']:.0f}",
                f"{r['live_rows']:,} / {r['slots']:,}",
                f"{r['bytes'] / 2**20:,.0f}",
            ]
            + ([f"{r['ms_per_step'] / dense:.2f}"] if dense else [])
        )
    where = (
        f"cuda ({torch.cuda.get_device_name(torch.device(cfg.device))})"
        if cfg.device.startswith("cuda")
        else f"cpu ({torch.get_num_threads()} threads)"
    )
    title = (
        f"dlrm-small train step on {where}{', CPU seconds of the process' if cfg.clock == 'cpu' else ''}: "
        f"{cfg.num_tables} tables x dim {cfg.dim}, "
        f"batch {cfg.batch_size} per table, bags 1..{cfg.max_bag}, ids Zipf({cfg.alpha}) over 2^{cfg.id_bits} "
        f"({data['ids_per_step']:,} ids/step, {data['unique_fraction_per_table']:.0%} distinct per table); "
        f"median of {cfg.repeats} repeats x {cfg.steps_per_repeat} steps after {cfg.warmup} warm-up repeats "
        f"(mch: {cfg.mch_repeats} after {cfg.mch_warmup}); a fresh batch every step"
        + (
            "; systems built first, then timed in turn chunk by chunk (rotating order), on the same batches"
            if cfg.interleave
            else ""
        )
    )
    header = [
        "system",
        "what",
        "ms / step",
        "× fused EBC",
        "M ids/s",
        "bytes / live row",
        "bytes / row of capacity",
        "live rows / capacity",
        "MiB",
    ] + (["× dense EmbeddingBag + SGD"] if dense else [])
    notes = [f"- {name}: {r['note']}" for name, r in results.items() if r.get("note")]
    return "\n".join([title, "", markdown_table(header, rows), ""] + notes)


def main() -> None:
    cfg, save_results = parse_config(Config, __doc__, systems=SYSTEMS)
    results, data = run(cfg)
    text = report(cfg, results, data)
    print(text)
    if save_results:
        save(
            cfg.results_name or f"lookup_{cfg.device.split(':')[0]}",
            {"config": dataclasses.asdict(cfg), "data": data, "results": results},
            text,
        )
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
