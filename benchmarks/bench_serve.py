"""The serving replica following a training job (issue 17, item 4): delta apply throughput and
predict latency while exports apply against idle, in one process.

A serve directory is made first by the job itself (`python -m torchrec_ext.train --export-deltas-every
every --serve-dir D`, `ranks` processes, synthetic data, CPU), unless --serve-dir names one. Then a
`Server` loads its base and:

- apply: the exports are published to it one by one (as the job would write them) while `readers`
  threads call `predict` on `predict_batch` samples in a loop; per export, the seconds of
  `poll()` (delta files read and checked, indexes built aside, rows encoded, then the publish under
  the write lock) and the rows it applied: rows/s.
- latency: the readers' predict latencies during the applies ("while applying") and then for
  `idle_s` seconds with nothing to apply ("idle"): p50 / p99 and QPS (requests of `predict_batch`).

    python benchmarks/bench_serve.py                               # saves results/serve_cpu.*
    python benchmarks/bench_serve.py --steps 6 --every 2 --capacity 4096 --batch-size 256 --idle-s 1 --no-save  # smoke
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import markdown_table, parse_config, save

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass
class Config:
    steps: int = 60
    every: int = 10
    capacity: int = 100_000  # rows per table (26 tables)
    embedding_dim: int = 16
    batch_size: int = 2048  # training samples per step per rank
    ranks: int = 1
    predict_batch: int = 64
    readers: int = 2
    idle_s: float = 5.0
    serve_dir: str = ""  # an existing serve directory (skips the job)


def make_serve_dir(cfg: Config, root: str) -> str:
    serve_dir = os.path.join(root, "D")
    launcher = (
        [sys.executable]
        if cfg.ranks == 1
        else [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(cfg.ranks)]
    )
    cmd = launcher + [
        "-m",
        "torchrec_ext.train",
        "--device",
        "cpu",
        "--no-progress",
        "--steps",
        str(cfg.steps),
        "--capacity",
        str(cfg.capacity),
        "--embedding-dim",
        str(cfg.embedding_dim),
        "--batch-size",
        str(cfg.batch_size),
        "--eval-every",
        "0",
        "--eval-batches",
        "1",
        "--export-deltas-every",
        str(cfg.every),
        "--serve-dir",
        serve_dir,
        "--run-dir",
        os.path.join(root, "run"),
    ]
    start = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.DEVNULL)
    print(f"job: {cfg.steps} steps, exports every {cfg.every}, in {time.perf_counter() - start:.1f} s", flush=True)
    return serve_dir


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def main() -> None:
    cfg, save_results = parse_config(Config, __doc__)
    from torchrec_ext.data.synthetic import SyntheticCriteo
    from torchrec_ext.serve import Server
    from torchrec_ext.train.serve_export import read_manifest

    root = tempfile.mkdtemp(prefix="bench_serve_")
    try:
        source = cfg.serve_dir or make_serve_dir(cfg, root)
        # The replica follows a copy into which the exports are published one at a time.
        serve_dir = os.path.join(root, "follow")
        shutil.copytree(source, serve_dir)
        exports = os.path.join(serve_dir, read_manifest(serve_dir)["exports"])
        names = sorted(os.listdir(exports))
        held = os.path.join(root, "held")
        os.makedirs(held)
        for name in names:
            shutil.move(os.path.join(exports, name), os.path.join(held, name))

        server = Server(serve_dir)
        start = time.perf_counter()
        server.load()
        load_s = time.perf_counter() - start
        batch = SyntheticCriteo(batch_size=cfg.predict_batch, num_batches=10, seed=0).batch(1)
        server.predict(batch.dense_features, batch.sparse_features)  # warm

        latencies: list[tuple[float, float]] = []  # (end time, seconds)
        stop = threading.Event()

        def reader() -> None:
            while not stop.is_set():
                t0 = time.perf_counter()
                server.predict(batch.dense_features, batch.sparse_features)
                t1 = time.perf_counter()
                latencies.append((t1, t1 - t0))

        threads = [threading.Thread(target=reader) for _ in range(cfg.readers)]
        for t in threads:
            t.start()
        applies = []
        apply_start = time.perf_counter()
        for name in names:
            shutil.move(os.path.join(held, name), os.path.join(exports, name))
            before = server.rows_applied
            t0 = time.perf_counter()
            server.poll()
            applies.append((time.perf_counter() - t0, server.rows_applied - before))
        apply_end = time.perf_counter()
        time.sleep(0.2)  # let readers finish requests that began during the applies
        idle_start = time.perf_counter()
        time.sleep(cfg.idle_s)
        stop.set()
        for t in threads:
            t.join()
        idle_end = time.perf_counter()
    finally:
        shutil.rmtree(root, ignore_errors=True)

    busy = [s for end, s in latencies if apply_start <= end <= apply_end]
    idle = [s for end, s in latencies if idle_start <= end <= idle_end]
    apply_s = sum(s for s, _ in applies)
    rows = sum(r for _, r in applies)
    rows_per_s = rows / apply_s if apply_s else float("nan")
    rec = dict(
        config=dataclasses.asdict(cfg),
        load_s=load_s,
        exports=len(applies),
        rows_applied=rows,
        apply_s=apply_s,
        apply_rows_per_s=rows_per_s,
        apply_s_per_export=[s for s, _ in applies],
        live_rows=server.status()["live_rows"],
        busy=dict(
            n=len(busy),
            p50_ms=1e3 * percentile(busy, 0.5),
            p99_ms=1e3 * percentile(busy, 0.99),
            qps=len(busy) / (apply_end - apply_start) if busy else None,
        ),
        idle=dict(
            n=len(idle),
            p50_ms=1e3 * percentile(idle, 0.5),
            p99_ms=1e3 * percentile(idle, 0.99),
            qps=len(idle) / (idle_end - idle_start) if idle else None,
        ),
        torch_threads=torch.get_num_threads(),
        load_average=os.getloadavg(),
    )
    text = [
        f"# Serving replica: {len(applies)} exports ({rows:,} rows) of a {cfg.ranks}-rank job, 26 tables x "
        f"{cfg.capacity:,} rows x dim {cfg.embedding_dim}; base loaded in {load_s:.2f} s",
        "",
        markdown_table(
            ["apply", "rows", "seconds", "rows/s"],
            [
                ["all exports", f"{rows:,}", f"{apply_s:.3f}", f"{rows_per_s:,.0f}"],
                ["median export", "", f"{statistics.median(s for s, _ in applies):.3f}", ""],
            ],
        ),
        "",
        markdown_table(
            [
                f"predict, batch {cfg.predict_batch}, {cfg.readers} reader threads",
                "requests",
                "p50 ms",
                "p99 ms",
                "QPS",
            ],
            [
                [
                    k,
                    rec[k]["n"],
                    f"{rec[k]['p50_ms']:.2f}",
                    f"{rec[k]['p99_ms']:.2f}",
                    f"{rec[k]['qps']:.0f}" if rec[k]["qps"] else "n/a",
                ]
                for k in ("idle", "busy")
            ],
        ),
        "",
        "busy: requests that ended while exports were being applied (poll: read, check, build aside, publish).",
        f"Load average (1, 5, 15 min) at the end: {', '.join(f'{x:.2f}' for x in os.getloadavg())} on "
        f"{os.cpu_count()} cores.",
        "",
        f"`python benchmarks/bench_serve.py {' '.join(sys.argv[1:])}`".replace(" `", "`"),
    ]
    print("\n".join(text))
    if save_results:
        save("serve_cpu", rec, "\n".join(text))


if __name__ == "__main__":
    main()
