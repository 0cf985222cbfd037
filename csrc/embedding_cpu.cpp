// CPU kernels of the embedding ops: per-table id dedup, per-id initial vectors, multi-table
// pooled and sequence lookups, and the backward fused with the optimizer step.
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
//
// The backward never materialises a per-id gradient: values are grouped by unique row (a
// counting sort of `inverse`), and each unique row sums its values' output gradients and takes
// its optimizer step in one pass, in parallel over unique rows (no two threads share a row).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__SSE2__)
#include <immintrin.h>
#endif

#include "hash_table_layout.h"

namespace torchrec_ext {
namespace {

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;
constexpr int kTruncNormalAttempts = 16;
constexpr int64_t kPrefetchDistance = 8;

// Row loops (sums, optimizer steps, hashes) compiled twice, for x86-64-v4 (AVX-512) and the
// baseline, the loader picking the one the CPU runs: the wheel stays portable and sqrt/div over
// a 64-float row take 4x fewer instructions where AVX-512 exists.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define TREXT_VECTOR_CLONES __attribute__((target_clones("arch=x86-64-v4", "default")))
#else
#define TREXT_VECTOR_CLONES
#endif

// acc += s * x over a row (s = 1 adds the same bits as a plain sum).
TREXT_VECTOR_CLONES
void add_scaled(float* acc, const float* x, float s, int64_t dim) {
  for (int64_t d = 0; d < dim; ++d) acc[d] += s * x[d];
}  // ids (or unique rows) ahead: covers DRAM latency

inline void prefetch_row(const void* row, int64_t bytes, int rw = 0) {
  const char* p = static_cast<const char*>(row);
  for (int64_t b = 0; b < bytes; b += 64) {
    if (rw)
      __builtin_prefetch(p + b, 1);
    else
      __builtin_prefetch(p + b, 0);
  }
}
inline void prefetch_row(const float* row, int64_t dim, int rw = 0) {
  prefetch_row(static_cast<const void*>(row), dim * 4, rw);
}

// ------------------------------------------------------------------- storage dtypes

enum class Storage : int64_t { kFloat = 0, kHalf = 1, kBFloat16 = 2 };
inline int64_t storage_bytes(Storage s) { return s == Storage::kFloat ? 4 : 2; }
inline int64_t table_words(int64_t cap, int64_t dim, Storage s) {
  return (cap * dim * storage_bytes(s) + 3) / 4;
}

inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float half_to_float(uint16_t h) { return c10::detail::fp16_ieee_to_fp32_value(h); }
inline float bf16_to_float(uint16_t h) { return bits_to_float(static_cast<uint32_t>(h) << 16); }

// Half rows read as float32 (exact): the conversions are branch-free bit operations, so the
// x86-64-v4 clone vectorises them.
TREXT_VECTOR_CLONES
void add_scaled_half(float* acc, const uint16_t* x, float s, int64_t dim) {
  for (int64_t d = 0; d < dim; ++d) acc[d] += s * half_to_float(x[d]);
}
TREXT_VECTOR_CLONES
void add_scaled_bf16(float* acc, const uint16_t* x, float s, int64_t dim) {
  for (int64_t d = 0; d < dim; ++d) acc[d] += s * bf16_to_float(x[d]);
}
TREXT_VECTOR_CLONES
void half_row_to_float(float* out, const uint16_t* x, int64_t dim) {
  for (int64_t d = 0; d < dim; ++d) out[d] = half_to_float(x[d]);
}
TREXT_VECTOR_CLONES
void bf16_row_to_float(float* out, const uint16_t* x, int64_t dim) {
  for (int64_t d = 0; d < dim; ++d) out[d] = bf16_to_float(x[d]);
}

// float16 <-> float32 in hardware (F16C: one instruction per 8 values; the bit-operation loops
// above take ~15 per value), where the CPU has it. Same bits: both convert exactly / to nearest.
#if defined(__x86_64__) && defined(__GNUC__)
#define TREXT_F16C __attribute__((target("avx2,f16c")))
// TORCHREC_EXT_NO_F16C=1 takes the portable loops (tests check both give the same bits).
const bool kHasF16C = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c") &&
                      std::getenv("TORCHREC_EXT_NO_F16C") == nullptr;

TREXT_F16C void add_scaled_half_f16c(float* acc, const uint16_t* x, float s, int64_t dim) {
  const __m256 sv = _mm256_set1_ps(s);
  int64_t d = 0;
  for (; d + 8 <= dim; d += 8) {
    const __m256 v = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + d)));
    _mm256_storeu_ps(acc + d, _mm256_add_ps(_mm256_loadu_ps(acc + d), _mm256_mul_ps(sv, v)));
  }
  for (; d < dim; ++d) acc[d] += s * half_to_float(x[d]);
}
TREXT_F16C void half_row_to_float_f16c(float* out, const uint16_t* x, int64_t dim) {
  int64_t d = 0;
  for (; d + 8 <= dim; d += 8)
    _mm256_storeu_ps(out + d,
                     _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + d))));
  for (; d < dim; ++d) out[d] = half_to_float(x[d]);
}
TREXT_F16C void float_row_to_half_f16c(uint16_t* out, const float* x, int64_t dim) {
  int64_t d = 0;
  for (; d + 8 <= dim; d += 8)
    _mm_storeu_si128(
        reinterpret_cast<__m128i*>(out + d),
        _mm256_cvtps_ph(_mm256_loadu_ps(x + d), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  for (; d < dim; ++d) out[d] = c10::detail::fp16_ieee_from_fp32_value(x[d]);
}
#else
constexpr bool kHasF16C = false;
void add_scaled_half_f16c(float*, const uint16_t*, float, int64_t) {}
void half_row_to_float_f16c(float*, const uint16_t*, int64_t) {}
void float_row_to_half_f16c(uint16_t*, const float*, int64_t) {}
#endif

// Round to nearest even (c10's conversions, as torch's .to()).
TREXT_VECTOR_CLONES
void float_row_to_half(uint16_t* out, const float* x, int64_t dim) {
  for (int64_t d = 0; d < dim; ++d) out[d] = c10::detail::fp16_ieee_from_fp32_value(x[d]);
}
TREXT_VECTOR_CLONES
void float_row_to_bf16(uint16_t* out, const float* x, int64_t dim) {
  for (int64_t d = 0; d < dim; ++d) out[d] = c10::detail::round_to_nearest_even(x[d]);
}

// Stochastic rounding of one float32 with 16 random bits r (reference.round_to_storage): the
// bit pattern plus r scaled to the D bits the conversion drops, truncated, is exactly a value
// of the target grid; in expectation it is x. bfloat16 drops 16 bits; float16 13, or up to 23
// in its subnormal range; below 2^-24 the two neighbours are 0 and 2^-24 (2^-24 where
// |x| + r * 2^-40 >= 2^-24, as everywhere: |x| + r * grid spacing / 2^16, truncated). A finite x
// never rounds up to inf where round-to-nearest keeps it finite (|x| below the dtype's overflow
// boundary): it takes the largest finite value instead. Branch-free (selects), so the row loops
// vectorise.
constexpr uint32_t kBf16OverflowBoundary = 0x7F7F8000u;  // |x| from which bfloat16 rounds to inf
constexpr uint32_t kHalfOverflowBoundary =
    0x477FF000u;                            // 65520: |x| from which float16 rounds to inf
constexpr uint32_t kHalfMax = 0x477FE000u;  // 65504, the largest float16, as float32 bits
inline uint16_t bf16_stochastic(float x, uint32_t r) {
  const uint32_t u = float_to_bits(x);
  const uint32_t a = u & 0x7FFFFFFFu;
  const bool nan = a > 0x7F800000u;
  // (a finite pattern plus r never carries into the sign; inf plus r truncates back to inf)
  const uint32_t t = (u + r) >> 16;
  const bool overflow = (t & 0x7FFFu) == 0x7F80u && a < kBf16OverflowBoundary;
  return nan ? static_cast<uint16_t>(0x7FC0) : static_cast<uint16_t>(overflow ? t - 1 : t);
}
// The float16 grid value half_stochastic rounds x to, as a float32 (inf and NaN: x itself), for
// a hardware conversion to take exactly.
inline float half_stochastic_grid(float x, uint32_t r) {
  const uint32_t u = float_to_bits(x), sign = u & 0x80000000u, a = u & 0x7FFFFFFFu;
  const int exponent = static_cast<int>(a >> 23);
  const int dropped = std::min(24, std::max(13, 126 - exponent));
  const uint32_t scaled = (r << 8) >> (24 - dropped);
  uint32_t t = (a + scaled) & ~((1u << dropped) - 1u);
  const uint32_t tiny = std::fabs(x) * 0x1p40f >= static_cast<float>(65536u - r) ? 0x33800000u : 0u;
  t = a < 0x33800000u ? tiny : t;
  t = t >= 0x47800000u && a < kHalfOverflowBoundary ? kHalfMax : t;
  return a >= 0x7F800000u ? x : bits_to_float(t | sign);
}
inline uint16_t half_stochastic(float x, uint32_t r) {
  const uint32_t u = float_to_bits(x), sign = (u >> 16) & 0x8000u, a = u & 0x7FFFFFFFu;
  // D = max(13, 126 - biased exponent), capped at 24 (below, the tiny case decides)
  const int exponent = static_cast<int>(a >> 23);
  const int dropped = std::min(24, std::max(13, 126 - exponent));
  const uint32_t scaled = (r << 8) >> (24 - dropped);  // r * 2^(D - 16), floored
  uint32_t t = (a + scaled) & ~((1u << dropped) - 1u);
  const uint32_t tiny = std::fabs(x) * 0x1p40f >= static_cast<float>(65536u - r) ? 0x33800000u : 0u;
  t = a < 0x33800000u ? tiny : t;
  t = t >= 0x47800000u && a < kHalfOverflowBoundary ? kHalfMax : t;
  // t is exactly a float16 value: its bits directly (no rounding left to do).
  const uint32_t normal = (t >> 13) - 0x1C000u;  // rebias 127 -> 15
  const uint32_t subnormal =
      static_cast<uint32_t>(bits_to_float(t) * 0x1p24f);  // multiples of 2^-24
  uint32_t h = t >= 0x47800000u ? 0x7C00u : t >= 0x38800000u ? normal : subnormal;
  h = a > 0x7F800000u ? 0x7E00u : a == 0x7F800000u ? 0x7C00u : h;  // NaN, inf
  return static_cast<uint16_t>(h | sign);
}

constexpr uint64_t kRoundingGolden = 0xD6E8FEB86659FD93ull;

// The 16-bit random numbers of a row's elements at one step (reference.rounding_bits): element
// d takes bits 16 * (d % 4) of hash d / 4, i.e. (little-endian) the d-th uint16 of the hashes.
TREXT_VECTOR_CLONES
void rounding_bits(uint16_t* out, uint64_t* scratch, int64_t dim, int64_t id, uint64_t seed,
                   int64_t step) {
  const uint64_t key = fmix64(fmix64(static_cast<uint64_t>(id) ^ seed) +
                              static_cast<uint64_t>(step) * kRoundingGolden);
  const int64_t groups = (dim + 3) / 4;
  for (int64_t q = 0; q < groups; ++q)
    scratch[q] = fmix64(key + static_cast<uint64_t>(q + 1) * kRoundingGolden);
  static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
                "rounding_bits reads hashes as uint16 lanes");
  std::memcpy(out, scratch, dim * sizeof(uint16_t));
}

TREXT_VECTOR_CLONES
void float_row_to_half_stochastic(uint16_t* out, const float* x, const uint16_t* r, int64_t dim) {
  for (int64_t d = 0; d < dim; ++d) out[d] = half_stochastic(x[d], r[d]);
}
TREXT_VECTOR_CLONES
void half_stochastic_grid_row(float* x, const uint16_t* r, int64_t dim) {
  for (int64_t d = 0; d < dim; ++d) x[d] = half_stochastic_grid(x[d], r[d]);
}
TREXT_VECTOR_CLONES
void float_row_to_bf16_stochastic(uint16_t* out, const float* x, const uint16_t* r, int64_t dim) {
  for (int64_t d = 0; d < dim; ++d) out[d] = bf16_stochastic(x[d], r[d]);
}

// float16 rows in AVX-512, 16 values per instruction (F16C's ymm forms take 8), tails masked.
// Stochastic rounding in one pass of float operations with a rounding-mode immediate (below); the
// F16C path makes two passes (grid row in integers, then conversion). Same bits as the portable
// and F16C paths.
#if defined(__x86_64__) && defined(__GNUC__)
// GCC 12 warns that the intrinsics' _mm*_undefined_* sources may be uninitialised (they are
// meant to be: every lane is written)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#define TREXT_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,f16c")))
// TORCHREC_EXT_NO_AVX512=1 takes the F16C path (tests check both give the same bits).
const bool kHasAvx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                        __builtin_cpu_supports("avx512vl") && kHasF16C &&
                        std::getenv("TORCHREC_EXT_NO_AVX512") == nullptr;

TREXT_AVX512 inline __m256i to_half16(__m512 x) {
  return _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
TREXT_AVX512 inline __m512 half16_to_float(const uint16_t* x, __mmask16 m) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, x));
}
// Half rows read 16 values per instruction (the F16C loops take 8): exact, so the same bits.
TREXT_AVX512 void add_scaled_half_avx512(float* acc, const uint16_t* x, float s, int64_t dim) {
  const __m512 sv = _mm512_set1_ps(s);
  for (int64_t d = 0; d < dim; d += 16) {
    const __mmask16 m = dim - d >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (dim - d)) - 1u);
    const __m512 sum = _mm512_add_ps(_mm512_maskz_loadu_ps(m, acc + d),
                                     _mm512_mul_ps(sv, half16_to_float(x + d, m)));
    _mm512_mask_storeu_ps(acc + d, m, sum);
  }
}
TREXT_AVX512 void half_row_to_float_avx512(float* out, const uint16_t* x, int64_t dim) {
  for (int64_t d = 0; d < dim; d += 16) {
    const __mmask16 m = dim - d >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (dim - d)) - 1u);
    _mm512_mask_storeu_ps(out + d, m, half16_to_float(x + d, m));
  }
}
TREXT_AVX512 void float_row_to_half_avx512(uint16_t* out, const float* x, int64_t dim) {
  for (int64_t d = 0; d < dim; d += 16) {
    const __mmask16 m = dim - d >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (dim - d)) - 1u);
    _mm256_mask_storeu_epi16(out + d, m, to_half16(_mm512_maskz_loadu_ps(m, x + d)));
  }
}

// Stochastic rounding to float16 without a per-element shift: |x| + r * g / 2^16 (g the float16
// grid spacing at |x|, a power of two read off x's exponent field: noise exact in float32), added
// rounding toward zero and converted rounding toward zero, is the truncation half_stochastic
// computes in integers. Rounding toward zero saturates at 65504, which is half_stochastic's cap
// below the overflow boundary; from the boundary up, a sum past 65504 is inf instead.
TREXT_AVX512 inline __m256i half_stochastic16(__m512 x, __m512i r) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i a = _mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF));
  // g / 2^16 = 2^(exponent - 26), at least 2^-40 (g = 2^-24 in the subnormal range): as bits
  const __m512i noise_scale =
      _mm512_max_epi32(_mm512_sub_epi32(_mm512_and_si512(u, _mm512_set1_epi32(0x7F800000)),
                                        _mm512_set1_epi32(26 << 23)),
                       _mm512_set1_epi32(0x2B800000));
  const __m512 noise = _mm512_mul_ps(_mm512_cvtepi32_ps(r), _mm512_castsi512_ps(noise_scale));
  __m512 y =
      _mm512_add_round_ps(_mm512_castsi512_ps(a), noise, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
  // inf, NaN: themselves (inf + noise = inf, NaN + noise = NaN); overflow from the boundary up
  const __mmask16 overflow = _mm512_mask_cmp_ps_mask(
      _mm512_cmpge_epu32_mask(a, _mm512_set1_epi32(static_cast<int>(kHalfOverflowBoundary))), y,
      _mm512_set1_ps(65536.0f), _CMP_GE_OQ);
  y = _mm512_mask_mov_ps(y, overflow, _mm512_set1_ps(std::numeric_limits<float>::infinity()));
  // y | (u & sign): the sign back; truncation is symmetric
  const __m512i signed_y = _mm512_ternarylogic_epi32(
      _mm512_castps_si512(y), u, _mm512_set1_epi32(static_cast<int>(0x80000000u)), 0xF8);
  return _mm512_cvtps_ph(_mm512_castsi512_ps(signed_y), _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
}

TREXT_AVX512 void float_row_to_half_stochastic_avx512(uint16_t* out, const float* x,
                                                      const uint16_t* r, int64_t dim) {
  int64_t d = 0;
  for (; d + 16 <= dim; d += 16) {
    const __m512i rv =
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + d)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + d),
                        half_stochastic16(_mm512_loadu_ps(x + d), rv));
  }
  if (d < dim) {  // the tail, masked (dims not a multiple of 16)
    const __mmask16 m = static_cast<__mmask16>((1u << (dim - d)) - 1u);
    const __m512i rv = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, r + d));
    _mm256_mask_storeu_epi16(out + d, m, half_stochastic16(_mm512_maskz_loadu_ps(m, x + d), rv));
  }
}
#pragma GCC diagnostic pop
#else
constexpr bool kHasAvx512 = false;
void add_scaled_half_avx512(float*, const uint16_t*, float, int64_t) {}
void half_row_to_float_avx512(float*, const uint16_t*, int64_t) {}
void float_row_to_half_avx512(uint16_t*, const float*, int64_t) {}
void float_row_to_half_stochastic_avx512(uint16_t*, const float*, const uint16_t*, int64_t) {}
#endif

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

// row = x in the storage dtype: stochastically rounded with bits r when given, else to nearest.
// x is scratch: stochastic rounding to float16 may overwrite it.
inline void store_row(void* row, float* x, Storage st, int64_t dim, const uint16_t* r) {
  switch (st) {
    case Storage::kFloat:
      std::memcpy(row, x, dim * 4);
      break;
    case Storage::kHalf:
      if (kHasAvx512) {
        if (r != nullptr)
          float_row_to_half_stochastic_avx512(static_cast<uint16_t*>(row), x, r, dim);
        else
          float_row_to_half_avx512(static_cast<uint16_t*>(row), x, dim);
      } else if (kHasF16C) {  // the grid values, then an exact hardware conversion
        if (r != nullptr) half_stochastic_grid_row(x, r, dim);
        float_row_to_half_f16c(static_cast<uint16_t*>(row), x, dim);
      } else if (r != nullptr) {
        float_row_to_half_stochastic(static_cast<uint16_t*>(row), x, r, dim);
      } else {
        float_row_to_half(static_cast<uint16_t*>(row), x, dim);
      }
      break;
    case Storage::kBFloat16:
      if (r != nullptr)
        float_row_to_bf16_stochastic(static_cast<uint16_t*>(row), x, r, dim);
      else
        float_row_to_bf16(static_cast<uint16_t*>(row), x, dim);
      break;
  }
}

inline const char* storage_name(Storage s) {
  return s == Storage::kFloat ? "float32" : s == Storage::kHalf ? "float16" : "bfloat16";
}
inline at::ScalarType storage_scalar_type(Storage s) {
  return s == Storage::kFloat ? at::kFloat : s == Storage::kHalf ? at::kHalf : at::kBFloat16;
}
enum class Init : int64_t { kUniform = 0, kNormal = 1, kTruncatedNormal = 2, kConstant = 3 };
enum class Optim : int64_t {
  kSgd = 0,
  kAdagrad = 1,
  kRowwiseAdagrad = 2,
  kAdam = 3,
  kAdamW = 4,
  kFtrl = 5
};

void check_long_1d(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.dim() == 1 && t.scalar_type() == at::kLong && t.is_contiguous(), op, ": ", name,
              " must be a contiguous 1-D int64 tensor, got ", t.scalar_type(), " of shape ",
              t.sizes());
}

void check_weights(const char* op, const at::Tensor& weights) {
  TORCH_CHECK(weights.dim() == 1 && weights.scalar_type() == at::kFloat && weights.is_contiguous(),
              op, ": weights must be a contiguous 1-D float32 buffer, got ", weights.scalar_type(),
              " of shape ", weights.sizes());
}

// The tables' storage dtypes (all float32 when not given).
std::vector<Storage> table_storage(const char* op, const std::optional<at::Tensor>& table_dtypes,
                                   int64_t T) {
  std::vector<Storage> out(T, Storage::kFloat);
  if (!table_dtypes.has_value()) return out;
  const at::Tensor codes = table_dtypes->contiguous();
  check_long_1d(op, "table_dtypes", codes);
  TORCH_CHECK(codes.numel() == T, op, ": table_dtypes must have one entry per table (", T,
              "), got ", codes.numel());
  const int64_t* c = codes.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(c[t] >= 0 && c[t] <= 2, op, ": table_dtypes[", t, "] = ", c[t],
                " is not a storage dtype (0 float32, 1 float16, 2 bfloat16)");
    out[t] = static_cast<Storage>(c[t]);
  }
  return out;
}

// Per-table capacities from the flat layout; checks that the tables tile the buffer in order,
// each spanning exactly the words of its rows.
std::vector<int64_t> table_capacities(const char* op, const at::Tensor& weights,
                                      const at::Tensor& table_offsets, const at::Tensor& table_dims,
                                      const std::vector<Storage>& storage) {
  check_long_1d(op, "table_offsets", table_offsets);
  check_long_1d(op, "table_dims", table_dims);
  const int64_t T = table_offsets.numel();
  TORCH_CHECK(table_dims.numel() == T, op, ": table_dims must have one entry per table (", T,
              "), got ", table_dims.numel());
  const int64_t* off = table_offsets.data_ptr<int64_t>();
  const int64_t* dim = table_dims.data_ptr<int64_t>();
  std::vector<int64_t> caps(T);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t end = t + 1 < T ? off[t + 1] : weights.numel();
    TORCH_CHECK(dim[t] > 0, op, ": table_dims[", t, "] must be > 0, got ", dim[t]);
    const int64_t row_bytes = dim[t] * storage_bytes(storage[t]);
    const int64_t cap = off[t] >= 0 && end >= off[t] ? (end - off[t]) * 4 / row_bytes : -1;
    TORCH_CHECK(
        cap >= 0 && end <= weights.numel() && table_words(cap, dim[t], storage[t]) == end - off[t],
        op, ": table ", t, " spans words [", off[t], ", ", end, ") of a buffer of ",
        weights.numel(), ", not the words of a whole number of rows of dim ", dim[t], " in ",
        storage_name(storage[t]));
    caps[t] = cap;
  }
  return caps;
}

// Where each table's rows start, as bytes.
std::vector<char*> table_bases(const at::Tensor& weights, const at::Tensor& table_offsets) {
  char* w = reinterpret_cast<char*>(weights.data_ptr<float>());
  const int64_t* off = table_offsets.data_ptr<int64_t>();
  std::vector<char*> out(table_offsets.numel());
  for (size_t t = 0; t < out.size(); ++t) out[t] = w + off[t] * 4;
  return out;
}

void check_rows_in_tables(const char* op, const int64_t* rows, const int64_t* table_of_row,
                          int64_t n, const std::vector<int64_t>& caps) {
  for (int64_t i = 0; i < n; ++i) {
    const int64_t t = table_of_row[i];
    TORCH_CHECK(t >= 0 && t < static_cast<int64_t>(caps.size()), op, ": table index ", t,
                " out of range [0, ", caps.size(), ")");
    TORCH_CHECK(rows[i] >= -1 && rows[i] < caps[t], op, ": row ", rows[i], " out of range [-1, ",
                caps[t], ") of table ", t);
  }
}

// ------------------------------------------------------------------------------------ dedup

// Open addressing over a power-of-two array at most half full; each slot holds a unique index
// (-1 = empty) and the id, so a probe touches one cache line.
struct DedupSlot {
  int64_t id;
  int64_t index;
};

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> dedup_segments_cpu(
    const at::Tensor& ids_in, const at::Tensor& segment_offsets_in) {
  const char* op = "dedup_segments";
  TORCH_CHECK(ids_in.dim() == 1 && ids_in.scalar_type() == at::kLong, op,
              ": ids must be a 1-D int64 tensor, got ", ids_in.scalar_type(), " of shape ",
              ids_in.sizes());
  const at::Tensor ids = ids_in.contiguous();
  const at::Tensor seg = segment_offsets_in.contiguous();
  check_long_1d(op, "segment_offsets", seg);
  TORCH_CHECK(seg.numel() >= 1, op, ": segment_offsets needs at least one entry");
  const int64_t S = seg.numel() - 1;
  const int64_t n = ids.numel();
  const int64_t* so = seg.data_ptr<int64_t>();
  TORCH_CHECK(so[0] == 0 && so[S] == n, op,
              ": segment_offsets must run from 0 to the number of ids (", n, "), got ", so[0],
              " .. ", so[S]);
  for (int64_t s = 0; s < S; ++s)
    TORCH_CHECK(so[s] <= so[s + 1], op, ": segment_offsets must be non-decreasing, got ", so[s],
                " then ", so[s + 1]);

  const int64_t* id = ids.data_ptr<int64_t>();
  at::Tensor inverse = at::empty({n}, ids.options());
  at::Tensor local_unique = at::empty({n}, ids.options());  // segment s's uniques at [so[s], ...)
  at::Tensor local_count = at::zeros({n}, ids.options());
  std::vector<int64_t> num_unique(S, 0);
  int64_t* inv = inverse.data_ptr<int64_t>();
  int64_t* lu = local_unique.data_ptr<int64_t>();
  int64_t* lc = local_count.data_ptr<int64_t>();

  at::parallel_for(0, S, 1, [&](int64_t begin, int64_t end) {
    std::vector<DedupSlot> slots;
    for (int64_t s = begin; s < end; ++s) {
      const int64_t base = so[s], len = so[s + 1] - so[s];
      uint64_t size = 16;
      while (size < 2 * static_cast<uint64_t>(len)) size <<= 1;
      slots.assign(size, DedupSlot{0, -1});
      const uint64_t mask = size - 1;
      int64_t count = 0;
      for (int64_t i = 0; i < len; ++i) {
        const int64_t key = id[base + i];
        uint64_t pos = fmix64(static_cast<uint64_t>(key)) & mask;
        while (slots[pos].index >= 0 && slots[pos].id != key) pos = (pos + 1) & mask;
        if (slots[pos].index < 0) {
          slots[pos] = DedupSlot{key, count};
          lu[base + count] = key;
          ++count;
        }
        const int64_t u = slots[pos].index;
        inv[base + i] = u;  // local index for now; made global below
        ++lc[base + u];
      }
      num_unique[s] = count;
    }
  });

  at::Tensor unique_offsets = at::empty({S + 1}, ids.options());
  int64_t* uo = unique_offsets.data_ptr<int64_t>();
  uo[0] = 0;
  for (int64_t s = 0; s < S; ++s) uo[s + 1] = uo[s] + num_unique[s];
  at::Tensor unique = at::empty({uo[S]}, ids.options());
  at::Tensor counts = at::empty({uo[S]}, ids.options());
  int64_t* uq = unique.data_ptr<int64_t>();
  int64_t* ct = counts.data_ptr<int64_t>();
  at::parallel_for(0, S, 1, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) {
      std::copy(lu + so[s], lu + so[s] + num_unique[s], uq + uo[s]);
      std::copy(lc + so[s], lc + so[s] + num_unique[s], ct + uo[s]);
      for (int64_t i = so[s]; i < so[s + 1]; ++i) inv[i] += uo[s];
    }
  });
  return {unique, inverse, counts, unique_offsets};
}

// ---------------------------------------------------------------------------- initial rows

inline uint64_t row_key(int64_t id, uint64_t seed) {
  return fmix64(static_cast<uint64_t>(id) ^ seed);
}

// 64 random bits for elements 2p and 2p+1 of a row (one hash feeds two elements).
inline uint64_t pair_bits(uint64_t key, int64_t pair, int64_t attempt) {
  const uint64_t counter = (static_cast<uint64_t>(attempt) << 32) + static_cast<uint64_t>(pair) + 1;
  return fmix64(key + counter * kGolden);
}

// Box-Muller on the two halves of `bits`: two independent standard normals.
inline void box_muller(uint64_t bits, double* z0, double* z1) {
  const double u1 = (static_cast<double>(bits >> 32) + 0.5) * 0x1p-32;
  const double u2 = static_cast<double>(bits & 0xFFFFFFFFull) * 0x1p-32;
  const double r = std::sqrt(-2.0 * std::log(u1));
  *z0 = r * std::cos(2.0 * M_PI * u2);
  *z1 = r * std::sin(2.0 * M_PI * u2);
}

// The default initializer, on every new row: written so the compiler vectorises the hashes
// (64-bit multiplies need AVX-512DQ, hence the x86-64-v4 clone).
TREXT_VECTOR_CLONES
void uniform_vector(float* out, int64_t dim, uint64_t key, double low, double span,
                    int64_t first_pair) {
  const int64_t pairs = dim / 2;
  for (int64_t q = 0; q < pairs; ++q) {
    const uint64_t bits = fmix64(key + static_cast<uint64_t>(first_pair + q + 1) * kGolden);
    out[2 * q] = static_cast<float>(low + span * (static_cast<double>(bits >> 40) * 0x1p-24));
    out[2 * q + 1] = static_cast<float>(
        low + span * (static_cast<double>((bits & 0xFFFFFFFFull) >> 8) * 0x1p-24));
  }
  if (dim % 2) {
    const uint64_t bits = pair_bits(key, first_pair + pairs, 0);
    out[dim - 1] = static_cast<float>(low + span * (static_cast<double>(bits >> 40) * 0x1p-24));
  }
}

// Elements first_column .. of the id's vector: a column shard of a table draws its columns
// of the whole table's vectors.
void init_vector(float* out, int64_t dim, uint64_t key, Init init, at::ArrayRef<double> p,
                 int64_t first_column) {
  if (init == Init::kConstant) {
    std::fill(out, out + dim, static_cast<float>(p[0]));
    return;
  }
  if (first_column % 2) {
    // One hash feeds two elements: draw from the pair holding the first column and drop the
    // pair's first element (every element is a function of its pair alone, so this is exact).
    thread_local std::vector<float> wide;
    wide.resize(dim + 1);
    init_vector(wide.data(), dim + 1, key, init, p, first_column - 1);
    std::copy(wide.begin() + 1, wide.end(), out);
    return;
  }
  const int64_t first_pair = first_column / 2;
  if (init == Init::kUniform) {
    uniform_vector(out, dim, key, p[0], p[1] - p[0], first_pair);
    return;
  }
  for (int64_t j = 0; j < dim; j += 2) {
    double z[2];
    box_muller(pair_bits(key, first_pair + j / 2, 0), &z[0], &z[1]);
    for (int64_t e = 0; e < 2 && j + e < dim; ++e) {
      double v = p[0] + p[1] * z[e];
      if (init == Init::kTruncatedNormal) {
        // Redraw out-of-range elements from the pair's next attempts; clamp after the last.
        for (int attempt = 1; attempt < kTruncNormalAttempts && (v < p[2] || v > p[3]); ++attempt) {
          double r[2];
          box_muller(pair_bits(key, first_pair + j / 2, attempt), &r[0], &r[1]);
          v = p[0] + p[1] * r[e];
        }
        v = std::min(std::max(v, p[2]), p[3]);
      }
      out[j + e] = static_cast<float>(v);
    }
  }
}

// Fills a row that will not be read again this step (optimizer state, read at backward) with
// non-temporal stores where it is 16-byte aligned: no read-for-ownership of lines about to be
// overwritten, and no eviction of the rows the lookup is about to read.
void fill_streaming(float* row, int64_t width, float value) {
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
void copy_streaming(float* dst, const float* src, int64_t width) {
#if defined(__SSE2__)
  if (reinterpret_cast<uintptr_t>(dst) % 16 == 0 && width % 4 == 0) {
    for (int64_t j = 0; j < width; j += 4) _mm_stream_ps(dst + j, _mm_loadu_ps(src + j));
    return;
  }
#endif
  std::copy(src, src + width, dst);
}

// The same for a row of any dtype, `bytes` long.
void copy_streaming_bytes(void* dst, const void* src, int64_t bytes) {
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

// Writes the initial vector of ids[i] into row rows[i] of `table` ([capacity, dim]) for every
// i with rows[i] >= 0 (a pure function of seed, id, element; see reference.init_vectors), and
// resets those rows of each optimizer state ([capacity, width]) to its initial value.
void init_rows_cpu(const at::Tensor& table, const at::Tensor& rows_in, const at::Tensor& ids_in,
                   int64_t seed, int64_t kind, at::ArrayRef<double> params, at::TensorList states,
                   at::ArrayRef<double> state_values) {
  const char* op = "init_rows";
  const at::ScalarType st = table.scalar_type();
  TORCH_CHECK(table.dim() == 2 && (st == at::kFloat || st == at::kHalf || st == at::kBFloat16) &&
                  table.is_contiguous(),
              op, ": table must be a contiguous 2-D float32, float16 or bfloat16 tensor, got ", st,
              " of shape ", table.sizes());
  // Half tables take the initial vector rounded to nearest even (a pure function still).
  const Storage storage = st == at::kFloat  ? Storage::kFloat
                          : st == at::kHalf ? Storage::kHalf
                                            : Storage::kBFloat16;
  const at::Tensor rows = rows_in.contiguous(), ids = ids_in.contiguous();
  check_long_1d(op, "rows", rows);
  check_long_1d(op, "ids", ids);
  TORCH_CHECK(rows.numel() == ids.numel(), op, ": rows and ids must have the same length, got ",
              rows.numel(), " and ", ids.numel());
  TORCH_CHECK(kind >= 0 && kind <= 3, op, ": unknown initializer kind ", kind);
  const size_t need = kind == 3 ? 1 : kind == 2 ? 4 : 2;
  TORCH_CHECK(params.size() == need || params.size() == need + 1, op, ": initializer kind ", kind,
              " needs ", need, " parameters (and optionally the first column), got ",
              params.size());
  // An optional last parameter: the table's first column in the whole table's vectors (a
  // column shard's).
  const double first_value = params.size() > need ? params[need] : 0.0;
  TORCH_CHECK(first_value >= 0 && first_value == std::floor(first_value) && first_value < 0x1p62,
              op, ": the first column must be an integer >= 0, got ", first_value);
  const int64_t first_column = static_cast<int64_t>(first_value);
  const int64_t cap = table.size(0), dim = table.size(1), n = rows.numel();
  TORCH_CHECK(state_values.size() == states.size(), op, ": one state value per state, got ",
              state_values.size(), " values for ", states.size(), " states");
  for (const at::Tensor& s : states)
    TORCH_CHECK(
        s.dim() == 2 && s.size(0) == cap && s.scalar_type() == at::kFloat && s.is_contiguous(), op,
        ": optimizer states must be contiguous float32 [", cap, ", width] tensors, got ",
        s.sizes());
  const int64_t* r = rows.data_ptr<int64_t>();
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(r[i] >= -1 && r[i] < cap, op, ": row ", r[i], " out of range [-1, ", cap, ")");
  char* w = static_cast<char*>(table.data_ptr());
  const int64_t row_bytes = dim * storage_bytes(storage);
  const Init init = static_cast<Init>(kind);
  const uint64_t s = static_cast<uint64_t>(seed);
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(storage == Storage::kFloat ? 0 : dim);
    for (int64_t i = begin; i < end; ++i) {
      // New rows are scattered over the table: start fetching a few rows ahead for writing.
      const int64_t ahead = i + kPrefetchDistance;
      if (ahead < end && r[ahead] >= 0)
        prefetch_row(w + r[ahead] * row_bytes, row_bytes, 1);  // states are streamed
      if (r[i] < 0) continue;
      if (storage == Storage::kFloat) {
        init_vector(reinterpret_cast<float*>(w + r[i] * row_bytes), dim, row_key(id[i], s), init,
                    params, first_column);
      } else {
        init_vector(scratch.data(), dim, row_key(id[i], s), init, params, first_column);
        store_row(w + r[i] * row_bytes, scratch.data(), storage, dim, nullptr);
      }
      for (size_t k = 0; k < states.size(); ++k) {
        const int64_t width = states[k].size(1);
        float* row = states[k].data_ptr<float>() + r[i] * width;
        fill_streaming(row, width, static_cast<float>(state_values[k]));
      }
    }
#if defined(__SSE2__)
    _mm_sfence();  // streamed stores visible before the op returns
#endif
  });
}

// ------------------------------------------------------------------------------- lookups

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

NewVectors check_new_vectors(const char* op, at::TensorList new_vectors, const int64_t* dims,
                             int64_t T, const std::vector<Storage>& storage) {
  NewVectors nv;
  if (new_vectors.empty()) return nv;
  TORCH_CHECK(static_cast<int64_t>(new_vectors.size()) == T, op,
              ": new_vectors must have one block per table (", T, "), got ", new_vectors.size());
  for (int64_t t = 0; t < T; ++t) {
    const at::Tensor& v = new_vectors[t];
    const at::ScalarType want = storage_scalar_type(storage[t]);
    TORCH_CHECK(
        v.dim() == 2 && v.size(1) == dims[t] && v.scalar_type() == want && v.is_contiguous(), op,
        ": new_vectors[", t, "] must be a contiguous ", storage_name(storage[t]), " [n, ", dims[t],
        "] tensor (its table's dtype), got ", v.scalar_type(), " of shape ", v.sizes());
    nv.data.push_back(static_cast<const char*>(v.data_ptr()));
    nv.count.push_back(v.size(0));
  }
  return nv;
}

// Row r of id i in table t must be -1 (no row), in [0, capacity), or name a new vector of t.
inline void check_lookup_row(const char* op, int64_t r, int64_t i, int64_t cap,
                             const NewVectors& nv, int64_t t) {
  TORCH_CHECK(
      (r >= -1 && r < cap) || (r <= -2 && !nv.empty() && -2 - r < nv.count[t]), op, ": row ", r,
      " of id ", i, " out of range [-1, ", cap, ") of table ", t,
      nv.empty() ? "" : " (or a new vector: -2 - j for j below the table's new_vectors count)");
}

struct FeatureLayout {
  const int64_t* table;
  const int64_t* col;
  const bool* mean;
  int64_t count;
};

FeatureLayout check_features(const char* op, const at::Tensor& feature_table,
                             const at::Tensor& feature_col, const at::Tensor& feature_mean,
                             int64_t num_tables, const int64_t* table_dims, int64_t total_dim) {
  check_long_1d(op, "feature_table", feature_table);
  check_long_1d(op, "feature_col", feature_col);
  const int64_t F = feature_table.numel();
  TORCH_CHECK(feature_col.numel() == F && feature_mean.numel() == F &&
                  feature_mean.scalar_type() == at::kBool && feature_mean.is_contiguous(),
              op, ": feature_col and feature_mean (bool) must have one entry per feature (", F,
              ")");
  const int64_t* ft = feature_table.data_ptr<int64_t>();
  const int64_t* fc = feature_col.data_ptr<int64_t>();
  for (int64_t f = 0; f < F; ++f) {
    TORCH_CHECK(ft[f] >= 0 && ft[f] < num_tables, op, ": feature_table[", f, "] = ", ft[f],
                " is not a table in [0, ", num_tables, ")");
    TORCH_CHECK(fc[f] >= 0 && fc[f] + table_dims[ft[f]] <= total_dim, op, ": feature ", f,
                "'s columns [", fc[f], ", ", fc[f] + table_dims[ft[f]], ") exceed total_dim ",
                total_dim);
  }
  return {ft, fc, feature_mean.data_ptr<bool>(), F};
}

void check_bags(const char* op, const at::Tensor& offsets, int64_t num_bags, int64_t num_values) {
  check_long_1d(op, "offsets", offsets);
  TORCH_CHECK(offsets.numel() == num_bags + 1, op,
              ": offsets must have num_features * batch_size + 1 = ", num_bags + 1,
              " entries, got ", offsets.numel());
  const int64_t* o = offsets.data_ptr<int64_t>();
  TORCH_CHECK(o[0] == 0 && o[num_bags] == num_values, op,
              ": offsets must run from 0 to the number of ids (", num_values, "), got ", o[0],
              " .. ", o[num_bags]);
  for (int64_t g = 0; g < num_bags; ++g)
    TORCH_CHECK(o[g] <= o[g + 1], op, ": offsets must be non-decreasing (bag ", g, " has length ",
                o[g + 1] - o[g], ")");
}

const float* check_per_sample_weights(const char* op, const std::optional<at::Tensor>& psw,
                                      int64_t num_values, at::Tensor& holder) {
  if (!psw.has_value()) return nullptr;
  holder = psw->contiguous();
  TORCH_CHECK(
      holder.dim() == 1 && holder.scalar_type() == at::kFloat && holder.numel() == num_values, op,
      ": per_sample_weights must be a 1-D float32 tensor with one weight per id (", num_values,
      "), got ", holder.scalar_type(), " of shape ", holder.sizes());
  return holder.data_ptr<float>();
}

at::Tensor pooled_lookup_cpu(const at::Tensor& weights, const at::Tensor& table_offsets,
                             const at::Tensor& table_dims, const at::Tensor& feature_table,
                             const at::Tensor& feature_col, const at::Tensor& feature_mean,
                             const at::Tensor& rows_in, const at::Tensor& offsets_in,
                             const std::optional<at::Tensor>& per_sample_weights,
                             int64_t batch_size, int64_t total_dim, at::TensorList new_vectors,
                             const std::optional<at::Tensor>& table_dtypes) {
  const char* op = "pooled_lookup";
  check_weights(op, weights);
  const std::vector<Storage> storage = table_storage(op, table_dtypes, table_offsets.numel());
  const std::vector<int64_t> caps =
      table_capacities(op, weights, table_offsets, table_dims, storage);
  const int64_t* dims = table_dims.data_ptr<int64_t>();
  TORCH_CHECK(batch_size >= 0 && total_dim >= 0, op,
              ": batch_size and total_dim must be >= 0, got ", batch_size, " and ", total_dim);
  const FeatureLayout fl =
      check_features(op, feature_table, feature_col, feature_mean, caps.size(), dims, total_dim);
  const NewVectors nv = check_new_vectors(op, new_vectors, dims, caps.size(), storage);
  const at::Tensor rows = rows_in.contiguous(), offsets = offsets_in.contiguous();
  check_long_1d(op, "rows", rows);
  const int64_t n = rows.numel(), num_bags = fl.count * batch_size;
  check_bags(op, offsets, num_bags, n);
  at::Tensor psw_holder;
  const float* psw = check_per_sample_weights(op, per_sample_weights, n, psw_holder);
  const int64_t* r = rows.data_ptr<int64_t>();
  const int64_t* o = offsets.data_ptr<int64_t>();
  for (int64_t f = 0; f < fl.count; ++f)
    for (int64_t i = o[f * batch_size]; i < o[(f + 1) * batch_size]; ++i)
      check_lookup_row(op, r[i], i, caps[fl.table[f]], nv, fl.table[f]);

  at::Tensor out = at::empty({batch_size, total_dim}, weights.options());
  float* y = out.data_ptr<float>();
  const std::vector<char*> bases = table_bases(weights, table_offsets);
  // Columns no feature writes (none, when the caller tiles total_dim) stay zero.
  int64_t covered = 0;
  for (int64_t f = 0; f < fl.count; ++f) covered += dims[fl.table[f]];
  if (covered != total_dim) out.zero_();
  std::vector<int64_t> feature_end(fl.count);
  for (int64_t f = 0; f < fl.count; ++f) feature_end[f] = o[(f + 1) * batch_size];
  at::parallel_for(0, num_bags, 64, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t f = g / batch_size, b = g % batch_size, t = fl.table[f], dim = dims[t];
      float* acc = y + b * total_dim + fl.col[f];
      const char* base = bases[t];
      const Storage st = storage[t];
      const int64_t row_bytes = dim * storage_bytes(st);
      for (int64_t d = 0; d < dim; ++d) acc[d] = 0.f;
      for (int64_t i = o[g]; i < o[g + 1]; ++i) {
        // Rows are scattered: fetch a few ids ahead, across bag ends, within this feature.
        const int64_t ahead = i + kPrefetchDistance;
        if (ahead < feature_end[f] && r[ahead] >= 0)
          prefetch_row(base + r[ahead] * row_bytes, row_bytes);
        if (r[i] == -1) continue;
        add_scaled_row(acc, nv.source(base, t, r[i], row_bytes), st, psw != nullptr ? psw[i] : 1.f,
                       dim);
      }
      const int64_t len = o[g + 1] - o[g];
      if (fl.mean[f] && len > 0) {
        const float scale = 1.f / static_cast<float>(len);
        for (int64_t d = 0; d < dim; ++d) acc[d] *= scale;
      }
    }
  });
  return out;
}

at::Tensor sequence_lookup_cpu(const at::Tensor& weights, const at::Tensor& table_offsets,
                               int64_t dim, const at::Tensor& feature_table,
                               const at::Tensor& feature_value_offsets_in,
                               const at::Tensor& rows_in, at::TensorList new_vectors,
                               const std::optional<at::Tensor>& table_dtypes) {
  const char* op = "sequence_lookup";
  check_weights(op, weights);
  TORCH_CHECK(dim > 0, op, ": dim must be > 0, got ", dim);
  const at::Tensor dims = at::full({table_offsets.numel()}, dim, table_offsets.options());
  const std::vector<Storage> storage = table_storage(op, table_dtypes, table_offsets.numel());
  const std::vector<int64_t> caps = table_capacities(op, weights, table_offsets, dims, storage);
  const NewVectors nv =
      check_new_vectors(op, new_vectors, dims.data_ptr<int64_t>(), caps.size(), storage);
  check_long_1d(op, "feature_table", feature_table);
  const at::Tensor rows = rows_in.contiguous(), fvo = feature_value_offsets_in.contiguous();
  check_long_1d(op, "rows", rows);
  check_long_1d(op, "feature_value_offsets", fvo);
  const int64_t F = feature_table.numel(), n = rows.numel();
  TORCH_CHECK(fvo.numel() == F + 1, op,
              ": feature_value_offsets must have num_features + 1 = ", F + 1, " entries, got ",
              fvo.numel());
  const int64_t* fo = fvo.data_ptr<int64_t>();
  const int64_t* ft = feature_table.data_ptr<int64_t>();
  const int64_t* r = rows.data_ptr<int64_t>();
  TORCH_CHECK(fo[0] == 0 && fo[F] == n, op,
              ": feature_value_offsets must run from 0 to the number of ids (", n, "), got ", fo[0],
              " .. ", fo[F]);
  for (int64_t f = 0; f < F; ++f) {
    TORCH_CHECK(fo[f] <= fo[f + 1], op, ": feature_value_offsets must be non-decreasing");
    TORCH_CHECK(ft[f] >= 0 && ft[f] < static_cast<int64_t>(caps.size()), op, ": feature_table[", f,
                "] = ", ft[f], " is not a table");
    for (int64_t i = fo[f]; i < fo[f + 1]; ++i)
      check_lookup_row(op, r[i], i, caps[ft[f]], nv, ft[f]);
  }
  at::Tensor out = at::empty({n, dim}, weights.options());
  float* y = out.data_ptr<float>();
  const std::vector<char*> bases = table_bases(weights, table_offsets);
  for (int64_t f = 0; f < F; ++f) {
    const int64_t t = ft[f];
    const char* base = bases[t];
    const Storage st = storage[t];
    const int64_t row_bytes = dim * storage_bytes(st);
    at::parallel_for(fo[f], fo[f + 1], 256, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        float* dst = y + i * dim;
        if (r[i] == -1) {
          std::fill(dst, dst + dim, 0.f);
        } else {
          load_row(dst, nv.source(base, t, r[i], row_bytes), st, dim);
        }
      }
    });
  }
  return out;
}

// ------------------------------------------------------------------- backward + optimizer

// Scalars derived once per call, in double and then rounded, as torch.optim does with its
// Python-float step sizes.
struct Hyper {
  float lr, eps, beta1, beta2, weight_decay;
  float clr;                         // Adagrad kinds: lr / (1 + (step - 1) * lr_decay)
  float step_size;                   // Adam kinds: lr / (1 - beta1^step)
  float bc2_sqrt;                    // Adam kinds: sqrt(1 - beta2^step)
  float decay;                       // AdamW: 1 - lr * weight_decay
  float lr_power, l1, two_l2, beta;  // FTRL
};

// Adam's moments and step (AdamW's too, after its decay), as torch.optim.Adam orders them.
TREXT_VECTOR_CLONES
void adam_step(const Hyper& h, float* w, const float* g, float* m, float* v, int64_t dim) {
  const float step_size = h.step_size, bc2_sqrt = h.bc2_sqrt;
  for (int64_t d = 0; d < dim; ++d) {
    m[d] += (1.f - h.beta1) * (g[d] - m[d]);  // torch.lerp for weights < 0.5
    v[d] = h.beta2 * v[d] + (1.f - h.beta2) * g[d] * g[d];
    w[d] -= step_size * m[d] / (std::sqrt(v[d]) / bc2_sqrt + h.eps);
  }
}

// FTRL-Proximal (TensorFlow's ApplyFtrl, see reference.ftrl_step) on accumulator n and linear z.
// n^-lr_power is a square root for the default lr_power = -0.5, as TensorFlow computes it.
template <bool kSqrt>
inline void ftrl_loop(const Hyper& h, float* w, const float* g, float* n, float* z, int64_t dim) {
  for (int64_t d = 0; d < dim; ++d) {
    const float n_new = n[d] + g[d] * g[d];
    const float p_new = kSqrt ? std::sqrt(n_new) : std::pow(n_new, -h.lr_power);
    const float p_old = kSqrt ? std::sqrt(n[d]) : std::pow(n[d], -h.lr_power);
    const float sigma = (p_new - p_old) / h.lr;
    const float zd = z[d] + (g[d] - sigma * w[d]);
    z[d] = zd;
    n[d] = n_new;
    const float quadratic = (p_new + h.beta) / h.lr + h.two_l2;
    w[d] = std::fabs(zd) > h.l1 ? (std::copysign(h.l1, zd) - zd) / quadratic : 0.f;
  }
}

TREXT_VECTOR_CLONES
void ftrl_step(const Hyper& h, float* w, const float* g, float* n, float* z, int64_t dim) {
  if (h.lr_power == -0.5f)
    ftrl_loop<true>(h, w, g, n, z, dim);
  else
    ftrl_loop<false>(h, w, g, n, z, dim);
}

// One optimizer step on a row of `dim` floats with gradient g (modified in place).
TREXT_VECTOR_CLONES
void apply_step(Optim kind, const Hyper& h, float* w, float* g, float* s0, float* s1, int64_t dim) {
  // torch's coupled (L2) decay; AdamW decays the weight itself, FTRL has none.
  if (h.weight_decay != 0.f && kind != Optim::kAdamW && kind != Optim::kFtrl)
    for (int64_t d = 0; d < dim; ++d) g[d] += h.weight_decay * w[d];
  switch (kind) {
    case Optim::kSgd:
      for (int64_t d = 0; d < dim; ++d) w[d] -= h.lr * g[d];
      break;
    case Optim::kAdagrad: {
      const float clr = h.clr;
      for (int64_t d = 0; d < dim; ++d) {
        s0[d] += g[d] * g[d];
        w[d] -= clr * g[d] / (std::sqrt(s0[d]) + h.eps);
      }
      break;
    }
    case Optim::kRowwiseAdagrad: {
      float sq = 0.f;
      for (int64_t d = 0; d < dim; ++d) sq += g[d] * g[d];
      *s0 += sq / static_cast<float>(dim);
      const float clr = h.clr;
      const float denom = std::sqrt(*s0) + h.eps;
      for (int64_t d = 0; d < dim; ++d) w[d] -= clr * g[d] / denom;
      break;
    }
    case Optim::kAdam:
      adam_step(h, w, g, s0, s1, dim);
      break;
    case Optim::kAdamW:
      for (int64_t d = 0; d < dim; ++d) w[d] *= h.decay;
      adam_step(h, w, g, s0, s1, dim);
      break;
    case Optim::kFtrl:
      ftrl_step(h, w, g, s0, s1, dim);
      break;
  }
}

void fused_update_cpu(const at::Tensor& grad_in, const at::Tensor& weights, at::TensorList states,
                      const at::Tensor& table_offsets, const at::Tensor& table_dims,
                      const at::Tensor& state_row_offsets, const at::Tensor& unique_rows_in,
                      const at::Tensor& unique_table_in, const at::Tensor& inverse_in,
                      const std::optional<at::Tensor>& offsets_opt,
                      const std::optional<at::Tensor>& per_sample_weights,
                      const at::Tensor& feature_col, const at::Tensor& feature_mean,
                      int64_t batch_size, int64_t optimizer, at::ArrayRef<double> hparams,
                      int64_t step, at::TensorList new_vectors,
                      const std::optional<at::Tensor>& unique_new_opt,
                      at::ArrayRef<double> state_init,
                      const std::optional<at::Tensor>& table_dtypes,
                      const std::optional<at::Tensor>& unique_ids_opt,
                      const std::optional<at::Tensor>& rounding_seeds_opt) {
  const char* op = "fused_update";
  check_weights(op, weights);
  const std::vector<Storage> storage = table_storage(op, table_dtypes, table_offsets.numel());
  const std::vector<int64_t> caps =
      table_capacities(op, weights, table_offsets, table_dims, storage);
  const int64_t T = caps.size();
  const int64_t* dims = table_dims.data_ptr<int64_t>();
  // Element-wise optimizer state: the tables' [capacity, dim] back to back.
  std::vector<int64_t> soff(T + 1, 0);
  for (int64_t t = 0; t < T; ++t) soff[t + 1] = soff[t] + caps[t] * dims[t];
  TORCH_CHECK(optimizer >= 0 && optimizer <= 5, op, ": unknown optimizer id ", optimizer);
  TORCH_CHECK(hparams.size() == 6 || hparams.size() == 10, op,
              ": hparams must be (lr, eps, beta1, beta2, weight_decay, lr_decay[, lr_power, l1, "
              "l2, beta]), got ",
              hparams.size(), " values");
  TORCH_CHECK(step >= 1, op, ": step must be >= 1, got ", step);
  const Optim kind = static_cast<Optim>(optimizer);
  TORCH_CHECK(kind != Optim::kFtrl || (hparams.size() == 10 && hparams[0] > 0 && hparams[6] <= 0),
              op,
              ": ftrl needs hparams (..., lr_power, l1, l2, beta) with lr > 0 and lr_power <= 0");
  const size_t want_states = kind == Optim::kSgd                                           ? 0
                             : (kind == Optim::kAdagrad || kind == Optim::kRowwiseAdagrad) ? 1
                                                                                           : 2;
  TORCH_CHECK(states.size() == want_states, op, ": optimizer ", optimizer, " needs ", want_states,
              " state buffers, got ", states.size());
  check_long_1d(op, "state_row_offsets", state_row_offsets);
  TORCH_CHECK(state_row_offsets.numel() == T, op,
              ": state_row_offsets must have one entry per table");
  const int64_t* sro = state_row_offsets.data_ptr<int64_t>();
  for (const at::Tensor& s : states) {
    TORCH_CHECK(s.dim() == 1 && s.scalar_type() == at::kFloat && s.is_contiguous(), op,
                ": optimizer states must be contiguous 1-D float32 buffers");
    if (kind == Optim::kRowwiseAdagrad) {
      for (int64_t t = 0; t < T; ++t)
        TORCH_CHECK(sro[t] >= 0 && sro[t] + caps[t] <= s.numel(), op, ": row-wise state of table ",
                    t, " [", sro[t], ", ", sro[t] + caps[t], ") exceeds its buffer of ", s.numel());
    } else {
      TORCH_CHECK(s.numel() == soff[T], op,
                  ": element-wise optimizer state must hold every table's rows (", soff[T],
                  " elements), got ", s.numel());
    }
  }
  const at::Tensor unique_rows = unique_rows_in.contiguous(),
                   unique_table = unique_table_in.contiguous();
  const at::Tensor inverse = inverse_in.contiguous();
  check_long_1d(op, "unique_rows", unique_rows);
  check_long_1d(op, "unique_table", unique_table);
  check_long_1d(op, "inverse", inverse);
  const int64_t U = unique_rows.numel(), n = inverse.numel();
  TORCH_CHECK(unique_table.numel() == U, op, ": unique_table must have one entry per unique row");
  const int64_t* ur = unique_rows.data_ptr<int64_t>();
  const int64_t* ut = unique_table.data_ptr<int64_t>();
  const int64_t* inv = inverse.data_ptr<int64_t>();
  check_rows_in_tables(op, ur, ut, U, caps);
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(inv[i] >= 0 && inv[i] < U, op, ": inverse[", i, "] = ", inv[i],
                " out of range [0, ", U, ")");
  // New rows: unique row u with unique_new[u] = j >= 0 first takes vector j of its table's
  // new_vectors block and state_init, then its step.
  const NewVectors nv = check_new_vectors(op, new_vectors, dims, T, storage);
  at::Tensor unique_new;
  const int64_t* un = nullptr;
  if (unique_new_opt.has_value()) {
    unique_new = unique_new_opt->contiguous();
    check_long_1d(op, "unique_new", unique_new);
    TORCH_CHECK(unique_new.numel() == U, op, ": unique_new must have one entry per unique row (", U,
                "), got ", unique_new.numel());
    TORCH_CHECK(!nv.empty(), op, ": unique_new needs new_vectors");
    TORCH_CHECK(state_init.size() == states.size(), op,
                ": state_init must give one initial value per state (", states.size(), "), got ",
                state_init.size());
    un = unique_new.data_ptr<int64_t>();
    for (int64_t u = 0; u < U; ++u)
      TORCH_CHECK(un[u] == -1 || (un[u] >= 0 && un[u] < nv.count[ut[u]] && ur[u] >= 0), op,
                  ": unique_new[", u, "] = ", un[u], " is neither -1 nor a vector of table ", ut[u],
                  "'s new_vectors (", nv.count[ut[u]], ") for a row >= 0");
  }
  int64_t max_dim = 1;
  for (int64_t t = 0; t < T; ++t) max_dim = std::max(max_dim, dims[t]);
  // Stochastic rounding of half tables with a rounding seed: bits from (seed, id, element, step).
  std::vector<uint64_t> sr_seed(T, 0);
  const int64_t* uid = nullptr;
  at::Tensor unique_ids;
  if (rounding_seeds_opt.has_value()) {
    const at::Tensor seeds = rounding_seeds_opt->contiguous();
    check_long_1d(op, "rounding_seeds", seeds);
    TORCH_CHECK(seeds.numel() == T, op, ": rounding_seeds must have one entry per table (", T,
                "), got ", seeds.numel());
    bool any = false;
    for (int64_t t = 0; t < T; ++t) {
      sr_seed[t] =
          storage[t] == Storage::kFloat ? 0 : static_cast<uint64_t>(seeds.data_ptr<int64_t>()[t]);
      any = any || sr_seed[t] != 0;
    }
    if (any) {
      TORCH_CHECK(unique_ids_opt.has_value(), op,
                  ": stochastic rounding (a non-zero rounding seed) needs unique_ids");
      unique_ids = unique_ids_opt->contiguous();
      check_long_1d(op, "unique_ids", unique_ids);
      TORCH_CHECK(unique_ids.numel() == U, op, ": unique_ids must have one entry per unique row (",
                  U, "), got ", unique_ids.numel());
      uid = unique_ids.data_ptr<int64_t>();
    }
  }
  const std::vector<char*> bases = table_bases(weights, table_offsets);

  TORCH_CHECK(grad_in.dim() == 2 && grad_in.scalar_type() == at::kFloat, op,
              ": grad must be a 2-D float32 tensor, got ", grad_in.scalar_type(), " of shape ",
              grad_in.sizes());
  // Rows may be strided (even broadcast, stride 0, as the gradient of a sum is); columns must
  // be dense for the vector loops.
  at::Tensor grad = grad_in;
  int64_t grow = grad_in.stride(0);
  if (grad_in.stride(1) != 1 || grad_in.size(0) == 0) {
    if (grad_in.stride(0) == 0 && grad_in.size(0) > 0) {
      grad = grad_in.select(0, 0).contiguous();  // one row broadcast to all: keep it once
      grow = 0;
    } else {
      grad = grad_in.contiguous();
      grow = grad_in.size(1);
    }
  }
  const float* gr = grad.data_ptr<float>();
  const int64_t gcols = grad_in.size(1);

  // Per value: the grad row it reads, its first column and its scale.
  const bool pooled = offsets_opt.has_value();
  std::vector<int64_t> src(n);
  std::vector<float> scale(pooled ? n : 0);
  if (pooled) {
    const at::Tensor offsets = offsets_opt->contiguous();
    const int64_t F = feature_col.numel();
    check_long_1d(op, "feature_col", feature_col);
    TORCH_CHECK(feature_mean.scalar_type() == at::kBool && feature_mean.numel() == F, op,
                ": feature_mean must be a bool tensor with one entry per feature");
    check_bags(op, offsets, F * batch_size, n);
    TORCH_CHECK(grad_in.size(0) == batch_size, op, ": grad must have batch_size = ", batch_size,
                " rows, got ", grad_in.size(0));
    at::Tensor psw_holder;
    const float* psw = check_per_sample_weights(op, per_sample_weights, n, psw_holder);
    const int64_t* o = offsets.data_ptr<int64_t>();
    const int64_t* fc = feature_col.data_ptr<int64_t>();
    const bool* fm = feature_mean.data_ptr<bool>();
    at::parallel_for(0, F * batch_size, 256, [&](int64_t begin, int64_t end) {
      for (int64_t g = begin; g < end; ++g) {
        const int64_t f = g / batch_size, b = g % batch_size, len = o[g + 1] - o[g];
        for (int64_t i = o[g]; i < o[g + 1]; ++i) {
          TORCH_CHECK(fc[f] + dims[ut[inv[i]]] <= gcols, op, ": feature ", f,
                      "'s columns exceed grad's ", gcols);
          src[i] = b * grow + fc[f];
          float s = psw != nullptr ? psw[i] : 1.f;
          if (fm[f]) s = s / static_cast<float>(std::max<int64_t>(len, 1));
          scale[i] = s;
        }
      }
    });
  } else {
    TORCH_CHECK(grad_in.size(0) >= n, op, ": sequence grad must have one row per id (", n,
                "), got ", grad_in.size(0));
    for (int64_t i = 0; i < n; ++i) {
      TORCH_CHECK(dims[ut[inv[i]]] <= gcols, op, ": grad has ", gcols, " columns, table needs ",
                  dims[ut[inv[i]]]);
      src[i] = i * grow;
    }
  }

  // Counting sort of values by unique row (stable: each row sums its values in id order).
  std::vector<int64_t> start(U + 1, 0), order(n);
  for (int64_t i = 0; i < n; ++i) ++start[inv[i] + 1];
  for (int64_t u = 0; u < U; ++u) start[u + 1] += start[u];
  {
    std::vector<int64_t> fill(start.begin(), start.end() - 1);
    for (int64_t i = 0; i < n; ++i) order[fill[inv[i]]++] = i;
  }

  const double lr = hparams[0], beta1 = hparams[2], beta2 = hparams[3], lr_decay = hparams[5];
  const Hyper h{static_cast<float>(lr),
                static_cast<float>(hparams[1]),
                static_cast<float>(beta1),
                static_cast<float>(beta2),
                static_cast<float>(hparams[4]),
                static_cast<float>(lr / (1.0 + static_cast<double>(step - 1) * lr_decay)),
                static_cast<float>(lr / (1.0 - std::pow(beta1, static_cast<double>(step)))),
                static_cast<float>(std::sqrt(1.0 - std::pow(beta2, static_cast<double>(step)))),
                static_cast<float>(1.0 - lr * hparams[4]),
                hparams.size() == 10 ? static_cast<float>(hparams[6]) : 0.f,
                hparams.size() == 10 ? static_cast<float>(hparams[7]) : 0.f,
                hparams.size() == 10 ? static_cast<float>(2.0 * hparams[8]) : 0.f,
                hparams.size() == 10 ? static_cast<float>(hparams[9]) : 0.f};
  float* s0 = want_states > 0 ? states[0].data_ptr<float>() : nullptr;
  float* s1 = want_states > 1 ? states[1].data_ptr<float>() : nullptr;
  const bool rowwise_state = kind == Optim::kRowwiseAdagrad;
  at::parallel_for(0, U, 32, [&](int64_t begin, int64_t end) {
    std::vector<float> g(max_dim), fresh_w(max_dim), fresh_s0(max_dim), fresh_s1(max_dim);
    std::vector<uint16_t> rbits(max_dim), fresh_half(max_dim);
    std::vector<uint64_t> rhash((max_dim + 3) / 4);
    const int64_t n_end = start[end];  // this chunk's values end here
    for (int64_t u = begin; u < end; ++u) {
      // The rows a few unique ids ahead: weights and state are read and written at random
      // (new rows are only written: nothing to fetch).
      const int64_t ahead = u + kPrefetchDistance;
      if (ahead < end && ur[ahead] >= 0 && (un == nullptr || un[ahead] < 0)) {
        const int64_t ta = ut[ahead], dim_a = dims[ta],
                      row_bytes_a = dim_a * storage_bytes(storage[ta]);
        const int64_t selem_a = soff[ta] + ur[ahead] * dim_a;
        prefetch_row(bases[ta] + ur[ahead] * row_bytes_a, row_bytes_a, 1);
        if (s0 != nullptr) {
          if (rowwise_state)
            __builtin_prefetch(s0 + sro[ta] + ur[ahead], 1);
          else
            prefetch_row(s0 + selem_a, dim_a, 1);
        }
        if (s1 != nullptr) prefetch_row(s1 + selem_a, dim_a, 1);
      }
      if (ur[u] < 0) continue;
      const int64_t t = ut[u], dim = dims[t];
      const Storage st = storage[t];
      const int64_t row_bytes = dim * storage_bytes(st);
      std::fill(g.begin(), g.begin() + dim, 0.f);
      for (int64_t k = start[u]; k < start[u + 1]; ++k) {
        // Values are grouped by row, so their gradient rows come in random order: fetch ahead.
        if (k + kPrefetchDistance < n_end)
          prefetch_row(gr + src[order[k + kPrefetchDistance]], dims[ut[u]]);
        const int64_t i = order[k];
        add_scaled(g.data(), gr + src[i], pooled ? scale[i] : 1.f, dim);
      }
      char* row = bases[t] + ur[u] * row_bytes;
      const int64_t selem = soff[t] + ur[u] * dim;
      float* state0 = s0 == nullptr ? nullptr : rowwise_state ? s0 + sro[t] + ur[u] : s0 + selem;
      float* state1 = s1 == nullptr ? nullptr : s1 + selem;
      const uint16_t* r = nullptr;
      if (sr_seed[t] != 0) {
        rounding_bits(rbits.data(), rhash.data(), dim, uid[u], sr_seed[t], step);
        r = rbits.data();
      }
      if (un != nullptr && un[u] >= 0) {
        // A new row: the step runs on its initial vector and state, and the results are
        // streamed to the row (never read from memory).
        load_row(fresh_w.data(), nv.data[t] + un[u] * row_bytes, st, dim);
        const int64_t width0 = rowwise_state ? 1 : dim;
        if (state0 != nullptr)
          std::fill(fresh_s0.begin(), fresh_s0.begin() + width0, static_cast<float>(state_init[0]));
        if (state1 != nullptr)
          std::fill(fresh_s1.begin(), fresh_s1.begin() + dim, static_cast<float>(state_init[1]));
        apply_step(kind, h, fresh_w.data(), g.data(), state0 != nullptr ? fresh_s0.data() : nullptr,
                   state1 != nullptr ? fresh_s1.data() : nullptr, dim);
        if (st == Storage::kFloat) {
          copy_streaming(reinterpret_cast<float*>(row), fresh_w.data(), dim);
        } else {  // rounded into a scratch row, then streamed as the float32 rows are
          store_row(fresh_half.data(), fresh_w.data(), st, dim, r);
          copy_streaming_bytes(row, fresh_half.data(), row_bytes);
        }
        if (state0 != nullptr) copy_streaming(state0, fresh_s0.data(), width0);
        if (state1 != nullptr) copy_streaming(state1, fresh_s1.data(), dim);
        continue;
      }
      if (st == Storage::kFloat) {
        apply_step(kind, h, reinterpret_cast<float*>(row), g.data(), state0, state1, dim);
      } else {  // a half row: stepped in float32, written back rounded
        load_row(fresh_w.data(), row, st, dim);
        apply_step(kind, h, fresh_w.data(), g.data(), state0, state1, dim);
        store_row(row, fresh_w.data(), st, dim, r);
      }
    }
#if defined(__SSE2__)
    _mm_sfence();  // streamed rows visible before the op returns
#endif
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(torchrec_ext, CPU, m) {
  m.impl("dedup_segments", &dedup_segments_cpu);
  m.impl("init_rows", &init_rows_cpu);
  m.impl("pooled_lookup", &pooled_lookup_cpu);
  m.impl("sequence_lookup", &sequence_lookup_cpu);
  m.impl("fused_update", &fused_update_cpu);
}

}  // namespace torchrec_ext
