// Float16 and bfloat16 rows read and written as float32: exact widening, round-to-nearest-even
// and stochastic narrowing, each in a portable loop, an F16C one and an AVX-512 one picked at
// load by what the CPU runs (TORCHREC_EXT_NO_F16C=1 / TORCHREC_EXT_NO_AVX512=1 take the slower
// paths; all give the same bits). Used through row_storage.h's add_scaled_row / load_row /
// store_row by the embedding kernels.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

#if defined(__SSE2__)
#include <immintrin.h>
#endif

#include "hash_table_layout.h"

namespace torchrec_ext {
namespace {

// Row loops (sums, optimizer steps, hashes) compiled twice, for x86-64-v4 (AVX-512) and the
// baseline, the loader picking the one the CPU runs: the wheel stays portable and sqrt/div over
// a 64-float row take 4x fewer instructions where AVX-512 exists.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define TREXT_VECTOR_CLONES __attribute__((target_clones("arch=x86-64-v4", "default")))
#else
#define TREXT_VECTOR_CLONES
#endif

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

// The 16-bit random numbers of a row's elements at one step (reference.rounding_bits): the row's
// key, fmix64(fmix64(id ^ seed) + step * golden), then one hash per 4 elements, element d taking
// bits 16 * (d % 4) of hash d / 4, i.e. (little-endian) the d-th uint16 of the hashes.
constexpr uint64_t kRoundingGolden = 0xD6E8FEB86659FD93ull;
inline uint64_t rounding_key(int64_t id, uint64_t seed, int64_t step) {
  return fmix64(fmix64(static_cast<uint64_t>(id) ^ seed) +
                static_cast<uint64_t>(step) * kRoundingGolden);
}
TREXT_VECTOR_CLONES
void rounding_bits(uint16_t* out, uint64_t* scratch, int64_t dim, uint64_t key) {
  const int64_t groups = (dim + 3) / 4;
  for (int64_t q = 0; q < groups; ++q)
    scratch[q] = fmix64(key + static_cast<uint64_t>(q + 1) * kRoundingGolden);
  static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
                "rounding_bits reads hashes as uint16 lanes");
  std::memcpy(out, scratch, dim * sizeof(uint16_t));
}

// One row's stochastic rounding: its key, and scratch where the paths that read the random
// numbers from memory (portable, F16C) draw them; the AVX-512 paths hash them in registers.
struct RowRounding {
  uint64_t key;
  uint16_t* bits;    // [dim]
  uint64_t* hashes;  // [(dim + 3) / 4]
  const uint16_t* drawn(int64_t dim) const {
    rounding_bits(bits, hashes, dim, key);
    return bits;
  }
};

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
#define TREXT_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,f16c")))
// TORCHREC_EXT_NO_AVX512=1 takes the F16C path (tests check both give the same bits).
const bool kHasAvx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                        kHasF16C && std::getenv("TORCHREC_EXT_NO_AVX512") == nullptr;

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
  // (rare: tested per block, so the common case skips the fix)
  const __mmask16 big =
      _mm512_cmpge_epu32_mask(a, _mm512_set1_epi32(static_cast<int>(kHalfOverflowBoundary)));
  if (__builtin_expect(big != 0, 0)) {
    const __mmask16 overflow =
        _mm512_mask_cmp_ps_mask(big, y, _mm512_set1_ps(65536.0f), _CMP_GE_OQ);
    y = _mm512_mask_mov_ps(y, overflow, _mm512_set1_ps(std::numeric_limits<float>::infinity()));
  }
  // y | (u & sign): the sign back; truncation is symmetric
  const __m512i signed_y = _mm512_ternarylogic_epi32(
      _mm512_castps_si512(y), u, _mm512_set1_epi32(static_cast<int>(0x80000000u)), 0xF8);
  return _mm512_cvtps_ph(_mm512_castsi512_ps(signed_y), _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
}

// The high 16 bits of each 32-bit lane, as 16 packed values: one permute (a shift and a
// narrowing vpmovdw cost three times as much here).
TREXT_AVX512 inline __m256i high_halves16(__m512i v) {
  const __m512i odd_words =
      _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33, 31, 29, 27,
                       25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  return _mm512_castsi512_si256(_mm512_permutexvar_epi16(odd_words, v));
}

// bfloat16_stochastic 16 wide: the bit pattern plus r, its top 16 bits; the largest finite value
// instead of inf below the overflow boundary; NaN as the quiet NaN.
TREXT_AVX512 inline __m256i bf16_stochastic16(__m512 x, __m512i r) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i a = _mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF));
  const __m512i sum = _mm512_add_epi32(u, r);
  // Only |x| from the largest finite value's lower neighbour up (near overflow, inf, NaN) can
  // need a fix: tested per block, so the common case skips it.
  const __mmask16 big = _mm512_cmpge_epu32_mask(a, _mm512_set1_epi32(0x7F7F0000));
  if (__builtin_expect(big == 0, 1)) return high_halves16(sum);
  __m512i t = _mm512_srli_epi32(sum, 16);
  const __mmask16 overflow = _mm512_mask_cmpeq_epi32_mask(
      _mm512_cmplt_epu32_mask(a, _mm512_set1_epi32(static_cast<int>(kBf16OverflowBoundary))),
      _mm512_and_si512(t, _mm512_set1_epi32(0x7FFF)), _mm512_set1_epi32(0x7F80));
  t = _mm512_mask_sub_epi32(t, overflow, t, _mm512_set1_epi32(1));
  t = _mm512_mask_mov_epi32(t, _mm512_cmpgt_epu32_mask(a, _mm512_set1_epi32(0x7F800000)),
                            _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(t);
}

// bfloat16 rounded to nearest even 16 wide (c10's round_to_nearest_even; NaN as the quiet NaN,
// tested per block: rare).
TREXT_AVX512 inline __m256i bf16_nearest16(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  __m512i t = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)),
                               _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)));
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF)),
                                                _mm512_set1_epi32(0x7F800000));
  if (__builtin_expect(nan != 0, 0))
    t = _mm512_mask_mov_epi32(t, nan, _mm512_set1_epi32(0x7FC00000));
  return high_halves16(t);
}
TREXT_AVX512 void float_row_to_bf16_avx512(uint16_t* out, const float* x, int64_t dim) {
  int64_t d = 0;
  for (; d + 16 <= dim; d += 16)  // whole blocks unmasked: masked loads of just-written rows stall
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + d),
                        bf16_nearest16(_mm512_loadu_ps(x + d)));
  if (d < dim) {
    const __mmask16 m = static_cast<__mmask16>((1u << (dim - d)) - 1u);
    _mm256_mask_storeu_epi16(out + d, m, bf16_nearest16(_mm512_maskz_loadu_ps(m, x + d)));
  }
}

// The random numbers of a row (rounding_bits) hashed in registers, 16 elements (4 hashes) at a
// time from the row's start: no pass through memory, and the row's key is all it needs.
struct RoundingStream16 {
  __m256i counter;  // key + (q + 1) * golden for the next block's hashes q = 4b .. 4b + 3
};
TREXT_AVX512 inline RoundingStream16 rounding_stream(uint64_t key) {
  const auto g = [](uint64_t q) { return static_cast<long long>(q * kRoundingGolden); };
  return {_mm256_add_epi64(_mm256_set1_epi64x(static_cast<long long>(key)),
                           _mm256_setr_epi64x(g(1), g(2), g(3), g(4)))};
}
TREXT_AVX512 inline __m512i next_rounding_bits16(RoundingStream16& s) {
  __m256i k = s.counter;
  k = _mm256_xor_si256(k, _mm256_srli_epi64(k, 33));
  k = _mm256_mullo_epi64(k, _mm256_set1_epi64x(static_cast<long long>(0xFF51AFD7ED558CCDull)));
  k = _mm256_xor_si256(k, _mm256_srli_epi64(k, 33));
  k = _mm256_mullo_epi64(k, _mm256_set1_epi64x(static_cast<long long>(0xC4CEB9FE1A85EC53ull)));
  k = _mm256_xor_si256(k, _mm256_srli_epi64(k, 33));
  s.counter =
      _mm256_add_epi64(s.counter, _mm256_set1_epi64x(static_cast<long long>(4 * kRoundingGolden)));
  return _mm512_cvtepu16_epi32(k);  // the 4 hashes' uint16 lanes, in element order
}

// A row rounded 16 wide, the random numbers hashed on the way (the tail's extra lanes' unused).
// `stream`: non-temporal stores, for a row not read again soon (out 32-byte aligned, dim a
// multiple of 16: no masked tail).
template <__m256i (*Round16)(__m512, __m512i)>
TREXT_AVX512 inline void row_stochastic_avx512(uint16_t* out, const float* x, uint64_t key,
                                               int64_t dim, bool stream) {
  RoundingStream16 rounding = rounding_stream(key);
  int64_t d = 0;
  for (; d + 16 <= dim; d += 16) {
    const __m256i h = Round16(_mm512_loadu_ps(x + d), next_rounding_bits16(rounding));
    if (stream)
      _mm256_stream_si256(reinterpret_cast<__m256i*>(out + d), h);
    else
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + d), h);
  }
  if (d < dim) {  // the tail, masked (dims not a multiple of 16)
    const __mmask16 m = static_cast<__mmask16>((1u << (dim - d)) - 1u);
    _mm256_mask_storeu_epi16(
        out + d, m, Round16(_mm512_maskz_loadu_ps(m, x + d), next_rounding_bits16(rounding)));
  }
}
TREXT_AVX512 void float_row_to_half_stochastic_avx512(uint16_t* out, const float* x, uint64_t key,
                                                      int64_t dim, bool stream = false) {
  row_stochastic_avx512<half_stochastic16>(out, x, key, dim, stream);
}
TREXT_AVX512 void float_row_to_bf16_stochastic_avx512(uint16_t* out, const float* x, uint64_t key,
                                                      int64_t dim, bool stream = false) {
  row_stochastic_avx512<bf16_stochastic16>(out, x, key, dim, stream);
}
#pragma GCC diagnostic pop
#else
constexpr bool kHasAvx512 = false;
void add_scaled_half_avx512(float*, const uint16_t*, float, int64_t) {}
void half_row_to_float_avx512(float*, const uint16_t*, int64_t) {}
void float_row_to_half_avx512(uint16_t*, const float*, int64_t) {}
void float_row_to_bf16_avx512(uint16_t*, const float*, int64_t) {}
void float_row_to_half_stochastic_avx512(uint16_t*, const float*, uint64_t, int64_t, bool = false) {
}
void float_row_to_bf16_stochastic_avx512(uint16_t*, const float*, uint64_t, int64_t, bool = false) {
}
#endif

}  // namespace
}  // namespace torchrec_ext
