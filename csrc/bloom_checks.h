// Input checks of bloom_admit shared by its CPU and CUDA kernels: each names the op, the
// argument, the constraint and the value seen, and all run before the filter is touched.
#pragma once
#include <ATen/ATen.h>

#include <optional>

#include "bloom_layout.h"

namespace torchrec_ext {

inline void check_bloom_admit(const at::Tensor& counters, const at::Tensor& keys,
                              const at::Tensor& counts, const std::optional<at::Tensor>& pending,
                              int64_t hashes, int64_t admit_after) {
  const char* op = "bloom_admit";
  TORCH_CHECK(
      counters.scalar_type() == at::kByte && counters.dim() == 1 && counters.is_contiguous(), op,
      ": counters must be a contiguous 1-D uint8 tensor (two 4-bit counters per byte), got ",
      counters.scalar_type(), " of shape ", counters.sizes(),
      counters.is_contiguous() ? "" : " (not contiguous)");
  const int64_t bytes = counters.numel();
  TORCH_CHECK(bytes > 0 && (bytes & (bytes - 1)) == 0, op,
              ": counters must hold a power-of-two number of bytes (cells are hashes modulo the "
              "counter count), got ",
              bytes);
  TORCH_CHECK(keys.scalar_type() == at::kLong && keys.dim() == 1, op,
              ": keys must be a 1-D int64 tensor, got ", keys.scalar_type(), " of shape ",
              keys.sizes());
  TORCH_CHECK(counts.scalar_type() == at::kLong && counts.dim() == 1, op,
              ": counts must be a 1-D int64 tensor, got ", counts.scalar_type(), " of shape ",
              counts.sizes());
  TORCH_CHECK(counts.numel() == keys.numel(), op, ": counts must have one entry per key (",
              keys.numel(), "), got ", counts.numel());
  if (pending.has_value()) {
    TORCH_CHECK(pending->scalar_type() == at::kBool && pending->dim() == 1 &&
                    pending->numel() == keys.numel(),
                op, ": pending must be a 1-D bool tensor with one entry per key (", keys.numel(),
                "), got ", pending->scalar_type(), " of shape ", pending->sizes());
  }
  TORCH_CHECK(hashes >= 1 && hashes <= kBloomMaxHashes, op, ": hashes must be in [1, ",
              kBloomMaxHashes, "], got ", hashes);
  TORCH_CHECK(admit_after >= 1 && admit_after <= kBloomCounterMax, op,
              ": admit_after must be in [1, ", kBloomCounterMax, "] (4-bit counters), got ",
              admit_after);
}

// Sighting counts must be >= 0; the first negative one is named. On a GPU the minimum is read
// back (a device sync); on the host a plain loop (cheaper than a reduction op).
inline void check_bloom_counts(const at::Tensor& counts) {
  if (counts.numel() == 0) return;
  int64_t at = -1;
  if (counts.is_cpu()) {
    const at::Tensor c = counts.contiguous();
    const int64_t* count = c.const_data_ptr<int64_t>();
    for (int64_t i = 0, n = c.numel(); i < n && at < 0; ++i) at = count[i] < 0 ? i : -1;
  } else if (counts.min().item<int64_t>() < 0) {
    at = (counts < 0).nonzero().select(1, 0)[0].item<int64_t>();
  }
  TORCH_CHECK(at < 0, "bloom_admit: counts must be >= 0, got ", counts[at].item<int64_t>(),
              " at entry ", at);
}

}  // namespace torchrec_ext
