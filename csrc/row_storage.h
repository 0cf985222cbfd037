// Rows of the embedding ops' flat multi-table buffer: the storage dtypes, a row summed into /
// loaded as / stored from float32 whatever its dtype (half_rows.h does the conversions),
// prefetches and non-temporal row writes, and the batch's new-row vectors.
//
// Storage convention (shared with torchrec_ext/reference.py and triton_kernels/): all tables of
// a module live in one flat buffer of 4-byte words (a float32 tensor); table t's [capacity_t,
// dim_t] rows start at word table_offsets[t], stored packed in the table's storage dtype
// (table_dtypes[t]: 0 float32, 1 float16, 2 bfloat16). Rows are read as float32, summed and
// stepped in float32, and written back rounded to nearest even or, for half tables with a
// rounding seed, stochastically (see round_stochastic). Optimizer state is float32: element-wise
// states hold the tables' [capacity_t, dim_t] back to back, row-wise ones one float per row from
// state_row_offsets[t]. A row of -1 reads as zeros and takes no update. Bags are KJT-ordered:
// bag g = f * batch_size + b is sample b of lookup feature f.
//
// New rows: a training batch's new ids get rows whose initial vectors are not yet written
// there. The lookups read them from `new_vectors` (one [n_t, dim_t] block per table; row
// -2 - j is block t's vector j), and the fused update writes each one to its row together with
// the row's first step. A new row thus costs one scattered write instead of three scattered
// passes (initialise, read back in backward, write the step).
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__SSE2__)
#include <immintrin.h>
#endif

#include "half_rows.h"

namespace torchrec_ext {
namespace {

constexpr int64_t kPrefetchDistance = 8;

// Rows a gather fetches ahead: about the bytes of kPrefetchDistance float32 rows of dim 64 in
// flight whatever the row's size, so half rows (fewer lines each) are fetched further ahead.
inline int64_t prefetch_distance(int64_t row_bytes) {
  return std::clamp<int64_t>(kPrefetchDistance * 256 / std::max<int64_t>(row_bytes, 1),
                             kPrefetchDistance, 4 * kPrefetchDistance);
}

// acc += s * x over a row (s = 1 adds the same bits as a plain sum).
TREXT_VECTOR_CLONES
void add_scaled(float* acc, const float* x, float s, int64_t dim) {
  for (int64_t d = 0; d < dim; ++d) acc[d] += s * x[d];
}

// Prefetching helpers are forced inline: GCC takes a function whose only effects are prefetches
// for pure and deletes calls to it whole (the fused update lost its row prefetches so when they
// moved into prefetch_unique_row); inlined, the prefetches stay in the caller's loop.
#if defined(__GNUC__)
#define TREXT_PREFETCH_INLINE inline __attribute__((always_inline))
#else
#define TREXT_PREFETCH_INLINE inline
#endif

// Fetches a row into cache (rw = 1: for writing) some ids (or unique rows) ahead: covers DRAM
// latency.
TREXT_PREFETCH_INLINE void prefetch_row(const void* row, int64_t bytes, int rw = 0) {
  const char* p = static_cast<const char*>(row);
  for (int64_t b = 0; b < bytes; b += 64) {
    if (rw)
      __builtin_prefetch(p + b, 1);
    else
      __builtin_prefetch(p + b, 0);
  }
}
TREXT_PREFETCH_INLINE void prefetch_row(const float* row, int64_t dim, int rw = 0) {
  prefetch_row(static_cast<const void*>(row), dim * 4, rw);
}

// ------------------------------------------------------------------- storage dtypes

enum class Storage : int64_t { kFloat = 0, kHalf = 1, kBFloat16 = 2 };
inline int64_t storage_bytes(Storage s) { return s == Storage::kFloat ? 4 : 2; }
inline int64_t table_words(int64_t cap, int64_t dim, Storage s) {
  return (cap * dim * storage_bytes(s) + 3) / 4;
}

// acc += s * row, the row in its storage dtype.
inline void add_scaled_row(float* acc, const void* row, Storage st, float s, int64_t dim) {
  switch (st) {
    case Storage::kFloat:
      add_scaled(acc, static_cast<const float*>(row), s, dim);
      break;
    case Storage::kHalf:
      if (kHasAvx512)
        add_scaled_half_avx512(acc, static_cast<const uint16_t*>(row), s, dim);
      else if (kHasF16C)
        add_scaled_half_f16c(acc, static_cast<const uint16_t*>(row), s, dim);
      else
        add_scaled_half(acc, static_cast<const uint16_t*>(row), s, dim);
      break;
    case Storage::kBFloat16:
      add_scaled_bf16(acc, static_cast<const uint16_t*>(row), s, dim);
      break;
  }
}

// out = row as float32.
inline void load_row(float* out, const void* row, Storage st, int64_t dim) {
  switch (st) {
    case Storage::kFloat:
      std::memcpy(out, row, dim * 4);
      break;
    case Storage::kHalf:
      if (kHasAvx512)
        half_row_to_float_avx512(out, static_cast<const uint16_t*>(row), dim);
      else if (kHasF16C)
        half_row_to_float_f16c(out, static_cast<const uint16_t*>(row), dim);
      else
        half_row_to_float(out, static_cast<const uint16_t*>(row), dim);
      break;
    case Storage::kBFloat16:
      bf16_row_to_float(out, static_cast<const uint16_t*>(row), dim);
      break;
  }
}

// row = x in the storage dtype: stochastically rounded with the row's random numbers when r is
// given, else to nearest. x is scratch: stochastic rounding to float16 may overwrite it.
inline void store_row(void* row, float* x, Storage st, int64_t dim, const RowRounding* r) {
  switch (st) {
    case Storage::kFloat:
      std::memcpy(row, x, dim * 4);
      break;
    case Storage::kHalf:
      if (kHasAvx512) {
        if (r != nullptr)
          float_row_to_half_stochastic_avx512(static_cast<uint16_t*>(row), x, r->key, dim);
        else
          float_row_to_half_avx512(static_cast<uint16_t*>(row), x, dim);
      } else if (kHasF16C) {  // the grid values, then an exact hardware conversion
        if (r != nullptr) half_stochastic_grid_row(x, r->drawn(dim), dim);
        float_row_to_half_f16c(static_cast<uint16_t*>(row), x, dim);
      } else if (r != nullptr) {
        float_row_to_half_stochastic(static_cast<uint16_t*>(row), x, r->drawn(dim), dim);
      } else {
        float_row_to_half(static_cast<uint16_t*>(row), x, dim);
      }
      break;
    case Storage::kBFloat16:
      if (r == nullptr && kHasAvx512)
        float_row_to_bf16_avx512(static_cast<uint16_t*>(row), x, dim);
      else if (r == nullptr)
        float_row_to_bf16(static_cast<uint16_t*>(row), x, dim);
      else if (kHasAvx512)
        float_row_to_bf16_stochastic_avx512(static_cast<uint16_t*>(row), x, r->key, dim);
      else
        float_row_to_bf16_stochastic(static_cast<uint16_t*>(row), x, r->drawn(dim), dim);
      break;
  }
}

inline const char* storage_name(Storage s) {
  return s == Storage::kFloat ? "float32" : s == Storage::kHalf ? "float16" : "bfloat16";
}
inline at::ScalarType storage_scalar_type(Storage s) {
  return s == Storage::kFloat ? at::kFloat : s == Storage::kHalf ? at::kHalf : at::kBFloat16;
}

// Where each table's rows start, as bytes.
inline std::vector<char*> table_bases(const at::Tensor& weights, const at::Tensor& table_offsets) {
  char* w = reinterpret_cast<char*>(weights.data_ptr<float>());
  const int64_t* off = table_offsets.data_ptr<int64_t>();
  std::vector<char*> out(table_offsets.numel());
  for (size_t t = 0; t < out.size(); ++t) out[t] = w + off[t] * 4;
  return out;
}

// Fills a row that will not be read again this step (optimizer state, read at backward) with
// non-temporal stores where it is 16-byte aligned: no read-for-ownership of lines about to be
// overwritten, and no eviction of the rows the lookup is about to read.
inline void fill_streaming(float* row, int64_t width, float value) {
#if defined(__SSE2__)
  if (reinterpret_cast<uintptr_t>(row) % 16 == 0 && width % 4 == 0) {
    const __m128 v = _mm_set1_ps(value);
    for (int64_t j = 0; j < width; j += 4) _mm_stream_ps(row + j, v);
    return;
  }
#endif
  std::fill(row, row + width, value);
}

// Copies a row that will not be read again soon (a new row's first step) with non-temporal
// stores where aligned: the line is written without being read first.
inline void copy_streaming(float* dst, const float* src, int64_t width) {
#if defined(__SSE2__)
  if (reinterpret_cast<uintptr_t>(dst) % 16 == 0 && width % 4 == 0) {
    for (int64_t j = 0; j < width; j += 4) _mm_stream_ps(dst + j, _mm_loadu_ps(src + j));
    return;
  }
#endif
  std::copy(src, src + width, dst);
}

// The same for a row of any dtype, `bytes` long.
inline void copy_streaming_bytes(void* dst, const void* src, int64_t bytes) {
#if defined(__SSE2__)
  if (reinterpret_cast<uintptr_t>(dst) % 16 == 0 && bytes % 16 == 0) {
    for (int64_t j = 0; j < bytes; j += 16)
      _mm_stream_si128(
          reinterpret_cast<__m128i*>(static_cast<char*>(dst) + j),
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const char*>(src) + j)));
    return;
  }
#endif
  std::memcpy(dst, src, bytes);
}

// store_row into a row not read again this step (a new row's first step), with non-temporal
// stores: directly where the AVX-512 path can (stochastic rounding, the row 32-byte aligned and
// a whole number of 16-value blocks), else rounded into `scratch` ([dim]) and streamed from
// there.
inline void store_row_streaming(void* row, float* x, Storage st, int64_t dim, const RowRounding* r,
                                uint16_t* scratch) {
  if (st == Storage::kFloat) {
    copy_streaming(static_cast<float*>(row), x, dim);
    return;
  }
  if (kHasAvx512 && r != nullptr && reinterpret_cast<uintptr_t>(row) % 32 == 0 && dim % 16 == 0) {
    if (st == Storage::kHalf)
      float_row_to_half_stochastic_avx512(static_cast<uint16_t*>(row), x, r->key, dim, true);
    else
      float_row_to_bf16_stochastic_avx512(static_cast<uint16_t*>(row), x, r->key, dim, true);
    return;
  }
  store_row(scratch, x, st, dim, r);
  copy_streaming_bytes(row, scratch, dim * storage_bytes(st));
}

// The initial vectors of the batch's new rows, one [n_t, dim_t] block per table (or none), each
// in its table's storage dtype.
struct NewVectors {
  std::vector<const char*> data;
  std::vector<int64_t> count;

  bool empty() const { return data.empty(); }
  // Where row `r` of table t is read from: the table (r >= 0) or block t (r <= -2).
  const void* source(const char* table_base, int64_t t, int64_t r, int64_t row_bytes) const {
    return r >= 0 ? table_base + r * row_bytes : data[t] + (-2 - r) * row_bytes;
  }
};

}  // namespace
}  // namespace torchrec_ext
