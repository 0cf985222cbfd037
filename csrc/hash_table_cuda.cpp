// CUDA kernels of the dynamic hash table ops (torch.ops.torchrec_ext.hash_*) and of `route`:
// the torch side. Validates inputs as the CPU kernels do (plus: every tensor on the table's
// GPU), groups mutation batches by stripe with a stable ATen sort, launches the kernels of
// hash_table_cuda.cu on the current stream, and compacts the variable-length outputs (evicted
// keys, export) with ATen. hash_restore (state_dict load: rare, all validation) runs the CPU
// kernel on host copies. Compiled only in CUDA builds (setup.py).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <initializer_list>
#include <limits>
#include <utility>

#include "hash_table_cuda.h"
#include "hash_table_checks.h"
#include "hash_table_layout.h"

namespace torchrec_ext {
namespace {

cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }





// The kernels take raw pointers: a tensor on the host or on another GPU would be an illegal
// access there, so every tensor of a call must be on the table's GPU.
void check_devices(const char* op, const at::Tensor& digests,
                   std::initializer_list<std::pair<const char*, const at::Tensor*>> tensors) {
  TORCH_CHECK(digests.is_cuda(), op, ": digests must be a CUDA tensor, got one on ",
              digests.device());
  for (const auto& [name, tensor] : tensors) {
    TORCH_CHECK(tensor->device() == digests.device(), op, ": ", name, " must be on ",
                digests.device(), " like the table, got ", tensor->device());
  }
}

// A batch grouped by stripe: the j-th key of the grouping is keys[order[j]], of stripe
// sorted_stripes[j]. The sort is stable, so each stripe keeps its keys in batch order, the
// order in which the kernels apply them.
struct StripeGroups {
  at::Tensor sorted_stripes;  // int32, ascending
  at::Tensor order;           // int64 batch positions
};

// Keys not `pending` (when given) get a stripe past the last, so no stripe kernel visits them.
StripeGroups group_by_stripe(const at::Tensor& keys, int64_t capacity,
                             const at::Tensor& pending = at::Tensor()) {
  at::Tensor stripes = at::empty({keys.numel()}, keys.options().dtype(at::kInt));
  C10_CUDA_CHECK(launch_key_stripes(keys.const_data_ptr<int64_t>(), keys.numel(), capacity,
                                    stripes.mutable_data_ptr<int32_t>(), current_stream()));
  if (pending.defined()) stripes.masked_fill_(pending.logical_not(), std::numeric_limits<int32_t>::max());
  auto [sorted_stripes, order] = at::sort(stripes, /*stable=*/true, /*dim=*/0, /*descending=*/false);
  return {sorted_stripes, order};
}

// ---------------------------------------------------------------------------------------------

std::tuple<at::Tensor, at::Tensor> hash_find_cuda(const at::Tensor& digests,
                                                  const at::Tensor& slot_keys,
                                                  const at::Tensor& keys, int64_t capacity) {
  check_table("hash_find", digests, slot_keys, capacity);
  check_keys("hash_find", keys);
  check_devices("hash_find", digests, {{"slot_keys", &slot_keys}, {"keys", &keys}});
  const c10::cuda::CUDAGuard device_guard(digests.device());
  const at::Tensor k = keys.contiguous();
  const int64_t n = k.numel();
  at::Tensor rows = at::empty({n}, k.options());
  at::Tensor found = at::empty({n}, k.options().dtype(at::kBool));
  C10_CUDA_CHECK(launch_hash_find(digests.const_data_ptr<uint8_t>(),
                                  slot_keys.const_data_ptr<int64_t>(), capacity,
                                  k.const_data_ptr<int64_t>(), n, rows.mutable_data_ptr<int64_t>(),
                                  found.mutable_data_ptr<bool>(), current_stream()));
  return {rows, found};
}

// The upsert kernels on one batch, outputs of one entry per key: rows (-1 for keys not pending,
// or refused), inserted, evicted (the key took an evicted key's row) and that evicted key (0
// elsewhere). Nothing is compacted, so nothing is read on the host.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> upsert_per_key(
    const char* op, at::Tensor& digests, at::Tensor& slot_keys, at::Tensor& slot_scores,
    at::Tensor& size, const at::Tensor& keys, const std::optional<at::Tensor>& scores,
    const std::optional<at::Tensor>& pending, int64_t capacity, int64_t policy_id, int64_t clock,
    int64_t epoch, bool assign) {
  check_table(op, digests, slot_keys, capacity);
  check_keys(op, keys);
  check_size(op, size);
  check_slot_scores(op, slot_scores, capacity);
  const int64_t n = keys.numel();
  const at::Tensor given = check_upsert_args(n, scores, policy_id, clock, epoch);
  const at::Tensor mask = check_pending(n, pending);
  check_devices(op, digests,
                {{"slot_keys", &slot_keys}, {"slot_scores", &slot_scores}, {"size", &size},
                 {"keys", &keys}});
  if (given.defined()) check_devices(op, digests, {{"scores", &given}});
  if (mask.defined()) check_devices(op, digests, {{"pending", &mask}});
  const c10::cuda::CUDAGuard device_guard(digests.device());

  at::Tensor k = keys.contiguous(), g = given, pending_keys = mask, perm;
  if (mask.defined()) {
    // The pending keys first, in batch order: their positions are then those of a call on them
    // alone, which the insert windows (cut by position) depend on. A sort: nothing read on the host.
    perm = std::get<1>(at::sort(mask.logical_not().to(at::kByte), /*stable=*/true, /*dim=*/0,
                                /*descending=*/false));
    k = k.index_select(0, perm);
    if (g.defined()) g = g.index_select(0, perm);
    pending_keys = mask.index_select(0, perm);
  }
  at::Tensor rows = at::full({n}, -1, k.options());  // keys not pending keep -1
  at::Tensor inserted = at::zeros({n}, k.options().dtype(at::kBool));
  at::Tensor evicted = at::zeros({n}, k.options().dtype(at::kBool));
  at::Tensor evicted_key = at::zeros({n}, k.options());
  if (n > 0) {
    const StripeGroups groups = group_by_stripe(k, capacity, pending_keys);
    C10_CUDA_CHECK(launch_hash_upsert(
        digests.mutable_data_ptr<uint8_t>(), slot_keys.mutable_data_ptr<int64_t>(),
        slot_scores.mutable_data_ptr<int64_t>(), size.mutable_data_ptr<int64_t>(), capacity,
        k.const_data_ptr<int64_t>(), g.defined() ? g.const_data_ptr<int64_t>() : nullptr,
        groups.sorted_stripes.const_data_ptr<int32_t>(), groups.order.const_data_ptr<int64_t>(), n,
        policy_id, clock, epoch, assign, rows.mutable_data_ptr<int64_t>(),
        inserted.mutable_data_ptr<bool>(), evicted.mutable_data_ptr<bool>(),
        evicted_key.mutable_data_ptr<int64_t>(), current_stream()));
  }
  if (!perm.defined()) return {rows, inserted, evicted, evicted_key};
  auto unpermuted = [&](const at::Tensor& x) { return at::empty_like(x).index_copy_(0, perm, x); };
  return {unpermuted(rows), unpermuted(inserted), unpermuted(evicted), unpermuted(evicted_key)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> hash_upsert_cuda(
    at::Tensor& digests, at::Tensor& slot_keys, at::Tensor& slot_scores, at::Tensor& size,
    const at::Tensor& keys, const std::optional<at::Tensor>& scores, int64_t capacity,
    int64_t policy_id, int64_t clock, int64_t epoch, bool assign) {
  auto [rows, inserted, evicted, evicted_key] =
      upsert_per_key("hash_upsert", digests, slot_keys, slot_scores, size, keys, scores,
                     std::nullopt, capacity, policy_id, clock, epoch, assign);
  // Evictions in batch position order, as the CPU kernel reports them: a compaction, whose size
  // the host reads (a sync; the training step calls hash_upsert_fixed instead).
  const at::Tensor evicted_at = evicted.nonzero().squeeze(1);
  return {rows, inserted, evicted_key.index_select(0, evicted_at), rows.index_select(0, evicted_at)};
}

// hash_upsert with outputs of one entry per key and a pending mask (see hash_table_cpu.cpp).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> hash_upsert_fixed_cuda(
    at::Tensor& digests, at::Tensor& slot_keys, at::Tensor& slot_scores, at::Tensor& size,
    const at::Tensor& keys, const std::optional<at::Tensor>& scores,
    const std::optional<at::Tensor>& pending, int64_t capacity, int64_t policy_id, int64_t clock,
    int64_t epoch, bool assign) {
  return upsert_per_key("hash_upsert_fixed", digests, slot_keys, slot_scores, size, keys, scores,
                        pending, capacity, policy_id, clock, epoch, assign);
}

at::Tensor hash_erase_cuda(at::Tensor& digests, const at::Tensor& slot_keys, at::Tensor& size,
                           const at::Tensor& keys, int64_t capacity) {
  check_table("hash_erase", digests, slot_keys, capacity);
  check_keys("hash_erase", keys);
  check_size("hash_erase", size);
  check_devices("hash_erase", digests,
                {{"slot_keys", &slot_keys}, {"size", &size}, {"keys", &keys}});
  const c10::cuda::CUDAGuard device_guard(digests.device());
  const at::Tensor k = keys.contiguous();
  const int64_t n = k.numel();
  at::Tensor erased = at::zeros({n}, k.options().dtype(at::kBool));
  if (n > 0) {
    const StripeGroups groups = group_by_stripe(k, capacity);
    C10_CUDA_CHECK(launch_hash_erase(
        digests.mutable_data_ptr<uint8_t>(), slot_keys.const_data_ptr<int64_t>(),
        size.mutable_data_ptr<int64_t>(), capacity, k.const_data_ptr<int64_t>(),
        groups.sorted_stripes.const_data_ptr<int32_t>(), groups.order.const_data_ptr<int64_t>(), n,
        erased.mutable_data_ptr<bool>(), current_stream()));
  }
  return erased;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> hash_export_cuda(const at::Tensor& digests,
                                                                const at::Tensor& slot_keys,
                                                                const at::Tensor& slot_scores,
                                                                int64_t capacity, int64_t start,
                                                                int64_t end) {
  check_table("hash_export", digests, slot_keys, capacity);
  check_slot_scores("hash_export", slot_scores, capacity);
  const TableGeometry geo = make_geometry(capacity);
  TORCH_CHECK(0 <= start && start <= end && end <= geo.num_slots(),
              "hash_export: need 0 <= start <= end <= ", geo.num_slots(), ", got start=", start,
              " end=", end);
  check_devices("hash_export", digests, {{"slot_keys", &slot_keys}, {"slot_scores", &slot_scores}});
  const c10::cuda::CUDAGuard device_guard(digests.device());
  // Rows past capacity are never used; live rows come out ascending, as on CPU.
  const int64_t last = std::min(end, capacity);
  const int64_t first = std::min(start, last);
  at::Tensor rows = digests.slice(0, first, last).ne(0).nonzero().squeeze(1).add_(first);
  return {slot_keys.index_select(0, rows), rows, slot_scores.index_select(0, rows)};
}

void hash_restore_cuda(at::Tensor& digests, at::Tensor& slot_keys, at::Tensor& slot_scores,
                       at::Tensor& size, const at::Tensor& keys, const at::Tensor& rows,
                       const at::Tensor& scores, int64_t capacity) {
  check_table("hash_restore", digests, slot_keys, capacity);
  check_slot_scores("hash_restore", slot_scores, capacity);
  check_size("hash_restore", size);
  check_devices("hash_restore", digests,
                {{"slot_keys", &slot_keys}, {"slot_scores", &slot_scores}, {"size", &size},
                 {"keys", &keys}, {"rows", &rows}, {"scores", &scores}});
  // The CPU kernel validates everything before its first write; the table is copied back only
  // when it succeeds, so a bad state leaves this one unchanged too.
  static const auto restore_cpu =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("torchrec_ext::hash_restore", "")
          .typed<void(at::Tensor&, at::Tensor&, at::Tensor&, at::Tensor&, const at::Tensor&,
                      const at::Tensor&, const at::Tensor&, int64_t)>();
  at::Tensor host_digests = digests.cpu(), host_keys = slot_keys.cpu(),
             host_scores = slot_scores.cpu(), host_size = size.cpu();
  restore_cpu.call(host_digests, host_keys, host_scores, host_size, keys.cpu(), rows.cpu(),
                   scores.cpu(), capacity);
  digests.copy_(host_digests);
  slot_keys.copy_(host_keys);
  slot_scores.copy_(host_scores);
  size.copy_(host_size);
}

at::Tensor route_cuda(const at::Tensor& keys, int64_t world_size) {
  check_keys("route", keys);
  check_world_size("route", world_size);
  TORCH_CHECK(keys.is_cuda(), "route: keys must be a CUDA tensor, got one on ", keys.device());
  const c10::cuda::CUDAGuard device_guard(keys.device());
  const at::Tensor k = keys.contiguous();
  at::Tensor ranks = at::empty_like(k);
  C10_CUDA_CHECK(launch_route(k.const_data_ptr<int64_t>(), k.numel(), world_size,
                              ranks.mutable_data_ptr<int64_t>(), current_stream()));
  return ranks;
}

}  // namespace

TORCH_LIBRARY_IMPL(torchrec_ext, CUDA, m) {
  m.impl("hash_find", &hash_find_cuda);
  m.impl("hash_upsert", &hash_upsert_cuda);
  m.impl("hash_upsert_fixed", &hash_upsert_fixed_cuda);
  m.impl("hash_erase", &hash_erase_cuda);
  m.impl("hash_export", &hash_export_cuda);
  m.impl("hash_restore", &hash_restore_cuda);
  m.impl("route", &route_cuda);
}

}  // namespace torchrec_ext
