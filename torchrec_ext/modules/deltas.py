"""Row deltas of the dynamic tables: what changed since a token, and applying it to a replica.

A source module marks a point with ``token = module.delta_token()``; later
``delta = module.export_delta(since=token)`` holds, per table, the ids and vectors of the rows
written since (fused optimizer updates, new rows' initial vectors, rows loaded by
``load_state_dict``) and the tombstones: ids evicted, expired (TTL) or erased since and not live
now. ``delta.token`` marks its end and is the next export's ``since``. A replica (same table
names, dims and dtypes; any capacity that holds the rows; any world size) that loaded the
source's checkpoint taken at ``token`` calls ``replica.follow_deltas(token)``, then
``replica.apply_delta(delta)`` for every delta in order, and holds exactly the source's live rows.

Tombstones name only ids that were live at ``since`` (an id inserted and removed between two
tokens never reached a replica): so a replica refuses a tombstone of an id it does not hold, a
sign that a delta is missing or that it did not start at the token's checkpoint.

How it stays cheap: tracking starts at the first ``delta_token()`` (a module that never asks
pays nothing). Then each row carries a version (one int64 per row, and one more: the version at
which its id got it), stamped with the module's
write counter by the callers of the kernels, on the touched rows only (one ``scatter_`` per
step); removed ids go to an append-only log per table. A token is a counter value: export is one
compare over the versions plus a gather of the changed rows, and the log entries past the token.

Bounds: the log holds at most ``max_tombstones`` ids (default: twice the tables' capacity, at
least 1M); ``release_deltas(before=token)`` drops what only older tokens need. Consumers that
share a module (a serving exporter, incremental checkpoints) name themselves
(``delta_token(consumer=...)``, ``release_deltas(..., consumer=...)``): each release then frees
what none of them needs, so the log stays as small as the oldest token in use. A token older
than what is kept is refused (``DeltaError``): re-sync that replica from a checkpoint.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from torchrec_ext import device_sync
from torchrec_ext.modules.delta_placement import DeltaRows, NoRowError, place_delta
from torchrec_ext.modules.dynamic_tables import DynamicTables
from torchrec_ext.modules.pending_rows import pending_rows_written
from torchrec_ext.modules.state_checks import _check_distinct, _checked

FORMAT_VERSION = 1
DEFAULT_MIN_TOMBSTONES = 1 << 20


class DeltaError(ValueError):
    """A delta or token that cannot be used here: out of order, missing, too old, or not this
    module's (another table config or dtype, bad tensors). Nothing was applied."""


@dataclass(frozen=True)
class DeltaToken:
    """A point in one source's write history: ``stream`` names the source (one per module, or
    per rank's share of a sharded module), ``version`` the write counter at the point."""

    stream: str
    version: int

    def to_dict(self) -> dict[str, object]:
        return {"stream": self.stream, "version": self.version}

    @staticmethod
    def from_dict(d: dict[str, object]) -> DeltaToken:
        return DeltaToken(str(d["stream"]), int(d["version"]))


@dataclass
class TableDelta:
    """One table's change: ``ids`` int64 [n] with their ``weights`` [n, dim] (storage dtype),
    optionally ``optimizer`` state per name ([n, dim] or [n]) and ``scores`` int64 [n]; and
    ``tombstones`` int64 [m], ids live at the delta's ``since`` and no longer live (each id once
    over ``ids`` and ``tombstones``).
    A table with fallback rows adds the ones written since: ``fallback_slots`` int64 [k] (distinct,
    in [0, fallback_rows)), their ``fallback_weights`` [k, dim] and ``fallback_optimizer`` state."""

    ids: Tensor
    weights: Tensor
    tombstones: Tensor
    optimizer: dict[str, Tensor] = field(default_factory=dict)
    scores: Tensor | None = None
    fallback_slots: Tensor | None = None
    fallback_weights: Tensor | None = None
    fallback_optimizer: dict[str, Tensor] = field(default_factory=dict)


@dataclass
class Delta:
    """The rows a source wrote between ``since`` and ``token``, per table name.

    ``source``: {"module": type name, "tables": {name: {"dim": int, "dtype": "float32"|...}}}
    (plus "rank", "world_size" for a sharded module's share). Format: ``FORMAT_VERSION``.
    """

    since: DeltaToken
    token: DeltaToken
    source: dict[str, object]
    tables: dict[str, TableDelta]
    format_version: int = FORMAT_VERSION


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class DeltaLog:
    """A module's write history since tracking began: row versions and the tombstone log."""

    def __init__(self, tables: DynamicTables, max_tombstones: int | None = None):
        self.stream = uuid.uuid4().hex
        self.current = 1  # the version stamped on writes now; every token issued is < current
        self.floor = 0  # tokens older than this were released: their tombstones are gone
        total = sum(m.rows for m in tables.meta)  # fallback rows included: their writes are versioned too
        self.max_tombstones = max_tombstones or max(2 * total, DEFAULT_MIN_TOMBSTONES)
        self.row_starts = tables.row_starts().to(tables.device)
        # 0: written before tracking. One extra slot at the end takes the stamps of rows -1 (none),
        # so a step's rows are stamped without compacting them first.
        self.version = torch.zeros(total + 1, dtype=torch.int64, device=tables.device)
        # The version at which each row's id got the row (0: before tracking): a removed id was
        # live at a token iff it got its row at or before the token.
        self.born = torch.zeros(total + 1, dtype=torch.int64, device=tables.device)
        self.no_row = total
        self.log: list[list[tuple]] = [[] for _ in tables.meta]  # per table: (version, ids, born versions)
        self.logged = 0
        # Named consumers (a serving exporter, incremental checkpoints): the oldest token each may
        # still use. A named release frees only what no consumer needs (see release).
        self.consumers: dict[str, int] = {}

    def _on(self, device: torch.device) -> None:
        if self.version.device != device:  # the module moved
            self.version, self.born = self.version.to(device), self.born.to(device)
            self.row_starts = self.row_starts.to(device)

    def table_versions(self, tables: DynamicTables, t: int, fallback: bool = False) -> Tensor:
        """Versions of table t's rows (fallback: of its fallback rows)."""
        self._on(tables.device)
        m = tables.meta[t]
        start = int(tables.row_starts()[t]) + (m.capacity if fallback else 0)
        return self.version[start : start + (m.fallback_rows if fallback else m.capacity)]

    def relayout(self, tables: DynamicTables, flat_map: Tensor) -> Callable[[], None]:
        """The tables' rows moved (a growth): ``flat_map[old flat row]`` is the new one (-1: gone).
        Write and born versions follow their rows, so what was written since a token is still
        exported and tombstones still name only ids live at the token. Allocates the moved
        versions and changes nothing: returns what puts them in place (allocating nothing), so
        that a growth that runs out of memory here leaves the log as it was."""
        device = flat_map.device
        total = sum(m.rows for m in tables.meta)
        # Rows gone go to the sink (row ``total``, zeroed after): no host read sizes anything.
        targets = flat_map.masked_fill(flat_map < 0, total)

        def follow(per_row: Tensor) -> Tensor:
            out = torch.zeros(total + 1, dtype=torch.int64, device=device)
            out.index_copy_(0, targets, per_row.to(device)[: flat_map.numel()])
            out[total] = 0
            return out

        # Born versions move too: a tombstone is sent only for ids born at or before a token.
        version, born = follow(self.version), follow(self.born)
        row_starts = device_sync.to_device(tables.row_starts(), device)

        def take() -> None:
            self.version, self.born, self.no_row, self.row_starts = version, born, total, row_starts

        return take

    # ------------------------------------------------------------------ hooks (DynamicTables)

    def written(self, t: int, rows: Tensor) -> None:
        """Table t's ``rows`` (each >= 0) got new vectors."""
        if rows.numel():
            self._on(rows.device)
            self.version.scatter_(0, rows + self.row_starts[t], self.current)  # scatter_: ~5x index_fill_ on CPU

    def updated(self, unique_rows: Tensor, unique_table: Tensor) -> None:
        """The fused update wrote these rows (row -1: none)."""
        if unique_rows.numel():
            self._on(unique_rows.device)
            flat = unique_rows if len(self.log) == 1 else unique_rows + self.row_starts.index_select(0, unique_table)
            self.version.scatter_(0, flat.masked_fill(unique_rows < 0, self.no_row), self.current)

    def inserted(self, t: int, rows: Tensor) -> None:
        """Table t's ``rows`` (each >= 0) were given to ids they did not hold."""
        if rows.numel():
            self._on(rows.device)
            self.born.scatter_(0, rows + self.row_starts[t], self.current)

    def removed(self, t: int, ids: Tensor, rows: Tensor, inserted_now: Tensor | None = None) -> None:
        """Table t's ``ids`` lost the ``rows`` they held (evicted, expired, erased), before the
        rows' new ids (if any) are ``inserted``. ``inserted_now``: ids the same call inserted (an
        id evicted by a later id of its own batch was never live before it)."""
        if ids.numel():
            self._on(rows.device)
            born = self.born.index_select(0, rows + self.row_starts[t])
            if inserted_now is not None and inserted_now.numel():
                born = born.masked_fill(torch.isin(ids, inserted_now), self.current)
            self.log[t].append((self.current, ids.clone(), born))
            self.logged += ids.numel()
            while self.logged > self.max_tombstones:  # drop the oldest entry; its tokens go stale
                oldest = min(range(len(self.log)), key=lambda i: self.log[i][0][0] if self.log[i] else math.inf)
                version, dropped, _ = self.log[oldest].pop(0)
                self.logged -= dropped.numel()
                self.floor = max(self.floor, version)

    def replaced(self, tables: DynamicTables, ts: Sequence[int], rows: Sequence[Tensor | None]) -> None:
        """Tables ``ts`` are rebuilt (load_state_dict, reset): every id they held is removed,
        then ``rows`` (None: none) are written."""
        for t, new_rows in zip(ts, rows):
            index = tables.indexes[t]
            if index is not None:
                for keys, old_rows, _ in index.export():
                    self.removed(t, keys, old_rows)
            if new_rows is not None:
                self.inserted(t, new_rows)
                self.written(t, new_rows)

    # ------------------------------------------------------------------ tokens

    def token(self, consumer: str | None = None) -> DeltaToken:
        token = DeltaToken(self.stream, self.current)
        self.current += 1  # writes from now on are after the token
        if consumer is not None:  # holds the log from here until the consumer releases past it
            self.consumers.setdefault(consumer, token.version)
        return token

    def check_since(self, since: object, where: str) -> DeltaToken:
        if not isinstance(since, DeltaToken):
            raise TypeError(
                f"{where}: since must be a DeltaToken (from delta_token() or a delta's .token), "
                f"got {type(since).__name__}"
            )
        if since.stream != self.stream:
            raise DeltaError(
                f"{where}: since is a token of stream {since.stream!r}, this module's stream is "
                f"{self.stream!r} (a token of another module or rank)"
            )
        if not 0 < since.version < self.current:
            raise DeltaError(
                f"{where}: since.version must be a version this module issued, in [1, "
                f"{self.current - 1}], got {since.version}"
            )
        if since.version < self.floor:
            raise DeltaError(
                f"{where}: since.version {since.version} is older than what is kept (tokens >= "
                f"{self.floor}; released by release_deltas or the tombstone bound "
                f"max_tombstones={self.max_tombstones}): re-sync the replica from a checkpoint"
            )
        return since

    def release(self, before: DeltaToken, consumer: str | None = None) -> None:
        """Forgets what only tokens older than ``before`` need; those tokens are refused after.
        A named ``consumer`` says it needs nothing older than ``before`` any more: what is freed
        is then what no named consumer needs (the oldest of their points), so consumers sharing
        a module do not cut each other's tokens off."""
        self.check_since(before, "release_deltas")
        if consumer is not None and not isinstance(consumer, str):
            raise TypeError(f"release_deltas: consumer must be a str or None, got {type(consumer).__name__}")
        upto = before.version
        if consumer is not None:
            self.consumers[consumer] = max(self.consumers.get(consumer, 0), before.version)
            upto = min(self.consumers.values())
        for entries in self.log:
            while entries and entries[0][0] <= upto:
                self.logged -= entries.pop(0)[1].numel()
        self.floor = max(self.floor, upto)

    def tombstones(self, t: int, since: DeltaToken) -> Tensor:
        """Ids of table t removed after ``since`` that were live at ``since`` (live again now or
        not: the caller drops the live ones)."""
        entries = [ids[born <= since.version] for version, ids, born in self.log[t] if version > since.version]
        return torch.cat(entries).unique() if entries else torch.zeros(0, dtype=torch.int64, device=self.version.device)


# ---------------------------------------------------------------------- source side


@pending_rows_written
def delta_token(tables: DynamicTables, max_tombstones: int | None = None, consumer: str | None = None) -> DeltaToken:
    """A token marking now; the first call starts tracking (writes before it are not tracked).
    A named ``consumer`` holds the log from this token until it releases past it."""
    if max_tombstones is not None and (not isinstance(max_tombstones, int) or max_tombstones <= 0):
        raise ValueError(f"delta_token: max_tombstones must be an int > 0, got {max_tombstones!r}")
    if tables.device.type == "meta":
        raise ValueError("delta_token: the module is on the meta device (no rows to track)")
    if tables.delta_log is None:
        tables.delta_log = DeltaLog(tables, max_tombstones)
    elif max_tombstones is not None:
        tables.delta_log.max_tombstones = max_tombstones
    if consumer is not None and not isinstance(consumer, str):
        raise TypeError(f"delta_token: consumer must be a str or None, got {type(consumer).__name__}")
    return tables.delta_log.token(consumer)


@pending_rows_written
def export_delta(
    tables: DynamicTables, since: DeltaToken, include_optimizer_state: bool, include_scores: bool, module_name: str
) -> Delta:
    log = tables.delta_log
    if log is None:
        raise DeltaError(
            "export_delta: no token was issued by this module: call delta_token() first (when the "
            "replica's base checkpoint is taken)"
        )
    since = log.check_since(since, "export_delta")
    out: dict[str, TableDelta] = {}
    for t, m in enumerate(tables.meta):
        index = tables.indexes[t]
        changed = (log.table_versions(tables, t) > since.version).nonzero().squeeze(1)
        ids, scores, live = index.entries_at(changed)
        rows, ids = changed[live], ids[live]
        tombstones = log.tombstones(t, since)
        if tombstones.numel():
            tombstones = tombstones[~index.find(tombstones)[1]]  # live again: in ids (rewritten) instead
        table = TableDelta(ids=ids, weights=tables.table_view(t).index_select(0, rows), tombstones=tombstones)
        if include_optimizer_state:
            table.optimizer = {name: view.index_select(0, rows) for name, view in tables.state_views(t).items()}
        if include_scores:
            table.scores = scores[live]
        if m.fallback_rows:
            slots = (log.table_versions(tables, t, fallback=True) > since.version).nonzero().squeeze(1)
            table.fallback_slots = slots
            table.fallback_weights = tables.fallback_view(t).index_select(0, slots)
            if include_optimizer_state:
                table.fallback_optimizer = {
                    name: view.index_select(0, slots) for name, view in tables.state_views(t, fallback=True).items()
                }
        out[m.name] = table
    return Delta(since=since, token=log.token(), source=describe(tables, module_name), tables=out)


def describe(tables: DynamicTables, module_name: str) -> dict[str, object]:
    return {
        "module": module_name,
        "tables": {
            m.name: {"dim": m.dim, "dtype": dtype_name(tables.table_view(t).dtype)}
            | ({"fallback_rows": m.fallback_rows} if m.fallback_rows else {})
            for t, m in enumerate(tables.meta)
        },
    }


# ---------------------------------------------------------------------- replica side


def follow_deltas(followed: dict[str, DeltaToken], since: DeltaToken | Sequence[DeltaToken]) -> None:
    """Sets the tokens the next deltas must start at: one per source stream (a sharded source
    has one per rank), the tokens taken when the replica's base checkpoint was."""
    tokens = [since] if isinstance(since, DeltaToken) else list(since) if isinstance(since, (list, tuple)) else None
    if not tokens or not all(isinstance(t, DeltaToken) for t in tokens):
        raise TypeError(
            f"follow_deltas: since must be a DeltaToken or a list of them (one per source rank), got {since!r}"
        )
    followed.clear()
    followed.update({t.stream: t for t in tokens})


@dataclass
class _Prepared:
    t: int
    placed: DeltaRows
    table: TableDelta
    tombstone_rows: Tensor  # the rows the tombstoned ids held


def unheld_tombstones(name: str, tombstones: Tensor, found: Tensor) -> None:
    """Refuses tombstones of ids the replica does not hold: a source tombstones only ids live at
    the delta's ``since``, which a replica that applied every delta before it holds."""
    if not bool(found.all()):
        missing = tombstones[~found]
        raise DeltaError(
            f"apply_delta: table {name!r}: {missing.numel()} of the delta's {tombstones.numel()} tombstones name "
            f"ids this replica does not hold (e.g. {missing[:5].tolist()}): a delta before it is missing or the "
            "replica did not start from the source's checkpoint at the followed token (inconsistent); nothing "
            "was applied: re-sync the replica from a checkpoint"
        )


def check_delta(tables: DynamicTables, followed: dict[str, DeltaToken], delta: object) -> None:
    """Everything about ``delta`` that can be checked without touching the tables."""
    where = "apply_delta"
    if not isinstance(delta, Delta):
        raise TypeError(f"{where}: delta must be a Delta (export_delta / load_delta), got {type(delta).__name__}")
    if delta.format_version != FORMAT_VERSION:
        raise DeltaError(f"{where}: delta format_version must be {FORMAT_VERSION}, got {delta.format_version}")
    if not followed:
        raise DeltaError(
            f"{where}: this module follows no source: call follow_deltas(token) first with the token "
            "taken when its base checkpoint was (one per source rank)"
        )
    expected = followed.get(delta.since.stream)
    if expected is None:
        raise DeltaError(
            f"{where}: delta of stream {delta.since.stream!r}, which this module does not follow "
            f"(it follows {sorted(followed)})"
        )
    if delta.since != expected:
        kind = (
            "missing delta(s) before it"
            if delta.since.version > expected.version
            else "out of order (already applied or older)"
        )
        raise DeltaError(
            f"{where}: delta since version {delta.since.version} of stream {delta.since.stream!r}, "
            f"expected since version {expected.version}: {kind}"
        )
    if delta.token.stream != delta.since.stream or delta.token.version <= delta.since.version:
        raise DeltaError(f"{where}: delta token {delta.token} does not follow its since {delta.since}")
    names = {m.name: t for t, m in enumerate(tables.meta)}
    described = delta.source.get("tables", {}) if isinstance(delta.source, dict) else {}
    for name, table in delta.tables.items():
        if name not in names:
            raise DeltaError(f"{where}: delta has table {name!r}, this module has tables {sorted(names)}")
        t = names[name]
        m, view = tables.meta[t], tables.table_view(t)
        info = described.get(name, {})
        if info.get("dim") != m.dim or info.get("dtype") != dtype_name(view.dtype):
            raise DeltaError(
                f"{where}: table {name!r} of the delta's source has dim {info.get('dim')} dtype "
                f"{info.get('dtype')}, this module's has dim {m.dim} dtype {dtype_name(view.dtype)}"
            )
        if info.get("fallback_rows", 0) != m.fallback_rows:
            raise DeltaError(
                f"{where}: table {name!r} of the delta's source has fallback_rows {info.get('fallback_rows')}, "
                f"this module's has {m.fallback_rows or None}"
            )
        check_table_delta(tables, t, table, f"{where}: table {name!r}")


def check_table_delta(tables: DynamicTables, t: int, table: TableDelta, name: str) -> None:
    view = tables.table_view(t)
    for key in ("ids", "tombstones"):
        value = getattr(table, key)
        if not isinstance(value, Tensor) or value.dtype != torch.int64:
            raise DeltaError(
                f"{name} {key} must be an int64 tensor, got {getattr(value, 'dtype', type(value).__name__)}"
            )
    ids = _checked(name, "ids", table.ids, "int", None)
    _checked(name, "tombstones", table.tombstones, "int", None)
    if not isinstance(table.weights, Tensor) or table.weights.dtype != view.dtype:
        raise DeltaError(
            f"{name} weights must be a {dtype_name(view.dtype)} tensor (this module's storage), got "
            f"{getattr(table.weights, 'dtype', type(table.weights).__name__)}"
        )
    _checked(name, "weights", table.weights, "float", (ids.numel(), view.shape[1]), ids)
    if table.scores is not None:
        _checked(name, "scores", table.scores, "int", (ids.numel(),))
    states = tables.state_views(t)
    for key, value in table.optimizer.items():
        if key in states:  # state of another optimizer than this module's: ignored
            _checked(name, f"optimizer.{key}", value, "float", (ids.numel(),) + tuple(states[key].shape[1:]), ids)
    # One sort: every id once, among ids and tombstones together (an id is live or removed).
    _check_distinct(name, "ids and tombstones (each id once: live or removed)", torch.cat([ids, table.tombstones]))
    if table.fallback_slots is not None:
        m = tables.meta[t]
        slots = _checked(name, "fallback_slots", table.fallback_slots, "int", None)
        if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= m.fallback_rows):
            raise DeltaError(f"{name} fallback_slots must be in [0, {m.fallback_rows}), got {slots.tolist()}")
        _check_distinct(name, "fallback_slots", slots)
        if not isinstance(table.fallback_weights, Tensor) or table.fallback_weights.dtype != view.dtype:
            raise DeltaError(
                f"{name} fallback_weights must be a {dtype_name(view.dtype)} tensor (this module's storage), "
                f"got {getattr(table.fallback_weights, 'dtype', type(table.fallback_weights).__name__)}"
            )
        _checked(name, "fallback_weights", table.fallback_weights, "float", (slots.numel(), view.shape[1]))
        fallback_states = tables.state_views(t, fallback=True)
        for key, value in table.fallback_optimizer.items():
            if key in fallback_states:
                _checked(
                    name,
                    f"fallback_optimizer.{key}",
                    value,
                    "float",
                    (slots.numel(),) + tuple(fallback_states[key].shape[1:]),
                )


@pending_rows_written
def prepare_delta(tables: DynamicTables, followed: dict[str, DeltaToken], delta: Delta) -> list[_Prepared]:
    """Everything ``apply_delta`` does that can fail, aside from the tables: the checks and each
    table's new index (on a copy). ``commit_delta`` then publishes it."""
    check_delta(tables, followed, delta)
    tables.check_ready("apply_delta")
    names = {m.name: t for t, m in enumerate(tables.meta)}
    device = tables.device
    # A growing replica first makes room for the delta's ids (growth moves rows, not values).
    tables.grow({names[name]: table.ids.numel() for name, table in delta.tables.items()})
    prepared: list[_Prepared] = []
    for name, table in delta.tables.items():
        t = names[name]
        index = tables.indexes[t]
        ids, tombstones = table.ids.to(device), table.tombstones.to(device)
        tombstone_rows, found = index.find(tombstones)
        unheld_tombstones(name, tombstones, found)
        # Planned on copies of the index: the tables change only once every table's rows have a place.
        try:
            placed = place_delta(index, ids, tombstones, None if table.scores is None else table.scores.to(device))
        except NoRowError as e:
            raise DeltaError(
                f"apply_delta: table {name!r}: {e}: their buckets are full of live ids in any placement; "
                f"nothing was applied: give the replica more capacity"
            ) from None
        prepared.append(_Prepared(t, placed, table, tombstone_rows))
    return prepared


def commit_delta(
    tables: DynamicTables, followed: dict[str, DeltaToken], delta: Delta, prepared: list[_Prepared]
) -> None:
    """Publishes what ``prepare_delta`` built (nothing here can fail)."""
    device = tables.device
    for p in prepared:
        m, rows, inserted = tables.meta[p.t], p.placed.rows, p.placed.inserted
        tables.indexes[p.t] = p.placed.index
        if tables.delta_log is not None:  # logged first: reads the born versions of the rows they held
            tables.delta_log.removed(p.t, p.table.tombstones.to(device), p.tombstone_rows)
        if p.placed.moved_from is not None:  # re-placed: held ids take their rows' contents along
            move_rows(tables, p.t, p.placed.moved_from, p.placed.moved_to)
        tables.table_view(p.t)[rows] = p.table.weights.to(device)
        for (key, view), fill in zip(tables.state_views(p.t).items(), tables._initial_state_values()):
            value = p.table.optimizer.get(key)
            if value is not None:
                view[rows] = value.to(device, view.dtype)
            else:
                view[rows[inserted]] = fill
        if m.ttl_steps is not None:
            tables.last_seen[p.t][rows] = tables.train_step
        slots = p.table.fallback_slots
        if slots is not None and slots.numel():
            slots = slots.to(device)
            tables.fallback_view(p.t)[slots] = p.table.fallback_weights.to(device)
            for key, view in tables.state_views(p.t, fallback=True).items():
                if key in p.table.fallback_optimizer:
                    view[slots] = p.table.fallback_optimizer[key].to(device, view.dtype)
        if tables.delta_log is not None:  # a replica may itself be a source
            tables.delta_log.inserted(p.t, rows[inserted])
            tables.delta_log.written(p.t, rows)
            if slots is not None and slots.numel():
                tables.delta_log.written(p.t, m.capacity + slots)
    followed[delta.since.stream] = delta.token


def apply_delta(tables: DynamicTables, followed: dict[str, DeltaToken], delta: Delta) -> None:
    """Makes the tables hold the delta's rows and drop its tombstones: all tables or none."""
    commit_delta(tables, followed, delta, prepare_delta(tables, followed, delta))


def move_rows(tables: DynamicTables, t: int, moved_from: Tensor, moved_to: Tensor) -> None:
    """Held ids move from rows ``moved_from`` to rows ``moved_to`` (a re-placement): their vectors,
    optimizer state, ``last_seen`` and, where the tables are a source too, their rows' write and
    born versions."""
    per_row = [tables.table_view(t), *tables.state_views(t).values()]
    if tables.meta[t].ttl_steps is not None:
        per_row.append(tables.last_seen[t])
    log = tables.delta_log
    if log is not None:
        start = int(tables.row_starts()[t])
        per_row += [log.table_versions(tables, t), log.born[start : start + tables.meta[t].capacity]]
    for view in per_row:
        view[moved_to] = view[moved_from]  # the right side is gathered (a copy) before the scatter


class DeltaMixin:
    """The delta API of the dynamic collections (host: ``DynamicCollectionMixin``)."""

    def delta_token(self, max_tombstones: int | None = None, consumer: str | None = None) -> DeltaToken:
        """Marks now: ``export_delta(since=token)`` returns what is written after this call.
        The first call starts tracking. ``max_tombstones`` bounds the tombstone log (ids);
        ``consumer`` names who will use the token (see ``release_deltas``)."""
        return delta_token(self._tables, max_tombstones, consumer)

    def export_delta(
        self, since: DeltaToken, include_optimizer_state: bool = False, include_scores: bool = False
    ) -> Delta:
        """The rows written and the ids removed since ``since``; ``.token`` is its end."""
        return export_delta(self._tables, since, include_optimizer_state, include_scores, type(self).__name__)

    def release_deltas(self, before: DeltaToken, consumer: str | None = None) -> None:
        """Frees the tombstones only tokens older than ``before`` need (those are refused after).
        ``consumer``: only what no named consumer (``delta_token(consumer=...)``) needs any more."""
        if self._tables.delta_log is None:
            raise DeltaError("release_deltas: no token was issued by this module")
        self._tables.delta_log.release(before, consumer)

    def follow_deltas(self, since: DeltaToken | Sequence[DeltaToken]) -> None:
        """Replica: the next delta applied must start at ``since`` (one token per source rank)."""
        follow_deltas(self._followed_deltas(), since)

    def apply_delta(self, delta: Delta) -> None:
        """Replica: applies the next delta of its source, in order; refuses it whole otherwise."""
        apply_delta(self._tables, self._followed_deltas(), delta)

    def _followed_deltas(self) -> dict[str, DeltaToken]:
        if "_delta_followed" not in self.__dict__:
            self.__dict__["_delta_followed"] = {}
        return self.__dict__["_delta_followed"]
