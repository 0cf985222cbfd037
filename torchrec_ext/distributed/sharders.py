"""Sharders that let DistributedModelParallel and the planner shard our dynamic modules.

They offer ``table_wise``, ``row_wise`` and ``table_row_wise`` (ids spread by ``ops.route``),
``column_wise`` and ``table_column_wise`` (placement.py; not ``data_parallel``), with TorchRec's
``customized_kernel`` compute kernel, which the planner accepts with our estimators
(``torchrec_ext.distributed.planner``). Their ``fused_params`` choose the tables' fused
optimizer as TorchRec's sharders' do (``sharded_base.sharded_optimizer``). The FP-EBC sharder
shards TorchRec's FeatureProcessedEmbeddingBagCollection over our EBC (fp_embeddingbag.py) and
hands one over TorchRec's EBC to TorchRec's own.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torchrec.distributed.embedding_types import BaseEmbeddingSharder, EmbeddingComputeKernel
from torchrec.distributed.fp_embeddingbag import FeatureProcessedEmbeddingBagCollectionSharder
from torchrec.distributed.sharding_plan import get_default_sharders
from torchrec.distributed.types import (
    EmbeddingModuleShardingPlan,
    ModuleSharder,
    ParameterSharding,
    QuantizedCommCodecs,
    ShardingEnv,
)
from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection

from torchrec_ext.distributed.embedding import ShardedDynamicEmbeddingCollection
from torchrec_ext.distributed.embeddingbag import ShardedDynamicEmbeddingBagCollection
from torchrec_ext.distributed.fp_embeddingbag import ShardedFeatureProcessedDynamicEmbeddingBagCollection
from torchrec_ext.distributed.placement import SUPPORTED_SHARDING_TYPES
from torchrec_ext.modules import DynamicEmbeddingBagCollection, DynamicEmbeddingCollection
from torchrec_ext.modules.fused_optimizer import spec_from_fused_params


class _DynamicSharder:
    """What both sharders share: sharding types, kernel, fused_params checked up front, and the
    sharding itself (each names its module, its sharded module and its tables' container)."""

    _module_cls: type[nn.Module]
    _sharded_cls: type[nn.Module]
    _container: str  # the collection's attribute holding its per-table submodules

    def __init__(self, fused_params: dict[str, Any] | None = None, *args: Any, **kwargs: Any) -> None:
        spec_from_fused_params(fused_params, type(self).__name__)  # unsupported ones refused now
        super().__init__(fused_params, *args, **kwargs)

    def sharding_types(self, compute_device_type: str) -> list[str]:
        return list(SUPPORTED_SHARDING_TYPES)

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        return [EmbeddingComputeKernel.CUSTOMIZED_KERNEL.value]

    def shard(
        self,
        module: nn.Module,
        params: EmbeddingModuleShardingPlan,
        env: ShardingEnv,
        device: torch.device | None = None,
        module_fqn: str | None = None,
    ) -> nn.Module:
        return self._sharded_cls(module, params, env, device, fused_params=self.fused_params)

    @property
    def module_type(self) -> type[nn.Module]:
        return self._module_cls

    def shardable_parameters(self, module: nn.Module) -> dict[str, nn.Parameter]:
        return {name: table.weight for name, table in getattr(module, self._container).items()}


class DynamicEmbeddingBagCollectionSharder(_DynamicSharder, BaseEmbeddingSharder[DynamicEmbeddingBagCollection]):
    _module_cls, _sharded_cls = DynamicEmbeddingBagCollection, ShardedDynamicEmbeddingBagCollection
    _container = "embedding_bags"


class DynamicEmbeddingCollectionSharder(_DynamicSharder, BaseEmbeddingSharder[DynamicEmbeddingCollection]):
    _module_cls, _sharded_cls = DynamicEmbeddingCollection, ShardedDynamicEmbeddingCollection
    _container = "embeddings"


def over_dynamic_ebc(module: nn.Module) -> bool:
    """Whether ``module`` is a FeatureProcessedEmbeddingBagCollection over our dynamic EBC."""
    return isinstance(module, FeatureProcessedEmbeddingBagCollection) and isinstance(
        module._embedding_bag_collection, DynamicEmbeddingBagCollection
    )


class FeatureProcessedDynamicEmbeddingBagCollectionSharder(FeatureProcessedEmbeddingBagCollectionSharder):
    """TorchRec's sharder of ``FeatureProcessedEmbeddingBagCollection``, for FP-EBCs over either
    EBC (DistributedModelParallel takes one sharder per module type): one over our dynamic EBC is
    sharded with ``ebc_sharder`` (ours; fp_embeddingbag.py), one over TorchRec's EBC goes to
    ``stock_sharder`` (TorchRec's own FP sharder), unchanged. It offers both kinds' sharding types
    and compute kernels; the planner keeps, per module, the options of its kind (planner.py).
    ``fused_params`` are ``ebc_sharder``'s."""

    def __init__(
        self,
        ebc_sharder: DynamicEmbeddingBagCollectionSharder | None = None,
        stock_sharder: FeatureProcessedEmbeddingBagCollectionSharder | None = None,
        qcomm_codecs_registry: dict[str, QuantizedCommCodecs] | None = None,
    ) -> None:
        super().__init__(ebc_sharder or DynamicEmbeddingBagCollectionSharder(), qcomm_codecs_registry)
        self._stock_sharder = stock_sharder or FeatureProcessedEmbeddingBagCollectionSharder(
            qcomm_codecs_registry=qcomm_codecs_registry
        )

    def shard(
        self,
        module: FeatureProcessedEmbeddingBagCollection,
        params: dict[str, ParameterSharding],
        env: ShardingEnv,
        device: torch.device | None = None,
        module_fqn: str | None = None,
    ) -> nn.Module:
        if not over_dynamic_ebc(module):
            return self._stock_sharder.shard(module, params, env, device, module_fqn)
        device = torch.device(device) if device is not None else module._embedding_bag_collection.device
        return ShardedFeatureProcessedDynamicEmbeddingBagCollection(
            module, params, self._ebc_sharder, env, device, module_fqn
        )

    def shardable_parameters(self, module: FeatureProcessedEmbeddingBagCollection) -> dict[str, nn.Parameter]:
        sharder = self._ebc_sharder if over_dynamic_ebc(module) else self._stock_sharder._ebc_sharder
        return sharder.shardable_parameters(module._embedding_bag_collection)

    def sharding_types(self, compute_device_type: str) -> list[str]:
        stock = self._stock_sharder.sharding_types(compute_device_type)
        return stock + [t for t in self._ebc_sharder.sharding_types(compute_device_type) if t not in stock]

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        kernels = list(self._stock_sharder.compute_kernels(sharding_type, compute_device_type))
        if sharding_type in self._ebc_sharder.sharding_types(compute_device_type):
            kernels += [
                k for k in self._ebc_sharder.compute_kernels(sharding_type, compute_device_type) if k not in kernels
            ]
        return kernels


def _with_our_sharders(defaults: list[ModuleSharder[nn.Module]]) -> list[ModuleSharder[nn.Module]]:
    """Ours, then ``defaults`` but TorchRec's FP-EBC sharder, which ours wraps."""
    ebc_sharder = DynamicEmbeddingBagCollectionSharder()
    stock_fp = [s for s in defaults if s.module_type is FeatureProcessedEmbeddingBagCollection]
    fp_sharder = FeatureProcessedDynamicEmbeddingBagCollectionSharder(ebc_sharder, *stock_fp[:1])
    return [ebc_sharder, DynamicEmbeddingCollectionSharder(), fp_sharder] + [
        s for s in defaults if s.module_type is not FeatureProcessedEmbeddingBagCollection
    ]


def get_sharders() -> list[ModuleSharder[nn.Module]]:
    """Our sharders plus TorchRec's defaults: for DistributedModelParallel(model, sharders=...)
    on models mixing dynamic and stock TorchRec tables. TorchRec's FP-EBC sharder is replaced by
    ours, which hands it the FP-EBCs over TorchRec's EBC."""
    return _with_our_sharders(list(get_default_sharders()))


def install_default_sharder_lookup() -> None:
    """Let TorchRec's composable ``shard(module, plan)`` and ``construct_module_sharding_plan``
    find our sharders when none is passed: the per-type map they look in
    (``get_module_to_default_sharders``) gets ours, the FP-EBC one in place of TorchRec's (which it
    hands FP-EBCs over TorchRec's EBC). ``DistributedModelParallel``'s default sharders stay
    TorchRec's: it refuses our modules at planning, naming ``get_sharders()`` (planner.py).
    Idempotent; runs on ``import torchrec_ext.distributed``."""
    import torchrec.distributed.shard as shard_module
    import torchrec.distributed.sharding_plan as plan_module

    original = plan_module.get_module_to_default_sharders
    if getattr(original, "_torchrec_ext_hooked", False):
        return

    def get_module_to_default_sharders() -> dict[type[nn.Module], ModuleSharder[nn.Module]]:
        return {sharder.module_type: sharder for sharder in _with_our_sharders(list(original().values()))}

    get_module_to_default_sharders._torchrec_ext_hooked = True
    plan_module.get_module_to_default_sharders = get_module_to_default_sharders
    shard_module.get_module_to_default_sharders = get_module_to_default_sharders
