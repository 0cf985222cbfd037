// Launch geometry shared by the CUDA kernel files (csrc/*.cu): how many blocks a launch gets,
// where a thread stands in its grid, and a warp's lanes. Kernels over n elements loop
// grid-stride, so any grid covers any n. Plain CUDA only (no torch), as the .cu files that
// include it, after <cuda_runtime.h>.
#pragma once
#include <algorithm>
#include <cstdint>

namespace torchrec_ext {

constexpr int kWarpSize = 32;
constexpr unsigned kFullWarpMask = 0xFFFFFFFFu;  // every lane of a warp takes part

// Grids are capped at 2^16 blocks: at 256 threads a block that is 16M threads, ~60 waves of an
// H100's SMs, enough to keep every SM busy to the end; past it more blocks only add block
// scheduling, so the kernels' grid-stride loops give a thread several elements instead.
constexpr int64_t kMaxBlocks = int64_t{1} << 16;

// Blocks of `block` threads for `threads` threads, capped at kMaxBlocks.
inline unsigned capped_grid(int64_t threads, int block) {
  return static_cast<unsigned>(std::min<int64_t>((threads + block - 1) / block, kMaxBlocks));
}

// This thread's index in the grid, 64-bit like the element counts the loops compare it with.
__device__ __forceinline__ int64_t global_thread() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}

// The grid's thread count: a grid-stride loop's step.
__device__ __forceinline__ int64_t global_threads() {
  return static_cast<int64_t>(gridDim.x) * blockDim.x;
}

// This warp's index in the grid (kernels that give a warp each stripe).
__device__ __forceinline__ int64_t global_warp() { return global_thread() / kWarpSize; }

__device__ __forceinline__ int lane_id() { return static_cast<int>(threadIdx.x) & (kWarpSize - 1); }

}  // namespace torchrec_ext
