// Schemas of every torch.ops.torchrec_ext op, defined once; backends register their kernels
// beside their code (hash_table_cpu.cpp, hash_table_cuda.cpp). Also the Python module entry
// point, so `import torchrec_ext._C` loads the library and runs these registrations.
#include <Python.h>
#include <torch/library.h>

TORCH_LIBRARY(torchrec_ext, m) {
  // Row of each key (-1 when absent) and whether it was found. Read-only.
  m.def(
      "hash_find(Tensor digests, Tensor slot_keys, Tensor keys, int capacity) -> (Tensor rows, "
      "Tensor found)");
  // hash_find of several tables in one call: table t's keys are
  // keys[key_offsets[t]:key_offsets[t+1]].
  m.def(
      "hash_find_tables(Tensor[] digests, Tensor[] slot_keys, Tensor keys, int[] key_offsets, "
      "int[] capacities) "
      "-> (Tensor rows, Tensor found)");
  // find_or_insert (assign=False: touch scores by the policy) or insert_or_assign (assign=True:
  // scores, when given, are stored as they are). Returns rows (-1 = refused), which positions
  // inserted a new key (first occurrence only), and the keys/rows evicted to make room.
  m.def(
      "hash_upsert(Tensor(a!) digests, Tensor(b!) slot_keys, Tensor(c!) slot_scores, "
      "Tensor(d!) size, Tensor keys, Tensor? scores, int capacity, int policy, int clock, "
      "int epoch, bool assign) -> (Tensor rows, Tensor inserted, Tensor evicted_keys, Tensor "
      "evicted_rows)");
  // hash_upsert with outputs of one entry per key (nothing a host must size: no GPU sync):
  // evicted[i] is True where key i took an evicted key's row, evicted_keys[i] that key (0
  // elsewhere). pending (bool [n], None = all): the keys not pending take no part (row -1),
  // as if the call had been made on the pending keys alone.
  m.def(
      "hash_upsert_fixed(Tensor(a!) digests, Tensor(b!) slot_keys, Tensor(c!) slot_scores, "
      "Tensor(d!) size, Tensor keys, Tensor? scores, Tensor? pending, int capacity, int policy, "
      "int clock, int epoch, bool assign) -> (Tensor rows, Tensor inserted, Tensor evicted, "
      "Tensor evicted_keys)");
  // hash_upsert_fixed of several tables in one call: table t's keys are
  // keys[key_offsets[t]:key_offsets[t+1]] (scores, pending sliced alike), and its index arrays,
  // capacity, policy, clock and epoch the t-th of each list. Results, tables and sizes are
  // exactly those of calling hash_upsert_fixed table by table; the tables must be distinct.
  m.def(
      "hash_upsert_tables(Tensor(a!)[] digests, Tensor(b!)[] slot_keys, Tensor(c!)[] slot_scores, "
      "Tensor(d!)[] sizes, Tensor keys, int[] key_offsets, Tensor? scores, Tensor? pending, "
      "int[] capacities, int[] policies, int[] clocks, int[] epochs, bool assign) -> (Tensor rows, "
      "Tensor inserted, Tensor evicted, Tensor evicted_keys)");
  // Slots to rows, in place: rows[key_offsets[t]:key_offsets[t+1]] (table t's slots; -1 stays
  // -1) become slot_rows[t][slot], the row that slot holds in a growing table's index (int32 or
  // int64, one per slot of [0, capacity)); None: the table's slots are its rows.
  m.def("hash_slot_rows(Tensor(a!) rows, int[] key_offsets, Tensor?[] slot_rows) -> ()");
  // Removes keys; True at the positions that removed one.
  m.def(
      "hash_erase(Tensor(a!) digests, Tensor slot_keys, Tensor(b!) size, Tensor keys, int "
      "capacity) -> Tensor");
  // Live (key, row, score) triples among slots [start, end), in row order.
  m.def(
      "hash_export(Tensor digests, Tensor slot_keys, Tensor slot_scores, int capacity, int start, "
      "int end) "
      "-> (Tensor keys, Tensor rows, Tensor scores)");
  // Places keys at the given rows of an empty table (state_dict load); validates before writing.
  m.def(
      "hash_restore(Tensor(a!) digests, Tensor(b!) slot_keys, Tensor(c!) slot_scores, Tensor(d!) "
      "size, "
      "Tensor keys, Tensor rows, Tensor scores, int capacity) -> ()");
  // Rows for distinct keys in an empty table (-1: left out), higher scores first: a key is left
  // out only when it cannot be placed beside the higher-priority keys placed (placement_cpu.cpp).
  // start_rows: a starting placement (-1: not placed); those keys move only to make room.
  m.def(
      "hash_place(Tensor keys, Tensor scores, int capacity, Tensor? start_rows=None) -> Tensor "
      "rows");
  // Owning rank of each key for row-wise sharding (hash independent of the bucket hash).
  m.def("route(Tensor keys, int world_size) -> Tensor");
  // Input routing of sharded tables (csrc/route_cpu.cpp): each id of bag g = slot * batch_size
  // + sample goes to route(id) (slot_owner -1) or to its slot's owner; returns the ids regrouped
  // destination-major then by bag, the [world_size * bags] lengths, and each routed id's input
  // position.
  m.def(
      "route_bucketize(Tensor ids, Tensor lengths, int[] slot_owner, int world_size, int "
      "batch_size) "
      "-> (Tensor values, Tensor lengths, Tensor order)");

  // ---- admission (csrc/bloom_cpu.cpp, csrc/bloom_cuda.cu; cells as bloom_layout.h defines them).
  // Counting Bloom filter of 4-bit saturating counters, two per byte (low nibble first), in place:
  // adds each pending key's count (min(count, 15); counts >= 0) to its `hashes` counters, then
  // returns which pending keys have all of their counters >= admit_after (others: False). All
  // increments of the call land before any key is decided. pending: bool [n], None = every key.
  m.def(
      "bloom_admit(Tensor(a!) counters, Tensor keys, Tensor counts, Tensor? pending, int "
      "hash_seed, "
      "int hashes, int admit_after) -> Tensor");

  // ---- serving index (csrc/serving_index_cpu.cpp): a read-only id -> row map of 64-byte
  // buckets (layout in that file; an all-zero int64 tensor of 8 * num_buckets words is empty).
  // A new index: `index` with erase_keys removed (absent ones skipped), then each key mapped to
  // its row (inserted or re-assigned, in order). `index` itself is left as it was.
  m.def(
      "serving_index_update(Tensor index, Tensor erase_keys, Tensor keys, Tensor rows) -> "
      "Tensor");
  // Row of each id in its table's index, default_rows[t] when absent: table t's ids are
  // ids[id_offsets[t]:id_offsets[t+1]]. Read-only.
  m.def(
      "serving_find(Tensor[] indexes, Tensor ids, Tensor id_offsets, int[] default_rows) -> "
      "Tensor");

  // ---- embedding ops (csrc/dedup_cpu.cpp, init_rows_cpu.cpp, embedding_lookup_cpu.cpp,
  // embedding_update_cpu.cpp; CUDA: triton_kernels/, registered from Python).
  // Tables live in one flat buffer of 4-byte words, table t's [capacity_t, dim_t] rows at word
  // table_offsets[t] in its storage dtype (table_dtypes[t]: 0 float32, 1 float16, 2 bfloat16);
  // a row of -1 reads as zeros and takes no update (see reference.py).
  // Unique ids of each segment [segment_offsets[s], segment_offsets[s+1]), first-occurrence
  // order, concatenated; each id's index into them; counts; where each segment's uniques start.
  m.def(
      "dedup_segments(Tensor ids, Tensor segment_offsets) "
      "-> (Tensor unique, Tensor inverse, Tensor counts, Tensor unique_offsets)");
  // Writes the initial vector of ids[i] (a pure function of seed, id, element) into rows[i]
  // and resets those rows of each optimizer state ([capacity, width]) to state_values.
  m.def(
      "init_rows(Tensor(a!) table, Tensor rows, Tensor ids, int seed, int kind, float[] params, "
      "Tensor(b!)[] states, float[] state_values) -> ()");
  // init_rows of every table at once, in the flat storage: ids[i]'s vector (table tables[i]'s
  // seed, initializer kind and params [T, 4]) into row rows[i] (-1: skip) of its table, and its
  // rows of each flat optimizer state (table t's from state_offsets[t], one value per row when
  // rowwise, else dim_t) reset to state_values. CUDA: one launch for all tables.
  m.def(
      "init_rows_tables(Tensor(a!) weights, Tensor table_offsets, Tensor table_dims, "
      "Tensor? table_dtypes, Tensor rows, Tensor tables, Tensor ids, Tensor table_seeds, "
      "Tensor table_kinds, Tensor table_params, int max_dim, Tensor(b!)[] states, "
      "Tensor? state_offsets, bool rowwise, float[] state_values) -> ()");
  // [batch_size, total_dim]: sum/mean (per feature) of each bag's rows, feature f at column
  // feature_col[f]. Row -2 - j of table t reads new_vectors[t][j] (a new row's initial vector, not
  // yet written).
  m.def(
      "pooled_lookup(Tensor weights, Tensor table_offsets, Tensor table_dims, Tensor "
      "feature_table, "
      "Tensor feature_col, Tensor feature_mean, Tensor rows, Tensor offsets, Tensor? "
      "per_sample_weights, "
      "SymInt batch_size, int total_dim, Tensor[] new_vectors, Tensor? table_dtypes=None) -> "
      "Tensor");
  // [num_ids, dim]: each id's row (rows -2 - j as in pooled_lookup).
  m.def(
      "sequence_lookup(Tensor weights, Tensor table_offsets, int dim, Tensor feature_table, "
      "Tensor feature_value_offsets, Tensor rows, Tensor[] new_vectors, Tensor? table_dtypes=None) "
      "-> Tensor");
  // Backward of a lookup (pooled when offsets are given, else sequence) fused with one optimizer
  // step (0 sgd, 1 adagrad, 2 rowwise_adagrad, 3 adam, 4 adamw, 5 ftrl) on each unique row, in
  // place. A unique row with unique_new[u] = j >= 0 is new: it first takes new_vectors[t][j] and
  // state_init. Half rows are written rounded to nearest, or stochastically where
  // rounding_seeds[t] != 0 (bits from the seed, unique_ids[u], element and step).
  m.def(
      "fused_update(Tensor grad, Tensor(a!) weights, Tensor(b!)[] states, Tensor table_offsets, "
      "Tensor table_dims, Tensor state_row_offsets, Tensor unique_rows, Tensor unique_table, "
      "Tensor inverse, Tensor? offsets, Tensor? per_sample_weights, Tensor feature_col, "
      "Tensor feature_mean, int batch_size, int optimizer, float[] hparams, int step, "
      "Tensor[] new_vectors, Tensor? unique_new, float[] state_init, Tensor? table_dtypes=None, "
      "Tensor? unique_ids=None, Tensor? rounding_seeds=None) -> ()");
  // dst[dst_rows[i]] = src[src_rows[i]] for each i (whole rows; None: rows 0, 1, ...), every
  // row number checked before any is written. One dtype and row size; rows may be strided,
  // their elements contiguous; src and dst share no memory. Duplicate dst_rows: which copy
  // lands is unspecified (as index_copy_'s).
  m.def("copy_rows(Tensor(a!) dst, Tensor? dst_rows, Tensor src, Tensor? src_rows) -> ()");
  // copy_rows where dst or src may be a file mapping (csrc/copy_rows_cpu.cpp): a SIGBUS raised
  // while the copy touches a page (a mapped file's page that cannot be read) ends the copy.
  // Returns an int64 0-dim tensor: 0, or the address of that SIGBUS (then some rows may be
  // copied, the others not).
  m.def(
      "guarded_copy_rows(Tensor(a!) dst, Tensor? dst_rows, Tensor src, Tensor? src_rows) -> "
      "Tensor");
  // copy_rows from a file mapping by pread(2) of the file behind it (csrc/copy_rows_cpu.cpp):
  // `src` (the mapping) gives shape and strides, `fd` and `src_offset` where its bytes lie in the
  // file. Returns int64 [2]: {-1, 0}, or the file offset of a failed read and its errno.
  m.def(
      "pread_rows(Tensor(a!) dst, Tensor? dst_rows, Tensor src, Tensor? src_rows, int fd, "
      "int src_offset) -> Tensor");
}

namespace torchrec_ext {
void install_sigbus_guard_once();
}

// _C.install_sigbus_guard(): the SIGBUS handler of guarded_copy_rows, installed once (before a
// backing file is mapped, so that it is in place whatever copy comes first).
static PyObject* install_sigbus_guard(PyObject*, PyObject*) {
  try {
    torchrec_ext::install_sigbus_guard_once();
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_OSError, e.what());
    return nullptr;
  }
  Py_RETURN_NONE;
}

PyMODINIT_FUNC PyInit__C(void) {
  static PyMethodDef methods[] = {{"install_sigbus_guard", install_sigbus_guard, METH_NOARGS,
                                   "Installs guarded_copy_rows' SIGBUS handler."},
                                  {nullptr, nullptr, 0, nullptr}};
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, methods};
  return PyModule_Create(&module_def);
}
