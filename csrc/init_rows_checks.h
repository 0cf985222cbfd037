// Argument checks of init_rows_tables shared by its CPU and CUDA kernels: shapes, dtypes and
// lengths only (nothing read from the tensors' data, which may live on a GPU). Each failure names
// the op, the argument, the constraint and the value, before anything is written.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>

#include "embedding_checks.h"

namespace torchrec_ext {
namespace {

constexpr const char* kInitTablesOp = "init_rows_tables";

inline void check_init_long(const char* name, const at::Tensor& t, int64_t length) {
  check_long_1d(kInitTablesOp, name, t);
  TORCH_CHECK(length < 0 || t.numel() == length, kInitTablesOp, ": ", name, " must have ", length,
              " entries, got ", t.numel());
}

// Returns the table count T.
inline int64_t check_init_rows_tables(
    const at::Tensor& weights, const at::Tensor& table_offsets, const at::Tensor& table_dims,
    const std::optional<at::Tensor>& table_dtypes, const at::Tensor& rows, const at::Tensor& tables,
    const at::Tensor& ids, const at::Tensor& table_seeds, const at::Tensor& table_kinds,
    const at::Tensor& table_params, int64_t max_dim, at::TensorList states,
    const std::optional<at::Tensor>& state_offsets, at::ArrayRef<double> state_values) {
  const char* op = kInitTablesOp;
  check_weights(op, weights);
  check_init_long("table_offsets", table_offsets, -1);
  const int64_t T = table_offsets.numel();
  check_init_long("table_dims", table_dims, T);
  if (table_dtypes.has_value()) check_init_long("table_dtypes", *table_dtypes, T);
  check_init_long("table_seeds", table_seeds, T);
  check_init_long("table_kinds", table_kinds, T);
  TORCH_CHECK(table_params.dim() == 2 && table_params.size(0) == T && table_params.size(1) == 4 &&
                  table_params.scalar_type() == at::kDouble && table_params.is_contiguous(),
              op, ": table_params must be a contiguous float64 [", T, ", 4] tensor, got ",
              table_params.scalar_type(), " of shape ", table_params.sizes());
  check_init_long("rows", rows, -1);
  check_init_long("tables", tables, rows.numel());
  check_init_long("ids", ids, rows.numel());
  TORCH_CHECK(max_dim >= 0, op, ": max_dim must be >= 0, got ", max_dim);
  TORCH_CHECK(state_values.size() == states.size(), op, ": one state value per state, got ",
              state_values.size(), " values for ", states.size(), " states");
  for (const at::Tensor& s : states)
    TORCH_CHECK(s.dim() == 1 && s.scalar_type() == at::kFloat && s.is_contiguous(), op,
                ": optimizer states must be contiguous 1-D float32 tensors, got ", s.scalar_type(),
                " of shape ", s.sizes());
  if (!states.empty()) {
    TORCH_CHECK(state_offsets.has_value(), op, ": state_offsets is required with states");
    check_init_long("state_offsets", *state_offsets, T);
  }
  return T;
}

}  // namespace
}  // namespace torchrec_ext
