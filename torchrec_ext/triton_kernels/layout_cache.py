"""What a Triton wrapper derives from the tables' layout (device copies, int32 dtype codes,
capacities, the widest dim), computed once per layout rather than each call: the storage hands
the same layout tensors until its layout changes, and a growth makes new ones. An entry is
checked against the layout tensors themselves (identity and in-place version), so a layout
changed in place, or a new one, is derived again."""

import weakref
from collections.abc import Callable, Hashable, Sequence
from typing import TypeVar

from torch import Tensor

T = TypeVar("T")

# Callers that make a layout each call (tests, lists) would grow the caches without bound.
_MAX_ENTRIES = 64


class LayoutCache:
    """One wrapper's derived values, keyed by its first layout tensor."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[tuple, tuple, object]] = {}

    def get(self, layout: Sequence[Tensor | None], extra: Hashable, derive: Callable[[], T]) -> T:
        """``derive()`` of ``layout`` (tensors or None) and ``extra`` (other hashable inputs it
        depends on: a buffer size, a device), cached while the same tensors are unchanged."""
        key = (extra,) + tuple(None if t is None else (t._version, t.device) for t in layout)
        cacheable = all(isinstance(t, Tensor) or t is None for t in layout)
        entry = self._entries.get(id(layout[0])) if cacheable else None
        if entry is not None and entry[0] == key and all(r() is t for r, t in zip(entry[1], layout)):
            return entry[2]
        derived = derive()
        if cacheable:
            if len(self._entries) >= _MAX_ENTRIES:
                self._entries.clear()
            refs = tuple((lambda: None) if t is None else weakref.ref(t) for t in layout)
            self._entries[id(layout[0])] = (key, refs, derived)
        return derived

    def clear(self) -> None:
        self._entries.clear()
