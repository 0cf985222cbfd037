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
// tables of several million rows fail to; the stash below takes the few keys left over).
// The stash (cuckoo hashing with a stash, Kirsch, Mitzenmacher and Wieder): at load exactly 1
// a few buckets are chosen by fewer keys than they hold (Hall's condition fails), so a full set
// of keys can leave a few rows empty that none of their keys may take (a 1M-row table: 0 to ~85
// of them). A stashed key lives in such a row outside its two buckets. Its row is an ordinary
// row of [0, capacity) (same row storage, same digest / key / score slot, seen by every pass
// over rows: export, TTL sweeps, stats, tiers), and an entry of the stash, stored after the main
// slots of the digest and key arrays, says where it is:
//   digests   [num_slots, +T)          the stashed key's tag (0 = free); entries packed first
//   digests   [num_slots + T, +B)      per bucket b: stash entries whose key's bucket1 is b
//                                      (saturates at 255 and then stays: only a cost)
//   slot_keys [num_slots, +T)          the row of the stashed key
//   slot_keys [num_slots + T, +T)      the stashed key
// (slot_scores has num_slots entries: a stashed key's score is its row's.) A probe that misses
// both buckets reads digests[num_slots] (0: empty stash, the usual case: one cached byte per
// miss), then the count of its bucket1, and scans the stash only when that is non-zero. An entry
// counts only while its row still holds its key (digest set, same key): a stashed row an insert
// evicted, erased or erase_rows cleared is a stale entry, never matched, and dropped by the next
// upsert (stash_sweep; an erase writes no slot_keys). A stashed key's row may lie in any stripe:
// the CPU kernels touch (pin) and erase stashed keys on one thread after the parallel phases;
// a CUDA warp does it in its phase (another warp may read that digest's tag bits, never its
// pin bit or score, so the results do not depend on timing). Only a load writes the stash
// (hash_restore, with rows from place_keys): inserts go to a key's buckets only, and may evict a
// stashed row like any other row of the bucket it lies in (by score; never a key of the call in
// flight: pinned first), so a table never holds more keys than its capacity.
// T = stash_slots(capacity): 32 per 128 of sqrt(capacity), at least 32 (256 at 1M rows, 3x the
// most a 1M-row load left over); a load with more keys than placement + stash can hold drops
// the lowest-priority ones, with a warning.
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
  int64_t stash_slots;  // T: entries of the stash

  int64_t stripe_width;  // num_buckets / num_stripes; the first `wide_stripes` get one more
  int64_t wide_stripes;  // num_buckets % num_stripes

  TREXT_HD int64_t num_slots() const { return num_buckets * kSlotsPerBucket; }
  // Array lengths: main slots, then the stash's entries (and its per-bucket counts, digests only).
  TREXT_HD int64_t digest_slots() const { return num_slots() + stash_slots + num_buckets; }
  TREXT_HD int64_t key_slots() const { return num_slots() + 2 * stash_slots; }
  // No division on the hot path: stripe s spans [begin(s), begin(s) + width(s)).
  TREXT_HD int64_t stripe_begin(int64_t s) const {
    return s * stripe_width + (s < wide_stripes ? s : wide_stripes);
  }
  TREXT_HD int64_t stripe_buckets(int64_t s) const {
    return stripe_width + (s < wide_stripes ? 1 : 0);
  }
  // Slots of bucket b that may hold keys: all of them except past `capacity` in the last one.
  TREXT_HD uint32_t usable_mask(int64_t b) const {
    int64_t left = capacity - b * kSlotsPerBucket;
    return left >= kSlotsPerBucket ? 0xFFFFFFFFu : ((1u << left) - 1u);
  }
};

// ceil(sqrt(n)) for n >= 0, bit by bit (no floating point: same on host and device).
TREXT_HD int64_t ceil_sqrt(int64_t n) {
  int64_t r = 0;
  for (int64_t bit = int64_t{1} << 31; bit > 0; bit >>= 1) {
    const int64_t c = r + bit;
    if (c <= 3037000499ll && c * c <= n) r = c;
  }
  return r * r == n ? r : r + 1;
}

constexpr int64_t kStashSqrtPerBlock = 128;  // 32 stash entries per 128 of sqrt(capacity)

TREXT_HD int64_t stash_slots(int64_t capacity) {
  const int64_t blocks = (ceil_sqrt(capacity) + kStashSqrtPerBlock - 1) / kStashSqrtPerBlock;
  return kSlotsPerBucket * (blocks > 1 ? blocks : 1);
}

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
  g.stash_slots = stash_slots(capacity);
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
    p.bucket2 =
        g.stripe_begin(next) +
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

// Whether the stash may hold a key placed at p: false for an empty stash (one byte read), else
// whether any entry's key has p's bucket1. The cheap half of stash_probe, for a hot loop to inline.
TREXT_HD bool stash_may_hold(const uint8_t* digests, const TableGeometry& g, const KeyPlace& p) {
  const int64_t base = g.num_slots();
  return digests[base] != 0 && digests[base + g.stash_slots + p.bucket1] != 0;
}

// Row of `key` (placed at p) in the stash, or -1. Read-only; see the stash's layout above.
TREXT_HD int64_t stash_probe(const uint8_t* digests, const int64_t* slot_keys,
                             const TableGeometry& g, const KeyPlace& p, int64_t key) {
  const int64_t base = g.num_slots();
  if (!stash_may_hold(digests, g, p)) return -1;
  for (int64_t j = 0; j < g.stash_slots && digests[base + j] != 0; ++j) {
    if (digests[base + j] != p.tag || slot_keys[base + g.stash_slots + j] != key) continue;
    const int64_t row = slot_keys[base + j];
    if ((digests[row] & kTagMask) == p.tag && slot_keys[row] == key) return row;
  }
  return -1;
}

// Stash writers: one thread, with no other thread touching the table's stash or the rows named.
// Adds `key`, held at `row` (outside its buckets); false when the stash is full.
TREXT_HD bool stash_add(uint8_t* digests, int64_t* slot_keys, const TableGeometry& g,
                        const KeyPlace& p, int64_t key, int64_t row) {
  const int64_t base = g.num_slots();
  int64_t j = 0;
  while (j < g.stash_slots && digests[base + j] != 0) ++j;
  if (j == g.stash_slots) return false;
  digests[base + j] = p.tag;
  slot_keys[base + j] = row;
  slot_keys[base + g.stash_slots + j] = key;
  uint8_t& count = digests[base + g.stash_slots + p.bucket1];
  if (count < 255) ++count;
  return true;
}

// Drops the stash entries whose row no longer holds their key (evicted, erased), keeping the
// others packed at the front in their order. Returns the entries left.
TREXT_HD int64_t stash_sweep(uint8_t* digests, int64_t* slot_keys, const TableGeometry& g) {
  const int64_t base = g.num_slots(), T = g.stash_slots;
  int64_t kept = 0;
  for (int64_t j = 0; j < T && digests[base + j] != 0; ++j) {
    const uint8_t tag = digests[base + j];
    const int64_t row = slot_keys[base + j], key = slot_keys[base + T + j];
    digests[base + j] = 0;
    if ((digests[row] & kTagMask) == tag && slot_keys[row] == key) {
      digests[base + kept] = tag;
      slot_keys[base + kept] = row;
      slot_keys[base + T + kept] = key;
      ++kept;
    } else {
      uint8_t& count = digests[base + T + place_key(key, g).bucket1];
      if (count < 255) --count;
    }
  }
  return kept;
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

// The score an upsert's touch leaves: the caller's score itself when it assigns one (`assign`
// with a score given), else touched_score's.
TREXT_HD int64_t upsert_score(Policy policy, bool is_new, int64_t old, bool has_given,
                              int64_t given, int64_t clock, int64_t epoch, bool assign) {
  return assign && has_given ? given
                             : touched_score(policy, is_new, old, has_given, given, clock, epoch);
}

}  // namespace torchrec_ext
