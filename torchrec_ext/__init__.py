"""torchrec_ext: dynamic embedding tables, sharders and a pipelined train loop for TorchRec."""

from torchrec_ext import ops
from torchrec_ext.device_gate import quiesced
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
    "quiesced",
]
__version__ = "0.1.0"

# Installs the hooks that let TorchRec's default planner and composable shard() find our sharders,
# and refuse a dynamic module no sharder covers: a user who only swapped the class must not have
# it silently left out of the plan and DDP-wrapped (distributed/planner.py).
import torchrec_ext.distributed  # noqa: F401
