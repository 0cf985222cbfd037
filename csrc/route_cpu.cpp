// CPU kernel of route_bucketize: the input routing of sharded dynamic tables in one pass.
//
// Every id goes to a rank (row-wise slots: route_key, the hash independent of the tables'
// bucket hash; table-wise slots: the slot's owner), and the ids are regrouped destination-major,
// then by bag, keeping their order within a bag: the layout KJTAllToAll sends. A counting sort
// over (destination, bag), so linear in the ids plus the bags.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <vector>

#include "hash_table_layout.h"

namespace torchrec_ext {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> route_bucketize_cpu(const at::Tensor& ids_in,
                                                                   const at::Tensor& lengths_in,
                                                                   at::IntArrayRef slot_owner,
                                                                   int64_t world_size,
                                                                   int64_t batch_size) {
  const char* op = "route_bucketize";
  TORCH_CHECK(ids_in.dim() == 1 && ids_in.scalar_type() == at::kLong, op,
              ": ids must be a 1-D int64 tensor, got ", ids_in.scalar_type(), " of shape ",
              ids_in.sizes());
  TORCH_CHECK(lengths_in.dim() == 1 && lengths_in.scalar_type() == at::kLong, op,
              ": lengths must be a 1-D int64 tensor, got ", lengths_in.scalar_type(), " of shape ",
              lengths_in.sizes());
  TORCH_CHECK(world_size > 0 && world_size < (int64_t{1} << 31), op,
              ": world_size must be in [1, 2^31), got ", world_size);
  TORCH_CHECK(batch_size >= 0, op, ": batch_size must be >= 0, got ", batch_size);
  const int64_t slots = static_cast<int64_t>(slot_owner.size()), bags = slots * batch_size;
  TORCH_CHECK(lengths_in.numel() == bags, op, ": lengths must have one entry per slot and sample (",
              bags, "), got ", lengths_in.numel());
  for (int64_t s = 0; s < slots; ++s)
    TORCH_CHECK(slot_owner[s] >= -1 && slot_owner[s] < world_size, op, ": slot_owner[", s,
                "] must be -1 (row-wise) ", "or a rank in [0, ", world_size, "), got ",
                slot_owner[s]);
  const at::Tensor ids = ids_in.contiguous(), lengths = lengths_in.contiguous();
  const int64_t* id = ids.data_ptr<int64_t>();
  const int64_t* len = lengths.data_ptr<int64_t>();
  const int64_t n = ids.numel();
  int64_t total = 0;
  for (int64_t g = 0; g < bags; ++g) {
    TORCH_CHECK(len[g] >= 0, op, ": lengths must be >= 0, got ", len[g], " at bag ", g);
    total += len[g];
  }
  TORCH_CHECK(total == n, op, ": lengths sum to ", total, " but there are ", n, " ids");

  at::Tensor out_lengths = at::zeros({world_size * bags}, lengths.options());
  int64_t* count = out_lengths.data_ptr<int64_t>();
  std::vector<int32_t> dest(n);
  for (int64_t g = 0, i = 0; g < bags; ++g) {
    const int64_t owner = slot_owner[g / std::max<int64_t>(batch_size, 1)];
    for (int64_t end = i + len[g]; i < end; ++i) {
      dest[i] = static_cast<int32_t>(owner >= 0 ? owner : route_key(id[i], world_size));
      ++count[dest[i] * bags + g];
    }
  }
  std::vector<int64_t> next(world_size * bags);
  for (int64_t b = 0, start = 0; b < world_size * bags; ++b) {
    next[b] = start;
    start += count[b];
  }
  at::Tensor values = at::empty({n}, ids.options());
  at::Tensor order = at::empty({n}, ids.options());
  int64_t* v = values.data_ptr<int64_t>();
  int64_t* o = order.data_ptr<int64_t>();
  for (int64_t g = 0, i = 0; g < bags; ++g) {
    for (int64_t end = i + len[g]; i < end; ++i) {
      const int64_t pos = next[dest[i] * bags + g]++;
      v[pos] = id[i];
      o[pos] = i;
    }
  }
  return {values, out_lengths, order};
}

}  // namespace

TORCH_LIBRARY_IMPL(torchrec_ext, CPU, m) { m.impl("route_bucketize", &route_bucketize_cpu); }

}  // namespace torchrec_ext
