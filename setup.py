"""Builds torchrec_ext._C: the C++ CPU kernels always, plus the CUDA kernels when torch was
built with CUDA and nvcc is found (or FORCE_CUDA=1). Says which it did.

The toolkit is torch's CUDA_HOME: $CUDA_HOME (or $CUDA_PATH), else the folder above the nvcc on
PATH, else /usr/local/cuda (torch.utils.cpp_extension._find_cuda_home). GPU architectures: sm_90
SASS plus compute_90 PTX (which newer GPUs JIT-compile) by default; TORCH_CUDA_ARCH_LIST
("9.0+PTX", "8.0;9.0", ...) when set, turned into -gencode flags by torch's BuildExtension;
TORCHREC_EXT_NVCC_ARCH (nvcc flags, space-separated) over both."""

import glob
import os
import shlex

import torch
from setuptools import find_packages, setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

ROOT = os.path.dirname(os.path.abspath(__file__))


def _want_cuda() -> bool:
    if os.environ.get("FORCE_CUDA", "0") == "1":
        return True
    return torch.version.cuda is not None and CUDA_HOME is not None


def _nvcc_arch_flags() -> list:
    if "TORCHREC_EXT_NVCC_ARCH" in os.environ:
        return shlex.split(os.environ["TORCHREC_EXT_NVCC_ARCH"])
    if os.environ.get("TORCH_CUDA_ARCH_LIST"):
        return []  # BuildExtension derives -gencode flags from the list when none are given
    return ["-gencode=arch=compute_90,code=[sm_90,compute_90]"]


def _extension():
    cpu_sources = sorted(glob.glob("csrc/*.cpp"))
    cuda_binding = [s for s in cpu_sources if s.endswith("_cuda.cpp")]
    cpu_sources = [s for s in cpu_sources if s not in cuda_binding]
    # at::parallel_for is a header template: without -fopenmp it compiles to a serial loop.
    # The OpenMP runtime it links (libgomp.so.1) is the one torch already loaded.
    # No FMA contraction: the AVX-512 and baseline clones of the row loops give the same bits.
    # No errno from sqrt: it lets the optimizer loops vectorise (an errno-setting sqrt keeps a
    # scalar branch per element); IEEE sqrt and division round the same in vector form.
    cxx_flags = ["-O3", "-fvisibility=hidden", "-fopenmp", "-ffp-contract=off", "-fno-math-errno"]
    link_flags = ["-fopenmp"]
    if _want_cuda():
        kernels = sorted(glob.glob("csrc/*.cu"))  # (by absolute path at build time: _BuildExtension)
        sources = cpu_sources + cuda_binding + kernels
        print(f"torchrec_ext: building CPU + CUDA kernels ({len(sources)} sources, CUDA_HOME={CUDA_HOME})")
        return CUDAExtension(
            "torchrec_ext._C",
            sources,
            include_dirs=[os.path.join(ROOT, "csrc")],
            define_macros=[("TORCHREC_EXT_WITH_CUDA", "1")],
            extra_link_args=link_flags,
            extra_compile_args={
                "cxx": cxx_flags,
                "nvcc": ["-O3", "--expt-relaxed-constexpr"] + _nvcc_arch_flags(),
            },
        )
    print(
        f"torchrec_ext: building CPU kernels only ({len(cpu_sources)} sources; "
        f"torch CUDA={torch.version.cuda}, nvcc home={CUDA_HOME}; FORCE_CUDA=1 to force CUDA)"
    )
    return CppExtension(
        "torchrec_ext._C",
        cpu_sources,
        include_dirs=[os.path.join(ROOT, "csrc")],
        extra_compile_args={"cxx": cxx_flags},
        extra_link_args=link_flags,
    )


class _BuildExtension(BuildExtension):
    def build_extensions(self) -> None:
        # The kernels by absolute path: their objects then land apart from their bindings' (x_cuda.cpp
        # and x_cuda.cu would both make csrc/x_cuda.o, which ninja refuses: "multiple rules generate").
        # Here only, and put back after: setuptools refuses an absolute path among setup()'s
        # arguments (egg_info, build_py, a wheel's build all read them, some after this).
        relative = {id(ext): ext.sources for ext in self.extensions}
        for ext in self.extensions:
            ext.sources = [os.path.join(ROOT, s) if s.endswith(".cu") else s for s in ext.sources]
        try:
            super().build_extensions()
        finally:
            for ext in self.extensions:
                ext.sources = relative[id(ext)]


setup(
    packages=find_packages(include=["torchrec_ext", "torchrec_ext.*"]),
    ext_modules=[_extension()],
    cmdclass={"build_ext": _BuildExtension.with_options(use_ninja=True)},
)
