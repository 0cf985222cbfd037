"""Admission strategies (issue 18): the counting Bloom filter and probabilistic admission against
pure-Python models written from the spec (exact admission sequences over a stream with decay,
false-positive rate at design load, admitted fraction, sharding invariance on 2 gloo ranks),
checkpoints of the filter (round trip, resize, sharded), and bad input."""

import math

import pytest
import torch
from torchrec import KeyedJaggedTensor

from dist_helpers import ModelWith, dmp_of, run_ranks
from torchrec_ext import DynamicEmbeddingBagCollection, DynamicEmbeddingBagConfig
from torchrec_ext.modules import admission as adm
from torchrec_ext.reference import _fmix64, table_seed

MASK = (1 << 64) - 1


# ---------------------------------------------------------------------------- models from the spec


class PyCountingBloom:
    """A counting Bloom filter with m 4-bit saturating counters, k cells per id by double hashing
    of fmix64(id ^ seed ^ salt), halved every ``decay`` steps; all sightings of a batch are
    added before any id is decided."""

    def __init__(self, m, k, seed, admit_after, decay=None):
        self.c, self.m, self.k, self.seed, self.t, self.decay = [0] * m, m, k, seed, admit_after, decay

    def cells(self, key):
        h = _fmix64((key & MASK) ^ ((self.seed ^ adm.BLOOM_SALT) & MASK))
        h1, h2 = h & 0xFFFFFFFF, (h >> 32) | 1
        return [((h1 + i * h2) & MASK) % self.m for i in range(self.k)]

    def batch(self, counts, step):
        """counts: {unseen id: sightings in this batch}; returns the admitted ids."""
        if self.decay is not None and step % self.decay == 0:
            self.c = [v // 2 for v in self.c]
        for key, n in counts.items():
            for cell in self.cells(key):
                self.c[cell] = min(15, self.c[cell] + n)
        return {key for key in counts if min(self.c[cell] for cell in self.cells(key)) >= self.t}


def py_probabilistic(key, seed, p):
    h = _fmix64(_fmix64((key & MASK) ^ ((seed ^ adm.PROBABILITY_SALT) & MASK)))
    return (h >> 11) < int(p * 2**53)


def _kjt(ids, batch):
    return KeyedJaggedTensor.from_lengths_sync(
        ["f"], torch.tensor(ids, dtype=torch.int64), torch.full((batch,), len(ids) // batch, dtype=torch.int64)
    )


def _module(capacity=4096, **admission):
    cfg = DynamicEmbeddingBagConfig(
        name="t", embedding_dim=4, num_embeddings=capacity, feature_names=["f"], **admission
    )
    return DynamicEmbeddingBagCollection([cfg], optimizer="sgd", optimizer_kwargs={"lr": 0.1})


def _ids_with_rows(module):
    return set(module.state_dict()["embedding_bags.t.weight_id"].tolist())


# ---------------------------------------------------------------------------- bloom


def test_bloom_admits_exactly_as_the_python_model_over_a_stream_with_decay():
    gen = torch.Generator().manual_seed(3)
    module = _module(admission="bloom", admit_after=3, bloom_bytes=64, bloom_expected_ids=40, bloom_decay_steps=4)
    strategy = module._tables.admission[0]
    model = PyCountingBloom(strategy.geometry.counters, strategy.geometry.hashes, table_seed(0, "t"), 3, decay=4)
    rows, admitted_per_step = set(), []
    for step in range(1, 25):
        ids = (torch.randint(0, 60, (48,), generator=gen) * 7919 - 2**40).tolist()  # heavy repeats, big ids
        counts = {}
        for i in ids:
            counts[i] = counts.get(i, 0) + 1
        unseen = {k: n for k, n in counts.items() if k not in rows}
        admitted = model.batch(unseen, step)
        rows |= admitted
        admitted_per_step.append(len(admitted))
        module(_kjt(ids, 12)).values().sum().backward()
        assert _ids_with_rows(module) == rows, f"step {step}"
        assert adm.unpack_counters(strategy.packed).tolist() == model.c, f"step {step}"
    assert sum(admitted_per_step) > 20 and rows != set()  # the stream exercised admission
    assert module.table_stats()["t"].admission_rejections > 0


def test_bloom_false_positive_rate_at_design_load_matches_its_target():
    n = 20_000
    geometry = adm.bloom_geometry(n, None, 0.01, "test")
    assert geometry.fpr <= 0.01
    bloom = adm.BloomAdmission(2, geometry, None, 11, torch.device("cpu"))
    inserted = torch.randint(0, 1 << 40, (n + 100,), generator=torch.Generator().manual_seed(0)).unique()[:n] * 2
    assert inserted.numel() == n  # distinct even ids
    bloom.admit(inserted, torch.ones_like(inserted), torch.ones_like(inserted, dtype=torch.bool), 1)
    counters = bloom.counters()
    assert bool((counters[adm.bloom_cells(inserted, 11, geometry)] >= 1).all())  # no false negative
    queries = torch.arange(200_000, dtype=torch.int64) * 2 + 1  # odd ids: never inserted
    positive = (counters[adm.bloom_cells(queries, 11, geometry)] >= 1).all(1).double().mean().item()
    assert abs(positive - geometry.fpr) < 0.1 * geometry.fpr, (positive, geometry.fpr)
    # A filter sized from its budget reaches the rate its geometry states, at the load it was made for.
    budget = adm.bloom_geometry(n, 128 * 1024, None, "test")
    assert budget.nbytes == 128 * 1024 and budget.fpr < 0.01


def test_bloom_sizing_states_its_bytes_and_refuses_a_budget_too_small_for_the_rate():
    g = adm.bloom_geometry(1000, None, 0.01, "t")
    assert g.counters & (g.counters - 1) == 0 and g.nbytes == g.counters // 2 and g.fpr <= 0.01
    with pytest.raises(
        ValueError,
        match=r"bloom_bytes=100 is too small for bloom_fpr=0.01 at bloom_expected_ids=1000"
        r".*needs bloom_bytes >= 8192",
    ):
        DynamicEmbeddingBagConfig(
            name="t",
            embedding_dim=4,
            num_embeddings=1000,
            admission="bloom",
            admit_after=2,
            bloom_bytes=100,
            bloom_fpr=0.01,
        )


@pytest.mark.parametrize(
    "fields, message",
    [
        (
            dict(admission="bloomy"),
            r"admission must be one of \['counter', 'bloom', 'probabilistic'\] or None, got 'bloomy'",
        ),
        (dict(admission="probabilistic", admit_probability=0.0), r"admit_probability in \(0, 1\], got 0.0"),
        (dict(admission="probabilistic", admit_probability=1.5), r"admit_probability in \(0, 1\], got 1.5"),
        (dict(admission="probabilistic"), r"admit_probability in \(0, 1\], got None"),
        (
            dict(admission="bloom", admit_after=2, bloom_decay_steps=0),
            r"bloom_decay_steps must be an int >= 1 or None, got 0",
        ),
        (dict(admission="bloom", admit_after=16), r"admit_after must be <= 15, got 16"),
        (
            dict(admission="bloom", admit_after=2, bloom_fpr=1.0),
            r"bloom_fpr must be a number in \(0, 1\) or None, got 1.0",
        ),
        (dict(admission="counter"), r"needs admit_after >= 2 .*got 1"),
        (dict(admit_after=3, bloom_bytes=64), r"bloom_bytes apply to admission='bloom', got admission='counter'"),
        (dict(admit_probability=0.5), r"admit_probability applies to admission='probabilistic', got admission=None"),
    ],
)
def test_bad_admission_settings_are_refused_naming_the_value(fields, message):
    with pytest.raises(ValueError, match=message):
        DynamicEmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=64, **fields)


def test_bloom_state_round_trips_and_loads_into_another_size_without_losing_sightings():
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 500, (64,), generator=gen).tolist() for _ in range(8)]
    a = _module(admission="bloom", admit_after=3, bloom_bytes=1024, bloom_expected_ids=500)
    for ids in batches[:4]:
        a(_kjt(ids, 16)).values().sum().backward()
    state = a.state_dict()
    assert state["embedding_bags.t.admission_bloom"].shape == (1, 1024)
    b = _module(admission="bloom", admit_after=3, bloom_bytes=1024, bloom_expected_ids=500)
    b.load_state_dict(state)
    for ids in batches[4:]:  # the same filter: the same admissions from here on
        for m in (a, b):
            m(_kjt(ids, 16)).values().sum().backward()
        assert _ids_with_rows(a) == _ids_with_rows(b)
    assert torch.equal(a._tables.admission[0].packed, b._tables.admission[0].packed)
    # Folded into a filter of a quarter the size, or tiled into one of twice, with the same
    # hashes (as a reshard's shards): every id's estimate stays >= what the saved filter counted.
    saved = a._tables.admission[0]
    seen = torch.tensor(sorted({i for ids in batches for i in ids}), dtype=torch.int64)
    before = saved.counters()[adm.bloom_cells(seen, saved.seed, saved.geometry)].amin(1)
    for nbytes in (256, 2048):
        c = _module(
            admission="bloom",
            admit_after=3,
            bloom_bytes=nbytes,
            bloom_expected_ids=500,
            bloom_hashes=saved.geometry.hashes,
        )
        c.load_state_dict(a.state_dict())
        loaded = c._tables.admission[0]
        after = loaded.counters()[adm.bloom_cells(seen, loaded.seed, loaded.geometry)].amin(1)
        assert bool((after >= before).all())
    with pytest.raises(ValueError, match=r"admission_bloom must be \[filters, bytes\] with a power-of-two byte count"):
        b.load_state_dict(dict(state, **{"embedding_bags.t.admission_bloom": torch.zeros(1, 1000, dtype=torch.uint8)}))
    assert _ids_with_rows(b) == _ids_with_rows(a)  # nothing changed


def test_planner_and_storage_bytes_count_each_strategy():
    from torchrec_ext.distributed.planner import dynamic_table_bytes

    base = dynamic_table_bytes(4096, 4, "sgd")
    for fields in (
        dict(admission="bloom", admit_after=2, bloom_fpr=0.01),
        dict(admit_after=2),
        dict(admission="probabilistic", admit_probability=0.3),
    ):
        module = _module(**fields)
        cfg = module.embedding_bag_configs()[0]
        planned = dynamic_table_bytes(4096, 4, "sgd", admission=cfg)
        assert module.storage_bytes() == planned
        extra = planned - base
        if fields.get("admission") == "bloom":
            assert extra == module._tables.admission[0].geometry.nbytes == 32768  # 4096 ids at 1%: 2^16 counters
        elif fields.get("admission") == "probabilistic":
            assert extra == 0
        else:
            # its side table: 17 B per slot and per stash entry (32 at 4096 rows), 1 B per bucket; 8 B counts
            assert extra == 4096 * (17 + 8) + 32 * 17 + 4096 // 32


# ---------------------------------------------------------------------------- probabilistic


def test_probabilistic_admission_is_the_hash_rule_and_admits_about_p():
    p = 0.3
    module = _module(capacity=1 << 17, admission="probabilistic", admit_probability=p, seed=5)
    ids = torch.arange(60_000, dtype=torch.int64) * 1_000_003 - 2**50
    for chunk in ids.split(6000):
        module(_kjt(chunk.tolist(), 1000)).values().sum().backward()
    seed = table_seed(5, "t")
    want = {i for i in ids.tolist() if py_probabilistic(i, seed, p)}
    assert _ids_with_rows(module) == want
    assert abs(len(want) / ids.numel() - p) < 0.01
    # Deterministic whatever the order: the same ids admitted from reversed batches.
    other = _module(capacity=1 << 17, admission="probabilistic", admit_probability=p, seed=5)
    for chunk in ids.flip(0).split(6000):
        other(_kjt(chunk.tolist(), 1000)).values().sum().backward()
    assert _ids_with_rows(other) == want
    stats = module.table_stats()["t"]
    assert stats.admission_rejections == ids.numel() - len(want) and stats.inserts == len(want)


def _row_wise_dmp(module, world_size):
    """``module`` (its one table ``t`` row-wise on every rank) under DMP."""
    from torchrec.distributed.sharding_plan import row_wise

    from torchrec_ext.distributed import DynamicEmbeddingBagCollectionSharder

    generators = {"t": row_wise(compute_kernel="customized_kernel")}
    return dmp_of(ModelWith("ebc", module), "ebc", generators, DynamicEmbeddingBagCollectionSharder(), world_size)


def _sharded_probabilistic(rank, world_size, out):
    import torch.distributed as dist

    from torchrec_ext.distributed.table_stats import reduce_table_stats

    dmp = _row_wise_dmp(_module(capacity=1 << 14, admission="probabilistic", admit_probability=0.4, seed=2), world_size)
    for step in range(4):
        ids = (torch.arange(1000) + 1000 * (2 * step + rank)) * 7 - 3000
        dmp(_kjt(ids.tolist(), 100)).values().sum().backward()
    local = dmp.module.ebc.local_module
    mine = local.state_dict()["embedding_bags.t.weight_id"].tolist()
    everyone = [None] * world_size
    dist.all_gather_object(everyone, mine)
    stats = reduce_table_stats(dmp.module.ebc.table_stats())
    if rank == 0:
        torch.save({"ids": sorted(i for part in everyone for i in part), "stats": stats["t"].as_dict()}, out)


def test_probabilistic_admission_is_sharding_invariant_on_two_ranks(tmp_path):
    out = str(tmp_path / "ids.pt")
    run_ranks(_sharded_probabilistic, 2, out)
    got = torch.load(out)
    unsharded = _module(capacity=1 << 14, admission="probabilistic", admit_probability=0.4, seed=2)
    for step in range(4):
        for rank in range(2):
            ids = (torch.arange(1000) + 1000 * (2 * step + rank)) * 7 - 3000
            unsharded(_kjt(ids.tolist(), 100)).values().sum().backward()
    assert got["ids"] == sorted(_ids_with_rows(unsharded))
    want = unsharded.table_stats()["t"]
    assert got["stats"]["inserts"] == want.inserts and got["stats"]["admission_rejections"] == want.admission_rejections
    assert got["stats"]["lookups"] == want.lookups == 8000 and got["stats"]["live_rows"] == want.live_rows


# ---------------------------------------------------------------------------- sharded bloom checkpoints


def _sharded_bloom(rank, world_size, out):
    from torchrec_ext.distributed import full_state_dict

    def build():
        module = _module(capacity=2048, admission="bloom", admit_after=2, bloom_bytes=2048, bloom_expected_ids=1000)
        return _row_wise_dmp(module, world_size)

    dmp = build()
    gen = torch.Generator().manual_seed(rank)
    for _ in range(3):
        dmp(_kjt(torch.randint(0, 800, (200,), generator=gen).tolist(), 50)).values().sum().backward()
    state = full_state_dict(dmp.state_dict())
    filters = state["ebc.embedding_bags.t.admission_bloom"]
    assert filters.shape == (2, 1024)  # one filter per rank, each half the budget
    own = dmp.module.ebc.local_module._tables.admission[0].packed
    assert torch.equal(filters[rank], own)
    again = build()  # the same layout: each rank takes its own filter back
    again.load_state_dict(state)
    assert torch.equal(again.module.ebc.local_module._tables.admission[0].packed, own)
    if rank == 0:
        torch.save({k[len("ebc.") :]: v for k, v in state.items()}, out)


def test_sharded_bloom_filters_save_per_rank_and_load_unsharded_as_their_sum(tmp_path):
    out = str(tmp_path / "state.pt")
    run_ranks(_sharded_bloom, 2, out)
    state = torch.load(out)
    one = _module(capacity=2048, admission="bloom", admit_after=2, bloom_bytes=2048, bloom_expected_ids=1000)
    one.load_state_dict(state)
    filters = state["embedding_bags.t.admission_bloom"]
    loaded = one._tables.admission[0]
    # Each rank's filter tiled to the whole size, then summed: every id each rank counted is kept.
    local = adm.BloomAdmission(
        2, adm.BloomGeometry(2048, loaded.geometry.hashes, 500), None, loaded.seed, torch.device("cpu")
    )
    ids = torch.arange(800, dtype=torch.int64)
    for f in filters:
        local.packed.copy_(f)
        shard = local.counters()[adm.bloom_cells(ids, loaded.seed, local.geometry)].amin(1)
        whole = loaded.counters()[adm.bloom_cells(ids, loaded.seed, loaded.geometry)].amin(1)
        assert bool((whole >= shard).all()) and bool((shard > 0).any())
    summed = adm.resize_counters(adm.unpack_counters(filters), loaded.geometry.counters).to(torch.int64).sum(0)
    assert torch.equal(loaded.counters(), summed.clamp(max=15).to(torch.uint8))


def test_counter_admission_is_the_default_with_admit_after():
    module = _module(admit_after=2)
    assert isinstance(module._tables.admission[0], adm.CounterAdmission)
    module(_kjt([1, 2, 2, 3], 2)).values().sum().backward()
    assert _ids_with_rows(module) == {2}
    assert math.isclose(module.table_stats()["t"].hit_rate, 0.0)


@pytest.mark.parametrize("parts", [2, 3, 5, 6])
def test_row_wise_shard_filters_keep_the_tables_false_positive_rate(parts):
    """Each shard's filter holds its share of the ids at the table's false-positive target, for
    any world size (not only powers of two): the independent formula (1 - e^(-k n / m))^k."""
    import math

    from torchrec_ext.modules.admission import bloom_geometry, local_bloom_geometry

    for expected in (1709, 100_000):
        opts = DynamicEmbeddingBagConfig(
            name="t",
            embedding_dim=4,
            num_embeddings=expected,
            feature_names=["f"],
            admission="bloom",
            admit_after=2,
            bloom_fpr=0.01,
        )
        whole = bloom_geometry(expected, None, 0.01, "t", None)
        local = local_bloom_geometry(opts, expected, parts)
        n, m, k = local.expected_ids, local.counters, local.hashes
        assert n == -(-expected // parts) and k == whole.hashes
        assert (1 - math.exp(-k * n / m)) ** k <= 0.01
