// CUDA kernels of the dynamic hash table (torch.ops.torchrec_ext.hash_*) and of `route`.
//
// A bucket has 32 slots, so a warp covers one: lane l owns slot l of both candidate buckets of
// a key. A probe is one coalesced digest load per bucket and a __ballot_sync; every choice the
// CPU kernel makes by scanning a bucket (first match, emptier bucket, lowest free slot,
// lowest-score victim) becomes a ballot or a warp reduction over the same scan order.
//
// Lookups are read-only and take one thread per key (hash_find: a warp per key where the digests
// are not 16-byte aligned), all in parallel. Mutations must give the CPU
// kernels' results bit for bit (same rows, flags, evictions and scores): an upsert first touches
// and pins every key of the batch that holds a row, then inserts the others one at a time in
// batch order per stripe, window by window of the batch (upsert_window), then releases its pins;
// an erase applies each stripe's keys in batch order. A key of stripe s lives in stripe s or
// s + 1, so the touch, insert and erase walks run phase by phase (upsert_phase, one launch each:
// the stripes of one phase share no bucket, so no two warps touch the same bucket at once).
// The binding sorts positions by stripe with a stable sort and here one warp walks one stripe's
// keys in batch order. No locks and no table atomics, and the results do not depend on
// scheduling. The walk is latency-bound, so a warp loads and hashes 32 keys at a time and
// prefetches their digest lines into L2 before applying them one by one.
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>

#include "hash_table_cuda.h"
#include "hash_table_layout.h"

namespace torchrec_ext {
namespace {

constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xFFFFFFFFu;
static_assert(kSlotsPerBucket == kWarpSize, "a warp covers a bucket: lane l owns slot l");
constexpr int kSlotMask = kSlotsPerBucket - 1;
// Victim candidates are numbered c * 32 + slot for bucket c = 0, 1: the CPU's scan order.
constexpr int kNoVictim = 2 * kSlotsPerBucket;

constexpr int kFindThreads = 256;
constexpr int kStripeThreads = 128;
constexpr int kElementwiseThreads = 256;
constexpr int64_t kMaxBlocks = int64_t{1} << 16;  // larger inputs use grid-stride loops

__device__ __forceinline__ int lane_id() { return static_cast<int>(threadIdx.x) & (kWarpSize - 1); }

__device__ __forceinline__ int64_t global_thread() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}

__device__ __forceinline__ int64_t global_threads() {
  return static_cast<int64_t>(gridDim.x) * blockDim.x;
}

__device__ __forceinline__ int64_t shfl64(int64_t v, int src_lane) {
  return static_cast<int64_t>(__shfl_sync(kFullMask, static_cast<long long>(v), src_lane));
}

__device__ __forceinline__ int64_t shfl_xor64(int64_t v, int lane_mask) {
  return static_cast<int64_t>(__shfl_xor_sync(kFullMask, static_cast<long long>(v), lane_mask));
}

__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

// This lane's slot in each of a key's candidate buckets.
struct LaneSlots {
  int64_t row1;
  int64_t row2;
  uint8_t d1;
  uint8_t d2;
  bool two;  // bucket2 != bucket1 (a one-bucket stripe gives both the same bucket)
};

__device__ __forceinline__ LaneSlots load_slots(const uint8_t* digests, const KeyPlace& p,
                                                int lane) {
  LaneSlots s;
  s.row1 = p.bucket1 * kSlotsPerBucket + lane;
  s.row2 = p.bucket2 * kSlotsPerBucket + lane;
  s.two = p.bucket2 != p.bucket1;
  s.d1 = digests[s.row1];
  s.d2 = s.two ? digests[s.row2] : uint8_t{0};
  return s;
}

// Row holding `key`, or -1: the lowest matching slot of bucket1, else of bucket2, as the CPU
// probe (the pin bit is ignored). Only lanes whose tag matches read their slot's key, and both
// buckets' key reads are issued before either ballot.
__device__ __forceinline__ int64_t warp_probe(const int64_t* slot_keys, const KeyPlace& p,
                                              const LaneSlots& s, int64_t key) {
  const bool hit1 = (s.d1 & kTagMask) == p.tag && slot_keys[s.row1] == key;
  const bool hit2 = s.two && (s.d2 & kTagMask) == p.tag && slot_keys[s.row2] == key;
  const uint32_t m1 = __ballot_sync(kFullMask, hit1);
  const uint32_t m2 = __ballot_sync(kFullMask, hit2);
  if (m1 != 0) return p.bucket1 * kSlotsPerBucket + (__ffs(static_cast<int>(m1)) - 1);
  if (m2 != 0) return p.bucket2 * kSlotsPerBucket + (__ffs(static_cast<int>(m2)) - 1);
  return -1;
}

// Keeps the lexicographic minimum of (score, candidate): the lowest score, the first on ties.
__device__ __forceinline__ void keep_lower(int64_t& score, int& cand, int64_t s, int c) {
  if (s < score || (s == score && c < cand)) {
    score = s;
    cand = c;
  }
}

// First index in [lo, hi) of the ascending `sorted` whose value is >= v, else hi (every lane gets
// the same answer): where a stripe's run starts in the sorted stripe ids, or a window's slice in
// a stripe's ascending batch positions.
template <typename T>
__device__ __forceinline__ int64_t lower_bound(const T* sorted, int64_t lo, int64_t hi, int64_t v) {
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (sorted[mid] < v) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// One key of a stripe's walk, as every lane of the warp sees it.
struct StripeKey {
  int64_t pos;  // batch position: where its results go
  int64_t key;
  int64_t given;  // caller's score or increment (0 when none)
  KeyPlace place;
};

// The stripe that this warp walks in phase `phase` (the warp's index among the phase's stripes),
// or -1 for a warp beyond them.
__device__ __forceinline__ int64_t phase_warp_stripe(int phase, const TableGeometry& geo) {
  const int64_t w = global_thread() / kWarpSize;
  return w < phase_stripes(phase, geo.num_stripes) ? phase_stripe(phase, w, geo.num_stripes) : -1;
}

// Every position of a walk.
struct AllPositions {
  __device__ __forceinline__ bool operator()(int64_t) const { return true; }
};

// Calls visit(k) with the whole warp for the grouped positions [begin, end) whose batch position
// `wanted` accepts, in order. Per chunk of 32, lane l loads and hashes key l and prefetches its
// digest lines, so the serial walk waits only on the table. The __syncwarp after each key makes
// the writer lane's stores visible to every lane's reads of the next key, which may hit the same
// bucket, and to the next walk's reads of the outputs.
template <typename Wanted, typename Visit>
__device__ __forceinline__ void walk_stripe(const uint8_t* digests, const int64_t* keys,
                                            const int64_t* given, const int64_t* order,
                                            const TableGeometry& geo, int64_t begin, int64_t end,
                                            int lane, Wanted&& wanted, Visit&& visit) {
  for (int64_t chunk = begin; chunk < end; chunk += kWarpSize) {
    StripeKey mine{};
    bool mine_wanted = false;
    if (chunk + lane < end) {
      mine.pos = order[chunk + lane];
      mine_wanted = wanted(mine.pos);
    }
    if (mine_wanted) {
      mine.key = keys[mine.pos];
      mine.given = given != nullptr ? given[mine.pos] : 0;
      mine.place = place_key(mine.key, geo);
      prefetch_l2(digests + mine.place.bucket1 * kSlotsPerBucket);
      prefetch_l2(digests + mine.place.bucket2 * kSlotsPerBucket);
    }
    for (uint32_t todo = __ballot_sync(kFullMask, mine_wanted); todo != 0; todo &= todo - 1) {
      const int t = __ffs(static_cast<int>(todo)) - 1;
      StripeKey k{};
      k.pos = shfl64(mine.pos, t);
      k.key = shfl64(mine.key, t);
      k.given = shfl64(mine.given, t);
      k.place.bucket1 = shfl64(mine.place.bucket1, t);
      k.place.bucket2 = shfl64(mine.place.bucket2, t);
      k.place.tag =
          static_cast<uint8_t>(__shfl_sync(kFullMask, static_cast<int>(mine.place.tag), t));
      visit(k);
      __syncwarp();
    }
  }
}

// ---------------------------------------------------------------------------------------------

// The slots of a bucket whose tag is `tag` (pin bit ignored), as a mask (bit l: slot l): its 32
// digests in two 16-byte loads (byte by byte where the digests are not 16-byte aligned, a view),
// compared four bytes at a time. Empty slots (digest 0) never match: tags are 1..127.
__device__ __forceinline__ uint32_t tag_matches(const uint8_t* bucket_digests, uint8_t tag) {
  uint32_t words[8];
  if (reinterpret_cast<uintptr_t>(bucket_digests) % alignof(uint4) == 0) {
    const uint4* vec = reinterpret_cast<const uint4*>(bucket_digests);
    const uint4 lo = vec[0], hi = vec[1];
    words[0] = lo.x, words[1] = lo.y, words[2] = lo.z, words[3] = lo.w;
    words[4] = hi.x, words[5] = hi.y, words[6] = hi.z, words[7] = hi.w;
  } else {
    for (int w = 0; w < 8; ++w) {
      words[w] = 0;
      for (int j = 0; j < 4; ++j) words[w] |= uint32_t{bucket_digests[4 * w + j]} << (8 * j);
    }
  }
  const uint32_t tags = 0x01010101u * tag;
  uint32_t mask = 0;
#pragma unroll
  for (int w = 0; w < 8; ++w) {
    // A byte of x is 0 where the tag matches; every byte is <= 0x7F, so adding 0x7F to each
    // carries into its bit 7 exactly when it is non-zero, and never into the next byte.
    const uint32_t x = (words[w] & 0x7F7F7F7Fu) ^ tags;
    const uint32_t zero = ~(x + 0x7F7F7F7Fu) & 0x80808080u;
    const uint32_t bits =
        ((zero >> 7) & 1u) | ((zero >> 14) & 2u) | ((zero >> 21) & 4u) | ((zero >> 28) & 8u);
    mask |= bits << (4 * w);  // byte j of word w is slot 4w + j (little-endian)
  }
  return mask;
}

// Row holding `key`, or -1, probed by one thread: warp_probe's answer (the lowest matching slot
// of bucket1, else of bucket2, else the stash). Both buckets' digests are loaded before any key.
__device__ __forceinline__ int64_t thread_probe(const uint8_t* digests, const int64_t* slot_keys,
                                                const TableGeometry& geo, int64_t key) {
  const KeyPlace p = place_key(key, geo);
  const uint32_t m1 = tag_matches(digests + p.bucket1 * kSlotsPerBucket, p.tag);
  const uint32_t m2 =
      p.bucket2 != p.bucket1 ? tag_matches(digests + p.bucket2 * kSlotsPerBucket, p.tag) : 0u;
  for (uint32_t m = m1; m != 0; m &= m - 1) {
    const int64_t row = p.bucket1 * kSlotsPerBucket + (__ffs(static_cast<int>(m)) - 1);
    if (slot_keys[row] == key) return row;
  }
  for (uint32_t m = m2; m != 0; m &= m - 1) {
    const int64_t row = p.bucket2 * kSlotsPerBucket + (__ffs(static_cast<int>(m)) - 1);
    if (slot_keys[row] == key) return row;
  }
  return stash_probe(digests, slot_keys, geo, p, key);
}

// hash_find with one thread per key (digests 16-byte aligned): the 32 keys of a warp load,
// hash and probe in parallel, their loads all in flight at once, and the reads of keys and
// writes of rows / found coalesce. A warp per key (below) issues every instruction for one
// key and keeps one key's loads in flight.
__global__ void hash_find_thread_kernel(const uint8_t* digests, const int64_t* slot_keys,
                                        TableGeometry geo, const int64_t* keys, int64_t n,
                                        int64_t* rows, bool* found) {
  for (int64_t i = global_thread(); i < n; i += global_threads()) {
    const int64_t row = thread_probe(digests, slot_keys, geo, keys[i]);
    rows[i] = row;
    found[i] = row >= 0;
  }
}

// The same with a warp per key: for digests that are not 16-byte aligned (a view).
__global__ void hash_find_kernel(const uint8_t* digests, const int64_t* slot_keys,
                                 TableGeometry geo, const int64_t* keys, int64_t n, int64_t* rows,
                                 bool* found) {
  const int lane = lane_id();
  const int64_t num_warps = global_threads() / kWarpSize;
  for (int64_t i = global_thread() / kWarpSize; i < n; i += num_warps) {
    const int64_t key = keys[i];
    const KeyPlace p = place_key(key, geo);
    int64_t row = warp_probe(slot_keys, p, load_slots(digests, p, lane), key);
    if (row < 0) row = stash_probe(digests, slot_keys, geo, p, key);  // every lane: same answer
    if (lane == 0) {
      rows[i] = row;
      found[i] = row >= 0;
    }
  }
}

__global__ void key_stripes_kernel(const int64_t* keys, int64_t n, TableGeometry geo,
                                   int32_t* stripes) {
  for (int64_t i = global_thread(); i < n; i += global_threads()) {
    stripes[i] = static_cast<int32_t>(place_key(keys[i], geo).stripe);
  }
}

// Gives the key found at `row` its touched score and pins it (the lane owning the row writes).
__device__ __forceinline__ void touch_slot(int64_t* slot_scores, uint8_t* digests, int64_t row,
                                           const StripeKey& k, Policy policy, bool has_given,
                                           int64_t clock, int64_t epoch, bool assign) {
  slot_scores[row] = assign && has_given ? k.given
                                         : touched_score(policy, false, slot_scores[row], has_given,
                                                         k.given, clock, epoch);
  digests[row] |= kPinBit;
}

// Upsert, pass 1, phase `phase`: warp w walks stripe phase_stripe(phase, w), touches and pins
// (digest bit 7) every key of the stripe that holds a row and marks the others (row -1) for pass 2.
// The walk of one stripe, whose grouped positions are [begin, end) (shared by the per-table and
// the multi-table kernels).
__device__ __forceinline__ void touch_stripe(uint8_t* digests, const int64_t* slot_keys,
                                             int64_t* slot_scores, const TableGeometry& geo,
                                             const int64_t* keys, const int64_t* given,
                                             const int64_t* order, int64_t begin, int64_t end,
                                             Policy policy, int64_t clock, int64_t epoch,
                                             bool assign, int64_t* rows) {
  const int lane = lane_id();
  const bool has_given = given != nullptr;
  walk_stripe(
      digests, keys, given, order, geo, begin, end, lane, AllPositions{}, [&](const StripeKey& k) {
        int64_t hit = warp_probe(slot_keys, k.place, load_slots(digests, k.place, lane), k.key);
        // A stashed key's row may lie in a bucket another warp of this phase reads: it reads only
        // the tag bits of the digest this warp pins, and no warp reads the score written.
        if (hit < 0) hit = stash_probe(digests, slot_keys, geo, k.place, k.key);
        if (lane != (hit >= 0 ? static_cast<int>(hit & kSlotMask) : 0)) return;
        rows[k.pos] = hit;
        if (hit >= 0)
          touch_slot(slot_scores, digests, hit, k, policy, has_given, clock, epoch, assign);
      });
}

__global__ void hash_touch_kernel(uint8_t* digests, const int64_t* slot_keys, int64_t* slot_scores,
                                  TableGeometry geo, const int64_t* keys, const int64_t* given,
                                  const int32_t* sorted_stripes, const int64_t* order, int64_t n,
                                  int phase, Policy policy, int64_t clock, int64_t epoch,
                                  bool assign, int64_t* rows) {
  const int64_t stripe = phase_warp_stripe(phase, geo);
  if (stripe < 0) return;
  const int64_t begin = lower_bound(sorted_stripes, 0, n, stripe);
  const int64_t end = lower_bound(sorted_stripes, begin, n, stripe + 1);
  touch_stripe(digests, slot_keys, slot_scores, geo, keys, given, order, begin, end, policy, clock,
               epoch, assign, rows);
}

// Upsert, pass 2, phase `phase` of the window [window_begin, window_end) of batch positions: warp
// w walks stripe phase_stripe(phase, w) and inserts the window's keys absent when the call began,
// in batch order, so a new key never evicts a key of the same call (all pinned by pass 1). A
// stripe's positions ascend, so the window's slice of them is found by binary search: a launch
// costs its window's keys, not the stripe's.
// The walk of one stripe over its window's grouped positions [begin, end) (shared by the
// per-table and the multi-table kernels).
__device__ __forceinline__ void insert_stripe(
    uint8_t* digests, int64_t* slot_keys, int64_t* slot_scores, int64_t* size,
    const TableGeometry& geo, const int64_t* keys, const int64_t* given, const int64_t* order,
    int64_t begin, int64_t end, Policy policy, int64_t clock, int64_t epoch, bool assign,
    int64_t* rows, bool* inserted, bool* evicted, int64_t* evicted_keys) {
  const int lane = lane_id();
  const bool has_given = given != nullptr;
  int64_t added = 0;  // warp-uniform: every decision below comes from a ballot or reduction

  auto absent = [&](int64_t pos) { return rows[pos] < 0; };
  walk_stripe(digests, keys, given, order, geo, begin, end, lane, absent, [&](const StripeKey& k) {
    const KeyPlace& p = k.place;
    const LaneSlots s = load_slots(digests, p, lane);
    const int64_t hit = warp_probe(slot_keys, p, s, k.key);
    if (hit >= 0) {  // a repeat of a key inserted earlier in this walk
      if (lane == (hit & kSlotMask)) {
        touch_slot(slot_scores, digests, hit, k, policy, has_given, clock, epoch, assign);
        rows[k.pos] = hit;
      }
      return;
    }
    const int64_t new_score =
        assign && has_given ? k.given
                            : touched_score(policy, true, 0, has_given, k.given, clock, epoch);
    const uint32_t usable1 = geo.usable_mask(p.bucket1);
    const uint32_t usable2 = s.two ? geo.usable_mask(p.bucket2) : 0u;
    const uint32_t free1 = __ballot_sync(kFullMask, s.d1 == 0) & usable1;
    const uint32_t free2 = __ballot_sync(kFullMask, s.d2 == 0) & usable2;
    int64_t row = -1;
    bool evicts = false;
    if ((free1 | free2) != 0) {
      // Two-choice: the emptier bucket (bucket1 on ties), its lowest free slot.
      row = __popc(free1) >= __popc(free2)
                ? p.bucket1 * kSlotsPerBucket + (__ffs(static_cast<int>(free1)) - 1)
                : p.bucket2 * kSlotsPerBucket + (__ffs(static_cast<int>(free2)) - 1);
      ++added;
    } else if (policy != Policy::kNone) {
      // Both full: the lowest-score slot not pinned by this call, the first on ties.
      int64_t score = INT64_MAX;
      int cand = kNoVictim;
      if (((usable1 >> lane) & 1u) && (s.d1 & kPinBit) == 0) {
        keep_lower(score, cand, slot_scores[s.row1], lane);
      }
      if (((usable2 >> lane) & 1u) && (s.d2 & kPinBit) == 0) {
        keep_lower(score, cand, slot_scores[s.row2], kSlotsPerBucket + lane);
      }
      for (int offset = kWarpSize / 2; offset > 0; offset >>= 1) {
        keep_lower(score, cand, shfl_xor64(score, offset),
                   __shfl_xor_sync(kFullMask, cand, offset));
      }
      if (cand != kNoVictim && new_score >= score) {
        row =
            (cand < kSlotsPerBucket ? p.bucket1 : p.bucket2) * kSlotsPerBucket + (cand & kSlotMask);
        evicts = true;
      }
    }
    // The lane owning the chosen slot writes it (a refusal keeps pass 1's row -1).
    if (row < 0 || lane != static_cast<int>(row & kSlotMask)) return;
    rows[k.pos] = row;
    if (evicts) {
      evicted[k.pos] = true;
      evicted_keys[k.pos] = slot_keys[row];
    }
    inserted[k.pos] = true;
    slot_keys[row] = k.key;
    slot_scores[row] = new_score;
    digests[row] = static_cast<uint8_t>(p.tag | kPinBit);
  });

  if (lane == 0 && added != 0) {
    atomicAdd(reinterpret_cast<unsigned long long*>(size), static_cast<unsigned long long>(added));
  }
}

__global__ void hash_insert_kernel(uint8_t* digests, int64_t* slot_keys, int64_t* slot_scores,
                                   int64_t* size, TableGeometry geo, const int64_t* keys,
                                   const int64_t* given, const int32_t* sorted_stripes,
                                   const int64_t* order, int64_t n, int phase, int64_t window_begin,
                                   int64_t window_end, Policy policy, int64_t clock, int64_t epoch,
                                   bool assign, int64_t* rows, bool* inserted, bool* evicted,
                                   int64_t* evicted_keys) {
  const int64_t stripe = phase_warp_stripe(phase, geo);
  if (stripe < 0) return;
  const int64_t first = lower_bound(sorted_stripes, 0, n, stripe);
  const int64_t last = lower_bound(sorted_stripes, first, n, stripe + 1);
  const int64_t begin = lower_bound(order, first, last, window_begin);
  const int64_t end = lower_bound(order, begin, last, window_end);
  insert_stripe(digests, slot_keys, slot_scores, size, geo, keys, given, order, begin, end, policy,
                clock, epoch, assign, rows, inserted, evicted, evicted_keys);
}

// Upsert, the end: every row returned is pinned; release them. One warp per stripe, every stripe
// at once (a key clears only its own digest's pin bit and reads no other byte), 32 positions at a
// time. The duplicates of a key hold one row and share a stripe: only the lowest lane holding a
// row clears it, and __syncwarp orders the rounds, so no two threads write a byte concurrently.
__device__ __forceinline__ void release_stripe(uint8_t* digests, const int64_t* rows,
                                               const int64_t* order, int64_t begin, int64_t end) {
  const int lane = lane_id();
  for (int64_t j = begin; j < end; j += kWarpSize) {
    const int64_t row = j + lane < end ? rows[order[j + lane]] : -1;
    const unsigned same = __match_any_sync(kFullMask, static_cast<unsigned long long>(row));
    if (row >= 0 && lane == __ffs(static_cast<int>(same)) - 1) digests[row] &= kTagMask;
    __syncwarp();
  }
}

__global__ void hash_release_kernel(uint8_t* digests, const int64_t* rows,
                                    const int32_t* sorted_stripes, const int64_t* order, int64_t n,
                                    int64_t num_stripes) {
  const int64_t stripe = global_thread() / kWarpSize;
  if (stripe >= num_stripes) return;
  const int64_t begin = lower_bound(sorted_stripes, 0, n, stripe);
  const int64_t end = lower_bound(sorted_stripes, begin, n, stripe + 1);
  release_stripe(digests, rows, order, begin, end);
}

// ---- hash_upsert_tables: the passes above, each one grid over every table. Inserts and releases:
// warp g takes global stripe g (its table's stripe g - stripe_begin) and runs the per-stripe walk
// of the per-table kernel with that table's arrays and parameters, in the same phases and windows;
// touches: a warp per key (below). The tables share no byte, so each table's results are exactly
// its per-table launches'.

// The last table whose range begins at or below v (begin_of ascending in the table): the table
// holding v, empty tables (which share their begin with the next) never chosen.
template <typename BeginOf>
__device__ __forceinline__ int64_t table_at(int64_t num_tables, int64_t v, BeginOf begin_of) {
  int64_t lo = 0, hi = num_tables;  // answer in [lo, hi)
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (begin_of(mid) <= v) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

__device__ __forceinline__ int64_t table_of_stripe(const UpsertTable* tables, int64_t num_tables,
                                                   int64_t g) {
  return table_at(num_tables, g, [&](int64_t t) { return tables[t].stripe_begin; });
}

// hash_find_tables: thread i takes key i (grid-stride) and probes it in its table, as
// hash_find_thread_kernel.
__global__ void hash_find_tables_kernel(const UpsertTable* tables, int64_t num_tables,
                                        const int64_t* keys, int64_t n, int64_t* rows,
                                        bool* found) {
  for (int64_t i = global_thread(); i < n; i += global_threads()) {
    const UpsertTable& t =
        tables[table_at(num_tables, i, [&](int64_t u) { return tables[u].key_begin; })];
    const int64_t row = thread_probe(t.digests, t.slot_keys, t.geo, keys[i]);
    rows[i] = row;
    found[i] = row >= 0;
  }
}

__global__ void key_table_stripes_kernel(const UpsertTable* tables, int64_t num_tables,
                                         const int64_t* keys, int64_t n, int32_t* table_of,
                                         int32_t* stripes) {
  for (int64_t i = global_thread(); i < n; i += global_threads()) {
    const int64_t t = table_at(num_tables, i, [&](int64_t u) { return tables[u].key_begin; });
    table_of[i] = static_cast<int32_t>(t);
    stripes[i] =
        static_cast<int32_t>(tables[t].stripe_begin + place_key(keys[i], tables[t].geo).stripe);
  }
}

// Pass 1 of every table at once, with a warp per key rather than per stripe (issue 13 item 7: a
// stripe's keys touch in parallel): positions come grouped by global stripe then key
// (touch_stripes ascending, touch_order; batch order among a key's occurrences), and warp w takes
// the w-th run of one key's occurrences in its table (grid-stride) and walks it as touch_stripe
// walks a stripe. Touches of distinct keys commute (each writes only its own row's score and pin
// bit, and reads no byte another writes but the pin bits of digests, whose tag bits a probe reads
// and nobody changes in this pass), so the results are the per-stripe walk's whatever the order.
__global__ void hash_touch_tables_kernel(const UpsertTable* tables, int64_t num_tables,
                                         const int64_t* keys, const int64_t* given,
                                         const int32_t* touch_stripes, const int64_t* touch_order,
                                         int64_t n, bool assign, int64_t* rows) {
  const int64_t num_warps = global_threads() / kWarpSize;
  auto same_key = [&](int64_t a, int64_t b) {
    return touch_stripes[a] == touch_stripes[b] && keys[touch_order[a]] == keys[touch_order[b]];
  };
  for (int64_t j = global_thread() / kWarpSize; j < n; j += num_warps) {
    if (touch_stripes[j] == INT32_MAX) break;   // keys not pending: sorted last
    if (j > 0 && same_key(j - 1, j)) continue;  // the run's first occurrence walks it
    int64_t end = j + 1;
    while (end < n && same_key(j, end)) ++end;
    const UpsertTable t = tables[table_of_stripe(tables, num_tables, touch_stripes[j])];
    touch_stripe(t.digests, t.slot_keys, t.slot_scores, t.geo, keys, given, touch_order, j, end,
                 static_cast<Policy>(t.policy), t.clock, t.epoch, assign, rows);
  }
}

// Pass 2, window `window` and k-th phase of every table (each table's phase order rotating with
// its own clock; a table with fewer windows or phases sits the rest out).
__global__ void hash_insert_tables_kernel(const UpsertTable* tables, int64_t num_tables,
                                          int64_t total_stripes, const int64_t* windows,
                                          const int64_t* keys, const int64_t* given,
                                          const int32_t* sorted_stripes, const int64_t* order,
                                          int64_t n, int64_t window, int k, bool assign,
                                          int64_t* rows, bool* inserted, bool* evicted,
                                          int64_t* evicted_keys) {
  const int64_t g = global_thread() / kWarpSize;
  if (g >= total_stripes) return;
  const UpsertTable t = tables[table_of_stripe(tables, num_tables, g)];
  const int64_t stripe = g - t.stripe_begin, stripes = t.geo.num_stripes;
  if (window >= t.windows || k >= upsert_phase_count(stripes) ||
      upsert_phase(stripe, stripes) != upsert_phase_at(k, t.clock, stripes)) {
    return;
  }
  const int64_t first = lower_bound(sorted_stripes, 0, n, g);
  const int64_t last = lower_bound(sorted_stripes, first, n, g + 1);
  const int64_t begin = lower_bound(order, first, last, windows[t.window_begin + window]);
  const int64_t end = lower_bound(order, begin, last, windows[t.window_begin + window + 1]);
  insert_stripe(t.digests, t.slot_keys, t.slot_scores, t.size, t.geo, keys, given, order, begin,
                end, static_cast<Policy>(t.policy), t.clock, t.epoch, assign, rows, inserted,
                evicted, evicted_keys);
}

__global__ void hash_release_tables_kernel(const UpsertTable* tables, int64_t num_tables,
                                           int64_t total_stripes, const int64_t* rows,
                                           const int32_t* sorted_stripes, const int64_t* order,
                                           int64_t n) {
  const int64_t g = global_thread() / kWarpSize;
  if (g >= total_stripes) return;
  const int64_t begin = lower_bound(sorted_stripes, 0, n, g);
  const int64_t end = lower_bound(sorted_stripes, begin, n, g + 1);
  release_stripe(tables[table_of_stripe(tables, num_tables, g)].digests, rows, order, begin, end);
}

// Phase `phase`: warp w walks stripe phase_stripe(phase, w) in batch order, so only the first of
// duplicate keys reports the erase.
__global__ void hash_erase_kernel(uint8_t* digests, const int64_t* slot_keys, int64_t* size,
                                  TableGeometry geo, const int64_t* keys,
                                  const int32_t* sorted_stripes, const int64_t* order, int64_t n,
                                  int phase, bool* erased) {
  const int64_t stripe = phase_warp_stripe(phase, geo);
  if (stripe < 0) return;
  const int lane = lane_id();
  const int64_t begin = lower_bound(sorted_stripes, 0, n, stripe);
  const int64_t end = lower_bound(sorted_stripes, begin, n, stripe + 1);
  int64_t removed = 0;  // warp-uniform

  walk_stripe(digests, keys, nullptr, order, geo, begin, end, lane, AllPositions{},
              [&](const StripeKey& k) {
                int64_t row =
                    warp_probe(slot_keys, k.place, load_slots(digests, k.place, lane), k.key);
                // A stashed key's row: another warp of this phase may read its tag bits (as 0 or
                // the tag, a slot without its key either way); its stash entry is stale, dropped by
                // the next upsert.
                if (row < 0) row = stash_probe(digests, slot_keys, geo, k.place, k.key);
                if (row < 0) return;
                ++removed;
                if (lane == (row & kSlotMask)) {
                  digests[row] = 0;
                  erased[k.pos] = true;
                }
              });

  if (lane == 0 && removed != 0) {
    // Two's complement: adding the wrapped negative count subtracts it.
    atomicAdd(reinterpret_cast<unsigned long long*>(size),
              static_cast<unsigned long long>(-removed));
  }
}

// After an upsert: drops the stash entries whose row lost its key. One thread of one warp: the
// stash holds a few hundred entries at most, and is empty but in loaded-full tables (one byte).
__global__ void stash_sweep_kernel(uint8_t* digests, int64_t* slot_keys, TableGeometry geo) {
  if (global_thread() == 0 && digests[geo.num_slots()] != 0) stash_sweep(digests, slot_keys, geo);
}

// The same after a multi-table upsert: a thread per table (the tables share no byte).
__global__ void stash_sweep_tables_kernel(const UpsertTable* tables, int64_t num_tables) {
  for (int64_t t = global_thread(); t < num_tables; t += global_threads()) {
    const UpsertTable& u = tables[t];
    if (u.digests[u.geo.num_slots()] != 0) stash_sweep(u.digests, u.slot_keys, u.geo);
  }
}

__global__ void route_kernel(const int64_t* keys, int64_t n, int64_t world_size, int64_t* ranks) {
  for (int64_t i = global_thread(); i < n; i += global_threads()) {
    ranks[i] = route_key(keys[i], world_size);
  }
}

// Blocks for `threads` threads of `block` each, capped: the kernels loop over the rest.
unsigned int capped_grid(int64_t threads, int block) {
  return static_cast<unsigned int>(std::min<int64_t>((threads + block - 1) / block, kMaxBlocks));
}

// One warp per stripe, uncapped: a stripe kernel has no grid-stride loop (<= 2^16 stripes).
unsigned int stripe_grid(int64_t stripes) {
  constexpr int64_t kWarpsPerBlock = kStripeThreads / kWarpSize;
  return static_cast<unsigned int>((stripes + kWarpsPerBlock - 1) / kWarpsPerBlock);
}

}  // namespace

cudaError_t launch_hash_find(const uint8_t* digests, const int64_t* slot_keys, int64_t capacity,
                             const int64_t* keys, int64_t n, int64_t* rows, bool* found,
                             cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const TableGeometry geo = make_geometry(capacity);
  if (reinterpret_cast<uintptr_t>(digests) % alignof(uint4) == 0) {
    hash_find_thread_kernel<<<capped_grid(n, kFindThreads), kFindThreads, 0, stream>>>(
        digests, slot_keys, geo, keys, n, rows, found);
  } else {
    hash_find_kernel<<<capped_grid(n * kWarpSize, kFindThreads), kFindThreads, 0, stream>>>(
        digests, slot_keys, geo, keys, n, rows, found);
  }
  return cudaGetLastError();
}

cudaError_t launch_key_stripes(const int64_t* keys, int64_t n, int64_t capacity, int32_t* stripes,
                               cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  key_stripes_kernel<<<capped_grid(n, kElementwiseThreads), kElementwiseThreads, 0, stream>>>(
      keys, n, make_geometry(capacity), stripes);
  return cudaGetLastError();
}

cudaError_t launch_hash_upsert(uint8_t* digests, int64_t* slot_keys, int64_t* slot_scores,
                               int64_t* size, int64_t capacity, const int64_t* keys,
                               const int64_t* given, const int32_t* sorted_stripes,
                               const int64_t* order, int64_t n, int64_t policy, int64_t clock,
                               int64_t epoch, bool assign, int64_t* rows, bool* inserted,
                               bool* evicted, int64_t* evicted_keys, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const TableGeometry geo = make_geometry(capacity);
  const Policy p = static_cast<Policy>(policy);
  const int phases = upsert_phase_count(geo.num_stripes);
  for (int phase = 0; phase < phases; ++phase) {
    hash_touch_kernel<<<stripe_grid(phase_stripes(phase, geo.num_stripes)), kStripeThreads, 0,
                        stream>>>(digests, slot_keys, slot_scores, geo, keys, given, sorted_stripes,
                                  order, n, phase, p, clock, epoch, assign, rows);
  }
  // Windows and phases come from n and the geometry (no host sync). With one phase the windows
  // do not change the order (each stripe's keys in batch order): one window.
  for (int64_t begin = 0, end; begin < n; begin = end) {
    end = phases == 1 ? n : std::min(n, begin + upsert_window(capacity, begin));
    for (int k = 0; k < phases; ++k) {
      const int phase = upsert_phase_at(k, clock, geo.num_stripes);
      hash_insert_kernel<<<stripe_grid(phase_stripes(phase, geo.num_stripes)), kStripeThreads, 0,
                           stream>>>(digests, slot_keys, slot_scores, size, geo, keys, given,
                                     sorted_stripes, order, n, phase, begin, end, p, clock, epoch,
                                     assign, rows, inserted, evicted, evicted_keys);
    }
  }
  hash_release_kernel<<<stripe_grid(geo.num_stripes), kStripeThreads, 0, stream>>>(
      digests, rows, sorted_stripes, order, n, geo.num_stripes);
  stash_sweep_kernel<<<1, kWarpSize, 0, stream>>>(digests, slot_keys, geo);
  return cudaGetLastError();
}

cudaError_t launch_hash_find_tables(const UpsertTable* tables, int64_t num_tables,
                                    const int64_t* keys, int64_t n, int64_t* rows, bool* found,
                                    cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  hash_find_tables_kernel<<<capped_grid(n, kFindThreads), kFindThreads, 0, stream>>>(
      tables, num_tables, keys, n, rows, found);
  return cudaGetLastError();
}

cudaError_t launch_key_table_stripes(const UpsertTable* tables, int64_t num_tables,
                                     const int64_t* keys, int64_t n, int32_t* table_of,
                                     int32_t* stripes, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  key_table_stripes_kernel<<<capped_grid(n, kElementwiseThreads), kElementwiseThreads, 0, stream>>>(
      tables, num_tables, keys, n, table_of, stripes);
  return cudaGetLastError();
}

cudaError_t launch_hash_upsert_tables(const UpsertTable* tables, int64_t num_tables,
                                      int64_t total_stripes, int phases, int64_t max_windows,
                                      const int64_t* windows, const int64_t* keys,
                                      const int64_t* given, const int32_t* sorted_stripes,
                                      const int64_t* order, const int32_t* touch_stripes,
                                      const int64_t* touch_order, int64_t n, bool assign,
                                      int64_t* rows, bool* inserted, bool* evicted,
                                      int64_t* evicted_keys, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const unsigned int grid = stripe_grid(total_stripes);
  hash_touch_tables_kernel<<<capped_grid(n * kWarpSize, kStripeThreads), kStripeThreads, 0,
                             stream>>>(tables, num_tables, keys, given, touch_stripes, touch_order,
                                       n, assign, rows);
  for (int64_t window = 0; window < max_windows; ++window) {
    for (int k = 0; k < phases; ++k) {
      hash_insert_tables_kernel<<<grid, kStripeThreads, 0, stream>>>(
          tables, num_tables, total_stripes, windows, keys, given, sorted_stripes, order, n, window,
          k, assign, rows, inserted, evicted, evicted_keys);
    }
  }
  hash_release_tables_kernel<<<grid, kStripeThreads, 0, stream>>>(tables, num_tables, total_stripes,
                                                                  rows, sorted_stripes, order, n);
  stash_sweep_tables_kernel<<<capped_grid(num_tables, kWarpSize), kWarpSize, 0, stream>>>(
      tables, num_tables);
  return cudaGetLastError();
}

cudaError_t launch_hash_erase(uint8_t* digests, const int64_t* slot_keys, int64_t* size,
                              int64_t capacity, const int64_t* keys, const int32_t* sorted_stripes,
                              const int64_t* order, int64_t n, bool* erased, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const TableGeometry geo = make_geometry(capacity);
  for (int phase = 0; phase < upsert_phase_count(geo.num_stripes); ++phase) {
    hash_erase_kernel<<<stripe_grid(phase_stripes(phase, geo.num_stripes)), kStripeThreads, 0,
                        stream>>>(digests, slot_keys, size, geo, keys, sorted_stripes, order, n,
                                  phase, erased);
  }
  return cudaGetLastError();
}

cudaError_t launch_route(const int64_t* keys, int64_t n, int64_t world_size, int64_t* ranks,
                         cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  route_kernel<<<capped_grid(n, kElementwiseThreads), kElementwiseThreads, 0, stream>>>(
      keys, n, world_size, ranks);
  return cudaGetLastError();
}

}  // namespace torchrec_ext
