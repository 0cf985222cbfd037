// Host entry points of the CUDA kernels of dedup_segments (dedup_cuda.cu). Plain C++ signatures
// (raw device pointers, a stream), so the kernels compile with bare nvcc and the torch binding
// (dedup_cuda.cpp) is the only file that sees both torch and these launches. The binding runs
// the steps in this order, with an inclusive scan of `ranks` (torch's cumsum) between the first
// two and its one read of the host between the last two.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

namespace torchrec_ext {

// Step 1. slots: 2 * num_slots words, all -1 (num_slots a power of two >= 2n): per slot, the
// first position of its (segment, id) key, then the key's count minus one. so: the S + 1 segment
// offsets, on the device (any values: every access is bounded; the binding validates them).
// Writes slot_of[i] (position i's slot) and ranks[0] = 0, ranks[i + 1] = whether position i is
// its key's first occurrence. Two launches.
cudaError_t launch_dedup_first_occurrences(const int64_t* ids, int64_t n, const int64_t* so,
                                           int64_t S, long long* slots, int64_t num_slots,
                                           int64_t* slot_of, int64_t* ranks, cudaStream_t stream);

// Step 2, after ranks was scanned (ranks[i]: first occurrences before position i): read[s] =
// unique_offsets[s] = ranks[so[s]] and read[S + 1 + s] = so[s], for s in [0, S]: the one buffer
// the host reads back (unique counts, and the offsets to validate). One launch.
cudaError_t launch_dedup_bounds(const int64_t* so, int64_t S, int64_t n, const int64_t* ranks,
                                int64_t* read, cudaStream_t stream);

// Step 3, into outputs the host sized: inverse[i] = ranks[first position of i's key]; at each
// first occurrence, unique[that index] = its id and counts[that index] = its key's count. One
// launch.
cudaError_t launch_dedup_outputs(const int64_t* ids, int64_t n, const long long* slots,
                                 const int64_t* slot_of, const int64_t* ranks, int64_t* unique,
                                 int64_t* inverse, int64_t* counts, cudaStream_t stream);

}  // namespace torchrec_ext
