// CUDA kernels of the dynamic hash table (torch.ops.torchrec_ext.hash_*) and of `route`.
//
// Lookups are read-only and take one thread per key, all in parallel: a thread loads a bucket's 32
// digests in two 16-byte loads (byte by byte where the digests are not 16-byte aligned: a view)
// and matches four tags per 32-bit op, in the CPU kernel's scan order.
//
// Mutations must give the CPU kernels' results bit for bit (same rows, flags, evictions and
// scores). The binding sorts positions by stripe with a stable sort (each stripe's keys in batch
// order), and a warp takes a stripe. An upsert first touches and pins every key of the batch that
// holds a row: every stripe at once, a lane per key (touches of distinct keys commute; a key's
// repeats are applied in batch order by one lane). Then it inserts the others window by window of
// the batch (upsert_window) and phase by phase (upsert_phase: a key of stripe s lives in stripe s
// or s + 1, and the stripes of one phase share no bucket, so no two warps touch a bucket at once):
// in a stripe, a lane per key too, in rounds in which no two keys share a bucket and each bucket
// sees its keys in batch order, which gives the serial walk's results. Then it releases its pins.
// An erase is one pass like the touch (erases of distinct keys commute; a key's first occurrence
// reports it). No locks and no table atomics, and the results do not depend on scheduling.
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>

#include "cuda_launch.cuh"
#include "hash_table_cuda.h"
#include "hash_table_layout.h"

namespace torchrec_ext {
namespace {

static_assert(kSlotsPerBucket == kWarpSize, "a warp covers a bucket: lane l owns slot l");

constexpr int kFindThreads = 256;
constexpr int kStripeThreads = 128;
constexpr int kElementwiseThreads = 256;

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

// The stripe that this warp walks in phase `phase` (the warp's index among the phase's stripes),
// or -1 for a warp beyond them.
__device__ __forceinline__ int64_t phase_warp_stripe(int phase, const TableGeometry& geo) {
  const int64_t w = global_warp();
  return w < phase_stripes(phase, geo.num_stripes) ? phase_stripe(phase, w, geo.num_stripes) : -1;
}

// ---------------------------------------------------------------------------------------------

// A bucket's 32 digests as eight little-endian words (byte j of word w is slot 4w + j): two
// 16-byte loads, byte by byte where the digests are not 16-byte aligned (a view).
struct BucketDigests {
  uint32_t words[8];
};

__device__ __forceinline__ BucketDigests load_bucket(const uint8_t* bucket_digests) {
  BucketDigests b;
  if (reinterpret_cast<uintptr_t>(bucket_digests) % alignof(uint4) == 0) {
    const uint4* vec = reinterpret_cast<const uint4*>(bucket_digests);
    const uint4 lo = vec[0], hi = vec[1];
    b.words[0] = lo.x, b.words[1] = lo.y, b.words[2] = lo.z, b.words[3] = lo.w;
    b.words[4] = hi.x, b.words[5] = hi.y, b.words[6] = hi.z, b.words[7] = hi.w;
  } else {
    for (int w = 0; w < 8; ++w) {
      b.words[w] = 0;
      for (int j = 0; j < 4; ++j) b.words[w] |= uint32_t{bucket_digests[4 * w + j]} << (8 * j);
    }
  }
  return b;
}

// Bit 7 of each byte of `high` (0x80808080-masked) as 4 bits, byte j -> bit j.
__device__ __forceinline__ uint32_t byte_flags(uint32_t high) {
  return ((high >> 7) & 1u) | ((high >> 14) & 2u) | ((high >> 21) & 4u) | ((high >> 28) & 8u);
}

// Slot masks (bit l: slot l) of a bucket's digests, four bytes per 32-bit op: slot 4w + j is in
// the mask where bit 7 of byte j of flagged(word w) is set.
template <typename Flagged>
__device__ __forceinline__ uint32_t slot_mask(const BucketDigests& b, Flagged flagged) {
  uint32_t mask = 0;
#pragma unroll
  for (int w = 0; w < 8; ++w) mask |= byte_flags(flagged(b.words[w]) & 0x80808080u) << (4 * w);
  return mask;
}

// Slots whose tag is `tag` (pin bit ignored). Empty slots (digest 0) never match: tags are
// 1..127. A byte of x is 0 where the tag matches; every byte is <= 0x7F, so adding 0x7F to each
// carries into its bit 7 exactly when it is non-zero, and never into the next byte.
__device__ __forceinline__ uint32_t tag_mask(const BucketDigests& b, uint8_t tag) {
  const uint32_t tags = 0x01010101u * tag;
  return slot_mask(b, [tags](uint32_t word) {
    const uint32_t x = (word & 0x7F7F7F7Fu) ^ tags;
    return ~(x + 0x7F7F7F7Fu);
  });
}

// Empty slots (digest 0): a byte is non-zero when its low 7 bits carry into bit 7 or bit 7 is set.
__device__ __forceinline__ uint32_t empty_mask(const BucketDigests& b) {
  return slot_mask(b, [](uint32_t x) { return ~(((x & 0x7F7F7F7Fu) + 0x7F7F7F7Fu) | x); });
}

// Pinned slots (digest bit 7: held by the call in flight).
__device__ __forceinline__ uint32_t pinned_mask(const BucketDigests& b) {
  return slot_mask(b, [](uint32_t x) { return x; });
}

__device__ __forceinline__ uint32_t tag_matches(const uint8_t* bucket_digests, uint8_t tag) {
  return tag_mask(load_bucket(bucket_digests), tag);
}

// Row holding `key` among the tag matches of its two buckets (masks m1 of the bucket at row
// base1, m2 at base2): the lowest matching slot of bucket1, else of bucket2, as the CPU probe;
// else -1. Only tag matches read their slot's key.
__device__ __forceinline__ int64_t key_in_buckets(const int64_t* slot_keys, int64_t key,
                                                  int64_t base1, uint32_t m1, int64_t base2,
                                                  uint32_t m2) {
  for (uint32_t m = m1; m != 0; m &= m - 1) {
    const int64_t row = base1 + (__ffs(static_cast<int>(m)) - 1);
    if (slot_keys[row] == key) return row;
  }
  for (uint32_t m = m2; m != 0; m &= m - 1) {
    const int64_t row = base2 + (__ffs(static_cast<int>(m)) - 1);
    if (slot_keys[row] == key) return row;
  }
  return -1;
}

// Row holding `key`, or -1, probed by one thread: the CPU probe's answer (the lowest matching slot
// of bucket1, else of bucket2, else the stash). Both buckets' digests are loaded before any key.
__device__ __forceinline__ int64_t thread_probe(const uint8_t* digests, const int64_t* slot_keys,
                                                const TableGeometry& geo, int64_t key) {
  const KeyPlace p = place_key(key, geo);
  const uint32_t m1 = tag_matches(digests + p.bucket1 * kSlotsPerBucket, p.tag);
  const uint32_t m2 =
      p.bucket2 != p.bucket1 ? tag_matches(digests + p.bucket2 * kSlotsPerBucket, p.tag) : 0u;
  const int64_t row = key_in_buckets(slot_keys, key, p.bucket1 * kSlotsPerBucket, m1,
                                     p.bucket2 * kSlotsPerBucket, m2);
  return row >= 0 ? row : stash_probe(digests, slot_keys, geo, p, key);
}

// hash_find: thread i takes key i (grid-stride): the 32 keys of a warp load, hash and probe in
// parallel, their loads all in flight at once, and the reads of keys and writes of rows / found
// coalesce.
__global__ void hash_find_kernel(const uint8_t* digests, const int64_t* slot_keys,
                                 TableGeometry geo, const int64_t* keys, int64_t n, int64_t* rows,
                                 bool* found) {
  for (int64_t i = global_thread(); i < n; i += global_threads()) {
    const int64_t row = thread_probe(digests, slot_keys, geo, keys[i]);
    rows[i] = row;
    found[i] = row >= 0;
  }
}

__global__ void key_stripes_kernel(const int64_t* keys, int64_t n, TableGeometry geo,
                                   int32_t* stripes) {
  for (int64_t i = global_thread(); i < n; i += global_threads()) {
    stripes[i] = static_cast<int32_t>(place_key(keys[i], geo).stripe);
  }
}

// Stripe s's grouped positions are [offsets[s], offsets[s + 1]): one thread per stripe finds
// them once per call, so no walk binary-searches the batch (~40 dependent loads per warp).
__global__ void stripe_offsets_kernel(const int32_t* sorted_stripes, int64_t n, int64_t num_stripes,
                                      int64_t* offsets) {
  for (int64_t s = global_thread(); s <= num_stripes; s += global_threads()) {
    offsets[s] = lower_bound(sorted_stripes, 0, n, s);
  }
}

// The score of the key at `row` after the touches of the grouped positions chunk + l for each
// lane l of `lanes`, in lane (batch) order.
__device__ __forceinline__ int64_t touched_by(int64_t score, uint32_t lanes, const int64_t* given,
                                              const int64_t* order, int64_t chunk, Policy policy,
                                              int64_t clock, int64_t epoch, bool assign) {
  const bool has_given = given != nullptr;
  for (uint32_t m = lanes; m != 0; m &= m - 1) {
    const int64_t g = has_given ? given[order[chunk + (__ffs(static_cast<int>(m)) - 1)]] : 0;
    score = upsert_score(policy, false, score, has_given, g, clock, epoch, assign);
  }
  return score;
}

// Upsert, pass 1: touches and pins (digest bit 7) every key of the batch that holds a row, and
// marks the others (row -1) for pass 2. A touch writes only its own key's row (score, pin bit)
// and reads no byte another touch writes but pin bits, which probes mask off; so touches of
// distinct keys commute, and the pass runs every stripe at once (no phases): warp w takes stripe
// w's grouped positions 32 at a time and each lane probes its own key (thread_probe: both
// buckets, then the stash), all 32 probes in flight together. A key's occurrences share a
// stripe, so one warp applies them all in batch order: among 32 positions the lowest lane
// holding a row applies its lanes' touches in lane order (__match_any_sync on the row), and the
// __syncwarp makes its writes visible to the next 32 (shared by the per-table and the
// multi-table kernels).
__device__ __forceinline__ void touch_stripe(uint8_t* digests, const int64_t* slot_keys,
                                             int64_t* slot_scores, const TableGeometry& geo,
                                             const int64_t* keys, const int64_t* given,
                                             const int64_t* order, int64_t begin, int64_t end,
                                             Policy policy, int64_t clock, int64_t epoch,
                                             bool assign, int64_t* rows) {
  const int lane = lane_id();
  for (int64_t chunk = begin; chunk < end; chunk += kWarpSize) {
    const bool mine = chunk + lane < end;
    const int64_t pos = mine ? order[chunk + lane] : 0;
    const int64_t row = mine ? thread_probe(digests, slot_keys, geo, keys[pos]) : -1;
    if (mine) rows[pos] = row;
    const uint32_t same = __match_any_sync(kFullWarpMask, static_cast<unsigned long long>(row));
    if (row >= 0 && lane == __ffs(static_cast<int>(same)) - 1) {
      slot_scores[row] =
          touched_by(slot_scores[row], same, given, order, chunk, policy, clock, epoch, assign);
      digests[row] |= kPinBit;
    }
    __syncwarp();
  }
}

__global__ void hash_touch_kernel(uint8_t* digests, const int64_t* slot_keys, int64_t* slot_scores,
                                  TableGeometry geo, const int64_t* keys, const int64_t* given,
                                  const int64_t* stripe_offsets, const int64_t* order,
                                  Policy policy, int64_t clock, int64_t epoch, bool assign,
                                  int64_t* rows) {
  const int64_t stripe = global_warp();
  if (stripe >= geo.num_stripes) return;
  touch_stripe(digests, slot_keys, slot_scores, geo, keys, given, order, stripe_offsets[stripe],
               stripe_offsets[stripe + 1], policy, clock, epoch, assign, rows);
}

// The victim among the candidate slots of both buckets (masks cand1, cand2): the first of the
// lowest scores in the CPU's scan order (bucket1's slots ascending, then bucket2's), i.e. the
// least (score, c) with c = slot for bucket1 and 32 + slot for bucket2; a minimum that does not
// depend on the order of comparisons, so both buckets' score loads issue together. -1 when
// there is no candidate; `lowest` gets its score.
__device__ __forceinline__ int64_t pick_victim(const int64_t* slot_scores, int64_t base1,
                                               uint32_t cand1, int64_t base2, uint32_t cand2,
                                               int64_t& lowest) {
  constexpr int kNone = 2 * kSlotsPerBucket;
  int best = kNone;
  lowest = INT64_MAX;
#pragma unroll 8
  for (int l = 0; l < kSlotsPerBucket; ++l) {
    const int64_t s1 = slot_scores[base1 + l], s2 = slot_scores[base2 + l];
    if (((cand1 >> l) & 1u) != 0 && (s1 < lowest || (s1 == lowest && l < best))) {
      lowest = s1;
      best = l;
    }
    const int c2 = kSlotsPerBucket + l;
    if (((cand2 >> l) & 1u) != 0 && (s2 < lowest || (s2 == lowest && c2 < best))) {
      lowest = s2;
      best = c2;
    }
  }
  if (best == kNone) return -1;
  return best < kSlotsPerBucket ? base1 + best : base2 + (best - kSlotsPerBucket);
}

// Inserts the key of batch position `pos`, absent when the call began, by one thread: the CPU
// kernel's insert (a repeat of a key this pass inserted is touched; else the emptier bucket's
// lowest free slot, bucket1 on ties; else, both full, the lowest-score slot not pinned by this
// call, the first on ties, if the new score is not lower; else refused, keeping pass 1's row -1).
// Reads and writes the key's two buckets only. Returns whether it took a free slot.
__device__ __forceinline__ bool insert_key(uint8_t* digests, int64_t* slot_keys,
                                           int64_t* slot_scores, const TableGeometry& geo,
                                           int64_t pos, int64_t key, int64_t g, const KeyPlace& p,
                                           Policy policy, int64_t clock, int64_t epoch, bool assign,
                                           bool has_given, int64_t* rows, bool* inserted,
                                           bool* evicted, int64_t* evicted_keys) {
  const int64_t base1 = p.bucket1 * kSlotsPerBucket, base2 = p.bucket2 * kSlotsPerBucket;
  const bool two = p.bucket2 != p.bucket1;  // else bucket2's masks are empty
  const BucketDigests d1 = load_bucket(digests + base1), d2 = load_bucket(digests + base2);
  const int64_t hit = key_in_buckets(slot_keys, key, base1, tag_mask(d1, p.tag), base2,
                                     two ? tag_mask(d2, p.tag) : 0u);
  if (hit >= 0) {  // a repeat of a key inserted earlier in this walk: pinned already
    slot_scores[hit] =
        upsert_score(policy, false, slot_scores[hit], has_given, g, clock, epoch, assign);
    rows[pos] = hit;
    return false;
  }
  const int64_t new_score = upsert_score(policy, true, 0, has_given, g, clock, epoch, assign);
  const uint32_t usable1 = geo.usable_mask(p.bucket1);
  const uint32_t usable2 = two ? geo.usable_mask(p.bucket2) : 0u;
  const uint32_t free1 = empty_mask(d1) & usable1, free2 = empty_mask(d2) & usable2;
  int64_t row = -1;
  bool evicts = false;
  if ((free1 | free2) != 0) {
    row = __popc(free1) >= __popc(free2) ? base1 + (__ffs(static_cast<int>(free1)) - 1)
                                         : base2 + (__ffs(static_cast<int>(free2)) - 1);
  } else if (policy != Policy::kNone) {
    int64_t lowest;
    const int64_t victim = pick_victim(slot_scores, base1, usable1 & ~pinned_mask(d1), base2,
                                       usable2 & ~pinned_mask(d2), lowest);
    if (victim >= 0 && new_score >= lowest) {
      row = victim;
      evicts = true;
    }
  }
  if (row < 0) return false;
  rows[pos] = row;
  if (evicts) {
    evicted[pos] = true;
    evicted_keys[pos] = slot_keys[row];
  }
  inserted[pos] = true;
  slot_keys[row] = key;
  slot_scores[row] = new_score;
  digests[row] = static_cast<uint8_t>(p.tag | kPinBit);
  return !evicts;
}

// Upsert, pass 2, phase `phase` of the window [window_begin, window_end) of batch positions: warp
// w takes stripe phase_stripe(phase, w) and inserts the window's keys absent when the call began
// (row -1 after pass 1) as if one at a time in batch order, so a new key never evicts a key of
// the same call (all pinned by pass 1). An insert reads and writes only its key's two buckets,
// so inserts whose keys share no bucket commute: the warp takes the stripe's positions 32 at a
// time and applies them in rounds, each lane inserting its own key (insert_key) in the first
// round in which no earlier lane still pending shares a bucket with it (__match_any_sync on
// bucket1 and on bucket2: a key's bucket1 lies in the walked stripe and its bucket2 in the next,
// so they meet only in a one-stripe table, where every pair of keys counts as sharing). So each
// bucket sees its keys' inserts in batch order, and the results are the serial walk's; ~12 new
// keys of 64 buckets take one or two rounds. A stripe's positions ascend, so the window's slice
// of them is found by binary search: a launch costs its window's keys, not the stripe's. The walk
// of one stripe over its window's grouped positions [begin, end) (shared by the per-table and
// the multi-table kernels).
__device__ __forceinline__ void insert_stripe(
    uint8_t* digests, int64_t* slot_keys, int64_t* slot_scores, int64_t* size,
    const TableGeometry& geo, const int64_t* keys, const int64_t* given, const int64_t* order,
    int64_t begin, int64_t end, Policy policy, int64_t clock, int64_t epoch, bool assign,
    int64_t* rows, bool* inserted, bool* evicted, int64_t* evicted_keys) {
  const int lane = lane_id();
  const bool has_given = given != nullptr;
  const uint32_t earlier = (1u << lane) - 1u;
  int64_t added = 0;  // warp-uniform: a sum of ballots
  for (int64_t chunk = begin; chunk < end; chunk += kWarpSize) {
    bool todo = false;
    int64_t pos = 0, key = 0, g = 0;
    KeyPlace p{};
    if (chunk + lane < end) {
      pos = order[chunk + lane];
      todo = rows[pos] < 0;
    }
    if (todo) {
      key = keys[pos];
      g = has_given ? given[pos] : 0;
      p = place_key(key, geo);
    }
    // Lanes with nothing to insert get values no bucket has (-1 - lane: distinct, negative).
    const int64_t none = -1 - lane;
    const uint32_t same1 =
        __match_any_sync(kFullWarpMask, static_cast<unsigned long long>(todo ? p.bucket1 : none));
    const uint32_t same2 =
        __match_any_sync(kFullWarpMask, static_cast<unsigned long long>(todo ? p.bucket2 : none));
    uint32_t pending = __ballot_sync(kFullWarpMask, todo);
    const uint32_t shares = geo.num_stripes == 1 ? pending : (same1 | same2);
    while (pending != 0) {  // warp-uniform; the lowest pending lane is always ready
      const bool ready = ((pending >> lane) & 1u) != 0 && (shares & pending & earlier) == 0;
      const bool grew =
          ready && insert_key(digests, slot_keys, slot_scores, geo, pos, key, g, p, policy, clock,
                              epoch, assign, has_given, rows, inserted, evicted, evicted_keys);
      added += __popc(__ballot_sync(kFullWarpMask, grew));
      pending &= ~__ballot_sync(kFullWarpMask, ready);
      __syncwarp();  // this round's writes, visible to the next round's reads of those buckets
    }
  }
  if (lane == 0 && added != 0) {
    atomicAdd(reinterpret_cast<unsigned long long*>(size), static_cast<unsigned long long>(added));
  }
}

__global__ void hash_insert_kernel(uint8_t* digests, int64_t* slot_keys, int64_t* slot_scores,
                                   int64_t* size, TableGeometry geo, const int64_t* keys,
                                   const int64_t* given, const int64_t* stripe_offsets,
                                   const int64_t* order, int phase, int64_t window_begin,
                                   int64_t window_end, Policy policy, int64_t clock, int64_t epoch,
                                   bool assign, int64_t* rows, bool* inserted, bool* evicted,
                                   int64_t* evicted_keys) {
  const int64_t stripe = phase_warp_stripe(phase, geo);
  if (stripe < 0) return;
  const int64_t first = stripe_offsets[stripe], last = stripe_offsets[stripe + 1];
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
    const unsigned same = __match_any_sync(kFullWarpMask, static_cast<unsigned long long>(row));
    if (row >= 0 && lane == __ffs(static_cast<int>(same)) - 1) digests[row] &= kTagMask;
    __syncwarp();
  }
}

__global__ void hash_release_kernel(uint8_t* digests, const int64_t* rows,
                                    const int64_t* stripe_offsets, const int64_t* order,
                                    int64_t num_stripes) {
  const int64_t stripe = global_warp();
  if (stripe >= num_stripes) return;
  release_stripe(digests, rows, order, stripe_offsets[stripe], stripe_offsets[stripe + 1]);
}

// ---- hash_upsert_tables: the passes above, each one grid over every table: warp g takes global
// stripe g (its table's stripe g - stripe_begin) and runs the per-stripe walk of the per-table
// kernel with that table's arrays and parameters, in the same phases and windows. The tables
// share no byte, so each table's results are exactly its per-table launches'.

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
// hash_find_kernel.
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

// Pass 1 of every table at once: warp g takes global stripe g and touches it as the per-table
// kernel does.
__global__ void hash_touch_tables_kernel(const UpsertTable* tables, int64_t num_tables,
                                         int64_t total_stripes, const int64_t* keys,
                                         const int64_t* given, const int64_t* stripe_offsets,
                                         const int64_t* order, bool assign, int64_t* rows) {
  const int64_t g = global_warp();
  if (g >= total_stripes) return;
  const UpsertTable t = tables[table_of_stripe(tables, num_tables, g)];
  touch_stripe(t.digests, t.slot_keys, t.slot_scores, t.geo, keys, given, order, stripe_offsets[g],
               stripe_offsets[g + 1], static_cast<Policy>(t.policy), t.clock, t.epoch, assign,
               rows);
}

// Pass 2, window `window` and k-th phase of every table (each table's phase order rotating with
// its own clock; a table with fewer windows or phases sits the rest out).
__global__ void hash_insert_tables_kernel(const UpsertTable* tables, int64_t num_tables,
                                          int64_t total_stripes, const int64_t* windows,
                                          const int64_t* keys, const int64_t* given,
                                          const int64_t* stripe_offsets, const int64_t* order,
                                          int64_t window, int k, bool assign, int64_t* rows,
                                          bool* inserted, bool* evicted, int64_t* evicted_keys) {
  const int64_t g = global_warp();
  if (g >= total_stripes) return;
  const UpsertTable t = tables[table_of_stripe(tables, num_tables, g)];
  const int64_t stripe = g - t.stripe_begin, stripes = t.geo.num_stripes;
  if (window >= t.windows || k >= upsert_phase_count(stripes) ||
      upsert_phase(stripe, stripes) != upsert_phase_at(k, t.clock, stripes)) {
    return;
  }
  const int64_t first = stripe_offsets[g], last = stripe_offsets[g + 1];
  const int64_t begin = lower_bound(order, first, last, windows[t.window_begin + window]);
  const int64_t end = lower_bound(order, begin, last, windows[t.window_begin + window + 1]);
  insert_stripe(t.digests, t.slot_keys, t.slot_scores, t.size, t.geo, keys, given, order, begin,
                end, static_cast<Policy>(t.policy), t.clock, t.epoch, assign, rows, inserted,
                evicted, evicted_keys);
}

__global__ void hash_release_tables_kernel(const UpsertTable* tables, int64_t num_tables,
                                           int64_t total_stripes, const int64_t* rows,
                                           const int64_t* stripe_offsets, const int64_t* order) {
  const int64_t g = global_warp();
  if (g >= total_stripes) return;
  release_stripe(tables[table_of_stripe(tables, num_tables, g)].digests, rows, order,
                 stripe_offsets[g], stripe_offsets[g + 1]);
}

// Every stripe at once, a lane per key, as the upsert's touch: an erase clears only its own key's
// digest, and a probe of another key reading that byte (as the tag or as 0) finds no key there
// either way, so erases of distinct keys commute and need no phases. Warp w takes stripe w's
// positions 32 at a time; a key's occurrences share a stripe, so among 32 positions the lowest
// lane holding a row clears it and reports the erase (__match_any_sync on the row), and after the
// __syncwarp a later occurrence finds the key gone: only the first in batch order reports. A
// stashed key's row may lie in another stripe; its stash entry is then stale, dropped by the
// next upsert.
__global__ void hash_erase_kernel(uint8_t* digests, const int64_t* slot_keys, int64_t* size,
                                  TableGeometry geo, const int64_t* keys,
                                  const int32_t* sorted_stripes, const int64_t* order, int64_t n,
                                  bool* erased) {
  const int64_t stripe = global_warp();
  if (stripe >= geo.num_stripes) return;
  const int lane = lane_id();
  const int64_t begin = lower_bound(sorted_stripes, 0, n, stripe);
  const int64_t end = lower_bound(sorted_stripes, begin, n, stripe + 1);
  int64_t removed = 0;  // warp-uniform: a sum of ballots
  for (int64_t chunk = begin; chunk < end; chunk += kWarpSize) {
    const bool mine = chunk + lane < end;
    const int64_t pos = mine ? order[chunk + lane] : 0;
    const int64_t row = mine ? thread_probe(digests, slot_keys, geo, keys[pos]) : -1;
    const uint32_t same = __match_any_sync(kFullWarpMask, static_cast<unsigned long long>(row));
    const bool first = row >= 0 && lane == __ffs(static_cast<int>(same)) - 1;
    if (first) {
      digests[row] = 0;
      erased[pos] = true;
    }
    removed += __popc(__ballot_sync(kFullWarpMask, first));
    __syncwarp();
  }
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
  hash_find_kernel<<<capped_grid(n, kFindThreads), kFindThreads, 0, stream>>>(
      digests, slot_keys, make_geometry(capacity), keys, n, rows, found);
  return cudaGetLastError();
}

cudaError_t launch_key_stripes(const int64_t* keys, int64_t n, int64_t capacity, int32_t* stripes,
                               cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  key_stripes_kernel<<<capped_grid(n, kElementwiseThreads), kElementwiseThreads, 0, stream>>>(
      keys, n, make_geometry(capacity), stripes);
  return cudaGetLastError();
}

// The grouped positions' stripe offsets (stripe_offsets_kernel), num_stripes + 1 of them.
cudaError_t launch_stripe_offsets(const int32_t* sorted_stripes, int64_t n, int64_t num_stripes,
                                  int64_t* offsets, cudaStream_t stream) {
  stripe_offsets_kernel<<<capped_grid(num_stripes + 1, kElementwiseThreads), kElementwiseThreads, 0,
                          stream>>>(sorted_stripes, n, num_stripes, offsets);
  return cudaGetLastError();
}

cudaError_t launch_hash_upsert(uint8_t* digests, int64_t* slot_keys, int64_t* slot_scores,
                               int64_t* size, int64_t capacity, const int64_t* keys,
                               const int64_t* given, const int32_t* sorted_stripes,
                               const int64_t* order, int64_t n, int64_t* stripe_offsets,
                               int64_t policy, int64_t clock, int64_t epoch, bool assign,
                               int64_t* rows, bool* inserted, bool* evicted, int64_t* evicted_keys,
                               cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const TableGeometry geo = make_geometry(capacity);
  const Policy p = static_cast<Policy>(policy);
  const cudaError_t offsets =
      launch_stripe_offsets(sorted_stripes, n, geo.num_stripes, stripe_offsets, stream);
  if (offsets != cudaSuccess) return offsets;
  hash_touch_kernel<<<stripe_grid(geo.num_stripes), kStripeThreads, 0, stream>>>(
      digests, slot_keys, slot_scores, geo, keys, given, stripe_offsets, order, p, clock, epoch,
      assign, rows);
  // Windows and phases come from n and the geometry (no host sync). With one phase the windows
  // do not change the order (each stripe's keys in batch order): one window.
  const int phases = upsert_phase_count(geo.num_stripes);
  for (int64_t begin = 0, end; begin < n; begin = end) {
    end = phases == 1 ? n : std::min(n, begin + upsert_window(capacity, begin));
    for (int k = 0; k < phases; ++k) {
      const int phase = upsert_phase_at(k, clock, geo.num_stripes);
      hash_insert_kernel<<<stripe_grid(phase_stripes(phase, geo.num_stripes)), kStripeThreads, 0,
                           stream>>>(digests, slot_keys, slot_scores, size, geo, keys, given,
                                     stripe_offsets, order, phase, begin, end, p, clock, epoch,
                                     assign, rows, inserted, evicted, evicted_keys);
    }
  }
  hash_release_kernel<<<stripe_grid(geo.num_stripes), kStripeThreads, 0, stream>>>(
      digests, rows, stripe_offsets, order, geo.num_stripes);
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
                                      const int64_t* order, int64_t n, int64_t* stripe_offsets,
                                      bool assign, int64_t* rows, bool* inserted, bool* evicted,
                                      int64_t* evicted_keys, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const cudaError_t offsets =
      launch_stripe_offsets(sorted_stripes, n, total_stripes, stripe_offsets, stream);
  if (offsets != cudaSuccess) return offsets;
  const unsigned int grid = stripe_grid(total_stripes);
  hash_touch_tables_kernel<<<grid, kStripeThreads, 0, stream>>>(
      tables, num_tables, total_stripes, keys, given, stripe_offsets, order, assign, rows);
  for (int64_t window = 0; window < max_windows; ++window) {
    for (int k = 0; k < phases; ++k) {
      hash_insert_tables_kernel<<<grid, kStripeThreads, 0, stream>>>(
          tables, num_tables, total_stripes, windows, keys, given, stripe_offsets, order, window, k,
          assign, rows, inserted, evicted, evicted_keys);
    }
  }
  hash_release_tables_kernel<<<grid, kStripeThreads, 0, stream>>>(tables, num_tables, total_stripes,
                                                                  rows, stripe_offsets, order);
  stash_sweep_tables_kernel<<<capped_grid(num_tables, kWarpSize), kWarpSize, 0, stream>>>(
      tables, num_tables);
  return cudaGetLastError();
}

cudaError_t launch_hash_erase(uint8_t* digests, const int64_t* slot_keys, int64_t* size,
                              int64_t capacity, const int64_t* keys, const int32_t* sorted_stripes,
                              const int64_t* order, int64_t n, bool* erased, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const TableGeometry geo = make_geometry(capacity);
  hash_erase_kernel<<<stripe_grid(geo.num_stripes), kStripeThreads, 0, stream>>>(
      digests, slot_keys, size, geo, keys, sorted_stripes, order, n, erased);
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
