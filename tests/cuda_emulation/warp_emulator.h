// A CPU emulator of the CUDA warp features our kernels use, so CI (no GPU) runs the real
// code paths of csrc/*.cu: each warp is 32 ucontext fibers, run lane by lane up to their
// next warp collective (__ballot_sync, __shfl_sync, __syncwarp); the scheduler checks all 32
// lanes reached the same collective (divergence aborts, as it would deadlock or corrupt on a
// GPU), then computes it. Launches run their warps one after another.
//
// What it cannot show: memory-ordering and timing effects between warps (warps never overlap
// here), and speed. It can show results that depend on the order of a launch's warps or of a
// warp's lanes between two collectives (a race on a GPU): with TORCHREC_EMU_REVERSE_WARPS set,
// launches run their warps last to first, and each warp its lanes from 31 down to 0.
// Included first by the emulated kernels file that build.py generates.
#pragma once
#include <cuda_runtime_api.h>
#include <ucontext.h>

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

#undef __global__
#undef __device__
#undef __forceinline__
#define __global__
#define __device__
#define __forceinline__ inline

struct Dim { unsigned x = 0; };
inline Dim threadIdx, blockIdx, blockDim, gridDim;  // inline: one emulator for every kernels file

namespace emu {
enum Kind { kDone = 0, kBallot = 1, kShfl = 2, kSync = 3, kMatch = 4 };
struct Lane {
  ucontext_t ctx;
  int kind;
  long long val;
  int src;
  long long result;
};
struct Warp {
  ucontext_t sched;
  Lane lanes[32];
  const std::function<void()>* body;
};
inline Warp* g_warp;
inline int g_lane;
inline std::vector<std::vector<char>> g_stacks(32, std::vector<char>(1 << 18));
inline long long g_collectives = 0;

inline long long collective(int kind, long long v, int src) {
  Lane& L = g_warp->lanes[g_lane];
  L.kind = kind; L.val = v; L.src = src;
  swapcontext(&L.ctx, &g_warp->sched);
  return L.result;
}
inline void lane_entry() {
  (*g_warp->body)();
  g_warp->lanes[g_lane].kind = kDone;
}
inline void run_warp(unsigned block, unsigned warp, const std::function<void()>& body,
                     bool reverse_lanes) {
  Warp w;
  w.body = &body;
  g_warp = &w;
  bool done[32] = {};
  for (int l = 0; l < 32; ++l) {
    getcontext(&w.lanes[l].ctx);
    w.lanes[l].ctx.uc_stack.ss_sp = g_stacks[l].data();
    w.lanes[l].ctx.uc_stack.ss_size = g_stacks[l].size();
    w.lanes[l].ctx.uc_link = &w.sched;
    makecontext(&w.lanes[l].ctx, lane_entry, 0);
  }
  for (;;) {
    int ndone = 0;
    for (int i = 0; i < 32; ++i) {
      const int l = reverse_lanes ? 31 - i : i;
      if (done[l]) { ++ndone; continue; }
      g_lane = l;
      threadIdx.x = warp * 32 + l;
      blockIdx.x = block;
      swapcontext(&w.sched, &w.lanes[l].ctx);
      if (w.lanes[l].kind == kDone) { done[l] = true; ++ndone; }
    }
    if (ndone == 32) return;
    const int kind = w.lanes[0].kind;
    for (int l = 0; l < 32; ++l) {
      if (done[l] || w.lanes[l].kind != kind) {
        std::fprintf(stderr, "EMU: divergent warp collective (lane %d kind %d vs lane 0 kind %d)\n", l,
                     done[l] ? -1 : w.lanes[l].kind, kind);
        std::abort();
      }
    }
    ++g_collectives;
    if (kind == kBallot) {
      long long m = 0;
      for (int l = 0; l < 32; ++l) m |= (w.lanes[l].val ? 1ll : 0ll) << l;
      for (int l = 0; l < 32; ++l) w.lanes[l].result = m;
    } else if (kind == kShfl) {
      long long vals[32];
      for (int l = 0; l < 32; ++l) vals[l] = w.lanes[l].val;
      for (int l = 0; l < 32; ++l) w.lanes[l].result = vals[w.lanes[l].src & 31];
    } else if (kind == kMatch) {
      for (int l = 0; l < 32; ++l) {
        long long m = 0;
        for (int o = 0; o < 32; ++o) m |= (w.lanes[o].val == w.lanes[l].val ? 1ll : 0ll) << o;
        w.lanes[l].result = m;
      }
    }
  }
}
}  // namespace emu

inline unsigned __ballot_sync(unsigned mask, bool pred) {
  if (mask != 0xFFFFFFFFu) std::abort();
  return static_cast<unsigned>(emu::collective(emu::kBallot, pred, 0));
}
template <typename T>
inline T __shfl_sync(unsigned mask, T v, int src) {
  static_assert(sizeof(T) <= 8, "");
  if (mask != 0xFFFFFFFFu) std::abort();
  return static_cast<T>(emu::collective(emu::kShfl, static_cast<long long>(v), src));
}
template <typename T>
inline T __shfl_xor_sync(unsigned mask, T v, int m) {
  return __shfl_sync(mask, v, static_cast<int>(threadIdx.x & 31) ^ m);
}
inline void __syncwarp() { emu::collective(emu::kSync, 0, 0); }
inline unsigned __match_any_sync(unsigned mask, unsigned long long v) {
  if (mask != 0xFFFFFFFFu) std::abort();
  return static_cast<unsigned>(emu::collective(emu::kMatch, static_cast<long long>(v), 0));
}
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
  const unsigned long long old = *p;
  *p = old + v;
  return old;
}
inline unsigned atomicCAS(unsigned* p, unsigned compare, unsigned v) {  // lanes never overlap here
  const unsigned old = *p;
  if (old == compare) *p = v;
  return old;
}
inline unsigned long long atomicCAS(unsigned long long* p, unsigned long long compare,
                                    unsigned long long v) {
  const unsigned long long old = *p;
  if (old == compare) *p = v;
  return old;
}
inline long long atomicMin(long long* p, long long v) {
  const long long old = *p;
  if (v < old) *p = v;
  return old;
}
inline void emu_prefetch(const void*) {}
inline cudaError_t emu_last_error() { return cudaSuccess; }
template <typename F>
void emu_launch(unsigned grid, unsigned block, cudaStream_t, F f) {
  if (grid == 0 || block % 32 != 0) std::abort();
  gridDim.x = grid;
  blockDim.x = block;
  const std::function<void()> body = f;
  const bool reverse = std::getenv("TORCHREC_EMU_REVERSE_WARPS") != nullptr;
  const unsigned per_block = block / 32, warps = grid * per_block;
  for (unsigned i = 0; i < warps; ++i) {
    const unsigned w = reverse ? warps - 1 - i : i;
    emu::run_warp(w / per_block, w % per_block, body, reverse);
  }
}


extern "C" inline long long emu_collectives() { return emu::g_collectives; }
