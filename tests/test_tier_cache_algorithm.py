"""The tier cache's algorithm (issue 16; TorchRec's ``CacheParams.algorithm``): LRU or LFU picks
which cached rows leave first (tier_device_maps.py, tiered_tables.RowCache).

Oracles: a brute-force simulation of each algorithm over the same lookups (its hits and misses
equal the table's counters), and the all-resident module (outputs, rows, optimizer states equal
bit for bit: the algorithm moves rows between the tiers only)."""

import pytest
import torch
from torchrec import KeyedJaggedTensor
from torchrec.distributed.types import CacheAlgorithm, CacheParams

from test_tier_memory import tiered_config
from test_tiers import _assert_same_state, _backing, _bag_configs, _train_staged
from torchrec_ext import DynamicEmbeddingBagCollection, DynamicEmbeddingBagConfig
from torchrec_ext.distributed.tier_plan import planned_cache_algorithm
from torchrec_ext.modules.tiered_tables import TieredTables


@pytest.fixture(params=[True, False], ids=["device_maps", "host_maps"])
def maps(monkeypatch, request):
    monkeypatch.setattr(TieredTables, "device_maps", request.param)
    return request.param


def _simulate(ids: list[int], slots: int, algorithm: str) -> tuple[int, int]:
    """(hits, misses) of a cache of ``slots`` rows over one id a lookup: a miss or a new id
    takes a free slot, else evicts the least recently used (lru) or the fewest looked up, ties
    by least recent use (lfu; counts per id, kept across evictions). A new id is neither."""
    cached: dict[int, int] = {}  # id -> clock of its last lookup
    uses: dict[int, int] = {}
    hits = misses = 0
    for clock, i in enumerate(ids, 1):
        seen = i in uses
        uses[i] = uses.get(i, 0) + 1
        if i in cached:
            hits += 1
        else:
            misses += seen
            if len(cached) == slots:
                key = (lambda j: cached[j]) if algorithm == "lru" else (lambda j: (uses[j], cached[j]))
                del cached[min(cached, key=key)]
        cached[i] = clock
    return hits, misses


def _one_id_lookups(steps: int = 160, distinct: int = 40, seed: int = 0) -> list[int]:
    # Zipf-like: a few hot ids and a tail (one id a lookup: no two slots share a clock, so the
    # victim order has no ties the simulation would have to break the table's way)
    gen = torch.Generator().manual_seed(seed)
    weights = 1.0 / torch.arange(1, distinct + 1, dtype=torch.float64) ** 1.05
    return (torch.multinomial(weights, steps, replacement=True, generator=gen) * 7919 + 11).tolist()


@pytest.mark.parametrize("algorithm", ["lru", "lfu"])
def test_the_victims_match_a_brute_force_simulation_of_the_algorithm(maps, algorithm, device):  # (cpu, cuda: conftest)
    config = DynamicEmbeddingBagConfig(
        name="a",
        embedding_dim=4,
        num_embeddings=256,
        feature_names=["f"],
        backing="host",
        cache_load_factor=0.04,  # 11 slots for 40 ids
        cache_algorithm=algorithm,
    )
    module = DynamicEmbeddingBagCollection(
        [config], optimizer="adagrad", optimizer_kwargs={"lr": 0.1}, device=torch.device(device)
    )
    ids = _one_id_lookups()
    for i in ids:
        kjt = KeyedJaggedTensor.from_lengths_sync(["f"], torch.tensor([i]), torch.tensor([1]))
        module(kjt.to(torch.device(device))).values().sum().backward()
    stats = module.table_stats()["a"]
    assert stats.evictions == 0  # (every id keeps its row: the simulation's ids are the table's rows)
    slots = module._tables.slots[0]
    expected = _simulate(ids, slots, algorithm)
    assert (stats.cache_hits, stats.cache_misses) == expected
    other = _simulate(ids, slots, "lfu" if algorithm == "lru" else "lru")
    assert other != expected  # (the lookups tell the two algorithms apart)


def test_an_lfu_table_after_an_lru_table_counts_its_own_rows(monkeypatch):
    """The device maps count the LFU tables' rows only, each table from its own first count: an
    LFU table after an LRU table (looked up with the same ids) still evicts as the simulation."""
    monkeypatch.setattr(TieredTables, "device_maps", True)
    configs = [tiered_config("x", 300, 0.5, "lru"), tiered_config("a", 256, 0.04, "lfu")]
    module = DynamicEmbeddingBagCollection(configs, optimizer="adagrad", optimizer_kwargs={"lr": 0.1})
    ids = _one_id_lookups()
    for i in ids:
        kjt = KeyedJaggedTensor.from_lengths_sync(["fx", "fa"], torch.tensor([i, i]), torch.tensor([1, 1]))
        module(kjt).values().sum().backward()
    stats = module.table_stats()["a"]
    assert (stats.cache_hits, stats.cache_misses) == _simulate(ids, module._tables.slots[1], "lfu")


@pytest.mark.parametrize("kind", ["host", "file"])
def test_lfu_and_lru_tiered_tables_equal_all_resident_tables_bit_for_bit(tmp_path, maps, kind):
    gen = torch.Generator().manual_seed(5)
    pool = torch.randint(0, 2**40, (400,), generator=gen)
    hot = pool[:30]

    def batch():
        ids = torch.cat(
            [hot[torch.randint(0, 30, (20,), generator=gen)], pool[torch.randint(0, 400, (20,), generator=gen)]]
        )
        lengths = torch.tensor([10, 10, 10, 10])
        return KeyedJaggedTensor.from_lengths_sync(["f0", "f1", "f2", "f3"], ids, lengths)

    batches = [batch() for _ in range(40)]
    make = lambda configs: DynamicEmbeddingBagCollection(configs, optimizer="adam", optimizer_kwargs={"lr": 0.05})
    resident = make(_bag_configs())
    tiered = {}
    for algorithm in ("lru", "lfu"):
        configs = _bag_configs(_backing(kind, tmp_path / algorithm), 0.2)
        (tmp_path / algorithm).mkdir()
        for config in configs:
            config.cache_algorithm = algorithm
        tiered[algorithm] = make(configs)
    lfu_resident = make(_bag_configs())
    _train_staged(resident, tiered["lru"], batches[:20])
    _train_staged(lfu_resident, tiered["lfu"], batches[:20])
    for step, kjt in enumerate(batches[20:]):  # unstaged too: misses filled in the lookup
        outs = [m(kjt).values() for m in (resident, tiered["lru"], lfu_resident, tiered["lfu"])]
        assert torch.equal(outs[0], outs[1]) and torch.equal(outs[2], outs[3]), step
        for out in outs:
            out.square().sum().backward()
    _assert_same_state(resident, tiered["lru"])
    _assert_same_state(lfu_resident, tiered["lfu"])
    for algorithm, module in tiered.items():  # (the caches evicted and read rows back)
        stats = module.table_stats().values()
        assert sum(s.cache_misses + s.cache_staged for s in stats) > 0, algorithm
        assert sum(s.cache_write_backs for s in stats) > 0, algorithm


def test_cache_algorithm_is_checked_and_taken_from_torchrecs_cache_params():
    make = lambda **kw: DynamicEmbeddingBagConfig(
        name="t", embedding_dim=4, num_embeddings=64, feature_names=["f"], **kw
    )
    assert make(backing="host", cache_algorithm=CacheAlgorithm.LFU).cache_algorithm == "lfu"
    assert make(backing="host", cache_algorithm="LRU").cache_algorithm == "lru"
    with pytest.raises(ValueError, match=r'cache_algorithm must be "lru" or "lfu".*got \'arc\''):
        make(backing="host", cache_algorithm="arc")
    with pytest.raises(ValueError, match=r'cache_algorithm applies to backing="host"'):
        make(cache_algorithm="lfu")
    tiered, device = make(backing="host"), make()
    lfu = CacheParams(algorithm=CacheAlgorithm.LFU)
    assert planned_cache_algorithm(tiered, lfu, "t") == "lfu"
    assert planned_cache_algorithm(tiered, None, "t", "lfu") == "lfu"  # the sharder's fused_params
    assert planned_cache_algorithm(tiered, CacheParams(load_factor=0.5), "t") is None  # LRU
    assert planned_cache_algorithm(make(backing="host", cache_algorithm="lfu"), None, "t", "lru") == "lfu"
    with pytest.raises(
        ValueError, match=r"cache_params.algorithm='lfu'.*differs from the config's cache_algorithm='lru'"
    ):
        planned_cache_algorithm(make(backing="host", cache_algorithm="lru"), lfu, "t")
    with pytest.raises(ValueError, match=r'cache_params.algorithm=\'lfu\' applies to tables with backing="host"'):
        planned_cache_algorithm(device, lfu, "t")


@pytest.mark.parametrize("given", ["plan", "fused_params", "config", "none"])
def test_a_sharded_table_caches_with_the_plans_or_the_sharders_algorithm(one_rank_group, given):
    import torch.distributed as dist
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
    from torchrec.distributed.types import ShardingEnv

    from torchrec_ext.distributed import DynamicEmbeddingBagCollectionSharder

    config = DynamicEmbeddingBagConfig(
        name="t",
        embedding_dim=4,
        num_embeddings=64,
        feature_names=["f"],
        backing="host",
        cache_algorithm="lfu" if given == "config" else None,
    )
    module = DynamicEmbeddingBagCollection([config], optimizer="adagrad", optimizer_kwargs={"lr": 0.1})
    sharder = DynamicEmbeddingBagCollectionSharder(
        fused_params={"cache_algorithm": CacheAlgorithm.LFU} if given == "fused_params" else None
    )
    plan = construct_module_sharding_plan(
        module,
        per_param_sharding={"t": table_wise(rank=0)},
        sharder=sharder,
        world_size=1,
        local_size=1,
        device_type="cpu",
    )
    if given == "plan":
        plan["t"].cache_params = CacheParams(algorithm=CacheAlgorithm.LFU)
    sharded = sharder.shard(module, plan, ShardingEnv.from_process_group(dist.group.WORLD), torch.device("cpu"))
    tables = {
        id(m._tables): m._tables for m in sharded.modules() if isinstance(getattr(m, "_tables", None), TieredTables)
    }
    assert [t.cache_algorithms for t in tables.values()] == [["lru" if given == "none" else "lfu"]]
    assert [c.lfu for t in tables.values() for c in t.caches] == [given != "none"]


def test_an_lfu_cache_counts_its_lookups_per_row_in_its_bytes_and_the_plans(maps):
    from torchrec_ext.distributed.planner import tiered_table_bytes

    make = lambda algorithm: DynamicEmbeddingBagCollection(
        [
            DynamicEmbeddingBagConfig(
                name="t",
                embedding_dim=4,
                num_embeddings=1000,
                feature_names=["f"],
                backing="host",
                cache_algorithm=algorithm,
            )
        ],
        optimizer="adagrad",
    )
    built = {a: make(a)._tables.storage_bytes() for a in ("lru", "lfu")}
    # (the device maps' spare count and the table's first count, uses_base)
    assert built["lfu"] - built["lru"] == 4 * 1000 + (4 + 8 if maps else 0)
    planned = {
        a: tiered_table_bytes(1000, 4, "adagrad", 0.2, file=False, cache_algorithm=a).host for a in ("lru", "lfu")
    }
    assert planned["lfu"] - planned["lru"] == 4 * 1000
