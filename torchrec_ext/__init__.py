"""torchrec_ext: dynamic embedding tables, sharders and a pipelined train loop for TorchRec."""

from torchrec_ext import ops
from torchrec_ext.modules import (
    DynamicEmbeddingBagCollection,
    DynamicEmbeddingBagConfig,
    DynamicEmbeddingCollection,
    DynamicEmbeddingConfig,
    Initializer,
)
from torchrec_ext.table import HashTable, InsertResult

__all__ = [
    "DynamicEmbeddingBagCollection",
    "DynamicEmbeddingBagConfig",
    "DynamicEmbeddingCollection",
    "DynamicEmbeddingConfig",
    "HashTable",
    "Initializer",
    "InsertResult",
    "ops",
]
__version__ = "0.1.0"
