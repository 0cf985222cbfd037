"""torchrec_ext.data: the Criteo TSV reader against hand-computed values and the real sample's
published counts; the synthetic ids against exact Zipf probabilities; determinism by seed."""

import math
import os

import numpy as np
import pytest
import torch

from torchrec_ext.data import (
    CriteoTsvReader,
    HeavyTailedIds,
    SyntheticCriteo,
    dlrm_small_batch,
    generator,
    parse_criteo_lines,
    table_key,
)

CRITEO_SAMPLE = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "data", "criteo_kaggle_sample"
)


def tsv_line(label, ints, cats):
    return "\t".join([str(label)] + [str(i) for i in ints] + list(cats)) + "\n"


INTS_A = [5, "", -3, 0, 1, 2, 3, 4, 1000000, "", 7, 8, 9]
CATS_A = ["68fd1e64", ""] + ["0"] * 22 + ["ffffffffffffffff", "7fffffffffffffff"]
INTS_B = [""] * 13
CATS_B = [""] * 25 + ["00000001"]


def test_parse_hand_written_lines():
    batch = parse_criteo_lines([tsv_line(1, INTS_A, CATS_A), tsv_line(0, INTS_B, CATS_B).rstrip("\n") + "\r\n"])
    assert batch.labels.tolist() == [1.0, 0.0]
    expected_a = [
        math.log(6),
        0,
        0,
        0,
        math.log(2),
        math.log(3),
        math.log(4),
        math.log(5),
        math.log(1000001),
        0,
        math.log(8),
        math.log(9),
        math.log(10),
    ]
    torch.testing.assert_close(batch.dense_features, torch.tensor([expected_a, [0.0] * 13]))
    assert batch.dense_features.dtype == torch.float32
    kjt = batch.sparse_features
    assert kjt.keys() == [f"cat_{i}" for i in range(26)]
    assert kjt.stride() == 2
    jts = kjt.to_dict()
    assert jts["cat_0"].values().tolist() == [0x68FD1E64] and jts["cat_0"].lengths().tolist() == [1, 0]
    assert jts["cat_1"].values().tolist() == [] and jts["cat_1"].lengths().tolist() == [0, 0]
    assert jts["cat_24"].values().tolist() == [-1]  # 2^64 - 1 wraps to -1
    assert jts["cat_25"].values().tolist() == [2**63 - 1, 1] and jts["cat_25"].lengths().tolist() == [1, 1]
    assert kjt.values().dtype == torch.int64
    assert kjt.lengths().sum().item() == kjt.values().numel() == 25 + 1


def test_parse_errors_name_the_line():
    with pytest.raises(ValueError, match=r"line 2: expected 40 tab-separated fields"):
        parse_criteo_lines([tsv_line(1, INTS_A, CATS_A), "1\t2\t3\n"])
    bad = CATS_A[:3] + ["xyz"] + CATS_A[4:]
    with pytest.raises(ValueError, match=r"line 1: field 17 \(category 3\) is not valid: 'xyz'"):
        parse_criteo_lines([tsv_line(1, INTS_A, bad)])
    with pytest.raises(ValueError, match=r"must be hex in \[0, 2\^64\)"):
        parse_criteo_lines([tsv_line(1, INTS_A, CATS_A[:-1] + ["1" + "0" * 16])])
    with pytest.raises(ValueError, match=r"integer feature 2"):
        parse_criteo_lines([tsv_line(1, INTS_A[:2] + ["1.5"] + INTS_A[3:], CATS_A)])


def test_parse_without_label_column():
    line = tsv_line(1, INTS_A, CATS_A).split("\t", 1)[1]
    batch = parse_criteo_lines([line], has_label=False)
    assert batch.labels.tolist() == [0.0]
    assert batch.sparse_features["cat_0"].values().tolist() == [0x68FD1E64]


def _write(path, rows):
    with open(path, "w") as f:
        f.writelines(rows)
    return str(path)


def test_reader_batches_span_files_and_drop_last(tmp_path):
    rows = [tsv_line(i % 2, [i] + INTS_A[1:], [f"{i:08x}"] + CATS_A[1:]) for i in range(10)]
    a = _write(tmp_path / "a.tsv", rows[:4] + ["\n"])  # a blank line is skipped
    b = _write(tmp_path / "b.tsv", rows[4:])

    def first_ids(batches):
        return [x for bt in batches for x in bt.sparse_features["cat_0"].values().tolist()]

    batches = list(CriteoTsvReader([a, b], batch_size=3))
    assert [bt.labels.numel() for bt in batches] == [3, 3, 3, 1]
    assert first_ids(batches) == list(range(10))
    torch.testing.assert_close(batches[1].dense_features[:, 0], torch.log1p(torch.tensor([3.0, 4.0, 5.0])))
    assert len(CriteoTsvReader([a, b], batch_size=3)) == 4
    dropped = list(CriteoTsvReader([a, b], batch_size=3, drop_last=True))
    assert [bt.labels.numel() for bt in dropped] == [3, 3, 3]
    # Two ranks: disjoint batches, the same count each, together the first full batches in order.
    r0 = list(CriteoTsvReader([a, b], batch_size=2, drop_last=True, rank=0, world_size=2))
    r1 = list(CriteoTsvReader([a, b], batch_size=2, drop_last=True, rank=1, world_size=2))
    assert len(r0) == len(r1) == 2 == len(CriteoTsvReader([a, b], batch_size=2, drop_last=True, rank=1, world_size=2))
    assert first_ids(r0) == [0, 1, 4, 5] and first_ids(r1) == [2, 3, 6, 7]
    with pytest.raises(ValueError, match="drop_last"):
        CriteoTsvReader([a, b], batch_size=2, world_size=2)
    with pytest.raises(ValueError, match="batch_size"):
        CriteoTsvReader(a, batch_size=0)


def test_reader_error_names_file_and_line(tmp_path):
    good = tsv_line(0, INTS_A, CATS_A)
    path = _write(tmp_path / "bad.tsv", [good, "\n", good, "0\t1\n"])
    with pytest.raises(ValueError, match=r"bad\.tsv:4: expected 40"):
        list(CriteoTsvReader(path, batch_size=8))


@pytest.mark.skipif(not os.path.isdir(CRITEO_SAMPLE), reason="real Criteo sample not present")
def test_real_criteo_sample():
    # Oracle: the sample's README (rows, positives, distinct values per categorical column).
    paths = [os.path.join(CRITEO_SAMPLE, f"{s}.tsv") for s in ("train", "dev", "test")]
    batches = list(CriteoTsvReader(paths, batch_size=1024))
    assert sum(b.labels.numel() for b in batches) == 8000
    assert int(sum(b.labels.sum() for b in batches)) == 1549 + 93 + 86
    distinct = [
        157,
        370,
        4524,
        3369,
        53,
        7,
        2817,
        82,
        3,
        2584,
        1904,
        4337,
        1591,
        22,
        1833,
        3905,
        9,
        1055,
        480,
        3,
        4140,
        7,
        12,
        2152,
        37,
        1635,
    ]
    for j, want in enumerate(distinct):
        ids = torch.cat([b.sparse_features[f"cat_{j}"].values() for b in batches])
        assert torch.unique(ids).numel() == want, f"cat_{j}"
    dense = torch.cat([b.dense_features for b in batches])
    assert dense.shape == (8000, 13) and bool((dense >= 0).all())
    # First row of train.tsv: "0 1 1 5 0 1382 4 15 2 181 1 2 <empty> 2 68fd1e64 ..."
    torch.testing.assert_close(
        batches[0].dense_features[0], torch.log1p(torch.tensor([1.0, 1, 5, 0, 1382, 4, 15, 2, 181, 1, 2, 0, 2]))
    )
    assert batches[0].sparse_features["cat_0"].values()[0].item() == 0x68FD1E64


def test_zipf_matches_exact_probabilities_small_space():
    # All ranks exact (num_ids within the exactly-sampled head): compare with r^-a / sum.
    dist = HeavyTailedIds(alpha=1.05, num_ids=500, id_bits=20)
    ranks = dist.ranks(400_000, generator(1))
    assert int(ranks.min()) >= 1 and int(ranks.max()) <= 500
    pmf = np.arange(1, 501, dtype=np.float64) ** -1.05
    pmf /= pmf.sum()
    freq = torch.bincount(ranks, minlength=501)[1:].double().numpy() / ranks.numel()
    assert np.abs(freq[:20] - pmf[:20]).max() < 4 * np.sqrt(pmf[0] / ranks.numel())
    assert abs(freq[100:].sum() - pmf[100:].sum()) < 0.005


@pytest.mark.parametrize("alpha", [0.8, 1.0, 1.2])
def test_zipf_tail_mass(alpha):
    # num_ids = 10^6 puts most ranks in the continuous tail; the oracle sums r^-a exactly.
    n_ids = 1_000_000
    dist = HeavyTailedIds(alpha=alpha, num_ids=n_ids, id_bits=40)
    ranks = dist.ranks(400_000, generator(2))
    assert int(ranks.min()) >= 1 and int(ranks.max()) <= n_ids
    w = np.arange(1, n_ids + 1, dtype=np.float64) ** -alpha
    w /= w.sum()
    for lo in (1024, 10_000, 100_000, 900_000):
        assert abs(float((ranks > lo).double().mean()) - w[lo:].sum()) < 0.004, lo
    torch.testing.assert_close(
        dist.probability(torch.tensor([1, 2, 1500, 999_999])), torch.tensor(w[[0, 1, 1499, 999_998]]), rtol=1e-6, atol=0
    )


def test_zipf_skew_over_2_40():
    # Default distribution over 2^40: the hottest ids' counts fall as rank^-1.05.
    ids = HeavyTailedIds(key=5).sample(1_000_000, generator(3))
    counts = torch.unique(ids, return_counts=True)[1].sort(descending=True).values.double()
    ratios = counts[:4] / counts[0]
    torch.testing.assert_close(ratios, torch.arange(1, 5, dtype=torch.float64) ** -1.05, rtol=0.06, atol=0)
    assert float(counts[0]) / ids.numel() > 0.05  # P(rank 1) = 1 / sum_r r^-1.05 ~ 0.064
    assert int(ids.min()) >= 0 and int(ids.max()) < 2**40


def test_rank_to_id_is_a_bijection():
    for bits in (1, 7, 12):
        dist = HeavyTailedIds(num_ids=1 << bits, id_bits=bits, key=11)
        ids = dist.ids_of_ranks(torch.arange(1, (1 << bits) + 1))
        assert sorted(ids.tolist()) == list(range(1 << bits))
    ids = HeavyTailedIds(id_bits=64).ids_of_ranks(torch.arange(1, 100_001))
    assert torch.unique(ids).numel() == 100_000 and bool((ids < 0).any())
    wide = HeavyTailedIds().ids_of_ranks(torch.arange(1, 100_001))
    assert int(wide.min()) >= 0 and int(wide.max()) < 2**40 and int(wide.max()) > 2**39  # scattered
    assert not torch.equal(wide, HeavyTailedIds(key=1).ids_of_ranks(torch.arange(1, 100_001)))
    with pytest.raises(ValueError, match="num_ids"):
        HeavyTailedIds(num_ids=1 << 41)
    with pytest.raises(ValueError, match="alpha"):
        HeavyTailedIds(alpha=0)


def test_dlrm_small_batch_shape_and_determinism():
    kjt = dlrm_small_batch(3)
    assert kjt.keys() == [f"f{t}" for t in range(8)] and kjt.stride() == 4096
    lengths = kjt.lengths()
    assert int(lengths.min()) == 1 and int(lengths.max()) == 7
    assert abs(float(lengths.double().mean()) - 4.0) < 0.05
    values = kjt.values()
    assert values.dtype == torch.int64 and values.numel() == int(lengths.sum())
    assert int(values.min()) >= 0 and int(values.max()) < 2**40
    assert torch.equal(values, dlrm_small_batch(3).values()) and torch.equal(lengths, dlrm_small_batch(3).lengths())
    assert not torch.equal(lengths, dlrm_small_batch(4).lengths())
    assert not torch.equal(lengths, dlrm_small_batch(3, seed=1).lengths())
    # Each table its own hot ids: the most frequent id of table t is rank 1 of its stream.
    tops = [int(torch.mode(jt.values()).values) for jt in kjt.to_dict().values()]
    assert tops == [int(HeavyTailedIds(key=table_key(0, t)).ids_of_ranks(torch.tensor([1]))) for t in range(8)]
    assert len(set(tops)) == 8
    small = dlrm_small_batch(0, num_tables=3, batch_size=5, max_bag=2, modulo=1000)
    assert small.keys() == ["f0", "f1", "f2"] and small.lengths().numel() == 15
    assert int(small.values().max()) < 1000
    with pytest.raises(ValueError, match="max_bag"):
        dlrm_small_batch(0, max_bag=0)


def _auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Mann-Whitney AUC with average ranks for ties."""
    order = scores.double().argsort()
    ranks = torch.empty_like(order, dtype=torch.float64)
    ranks[order] = torch.arange(1, scores.numel() + 1, dtype=torch.float64)
    uniq, inverse = torch.unique(scores, return_inverse=True)
    mean_rank = torch.zeros(uniq.numel(), dtype=torch.float64).index_add_(0, inverse, ranks)
    mean_rank /= torch.bincount(inverse, minlength=uniq.numel()).double()
    pos = labels > 0.5
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    return (float(mean_rank[inverse][pos].sum()) - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


def test_synthetic_criteo_shapes_determinism_and_learnable_labels():
    data = SyntheticCriteo(batch_size=4096, num_batches=3, seed=0)
    batches = list(data)
    assert len(batches) == len(data) == 3
    b = batches[0]
    assert b.dense_features.shape == (4096, 13) and b.dense_features.dtype == torch.float32
    assert b.sparse_features.keys() == [f"cat_{i}" for i in range(26)]
    assert b.sparse_features.lengths().tolist() == [1] * (26 * 4096)
    assert b.labels.shape == (4096,) and set(b.labels.unique().tolist()) <= {0.0, 1.0}
    assert bool((b.sparse_features.values() < 0).any())  # raw 64-bit ids
    again = SyntheticCriteo(batch_size=4096, num_batches=3).batch(0)
    assert torch.equal(b.sparse_features.values(), again.sparse_features.values())
    assert torch.equal(b.labels, again.labels)
    assert not torch.equal(b.labels, batches[1].labels)
    assert not torch.equal(b.labels, SyntheticCriteo(batch_size=4096, seed=1).batch(0).labels)
    labels = torch.cat([x.labels for x in batches])
    assert abs(float(labels.mean()) - 0.25) < 0.03
    # The hidden model separates clicks well, and its sparse part is learnable: the click rate per
    # id of an effect feature, counted on two batches, ranks a third batch better than chance.
    logits = torch.cat([data.hidden_logits(x) for x in batches])
    assert _auc(logits, labels) > 0.75
    train_ids = torch.cat([x.sparse_features["cat_2"].values() for x in batches[:2]])
    train_labels = torch.cat([x.labels for x in batches[:2]])
    uniq, inverse = torch.unique(train_ids, return_inverse=True)
    clicks = torch.zeros(uniq.numel()).index_add_(0, inverse, train_labels)
    rate = (clicks + 0.25 * 5) / (torch.bincount(inverse, minlength=uniq.numel()) + 5)
    test_ids = batches[2].sparse_features["cat_2"].values()
    pos = torch.searchsorted(uniq, test_ids).clamp(max=uniq.numel() - 1)
    score = torch.where(uniq[pos] == test_ids, rate[pos], 0.25)
    assert _auc(score, batches[2].labels) > 0.55
    # Ranks get different streams; the same truth_seed keeps the hidden model.
    other = SyntheticCriteo(batch_size=4096, num_batches=3, rank=1, world_size=2)
    assert not torch.equal(other.batch(0).labels, b.labels)
    torch.testing.assert_close(other.hidden_logits(b), data.hidden_logits(b))


def test_synthetic_criteo_workers_split_batches(monkeypatch):
    data = SyntheticCriteo(batch_size=16, num_batches=5, min_bag=0, max_bag=3)
    full = [x.sparse_features.values() for x in data]

    class Info:
        num_workers, id = 2, 1

    monkeypatch.setattr(torch.utils.data, "get_worker_info", lambda: Info)
    second = [x.sparse_features.values() for x in data]
    assert len(second) == 2 and torch.equal(second[0], full[1]) and torch.equal(second[1], full[3])
    assert int(data.batch(0).sparse_features.lengths().min()) == 0
