"""Shared benchmark plumbing: median-of-repeats timing, results files, machine description, the
dlrm-small tables, and the command line (one flag per Config field, optional torchrun relaunch)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

import torch

# BENCH_RESULTS_DIR redirects every benchmark's results (scripts/gpu_check.sh points it at its OUT_DIR).
RESULTS_DIR = os.environ.get("BENCH_RESULTS_DIR") or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def median_seconds(
    fn: Callable[[], object],
    repeats: int,
    warmup: int = 1,
    setup: Callable[[], object] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Median wall time of fn() over `repeats` runs after `warmup` runs; `setup` runs untimed
    before each call (and its result is passed to fn when fn takes one argument). ``clock``
    time.process_time gives the process's CPU seconds instead (all its threads): steadier than
    wall time on a machine other processes load."""
    times = []
    for i in range(warmup + repeats):
        arg = setup() if setup is not None else None
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = clock()
        fn(arg) if setup is not None else fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(clock() - start)
    return statistics.median(times)


def built_batches(make: Callable[[int], object], steps: int) -> tuple[list, float, float]:
    """The KJTs make(0), ..., make(steps - 1); the milliseconds each took to build (the first, which
    also imports TorchRec's KJT, not timed); and the first one's distinct ids per table over its ids."""
    raw = [make(0)]
    start = time.perf_counter()
    raw += [make(i) for i in range(1, steps)]
    build_ms = (time.perf_counter() - start) / max(steps - 1, 1) * 1e3
    first = raw[0]
    unique = sum(int(torch.unique(jt.values()).numel()) for jt in first.to_dict().values()) / first.values().numel()
    return raw, build_ms, unique


def machine() -> dict[str, object]:
    info = {
        "host_cpu": platform.processor() or platform.machine(),
        "cpu_threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name()
    return info


def fbgemm_cuda_reason() -> str | None:
    """None when fbgemm's CUDA kernels run here (so stock TorchRec tables can run on the GPU), else why
    not: fbgemm-gpu-cpu registers its ops for CPU only, and a CUDA call then raises."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)

        torch.ops.fbgemm.asynchronous_complete_cumsum(torch.ones(2, dtype=torch.int64, device="cuda"))
    except Exception as e:  # noqa: BLE001 - ImportError, NotImplementedError, RuntimeError: all mean "not here"
        return f"fbgemm CUDA ops unavailable ({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''})"
    return None


def triton_device(script: str) -> torch.device:
    """Where a Triton kernel benchmark runs: the GPU, or the CPU under TRITON_INTERPRET=1 (a check
    of the script with --smoke 1, nothing timed that means anything); else exits naming why."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    if os.environ.get("TRITON_INTERPRET") == "1":
        return torch.device("cpu")
    sys.exit(f"{script}: needs a CUDA GPU (or TRITON_INTERPRET=1 with --smoke 1 on CPU)")


def markdown_table(header: list[str], rows: list[list[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def save(name: str, record: dict[str, object], markdown: str) -> None:
    """Appends `record` as a JSON line to results/<name>.jsonl and writes results/<name>.md."""
    os.makedirs(RESULTS_DIR, exist_ok=True)
    record = dict(record, time=time.strftime("%Y-%m-%dT%H:%M:%S"), machine=machine())
    with open(os.path.join(RESULTS_DIR, f"{name}.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\n")
    with open(os.path.join(RESULTS_DIR, f"{name}.md"), "w") as f:
        f.write(markdown + "\n")


def print_and_save(name: str, cfg: object, results: object, text: str, save_results: bool) -> None:
    """Prints the report ``text``; with ``save_results``, saves it (``save``) with the config
    dataclass ``cfg`` and ``results`` as the record."""
    print(text)
    if save_results:
        save(name, {"config": dataclasses.asdict(cfg), "results": results}, text)


def process_memory() -> dict[str, int]:
    """VmRSS / VmHWM (its peak) / RssAnon / RssFile of this process, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) * 1024
    return out


def tensor_bytes(*objs) -> int:
    """Bytes of the distinct storages under tensors, ShardedTensors (local shards), dicts, lists."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    seen: dict[int, int] = {}

    def visit(o) -> None:
        if isinstance(o, ShardedTensor):
            for shard in o.local_shards():
                visit(shard.tensor)
        elif isinstance(o, torch.Tensor):
            if o.device.type != "meta":
                storage = o.untyped_storage()
                seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
        elif isinstance(o, dict):
            for v in o.values():
                visit(v)
        elif isinstance(o, (list, tuple)):
            for v in o:
                visit(v)

    for o in objs:
        visit(o)
    return sum(seen.values())


@dataclasses.dataclass
class Built:
    """A system ready to time: `step(batch)` runs one train step; `memory()` gives (bytes of
    vectors + optimizer state [+ index metadata], live rows, rows it can hold), per rank when sharded."""

    step: Callable[[object], None]
    memory: Callable[[], tuple[int, int, int]]
    batch_of: Callable[[object], object] = lambda kjt: kjt  # input transform, applied before timing
    note: str = ""


@dataclasses.dataclass
class DlrmSmall:
    """The dlrm-small workload (``torchrec_ext.data.dlrm_small_batch``): tables, their dim, bags
    per table per step, ids per bag, the ids' Zipf exponent and bits; benchmarks extend it."""

    num_tables: int = 8
    dim: int = 64
    batch_size: int = 4096
    max_bag: int = 7
    alpha: float = 1.05
    id_bits: int = 40


def small_tables(cfg, config_cls=None, num_embeddings: int | None = None) -> list:
    """cfg.num_tables tables t<i> of cfg.dim, each read by one feature f<i>; cfg.rows rows unless given."""
    from torchrec import EmbeddingBagConfig

    config_cls = config_cls or EmbeddingBagConfig
    return [
        config_cls(
            name=f"t{t}", embedding_dim=cfg.dim, num_embeddings=num_embeddings or cfg.rows, feature_names=[f"f{t}"]
        )
        for t in range(cfg.num_tables)
    ]


def every_row_batches(num_tables: int, rows: int, batch_size: int) -> list:
    """Batches giving each table t<i> (feature f<i>) ids 0..rows-1 once, one id a bag: a pass
    that makes every row of tables of ``rows`` rows live (so a cache of a fraction of them evicts)."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    out = []
    for start in range(0, rows, batch_size):
        ids = torch.arange(start, min(start + batch_size, rows), dtype=torch.int64)
        out.append(
            KeyedJaggedTensor(
                keys=[f"f{t}" for t in range(num_tables)],
                values=ids.repeat(num_tables),
                lengths=torch.ones(num_tables * ids.numel(), dtype=torch.int64),
            )
        )
    return out


def parse_config(config_cls, description: str, systems: Sequence[str] = (), ranks: bool = False):
    """(config, save_results) from the command line: one --flag per field of the `config_cls`
    dataclass (its type and default) and --no-save; with `systems`, --systems picks a comma-separated
    subset of them (the `systems` field); with `ranks`, --nproc, and a script not yet running as a
    rank re-launches itself under torchrun with that many ranks (one thread each)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    fields = [f for f in dataclasses.fields(config_cls) if f.name != "systems"]
    for f in fields:
        parser.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default)
    if systems:
        default = getattr(config_cls, "systems", None) or systems  # the config's default subset, if it has one
        parser.add_argument(
            "--systems", default=",".join(default), help=f"comma-separated subset of {','.join(systems)}"
        )
    if ranks:
        parser.add_argument("--nproc", type=int, default=2, help="ranks (torchrun --nproc_per_node)")
    parser.add_argument("--no-save", action="store_true", help="print only; write nothing under results/")
    args = parser.parse_args()
    chosen = {}
    if systems:
        picked = tuple(s for s in args.systems.split(",") if s)
        unknown = [s for s in picked if s not in systems]
        if unknown or not picked:
            parser.error(f"--systems: unknown {unknown}, choose from {','.join(systems)}")
        chosen["systems"] = picked
    if ranks and "RANK" not in os.environ:  # re-launch under torchrun
        # The ranks do not need --nproc, and torchrun's parser would reject it even after the script
        # ("ambiguous option: --nproc could match --nproc-per-node, --nproc_per_node").
        argv = sys.argv[1:]
        rest = [
            a
            for i, a in enumerate(argv)
            if not (a == "--nproc" or a.startswith("--nproc=") or (i > 0 and argv[i - 1] == "--nproc"))
        ]
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={args.nproc}",
            os.path.abspath(sys.argv[0]),
        ] + rest
        sys.exit(subprocess.call(cmd, env=dict(os.environ, OMP_NUM_THREADS="1")))
    return config_cls(**{f.name: getattr(args, f.name) for f in fields}, **chosen), not args.no_save
