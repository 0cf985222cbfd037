"""A table's state as a checkpoint holds it, and back: ``table_state`` (live rows: vectors, ids,
scores, rows, optimizer state, counters, admission, fallback rows) and ``load_states`` (all tables
or none: each state checked and placed in a new index before any table changes).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor

from torchrec_ext.modules.admission import Admission, bloom_geometry
from torchrec_ext.modules.pending_rows import pending_rows_written
from torchrec_ext.modules.state_checks import _check_distinct, _checked, first_non_finite
from torchrec_ext.table import (
    CLOCK_LIMIT,
    EPOCH_LIMIT,
    LAYOUT_LIMIT,
    LAYOUT_VERSION,
    LAYOUTS,
    SAME_BUCKET_LAYOUTS,
    HashTable,
    check_counter,
    place_keys,
    stash_slots,
)
from torchrec_ext.vocabulary import SQUARED_STATES


@dataclass
class _LoadedTable:
    """One table's checkpoint state, checked and placed: what replaces the table's own."""

    index: HashTable
    rows: Tensor  # the row of each kept entry
    vectors: Tensor  # their vectors, in the table's dtype on the storage's device
    states: dict[str, Tensor | None]  # optimizer state per name (None: not saved, initial values)
    last_seen: Tensor | None
    admission: Admission | None
    train_step: int
    optimizer_step: int
    warning: str | None  # said once the load is applied (entries that did not fit)
    dtype_warning: str | None = None  # said once the load is applied (vectors converted to the table's dtype)
    fallback: Tensor | None = None  # the fallback rows (None: not saved, initial values: zeros)
    fallback_states: dict[str, Tensor | None] | None = None  # their optimizer state (None: initial values)
    layout_warning: str | None = None  # said once the load is applied (rows of another layout re-placed)
    capacity: int = 0  # the table's capacity once loaded (a growing table fits its ids)


# A table state's ``counters``: what they are, and the exclusive upper bound of each. ``layout``
# is the LAYOUT_VERSION its rows follow; states saved before it had the first four only (layout 1).
COUNTERS = (
    ("clock", CLOCK_LIMIT),
    ("epoch", EPOCH_LIMIT),
    ("training step", CLOCK_LIMIT),
    ("optimizer step", CLOCK_LIMIT),
    ("layout", LAYOUT_LIMIT),
)


class TableCheckpoint:
    """The checkpoint part of ``DynamicTables``: state of one table out, states of tables in."""

    @pending_rows_written
    def table_state(self, t: int) -> dict[str, Tensor]:
        """Table t's live rows: vectors, ids, scores, rows, optimizer state, counters."""
        if self.device.type == "meta":
            return self._shape_only_state(t)
        if self.__dict__.get("_rows_as_shapes"):
            return self._shape_only_state(t, self.device)
        state = self.indexes[t].state_dict()
        keys, rows, scores = state["keys"], state["rows"], state["scores"]
        per_row, whole = self.rows_state(t, rows), self.whole_table_state(t)
        out = {
            "weight": per_row.pop("weight"),
            "weight_id": keys,
            "metadata": scores,
            "row": rows,
            "counters": whole.pop("counters"),
        }
        out.update(per_row)  # optimizer state, last seen
        out.update(whole)  # admission, fallback rows
        return out

    def rows_state(self, t: int, rows: Tensor) -> dict[str, Tensor]:
        """Table t's per-row state at ``rows`` (live rows): vectors, optimizer state, last seen.
        Gathered copies (the state never aliases the table), by index_select: indexing (``view[rows]``)
        costs ~15 ms more per call on CPU, which a small delta would pay per key."""
        out = {"weight": self.table_view(t).index_select(0, rows)}
        for name, view in self.state_views(t).items():
            out[f"optimizer.{name}"] = view.index_select(0, rows)
        if self.meta[t].ttl_steps is not None:
            out["last_seen"] = self.last_seen[t].index_select(0, rows)
        return out

    @pending_rows_written
    def whole_table_state(self, t: int) -> dict[str, Tensor]:
        """Table t's state that is not per row: counters, admission state, fallback rows (small;
        what an incremental checkpoint saves whole)."""
        m, index = self.meta[t], self.indexes[t]
        out = {
            # on the storage's device, as every other key (one device per rank's checkpoint shards)
            "counters": torch.tensor(
                [index.clock, index.epoch, self.train_step, int(self.optimizer_step), LAYOUT_VERSION],
                device=self.device,
            ),
        }
        if self.admission[t] is not None:
            out.update(self.admission[t].state())
        if m.fallback_rows:
            out["fallback_weight"] = self.fallback_view(t).clone()
            for name, view in self.state_views(t, fallback=True).items():
                out[f"fallback_optimizer.{name}"] = view.clone()
        return out

    @contextmanager
    def rows_as_shapes(self) -> Iterator[None]:
        """Within it, ``table_state`` gives each key's dtype and trailing shape with no rows (on the
        tables' device, zeros where a key has a fixed size): a template to load a checkpoint into
        that gathers no row (``load_checkpoint`` sizes the entries from the checkpoint)."""
        self.__dict__["_rows_as_shapes"] = True
        try:
            yield
        finally:
            self.__dict__.pop("_rows_as_shapes", None)

    def _shape_only_state(self, t: int, device: torch.device | None = None) -> dict[str, Tensor]:
        """A meta module's state: the keys, dtypes and shapes of a fresh module's (no live rows),
        on the meta device (or ``device``), as TorchRec's modules give shape-only state on meta."""
        m, meta = self.meta[t], device or torch.device("meta")
        out = {}
        for key in self.state_keys(t):
            if key == "weight":
                out[key] = torch.zeros(0, m.dim, dtype=m.dtype, device=meta)
            elif key == "counters":
                out[key] = torch.zeros(len(COUNTERS), dtype=torch.int64, device=meta)
            elif key == "admission_bloom":  # one packed filter
                opts = m.options
                nbytes = bloom_geometry(
                    opts.bloom_expected_ids or m.max_capacity,
                    opts.bloom_bytes,
                    opts.bloom_fpr,
                    m.name,
                    opts.bloom_hashes,
                ).nbytes
                out[key] = torch.zeros(1, nbytes, dtype=torch.uint8, device=meta)
            elif key.startswith("optimizer."):
                view = self.state_views(t)[key[len("optimizer.") :]]
                out[key] = torch.zeros((0,) + tuple(view.shape[1:]), dtype=view.dtype, device=meta)
            elif key == "fallback_weight":  # fixed size: the fallback rows themselves
                out[key] = torch.zeros(m.fallback_rows, m.dim, dtype=m.dtype, device=meta)
            elif key.startswith("fallback_optimizer."):
                view = self.state_views(t, fallback=True)[key[len("fallback_optimizer.") :]]
                out[key] = torch.zeros(view.shape, dtype=view.dtype, device=meta)
            else:  # ids, scores, rows, last_seen, admission ids and counts
                out[key] = torch.zeros(0, dtype=torch.int64, device=meta)
        return out

    def state_keys(self, t: int) -> list[str]:
        m = self.meta[t]
        keys = ["weight", "weight_id", "metadata", "row", "counters"]
        keys += [f"optimizer.{name}" for name in self.state_views(t)]
        keys += ["last_seen"] if m.ttl_steps is not None else []
        keys += {"counter": ["admission_id", "admission_count"], "bloom": ["admission_bloom"]}.get(m.admission, [])
        if m.fallback_rows:
            keys += ["fallback_weight"] + [f"fallback_optimizer.{name}" for name in self.state_views(t)]
        return keys

    @pending_rows_written
    def load_states(self, states: dict[int, dict[str, Tensor]], where: str) -> None:
        """Replaces tables by ``table_state`` outputs (table index -> state), all or none: every
        state is checked and its index built before any table changes. ``row`` may be absent
        (rows placed afresh), and so may optimizer state, ``last_seen`` and the admission keys
        (initial values: fresh optimizer state, seen now, nothing pending)."""
        if not states:
            return
        self.check_ready(where)
        loaded = {t: self._check_table_state(t, state, where) for t, state in states.items()}
        resized = {t: (table.capacity, None) for t, table in loaded.items() if table.capacity != self.meta[t].capacity}
        if resized:  # growing tables fit the checkpoint's ids (GrowthError, nothing changed, if they cannot)
            self._relayout(resized, {})
        if self.delta_log is not None:
            self.delta_log.replaced(self, list(loaded), [table.rows for table in loaded.values()])
        for t, table in loaded.items():
            self._replace_table(t, table)
        self.train_step = max(table.train_step for table in loaded.values())
        self.optimizer_step.fill_(max(table.optimizer_step for table in loaded.values()))
        for table in loaded.values():
            for said in (table.dtype_warning, table.layout_warning, table.warning):
                if said is not None:
                    warnings.warn(said, stacklevel=3)

    def _check_table_state(self, t: int, state: dict[str, Tensor], where: str) -> _LoadedTable:
        """Table t's checkpoint state, checked (types, shapes, finite values, distinct ids, counter
        ranges) and placed in a new index; raises TypeError / ValueError naming the key."""
        m, device = self.meta[t], self.device
        name = f"{where}: table {m.name!r}"
        ids = _checked(name, "weight_id", state["weight_id"], "int", None)
        n = ids.numel()
        vectors = _checked(name, "weight", state["weight"], "float", (n, m.dim), ids)
        scores = _checked(name, "metadata", state["metadata"], "int", (n,))
        before_layouts = isinstance(state["counters"], Tensor) and tuple(state["counters"].shape) == (
            len(COUNTERS) - 1,
        )
        counters = _checked(name, "counters", state["counters"], "int", (len(COUNTERS) - before_layouts,)).tolist()
        clock, epoch, train_step, optimizer_step, layout = (
            check_counter(where, f"table {m.name!r} counters[{i}] ({what})", value, limit)
            for i, ((what, limit), value) in enumerate(zip(COUNTERS, counters + [1] * before_layouts))
        )
        saved_rows = _checked(name, "row", state["row"], "int", (n,)) if "row" in state else None
        _check_distinct(name, "weight_id", ids)
        states = self._checked_states(state, "optimizer", self.state_views(t), n, name, ids)
        last_seen = None
        if m.ttl_steps is not None and "last_seen" in state:
            last_seen = _checked(name, "last_seen", state["last_seen"], "int", (n,))
            late = (last_seen < 0) | (last_seen > train_step)
            if bool(late.any()):
                i = int(late.nonzero()[0])
                raise ValueError(
                    f"{name} last_seen must be in [0, training step {train_step}], got {int(last_seen[i])} "
                    f"at entry {i} (weight_id {int(ids[i])})"
                )
        admission = None if self.admission[t] is None else self.admission[t].checked_state(state, name)
        fallback, fallback_states = self._checked_fallback(t, state, name)

        # Placement: the saved rows when valid in this table, else placed afresh: silently after a
        # change of capacity or world size, said once when the rows follow another layout. A
        # growing table takes the capacity its ids fit in, doubling from its initial one (that of
        # the table that saved them, unless it grew for ids since evicted or expired).
        ids, scores = ids.to(device, torch.int64), scores.to(device, torch.int64)
        capacity = m.fit_capacity(n, start=m.initial_capacity) if m.max_capacity != m.initial_capacity else m.capacity
        index = HashTable(capacity, policy=m.policy, device=device, mapped_rows=m.may_grow)
        entry = {"capacity": capacity, "policy": m.policy, "clock": clock, "epoch": epoch, "layout": LAYOUT_VERSION}
        rows, keep, warning, layout_warning = None, None, None, None
        if saved_rows is not None and n <= capacity:
            saved_rows = saved_rows.to(device, torch.int64)
            try:
                index.load_state_dict(dict(entry, layout=layout, keys=ids, rows=saved_rows, scores=scores))
                rows = saved_rows
            except ValueError:
                pass  # saved at another capacity, or with another layout, or by a grown table
        if rows is None and saved_rows is not None and m.may_grow and n <= capacity:
            rows = self._keep_saved_rows(index, entry, ids, saved_rows, scores)
        if rows is None:
            if saved_rows is not None and layout not in SAME_BUCKET_LAYOUTS:
                layout_warning = (
                    f"{name}: the checkpoint's rows follow hash-table layout {layout} "
                    f"({LAYOUTS.get(layout, 'unknown')}), this table's layout is {LAYOUT_VERSION} "
                    f"({LAYOUTS[LAYOUT_VERSION]}): its ids were given new rows"
                )
            rows = place_keys(ids, scores, capacity)
            keep = rows >= 0
            index.load_state_dict(dict(entry, keys=ids[keep], rows=rows[keep], scores=scores[keep]))
            kept = int(keep.sum())
            if kept < n:
                warning = (
                    f"{name}: placed {kept} of the checkpoint's {n} ids in capacity {capacity}; the other "
                    f"{n - kept} were dropped, by eviction score (metadata), highest kept: an id is dropped when "
                    f"the two 32-row buckets it hashes to have no free row in any placement of the higher-scored "
                    f"ids kept and the stash ({stash_slots(capacity)} ids outside their buckets) is full"
                    + (f" ({n} ids > capacity {capacity})" if n > capacity else "")
                )
            rows = rows[keep]
            keep = keep.to(vectors.device)
        pick = (lambda x: x.to(device)) if keep is None else (lambda x: x[keep.to(x.device)].to(device))
        if m.ttl_steps is not None:
            last_seen = (
                torch.full((rows.numel(),), train_step, dtype=torch.int64, device=device)
                if last_seen is None
                else pick(last_seen.to(torch.int64))
            )
        return _LoadedTable(
            index=index,
            rows=rows,
            vectors=pick(vectors.to(m.dtype)),
            states={k: None if v is None else pick(v.to(torch.float32)) for k, v in states.items()},
            last_seen=last_seen,
            admission=admission,
            train_step=train_step,
            optimizer_step=optimizer_step,
            warning=warning,
            dtype_warning=self._dtype_warning(t, vectors, ids, name),
            layout_warning=layout_warning,
            fallback=fallback,
            fallback_states=fallback_states,
            capacity=capacity,
        )

    @staticmethod
    def _keep_saved_rows(index: HashTable, entry: dict, ids: Tensor, rows: Tensor, scores: Tensor) -> Tensor | None:
        """Loads ``ids`` into a growing table's ``index`` (its slots map to rows) at their saved
        ``rows``, placing them in slots afresh; None (the index unchanged) when the rows are not
        distinct rows of the table or some id finds no slot."""
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= index.capacity):
            return None
        if torch.unique(rows).numel() != rows.numel():
            return None
        slots = place_keys(ids, scores, index.capacity)
        if bool((slots < 0).any()):
            return None
        index.load_state_dict(dict(entry, keys=ids, rows=rows, slots=slots, scores=scores))
        return rows

    def _checked_fallback(
        self, t: int, state: dict[str, Tensor], name: str
    ) -> tuple[Tensor | None, dict[str, Tensor | None]]:
        """Table t's saved fallback rows and their optimizer state, checked and converted (None
        where not saved)."""
        m, device = self.meta[t], self.device
        if not m.fallback_rows:
            return None, {}
        fallback = state.get("fallback_weight")
        if fallback is not None:
            fallback = _checked(name, "fallback_weight", fallback, "float", (m.fallback_rows, m.dim))
            fallback = fallback.to(device, m.dtype)
            if first_non_finite(fallback) is not None:
                raise ValueError(
                    f"{name} fallback_weight holds values beyond the range of the table's data_type ({m.dtype})"
                )
        views = self.state_views(t, fallback=True)
        return fallback, self._checked_states(state, "fallback_optimizer", views, m.fallback_rows, name)

    def _checked_states(
        self, state: dict[str, Tensor], prefix: str, views: dict[str, Tensor], rows: int, name: str, ids=None
    ) -> dict[str, Tensor | None]:
        """The optimizer state ``state`` holds for ``views`` (``<prefix>.<key>``; None where not
        saved), checked: ``rows`` rows as wide as the view's, finite, squared ones >= 0 (``ids``
        name a bad row)."""
        checked: dict[str, Tensor | None] = {}
        for key, view in views.items():
            value = state.get(f"{prefix}.{key}")
            if value is not None:
                value = _checked(
                    name,
                    f"{prefix}.{key}",
                    value,
                    "float",
                    (rows, *view.shape[1:]),
                    ids,
                    non_negative=(self.optimizer.kind, key) in SQUARED_STATES,
                )
            checked[key] = value
        return checked

    def _dtype_warning(self, t: int, vectors: Tensor, ids: Tensor, name: str) -> str | None:
        """None when the checkpoint's vectors have table t's storage dtype; else what converting
        them (to nearest) is said with. Values beyond the dtype's range are refused, naming an id."""
        dtype = self.meta[t].dtype
        if vectors.dtype == dtype:
            return None
        at = first_non_finite(vectors.to(dtype))
        if at is not None:
            raise ValueError(
                f"{name} weight holds {vectors[tuple(at)].item()} at {at} (weight_id {int(ids[at[0]])}), "
                f"beyond the range of the table's data_type ({dtype})"
            )
        return (
            f"{name}: the checkpoint's weight is {vectors.dtype}, the table stores {dtype} (its config's "
            "data_type): converted, rounding to nearest"
        )

    @staticmethod
    def _write_rows(view: Tensor, at: Tensor, values: Tensor | None, fill: float = 0.0) -> None:
        """``view[at] = values`` (None: ``fill``): a load's writes of a table's rows and states
        (a file-backed tier's go through its mapping: ``TieredTables._write_rows``)."""
        if values is None:
            view.index_fill_(0, at, fill)
        else:
            view.index_copy_(0, at, values)

    def _replace_table(self, t: int, table: _LoadedTable) -> None:
        m, rows = self.meta[t], table.rows
        self.indexes[t] = table.index
        # index_copy_ / index_fill_ rather than view[rows] = ...: indexing costs ~15 ms more per call on CPU
        view = self.table_view(t)
        at = rows.to(view.device)  # (a tiered table's views are of its backing store, on the host)
        self._write_rows(view, at, table.vectors.to(view.device))
        for (key, view), fill in zip(self.state_views(t).items(), self._initial_state_values()):
            value = table.states[key]
            self._write_rows(view, at, None if value is None else value.to(view.device), fill)
        if m.ttl_steps is not None:
            self.last_seen[t].zero_()
            self.last_seen[t].index_copy_(0, rows, table.last_seen)
        if table.admission is not None:
            self.admission[t] = table.admission
        if m.fallback_rows:  # what was not saved starts over: zero rows, initial optimizer state
            if table.fallback is not None:
                self.fallback_view(t).copy_(table.fallback)
            else:
                self.fallback_view(t).zero_()
            for (key, view), fill in zip(self.state_views(t, fallback=True).items(), self._initial_state_values()):
                if table.fallback_states[key] is not None:
                    view.copy_(table.fallback_states[key])
                else:
                    view.fill_(fill)
