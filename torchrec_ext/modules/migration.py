"""Switching a trained model from TorchRec's tables to dynamic ones without starting over.

A TorchRec ``EmbeddingBagCollection`` / ``EmbeddingCollection`` table of N rows serves id k
from row k (the ids were taken modulo N, or hashed into [0, N), before the model saw them).
``from_ebc_state_dict`` gives each dynamic table those N rows as ids 0..N-1, so id k reads
row k's vector: a model reading the same ids computes what it computed before.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.tensor import DTensor

from torchrec_ext.modules.base import DynamicCollectionMixin
from torchrec_ext.table import LAYOUT_VERSION


def from_ebc_state_dict(module: Any, state_dict: Mapping[str, Any], prefix: str = "") -> Any:
    """Loads a TorchRec EBC / EC ``state_dict`` (``embedding_bags.<table>.weight`` /
    ``embeddings.<table>.weight``, N rows each, under ``prefix``) into ``module``, a
    DynamicEmbeddingBagCollection / DynamicEmbeddingCollection with the same table names and
    dims: id k (0 <= k < N) gets row k's vector. Returns ``module``.

    What else the tables hold starts afresh: optimizer state (TorchRec keeps it in the
    optimizer's state_dict, not the module's) at its initial value, the optimizer's step at 0,
    eviction scores at 0 (the migrated rows are the first a full table evicts), and the
    counters at 0. Ids >= N, which TorchRec never saw unreduced, get new rows of their own in
    training (zeros in eval); keep reducing ids modulo N upstream for as long as the old mapping
    is wanted. Every table must be there, with N <= the table's capacity (``num_embeddings``;
    allow ~10% headroom: a table filled to capacity may not place every id); all tables are
    checked before any changes. A sharded TorchRec state (ShardedTensors) must be gathered first.
    """
    where = "from_ebc_state_dict"
    if not isinstance(module, DynamicCollectionMixin):
        raise TypeError(
            f"{where}: module must be a DynamicEmbeddingBagCollection or DynamicEmbeddingCollection "
            f"(unsharded: migrate, then shard), got {type(module).__name__}"
        )
    tables = module._tables
    container = module._container
    if not isinstance(state_dict, Mapping):
        raise TypeError(
            f"{where}: state_dict must be a mapping (a TorchRec module's state_dict()), got {type(state_dict).__name__}"
        )
    names = [m.name for m in tables.meta]
    base = f"{prefix}{container}."
    unknown = sorted(
        k for k in state_dict if k.startswith(base) and not any(k == f"{base}{name}.weight" for name in names)
    )
    if unknown:
        raise ValueError(
            f"{where}: state_dict has keys no table of this module takes: {unknown[:5]} "
            f"(tables {names}, each reading {base}<table>.weight)"
        )
    states = {}
    for t, m in enumerate(tables.meta):
        key = f"{base}{m.name}.weight"
        if key not in state_dict:
            raise ValueError(
                f"{where}: state_dict lacks {key!r} (keys under {prefix!r}: "
                f"{sorted(k for k in state_dict if k.startswith(prefix))[:5]})"
            )
        weight = state_dict[key]
        if not isinstance(weight, Tensor) or isinstance(weight, (ShardedTensor, DTensor)):
            raise TypeError(
                f"{where}: {key} must be a plain tensor of the whole table, got "
                f"{type(weight).__name__} (gather a sharded state first)"
            )
        if weight.dim() != 2 or weight.shape[1] != m.dim or not weight.dtype.is_floating_point:
            raise ValueError(
                f"{where}: {key} must be a float [N, {m.dim}] tensor (table {m.name!r} has "
                f"embedding_dim {m.dim}), got {weight.dtype} {list(weight.shape)}"
            )
        n = weight.shape[0]
        if n > m.max_capacity:  # a growing table grows to fit them
            raise ValueError(
                f"{where}: {key} has {n} rows, more than table {m.name!r}'s capacity "
                f"(num_embeddings) {m.max_capacity}; give the dynamic table at least {n} rows"
            )
        ids = torch.arange(n, dtype=torch.int64, device="cpu")
        states[t] = {
            "weight": weight.detach(),
            "weight_id": ids,
            "metadata": torch.zeros_like(ids),
            "counters": torch.tensor([0, 0, 0, 0, LAYOUT_VERSION], device="cpu"),
        }  # fresh, in this layout
    tables.load_states(states, where=where)  # checked (finite values...) before any table changes
    return module
