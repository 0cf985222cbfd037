// Argument checks of dedup_segments shared by its CPU and CUDA kernels. The offsets' values are
// checked on the host: the CPU kernel reads its own, the CUDA kernel those given on the host or
// the copy it reads back with the unique counts (its one read). Each failure names the op, the
// argument, the constraint and the value.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#include "embedding_checks.h"

namespace torchrec_ext {
namespace {

constexpr const char* kDedupOp = "dedup_segments";

inline void check_dedup_ids(const at::Tensor& ids) {
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong, kDedupOp,
              ": ids must be a 1-D int64 tensor, got ", ids.scalar_type(), " of shape ",
              ids.sizes());
}

// dtype and shape of the (contiguous) offsets; their values: check_segment_offsets.
inline void check_segment_offsets_tensor(const at::Tensor& segment_offsets) {
  check_long_1d(kDedupOp, "segment_offsets", segment_offsets);
  TORCH_CHECK(segment_offsets.numel() >= 1, kDedupOp, ": segment_offsets needs at least one entry");
}

// so: the S + 1 offsets on the host; n: the number of ids.
inline void check_segment_offsets(const int64_t* so, int64_t S, int64_t n) {
  TORCH_CHECK(so[0] == 0 && so[S] == n, kDedupOp,
              ": segment_offsets must run from 0 to the number of ids (", n, "), got ", so[0],
              " .. ", so[S]);
  for (int64_t s = 0; s < S; ++s)
    TORCH_CHECK(so[s] <= so[s + 1], kDedupOp, ": segment_offsets must be non-decreasing, got ",
                so[s], " then ", so[s + 1]);
}

}  // namespace
}  // namespace torchrec_ext
