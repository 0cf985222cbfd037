// Argument checks shared by the embedding ops' CPU kernels (the multi-table layout, rows, new
// vectors, bags, per-sample weights): each failure names the op, the argument, the constraint and
// the value, before anything is written.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "row_storage.h"

namespace torchrec_ext {
namespace {

inline void check_long_1d(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.dim() == 1 && t.scalar_type() == at::kLong && t.is_contiguous(), op, ": ", name,
              " must be a contiguous 1-D int64 tensor, got ", t.scalar_type(), " of shape ",
              t.sizes());
}

inline void check_weights(const char* op, const at::Tensor& weights) {
  TORCH_CHECK(weights.dim() == 1 && weights.scalar_type() == at::kFloat && weights.is_contiguous(),
              op, ": weights must be a contiguous 1-D float32 buffer, got ", weights.scalar_type(),
              " of shape ", weights.sizes());
}

// The tables' storage dtypes (all float32 when not given).
inline std::vector<Storage> table_storage(const char* op,
                                          const std::optional<at::Tensor>& table_dtypes,
                                          int64_t T) {
  std::vector<Storage> out(T, Storage::kFloat);
  if (!table_dtypes.has_value()) return out;
  const at::Tensor codes = table_dtypes->contiguous();
  check_long_1d(op, "table_dtypes", codes);
  TORCH_CHECK(codes.numel() == T, op, ": table_dtypes must have one entry per table (", T,
              "), got ", codes.numel());
  const int64_t* c = codes.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(c[t] >= 0 && c[t] <= 2, op, ": table_dtypes[", t, "] = ", c[t],
                " is not a storage dtype (0 float32, 1 float16, 2 bfloat16)");
    out[t] = static_cast<Storage>(c[t]);
  }
  return out;
}

// Per-table capacities from the flat layout; checks that the tables tile the buffer in order,
// each spanning exactly the words of its rows.
inline std::vector<int64_t> table_capacities(const char* op, const at::Tensor& weights,
                                             const at::Tensor& table_offsets,
                                             const at::Tensor& table_dims,
                                             const std::vector<Storage>& storage) {
  check_long_1d(op, "table_offsets", table_offsets);
  check_long_1d(op, "table_dims", table_dims);
  const int64_t T = table_offsets.numel();
  TORCH_CHECK(table_dims.numel() == T, op, ": table_dims must have one entry per table (", T,
              "), got ", table_dims.numel());
  const int64_t* off = table_offsets.data_ptr<int64_t>();
  const int64_t* dim = table_dims.data_ptr<int64_t>();
  std::vector<int64_t> caps(T);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t end = t + 1 < T ? off[t + 1] : weights.numel();
    TORCH_CHECK(dim[t] > 0, op, ": table_dims[", t, "] must be > 0, got ", dim[t]);
    const int64_t row_bytes = dim[t] * storage_bytes(storage[t]);
    const int64_t cap = off[t] >= 0 && end >= off[t] ? (end - off[t]) * 4 / row_bytes : -1;
    TORCH_CHECK(
        cap >= 0 && end <= weights.numel() && table_words(cap, dim[t], storage[t]) == end - off[t],
        op, ": table ", t, " spans words [", off[t], ", ", end, ") of a buffer of ",
        weights.numel(), ", not the words of a whole number of rows of dim ", dim[t], " in ",
        storage_name(storage[t]));
    caps[t] = cap;
  }
  return caps;
}

inline void check_rows_in_tables(const char* op, const int64_t* rows, const int64_t* table_of_row,
                                 int64_t n, const std::vector<int64_t>& caps) {
  for (int64_t i = 0; i < n; ++i) {
    const int64_t t = table_of_row[i];
    TORCH_CHECK(t >= 0 && t < static_cast<int64_t>(caps.size()), op, ": table index ", t,
                " out of range [0, ", caps.size(), ")");
    TORCH_CHECK(rows[i] >= -1 && rows[i] < caps[t], op, ": row ", rows[i], " out of range [-1, ",
                caps[t], ") of table ", t);
  }
}

inline NewVectors check_new_vectors(const char* op, at::TensorList new_vectors, const int64_t* dims,
                                    int64_t T, const std::vector<Storage>& storage) {
  NewVectors nv;
  if (new_vectors.empty()) return nv;
  TORCH_CHECK(static_cast<int64_t>(new_vectors.size()) == T, op,
              ": new_vectors must have one block per table (", T, "), got ", new_vectors.size());
  for (int64_t t = 0; t < T; ++t) {
    const at::Tensor& v = new_vectors[t];
    const at::ScalarType want = storage_scalar_type(storage[t]);
    TORCH_CHECK(
        v.dim() == 2 && v.size(1) == dims[t] && v.scalar_type() == want && v.is_contiguous(), op,
        ": new_vectors[", t, "] must be a contiguous ", storage_name(storage[t]), " [n, ", dims[t],
        "] tensor (its table's dtype), got ", v.scalar_type(), " of shape ", v.sizes());
    nv.data.push_back(static_cast<const char*>(v.data_ptr()));
    nv.count.push_back(v.size(0));
  }
  return nv;
}

inline void check_bags(const char* op, const at::Tensor& offsets, int64_t num_bags,
                       int64_t num_values) {
  check_long_1d(op, "offsets", offsets);
  TORCH_CHECK(offsets.numel() == num_bags + 1, op,
              ": offsets must have num_features * batch_size + 1 = ", num_bags + 1,
              " entries, got ", offsets.numel());
  const int64_t* o = offsets.data_ptr<int64_t>();
  TORCH_CHECK(o[0] == 0 && o[num_bags] == num_values, op,
              ": offsets must run from 0 to the number of ids (", num_values, "), got ", o[0],
              " .. ", o[num_bags]);
  for (int64_t g = 0; g < num_bags; ++g)
    TORCH_CHECK(o[g] <= o[g + 1], op, ": offsets must be non-decreasing (bag ", g, " has length ",
                o[g + 1] - o[g], ")");
}

inline const float* check_per_sample_weights(const char* op, const std::optional<at::Tensor>& psw,
                                             int64_t num_values, at::Tensor& holder) {
  if (!psw.has_value()) return nullptr;
  holder = psw->contiguous();
  TORCH_CHECK(
      holder.dim() == 1 && holder.scalar_type() == at::kFloat && holder.numel() == num_values, op,
      ": per_sample_weights must be a 1-D float32 tensor with one weight per id (", num_values,
      "), got ", holder.scalar_type(), " of shape ", holder.sizes());
  return holder.data_ptr<float>();
}

}  // namespace
}  // namespace torchrec_ext
