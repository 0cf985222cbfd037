"""scripts/gpu_check.sh's modes, checked on CPU: --dry-run prints what each mode would run, and
--tests-part K/N (tests/parts.py, the conftest's --tests-part) splits the suite into disjoint
parts whose union is the whole, so the suite can run across several 10-minute device calls."""

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from parts import parse_part, part_of, split

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "gpu_check.sh")


def dry_run(*args, **env_vars):
    env = dict(os.environ, PYTHON=sys.executable, PYTEST_WORKERS="0")
    env.pop("PYTEST_ARGS", None)
    env.update(env_vars)
    return subprocess.run(["bash", SCRIPT, "--dry-run", *args], cwd=ROOT, env=env, capture_output=True, text=True)


def pytest_commands(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("+ ") and " -m pytest " in line]


def test_parts_cover_every_test_once_in_collection_order():
    items = [
        SimpleNamespace(nodeid=f"tests/test_{f}.py::test_{i}[{p}]")
        for f in "abc"
        for i in range(40)
        for p in ("cpu", "cuda")
    ]
    parts = [split(items, f"{k}/3")[0] for k in (1, 2, 3)]
    assert sorted(id(x) for part in parts for x in part) == sorted(id(x) for x in items)
    for k, part in enumerate(parts, 1):
        assert part == [x for x in items if part_of(x.nodeid, 3) == k]  # order kept
        assert 40 <= len(part) <= 120  # spread, not one family per part (240 tests in all)
    kept, deselected = split(items, "2/3")
    assert kept == parts[1] and len(kept) + len(deselected) == len(items)


@pytest.mark.parametrize("spec", ["0/3", "4/3", "1", "a/b", "1/0", ""])
def test_a_bad_part_is_refused_by_name(spec):
    with pytest.raises(ValueError, match="--tests-part"):
        parse_part(spec)


def test_conftest_option_splits_a_collection_into_disjoint_parts():
    def collected(*extra):
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "tests/test_gpu_check_script.py",
                "--collect-only",
                "-q",
                "-p",
                "no:cacheprovider",
                *extra,
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return [line for line in proc.stdout.splitlines() if "::" in line]

    whole = collected()
    parts = [collected("--tests-part", f"{k}/2") for k in (1, 2)]
    assert sorted(parts[0] + parts[1]) == sorted(whole) and not set(parts[0]) & set(parts[1])
    assert all(parts)


def test_dry_run_of_each_mode():
    full = dry_run()
    assert full.returncode == 0, full.stderr
    assert len(pytest_commands(full.stdout)) == 2 and "benchmarks/gpu_check.py" in full.stdout

    part = dry_run("--tests-part", "2/3", "/tmp/gpu_out")
    assert part.returncode == 0, part.stderr
    (command,) = pytest_commands(part.stdout)
    assert "--tests-part 2/3" in command and "/tmp/gpu_out/gpu_tests_part2.xml" in command
    assert "gpu_check.py" not in part.stdout.replace("gpu_check.sh", "")

    tests = dry_run("--tests-only")
    assert len(pytest_commands(tests.stdout)) == 2 and "benchmarks/gpu_check.py" not in tests.stdout

    bench = dry_run("--bench-only")
    assert not pytest_commands(bench.stdout) and "benchmarks/gpu_check.py" in bench.stdout


def test_dry_run_spreads_the_suite_over_the_workers_asked_for():
    spread = dry_run("--tests-only", PYTEST_WORKERS="4")
    assert spread.returncode == 0, spread.stderr
    commands = pytest_commands(spread.stdout)
    assert len(commands) == 2 and all(" -n 4 " in c for c in commands)

    assert " -n " not in " ".join(pytest_commands(dry_run("--tests-only").stdout))  # 0: one process
    own = pytest_commands(dry_run("--tests-part", "1/2", PYTEST_WORKERS="4", PYTEST_ARGS="-n 2").stdout)
    assert len(own) == 1 and " -n 2 " in own[0] and " -n 4 " not in own[0]  # PYTEST_ARGS' -n wins

    bad = dry_run(PYTEST_WORKERS="many")
    assert bad.returncode == 2 and "PYTEST_WORKERS" in bad.stderr and "'many'" in bad.stderr


@pytest.mark.parametrize("args", [("--tests-part", "0/3"), ("--tests-part", "3/2"), ("--tests-part",), ("--bogus",)])
def test_dry_run_refuses_bad_arguments(args):
    proc = dry_run(*args)
    assert proc.returncode == 2 and "gpu_check.sh:" in proc.stderr


def test_carried_fbgemm_parts_are_unpacked_and_put_first_on_the_path(tmp_path):
    (tmp_path / "MANIFEST.json").write_text("{}")
    proc = dry_run("--bench-only", FBGEMM_PARTS=str(tmp_path), FBGEMM_CUDA_SITE="/x/fbgemm_cuda", PYTHONPATH="")
    assert proc.returncode == 0, proc.stderr
    unpack = f"+ {sys.executable} scripts/fbgemm_cuda_parts.py unpack --dir {tmp_path} --target /x/fbgemm_cuda"
    assert unpack in proc.stdout.splitlines()
    assert f"PYTHONPATH={ROOT}:/x/fbgemm_cuda" in proc.stdout.splitlines()
    without = dry_run("--bench-only", FBGEMM_PARTS=str(tmp_path / "none"), PYTHONPATH="")
    assert "fbgemm_cuda_parts.py" not in without.stdout and f"PYTHONPATH={ROOT}" in without.stdout.splitlines()


def _prepare(*args, **env_vars):
    env = dict(os.environ, PYTHON=sys.executable, **env_vars)
    script = os.path.join(ROOT, "scripts", "gpu_prepare.sh")
    return subprocess.run(["bash", script, *args], cwd=ROOT, env=env, capture_output=True, text=True)


def test_gpu_prepare_names_every_download_and_refuses_what_it_cannot_do(tmp_path):
    wheels = tmp_path / "wheels.sh"
    wheels.write_text("exit 0\n")
    proc = _prepare("--dry-run", "--no-fbgemm", WHEELS_SCRIPT=str(wheels))
    assert proc.returncode == 0, proc.stderr
    commands = [line for line in proc.stdout.splitlines() if line.startswith("+ ")]
    assert commands[0] == f"+ bash {wheels}"
    assert "pytest pluggy iniconfig pytest-xdist execnet" in commands[1]
    assert [c.split("> ")[-1] for c in commands[2:5]] == [
        ".whl/lookup_before_7a37695.py",
        ".whl/lookup_before_42544ae.py",
        ".whl/lookup_before_eab9927.py",
    ]
    assert not any("fbgemm_cuda_parts.py" in c for c in commands)
    assert "device call" in proc.stdout or "every device call carries" in proc.stdout
    missing = _prepare("--dry-run", WHEELS_SCRIPT=str(tmp_path / "none.sh"))
    assert missing.returncode == 2 and "no wheels script at" in missing.stderr
    bad = _prepare("--dry", WHEELS_SCRIPT=str(wheels))
    assert bad.returncode == 2 and "unknown argument --dry" in bad.stderr
