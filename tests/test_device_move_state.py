"""A module moved to another device keeps its tables' per-row TTL state, counters and admission
sightings, as it keeps their indexes: ``DynamicTables.apply`` copies them to the new device
(``_build_indexes(carry_from=...)``), each allocated there once, no index rebuilt. The CPU tests
make that carry on the CPU (what a move does after the storage moved); the CUDA one moves for real."""

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torchrec import KeyedJaggedTensor

from torchrec_ext import DynamicEmbeddingBagCollection, DynamicEmbeddingBagConfig, ops

TTL = 3


def _trained():
    cfg = DynamicEmbeddingBagConfig(
        name="t", embedding_dim=4, num_embeddings=64, feature_names=["f"], eviction_policy="lru", ttl_steps=TTL
    )
    module = DynamicEmbeddingBagCollection([cfg], optimizer="sgd", optimizer_kwargs={"lr": 0.5})
    for _ in range(3 * TTL):  # ids 0..7 read every step: never expire; the step passes the ttl
        module(
            KeyedJaggedTensor.from_lengths_sync(["f"], torch.arange(8), torch.ones(8, dtype=torch.int64))
        ).values().sum().backward()
    return module


def _eval_rows(module, device):
    module.eval()
    kjt = KeyedJaggedTensor.from_lengths_sync(["f"], torch.arange(8), torch.ones(8, dtype=torch.int64)).to(device)
    with torch.no_grad():
        return module(kjt).values().cpu()


def test_the_carry_of_a_device_move_keeps_ttl_state_and_counters():
    module = _trained()
    before = copy.deepcopy(module)
    tables = module._tables
    tables._build_indexes(carry_from=tables.device)  # what apply does once the storage moved
    want = _eval_rows(before, "cpu")
    assert want.abs().sum() > 0  # the rows were trained
    assert torch.equal(_eval_rows(module, "cpu"), want)  # still live: not read as expired (zeros)
    assert module.table_stats()["t"].lookups == before.table_stats()["t"].lookups


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_module_moved_to_cuda_keeps_ttl_state():
    module = _trained()
    want = _eval_rows(copy.deepcopy(module), "cpu")
    assert torch.equal(_eval_rows(module.to("cuda"), "cuda"), want)


@pytest.mark.parametrize("admission", ["counter", "bloom"])
def test_the_carry_of_a_device_move_keeps_admission_sightings(admission):
    cfg = DynamicEmbeddingBagConfig(
        name="t", embedding_dim=4, num_embeddings=64, feature_names=["f"], admission=admission, admit_after=2
    )
    module = DynamicEmbeddingBagCollection([cfg], optimizer="sgd", optimizer_kwargs={"lr": 0.5})
    kjt = KeyedJaggedTensor.from_lengths_sync(["f"], torch.arange(8), torch.ones(8, dtype=torch.int64))
    module(kjt).values().sum().backward()  # seen once: not admitted yet
    assert module.table_stats()["t"].live_rows == 0
    tables = module._tables
    tables._build_indexes(carry_from=tables.device)  # what apply does once the storage moved
    module(kjt).values().sum().backward()  # the second sighting admits them
    assert module._tables.num_live_rows() == 8


class _AllocatedBytes(TorchDispatchMode):
    """Sums the bytes of every tensor an op makes (outputs that alias none of its inputs)."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            x.untyped_storage().data_ptr()
            for x in torch.utils._pytree.tree_leaves((args, kwargs))
            if isinstance(x, torch.Tensor)
        }
        for x in torch.utils._pytree.tree_leaves(out):
            if isinstance(x, torch.Tensor) and x.untyped_storage().data_ptr() not in inputs:
                self.bytes += x.untyped_storage().nbytes()
        return out


def _allocated(fn) -> int:
    with _AllocatedBytes() as mode:
        fn()
    return mode.bytes


@pytest.mark.parametrize("admission", ["counter", "bloom"])
def test_the_carry_of_a_device_move_allocates_the_carried_state_once(admission, monkeypatch):
    """The carry allocates each index's arrays and the admission state once, and builds no index
    (no export or restore, the counter admission's side table included: the arrays are copied):
    no fresh last_seen, counters, admission state or index that the moved ones then replace."""
    cfg = DynamicEmbeddingBagConfig(
        name="t",
        embedding_dim=4,
        num_embeddings=1 << 14,
        feature_names=["f"],
        ttl_steps=TTL,
        admission=admission,
        admit_after=2,
    )
    module = DynamicEmbeddingBagCollection([cfg], optimizer="sgd", optimizer_kwargs={"lr": 0.5})
    kjt = KeyedJaggedTensor.from_lengths_sync(["f"], torch.arange(64), torch.ones(64, dtype=torch.int64))
    for _ in range(2):  # (admitted at the second sighting)
        module(kjt).values().sum().backward()
    tables = module._tables
    index, admission_state = tables.indexes[0], tables.admission[0]
    want = _eval_rows(copy.deepcopy(module), "cpu")
    module.train()

    sizes = [index] + ([admission_state.counter] if admission == "counter" else [])
    budget = index.metadata_bytes() + admission_state.nbytes() + sum(t.size_tensor().nbytes for t in sizes)
    seen_before = tables.last_seen[0].clone()
    builds = []
    for name in ("hash_export", "hash_restore"):
        real = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, real=real, name=name: builds.append(name) or real(*a))
    carried = _allocated(lambda: tables._build_indexes(carry_from=tables.device))
    assert builds == [], "the carry rebuilt an index"
    assert carried == budget, f"the carry allocated {carried} bytes, the index and admission state {budget}"
    assert tables.indexes[0] is not index and torch.equal(tables.indexes[0]._digests, index._digests)
    assert torch.equal(tables.last_seen[0], seen_before)
    assert module.table_stats()["t"].lookups == 128
    assert torch.equal(_eval_rows(module, "cpu"), want)


def _moved_tables_module():
    """Three tables past full with what a move carries beyond the index: LFU scores with counter
    admission, LRU with a TTL, a table grown from 16 rows (slots mapped to rows) with a bloom filter."""
    configs = [
        DynamicEmbeddingBagConfig(
            name=name, embedding_dim=4, num_embeddings=64, feature_names=[name], eviction_policy=policy, **options
        )
        for name, policy, options in (
            ("lfu", "lfu", {"admission": "counter", "admit_after": 2}),
            ("ttl", "lru", {"ttl_steps": TTL}),
            ("grown", "lru", {"initial_capacity": 16, "admission": "bloom", "admit_after": 2}),
        )
    ]
    return DynamicEmbeddingBagCollection(configs, optimizer="adagrad", optimizer_kwargs={"lr": 0.1})


def _batch(step, device):
    g = torch.Generator().manual_seed(step)
    lengths = torch.randint(0, 6, (3 * 8,), generator=g)
    values = torch.randint(0, 120, (int(lengths.sum()),), generator=g)
    return KeyedJaggedTensor.from_lengths_sync(["lfu", "ttl", "grown"], values, lengths).to(device)


def _index_states(module):
    """Each index's state_dict, then each admission state (the counter's as id -> count: its side
    table's own placement is the CPU's compacting form's on the CPU, the fixed form's on a GPU)."""
    tables = module._tables
    states = [
        {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in index.state_dict().items()}
        for index in tables.indexes
    ]
    for a in tables.admission:
        state = {} if a is None else {k: v.cpu() for k, v in a.state().items()}
        if "admission_id" in state:
            state = {"counts": dict(zip(state["admission_id"].tolist(), state["admission_count"].tolist()))}
        states.append(state)
    return states


def test_a_moved_module_trains_on_as_the_one_that_stayed(device):
    """Oracle: the module left on the CPU, fed the same batches. After the move (on the CPU, the
    carry as apply makes it; on CUDA, a real move) and 4 training steps, every index holds the same
    keys at the same rows with the same scores, the admission states are equal, and the outputs
    agree (exactly on the CPU; within float sums' rounding on a GPU)."""
    module = _moved_tables_module()
    for step in range(6):
        module(_batch(step, "cpu")).values().sum().backward()
    stayed = copy.deepcopy(module)
    if device == "cpu":
        module._tables._build_indexes(carry_from=module._tables.device)
    else:
        module.to(device)
    assert [s.keys() for s in _index_states(module)] == [s.keys() for s in _index_states(stayed)]
    for step in range(6, 10):
        got, want = module(_batch(step, device)).values(), stayed(_batch(step, "cpu")).values()
        got.sum().backward()
        want.sum().backward()
        if device == "cpu":
            assert torch.equal(got, want), step
        else:
            torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-6)
    for got, want in zip(_index_states(module), _index_states(stayed)):
        assert got.keys() == want.keys()
        for name in got:
            assert torch.equal(got[name], want[name]) if torch.is_tensor(got[name]) else got[name] == want[name], name
    assert module._tables.indexes[2].capacity > 16  # the grown table did grow
    assert module.table_stats() == stayed.table_stats()


@pytest.mark.parametrize(
    "cast",
    [
        lambda m: m.half(),
        lambda m: m.bfloat16(),
        lambda m: m.double(),
        lambda m: m.to(torch.float16),
        lambda m: m.to("cpu", torch.bfloat16),
    ],
    ids=["half", "bfloat16", "double", "to_float16", "to_cpu_bfloat16"],
)
@pytest.mark.parametrize("collection", ["ebc", "ec"])
def test_a_dtype_cast_is_refused_and_changes_nothing(cast, collection):
    """module.half() & co. would convert the packed 4-byte words of the tables' one buffer (each
    table in its own data_type): refused with a TypeError naming the dtype and data_type, before
    anything changes; the module then looks up and trains as a copy that was never cast. .float()
    and .to(device) are no casts of the storage and pass."""
    from torchrec import DataType, EmbeddingConfig

    from torchrec_ext import DynamicEmbeddingCollection

    kjt = KeyedJaggedTensor.from_lengths_sync(["f"], torch.tensor([3, 9, 3, -7]), torch.tensor([2, 0, 2]))
    if collection == "ebc":
        cfg = DynamicEmbeddingBagConfig(
            name="t", embedding_dim=4, num_embeddings=64, feature_names=["f"], data_type=DataType.FP16
        )
        module = DynamicEmbeddingBagCollection([cfg], optimizer="adagrad", optimizer_kwargs={"lr": 0.5})
    else:
        cfg = EmbeddingConfig(name="t", embedding_dim=4, num_embeddings=64, feature_names=["f"])
        module = DynamicEmbeddingCollection([cfg], optimizer="adagrad", optimizer_kwargs={"lr": 0.5})

    def step(m):
        out = m(kjt)
        values = out.values() if collection == "ebc" else out["f"].values()
        values.sum().backward()
        return values.detach()

    step(module)
    twin = copy.deepcopy(module)
    with pytest.raises(TypeError, match=r"cannot convert its tables to torch\.\w+ .* data_type"):
        cast(module)
    assert module.state_dict().keys() == twin.state_dict().keys()
    for key, value in twin.state_dict().items():
        assert torch.equal(module.state_dict()[key], value), key
    tables = module.embedding_bags if collection == "ebc" else module.embeddings
    assert tables["t"].weight.dtype == (torch.float16 if collection == "ebc" else torch.float32)
    torch.testing.assert_close(step(module), step(twin), rtol=0, atol=0)
    module.float()
    module.to("cpu")
    torch.testing.assert_close(step(module), step(twin), rtol=0, atol=0)
