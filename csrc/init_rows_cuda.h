// Host entry point of the CUDA kernel of init_rows_tables (init_rows_cuda.cu). Plain C++
// signature (raw device pointers, a stream), so the kernel compiles with bare nvcc and the torch
// binding (init_rows_cuda.cpp) is the only file that sees both torch and this launch.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

namespace torchrec_ext {

constexpr int kInitMaxStates =
    8;  // optimizer states one call resets (the most any optimizer has: 2)

// Every table's new rows in the flat storage, as the CPU kernel of init_rows_tables writes them.
struct InitRowsTables {
  float* weights;  // the flat storage, `words` 4-byte words
  int64_t words;
  const int64_t* table_offsets;  // [T] word where table t's rows start
  const int64_t* table_dims;     // [T]
  const int64_t*
      table_dtypes;  // [T] storage code (0 float32, 1 float16, 2 bfloat16); nullptr: all float32
  const int64_t* table_seeds;  // [T]
  const int64_t* table_kinds;  // [T] initializer (vocabulary.INITIALIZERS)
  const double* table_params;  // [T, 4]
  const int64_t* rows;         // [n] the new id's row in its table, -1: skip
  const int64_t* tables;       // [n]
  const int64_t* ids;          // [n]
  int64_t n;
  int64_t max_dim;  // the widest table's dim (a host int: it sizes the launch)
  int num_states;
  float* states[kInitMaxStates];  // flat float32 optimizer states
  int64_t state_numel[kInitMaxStates];
  float state_values[kInitMaxStates];
  const int64_t* state_offsets;  // [T] element where table t's state rows start
  bool rowwise;                  // one state value per row (else dim_t)
};

// One launch on `stream` for all tables: a thread per (new row, element).
cudaError_t launch_init_rows_tables(const InitRowsTables& args, cudaStream_t stream);

}  // namespace torchrec_ext
