"""The walk of one training id, traced (``benchmarks/count_walk.py``: one CPU training step under
``sys.setprofile``): no hop goes up a layer, and the lookup functions take what they need from
the lookup (its rows, layout and pending rows) instead of calling back into the tables' files.
The counts themselves are in ``benchmarks/results/house_counts.md``."""

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "count_walk.py"


@pytest.fixture(scope="module")
def walk() -> dict:
    spec = importlib.util.spec_from_file_location("count_walk", SCRIPT)
    count_walk = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(count_walk)
    return count_walk.count()


def test_the_walk_reaches_every_kernel_of_a_training_step(walk):
    assert walk["ops"] == ["dedup_segments", "hash_upsert_tables", "init_rows", "pooled_lookup", "fused_update"]
    kernels = {f for f in walk["walk_files"] if f.startswith("csrc/")}
    assert kernels == {
        "csrc/dedup_cpu.cpp",
        "csrc/hash_table_cpu.cpp",
        "csrc/init_rows_cpu.cpp",
        "csrc/embedding_lookup_cpu.cpp",
        "csrc/embedding_update_cpu.cpp",
    }


def test_no_hop_goes_up_a_layer(walk):
    assert walk["hops_up_a_layer"] == []


def test_the_lookup_functions_call_no_tables_file(walk):
    called = {b for a, b in walk["hops"] if a == "torchrec_ext/modules/lookup_functions.py"}
    # The kernels (through ops), the plan, the lookup's update (ids_to_rows) and the
    # hyperparameter reader (base.py); not the storage's or the tables' files.
    assert called == {
        "torchrec_ext/ops.py",
        "torchrec_ext/modules/features.py",
        "torchrec_ext/modules/ids_to_rows.py",
        "torchrec_ext/modules/base.py",
    }
