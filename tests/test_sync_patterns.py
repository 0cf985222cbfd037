"""No host sync in a training step's code outside ``torchrec_ext.device_sync`` (issue 13 item 6).

On CPU, ``.item()``, ``.tolist()``, ``int(t)``, ``.nonzero()``, boolean-mask indexing or
``torch.unique`` cost nothing, so tests/test_sync_budget.py cannot see them; on a GPU each is a
device-to-host sync. This scans the step path's code (the functions named below: forward
lookup, fused backward, the kernels' wrappers) and fails on any of them, except where listed in
EXEMPT with the reason. The scan is syntactic: a boolean mask is recognised by how it is built
(a comparison, ``~``, ``&``, ``|``, ``isfinite``...) or by the names the step path gives its masks.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "torchrec_ext"

# file -> the functions ("Class.method" or "function") of the step path; "*": the whole file.
STEP_PATH = {
    "modules/ids_to_rows.py": [
        "IdsToRows.lookup",
        "IdsToRows._rows_for",
        "IdsToRows._mask_expired",
        "IdsToRows._erase_expired",
        "IdsToRows._initialise",
        "IdsToRows._defer_tables",
        "IdsToRows._flat_init",
        "IdsToRows._initialise_tables",
        "IdsToRows._read_fallback",
        "IdsToRows.write_new_rows",
        "IdsToRows.begin_update",
        "IdsToRows.end_update",
    ],
    "modules/pending_rows.py": ["*"],
    "modules/table_storage.py": [
        "TableStorage._init_view",
        "TableStorage.layout",
        "TableStorage.dtype_layout",
        "TableStorage._on_device",
        "TableStorage.table_view",
        "TableStorage._storage_view",
        "TableStorage.state_views",
    ],
    "modules/base.py": [
        "DynamicCollectionMixin._lookup_rows",
        "DynamicCollectionMixin._differentiable_params",
    ],
    "modules/lookup_functions.py": [
        "PooledLookupFunction.forward",
        "PooledLookupFunction.backward",
        "per_sample_weight_grad",
        "SequenceLookupFunction.forward",
        "SequenceLookupFunction.backward",
        "fused_backward",
    ],
    "modules/embedding_bag_collection.py": ["DynamicEmbeddingBagCollection.forward"],
    "modules/embedding_collection.py": ["DynamicEmbeddingCollection.forward"],
    "modules/features.py": ["*"],
    "modules/admission.py": [
        "CounterAdmission.admit",
        "CounterAdmission._admit_compacted",
        "BloomAdmission.admit",
        "BloomAdmission.decay",
        "ProbabilisticAdmission.admit",
        "probabilistic_draw",
    ],
    "modules/table_stats.py": [
        "TableCounters.count_batch",
        "TableCounters.count_rejected",
        "TableCounters.count_expired",
        "TableCounters.count_evicted",
    ],
    "table.py": [
        "HashTable.find",
        "HashTable.find_or_insert_fixed",
        "HashTable.erase_rows",
        "HashTable._check_keys",
        "HashTable._check_scores",
        "HashTable._set_slot_rows",
        "grown_tables",
    ],
    # The sharded EBC's and EC's step on each rank: its input dist's one read of the exchange's
    # splits is device_sync's (test_input_dist.py counts it); the EC's output dist reads nothing.
    "distributed/input_dist.py": [
        "RoutedCountsAwaitable.__init__",
        "RoutedCountsAwaitable._wait_impl",
        "RoutedDataAwaitable.__init__",
        "RoutedDataAwaitable._wait_impl",
    ],
    "distributed/routing.py": ["SlotRouting.route"],
    "distributed/embedding.py": [
        "ShardedDynamicEmbeddingCollection.input_dist",
        "ShardedDynamicEmbeddingCollection.compute",
        "ShardedDynamicEmbeddingCollection._received_lengths",
        "ShardedDynamicEmbeddingCollection._local_features",
        "ShardedDynamicEmbeddingCollection.output_dist",
        "ShardedDynamicEmbeddingCollection._exchange_sizes",
        "ShardedDynamicEmbeddingCollection._placed_columns",
    ],
    "distributed/embeddingbag.py": [
        "ShardedDynamicEmbeddingBagCollection.input_dist",
        "ShardedDynamicEmbeddingBagCollection.compute",
        "ShardedDynamicEmbeddingBagCollection._local_features",
        "ShardedDynamicEmbeddingBagCollection.output_dist",
        "ShardedDynamicEmbeddingBagCollection._mean_divisor",
    ],
    # A growth (between steps, at most once a step, in the step that passes a load factor): its
    # reads are device_sync's, so test_sync_budget counts them.
    "modules/table_growth.py": [
        "TableGrowth._grow_or_defer",
        "TableGrowth.grow",
        "TableGrowth._relayout",
        "TableGrowth._relaid",
        "TableGrowth._carried_rows",
        "TableGrowth._row_moves",
    ],
    "modules/deltas.py": ["DeltaLog.relayout"],
    "ops.py": ["*"],
    "torch_kernels.py": ["*"],
    "triton_kernels/embedding_lookup.py": ["*"],
    "triton_kernels/embedding_update.py": ["*"],
}

# (file, function, pattern) -> why it is not a sync of the step.
EXEMPT = {
    (
        "ops.py",
        "pread_rows",
        ".tolist()",
    ): "a CPU op's result (two int64): a file-backed tier's reads of its files run on the host",
    (
        "modules/features.py",
        "check_and_arrange",
        ".item()",
    ): "under torch.compile only: symbolic values, compiled into the program's runtime asserts",
    (
        "torch_kernels.py",
        "init_rows",
        "int(tensor)",
    ): "params: the op's float[] argument, host floats (a column shard's first column)",
    (
        "torch_kernels.py",
        "route_bucketize",
        "torch.bincount",
    ): "input routing of sharded tables (the input dist), not the module's step",
    (
        "modules/admission.py",
        "CounterAdmission._admit_compacted",
        "tensor truthiness",
    ): "CPU tensors only, by construction (admit dispatches here for CPU keys): host reads cost no sync there, and the fixed-size form's pass over the side table's capacity cost 1.4x the step",
    (
        "modules/admission.py",
        "CounterAdmission._admit_compacted",
        "sized op",
    ): "CPU tensors only, by construction (admit dispatches here for CPU keys): host reads cost no sync there, and the fixed-size form's pass over the side table's capacity cost 1.4x the step",
    (
        "modules/admission.py",
        "CounterAdmission._admit_compacted",
        "int(tensor)",
    ): "CPU tensors only, by construction (admit dispatches here for CPU keys): host reads cost no sync there, and the fixed-size form's pass over the side table's capacity cost 1.4x the step",
    (
        "modules/admission.py",
        "CounterAdmission._admit_compacted",
        "mask or nonzero",
    ): "CPU tensors only, by construction (admit dispatches here for CPU keys): host reads cost no sync there, and the fixed-size form's pass over the side table's capacity cost 1.4x the step",
    (
        "modules/ids_to_rows.py",
        "IdsToRows._defer_tables",
        "mask or nonzero",
    ): "the deferred new rows (NewRows): CPU tensors only, by construction (lookup defers on CPU only)",
    (
        "modules/ids_to_rows.py",
        "IdsToRows._defer_tables",
        "torch.bincount",
    ): "the deferred new rows (NewRows): CPU tensors only, by construction (lookup defers on CPU only)",
    (
        "modules/ids_to_rows.py",
        "IdsToRows._defer_tables",
        ".tolist()",
    ): "the deferred new rows (NewRows): CPU tensors only, by construction (lookup defers on CPU only)",
    (
        "table.py",
        "HashTable._check_scores",
        "int(tensor)",
    ): "only with increments=True (find_or_insert's check of a caller's scores); the step's "
    "find_or_insert_fixed passes increments=False",
    ("table.py", "HashTable._check_scores", "tensor truthiness"): "only with increments=True, as above",
    (
        "modules/table_storage.py",
        "TableStorage._storage_view",
        "int(tensor)",
    ): "table_offsets: a layout descriptor kept on the CPU by construction (the device copy is _on_device's)",
    (
        "modules/table_storage.py",
        "TableStorage.state_views",
        "int(tensor)",
    ): "state_row_offsets: a layout descriptor kept on the CPU by construction",
    (
        "modules/ids_to_rows.py",
        "IdsToRows.begin_update",
        "int(tensor)",
    ): "optimizer_step: a CPU tensor by construction (the fused optimizer's step count)",
}

EXEMPT.update(
    {
        (
            "modules/table_growth.py",
            "TableGrowth._relaid",
            "int(tensor)",
        ): "row_starts(): a layout descriptor made on the CPU by construction",
        (
            "modules/deltas.py",
            "DeltaLog.relayout",
            "blocking copy",
        ): "the log's versions, on the tables' device already (the hooks move them with the module): a no-op",
    }
)

_ON_DEVICE_ALREADY = (
    "the op's tensor arguments, on the kernel's device already (the op's contract): .to(device) is a no-op there"
)
EXEMPT.update(
    {
        (
            "modules/ids_to_rows.py",
            "IdsToRows._initialise_tables",
            "blocking copy",
        ): "the initializers' descriptors, copied once per layout (cached in _device_layout), not per step",
        (
            "torch_kernels.py",
            "init_rows",
            "blocking copy",
        ): "the vectors are drawn on the ids' device, the table's: a dtype cast",
        ("triton_kernels/embedding_lookup.py", "pooled_lookup", "blocking copy"): _ON_DEVICE_ALREADY,
        ("triton_kernels/embedding_lookup.py", "sequence_lookup", "blocking copy"): _ON_DEVICE_ALREADY,
        ("triton_kernels/embedding_update.py", "fused_update", "blocking copy"): _ON_DEVICE_ALREADY,
    }
)

# Ops whose outputs a GPU kernel sizes on the host (a compaction inside the op): the step path
# calls their fixed-size forms (find_or_insert_fixed, erase_rows).
_SIZED_OPS = {"find_or_insert", "insert_or_assign", "hash_upsert", "export", "hash_export", "erase", "hash_erase"}
_HOST_READ_METHODS = {
    "item",
    "tolist",
    "nonzero",
    "cpu",
    "numpy",
    "masked_select",
    "unique",
    "unique_consecutive",
    "argwhere",
    "equal",  # a Python bool: the values compared on the device, read by the host
}
_TORCH_SIZED = {"nonzero", "unique", "unique_consecutive", "masked_select", "argwhere", "bincount", "equal"}
_REDUCTIONS = {"max", "min", "sum", "any", "all", "item", "argmax", "argmin", "mean", "prod", "count_nonzero"}
_MASK_NAMES = {
    "found",
    "inserted",
    "fresh",
    "live",
    "expired",
    "stale",
    "keep",
    "unseen",
    "admitted",
    "candidates",
    "ready",
    "replicated",
    "outside",
    "mask",
    "late",
    "evicted",
}
_MASK_CALLS = {
    "isfinite",
    "isnan",
    "isinf",
    "isin",
    "eq",
    "ne",
    "lt",
    "le",
    "gt",
    "ge",
    "logical_and",
    "logical_or",
    "logical_not",
    "bool",
}


def _is_device_arg(node):
    """A device expression: ``device``, ``x.device``, ``torch.device(...)`` or a string naming one."""
    if isinstance(node, ast.Name):
        return node.id == "device" or node.id.endswith("_device")
    if isinstance(node, ast.Attribute):
        return node.attr == "device"
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        return node.func.attr == "device"
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("cuda")


def _names_the_host(node):
    """``"cpu"``, or ``getattr(t, "device", "cpu")`` (a tensor's own device, no copy; else the host)."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str) and node.value.startswith("cpu")
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "getattr"
        and len(node.args) == 3
        and isinstance(node.args[1], ast.Constant)
        and node.args[1].value == "device"
        and _names_the_host(node.args[2])
    )


def _is_blocking_copy(call):
    """``torch.tensor(data, device=d)`` (host data copied to d) or ``t.to(d)`` / ``t.cuda()``
    without ``non_blocking=True``: from pageable host memory, a blocking copy the host waits on
    (a sync on a GPU; device_sync.to_device copies through pinned memory without one). A ``.to``
    of a tensor already on the device is a no-op the scan cannot tell apart: say so in EXEMPT."""
    f = call.func
    if not isinstance(f, ast.Attribute):
        return False
    kwargs = {k.arg: k.value for k in call.keywords}
    if isinstance(f.value, ast.Name) and f.value.id == "torch" and f.attr in ("tensor", "as_tensor"):
        return "device" in kwargs and not _names_the_host(kwargs["device"])  # host data made on the host
    non_blocking = isinstance(kwargs.get("non_blocking"), ast.Constant) and kwargs["non_blocking"].value is True
    if f.attr == "cuda":
        return not non_blocking
    if f.attr == "to":
        target = call.args[0] if call.args else kwargs.get("device")
        return target is not None and _is_device_arg(target) and not non_blocking
    return False


def _is_mask(node, masks):
    if isinstance(node, ast.Compare):
        return True
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.Invert, ast.Not)):
        return _is_mask(node.operand, masks) or isinstance(node.op, ast.Not) or True
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.BitAnd, ast.BitOr, ast.BitXor)):
        return _is_mask(node.left, masks) or _is_mask(node.right, masks)
    if isinstance(node, ast.Name):
        return node.id in masks
    if isinstance(node, ast.Attribute):
        return node.attr in _MASK_NAMES
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        return node.func.attr in _MASK_CALLS
    return False


def _has_reduction(node):
    return any(
        isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in _REDUCTIONS
        for n in ast.walk(node)
    )


def _findings(func):
    """(pattern, line) of every host read in ``func``'s body."""
    masks = set(_MASK_NAMES)
    for node in ast.walk(func):  # names bound to masks
        if isinstance(node, ast.Assign) and _is_mask(node.value, masks):
            masks.update(t.id for t in node.targets if isinstance(t, ast.Name))
    out = []
    for node in ast.walk(func):
        if isinstance(node, ast.Call) and _is_blocking_copy(node):
            out.append(("blocking copy", node.lineno))
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Attribute) and f.attr in _HOST_READ_METHODS:
                pattern = "mask or nonzero" if f.attr == "nonzero" else f".{f.attr}()"
                if isinstance(f.value, ast.Name) and f.value.id == "device_sync":
                    continue
                if isinstance(f.value, ast.Name) and f.value.id == "torch" and f.attr in _TORCH_SIZED:
                    pattern = f"torch.{f.attr}"
                out.append((pattern, node.lineno))
            elif isinstance(f, ast.Attribute) and f.attr in _SIZED_OPS:
                out.append(("sized op", node.lineno))
            elif (
                isinstance(f, ast.Attribute)
                and isinstance(f.value, ast.Name)
                and f.value.id == "torch"
                and f.attr in _TORCH_SIZED
            ):
                out.append((f"torch.{f.attr}", node.lineno))
            elif isinstance(f, ast.Name) and f.id in ("int", "bool", "float") and node.args:
                arg = node.args[0]
                if _is_device_sync_call(arg):  # a host value read through the helper
                    continue
                if (
                    _has_reduction(arg)
                    or isinstance(arg, ast.Subscript)
                    or (isinstance(arg, ast.Attribute) and arg.attr.endswith("_step") and arg.attr != "train_step")
                ):
                    out.append(("int(tensor)", node.lineno))
        elif isinstance(node, (ast.If, ast.While, ast.IfExp, ast.Assert)):
            if _has_reduction(node.test) and not _is_device_sync_call(node.test):
                out.append(("tensor truthiness", node.lineno))
        elif isinstance(node, ast.Subscript) and _is_mask(node.slice, masks):
            out.append(("mask or nonzero", node.lineno))
    return out


def _is_device_sync_call(node):
    return any(
        isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "device_sync"
        for n in ast.walk(node)
    )


def _functions(tree):
    """qualified name -> function node (methods as Class.method; nested functions skipped)."""
    out = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out[node.name] = node
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    out[f"{node.name}.{item.name}"] = item
    return out


def _scan():
    found = []
    for path, names in STEP_PATH.items():
        tree = ast.parse((ROOT / path).read_text())
        funcs = _functions(tree)
        chosen = funcs if names == ["*"] else {n: funcs[n] for n in names}
        for name, func in chosen.items():
            for pattern, line in _findings(func):
                key = (path, name, pattern)
                if key not in EXEMPT:
                    found.append(f"{path}:{line} {name}: {pattern}")
    return found


def test_step_path_reads_the_host_only_through_device_sync():
    assert _scan() == []


def test_every_named_function_exists():
    for path, names in STEP_PATH.items():
        funcs = _functions(ast.parse((ROOT / path).read_text()))
        missing = [n for n in names if n != "*" and n not in funcs]
        assert not missing, f"{path}: {missing}"


def test_every_exemption_is_still_needed():
    for path, name, pattern in EXEMPT:
        funcs = _functions(ast.parse((ROOT / path).read_text()))
        assert pattern in {p for p, _ in _findings(funcs[name])}, f"stale exemption: {path} {name} {pattern}"


@pytest.mark.parametrize(
    "code, pattern",
    [
        ("def f(t):\n    return t.nonzero()", "mask or nonzero"),
        ("def f(t, keep):\n    return t[keep]", "mask or nonzero"),
        ("def f(t):\n    m = t > 0\n    t[m] = 1", "mask or nonzero"),
        ("def f(t):\n    return int(t.max())", "int(tensor)"),
        ("def f(t):\n    return int(t[-1])", "int(tensor)"),
        ("def f(t):\n    if t.any():\n        pass", "tensor truthiness"),
        ("def f(t):\n    return t.tolist()", ".tolist()"),
        ("def f(t):\n    return t.item()", ".item()"),
        ("def f(t):\n    return torch.unique(t)", "torch.unique"),
        ("def f(t):\n    return t.cpu()", ".cpu()"),
        # a growth's check that its rows kept their numbers, uncounted until review16_gpu_path.md
        ("def f(a, b):\n    return bool(a.equal(b))", ".equal()"),
        ("def f(a, b):\n    return torch.equal(a, b)", "torch.equal"),
        ("def f(index, keys):\n    return index.find_or_insert(keys)", "sized op"),
        # host-to-device copies the host waits on (pageable memory): the three that escaped the
        # scan in check_and_arrange until the first GPU run found them (gpu_check.md)
        ("def f(n, t):\n    return torch.tensor(n, device=t.device)", "blocking copy"),
        ("def f(o, values):\n    return o.to(values.device)", "blocking copy"),
        ("def f(o, device):\n    return o.to(device, torch.int64)", "blocking copy"),
        ("def f(o):\n    return o.cuda()", "blocking copy"),
    ],
)
def test_the_scan_sees_each_pattern(code, pattern):
    func = ast.parse(code).body[0]
    assert pattern in {p for p, _ in _findings(func)}


def test_the_scan_lets_device_sync_and_positions_pass():
    code = (
        "def f(t, which):\n    n = int(device_sync.to_host(t, 'x')[-1])\n    return t[which], t.index_select(0, which), "
        "device_sync.nonzero(t > 0, 'y'), device_sync.to_device(torch.tensor([1]), t.device), "
        "t.to(torch.int64), t.to(device, non_blocking=True), torch.zeros(3, device=t.device), "
        "torch.tensor([2], device='cpu'), torch.as_tensor(t, device=getattr(t, 'device', 'cpu'))"
    )
    assert _findings(ast.parse(code).body[0]) == []
