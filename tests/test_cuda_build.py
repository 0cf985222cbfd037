"""Every CUDA kernel file compiles with nvcc for sm_90 (the GPU path is kept free of torch
headers so this check runs on CPU-only machines too)."""
import glob
import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CU_FILES = sorted(glob.glob(os.path.join(ROOT, "csrc", "*.cu")))
NVCC = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None)


def test_there_are_cuda_sources():
    assert CU_FILES, "csrc/ has no .cu files"


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("source", CU_FILES, ids=os.path.basename)
def test_cu_compiles_for_sm90(source, tmp_path):
    cmd = [NVCC, "-c", "-std=c++17", "-O3", "--expt-relaxed-constexpr", "-Werror", "all-warnings",
           "-gencode=arch=compute_90,code=sm_90", "-I", os.path.join(ROOT, "csrc"), source,
           "-o", str(tmp_path / "out.o")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}"
