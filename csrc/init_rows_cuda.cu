// CUDA kernel of init_rows_tables: every table's new rows in one launch, a thread per (row,
// element), bit for bit the CPU kernel's (init_rows_cpu.cpp). Each element is a pure function
// of (table seed, id, column): the same counter-based hash (fmix64 of the row key plus the
// pair's counter times the golden ratio), the same double arithmetic, each product and sum
// rounded on its own (__dmul_rn / __dadd_rn: nvcc would otherwise contract them into FMAs, which
// the CPU build forbids with -ffp-contract=off), the same round-to-nearest-even narrowing for
// half rows. The normals take CUDA's double log / sin / cos, which may differ from glibc's by an
// ulp of a double: invisible after the float32 cast but for a value within that ulp of a float32
// rounding boundary (about 2^-28 of the elements where the two libraries differ).
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "cuda_launch.cuh"
#include "init_rows_cuda.h"
#include "init_rows_math.h"

namespace torchrec_ext {
namespace {

constexpr int kInitThreads = 256;
constexpr double kTwoPi = 2.0 * 3.14159265358979323846;  // 2.0 * M_PI, folded exactly as the CPU's

// Products and sums rounded one by one (never fused), as the CPU kernel computes them. (The
// emulator's host build takes plain operations: x86-64 contracts nothing without -mfma.)
#if defined(__CUDA_ARCH__)
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ float fmul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ float fadd_rn(float a, float b) { return __fadd_rn(a, b); }
#else
__device__ __forceinline__ double mul_rn(double a, double b) { return a * b; }
__device__ __forceinline__ double add_rn(double a, double b) { return a + b; }
__device__ __forceinline__ float fmul_rn(float a, float b) { return a * b; }
__device__ __forceinline__ float fadd_rn(float a, float b) { return a + b; }
#endif

// The bits of one 4-byte type read as another (std::bit_cast, which device code lacks).
template <typename To, typename From>
__device__ __forceinline__ To bits_as(From x) {
  union {
    From from;
    To to;
  } v;
  v.from = x;
  return v.to;
}

// float32 -> float16 rounded to nearest even, c10's fp16_ieee_from_fp32_value (what the CPU's
// store_row gives, in whichever of its loops), subnormals, overflow to inf and NaN included.
__device__ __forceinline__ uint16_t half_nearest(float f) {
  float base = fmul_rn(fmul_rn(fabsf(f), 0x1.0p+112f), 0x1.0p-110f);
  const uint32_t w = bits_as<uint32_t>(f), shl1_w = w + w, sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = fadd_rn(bits_as<float>((bias >> 1) + 0x07800000u), base);
  const uint32_t bits = bits_as<uint32_t>(base);
  const uint32_t nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
  return static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

// float32 -> bfloat16 rounded to nearest even, c10's round_to_nearest_even (NaN: 0x7FC0).
__device__ __forceinline__ uint16_t bf16_nearest(float f) {
  const uint32_t u = bits_as<uint32_t>(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// Element `second` (0 or 1) of the Box-Muller pair of `bits` (init_rows_cpu.cpp's box_muller).
__device__ __forceinline__ double box_muller(uint64_t bits, int second) {
  const double u1 = (static_cast<double>(bits >> 32) + 0.5) * 0x1p-32;    // exact
  const double u2 = static_cast<double>(bits & 0xFFFFFFFFull) * 0x1p-32;  // exact
  const double r = sqrt(-2.0 * log(u1));                                  // IEEE sqrt; x -2 exact
  const double angle = mul_rn(kTwoPi, u2);
  return mul_rn(r, second ? sin(angle) : cos(angle));
}

// Element `column` of the initial vector of the row with key `key` (init_rows_cpu.cpp's
// init_vector, one element at a time: every element is a function of its pair alone).
__device__ __forceinline__ float initial_value(uint64_t key, Init init, const double* p,
                                               int64_t column) {
  if (init == Init::kConstant) return static_cast<float>(p[0]);
  const int64_t pair = column >> 1;
  const int second = static_cast<int>(column & 1);
  if (init == Init::kUniform) {  // 24 bits of each half of the pair's hash
    const uint64_t bits = pair_bits(key, pair, 0);
    const uint64_t u = second ? (bits & 0xFFFFFFFFull) >> 8 : bits >> 40;
    return static_cast<float>(add_rn(p[0], mul_rn(p[1] - p[0], static_cast<double>(u) * 0x1p-24)));
  }
  double v = add_rn(p[0], mul_rn(p[1], box_muller(pair_bits(key, pair, 0), second)));
  if (init == Init::kTruncatedNormal) {  // redraw from the pair's next attempts; clamp after
    for (int attempt = 1; attempt < kTruncNormalAttempts && (v < p[2] || v > p[3]); ++attempt)
      v = add_rn(p[0], mul_rn(p[1], box_muller(pair_bits(key, pair, attempt), second)));
    v = v < p[2] ? p[2] : v;  // std::max(v, low)
    v = p[3] < v ? p[3] : v;  // std::min(v, high)
  }
  return static_cast<float>(v);
}

__global__ void init_rows_tables_kernel(const InitRowsTables a) {
  const int64_t total = a.n * a.max_dim;
  const int64_t stride = global_threads();
  for (int64_t k = global_thread(); k < total; k += stride) {
    const int64_t i = k / a.max_dim, e = k - i * a.max_dim;
    const int64_t row = a.rows[i];
    if (row < 0) continue;
    const int64_t t = a.tables[i], dim = a.table_dims[t];
    if (e >= dim) continue;
    const uint64_t key = row_key(a.ids[i], static_cast<uint64_t>(a.table_seeds[t]));
    const float v =
        initial_value(key, static_cast<Init>(a.table_kinds[t]), a.table_params + 4 * t, e);
    const int64_t code = a.table_dtypes == nullptr ? 0 : a.table_dtypes[t];
    const int64_t element = row * dim + e;  // in the table's own dtype
    if (code == 0) {
      const int64_t at = a.table_offsets[t] + element;
      if (at < a.words) a.weights[at] = v;
    } else {
      const int64_t at = 2 * a.table_offsets[t] + element;
      if (at < 2 * a.words)
        reinterpret_cast<uint16_t*>(a.weights)[at] = code == 1 ? half_nearest(v) : bf16_nearest(v);
    }
    if (a.rowwise && e != 0) continue;
    const int64_t state_at = a.num_states ? a.state_offsets[t] + (a.rowwise ? row : element) : 0;
    for (int s = 0; s < a.num_states; ++s)
      if (state_at < a.state_numel[s]) a.states[s][state_at] = a.state_values[s];
  }
}

}  // namespace

cudaError_t launch_init_rows_tables(const InitRowsTables& args, cudaStream_t stream) {
  const int64_t total = args.n * args.max_dim;
  if (total == 0) return cudaSuccess;
  init_rows_tables_kernel<<<capped_grid(total, kInitThreads), kInitThreads, 0, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace torchrec_ext
