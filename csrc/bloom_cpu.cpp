// CPU kernel of bloom_admit: the counting Bloom filter of the bloom admission, in place.
//
// Two passes over the keys, parallel over keys: the first adds each pending key's count to its
// k counters (saturating at 15), the second decides each pending key from the smallest of its k
// counters once every increment of the batch is in (so the order of keys and threads does not
// change a decision: saturating sums of non-negative counts do not depend on their order).
// Two counters share a byte, so with several threads an increment is a compare-and-swap on the
// byte: concurrent increments of its two nibbles are never lost. The filter is larger than the
// caches on real tables, so each key's cells are prefetched a few keys ahead.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <optional>

#include "bloom_checks.h"
#include "bloom_layout.h"

namespace torchrec_ext {
namespace {

constexpr int64_t kGrain = 4096;  // keys per task: smaller batches run on the calling thread
constexpr int64_t kAhead = 8;     // keys between a key's prefetch and its use

template <bool kAtomic>
inline void add_to_counter(uint8_t* filter, uint64_t cell, int increment) {
  uint8_t* byte = filter + (cell >> 1);
  const int shift = static_cast<int>(cell & 1) * 4;
  uint8_t old = kAtomic ? __atomic_load_n(byte, __ATOMIC_RELAXED) : *byte;
  for (;;) {
    const int now = (old >> shift) & kBloomCounterMax;
    if (now == kBloomCounterMax) return;
    const uint8_t want = static_cast<uint8_t>((old & ~(kBloomCounterMax << shift)) |
                                              (bloom_saturating_add(now, increment) << shift));
    if (!kAtomic) {
      *byte = want;
      return;
    }
    // On failure `old` is reloaded with the byte's current value (the other nibble moved).
    if (__atomic_compare_exchange_n(byte, &old, want, /*weak=*/true, __ATOMIC_RELAXED,
                                    __ATOMIC_RELAXED))
      return;
  }
}

inline void prefetch_cells(const uint8_t* filter, int64_t key, int64_t hash_seed, int64_t hashes,
                           uint64_t mask, int rw) {
  const BloomHash h = bloom_hash(key, hash_seed);
  for (int64_t i = 0; i < hashes; ++i) {
    const uint8_t* p = filter + (bloom_cell(h, i, mask) >> 1);
    if (rw)
      __builtin_prefetch(p, 1);
    else
      __builtin_prefetch(p, 0);
  }
}

template <bool kAtomic>
void add_counts(uint8_t* filter, uint64_t mask, const int64_t* key, const int64_t* count,
                const bool* pending, int64_t begin, int64_t end, int64_t hash_seed,
                int64_t hashes) {
  for (int64_t j = begin; j < end; ++j) {
    const int64_t ahead = j + kAhead;
    if (ahead < end && (pending == nullptr || pending[ahead]))
      prefetch_cells(filter, key[ahead], hash_seed, hashes, mask, 1);
    if (pending != nullptr && !pending[j]) continue;
    const int increment = bloom_increment(count[j]);
    if (increment == 0) continue;
    const BloomHash h = bloom_hash(key[j], hash_seed);
    for (int64_t i = 0; i < hashes; ++i)
      add_to_counter<kAtomic>(filter, bloom_cell(h, i, mask), increment);
  }
}

at::Tensor bloom_admit_cpu(at::Tensor& counters, const at::Tensor& keys_in,
                           const at::Tensor& counts_in, const std::optional<at::Tensor>& pending_in,
                           int64_t hash_seed, int64_t hashes, int64_t admit_after) {
  check_bloom_admit(counters, keys_in, counts_in, pending_in, hashes, admit_after);
  check_bloom_counts(counts_in);
  const at::Tensor keys = keys_in.contiguous(), counts = counts_in.contiguous();
  const std::optional<at::Tensor> pending_t =
      pending_in.has_value() ? std::optional<at::Tensor>(pending_in->contiguous()) : std::nullopt;
  const int64_t n = keys.numel();
  at::Tensor admitted = at::zeros({n}, keys.options().dtype(at::kBool));
  if (n == 0) return admitted;
  uint8_t* filter = counters.data_ptr<uint8_t>();
  const uint64_t mask = static_cast<uint64_t>(counters.numel()) * 2 - 1;
  const int64_t* key = keys.const_data_ptr<int64_t>();
  const int64_t* count = counts.const_data_ptr<int64_t>();
  const bool* pending = pending_t.has_value() ? pending_t->const_data_ptr<bool>() : nullptr;
  bool* out = admitted.data_ptr<bool>();

  // One task (a small batch, one thread, or a call from inside a parallel region) needs no atomics.
  const bool one_task = n <= kGrain || at::get_num_threads() == 1 || at::in_parallel_region();
  if (one_task) {
    add_counts<false>(filter, mask, key, count, pending, 0, n, hash_seed, hashes);
  } else {
    at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
      add_counts<true>(filter, mask, key, count, pending, begin, end, hash_seed, hashes);
    });
  }
  // parallel_for returns after its tasks finish: every increment is visible here.
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const int64_t ahead = j + kAhead;
      if (ahead < end && (pending == nullptr || pending[ahead]))
        prefetch_cells(filter, key[ahead], hash_seed, hashes, mask, 0);
      if (pending != nullptr && !pending[j]) continue;
      out[j] = bloom_smallest_counter(filter, bloom_hash(key[j], hash_seed), hashes, mask) >=
               admit_after;
    }
  });
  return admitted;
}

}  // namespace

TORCH_LIBRARY_IMPL(torchrec_ext, CPU, m) { m.impl("bloom_admit", &bloom_admit_cpu); }

}  // namespace torchrec_ext
