"""The per-table submodules of a dynamic collection (``embedding_bags.<name>`` / ``embeddings.<name>``)
and their state_dict: ``DynamicTableModule`` (one table's ``weight``, a view of the shared storage),
``DynamicTableDict`` (the container, which loads every table at once) and ``load_tables`` (all or
none, strict or not).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from contextlib import contextmanager
from typing import Any

from torch import nn

from torchrec_ext.modules.dynamic_tables import DynamicTables

_REQUIRED_STATE = ("weight", "weight_id", "metadata", "counters")


class DynamicTableModule(nn.Module):
    """One dynamic table (``embedding_bags.<name>`` / ``embeddings.<name>``).

    ``weight`` is a [capacity, dim] view of the collection's storage. Its gradient is never
    materialised: the fused optimizer updates the touched rows during backward. On CPU the rows
    of a training batch's new ids are written by that backward too (or by the next lookup or
    ``state_dict``), so read ``weight`` directly only after the backward. The table's
    ``state_dict`` holds only its live rows: ``weight`` [n, dim], ``weight_id`` (raw ids),
    ``metadata`` (eviction scores), ``row`` (placement), ``optimizer.<state>``, ``counters``
    (index clock, epoch, training step, optimizer step, and the ``LAYOUT_VERSION`` the rows
    follow; a state saved before it has the first four: layout 1, whose rows are re-placed, saying
    so, where they do not fit), plus ``last_seen`` with ttl_steps,
    ``admission_id`` / ``admission_count`` with the counter admission and ``admission_bloom``
    (one packed filter per row) with the Bloom filter.
    """

    def __init__(self, tables: DynamicTables, index: int):
        super().__init__()
        self._tables = tables
        self._index = index
        self._loaded_by_container = False
        self.weight = nn.Parameter(tables.table_view(index))
        tables.register_parameter_owner(self)  # ``weight`` follows the storage when a growth replaces it

    def extra_repr(self) -> str:
        m = self._tables.meta[self._index]
        fallback = f", fallback_rows={m.fallback_rows}" if m.fallback_rows else ""
        grows = f", max_capacity={m.max_capacity}" if m.max_capacity != m.capacity else ""
        return f"capacity={m.capacity}{grows}, dim={m.dim}, policy={m.policy!r}, dtype={m.dtype}{fallback}"

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        for key, value in self._tables.table_state(self._index).items():
            destination[prefix + key] = value

    def _load_from_state_dict(
        self,
        state_dict: Mapping[str, Any],
        prefix: str,
        local_metadata: Any,
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        if self._loaded_by_container:  # its container loaded every table at once, this one included
            self._loaded_by_container = False
            return
        load_tables(self._tables, {self._index: prefix}, state_dict, None, missing_keys, unexpected_keys, error_msgs)


class DynamicTableDict(nn.ModuleDict):
    """The per-table submodules of a collection (``embedding_bags`` / ``embeddings``). It loads
    a state_dict into all of its tables at once, so a bad table state changes no table."""

    def __init__(self, tables: DynamicTables, modules: dict[str, DynamicTableModule]):
        super().__init__(modules)
        self._tables = tables
        self.strict: bool | None = None  # the load_state_dict in progress's, when known

    @contextmanager
    def loading(self, strict: bool):
        """For the duration of a load_state_dict(strict=...) that reaches this container."""
        self.strict = strict
        try:
            yield
        finally:
            self.strict = None

    def _load_from_state_dict(
        self,
        state_dict: Mapping[str, Any],
        prefix: str,
        local_metadata: Any,
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        unknown_before = len(unexpected_keys)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )  # reports keys of tables this module does not have
        # (a sharded module's container also holds placeholders of other ranks' tables: skipped)
        mine = {name: table for name, table in self.items() if isinstance(table, DynamicTableModule)}
        tables = {table._index: f"{prefix}{name}." for name, table in mine.items()}
        load_tables(
            self._tables,
            tables,
            state_dict,
            self.strict,
            missing_keys,
            unexpected_keys,
            error_msgs,
            unknown=len(unexpected_keys) > unknown_before,
        )
        for table in mine.values():
            table._loaded_by_container = True


def load_tables(
    tables: DynamicTables,
    prefixes: dict[int, str],
    state_dict: Mapping[str, Any],
    strict: bool | None,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
    unknown: bool = False,
) -> None:
    """Loads tables (index -> state_dict prefix) from ``state_dict``: all or none.

    Missing and unexpected keys are reported. A module without a fused optimizer ignores the
    checkpoint's ``optimizer.*`` keys (a training checkpoint loads for eval or serving). With
    strict=True (or unknown: nested in another module's load_state_dict, whose strictness a
    submodule cannot see) any missing or unexpected key, or ``unknown`` tables, load nothing (a
    strict load then raises, listing them; an unknown-strictness load raises too, saying why, so a
    nested strict=False load never leaves the tables silently unloaded). With strict=False the
    tables whose weight, weight_id, metadata and counters are all there load (other missing state
    starts at its initial values), the others stay as they were. Bad values raise TypeError /
    ValueError before any table changes.
    """
    states, problems, torchrec_states = {}, unknown, []
    for t, prefix in prefixes.items():
        expected = tables.state_keys(t)
        mine = {k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix)}
        if "weight" in mine and "weight_id" not in mine:
            torchrec_states.append(prefix)
        ignored = (
            []
            if tables.optimizer is not None
            else [k for k in mine if k.startswith(("optimizer.", "fallback_optimizer."))]
        )
        missing = [k for k in expected if k not in mine and k != "row"]
        unexpected = [k for k in mine if k not in expected and k not in ignored]
        missing_keys.extend(prefix + k for k in missing)
        unexpected_keys.extend(prefix + k for k in unexpected)
        problems = problems or bool(missing or unexpected)
        if not any(k in missing for k in _REQUIRED_STATE):
            states[t] = {k: v for k, v in mine.items() if k in expected}
    if torchrec_states:  # the likeliest missing-keys load: a TorchRec EBC / EC's state
        hint = (
            f"tables {torchrec_states}: the state has 'weight' but no 'weight_id', as a TorchRec "
            "EmbeddingBagCollection / EmbeddingCollection saves its rows (row k for id k); load such a "
            "state with torchrec_ext.modules.from_ebc_state_dict(module, state_dict, prefix=<the module's "
            "key prefix>)"
        )
        if strict is False:
            warnings.warn(hint + "; those tables were not loaded", stacklevel=4)
        else:
            error_msgs.append(hint)
    if problems and strict is not False:
        if strict is None:
            error_msgs.append(
                f"tables {sorted(prefixes.values())} not loaded: their keys are incomplete or unexpected (see "
                "the missing / unexpected keys), and a dynamic collection nested in another module cannot see "
                "the load's strictness, so it loads none of them; call load_state_dict(..., strict=False) on "
                "the collection itself to load the complete tables, or pass the complete state"
            )
        return
    tables.load_states(states, where="load_state_dict")
