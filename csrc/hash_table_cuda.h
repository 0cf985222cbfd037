// Host entry points of the CUDA hash table kernels (hash_table_cuda.cu). Plain C++ signatures
// (raw device pointers, int64 counts, a stream), so the kernels compile with bare nvcc and the
// torch binding (hash_table_cuda.cpp) is the only file that sees both torch and these launches.
// Every function enqueues its work on `stream` and returns the launch status.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "hash_table_layout.h"

namespace torchrec_ext {

// rows[i] = row of keys[i] or -1; found[i] = rows[i] >= 0. Read-only.
cudaError_t launch_hash_find(const uint8_t* digests, const int64_t* slot_keys, int64_t capacity,
                             const int64_t* keys, int64_t n, int64_t* rows, bool* found,
                             cudaStream_t stream);

// stripes[i] = stripe of keys[i]: the caller sorts positions by it (stably) for the mutations.
cudaError_t launch_key_stripes(const int64_t* keys, int64_t n, int64_t capacity, int32_t* stripes,
                               cudaStream_t stream);

// find_or_insert / insert_or_assign. Key j of the grouping is keys[order[j]]; sorted_stripes[j]
// is its stripe (ascending, batch order within a stripe). given: caller scores or nullptr.
// stripe_offsets: scratch of num_stripes + 1 entries (where each stripe's keys begin).
// inserted and evicted must be zeroed by the caller; evicted_keys is written where evicted.
cudaError_t launch_hash_upsert(uint8_t* digests, int64_t* slot_keys, int64_t* slot_scores,
                               int64_t* size, int64_t capacity, const int64_t* keys,
                               const int64_t* given, const int32_t* sorted_stripes,
                               const int64_t* order, int64_t n, int64_t* stripe_offsets,
                               int64_t policy, int64_t clock, int64_t epoch, bool assign,
                               int64_t* rows, bool* inserted, bool* evicted, int64_t* evicted_keys,
                               cudaStream_t stream);

// One table of a multi-table upsert (hash_upsert_tables), as the kernels read it from device
// memory: its arrays and parameters, where its keys sit in the batch, where its stripes sit among
// every table's (global stripe id = stripe_begin + its own stripe id), and its insert windows:
// windows[window_begin .. window_begin + windows] are the batch positions that bound them.
struct UpsertTable {
  uint8_t* digests;
  int64_t* slot_keys;
  int64_t* slot_scores;
  int64_t* size;
  TableGeometry geo;
  int64_t key_begin;
  int64_t key_end;
  int64_t stripe_begin;
  int64_t policy;
  int64_t clock;
  int64_t epoch;
  int64_t window_begin;
  int64_t windows;
};

// table_of[i] = the table of batch position i, stripes[i] = its key's global stripe id.
cudaError_t launch_key_table_stripes(const UpsertTable* tables, int64_t num_tables,
                                     const int64_t* keys, int64_t n, int32_t* table_of,
                                     int32_t* stripes, cudaStream_t stream);

// launch_hash_find of every table at once (one thread per key, each probing its own table).
cudaError_t launch_hash_find_tables(const UpsertTable* tables, int64_t num_tables,
                                    const int64_t* keys, int64_t n, int64_t* rows, bool* found,
                                    cudaStream_t stream);

// launch_hash_upsert of every table at once, each pass one grid over all tables' stripes
// (total_stripes): a table's keys, given, outputs are its positions of the shared arrays; its
// keys are grouped by global stripe id (sorted_stripes, order as for launch_hash_upsert;
// stripe_offsets: scratch of total_stripes + 1 entries). phases and max_windows: the most of any
// table. Results are each table's launch_hash_upsert's.
cudaError_t launch_hash_upsert_tables(const UpsertTable* tables, int64_t num_tables,
                                      int64_t total_stripes, int phases, int64_t max_windows,
                                      const int64_t* windows, const int64_t* keys,
                                      const int64_t* given, const int32_t* sorted_stripes,
                                      const int64_t* order, int64_t n, int64_t* stripe_offsets,
                                      bool assign, int64_t* rows, bool* inserted, bool* evicted,
                                      int64_t* evicted_keys, cudaStream_t stream);

// Removes keys, grouped as for launch_hash_upsert; erased must be zeroed by the caller.
cudaError_t launch_hash_erase(uint8_t* digests, const int64_t* slot_keys, int64_t* size,
                              int64_t capacity, const int64_t* keys, const int32_t* sorted_stripes,
                              const int64_t* order, int64_t n, bool* erased, cudaStream_t stream);

// ranks[i] = owning rank of keys[i] among world_size.
cudaError_t launch_route(const int64_t* keys, int64_t n, int64_t world_size, int64_t* ranks,
                         cudaStream_t stream);

}  // namespace torchrec_ext
