"""The rows and id -> row indexes of a read-only (serving) module, and their lookups.

``InferenceTables`` holds, per table, a ``HashTable`` (policy ``none``: nothing is ever evicted;
the table's truth, which deltas update), the read index built from it that lookups use
(``read_index.py``: one cache line per id), and ``capacity`` rows for the ids, then the rows the ids the table does not hold read: one
*default row* (zeros unless a default vector is configured), or the trained table's K learned
fallback rows (``fallback_rows``: an id reads row ``capacity + reference.fallback_slots(id)``, as
in training). Rows are kept as

- float32 / float16 / bfloat16: the training storage layout (one flat buffer of 4-byte words, as
  ``DynamicTables``), read by our ``pooled_lookup`` / ``sequence_lookup`` kernels, so float32
  rows give the trained module's eval outputs bit for bit;
- int8, row-wise quantized as TorchRec's quantized EmbeddingBagCollection does it (fbgemm's
  ``FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf``: per row a float16 scale and bias), in the
  row layout of fbgemm's inference TBE, read by fbgemm's own lookup op
  (``int_nbit_split_embedding_codegen_lookup_function``, which has a fake kernel for export).

Concurrency: lookups hold ``lock.read()`` from the id -> row find to the last row read; a
writer (``apply_delta``) prepares everything aside, then holds ``lock.write()`` only to copy the
changed rows and swap in the new indexes. So a concurrent lookup sees every row (and every
table) wholly before or wholly after an update. Under torch.compile / export no lock is traced:
a compiled or exported program is a snapshot, and nothing may mutate the eager tables while
one of its lookups runs.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from torchrec_ext import ops
from torchrec_ext.hashing import fallback_slots
from torchrec_ext.inference.read_index import ReadIndex, build_read_index
from torchrec_ext.modules.features import LookupInput, LookupPlan
from torchrec_ext.table import HashTable, _ReadWriteLock
from torchrec_ext.vocabulary import STORAGE_DTYPES, dtype_code, table_words

INT8 = torch.int8
SERVING_DTYPES = STORAGE_DTYPES + (INT8,)
_SCALE_BIAS_BYTES = 4  # fbgemm's int8 rows: float16 scale, float16 bias, then the dim bytes


@dataclass
class ServingTable:
    """One table as served: ``capacity`` rows for ids, then its default row or its
    ``fallback_rows`` fallback rows (chosen by ``fallback_seed``), vectors of ``dim`` stored as
    ``dtype``; ``source_dtype`` is the trained table's (the dtype its deltas carry)."""

    name: str
    capacity: int
    dim: int
    dtype: torch.dtype
    source_dtype: torch.dtype
    fallback_rows: int = 0
    fallback_seed: int = 0

    @property
    def rows(self) -> int:
        """Stored rows: the ids', then the default row or the fallback rows."""
        return self.capacity + max(1, self.fallback_rows)


def quantize_rows(vectors: Tensor) -> Tensor:
    """float rows [n, dim] -> fbgemm inference TBE int8 rows [n, 4 + dim] uint8: the float16
    scale and bias first, then the quantized values (TorchRec's quantize_state_dict numerics)."""
    fused = torch.ops.fbgemm.FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf(vectors.contiguous(), 8)
    return torch.cat([fused[:, -_SCALE_BIAS_BYTES:], fused[:, :-_SCALE_BIAS_BYTES]], dim=1)


def dequantize_rows(rows: Tensor) -> Tensor:
    """The float32 vectors that int8 rows (``quantize_rows``'s layout) read as."""
    fused = torch.cat([rows[:, _SCALE_BIAS_BYTES:], rows[:, :_SCALE_BIAS_BYTES]], dim=1).contiguous()
    return torch.ops.fbgemm.FusedNBitRowwiseQuantizedSBHalfToFloat(fused, 8)


class InferenceTables:
    """All tables of one serving module: rows, default rows, indexes, the readers/writer lock."""

    def __init__(self, tables: Sequence[ServingTable], plan: LookupPlan, pooled: bool):
        self.meta: list[ServingTable] = list(tables)
        self.plan = plan
        self.lock = _ReadWriteLock()
        self.applying = threading.RLock()  # held by apply_deltas from its checks to its commit
        self.generation = 0  # commits of deltas so far: a delta prepared before another's commit is void
        self.indexes: list[HashTable] = [HashTable(m.capacity, policy="none") for m in self.meta]
        self.read_indexes: list[ReadIndex] = [build_read_index(index) for index in self.indexes]
        # Per table: ids the conversion left out as expired (TTL; None: none), which the source
        # still held and will tombstone later.
        self.left_out: list[Tensor | None] = [None] * len(self.meta)
        self.default_rows = [m.capacity for m in self.meta]  # the row each table's unseen ids read
        # Float rows read row -1 as zeros (the kernels' "no row"): a table whose default is zeros
        # keeps the find's -1, as the trained module does, and skips mapping it to the default row.
        self._maps_default = [False] * len(self.meta)
        dtypes = {m.dtype for m in self.meta}
        odd = [m.name for m in self.meta if m.dtype == INT8 and m.dim % 2]
        if odd:  # fbgemm's float16 scale and bias follow the int8 values: they must stay 2-byte aligned
            raise ValueError(
                f"inference tables: int8 rows need an even embedding_dim (fbgemm's row-wise layout), "
                f"tables {odd} have an odd one; keep them as float16 or float32"
            )
        if INT8 in dtypes and len(dtypes) > 1:
            raise ValueError(
                f"inference tables: int8 rows cannot be mixed with float rows in one module, got "
                f"{ {m.name: str(m.dtype) for m in self.meta} }"
            )
        self.int8 = dtypes == {INT8}
        self._build_int8(pooled) if self.int8 else self._build_float()

    # ------------------------------------------------------------------ storage

    def _build_float(self) -> None:
        sizes = [table_words(m.rows, m.dim, m.dtype) for m in self.meta]
        self.table_offsets = torch.tensor([0] + sizes[:-1], dtype=torch.int64, device="cpu").cumsum(0)
        self.table_dims = torch.tensor([m.dim for m in self.meta], dtype=torch.int64, device="cpu")
        half = any(m.dtype != torch.float32 for m in self.meta)
        self.table_dtypes = torch.tensor([dtype_code(m.dtype) for m in self.meta], device="cpu") if half else None
        self.weights = torch.zeros(sum(sizes), dtype=torch.float32, device="cpu")
        self.feature_table, self.feature_col, self.feature_mean = self.plan.tensors(torch.device("cpu"))

    def _build_int8(self, pooled: bool) -> None:
        # fbgemm's inference TBE lays the tables out (offsets, alignment, per-feature descriptors);
        # its lookup op is called directly, as the module itself holds a script object that
        # torch.export cannot trace.
        from fbgemm_gpu.split_embedding_configs import SparseType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
        from fbgemm_gpu.split_table_batched_embeddings_ops_inference import IntNBitTableBatchedEmbeddingBagsCodegen

        means = set(self.plan.mean)
        # One pooling mode per lookup: mixed sum / mean features sum, and the means are divided after.
        mode = PoolingMode.NONE if not pooled else PoolingMode.MEAN if means == {True} else PoolingMode.SUM
        self.divide_means = pooled and len(means) > 1
        tbe = IntNBitTableBatchedEmbeddingBagsCodegen(
            [(m.name, m.rows, m.dim, SparseType.INT8, EmbeddingLocation.HOST) for m in self.meta],
            feature_table_map=list(self.plan.tables),
            device="cpu",
            pooling_mode=mode,
            output_dtype=SparseType.FP32,
        )
        tbe.initialize_weights()
        self.tbe = {
            name: getattr(tbe, name)
            for name in (
                "weights_host",
                "weights_uvm",
                "weights_placements",
                "weights_offsets",
                "weights_tys",
                "D_offsets",
                "total_D",
                "max_int2_D",
                "max_int4_D",
                "max_int8_D",
                "max_float16_D",
                "max_float32_D",
                "row_alignment",
                "max_float8_D",
                "fp8_exponent_bits",
                "fp8_exponent_bias",
            )
        }
        self.pooling_mode = int(mode.value)
        row_bytes = [w.shape[1] + s.shape[1] for w, s in tbe.split_embedding_weights()]
        starts = [int(tbe.weights_physical_offsets[t]) for t in range(len(self.meta))]
        host = self.tbe["weights_host"]
        self._int8_views = [
            host[s : s + m.rows * b].view(m.rows, b)[:, : _SCALE_BIAS_BYTES + m.dim]
            for m, s, b in zip(self.meta, starts, row_bytes)
        ]
        for m, view in zip(self.meta, self._int8_views):  # every row reads zeros until written
            view[:] = quantize_rows(torch.zeros(1, m.dim, device="cpu"))
        self.feature_mean = torch.tensor(self.plan.mean, device="cpu")

    def set_index(self, t: int, index: HashTable) -> None:
        """Table t's ids are ``index``'s (and its read index is built from it)."""
        self.indexes[t] = index
        self.read_indexes[t] = build_read_index(index)

    def set_default(self, t: int, vector: Tensor) -> None:
        """What the ids table t does not hold read: float32 ``vector`` [dim]."""
        self.row_view(t)[self.default_rows[t]] = self.encode(t, vector.unsqueeze(0))[0]
        self._maps_default[t] = self.int8 or bool(vector.any())

    def set_fallback(self, t: int, slots: Tensor, vectors: Tensor) -> None:
        """Fallback rows ``slots`` of table t hold float ``vectors`` [n, dim]."""
        self.row_view(t)[self.meta[t].capacity + slots] = self.encode(t, vectors)
        self._maps_default[t] = True

    def _unseen_rows(self, t: int, ids: Tensor, rows: Tensor, found: Tensor) -> Tensor:
        """``rows`` with each id not found given the row its table serves unseen ids."""
        m = self.meta[t]
        if m.fallback_rows:
            seed = torch.tensor(m.fallback_seed, dtype=torch.int64, device="cpu")
            return torch.where(found, rows, m.capacity + fallback_slots(ids, seed, m.fallback_rows))
        return torch.where(found, rows, self.default_rows[t])

    def row_view(self, t: int) -> Tensor:
        """Table t's stored rows: [.., dim] in its dtype, or [.., 4 + dim] uint8 int8 rows."""
        if self.int8:
            return self._int8_views[t]
        m = self.meta[t]
        start = int(self.table_offsets[t])
        words = self.weights[start : start + table_words(m.rows, m.dim, m.dtype)]
        return words.view(m.dtype)[: m.rows * m.dim].view(m.rows, m.dim)

    def encode(self, t: int, vectors: Tensor) -> Tensor:
        """Float vectors [n, dim] as table t stores them (rounded to nearest, or quantized)."""
        return quantize_rows(vectors) if self.int8 else vectors.to(self.meta[t].dtype)

    def decode(self, t: int, rows: Tensor) -> Tensor:
        """Stored rows of table t as the float32 vectors lookups read."""
        return dequantize_rows(rows) if self.int8 else rows.float()

    def vectors(self, t: int, ids: Tensor) -> Tensor:
        """float32 [n, dim]: what each id reads (its row, or the table's default row)."""
        with self.lock.read():
            rows, found = self.indexes[t].find(ids)
            return self.decode(t, self.row_view(t)[self._unseen_rows(t, ids, rows, found)])

    def num_live_rows(self) -> int:
        return sum(index.size() for index in self.indexes)

    def storage_bytes(self) -> int:
        """Bytes of rows, index metadata and read indexes."""
        rows = self.tbe["weights_host"].numel() if self.int8 else self.weights.numel() * 4
        indexes = sum(index.metadata_bytes() for index in self.indexes)
        return rows + indexes + sum(index.nbytes() for index in self.read_indexes)

    # ------------------------------------------------------------------ lookups

    def rows_of(self, batch: LookupInput) -> Tensor:
        """Each id's row: its table's row for it, else the row its table serves unseen ids (-1:
        zeros, for float rows whose default is zeros). One ``serving_find`` for all tables."""
        # The read indexes are read under this module's read lock, and apply_delta never mutates
        # a published one: it swaps in a new one.
        words = [index.words for index in self.read_indexes]
        rows = ops.serving_find(words, batch.ids, batch.segment_offsets, self._find_defaults())
        if any(m.fallback_rows for m in self.meta):
            rows = self._with_fallback_rows(batch, rows)
        return rows

    def _find_defaults(self) -> list[int]:
        """The row each table's unseen ids read from the find: its default row where the lookup
        needs one (int8 rows, a configured default), else -1 (zeros; fallback rows come after)."""
        return [
            self.default_rows[t] if (self._maps_default[t] or self.int8) and not m.fallback_rows else -1
            for t, m in enumerate(self.meta)
        ]

    def _with_fallback_rows(self, batch: LookupInput, rows: Tensor) -> Tensor:
        """``rows`` with each unseen id of a table with fallback rows given its fallback row."""
        exporting = torch.compiler.is_compiling()
        counts = [0] * len(self.meta)
        for t, n in zip(self.plan.tables, batch.value_counts):
            counts[t] = counts[t] + n
        per_table, start = [], 0
        for t, n in enumerate(counts):
            end = start + n
            if exporting:  # the counts are symbolic: say what the KJT checks guarantee
                torch._check(start >= 0)
                torch._check(start <= end)
                torch._check(end <= batch.ids.numel())
            part = rows[start:end]
            if self.meta[t].fallback_rows:
                part = self._unseen_rows(t, batch.ids[start:end], part, part >= 0)
            per_table.append(part)
            start = end
        return torch.cat(per_table) if per_table else rows

    def pooled(self, batch: LookupInput) -> Tensor:
        """float32 [batch_size, total_dim]: every feature's bags, pooled (sum or mean)."""
        offsets = torch.zeros(batch.lengths.numel() + 1, dtype=torch.int64, device="cpu")
        torch.cumsum(batch.lengths, 0, out=offsets[1:])
        rows = self.rows_of(batch)
        if not self.int8:
            return ops.pooled_lookup(
                self.weights,
                self.table_offsets,
                self.table_dims,
                self.feature_table,
                self.feature_col,
                self.feature_mean,
                rows,
                offsets,
                batch.weights,
                batch.batch_size,
                self.plan.total_dim,
                (),
                self.table_dtypes,
            )
        out = self._fbgemm_lookup(rows, offsets, batch.weights)
        if self.divide_means:
            lengths = batch.lengths.view(-1, batch.batch_size).clamp(min=1).to(out.dtype)
            per_col = torch.repeat_interleave(
                torch.where(self.feature_mean.unsqueeze(1), lengths, 1.0),
                torch.tensor(self.plan.dims, device="cpu"),
                dim=0,
                output_size=self.plan.total_dim,
            )
            out = out / per_col.t()
        return out

    def sequence(self, batch: LookupInput) -> Tensor:
        """float32 [num_ids, dim]: each id's vector."""
        rows = self.rows_of(batch)
        if not self.int8:
            dim = self.meta[0].dim if self.meta else 1
            return ops.sequence_lookup(
                self.weights,
                self.table_offsets,
                dim,
                self.feature_table,
                batch.feature_value_offsets,
                rows,
                (),
                self.table_dtypes,
            )
        offsets = torch.zeros(batch.lengths.numel() + 1, dtype=torch.int64, device="cpu")
        torch.cumsum(batch.lengths, 0, out=offsets[1:])
        return self._fbgemm_lookup(rows, offsets, None)

    def _fbgemm_lookup(self, rows: Tensor, offsets: Tensor, per_sample_weights: Tensor | None) -> Tensor:
        tbe = self.tbe
        return torch.ops.fbgemm.int_nbit_split_embedding_codegen_lookup_function(
            dev_weights=tbe["weights_host"],
            uvm_weights=tbe["weights_uvm"],
            weights_placements=tbe["weights_placements"],
            weights_offsets=tbe["weights_offsets"],
            weights_tys=tbe["weights_tys"],
            D_offsets=tbe["D_offsets"],
            total_D=tbe["total_D"],
            max_int2_D=tbe["max_int2_D"],
            max_int4_D=tbe["max_int4_D"],
            max_int8_D=tbe["max_int8_D"],
            max_float16_D=tbe["max_float16_D"],
            max_float32_D=tbe["max_float32_D"],
            indices=rows,
            offsets=offsets,
            pooling_mode=self.pooling_mode,
            indice_weights=per_sample_weights,
            output_dtype=0,  # SparseType.FP32
            lxu_cache_weights=None,
            lxu_cache_locations=None,
            row_alignment=tbe["row_alignment"],
            max_float8_D=tbe["max_float8_D"],
            fp8_exponent_bits=tbe["fp8_exponent_bits"],
            fp8_exponent_bias=tbe["fp8_exponent_bias"],
        )
