"""Sharding of the dynamic modules: sharders, sharded modules, planner."""

from torchrec_ext.distributed.embedding import ShardedDynamicEmbeddingCollection
from torchrec_ext.distributed.embeddingbag import ShardedDynamicEmbeddingBagCollection
from torchrec_ext.distributed.fp_embeddingbag import ShardedFeatureProcessedDynamicEmbeddingBagCollection
from torchrec_ext.distributed.input_dist import BatchRefusedError
from torchrec_ext.distributed.planner import (
    DynamicEmbeddingPerfEstimator,
    DynamicEmbeddingStorageEstimator,
    install_default_planner_hook,
    make_planner,
)
from torchrec_ext.distributed.sharded_state import full_state_dict
from torchrec_ext.distributed.sharders import (
    DynamicEmbeddingBagCollectionSharder,
    DynamicEmbeddingCollectionSharder,
    FeatureProcessedDynamicEmbeddingBagCollectionSharder,
    get_sharders,
    install_default_sharder_lookup,
)

# TorchRec's default planner (DistributedModelParallel without a plan) costs our tables with our
# estimators and refuses models whose dynamic modules have no sharder: see planner.py.
install_default_planner_hook()
# TorchRec's composable shard() and construct_module_sharding_plan find our sharders: see sharders.py.
install_default_sharder_lookup()

__all__ = [
    "BatchRefusedError",
    "DynamicEmbeddingBagCollectionSharder",
    "DynamicEmbeddingCollectionSharder",
    "DynamicEmbeddingPerfEstimator",
    "DynamicEmbeddingStorageEstimator",
    "FeatureProcessedDynamicEmbeddingBagCollectionSharder",
    "ShardedDynamicEmbeddingBagCollection",
    "ShardedDynamicEmbeddingCollection",
    "ShardedFeatureProcessedDynamicEmbeddingBagCollection",
    "full_state_dict",
    "get_sharders",
    "make_planner",
]
