"""A module moved to another device keeps its tables' per-row TTL state and counters, as it keeps
their indexes: ``DynamicTables.apply`` rebuilds the indexes on the new device, carrying the old
ones (``_build_indexes(carry_from=...)``). The CPU test makes that carry on the CPU (what a move
does after the storage moved); the CUDA one moves for real."""

import copy

import pytest
import torch
from torchrec import KeyedJaggedTensor

from torchrec_ext import DynamicEmbeddingBagCollection, DynamicEmbeddingBagConfig

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
