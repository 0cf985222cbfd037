// CPU kernel of dedup_segments: each table's ids deduplicated within its segment of the
// batch (the unique ids in first-seen order, each id's unique index, the segments' counts).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "dedup_checks.h"
#include "row_storage.h"

namespace torchrec_ext {
namespace {

// Open addressing over a power-of-two array at most half full; each slot holds a unique index
// (-1 = empty) and the id, so a probe touches one cache line.
struct DedupSlot {
  int64_t id;
  int64_t index;
};

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> dedup_segments_cpu(
    const at::Tensor& ids_in, const at::Tensor& segment_offsets_in) {
  check_dedup_ids(ids_in);
  const at::Tensor ids = ids_in.contiguous();
  const at::Tensor seg = segment_offsets_in.contiguous();
  check_segment_offsets_tensor(seg);
  const int64_t S = seg.numel() - 1;
  const int64_t n = ids.numel();
  const int64_t* so = seg.data_ptr<int64_t>();
  check_segment_offsets(so, S, n);

  const int64_t* id = ids.data_ptr<int64_t>();
  at::Tensor inverse = at::empty({n}, ids.options());
  at::Tensor local_unique = at::empty({n}, ids.options());  // segment s's uniques at [so[s], ...)
  at::Tensor local_count = at::zeros({n}, ids.options());
  std::vector<int64_t> num_unique(S, 0);
  int64_t* inv = inverse.data_ptr<int64_t>();
  int64_t* lu = local_unique.data_ptr<int64_t>();
  int64_t* lc = local_count.data_ptr<int64_t>();

  at::parallel_for(0, S, 1, [&](int64_t begin, int64_t end) {
    std::vector<DedupSlot> slots;
    for (int64_t s = begin; s < end; ++s) {
      const int64_t base = so[s], len = so[s + 1] - so[s];
      uint64_t size = 16;
      while (size < 2 * static_cast<uint64_t>(len)) size <<= 1;
      slots.assign(size, DedupSlot{0, -1});
      const uint64_t mask = size - 1;
      int64_t count = 0;
      for (int64_t i = 0; i < len; ++i) {
        const int64_t key = id[base + i];
        uint64_t pos = fmix64(static_cast<uint64_t>(key)) & mask;
        while (slots[pos].index >= 0 && slots[pos].id != key) pos = (pos + 1) & mask;
        if (slots[pos].index < 0) {
          slots[pos] = DedupSlot{key, count};
          lu[base + count] = key;
          ++count;
        }
        const int64_t u = slots[pos].index;
        inv[base + i] = u;  // local index for now; made global below
        ++lc[base + u];
      }
      num_unique[s] = count;
    }
  });

  at::Tensor unique_offsets = at::empty({S + 1}, ids.options());
  int64_t* uo = unique_offsets.data_ptr<int64_t>();
  uo[0] = 0;
  for (int64_t s = 0; s < S; ++s) uo[s + 1] = uo[s] + num_unique[s];
  at::Tensor unique = at::empty({uo[S]}, ids.options());
  at::Tensor counts = at::empty({uo[S]}, ids.options());
  int64_t* uq = unique.data_ptr<int64_t>();
  int64_t* ct = counts.data_ptr<int64_t>();
  at::parallel_for(0, S, 1, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) {
      std::copy(lu + so[s], lu + so[s] + num_unique[s], uq + uo[s]);
      std::copy(lc + so[s], lc + so[s] + num_unique[s], ct + uo[s]);
      for (int64_t i = so[s]; i < so[s + 1]; ++i) inv[i] += uo[s];
    }
  });
  return {unique, inverse, counts, unique_offsets};
}

}  // namespace

TORCH_LIBRARY_IMPL(torchrec_ext, CPU, m) { m.impl("dedup_segments", &dedup_segments_cpu); }

}  // namespace torchrec_ext
