"""scripts/fatbin.py and scripts/fbgemm_cuda_parts.py, on CPU: slimming a library's device code to
one architecture leaves the fat binary nvcc itself builds for that architecture alone (byte for
byte, the oracle), which NVIDIA's cuobjdump reads as such, and the parts
carried to the GPU machine unpack to the slimmed wheel, or are refused, naming the part, when one is
missing or damaged."""

import json
import os
import struct
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


def _fatbin_bytes(data: bytes | bytearray) -> bytes:
    where = fatbin.section(data, ".nv_fatbin")
    return bytes(data[where])


def _slimmed_is_nvccs_own(slimmed: bytearray, before: bytes, alone: bytes) -> None:
    """``slimmed`` (``before`` slimmed) holds in its .nv_fatbin section the fat binary nvcc builds
    for the kept architectures alone (``alone``'s section), then zeros; nothing else changed."""
    where = fatbin.section(slimmed, ".nv_fatbin")
    assert where == fatbin.section(before, ".nv_fatbin")
    own = _fatbin_bytes(alone)
    assert bytes(slimmed[where.start : where.start + len(own)]) == own
    assert not any(slimmed[where.start + len(own) : where.stop])
    assert slimmed[: where.start] == before[: where.start] and slimmed[where.stop :] == before[where.stop :]


@needs_nvcc
def test_keeping_one_arch_leaves_the_fat_binary_nvcc_builds_for_it_alone(tmp_path):
    before = _object(tmp_path, [80, 90], "--no-compress")
    alone = _object(tmp_path, [90], "--no-compress")
    cubins = {a: _nvcc(tmp_path, f"k{a}.cubin", "-cubin", f"-arch=sm_{a}") for a in (80, 90)}
    assert all(c in before for c in cubins.values()), "nvcc's cubins lie verbatim in the uncompressed object"
    data = bytearray(before)
    stats = fatbin.keep_archs(data, {90})
    _slimmed_is_nvccs_own(data, before, alone)
    assert cubins[90] in data and cubins[80] not in data
    assert stats["fatbins"] == 1 and stats["kept_bytes"] >= len(cubins[90])
    assert stats["dropped_bytes"] == len(_fatbin_bytes(before)) - len(_fatbin_bytes(alone))


@needs_nvcc
def test_compressed_images_are_dropped_whole_and_the_kept_one_moves_unchanged(tmp_path):
    before = _object(tmp_path, [80, 90, 100])
    (fat,) = fatbin.fat_binaries(before, fatbin.section(before, ".nv_fatbin"))
    assert sorted(e.arch for e in fat.entries if e.kind == fatbin.KIND_CUBIN) == [80, 90, 100]
    data = bytearray(before)
    fatbin.keep_archs(data, {90})
    _slimmed_is_nvccs_own(data, before, _object(tmp_path, [90]))
    (slim,) = fatbin.fat_binaries(data, fatbin.section(data, ".nv_fatbin"))
    assert slim.start == fat.start and [e.arch for e in slim.entries] == [90]
    (kept,) = [e for e in fat.entries if e.arch == 90]
    assert data[slim.entries[0].payload] == before[kept.payload]


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
    _slimmed_is_nvccs_own(data, before, _object(tmp_path, [], "-gencode=arch=compute_80,code=compute_80"))


@needs_nvcc
@pytest.mark.skipif(fatbin.find_cuobjdump() is None, reason="cuobjdump not found (scripts/setup.sh installs it)")
def test_cuobjdump_reads_a_slimmed_object_as_one_built_for_sm_90_alone(tmp_path):
    """NVIDIA's own reader as the oracle: it lists the kept cubin only, and extracts it byte for
    byte as nvcc builds it. (Zeroing the dropped images in place, the first slimming, made it
    refuse the file.)"""
    cuobjdump = fatbin.find_cuobjdump()
    data = bytearray(_object(tmp_path, [80, 90, 100]))
    fatbin.keep_archs(data, {90})
    slimmed = tmp_path / "slimmed.o"
    slimmed.write_bytes(data)
    assert fatbin.cuobjdump_listing(cuobjdump, str(slimmed)) == ["sm_90"]
    out = tmp_path / "x"
    out.mkdir()
    subprocess.run([cuobjdump, "-xelf", "all", str(slimmed)], cwd=out, check=True, capture_output=True)
    (extracted,) = list(out.iterdir())
    assert extracted.read_bytes() == _nvcc(tmp_path, "k90.cubin", "-cubin", "-arch=sm_90")
    zeroed_in_place = bytearray(_object(tmp_path, [80, 90, 100]))
    for fat in fatbin.fat_binaries(zeroed_in_place, fatbin.section(zeroed_in_place, ".nv_fatbin")):
        for e in fat.entries:
            if e.arch != 90:
                zeroed_in_place[e.payload] = bytes(e.payload.stop - e.payload.start)
    slimmed.write_bytes(zeroed_in_place)
    with pytest.raises(fatbin.FatbinError, match="cuobjdump cannot read"):
        fatbin.cuobjdump_listing(cuobjdump, str(slimmed))
    assert fatbin.cuobjdump_listing(cuobjdump, str(tmp_path / "kernel.cu")) == []  # no device code


def _fat_binary(images: list[tuple[int, int, bytes]], header_size: int = 16) -> bytes:
    """A fat binary as nvcc lays one out: its header, then each (kind, arch, payload) entry's
    64-byte header (kind, version, header size, payload size; the arch at byte 28) and payload."""
    body = b""
    for kind, arch, payload in images:
        entry = struct.pack("<HHIQ", kind, 0x0101, 64, len(payload)).ljust(28, b"\0") + struct.pack("<I", arch)
        body += entry.ljust(64, b"\0") + payload
    return struct.pack("<IHHQ", fatbin.FATBIN_MAGIC, 1, header_size, len(body)).ljust(header_size, b"\0") + body


def _elf(fatbin_section: bytes) -> bytes:
    """A minimal ELF64 file whose one named section is ``.nv_fatbin`` (at offset 0x100)."""
    names = b"\0.shstrtab\0.nv_fatbin\0"
    at = 0x100
    shoff = at + len(fatbin_section)
    header = b"\x7fELF\x02\x01\x01".ljust(0x28, b"\0") + struct.pack("<Q", shoff)
    header = header.ljust(0x3A, b"\0") + struct.pack("<HHH", 64, 3, 1)
    sections = [
        bytes(64),
        struct.pack("<IIQQQQIIQQ", 1, 3, 0, 0, 64, len(names), 0, 0, 1, 0),
        struct.pack("<IIQQQQIIQQ", 11, 1, 2, 0, at, len(fatbin_section), 0, 0, 8, 0),
    ]
    return (header.ljust(64, b"\0") + names).ljust(at, b"\0") + fatbin_section + b"".join(sections)


def test_fat_binaries_one_after_another_with_padding_are_slimmed_each():
    archs = {0: (80, 90, 100), 1: (90, 100)}  # (the second has PTX for compute_80 instead of an sm_80 cubin)
    payloads = {(f, a): bytes([f * 16 + a // 10]) * (40 + a) for f in archs for a in archs[f]}
    first = _fat_binary([(fatbin.KIND_CUBIN, a, payloads[0, a]) for a in (80, 90, 100)])
    second = _fat_binary(
        [(fatbin.KIND_PTX, 80, b"ptx text"), *[(fatbin.KIND_CUBIN, a, payloads[1, a]) for a in (90, 100)]]
    )
    before = _elf(first + bytes(8) + second)
    data = bytearray(before)
    stats = fatbin.keep_archs(data, {90})
    where = fatbin.section(data, ".nv_fatbin")
    alone = [
        _fat_binary([(fatbin.KIND_CUBIN, 90, payloads[0, 90])]),
        _fat_binary([(fatbin.KIND_PTX, 80, b"ptx text"), (fatbin.KIND_CUBIN, 90, payloads[1, 90])]),
    ]
    expected = alone[0].ljust(len(first) + 8, b"\0") + alone[1].ljust(len(second), b"\0")
    assert bytes(data[where]) == expected  # each where it was, its own header's size the new one
    assert data[: where.start] == before[: where.start] and data[where.stop :] == before[where.stop :]
    assert stats["fatbins"] == 2
    assert stats["dropped_bytes"] == len(first) + len(second) - sum(len(a) for a in alone)
    assert stats["kept_bytes"] == len(payloads[0, 90]) + len(payloads[1, 90]) + len(b"ptx text")


def test_an_entry_that_would_move_off_its_alignment_is_refused_and_left_as_it_was():
    section = _fat_binary([(fatbin.KIND_CUBIN, 80, b"a" * 60), (fatbin.KIND_CUBIN, 90, b"b" * 64)])
    before = _elf(section)
    data = bytearray(before)
    with pytest.raises(fatbin.FatbinError, match="would move 124 bytes, off its 8-byte alignment"):
        fatbin.keep_archs(data, {90})
    assert data == before


@pytest.mark.parametrize(
    "damage, message",
    [
        ("junk", "unrecognised byte"),
        ("header_size", "header size 0"),
        ("entry_past_end", "does not fit its fat binary"),
        ("truncated", "past the end of the file"),
    ],
)
def test_a_damaged_layout_is_refused_and_left_as_it_was(damage, message):
    good = _fat_binary([(fatbin.KIND_CUBIN, 80, b"a" * 64), (fatbin.KIND_CUBIN, 90, b"b" * 64)])
    if damage == "junk":
        section = good + b"\x07" + good
    elif damage == "header_size":  # (a header size of 0 used to loop forever)
        section = struct.pack("<IHHQ", fatbin.FATBIN_MAGIC, 1, 0, 0) + good
    elif damage == "entry_past_end":
        section = good[:16] + struct.pack("<HHIQ", 2, 0x0101, 64, 10**6) + good[32:]
    else:
        section = good
    elf = _elf(section)
    before = bytearray(elf[:-100] if damage == "truncated" else elf)
    data = bytearray(before)
    with pytest.raises(fatbin.FatbinError, match=message):
        fatbin.keep_archs(data, {90})
    assert data == before


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
        first = f.read(1)
        f.seek(0)
        f.write(bytes([first[0] ^ 0xFF]))  # (always a change)
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


def test_a_cuobjdump_listing_other_than_the_kept_cubins_is_refused():
    fbgemm_cuda_parts.check_listing(["sm_90a", "sm_90"], 2, {90}, "lib.so")
    with pytest.raises(fatbin.FatbinError, match=r"lib\.so: cuobjdump lists 2 cubin\(s\) \(sm_100a, sm_90a\)"):
        fbgemm_cuda_parts.check_listing(["sm_90a", "sm_100a"], 2, {90}, "lib.so")
    with pytest.raises(fatbin.FatbinError, match=r"lists 1 cubin\(s\) \(sm_90\) after slimming, expected the 2 kept"):
        fbgemm_cuda_parts.check_listing(["sm_90"], 2, {90}, "lib.so")
