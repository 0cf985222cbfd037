"""An incremental checkpoint (``torchrec_ext.distributed.checkpoint_incremental``: a base, then
deltas) read for serving: every rank's share of each table replayed through the chain and the
ranks' shares merged, as state_dict entries of the unsharded model; its dense state from the
checkpoint's DCP part. ``load_inference_checkpoint`` converts what this returns."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from torchrec_ext.distributed.checkpoint import CheckpointError, ensure_process_group, load_dcp, read_metadata
from torchrec_ext.distributed.checkpoint_incremental import MODEL_KEY, chain_links, replay_rank

# Per-row entries, concatenated over the ranks; the per-table ones (the trained step in the
# counters, fallback rows) are alike on every rank holding the table: the first one's is kept.
_PER_ROW = ("weight", "weight_id", "last_seen")
_PER_TABLE = ("counters", "fallback_weight")


def merged_tables(path: str) -> dict[str, dict[str, dict[str, Tensor]]]:
    """Module fqn (as the training model named it) -> table -> its live rows over all ranks."""
    links, world = chain_links(path)
    out: dict[str, dict[str, dict[str, Tensor]]] = {}
    for rank in range(world):
        for fqn, tables in replay_rank(links, rank, world).items():
            for name, state in tables.items():
                held = out.setdefault(fqn, {}).setdefault(name, {})
                for key in _PER_ROW:
                    if key in state:
                        held[key] = torch.cat([held[key], state[key]]) if key in held else state[key]
                for key in _PER_TABLE:
                    if key in state and key not in held:
                        held[key] = state[key]
    return out


def _saved_module(saved: Mapping[str, Any], path: str, where: str) -> Mapping[str, Any]:
    """The saved module that the unsharded model's module at ``path`` is: same fqn, or one that
    ends with it (a sharded model's wrapper adds a prefix)."""
    found = [
        fqn for fqn in saved if fqn == path or (path and fqn.endswith("." + path)) or (not path and len(saved) == 1)
    ]
    if len(found) != 1:
        raise ValueError(
            f"{where}: the incremental checkpoint holds dynamic modules {sorted(saved)}; "
            f"{'none' if not found else 'several'} of them is the model's {path or '(the model itself)'!r}: "
            "a checkpoint of another model?"
        )
    return saved[found[0]]


def read_incremental(
    path: str, model: nn.Module, dynamic_paths: Sequence[str], where: str
) -> tuple[dict[str, Mapping[str, dict[str, Tensor]]], dict[str, Tensor]]:
    """(the model's dynamic module path -> its tables' merged rows, the model's dense state) from
    incremental checkpoint ``path`` (verified by the caller); ``model`` is unsharded."""
    try:
        saved = merged_tables(path)
    except CheckpointError as e:
        raise ValueError(f"{where}: {e}") from None
    tables = {p: _saved_module(saved, p, where) for p in dynamic_paths}
    dense = _dense_request(model, dynamic_paths)
    refuse_missing(where, path, MODEL_KEY, dense, read_metadata(path).state_dict_metadata)
    load_dcp(path, {MODEL_KEY: dense}, ensure_process_group())
    return tables, dense


def refuse_missing(where: str, path: str, key: str, names: Sequence[str], stored: Mapping[str, Any]) -> None:
    """Refuses checkpoint ``path`` when it lacks ``key.<name>`` for some of ``names``."""
    missing = sorted(n for n in names if f"{key}.{n}" not in stored)
    if missing:
        raise ValueError(
            f"{where}: checkpoint {path!r} has no {key}.{missing[0]}"
            + (f" and {len(missing) - 1} more dense entries" if len(missing) > 1 else "")
            + ": a checkpoint of another model?"
        )


def _dense_request(model: nn.Module, dynamic_paths: Sequence[str]) -> dict[str, Tensor]:
    """The model's state outside its dynamic modules, as host tensors for DCP to fill."""
    out = {}
    for name, value in model.state_dict().items():
        if not any(p == "" or name.startswith(p + ".") for p in dynamic_paths):
            out[name] = torch.empty(value.shape, dtype=value.dtype, device="cpu") if value.is_meta else value.clone()
    return out
