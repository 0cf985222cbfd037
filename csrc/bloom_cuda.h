// Host entry point of the CUDA kernels of bloom_admit (bloom_cuda.cu). Plain C++ signature (raw
// device pointers, a stream), so the kernels compile with bare nvcc and the torch binding
// (bloom_cuda.cpp) is the only file that sees both torch and this launch.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

namespace torchrec_ext {

// words: the filter as 32-bit words (8 counters each; the binding pads a filter of fewer than 4
// bytes or one not 4-byte aligned); num_counters: the filter's counters (a power of two).
// pending: nullptr = every key. admitted must be zeroed by the caller. Enqueues the increment
// pass, then the decision pass, on `stream`.
cudaError_t launch_bloom_admit(uint32_t* words, int64_t num_counters, const int64_t* keys,
                               const int64_t* counts, const bool* pending, int64_t n,
                               int64_t hash_seed, int64_t hashes, int64_t admit_after,
                               bool* admitted, cudaStream_t stream);

}  // namespace torchrec_ext
