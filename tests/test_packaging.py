"""torchrec_ext imports without the editable install: from a plain copy of the checkout with the
extension built in place, and from what a wheel would hold (setup.py build_py + the built _C).
Both run where CUDA looks available, the path on which ops.py imports the Triton kernels."""

import glob
import os
import shutil
import subprocess
import sys

import pytest

import torchrec_ext._C
from build_helpers import ROOT

# Drops the editable install's import hook, stubs a GPU (ops.py then registers the Triton kernels
# as CUDA kernels, as on a GPU machine), imports, and says where every torchrec_ext module came from.
IMPORT_CHECK = """
import sys
sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]
import torch
torch.cuda.is_available = lambda: True
import torchrec_ext, torchrec_ext.ops, torchrec_ext.triton_kernels.embedding_lookup
import torchrec_ext.distributed, torchrec_ext.pipeline, torchrec_ext.data, torchrec_ext.train
print(torchrec_ext.ops.has_kernel("pooled_lookup", torch.device("cuda")))
for name, module in sorted(sys.modules.items()):
    if name.startswith("torchrec_ext"):
        print(name, getattr(module, "__file__", None))
"""


def _checkout_copy(destination: str) -> str:
    """The source tree as a fresh checkout has it, plus the built extension in place."""
    shutil.copytree(
        ROOT,
        destination,
        ignore=shutil.ignore_patterns(
            ".git",
            ".venv",
            ".versions",  # (scripts/test_versions.sh's checkouts and their venvs)
            ".whl",
            ".fbgemm",
            "build",
            "runs",
            "*.egg-info",
            "__pycache__",
            ".pytest_cache",
            "*.so",
        ),
    )
    shutil.copy2(torchrec_ext._C.__file__, os.path.join(destination, "torchrec_ext"))
    return destination


def _wheel_contents(destination: str, checkout: str) -> str:
    """The Python files a wheel would hold (setup.py's build_py), plus the built extension."""
    proc = subprocess.run(
        [sys.executable, "setup.py", "-q", "build_py", "-d", destination],
        cwd=checkout,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    shutil.copy2(torchrec_ext._C.__file__, os.path.join(destination, "torchrec_ext"))
    return destination


def _python_files(root: str) -> set:
    return {
        os.path.relpath(p, root) for p in glob.glob(os.path.join(root, "torchrec_ext", "**", "*.py"), recursive=True)
    }


@pytest.fixture(scope="module")
def layouts(tmp_path_factory) -> dict:
    checkout = _checkout_copy(str(tmp_path_factory.mktemp("checkout") / "torchrec_ext_src"))
    return {"checkout": checkout, "wheel": _wheel_contents(str(tmp_path_factory.mktemp("wheel")), checkout)}


def test_wheel_holds_every_python_file(layouts):
    assert _python_files(layouts["wheel"]) == _python_files(layouts["checkout"])


@pytest.mark.parametrize("layout", ["checkout", "wheel"])
def test_imports_from_pythonpath_without_the_editable_finder(layouts, layout):
    root = layouts[layout]
    proc = subprocess.run(
        [sys.executable, "-c", IMPORT_CHECK],
        cwd=root,
        env=dict(os.environ, PYTHONPATH=root),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    registered, *modules = proc.stdout.splitlines()
    assert registered == "True"  # the Triton lookup is the op's CUDA kernel
    for line in modules:
        name, path = line.split(maxsplit=1)
        assert path.startswith(root + os.sep), f"{name} loaded from {path}, outside {root}"
