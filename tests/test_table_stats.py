"""module.table_stats() (issue 18 item 4) against counted truth: a stream replayed on the
reference hash table (reference.py's dict model of the index), with the admission rule and
evicted rows' ages counted independently."""

import torch
from torchrec import KeyedJaggedTensor

from test_admission import py_probabilistic
from torchrec_ext import DynamicEmbeddingBagCollection, DynamicEmbeddingBagConfig
from torchrec_ext.reference import ReferenceHashTable, dedup_ids, table_seed


def _replay(policy, capacity, p, steps=30, ttl=None):
    cfg = DynamicEmbeddingBagConfig(
        name="t",
        embedding_dim=4,
        num_embeddings=capacity,
        feature_names=["f"],
        eviction_policy=policy,
        ttl_steps=ttl,
        **({} if p is None else dict(admission="probabilistic", admit_probability=p)),
    )
    module = DynamicEmbeddingBagCollection([cfg], optimizer="sgd", optimizer_kwargs={"lr": 0.1})
    ref, seed = ReferenceHashTable(capacity, policy), table_seed(0, "t")
    truth = dict(lookups=0, hits=0, inserts=0, evictions=0, admission_rejections=0, refused=0)
    last_read, ages = {}, []
    gen = torch.Generator().manual_seed(7)
    for step in range(1, steps + 1):
        ids = torch.randint(0, 300, (60,), generator=gen) * 1_000_000_007 - 2**45
        module(KeyedJaggedTensor.from_lengths_sync(["f"], ids, torch.full((20,), 3))).values().sum().backward()
        unique, _, counts = dedup_ids(ids)
        keys, counts = unique.tolist(), counts.tolist()
        _, found = ref.find(keys)
        truth["lookups"] += sum(counts)
        truth["hits"] += sum(c for c, f in zip(counts, found) if f)
        admitted = [k for k, f in zip(keys, found) if f or p is None or py_probabilistic(k, seed, p)]
        truth["admission_rejections"] += len(keys) - len(admitted)
        rows, inserted, evicted, _ = ref.upsert(admitted)
        truth["inserts"] += sum(inserted)
        truth["evictions"] += len(evicted)
        truth["refused"] += sum(r == -1 for r in rows)
        ages += [step - last_read[k] for k in evicted]
        last_read.update((k, step) for k, r in zip(admitted, rows) if r >= 0)
    stats = module.table_stats()["t"]
    for key, want in truth.items():
        assert getattr(stats, key) == want, (key, getattr(stats, key), want)
    assert stats.live_rows == ref.size() and stats.capacity == capacity
    return stats, truth, ages


def test_counters_match_the_reference_table_with_evictions():
    stats, truth, _ = _replay("lru", 64, None)
    assert truth["evictions"] > 100 and truth["hits"] > 0  # the stream churned
    assert abs(stats.hit_rate - truth["hits"] / truth["lookups"]) < 1e-12 and stats.load_factor == 1.0


def test_counters_match_with_admission_and_a_full_table_refusing():
    stats, truth, _ = _replay("none", 64, 0.6)
    assert truth["admission_rejections"] > 0 and truth["refused"] > 0 and truth["evictions"] == 0


def test_evicted_row_ages_match_the_steps_since_last_read():
    stats, _, ages = _replay("lru", 64, None, ttl=1000)  # ttl keeps last_seen (and never expires here)
    want = [0] * len(stats.evicted_ages)
    for a in ages:
        want[min(a, len(want) - 1)] += 1
    assert stats.evicted_ages == want and sum(want) > 100
    ordered = sorted(ages)
    assert stats.evicted_age_p50 == ordered[(len(ordered) + 1) // 2 - 1]
    assert abs(stats.evicted_age_mean - sum(ages) / len(ages)) < 1e-9


def test_table_stats_of_an_untrained_or_eval_module_count_nothing():
    cfg = DynamicEmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=64, feature_names=["f"])
    module = DynamicEmbeddingBagCollection([cfg], optimizer="sgd", optimizer_kwargs={"lr": 0.1}).eval()
    module(KeyedJaggedTensor.from_lengths_sync(["f"], torch.arange(6), torch.full((2,), 3)))
    stats = module.table_stats()["t"]
    assert (stats.lookups, stats.inserts, stats.live_rows, stats.hit_rate) == (0, 0, 0, None)


def test_evicted_ages_keep_counting_after_a_pickle_round_trip():
    """The age histograms are views of one flat tensor (counted by one op for all tables); plain
    pickle copies each view's storage apart, so an unpickled module must lay them out again, or
    its ages stop counting (while torch.save and deepcopy keep the views)."""
    import copy
    import pickle

    cfgs = [
        DynamicEmbeddingBagConfig(
            name=n, embedding_dim=4, num_embeddings=64, feature_names=[n], eviction_policy="lru", ttl_steps=ttl
        )
        for n, ttl in (("a", 1000), ("b", None), ("c", 3))
    ]
    module = DynamicEmbeddingBagCollection(cfgs, optimizer="sgd", optimizer_kwargs={"lr": 0.1})

    def train(m, steps):
        for s in steps:
            ids = torch.randint(0, 300, (180,), generator=torch.Generator().manual_seed(s))
            m(KeyedJaggedTensor.from_lengths_sync(["a", "b", "c"], ids, torch.full((60,), 3))).values().sum().backward()

    train(module, range(3))
    unpickled, copied = pickle.loads(pickle.dumps(module)), copy.deepcopy(module)
    train(unpickled, range(3, 8))
    train(copied, range(3, 8))
    want, got = copied.table_stats(), unpickled.table_stats()
    assert sum(want["a"].evicted_ages) > sum(module.table_stats()["a"].evicted_ages)  # ages were counted
    for name in "abc":
        assert got[name].evicted_ages == want[name].evicted_ages, name
