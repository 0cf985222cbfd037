"""The one registration table: each backend's ``KERNELS`` (op -> device type -> kernel) against
what ``csrc/`` registers and what the dispatcher serves, and ``ops.register_python_kernels``
refusing a second kernel for an (op, device) instead of silently replacing one."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from torchrec_ext import csrc_kernels, ops, torch_kernels, triton_kernels

CSRC = Path(__file__).resolve().parents[1] / "csrc"


def _schema_ops():
    return re.findall(r'm\.def\(\s*"(\w+)\(', (CSRC / "ops.cpp").read_text())


def _registered_in_csrc() -> dict[str, dict[str, str]]:
    """{op: {device: file}} from every ``TORCH_LIBRARY_IMPL(torchrec_ext, <KEY>, m) { m.impl(...) }``."""
    out: dict[str, dict[str, str]] = {}
    for path in sorted(CSRC.glob("*.cpp")):
        for key, body in re.findall(
            r"TORCH_LIBRARY_IMPL\(torchrec_ext,\s*(\w+),\s*m\)\s*\{(.*?)\n?\}", path.read_text(), re.S
        ):
            for op in re.findall(r'm\.impl\("(\w+)"', body):
                out.setdefault(op, {})[key.lower()] = f"csrc/{path.name}"
    return out


def test_the_csrc_table_is_what_csrc_registers():
    assert _registered_in_csrc() == csrc_kernels.KERNELS


def test_every_op_has_a_cpu_kernel_and_the_dispatcher_serves_the_table():
    schema = _schema_ops()
    assert sorted(schema) == sorted(csrc_kernels.KERNELS)
    cuda_build = ops.has_kernel("hash_find", torch.device("cuda"))
    for op, by_device in csrc_kernels.KERNELS.items():
        assert "cpu" in by_device, op
        assert ops.has_kernel(op, torch.device("cpu")), op
        if cuda_build and "cuda" in by_device:
            assert ops.has_kernel(op, torch.device("cuda")), op


def test_python_tables_name_schema_ops_and_never_a_csrc_kernel():
    schema = set(_schema_ops())
    seen = {}
    for table in (torch_kernels.KERNELS, triton_kernels.KERNELS):
        for op, by_device in table.items():
            assert op in schema, op
            for device, kernel in by_device.items():
                assert callable(kernel)
                assert device not in csrc_kernels.KERNELS[op], f"{op} on {device}: C++ and Python both"
                assert (op, device) not in seen, f"{op} on {device}: two Python kernels"
                seen[(op, device)] = kernel
    # every GPU gap of the C++ library is filled by torch ops (Triton adds the embedding kernels),
    # but for the serving index's ops (serving modules run on CPU only) and guarded_copy_rows and
    # pread_rows (a backing file's mapping and the file itself are on the host)
    no_cuda = {op for op, by_device in csrc_kernels.KERNELS.items() if "cuda" not in by_device}
    cpu_only = {"hash_place", "serving_index_update", "serving_find", "guarded_copy_rows", "pread_rows"}
    assert set(torch_kernels.KERNELS) | {"pooled_lookup", "sequence_lookup", "fused_update"} | cpu_only >= no_cuda


def test_registering_a_second_kernel_is_refused(monkeypatch):
    calls = []
    monkeypatch.setattr(torch_kernels, "KERNELS", {"hash_find": {"cpu": lambda *a: calls.append(a)}})
    monkeypatch.setattr(torch.library, "register_kernel", lambda *a, **k: calls.append(a))
    with pytest.raises(RuntimeError, match="hash_find has two cpu kernels: csrc/hash_table_cpu.cpp"):
        ops.register_python_kernels("cpu")
    assert calls == []  # nothing registered


def test_the_loop_registers_each_python_kernel_once(monkeypatch):
    registered = []
    monkeypatch.setattr(
        torch.library, "register_kernel", lambda name, device, fn: registered.append((name, device, fn))
    )
    ops.register_python_kernels("cuda")
    want = [
        (f"torchrec_ext::{op}", "cuda", by_device["cuda"])
        for table in (torch_kernels.KERNELS, triton_kernels.KERNELS)
        for op, by_device in table.items()
    ]
    assert registered == want
    assert ("torchrec_ext::route_bucketize", "cuda", torch_kernels.route_bucketize) in registered


def test_two_python_backends_for_one_op_are_refused_before_anything_is_registered(monkeypatch):
    registered = []

    def first(*args):
        return None

    def second(*args):
        return None

    tables = [{"init_rows": {"cuda": first}, "route_bucketize": {"cuda": first}}, {"route_bucketize": {"cuda": second}}]
    monkeypatch.setattr(ops, "python_kernel_tables", lambda: tables)
    monkeypatch.setattr(torch.library, "register_kernel", lambda *a: registered.append(a))
    with pytest.raises(RuntimeError, match=r"route_bucketize has two cuda kernels: .*first and .*second"):
        ops.register_python_kernels("cuda")
    assert registered == []  # init_rows, valid, was not registered either
