"""Incremental checkpoints: a base, then at each later save only what changed since the previous
one (base + deltas), for tables too large to write whole at every checkpoint.

    ckpts = IncrementalCheckpoints("ckpt", model, full_every=8, keep=2)
    ckpts.save(step, {"optim": dense_opt.state_dict(), "step": step})    # collective
    ...
    found = latest_checkpoint("ckpt")            # verifies the chain the newest one builds on
    state = IncrementalCheckpoints("ckpt", model).load(found[1], {"optim": dense_opt.state_dict(), "step": 0})

Each save is a checkpoint directory of its own (``step_<k>``, written aside and renamed, with its
manifest). It holds, through DCP, ``state`` and the model's state without its dynamic tables'
(dense parameters, buffers: whole each time, under the key "model"), and per rank one file,
``tables.rank<r>-of-<W>.pt``, with that rank's share of every dynamic module's tables
(``torch.save`` of plain tensors, read back with ``weights_only=True``):

- a **base** link: each table's whole state (``table_state``: rows, ids, scores, optimizer
  state, last seen, counters, admission state, fallback rows);
- a **delta** link: per table the rows written since the previous link (ids, rows, vectors,
  optimizer state, scores, last seen; from the module's delta tracking), the tombstones (ids live
  at the previous link and not now), and the small per-table state whole (counters, admission,
  fallback rows).

The manifest of a link (format ``manifest/2``) names the links it builds on, base first, each
with the SHA-256 of its manifest: ``verify_checkpoint`` (hence ``load``, ``latest_checkpoint``)
checks every link's files and that each is the link it was built on, so a missing or damaged
link is refused and ``latest_checkpoint`` falls back to the newest checkpoint whose whole chain
verifies. Rotation (``keep``) never deletes a link that a kept checkpoint builds on.

Loading applies the base and every delta in order to each rank's tables (a row's state is the
latest link's, a tombstoned id gone, the rows in row order as ``table_state`` gives them), then
loads the tables in place (``load_states``: saved rows at their saved slots) and the dense state:
the model's ``state_dict()`` afterwards equals the one a full save at that step would restore,
bit for bit. A base is written at the first save, every ``full_every`` saves, and whenever a
delta cannot be (a table grew, moving its rows; a delta token released); an incremental chain
loads at the world size that saved it (reshard through a full ``save_checkpoint``).
"""

from __future__ import annotations

import hashlib
import io
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from torchrec_ext.distributed.checkpoint import (
    MANIFEST_FILE,
    CheckpointError,
    _from_first_rank,
    _raise_if_any,
    _save,
    ensure_process_group,
    load_dcp,
    read_manifest,
    verify_checkpoint,
)
from torchrec_ext.distributed.checkpoint_background import wait_for_pending
from torchrec_ext.distributed.checkpoint_template import dynamic_modules, local_tables, tables_left_out
from torchrec_ext.modules.deltas import DeltaError, DeltaToken, delta_token, export_delta

MODEL_KEY = "model"  # the model's state without its tables, in the DCP part of every link
CONSUMER = "incremental_checkpoints"  # their name on the modules' delta logs (release_deltas)
_FORMAT = "torchrec_ext.checkpoint.tables/1"


def tables_file(rank: int, world_size: int) -> str:
    return f"tables.rank{rank}-of-{world_size}.pt"


def apply_table_delta(state: dict[str, Tensor], delta: dict[str, Any]) -> dict[str, Tensor]:
    """A table's state (``table_state`` form) after a delta link: the delta's rows replace or join
    the state's, tombstoned ids leave, rows in row order; the whole-table keys are the delta's."""
    rows = delta["rows"]
    gone = torch.cat([delta["tombstones"], rows["weight_id"]])
    keep = ~torch.isin(state["weight_id"], gone)
    merged = {key: torch.cat([state[key][keep], value]) for key, value in rows.items()}
    order = merged["row"].argsort()
    out = {key: value.index_select(0, order) for key, value in merged.items()}
    out.update(delta["whole"])
    return out


class IncrementalCheckpoints:
    """Saves and loads incremental checkpoints of ``model`` under ``ckpt_dir`` (module doc).
    ``full_every``: saves per chain (a base, then ``full_every - 1`` deltas); ``keep``: as
    ``save_checkpoint``'s (the links kept checkpoints build on stay too)."""

    def __init__(
        self,
        ckpt_dir: str,
        model: nn.Module,
        full_every: int = 8,
        keep: int = 2,
        process_group: dist.ProcessGroup | None = None,
    ):
        if type(full_every) is not int or full_every < 1:
            raise ValueError(f"IncrementalCheckpoints: full_every must be an int >= 1, got {full_every!r}")
        if type(keep) is not int or keep < 0:
            raise ValueError(f"IncrementalCheckpoints: keep must be an int >= 0, got {keep!r}")
        self.modules = dynamic_modules(model)
        if not self.modules:
            raise ValueError(
                "IncrementalCheckpoints: model holds no dynamic embedding module (nothing to save "
                "incrementally; use save_checkpoint)"
            )
        self.ckpt_dir, self.model, self.full_every, self.keep = ckpt_dir, model, full_every, keep
        self.pg = process_group or ensure_process_group()
        self._tokens: dict[str, DeltaToken] | None = None  # since the previous link (None: next is a base)
        self._capacities: dict[str, list[int]] = {}
        self._links: list[dict[str, Any]] = []  # the chain so far: {"step", "manifest_sha256"}

    # ------------------------------------------------------------------ save

    def save(self, step: int, state: dict[str, Any] | None = None) -> str:
        """Saves step ``step`` (collective): a base or a delta link holding the model and
        ``state`` (which must not use the key "model"). Returns the checkpoint's path."""
        state = dict(state or {})
        if MODEL_KEY in state:
            raise ValueError(
                f"IncrementalCheckpoints.save: state must not hold the key {MODEL_KEY!r} (the model's state goes there)"
            )
        wait_for_pending(self.pg)
        rank, world = dist.get_rank(self.pg), dist.get_world_size(self.pg)
        payload, tokens, why_base = self._delta_payload() if self._can_delta() else (None, None, "no base yet")
        # Every rank writes the same kind of link: a base as soon as one rank cannot write a delta.
        reasons = [None] * world
        dist.all_gather_object(reasons, why_base, group=self.pg)
        if any(reasons):
            payload, tokens = self._base_payload()
        kind = "base" if any(reasons) else "delta"
        payload = {"format": _FORMAT, "kind": kind, "rank": rank, "world_size": world, "step": step, "modules": payload}
        with tables_left_out(list(self.modules.values())):
            state[MODEL_KEY] = self.model.state_dict()
        links = [] if kind == "base" else list(self._links)
        name = tables_file(rank, world)

        def write_tables(directory: str) -> dict[str, tuple[int, str]]:
            buffer = io.BytesIO()
            torch.save(payload, buffer)
            data = buffer.getbuffer()
            fd = os.open(os.path.join(directory, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            return {name: (len(data), hashlib.sha256(data).hexdigest())}

        path = _save(
            self.ckpt_dir,
            step,
            state,
            self.keep,
            self.pg,
            write_files=write_tables,
            chain={"world_size": world, "links": links},
        )
        digest = _from_first_rank(
            hashlib.sha256(_read(os.path.join(path, MANIFEST_FILE))).hexdigest() if rank == 0 else None, self.pg
        )
        self._links = links + [{"step": step, "manifest_sha256": digest}]
        self._tokens = tokens if len(self._links) < self.full_every else None
        self._release(tokens)
        return path

    def _release(self, tokens: dict[str, DeltaToken]) -> None:
        """The next link starts at ``tokens`` (or is a base): the delta logs may forget what only
        older tokens of these checkpoints needed (what another consumer needs is kept)."""
        for fqn, token in tokens.items():
            tables = local_tables(self.modules[fqn])
            if tables is not None and tables.delta_log is not None:
                tables.delta_log.release(token, CONSUMER)

    def _can_delta(self) -> bool:
        return self._tokens is not None

    def _base_payload(self) -> tuple[dict[str, Any], dict[str, DeltaToken]]:
        payload, tokens = {}, {}
        for fqn, module in self.modules.items():
            tables = local_tables(module)
            if tables is None:
                continue
            tokens[fqn] = delta_token(tables, consumer=CONSUMER)  # the point the next delta starts from
            self._capacities[fqn] = [m.capacity for m in tables.meta]
            payload[fqn] = {m.name: {"table": tables.table_state(t)} for t, m in enumerate(tables.meta)}
        return payload, tokens

    def _delta_payload(self) -> tuple[dict[str, Any] | None, dict[str, DeltaToken] | None, str | None]:
        """This rank's delta since the previous link, the tokens it ends at, or why it must be a base."""
        assert self._tokens is not None
        payload, tokens = {}, {}
        for fqn, module in self.modules.items():
            tables = local_tables(module)
            if tables is None:
                continue
            if [m.capacity for m in tables.meta] != self._capacities.get(fqn):
                return None, None, f"{fqn}: a table grew since the previous link (its rows moved)"
            try:
                delta = export_delta(tables, self._tokens[fqn], False, True, type(module).__name__)
            except DeltaError as e:
                return None, None, str(e)
            tokens[fqn] = delta.token
            payload[fqn] = {}
            for t, m in enumerate(tables.meta):
                changed = delta.tables[m.name]
                rows, found = tables.indexes[t].find(changed.ids)
                assert bool(found.all()), "a delta's ids are live"
                per_row = {"weight_id": changed.ids, "metadata": changed.scores, "row": rows}
                per_row.update(tables.rows_state(t, rows))
                payload[fqn][m.name] = {
                    "rows": per_row,
                    "tombstones": changed.tombstones,
                    "whole": tables.whole_table_state(t),
                }
        return payload, tokens, None

    # ------------------------------------------------------------------ load

    def load(self, path: str, state: dict[str, Any] | None = None, verify: bool = True) -> dict[str, Any]:
        """Loads incremental checkpoint ``path`` (collective): the model in place (its tables from
        the base and every delta, in order; its dense state), and ``state``'s entries, returned as
        load_checkpoint returns them. Verifies the whole chain first (``verify=False``: only right
        after latest_checkpoint / verify_checkpoint did). Nothing is changed when anything is refused."""
        state = dict(state or {})
        wait_for_pending(self.pg)
        if verify:
            verify_checkpoint(path, self.pg)
        manifest = read_manifest(path)
        chain = manifest.get("incremental")
        rank, world = dist.get_rank(self.pg), dist.get_world_size(self.pg)
        error = None
        if chain is None:
            error = f"checkpoint {path}: is a full checkpoint, not an incremental one: load it with load_checkpoint"
        elif chain["world_size"] != world:
            error = (
                f"checkpoint {path}: was saved by {chain['world_size']} ranks, this group has {world}: an "
                "incremental chain loads at the world size that saved it (reshard through save_checkpoint)"
            )
        _raise_if_any(error, self.pg)
        links, _ = chain_links(path)
        tables_state: dict[str, dict[str, dict[str, Tensor]]] = {}
        try:
            tables_state = self._replay(links, rank, world)
        except CheckpointError as e:
            error = str(e)
        _raise_if_any(error, self.pg)
        modules = list(self.modules.values())
        with tables_left_out(modules):
            # state_dict() gives views of the parameters: copies, so that nothing changes before all is read
            state[MODEL_KEY] = {
                key: value.clone() if type(value) is Tensor else value for key, value in self.model.state_dict().items()
            }
        load_dcp(path, state, self.pg)
        for fqn, module in self.modules.items():
            tables = local_tables(module)
            if tables is not None:
                tables.load_states(
                    {t: tables_state[fqn][m.name] for t, m in enumerate(tables.meta)},
                    f"IncrementalCheckpoints.load({path})",
                )
        with tables_left_out(modules):
            self.model.load_state_dict(state.pop(MODEL_KEY))
        return state

    def _replay(self, links: list[str], rank: int, world: int) -> dict[str, dict[str, dict[str, Tensor]]]:
        """This rank's tables' state at the last of ``links``: the base, then each delta applied."""
        out: dict[str, dict[str, dict[str, Tensor]]] = {}
        for i, link in enumerate(links):
            payload = read_link(link, rank, world, "base" if i == 0 else "delta")
            for fqn, module in self.modules.items():
                tables = local_tables(module)
                if tables is None:
                    continue
                saved = payload["modules"].get(fqn)
                names = [m.name for m in tables.meta]
                if not isinstance(saved, dict) or sorted(saved) != sorted(names):
                    raise CheckpointError(
                        f"checkpoint {link}: module {fqn!r} holds tables "
                        f"{sorted(saved) if isinstance(saved, dict) else None}, this model's "
                        f"has {sorted(names)} (a checkpoint of another model)"
                    )
                if i == 0:
                    out[fqn] = {name: saved[name]["table"] for name in names}
                else:
                    out[fqn] = {name: apply_table_delta(out[fqn][name], saved[name]) for name in names}
        return out


def chain_links(path: str) -> tuple[list[str], int]:
    """(the link directories incremental checkpoint ``path`` builds on, base first, ``path``
    last; the world size that saved it), from its manifest (verified by the caller)."""
    chain = read_manifest(path).get("incremental")
    if chain is None:
        raise CheckpointError(f"checkpoint {path}: is a full checkpoint, not an incremental one")
    parent = os.path.dirname(os.path.abspath(path))
    return [os.path.join(parent, f"step_{link['step']}") for link in chain["links"]] + [path], chain["world_size"]


def read_link(link: str, rank: int, world: int, kind: str) -> dict[str, Any]:
    """Rank ``rank``'s tables file of link ``link``, checked to be a ``kind`` ("base" / "delta") link."""
    file = os.path.join(link, tables_file(rank, world))
    try:
        with open(file, "rb") as f:
            payload = torch.load(f, weights_only=True)
    except (OSError, RuntimeError, ValueError) as e:
        raise CheckpointError(
            f"checkpoint {link}: {tables_file(rank, world)} cannot be read "
            f"({str(e).splitlines()[0] if str(e) else type(e).__name__})"
        ) from None
    if not isinstance(payload, dict) or payload.get("format") != _FORMAT or payload.get("kind") != kind:
        raise CheckpointError(
            f"checkpoint {link}: {tables_file(rank, world)} is not a {kind} link of format {_FORMAT!r}"
        )
    return payload


def replay_rank(links: list[str], rank: int, world: int) -> dict[str, dict[str, dict[str, Tensor]]]:
    """Rank ``rank``'s share of every module's tables (module fqn -> table -> ``table_state``
    form) at the last of ``links``: the base, then each delta applied; for readers without the
    model's sharded modules (a serving conversion)."""
    out: dict[str, dict[str, dict[str, Tensor]]] = {}
    for i, link in enumerate(links):
        modules = read_link(link, rank, world, "base" if i == 0 else "delta")["modules"]
        if i == 0:
            out = {fqn: {name: saved["table"] for name, saved in tables.items()} for fqn, tables in modules.items()}
            continue
        if {fqn: sorted(t) for fqn, t in modules.items()} != {fqn: sorted(t) for fqn, t in out.items()}:
            raise CheckpointError(f"checkpoint {link}: rank {rank}'s modules and tables are not its base's")
        out = {
            fqn: {name: apply_table_delta(state, modules[fqn][name]) for name, state in tables.items()}
            for fqn, tables in out.items()
        }
    return out


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()
