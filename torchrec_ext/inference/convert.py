"""Converting a trained model's dynamic collections into serving modules.

``convert_to_inference(model)`` walks the model (as TorchRec's ``quantize_inference_model``
does) and swaps every DynamicEmbeddingBagCollection / DynamicEmbeddingCollection for its
read-only serving form, holding the rows the module holds now, or those of a ``state_dict``
(then the dense parameters load from it too). ``load_inference_checkpoint`` does the same from a
checkpoint written by ``torchrec_ext.distributed.checkpoint.save_checkpoint`` (any world size).
The returned model is a copy (the dense modules copied, the dynamic ones replaced, the trained
model untouched) in eval mode.

Each table keeps the trained table's capacity (``capacity=`` gives more room for the ids its
deltas will bring) and its ids' rows, stored as the trained table's dtype or ``data_type``
(float32 / float16 / bfloat16, or int8: row-wise quantized as TorchRec's quantized EBC).
A state or checkpoint that does not fit the model (a table missing, another dim, bad values) is
refused with a ValueError naming the table, before anything is built.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torchrec.modules.embedding_configs import BaseEmbeddingConfig, DataType

from torchrec_ext.hashing import fallback_seed, table_seed
from torchrec_ext.inference.modules import InferenceEmbeddingBagCollection, InferenceEmbeddingCollection
from torchrec_ext.inference.storage import INT8, SERVING_DTYPES, InferenceTables, ServingTable
from torchrec_ext.modules.configs import STORAGE_DATA_TYPES, options_of
from torchrec_ext.modules.embedding_bag_collection import DynamicEmbeddingBagCollection
from torchrec_ext.modules.embedding_collection import DynamicEmbeddingCollection
from torchrec_ext.modules.features import LookupPlan
from torchrec_ext.modules.state_checks import _check_distinct, _checked
from torchrec_ext.table import LAYOUT_VERSION, HashTable, place_keys

DYNAMIC_MODULES = (DynamicEmbeddingBagCollection, DynamicEmbeddingCollection)
_DATA_TYPES = {
    DataType.FP32: torch.float32,
    DataType.FP16: torch.float16,
    DataType.BF16: torch.bfloat16,
    DataType.INT8: INT8,
}
_NAMES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "int8": INT8}
DataTypeArg = None | str | torch.dtype | DataType
PerTable = Any  # None, one value for every table, or table name -> value


def convert_to_inference(
    model: nn.Module,
    *,
    state_dict: Mapping[str, Any] | None = None,
    data_type: DataTypeArg = None,
    defaults: Mapping[str, Any] | None = None,
    capacity: PerTable = None,
) -> nn.Module:
    """A copy of ``model`` (or of a dynamic collection itself) whose dynamic collections are
    serving modules, in eval mode.

    Args:
        state_dict: the trained model's state_dict (keys as ``model.state_dict()``'s); None: the
            rows the model's dynamic collections hold now (and its dense parameters as they are).
        data_type: how rows are kept: ``torch.float32`` / ``float16`` / ``bfloat16`` / ``torch.int8``
            (or TorchRec's DataType, or "fp32" / "fp16" / "bf16" / "int8"); None: each table's
            trained dtype (float32 rows then read bit for bit as the trained module's).
        defaults: table name -> the vector (or one value for every element) that ids the table
            does not hold read; tables not named read zeros.
        capacity: rows per table (an int for all, or table name -> int); default: the trained
            table's ``num_embeddings``. More room for the new ids deltas bring.
    """
    dynamic = {path: m for path, m in model.named_modules() if isinstance(m, DYNAMIC_MODULES)}
    if not dynamic:
        raise ValueError(
            f"convert_to_inference: {type(model).__name__} holds no DynamicEmbeddingBagCollection "
            "or DynamicEmbeddingCollection to convert"
        )
    where = "convert_to_inference"
    served = {
        path: serving_module(m, _state_source(m, path, state_dict, where), where, data_type, defaults, capacity)
        for path, m in dynamic.items()
    }
    if "" in served:  # the model is a dynamic collection itself
        return served[""].eval()
    copy_of = copy.deepcopy(model, {id(m): served[path] for path, m in dynamic.items()})
    if state_dict is not None:
        _load_dense(copy_of, state_dict, list(dynamic), where)
    return copy_of.eval()


def load_inference_checkpoint(path: str, model: nn.Module, key: str = "model", **kwargs: Any) -> nn.Module:
    """``convert_to_inference(model, state_dict=<the checkpoint's state[key]>, **kwargs)`` for a
    checkpoint directory written by ``save_checkpoint``, or a link of an incremental chain written
    by ``IncrementalCheckpoints`` (its tables replayed from the base through every delta, all
    ranks' shares merged; verified first, the whole chain). ``model`` is the
    trained architecture, unsharded (it may be built on the meta device: only its structure and
    configs are read). Only the dense state and each table's ids, rows and counters are read."""
    from torchrec_ext.distributed.checkpoint import load_checkpoint, read_manifest, read_metadata, verify_checkpoint
    from torchrec_ext.inference.checkpoint_chain import refuse_missing

    where = "load_inference_checkpoint"
    verify_checkpoint(path)
    dynamic = {p: m for p, m in model.named_modules() if isinstance(m, DYNAMIC_MODULES)}
    if "incremental" in read_manifest(path):
        return convert_to_inference(model, state_dict=_incremental_state(path, model, dynamic, key, where), **kwargs)
    stored = read_metadata(path).state_dict_metadata
    request: dict[str, Any] = {}
    for name, value in model.state_dict().items():
        if not _under(name, list(dynamic)):
            # On meta (structure only): a host tensor of the same size for DCP to fill.
            request[name] = torch.empty(value.shape, dtype=value.dtype, device="cpu") if value.is_meta else value
    for p, m in dynamic.items():
        for cfg in _configs(m):
            prefix = _table_prefix(m, p, cfg.name)
            for entry in ("weight", "weight_id", "counters", "last_seen", "fallback_weight"):
                if f"{key}.{prefix}{entry}" in stored:
                    request[prefix + entry] = torch.empty(0, device="cpu")  # sized by load_checkpoint
                elif entry in ("weight", "weight_id"):
                    raise ValueError(
                        f"{where}: table {cfg.name!r} ({prefix[:-1]}) is not in checkpoint {path!r} "
                        f"(no {key}.{prefix}{entry}): a checkpoint of another model?"
                    )
    refuse_missing(where, path, key, list(request), stored)
    state = load_checkpoint(path, {key: request}, verify=False)[key]
    return convert_to_inference(model, state_dict=state, **kwargs)


def _incremental_state(path: str, model: nn.Module, dynamic: dict[str, nn.Module], key: str, where: str) -> dict:
    """``model``'s state_dict from the incremental checkpoint ``path`` (``checkpoint_chain.py``)."""
    from torchrec_ext.inference.checkpoint_chain import MODEL_KEY, read_incremental

    if key != MODEL_KEY:
        raise ValueError(f"{where}: an incremental checkpoint keeps the model under key {MODEL_KEY!r}, got key={key!r}")
    tables, state = read_incremental(path, model, list(dynamic), where)
    for p, module in dynamic.items():
        for cfg in _configs(module):
            if cfg.name not in tables[p]:
                raise ValueError(
                    f"{where}: table {cfg.name!r} ({p or 'the model'}) is not in checkpoint {path!r} (its module "
                    f"holds {sorted(tables[p])}): a checkpoint of another model?"
                )
            state.update({_table_prefix(module, p, cfg.name) + k: v for k, v in tables[p][cfg.name].items()})
    return state


def serving_module(
    module: nn.Module,
    table_state: Callable[[str], Mapping[str, Any]],
    where: str,
    data_type: DataTypeArg = None,
    defaults: Mapping[str, Any] | None = None,
    capacity: PerTable = None,
) -> nn.Module:
    """The serving form of one dynamic collection, its tables' states given by name
    (``weight``, ``weight_id``; optional ``row``, ``counters``, ``last_seen``)."""
    configs = _configs(module)
    names = [cfg.name for cfg in configs]
    for arg, given in (("defaults", defaults), ("capacity", capacity if isinstance(capacity, Mapping) else None)):
        unknown = sorted(set(given or {}) - set(names))
        if unknown:
            raise ValueError(
                f"{where}: {arg} names tables {unknown} that {type(module).__name__} does not have "
                f"(its tables: {names})"
            )
    loaded = [_table_rows(cfg, table_state(cfg.name), where) for cfg in configs]  # every table checked first
    metas = [
        ServingTable(
            cfg.name,
            _capacity_of(cfg, capacity, ids.numel(), where),
            cfg.embedding_dim,
            _serving_dtype(data_type, cfg, where),
            _source_dtype(cfg, vectors),
            options_of(cfg).fallback_rows or 0,
            fallback_seed(table_seed(options_of(cfg).seed, cfg.name)),
        )
        for cfg, (ids, vectors, _) in zip(configs, loaded)
    ]
    fallback = [_fallback_rows(m, table_state(m.name), where) for m in metas]
    given = sorted(m.name for m in metas if m.fallback_rows and m.name in (defaults or {}))
    if given:
        raise ValueError(
            f"{where}: defaults names tables {given} that have learned fallback rows (their unseen ids "
            "read those, as in training)"
        )
    placed = [_placed_index(m, ids, rows, where) for m, (ids, _, rows) in zip(metas, loaded)]
    default_vectors = [_default_vector(m, (defaults or {}).get(m.name), where) for m in metas]
    pooled = isinstance(module, DynamicEmbeddingBagCollection)
    storage = InferenceTables(metas, LookupPlan.of(configs), pooled)
    for t, ((index, rows), (_, vectors, _), default) in enumerate(zip(placed, loaded, default_vectors)):
        storage.set_index(t, index)
        view = storage.row_view(t)
        view[rows] = storage.encode(t, vectors)
        if fallback[t] is not None:
            storage.set_fallback(t, torch.arange(metas[t].fallback_rows, device="cpu"), fallback[t])
        else:
            storage.set_default(t, default)
    for t, cfg in enumerate(configs):
        if options_of(cfg).ttl_steps is not None:  # ids left out as expired: the source tombstones them later
            held = table_state(cfg.name)["weight_id"].to(torch.int64).cpu()
            storage.left_out[t] = held[~torch.isin(held, loaded[t][0])]
    if pooled:
        return InferenceEmbeddingBagCollection(configs, storage, module.is_weighted())
    return InferenceEmbeddingCollection(configs, storage, module.need_indices())


# ---------------------------------------------------------------------- helpers


def _configs(module: nn.Module) -> list[BaseEmbeddingConfig]:
    return (
        module.embedding_bag_configs()
        if isinstance(module, DynamicEmbeddingBagCollection)
        else module.embedding_configs()
    )


def _table_prefix(module: nn.Module, path: str, table: str) -> str:
    return f"{path}.{module._container}.{table}." if path else f"{module._container}.{table}."


def _under(key: str, paths: Sequence[str]) -> bool:
    return any(p == "" or key.startswith(p + ".") for p in paths)


def _state_source(
    module: nn.Module, path: str, state_dict: Mapping[str, Any] | None, where: str
) -> Callable[[str], Mapping[str, Any]]:
    """Table name -> its state: from ``state_dict`` (refusing tables the module lacks), or the
    module's rows now."""
    if state_dict is None:
        tables = module._tables
        tables.check_ready(where)
        index_of = {m.name: t for t, m in enumerate(tables.meta)}
        return lambda name: tables.table_state(index_of[name])
    container = f"{path}.{module._container}." if path else f"{module._container}."
    names = {cfg.name for cfg in _configs(module)}
    extra = sorted({k[len(container) :].split(".")[0] for k in state_dict if k.startswith(container)} - names)
    if extra:
        raise ValueError(
            f"{where}: the state_dict has tables {extra} under {container[:-1]!r}, which "
            f"{type(module).__name__} does not have (its tables: {sorted(names)}): a state_dict "
            "of another model?"
        )
    return lambda name: {
        k[len(prefix) :]: v
        for prefix in [_table_prefix(module, path, name)]
        for k, v in state_dict.items()
        if k.startswith(prefix)
    }


def _table_rows(cfg: BaseEmbeddingConfig, state: Mapping[str, Any], where: str) -> tuple[Tensor, Tensor, Tensor | None]:
    """A table's live (ids, vectors, saved rows or None), checked against its config. Ids past
    their TTL at the saved step are left out: the trained module reads them as unseen."""
    name = f"{where}: table {cfg.name!r}"
    for key in ("weight", "weight_id"):
        if key not in state:
            raise ValueError(
                f"{name}: the state has no {key!r} for this table (the model's table is missing from "
                "it: a state_dict or checkpoint of another model?)"
            )
    weight = state["weight"]
    if isinstance(weight, Tensor) and weight.dim() == 2 and weight.shape[1] != cfg.embedding_dim:
        raise ValueError(
            f"{name}: the state's weight has dim {weight.shape[1]}, the model's table has embedding_dim "
            f"{cfg.embedding_dim} (a state_dict or checkpoint of another model?)"
        )
    ids = _checked(name, "weight_id", state["weight_id"], "int", None).to(torch.int64).cpu()
    vectors = _checked(name, "weight", weight, "float", (ids.numel(), cfg.embedding_dim), ids).cpu()
    _check_distinct(name, "weight_id", ids)
    rows = state.get("row")
    if rows is not None:
        rows = _checked(name, "row", rows, "int", (ids.numel(),)).to(torch.int64).cpu()
    ttl = options_of(cfg).ttl_steps
    if ttl is not None and "last_seen" in state and "counters" in state:
        counters = _checked(name, "counters", state["counters"], "int", None)  # [5] ([4] before the layout version)
        if counters.numel() not in (4, 5):
            raise ValueError(
                f"{name}: counters must have 5 entries (4 in states saved before the layout version), "
                f"got {counters.numel()}"
            )
        train_step = int(counters[2])
        live = _checked(name, "last_seen", state["last_seen"], "int", (ids.numel(),)).cpu() >= train_step - ttl
        ids, vectors, rows = ids[live], vectors[live], None if rows is None else rows[live]
    return ids, vectors, rows


def _serving_dtype(data_type: DataTypeArg, cfg: BaseEmbeddingConfig, where: str) -> torch.dtype:
    if data_type is None:
        return STORAGE_DATA_TYPES.get(cfg.data_type, torch.float32)
    dtype = (
        _DATA_TYPES.get(data_type)
        if isinstance(data_type, DataType)
        else _NAMES.get(data_type.lower())
        if isinstance(data_type, str)
        else data_type
    )
    if dtype not in SERVING_DTYPES:
        raise ValueError(
            f"{where}: data_type must be one of float32, float16, bfloat16, int8 (a torch dtype, "
            f"TorchRec DataType or its name), got {data_type!r}"
        )
    return dtype


def _source_dtype(cfg: BaseEmbeddingConfig, vectors: Tensor) -> torch.dtype:
    """The dtype the trained table's deltas carry: its storage dtype."""
    return STORAGE_DATA_TYPES.get(cfg.data_type, vectors.dtype)


def _capacity_of(cfg: BaseEmbeddingConfig, capacity: PerTable, live: int, where: str) -> int:
    value = (
        capacity.get(cfg.name, cfg.num_embeddings)
        if isinstance(capacity, Mapping)
        else cfg.num_embeddings
        if capacity is None
        else capacity
    )
    if not isinstance(value, int) or isinstance(value, bool) or value < max(live, 1):
        raise ValueError(
            f"{where}: table {cfg.name!r} capacity must be an int >= its {live} live ids (and >= 1), got {value!r}"
        )
    return value


def _placed_index(m: ServingTable, ids: Tensor, rows: Tensor | None, where: str) -> tuple[HashTable, Tensor]:
    """The table's index holding ``ids``: at their saved rows when valid at this capacity, else placed afresh."""
    index = HashTable(m.capacity, policy="none")
    entry = {
        "capacity": m.capacity,
        "policy": "none",
        "clock": 0,
        "epoch": 0,
        "layout": LAYOUT_VERSION,  # rows outside a key's buckets are stashed (place_keys at load 1)
        "keys": ids,
        "scores": torch.zeros_like(ids),
    }
    if rows is not None:
        try:
            index.load_state_dict(dict(entry, rows=rows))
            return index, rows
        except ValueError:
            pass  # saved at another capacity
    rows = place_keys(ids, entry["scores"], m.capacity)
    refused = int((rows < 0).sum())
    if refused:
        raise ValueError(
            f"{where}: table {m.name!r}: {refused} of its {ids.numel()} ids find no row at capacity "
            f"{m.capacity} (their buckets are full); convert with more capacity (capacity=...)"
        )
    index.load_state_dict(dict(entry, rows=rows))
    return index, rows


def _fallback_rows(m: ServingTable, state: Mapping[str, Any], where: str) -> Tensor | None:
    """A table's trained fallback rows, float [fallback_rows, dim] (None: it has none)."""
    if not m.fallback_rows:
        return None
    name = f"{where}: table {m.name!r}"
    if "fallback_weight" not in state:
        raise ValueError(
            f"{name}: the table has fallback_rows={m.fallback_rows} but the state has no "
            "'fallback_weight' (a state of another model?)"
        )
    return _checked(name, "fallback_weight", state["fallback_weight"], "float", (m.fallback_rows, m.dim)).cpu()


def _default_vector(m: ServingTable, value: Any, where: str) -> Tensor:
    """float32 [dim]: what ids the table does not hold read."""
    if value is None:
        return torch.zeros(m.dim, device="cpu")
    vector = torch.as_tensor(value, dtype=torch.float32, device="cpu").flatten()
    if vector.numel() == 1:
        vector = vector.expand(m.dim)
    if vector.numel() != m.dim or not bool(torch.isfinite(vector).all()):
        raise ValueError(
            f"{where}: defaults[{m.name!r}] must be one finite value or {m.dim} of them (the table's "
            f"dim), got {value!r}"
        )
    return vector.clone()


def _load_dense(model: nn.Module, state_dict: Mapping[str, Any], dynamic: Sequence[str], where: str) -> None:
    """The dense parameters and buffers of ``model`` (its serving modules hold none) from ``state_dict``."""
    expected = set(model.state_dict())
    given = {k: v for k, v in state_dict.items() if not _under(k, dynamic)}
    missing, unexpected = sorted(expected - set(given)), sorted(set(given) - expected)
    if missing or unexpected:
        raise ValueError(
            f"{where}: the state_dict does not fit the model's dense part: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]} (a state_dict of another model?)"
        )
    on_meta = any(v.is_meta for v in model.state_dict().values())
    try:
        model.load_state_dict(given, strict=True, assign=on_meta)
    except RuntimeError as e:  # sizes that differ: torch names the parameter
        raise ValueError(f"{where}: {e}") from None
