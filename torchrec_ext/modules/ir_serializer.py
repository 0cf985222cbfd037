"""TorchRec's IR serializer round trip for our collections: ``encapsulate_ir_modules`` →
``torch.export`` → ``decapsulate_ir_modules``.

Encapsulating a DynamicEmbeddingBagCollection / DynamicEmbeddingCollection stores its
configuration as JSON in an ``ir_metadata`` buffer and swaps its forward for a shape-only op, so
the exported program holds the model's dense part and, for our module, one opaque call; its
tables are not in the program. Decapsulating rebuilds the module from the JSON (same tables,
options, weighting and optimizer), empty: the table contents travel as TorchRec's do, through
``state_dict`` loaded after decapsulation.

TorchRec's ``torchrec.ir`` has no ``__init__.py`` and so is not in its pip wheels (1.6-1.8).
Where it is importable (a source install) our serializers subclass its ``JsonSerializer`` and
register in its table, so TorchRec's own ``encapsulate_ir_modules`` / ``decapsulate_ir_modules``
handle our modules; elsewhere the two functions below do the same round trip, in the same
format (a model holding TorchRec's own EBC then needs TorchRec's).
"""

from __future__ import annotations

import dataclasses
import enum
import json
from typing import Any

import torch
from torch import Tensor, nn
from torchrec.modules.embedding_configs import DataType, PoolingType
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor, KeyedTensor

from torchrec_ext.modules.configs import (
    DynamicEmbeddingBagConfig,
    DynamicEmbeddingConfig,
    Initializer,
    initializer_from_init_fn,
    options_of,
)
from torchrec_ext.modules.embedding_bag_collection import DynamicEmbeddingBagCollection
from torchrec_ext.modules.embedding_collection import DynamicEmbeddingCollection

try:  # TorchRec source installs only (see the module docstring)
    from torchrec.ir.serializer import JsonSerializer as _TorchRecJsonSerializer
    from torchrec.ir.utils import decapsulate_ir_modules as _torchrec_decapsulate
    from torchrec.ir.utils import encapsulate_ir_modules as _torchrec_encapsulate
except ImportError:
    _TorchRecJsonSerializer = None
    _torchrec_encapsulate = _torchrec_decapsulate = None

TORCHREC_IR_AVAILABLE = _TorchRecJsonSerializer is not None
METADATA_BUFFER = "ir_metadata"  # TorchRec's name: decapsulation looks for it


def qualname(m: nn.Module | type) -> str:
    cls = m if isinstance(m, type) else type(m)
    return f"{cls.__module__}.{cls.__qualname__}"


# ----------------------------------------------------------------------------- shape-only ops


@torch.library.custom_op("torchrec_ext::ir_pooled_lookup", mutates_args=())
def ir_pooled_lookup(tensors: list[Tensor | None], batch_size: int, dims: list[int]) -> list[Tensor]:
    """Stands for a pooled lookup in an exported program: [batch_size, dim] per feature."""
    device = next(t.device for t in tensors if t is not None)
    return [torch.zeros(batch_size, d, device=device) for d in dims]


@ir_pooled_lookup.register_fake
def _(tensors, batch_size, dims):
    device = next(t.device for t in tensors if t is not None)
    return [torch.empty(batch_size, d, device=device) for d in dims]


@torch.library.custom_op("torchrec_ext::ir_sequence_lookup", mutates_args=())
def ir_sequence_lookup(ids: Tensor, dim: int) -> Tensor:
    """Stands for a sequence lookup in an exported program: [number of ids, dim]."""
    return torch.zeros(ids.shape[0], dim, device=ids.device)


@ir_sequence_lookup.register_fake
def _(ids, dim):
    return ids.new_empty(ids.shape[0], dim, dtype=torch.float32)


def _ebc_meta_forward(
    ebc: DynamicEmbeddingBagCollection, features: KeyedJaggedTensor, weighted_features: Any = None
) -> KeyedTensor:
    plan = ebc._plan
    tensors = [features.values(), features.weights_or_none(), features.lengths_or_none(), features.offsets_or_none()]
    outputs = torch.ops.torchrec_ext.ir_pooled_lookup(tensors, features.stride(), plan.dims)
    return KeyedTensor(keys=plan.embedding_names, length_per_key=plan.dims, values=torch.cat(outputs, dim=1))


def _ec_meta_forward(
    ec: DynamicEmbeddingCollection, features: KeyedJaggedTensor, weighted_features: Any = None
) -> dict[str, JaggedTensor]:
    plan, per_feature = ec._plan, features.to_dict()
    out = {}
    for feature, name in zip(plan.features, plan.embedding_names):
        jt = per_feature[feature]
        vectors = torch.ops.torchrec_ext.ir_sequence_lookup(jt.values(), ec.embedding_dim())
        out[name] = JaggedTensor(
            values=vectors, lengths=jt.lengths(), weights=jt.values() if ec.need_indices() else None
        )
    return out


# ----------------------------------------------------------------------------- configs as JSON


def _config_to_dict(config: Any) -> dict[str, Any]:
    """A table config as JSON-able fields, as the Dynamic*Config the decapsulated module gets:
    ``init_fn`` is replaced by the Initializer it stands for (a TorchRec default or a torch.nn.init
    partial; any other callable is refused by initializer_from_init_fn, naming the table)."""
    if config.virtual_table_eviction_policy is not None:
        raise ValueError(
            f"table {config.name!r}: virtual_table_eviction_policy cannot be serialized (a TorchRec virtual-table "
            f"option our tables do not read), got {config.virtual_table_eviction_policy!r}"
        )
    init = options_of(config).initializer
    if init is None:
        init = initializer_from_init_fn(config.init_fn, config.name)
    elif isinstance(init, str):
        init = Initializer(init)
    out: dict[str, Any] = {}
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if field.name == "init_fn":
            value = None
        elif field.name == "initializer":
            value = dataclasses.asdict(init)
        elif isinstance(value, enum.Enum):
            value = value.value
        out[field.name] = value
    out["initializer"] = dataclasses.asdict(init)  # a plain TorchRec config has no such field
    return out


def _config_from_dict(fields: dict[str, Any], cls: type) -> Any:
    fields = dict(fields)
    fields["data_type"] = DataType(fields["data_type"])
    if "pooling" in fields:
        fields["pooling"] = PoolingType(fields["pooling"])
    fields["initializer"] = Initializer(**fields["initializer"])
    return cls(**fields)


def _optimizer_to_dict(module: Any) -> dict[str, Any] | None:
    """The optimizer chosen for the tables (constructor, apply_optimizer_in_backward or
    fuse_embedding_optimizer): its kind and hyper-parameters; None when none was chosen (the
    rebuilt module then takes TorchRec's fused default at its first backward, as this one did)."""
    spec = module._chosen_spec()
    return None if spec is None else {"optimizer": spec.kind, "kwargs": spec.torch_kwargs()}


# ----------------------------------------------------------------------------- serializers

_Base = _TorchRecJsonSerializer if TORCHREC_IR_AVAILABLE else object


class DynamicJsonSerializer(_Base):  # type: ignore[misc, valid-type]
    """TorchRec's JsonSerializer contract: ``module_to_serializer_cls`` maps a module class's
    qualified name to its serializer (TorchRec's own table when torchrec.ir is importable, so it
    knows ours too); each serializer has ``_module_cls``, ``serialize_to_dict``,
    ``deserialize_from_dict`` and ``swap_meta_forward``."""

    module_to_serializer_cls: dict[str, type] = (
        _TorchRecJsonSerializer.module_to_serializer_cls if TORCHREC_IR_AVAILABLE else {}
    )
    _module_cls: type | None = None
    _children: list[str] | None = None

    @classmethod
    def children(cls, module: nn.Module) -> list[str]:
        return list(cls._children or [])

    @classmethod
    def swap_meta_forward(cls, module: nn.Module) -> None:
        pass

    if not TORCHREC_IR_AVAILABLE:  # else TorchRec's, which write and read the same buffer

        @classmethod
        def encapsulate_module(cls, module: nn.Module) -> list[str]:
            typename = qualname(module)
            serializer = cls.module_to_serializer_cls.get(typename)
            if serializer is None:
                raise ValueError(f"Expected typename to be one of {list(cls.module_to_serializer_cls)}, got {typename}")
            raw = {"typename": typename, "metadata_dict": serializer.serialize_to_dict(module)}
            buffer = torch.frombuffer(bytearray(json.dumps(raw).encode()), dtype=torch.uint8)
            module.register_buffer(METADATA_BUFFER, buffer, persistent=False)
            serializer.swap_meta_forward(module)
            return serializer.children(module)

        @classmethod
        def decapsulate_module(cls, module: nn.Module, device: torch.device | None = None) -> nn.Module:
            raw = json.loads(module.get_buffer(METADATA_BUFFER).numpy().tobytes().decode())
            serializer = cls.module_to_serializer_cls.get(raw["typename"])
            if serializer is None:
                raise ValueError(
                    f"Expected typename to be one of {list(cls.module_to_serializer_cls)}, got {raw['typename']}"
                )
            return serializer.deserialize_from_dict(raw["metadata_dict"], device, module)


def _device_of(metadata: dict[str, Any], device: torch.device | None) -> torch.device:
    return torch.device(device) if device is not None else torch.device(metadata["device"])


class DynamicEBCJsonSerializer(DynamicJsonSerializer):
    _module_cls = DynamicEmbeddingBagCollection

    @classmethod
    def swap_meta_forward(cls, module: nn.Module) -> None:
        module.forward = _ebc_meta_forward.__get__(module, cls._module_cls)

    @classmethod
    def serialize_to_dict(cls, module: nn.Module) -> dict[str, Any]:
        return {
            "tables": [_config_to_dict(c) for c in module.embedding_bag_configs()],
            "is_weighted": module.is_weighted(),
            "device": str(module.device),
            "optimizer": _optimizer_to_dict(module),
            "per_rank_tables": module.per_rank_tables,
        }

    @classmethod
    def deserialize_from_dict(
        cls, metadata_dict: dict[str, Any], device: torch.device | None = None, unflatten_ep: nn.Module | None = None
    ) -> nn.Module:
        opt = metadata_dict["optimizer"] or {}
        return DynamicEmbeddingBagCollection(
            tables=[_config_from_dict(t, DynamicEmbeddingBagConfig) for t in metadata_dict["tables"]],
            is_weighted=metadata_dict["is_weighted"],
            device=_device_of(metadata_dict, device),
            optimizer=opt.get("optimizer"),
            optimizer_kwargs=opt.get("kwargs"),
            per_rank_tables=metadata_dict.get("per_rank_tables", False),  # absent from older exports
        )


class DynamicECJsonSerializer(DynamicJsonSerializer):
    _module_cls = DynamicEmbeddingCollection

    @classmethod
    def swap_meta_forward(cls, module: nn.Module) -> None:
        module.forward = _ec_meta_forward.__get__(module, cls._module_cls)

    @classmethod
    def serialize_to_dict(cls, module: nn.Module) -> dict[str, Any]:
        return {
            "tables": [_config_to_dict(c) for c in module.embedding_configs()],
            "need_indices": module.need_indices(),
            "use_gather_select": module.use_gather_select(),
            "use_gather_select_per_sharding": module.use_gather_select_per_sharding(),
            "device": str(module.device),
            "optimizer": _optimizer_to_dict(module),
            "per_rank_tables": module.per_rank_tables,
        }

    @classmethod
    def deserialize_from_dict(
        cls, metadata_dict: dict[str, Any], device: torch.device | None = None, unflatten_ep: nn.Module | None = None
    ) -> nn.Module:
        opt = metadata_dict["optimizer"] or {}
        return DynamicEmbeddingCollection(
            tables=[_config_from_dict(t, DynamicEmbeddingConfig) for t in metadata_dict["tables"]],
            device=_device_of(metadata_dict, device),
            need_indices=metadata_dict["need_indices"],
            use_gather_select=metadata_dict["use_gather_select"],
            use_gather_select_per_sharding=metadata_dict["use_gather_select_per_sharding"],
            optimizer=opt.get("optimizer"),
            optimizer_kwargs=opt.get("kwargs"),
            per_rank_tables=metadata_dict.get("per_rank_tables", False),  # absent from older exports
        )


for _serializer in (DynamicEBCJsonSerializer, DynamicECJsonSerializer):
    DynamicJsonSerializer.module_to_serializer_cls[qualname(_serializer._module_cls)] = _serializer

if TORCHREC_IR_AVAILABLE:
    from torchrec.ir.serializer import FPEBCJsonSerializer as _TorchRecFPEBCSerializer
    from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection

    class FPEBCOverDynamicJsonSerializer(_TorchRecFPEBCSerializer):
        """TorchRec's FP-EBC serializer, whose deserializer asserts that the EBC inside is
        TorchRec's: an FP-EBC over ours is rebuilt the same way around our (decapsulated) EBC.
        (Without torchrec.ir an FP-EBC is not encapsulated: its EBC is, and the processors stay
        in the program.)"""

        @classmethod
        def deserialize_from_dict(
            cls,
            metadata_dict: dict[str, Any],
            device: torch.device | None = None,
            unflatten_ep: nn.Module | None = None,
        ) -> nn.Module:
            ebc = unflatten_ep._embedding_bag_collection
            if not isinstance(ebc, DynamicEmbeddingBagCollection):
                return super().deserialize_from_dict(metadata_dict, device, unflatten_ep)
            processors = unflatten_ep._feature_processors
            if not metadata_dict["is_fp_collection"]:
                processors = {f: getattr(processors, f) for f in metadata_dict["features"]}
            return FeatureProcessedEmbeddingBagCollection(ebc, processors)

    DynamicJsonSerializer.module_to_serializer_cls[qualname(FeatureProcessedEmbeddingBagCollection)] = (
        FPEBCOverDynamicJsonSerializer
    )


# ----------------------------------------------------------------------------- the round trip


def encapsulate_ir_modules(
    module: nn.Module, serializer: type = DynamicJsonSerializer, fqn: str = ""
) -> tuple[nn.Module, list[str]]:
    """TorchRec's ``encapsulate_ir_modules`` (its own where torchrec.ir is importable): each
    module ``serializer`` knows gets its ``ir_metadata`` buffer and shape-only forward, in place.
    Returns the module and their fully qualified names, for ``torch.export.export(...,
    preserve_module_call_signature=tuple(fqns))``."""
    if _torchrec_encapsulate is not None:
        return _torchrec_encapsulate(module, serializer, fqn)
    fqns: list[str] = []
    if qualname(module) in serializer.module_to_serializer_cls:
        children = serializer.encapsulate_module(module)
        fqns.append(fqn)
    else:
        children = [name for name, _ in module.named_children()]
    for child in children:
        _, found = encapsulate_ir_modules(module.get_submodule(child), serializer, f"{fqn}.{child}" if fqn else child)
        fqns.extend(found)
    return module, fqns


def decapsulate_ir_modules(
    module: nn.Module, serializer: type = DynamicJsonSerializer, device: torch.device | None = None
) -> nn.Module:
    """TorchRec's ``decapsulate_ir_modules`` (its own where torchrec.ir is importable): in an
    unflattened exported program, each submodule with an ``ir_metadata`` buffer is replaced by
    the module it describes, built empty on ``device`` (default: the one it was on); load the
    original's ``state_dict`` into the result for the tables' rows."""
    if _torchrec_decapsulate is not None:
        return _torchrec_decapsulate(module, serializer, device)
    for name, child in list(module.named_children()):
        setattr(module, name, decapsulate_ir_modules(child, serializer, device))
    if METADATA_BUFFER in dict(module.named_buffers(recurse=False)):
        module = serializer.decapsulate_module(module, device)
    return module
