// CUDA kernel of bloom_admit: the torch side. Validates inputs as the CPU kernel does (plus:
// every tensor on the filter's GPU), gives the kernels the filter as aligned 32-bit words, and
// launches bloom_cuda.cu on the current stream. Compiled only in CUDA builds (setup.py).
#include "bloom_cuda.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>

#include "bloom_checks.h"
#include "cuda_binding_checks.h"

namespace torchrec_ext {
namespace {

at::Tensor bloom_admit_cuda(at::Tensor& counters, const at::Tensor& keys_in,
                            const at::Tensor& counts_in,
                            const std::optional<at::Tensor>& pending_in, int64_t hash_seed,
                            int64_t hashes, int64_t admit_after) {
  check_bloom_admit(counters, keys_in, counts_in, pending_in, hashes, admit_after);
  TORCH_CHECK(counters.is_cuda(), "bloom_admit: counters must be a CUDA tensor, got one on ",
              counters.device());
  check_on_anchor_device("bloom_admit", counters, "the filter",
                         {{"keys", &keys_in},
                          {"counts", &counts_in},
                          {"pending", pending_in.has_value() ? &*pending_in : nullptr}});
  const c10::cuda::CUDAGuard device_guard(counters.device());
  check_bloom_counts(counts_in);
  const at::Tensor keys = keys_in.contiguous(), counts = counts_in.contiguous();
  const std::optional<at::Tensor> pending =
      pending_in.has_value() ? std::optional<at::Tensor>(pending_in->contiguous()) : std::nullopt;
  const int64_t n = keys.numel();
  at::Tensor admitted = at::zeros({n}, keys.options().dtype(at::kBool));
  if (n == 0) return admitted;
  // The kernels CAS 32-bit words: a filter of fewer than 4 bytes, or one not 4-byte aligned (a
  // view), is worked on in a padded copy, so no word reaches past the filter's own bytes.
  const int64_t bytes = counters.numel();
  const bool in_place = bytes % 4 == 0 && reinterpret_cast<uintptr_t>(counters.data_ptr()) % 4 == 0;
  at::Tensor words = in_place ? counters : at::zeros({(bytes + 3) / 4 * 4}, counters.options());
  if (!in_place) words.narrow(0, 0, bytes).copy_(counters);
  C10_CUDA_CHECK(launch_bloom_admit(
      reinterpret_cast<uint32_t*>(words.data_ptr<uint8_t>()), 2 * bytes,
      keys.const_data_ptr<int64_t>(), counts.const_data_ptr<int64_t>(),
      pending.has_value() ? pending->const_data_ptr<bool>() : nullptr, n, hash_seed, hashes,
      admit_after, admitted.data_ptr<bool>(), c10::cuda::getCurrentCUDAStream().stream()));
  if (!in_place) counters.copy_(words.narrow(0, 0, bytes));
  return admitted;
}

}  // namespace

TORCH_LIBRARY_IMPL(torchrec_ext, CUDA, m) { m.impl("bloom_admit", &bloom_admit_cuda); }

}  // namespace torchrec_ext
