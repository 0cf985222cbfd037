"""Dynamic embedding modules: drop-in replacements for TorchRec's EBC and EC."""

from torchrec_ext.modules.configs import (
    DynamicEmbeddingBagConfig,
    DynamicEmbeddingConfig,
    DynamicTableOptions,
    Initializer,
)
from torchrec_ext.modules.delta_file import load_delta, save_delta
from torchrec_ext.modules.deltas import Delta, DeltaError, DeltaToken, TableDelta
from torchrec_ext.modules.embedding_bag_collection import DynamicEmbeddingBagCollection
from torchrec_ext.modules.embedding_collection import DynamicEmbeddingCollection
from torchrec_ext.modules.ftrl import Ftrl
from torchrec_ext.modules.fuse import fuse_embedding_optimizer, install_torchrec_fuse_hook
from torchrec_ext.modules.fused_optimizer import DEFAULT_OPTIMIZER
from torchrec_ext.modules.migration import from_ebc_state_dict
from torchrec_ext.modules.quantization import install_quantization_refusal
from torchrec_ext.modules.table_growth import GrowthError

# TorchRec's quantize_inference_model refuses our modules instead of leaving them in float: see quantization.py.
install_quantization_refusal()
# TorchRec's fuse_embedding_optimizer sets our modules' optimizer instead of skipping them: see fuse.py.
install_torchrec_fuse_hook()

__all__ = [
    "DynamicEmbeddingBagCollection",
    "DynamicEmbeddingBagConfig",
    "DynamicEmbeddingCollection",
    "DynamicEmbeddingConfig",
    "DynamicTableOptions",
    "Initializer",
    "DEFAULT_OPTIMIZER",
    "Ftrl",
    "fuse_embedding_optimizer",
    "from_ebc_state_dict",
    "Delta",
    "DeltaError",
    "DeltaToken",
    "TableDelta",
    "save_delta",
    "load_delta",
    "GrowthError",
]
