// Input checks shared by the CPU and CUDA kernels of the hash table ops: the ops are public
// (torch.ops.torchrec_ext.*), so each validates its tensors with a TORCH_CHECK naming the op,
// the argument, the constraint and the value seen, whatever the backend.
#pragma once
#include <ATen/ATen.h>

#include <algorithm>
#include <initializer_list>
#include <optional>
#include <utility>
#include <vector>

#include "hash_table_layout.h"

namespace torchrec_ext {

inline void check_table(const char* op, const at::Tensor& digests, const at::Tensor& slot_keys,
                        int64_t capacity) {
  TORCH_CHECK(capacity > 0, op, ": capacity must be > 0, got ", capacity);
  const TableGeometry g = make_geometry(capacity);
  TORCH_CHECK(digests.scalar_type() == at::kByte && digests.is_contiguous() &&
                  digests.numel() == g.digest_slots(),
              op, ": digests must be a contiguous uint8 tensor of ", g.digest_slots(),
              " entries for capacity ", capacity, " (slots, stash, stash counts), got ",
              digests.scalar_type(), " of ", digests.numel());
  TORCH_CHECK(slot_keys.scalar_type() == at::kLong && slot_keys.is_contiguous() &&
                  slot_keys.numel() == g.key_slots(),
              op, ": slot_keys must be a contiguous int64 tensor of ", g.key_slots(),
              " entries for capacity ", capacity, " (slots, stash rows, stash keys), got ",
              slot_keys.scalar_type(), " of ", slot_keys.numel());
}

inline void check_slot_scores(const char* op, const at::Tensor& slot_scores, int64_t capacity) {
  const TableGeometry g = make_geometry(capacity);
  TORCH_CHECK(slot_scores.scalar_type() == at::kLong && slot_scores.is_contiguous() &&
                  slot_scores.numel() == g.num_slots(),
              op, ": slot_scores must be a contiguous int64 tensor of ", g.num_slots(), " slots");
}

// hash_export's table and its slot range [start, end).
inline void check_export(const at::Tensor& digests, const at::Tensor& slot_keys,
                         const at::Tensor& slot_scores, int64_t capacity, int64_t start,
                         int64_t end) {
  check_table("hash_export", digests, slot_keys, capacity);
  check_slot_scores("hash_export", slot_scores, capacity);
  const int64_t slots = make_geometry(capacity).num_slots();
  TORCH_CHECK(0 <= start && start <= end && end <= slots,
              "hash_export: need 0 <= start <= end <= ", slots, ", got start=", start,
              " end=", end);
}

inline void check_size(const char* op, const at::Tensor& size) {
  TORCH_CHECK(size.scalar_type() == at::kLong && size.numel() == 1, op,
              ": size must be a one-element int64 tensor, got ", size.scalar_type(), " of ",
              size.numel());
}

inline void check_keys(const char* op, const at::Tensor& keys) {
  TORCH_CHECK(keys.dim() == 1, op, ": keys must be 1-D, got shape ", keys.sizes());
  TORCH_CHECK(keys.scalar_type() == at::kLong, op, ": keys must be int64, got ",
              keys.scalar_type());
}

// Keys that each take a row of their own (a state to restore, keys to place) must be distinct.
inline void check_distinct_keys(const char* op, const int64_t* keys, int64_t n) {
  std::vector<int64_t> sorted(keys, keys + n);
  std::sort(sorted.begin(), sorted.end());
  const auto dup = std::adjacent_find(sorted.begin(), sorted.end());
  TORCH_CHECK(dup == sorted.end(), op, ": key ", dup == sorted.end() ? 0 : *dup, " appears twice");
}

inline void check_world_size(const char* op, int64_t world_size) {
  TORCH_CHECK(world_size > 0 && world_size < (int64_t{1} << 31), op,
              ": world_size must be in [1, 2^31), got ", world_size);
}

// hash_upsert's scalar arguments and optional scores; returns the scores made contiguous
// (undefined when none were given).
inline at::Tensor check_upsert_args(int64_t n, const std::optional<at::Tensor>& scores,
                                    int64_t policy_id, int64_t clock, int64_t epoch) {
  TORCH_CHECK(policy_id >= 0 && policy_id <= static_cast<int64_t>(Policy::kCustom),
              "hash_upsert: unknown policy id ", policy_id);
  // The clock is an LRU score and picks the call's first insert phase: never negative.
  TORCH_CHECK(clock >= 0, "hash_upsert: clock must be >= 0, got ", clock);
  TORCH_CHECK(epoch >= 0 && epoch < (int64_t{1} << 31),
              "hash_upsert: epoch must be in [0, 2^31), got ", epoch);
  TORCH_CHECK(static_cast<Policy>(policy_id) != Policy::kCustom || scores.has_value(),
              "hash_upsert: the custom policy needs scores");
  if (!scores.has_value()) return at::Tensor();
  at::Tensor given = scores->contiguous();
  TORCH_CHECK(given.scalar_type() == at::kLong && given.dim() == 1 && given.numel() == n,
              "hash_upsert: scores must be a 1-D int64 tensor of ", n, " elements, got ",
              given.scalar_type(), " of shape ", given.sizes());
  return given;
}

// hash_upsert_fixed's pending mask: none, or a 1-D bool tensor of one flag per key.
inline at::Tensor check_pending(int64_t n, const std::optional<at::Tensor>& pending) {
  if (!pending.has_value()) return at::Tensor();
  const at::Tensor p = pending->contiguous();
  TORCH_CHECK(p.scalar_type() == at::kBool && p.dim() == 1 && p.numel() == n,
              "hash_upsert_fixed: pending must be a 1-D bool tensor of ", n, " elements, got ",
              p.scalar_type(), " of shape ", p.sizes());
  return p;
}

// hash_upsert_tables' arguments, all checked before any table is written: one entry per table
// in every list, key_offsets ascending from 0 to keys.numel(), each table valid as
// hash_upsert_fixed checks it, and no table given twice (the tables are applied independently).
// The arguments every multi-table op shares: one entry per table in each list (`lists`: name,
// length), key_offsets ascending from 0 to keys.numel(), each table's index arrays valid.
inline void check_tables(const char* op, at::TensorList digests, at::TensorList slot_keys,
                         const at::Tensor& keys, at::IntArrayRef key_offsets,
                         at::IntArrayRef capacities,
                         std::initializer_list<std::pair<const char*, int64_t>> lists) {
  check_keys(op, keys);
  const int64_t T = static_cast<int64_t>(digests.size());
  auto check_length = [&](const char* name, int64_t len) {
    TORCH_CHECK(len == T, op, ": ", name, " must have one entry per table (", T,
                ", as digests), got ", len);
  };
  check_length("slot_keys", static_cast<int64_t>(slot_keys.size()));
  check_length("capacities", static_cast<int64_t>(capacities.size()));
  for (const auto& [name, len] : lists) check_length(name, len);
  TORCH_CHECK(static_cast<int64_t>(key_offsets.size()) == T + 1, op, ": key_offsets must have ",
              T + 1, " entries (tables + 1), got ", key_offsets.size());
  TORCH_CHECK(key_offsets[0] == 0 && key_offsets[T] == keys.numel(), op,
              ": key_offsets must run from 0 to keys.numel() = ", keys.numel(), ", got ",
              key_offsets[0], " to ", key_offsets[T]);
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(key_offsets[t] <= key_offsets[t + 1], op, ": key_offsets must not decrease, got ",
                key_offsets[t], " then ", key_offsets[t + 1], " at table ", t);
    check_table(op, digests[t], slot_keys[t], capacities[t]);
  }
}

inline void check_upsert_tables(at::TensorList digests, at::TensorList slot_keys,
                                at::TensorList slot_scores, at::TensorList sizes,
                                const at::Tensor& keys, at::IntArrayRef key_offsets,
                                const std::optional<at::Tensor>& scores,
                                const std::optional<at::Tensor>& pending,
                                at::IntArrayRef capacities, at::IntArrayRef policies,
                                at::IntArrayRef clocks, at::IntArrayRef epochs) {
  constexpr const char* op = "hash_upsert_tables";
  check_tables(op, digests, slot_keys, keys, key_offsets, capacities,
               {{"slot_scores", static_cast<int64_t>(slot_scores.size())},
                {"sizes", static_cast<int64_t>(sizes.size())},
                {"policies", static_cast<int64_t>(policies.size())},
                {"clocks", static_cast<int64_t>(clocks.size())},
                {"epochs", static_cast<int64_t>(epochs.size())}});
  const int64_t T = static_cast<int64_t>(digests.size());
  for (int64_t t = 0; t < T; ++t) {
    check_slot_scores(op, slot_scores[t], capacities[t]);
    check_size(op, sizes[t]);
    check_upsert_args(keys.numel(), scores, policies[t], clocks[t], epochs[t]);
    for (int64_t u = 0; u < t; ++u) {
      TORCH_CHECK(!digests[u].is_same(digests[t]) && digests[u].data_ptr() != digests[t].data_ptr(),
                  op, ": table ", t, " is table ", u, " again (the same digests)");
    }
  }
  check_pending(keys.numel(), pending);
}

}  // namespace torchrec_ext
