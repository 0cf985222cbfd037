// CUDA kernels of bloom_admit: the counting Bloom filter of the bloom admission, in place.
//
// Two launches, one thread per key: the first adds each pending key's count to its k counters
// (saturating at 15), the second decides each pending key from the smallest of its counters
// once every increment of the batch is in (the launch boundary orders them), so a decision does
// not depend on scheduling. Eight counters share a 32-bit word, so an increment is an atomicCAS
// loop on the word: concurrent increments of neighbouring nibbles are never lost.
#include <cuda_runtime.h>

#include <cstdint>

#include "bloom_cuda.h"
#include "bloom_layout.h"
#include "cuda_launch.cuh"

namespace torchrec_ext {
namespace {

constexpr int kBloomThreads = 256;

// Counter `cell` of the filter's little-endian words: nibble cell % 8 of word cell / 8.
__device__ __forceinline__ void add_to_counter(uint32_t* words, uint64_t cell, int increment) {
  uint32_t* word = words + (cell >> 3);
  const int shift = static_cast<int>(cell & 7) * 4;
  uint32_t old = *word;  // a stale value only costs one more turn: the CAS returns the current one
  for (;;) {
    const int now = static_cast<int>((old >> shift) & kBloomCounterMax);
    if (now == kBloomCounterMax) return;
    const uint32_t want = (old & ~(static_cast<uint32_t>(kBloomCounterMax) << shift)) |
                          (static_cast<uint32_t>(bloom_saturating_add(now, increment)) << shift);
    const uint32_t seen = atomicCAS(word, old, want);
    if (seen == old) return;
    old = seen;
  }
}

__global__ void bloom_add_kernel(uint32_t* words, uint64_t mask, const int64_t* keys,
                                 const int64_t* counts, const bool* pending, int64_t n,
                                 int64_t hash_seed, int64_t hashes) {
  for (int64_t j = global_thread(); j < n; j += global_threads()) {
    if (pending != nullptr && !pending[j]) continue;
    const int increment = bloom_increment(counts[j]);
    if (increment == 0) continue;
    const BloomHash h = bloom_hash(keys[j], hash_seed);
    for (int64_t i = 0; i < hashes; ++i) add_to_counter(words, bloom_cell(h, i, mask), increment);
  }
}

__global__ void bloom_decide_kernel(const uint8_t* bytes, uint64_t mask, const int64_t* keys,
                                    const bool* pending, int64_t n, int64_t hash_seed,
                                    int64_t hashes, int64_t admit_after, bool* admitted) {
  for (int64_t j = global_thread(); j < n; j += global_threads()) {
    if (pending != nullptr && !pending[j]) continue;
    admitted[j] =
        bloom_smallest_counter(bytes, bloom_hash(keys[j], hash_seed), hashes, mask) >= admit_after;
  }
}

}  // namespace

cudaError_t launch_bloom_admit(uint32_t* words, int64_t num_counters, const int64_t* keys,
                               const int64_t* counts, const bool* pending, int64_t n,
                               int64_t hash_seed, int64_t hashes, int64_t admit_after,
                               bool* admitted, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const uint64_t mask = static_cast<uint64_t>(num_counters) - 1;
  const unsigned grid = capped_grid(n, kBloomThreads);
  bloom_add_kernel<<<grid, kBloomThreads, 0, stream>>>(words, mask, keys, counts, pending, n,
                                                       hash_seed, hashes);
  bloom_decide_kernel<<<grid, kBloomThreads, 0, stream>>>(reinterpret_cast<const uint8_t*>(words),
                                                          mask, keys, pending, n, hash_seed, hashes,
                                                          admit_after, admitted);
  return cudaGetLastError();
}

}  // namespace torchrec_ext
