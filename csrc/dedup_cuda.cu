// CUDA kernels of dedup_segments: the ids of each segment deduplicated, uniques in
// first-occurrence order, segment-major (the CPU kernel's outputs exactly).
//
// One open-addressing table for all segments, keyed by (segment, id), at most half full. A slot
// holds the smallest position of its key (claimed by atomicCAS, lowered by atomicMin) and the
// key's count. A slot's key is that of any position it holds (ids are read-only), so no key is
// stored and a claim is one 64-bit CAS. Then position i is a first occurrence iff its slot holds
// i; an exclusive scan of those flags (torch's cumsum, in the binding) numbers the first
// occurrences in position order, which is segment-major first-occurrence order since segments
// are contiguous: that number is the unique's global index, and the scan at each segment's start
// is unique_offsets. Nothing depends on which thread wins a race: the minimum, the count and the
// scan are the same in any order.
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda_launch.cuh"
#include "dedup_cuda.h"
#include "hash_table_layout.h"

namespace torchrec_ext {
namespace {

constexpr int kDedupThreads = 256;
constexpr long long kEmptySlot = -1;

// Segment of position i: the last s in [0, S) with so[s] <= i. Bounded for any offsets (the
// binding validates them only after its read): garbage offsets give garbage, never a stray access.
__device__ __forceinline__ int64_t segment_of(const int64_t* so, int64_t S, int64_t i) {
  int64_t lo = 0, hi = S;
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (so[mid] <= i)
      lo = mid;
    else
      hi = mid;
  }
  return lo;
}

__device__ __forceinline__ uint64_t key_hash(int64_t id, int64_t segment) {
  return fmix64(static_cast<uint64_t>(id) ^ fmix64(static_cast<uint64_t>(segment) + kBucketSeed));
}

// A lane per position; the loop is warp-uniform (all lanes reach the collectives). Lanes of a warp
// with the same key insert once, by the lowest lane (the smallest position), and add their number
// to the count: one atomic per key per warp, however hot the id.
__global__ void dedup_insert_kernel(const int64_t* ids, int64_t n, const int64_t* so, int64_t S,
                                    long long* slots, uint64_t mask, int64_t* slot_of) {
  const int lane = lane_id();
  for (int64_t base = global_thread() - lane; base < n; base += global_threads()) {
    const int64_t i = base + lane;
    const bool live = i < n;
    const int64_t id = live ? ids[i] : 0;
    const int64_t segment = live ? segment_of(so, S, i) : -1;  // -1: matches no live lane
    const unsigned same = __match_any_sync(kFullWarpMask, static_cast<unsigned long long>(id)) &
                          __match_any_sync(kFullWarpMask, static_cast<unsigned long long>(segment));
    const int leader = __ffs(static_cast<int>(same)) - 1;
    int64_t slot = 0;
    if (live && lane == leader) {
      uint64_t p = key_hash(id, segment) & mask;
      for (;;) {
        long long* first = slots + 2 * p;
        // A stale read costs nothing: the CAS returns the slot's real holder.
        long long held = *reinterpret_cast<volatile long long*>(first);
        if (held == kEmptySlot) {
          held = static_cast<long long>(atomicCAS(reinterpret_cast<unsigned long long*>(first),
                                                  static_cast<unsigned long long>(kEmptySlot),
                                                  static_cast<unsigned long long>(i)));
          if (held == kEmptySlot) break;  // claimed
        }
        if (ids[held] == id && segment_of(so, S, held) == segment) {
          if (held > i) atomicMin(first, static_cast<long long>(i));
          break;
        }
        p = (p + 1) & mask;
      }
      atomicAdd(reinterpret_cast<unsigned long long*>(slots + 2 * p + 1),
                static_cast<unsigned long long>(__popc(same)));
      slot = static_cast<int64_t>(p);
    }
    slot = __shfl_sync(kFullWarpMask, slot, leader);
    if (live) slot_of[i] = slot;
  }
}

__global__ void dedup_mark_kernel(const long long* slots, const int64_t* slot_of, int64_t n,
                                  int64_t* ranks) {
  for (int64_t j = global_thread(); j <= n; j += global_threads())
    ranks[j] = j == 0 ? 0 : static_cast<int64_t>(slots[2 * slot_of[j - 1]] == j - 1);
}

__global__ void dedup_bounds_kernel(const int64_t* so, int64_t S, int64_t n, const int64_t* ranks,
                                    int64_t* read) {
  for (int64_t s = global_thread(); s <= S; s += global_threads()) {
    const int64_t at = so[s] < 0 ? 0 : so[s] > n ? n : so[s];
    read[s] = ranks[at];
    read[S + 1 + s] = so[s];
  }
}

__global__ void dedup_outputs_kernel(const int64_t* ids, int64_t n, const long long* slots,
                                     const int64_t* slot_of, const int64_t* ranks, int64_t* unique,
                                     int64_t* inverse, int64_t* counts) {
  for (int64_t i = global_thread(); i < n; i += global_threads()) {
    const int64_t p = slot_of[i];
    const int64_t first = slots[2 * p];
    const int64_t u = ranks[first];
    inverse[i] = u;
    if (first == i) {
      unique[u] = ids[i];
      counts[u] = slots[2 * p + 1] + 1;  // the count word started at -1
    }
  }
}

}  // namespace

cudaError_t launch_dedup_first_occurrences(const int64_t* ids, int64_t n, const int64_t* so,
                                           int64_t S, long long* slots, int64_t num_slots,
                                           int64_t* slot_of, int64_t* ranks, cudaStream_t stream) {
  const uint64_t mask = static_cast<uint64_t>(num_slots) - 1;
  if (n > 0) {
    const unsigned grid = capped_grid(n, kDedupThreads);
    dedup_insert_kernel<<<grid, kDedupThreads, 0, stream>>>(ids, n, so, S, slots, mask, slot_of);
  }
  const unsigned grid = capped_grid(n + 1, kDedupThreads);
  dedup_mark_kernel<<<grid, kDedupThreads, 0, stream>>>(slots, slot_of, n, ranks);
  return cudaGetLastError();
}

cudaError_t launch_dedup_bounds(const int64_t* so, int64_t S, int64_t n, const int64_t* ranks,
                                int64_t* read, cudaStream_t stream) {
  const unsigned grid = capped_grid(S + 1, kDedupThreads);
  dedup_bounds_kernel<<<grid, kDedupThreads, 0, stream>>>(so, S, n, ranks, read);
  return cudaGetLastError();
}

cudaError_t launch_dedup_outputs(const int64_t* ids, int64_t n, const long long* slots,
                                 const int64_t* slot_of, const int64_t* ranks, int64_t* unique,
                                 int64_t* inverse, int64_t* counts, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const unsigned grid = capped_grid(n, kDedupThreads);
  dedup_outputs_kernel<<<grid, kDedupThreads, 0, stream>>>(ids, n, slots, slot_of, ranks, unique,
                                                           inverse, counts);
  return cudaGetLastError();
}

}  // namespace torchrec_ext
