"""Triton GPU kernels of torchrec_ext, installed as ``torchrec_ext.triton_kernels``.

setup.py maps this folder into the torchrec_ext package. Run from the repository root, though,
Python would also find it as a top-level ``triton_kernels`` and shadow Triton's unrelated
distribution of that name; the guard below steps aside in that case and loads the real one.
"""
import sys as _sys

if __name__ == "triton_kernels":
    import importlib.machinery as _machinery
    import importlib.util as _util
    import os as _os

    _repo_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
    _path = [p for p in _sys.path if _os.path.abspath(p or _os.curdir) != _repo_root]
    _spec = _machinery.PathFinder.find_spec("triton_kernels", _path)
    del _sys.modules[__name__]
    if _spec is None:
        raise ModuleNotFoundError("No module named 'triton_kernels'", name="triton_kernels")
    _real = _util.module_from_spec(_spec)
    _sys.modules["triton_kernels"] = _real  # the import statement returns this module
    _spec.loader.exec_module(_real)
