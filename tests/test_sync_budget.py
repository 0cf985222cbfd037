"""Host syncs of a training step (issue 13 item 6), checked on CPU.

Every point of a dynamic module's training step that would be a device-to-host sync on a GPU
goes through ``torchrec_ext.device_sync`` (tests/test_sync_patterns.py fails on any other), which
counts it on CPU too. A training step (forward lookup, loss, fused backward update) of a 26-table
module must make at most 3, whatever the table count: TTL, admission, fallback rows, FP16
rows and growing tables included (growing tables with admission read each one's admitted count: not
in the budget; a step that grows reads 2 more, whatever the table count: counted apart), with new rows written by the lookup (as on a GPU) or deferred (CPU)."""

import pytest
import torch
from torchrec import DataType, KeyedJaggedTensor

from torchrec_ext import (
    DynamicEmbeddingBagCollection,
    DynamicEmbeddingBagConfig,
    DynamicEmbeddingCollection,
    device_sync,
    ops,
)
from torchrec_ext.modules.admission import CounterAdmission
from torchrec_ext.modules.configs import DynamicEmbeddingConfig

BUDGET = 3
TABLES = 26
BATCH = 16

# name -> options of every table (capacities small enough that tables fill and evict).
VARIANTS = {
    "default": {},
    "ttl": {"ttl_steps": 2},
    "counter": {"admission": "counter", "admit_after": 2},
    "bloom": {"admission": "bloom", "admit_after": 2},
    "probabilistic": {"admission": "probabilistic", "admit_probability": 0.5},
    "fallback": {"fallback_rows": 3, "admission": "probabilistic", "admit_probability": 0.5},
    "fp16": {"data_type": DataType.FP16},
    "lfu": {"eviction_policy": "lfu"},
    "growth": {"initial_capacity": 8},  # tables double up to 64 rows: one read of all tables' sizes
}


def _configs(options, tables=TABLES, cls=DynamicEmbeddingBagConfig, capacity=64):
    return [
        cls(name=f"t{i}", embedding_dim=4 + 4 * (i % 3), num_embeddings=capacity, feature_names=[f"f{i}"], **options)
        for i in range(tables)
    ]


def _batch(step, tables=TABLES, length_per_key=False):
    g = torch.Generator().manual_seed(step)
    lengths = torch.randint(0, 4, (tables * BATCH,), generator=g)
    values = torch.randint(0, 200, (int(lengths.sum()),), generator=g)
    per_key = lengths.view(tables, BATCH).sum(1).tolist() if length_per_key else None
    return KeyedJaggedTensor(
        keys=[f"f{i}" for i in range(tables)], values=values, lengths=lengths, stride=BATCH, length_per_key=per_key
    )


def _step(module, kjt):
    out = module(kjt)
    loss = sum(v.values().sum() for v in out.values()) if isinstance(out, dict) else out.values().sum()
    loss.backward()


def _syncs_per_step(module, steps=6, tables=TABLES, length_per_key=False):
    """Host reads of each training step after a warm-up step (which builds cached layouts)."""
    _step(module, _batch(0, tables))
    counts = []
    for step in range(1, steps + 1):
        kjt = _batch(step, tables, length_per_key)
        with device_sync.recording() as seen:
            _step(module, kjt)
        counts.append((sum(seen.values()), dict(seen)))
    return counts


# How new rows are written: deferred to the fused update (CPU), by the lookup table by table (the
# C++ kernel), or by the lookup in one call for all tables (init_rows_tables); and how the tables
# are upserted: table by table, or in one call (the GPU path: hash_upsert_tables).
NEW_ROWS = {
    "deferred_rows": (True, False, False),
    "rows_written_by_lookup": (False, False, False),
    "one_init_call": (False, True, False),
    "one_init_and_upsert_call": (False, True, True),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("new_rows", sorted(NEW_ROWS))
def test_training_step_syncs_within_budget(variant, new_rows, monkeypatch):
    # Counter admission's GPU form (fixed-size), run on the CPU: the CPU form reads sizes freely.
    monkeypatch.setattr(CounterAdmission, "compact_on_cpu", False)
    module = DynamicEmbeddingBagCollection(_configs(VARIANTS[variant]), optimizer="adagrad")
    module._tables.defer_new_rows, module._tables.flat_init, module._tables.batched_upsert = NEW_ROWS[new_rows]
    for total, seen in _syncs_per_step(module):
        relayout = {reason: n for reason, n in seen.items() if reason in GROWTH_RELAYOUT}
        assert relayout in ({}, dict.fromkeys(GROWTH_RELAYOUT, 1)), relayout  # a step that grows: see below
        total -= sum(relayout.values())
        assert total <= BUDGET, f"{variant}: {total} host syncs in one step, budget {BUDGET}: {seen}"
        assert seen.get("lookup: where each table's unique ids start") == 1  # the count is live: the one read
        # no step can avoid (how many unique ids each table has) is seen


# A step that grows its tables reads, beside the step's own reads (a growing module's include
# "growth: live rows", every step), once for all tables grown: whether each rebuilt index placed
# every key, and how many rows each carries (and whether they keep their numbers).
GROWTH_RELAYOUT = ("growth: keys placed", "growth: rows carried")


@pytest.mark.parametrize("deltas", [False, True], ids=["plain", "delta_log"])
def test_a_growth_reads_the_host_the_same_times_whatever_the_table_count(deltas, device):
    """A growth's counted reads: 3 (the live rows, keys placed, rows carried), whether 1 table grows
    or 26 do, with or without the delta log (whose versions follow their rows without a read).
    ``grown_tables`` calls no op that sizes its output on the host (test_sync_patterns; on a GPU,
    test_hash_table_grown.py's sync debug count)."""
    per_count = {}
    for tables in (1, 2, TABLES):
        module = DynamicEmbeddingBagCollection(
            _configs({"initial_capacity": 8}, tables=tables, capacity=512), optimizer="adagrad"
        ).to(device)
        if deltas:
            module.delta_token()
        _step(module, _batch(0, tables).to(device))  # a first growth of empty tables: nothing to place or carry
        growths = []
        for step in range(1, 8):
            before = [m.capacity for m in module._tables.meta]
            with device_sync.recording() as seen:
                _step(module, _batch(step, tables).to(device))
            grown = sum(m.capacity != c for m, c in zip(module._tables.meta, before))
            growth_reads = {reason: n for reason, n in seen.items() if reason.startswith("growth:")}
            if grown:
                growths.append((grown, growth_reads))
            else:  # the live rows, read every step of a growing module's lookup: no relayout
                assert growth_reads in ({}, {"growth: live rows": 1}), growth_reads
        assert growths, f"{tables} tables never grew"
        per_count[tables] = growths
    assert max(grown for grown, _ in per_count[TABLES]) > TABLES // 2  # many tables in one growth
    for growths in per_count.values():
        for _, reads in growths:
            assert reads == {"growth: live rows": 1, **dict.fromkeys(GROWTH_RELAYOUT, 1)}, reads


def test_sync_count_does_not_grow_with_tables():
    few = _syncs_per_step(DynamicEmbeddingBagCollection(_configs({}, tables=2), optimizer="sgd"), tables=2)
    many = _syncs_per_step(DynamicEmbeddingBagCollection(_configs({}), optimizer="sgd"))
    assert [t for t, _ in few] == [t for t, _ in many]


@pytest.mark.parametrize("defer", [False, True], ids=["cpu_order", "gpu_order"])
def test_a_kjt_with_its_ids_per_key_costs_one_read(defer, monkeypatch):
    """A KJT that knows its ids per key on the host (built with length_per_key, or computed on
    the CPU before its copy to the device, as dlrm_small_batch and TorchRec's from_lengths_sync
    do) is checked on the device: the step's one read is the unique count (the H100 found the
    input check's read and its blocking copies beside it: benchmarks/results/gpu/gpu_check.md)."""
    monkeypatch.setattr(device_sync, "defer_on_cpu", defer)
    module = DynamicEmbeddingBagCollection(_configs({}), optimizer="adagrad")
    for _, seen in _syncs_per_step(module, steps=3, length_per_key=True):
        assert seen == {"lookup: where each table's unique ids start": 1}, seen


@pytest.mark.parametrize("variant", ["default", "ttl", "counter", "growth"])
def test_an_eval_lookup_under_inference_mode_costs_the_reads_of_one_under_no_grad(variant, monkeypatch):
    """With the GPU's dedup path (the kernel given host offsets, its read counted; here the CPU
    kernel, which answers as the CUDA one does), an eval lookup under ``torch.inference_mode``
    reads no more than under no_grad, and gives the same rows: its offsets and the unique
    offsets are mirrored though made in inference mode (they cost 2 more reads)."""
    kernel = torch.ops.torchrec_ext.dedup_segments.default
    monkeypatch.setattr(ops, "dedup_segments", lambda ids, offsets: ops.dedup_segments_read_once(kernel, ids, offsets))
    module = DynamicEmbeddingBagCollection(_configs(VARIANTS[variant], tables=6), optimizer="adagrad")
    for step in range(3):
        _step(module, _batch(step, tables=6))
    module.eval()
    seen, pooled = {}, {}
    for mode in ("no_grad", "inference_mode"):
        with torch.inference_mode() if mode == "inference_mode" else torch.no_grad():
            kjt = _batch(7, tables=6)
            with device_sync.recording() as counted:
                pooled[mode] = module(kjt).values()
        seen[mode] = dict(counted)
    assert seen["inference_mode"] == seen["no_grad"], seen
    assert sum(seen["no_grad"].values()) <= 2, seen
    assert torch.equal(pooled["inference_mode"], pooled["no_grad"])


def test_a_module_first_run_under_inference_mode_then_trains_within_the_same_reads(device):
    """What a module's first lookup on a device builds and keeps (its tables' layout on the
    device: dims, offsets) must be mirrored though built under inference_mode: else every later
    pooled lookup on a GPU reads the widest dim back, a sync a step, training included. On the
    CPU the layout is the host's own tensors: the check there is that such a module trains."""
    seen = {}
    for first in ("no_grad", "inference_mode"):
        module = DynamicEmbeddingBagCollection(_configs({}, tables=6), optimizer="adagrad").to(device)
        module.eval()
        with torch.inference_mode() if first == "inference_mode" else torch.no_grad():
            module(_batch(0, tables=6).to(device))
        module.train()
        _step(module, _batch(1, tables=6).to(device))
        with device_sync.recording() as counted:
            _step(module, _batch(2, tables=6).to(device))
        seen[first] = dict(counted)
    assert seen["inference_mode"] == seen["no_grad"], seen
    assert "pooled_lookup: widest table" not in seen["inference_mode"], seen


def test_a_layout_first_built_under_inference_mode_is_mirrored(monkeypatch):
    """The CPU's form of the test above: there the layout's ``.to(device)`` copies to the GPU (made
    an inference tensor under inference_mode), here it is made to copy; the copies must be normal,
    mirrored tensors, read for free."""
    tables = DynamicEmbeddingBagCollection(_configs({}, tables=3), optimizer="adagrad")._tables
    tables._device_layout = {}
    to = torch.Tensor.to
    monkeypatch.setattr(torch.Tensor, "to", lambda t, *args, **kwargs: to(t, *args, **{**kwargs, "copy": True}))
    with torch.inference_mode():
        offsets, dims, state_offsets = tables.layout()
    monkeypatch.undo()
    assert not any(t.is_inference() for t in (offsets, dims, state_offsets))
    assert device_sync.host_list_if_free(dims) == [m.dim for m in tables.meta]


def test_sequence_module_step_within_budget():
    configs = [
        DynamicEmbeddingConfig(name=f"t{i}", embedding_dim=8, num_embeddings=64, feature_names=[f"f{i}"], ttl_steps=3)
        for i in range(TABLES)
    ]
    module = DynamicEmbeddingCollection(configs, optimizer="adam")
    for total, seen in _syncs_per_step(module):
        assert total <= BUDGET, f"{total} host syncs in one step, budget {BUDGET}: {seen}"


def test_the_counter_counts_every_read():
    """The helper counts each read once, mirrored tensors (host values kept beside) not at all."""
    t = torch.arange(5)
    with device_sync.recording() as seen:
        assert device_sync.host_list(t, "a") == [0, 1, 2, 3, 4]
        assert device_sync.host_list(t, "a") == [0, 1, 2, 3, 4]  # read once: mirrored since
        t.add_(1)  # written since: read again
        assert device_sync.host_list(t, "b") == [1, 2, 3, 4, 5]
        device_sync.nonzero(t > 2, "c")
        mirrored = device_sync.mirror(torch.ones(2), torch.ones(2))
        device_sync.to_host(mirrored, "d")
    assert dict(seen) == {"a": 1, "b": 1, "c": 1}


def test_a_deferred_check_is_raised_at_the_next_read_of_its_thread(monkeypatch):
    import threading

    monkeypatch.setattr(device_sync, "defer_on_cpu", True)  # a GPU's order, on CPU
    verdicts = []

    def verdict(values):
        verdicts.append(values)
        return ValueError(f"bad: {values}") if values[0] < 0 else None

    def fails(values):
        return values[0] < 0

    device_sync.defer_check(torch.tensor([-1, 7]), verdict, fails)
    assert verdicts == []  # not read yet
    other = threading.Thread(target=lambda: device_sync.to_host(torch.arange(2), "another thread's read"))
    other.start()
    other.join()
    assert verdicts == []  # another thread's read does not raise this thread's check
    with device_sync.recording() as seen, pytest.raises(ValueError, match=r"bad: \[-1, 7\]"):
        device_sync.to_host(torch.arange(3), "a read")
    assert dict(seen) == {"a read": 1}  # the check itself cost no read
    device_sync.to_host(torch.arange(4), "a later read")  # raised once, then gone
    device_sync.defer_check(torch.tensor([1, 7]), verdict, fails)
    device_sync.settle()  # a passing check raises nothing
    assert verdicts == [[-1, 7], [1, 7]]
    monkeypatch.setattr(device_sync, "defer_on_cpu", False)
    with pytest.raises(ValueError, match="bad"):
        device_sync.defer_check(torch.tensor([-2]), verdict, fails)  # on CPU: at once


def test_a_mirrored_tensor_dying_inside_the_modules_lock_does_not_deadlock():
    # A mirrored tensor's weakref callback can run inside any allocation (a collection of a dead
    # tensor), even one made while this thread holds device_sync's lock: the CI once hung there.
    # In a child process, so that a regression fails on the timeout instead of hanging the suite.
    import subprocess
    import sys

    script = (
        "import torch\n"
        "from torchrec_ext import device_sync\n"
        "t = torch.arange(4)\n"
        "device_sync.mirror(t, t.clone())\n"
        "with device_sync._lock:\n"
        "    del t  # its callback runs here, on this thread\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
