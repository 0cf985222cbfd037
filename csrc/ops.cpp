// Schemas of every torch.ops.torchrec_ext op, defined once; backends register their kernels
// beside their code (hash_table_cpu.cpp, hash_table_cuda.cpp). Also the Python module entry
// point, so `import torchrec_ext._C` loads the library and runs these registrations.
#include <Python.h>
#include <torch/library.h>

TORCH_LIBRARY(torchrec_ext, m) {
  // Row of each key (-1 when absent) and whether it was found. Read-only.
  m.def("hash_find(Tensor digests, Tensor slot_keys, Tensor keys, int capacity) -> (Tensor rows, Tensor found)");
  // find_or_insert (assign=False: touch scores by the policy) or insert_or_assign (assign=True:
  // scores, when given, are stored as they are). Returns rows (-1 = refused), which positions
  // inserted a new key (first occurrence only), and the keys/rows evicted to make room.
  m.def(
      "hash_upsert(Tensor(a!) digests, Tensor(b!) slot_keys, Tensor(c!) slot_scores, "
      "Tensor(d!) size, Tensor keys, Tensor? scores, int capacity, int policy, int clock, "
      "int epoch, bool assign) -> (Tensor rows, Tensor inserted, Tensor evicted_keys, Tensor evicted_rows)");
  // Removes keys; True at the positions that removed one.
  m.def("hash_erase(Tensor(a!) digests, Tensor slot_keys, Tensor(b!) size, Tensor keys, int capacity) -> Tensor");
  // Live (key, row, score) triples among slots [start, end), in row order.
  m.def(
      "hash_export(Tensor digests, Tensor slot_keys, Tensor slot_scores, int capacity, int start, int end) "
      "-> (Tensor keys, Tensor rows, Tensor scores)");
  // Places keys at the given rows of an empty table (state_dict load); validates before writing.
  m.def(
      "hash_restore(Tensor(a!) digests, Tensor(b!) slot_keys, Tensor(c!) slot_scores, Tensor(d!) size, "
      "Tensor keys, Tensor rows, Tensor scores, int capacity) -> ()");
  // Owning rank of each key for row-wise sharding (hash independent of the bucket hash).
  m.def("route(Tensor keys, int world_size) -> Tensor");
}

PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
