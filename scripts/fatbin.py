"""The CUDA device code inside a shared library (its ELF ``.nv_fatbin`` section), read and slimmed:
``keep_archs`` zeroes every cubin built for another GPU architecture, in place, leaving every
header, offset and every other byte of the file as it was. The CUDA runtime picks the cubin of the
device's architecture from each fat binary, so a library slimmed to sm_90 loads and runs on an
H100/H200 as before, while the zeroed images compress to nothing (fbgemm-gpu's CUDA wheel carries
sm_80, sm_90 and sm_100 code: 2.5 GB unpacked; see scripts/fbgemm_cuda_parts.py).

Layout read here (what nvcc writes): the section holds fat binaries one after another, each a
16-byte header (magic 0xBA55ED50, version, header size, size of the entries) followed by entries;
each entry a header (kind: 1 PTX, 2 ELF cubin; its header size; its payload size; at byte 28 the
architecture, e.g. 90) followed by its payload. Anything else in the section is refused, so a
layout this does not know is never half-rewritten.
"""

from __future__ import annotations

import dataclasses
import struct

FATBIN_MAGIC = 0xBA55ED50
KIND_PTX, KIND_CUBIN = 1, 2


class FatbinError(ValueError):
    pass


@dataclasses.dataclass(frozen=True)
class Entry:
    kind: int  # KIND_PTX, KIND_CUBIN or another kind this leaves alone
    arch: int  # e.g. 90 for sm_90
    payload: slice  # its bytes in the file


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


def entries(data: bytes | bytearray, where: slice) -> list[list[Entry]]:
    """The entries of each fat binary in ``data[where]`` (one list per fat binary)."""
    fatbins: list[list[Entry]] = []
    pos, end = where.start, where.stop
    while pos < end:
        if end - pos < 16 or struct.unpack_from("<I", data, pos)[0] != FATBIN_MAGIC:
            if data[pos] != 0:  # only zero padding may lie between fat binaries
                raise FatbinError(f"unrecognised byte at offset {pos:#x} of .nv_fatbin (not a fat binary header)")
            pos += 1
            continue
        _magic, _version, header_size, fat_size = struct.unpack_from("<IHHQ", data, pos)
        at, fat_end = pos + header_size, pos + header_size + fat_size
        if header_size < 16 or fat_end > end:
            raise FatbinError(
                f"the fat binary at offset {pos:#x} has header size {header_size} and size {fat_size}: "
                f"not within its section (which ends at {end:#x})"
            )
        found = []
        while at < fat_end:
            kind, _ver, entry_header, payload_size = _unpack("<HHIQ", data, at, "a fat binary entry")
            (arch,) = _unpack("<I", data, at + 28, "a fat binary entry's architecture")
            payload = slice(at + entry_header, at + entry_header + payload_size)
            if entry_header < 32 or payload.stop > fat_end:
                raise FatbinError(f"the fat binary entry at offset {at:#x} does not fit its fat binary")
            found.append(Entry(kind, arch, payload))
            at = payload.stop
        fatbins.append(found)
        pos = fat_end
    return fatbins


def keep_archs(data: bytearray, keep: set[int], name: str = "the file") -> dict[str, int]:
    """Zeroes, in ``data``, every cubin whose architecture is not in ``keep``; PTX and other kinds
    stay. Checks every fat binary first and changes nothing when one would be left with no code
    for the kept architectures (no cubin of theirs, no PTX at or below the highest). Returns bytes
    kept and zeroed."""
    where = section(data, ".nv_fatbin")
    fatbins = entries(data, where) if where else []
    newest = max(keep)
    for fatbin in fatbins:
        cubins = [e for e in fatbin if e.kind == KIND_CUBIN]
        runnable = any(e.arch in keep for e in cubins) or any(e.kind == KIND_PTX and e.arch <= newest for e in fatbin)
        if cubins and not runnable:
            archs = ", ".join(f"sm_{e.arch}" for e in cubins)
            raise FatbinError(
                f"{name}: a fat binary at offset {cubins[0].payload.start:#x} has code for {archs} only, none for "
                f"{', '.join(f'sm_{a}' for a in sorted(keep))}: slimming it would leave its kernels without code"
            )
    kept = zeroed = 0
    for fatbin in fatbins:
        for e in fatbin:
            size = e.payload.stop - e.payload.start
            if e.kind == KIND_CUBIN and e.arch not in keep:
                data[e.payload] = bytes(size)
                zeroed += size
            else:
                kept += size
    return {"fatbins": len(fatbins), "kept_bytes": kept, "zeroed_bytes": zeroed}
