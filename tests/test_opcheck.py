"""Every torchrec_ext op passes ``torch.library.opcheck``: its schema (aliasing and mutation
annotations), its fake kernel (shapes and dtypes for FakeTensor / torch.compile), autograd
registration and AOT dispatch, on real inputs of each op. A new op gets a row here."""

import os
import tempfile

import pytest
import torch

from embedding_ops_helpers import pooled_case, update_case
from torchrec_ext import HashTable
from torchrec_ext import reference as ref
from torchrec_ext.modules import ir_serializer  # noqa: F401  (registers the ir_* ops, as exporting does)

_ops = torch.ops.torchrec_ext
CAPACITY = 300


def _full_table() -> HashTable:
    table = HashTable(CAPACITY)
    table.find_or_insert(torch.arange(200) * 7919)
    return table


def _hash_cases():
    t = _full_table()
    keys = torch.arange(150, 260) * 7919
    state = (t._digests.clone(), t._slot_keys.clone(), t._slot_scores.clone(), t._size.clone())
    live_keys, live_rows, live_scores = next(iter(t.export()))
    empty = HashTable(CAPACITY)
    yield "hash_find", (t._digests, t._slot_keys, keys, CAPACITY)
    yield "hash_upsert", (*state, keys, None, CAPACITY, ref.POLICIES.index("lru"), 5, 0, False)
    yield "hash_upsert", (*state, keys, torch.arange(keys.numel()), CAPACITY, ref.POLICIES.index("custom"), 5, 0, True)
    pending = torch.arange(keys.numel()) % 3 != 0
    yield "hash_upsert_fixed", (*state, keys, None, pending, CAPACITY, ref.POLICIES.index("lru"), 6, 0, False)
    yield (
        "hash_upsert_fixed",
        (*state, keys, torch.ones_like(keys), None, CAPACITY, ref.POLICIES.index("lfu"), 7, 0, False),
    )
    other = HashTable(64)
    other.find_or_insert(torch.arange(64) * 31)
    tables = [[x.clone() for x in state], [other._digests, other._slot_keys, other._slot_scores, other._size]]
    both = torch.cat([keys, torch.arange(40) * 29])
    yield (
        "hash_upsert_tables",
        (
            *[[t[i] for t in tables] for i in range(4)],
            both,
            [0, keys.numel(), both.numel()],
            None,
            both % 4 != 0,
            [CAPACITY, 64],
            [ref.POLICIES.index("lru"), ref.POLICIES.index("lfu")],
            [8, 3],
            [0, 1],
            False,
        ),
    )
    yield (
        "hash_find_tables",
        (
            [t._digests, other._digests],
            [t._slot_keys, other._slot_keys],
            both,
            [0, keys.numel(), both.numel()],
            [CAPACITY, 64],
        ),
    )
    yield "hash_erase", (state[0], state[1], state[3], keys, CAPACITY)
    slot_map = torch.randperm(CAPACITY).to(torch.int32)
    slots = torch.cat([torch.randint(-1, CAPACITY, (30,)), torch.randint(-1, 64, (20,))])
    yield "hash_slot_rows", (slots, [0, 30, 50], [slot_map, None])
    yield "hash_export", (t._digests, t._slot_keys, t._slot_scores, CAPACITY, 0, t._slot_scores.numel())
    yield (
        "hash_restore",
        (
            empty._digests,
            empty._slot_keys,
            empty._slot_scores,
            empty._size,
            live_keys,
            live_rows,
            live_scores,
            CAPACITY,
        ),
    )
    yield "hash_place", (live_keys, live_scores, CAPACITY)
    yield "hash_place", (keys, torch.arange(keys.numel()) % 7, 64)  # more keys than rows: some left out
    start = torch.where(torch.arange(live_keys.numel()) % 2 == 0, live_rows, -1)  # half of them held
    yield "hash_place", (live_keys, live_scores, CAPACITY, start)
    yield "route", (keys, 4)
    read_index = _ops.serving_index_update(torch.zeros(8 * 64, dtype=torch.int64), keys[:0], live_keys, live_rows)
    yield "serving_index_update", (read_index, live_keys[:20], keys, torch.arange(keys.numel()))
    yield "serving_find", ([read_index, read_index], both, torch.tensor([0, keys.numel(), both.numel()]), [-1, 3])
    yield "route_bucketize", (keys, torch.tensor([50, 60]), [-1], 2, 2)
    filter_bytes = torch.zeros(64, dtype=torch.uint8)
    yield "bloom_admit", (filter_bytes, keys, torch.ones_like(keys), None, -12345, 3, 2)
    yield "bloom_admit", (filter_bytes, keys, torch.full_like(keys, 7), keys % 3 == 0, 99, 1, 1)


def _embedding_cases():
    yield "dedup_segments", (torch.randint(0, 20, (50,)), torch.tensor([0, 20, 50]))
    yield (
        "init_rows",
        (
            torch.zeros(10, 4),
            torch.tensor([0, 3]),
            torch.tensor([5, 7]),
            1,
            ref.INITIALIZERS["normal"],
            [0.0, 1.0],
            [torch.zeros(10, 1)],
            [0.5],
        ),
    )
    yield (
        "init_rows_tables",
        (
            torch.zeros(4 * 3 + 2 * 5),
            torch.tensor([0, 12]),
            torch.tensor([3, 5]),
            None,
            torch.tensor([1, -1, 0, 3]),
            torch.tensor([1, 0, 0, 0]),
            torch.tensor([5, 7, 9, 11]),
            torch.tensor([1, 2]),
            torch.tensor([ref.INITIALIZERS["normal"], ref.INITIALIZERS["uniform"]]),
            torch.tensor([[0.0, 1.0, 0.0, 0.0], [-1.0, 1.0, 0.0, 0.0]], dtype=torch.float64),
            5,
            [torch.zeros(4 + 2)],
            torch.tensor([0, 4]),
            True,
            [0.5],
        ),
    )
    case = pooled_case(weighted=True)
    yield (
        "pooled_lookup",
        (
            case["weights"],
            case["table_offsets"],
            case["table_dims"],
            case["feature_table"],
            case["feature_col"],
            case["feature_mean"],
            case["rows"],
            case["offsets"],
            case["per_sample_weights"],
            case["batch_size"],
            case["total_dim"],
            [],
        ),
    )
    weights = torch.randn(6 * 8 + 9 * 8)
    yield (
        "sequence_lookup",
        (
            weights,
            torch.tensor([0, 48]),
            8,
            torch.tensor([1, 0]),
            torch.tensor([0, 4, 9]),
            torch.tensor([0, 8, -1, 2, 5, 5, 1, 0, 3]),
            [],
        ),
    )
    for optimizer in ref.OPTIMIZERS:
        for pooled in (True, False):
            grad, w, states, c = update_case(optimizer, pooled)
            yield (
                "fused_update",
                (
                    grad,
                    w,
                    states,
                    c["table_offsets"],
                    c["table_dims"],
                    c["state_row_offsets"],
                    c["unique_rows"],
                    c["unique_table"],
                    c["inverse"],
                    c["offsets"],
                    c["per_sample_weights"],
                    c["feature_col"],
                    c["feature_mean"],
                    c["batch_size"],
                    ref.OPTIMIZERS[optimizer],
                    list(c["hparams"]),
                    1,
                    [],
                    None,
                    [],
                ),
            )


def _copy_rows_cases():
    src = torch.randn(12, 5)
    yield "copy_rows", (torch.zeros(4, 5), None, src, torch.tensor([3, 0, 11, 3]))
    yield "copy_rows", (torch.zeros(12, 5), torch.tensor([2, 7]), src[:2], None)
    yield "guarded_copy_rows", (torch.zeros(4, 5), None, src, torch.tensor([3, 0, 11, 3]))
    yield "guarded_copy_rows", (torch.zeros(12, 5), torch.tensor([2, 7]), src[:2], None)
    yield "guarded_copy_rows", (torch.zeros(12), torch.tensor([1, 4]), torch.arange(12.0), torch.tensor([5, 6]))
    # pread_rows reads src's bytes from a file (src gives the shape): a file holding them
    with tempfile.NamedTemporaryFile(delete=False) as f:
        f.write(src.numpy().tobytes())
    fd = os.open(f.name, os.O_RDONLY)
    os.unlink(f.name)  # (the descriptor keeps the file)
    yield "pread_rows", (torch.zeros(4, 5), None, src, torch.tensor([3, 0, 11, 3]), fd, 0)
    yield "pread_rows", (torch.zeros(12, 5), torch.tensor([2, 7]), src[:2], None, fd, 0)


def _ir_cases():
    # The shape-only stand-ins of an IR-serialized program (modules/ir_serializer.py).
    ids = torch.tensor([3, 1, 4, 1, 5], dtype=torch.int64)
    yield "ir_pooled_lookup", ([ids, None, torch.tensor([2, 3])], 2, [4, 8])
    yield "ir_sequence_lookup", (ids, 6)


CASES = list(_hash_cases()) + list(_embedding_cases()) + list(_copy_rows_cases()) + list(_ir_cases())


# Ops registered from Python that opcheck cannot drive: their first argument names a live module
# (torch.compile's one-op lookup, modules/compiled_lookup.py; tested by tests/test_dropin_compile.py).
MODULE_HANDLE_OPS = {
    "compiled_pooled_lookup",
    "compiled_pooled_update",
    "compiled_sequence_lookup",
    "compiled_sequence_update",
}


def test_every_op_has_a_case():
    """A new op in csrc/ops.cpp must be added to CASES (the check reads the registered schemas)."""
    registered = {s.name.split("::")[1] for s in torch._C._jit_get_all_schemas() if s.name.startswith("torchrec_ext::")}
    assert registered - MODULE_HANDLE_OPS == {name for name, _ in CASES}


@pytest.mark.parametrize("name,args", CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
def test_opcheck(name, args):
    torch.library.opcheck(getattr(_ops, name).default, args)
