"""Builds the CUDA kernels of csrc/ (each ``<name>.cu`` with its torch binding ``<name>.cpp``)
for the CPU under the warp emulator, as the op library ``torch.ops.torchrec_emu`` (same schemas
as torchrec_ext): kernel launches become calls into the emulator, and the bindings' kernels
register as CPU kernels. Tests then compare these ops with the CPU ops of torchrec_ext, output
for output and table byte for byte."""

import contextlib
import glob
import os
import re

import torch
from torch.utils.cpp_extension import load

HERE = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join(os.path.dirname(os.path.dirname(HERE)), "csrc")

# Every CUDA kernel file: its kernel launches (a different count means the launch rewrite below
# missed one) and the tensors its binding requires on a GPU (emulated "device" memory is host memory).
KERNEL_FILES = {
    "hash_table_cuda": dict(launches=15, on_device=("digests", "keys")),
    "bloom_cuda": dict(launches=2, on_device=("counters",)),
    "init_rows_cuda": dict(launches=1, on_device=("weights",)),
    "dedup_cuda": dict(launches=4, on_device=("ids_in",)),
}


def cuda_include_dir():
    """The CUDA toolkit's include folder (for cuda_runtime_api.h's types), or None."""
    for root in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if root and os.path.exists(os.path.join(root, "include", "cuda_runtime_api.h")):
            return os.path.join(root, "include")
    return None


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _emulated_kernels(name: str) -> str:
    cu = _read(os.path.join(CSRC, f"{name}.cu"))
    cu = cu.replace("#include <cuda_runtime.h>\n", "")
    prefetch = 'asm volatile("prefetch.global.L2 [%0];" ::"l"(p));'
    cu = cu.replace(prefetch, "emu_prefetch(p);")
    assert "asm" not in cu, f"{name}.cu has inline assembly the emulation does not rewrite"
    cu, launches = re.subn(
        r"(\w+)<<<(.*?),\s*(\w+),\s*0,\s*stream>>>\((.*?)\);",
        r"emu_launch(\2, \3, stream, [&] { \1(\4); });",
        cu,
        flags=re.S,
    )
    want = KERNEL_FILES[name]["launches"]
    assert launches == want, f"expected {want} kernel launches in {name}.cu, rewrote {launches}"
    assert "<<<" not in cu, f"{name}.cu has a launch the emulation's rewrite does not match"
    cu = cu.replace("cudaGetLastError()", "emu_last_error()")
    return '#include "warp_emulator.h"\n' + cu


def _emulated_binding(name: str) -> str:
    cpp = _read(os.path.join(CSRC, f"{name}.cpp"))
    for header in ("CUDAException", "CUDAGuard", "CUDAStream"):
        cpp = cpp.replace(f"#include <c10/cuda/{header}.h>\n", "")
    cpp = cpp.replace("#include <torch/library.h>\n", '#include <torch/library.h>\n#include "cuda_stubs.h"\n')
    for tensor in KERNEL_FILES[name]["on_device"]:
        assert f"{tensor}.is_cuda()" in cpp, f"{name}.cpp no longer checks {tensor}.is_cuda()"
        cpp = cpp.replace(f"{tensor}.is_cuda()", f"({tensor}.is_cuda() || {tensor}.is_cpu())")
    assert "TORCH_LIBRARY_IMPL(torchrec_ext, CUDA, m)" in cpp
    return cpp.replace("TORCH_LIBRARY_IMPL(torchrec_ext, CUDA, m)", "TORCH_LIBRARY_IMPL(torchrec_emu, CPU, m)")


def _schemas() -> str:
    schemas = _read(os.path.join(CSRC, "ops.cpp"))
    start = schemas.index("TORCH_LIBRARY(torchrec_ext, m)")
    schemas = schemas[
        start : schemas.index("\n}\n", start) + 3
    ]  # (the block only: the module's Python entry points follow)
    return "#include <torch/library.h>\n" + schemas.replace(
        "TORCH_LIBRARY(torchrec_ext, m)", "TORCH_LIBRARY(torchrec_emu, m)"
    )


@contextlib.contextmanager
def reversed_warps():
    """Launches inside the block run their warps last to first, and each warp its lanes 31 to 0."""
    os.environ["TORCHREC_EMU_REVERSE_WARPS"] = "1"  # read by the emulator at each launch
    try:
        yield
    finally:
        del os.environ["TORCHREC_EMU_REVERSE_WARPS"]


_built = []  # a process loads the library once (its op namespace can be registered once)


def build(build_dir: str):
    """Generates and compiles the emulated library in build_dir (once per process: later calls
    return the loaded one); returns torch.ops.torchrec_emu."""
    import torchrec_ext  # noqa: F401  (the emulated hash_restore calls torchrec_ext's CPU kernel)

    if _built:
        return torch.ops.torchrec_emu
    cu_files = {os.path.basename(p)[:-3] for p in glob.glob(os.path.join(CSRC, "*.cu"))}
    assert cu_files == set(KERNEL_FILES), f"csrc/ has CUDA files {sorted(cu_files)}: list each in KERNEL_FILES"
    os.makedirs(build_dir, exist_ok=True)
    sources = {"emulated_schemas.cpp": _schemas()}
    for name in KERNEL_FILES:
        sources[f"emulated_{name}_kernels.cpp"] = _emulated_kernels(name)
        sources[f"emulated_{name}_binding.cpp"] = _emulated_binding(name)
    for name, text in sources.items():
        with open(os.path.join(build_dir, name), "w") as f:
            f.write(text)
    load(
        name="torchrec_emu",
        sources=[os.path.join(build_dir, n) for n in sources],
        extra_include_paths=[CSRC, HERE, cuda_include_dir()],
        extra_cflags=["-O2"],
        is_python_module=False,
        build_directory=build_dir,
        verbose=False,
    )
    _built.append(build_dir)
    return torch.ops.torchrec_emu
