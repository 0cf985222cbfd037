"""DynamicEmbeddingBagCollection: TorchRec's EmbeddingBagCollection over dynamic tables."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollectionInterface
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from torchrec_ext.modules.base import DynamicCollectionMixin
from torchrec_ext.modules.compiled_lookup import compiled_pooled_forward, lookup_is_one_op
from torchrec_ext.modules.configs import check_tables
from torchrec_ext.modules.features import check_and_arrange, expand_pooled
from torchrec_ext.modules.lookup_functions import PooledLookupFunction


class DynamicEmbeddingBagCollection(DynamicCollectionMixin, EmbeddingBagCollectionInterface):
    """Drop-in for ``torchrec.EmbeddingBagCollection`` whose tables take raw int64 ids.

    Each table maps any id to a row of its own, up to ``num_embeddings`` rows (its capacity),
    then evicts by its policy (see ``DynamicEmbeddingBagConfig``). In training mode unseen ids
    get a row, initialised as a pure function of (seed, table, id); in eval mode nothing is
    inserted and unseen ids pool as zeros. The tables train with a fused optimizer applied
    during backward: pass ``optimizer`` (torch.optim.SGD / Adagrad / Adam,
    torchrec.optim.RowWiseAdagrad, or their names) and ``optimizer_kwargs``, or call
    ``torchrec.optim.apply_optimizer_in_backward`` on this module's parameters.

    Train it on several ranks sharded (``DistributedModelParallel`` with
    ``torchrec_ext.distributed.get_sharders()``): unsharded, each rank's copy inserts and updates
    its own ids and nothing keeps the copies equal (torch's DistributedDataParallel averages
    gradients, which these tables do not have), so its first training step warns.
    ``per_rank_tables=True`` (or setting ``module.per_rank_tables``) says each rank is meant to
    train tables of its own, and silences that warning.

    Output, like EmbeddingBagCollection's: a KeyedTensor keyed by feature name (``feature@table``
    where a feature feeds several tables), tables in order, [batch_size, sum of dims].

    Example::

        ebc = DynamicEmbeddingBagCollection(
            tables=[DynamicEmbeddingBagConfig(name="t1", embedding_dim=64, num_embeddings=1 << 20,
                                              feature_names=["f1"])],
            optimizer=torch.optim.Adagrad, optimizer_kwargs={"lr": 0.01})
        pooled = ebc(kjt)  # KeyedTensor; kjt values are raw ids, any int64
    """

    def __init__(
        self,
        tables: list[EmbeddingBagConfig],
        is_weighted: bool = False,
        device: torch.device | None = None,
        optimizer: Any = None,
        optimizer_kwargs: Mapping[str, Any] | None = None,
        per_rank_tables: bool = False,
    ) -> None:
        super().__init__()
        where = type(self).__name__
        check_tables(tables, EmbeddingBagConfig, where)
        for cfg in tables:
            if cfg.pooling not in (PoolingType.SUM, PoolingType.MEAN):
                # a str such as "sum" is the likely slip: say it is not the enum
                got = cfg.pooling if isinstance(cfg.pooling, PoolingType) else f"{cfg.pooling!r}, not a PoolingType"
                raise ValueError(
                    f"{where}: table {cfg.name!r} pooling must be SUM or MEAN (torchrec.PoolingType), got {got}"
                )
        self._embedding_bag_configs = list(tables)
        self._is_weighted = bool(is_weighted)
        self._init_dynamic(tables, device, "embedding_bags", optimizer, optimizer_kwargs, per_rank_tables)

    def forward(self, features: KeyedJaggedTensor, weighted_features: KeyedJaggedTensor | None = None) -> KeyedTensor:
        # TorchRec's EmbeddingTowerCollection gives a module it does not know both KJTs (it gives
        # its own EBC only the one it reads): read the weighted one when weighted, as it would.
        if weighted_features is not None and self._is_weighted:
            features = weighted_features
        if isinstance(features, torch.fx.Proxy):  # symbolic tracing: a leaf
            return self._traced_call(features, KeyedTensor)
        backward_follows = self._backward_follows()
        if lookup_is_one_op(self, features, backward_follows):  # torch.compile: so that fullgraph=True holds
            pooled = compiled_pooled_forward(self, features, backward_follows)
            return KeyedTensor(
                keys=self._plan.embedding_names, length_per_key=self._plan.dims, values=pooled, key_dim=1
            )
        batch = check_and_arrange(
            features, self._plan, self._is_weighted, type(self).__name__, self.device, variable_batch="pool"
        )
        if self.device.type == "meta":  # shapes only, as TorchRec's module on meta
            pooled = torch.empty(batch.batch_size, self._plan.total_dim, device=self.device)
        else:
            lookup = self._lookup_rows(batch, backward_follows)
            pooled = PooledLookupFunction.apply(
                self._tables,
                self._plan,
                self._hyperparams,
                lookup,
                batch,
                batch.weights,
                *self._differentiable_params(),
            )
        if batch.expand is not None:  # a variable batch size per feature
            pooled = expand_pooled(pooled, batch.expand, self._plan)
        return KeyedTensor(keys=self._plan.embedding_names, length_per_key=self._plan.dims, values=pooled, key_dim=1)

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return self._embedding_bag_configs

    def embedding_configs(self) -> list[EmbeddingBagConfig]:
        """The tables, for TorchRec code that reads the configs of a module other than its own EBC
        through this name (ManagedCollisionEmbeddingBagCollection's constructor)."""
        return self._embedding_bag_configs

    def is_weighted(self) -> bool:
        return self._is_weighted
