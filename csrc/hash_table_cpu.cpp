// CPU kernels of the dynamic hash table (torch.ops.torchrec_ext.hash_*) and of `route`.
//
// Speed comes from memory-level parallelism: a bucket's 32 digests are matched with two SIMD
// compares, and the buckets of key i + kPrefetchDistance are prefetched while key i is probed
// (finds: groups of kFindGroup ids in a pipeline, see find_ids). Lookups run in parallel over
// keys. Mutations are grouped by stripe (a stable counting sort)
// and each stripe's keys are applied by one thread in batch order, so results do not depend on
// the thread count. A key of stripe s lives in stripe s or s + 1, so a mutating pass runs phase by
// phase (upsert_phase: the stripes of one phase share no bucket, so no two threads touch the same
// bucket at once). An upsert runs two passes: first every key of the batch that already holds a
// row is touched and pinned, then, once that is done everywhere, the others are inserted one at
// a time in batch order per stripe, window by window of the batch (upsert_window) and phase by
// phase within a window. No key of the call can be evicted by the call. Small passes run on the
// calling thread (kInlineKeys).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "hash_table_checks.h"
#include "hash_table_layout.h"

namespace torchrec_ext {
namespace {

constexpr int kPrefetchDistance = 16;
constexpr int64_t kGrainKeys = 4096;

struct TableRef {
  uint8_t* digests;
  int64_t* keys;
  int64_t* scores;
  TableGeometry geo;
};

inline uint32_t lowest_bit(uint32_t m) { return static_cast<uint32_t>(__builtin_ctz(m)); }
// Slot of the lowest / highest set bit of a bucket's match mask; some slot of the bucket (31 / 0)
// when it is empty, so that callers need no branch.
inline uint32_t first_match(uint32_t m) {
  return static_cast<uint32_t>(__builtin_ctz(m | 0x80000000u));
}
inline uint32_t last_match(uint32_t m) {
  return 31u - static_cast<uint32_t>(__builtin_clz(m | 1u));
}

// Bit i set when slot i of the bucket holds `tag` (the pin bit is ignored).
inline uint32_t match_tag(const uint8_t* d, uint8_t tag) {
#if defined(__SSE2__)
  const __m128i mask = _mm_set1_epi8(static_cast<char>(kTagMask));
  const __m128i want = _mm_set1_epi8(static_cast<char>(tag));
  const __m128i lo = _mm_and_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d)), mask);
  const __m128i hi = _mm_and_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + 16)), mask);
  return static_cast<uint32_t>(_mm_movemask_epi8(_mm_cmpeq_epi8(lo, want))) |
         (static_cast<uint32_t>(_mm_movemask_epi8(_mm_cmpeq_epi8(hi, want))) << 16);
#else
  uint32_t m = 0;
  for (int i = 0; i < kSlotsPerBucket; ++i)
    m |= static_cast<uint32_t>((d[i] & kTagMask) == tag) << i;
  return m;
#endif
}

// Bit i set when slot i is empty.
inline uint32_t match_empty(const uint8_t* d) {
#if defined(__SSE2__)
  const __m128i zero = _mm_setzero_si128();
  const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(d));
  const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(d + 16));
  return static_cast<uint32_t>(_mm_movemask_epi8(_mm_cmpeq_epi8(lo, zero))) |
         (static_cast<uint32_t>(_mm_movemask_epi8(_mm_cmpeq_epi8(hi, zero))) << 16);
#else
  uint32_t m = 0;
  for (int i = 0; i < kSlotsPerBucket; ++i) m |= static_cast<uint32_t>(d[i] == 0) << i;
  return m;
#endif
}

// Bit i set when slot i is pinned (the pin bit is the digest's sign bit).
static_assert(kPinBit == 0x80, "match_pinned reads the pin bit as the sign bit of each digest");
inline uint32_t match_pinned(const uint8_t* d) {
#if defined(__SSE2__)
  return static_cast<uint32_t>(
             _mm_movemask_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d)))) |
         (static_cast<uint32_t>(
              _mm_movemask_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + 16))))
          << 16);
#else
  uint32_t m = 0;
  for (int i = 0; i < kSlotsPerBucket; ++i) m |= static_cast<uint32_t>((d[i] & kPinBit) != 0) << i;
  return m;
#endif
}

inline void prefetch_buckets(const TableRef& t, const KeyPlace& p) {
  __builtin_prefetch(t.digests + p.bucket1 * kSlotsPerBucket);
  __builtin_prefetch(t.digests + p.bucket2 * kSlotsPerBucket);
}

// What a pass over keys will read and write once it visits a key, so what to prefetch.
enum class Prefetch {
  kFind,    // find, erase: the key lines its tag matches
  kTouch,   // upsert's first pass: also the score lines of those matches (a found key's score
            // is rewritten)
  kInsert,  // upsert's second pass (keys absent when the call began): also the lines of the free
            // slot the key will most likely take, or, in a full pair, every score line (the
            // victim search) and key line (the victim's key is reported, then overwritten)
};

// Once a key's digests are cached: prefetch the lines `kMode` says the visit will touch.
template <Prefetch kMode>
inline void prefetch_matches(const TableRef& t, const KeyPlace& p) {
  for (const int64_t bucket : {p.bucket1, p.bucket2}) {
    const int64_t base = bucket * kSlotsPerBucket;
    for (uint32_t m = match_tag(t.digests + base, p.tag); m != 0; m &= m - 1) {
      const int64_t row = base + lowest_bit(m);
      __builtin_prefetch(t.keys + row);
      if (kMode == Prefetch::kTouch) __builtin_prefetch(t.scores + row, 1);
    }
  }
  if (kMode != Prefetch::kInsert) return;
  // A tag match here is a collision or a repeat of a key this pass inserted: the key is new.
  const uint32_t free1 = match_empty(t.digests + p.bucket1 * kSlotsPerBucket);
  const uint32_t free2 = match_empty(t.digests + p.bucket2 * kSlotsPerBucket);
  if (free1 | free2) {
    const int64_t row = __builtin_popcount(free1) >= __builtin_popcount(free2)
                            ? p.bucket1 * kSlotsPerBucket + lowest_bit(free1)
                            : p.bucket2 * kSlotsPerBucket + lowest_bit(free2);
    __builtin_prefetch(t.keys + row, 1);
    __builtin_prefetch(t.scores + row, 1);
    return;
  }
  constexpr int kScoresPerLine = 64 / sizeof(int64_t);
  for (const int64_t bucket : {p.bucket1, p.bucket2}) {
    for (int slot = 0; slot < kSlotsPerBucket; slot += kScoresPerLine) {
      __builtin_prefetch(t.scores + bucket * kSlotsPerBucket + slot, 1);
      __builtin_prefetch(t.keys + bucket * kSlotsPerBucket + slot, 1);
    }
  }
}

inline int64_t probe_bucket(const TableRef& t, int64_t bucket, uint8_t tag, int64_t key) {
  const int64_t base = bucket * kSlotsPerBucket;
  for (uint32_t m = match_tag(t.digests + base, tag); m != 0; m &= m - 1) {
    const int64_t row = base + lowest_bit(m);
    if (t.keys[row] == key) return row;
  }
  return -1;
}

// Row holding `key`, or -1.
inline int64_t probe(const TableRef& t, const KeyPlace& p, int64_t key) {
  const int64_t row = probe_bucket(t, p.bucket1, p.tag, key);
  if (row >= 0 || p.bucket2 == p.bucket1) return row;
  return probe_bucket(t, p.bucket2, p.tag, key);
}

// Row of `key` in the stash, or -1: out of line, so the probe loops that call it on a miss
// (rarely past stash_may_hold's byte) stay small.
[[gnu::noinline]] int64_t stash_row(const TableRef& t, const KeyPlace& p, int64_t key) {
  return stash_probe(t.digests, t.keys, t.geo, p, key);
}

// Visits the keys of places place_at(0..count-1) as a three-stage software pipeline, so the
// DRAM misses of many keys overlap: the buckets of key j + 2D are prefetched, the key lines
// matching key j + D's tag are prefetched (its digests arrived meanwhile), and key j is handed to
// visit(j, place) with its lines in cache.
template <Prefetch kMode, typename PlaceAt, typename Visit>
inline void for_each_prefetched(const TableRef& t, int64_t count, PlaceAt place_at, Visit visit) {
  constexpr int64_t D = kPrefetchDistance;
  constexpr int64_t kRing = 4 * D;  // holds positions j .. j + 2D
  static_assert((kRing & (kRing - 1)) == 0, "ring size must be a power of two");
  KeyPlace ring[kRing];
  auto fetch_buckets = [&](int64_t j) {
    ring[j & (kRing - 1)] = place_at(j);
    prefetch_buckets(t, ring[j & (kRing - 1)]);
  };
  for (int64_t j = 0; j < std::min(count, 2 * D); ++j) fetch_buckets(j);
  for (int64_t j = 0; j < std::min(count, D); ++j)
    prefetch_matches<kMode>(t, ring[j & (kRing - 1)]);
  for (int64_t j = 0; j < count; ++j) {
    if (j + 2 * D < count) fetch_buckets(j + 2 * D);
    if (j + D < count) prefetch_matches<kMode>(t, ring[(j + D) & (kRing - 1)]);
    visit(j, ring[j & (kRing - 1)]);
  }
}

TableRef table_ref(const at::Tensor& digests, const at::Tensor& slot_keys,
                   const at::Tensor* slot_scores, int64_t capacity) {
  return TableRef{digests.data_ptr<uint8_t>(), slot_keys.data_ptr<int64_t>(),
                  slot_scores ? slot_scores->data_ptr<int64_t>() : nullptr,
                  make_geometry(capacity)};
}

// A batch grouped by stripe with a stable counting sort: position j of the grouping holds key
// keys[j] = input[order[j]]; group g owns positions [offsets[g], offsets[g + 1]), in batch
// order. Groups are phase-major: phase f's groups are [f * R, (f + 1) * R) (R = ranges()), and
// group f * R + r holds the keys of the stripes of phase f among the r-th of R runs of whole
// stripes (R <= kMaxRanges, so the scatter writes to few places at once). Keys of one stripe
// keep their batch order and share a group, which is all that matters: the stripes applied at
// once (one phase) never share a bucket.
constexpr int64_t kMaxRanges = 128;

// The buffers live on as thread-local scratch, so a steady stream of calls does not pay for
// fresh pages (faulting in ~20 MB per million keys) on every call.
struct StripeGroups {
  std::vector<int64_t> order;
  std::vector<int64_t> keys;
  std::vector<int64_t> offsets;
  std::vector<int32_t> group_of;  // per input position, during the sort

  int64_t groups() const { return static_cast<int64_t>(offsets.size()) - 1; }
  int64_t ranges() const { return groups() / kUpsertPhases; }
};

template <typename T>
void grow(std::vector<T>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(n);
}

const StripeGroups& group_by_stripe(const int64_t* keys, int64_t n, const TableGeometry& g) {
  thread_local StripeGroups scratch;
  StripeGroups& out =
      scratch;  // the caller's instance: worker threads below must not see their own
  const int64_t R = std::min(g.num_stripes, kMaxRanges);
  const int64_t P = kUpsertPhases * R;
  const int64_t chunks = std::max<int64_t>(
      1, std::min<int64_t>(at::get_num_threads(), (n + kGrainKeys - 1) / kGrainKeys));
  const int64_t chunk_len = (n + chunks - 1) / chunks;
  grow(out.group_of, n);
  grow(out.order, n);
  grow(out.keys, n);
  out.offsets.assign(P + 1, 0);
  int32_t* group_of = out.group_of.data();
  std::vector<int64_t> cursors(chunks * P, 0);
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      int64_t* count = cursors.data() + c * P;
      for (int64_t i = c * chunk_len, e = std::min(n, (c + 1) * chunk_len); i < e; ++i) {
        const int64_t stripe = place_key(keys[i], g).stripe;
        const int32_t s = static_cast<int32_t>(upsert_phase(stripe, g.num_stripes) * R +
                                               stripe * R / g.num_stripes);
        group_of[i] = s;
        ++count[s];
      }
    }
  });
  int64_t running = 0;
  for (int64_t s = 0; s < P; ++s) {
    out.offsets[s] = running;
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t k = cursors[c * P + s];
      cursors[c * P + s] = running;  // now chunk c's write cursor in stripe s
      running += k;
    }
  }
  out.offsets[P] = running;
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      int64_t* cursor = cursors.data() + c * P;
      for (int64_t i = c * chunk_len, e = std::min(n, (c + 1) * chunk_len); i < e; ++i) {
        const int64_t j = cursor[group_of[i]]++;
        out.order[j] = i;
        out.keys[j] = keys[i];
      }
    }
  });
  return out;
}

// A pass over fewer keys than this runs on the calling thread: a parallel region would cost
// about as much as it saves, and on a busy machine far more (it waits for a descheduled worker:
// milliseconds). An upsert of a batch much larger than its table runs a few dozen insert passes
// (windows times phases), most of them small. Releasing a pin is a few cached byte writes, so
// the release pass runs inline below kInlineReleases.
constexpr int64_t kInlineKeys = 512;
constexpr int64_t kInlineReleases = 16 * kInlineKeys;

// Runs fn(g0, g1) on ranges of the groups [first, last) that hold `work` keys to apply, in
// parallel unless work < kInlineKeys: one thread owns a group, so it applies each of its stripes'
// keys in batch order, and its prefetch pipeline runs on across the group boundaries of its range.
template <typename Fn>
void for_each_group_range(int64_t first, int64_t last, int64_t work, Fn fn,
                          int64_t inline_below = kInlineKeys) {
  if (work <= 0) return;
  if (work < inline_below) {
    fn(first, last);
    return;
  }
  at::parallel_for(first, last, 1, fn);
}

// Runs fn(g0, g1) on the groups of each phase in turn (see for_each_group_range).
template <typename Fn>
void for_each_phase_group_range(const StripeGroups& groups, Fn fn) {
  const int64_t R = groups.ranges();
  for (int phase = 0; phase < kUpsertPhases; ++phase) {
    const int64_t g0 = phase * R, g1 = g0 + R;
    for_each_group_range(g0, g1, groups.offsets[g1] - groups.offsets[g0], fn);
  }
}

// ---------------------------------------------------------------------------------------------
// Find: ids go through in groups of kFindGroup, a three-stage pipeline over groups (the batched
// lookups of Swiss / F14 tables), so the misses of ~3 groups' ids are in flight at once: group
// k + 2's places are computed and both buckets' digest lines prefetched; group k + 1's digests
// (arrived meanwhile) are matched against their tags (SIMD) and the key lines of the matches
// prefetched; group k's keys are confirmed (bucket1's matches, then bucket2's, lowest slot first,
// as probe does) and, on a miss, the stash probed. Read-only, so any split of the ids into
// parallel chunks gives the same rows.
constexpr int kFindGroup = 16;

struct FindId {
  const TableRef* t;
  int64_t key;
  KeyPlace p;
  uint32_t match1, match2;  // tag matches in bucket1 / bucket2 (match2 = 0 when they are one)
};

// Finds ids [0, n): id_at(j, table, key) names id j's table and key, called for j = 0, 1, ...
// in order (so a caller may walk its tables with a cursor). Writes rows[j] (-1: absent), found[j].
template <typename IdAt>
void find_ids(int64_t n, IdAt id_at, int64_t* rows, bool* found) {
  constexpr int G = kFindGroup;
  FindId ring[3][G];
  const int64_t groups = (n + G - 1) / G;
  auto group_size = [&](int64_t g) { return static_cast<int>(std::min<int64_t>(G, n - g * G)); };
  auto place = [&](int64_t g) {
    FindId* ids = ring[g % 3];
    for (int j = 0, e = group_size(g); j < e; ++j) {
      FindId& f = ids[j];
      id_at(g * G + j, f.t, f.key);
      f.p = place_key(f.key, f.t->geo);
      prefetch_buckets(*f.t, f.p);
    }
  };
  auto match = [&](int64_t g) {
    FindId* ids = ring[g % 3];
    for (int j = 0, e = group_size(g); j < e; ++j) {
      FindId& f = ids[j];
      const int64_t base1 = f.p.bucket1 * kSlotsPerBucket, base2 = f.p.bucket2 * kSlotsPerBucket;
      f.match1 = match_tag(f.t->digests + base1, f.p.tag);
      f.match2 = f.p.bucket2 == f.p.bucket1 ? 0u : match_tag(f.t->digests + base2, f.p.tag);
      // The key lines of the lowest and highest match of each bucket, with no branch on how many
      // matches there are (unpredictable: a mispredict costs about as much as the rest of an
      // id's work); a bucket without a match prefetches this FindId's own (cached) line instead.
      const int64_t* keys = f.t->keys;
      auto line = [&](uint32_t m, int64_t row) {
        return m != 0 ? static_cast<const void*>(keys + row) : &f;
      };
      __builtin_prefetch(line(f.match1, base1 + first_match(f.match1)));
      __builtin_prefetch(line(f.match1, base1 + last_match(f.match1)));
      __builtin_prefetch(line(f.match2, base2 + first_match(f.match2)));
      __builtin_prefetch(line(f.match2, base2 + last_match(f.match2)));
    }
  };
  auto confirm = [&](int64_t g) {
    const FindId* ids = ring[g % 3];
    for (int j = 0, e = group_size(g); j < e; ++j) {
      const FindId& f = ids[j];
      const int64_t* keys = f.t->keys;
      // Fast path, branch-free: each bucket's lowest match (a key is held in one row only, so a
      // key at bucket2's lowest match is in no slot of bucket1). Else (a false tag match below
      // the key, an absent or a stashed key) every match in probe's order, then the stash.
      // A bucket without a match reads `other` (cached, never the key): no load of an unfetched
      // line.
      const int64_t other = ~f.key;
      const int64_t r1 = f.p.bucket1 * kSlotsPerBucket + first_match(f.match1);
      const int64_t r2 = f.p.bucket2 * kSlotsPerBucket + first_match(f.match2);
      const bool hit1 = *(f.match1 != 0 ? keys + r1 : &other) == f.key;
      const bool hit2 = *(f.match2 != 0 ? keys + r2 : &other) == f.key;
      int64_t row = hit1 ? r1 : hit2 ? r2 : -1;
      if (__builtin_expect(row < 0, 0)) {
        row = probe(*f.t, f.p, f.key);
        if (row < 0 && __builtin_expect(stash_may_hold(f.t->digests, f.t->geo, f.p), 0))
          row = stash_row(*f.t, f.p, f.key);
      }
      rows[g * G + j] = row;
      found[g * G + j] = row >= 0;
    }
  };
  for (int64_t g = 0; g < std::min<int64_t>(groups, 2); ++g) place(g);
  if (groups > 0) match(0);
  for (int64_t g = 0; g < groups; ++g) {
    if (g + 2 < groups) place(g + 2);
    if (g + 1 < groups) match(g + 1);
    confirm(g);
  }
}

std::tuple<at::Tensor, at::Tensor> hash_find_cpu(const at::Tensor& digests,
                                                 const at::Tensor& slot_keys,
                                                 const at::Tensor& keys, int64_t capacity) {
  check_table("hash_find", digests, slot_keys, capacity);
  check_keys("hash_find", keys);
  const at::Tensor k = keys.contiguous();
  const int64_t n = k.numel();
  at::Tensor rows = at::empty({n}, k.options());
  at::Tensor found = at::empty({n}, k.options().dtype(at::kBool));
  const TableRef t = table_ref(digests, slot_keys, nullptr, capacity);
  const int64_t* kp = k.data_ptr<int64_t>();
  int64_t* rp = rows.data_ptr<int64_t>();
  bool* fp = found.data_ptr<bool>();
  at::parallel_for(0, n, kGrainKeys, [&](int64_t begin, int64_t end) {
    find_ids(
        end - begin,
        [&](int64_t j, const TableRef*& table, int64_t& key) {
          table = &t;
          key = kp[begin + j];
        },
        rp + begin, fp + begin);
  });
  return {rows, found};
}

// Slot that a new key takes in a pair of buckets with no free slot: the lowest-score slot not
// held by this call (the first on ties), or -1 when every slot is held.
inline int64_t pick_victim(const TableRef& t, const KeyPlace& p) {
  int64_t victim = -1, lowest = 0;
  const int num_buckets = p.bucket2 == p.bucket1 ? 1 : 2;
  for (int c = 0; c < num_buckets; ++c) {
    const int64_t bucket = c == 0 ? p.bucket1 : p.bucket2;
    const int64_t base = bucket * kSlotsPerBucket;
    for (uint32_t m = t.geo.usable_mask(bucket) & ~match_pinned(t.digests + base); m != 0;
         m &= m - 1) {
      const int64_t r = base + lowest_bit(m);
      const int64_t score = t.scores[r];
      if (victim < 0 || score < lowest) {
        victim = r;
        lowest = score;
      }
    }
  }
  return victim;
}

// A key of an upsert's batch that held no row when the call began: its position in the
// grouping and its place (so pass 2 does not hash it again).
struct AbsentKey {
  int64_t at;
  KeyPlace place;
};

// Absent keys [first[g], last[g]) of each group from `g` on, as one sequence (for one prefetch
// pipeline); group g's k-th absent key is absent[offsets[g] + k].
struct AbsentWalk {
  const AbsentKey* absent;
  const int64_t* offsets;
  const int64_t* first;
  const int64_t* last;
  int64_t g;
  int64_t k;

  const AbsentKey& next() {
    while (k == last[g]) k = first[++g];
    return absent[offsets[g] + k++];
  }
};

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> hash_upsert_cpu(
    at::Tensor& digests, at::Tensor& slot_keys, at::Tensor& slot_scores, at::Tensor& size,
    const at::Tensor& keys, const std::optional<at::Tensor>& scores, int64_t capacity,
    int64_t policy_id, int64_t clock, int64_t epoch, bool assign) {
  check_table("hash_upsert", digests, slot_keys, capacity);
  check_keys("hash_upsert", keys);
  check_size("hash_upsert", size);
  check_slot_scores("hash_upsert", slot_scores, capacity);
  const TableGeometry geo = make_geometry(capacity);
  const Policy policy = static_cast<Policy>(policy_id);
  const at::Tensor k = keys.contiguous();
  const int64_t n = k.numel();
  const at::Tensor given = check_upsert_args(n, scores, policy_id, clock, epoch);

  at::Tensor rows = at::empty({n}, k.options());
  at::Tensor inserted = at::zeros({n}, k.options().dtype(at::kBool));
  const TableRef t = table_ref(digests, slot_keys, &slot_scores, capacity);
  const int64_t* gp = given.defined() ? given.data_ptr<int64_t>() : nullptr;
  int64_t* rp = rows.data_ptr<int64_t>();
  bool* ip = inserted.data_ptr<bool>();
  // (input position, evicted key) pairs; few, so gathered per thread and merged at the end.
  std::vector<std::pair<int64_t, int64_t>> evictions;
  std::mutex evictions_mutex;
  std::atomic<int64_t> size_delta{0};

  const StripeGroups& groups = group_by_stripe(k.data_ptr<int64_t>(), n, geo);
  const int64_t* order = groups.order.data();
  const bool has_given = gp != nullptr;
  // Gives the key of input position i, found at `row`, its touched score and pins the row.
  auto touch = [&](int64_t i, int64_t row) {
    const int64_t g = has_given ? gp[i] : 0;
    t.scores[row] = upsert_score(policy, false, t.scores[row], has_given, g, clock, epoch, assign);
    t.digests[row] |= kPinBit;
  };
  // Inserts the key of input position i, absent when the call began, and returns its row (-1:
  // refused). Every key of this call that holds a row is pinned by now, so none is a victim.
  auto insert = [&](int64_t i, int64_t key, const KeyPlace& p, int64_t& added,
                    std::vector<std::pair<int64_t, int64_t>>& evicted) -> int64_t {
    int64_t row = probe(t, p, key);
    if (row >= 0) {  // a repeat of a key inserted earlier in this pass
      touch(i, row);
      return row;
    }
    const int64_t g = has_given ? gp[i] : 0;
    const int64_t new_score = upsert_score(policy, true, 0, has_given, g, clock, epoch, assign);
    const int64_t base1 = p.bucket1 * kSlotsPerBucket, base2 = p.bucket2 * kSlotsPerBucket;
    const uint32_t free1 = match_empty(t.digests + base1) & geo.usable_mask(p.bucket1);
    const uint32_t free2 =
        p.bucket2 == p.bucket1 ? 0u : match_empty(t.digests + base2) & geo.usable_mask(p.bucket2);
    if (free1 | free2) {
      // Two-choice: the emptier bucket (the first on ties), its lowest free slot.
      row = __builtin_popcount(free1) >= __builtin_popcount(free2) ? base1 + lowest_bit(free1)
                                                                   : base2 + lowest_bit(free2);
      ++added;
    } else {
      if (policy == Policy::kNone) return -1;
      row = pick_victim(t, p);
      if (row < 0 || new_score < t.scores[row]) return -1;
      evicted.emplace_back(i, t.keys[row]);
    }
    ip[i] = true;
    t.keys[row] = key;
    t.scores[row] = new_score;
    t.digests[row] = static_cast<uint8_t>(p.tag | kPinBit);
    return row;
  };
  // Pass 1, phase by phase: every key that holds a row is touched and pinned before any key is
  // inserted, so a new key cannot evict a resident key of the call, wherever either comes in the
  // batch and whichever stripe the new key evicts in. The keys not found are kept, with their
  // places, for pass 2: group g's at absent[offsets[g] + k]. The phases run in the reverse of
  // pass 2's order, so pass 2 starts on the keys whose lines pass 1 touched last (still cached).
  const int64_t G = groups.groups(), R = groups.ranges();
  const int64_t* offsets = groups.offsets.data();
  const int phases = upsert_phase_count(geo.num_stripes);
  thread_local std::vector<AbsentKey> absent_scratch;
  grow(absent_scratch, n);
  AbsentKey* absent = absent_scratch.data();
  std::vector<int64_t> absent_count(G, 0);
  auto touch_groups = [&](int64_t g0, int64_t g1) {
    const int64_t begin = offsets[g0];
    int64_t g = g0;
    for_each_prefetched<Prefetch::kTouch>(
        t, offsets[g1] - begin, [&](int64_t j) { return place_key(groups.keys[begin + j], geo); },
        [&](int64_t j, const KeyPlace& p) {
          const int64_t at = begin + j;
          while (at >= offsets[g + 1]) ++g;
          const int64_t row = probe(t, p, groups.keys[at]);
          if (row < 0) {
            absent[offsets[g] + absent_count[g]++] = AbsentKey{at, p};
            return;
          }
          touch(order[at], row);
          rp[order[at]] = row;
        });
  };
  for (int k = phases - 1; k >= 0; --k) {
    const int64_t first = upsert_phase_at(k, clock, geo.num_stripes) * R, last = first + R;
    for_each_group_range(first, last, offsets[last] - offsets[first], touch_groups);
  }
  // Stashed keys of the batch, only when the stash holds any (one byte read per call): found among
  // the keys pass 1 did not find in their buckets, then touched and pinned by this thread (their
  // rows may lie in any stripe), in batch order, before any insert.
  if (t.digests[geo.num_slots()] != 0) {
    std::vector<std::pair<int64_t, int64_t>> stash_hits;  // (input position, row)
    for (int64_t g = 0; g < G; ++g) {
      AbsentKey* a = absent + offsets[g];
      int64_t kept = 0;
      for (int64_t q = 0; q < absent_count[g]; ++q) {
        const int64_t row = stash_probe(t.digests, t.keys, geo, a[q].place, groups.keys[a[q].at]);
        if (row >= 0) {
          stash_hits.emplace_back(order[a[q].at], row);
        } else {
          a[kept++] = a[q];  // still in batch order
        }
      }
      absent_count[g] = kept;
    }
    std::sort(stash_hits.begin(), stash_hits.end());
    for (const auto& [i, row] : stash_hits) {
      touch(i, row);
      rp[i] = row;
    }
  }
  // Pass 2: the keys absent when the call began, one at a time in batch order per stripe, window
  // by window of the batch and phase by phase within a window (the first phase rotating with
  // the clock). With one phase the windows do not change that order: one window.
  std::vector<int64_t> done(G, 0), upto(G, 0);  // per group: absent keys applied, in this window
  for (int64_t begin = 0, window_end; begin < n; begin = window_end) {
    window_end = phases == 1 ? n : std::min(n, begin + upsert_window(capacity, begin));
    for (int k = 0; k < phases; ++k) {
      const int64_t first = upsert_phase_at(k, clock, geo.num_stripes) * R, last = first + R;
      int64_t work = 0;
      for (int64_t g = first; g < last; ++g) {  // a group's absent keys are in batch order
        const AbsentKey* a = absent + offsets[g];
        upto[g] =
            std::partition_point(a + done[g], a + absent_count[g],
                                 [&](const AbsentKey& x) { return order[x.at] < window_end; }) -
            a;
        work += upto[g] - done[g];
      }
      for_each_group_range(first, last, work, [&](int64_t g0, int64_t g1) {
        int64_t added = 0, count = 0;
        for (int64_t g = g0; g < g1; ++g) count += upto[g] - done[g];
        if (count == 0) return;
        std::vector<std::pair<int64_t, int64_t>> evicted;
        AbsentWalk ahead{absent, offsets, done.data(), upto.data(), g0, done[g0]}, behind = ahead;
        for_each_prefetched<Prefetch::kInsert>(
            t, count, [&](int64_t) { return ahead.next().place; },
            [&](int64_t, const KeyPlace& p) {
              const int64_t at = behind.next().at;
              const int64_t i = order[at];
              rp[i] = insert(i, groups.keys[at], p, added, evicted);
            });
        size_delta += added;
        if (!evicted.empty()) {
          std::lock_guard<std::mutex> lock(evictions_mutex);
          evictions.insert(evictions.end(), evicted.begin(), evicted.end());
        }
      });
      std::copy(upto.begin() + first, upto.begin() + last, done.begin() + first);
    }
  }
  // Every row returned is pinned: release them, every stripe at once (a key clears only its own
  // digest's pin bit and reads no other byte; the duplicates of a key share a group, so one
  // thread clears each row).
  for_each_group_range(
      0, G, n,
      [&](int64_t g0, int64_t g1) {
        for (int64_t q = offsets[g0]; q < offsets[g1]; ++q) {
          const int64_t r = rp[order[q]];
          if (r >= 0) t.digests[r] &= kTagMask;
        }
      },
      kInlineReleases);
  *size.data_ptr<int64_t>() += size_delta.load();
  // An insert may have evicted a stashed row, erase_rows cleared one: drop their entries.
  if (n > 0 && t.digests[geo.num_slots()] != 0)
    stash_sweep(t.digests, t.keys, geo);  // (CUDA: no launch at n = 0)

  // In batch order: an input position evicts at most once, so a pass over the positions
  // places them (no sort).
  const int64_t m = static_cast<int64_t>(evictions.size());
  at::Tensor evicted_keys = at::empty({m}, k.options());
  at::Tensor evicted_rows = at::empty({m}, k.options());
  if (m > 0) {
    std::vector<int64_t> eviction_at(n, -1);
    for (int64_t e = 0; e < m; ++e) eviction_at[evictions[e].first] = e;
    int64_t* ek = evicted_keys.data_ptr<int64_t>();
    int64_t* er = evicted_rows.data_ptr<int64_t>();
    for (int64_t i = 0, out = 0; i < n; ++i) {
      if (eviction_at[i] < 0) continue;
      ek[out] = evictions[eviction_at[i]].second;
      er[out++] = rp[i];
    }
  }
  return {rows, inserted, evicted_keys, evicted_rows};
}

// hash_upsert with outputs of one entry per key (no size the host must learn: on a GPU no
// sync) and a pending mask: the keys not pending take no part (row -1), exactly as if the call
// had been made on the pending keys alone. The CPU kernel is that call, its outputs scattered
// back: the evictions, in position order, are the inserted positions whose row was evicted.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> hash_upsert_fixed_cpu(
    at::Tensor& digests, at::Tensor& slot_keys, at::Tensor& slot_scores, at::Tensor& size,
    const at::Tensor& keys, const std::optional<at::Tensor>& scores,
    const std::optional<at::Tensor>& pending, int64_t capacity, int64_t policy_id, int64_t clock,
    int64_t epoch, bool assign) {
  check_keys("hash_upsert_fixed", keys);
  const int64_t n = keys.numel();
  const at::Tensor mask = check_pending(n, pending);
  const at::Tensor k = keys.contiguous();
  at::Tensor at_pos = mask.defined() ? mask.nonzero().squeeze(1) : at::Tensor();
  const at::Tensor sub_keys = mask.defined() ? k.index_select(0, at_pos) : k;
  std::optional<at::Tensor> sub_scores = scores;
  if (scores.has_value() && mask.defined()) {
    check_upsert_args(n, scores, policy_id, clock, epoch);  // checked at the caller's size
    sub_scores = scores->contiguous().index_select(0, at_pos);
  }
  auto [sub_rows, sub_inserted, evicted_keys, evicted_rows] =
      hash_upsert_cpu(digests, slot_keys, slot_scores, size, sub_keys, sub_scores, capacity,
                      policy_id, clock, epoch, assign);
  const int64_t m = sub_keys.numel();
  at::Tensor evicted = at::zeros({m}, k.options().dtype(at::kBool));
  at::Tensor evicted_key = at::zeros({m}, k.options());
  {
    const int64_t* rp = sub_rows.data_ptr<int64_t>();
    const bool* ip = sub_inserted.data_ptr<bool>();
    const int64_t* er = evicted_rows.data_ptr<int64_t>();
    const int64_t* ek = evicted_keys.data_ptr<int64_t>();
    bool* ep = evicted.data_ptr<bool>();
    int64_t* out = evicted_key.data_ptr<int64_t>();
    const int64_t e = evicted_rows.numel();
    for (int64_t i = 0, j = 0; i < m && j < e; ++i) {
      if (ip[i] &&
          rp[i] == er[j]) {  // a row evicted in a call holds the new key: never evicted twice
        ep[i] = true;
        out[i] = ek[j++];
      }
    }
  }
  if (!mask.defined()) return {sub_rows, sub_inserted, evicted, evicted_key};
  at::Tensor rows = at::full({n}, -1, k.options());
  at::Tensor inserted = at::zeros({n}, k.options().dtype(at::kBool));
  at::Tensor evicted_full = at::zeros({n}, k.options().dtype(at::kBool));
  at::Tensor evicted_key_full = at::zeros({n}, k.options());
  rows.index_copy_(0, at_pos, sub_rows);
  inserted.index_copy_(0, at_pos, sub_inserted);
  evicted_full.index_copy_(0, at_pos, evicted);
  evicted_key_full.index_copy_(0, at_pos, evicted_key);
  return {rows, inserted, evicted_full, evicted_key_full};
}

// hash_upsert_fixed of several tables in one call (a training step's index work for all of a
// module's tables, one dispatch): each table's slice of the batch goes through the per-table
// kernel above, so results are those of calls made table by table. Tables are independent, so
// they run in parallel when several share a batch big enough to pay for a parallel region (each
// table's passes then run on its thread; kParallelTablesKeys: on a loaded machine a region can
// cost milliseconds, while 26 tables of a few hundred keys take ~0.5 ms inline); a table holding
// most of the batch keeps the per-table kernel's parallelism instead. Either way the results do
// not depend on the thread count.
constexpr int64_t kParallelTablesKeys = 4 * kGrainKeys;

// Runs fn(t) for every table t of a multi-table call, whose keys are [key_offsets[t],
// key_offsets[t + 1]): on parallel threads when several tables share a batch of at least
// kParallelTablesKeys keys, else one after another (each table's kernel parallel on its own).
template <typename Fn>
void for_each_table(at::IntArrayRef key_offsets, Fn fn) {
  const int64_t T = static_cast<int64_t>(key_offsets.size()) - 1, n = key_offsets[T];
  int64_t largest = 0;
  for (int64_t t = 0; t < T; ++t) largest = std::max(largest, key_offsets[t + 1] - key_offsets[t]);
  if (T > 1 && n >= kParallelTablesKeys && 2 * largest <= n) {
    at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) fn(t);
    });
  } else {
    for (int64_t t = 0; t < T; ++t) fn(t);
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> hash_upsert_tables_cpu(
    at::TensorList digests, at::TensorList slot_keys, at::TensorList slot_scores,
    at::TensorList sizes, const at::Tensor& keys, at::IntArrayRef key_offsets,
    const std::optional<at::Tensor>& scores, const std::optional<at::Tensor>& pending,
    at::IntArrayRef capacities, at::IntArrayRef policies, at::IntArrayRef clocks,
    at::IntArrayRef epochs, bool assign) {
  check_upsert_tables(digests, slot_keys, slot_scores, sizes, keys, key_offsets, scores, pending,
                      capacities, policies, clocks, epochs);
  const at::Tensor k = keys.contiguous();
  const int64_t n = k.numel();
  const std::optional<at::Tensor> given =
      scores.has_value() ? std::optional<at::Tensor>(scores->contiguous()) : std::nullopt;
  const std::optional<at::Tensor> mask =
      pending.has_value() ? std::optional<at::Tensor>(pending->contiguous()) : std::nullopt;
  at::Tensor rows = at::empty({n}, k.options());
  at::Tensor inserted = at::empty({n}, k.options().dtype(at::kBool));
  at::Tensor evicted = at::empty({n}, k.options().dtype(at::kBool));
  at::Tensor evicted_keys = at::empty({n}, k.options());
  auto upsert_table = [&](int64_t t) {
    const int64_t b = key_offsets[t], e = key_offsets[t + 1];
    at::Tensor d = digests[t], sk = slot_keys[t], ss = slot_scores[t], size = sizes[t];
    auto slice = [&](const std::optional<at::Tensor>& x) {
      return x.has_value() ? std::optional<at::Tensor>(x->slice(0, b, e)) : std::nullopt;
    };
    auto [r, i, ev, ek] =
        hash_upsert_fixed_cpu(d, sk, ss, size, k.slice(0, b, e), slice(given), slice(mask),
                              capacities[t], policies[t], clocks[t], epochs[t], assign);
    rows.slice(0, b, e).copy_(r);
    inserted.slice(0, b, e).copy_(i);
    evicted.slice(0, b, e).copy_(ev);
    evicted_keys.slice(0, b, e).copy_(ek);
  };
  for_each_table(key_offsets, upsert_table);
  return {rows, inserted, evicted, evicted_keys};
}

// hash_find of several tables in one call (a serving lookup's id -> row step for all tables): one
// find pipeline runs across the tables' ids (no restart, nor tensors of its own, per table), in
// parallel chunks of the whole batch.
std::tuple<at::Tensor, at::Tensor> hash_find_tables_cpu(at::TensorList digests,
                                                        at::TensorList slot_keys,
                                                        const at::Tensor& keys,
                                                        at::IntArrayRef key_offsets,
                                                        at::IntArrayRef capacities) {
  check_tables("hash_find_tables", digests, slot_keys, keys, key_offsets, capacities, {});
  const at::Tensor k = keys.contiguous();
  const int64_t n = k.numel();
  at::Tensor rows = at::empty({n}, k.options());
  at::Tensor found = at::empty({n}, k.options().dtype(at::kBool));
  std::vector<TableRef> tables;
  tables.reserve(digests.size());
  for (size_t t = 0; t < digests.size(); ++t)
    tables.push_back(table_ref(digests[t], slot_keys[t], nullptr, capacities[t]));
  const int64_t* kp = k.data_ptr<int64_t>();
  int64_t* rp = rows.data_ptr<int64_t>();
  bool* fp = found.data_ptr<bool>();
  at::parallel_for(0, n, kGrainKeys, [&](int64_t begin, int64_t end) {
    // The table of id `begin`: the last t with key_offsets[t] <= begin (empty tables skipped).
    int64_t t =
        std::upper_bound(key_offsets.begin(), key_offsets.end(), begin) - key_offsets.begin() - 1;
    find_ids(
        end - begin,
        [&](int64_t j, const TableRef*& table, int64_t& key) {
          while (begin + j >= key_offsets[t + 1]) ++t;
          table = &tables[t];
          key = kp[begin + j];
        },
        rp + begin, fp + begin);
  });
  return {rows, found};
}

at::Tensor hash_erase_cpu(at::Tensor& digests, const at::Tensor& slot_keys, at::Tensor& size,
                          const at::Tensor& keys, int64_t capacity) {
  check_table("hash_erase", digests, slot_keys, capacity);
  check_keys("hash_erase", keys);
  check_size("hash_erase", size);
  const TableGeometry geo = make_geometry(capacity);
  const at::Tensor k = keys.contiguous();
  const int64_t n = k.numel();
  at::Tensor erased = at::zeros({n}, k.options().dtype(at::kBool));
  const TableRef t = table_ref(digests, slot_keys, nullptr, capacity);
  bool* ep = erased.data_ptr<bool>();
  std::atomic<int64_t> size_delta{0};
  std::vector<int64_t> stash_hits;  // input positions of stashed keys
  std::mutex stash_hits_mutex;
  const StripeGroups& groups = group_by_stripe(k.data_ptr<int64_t>(), n, geo);
  for_each_phase_group_range(groups, [&](int64_t g0, int64_t g1) {
    const int64_t begin = groups.offsets[g0], end = groups.offsets[g1];
    int64_t removed = 0;
    for_each_prefetched<Prefetch::kFind>(
        t, end - begin, [&](int64_t j) { return place_key(groups.keys[begin + j], geo); },
        [&](int64_t j, const KeyPlace& p) {
          const int64_t row = probe(t, p, groups.keys[begin + j]);
          if (row >= 0) {
            t.digests[row] = 0;
            ep[groups.order[begin + j]] = true;
            ++removed;
          } else if (stash_may_hold(t.digests, geo, p) &&
                     stash_row(t, p, groups.keys[begin + j]) >= 0) {
            std::lock_guard<std::mutex> lock(stash_hits_mutex);  // its row may lie in any stripe
            stash_hits.push_back(groups.order[begin + j]);
          }
        });
    size_delta -= removed;
  });
  // Stashed keys: erased by this thread, in batch order (a repeat finds its key gone).
  std::sort(stash_hits.begin(), stash_hits.end());
  for (const int64_t i : stash_hits) {
    const int64_t key = k.data_ptr<int64_t>()[i];
    const int64_t row = stash_probe(t.digests, t.keys, geo, place_key(key, geo), key);
    if (row < 0) continue;
    t.digests[row] = 0;
    ep[i] = true;
    --size_delta;
  }
  // (Their stash entries are stale now: slot_keys is not written by an erase; the next upsert drops
  // them.)
  *size.data_ptr<int64_t>() += size_delta.load();
  return erased;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> hash_export_cpu(const at::Tensor& digests,
                                                               const at::Tensor& slot_keys,
                                                               const at::Tensor& slot_scores,
                                                               int64_t capacity, int64_t start,
                                                               int64_t end) {
  check_export(digests, slot_keys, slot_scores, capacity, start, end);
  const uint8_t* d = digests.data_ptr<uint8_t>();
  const int64_t* sk = slot_keys.data_ptr<int64_t>();
  const int64_t* ss = slot_scores.data_ptr<int64_t>();
  const int64_t last = std::max(start, std::min(end, capacity));
  // Two passes over fixed chunks (count, then fill at each chunk's offset): parallel, and the
  // output stays in row order whatever the thread count.
  constexpr int64_t kChunk = int64_t{1} << 16;
  const int64_t chunks = (last - start + kChunk - 1) / kChunk;
  std::vector<int64_t> offset(chunks + 1, 0);
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      int64_t live = 0;
      for (int64_t r = start + c * kChunk, e = std::min(last, r + kChunk); r < e; ++r)
        live += d[r] != 0;
      offset[c + 1] = live;
    }
  });
  for (int64_t c = 0; c < chunks; ++c) offset[c + 1] += offset[c];
  auto opts = slot_keys.options();
  at::Tensor out_keys = at::empty({offset[chunks]}, opts),
             out_rows = at::empty({offset[chunks]}, opts),
             out_scores = at::empty({offset[chunks]}, opts);
  int64_t* ok = out_keys.data_ptr<int64_t>();
  int64_t* orow = out_rows.data_ptr<int64_t>();
  int64_t* os = out_scores.data_ptr<int64_t>();
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      int64_t j = offset[c];
      for (int64_t r = start + c * kChunk, e = std::min(last, r + kChunk); r < e; ++r) {
        if (d[r] != 0) {
          ok[j] = sk[r];
          orow[j] = r;
          os[j] = ss[r];
          ++j;
        }
      }
    }
  });
  return {out_keys, out_rows, out_scores};
}

void hash_restore_cpu(at::Tensor& digests, at::Tensor& slot_keys, at::Tensor& slot_scores,
                      at::Tensor& size, const at::Tensor& keys, const at::Tensor& rows,
                      const at::Tensor& scores, int64_t capacity) {
  check_table("hash_restore", digests, slot_keys, capacity);
  check_slot_scores("hash_restore", slot_scores, capacity);
  check_size("hash_restore", size);
  check_keys("hash_restore", keys);
  const TableGeometry geo = make_geometry(capacity);
  const int64_t n = keys.numel();
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1 && rows.numel() == n,
              "hash_restore: rows must be a 1-D int64 tensor of ", n, " elements");
  TORCH_CHECK(scores.scalar_type() == at::kLong && scores.dim() == 1 && scores.numel() == n,
              "hash_restore: scores must be a 1-D int64 tensor of ", n, " elements");
  const at::Tensor k = keys.contiguous(), r = rows.contiguous(), s = scores.contiguous();
  const int64_t* kp = k.data_ptr<int64_t>();
  const int64_t* rp = r.data_ptr<int64_t>();
  const int64_t* sp = s.data_ptr<int64_t>();
  uint8_t* d = digests.data_ptr<uint8_t>();
  // Validate everything before the first write, so a bad state leaves the table unchanged.
  check_distinct_keys("hash_restore", kp, n);
  std::vector<uint8_t> taken(static_cast<size_t>(geo.num_slots()), 0);
  int64_t stashed = 0, stash_used = 0;
  while (stash_used < geo.stash_slots && d[geo.num_slots() + stash_used] != 0) ++stash_used;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t row = rp[i];
    TORCH_CHECK(row >= 0 && row < capacity, "hash_restore: row ", row, " of key ", kp[i],
                " is outside [0, ", capacity, ")");
    const KeyPlace p = place_key(kp[i], geo);
    const int64_t bucket = row / kSlotsPerBucket;
    // A row outside the key's buckets is a stashed one (a load's placement left it no row there).
    if (bucket != p.bucket1 && bucket != p.bucket2) {
      TORCH_CHECK(++stashed <= geo.stash_slots - stash_used, "hash_restore: key ", kp[i],
                  " cannot live in row ", row, " (its buckets are ", p.bucket1, " and ", p.bucket2,
                  ", and the stash's ", geo.stash_slots,
                  " entries are taken); was the state saved with another "
                  "capacity or version?");
    }
    TORCH_CHECK(!taken[row] && d[row] == 0, "hash_restore: row ", row,
                " is given twice or already occupied");
    taken[row] = 1;
  }
  int64_t* sk = slot_keys.data_ptr<int64_t>();
  int64_t* ss = slot_scores.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    const KeyPlace p = place_key(kp[i], geo);
    d[rp[i]] = p.tag;
    sk[rp[i]] = kp[i];
    ss[rp[i]] = sp[i];
    const int64_t bucket = rp[i] / kSlotsPerBucket;
    if (bucket != p.bucket1 && bucket != p.bucket2) stash_add(d, sk, geo, p, kp[i], rp[i]);
  }
  *size.data_ptr<int64_t>() += n;
}

at::Tensor route_cpu(const at::Tensor& keys, int64_t world_size) {
  check_keys("route", keys);
  check_world_size("route", world_size);
  const at::Tensor k = keys.contiguous();
  at::Tensor ranks = at::empty_like(k);
  const int64_t* kp = k.data_ptr<int64_t>();
  int64_t* out = ranks.data_ptr<int64_t>();
  at::parallel_for(0, k.numel(), kGrainKeys, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) out[i] = route_key(kp[i], world_size);
  });
  return ranks;
}

// Slots to rows, in place, for the tables whose index maps them (a growing table's permutation:
// table.py). One pass with no temporaries: a step's upsert output goes through it.
template <typename Map>
int64_t map_slot_rows(int64_t* rows, int64_t begin, int64_t end, const Map* map, int64_t size) {
  std::atomic<int64_t> bad{-1};
  at::parallel_for(begin, end, kGrainKeys, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const int64_t slot = rows[i];
      if (slot < 0) continue;  // refused or absent: stays -1
      if (slot >= size) {
        bad.store(i, std::memory_order_relaxed);
        continue;
      }
      rows[i] = static_cast<int64_t>(map[slot]);
    }
  });
  return bad.load();
}

void hash_slot_rows_cpu(const at::Tensor& rows, at::IntArrayRef key_offsets,
                        const c10::List<std::optional<at::Tensor>>& slot_rows) {
  const char* op = "hash_slot_rows";
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.is_contiguous(), op,
              ": rows must be a contiguous 1-D int64 tensor");
  const int64_t T = static_cast<int64_t>(slot_rows.size());
  TORCH_CHECK(static_cast<int64_t>(key_offsets.size()) == T + 1 && key_offsets[0] == 0 &&
                  key_offsets[T] == rows.numel(),
              op, ": key_offsets must be ", T + 1, " ascending ints from 0 to ", rows.numel());
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(key_offsets[t] <= key_offsets[t + 1], op, ": key_offsets must ascend");
  int64_t* r = rows.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    const std::optional<at::Tensor> map_opt = slot_rows.get(t);
    if (!map_opt.has_value()) continue;
    const at::Tensor& map = *map_opt;
    TORCH_CHECK(map.dim() == 1 && map.is_contiguous() && map.device().is_cpu() &&
                    (map.scalar_type() == at::kInt || map.scalar_type() == at::kLong),
                op, ": slot_rows[", t, "] must be a contiguous 1-D int32 or int64 CPU tensor");
    const int64_t bad = map.scalar_type() == at::kInt
                            ? map_slot_rows(r, key_offsets[t], key_offsets[t + 1],
                                            map.data_ptr<int32_t>(), map.numel())
                            : map_slot_rows(r, key_offsets[t], key_offsets[t + 1],
                                            map.data_ptr<int64_t>(), map.numel());
    TORCH_CHECK(bad < 0, op, ": rows[", bad, "] = ", r[bad], " is not a slot of table ", t,
                " (slot_rows[", t, "] has ", map.numel(), " entries)");
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(torchrec_ext, CPU, m) {
  m.impl("hash_find", &hash_find_cpu);
  m.impl("hash_upsert", &hash_upsert_cpu);
  m.impl("hash_upsert_fixed", &hash_upsert_fixed_cpu);
  m.impl("hash_upsert_tables", &hash_upsert_tables_cpu);
  m.impl("hash_find_tables", &hash_find_tables_cpu);
  m.impl("hash_erase", &hash_erase_cpu);
  m.impl("hash_export", &hash_export_cpu);
  m.impl("hash_restore", &hash_restore_cpu);
  m.impl("route", &route_cpu);
  m.impl("hash_slot_rows", &hash_slot_rows_cpu);
}

}  // namespace torchrec_ext
