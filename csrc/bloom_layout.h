// Cells and counters of the counting Bloom filter of the bloom admission, shared by the CPU
// (bloom_cpu.cpp) and CUDA (bloom_cuda.cu) kernels of bloom_admit. Plain C++ only, so .cu files
// include it with bare nvcc.
//
// The filter is 2 * bytes 4-bit saturating counters (a power of two), two per byte, the low
// nibble first. A key's k cells are double hashing h1 + i * h2 of h = fmix64(key ^ hash_seed)
// (h1 its low 32 bits, h2 its high 32 bits | 1), modulo the counter count: the same definition
// as bloom_cells in torchrec_ext/modules/admission.py, which also gives hash_seed (the table's
// seed ^ its Bloom salt); tests/test_bloom_admit.py checks the two agree.
#pragma once
#include <cstdint>

#include "hash_table_layout.h"

namespace torchrec_ext {

constexpr int kBloomCounterMax = 15;
constexpr int64_t kBloomMaxHashes = 16;

struct BloomHash {
  uint64_t h1;
  uint64_t h2;
};

TREXT_HD BloomHash bloom_hash(int64_t key, int64_t hash_seed) {
  const uint64_t h = fmix64(static_cast<uint64_t>(key) ^ static_cast<uint64_t>(hash_seed));
  return {h & 0xFFFFFFFFull, (h >> 32) | 1ull};
}

// The i-th cell of a key; cell_mask = counters - 1.
TREXT_HD uint64_t bloom_cell(const BloomHash& h, int64_t i, uint64_t cell_mask) {
  return (h.h1 + static_cast<uint64_t>(i) * h.h2) & cell_mask;
}

// Counter `cell` read from its byte.
TREXT_HD int bloom_counter(uint8_t byte, uint64_t cell) {
  return (byte >> ((cell & 1) * 4)) & kBloomCounterMax;
}

// The smallest of a key's counters (what the admission compares with admit_after).
TREXT_HD int bloom_smallest_counter(const uint8_t* filter, const BloomHash& h, int64_t hashes,
                                    uint64_t cell_mask) {
  int smallest = kBloomCounterMax;
  for (int64_t i = 0; i < hashes; ++i) {
    const uint64_t cell = bloom_cell(h, i, cell_mask);
    const int c = bloom_counter(filter[cell >> 1], cell);
    smallest = c < smallest ? c : smallest;
  }
  return smallest;
}

// What one sighting count adds to each of a key's counters (counts saturate at 15 anyway).
TREXT_HD int bloom_increment(int64_t count) {
  return count <= 0 ? 0 : count >= kBloomCounterMax ? kBloomCounterMax : static_cast<int>(count);
}

TREXT_HD int bloom_saturating_add(int counter, int increment) {
  const int sum = counter + increment;
  return sum > kBloomCounterMax ? kBloomCounterMax : sum;
}

}  // namespace torchrec_ext
