"""Sharding of the dynamic modules: sharders, sharded modules, planner."""
from torchrec_ext.distributed.embedding import ShardedDynamicEmbeddingCollection
from torchrec_ext.distributed.embeddingbag import ShardedDynamicEmbeddingBagCollection
from torchrec_ext.distributed.planner import (
    DynamicEmbeddingPerfEstimator, DynamicEmbeddingStorageEstimator, make_planner,
)
from torchrec_ext.distributed.sharders import (
    DynamicEmbeddingBagCollectionSharder, DynamicEmbeddingCollectionSharder, get_sharders,
)

__all__ = [
    "DynamicEmbeddingBagCollectionSharder", "DynamicEmbeddingCollectionSharder", "DynamicEmbeddingPerfEstimator",
    "DynamicEmbeddingStorageEstimator", "ShardedDynamicEmbeddingBagCollection", "ShardedDynamicEmbeddingCollection",
    "get_sharders", "make_planner",
]
