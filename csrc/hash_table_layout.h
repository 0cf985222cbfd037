// Layout and hashing of the dynamic hash table, shared by the CPU (C++) and CUDA kernels.
// Plain C++ only: no torch headers, so .cu files can include it and compile with bare nvcc.
//
// A table of `capacity` rows is split into B = ceil(capacity / kSlotsPerBucket) buckets of
// kSlotsPerBucket slots; row = bucket * kSlotsPerBucket + slot, and rows >= capacity (the tail
// of the last bucket) are never used. Per slot we keep 17 bytes of metadata:
//   digest : uint8   0 = empty; else bit 7 = pinned (held by the call in flight), bits 0..6 = tag
//   key    : int64   any value is a valid key; occupancy lives in the digest, not the key
//   score  : int64   eviction score, larger = kept longer
// Buckets are grouped into S stripes of ~2048 slots. A key has a stripe s and two candidate
// buckets (two-choice hashing: inserts go to the emptier one): bucket1 in stripe s, bucket2 in
// the neighbour stripe (s + 1) mod S (both in the one stripe when S == 1). So buckets fill evenly
// up to load factor ~1, and keys can flow along the ring of stripes: whenever a table's rows can
// hold a set of keys, some placement of them exists w.h.p. (no stripe overflows on its own; at
// load exactly 1 a run of j stripes must absorb its keys' random excess, ~45 sqrt(j), which only
// tables of several million rows fail to).
// A mutation of a key touches stripes s and s + 1 only, so mutations are applied per stripe, in
// batch order, by one thread at a time, and in phases (upsert_phase) in which no two stripes
// being applied share a bucket: parallel, lock-free and deterministic regardless of thread count.
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define TREXT_HD __host__ __device__ __forceinline__
#else
#define TREXT_HD inline
#endif

namespace torchrec_ext {

constexpr int kSlotsPerBucket = 32;
constexpr int kBucketsPerStripeTarget = 64;  // ~2048 slots per stripe
constexpr int64_t kMaxStripes = 1 << 16;
constexpr uint8_t kPinBit = 0x80;
constexpr uint8_t kTagMask = 0x7F;

// Seeds: the bucket hash and the rank-routing hash must be independent, otherwise the keys a
// rank owns (route(k) % W == r) would land in a 1/W slice of that rank's buckets.
constexpr uint64_t kBucketSeed = 0x9E3779B97F4A7C15ull;
constexpr uint64_t kStripeSeed = 0xC2B2AE3D27D4EB4Full;
constexpr uint64_t kRouteSeed = 0x165667B19E3779F9ull;

// MurmurHash3's 64-bit finalizer: a bijection with full avalanche.
TREXT_HD uint64_t fmix64(uint64_t k) {
  k ^= k >> 33;
  k *= 0xFF51AFD7ED558CCDull;
  k ^= k >> 33;
  k *= 0xC4CEB9FE1A85EC53ull;
  k ^= k >> 33;
  return k;
}

// Maps a uniform 32-bit value onto [0, n) without division (Lemire's fastrange).
TREXT_HD uint64_t fastrange32(uint32_t x, uint64_t n) {
  return (static_cast<uint64_t>(x) * n) >> 32;
}

struct TableGeometry {
  int64_t capacity;
  int64_t num_buckets;
  int64_t num_stripes;

  int64_t stripe_width;      // num_buckets / num_stripes; the first `wide_stripes` get one more
  int64_t wide_stripes;      // num_buckets % num_stripes

  TREXT_HD int64_t num_slots() const { return num_buckets * kSlotsPerBucket; }
  // No division on the hot path: stripe s spans [begin(s), begin(s) + width(s)).
  TREXT_HD int64_t stripe_begin(int64_t s) const {
    return s * stripe_width + (s < wide_stripes ? s : wide_stripes);
  }
  TREXT_HD int64_t stripe_buckets(int64_t s) const { return stripe_width + (s < wide_stripes ? 1 : 0); }
  // Slots of bucket b that may hold keys: all of them except past `capacity` in the last one.
  TREXT_HD uint32_t usable_mask(int64_t b) const {
    int64_t left = capacity - b * kSlotsPerBucket;
    return left >= kSlotsPerBucket ? 0xFFFFFFFFu : ((1u << left) - 1u);
  }
};

// make_geometry and place_key decide which rows a key may hold: a change to either must bump
// LAYOUT_VERSION in torchrec_ext/table.py (saved rows of another layout are re-placed on load).
TREXT_HD TableGeometry make_geometry(int64_t capacity) {
  TableGeometry g;
  g.capacity = capacity;
  g.num_buckets = (capacity + kSlotsPerBucket - 1) / kSlotsPerBucket;
  int64_t stripes = g.num_buckets / kBucketsPerStripeTarget;
  if (stripes < 1) stripes = 1;
  if (stripes > kMaxStripes) stripes = kMaxStripes;
  g.num_stripes = stripes;
  g.stripe_width = g.num_buckets / stripes;
  g.wide_stripes = g.num_buckets % stripes;
  return g;
}

// Where a key may live: its stripe, two candidate buckets (bucket1 in the stripe, bucket2 in
// the next stripe on the ring; both distinct when the table has more than one bucket), and its
// 7-bit tag (1..127).
struct KeyPlace {
  int64_t stripe;
  int64_t bucket1;
  int64_t bucket2;
  uint8_t tag;
};

TREXT_HD KeyPlace place_key(int64_t key, const TableGeometry& g) {
  const uint64_t h = fmix64(static_cast<uint64_t>(key) ^ kBucketSeed);
  const uint64_t h2 = fmix64(h ^ kStripeSeed);
  KeyPlace p;
  p.stripe = static_cast<int64_t>(fastrange32(static_cast<uint32_t>(h2), g.num_stripes));
  const int64_t begin = g.stripe_begin(p.stripe);
  const int64_t width = g.stripe_buckets(p.stripe);
  const int64_t off1 = static_cast<int64_t>(fastrange32(static_cast<uint32_t>(h), width));
  p.bucket1 = begin + off1;
  if (g.num_stripes > 1) {
    const int64_t next = p.stripe + 1 == g.num_stripes ? 0 : p.stripe + 1;
    p.bucket2 = g.stripe_begin(next) +
                static_cast<int64_t>(fastrange32(static_cast<uint32_t>(h2 >> 32), g.stripe_buckets(next)));
  } else {
    int64_t off2 = off1;
    if (width > 1) {
      off2 = static_cast<int64_t>(fastrange32(static_cast<uint32_t>(h2 >> 32), width - 1));
      if (off2 >= off1) off2 += 1;
    }
    p.bucket2 = begin + off2;
  }
  p.tag = static_cast<uint8_t>((h >> 57) % 127u + 1u);
  return p;
}

// Mutations run in phases, so that the stripes applied at once never share a bucket: a key of
// stripe s touches stripes s and s + 1, so phase 0 applies the even stripes, phase 1 the odd
// ones, and phase 2 the last stripe when S is odd and >= 3 (it wraps onto stripe 0). Every pass
// that writes the table (an upsert's touch and insert passes, an erase) runs phase by phase, so
// no thread (warp) ever reads or writes a digest, key or score byte of a bucket that another
// thread writes at the same time: the kernels need no atomics and have no data race. Passes that
// write only the slots of their own keys without reading others' (the release of an upsert's
// pins) run on every stripe at once: all occurrences of a key are applied by one thread.
// A phase's new keys take free rows and cheap victims before the next phase's; so that no class
// of stripes is favoured (a batch of more new keys than rows would otherwise fill the table with
// even stripes' keys only), the batch is cut into windows (upsert_window), applied one after
// another (phases within each), and the first phase rotates with the clock.
constexpr int kUpsertPhases = 3;
constexpr int64_t kUpsertWindowFraction = 8;

TREXT_HD int upsert_phase_count(int64_t num_stripes) {
  return num_stripes == 1 ? 1 : (num_stripes >= 3 && (num_stripes & 1)) ? 3 : 2;
}

// The k-th phase applied by the call with logical clock `clock`.
TREXT_HD int upsert_phase_at(int k, int64_t clock, int64_t num_stripes) {
  const int count = upsert_phase_count(num_stripes);
  return static_cast<int>((static_cast<uint64_t>(clock) + static_cast<uint64_t>(k)) % count);
}

// Batch positions of the window that starts at position `begin`: an eighth of the capacity or of
// the positions before it, whichever is more. The rows one phase's new keys of a window can take
// ahead of the other phases' are then at most ~1/8 of the capacity or of the rows the new keys of
// earlier windows took (new keys spread through the batch), so the classes of stripes share the
// rows evenly for any batch size; yet a batch of n positions has only ~8 + 8.5 ln(n / capacity)
// windows beyond its first `capacity` positions (20 at n = 4 * capacity, 55 at 256 *): the passes
// (parallel regions, kernel launches) grow with the log of the batch, not with the batch.
TREXT_HD int64_t upsert_window(int64_t capacity, int64_t begin) {
  const int64_t by_capacity = (capacity + kUpsertWindowFraction - 1) / kUpsertWindowFraction;
  const int64_t by_batch = (begin + kUpsertWindowFraction - 1) / kUpsertWindowFraction;
  const int64_t w = by_capacity > by_batch ? by_capacity : by_batch;
  return w > 0 ? w : 1;
}

TREXT_HD int upsert_phase(int64_t stripe, int64_t num_stripes) {
  if (num_stripes >= 3 && (num_stripes & 1) && stripe == num_stripes - 1) return 2;
  return static_cast<int>(stripe & 1);
}

// Stripes of phase `phase`, in ascending order: the w-th is phase_stripe(phase, w).
TREXT_HD int64_t phase_stripes(int phase, int64_t num_stripes) {
  const bool odd_ring = num_stripes >= 3 && (num_stripes & 1);
  if (phase == 2) return odd_ring ? 1 : 0;
  const int64_t even = (num_stripes + 1) / 2 - (odd_ring ? 1 : 0);
  return phase == 0 ? even : num_stripes / 2;
}

TREXT_HD int64_t phase_stripe(int phase, int64_t w, int64_t num_stripes) {
  return phase == 2 ? num_stripes - 1 : 2 * w + phase;
}

// Owning rank of a key under row-wise sharding; independent of place_key's hash.
TREXT_HD int64_t route_key(int64_t key, int64_t world_size) {
  const uint64_t h = fmix64(static_cast<uint64_t>(key) ^ kRouteSeed);
  return static_cast<int64_t>(fastrange32(static_cast<uint32_t>(h >> 32), world_size));
}

// Eviction policies. The score a touch leaves behind:
enum class Policy : int64_t {
  kNone = 0,      // LRU-like clock, but nothing is ever evicted: a full pair of buckets refuses
  kLru = 1,       // score = logical clock of the last touch
  kLfu = 2,       // score = touch count (increment per occurrence, or caller's increments)
  kEpochLru = 3,  // score = epoch << 32 | (clock & 0xFFFFFFFF)
  kEpochLfu = 4,  // score = epoch << 32 | count within that epoch
  kCustom = 5,    // score = caller's score
};

// Score after a touch of a key that had `old` (ignored when `is_new`). `given` is the
// caller's score (custom, or an increment for lfu/epoch_lfu); has_given says if there was one.
TREXT_HD int64_t touched_score(Policy policy, bool is_new, int64_t old, bool has_given,
                               int64_t given, int64_t clock, int64_t epoch) {
  switch (policy) {
    case Policy::kNone:
    case Policy::kLru:
      return clock;
    case Policy::kLfu: {
      const int64_t inc = has_given ? given : 1;
      if (is_new) return inc;
      return old > INT64_MAX - inc ? INT64_MAX : old + inc;
    }
    case Policy::kEpochLru:
      return (epoch << 32) | (clock & 0xFFFFFFFFll);
    case Policy::kEpochLfu: {
      const int64_t inc = has_given ? given : 1;
      int64_t count = (!is_new && (old >> 32) == epoch) ? (old & 0xFFFFFFFFll) : 0;
      count = count > 0xFFFFFFFFll - inc ? 0xFFFFFFFFll : count + inc;
      return (epoch << 32) | count;
    }
    case Policy::kCustom:
    default:
      return given;
  }
}

}  // namespace torchrec_ext
