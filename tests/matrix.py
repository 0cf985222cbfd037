"""Test matrices too large for CI run whole only when asked.

A parametrized drill lists every case; `ci_subset` keeps, in an ordinary run, the cases its
predicate picks (chosen so every value of every axis still runs at least once) and marks the
others skipped with the reason below, so they show in `-ra` and are never silently lost.
`TORCHREC_EXT_FULL_MATRIX=1` (set by scripts/gpu_check.sh and scripts/full_matrix.sh) runs all.
"""

import os
from collections.abc import Callable, Iterable

import pytest

FULL_MATRIX = os.environ.get("TORCHREC_EXT_FULL_MATRIX") == "1"
REASON = "in the full matrix only (TORCHREC_EXT_FULL_MATRIX=1; summary: benchmarks/results/full_matrix.md)"


def ci_subset(cases: Iterable[tuple], keep: Callable[..., bool]) -> list:
    """`cases` as pytest params: each one `keep(*case)` refuses is skipped unless FULL_MATRIX."""
    out = []
    for case in cases:
        case = case if isinstance(case, tuple) else (case,)
        marks = () if FULL_MATRIX or keep(*case) else (pytest.mark.skip(reason=REASON),)
        out.append(pytest.param(*case, marks=marks))
    return out
