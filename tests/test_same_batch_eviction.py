"""Issue 11 at module level: on a full table, a batch whose new ids come before its resident ids
must not evict those resident ids. Before the fix a new id early in the batch took the row of a
resident id appearing later, which was then re-inserted as new: its trained vector and optimizer
state were replaced by a fresh initial vector while the id was in use. The oracle is the module's
own state read before the call."""

import pytest
import torch
from torchrec import KeyedJaggedTensor

from torchrec_ext import DynamicEmbeddingBagCollection, DynamicEmbeddingBagConfig

DIM = 8


def _kjt(ids: torch.Tensor) -> KeyedJaggedTensor:
    """One bag per id, so each bag's pooled output is its id's vector."""
    return KeyedJaggedTensor(keys=["f"], values=ids, lengths=torch.ones(ids.numel(), dtype=torch.int64))


def _rows_by_id(module):
    sd = module.state_dict()
    prefix = "embedding_bags.t."
    ids = sd[prefix + "weight_id"].tolist()
    return {
        i: (sd[prefix + "weight"][n], sd[prefix + "optimizer.momentum1"][n], sd[prefix + "metadata"][n].item())
        for n, i in enumerate(ids)
    }


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("capacity", [64, 1024])
def test_resident_ids_keep_trained_vectors_and_optimizer_state(capacity, policy):
    torch.manual_seed(0)
    module = DynamicEmbeddingBagCollection(
        [
            DynamicEmbeddingBagConfig(
                name="t", embedding_dim=DIM, num_embeddings=capacity, feature_names=["f"], eviction_policy=policy
            )
        ],
        optimizer=torch.optim.Adagrad,
        optimizer_kwargs={"lr": 0.1},
    )
    module.train()
    pool = torch.arange(4 * capacity) * 7919 - 10**6
    for _ in range(6):  # train until the table is full (and evicting)
        ids = pool[torch.randperm(pool.numel())[: capacity // 2 + 7]]
        module(_kjt(ids)).values().sum().backward()
    before = _rows_by_id(module)
    assert len(before) == capacity, "the table must be full"
    # The resident ids an eviction would pick first (lowest scores), placed after new ids (a
    # quarter of the capacity, so every new id's buckets keep rows outside the batch).
    resident = sorted(before, key=lambda i: before[i][2])[: capacity // 2]
    fresh = torch.arange(capacity // 4) + 10**12
    batch = torch.cat([fresh, torch.tensor(resident)])

    out = module(_kjt(batch)).values()

    after = _rows_by_id(module)
    for n, i in enumerate(resident):
        vector, momentum, _ = before[i]
        torch.testing.assert_close(out[fresh.numel() + n], vector, rtol=0, atol=0)
        assert i in after, f"resident id {i} was evicted by its own batch"
        torch.testing.assert_close(after[i][0], vector, rtol=0, atol=0)
        torch.testing.assert_close(after[i][1], momentum, rtol=0, atol=0)
    # New ids took rows of ids outside the batch only (under LRU all of them got one; under LFU
    # a new id scores less than a resident seen more often, so it may be refused instead).
    assert len(after) == capacity
    if policy == "lru":
        assert set(fresh.tolist()) <= set(after)
