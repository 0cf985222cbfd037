"""scripts/fatbin.py and scripts/fbgemm_cuda_parts.py, on CPU: slimming a library's device code to
one architecture zeroes exactly the other architectures' cubins (the oracle: the cubins nvcc itself
builds for each architecture, found byte for byte in the object before and after), and the parts
carried to the GPU machine unpack to the slimmed wheel, or are refused, naming the part, when one is
missing or damaged."""

import json
import os
import subprocess
import sys
import zipfile

import pytest

from build_helpers import NVCC, ROOT

sys.path.insert(0, os.path.join(ROOT, "scripts"))
import fatbin
import fbgemm_cuda_parts

needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found")
KERNEL = 'extern "C" __global__ void add_one(float* x, int n) { int i = threadIdx.x; if (i < n) x[i] += 1.f; }\n'


def _nvcc(tmp_path, out: str, *flags: str) -> bytes:
    source = tmp_path / "kernel.cu"
    source.write_text(KERNEL)
    subprocess.run([NVCC, *flags, str(source), "-o", str(tmp_path / out)], check=True, capture_output=True)
    return (tmp_path / out).read_bytes()


def _object(tmp_path, archs: list[int], *flags: str) -> bytes:
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    return _nvcc(tmp_path, "kernel.o", "-c", "-Xcompiler", "-fPIC", *gencode, *flags)


@needs_nvcc
def test_keeping_one_arch_zeroes_the_others_cubins_and_nothing_else(tmp_path):
    before = _object(tmp_path, [80, 90], "--no-compress")
    cubins = {a: _nvcc(tmp_path, f"k{a}.cubin", "-cubin", f"-arch=sm_{a}") for a in (80, 90)}
    at = {a: before.find(c) for a, c in cubins.items()}
    assert all(offset > 0 for offset in at.values()), "nvcc's cubins lie verbatim in the uncompressed object"
    data = bytearray(before)
    stats = fatbin.keep_archs(data, {90})
    assert data.find(cubins[90]) == at[90]
    assert cubins[80] not in data
    changed = [i for i in range(len(data)) if data[i] != before[i]]
    start, stop = at[80], at[80] + len(cubins[80])
    assert changed and start <= changed[0] and changed[-1] < stop + 64  # the sm_80 image (and its padding) alone
    assert not any(data[changed[0] : changed[-1] + 1])
    assert stats["fatbins"] == 1 and stats["zeroed_bytes"] >= len(cubins[80])
    assert stats["kept_bytes"] >= len(cubins[90])


@needs_nvcc
def test_compressed_images_are_zeroed_whole_and_the_kept_one_is_untouched(tmp_path):
    before = _object(tmp_path, [80, 90, 100])
    where = fatbin.section(before, ".nv_fatbin")
    (entries,) = fatbin.entries(before, where)
    assert sorted(e.arch for e in entries if e.kind == fatbin.KIND_CUBIN) == [80, 90, 100]
    data = bytearray(before)
    fatbin.keep_archs(data, {90})
    for e in entries:
        if e.arch == 90:
            assert data[e.payload] == before[e.payload]
        else:
            assert not any(data[e.payload])
    outside = bytearray(before)
    for e in entries:
        if e.arch != 90:
            outside[e.payload] = bytes(e.payload.stop - e.payload.start)
    assert data == outside


@needs_nvcc
def test_a_fat_binary_with_no_code_for_the_kept_arch_is_refused_and_left_as_it_was(tmp_path):
    before = _object(tmp_path, [80])
    data = bytearray(before)
    with pytest.raises(fatbin.FatbinError, match=r"lib\.so: .* code for sm_80 only, none for sm_90"):
        fatbin.keep_archs(data, {90}, name="lib.so")
    assert data == before


@needs_nvcc
def test_ptx_at_or_below_the_kept_arch_counts_as_its_code(tmp_path):
    before = _object(tmp_path, [], "-gencode=arch=compute_80,code=[sm_80,compute_80]")
    data = bytearray(before)
    fatbin.keep_archs(data, {90})  # the driver compiles the PTX for sm_90
    (entries,) = fatbin.entries(data, fatbin.section(data, ".nv_fatbin"))
    ptx = [e for e in entries if e.kind == fatbin.KIND_PTX]
    assert ptx and all(data[e.payload] == before[e.payload] for e in ptx)
    assert all(not any(data[e.payload]) for e in entries if e.kind == fatbin.KIND_CUBIN)


def test_a_file_that_is_not_elf64_is_refused():
    with pytest.raises(fatbin.FatbinError, match="not a 64-bit little-endian ELF"):
        fatbin.keep_archs(bytearray(b"#!/bin/sh\n" * 10), {90})


def _wheel(tmp_path, library: bytes | None, data: bytes = b"") -> str:
    path = tmp_path / "fbgemm_gpu-1.6.0-cp312-cp312-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("fbgemm_gpu/__init__.py", "VERSION = '1.6.0'\n")
        zf.writestr("fbgemm_gpu/data.bin", data)
        if library is not None:
            zf.writestr("fbgemm_gpu/fbgemm_gpu_py.so", library)
        zf.writestr("fbgemm_gpu-1.6.0.dist-info/METADATA", "Name: fbgemm_gpu\nVersion: 1.6.0\n")
    return str(path)


def _pack(tmp_path, library: bytes | None, data: bytes = b"", part_mib: float = 0.001) -> str:
    out = str(tmp_path / "parts")
    wheel = _wheel(tmp_path, library, data)
    assert fbgemm_cuda_parts.main(["pack", "--wheel", wheel, "--out", out, "--part-mib", str(part_mib)]) == 0
    return out


@needs_nvcc
def test_the_parts_unpack_to_the_slimmed_wheel_once(tmp_path, capsys):
    library = _object(tmp_path, [80, 90])
    parts = _pack(tmp_path, library)
    manifest = json.loads((tmp_path / "parts" / "MANIFEST.json").read_text())
    assert len(manifest["parts"]) >= 2 and manifest["archs"] == [90]
    target = tmp_path / "site"
    assert fbgemm_cuda_parts.main(["unpack", "--dir", parts, "--target", str(target)]) == 0
    slimmed = bytearray(library)
    fatbin.keep_archs(slimmed, {90})
    assert (target / "fbgemm_gpu" / "fbgemm_gpu_py.so").read_bytes() == slimmed
    assert (target / "fbgemm_gpu" / "__init__.py").read_text() == "VERSION = '1.6.0'\n"
    assert (target / "fbgemm_gpu-1.6.0.dist-info" / "METADATA").is_file()
    assert sorted(os.listdir(target)) == [".fbgemm_cuda_archive", "fbgemm_gpu", "fbgemm_gpu-1.6.0.dist-info"]
    assert fbgemm_cuda_parts.main(["unpack", "--dir", parts, "--target", str(target)]) == 0
    assert "already unpacked" in capsys.readouterr().out


def test_a_missing_or_damaged_part_is_named_and_nothing_is_unpacked(tmp_path, capsys):
    parts = _pack(tmp_path, None, os.urandom(6000))  # incompressible: several parts of ~1 KiB
    names = sorted(n for n in os.listdir(parts) if n.startswith("part-"))
    assert len(names) >= 3
    target = str(tmp_path / "site")
    os.rename(os.path.join(parts, names[1]), str(tmp_path / "aside"))
    assert fbgemm_cuda_parts.main(["unpack", "--dir", parts, "--target", target]) == fbgemm_cuda_parts.MISSING
    err = capsys.readouterr().err
    assert f"{names[1]} is not here" in err and f"{len(names)} parts in all" in err
    os.rename(str(tmp_path / "aside"), os.path.join(parts, names[1]))
    with open(os.path.join(parts, names[2]), "r+b") as f:
        f.write(b"\xff")
    assert fbgemm_cuda_parts.main(["unpack", "--dir", parts, "--target", target]) == fbgemm_cuda_parts.MISSING
    assert f"{names[2]} is damaged" in capsys.readouterr().err
    assert not os.path.exists(target)


def test_bad_pack_arguments_are_named(tmp_path):
    wheel = _wheel(tmp_path, None)
    with pytest.raises(SystemExit, match=r"--arch must be .* got '9x'"):
        fbgemm_cuda_parts.main(["pack", "--wheel", wheel, "--arch", "9x", "--out", str(tmp_path / "p")])
    with pytest.raises(SystemExit, match="--part-mib must be > 0, got 0"):
        fbgemm_cuda_parts.main(["pack", "--wheel", wheel, "--part-mib", "0", "--out", str(tmp_path / "p")])
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(SystemExit, match="holds files but no MANIFEST.json"):
        fbgemm_cuda_parts.main(["pack", "--wheel", wheel, "--out", str(tmp_path / "mine")])
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
