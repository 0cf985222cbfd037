"""Sharded EBC (weighted, a mean-pooled table) and EC on 2 real gloo ranks whose batches differ in
size within a step (an uneven last batch, drop_last=False), as TorchRec's sharded EBC takes them,
against the unsharded module fed every rank's samples: the same outputs each step and, after the
steps, the same table rows (fused SGD, so the gradient's scale shows)."""

import pytest
import torch
import torch.distributed as dist
from torchrec import KeyedJaggedTensor, PoolingType

from dist_helpers import ModelWith, dmp_of, run_ranks
from torchrec_ext import (
    DynamicEmbeddingBagCollection,
    DynamicEmbeddingBagConfig,
    DynamicEmbeddingCollection,
    DynamicEmbeddingConfig,
)

WORLD, KEYS, TIMEOUT_S = 2, ["f1", "f2", "f3"], 60
# Each step's batch size on rank 0 and rank 1 (one even step between, one rank with no samples).
BATCHES = [(3, 5), (4, 4), (2, 1), (0, 3), (6, 2)]


def _make(bags):
    if bags:
        return DynamicEmbeddingBagCollection(
            [
                DynamicEmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=256, feature_names=["f1", "f2"]),
                DynamicEmbeddingBagConfig(
                    name="t2", embedding_dim=3, num_embeddings=128, feature_names=["f3"], pooling=PoolingType.MEAN
                ),
            ],
            is_weighted=True,
            optimizer="sgd",
            optimizer_kwargs={"lr": 0.5},
        )
    return DynamicEmbeddingCollection(
        [
            DynamicEmbeddingConfig(name="t1", embedding_dim=4, num_embeddings=256, feature_names=["f1", "f3"]),
            DynamicEmbeddingConfig(name="t2", embedding_dim=4, num_embeddings=128, feature_names=["f2"]),
        ],
        need_indices=True,
        optimizer="sgd",
        optimizer_kwargs={"lr": 0.5},
    )


def _rank_batch(step, rank, weighted):
    batch = BATCHES[step][rank]
    gen = torch.Generator().manual_seed(step * 10 + rank)
    lengths = torch.randint(0, 4, (len(KEYS) * batch,), generator=gen)
    n = int(lengths.sum())
    values = torch.tensor([0, -1, 2**62, 5, 6, 7, 99])[torch.randint(0, 7, (n,), generator=gen)]
    weights = torch.rand(n, generator=gen) if weighted else None
    return KeyedJaggedTensor(keys=KEYS, values=values, lengths=lengths, weights=weights, stride=batch)


def _per_key(kjt):
    """{key: (lengths, values, weights)} (TorchRec's to_dict fails on a batch of no samples)."""
    lengths = kjt.lengths().view(len(KEYS), kjt.stride())
    counts = lengths.sum(1).tolist()
    values = kjt.values().split(counts)
    weights = kjt.weights().split(counts) if kjt.weights_or_none() is not None else [None] * len(KEYS)
    return {key: (lengths[i], values[i], weights[i]) for i, key in enumerate(KEYS)}


def _global(kjts, weighted):
    """Every rank's samples, rank after rank per key."""
    per_key = [_per_key(k) for k in kjts]
    return KeyedJaggedTensor(
        keys=KEYS,
        values=torch.cat([part[key][1] for key in KEYS for part in per_key]),
        lengths=torch.cat([part[key][0] for key in KEYS for part in per_key]),
        weights=torch.cat([part[key][2] for key in KEYS for part in per_key]) if weighted else None,
        stride=sum(k.stride() for k in kjts),
    )


def _rows(state, container):
    """{table: {id: row}} of a (local) module's state dict."""
    tables = {k.split(".")[1] for k in state if k.startswith(container) and k.endswith(".weight_id")}
    return {
        t: dict(zip(state[f"{container}.{t}.weight_id"].tolist(), state[f"{container}.{t}.weight"].tolist()))
        for t in tables
    }


def _uneven_batches_train_as_unsharded(rank, world_size, bags, sharding):
    from torchrec.distributed.comm_ops import get_gradient_division
    from torchrec.distributed.sharding_plan import column_wise, row_wise, table_wise

    from torchrec_ext.distributed import get_sharders

    reference, module = _make(bags), _make(bags)
    sharder = next(s for s in get_sharders() if s.module_type is type(module))
    kernel = "customized_kernel"
    plan = {
        "mixed": {"t1": row_wise(compute_kernel=kernel), "t2": table_wise(rank=1, compute_kernel=kernel)},
        # (an EC's tables on a rank are as wide: both split in columns)
        "column": {
            "t1": column_wise(ranks=[0, 1], compute_kernel=kernel),
            "t2": row_wise(compute_kernel=kernel) if bags else column_wise(ranks=[1, 0], compute_kernel=kernel),
        },
    }[sharding]
    dmp = dmp_of(ModelWith("m", module), "m", plan, sharder, world_size)
    # The pooled output dist divides the tables' gradient by the world size, as TorchRec's does:
    # the ranks train on the mean of their losses. The sequence one does not divide it.
    scale = 1.0 / world_size if bags and get_gradient_division() else 1.0
    for step in range(len(BATCHES)):
        kjts = [_rank_batch(step, r, bags) for r in range(world_size)]
        out, want = dmp(kjts[rank]), reference(_global(kjts, bags))
        out = out.wait() if hasattr(out, "wait") else out
        gen = torch.Generator().manual_seed(1000 + step)
        if bags:
            grads = torch.randn(want.values().shape, generator=gen)
            first, mine = sum(BATCHES[step][:rank]), BATCHES[step][rank]
            torch.testing.assert_close(out.values(), want.values()[first : first + mine], rtol=1e-6, atol=1e-6)
            (out.values() * grads[first : first + mine]).sum().backward()
            (want.values() * grads).sum().mul(scale).backward()
            continue
        loss, ref_loss = 0, 0
        for name, jt in want.items():
            grads = torch.randn(jt.values().shape, generator=gen)
            feature = name.split("@")[0]
            per_rank = [int(_per_key(k)[feature][0].sum()) for k in kjts]
            first, mine = sum(per_rank[:rank]), per_rank[rank]
            torch.testing.assert_close(out[name].values(), jt.values()[first : first + mine], rtol=1e-6, atol=1e-6)
            assert torch.equal(out[name].lengths(), _per_key(kjts[rank])[feature][0]), (step, name)
            loss = loss + (out[name].values() * grads[first : first + mine]).sum()
            ref_loss = ref_loss + (jt.values() * grads).sum()
        loss.backward()
        ref_loss.mul(scale).backward()
    if sharding == "column":  # a row split in columns over the ranks: the outputs above compared them
        return
    container = "embedding_bags" if bags else "embeddings"
    local = dmp.module.m.local_module
    gathered = [None] * world_size
    dist.all_gather_object(gathered, _rows(local.state_dict(), container) if local is not None else {})
    merged = {}
    for part in gathered:
        for table, rows in part.items():
            assert not set(rows) & set(merged.get(table, {})), f"an id of {table} lives on two ranks"
            merged.setdefault(table, {}).update(rows)
    want_rows = _rows(reference.state_dict(), container)
    assert merged.keys() == want_rows.keys()
    for table, rows in want_rows.items():
        assert merged[table].keys() == rows.keys(), table
        for k, v in rows.items():
            torch.testing.assert_close(torch.tensor(merged[table][k]), torch.tensor(v), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("sharding", ["mixed", "column"])
@pytest.mark.parametrize("bags", [True, False], ids=["ebc", "ec"])
def test_uneven_batches_train_as_the_unsharded_module(bags, sharding):
    """mixed: row-wise and table-wise tables; column: column-wise ones (the outputs of each step,
    which read the rows the steps before updated)."""
    run_ranks(_uneven_batches_train_as_unsharded, WORLD, bags, sharding, timeout_s=TIMEOUT_S)
