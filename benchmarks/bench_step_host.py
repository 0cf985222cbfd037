"""Host cost of one training step (issue 13: the H100 found the dlrm-small step host-bound, GPU busy
3.5%, ~261 kernels a step): our modules against a static ``torch.nn.EmbeddingBag`` per table with
sparse SGD, run in the same process on the same batches, at a batch small enough that the host
side dominates.

Per step (forward, a sum as the loss, backward with the fused optimizer; the dense baseline also
``zero_grad`` and ``SGD.step``):
- ops: aten ops dispatched from Python (a ``TorchDispatchMode``: what the step asks of the
  dispatcher; ops called inside a C++ op are not seen), views apart (no kernel on a GPU);
- py calls: Python function calls (``sys.setprofile`` call events);
- host µs: wall time per step, median over interleaved repeats (on CUDA the time to issue the
  step, its own host syncs included, and, apart, the time to its end);
- kernels (CUDA): kernel launches per step (torch.profiler);
- by phase: ops, Python calls and µs of each part of the step (features: the KJT's check and
  arrangement; dedup; upsert; init rows; bookkeeping: table counters, admission, TTL; rows: the
  rest of ids -> rows; lookup: the lookup kernel's forward; backward: the fused update; other:
  the module, autograd and the loss), by wrapping each part's function (exclusive times).

Our modules run as on the device: on CUDA their defaults; on CPU both the CPU defaults (``cpu``:
new rows deferred to the fused update, per-table init) and the GPU's settings (``device``: new
rows written by the lookup in one call, ``flat_init``), so that the CPU machine measures the host
side of the GPU path too.

    PYTHONPATH=$PWD python benchmarks/bench_step_host.py                 # 8 and 26 tables, batch 32
    PYTHONPATH=$PWD python benchmarks/bench_step_host.py --device cuda   # + kernels per step
    PYTHONPATH=$PWD python benchmarks/bench_step_host.py --ab /work/main # wall time A/B against another checkout
    PYTHONPATH=$PWD python benchmarks/bench_step_host.py --tables 4 --repeats 2 --steps 3 --no-save  # smoke
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import markdown_table, save

PHASES = ("features", "dedup", "upsert", "init_rows", "bookkeeping", "rows", "lookup", "backward", "other")


# ---- the systems ------------------------------------------------------------------------------


def make_batches(tables: int, batch: int, count: int, device: torch.device) -> list:
    from torchrec_ext.data import dlrm_small_batch

    return [dlrm_small_batch(i, tables, batch, 3).to(device) for i in range(count)]


def ours(kind: str, tables: int, dim: int, rows: int, device: torch.device, gpu_settings: bool) -> Callable:
    """A training step of our EBC (``kind`` "ebc") or EC ("ec") of ``tables`` tables, Adagrad."""
    from torchrec_ext import (
        DynamicEmbeddingBagCollection,
        DynamicEmbeddingBagConfig,
        DynamicEmbeddingCollection,
        DynamicEmbeddingConfig,
    )

    cls, config = (
        (DynamicEmbeddingBagCollection, DynamicEmbeddingBagConfig)
        if kind == "ebc"
        else (DynamicEmbeddingCollection, DynamicEmbeddingConfig)
    )
    configs = [
        config(name=f"t{t}", embedding_dim=dim, num_embeddings=rows, feature_names=[f"f{t}"]) for t in range(tables)
    ]
    module = cls(configs, device=device, optimizer=torch.optim.Adagrad, optimizer_kwargs={"lr": 0.01})
    if gpu_settings:  # what a CUDA module does by default
        module._tables.defer_new_rows, module._tables.flat_init, module._tables.batched_upsert = False, True, True

    def step(kjt) -> None:
        out = module(kjt)
        # (an EC's output is a JaggedTensor per feature: one op for the loss whatever the table count)
        values = out.values() if kind == "ebc" else torch.cat([jt.values() for jt in out.values()])
        values.sum().backward()

    return step


def dense(tables: int, dim: int, rows: int, device: torch.device) -> Callable:
    """The static baseline: one ``nn.EmbeddingBag(sparse=True)`` per table, ids mod rows, SGD."""
    bags = torch.nn.ModuleList([torch.nn.EmbeddingBag(rows, dim, mode="sum", sparse=True) for _ in range(tables)])
    bags.to(device)
    opt = torch.optim.SGD(bags.parameters(), lr=0.01)

    def step(kjt) -> None:
        features = kjt.to_dict()
        out = torch.cat(
            [bag(features[f"f{t}"].values() % rows, features[f"f{t}"].offsets()) for t, bag in enumerate(bags)], 1
        )
        opt.zero_grad()
        out.sum().backward()
        opt.step()

    return step


def systems_for(args, tables: int, device: torch.device) -> dict[str, Callable]:
    out: dict[str, Callable] = {}
    paths = ("device",) if device.type == "cuda" else ("device", "cpu")
    for kind in args.kinds.split(","):
        for path in paths:
            out[f"{kind}/{path}"] = ours(kind, tables, args.dim, args.rows, device, path == "device")
    out["dense"] = dense(tables, args.dim, args.rows, device)
    return out


# ---- counting ---------------------------------------------------------------------------------


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched while active, per phase (``PhaseClock.current``), views apart."""

    def __init__(self, clock: PhaseClock | None = None) -> None:
        super().__init__()
        self.clock = clock
        self.ops: collections.Counter = collections.Counter()
        self.views: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        phase = self.clock.current() if self.clock is not None else "other"
        (self.views if func.is_view else self.ops)[phase] += 1
        return func(*args, **(kwargs or {}))


class PhaseClock:
    """Wraps each phase's functions (``_targets``) so that time, Python calls and ops are told
    apart by phase: a stack of the phases entered, each timed exclusive of the phases nested in it."""

    def __init__(self) -> None:
        self.stack: list[str] = []
        self.seconds: collections.Counter = collections.Counter()
        self._started: list[float] = []
        self._wrappers: set = set()

    def current(self) -> str:
        return self.stack[-1] if self.stack else "other"

    def _enter(self, phase: str) -> None:
        now = time.perf_counter()
        if self.stack:
            self.seconds[self.stack[-1]] += now - self._started[-1]
        self.stack.append(phase)
        self._started.append(now)

    def _exit(self) -> None:
        now = time.perf_counter()
        phase = self.stack.pop()
        self.seconds[phase] += now - self._started.pop()
        if self._started:
            self._started[-1] = now

    def wrap(self, phase: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            self._enter(phase)
            try:
                return fn(*args, **kwargs)
            finally:
                self._exit()

        self._wrappers.add(timed.__code__)
        return timed

    @contextlib.contextmanager
    def installed(self) -> Iterator[PhaseClock]:
        undo = []
        for owner, name, phase in _targets():
            raw = owner.__dict__[name]
            fn = raw.__func__ if isinstance(raw, staticmethod) else raw
            wrapped = self.wrap(phase, fn)
            setattr(owner, name, staticmethod(wrapped) if isinstance(raw, staticmethod) else wrapped)
            undo.append((owner, name, raw))
        try:
            yield self
        finally:
            for owner, name, raw in reversed(undo):
                setattr(owner, name, raw)

    def is_wrapper(self, code) -> bool:
        return code in self._wrappers


def _targets() -> list[tuple[object, str, str]]:
    """(owner, attribute, phase) of each function that starts a phase."""
    from torchrec_ext import ops
    from torchrec_ext.modules import embedding_bag_collection, embedding_collection, lookup_functions
    from torchrec_ext.modules.ids_to_rows import IdsToRows
    from torchrec_ext.modules.table_stats import TableCounters

    out = [
        (embedding_bag_collection, "check_and_arrange", "features"),
        (embedding_collection, "check_and_arrange", "features"),
        (ops, "dedup_segments", "dedup"),
        (IdsToRows, "lookup", "rows"),
        (IdsToRows, "_rows_for", "upsert"),
        (IdsToRows, "_rows_for_tables", "upsert"),
        (IdsToRows, "_initialise", "init_rows"),
        (IdsToRows, "_initialise_tables", "init_rows"),
        (lookup_functions.PooledLookupFunction, "forward", "lookup"),
        (lookup_functions.SequenceLookupFunction, "forward", "lookup"),
        (lookup_functions, "fused_backward", "backward"),
    ]
    for name in ("_defer_tables",):  # (absent from older checkouts)
        if name in IdsToRows.__dict__:
            out.append((IdsToRows, name, "init_rows"))
    for name in ("_admit", "_after_upsert", "_erase_expired", "_mask_expired", "_read_fallback"):
        if name in IdsToRows.__dict__:
            out.append((IdsToRows, name, "bookkeeping"))
    for name, value in TableCounters.__dict__.items():
        if name.startswith("count") and callable(value):
            out.append((TableCounters, name, "bookkeeping"))
    return out


def count_step(step: Callable, batches: list, by_phase: bool = True) -> dict[str, object]:
    """Ops (views apart) of one step and Python calls of the next (the op counter's own Python
    calls would count otherwise), in all and per phase."""
    clock = PhaseClock()
    calls: collections.Counter = collections.Counter()

    def profile(frame, event, arg):
        if event == "call" and not clock.is_wrapper(frame.f_code):
            calls[clock.current()] += 1

    with contextlib.ExitStack() as stack:
        if by_phase:
            stack.enter_context(clock.installed())
        with OpCounter(clock) as counter:
            step(batches[0])
        sys.setprofile(profile)
        try:
            step(batches[1])
        finally:
            sys.setprofile(None)
    return {
        "ops": sum(counter.ops.values()),
        "views": sum(counter.views.values()),
        "py_calls": sum(calls.values()),
        "phase_ops": {p: counter.ops[p] for p in PHASES if counter.ops[p]},
        "phase_py_calls": {p: calls[p] for p in PHASES if calls[p]},
    }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(systems: dict[str, Callable], batches: list, args, device: torch.device) -> dict[str, dict]:
    """Host µs per step (and, on CUDA, µs to the step's end), median over interleaved repeats."""
    issue, total = collections.defaultdict(list), collections.defaultdict(list)
    steps = args.steps
    for r in range(args.repeats):
        for name, step in systems.items():
            chunk = [batches[(r * steps + i) % len(batches)] for i in range(steps)]
            _sync(device)
            start = time.perf_counter()
            for kjt in chunk:
                step(kjt)
            issued = time.perf_counter()
            _sync(device)
            done = time.perf_counter()
            issue[name].append((issued - start) / steps * 1e6)
            total[name].append((done - start) / steps * 1e6)
    return {n: {"host_us": statistics.median(issue[n]), "step_us": statistics.median(total[n])} for n in systems}


def phase_times(step: Callable, batches: list, args, device: torch.device) -> dict[str, float]:
    """µs per step of each phase (exclusive; "other": the step's time outside the wrapped ones;
    wrapped, so a little slower than the plain step)."""
    clock = PhaseClock()
    per_step = collections.defaultdict(list)
    with clock.installed():
        for i in range(args.repeats * args.steps):
            clock.seconds.clear()
            start = time.perf_counter()
            step(batches[i % len(batches)])
            _sync(device)
            clock.seconds["other"] = time.perf_counter() - start - sum(clock.seconds.values())
            for p in PHASES:
                per_step[p].append(clock.seconds[p] * 1e6)
    return {p: statistics.median(v) for p, v in per_step.items() if statistics.median(v) > 0}


def kernels_per_step(step: Callable, batches: list, device: torch.device, steps: int = 3) -> float | None:
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    _sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            step(batches[i % len(batches)])
        _sync(device)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return len(kernels) / steps


# ---- the run ----------------------------------------------------------------------------------


def measure(args, device: torch.device) -> list[dict]:
    rows = []
    for tables in [int(t) for t in args.tables.split(",")]:
        batches = make_batches(tables, args.batch, max(args.steps * args.repeats, 8), device)
        systems = systems_for(args, tables, device)
        for step in systems.values():
            for kjt in batches[: args.warmup]:
                step(kjt)
        _sync(device)
        times = time_steps(systems, batches, args, device)
        for name, step in systems.items():
            row = {"system": name, "tables": tables, "batch": args.batch, "device": str(device)}
            row.update(times[name])
            row.update(count_step(step, batches, by_phase=name != "dense"))
            row["kernels"] = kernels_per_step(step, batches, device)
            if name != "dense" and not args.ab_child:
                row["phase_us"] = phase_times(step, batches, args, device)
            rows.append(row)
    return rows


def ab_rounds(args) -> dict[tuple[str, int], dict[str, list[float]]]:
    """Host µs per step of this checkout (A) and ``args.ab`` (B), each round a fresh process of
    each, alternating: (system, tables) -> {"A": [...], "B": [...]}, and each of ours over the
    dense baseline of the same process and round ("A/dense", "B/dense": the same dense code on
    both sides, so the ratio cancels most of a loaded machine's drift)."""
    out: dict = collections.defaultdict(lambda: {"A": [], "B": []})
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    argv = [a for a in sys.argv[1:] if a != "--ab" and a != args.ab]
    for _ in range(args.ab_rounds):
        for label, root in (("A", here), ("B", args.ab)):
            env = dict(os.environ, PYTHONPATH=root)
            done = subprocess.run(
                [sys.executable, os.path.abspath(__file__), *argv, "--ab-child", "--no-save"],
                env=env,
                cwd=root,
                capture_output=True,
                text=True,
                check=True,
            )
            rows = json.loads(done.stdout.strip().splitlines()[-1])
            dense_us = {r["tables"]: r["host_us"] for r in rows if r["system"] == "dense"}
            for row in rows:
                entry = out[(row["system"], row["tables"])]
                entry[label].append(row["host_us"])
                entry.setdefault(f"{label}/dense", []).append(row["host_us"] / dense_us[row["tables"]])
    return out


def report(args, rows: list[dict], device: torch.device, ab: dict | None) -> str:
    dense_us = {r["tables"]: r["host_us"] for r in rows if r["system"] == "dense"}
    lines = [
        f"# Host cost of one training step ({device})",
        "",
        f"`{' '.join(['python benchmarks/bench_step_host.py', *sys.argv[1:]])}`: batch {args.batch} per table, "
        f"dim {args.dim}, {args.rows} rows per table, bags 1..3 of dlrm-small ids; median of {args.repeats} "
        f"interleaved repeats x {args.steps} steps after {args.warmup} warm-up steps. ours: Adagrad; "
        "`device`: the GPU's settings (new rows written by the lookup in one call), `cpu`: CPU defaults; "
        "dense: nn.EmbeddingBag(sparse=True) per table + SGD. ops: aten ops dispatched from Python "
        "(views apart); py calls: Python function calls.",
        "",
    ]
    header = ["system", "tables", "host µs / step", "× dense", "ops / step", "views", "py calls / step"]
    if device.type == "cuda":
        header[3:3] = ["µs to step end"]
        header.append("kernels / step")
    table = []
    for r in rows:
        cells = [r["system"], r["tables"], f"{r['host_us']:.0f}", f"{r['host_us'] / dense_us[r['tables']]:.2f}"]
        if device.type == "cuda":
            cells[3:3] = [f"{r['step_us']:.0f}"]
        cells += [r["ops"], r["views"], r["py_calls"]]
        if device.type == "cuda":
            cells.append(f"{r['kernels']:.0f}")
        table.append(cells)
    lines += [markdown_table(header, table), "", "## By phase (ours): ops / Python calls / µs per step", ""]
    phase_rows = []
    for r in rows:
        if r["system"] == "dense":
            continue
        cells = [r["system"], r["tables"]]
        for p in PHASES:
            us = r.get("phase_us", {}).get(p, 0.0)
            cells.append(f"{r['phase_ops'].get(p, 0)} / {r['phase_py_calls'].get(p, 0)} / {us:.0f}")
        phase_rows.append(cells)
    lines.append(markdown_table(["system", "tables", *PHASES], phase_rows))
    if ab:
        lines += [
            "",
            f"## A/B: host µs per step, this checkout (A) vs `{args.ab}` (B), "
            f"{args.ab_rounds} alternating rounds of one process each, medians",
            "",
        ]
        ab_rows = [
            [
                s,
                t,
                f"{statistics.median(v['A']):.0f}",
                f"{statistics.median(v['B']):.0f}",
                f"{statistics.median(v['A/dense']):.3f}",
                f"{statistics.median(v['B/dense']):.3f}",
                f"{statistics.median(v['A/dense']) / statistics.median(v['B/dense']):.3f}",
            ]
            for (s, t), v in sorted(ab.items())
            if s != "dense"
        ]
        header = ["system", "tables", "A µs", "B µs", "A × dense", "B × dense", "A / B (× dense)"]
        lines.append(markdown_table(header, ab_rows))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tables", default="8,26", help="comma-separated table counts")
    parser.add_argument("--kinds", default="ebc,ec", help="ebc, ec or both")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--rows", type=int, default=1 << 16)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: the host path alone)")
    parser.add_argument("--ab", default=None, help="another checkout to compare wall time with")
    parser.add_argument("--ab-rounds", type=int, default=5)
    parser.add_argument("--ab-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    rows = measure(args, device)
    if args.ab_child:
        print(json.dumps([{k: r[k] for k in ("system", "tables", "host_us")} for r in rows]))
        return
    ab = ab_rounds(args) if args.ab else None
    text = report(args, rows, device, ab)
    print(text)
    if not args.no_save:
        record = {"rows": rows}
        if ab:
            record["ab"] = [{"system": s, "tables": t, **v} for (s, t), v in ab.items()]
        save(f"step_host_{device.type}", record, text)


if __name__ == "__main__":
    main()
