"""Sharding of the dynamic modules: sharders, sharded modules, planner."""
from torchrec_ext.distributed.embeddingbag import ShardedDynamicEmbeddingBagCollection
from torchrec_ext.distributed.sharders import DynamicEmbeddingBagCollectionSharder, get_sharders

__all__ = ["DynamicEmbeddingBagCollectionSharder", "ShardedDynamicEmbeddingBagCollection", "get_sharders"]
