"""Builds csrc/hash_table_cuda.{cu,cpp} for the CPU under the warp emulator, as the op library
``torch.ops.torchrec_emu`` (same schemas as torchrec_ext): kernel launches become calls into the
emulator, and the binding's kernels register as CPU kernels. Tests then compare these ops with
the CPU ops of torchrec_ext, output for output and table byte for byte."""
import os
import re

import torch
from torch.utils.cpp_extension import load

HERE = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join(os.path.dirname(os.path.dirname(HERE)), "csrc")


def cuda_include_dir():
    """The CUDA toolkit's include folder (for cuda_runtime_api.h's types), or None."""
    for root in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if root and os.path.exists(os.path.join(root, "include", "cuda_runtime_api.h")):
            return os.path.join(root, "include")
    return None


def _emulated_kernels() -> str:
    cu = open(os.path.join(CSRC, "hash_table_cuda.cu")).read()
    cu = cu.replace("#include <cuda_runtime.h>\n", "")
    prefetch = 'asm volatile("prefetch.global.L2 [%0];" ::"l"(p));'
    assert prefetch in cu, "hash_table_cuda.cu changed: update the emulation's L2 prefetch rewrite"
    cu = cu.replace(prefetch, "emu_prefetch(p);")
    cu, launches = re.subn(r"(\w+)<<<(.*?), (\w+), 0, stream>>>\((.*?)\);",
                           r"emu_launch(\2, \3, stream, [&] { \1(\4); });", cu, flags=re.S)
    assert launches == 7, f"expected 7 kernel launches in hash_table_cuda.cu, rewrote {launches}"
    cu = cu.replace("cudaGetLastError()", "emu_last_error()")
    return '#include "warp_emulator.h"\n' + cu


def _emulated_binding() -> str:
    cpp = open(os.path.join(CSRC, "hash_table_cuda.cpp")).read()
    for header in ("CUDAException", "CUDAGuard", "CUDAStream"):
        cpp = cpp.replace(f"#include <c10/cuda/{header}.h>\n", "")
    cpp = cpp.replace("#include <torch/library.h>\n", '#include <torch/library.h>\n#include "cuda_stubs.h"\n')
    for name in ("digests", "keys"):  # the emulated "device" memory is host memory
        assert f"{name}.is_cuda()" in cpp
        cpp = cpp.replace(f"{name}.is_cuda()", f"({name}.is_cuda() || {name}.is_cpu())")
    cpp = cpp.replace("TORCH_LIBRARY_IMPL(torchrec_ext, CUDA, m)", "TORCH_LIBRARY_IMPL(torchrec_emu, CPU, m)")
    schemas = open(os.path.join(CSRC, "ops.cpp")).read()
    schemas = schemas[schemas.index("TORCH_LIBRARY(torchrec_ext, m)"):schemas.index("PyMODINIT_FUNC")]
    return cpp + "\n" + schemas.replace("TORCH_LIBRARY(torchrec_ext, m)", "TORCH_LIBRARY(torchrec_emu, m)")


def build(build_dir: str):
    """Generates and compiles the emulated library in build_dir; returns torch.ops.torchrec_emu."""
    import torchrec_ext  # noqa: F401  (the emulated hash_restore calls torchrec_ext's CPU kernel)

    os.makedirs(build_dir, exist_ok=True)
    sources = {"emulated_kernels.cpp": _emulated_kernels(), "emulated_binding.cpp": _emulated_binding()}
    for name, text in sources.items():
        with open(os.path.join(build_dir, name), "w") as f:
            f.write(text)
    load(name="torchrec_emu", sources=[os.path.join(build_dir, n) for n in sources],
         extra_include_paths=[CSRC, HERE, cuda_include_dir()], extra_cflags=["-O2"],
         is_python_module=False, build_directory=build_dir, verbose=False)
    return torch.ops.torchrec_emu
