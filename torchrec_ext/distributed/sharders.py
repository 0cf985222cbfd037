"""Sharders that let DistributedModelParallel and the planner shard our dynamic modules.

They offer ``table_wise``, ``row_wise`` and ``table_row_wise`` (ids spread by ``ops.route``),
``column_wise`` and ``table_column_wise`` (placement.py; not ``data_parallel``), with TorchRec's
``customized_kernel`` compute kernel, which the planner accepts with our estimators
(``torchrec_ext.distributed.planner``). Their ``fused_params`` choose the tables' fused
optimizer as TorchRec's sharders' do (``sharded_base.sharded_optimizer``).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Type

import torch
from torch import nn
from torchrec.distributed.embedding_types import BaseEmbeddingSharder, EmbeddingComputeKernel
from torchrec.distributed.sharding_plan import get_default_sharders
from torchrec.distributed.types import EmbeddingModuleShardingPlan, ModuleSharder, ShardingEnv

from torchrec_ext.distributed.embedding import ShardedDynamicEmbeddingCollection
from torchrec_ext.distributed.embeddingbag import ShardedDynamicEmbeddingBagCollection
from torchrec_ext.distributed.placement import SUPPORTED_SHARDING_TYPES
from torchrec_ext.modules.fused_optimizer import spec_from_fused_params
from torchrec_ext.modules import DynamicEmbeddingBagCollection, DynamicEmbeddingCollection



class _DynamicSharder:
    """What both sharders share: sharding types, kernel, and fused_params checked up front."""

    def __init__(self, fused_params: Optional[Dict[str, Any]] = None, *args: Any, **kwargs: Any) -> None:
        spec_from_fused_params(fused_params, type(self).__name__)  # unsupported ones refused now
        super().__init__(fused_params, *args, **kwargs)

    def sharding_types(self, compute_device_type: str) -> List[str]:
        return list(SUPPORTED_SHARDING_TYPES)

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> List[str]:
        return [EmbeddingComputeKernel.CUSTOMIZED_KERNEL.value]


class DynamicEmbeddingBagCollectionSharder(_DynamicSharder, BaseEmbeddingSharder[DynamicEmbeddingBagCollection]):
    def shard(self, module: DynamicEmbeddingBagCollection, params: EmbeddingModuleShardingPlan, env: ShardingEnv,
              device: Optional[torch.device] = None, module_fqn: Optional[str] = None) -> ShardedDynamicEmbeddingBagCollection:
        return ShardedDynamicEmbeddingBagCollection(module, params, env, device, fused_params=self.fused_params)

    @property
    def module_type(self) -> Type[DynamicEmbeddingBagCollection]:
        return DynamicEmbeddingBagCollection

    def shardable_parameters(self, module: DynamicEmbeddingBagCollection) -> Dict[str, nn.Parameter]:
        return {name: table.weight for name, table in module.embedding_bags.items()}


class DynamicEmbeddingCollectionSharder(_DynamicSharder, BaseEmbeddingSharder[DynamicEmbeddingCollection]):
    def shard(self, module: DynamicEmbeddingCollection, params: EmbeddingModuleShardingPlan, env: ShardingEnv,
              device: Optional[torch.device] = None, module_fqn: Optional[str] = None) -> ShardedDynamicEmbeddingCollection:
        return ShardedDynamicEmbeddingCollection(module, params, env, device, fused_params=self.fused_params)

    @property
    def module_type(self) -> Type[DynamicEmbeddingCollection]:
        return DynamicEmbeddingCollection

    def shardable_parameters(self, module: DynamicEmbeddingCollection) -> Dict[str, nn.Parameter]:
        return {name: table.weight for name, table in module.embeddings.items()}


def get_sharders() -> List[ModuleSharder[nn.Module]]:
    """Our sharders plus TorchRec's defaults: for DistributedModelParallel(model, sharders=...)
    on models mixing dynamic and stock TorchRec tables."""
    return [DynamicEmbeddingBagCollectionSharder(), DynamicEmbeddingCollectionSharder()] + list(get_default_sharders())
