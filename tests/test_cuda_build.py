"""Every CUDA kernel file compiles with nvcc under setup.py's own nvcc flags (the GPU path is kept
free of torch headers so this check runs on CPU-only machines too), and setup.py picks the GPU
architectures as documented: sm_90 SASS + compute_90 PTX by default, TORCH_CUDA_ARCH_LIST when
set, TORCHREC_EXT_NVCC_ARCH over both."""

import glob
import os
import pathlib
import re
import subprocess
from unittest import mock

import pytest
from torch.utils.cpp_extension import _get_cuda_arch_flags

from build_helpers import NVCC, ROOT, nvcc_flags, setup_arguments

CU_FILES = sorted(glob.glob(os.path.join(ROOT, "csrc", "*.cu")))
DEFAULT_ENV = {"TORCH_CUDA_ARCH_LIST": None, "TORCHREC_EXT_NVCC_ARCH": None}
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found")


def _nvcc(args, tmp_path) -> subprocess.CompletedProcess:
    cmd = (
        [NVCC, "-c", "-Werror", "all-warnings", "-I", os.path.join(ROOT, "csrc")]
        + args
        + ["-o", str(tmp_path / "out.o")]
    )
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}"
    return proc


def test_every_cuda_launcher_a_binding_calls_is_defined_in_a_compiled_source():
    """Each ``launch_*`` the ``*_cuda.h`` headers declare (what the ``*_cuda.cpp`` bindings call) is
    defined in a ``.cu`` file that setup.py compiles (every ``csrc/*.cu``, parametrized above): a
    launcher declared but defined nowhere would only fail at link time on a GPU build."""
    declared = set()
    for header in glob.glob(os.path.join(ROOT, "csrc", "*_cuda.h")):
        declared |= set(re.findall(r"^cudaError_t (launch_\w+)\(", pathlib.Path(header).read_text(), re.M))
    defined = set()
    for source in CU_FILES:
        defined |= set(re.findall(r"^cudaError_t (launch_\w+)\(", pathlib.Path(source).read_text(), re.M))
    assert declared, "no launch_* declarations found in csrc/*_cuda.h"
    assert declared <= defined, sorted(declared - defined)


def _definitions(text: str) -> set:
    """Names a C++/CUDA text defines at the start of a line: functions (a body follows the
    parameter list) and constants (``constexpr ... name =``)."""
    functions = re.findall(r"^[^\s/#][^;{}()]*?\b(\w+)\([^;{}]*\)\s*\{", text, re.M)
    constants = re.findall(r"^\s*constexpr [^=;]*?\b(\w+)\s*=", text, re.M)
    return set(functions) | set(constants)


def test_the_shared_launch_helpers_are_defined_once():
    """Grid sizing, grid-stride indexing and the warp constants live in csrc/cuda_launch.cuh: a
    kernel file defining its own copy (as each once did) could drift from the others (a
    different grid cap, a 32-bit index)."""
    shared = _definitions(pathlib.Path(ROOT, "csrc", "cuda_launch.cuh").read_text())
    assert {"capped_grid", "global_thread", "global_threads", "kMaxBlocks", "kWarpSize"} <= shared
    for source in CU_FILES:
        text = pathlib.Path(source).read_text()
        assert '#include "cuda_launch.cuh"' in text, os.path.basename(source)
        again = shared & _definitions(text)
        assert not again, f"{os.path.basename(source)} defines {sorted(again)} again"


@needs_nvcc
@pytest.mark.parametrize("std", ["c++17", "c++20"])  # torch 2.13 passes c++20; keep c++17 working
@pytest.mark.parametrize("source", CU_FILES, ids=os.path.basename)
def test_cu_compiles_with_the_setup_flags(source, std, tmp_path):
    _nvcc([f"-std={std}"] + nvcc_flags(DEFAULT_ENV) + [source], tmp_path)


@needs_nvcc
def test_default_build_embeds_sm90_sass_and_compute90_ptx(tmp_path):
    """PTX beside the SASS lets GPUs newer than sm_90 JIT-compile the kernels."""
    proc = _nvcc(["--dryrun"] + nvcc_flags(DEFAULT_ENV) + [CU_FILES[0]], tmp_path)
    (fatbinary,) = [line for line in proc.stderr.splitlines() if re.search(r"\bfatbinary\b", line)]
    images = set(re.findall(r"--image3=kind=(\w+),sm=(\d+)", fatbinary))
    assert images == {("elf", "90"), ("ptx", "90")}, fatbinary


def test_torch_cuda_arch_list_is_left_to_torch():
    """With TORCH_CUDA_ARCH_LIST set, setup.py passes no arch flag, so BuildExtension derives them."""
    env = dict(DEFAULT_ENV, TORCH_CUDA_ARCH_LIST="8.0;9.0+PTX")
    flags = nvcc_flags(env)
    assert not any("arch" in flag for flag in flags), flags
    with mock.patch.dict(os.environ, {"TORCH_CUDA_ARCH_LIST": env["TORCH_CUDA_ARCH_LIST"]}):
        derived = _get_cuda_arch_flags(flags)
    assert derived == [
        "-gencode=arch=compute_80,code=sm_80",
        "-gencode=arch=compute_90,code=compute_90",
        "-gencode=arch=compute_90,code=sm_90",
    ]


def test_torchrec_ext_nvcc_arch_overrides_both():
    override = ["-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90,code=sm_90"]
    flags = nvcc_flags({"TORCH_CUDA_ARCH_LIST": "8.6", "TORCHREC_EXT_NVCC_ARCH": " ".join(override)})
    assert flags[-2:] == override and sum("arch" in flag for flag in flags) == 2, flags
    with mock.patch.dict(os.environ, {"TORCH_CUDA_ARCH_LIST": "8.6"}):
        assert _get_cuda_arch_flags(flags) == []  # torch adds none of its own


def test_the_toolkit_is_the_one_cuda_home_names(tmp_path):
    """$CUDA_HOME picks the toolkit: torch's finder returns it (before nvcc on PATH or
    /usr/local/cuda), and setup.py builds against torch's CUDA_HOME (its libraries and headers)."""
    from torch.utils.cpp_extension import _find_cuda_home

    home = str(tmp_path / "cuda-x")
    with mock.patch.dict(os.environ, {"CUDA_HOME": home}):
        assert _find_cuda_home() == home
    (extension,) = setup_arguments(dict(DEFAULT_ENV, FORCE_CUDA="1"), cuda_home=home)["ext_modules"]
    assert any(d.startswith(home) for d in extension.library_dirs), extension.library_dirs
    assert any(d.startswith(home) for d in extension.include_dirs), extension.include_dirs
