// CPU kernels of the multi-table lookups: pooled_lookup (one [batch, total_dim] output, each
// feature's bags summed or averaged into its columns) and sequence_lookup (one row per id), rows
// read in their storage dtype and summed in float32; new rows are read from `new_vectors`.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "embedding_checks.h"
#include "row_storage.h"

namespace torchrec_ext {
namespace {

// Row r of id i in table t must be -1 (no row), in [0, capacity), or name a new vector of t.
inline void check_lookup_row(const char* op, int64_t r, int64_t i, int64_t cap,
                             const NewVectors& nv, int64_t t) {
  TORCH_CHECK(
      (r >= -1 && r < cap) || (r <= -2 && !nv.empty() && -2 - r < nv.count[t]), op, ": row ", r,
      " of id ", i, " out of range [-1, ", cap, ") of table ", t,
      nv.empty() ? "" : " (or a new vector: -2 - j for j below the table's new_vectors count)");
}

struct FeatureLayout {
  const int64_t* table;
  const int64_t* col;
  const bool* mean;
  int64_t count;
};

FeatureLayout check_features(const char* op, const at::Tensor& feature_table,
                             const at::Tensor& feature_col, const at::Tensor& feature_mean,
                             int64_t num_tables, const int64_t* table_dims, int64_t total_dim) {
  check_long_1d(op, "feature_table", feature_table);
  check_long_1d(op, "feature_col", feature_col);
  const int64_t F = feature_table.numel();
  TORCH_CHECK(feature_col.numel() == F && feature_mean.numel() == F &&
                  feature_mean.scalar_type() == at::kBool && feature_mean.is_contiguous(),
              op, ": feature_col and feature_mean (bool) must have one entry per feature (", F,
              ")");
  const int64_t* ft = feature_table.data_ptr<int64_t>();
  const int64_t* fc = feature_col.data_ptr<int64_t>();
  for (int64_t f = 0; f < F; ++f) {
    TORCH_CHECK(ft[f] >= 0 && ft[f] < num_tables, op, ": feature_table[", f, "] = ", ft[f],
                " is not a table in [0, ", num_tables, ")");
    TORCH_CHECK(fc[f] >= 0 && fc[f] + table_dims[ft[f]] <= total_dim, op, ": feature ", f,
                "'s columns [", fc[f], ", ", fc[f] + table_dims[ft[f]], ") exceed total_dim ",
                total_dim);
  }
  return {ft, fc, feature_mean.data_ptr<bool>(), F};
}

at::Tensor pooled_lookup_cpu(const at::Tensor& weights, const at::Tensor& table_offsets,
                             const at::Tensor& table_dims, const at::Tensor& feature_table,
                             const at::Tensor& feature_col, const at::Tensor& feature_mean,
                             const at::Tensor& rows_in, const at::Tensor& offsets_in,
                             const std::optional<at::Tensor>& per_sample_weights,
                             int64_t batch_size, int64_t total_dim, at::TensorList new_vectors,
                             const std::optional<at::Tensor>& table_dtypes) {
  const char* op = "pooled_lookup";
  check_weights(op, weights);
  const std::vector<Storage> storage = table_storage(op, table_dtypes, table_offsets.numel());
  const std::vector<int64_t> caps =
      table_capacities(op, weights, table_offsets, table_dims, storage);
  const int64_t* dims = table_dims.data_ptr<int64_t>();
  TORCH_CHECK(batch_size >= 0 && total_dim >= 0, op,
              ": batch_size and total_dim must be >= 0, got ", batch_size, " and ", total_dim);
  const FeatureLayout fl =
      check_features(op, feature_table, feature_col, feature_mean, caps.size(), dims, total_dim);
  const NewVectors nv = check_new_vectors(op, new_vectors, dims, caps.size(), storage);
  const at::Tensor rows = rows_in.contiguous(), offsets = offsets_in.contiguous();
  check_long_1d(op, "rows", rows);
  const int64_t n = rows.numel(), num_bags = fl.count * batch_size;
  check_bags(op, offsets, num_bags, n);
  at::Tensor psw_holder;
  const float* psw = check_per_sample_weights(op, per_sample_weights, n, psw_holder);
  const int64_t* r = rows.data_ptr<int64_t>();
  const int64_t* o = offsets.data_ptr<int64_t>();
  for (int64_t f = 0; f < fl.count; ++f)
    for (int64_t i = o[f * batch_size]; i < o[(f + 1) * batch_size]; ++i)
      check_lookup_row(op, r[i], i, caps[fl.table[f]], nv, fl.table[f]);

  at::Tensor out = at::empty({batch_size, total_dim}, weights.options());
  float* y = out.data_ptr<float>();
  const std::vector<char*> bases = table_bases(weights, table_offsets);
  // Columns no feature writes (none, when the caller tiles total_dim) stay zero.
  int64_t covered = 0;
  for (int64_t f = 0; f < fl.count; ++f) covered += dims[fl.table[f]];
  if (covered != total_dim) out.zero_();
  std::vector<int64_t> feature_end(fl.count);
  for (int64_t f = 0; f < fl.count; ++f) feature_end[f] = o[(f + 1) * batch_size];
  at::parallel_for(0, num_bags, 64, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t f = g / batch_size, b = g % batch_size, t = fl.table[f], dim = dims[t];
      float* acc = y + b * total_dim + fl.col[f];
      const char* base = bases[t];
      const Storage st = storage[t];
      const int64_t row_bytes = dim * storage_bytes(st), distance = prefetch_distance(row_bytes);
      for (int64_t d = 0; d < dim; ++d) acc[d] = 0.f;
      for (int64_t i = o[g]; i < o[g + 1]; ++i) {
        // Rows are scattered: fetch a few ids ahead, across bag ends, within this feature.
        const int64_t ahead = i + distance;
        if (ahead < feature_end[f] && r[ahead] >= 0)
          prefetch_row(base + r[ahead] * row_bytes, row_bytes);
        if (r[i] == -1) continue;
        add_scaled_row(acc, nv.source(base, t, r[i], row_bytes), st, psw != nullptr ? psw[i] : 1.f,
                       dim);
      }
      const int64_t len = o[g + 1] - o[g];
      if (fl.mean[f] && len > 0) {
        const float scale = 1.f / static_cast<float>(len);
        for (int64_t d = 0; d < dim; ++d) acc[d] *= scale;
      }
    }
  });
  return out;
}

at::Tensor sequence_lookup_cpu(const at::Tensor& weights, const at::Tensor& table_offsets,
                               int64_t dim, const at::Tensor& feature_table,
                               const at::Tensor& feature_value_offsets_in,
                               const at::Tensor& rows_in, at::TensorList new_vectors,
                               const std::optional<at::Tensor>& table_dtypes) {
  const char* op = "sequence_lookup";
  check_weights(op, weights);
  TORCH_CHECK(dim > 0, op, ": dim must be > 0, got ", dim);
  const at::Tensor dims = at::full({table_offsets.numel()}, dim, table_offsets.options());
  const std::vector<Storage> storage = table_storage(op, table_dtypes, table_offsets.numel());
  const std::vector<int64_t> caps = table_capacities(op, weights, table_offsets, dims, storage);
  const NewVectors nv =
      check_new_vectors(op, new_vectors, dims.data_ptr<int64_t>(), caps.size(), storage);
  check_long_1d(op, "feature_table", feature_table);
  const at::Tensor rows = rows_in.contiguous(), fvo = feature_value_offsets_in.contiguous();
  check_long_1d(op, "rows", rows);
  check_long_1d(op, "feature_value_offsets", fvo);
  const int64_t F = feature_table.numel(), n = rows.numel();
  TORCH_CHECK(fvo.numel() == F + 1, op,
              ": feature_value_offsets must have num_features + 1 = ", F + 1, " entries, got ",
              fvo.numel());
  const int64_t* fo = fvo.data_ptr<int64_t>();
  const int64_t* ft = feature_table.data_ptr<int64_t>();
  const int64_t* r = rows.data_ptr<int64_t>();
  TORCH_CHECK(fo[0] == 0 && fo[F] == n, op,
              ": feature_value_offsets must run from 0 to the number of ids (", n, "), got ", fo[0],
              " .. ", fo[F]);
  for (int64_t f = 0; f < F; ++f) {
    TORCH_CHECK(fo[f] <= fo[f + 1], op, ": feature_value_offsets must be non-decreasing");
    TORCH_CHECK(ft[f] >= 0 && ft[f] < static_cast<int64_t>(caps.size()), op, ": feature_table[", f,
                "] = ", ft[f], " is not a table");
    for (int64_t i = fo[f]; i < fo[f + 1]; ++i)
      check_lookup_row(op, r[i], i, caps[ft[f]], nv, ft[f]);
  }
  at::Tensor out = at::empty({n, dim}, weights.options());
  float* y = out.data_ptr<float>();
  const std::vector<char*> bases = table_bases(weights, table_offsets);
  for (int64_t f = 0; f < F; ++f) {
    const int64_t t = ft[f];
    const char* base = bases[t];
    const Storage st = storage[t];
    const int64_t row_bytes = dim * storage_bytes(st);
    at::parallel_for(fo[f], fo[f + 1], 256, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        float* dst = y + i * dim;
        if (r[i] == -1) {
          std::fill(dst, dst + dim, 0.f);
        } else {
          load_row(dst, nv.source(base, t, r[i], row_bytes), st, dim);
        }
      }
    });
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(torchrec_ext, CPU, m) {
  m.impl("pooled_lookup", &pooled_lookup_cpu);
  m.impl("sequence_lookup", &sequence_lookup_cpu);
}

}  // namespace torchrec_ext
