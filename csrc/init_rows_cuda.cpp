// CUDA kernel of init_rows_tables: the torch side. Validates shapes and dtypes as the CPU kernel
// does (plus: every tensor on the storage's GPU; nothing is read back, so row and table indices
// are not range-checked here: the kernel skips any write outside its buffer), and launches
// init_rows_cuda.cu once on the current stream. Compiled only in CUDA builds (setup.py).
#include "init_rows_cuda.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>

#include "cuda_binding_checks.h"
#include "init_rows_checks.h"

namespace torchrec_ext {
namespace {

void init_rows_tables_cuda(at::Tensor& weights, const at::Tensor& table_offsets,
                           const at::Tensor& table_dims,
                           const std::optional<at::Tensor>& table_dtypes, const at::Tensor& rows,
                           const at::Tensor& tables, const at::Tensor& ids,
                           const at::Tensor& table_seeds, const at::Tensor& table_kinds,
                           const at::Tensor& table_params, int64_t max_dim, at::TensorList states,
                           const std::optional<at::Tensor>& state_offsets, bool rowwise,
                           at::ArrayRef<double> state_values) {
  const char* op = kInitTablesOp;
  check_init_rows_tables(weights, table_offsets, table_dims, table_dtypes, rows, tables, ids,
                         table_seeds, table_kinds, table_params, max_dim, states, state_offsets,
                         state_values);
  TORCH_CHECK(weights.is_cuda(), op, ": weights must be a CUDA tensor, got one on ",
              weights.device());
  check_on_anchor_device(op, weights, "weights",
                         {{"table_offsets", &table_offsets},
                          {"table_dims", &table_dims},
                          {"table_dtypes", table_dtypes.has_value() ? &*table_dtypes : nullptr},
                          {"table_seeds", &table_seeds},
                          {"table_kinds", &table_kinds},
                          {"table_params", &table_params},
                          {"rows", &rows},
                          {"tables", &tables},
                          {"ids", &ids}});
  for (const at::Tensor& s : states)
    check_on_anchor_device(op, weights, "weights", {{"states", &s}});
  if (!states.empty())
    check_on_anchor_device(op, weights, "weights", {{"state_offsets", &*state_offsets}});
  TORCH_CHECK(static_cast<int>(states.size()) <= kInitMaxStates, op, ": at most ", kInitMaxStates,
              " optimizer states, got ", states.size());
  const c10::cuda::CUDAGuard device_guard(weights.device());
  InitRowsTables a{};
  a.weights = weights.data_ptr<float>();
  a.words = weights.numel();
  a.table_offsets = table_offsets.const_data_ptr<int64_t>();
  a.table_dims = table_dims.const_data_ptr<int64_t>();
  a.table_dtypes = table_dtypes.has_value() ? table_dtypes->const_data_ptr<int64_t>() : nullptr;
  a.table_seeds = table_seeds.const_data_ptr<int64_t>();
  a.table_kinds = table_kinds.const_data_ptr<int64_t>();
  a.table_params = table_params.const_data_ptr<double>();
  a.rows = rows.const_data_ptr<int64_t>();
  a.tables = tables.const_data_ptr<int64_t>();
  a.ids = ids.const_data_ptr<int64_t>();
  a.n = rows.numel();
  a.max_dim = max_dim;
  a.num_states = static_cast<int>(states.size());
  for (int s = 0; s < a.num_states; ++s) {
    a.states[s] = states[s].data_ptr<float>();
    a.state_numel[s] = states[s].numel();
    a.state_values[s] = static_cast<float>(state_values[s]);
  }
  a.state_offsets = states.empty() ? nullptr : state_offsets->const_data_ptr<int64_t>();
  a.rowwise = rowwise;
  C10_CUDA_CHECK(launch_init_rows_tables(a, c10::cuda::getCurrentCUDAStream().stream()));
}

}  // namespace

TORCH_LIBRARY_IMPL(torchrec_ext, CUDA, m) { m.impl("init_rows_tables", &init_rows_tables_cuda); }

}  // namespace torchrec_ext
