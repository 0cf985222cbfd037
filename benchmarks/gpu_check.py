"""The GPU check's measurements (run by scripts/gpu_check.sh after the build and the test suite):
host syncs of one training step, a profile of one step, pooled-lookup bandwidth against the
device's copy bandwidth, and the GPU benchmarks. Writes OUT_DIR/gpu_check.md and appends one JSON
row per step to OUT_DIR/gpu_check.jsonl (each with the device name and torch / triton / torchrec
versions). A step that fails is reported and the others still run; the exit status is 1 when any
step failed, 0 otherwise ("not runnable", e.g. TorchRec's CUDA pipeline without fbgemm's CUDA
build, is not a failure).

Steps:
- env:       versions, device, whether the CUDA kernels were built, whether fbgemm's CUDA ops exist.
- syncs:     torch.cuda.set_sync_debug_mode("warn") over one training step (forward + backward with
             the fused optimizer) of a DynamicEmbeddingBagCollection on the dlrm-small tables;
             every synchronizing call is counted, grouped by the innermost torchrec_ext frame.
- profile:   torch.profiler over `profile_steps` steps: kernels per step, GPU busy fraction
             (sum of kernel durations per step / step wall time measured without the profiler;
             the union of kernel intervals too, which discounts overlap); the host side of a
             step: host µs to issue it (its own host syncs included) and the aten ops it
             dispatches and Python calls it makes (bench_step_host.count_step).
- step_host: benchmarks/bench_step_host.py: host µs, ops and Python calls per step at a tiny batch
             (where the host side dominates), by phase, for 8 and 26 tables, our EBC / EC against
             nn.EmbeddingBag + SGD, kernels per step on CUDA.
- bandwidth: device copy bandwidth (a large tensor copy: bytes read + written / time) and the
             pooled lookup's achieved GB/s, counting (unique rows x dim x 4 B) + output bytes,
             for the pooled-lookup kernel alone (profiler, median of 5 launches; also against a
             copy of the same bytes) and for a whole eval forward.
- pooled_lookup: benchmarks/bench_pooled_lookup.py on the same shape: the Triton kernel alone
             (CUDA events and profiler) against a 1 GiB copy, a same-size copy and torch's
             embedding_bag, with a sweep of its tile sizes; on CPU a smoke run under
             TRITON_INTERPRET=1 that checks it against the reference.
- hash_table, lookup, pipeline: benchmarks/bench_hash_table.py --hkv, bench_lookup.py
             (ours / ours-sgd / ours-fp16 / ours-bf16 / dense EmbeddingBag + SGD, + TorchRec's EBC when fbgemm's CUDA
             ops exist), bench_pipeline.py --nproc 1 (when TorchRec's pipeline runs here), each
             in its own process, its results written to OUT_DIR.
- upsert_tables: benchmarks/bench_upsert_tables.py: the upsert of 26 tables table by table vs one
             hash_upsert_tables call, and a module's training step either way.
- tiers:     benchmarks/bench_tiers_gpu.py: tiered tables (cache in HBM over host memory, with
             prefetch) vs TorchRec's FUSED_UVM_CACHING EBC at cache ratios 1.0 and 0.8 (TorchRec's
             when fbgemm's CUDA ops exist); results OUT_DIR/tiers_gpu.{md,jsonl}. CUDA only.

    python benchmarks/gpu_check.py --out-dir benchmarks/results/gpu             # on a GPU
    python benchmarks/gpu_check.py --out-dir /tmp/gc --device cpu --smoke      # the code paths on CPU, tiny sizes
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_step_host import count_step  # noqa: E402
from common import fbgemm_cuda_reason, markdown_table, median_seconds, small_tables  # noqa: E402

STEPS = (
    "env",
    "syncs",
    "profile",
    "step_host",
    "bandwidth",
    "pooled_lookup",
    "hash_table",
    "upsert_tables",
    "lookup",
    "pipeline",
    "tiers",
)


class NotRunnable(Exception):
    """The step cannot run on this machine (reported, not a failure)."""


@dataclasses.dataclass
class Sizes:
    """dlrm-small (ANCHORS.md) on a GPU; --smoke shrinks everything so CPU runs take seconds."""

    num_tables: int = 8
    dim: int = 64
    batch_size: int = 4096
    max_bag: int = 7
    capacity: int = 1 << 20
    profile_steps: int = 5
    copy_bytes: int = 1 << 30
    bench_timeout_s: int = 420
    hash_args: tuple[str, ...] = ("--hkv",)
    lookup_args: tuple[str, ...] = ()
    pipeline_args: tuple[str, ...] = ("--nproc", "1", "--rounds", "3", "--steps", "20")
    upsert_args: tuple[str, ...] = ("--tables", "26", "--capacity", "100000", "--keys", "4096", "--batch", "2048")
    tiers_args: tuple[str, ...] = ()
    step_host_args: tuple[str, ...] = ("--tables", "8,26", "--batch", "32")

    @classmethod
    def smoke(cls) -> Sizes:
        return cls(
            num_tables=2,
            dim=8,
            batch_size=64,
            max_bag=3,
            capacity=4096,
            profile_steps=2,
            copy_bytes=1 << 22,
            bench_timeout_s=300,
            hash_args=("--hkv", "--capacity", "65536", "--batch", "4096", "--repeats", "2", "--dims", "8"),
            lookup_args=(
                "--num-tables",
                "2",
                "--dim",
                "8",
                "--batch-size",
                "64",
                "--rows",
                "4096",
                "--capacity",
                "4096",
                "--repeats",
                "2",
                "--warmup",
                "1",
                "--steps-per-repeat",
                "2",
            ),
            pipeline_args=(
                "--nproc",
                "1",
                "--rows",
                "1000",
                "--batch",
                "64",
                "--steps",
                "3",
                "--warmup",
                "1",
                "--rounds",
                "1",
            ),
            upsert_args=("--tables", "2", "--capacity", "4096", "--keys", "256", "--batch", "64", "--repeats", "2"),
            tiers_args=("--rows", "65536", "--batch-size", "1024", "--warmup-steps", "3", "--repeats", "2"),
            step_host_args=("--tables", "2", "--kinds", "ebc", "--warmup", "2", "--repeats", "2", "--steps", "2"),
        )


def versions(device: torch.device) -> dict[str, object]:
    info: dict[str, object] = {  # the device the steps run on (a GPU machine may run them on its CPU)
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
    }
    for name in ("triton", "torchrec", "fbgemm_gpu"):
        try:
            info[name] = __import__(name).__version__
        except Exception as e:  # noqa: BLE001 - not installed, or fails to import: say so in the row
            info[name] = f"not importable ({type(e).__name__})"
    return info


# ---- the module under test -------------------------------------------------------------------


def make_module(sizes: Sizes, device: torch.device):
    from torchrec_ext import DynamicEmbeddingBagCollection, DynamicEmbeddingBagConfig

    module = DynamicEmbeddingBagCollection(
        small_tables(sizes, DynamicEmbeddingBagConfig, sizes.capacity),
        device=device,
        optimizer=torch.optim.Adagrad,
        optimizer_kwargs={"lr": 0.01},
    )
    return module.train()


def batches(sizes: Sizes, device: torch.device, count: int) -> list:
    from torchrec_ext.data import dlrm_small_batch

    return [dlrm_small_batch(i, sizes.num_tables, sizes.batch_size, sizes.max_bag).to(device) for i in range(count)]


def train_step(module, kjt) -> None:
    module(kjt).values().sum().backward()  # the fused optimizer updates the touched rows in backward


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---- steps -------------------------------------------------------------------------------------


def step_env(sizes: Sizes, device: torch.device, out_dir: str) -> tuple[dict, str]:
    from torchrec_ext import ops

    row = dict(versions(device))
    row["cuda_kernels_built"] = bool(torch.cuda.is_available() and ops.has_kernel("hash_find", torch.device("cuda")))
    row["fbgemm_cuda"] = fbgemm_cuda_reason() or "yes"
    if device.type == "cuda" and not row["cuda_kernels_built"]:
        raise RuntimeError(
            "torchrec_ext's CUDA kernels are not built (ops.has_kernel('hash_find', cuda) is False): see the build log"
        )
    text = "\n".join(f"- {k}: {v}" for k, v in row.items())
    return row, text


# What set_sync_debug_mode("warn") says for each synchronizing call. Other warnings are not
# syncs: the first switch to "warn" itself warns that the mode is a prototype (the H100's first
# run counted that notice as a sync of the step).
SYNC_WARNING = "called a synchronizing CUDA operation"


class SyncRecorder:
    """Counts the sync warnings issued while active (set_sync_debug_mode("warn") issues one per
    synchronizing call), each under the innermost torchrec_ext frame of the live stack, else the
    innermost Python frame outside the warnings machinery. Other warnings are kept apart
    (``others``), not counted."""

    def __init__(self) -> None:
        self.sites: collections.Counter = collections.Counter()
        self.messages: collections.Counter = collections.Counter()
        self.others: collections.Counter = collections.Counter()
        self._catch = warnings.catch_warnings()

    def __enter__(self) -> SyncRecorder:
        self._catch.__enter__()
        warnings.simplefilter("always")
        warnings.showwarning = self._record
        return self

    def __exit__(self, *exc) -> None:
        self._catch.__exit__(*exc)

    def _record(self, message, category, filename, lineno, file=None, line=None) -> None:
        if SYNC_WARNING not in str(message):
            self.others[str(message).splitlines()[0][:120]] += 1
            return
        frames = [f for f in traceback.extract_stack()[:-1] if os.path.basename(f.filename) != "warnings.py"]
        # The caller of device_sync (the one door of the step's host reads) names the site.
        ours = [
            f
            for f in frames
            if os.path.join("torchrec_ext", "") in f.filename and os.path.basename(f.filename) != "device_sync.py"
        ]
        where = (ours or frames)[-1]
        self.sites[f"{os.path.relpath(where.filename, os.path.dirname(HERE))}:{where.lineno} ({where.name})"] += 1
        self.messages[str(message).splitlines()[0][:120]] += 1


def step_syncs(sizes: Sizes, device: torch.device, out_dir: str) -> tuple[dict, str]:
    from torchrec_ext import device_sync

    module = make_module(sizes, device)
    *warm, measured = batches(sizes, device, 3)
    for kjt in warm:  # first steps compile the Triton kernels and allocate
        train_step(module, kjt)
    synchronize(device)
    if device.type != "cuda":
        with device_sync.recording() as counted:
            train_step(module, measured)
        return (
            {"syncs": None, "counted": dict(counted), "note": "cpu: no host-device syncs to report"},
            f"n/a on cpu (the step ran; device_sync counted {sum(counted.values())})",
        )
    with SyncRecorder() as recorder, device_sync.recording() as counted:
        torch.cuda.set_sync_debug_mode("warn")
        try:
            train_step(module, measured)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    sites, messages = recorder.sites, recorder.messages
    synchronize(device)
    total = sum(sites.values())
    # counted: what the step path's own helper counted (tests/test_sync_budget.py holds it to <= 3
    # on CPU); a GPU total above it is a sync the helper does not see.
    row = {
        "syncs": total,
        "counted": dict(counted),
        "sites": dict(sites.most_common()),
        "messages": dict(messages.most_common()),
        "other_warnings": dict(recorder.others.most_common()),  # not syncs (the debug mode's own notice)
    }
    text = (
        f"{total} synchronizing call(s) in one training step (forward + backward + fused Adagrad), "
        f"{sizes.num_tables} tables x dim {sizes.dim}, batch {sizes.batch_size}; device_sync counted "
        f"{sum(counted.values())}:\n\n"
        + (
            markdown_table(["site (innermost torchrec_ext frame)", "syncs"], [[s, n] for s, n in sites.most_common()])
            if total
            else "(none)"
        )
    )
    return row, text


def kernel_events(prof) -> list:
    """The profiler's device-side kernel events (memcpy / memset excluded)."""
    from torch.autograd import DeviceType

    return [
        e
        for e in prof.events()
        if e.device_type == DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset", "[memcpy]", "[memset]"))
    ]


def busy_time_us(events) -> tuple[float, float]:
    """(sum of durations, union of [start, end) intervals) in microseconds."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events)
    total = sum(end - start for start, end in spans)
    union, cur_start, cur_end = 0.0, None, None
    for start, end in spans:
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                union += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        union += cur_end - cur_start
    return total, union


def step_profile(sizes: Sizes, device: torch.device, out_dir: str) -> tuple[dict, str]:
    from torch.profiler import ProfilerActivity, profile

    module = make_module(sizes, device)
    # Warm-up: the first steps compile Triton kernels for the shapes they meet (the H100's first
    # run timed 2 warm-up steps: 99.9 ms a step here against bench_lookup's 8.3 ms).
    warm = 2 if device.type != "cuda" else 6
    data = batches(sizes, device, warm + 2 * sizes.profile_steps)
    for kjt in data[:warm]:
        train_step(module, kjt)
    data = data[warm - 2 :]
    synchronize(device)
    start = time.perf_counter()
    for kjt in data[2 : 2 + sizes.profile_steps]:
        train_step(module, kjt)
    issued = time.perf_counter()
    synchronize(device)
    wall_ms = (time.perf_counter() - start) / sizes.profile_steps * 1e3
    host_ms = (issued - start) / sizes.profile_steps * 1e3  # issuing the steps, their own host syncs included
    counted = count_step(lambda kjt: train_step(module, kjt), data[:2], by_phase=False)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for kjt in data[2 + sizes.profile_steps :]:
            train_step(module, kjt)
        synchronize(device)
    kernels = kernel_events(prof)
    total_us, union_us = busy_time_us(kernels)
    n = sizes.profile_steps
    by_name = collections.Counter()
    for e in kernels:
        by_name[e.name[:90]] += e.time_range.elapsed_us()
    row = {
        "steps": n,
        "wall_ms_per_step": wall_ms,
        "host_ms_per_step": host_ms,
        "ops_per_step": counted["ops"],
        "views_per_step": counted["views"],
        "py_calls_per_step": counted["py_calls"],
        "kernels_per_step": len(kernels) / n,
        "kernel_ms_per_step": total_us / n / 1e3,
        "busy_fraction": total_us / n / 1e3 / wall_ms,
        "busy_fraction_union": union_us / n / 1e3 / wall_ms,
        "top_kernels_us_per_step": {k: v / n for k, v in by_name.most_common(10)},
    }
    if device.type != "cuda":
        row["note"] = "cpu: no kernels recorded (profiler CPU activity only)"
    text = (
        f"{n} profiled training steps: {row['kernels_per_step']:.1f} kernels per step, "
        f"{row['kernel_ms_per_step']:.3f} ms of kernels per step in {wall_ms:.3f} ms wall (unprofiled): "
        f"GPU busy {row['busy_fraction']:.1%} (sum of kernel durations), {row['busy_fraction_union']:.1%} "
        f"(union of kernel intervals). Host side of a step: {host_ms:.3f} ms to issue it (its host syncs "
        f"included), {counted['ops']} aten ops dispatched (+ {counted['views']} views), "
        f"{counted['py_calls']} Python calls\n\n"
        + markdown_table(["kernel", "µs / step"], [[k, f"{v:.1f}"] for k, v in row["top_kernels_us_per_step"].items()])
    )
    return row, text


def step_bandwidth(sizes: Sizes, device: torch.device, out_dir: str) -> tuple[dict, str]:
    from torch.profiler import ProfilerActivity, profile

    src = torch.empty(sizes.copy_bytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    copy_s = median_seconds(lambda: dst.copy_(src), repeats=10, warmup=2)
    copy_gbps = 2 * sizes.copy_bytes / copy_s / 1e9  # read + written
    src = dst = None  # freed before the next step allocates

    module = make_module(sizes, device)
    data = batches(sizes, device, 3)
    for kjt in data[:2]:  # insert the ids (training mode), so the eval lookup finds rows
        train_step(module, kjt)
    module.eval()
    probe = data[0]
    unique_rows = sum(int(torch.unique(jt.values()).numel()) for jt in probe.to_dict().values())
    out_bytes = sizes.batch_size * sizes.num_tables * sizes.dim * 4
    lookup_bytes = unique_rows * sizes.dim * 4 + out_bytes
    with torch.no_grad():
        forward_s = median_seconds(lambda: module(probe), repeats=10, warmup=2)  # warm: compiles excluded
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            for _ in range(5):  # the median of 5 launches, not one
                module(probe)
            synchronize(device)
    pooled = [e.time_range.elapsed_us() for e in kernel_events(prof) if "pooled" in e.name]
    kernel_us = statistics.median(pooled) if pooled else 0.0
    # A copy moving as many bytes as the lookup: a 29 MB kernel pays launch and ramp costs a
    # 1 GiB copy hides, so this is the fair reference for the ratio too.
    src = torch.empty(max(lookup_bytes // 8, 1), dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    same_copy_gbps = 2 * src.numel() * 4 / median_seconds(lambda: dst.copy_(src), repeats=10, warmup=2) / 1e9
    src = dst = None
    row = {
        "copy_bytes": sizes.copy_bytes,
        "copy_GBps": copy_gbps,
        "unique_rows": unique_rows,
        "output_bytes": out_bytes,
        "lookup_bytes": lookup_bytes,
        "forward_ms": forward_s * 1e3,
        "forward_GBps": lookup_bytes / forward_s / 1e9,
        "pooled_kernel_us": kernel_us or None,
        "pooled_kernel_GBps": lookup_bytes / (kernel_us * 1e-6) / 1e9 if kernel_us else None,
        "same_size_copy_GBps": same_copy_gbps,
    }
    kernel_text = (
        f"pooled-lookup kernel alone {kernel_us:.1f} µs (median of 5): {row['pooled_kernel_GBps']:.0f} GB/s "
        f"({row['pooled_kernel_GBps'] / copy_gbps:.1%} of copy, {row['pooled_kernel_GBps'] / same_copy_gbps:.1%} "
        f"of a same-size copy's {same_copy_gbps:.0f} GB/s)"
        if kernel_us
        else "pooled-lookup kernel: not seen by the profiler (cpu)"
    )
    text = (
        f"Device copy bandwidth {copy_gbps:.0f} GB/s ({sizes.copy_bytes / 2**20:.0f} MiB tensor copy, bytes read + "
        f"written). Pooled lookup, eval forward of {sizes.num_tables} tables x dim {sizes.dim}, batch "
        f"{sizes.batch_size}: bytes counted = unique rows ({unique_rows:,}) x dim x 4 B + output "
        f"({out_bytes:,} B) = {lookup_bytes / 1e6:.1f} MB. Whole forward (dedup, hash find, pooling) "
        f"{forward_s * 1e3:.3f} ms: {row['forward_GBps']:.0f} GB/s ({row['forward_GBps'] / copy_gbps:.1%} of copy); "
        + kernel_text
        + "."
    )
    return row, text


def run_bench(
    name: str,
    script: str,
    args: list[str],
    sizes: Sizes,
    out_dir: str,
    results_file: str,
    device: torch.device,
    env: dict | None = None,
) -> tuple[dict, str]:
    """Runs one benchmark in its own process (a CUDA error there cannot poison this one), results to
    out_dir. For a step on the CPU the process sees no GPU: some benchmarks take one whenever it
    is visible, and would then run on it and write their *_cuda results instead."""
    log = os.path.join(out_dir, f"{name}.log")
    cmd = [sys.executable, os.path.join(HERE, script)] + args
    env = dict(os.environ, BENCH_RESULTS_DIR=out_dir, **(env or {}))
    if device.type != "cuda":
        env["CUDA_VISIBLE_DEVICES"] = ""
    with open(log, "w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        try:
            rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=sizes.bench_timeout_s)
        except subprocess.TimeoutExpired:
            rc = f"timed out after {sizes.bench_timeout_s} s"
    if rc != 0:
        with open(log) as f:
            tail = "".join(f.readlines()[-15:])
        raise RuntimeError(f"{script} exited {rc}; last lines of {log}:\n{tail}")
    md = os.path.join(out_dir, f"{results_file}.md")
    row = {"command": " ".join(cmd[1:]), "log": log, "results": md}
    with open(os.path.join(out_dir, f"{results_file}.jsonl")) as f:
        row["record"] = json.loads(f.readlines()[-1])
    with open(md) as f:
        return row, f.read().strip()


def step_pooled_lookup(sizes: Sizes, device: torch.device, out_dir: str) -> tuple[dict, str]:
    # The pooled-lookup kernel alone on gpu_check's shape, against a 1 GiB and a same-size copy
    # and torch's embedding_bag; on CPU a smoke run under the Triton interpreter (checks only).
    args = ["--num-tables", str(sizes.num_tables), "--dim", str(sizes.dim), "--batch-size", str(sizes.batch_size)]
    args += ["--max-bag", str(sizes.max_bag)]
    if device.type != "cuda":
        return run_bench(
            "pooled_lookup",
            "bench_pooled_lookup.py",
            args + ["--smoke", "1"],
            sizes,
            out_dir,
            "pooled_lookup_cpu",
            device,
            env={"TRITON_INTERPRET": "1"},
        )
    return run_bench(
        "pooled_lookup", "bench_pooled_lookup.py", args + ["--sweep", "1"], sizes, out_dir, "pooled_lookup_cuda", device
    )


def step_hash_table(sizes: Sizes, device: torch.device, out_dir: str) -> tuple[dict, str]:
    return run_bench(
        "hash_table",
        "bench_hash_table.py",
        list(sizes.hash_args) + ["--device", device.type],
        sizes,
        out_dir,
        f"hash_table_{device.type}_hkv",
        device,
    )


def step_upsert_tables(sizes: Sizes, device: torch.device, out_dir: str) -> tuple[dict, str]:
    return run_bench(
        "upsert_tables",
        "bench_upsert_tables.py",
        list(sizes.upsert_args) + ["--device", device.type],
        sizes,
        out_dir,
        f"upsert_tables_{device.type}",
        device,
    )


def step_step_host(sizes: Sizes, device: torch.device, out_dir: str) -> tuple[dict, str]:
    return run_bench(
        "step_host",
        "bench_step_host.py",
        list(sizes.step_host_args) + ["--device", device.type],
        sizes,
        out_dir,
        f"step_host_{device.type}",
        device,
    )


def step_lookup(sizes: Sizes, device: torch.device, out_dir: str) -> tuple[dict, str]:
    systems = "ours,ours-sgd,ours-fp16,ours-bf16,dense"  # FP16/BF16 rows vs FP32: issue 15
    reason = fbgemm_cuda_reason() if device.type == "cuda" else None
    if device.type == "cuda" and reason is None:
        systems += ",ebc"
    row, text = run_bench(
        "lookup",
        "bench_lookup.py",
        list(sizes.lookup_args) + ["--device", device.type, "--systems", systems],
        sizes,
        out_dir,
        f"lookup_{device.type}",
        device,
    )
    if reason:
        row["ebc"] = f"not run: {reason}"
        text += f"\n\nTorchRec EBC not run: {reason}."
    return row, text


def step_pipeline(sizes: Sizes, device: torch.device, out_dir: str) -> tuple[dict, str]:
    if device.type == "cuda":
        reason = fbgemm_cuda_reason()
        if reason:  # TorchRec's sharded EBC (the benchmark's model) needs fbgemm's CUDA TBE
            raise NotRunnable(f"TorchRec's sharded EBC on CUDA needs fbgemm's CUDA build: {reason}")
    return run_bench(
        "pipeline", "bench_pipeline.py", list(sizes.pipeline_args), sizes, out_dir, f"pipeline_{device.type}", device
    )


def step_tiers(sizes: Sizes, device: torch.device, out_dir: str) -> tuple[dict, str]:
    if device.type != "cuda":
        raise NotRunnable("bench_tiers_gpu.py times a cache in HBM over host memory: it needs a CUDA device")
    reason = fbgemm_cuda_reason()
    systems = "ours,resident" if reason else "ours,torchrec,resident"
    row, text = run_bench(
        "tiers",
        "bench_tiers_gpu.py",
        list(sizes.tiers_args) + ["--systems", systems],
        sizes,
        out_dir,
        "tiers_gpu",
        device,
    )
    if reason:
        row["torchrec"] = f"not run: {reason}"
        text += f"\n\nTorchRec's FUSED_UVM_CACHING EBC not run: {reason}."
    return row, text


STEP_FUNCS: dict[str, Callable[[Sizes, torch.device, str], tuple[dict, str]]] = {
    "env": step_env,
    "syncs": step_syncs,
    "profile": step_profile,
    "step_host": step_step_host,
    "bandwidth": step_bandwidth,
    "pooled_lookup": step_pooled_lookup,
    "hash_table": step_hash_table,
    "upsert_tables": step_upsert_tables,
    "lookup": step_lookup,
    "pipeline": step_pipeline,
    "tiers": step_tiers,
}


def run_steps(
    steps: list[str],
    sizes: Sizes,
    device: torch.device,
    out_dir: str,
    inject_failure: str | None = None,
    inject_kill: str | None = None,
) -> list[dict[str, object]]:
    common = versions(device)
    rows = []
    for name in steps:
        start = time.perf_counter()
        print(f"== {name}", flush=True)
        try:
            if name == inject_kill:  # as a device call's time limit ends the run
                os.kill(os.getpid(), signal.SIGKILL)
            if name == inject_failure:
                raise RuntimeError("failure injected by --inject-failure")
            result, text = STEP_FUNCS[name](sizes, device, out_dir)
            status = "ok"
        except NotRunnable as e:
            result, text, status = {"reason": str(e)}, f"not runnable: {e}", "not runnable"
        except Exception as e:  # noqa: BLE001 - reported, and the remaining steps still run
            tb = traceback.format_exc()
            result, text, status = {"error": f"{type(e).__name__}: {e}"}, f"FAILED\n\n```\n{tb.strip()}\n```", "failed"
        seconds = time.perf_counter() - start
        print(f"   {status} in {seconds:.1f} s", flush=True)
        row = dict(
            common,
            step=name,
            status=status,
            seconds=round(seconds, 2),
            result=result,
            text=text,
            time=time.strftime("%Y-%m-%dT%H:%M:%S"),
        )
        rows.append(row)
        # Written as each step ends: a device call cut off at its time limit still brings back
        # the steps that finished.
        with open(os.path.join(out_dir, "gpu_check.jsonl"), "a") as f:
            f.write(json.dumps({k: v for k, v in row.items() if k != "text"}, default=str) + "\n")
        write_report(rows, out_dir, sizes, device, pending=steps[len(rows) :])
    return rows


def write_report(
    rows: list[dict[str, object]], out_dir: str, sizes: Sizes, device: torch.device, pending: list[str] = ()
) -> str:
    """gpu_check.md for the steps run so far (`pending`: those still to run, named)."""
    head = rows[0] if rows else versions(device)
    lines = [
        f"# GPU check: {head['device']}",
        "",
        f"torch {head['torch']}, triton {head['triton']}, torchrec {head['torchrec']}, fbgemm_gpu "
        f"{head['fbgemm_gpu']}, Python {head['python']}; {time.strftime('%Y-%m-%d %H:%M')}; sizes: "
        f"{sizes.num_tables} tables x dim {sizes.dim}, batch {sizes.batch_size}, capacity {sizes.capacity:,} per table",
        "",
        markdown_table(["step", "status", "seconds"], [[r["step"], r["status"], r["seconds"]] for r in rows]),
    ]
    if pending:
        lines += ["", f"Still running or not reached: {', '.join(pending)}."]
    for r in rows:
        lines += ["", f"## {r['step']} ({r['status']})", "", str(r["text"])]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out_dir, "gpu_check.md"), "w") as f:
        f.write(text)
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", default=os.path.join(HERE, "results"))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (seconds on CPU): exercises the code paths")
    parser.add_argument("--steps", default=",".join(STEPS), help=f"comma-separated subset of {','.join(STEPS)}")
    parser.add_argument("--inject-failure", default=None, help=argparse.SUPPRESS)  # tests: this step raises
    parser.add_argument("--inject-kill", default=None, help=argparse.SUPPRESS)  # tests: killed at this step
    args = parser.parse_args()
    steps = [s for s in args.steps.split(",") if s]
    unknown = [s for s in steps if s not in STEPS]
    if unknown:
        parser.error(f"--steps: unknown {unknown}, choose from {','.join(STEPS)}")
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        torch.cuda.set_device(device)
    os.makedirs(args.out_dir, exist_ok=True)
    sizes = Sizes.smoke() if args.smoke else Sizes()
    rows = run_steps(steps, sizes, device, args.out_dir, args.inject_failure, args.inject_kill)
    print(write_report(rows, args.out_dir, sizes, device))
    failed = [r["step"] for r in rows if r["status"] == "failed"]
    if failed:
        print(f"gpu_check: FAILED steps: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
