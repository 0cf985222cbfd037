"""DynamicEmbeddingCollection: TorchRec's EmbeddingCollection over dynamic tables."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingCollectionInterface, get_embedding_names_by_table
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from torchrec_ext.modules.base import DynamicCollectionMixin
from torchrec_ext.modules.compiled_lookup import compiled_sequence_forward, lookup_is_one_op
from torchrec_ext.modules.configs import check_tables
from torchrec_ext.modules.features import check_and_arrange
from torchrec_ext.modules.lookup_functions import SequenceLookupFunction


class DynamicEmbeddingCollection(DynamicCollectionMixin, EmbeddingCollectionInterface):
    """Drop-in for ``torchrec.EmbeddingCollection`` whose tables take raw int64 ids.

    Same tables, semantics, optimizers and ``per_rank_tables`` as ``DynamicEmbeddingBagCollection``, without
    pooling: ``forward`` returns, per feature (``feature@table`` where a feature feeds several
    tables), a JaggedTensor of one vector per id with the feature's lengths (and the ids as
    weights when ``need_indices``). All tables share one embedding_dim, as in TorchRec.

    The constructor takes EmbeddingCollection's arguments in its order, then ``optimizer``,
    ``optimizer_kwargs`` and ``per_rank_tables``. ``use_gather_select`` and ``use_gather_select_per_sharding`` are
    TorchRec's hints on how to select rows (a gather instead of an index lookup): accepted,
    returned by their getters, and otherwise no-ops, as our kernels do one gather whatever they say.
    """

    def __init__(
        self,
        tables: list[EmbeddingConfig],
        device: torch.device | None = None,
        need_indices: bool = False,
        use_gather_select: bool = False,
        use_gather_select_per_sharding: dict[str, bool] | None = None,
        optimizer: Any = None,
        optimizer_kwargs: Mapping[str, Any] | None = None,
        per_rank_tables: bool = False,
    ) -> None:
        super().__init__()
        where = type(self).__name__
        check_tables(tables, EmbeddingConfig, where)
        for cfg in tables:
            if cfg.embedding_dim != tables[0].embedding_dim:
                raise ValueError(
                    f"All tables in a EmbeddingCollection are required to have same embedding dimension. "
                    f"Violating case: {cfg.name}'s embedding_dim {cfg.embedding_dim} != {tables[0].embedding_dim}"
                )
        if use_gather_select_per_sharding is not None and not isinstance(use_gather_select_per_sharding, dict):
            raise TypeError(
                f"{where}: use_gather_select_per_sharding must be a dict of sharding type -> bool or "
                f"None, got {use_gather_select_per_sharding!r}"
            )
        self._embedding_configs = list(tables)
        self._embedding_dim = tables[0].embedding_dim if tables else -1  # TorchRec's value without tables
        self._need_indices = bool(need_indices)
        self._use_gather_select = bool(use_gather_select)
        self._use_gather_select_per_sharding = use_gather_select_per_sharding
        self._embedding_names_by_table = get_embedding_names_by_table(tables)
        self._init_dynamic(tables, device, "embeddings", optimizer, optimizer_kwargs, per_rank_tables)

    def forward(
        self, features: KeyedJaggedTensor, weighted_features: KeyedJaggedTensor | None = None
    ) -> dict[str, JaggedTensor]:
        # weighted_features: what TorchRec's EmbeddingTowerCollection also gives a module it does
        # not know; an EmbeddingCollection reads no weights (TorchRec gives its own EC only features).
        if isinstance(features, torch.fx.Proxy):  # symbolic tracing: a leaf
            return self._traced_call(features, dict)
        backward_follows = self._backward_follows()
        if lookup_is_one_op(self, features, backward_follows):  # torch.compile: so that fullgraph=True holds
            return compiled_sequence_forward(self, features, backward_follows)
        batch = check_and_arrange(features, self._plan, False, type(self).__name__, self.device, variable_batch="pool")
        if self.device.type == "meta":  # shapes only, as TorchRec's module on meta
            vectors = torch.empty(batch.ids.numel(), self._embedding_dim, device=self.device)
        else:
            lookup = self._lookup_rows(batch, backward_follows)
            vectors = SequenceLookupFunction.apply(
                self._tables, self._plan, self._hyperparams, lookup, batch, *self._differentiable_params()
            )
        counts = batch.value_counts  # ids per lookup feature, host side (no read of the device offsets)
        per_feature = torch.split(vectors, counts)
        ids = torch.split(batch.ids, counts)
        lengths = batch.lengths.view(len(counts), batch.batch_size)
        if batch.feature_bags is not None:  # a variable batch size per feature: each its own bags, as in TorchRec
            lengths = [lengths[i, :n] for i, n in enumerate(batch.feature_bags)]
        return {
            name: JaggedTensor(
                values=per_feature[i], lengths=lengths[i], weights=ids[i] if self._need_indices else None
            )
            for i, name in enumerate(self._plan.embedding_names)
        }

    def embedding_configs(self) -> list[EmbeddingConfig]:
        return self._embedding_configs

    def need_indices(self) -> bool:
        return self._need_indices

    def embedding_dim(self) -> int:
        return self._embedding_dim

    def embedding_names_by_table(self) -> list[list[str]]:
        return self._embedding_names_by_table

    def use_gather_select(self) -> bool:
        """TorchRec's row-selection hint, as given (a no-op here)."""
        return self._use_gather_select

    def use_gather_select_per_sharding(self) -> dict[str, bool] | None:
        """TorchRec's per-sharding row-selection hint, as given (a no-op here)."""
        return self._use_gather_select_per_sharding
