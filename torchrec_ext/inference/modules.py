"""Read-only serving forms of DynamicEmbeddingBagCollection and DynamicEmbeddingCollection.

Same forward contract as the trained modules (and TorchRec's EBC / EC): a KeyedJaggedTensor
of raw int64 ids in, a KeyedTensor (pooled) or a dict of JaggedTensors (sequence) out. They hold
no optimizer state and no admission, eviction or TTL bookkeeping, never insert an id (an id a
table does not hold reads the table's default row: zeros unless configured), and follow a
training module through its deltas (``follow_deltas`` / ``apply_delta``), while serving.
Build them with ``torchrec_ext.inference.convert``.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext

import torch
from torch import Tensor
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
from torchrec.modules.embedding_modules import (
    EmbeddingBagCollectionInterface,
    EmbeddingCollectionInterface,
    get_embedding_names_by_table,
)
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor, KeyedTensor

from torchrec_ext.inference import deltas as serving_deltas
from torchrec_ext.inference.storage import InferenceTables
from torchrec_ext.modules.deltas import Delta, DeltaToken, follow_deltas
from torchrec_ext.modules.features import LookupInput, check_and_arrange

_CPU = torch.device("cpu")


class _ServingMixin:
    """Reads, delta following and the refusals shared by the two serving modules."""

    _tables: InferenceTables

    def _arrange(self, features: KeyedJaggedTensor, weighted: bool) -> LookupInput:
        where = type(self).__name__
        if self.training:
            raise RuntimeError(
                f"{where} is read-only: it does not insert ids or train (no optimizer, no gradients). Call "
                "model.eval() before serving (the converters return models in eval mode); train the dynamic "
                "collection it was converted from and ship its deltas here with apply_delta"
            )
        return check_and_arrange(features, self._tables.plan, weighted, where, _CPU)

    def _reading(self):
        # A compiled / exported program cannot trace a lock (see storage.py).
        return nullcontext() if torch.compiler.is_compiling() else self._tables.lock.read()

    @property
    def fused_optimizer(self):
        raise RuntimeError(
            f"{type(self).__name__} is read-only: it has no optimizer (it serves rows; train the "
            "dynamic collection it was converted from)"
        )

    # ------------------------------------------------------------------ deltas

    def follow_deltas(self, since: DeltaToken | Sequence[DeltaToken]) -> None:
        """The next delta applied must start at ``since`` (one token per source rank): the token(s)
        taken when the rows this module was converted from were."""
        follow_deltas(self._followed_deltas(), since)

    def apply_delta(self, delta: Delta) -> None:
        """Applies the next delta of the followed source while lookups go on: they see it wholly
        or not at all. New ids are inserted, tombstoned ids removed; refused whole otherwise."""
        serving_deltas.apply_deltas(self._tables, self._followed_deltas(), [delta])

    def apply_deltas(self, deltas: Sequence[Delta]) -> None:
        """Applies several deltas as one (e.g. every rank's share of a sharded source's export):
        lookups see all of them or none; refused whole if any is."""
        serving_deltas.apply_deltas(self._tables, self._followed_deltas(), deltas)

    def prepare_deltas(self, deltas: Sequence[Delta]) -> serving_deltas.PreparedDeltas:
        """``apply_deltas`` in two steps: this one checks and builds everything aside (the module
        unchanged); ``commit_deltas`` publishes it, cannot fail but for a commit in between."""
        return serving_deltas.prepare_deltas(self._tables, self._followed_deltas(), deltas)

    def commit_deltas(self, prepared: serving_deltas.PreparedDeltas) -> None:
        serving_deltas.commit_deltas(self._tables, self._followed_deltas(), prepared)

    def _followed_deltas(self) -> dict[str, DeltaToken]:
        if "_delta_followed" not in self.__dict__:
            self.__dict__["_delta_followed"] = {}
        return self.__dict__["_delta_followed"]

    # ------------------------------------------------------------------ inspection

    def vectors(self, table: str, ids: Tensor) -> Tensor:
        """float32 [n, dim]: what each id of ``table`` reads now (its row or the default row)."""
        names = [m.name for m in self._tables.meta]
        if table not in names:
            raise ValueError(f"{type(self).__name__}.vectors: table must be one of {names}, got {table!r}")
        return self._tables.vectors(names.index(table), ids)

    def num_live_rows(self) -> int:
        """Ids that hold a row now, over all tables."""
        return self._tables.num_live_rows()

    def storage_bytes(self) -> int:
        """Bytes of rows (default rows included) and index metadata."""
        return self._tables.storage_bytes()

    def extra_repr(self) -> str:
        return ", ".join(f"{m.name}: capacity={m.capacity}, dim={m.dim}, dtype={m.dtype}" for m in self._tables.meta)


class InferenceEmbeddingBagCollection(_ServingMixin, EmbeddingBagCollectionInterface):
    """The serving form of a DynamicEmbeddingBagCollection: pooled lookups of raw ids,
    read-only; a KeyedTensor keyed as the trained module's output."""

    def __init__(self, tables: list[EmbeddingBagConfig], storage: InferenceTables, is_weighted: bool = False):
        super().__init__()
        self._embedding_bag_configs = list(tables)
        self._is_weighted = bool(is_weighted)
        self._tables = storage

    def forward(self, features: KeyedJaggedTensor, weighted_features: KeyedJaggedTensor | None = None) -> KeyedTensor:
        if weighted_features is not None and self._is_weighted:
            features = weighted_features
        batch = self._arrange(features, self._is_weighted)
        with self._reading():
            pooled = self._tables.pooled(batch)
        plan = self._tables.plan
        return KeyedTensor(keys=plan.embedding_names, length_per_key=plan.dims, values=pooled, key_dim=1)

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return self._embedding_bag_configs

    def is_weighted(self) -> bool:
        return self._is_weighted


class InferenceEmbeddingCollection(_ServingMixin, EmbeddingCollectionInterface):
    """The serving form of a DynamicEmbeddingCollection: per feature, a JaggedTensor of one
    vector per id (and the ids as weights when ``need_indices``), read-only."""

    def __init__(self, tables: list[EmbeddingConfig], storage: InferenceTables, need_indices: bool = False):
        super().__init__()
        self._embedding_configs = list(tables)
        self._need_indices = bool(need_indices)
        self._embedding_dim = tables[0].embedding_dim if tables else -1
        self._embedding_names_by_table = get_embedding_names_by_table(tables)
        self._tables = storage

    def forward(
        self, features: KeyedJaggedTensor, weighted_features: KeyedJaggedTensor | None = None
    ) -> dict[str, JaggedTensor]:
        batch = self._arrange(features, False)
        with self._reading():
            vectors = self._tables.sequence(batch)
        counts = batch.value_counts
        per_feature = torch.split(vectors, counts)
        ids = torch.split(batch.ids, counts)
        lengths = batch.lengths.view(len(counts), batch.batch_size)
        return {
            name: JaggedTensor(
                values=per_feature[i], lengths=lengths[i], weights=ids[i] if self._need_indices else None
            )
            for i, name in enumerate(self._tables.plan.embedding_names)
        }

    def embedding_configs(self) -> list[EmbeddingConfig]:
        return self._embedding_configs

    def need_indices(self) -> bool:
        return self._need_indices

    def embedding_dim(self) -> int:
        return self._embedding_dim

    def embedding_names_by_table(self) -> list[list[str]]:
        return self._embedding_names_by_table


SERVING_MODULES = (InferenceEmbeddingBagCollection, InferenceEmbeddingCollection)
