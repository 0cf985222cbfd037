"""Bad input gets a clear error naming the argument, and leaves the table unchanged."""

import pytest
import torch

from torchrec_ext import HashTable


def _snapshot(table):
    s = table.state_dict()
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in s.items()}


def _assert_unchanged(table, before):
    after = table.state_dict()
    for k, v in before.items():
        assert torch.equal(v, after[k]) if isinstance(v, torch.Tensor) else v == after[k], k


@pytest.fixture
def table():
    t = HashTable(256, policy="lru")
    t.find_or_insert(torch.arange(100))
    return t


@pytest.mark.parametrize(
    "bad_keys, error, message",
    [
        ([1, 2, 3], TypeError, "keys must be a torch.Tensor"),
        (torch.tensor([1.0, 2.0]), TypeError, "keys must be an integer tensor"),
        (torch.tensor([True, False]), TypeError, "keys must be an integer tensor"),
        (torch.arange(6).reshape(2, 3), ValueError, "keys must be 1-D"),
        (torch.tensor(5), ValueError, "keys must be 1-D"),
        (torch.arange(3, device="meta"), ValueError, "keys are on meta"),
    ],
)
@pytest.mark.parametrize("op", ["find", "find_or_insert", "insert_or_assign", "erase"])
def test_bad_keys(table, op, bad_keys, error, message):
    before = _snapshot(table)
    with pytest.raises(error, match=message):
        getattr(table, op)(bad_keys)
    _assert_unchanged(table, before)


@pytest.mark.parametrize("capacity", [0, -5])
def test_capacity_must_be_positive(capacity):
    with pytest.raises(ValueError, match=f"capacity must be > 0, got {capacity}"):
        HashTable(capacity)


def test_capacity_must_be_int():
    with pytest.raises(TypeError, match="capacity must be an int, got float"):
        HashTable(10.0)


def test_unknown_policy():
    with pytest.raises(ValueError, match="policy must be one of .* got 'fifo'"):
        HashTable(10, policy="fifo")


def test_custom_scores_required_and_sized():
    table = HashTable(64, policy="custom")
    table.find_or_insert(torch.arange(10), scores=torch.arange(10))
    before = _snapshot(table)
    with pytest.raises(ValueError, match="'custom' policy needs scores"):
        table.find_or_insert(torch.arange(5))
    with pytest.raises(ValueError, match=r"one entry per key, shape \(5,\), got \(4,\)"):
        table.find_or_insert(torch.arange(5), scores=torch.arange(4))
    with pytest.raises(TypeError, match="scores must be an integer tensor"):
        table.insert_or_assign(torch.arange(5), scores=torch.ones(5))
    _assert_unchanged(table, before)


def test_scores_rejected_where_policy_ignores_them(table):
    before = _snapshot(table)
    with pytest.raises(ValueError, match="only taken by policies"):
        table.find_or_insert(torch.arange(3), scores=torch.arange(3))
    _assert_unchanged(table, before)


def test_negative_lfu_increments():
    table = HashTable(64, policy="lfu")
    before = _snapshot(table)
    with pytest.raises(ValueError, match="increments must be >= 0, got -1"):
        table.find_or_insert(torch.arange(3), scores=torch.tensor([1, -1, 2]))
    _assert_unchanged(table, before)


def test_bad_epoch_and_page_size(table):
    with pytest.raises(ValueError, match="epoch must be an int in"):
        table.set_epoch(-1)
    with pytest.raises(ValueError, match="page_size must be an int > 0"):
        next(table.export(page_size=0))


def test_load_state_dict_rejects_mismatches(table):
    state = table.state_dict()
    other = HashTable(512, policy="lru")
    with pytest.raises(ValueError, match="saved with capacity 256, this table has capacity 512"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match="saved with policy 'lru'"):
        HashTable(256, policy="lfu").load_state_dict(state)
    victim = HashTable(256, policy="lru")
    victim.find_or_insert(torch.tensor([7, 8, 9]))
    before = _snapshot(victim)
    # Keys no longer at their rows: beyond what the stash holds (a few rows outside their buckets
    # are a full load's stashed keys), refused.
    corrupt = dict(state, rows=state["rows"].flip(0))
    with pytest.raises(ValueError, match="cannot live in row .* and the stash's 32 entries are taken"):
        victim.load_state_dict(corrupt)
    duplicated = dict(state, keys=torch.cat([state["keys"][:1], state["keys"][:-1]]))
    with pytest.raises(ValueError, match="appears twice"):
        victim.load_state_dict(duplicated)
    with pytest.raises(ValueError, match="missing"):
        victim.load_state_dict({"keys": state["keys"]})
    _assert_unchanged(victim, before)


def test_cuda_table_without_cuda_kernels_is_a_clear_error():
    from torchrec_ext import ops

    if ops.has_kernel("hash_find", torch.device("cuda")):
        pytest.skip("this build has CUDA kernels")
    with pytest.raises(ValueError, match="has no torchrec_ext kernels in this build"):
        HashTable(10, device="cuda")


def test_kernels_check_their_inputs_too():
    # The ops are public (torch.ops.torchrec_ext.*): they validate with TORCH_CHECK, no crash.
    digests = torch.zeros(32, dtype=torch.uint8)
    with pytest.raises(
        RuntimeError, match="hash_find: digests must be a contiguous uint8 tensor of 98 entries for capacity 40"
    ):
        torch.ops.torchrec_ext.hash_find(digests, torch.zeros(32, dtype=torch.int64), torch.arange(3), 40)
    with pytest.raises(RuntimeError, match="hash_find: keys must be int64"):
        torch.ops.torchrec_ext.hash_find(
            torch.zeros(65, dtype=torch.uint8), torch.zeros(96, dtype=torch.int64), torch.arange(3).int(), 32
        )
    with pytest.raises(RuntimeError, match="route: world_size must be in"):
        torch.ops.torchrec_ext.route(torch.arange(3), 0)


@pytest.mark.parametrize("clock", [-1, -(2**63)])
def test_upsert_op_refuses_a_negative_clock(table, clock):
    """The op itself refuses a negative clock (HashTable never passes one; a caller of the op
    might): it is an LRU score, and it picks the call's first insert phase."""
    before = _snapshot(table)
    with pytest.raises(RuntimeError, match=f"hash_upsert: clock must be >= 0, got {clock}"):
        torch.ops.torchrec_ext.hash_upsert(
            table._digests,
            table._slot_keys,
            table._slot_scores,
            table._size,
            torch.arange(200, 300),
            None,
            table.capacity,
            1,
            clock,
            0,
            False,
        )
    _assert_unchanged(table, before)


@pytest.mark.parametrize("start, end", [(-1, 10), (20, 10), (0, 257)])
def test_export_op_refuses_a_range_outside_the_slots(start, end, device):
    """Both kernels of the op refuse a slot range outside [0, num_slots] with the same message."""
    table = HashTable(250, policy="lru", device=device)  # 8 buckets: 256 slots
    with pytest.raises(RuntimeError, match=f"hash_export: need 0 <= start <= end <= 256, got start={start} end={end}"):
        torch.ops.torchrec_ext.hash_export(table._digests, table._slot_keys, table._slot_scores, 250, start, end)
