"""`--tests-part K/N`: one of N disjoint parts of the selected tests, so a suite too long for one
sitting (a 10-minute device call) runs across N (scripts/gpu_check.sh --tests-part).

A test's part is a hash of its node id: the same on every machine and every run, independent of
what else is collected, and spread evenly (neighbours such as a test's cpu/cuda variants or a
matrix's cases land in different parts, so no part gets all of one slow family)."""

import zlib


def parse_part(spec: str) -> tuple[int, int]:
    """`"K/N"` -> (K, N) with 1 <= K <= N; a clear error otherwise."""
    try:
        k, n = (int(x) for x in spec.split("/"))
    except ValueError:
        raise ValueError(f"--tests-part must be K/N (two integers), got {spec!r}") from None
    if not 1 <= k <= n:
        raise ValueError(f"--tests-part K/N needs 1 <= K <= N, got {spec!r}")
    return k, n


def part_of(nodeid: str, parts: int) -> int:
    """The part (1..parts) test ``nodeid`` belongs to."""
    return zlib.crc32(nodeid.encode()) % parts + 1


def split(items: list, spec: str) -> tuple[list, list]:
    """(kept, deselected) of pytest ``items`` for part ``spec``, each in collection order."""
    k, n = parse_part(spec)
    kept = [item for item in items if part_of(item.nodeid, n) == k]
    return kept, [item for item in items if part_of(item.nodeid, n) != k]
