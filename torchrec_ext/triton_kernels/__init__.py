"""Triton GPU kernels of the embedding ops: the lookups (embedding_lookup) and the backward fused
with the optimizer step (embedding_update).

``KERNELS`` (op name -> device type -> kernel) is this backend's entry in the registration table
``torchrec_ext.ops`` reads; it is empty where Triton is not installed (the submodules need it).
"""

from collections.abc import Callable

try:
    import triton  # noqa: F401
except ImportError:
    KERNELS: dict[str, dict[str, Callable]] = {}
else:
    from torchrec_ext.triton_kernels import embedding_lookup, embedding_update

    KERNELS = {
        "pooled_lookup": {"cuda": embedding_lookup.pooled_lookup},
        "sequence_lookup": {"cuda": embedding_lookup.sequence_lookup},
        "fused_update": {"cuda": embedding_update.fused_update},
    }
