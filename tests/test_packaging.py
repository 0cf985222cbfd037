"""The Triton kernels folder is importable only as torchrec_ext.triton_kernels: run from the
repository root, a bare `import triton_kernels` gets Triton's own package (or nothing), never ours."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _python(code: str, extra_path: str = "") -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=extra_path)
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_our_kernels_import_under_the_package_name():
    proc = _python("import torchrec_ext.triton_kernels as k; print(k.__name__)")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "torchrec_ext.triton_kernels"


def test_bare_triton_kernels_is_not_shadowed(tmp_path):
    real = tmp_path / "triton_kernels"
    real.mkdir()
    (real / "__init__.py").write_text("ORIGIN = 'triton'\n")
    proc = _python("import triton_kernels; print(triton_kernels.ORIGIN)", extra_path=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "triton"


def test_bare_triton_kernels_absent_is_module_not_found(tmp_path):
    installed = subprocess.run([sys.executable, "-c", "import triton_kernels"], cwd=tmp_path, capture_output=True)
    if installed.returncode == 0:
        pytest.skip("Triton's triton_kernels is installed here")
    proc = _python("import triton_kernels")
    assert proc.returncode != 0 and "No module named 'triton_kernels'" in proc.stderr
