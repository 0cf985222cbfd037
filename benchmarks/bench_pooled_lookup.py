"""Pooled-lookup kernel bandwidth (torchrec_ext/triton_kernels/embedding_lookup.py) against the
device's copy bandwidth and torch's embedding_bag, all in one process, on a GPU (issue 13's
"pooled lookup >= 70% of copy bandwidth").

    PYTHONPATH=. python benchmarks/bench_pooled_lookup.py                  # gpu_check's shape
    PYTHONPATH=. python benchmarks/bench_pooled_lookup.py --dim 128 --max-bag 40 --dtype float16
    PYTHONPATH=. python benchmarks/bench_pooled_lookup.py --sweep 1        # tiles x elements/thread
    TRITON_INTERPRET=1 PYTHONPATH=. python benchmarks/bench_pooled_lookup.py --smoke 1 --no-save  # CPU

The case: `num_tables` tables of `rows` x `dim` rows in one flat buffer (the module's storage),
one feature per table, `batch_size` bags per feature of uniform length in [min_bag, max_bag],
uniform random ids (so rows come from DRAM, not L2).

Bytes counted, the traffic a perfect kernel cannot avoid: every distinct row once (in its storage
dtype) + the ids, offsets and per-sample weights read + the float32 output written. "all rows"
also counts every repeated row (an L2 hit). Copy bandwidth (read + written) / time, for a 1 GiB
copy (gpu_check's reference) and for a copy moving as many bytes as the lookup (same launch and
ramp costs). Times: "call", CUDA events around `calls` back-to-back calls after warm-up (the
compiles are excluded), median of `repeats`: host-bound when a call takes longer to issue than
its kernels run; "kernel", the profiler's GPU time per call (every kernel it launches): the
figure to hold against the copy.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import markdown_table, parse_config, save, triton_device

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclasses.dataclass
class Config:
    num_tables: int = 8
    dim: int = 64
    batch_size: int = 4096
    min_bag: int = 1
    max_bag: int = 7
    rows: int = 1_000_000
    dtype: str = "float32"
    weighted: int = 0
    repeats: int = 20
    calls: int = 20
    copy_mib: int = 1024
    sweep: int = 0  # 1: also time POOLED_TILE x POOLED_ELEMENTS_PER_THREAD and scalar loads
    smoke: int = 0  # 1: tiny sizes (a CPU run under TRITON_INTERPRET=1 checks the script only)
    seed: int = 0


def make_case(cfg: Config, device: torch.device) -> dict:
    """pooled_lookup's keyword arguments, on `device`."""
    from torchrec_ext import vocabulary

    dtype = DTYPES[cfg.dtype]
    gen = torch.Generator().manual_seed(cfg.seed)
    words = vocabulary.table_words(cfg.rows, cfg.dim, dtype)
    weights = torch.empty(cfg.num_tables * words, dtype=torch.float32, device=device)
    weights.view(dtype).uniform_(-1, 1)
    num_bags = cfg.num_tables * cfg.batch_size
    lengths = torch.randint(cfg.min_bag, cfg.max_bag + 1, (num_bags,), generator=gen)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    rows = torch.randint(0, cfg.rows, (int(offsets[-1]),), generator=gen)
    host = dict(
        table_offsets=torch.arange(cfg.num_tables) * words,
        table_dims=torch.full((cfg.num_tables,), cfg.dim),
        feature_table=torch.arange(cfg.num_tables),
        feature_col=torch.arange(cfg.num_tables) * cfg.dim,
        feature_mean=torch.zeros(cfg.num_tables, dtype=torch.bool),
        table_dtypes=None if dtype == torch.float32 else torch.full((cfg.num_tables,), vocabulary.dtype_code(dtype)),
    )
    # Layout tensors mirrored on the device, as a module's are: the kernel reads their host values free.
    case = {k: None if v is None else _mirrored(v, device) for k, v in host.items()}
    psw = torch.rand(rows.numel(), generator=gen).to(device) if cfg.weighted else None
    return dict(
        case,
        weights=weights,
        rows=rows.to(device),
        offsets=offsets.to(device),
        per_sample_weights=psw,
        batch_size=cfg.batch_size,
        total_dim=cfg.num_tables * cfg.dim,
    )


def _mirrored(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    from torchrec_ext import device_sync

    return device_sync.mirror(host.to(device), host)


def counted_bytes(cfg: Config, case: dict) -> tuple[int, int]:
    """(bytes counted: distinct rows once, all rows: every id's row) of one call."""
    row_bytes = cfg.dim * DTYPES[cfg.dtype].itemsize
    rows, n = case["rows"], case["rows"].numel()
    # Distinct (table, row) pairs: each bag's table is its feature's (feature f = table f here).
    table_of_value = torch.repeat_interleave(
        torch.arange(cfg.num_tables, device=rows.device), torch.diff(case["offsets"]).view(cfg.num_tables, -1).sum(1)
    )
    distinct = int(torch.unique(table_of_value * cfg.rows + rows).numel())
    side = n * 8 + case["offsets"].numel() * 8 + (n * 4 if cfg.weighted else 0)
    out = cfg.batch_size * cfg.num_tables * cfg.dim * 4
    return distinct * row_bytes + side + out, n * row_bytes + side + out


def seconds_per_call(fn, cfg: Config, device: torch.device) -> float:
    """Median over `repeats` of (`calls` back-to-back calls) / calls, after 3 warm-up calls."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(cfg.repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(cfg.calls):
                fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / cfg.calls)
        else:
            t0 = time.perf_counter()
            for _ in range(cfg.calls):
                fn()
            times.append((time.perf_counter() - t0) / cfg.calls)
    return statistics.median(times)


def kernel_seconds(fn, cfg: Config, device: torch.device) -> float | None:
    """GPU time per call from the profiler: the durations of every kernel a call launches
    (memsets included), summed (None on CPU). Unlike the CUDA-event time of back-to-back calls,
    it does not turn into the host's issue time when the kernels are shorter than that."""
    if device.type != "cuda":
        return None
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(cfg.calls):
            fn()
        torch.cuda.synchronize()
    us = [
        e.time_range.elapsed_us()
        for e in prof.events()
        if e.device_type == DeviceType.CUDA and not e.name.startswith(("Memcpy", "[memcpy]"))
    ]
    return sum(us) / cfg.calls / 1e6 if us else None


def copy_gbps(nbytes: int, cfg: Config, device: torch.device) -> float:
    """(read + written) / time of a copy moving `nbytes` in all."""
    src = torch.empty(max(nbytes // 8, 1), dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / seconds_per_call(lambda: dst.copy_(src), cfg, device) / 1e9


def torch_embedding_bag(cfg: Config, case: dict):
    """The same lookup with torch's embedding_bag over the flat buffer seen as one table
    ([num_tables * rows, dim]; output [bags, dim]: the same bytes, another layout)."""
    dtype = DTYPES[cfg.dtype]
    table = case["weights"].view(dtype)[: cfg.num_tables * cfg.rows * cfg.dim].view(-1, cfg.dim)
    counts = torch.diff(case["offsets"]).view(cfg.num_tables, -1).sum(1)
    table_of_value = torch.repeat_interleave(torch.arange(cfg.num_tables, device=table.device), counts)
    ids = case["rows"] + table_of_value * cfg.rows
    offsets, psw = case["offsets"][:-1], case["per_sample_weights"]
    psw = None if psw is None else psw.to(dtype)
    return lambda: torch.nn.functional.embedding_bag(ids, table, offsets, mode="sum", per_sample_weights=psw)


def main() -> None:
    cfg, save_results = parse_config(Config, __doc__)
    if cfg.smoke:
        cfg = dataclasses.replace(cfg, num_tables=2, dim=8, batch_size=16, rows=64, repeats=1, calls=1, copy_mib=1)
    device = triton_device("bench_pooled_lookup")
    from torchrec_ext.reference import pooled_lookup as reference
    from torchrec_ext.triton_kernels import embedding_lookup

    case = make_case(cfg, device)
    op = lambda: embedding_lookup.pooled_lookup(**case)
    if cfg.smoke:  # a CPU run is only a check: compare with the reference
        torch.testing.assert_close(op(), reference(**case))
    counted, all_rows = counted_bytes(cfg, case)
    copy_ref = copy_gbps(cfg.copy_mib << 20, cfg, device)
    copy_same = copy_gbps(counted, cfg, device)

    results = []

    def measure(name: str, fn, kernel: bool) -> None:
        s = seconds_per_call(fn, cfg, device)
        k = kernel_seconds(fn, cfg, device) if kernel else None
        for what, sec in (("call", s), ("kernel", k)):
            if sec:
                gbps = counted / sec / 1e9
                results.append(
                    {
                        "system": name,
                        "timed": what,
                        "us": sec * 1e6,
                        "GBps": gbps,
                        "GBps_all_rows": all_rows / sec / 1e9,
                        "of_copy_1GiB": gbps / copy_ref,
                        "of_copy_same_bytes": gbps / copy_same,
                    }
                )

    measure("ours", op, kernel=True)
    if device.type == "cuda":
        measure("torch embedding_bag", torch_embedding_bag(cfg, case), kernel=True)
    if cfg.sweep:
        saved = (embedding_lookup.POOLED_TILE, embedding_lookup.POOLED_ELEMENTS_PER_THREAD)
        for tile in (2048, 4096, 8192):
            for per_thread in (8, 16, 32):
                embedding_lookup.POOLED_TILE, embedding_lookup.POOLED_ELEMENTS_PER_THREAD = tile, per_thread
                measure(f"ours tile {tile}, {per_thread}/thread", op, kernel=True)
        embedding_lookup.POOLED_TILE, embedding_lookup.POOLED_ELEMENTS_PER_THREAD = saved
        alignment = embedding_lookup._alignment
        embedding_lookup._alignment = lambda dims, offsets: 1  # 4-byte loads, as before this kernel
        measure("ours, scalar loads (ALIGN 1)", op, kernel=True)
        embedding_lookup._alignment = alignment

    record = {
        "config": dataclasses.asdict(cfg),
        "device": device.type,
        "copy_GBps_1GiB": copy_ref,
        "copy_GBps_same_bytes": copy_same,
        "bytes_counted": counted,
        "bytes_all_rows": all_rows,
        "results": results,
    }
    md = (
        f"Pooled lookup, {cfg.num_tables} tables x dim {cfg.dim} ({cfg.dtype}), batch {cfg.batch_size}, bags of "
        f"{cfg.min_bag}..{cfg.max_bag} ids{', weighted' if cfg.weighted else ''}, {cfg.rows:,} rows a table: "
        f"{counted / 1e6:.1f} MB counted ({all_rows / 1e6:.1f} MB with repeated rows). Copy bandwidth "
        f"{copy_ref:.0f} GB/s ({cfg.copy_mib} MiB), {copy_same:.0f} GB/s (same bytes as the lookup).\n\n"
        + markdown_table(
            ["system", "timed", "µs", "GB/s", "of 1 GiB copy", "of same-size copy"],
            [
                [
                    r["system"],
                    r["timed"],
                    f"{r['us']:.1f}",
                    f"{r['GBps']:.0f}",
                    f"{r['of_copy_1GiB']:.1%}",
                    f"{r['of_copy_same_bytes']:.1%}",
                ]
                for r in results
            ],
        )
    )
    print(md)
    if save_results:
        save(f"pooled_lookup_{device.type}", record, md)


if __name__ == "__main__":
    main()
