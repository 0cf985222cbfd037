"""Checks of a checkpoint's entries before anything is loaded: the right kind, shape and finite
values (``_checked``), distinct ids (``_check_distinct``). Shared by the tables' state, the
admission's pending ids, deltas and inference conversion, so each names a bad entry the same way.
"""

from __future__ import annotations

import torch
from torch import Tensor

from torchrec_ext.table import INT_DTYPES


def _checked(
    where: str,
    key: str,
    value: object,
    kind: str,
    shape: tuple[int, ...] | None,
    ids: Tensor | None = None,
    non_negative: bool = False,
) -> Tensor:
    """A checkpoint entry as a tensor of the right kind ("int" / "float") and shape (None: any
    1-D); float entries must be finite (and >= 0 when non_negative). ``ids`` name bad rows."""
    if not isinstance(value, Tensor):
        raise TypeError(f"{where} {key} must be a tensor, got {type(value).__name__}")
    if kind == "int" and value.dtype not in INT_DTYPES:
        raise TypeError(f"{where} {key} must be an integer tensor, got {value.dtype}")
    if kind == "float" and not value.dtype.is_floating_point:
        raise TypeError(f"{where} {key} must be a floating-point tensor, got {value.dtype}")
    if (value.dim() != 1) if shape is None else (tuple(value.shape) != tuple(shape)):
        want = "1-D" if shape is None else list(shape)
        raise ValueError(
            f"{where} {key} must be {want}"
            + (" (one row per weight_id)" if ids is not None else "")
            + f", got {list(value.shape)}"
        )
    if kind == "float":
        at = first_non_finite(value)
        if at is None and non_negative and value.numel() and float(value.min()) < 0:
            at = (value < 0).nonzero()[0].tolist()
        if at is not None:
            what = "finite and >= 0" if non_negative else "finite"
            row = f" (weight_id {int(ids[at[0]])})" if ids is not None else ""
            raise ValueError(f"{where} {key} must be {what}, got {value[tuple(at)].item()} at {at}{row}")
    return value


def first_non_finite(value: Tensor) -> list[int] | None:
    """The index of ``value``'s first NaN or inf (None: every value is finite)."""
    # A sum is finite when every value is (one fast pass, ~25x faster than an isfinite mask); the
    # mask is built only when it is not: a NaN or inf, or finite values whose sum overflowed (near
    # the dtype's largest value, e.g. bfloat16 rows above ~1.7e38), which the mask then clears.
    # the sum of 16-bit floats in float32, as their own would overflow at 65504 (float16)
    if not value.numel() or bool(torch.isfinite(value.sum(dtype=torch.float32 if value.element_size() < 4 else None))):
        return None
    bad = (~torch.isfinite(value)).nonzero()
    return bad[0].tolist() if bad.shape[0] else None


def _check_distinct(where: str, key: str, ids: Tensor) -> None:
    ordered = ids.sort().values
    same = (ordered[1:] == ordered[:-1]).nonzero()
    if same.numel():
        raise ValueError(f"{where} {key} must hold distinct ids, got {int(ordered[int(same[0])])} more than once")
