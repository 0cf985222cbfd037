// The draw of init_rows' initial vectors, shared by its CPU (init_rows_cpu.cpp) and CUDA
// (init_rows_cuda.cu) kernels, which must write the same bits: the initializer codes and the
// counter-based hash each element is drawn from. Plain C++ only, as hash_table_layout.h, so the
// .cu file includes it and compiles with bare nvcc.
#pragma once
#include <cstdint>

#include "hash_table_layout.h"  // fmix64, TREXT_HD

namespace torchrec_ext {

// Initializer codes (vocabulary.INITIALIZERS), with their parameters p: uniform on [p0, p1),
// normal (mean p0, std p1), truncated normal (also within [p2, p3]), constant p0.
enum class Init : int64_t { kUniform = 0, kNormal = 1, kTruncatedNormal = 2, kConstant = 3 };

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;  // a row's counter step (2^64 / golden ratio)
constexpr int kTruncNormalAttempts = 16;  // draws of a truncated normal element before a clamp

// The key of id's row: every element of its vector is a function of it and the element's column.
TREXT_HD uint64_t row_key(int64_t id, uint64_t seed) {
  return fmix64(static_cast<uint64_t>(id) ^ seed);
}

// 64 random bits for elements 2p and 2p+1 of a row (one hash feeds two elements); attempts after
// the first redraw a truncated normal's out-of-range elements.
TREXT_HD uint64_t pair_bits(uint64_t key, int64_t pair, int64_t attempt) {
  const uint64_t counter = (static_cast<uint64_t>(attempt) << 32) + static_cast<uint64_t>(pair) + 1;
  return fmix64(key + counter * kGolden);
}

}  // namespace torchrec_ext
