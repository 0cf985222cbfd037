"""Reads what setup.py would build without building it: setup.py runs with setuptools.setup
replaced by a recorder, so tests check the real packages and extension flags."""

import contextlib
import os
import runpy
import shutil
from unittest import mock

import torch.utils.cpp_extension as cpp_extension

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NVCC = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None)


def setup_arguments(env: dict[str, str | None] | None = None, cuda_home: str | None = None) -> dict:
    """The keyword arguments setup.py passes to setuptools.setup. ``env`` sets (or, for None,
    unsets) environment variables for the run; ``cuda_home`` stands in for torch's CUDA_HOME, so
    that with FORCE_CUDA=1 the CUDA extension is described even under a CPU-only torch."""
    recorded: dict = {}
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.dict(os.environ))
        for name, value in (env or {}).items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        stack.callback(os.chdir, os.getcwd())
        os.chdir(ROOT)  # setup.py globs csrc/ relative to the cwd
        stack.enter_context(mock.patch("setuptools.setup", lambda **kwargs: recorded.update(kwargs)))
        stack.enter_context(mock.patch.object(cpp_extension, "CUDA_HOME", cuda_home))
        runpy.run_path(os.path.join(ROOT, "setup.py"), run_name="__main__")
    return recorded


def nvcc_flags(env: dict[str, str | None] | None = None) -> list:
    """The nvcc flags setup.py gives the CUDA extension (before torch's BuildExtension adds its own)."""
    cuda_home = os.path.dirname(os.path.dirname(os.path.realpath(NVCC))) if NVCC else "/usr/local/cuda"
    arguments = setup_arguments(dict(env or {}, FORCE_CUDA="1"), cuda_home=cuda_home)
    (extension,) = arguments["ext_modules"]
    return extension.extra_compile_args["nvcc"]
