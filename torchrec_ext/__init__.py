"""torchrec_ext: dynamic embedding tables, sharders and a pipelined train loop for TorchRec."""
from torchrec_ext import ops
from torchrec_ext.table import HashTable, InsertResult

__all__ = ["HashTable", "InsertResult", "ops"]
__version__ = "0.1.0"
