// CUDA kernels of the dynamic hash table ops (torch.ops.torchrec_ext.hash_*) and of `route`:
// the torch side. Validates inputs as the CPU kernels do (plus: every tensor on the table's
// GPU), groups mutation batches by stripe with a stable ATen sort, launches the kernels of
// hash_table_cuda.cu on the current stream, and compacts the variable-length outputs (evicted
// keys, export) with ATen. hash_restore (state_dict load: rare, all validation) runs the CPU
// kernel on host copies. Compiled only in CUDA builds (setup.py).
#include "hash_table_cuda.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <utility>
#include <vector>

#include "cuda_binding_checks.h"
#include "hash_table_checks.h"
#include "hash_table_layout.h"

namespace torchrec_ext {
namespace {

cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

// The table on a GPU, and every other tensor of the call on the table's GPU.
void check_devices(const char* op, const at::Tensor& digests,
                   std::initializer_list<std::pair<const char*, const at::Tensor*>> tensors) {
  TORCH_CHECK(digests.is_cuda(), op, ": digests must be a CUDA tensor, got one on ",
              digests.device());
  check_on_anchor_device(op, digests, "the table", tensors);
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
  if (pending.defined())
    stripes.masked_fill_(pending.logical_not(), std::numeric_limits<int32_t>::max());
  auto [sorted_stripes, order] =
      at::sort(stripes, /*stable=*/true, /*dim=*/0, /*descending=*/false);
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

// The upsert kernels' outputs, one entry per key: rows (-1 for keys not pending, or refused),
// inserted, evicted (the key took an evicted key's row) and that evicted key (0 elsewhere).
// Nothing is compacted, so nothing is read on the host.
struct UpsertOutputs {
  at::Tensor rows, inserted, evicted, evicted_key;

  UpsertOutputs(int64_t n, const at::TensorOptions& keys)
      : rows(at::full({n}, -1, keys)),
        inserted(at::zeros({n}, keys.dtype(at::kBool))),
        evicted(at::zeros({n}, keys.dtype(at::kBool))),
        evicted_key(at::zeros({n}, keys)) {}

  // In batch order, where the kernels ran on the keys permuted by `perm` (undefined: not).
  std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> in_batch_order(
      const at::Tensor& perm = at::Tensor()) const {
    if (!perm.defined()) return {rows, inserted, evicted, evicted_key};
    auto unpermuted = [&](const at::Tensor& x) {
      return at::empty_like(x).index_copy_(0, perm, x);
    };
    return {unpermuted(rows), unpermuted(inserted), unpermuted(evicted), unpermuted(evicted_key)};
  }
};

// The upsert kernels on one batch (see UpsertOutputs).
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
  check_devices(
      op, digests,
      {{"slot_keys", &slot_keys}, {"slot_scores", &slot_scores}, {"size", &size}, {"keys", &keys}});
  if (given.defined()) check_devices(op, digests, {{"scores", &given}});
  if (mask.defined()) check_devices(op, digests, {{"pending", &mask}});
  const c10::cuda::CUDAGuard device_guard(digests.device());

  at::Tensor k = keys.contiguous(), g = given, pending_keys = mask, perm;
  if (mask.defined()) {
    // The pending keys first, in batch order: their positions are then those of a call on them
    // alone, which the insert windows (cut by position) depend on. A sort: nothing read on the
    // host.
    perm = std::get<1>(at::sort(mask.logical_not().to(at::kByte), /*stable=*/true, /*dim=*/0,
                                /*descending=*/false));
    k = k.index_select(0, perm);
    if (g.defined()) g = g.index_select(0, perm);
    pending_keys = mask.index_select(0, perm);
  }
  UpsertOutputs out(n, k.options());
  if (n > 0) {
    const StripeGroups groups = group_by_stripe(k, capacity, pending_keys);
    at::Tensor stripe_offsets =
        at::empty({make_geometry(capacity).num_stripes + 1}, k.options());  // kernels' scratch
    C10_CUDA_CHECK(launch_hash_upsert(
        digests.mutable_data_ptr<uint8_t>(), slot_keys.mutable_data_ptr<int64_t>(),
        slot_scores.mutable_data_ptr<int64_t>(), size.mutable_data_ptr<int64_t>(), capacity,
        k.const_data_ptr<int64_t>(), g.defined() ? g.const_data_ptr<int64_t>() : nullptr,
        groups.sorted_stripes.const_data_ptr<int32_t>(), groups.order.const_data_ptr<int64_t>(), n,
        stripe_offsets.mutable_data_ptr<int64_t>(), policy_id, clock, epoch, assign,
        out.rows.mutable_data_ptr<int64_t>(), out.inserted.mutable_data_ptr<bool>(),
        out.evicted.mutable_data_ptr<bool>(), out.evicted_key.mutable_data_ptr<int64_t>(),
        current_stream()));
  }
  return out.in_batch_order(perm);
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
  return {rows, inserted, evicted_key.index_select(0, evicted_at),
          rows.index_select(0, evicted_at)};
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

// The descriptors of a multi-table op's tables on the GPU: T UpsertTable, then the bounds of
// their insert windows (absolute batch positions), in one copy from pinned host memory (no sync).
// A find passes empty slot_scores / sizes / policies / clocks / epochs.
struct TableDescriptors {
  at::Tensor buffer;  // keeps the device copy alive while the call's launches are built
  const UpsertTable* tables;
  const int64_t* windows;
  int64_t total_stripes = 0;
  int phases = 1;
  int64_t max_windows = 0;
};

TableDescriptors describe_tables(at::TensorList digests, at::TensorList slot_keys,
                                 at::TensorList slot_scores, at::TensorList sizes,
                                 at::IntArrayRef key_offsets, at::IntArrayRef capacities,
                                 at::IntArrayRef policies, at::IntArrayRef clocks,
                                 at::IntArrayRef epochs) {
  const int64_t T = static_cast<int64_t>(digests.size());
  std::vector<UpsertTable> tables(T);
  std::vector<int64_t> windows;
  TableDescriptors out;
  for (int64_t t = 0; t < T; ++t) {
    UpsertTable& d = tables[t];
    d.digests = digests[t].mutable_data_ptr<uint8_t>();
    d.slot_keys = slot_keys[t].mutable_data_ptr<int64_t>();
    const bool upsert = !slot_scores.empty();  // a find passes no scores, sizes or policies
    d.slot_scores = upsert ? slot_scores[t].mutable_data_ptr<int64_t>() : nullptr;
    d.size = upsert ? sizes[t].mutable_data_ptr<int64_t>() : nullptr;
    d.geo = make_geometry(capacities[t]);
    d.key_begin = key_offsets[t];
    d.key_end = key_offsets[t + 1];
    d.stripe_begin = out.total_stripes;
    d.policy = upsert ? policies[t] : 0;
    d.clock = upsert ? clocks[t] : 0;
    d.epoch = upsert ? epochs[t] : 0;
    d.window_begin = static_cast<int64_t>(windows.size());
    out.total_stripes += d.geo.num_stripes;
    // The windows launch_hash_upsert cuts this table's batch into (from its size: no sync).
    const int phases = upsert_phase_count(d.geo.num_stripes);
    const int64_t n = d.key_end - d.key_begin;
    windows.push_back(d.key_begin);
    for (int64_t begin = 0, end; begin < n; begin = end) {
      end = phases == 1 ? n : std::min(n, begin + upsert_window(capacities[t], begin));
      windows.push_back(d.key_begin + end);
    }
    d.windows = static_cast<int64_t>(windows.size()) - d.window_begin - 1;
    out.phases = std::max(out.phases, phases);
    out.max_windows = std::max(out.max_windows, d.windows);
  }
  TORCH_CHECK(out.total_stripes < std::numeric_limits<int32_t>::max(),
              "hash_upsert_tables: ", out.total_stripes, " stripes in all: at most 2^31 - 2");
  const size_t table_bytes = tables.size() * sizeof(UpsertTable),
               window_bytes = windows.size() * sizeof(int64_t);
  at::Tensor host =
      at::empty({static_cast<int64_t>(table_bytes + window_bytes)},
                at::TensorOptions().dtype(at::kByte).pinned_memory(digests[0].is_cuda()));
  std::memcpy(host.mutable_data_ptr<uint8_t>(), tables.data(), table_bytes);
  std::memcpy(host.mutable_data_ptr<uint8_t>() + table_bytes, windows.data(), window_bytes);
  out.buffer = host.to(host.options().device(digests[0].device()).pinned_memory(false),
                       /*non_blocking=*/true);
  out.tables = reinterpret_cast<const UpsertTable*>(out.buffer.const_data_ptr<uint8_t>());
  out.windows =
      reinterpret_cast<const int64_t*>(out.buffer.const_data_ptr<uint8_t>() + table_bytes);
  return out;
}

// hash_find of several tables: one launch for all of them.
std::tuple<at::Tensor, at::Tensor> hash_find_tables_cuda(at::TensorList digests,
                                                         at::TensorList slot_keys,
                                                         const at::Tensor& keys,
                                                         at::IntArrayRef key_offsets,
                                                         at::IntArrayRef capacities) {
  constexpr const char* op = "hash_find_tables";
  check_tables(op, digests, slot_keys, keys, key_offsets, capacities, {});
  const int64_t T = static_cast<int64_t>(digests.size()), n = keys.numel();
  const at::Tensor k = keys.contiguous();
  at::Tensor rows = at::empty({n}, k.options());
  at::Tensor found = at::empty({n}, k.options().dtype(at::kBool));
  if (T == 0 || n == 0) return {rows, found};
  for (int64_t t = 0; t < T; ++t) {
    check_devices(op, digests[0], {{"digests", &digests[t]}, {"slot_keys", &slot_keys[t]}});
  }
  check_devices(op, digests[0], {{"keys", &keys}});
  const c10::cuda::CUDAGuard device_guard(digests[0].device());
  const TableDescriptors d =
      describe_tables(digests, slot_keys, {}, {}, key_offsets, capacities, {}, {}, {});
  C10_CUDA_CHECK(launch_hash_find_tables(d.tables, T, k.const_data_ptr<int64_t>(), n,
                                         rows.mutable_data_ptr<int64_t>(),
                                         found.mutable_data_ptr<bool>(), current_stream()));
  return {rows, found};
}

// hash_upsert_fixed of several tables: one pass of launches for all of them (see
// hash_table_cuda.cu), each table's keys ordered as the per-table kernel orders them, so each
// table gets exactly its per-table results.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> hash_upsert_tables_cuda(
    at::TensorList digests, at::TensorList slot_keys, at::TensorList slot_scores,
    at::TensorList sizes, const at::Tensor& keys, at::IntArrayRef key_offsets,
    const std::optional<at::Tensor>& scores, const std::optional<at::Tensor>& pending,
    at::IntArrayRef capacities, at::IntArrayRef policies, at::IntArrayRef clocks,
    at::IntArrayRef epochs, bool assign) {
  constexpr const char* op = "hash_upsert_tables";
  check_upsert_tables(digests, slot_keys, slot_scores, sizes, keys, key_offsets, scores, pending,
                      capacities, policies, clocks, epochs);
  const int64_t T = static_cast<int64_t>(digests.size()), n = keys.numel();
  const at::Tensor given = scores.has_value() ? scores->contiguous() : at::Tensor();
  const at::Tensor mask = pending.has_value() ? pending->contiguous() : at::Tensor();
  at::Tensor k = keys.contiguous(), g = given;
  UpsertOutputs out(n, k.options());
  if (T == 0 || n == 0) return out.in_batch_order();
  for (int64_t t = 0; t < T; ++t) {
    check_devices(op, digests[0],
                  {{"digests", &digests[t]},
                   {"slot_keys", &slot_keys[t]},
                   {"slot_scores", &slot_scores[t]},
                   {"sizes", &sizes[t]}});
  }
  check_devices(op, digests[0], {{"keys", &keys}});
  if (given.defined()) check_devices(op, digests[0], {{"scores", &given}});
  if (mask.defined()) check_devices(op, digests[0], {{"pending", &mask}});
  const c10::cuda::CUDAGuard device_guard(digests[0].device());
  const TableDescriptors d = describe_tables(digests, slot_keys, slot_scores, sizes, key_offsets,
                                             capacities, policies, clocks, epochs);
  at::Tensor table_of = at::empty({n}, k.options().dtype(at::kInt));
  at::Tensor stripes = at::empty({n}, k.options().dtype(at::kInt));
  C10_CUDA_CHECK(launch_key_table_stripes(d.tables, T, k.const_data_ptr<int64_t>(), n,
                                          table_of.mutable_data_ptr<int32_t>(),
                                          stripes.mutable_data_ptr<int32_t>(), current_stream()));
  at::Tensor perm;
  if (mask.defined()) {
    // Each table's pending keys first, in batch order, as upsert_per_key orders one table's.
    perm = std::get<1>(at::sort(table_of.to(at::kLong) * 2 + mask.logical_not().to(at::kLong),
                                /*stable=*/true,
                                /*dim=*/0, /*descending=*/false));
    k = k.index_select(0, perm);
    if (g.defined()) g = g.index_select(0, perm);
    stripes = stripes.index_select(0, perm);
    stripes.masked_fill_(mask.index_select(0, perm).logical_not(),
                         std::numeric_limits<int32_t>::max());
  }
  auto [sorted_stripes, order] =
      at::sort(stripes, /*stable=*/true, /*dim=*/0, /*descending=*/false);
  at::Tensor stripe_offsets = at::empty({d.total_stripes + 1}, k.options());  // kernels' scratch
  C10_CUDA_CHECK(launch_hash_upsert_tables(
      d.tables, T, d.total_stripes, d.phases, d.max_windows, d.windows, k.const_data_ptr<int64_t>(),
      g.defined() ? g.const_data_ptr<int64_t>() : nullptr, sorted_stripes.const_data_ptr<int32_t>(),
      order.const_data_ptr<int64_t>(), n, stripe_offsets.mutable_data_ptr<int64_t>(), assign,
      out.rows.mutable_data_ptr<int64_t>(), out.inserted.mutable_data_ptr<bool>(),
      out.evicted.mutable_data_ptr<bool>(), out.evicted_key.mutable_data_ptr<int64_t>(),
      current_stream()));
  return out.in_batch_order(perm);
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
  check_export(digests, slot_keys, slot_scores, capacity, start, end);
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
                {{"slot_keys", &slot_keys},
                 {"slot_scores", &slot_scores},
                 {"size", &size},
                 {"keys", &keys},
                 {"rows", &rows},
                 {"scores", &scores}});
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
  m.impl("hash_upsert_tables", &hash_upsert_tables_cuda);
  m.impl("hash_find_tables", &hash_find_tables_cuda);
  m.impl("hash_erase", &hash_erase_cuda);
  m.impl("hash_export", &hash_export_cuda);
  m.impl("hash_restore", &hash_restore_cuda);
  m.impl("route", &route_cuda);
}

}  // namespace torchrec_ext
