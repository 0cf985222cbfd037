"""The CUDA device code inside a shared library (its ELF ``.nv_fatbin`` section), read and slimmed:
``keep_archs`` drops, in place, every cubin built for another GPU architecture from each fat
binary. The entries kept move up byte for byte, the fat binary's header records its new size, and
the bytes it no longer uses become zero padding. Each fat binary still starts where it did (the
host code registers it by that address) and every other byte of the file stays as it was, so a
slimmed fat binary is the one nvcc writes for the kept architectures alone (the tests' oracle), a
library slimmed to sm_90 loads and runs on an H100/H200 as before, and the padding compresses to
nothing (fbgemm-gpu's CUDA wheel carries sm_80, sm_90 and sm_100 code: 2.5 GB unpacked; see
scripts/fbgemm_cuda_parts.py). (Zeroing the dropped images where they lay, the first way this was
done, left entries whose headers name images that are not there: cuobjdump refuses such a
library, "Invalid ELF", and the driver's loader was never asked.)

Layout read here (what nvcc writes): the section holds fat binaries one after another, each a
16-byte header (magic 0xBA55ED50, version, header size, size of the entries) followed by entries;
each entry a header (kind: 1 PTX, 2 ELF cubin; its header size; its payload size; at byte 28 the
architecture, e.g. 90) followed by its payload. Anything else in the section is refused, so a
layout this does not know is never half-rewritten.

``cuobjdump_listing`` asks NVIDIA's cuobjdump (on PATH, or from the ``nvidia-cuda-cuobjdump``
wheel) which cubins a library holds: the independent check of a slimmed library, here and in pack.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import shutil
import struct
import subprocess
import sys

FATBIN_MAGIC = 0xBA55ED50
KIND_PTX, KIND_CUBIN = 1, 2
HEADER = struct.Struct("<IHHQ")  # magic, version, header size, size of the entries
ENTRY_ALIGN = 8  # entries start 8-byte aligned in the section (nvcc's layout); a move keeps that


class FatbinError(ValueError):
    pass


@dataclasses.dataclass(frozen=True)
class Entry:
    kind: int  # KIND_PTX, KIND_CUBIN or another kind this leaves alone
    arch: int  # e.g. 90 for sm_90
    header: slice  # its header's bytes in the file
    payload: slice  # its image's bytes in the file


@dataclasses.dataclass(frozen=True)
class FatBinary:
    start: int  # its header's offset in the file
    header_size: int
    size: int  # of its entries, as its header says
    entries: list[Entry]

    @property
    def body(self) -> slice:  # its entries' bytes in the file
        return slice(self.start + self.header_size, self.start + self.header_size + self.size)


def _unpack(fmt: str, data: bytes | bytearray, offset: int, what: str) -> tuple:
    if offset < 0 or offset + struct.calcsize(fmt) > len(data):
        raise FatbinError(f"{what} at offset {offset:#x} lies past the end of the file ({len(data):#x} bytes)")
    return struct.unpack_from(fmt, data, offset)


def section(data: bytes | bytearray, name: str) -> slice | None:
    """Where the named section's bytes lie in an ELF64 little-endian file, or None without one."""
    if len(data) < 64 or data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise FatbinError("not a 64-bit little-endian ELF file")
    (shoff,) = _unpack("<Q", data, 0x28, "the section header offset")
    shentsize, shnum, shstrndx = _unpack("<HHH", data, 0x3A, "the section header sizes")
    if shoff == 0 or shnum == 0:
        return None
    if shentsize < 64 or shstrndx >= shnum:
        raise FatbinError(f"bad section headers (entry size {shentsize}, names at {shstrndx} of {shnum})")
    headers = [_unpack("<IIQQQQ", data, shoff + i * shentsize, f"section header {i}") for i in range(shnum)]
    names_at = headers[shstrndx][4]
    for name_off, _type, _flags, _addr, offset, size in headers:
        start = names_at + name_off
        end = data.find(b"\0", start)
        if start >= len(data) or end < 0:
            raise FatbinError(f"a section name at offset {start:#x} runs past the end of the file")
        if bytes(data[start:end]) == name.encode():
            if offset + size > len(data):
                raise FatbinError(f"section {name} ({offset:#x} + {size:#x}) runs past the end of the file")
            return slice(offset, offset + size)
    return None


def fat_binaries(data: bytes | bytearray, where: slice) -> list[FatBinary]:
    """The fat binaries in ``data[where]``, one after another, zero padding between them allowed."""
    found: list[FatBinary] = []
    pos, end = where.start, where.stop
    while pos < end:
        if end - pos < HEADER.size or struct.unpack_from("<I", data, pos)[0] != FATBIN_MAGIC:
            if data[pos] != 0:  # only zero padding may lie between fat binaries
                raise FatbinError(f"unrecognised byte at offset {pos:#x} of .nv_fatbin (not a fat binary header)")
            pos += 1
            continue
        _magic, _version, header_size, fat_size = HEADER.unpack_from(data, pos)
        at, fat_end = pos + header_size, pos + header_size + fat_size
        if header_size < HEADER.size or fat_end > end:
            raise FatbinError(
                f"the fat binary at offset {pos:#x} has header size {header_size} and size {fat_size}: "
                f"not within its section (which ends at {end:#x})"
            )
        entries = []
        while at < fat_end:
            kind, _ver, entry_header, payload_size = _unpack("<HHIQ", data, at, "a fat binary entry")
            (arch,) = _unpack("<I", data, at + 28, "a fat binary entry's architecture")
            payload = slice(at + entry_header, at + entry_header + payload_size)
            if entry_header < 32 or payload.stop > fat_end:
                raise FatbinError(f"the fat binary entry at offset {at:#x} does not fit its fat binary")
            entries.append(Entry(kind, arch, slice(at, payload.start), payload))
            at = payload.stop
        found.append(FatBinary(pos, header_size, fat_size, entries))
        pos = fat_end
    return found


def _dropped(entry: Entry, keep: set[int]) -> bool:
    return entry.kind == KIND_CUBIN and entry.arch not in keep


def keep_archs(data: bytearray, keep: set[int], name: str = "the file") -> dict[str, int]:
    """Drops from ``data``'s fat binaries every cubin whose architecture is not in ``keep`` (see the
    module docstring); PTX and other kinds stay. Checks every fat binary first and changes nothing
    when one would be left with no code for the kept architectures (no cubin of theirs, no PTX at or
    below the highest) or an entry would move off its alignment. Returns the count of fat binaries,
    the cubins kept, the bytes of the images kept, and the bytes dropped (images and their entries'
    headers)."""
    where = section(data, ".nv_fatbin")
    fatbins = fat_binaries(data, where) if where else []
    newest = max(keep)
    for fatbin in fatbins:
        cubins = [e for e in fatbin.entries if e.kind == KIND_CUBIN]
        runnable = any(e.arch in keep for e in cubins) or any(
            e.kind == KIND_PTX and e.arch <= newest for e in fatbin.entries
        )
        if cubins and not runnable:
            archs = ", ".join(f"sm_{e.arch}" for e in cubins)
            raise FatbinError(
                f"{name}: a fat binary at offset {fatbin.start:#x} has code for {archs} only, none for "
                f"{', '.join(f'sm_{a}' for a in sorted(keep))}: slimming it would leave its kernels without code"
            )
        shift = 0
        for e in fatbin.entries:
            if _dropped(e, keep):
                shift += e.payload.stop - e.header.start
            elif shift % ENTRY_ALIGN:
                raise FatbinError(
                    f"{name}: the entry at offset {e.header.start:#x} would move {shift} bytes, off its "
                    f"{ENTRY_ALIGN}-byte alignment: not slimming a layout nvcc does not write"
                )
    kept = dropped = cubins_kept = 0
    for fatbin in fatbins:
        body = fatbin.body
        kept_entries = [e for e in fatbin.entries if not _dropped(e, keep)]
        cubins_kept += sum(e.kind == KIND_CUBIN for e in kept_entries)
        compacted = b"".join(bytes(data[e.header.start : e.payload.stop]) for e in kept_entries)
        kept += sum(e.payload.stop - e.payload.start for e in kept_entries)
        dropped += (body.stop - body.start) - len(compacted)
        data[body] = compacted + bytes(body.stop - body.start - len(compacted))
        struct.pack_into("<Q", data, fatbin.start + 8, len(compacted))
    return {"fatbins": len(fatbins), "cubins_kept": cubins_kept, "kept_bytes": kept, "dropped_bytes": dropped}


def find_cuobjdump() -> str | None:
    """NVIDIA's cuobjdump: on PATH, beside nvcc, or from the ``nvidia-cuda-cuobjdump`` wheel in this
    interpreter's environment; None without one."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    nvcc = shutil.which("nvcc")
    candidates = [os.path.join(os.path.dirname(os.path.realpath(nvcc)), "cuobjdump")] if nvcc else []
    for site in sys.path:
        candidates += sorted(glob.glob(os.path.join(site, "nvidia", "cu*", "bin", "cuobjdump")))
    return next((c for c in candidates if os.access(c, os.X_OK)), None)


def cuobjdump_listing(cuobjdump: str, path: str) -> list[str]:
    """The architectures (e.g. "sm_90a") of the cubins cuobjdump finds in ``path``, in order (none
    in a file without device code); a FatbinError with cuobjdump's own words when it cannot read the
    file's device code."""
    run = subprocess.run([cuobjdump, "--list-elf", path], capture_output=True, text=True)
    if run.returncode != 0 and "does not contain device code" in run.stderr:
        return []
    if run.returncode != 0:
        said = (run.stderr or run.stdout).strip().splitlines()
        raise FatbinError(f"cuobjdump cannot read {path}: {said[-1] if said else f'exit {run.returncode}'}")
    return re.findall(r"\.(sm_\d+[a-z]?)\.cubin", run.stdout)
