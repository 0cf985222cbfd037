"""Inputs shared by the embedding ops' tests (test_embedding_lookup.py, test_embedding_update.py,
test_opcheck.py): the storage layout of a few tables, random bags, a pooled lookup case and a fused
update case."""

import torch

from torchrec_ext import reference as ref

EXTREME_IDS = [0, -1, 2**63 - 1, -(2**63), 12345]

# FTRL's (lr_power, l1, l2, beta): TensorFlow's default power (a square root) with all three
# regularisers, a general power (l1 large enough to zero some weights), and power 0 (n^0 = 1).
FTRL_SETTINGS = [(-0.5, 0.02, 0.01, 0.5), (-0.3, 0.3, 0.1, 0.0), (0.0, 0.01, 0.0, 0.0)]


def layout_of(caps, dims):
    offsets, total = [], 0
    for cap, dim in zip(caps, dims):
        offsets.append(total)
        total += cap * dim
    row_offsets = torch.tensor([0] + list(torch.tensor(caps).cumsum(0)[:-1].tolist()), dtype=torch.int64)
    return torch.tensor(offsets, dtype=torch.int64), torch.tensor(dims, dtype=torch.int64), total, row_offsets


def random_bags(num_bags, max_len, allow_empty=True):
    lengths = torch.randint(0 if allow_empty else 1, max_len + 1, (num_bags,))
    return torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])


def pooled_case(weighted, batch_size=7):
    caps, dims = [11, 5, 9], [4, 12, 8]
    table_offsets, table_dims, total, _ = layout_of(caps, dims)
    weights = torch.randn(total)
    feature_table = torch.tensor([0, 0, 1, 2])
    feature_dims = table_dims[feature_table]
    feature_col = torch.cat([torch.zeros(1, dtype=torch.int64), feature_dims.cumsum(0)[:-1]])
    feature_mean = torch.tensor([False, True, False, True])
    offsets = random_bags(4 * batch_size, 5)
    n = int(offsets[-1])
    bag_table = feature_table.repeat_interleave(batch_size)
    value_table = bag_table.repeat_interleave(offsets[1:] - offsets[:-1])
    caps_t = torch.tensor(caps)
    rows = (torch.rand(n) * caps_t[value_table]).long()
    rows[torch.rand(n) < 0.15] = -1
    psw = torch.rand(n) if weighted else None
    return dict(
        weights=weights,
        table_offsets=table_offsets,
        table_dims=table_dims,
        feature_table=feature_table,
        feature_col=feature_col,
        feature_mean=feature_mean,
        rows=rows,
        offsets=offsets,
        per_sample_weights=psw,
        batch_size=batch_size,
        total_dim=int(feature_dims.sum()),
    )


def update_case(optimizer, pooled):
    """A fused_update case: grad, weights, states and the op's other arguments but step."""
    torch.manual_seed(3)
    if pooled:
        case = pooled_case(weighted=True)
        caps = [11, 5, 9]
        table_offsets, table_dims, total, row_offsets = layout_of(caps, [4, 12, 8])
        bag_table = case["feature_table"].repeat_interleave(case["batch_size"])
        offsets = case["offsets"]
        value_table = bag_table.repeat_interleave(offsets[1:] - offsets[:-1])
        grad = torch.randn(case["batch_size"], case["total_dim"])
        extra = dict(
            offsets=offsets,
            per_sample_weights=case["per_sample_weights"],
            feature_col=case["feature_col"],
            feature_mean=case["feature_mean"],
            batch_size=case["batch_size"],
        )
        rows = case["rows"]
    else:
        caps = [6, 9]
        table_offsets, table_dims, total, row_offsets = layout_of(caps, [8, 8])
        value_table = torch.tensor([1] * 4 + [0] * 7)
        rows = (torch.rand(11) * torch.tensor(caps)[value_table]).long()
        grad = torch.randn(11, 8)
        extra = dict(
            offsets=None,
            per_sample_weights=None,
            feature_col=torch.zeros(0, dtype=torch.int64),
            feature_mean=torch.zeros(0, dtype=torch.bool),
            batch_size=0,
        )
    # Unique (table, row) pairs, as the module's dedup produces them (a -1 row is a unique too).
    uniq, inverse = torch.unique(value_table * 1000 + rows + 1, return_inverse=True)
    unique_table, unique_rows = uniq // 1000, uniq % 1000 - 1
    weights = torch.randn(total)
    num_states = len(ref.OPTIMIZER_STATES[optimizer])
    state_size = sum(caps) if optimizer in ref.ROWWISE_STATE else total
    states = [torch.rand(state_size) for _ in range(num_states)]
    common = dict(
        table_offsets=table_offsets,
        table_dims=table_dims,
        state_row_offsets=row_offsets,
        unique_rows=unique_rows,
        unique_table=unique_table,
        inverse=inverse,
        hparams=(0.05, 1e-8, 0.9, 0.999, 0.01, 0.1) + (FTRL_SETTINGS[0] if optimizer == "ftrl" else ()),
        **extra,
    )
    return grad, weights, states, common


# FTRL's (lr_power, l1, l2, beta): TensorFlow's default power (a square root) with all three


def random_new_vectors(table_dims, counts):
    return [torch.randn(n, int(d)) for n, d in zip(counts, table_dims)]
