"""route(): the row-wise owner of a key, and its independence from the bucket hash."""

import pytest
import torch

from torchrec_ext import HashTable, ops
from torchrec_ext import reference as ref
from torchrec_ext.reference import place, route


def test_route_matches_reference_and_covers_ranks(device):
    keys = torch.cat([torch.randint(-(2**63), 2**63 - 1, (5000,)), torch.tensor([-(2**63), -1, 0, 2**63 - 1])])
    for world in (1, 2, 3, 8):
        ranks = ops.route(keys.to(device), world).cpu()
        assert ranks.tolist() == [route(k, world) for k in keys.tolist()]
        counts = torch.bincount(ranks, minlength=world)
        assert counts.min() > 0.8 * len(keys) / world


def test_keys_of_one_rank_spread_over_all_of_its_buckets(device):
    # If rank and bucket came from the same hash, the keys a rank owns would all land in 1/W of
    # its buckets. Route 200k keys, keep rank 0's, insert them into a table: every bucket used,
    # and bucket loads look like a fair draw.
    world = 4
    keys = torch.randint(-(2**62), 2**62, (200_000,))
    mine = keys[ops.route(keys, world) == 0]
    capacity = 32 * 512
    buckets = torch.tensor([place(k, capacity)[0] for k in mine.tolist()])
    load = torch.bincount(buckets, minlength=512).double()
    assert (load > 0).all()
    # Control: a router sharing the bucket hash (rank = bucket % world) leaves 3/4 unused.
    dependent = [b for b in (place(k, capacity)[0] for k in keys[:20_000].tolist()) if b % world == 0]
    assert torch.unique(torch.tensor(dependent)).numel() <= 512 // world
    mean = load.mean()
    chi2 = float(((load - mean) ** 2 / mean).sum())
    assert chi2 < 512 + 6 * (2 * 512) ** 0.5  # ~ chi-square with 511 dof, 6 sigma
    table = HashTable(capacity, policy="lru", device=device)
    rows = table.find_or_insert(mine[: capacity // 2].to(device)).rows.cpu()
    used = torch.unique(rows // 32)
    assert used.numel() == 512


def test_route_rejects_bad_input():
    with pytest.raises(ValueError, match="world_size must be an int >= 1, got 0"):
        ops.route(torch.arange(3), 0)
    with pytest.raises(TypeError, match="keys must be int64"):
        ops.route(torch.arange(3).int(), 2)
    with pytest.raises(ValueError, match="keys must be 1-D"):
        ops.route(torch.zeros(2, 2, dtype=torch.int64), 2)


@pytest.mark.parametrize("world_size,batch_size", [(1, 3), (2, 5), (4, 1), (3, 0)])
@pytest.mark.parametrize("kernel", ["cpp", "torch"])
def test_route_bucketize_matches_reference(world_size, batch_size, kernel):
    from torchrec_ext import torch_kernels

    bucketize = ops.route_bucketize if kernel == "cpp" else torch_kernels.route_bucketize
    owners = [-1, min(1, world_size - 1), -1, 0]
    lengths = torch.randint(0, 4, (len(owners) * batch_size,))
    ids = torch.randint(-(2**62), 2**62, (int(lengths.sum()),))
    got = bucketize(ids, lengths, owners, world_size, batch_size)
    want = ref.route_bucketize(ids.tolist(), lengths.tolist(), owners, world_size, batch_size)
    for g, w in zip(got, want):
        assert g.tolist() == w


def test_route_bucketize_rejects_bad_input():
    with pytest.raises(RuntimeError, match="lengths sum to 3 but there are 2 ids"):
        ops.route_bucketize(torch.tensor([1, 2]), torch.tensor([1, 2]), [-1], 2, 2)
    with pytest.raises(RuntimeError, match=r"slot_owner\[0\] must be -1 \(row-wise\) or a rank in \[0, 2\), got 5"):
        ops.route_bucketize(torch.tensor([1]), torch.tensor([1]), [5], 2, 1)
