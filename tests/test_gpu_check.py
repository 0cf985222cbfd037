"""benchmarks/gpu_check.py (the driver of scripts/gpu_check.sh) at tiny sizes on CPU, so the GPU
check cannot rot between GPU runs: every step runs, the report and the JSON rows say what ran where,
and one failing step is reported, fails the exit status, and does not stop the next steps."""

import contextlib
import json
import os
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DRIVER = os.path.join(ROOT, "benchmarks", "gpu_check.py")


def run_driver(out_dir, *args):
    proc = subprocess.run(
        [sys.executable, DRIVER, "--out-dir", str(out_dir), "--device", "cpu", "--smoke", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    with open(os.path.join(out_dir, "gpu_check.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    with open(os.path.join(out_dir, "gpu_check.md")) as f:
        report = f.read()
    return proc, rows, report


def test_smoke_runs_every_step_and_records_device_and_versions(tmp_path):
    steps = [
        "env",
        "syncs",
        "profile",
        "bandwidth",
        "hash_table",
        "upsert_tables",
        "lookup",
    ]  # pipeline: torchrun, ~40 s
    proc, rows, report = run_driver(tmp_path, "--steps", ",".join(steps))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [r["step"] for r in rows] == steps
    for r in rows:
        assert r["status"] == "ok", r
        assert r["device"] == "cpu" and r["torch"] == torch.__version__
        assert {"triton", "torchrec", "python", "seconds", "time", "result"} <= set(r)
        assert f"## {r['step']} (ok)" in report
    assert report.startswith("# GPU check: cpu")
    by_step = {r["step"]: r["result"] for r in rows}
    # whether this build has CUDA kernels (true on a GPU machine even when the steps run on its CPU)
    from torchrec_ext import ops

    built = torch.cuda.is_available() and ops.has_kernel("hash_find", torch.device("cuda"))
    assert by_step["env"]["cuda_kernels_built"] is built
    bw = by_step["bandwidth"]
    assert bw["copy_GBps"] > 0 and bw["unique_rows"] > 0
    assert bw["lookup_bytes"] == bw["unique_rows"] * 8 * 4 + bw["output_bytes"]  # smoke: dim 8
    assert by_step["profile"]["wall_ms_per_step"] > 0
    assert by_step["profile"]["host_ms_per_step"] > 0 and by_step["profile"]["ops_per_step"] > 0
    # The benchmarks ran in their own processes and wrote their results next to the report.
    hash_rows = by_step["hash_table"]["record"]["results"]
    assert {(r["load_factor"], r["dim"]) for r in hash_rows} == {(0.5, 8), (1.0, 8)}
    assert all(r[f"{op}_keys_per_s"] > 0 for r in hash_rows for op in ("find", "find_or_insert", "insert_or_assign"))
    assert set(by_step["lookup"]["record"]["results"]) == {"ours", "ours-sgd", "ours-fp16", "ours-bf16", "dense"}
    for name in ("hash_table_cpu_hkv.md", "lookup_cpu.md", "upsert_tables_cpu.md", "hash_table.log", "lookup.log"):
        assert os.path.exists(tmp_path / name), name


def test_a_failing_step_is_reported_fails_the_run_and_the_rest_still_run(tmp_path):
    proc, rows, report = run_driver(tmp_path, "--steps", "env,syncs,profile", "--inject-failure", "syncs")
    assert proc.returncode == 1
    assert [(r["step"], r["status"]) for r in rows] == [("env", "ok"), ("syncs", "failed"), ("profile", "ok")]
    assert "failure injected" in rows[1]["result"]["error"]
    assert "## syncs (failed)" in report and "FAILED steps: syncs" in proc.stderr


def test_a_run_killed_mid_step_leaves_the_report_of_the_steps_that_finished(tmp_path):
    # A device call that reaches its time limit is killed: what is under $OUT still comes back.
    proc, rows, report = run_driver(tmp_path, "--steps", "env,syncs,profile", "--inject-kill", "syncs")
    assert proc.returncode == -9
    assert [(r["step"], r["status"]) for r in rows] == [("env", "ok")]
    assert "## env (ok)" in report and "Still running or not reached: syncs, profile." in report


def _driver_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check_driver", DRIVER)
    driver = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = driver  # its dataclasses look their module up
    spec.loader.exec_module(driver)
    return driver


def test_sync_recorder_counts_each_warning_under_the_call_that_issued_it():
    # The GPU-only step's bookkeeping, driven by plain warnings (a sync warning is one per call).
    import warnings

    driver = _driver_module()

    def synchronizing_op():
        warnings.warn("called a synchronizing CUDA operation", stacklevel=2)

    with driver.SyncRecorder() as recorder:
        # What torch says when the mode is switched on: a notice, not a sync (the first GPU run
        # counted it as one).
        warnings.warn(
            "Synchronization debug mode is a prototype feature and does not yet detect all synchronizing operations",
            stacklevel=1,
        )
        for _ in range(3):
            synchronizing_op()
    warnings.warn("after: not counted", stacklevel=1)
    assert dict(recorder.messages) == {"called a synchronizing CUDA operation": 3}
    assert list(recorder.others.values()) == [1]
    ((site, count),) = recorder.sites.items()
    assert (
        count == 3
        and site.startswith(os.path.join("tests", "test_gpu_check.py:"))
        and site.endswith("(synchronizing_op)")
    )


def test_steps_run_on_cpu_hide_the_gpu_from_their_benchmark_processes(tmp_path, monkeypatch):
    # bench_pooled_lookup and bench_pipeline take the GPU whenever one is visible: on a GPU
    # machine a --device cpu check (gpu_check.sh --cpu-smoke) ran them on CUDA, and then looked
    # for their *_cpu results (not written). The CPU steps' processes see no GPU; the CUDA ones do.
    driver = _driver_module()
    seen = {}

    def fake_run(cmd, stdout, stderr, env, timeout):
        seen[os.path.basename(cmd[1])] = env.get("CUDA_VISIBLE_DEVICES")
        return 1  # (the step then fails: only the environment is checked here)

    monkeypatch.setattr(driver.subprocess, "call", fake_run)
    monkeypatch.setattr(driver, "fbgemm_cuda_reason", lambda: None)
    sizes = driver.Sizes.smoke()
    steps = ["pooled_lookup", "hash_table", "upsert_tables", "step_host", "lookup", "pipeline"]
    for device in ("cpu", "cuda"):
        seen.clear()
        for name in steps:
            with contextlib.suppress(RuntimeError):
                driver.STEP_FUNCS[name](sizes, torch.device(device), str(tmp_path))
        assert len(seen) == len(steps), seen
        assert all(v == ("" if device == "cpu" else os.environ.get("CUDA_VISIBLE_DEVICES")) for v in seen.values()), (
            device,
            seen,
        )
