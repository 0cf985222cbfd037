// CPU kernels of the read-only serving index (torch.ops.torchrec_ext.serving_index_update and
// serving_find): the id -> row map a serving module reads, built aside from the training hash
// table at conversion and after each delta, and specialised for reads.
//
// Why not the training table's find: a training table keeps a digest byte per slot (tags, pins),
// two candidate buckets and a stash, so its find costs two or three dependent lines and tag work
// per id (~30 ns at 500K rows). Here one id costs one hash and, almost always, one cache line:
//
//   index: int64 [num_buckets * 8], one 64-byte bucket per 8 words:
//   - words 0..4: up to 5 keys (any int64 is a key: occupancy is the count, not a key value);
//   - int32 at byte 40 + 4i: the row of key i (0 <= row < 2^31);
//   - int32 at byte 60: meta, the count of keys (bits 0..7) | kOverflowBit.
//   A key's home bucket is fastrange32((key ^ kServingSeed) * kServingMultiplier >> 32,
//   num_buckets) (see home_bucket; at most 2^32 buckets); it lives in the
//   first bucket from its home (cyclically) that had room when it was inserted, and every bucket
//   it passed has kOverflowBit set. So a find stops at the first bucket without the bit. Erases
//   move a bucket's last key into the hole and leave the bits (a stale bit costs a probe, never
//   a wrong answer); the Python side rebuilds the index when it grows past its load target.
//   An all-zero tensor is an empty index.
//
// Finds run a pipeline: the home buckets of ids i + kLookahead.. are prefetched while id i is
// probed, so ~kLookahead misses are in flight. Where the CPU has AVX-512 (runtime dispatch;
// TORCHREC_EXT_NO_AVX512=1 takes the portable code, which gives the same rows) 8 ids are hashed
// at once and a bucket's 5 keys are compared in one instruction.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <limits>

#if defined(__linux__)
#include <sys/mman.h>
#endif
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

#include "hash_table_layout.h"

namespace torchrec_ext {
namespace {

constexpr int64_t kWordsPerBucket = 8;  // 64 bytes: one cache line
constexpr int kKeysPerBucket = 5;
constexpr int kRowsAt = 10;  // int32 position of key 0's row
constexpr int kMetaAt = 15;  // int32 position of the meta word
constexpr int32_t kCountMask = 0xFF;
constexpr int32_t kOverflowBit = 0x100;
constexpr uint64_t kServingSeed = 0x2545F4914F6CDD1Dull;
constexpr uint64_t kServingMultiplier = 0x9E3779B97F4A7C15ull;  // 2^64 / golden ratio, odd
constexpr int64_t kMaxBuckets = int64_t{1} << 32;               // fastrange32's range
constexpr int kLookahead = 32;                                  // a power of two (ring index)
constexpr int64_t kGrainIds = 16384;

// Bucket words are int64; rows and meta are int32 halves, read and written through memcpy (no
// type-punned pointer).
inline int32_t load_i32(const int64_t* bucket, int at) {
  int32_t v;
  std::memcpy(&v, reinterpret_cast<const char*>(bucket) + 4 * at, sizeof(v));
  return v;
}
inline void store_i32(int64_t* bucket, int at, int32_t v) {
  std::memcpy(reinterpret_cast<char*>(bucket) + 4 * at, &v, sizeof(v));
}

// Multiplicative (Fibonacci) hashing: the high 32 bits of (key ^ seed) * golden, mapped onto
// the buckets by fastrange32. Every key bit reaches them, and it is a handful of instructions:
// a find is bound by how many ids' misses the core keeps in flight, so fewer instructions per id
// mean more ids in its window (MurmurHash's finaliser here cost ~30% more per id at 500K keys).
inline int64_t home_bucket(int64_t key, int64_t num_buckets) {
  const uint64_t h = (static_cast<uint64_t>(key) ^ kServingSeed) * kServingMultiplier;
  return static_cast<int64_t>(((h >> 32) * static_cast<uint64_t>(num_buckets)) >> 32);
}

// Slot of `key` among a bucket's first `count` keys, or -1: portable and branch-free.
struct ScalarSlot {
  static constexpr bool kHashes8 = false;
  static inline int slot_of(const int64_t* bucket, int64_t key, int count) {
    int slot = -1;
    for (int i = kKeysPerBucket - 1; i >= 0; --i) slot = (i < count && bucket[i] == key) ? i : slot;
    return slot;
  }
  static inline void home_buckets8(const int64_t*, const int64_t*, int64_t, const int64_t**) {}
};

#if defined(__x86_64__) && defined(__GNUC__)
// GCC 12 warns that the intrinsics' _mm512_undefined_* sources may be uninitialised (they are
// meant to be: every lane is written)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#define TREXT_SERVING_AVX512 __attribute__((target("avx512f,avx512dq")))
const bool kServingAvx512 = __builtin_cpu_supports("avx512f") &&
                            __builtin_cpu_supports("avx512dq") &&
                            std::getenv("TORCHREC_EXT_NO_AVX512") == nullptr;

struct Avx512Slot {
  static constexpr bool kHashes8 = true;
  // One compare of the bucket's 8 words; the lanes past `count` (rows, meta) are masked out.
  TREXT_SERVING_AVX512 static inline int slot_of(const int64_t* bucket, int64_t key, int count) {
    const __mmask8 m = _mm512_cmpeq_epi64_mask(_mm512_loadu_si512(bucket), _mm512_set1_epi64(key)) &
                       static_cast<__mmask8>((1u << count) - 1u);
    return m ? __builtin_ctz(m) : -1;
  }
  // home_bucket of 8 ids of one table at once: out[i] = its bucket's first word.
  TREXT_SERVING_AVX512 static inline void home_buckets8(const int64_t* ids, const int64_t* words,
                                                        int64_t num_buckets, const int64_t** out) {
    const __m512i h =
        _mm512_mullo_epi64(_mm512_xor_si512(_mm512_loadu_si512(ids),
                                            _mm512_set1_epi64(static_cast<int64_t>(kServingSeed))),
                           _mm512_set1_epi64(static_cast<int64_t>(kServingMultiplier)));
    const __m512i b = _mm512_srli_epi64(
        _mm512_mul_epu32(_mm512_srli_epi64(h, 32), _mm512_set1_epi64(num_buckets)), 32);
    const __m512i at = _mm512_add_epi64(_mm512_set1_epi64(reinterpret_cast<int64_t>(words)),
                                        _mm512_slli_epi64(b, 6));
    _mm512_storeu_si512(reinterpret_cast<void*>(out), at);
  }
};
#else
const bool kServingAvx512 = false;
#endif

struct Where {
  int64_t bucket;  // -1: absent
  int slot;
};

// Where `key` is, walking from its home bucket while the buckets say some key overflowed them.
template <typename Slot>
__attribute__((always_inline)) inline Where locate(const int64_t* index, int64_t num_buckets,
                                                   int64_t b, int64_t key) {
  for (int64_t step = 0; step < num_buckets; ++step) {
    const int64_t* bucket = index + b * kWordsPerBucket;
    const int32_t meta = load_i32(bucket, kMetaAt);
    const int slot = Slot::slot_of(bucket, key, meta & kCountMask);
    if (slot >= 0) return {b, slot};
    if (!(meta & kOverflowBit)) break;
    b = b + 1 == num_buckets ? 0 : b + 1;
  }
  return {-1, 0};
}

struct IndexRef {
  const int64_t* words;
  int64_t num_buckets;
};

// Rows of ids [begin, end): table t's ids are [offsets[t], offsets[t + 1]); absent ids get
// default_rows[t]. Ids go in groups of kGroup: the home buckets of group k + kLookahead / kGroup
// are computed (8 at once where the CPU can) and prefetched while group k is probed. The ring
// keeps what a probe needs and no more (the common case reads one bucket).
constexpr int kGroup = 8;
static_assert(kLookahead % kGroup == 0, "the ring holds whole groups");

template <typename Slot>
__attribute__((always_inline)) inline void find_range(const IndexRef* tables,
                                                      const int64_t* offsets,
                                                      const int64_t* default_rows,
                                                      int64_t num_tables, const int64_t* ids,
                                                      int64_t begin, int64_t end, int64_t* rows) {
  const int64_t* bucket_of[kLookahead];  // ring positions (j - begin) % kLookahead
  int64_t key_of[kLookahead];
  int64_t table_of[kLookahead];
  // The table of id `begin`: the last t with offsets[t] <= begin.
  int64_t t = std::upper_bound(offsets, offsets + num_tables + 1, begin) - offsets - 1;
  int64_t table_end = offsets[t + 1];
  const int64_t* words = tables[t].words;
  int64_t num_buckets = tables[t].num_buckets;
  auto to_table_of = [&](int64_t j) {  // the tables are walked forwards only
    while (j >= table_end) {
      ++t;
      table_end = offsets[t + 1];
      words = tables[t].words;
      num_buckets = tables[t].num_buckets;
    }
  };
  for (int64_t g = begin; g < end + kLookahead; g += kGroup) {
    const int64_t first = std::max(begin, g - kLookahead),
                  last = std::min(end, g - kLookahead + kGroup);
    for (int64_t j = first; j < last; ++j) {  // probe
      const int r = static_cast<int>((j - begin) & (kLookahead - 1));
      const int64_t* bucket = bucket_of[r];
      const int32_t meta = load_i32(bucket, kMetaAt);
      const int slot = Slot::slot_of(bucket, key_of[r], meta & kCountMask);
      int64_t row = slot >= 0 ? load_i32(bucket, kRowsAt + slot) : default_rows[table_of[r]];
      if (__builtin_expect(slot < 0 && (meta & kOverflowBit), 0)) {  // it may lie further on
        const IndexRef& ix = tables[table_of[r]];
        const int64_t next = (bucket - ix.words) / kWordsPerBucket + 1;
        const Where w =
            locate<Slot>(ix.words, ix.num_buckets, next == ix.num_buckets ? 0 : next, key_of[r]);
        if (w.bucket >= 0) row = load_i32(ix.words + w.bucket * kWordsPerBucket, kRowsAt + w.slot);
      }
      rows[j] = row;
    }
    const int64_t stop = std::min(end, g + kGroup);
    if (g >= stop) continue;
    to_table_of(g);
    const int r0 = static_cast<int>((g - begin) & (kLookahead - 1));
    if (Slot::kHashes8 && stop - g == kGroup && stop <= table_end) {  // place: one table's 8 ids
      Slot::home_buckets8(ids + g, words, num_buckets, bucket_of + r0);
      for (int i = 0; i < kGroup; ++i) {
        key_of[r0 + i] = ids[g + i];
        table_of[r0 + i] = t;
        __builtin_prefetch(bucket_of[r0 + i]);
      }
      continue;
    }
    for (int64_t j = g; j < stop; ++j) {
      to_table_of(j);
      const int r = static_cast<int>((j - begin) & (kLookahead - 1));
      key_of[r] = ids[j];
      bucket_of[r] = words + home_bucket(key_of[r], num_buckets) * kWordsPerBucket;
      table_of[r] = t;
      __builtin_prefetch(bucket_of[r]);
    }
  }
}

void find_range_scalar(const IndexRef* tables, const int64_t* offsets, const int64_t* default_rows,
                       int64_t num_tables, const int64_t* ids, int64_t begin, int64_t end,
                       int64_t* rows) {
  find_range<ScalarSlot>(tables, offsets, default_rows, num_tables, ids, begin, end, rows);
}

#if defined(__x86_64__) && defined(__GNUC__)
TREXT_SERVING_AVX512 void find_range_avx512(const IndexRef* tables, const int64_t* offsets,
                                            const int64_t* default_rows, int64_t num_tables,
                                            const int64_t* ids, int64_t begin, int64_t end,
                                            int64_t* rows) {
  find_range<Avx512Slot>(tables, offsets, default_rows, num_tables, ids, begin, end, rows);
}
#endif

// ---------------------------------------------------------------------------------------------
// Checks

void check_index(const char* op, const char* name, const at::Tensor& index) {
  TORCH_CHECK(index.device().is_cpu(), op, ": ", name, " must be a CPU tensor, got ",
              index.device());
  TORCH_CHECK(index.scalar_type() == at::kLong, op, ": ", name, " must be int64, got ",
              index.scalar_type());
  TORCH_CHECK(index.dim() == 1 && index.is_contiguous(), op, ": ", name,
              " must be a contiguous 1-D tensor, got shape ", index.sizes());
  TORCH_CHECK(index.numel() > 0 && index.numel() % kWordsPerBucket == 0, op, ": ", name,
              " must hold a positive multiple of ", kWordsPerBucket,
              " words (64-byte buckets), got ", index.numel());
}

void check_ids(const char* op, const char* name, const at::Tensor& ids) {
  TORCH_CHECK(ids.device().is_cpu(), op, ": ", name, " must be a CPU tensor, got ", ids.device());
  TORCH_CHECK(ids.scalar_type() == at::kLong, op, ": ", name, " must be int64, got ",
              ids.scalar_type());
  TORCH_CHECK(ids.dim() == 1, op, ": ", name, " must be 1-D, got shape ", ids.sizes());
}

// A new index tensor of `words`, asked for huge pages (best effort: a 500K-key index spans ~10 MB,
// and a TLB miss per id would cost as much as the probe).
at::Tensor allocate_index(int64_t words) {
  at::Tensor out = at::empty({words}, at::TensorOptions().dtype(at::kLong));
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t{1} << 21;
  const uintptr_t begin = reinterpret_cast<uintptr_t>(out.data_ptr());
  const uintptr_t end = begin + static_cast<uintptr_t>(words) * sizeof(int64_t);
  const uintptr_t first = (begin + kHuge - 1) & ~(kHuge - 1), last = end & ~(kHuge - 1);
  if (last > first) madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);
#endif
  return out;
}

// ---------------------------------------------------------------------------------------------
// Ops

at::Tensor serving_index_update_cpu(const at::Tensor& index, const at::Tensor& erase_keys,
                                    const at::Tensor& keys, const at::Tensor& rows) {
  constexpr const char* op = "serving_index_update";
  check_index(op, "index", index);
  check_ids(op, "erase_keys", erase_keys);
  check_ids(op, "keys", keys);
  check_ids(op, "rows", rows);
  TORCH_CHECK(rows.numel() == keys.numel(), op, ": rows must have one entry per key (",
              keys.numel(), "), got ", rows.numel());
  const at::Tensor r = rows.contiguous();
  const int64_t* rp = r.data_ptr<int64_t>();
  const int64_t n = keys.numel();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(rp[i] >= 0 && rp[i] <= std::numeric_limits<int32_t>::max(), op,
                ": rows must be in [0, 2^31 - 1], got ", rp[i], " at position ", i);
  const int64_t num_buckets = index.numel() / kWordsPerBucket;
  const int64_t* old = index.data_ptr<int64_t>();
  int64_t live = 0;
  for (int64_t b = 0; b < num_buckets; ++b) {
    const int32_t count = load_i32(old + b * kWordsPerBucket, kMetaAt) & kCountMask;
    TORCH_CHECK(count <= kKeysPerBucket, op, ": index is not a serving index: bucket ", b,
                " says it holds ", count, " keys (at most ", kKeysPerBucket, ")");
    live += count;
  }
  // Out of place: the published index stays as it is for the lookups reading it.
  at::Tensor out = allocate_index(index.numel());
  int64_t* w = out.data_ptr<int64_t>();
  std::memcpy(w, old, index.numel() * sizeof(int64_t));

  const at::Tensor e = erase_keys.contiguous();
  const int64_t* ep = e.data_ptr<int64_t>();
  for (int64_t i = 0; i < e.numel(); ++i) {  // absent keys are skipped
    const Where at = locate<ScalarSlot>(w, num_buckets, home_bucket(ep[i], num_buckets), ep[i]);
    if (at.bucket < 0) continue;
    int64_t* bucket = w + at.bucket * kWordsPerBucket;
    const int32_t meta = load_i32(bucket, kMetaAt);
    const int last = (meta & kCountMask) - 1;
    bucket[at.slot] = bucket[last];
    store_i32(bucket, kRowsAt + at.slot, load_i32(bucket, kRowsAt + last));
    bucket[last] = 0;
    store_i32(bucket, kRowsAt + last, 0);
    store_i32(bucket, kMetaAt, meta - 1);
    --live;
  }
  const at::Tensor k = keys.contiguous();
  const int64_t* kp = k.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {  // in order: a repeated key keeps its last row
    const int64_t home = home_bucket(kp[i], num_buckets);
    const Where at = locate<ScalarSlot>(w, num_buckets, home, kp[i]);
    if (at.bucket >= 0) {
      store_i32(w + at.bucket * kWordsPerBucket, kRowsAt + at.slot, static_cast<int32_t>(rp[i]));
      continue;
    }
    TORCH_CHECK(live < num_buckets * kKeysPerBucket, op, ": index is full (", num_buckets,
                " buckets of ", kKeysPerBucket, " keys) at key ", i, " of ", n,
                ": build a larger one (nothing was changed)");
    int64_t b = home;
    for (;;) {
      int64_t* bucket = w + b * kWordsPerBucket;
      const int32_t meta = load_i32(bucket, kMetaAt);
      const int count = meta & kCountMask;
      if (count < kKeysPerBucket) {
        bucket[count] = kp[i];
        store_i32(bucket, kRowsAt + count, static_cast<int32_t>(rp[i]));
        store_i32(bucket, kMetaAt, meta + 1);
        break;
      }
      store_i32(bucket, kMetaAt, meta | kOverflowBit);
      b = b + 1 == num_buckets ? 0 : b + 1;
    }
    ++live;
  }
  return out;
}

at::Tensor serving_find_cpu(at::TensorList indexes, const at::Tensor& ids,
                            const at::Tensor& id_offsets, at::IntArrayRef default_rows) {
  constexpr const char* op = "serving_find";
  const int64_t T = static_cast<int64_t>(indexes.size());
  TORCH_CHECK(static_cast<int64_t>(default_rows.size()) == T, op,
              ": default_rows must have one entry per index (", T, "), got ", default_rows.size());
  for (int64_t t = 0; t < T; ++t) check_index(op, "indexes[t]", indexes[t]);
  check_ids(op, "ids", ids);
  check_ids(op, "id_offsets", id_offsets);
  TORCH_CHECK(id_offsets.numel() == T + 1, op, ": id_offsets must have len(indexes) + 1 = ", T + 1,
              " entries, got ", id_offsets.numel());
  const at::Tensor o = id_offsets.contiguous();
  const int64_t* op_ = o.data_ptr<int64_t>();
  const int64_t n = ids.numel();
  TORCH_CHECK(op_[0] == 0 && op_[T] == n, op, ": id_offsets must run from 0 to the number of ids (",
              n, "), got ", op_[0], " to ", op_[T]);
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(op_[t] <= op_[t + 1], op, ": id_offsets must be ascending, got ", op_[t], " then ",
                op_[t + 1], " at ", t);
  std::vector<IndexRef> tables;
  tables.reserve(T);
  for (const at::Tensor& index : indexes)
    tables.push_back({index.data_ptr<int64_t>(), index.numel() / kWordsPerBucket});
  const at::Tensor k = ids.contiguous();
  at::Tensor out = at::empty({n}, k.options());
  const int64_t* kp = k.data_ptr<int64_t>();
  int64_t* rp = out.data_ptr<int64_t>();
  const int64_t* dp = default_rows.data();
  at::parallel_for(0, n, kGrainIds, [&](int64_t begin, int64_t end) {
#if defined(__x86_64__) && defined(__GNUC__)
    if (kServingAvx512) return find_range_avx512(tables.data(), op_, dp, T, kp, begin, end, rp);
#endif
    find_range_scalar(tables.data(), op_, dp, T, kp, begin, end, rp);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(torchrec_ext, CPU, m) {
  m.impl("serving_index_update", &serving_index_update_cpu);
  m.impl("serving_find", &serving_find_cpu);
}

}  // namespace torchrec_ext
