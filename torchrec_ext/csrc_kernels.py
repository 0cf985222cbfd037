"""The C++ extension's kernels: which op each backend of ``torchrec_ext._C`` provides, and the
file that registers it (``TORCH_LIBRARY_IMPL(torchrec_ext, <backend>, m)`` in ``csrc/``).

The C++ kernels register themselves when the library loads; this table is their entry in the
one registration table ``torchrec_ext.ops`` reads (beside ``torch_kernels.KERNELS`` and
``triton_kernels.KERNELS``): ``ops`` refuses a Python kernel for a (op, device) the C++
library already serves, and ``tests/test_kernel_tables.py`` checks this table against the
``m.impl`` lines of ``csrc/`` and against the dispatcher. CUDA entries exist only in a CUDA build.
"""

from __future__ import annotations

# op name -> device type -> the csrc file that registers its kernel.
KERNELS: dict[str, dict[str, str]] = {
    "hash_find": {"cpu": "csrc/hash_table_cpu.cpp", "cuda": "csrc/hash_table_cuda.cpp"},
    "hash_find_tables": {"cpu": "csrc/hash_table_cpu.cpp", "cuda": "csrc/hash_table_cuda.cpp"},
    "hash_upsert": {"cpu": "csrc/hash_table_cpu.cpp", "cuda": "csrc/hash_table_cuda.cpp"},
    "hash_upsert_fixed": {"cpu": "csrc/hash_table_cpu.cpp", "cuda": "csrc/hash_table_cuda.cpp"},
    "hash_upsert_tables": {"cpu": "csrc/hash_table_cpu.cpp", "cuda": "csrc/hash_table_cuda.cpp"},
    "hash_erase": {"cpu": "csrc/hash_table_cpu.cpp", "cuda": "csrc/hash_table_cuda.cpp"},
    "hash_export": {"cpu": "csrc/hash_table_cpu.cpp", "cuda": "csrc/hash_table_cuda.cpp"},
    "hash_restore": {"cpu": "csrc/hash_table_cpu.cpp", "cuda": "csrc/hash_table_cuda.cpp"},
    "route": {"cpu": "csrc/hash_table_cpu.cpp", "cuda": "csrc/hash_table_cuda.cpp"},
    "hash_slot_rows": {"cpu": "csrc/hash_table_cpu.cpp"},
    "hash_place": {"cpu": "csrc/placement_cpu.cpp"},
    "serving_index_update": {"cpu": "csrc/serving_index_cpu.cpp"},
    "serving_find": {"cpu": "csrc/serving_index_cpu.cpp"},
    "route_bucketize": {"cpu": "csrc/route_cpu.cpp"},
    "bloom_admit": {"cpu": "csrc/bloom_cpu.cpp", "cuda": "csrc/bloom_cuda.cpp"},
    "dedup_segments": {"cpu": "csrc/dedup_cpu.cpp", "cuda": "csrc/dedup_cuda.cpp"},
    "init_rows": {"cpu": "csrc/init_rows_cpu.cpp"},
    "init_rows_tables": {"cpu": "csrc/init_rows_cpu.cpp", "cuda": "csrc/init_rows_cuda.cpp"},
    "pooled_lookup": {"cpu": "csrc/embedding_lookup_cpu.cpp"},
    "sequence_lookup": {"cpu": "csrc/embedding_lookup_cpu.cpp"},
    "fused_update": {"cpu": "csrc/embedding_update_cpu.cpp"},
    "copy_rows": {"cpu": "csrc/copy_rows_cpu.cpp"},
    "guarded_copy_rows": {"cpu": "csrc/copy_rows_cpu.cpp"},
    "pread_rows": {"cpu": "csrc/copy_rows_cpu.cpp"},
}
