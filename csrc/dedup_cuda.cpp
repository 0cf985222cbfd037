// CUDA kernel of dedup_segments: the torch side. Runs dedup_cuda.cu's steps on the current stream
// with one read of the host: the unique counts (they size the outputs) and the offsets, in one
// copy. segment_offsets may be on the ids' GPU (validated on the copy read back, as the CPU kernel
// validates its own, before any output is made) or on the host (validated before any launch, and
// unique_offsets is then returned on the host too: the values read, so a caller has them without
// a second read; ops.dedup_segments passes the host copy it holds). Compiled only in CUDA builds.
#include "dedup_cuda.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>
#include <tuple>

#include "dedup_checks.h"

namespace torchrec_ext {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> dedup_segments_cuda(
    const at::Tensor& ids_in, const at::Tensor& segment_offsets_in) {
  const char* op = kDedupOp;
  check_dedup_ids(ids_in);
  TORCH_CHECK(ids_in.is_cuda(), op, ": ids must be a CUDA tensor, got one on ", ids_in.device());
  const bool on_host = segment_offsets_in.device() != ids_in.device();
  TORCH_CHECK(!on_host || segment_offsets_in.is_cpu(), op, ": segment_offsets must be on ",
              ids_in.device(), " like ids, or on the host, got one on ",
              segment_offsets_in.device());
  const c10::cuda::CUDAGuard device_guard(ids_in.device());
  const at::Tensor ids = ids_in.contiguous();
  const at::Tensor seg = segment_offsets_in.contiguous();
  check_segment_offsets_tensor(seg);
  const int64_t S = seg.numel() - 1, n = ids.numel();
  if (on_host) check_segment_offsets(seg.const_data_ptr<int64_t>(), S, n);
  // (pinned, so the copy does not wait for the stream)
  const at::Tensor so = on_host ? seg.pin_memory().to(ids.device(), /*non_blocking=*/true) : seg;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();

  int64_t num_slots = 32;
  while (num_slots < 2 * n) num_slots <<= 1;
  const at::Tensor slots = at::full({2 * num_slots}, -1, ids.options());
  const at::Tensor slot_of = at::empty({n}, ids.options());
  at::Tensor ranks = at::empty({n + 1}, ids.options());
  const int64_t* so_ptr = so.const_data_ptr<int64_t>();
  long long* slots_ptr = reinterpret_cast<long long*>(slots.data_ptr<int64_t>());
  C10_CUDA_CHECK(launch_dedup_first_occurrences(ids.const_data_ptr<int64_t>(), n, so_ptr, S,
                                                slots_ptr, num_slots, slot_of.data_ptr<int64_t>(),
                                                ranks.data_ptr<int64_t>(), stream));
  ranks.cumsum_(0);  // ranks[i]: first occurrences before position i
  const at::Tensor read = at::empty({2 * (S + 1)}, ids.options());
  C10_CUDA_CHECK(launch_dedup_bounds(so_ptr, S, n, ranks.const_data_ptr<int64_t>(),
                                     read.data_ptr<int64_t>(), stream));
  const at::Tensor host = read.to(at::kCPU);  // the one read: waits for the steps above
  const int64_t* bounds = host.const_data_ptr<int64_t>();
  if (!on_host) check_segment_offsets(bounds + S + 1, S, n);
  const int64_t num_unique = bounds[S];

  at::Tensor unique = at::empty({num_unique}, ids.options());
  at::Tensor inverse = at::empty({n}, ids.options());
  at::Tensor counts = at::empty({num_unique}, ids.options());
  C10_CUDA_CHECK(launch_dedup_outputs(
      ids.const_data_ptr<int64_t>(), n, slots_ptr, slot_of.const_data_ptr<int64_t>(),
      ranks.const_data_ptr<int64_t>(), unique.data_ptr<int64_t>(), inverse.data_ptr<int64_t>(),
      counts.data_ptr<int64_t>(), stream));
  at::Tensor unique_offsets = (on_host ? host : read).narrow(0, 0, S + 1);
  return {unique, inverse, counts, unique_offsets};
}

}  // namespace

TORCH_LIBRARY_IMPL(torchrec_ext, CUDA, m) { m.impl("dedup_segments", &dedup_segments_cuda); }

}  // namespace torchrec_ext
