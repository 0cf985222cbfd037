"""The planner and tiered tables (backing="host" / "file:<dir>", issue 16): each shard's storage
against a module holding that share (its storage_bytes() and backing_bytes(), its log's record
size), the load factor from constraints and configs, the factor the planner chooses against a
brute force over every candidate factor planned as a constraint, and the errors. Plans on a real
Topology with TorchRec's planner (plan() needs no process group); the sharded shares' caches are
checked on 2 gloo ranks in test_tiers_sharded.py."""

import math
import os

import pytest
import torch
from torch import nn
from torchrec import DataType
from torchrec.distributed.planner import ParameterConstraints, Topology
from torchrec.distributed.planner.types import PlannerError, Storage
from torchrec.distributed.types import CacheParams

from test_planner import BATCH, _enumerate, _expected_io, _expected_resident, _sharders
from torchrec_ext import DynamicEmbeddingBagCollection, DynamicEmbeddingBagConfig
from torchrec_ext.distributed.planner import DynamicEmbeddingStorageEstimator, make_planner
from torchrec_ext.modules.tiered_tables import TieredTables

META = torch.device("meta")
# per slot: the LRU queue holds at most 2 int32 entries a slot before it is rebuilt, plus what its
# views keep of a rebuild's tensor and of a chunk partly taken (at most 4 bytes a slot each)
LRU_BOUND = 16
LOG_BUFFER_ROWS = 1 << 15  # a file-backed table's write-back records buffers (two): at most 2 * slots each
TRANSFER_ROWS = 1 << 15  # records of one transfer between a CUDA cache and the host


def _tiered(name, capacity, dim, backing, factor=None, **fields):
    return DynamicEmbeddingBagConfig(
        name=name,
        embedding_dim=dim,
        num_embeddings=capacity,
        feature_names=[f"f_{name}"],
        backing=backing,
        cache_load_factor=factor,
        **fields,
    )


CASES = [  # name, capacity, dim, extra fields
    ("a", 1000, 16, {}),
    ("b", 777, 6, {"ttl_steps": 5, "admit_after": 2}),
    ("c", 513, 10, {"data_type": DataType.FP16, "eviction_policy": "lfu"}),
]


def _share_oracle(tmp_path, kind, name, capacity, dim, fields, parts, factor, optimizer, cuda=False):
    """(device, host, disk) bytes of a module holding one share, built for real (on the CPU: its
    maps, on the host in any case, are told from the rest by its caches' and logs' own counts),
    plus the documented bounds of what it makes as rows move: its LRU queue, and the records
    buffers (a CUDA cache: the pinned host buffer of transfers, the packed reads' and a transfer's
    records on the device; a CPU cache over a file: the write-back buffer)."""
    backing = "host" if kind == "host" else f"file:{tmp_path}/{name}{parts}"
    if kind == "file":
        os.makedirs(backing[5:], exist_ok=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(TieredTables, "device_maps", cuda)  # a CUDA cache's default: its maps on the device
        patch.setattr(TieredTables, "copy_through_records", cuda)  # (its rows through records, as on a GPU)
        share = DynamicEmbeddingBagCollection(
            [_tiered("x", math.ceil(capacity / parts), dim, backing, factor, **fields)],
            optimizer=optimizer,
            optimizer_kwargs={"lr": 0.1},
        )
        tables = share._tables
        mover = tables._mover(0)  # its record: the row's number, vector and states, as the module lays them out
    cache = tables.caches[0]
    log_maps = mover.log.nbytes() if kind == "file" else 0
    if cuda:  # the maps on the device, but for their free stack's mirror
        maps_on_host = tables._maps.free_host.untyped_storage().nbytes()
        host = maps_on_host + log_maps
    else:
        assert cache.order.nbytes() == 0  # (the queue starts empty)
        maps_on_host = cache.nbytes()
        host = maps_on_host + LRU_BOUND * cache.slots + log_maps
    device = share.storage_bytes() - maps_on_host - log_maps
    if cuda:
        host += min(2 * cache.slots, TRANSFER_ROWS) * mover.record_bytes
        device += min(cache.slots, TRANSFER_ROWS) * mover.record_bytes
        packed = mover.copies.packed  # the buffer of all tables' packed reads: its bound, this table's share
        host += packed.max_rows * packed.record_bytes
        assert packed.max_rows * packed.record_bytes == min(cache.slots, TRANSFER_ROWS) * mover.record_bytes
    elif kind == "file":  # (two: reads' and write-backs', and the stage's deferred write-backs')
        host += 2 * min(2 * cache.slots, LOG_BUFFER_ROWS) * mover.record_bytes
    if kind == "host":
        return device, host + tables.backing_bytes(), 0
    return device, host, tables.backing_bytes() + mover.log.records.shape[0] * mover.record_bytes


@pytest.mark.parametrize("kind", ["host", "file"])
@pytest.mark.parametrize("world", [1, 2])
def test_tiered_storage_matches_a_module_holding_the_share(tmp_path, kind, world):
    """Without IO buffers (is_inference): the cache, index and metadata on the compute device (ddr
    on CPU, hbm on CUDA), the cache's maps and buffers and host backing's store in ddr, file
    backing's on disk (ssd)."""
    backing = "host" if kind == "host" else f"file:{tmp_path}"
    configs = [_tiered(n, cap, dim, backing, **f) for n, cap, dim, f in CASES]
    optimizer = "adagrad"
    ebc = DynamicEmbeddingBagCollection(configs, device=META, optimizer=optimizer, optimizer_kwargs={"lr": 0.1})
    factors = {"a": 0.3, "b": 0.05, "c": 1.0}
    constraints = {n: ParameterConstraints(cache_params=CacheParams(load_factor=f)) for n, f in factors.items()}
    for device in ("cpu", "cuda"):
        topology = Topology(world_size=world, compute_device=device)
        estimator = DynamicEmbeddingStorageEstimator(topology, constraints, is_inference=True)
        options = _enumerate(ebc, world, device=device, constraints=constraints, estimators=[estimator])
        assert {o.name for o in options} == set(factors)
        for o in options:
            name, cap, dim, fields = next(c for c in CASES if c[0] == o.name)
            parts = world if o.sharding_type == "row_wise" else 1
            cuda = device == "cuda"
            on_device, host, disk = _share_oracle(
                tmp_path, kind, name, cap, dim, fields, parts, factors[name], optimizer, cuda
            )
            want = (
                Storage(hbm=on_device, ddr=host, ssd=disk) if cuda else Storage(hbm=0, ddr=on_device + host, ssd=disk)
            )
            assert all(s.storage == want for s in o.shards), (device, o.name, o.sharding_type)
            assert o.cache_params.load_factor == factors[name]  # what the plan will carry


def test_the_load_factor_of_the_constraint_or_the_config_and_bad_ones():
    def options(configs, constraints):
        ebc = DynamicEmbeddingBagCollection(configs, device=META, optimizer="sgd", optimizer_kwargs={"lr": 0.1})
        return _enumerate(ebc, 2, constraints=constraints)

    # The config's, the constraint's, or both alike: the option (hence the plan) carries it.
    for config_factor, constraint_factor in ((0.4, None), (None, 0.4), (0.4, 0.4)):
        constraints = (
            {"a": ParameterConstraints(cache_params=CacheParams(load_factor=constraint_factor))}
            if constraint_factor
            else None
        )
        for o in options([_tiered("a", 100, 4, "host", config_factor)], constraints):
            assert o.cache_params.load_factor == 0.4
    # Both, different: which one was meant is the user's to say.
    different = {"a": ParameterConstraints(cache_params=CacheParams(load_factor=0.5))}
    with pytest.raises(
        ValueError, match=r"table 'a'.*load_factor=0.5 .*differs from the config's cache_load_factor=0.4"
    ):
        options([_tiered("a", 100, 4, "host", 0.4)], different)
    for bad in (0, 0.0, -0.1, 1.5, float("nan"), True, "0.5"):
        constraints = {"a": ParameterConstraints(cache_params=CacheParams(load_factor=bad))}
        with pytest.raises(
            ValueError, match=rf"table 'a'.*cache_params.load_factor must be a number in \(0, 1\].*got {bad!r}"
        ):
            options([_tiered("a", 100, 4, "host")], constraints)
    # A table without a tier has no cache to size.
    resident = DynamicEmbeddingBagConfig(name="a", embedding_dim=4, num_embeddings=100, feature_names=["f_a"])
    with pytest.raises(ValueError, match=r"table 'a'.*load_factor=0.5 applies to tables with backing=\"host\""):
        options([resident], different)


# ------------------------------------------------------------------ the planner's choice

CAPACITY, DIM = 20000, 16


def _model(backing="host", extra=(), resident=None):
    """Two tiered tables t0, t1 (and ``extra`` ones) in one module; ``resident``: a config of an
    all-resident table, in a module of its own (a module's tables share one backing)."""
    configs = [_tiered(f"t{i}", CAPACITY, DIM, backing) for i in range(2)] + list(extra)
    make = lambda c: DynamicEmbeddingBagCollection(c, device=META, optimizer="adagrad", optimizer_kwargs={"lr": 0.1})
    if resident is None:
        return make(configs)
    return nn.ModuleDict({"tiers": make(configs), "resident": make([resident])})


def _plan(model, ddr_cap, constraints=None, world=2):
    planner = make_planner(Topology(world_size=world, compute_device="cpu", ddr_cap=ddr_cap), BATCH, constraints)
    return planner.plan(model, _sharders())


def _factors(plan):
    return {
        name: ps.cache_params.load_factor
        for module_plan in plan.plan.values()
        for name, ps in module_plan.items()
        if ps.cache_params
    }


def test_the_chosen_load_factor_is_the_largest_that_plans(ddr_cap=5 << 20):
    """Brute force: every candidate factor k / 100 given as a constraint; the planner's choice is the
    largest that plans (the smallest caches, one step's ids, are below 1 / 100 of the rows here),
    and its plan fits the budget as modules holding the shares count their bytes."""
    resident = DynamicEmbeddingBagConfig(name="r", embedding_dim=8, num_embeddings=3000, feature_names=["f_r"])
    model = _model(resident=resident)
    types = {t: ParameterConstraints(sharding_types=["table_wise", "row_wise"]) for t in ("t0", "t1", "r")}
    plan = _plan(model, ddr_cap, types)
    chosen = _factors(plan)
    assert set(chosen) == {"t0", "t1"} and chosen["t0"] == chosen["t1"]

    def plans(k):
        constraints = dict(types)
        for t in ("t0", "t1"):
            constraints[t] = ParameterConstraints(
                sharding_types=["table_wise", "row_wise"], cache_params=CacheParams(load_factor=k / 100)
            )
        try:
            _plan(model, ddr_cap, constraints)
            return True
        except PlannerError:
            return False

    best = next(k for k in range(100, 0, -1) if plans(k))
    assert 1 < best < 100  # (a budget between the smallest and the whole caches)
    assert chosen["t0"] == best / 100
    # Each rank's shares, as modules holding them count their bytes (plus the step's IO), fit.
    per_rank = [0, 0]
    for module_plan in plan.plan.values():
        for name, ps in module_plan.items():
            parts = len(ps.ranks) if ps.sharding_type == "row_wise" else 1
            io = _expected_io(ps.sharding_type, 2, 8 if name == "r" else DIM, True, False, [1.0])
            if name == "r":
                held = _expected_resident(3000, 8, "adagrad", None, 1, None, parts)
            else:
                on_device, host, _ = _share_oracle(
                    None, "host", name, CAPACITY, DIM, {}, parts, chosen[name], "adagrad"
                )
                held = on_device + host
            for rank in ps.ranks:
                per_rank[rank] += held + io
    assert max(per_rank) <= ddr_cap, per_rank
    # A larger budget, a larger cache; enough for all the rows: 1.0.
    assert _factors(_plan(model, ddr_cap + (1 << 20), types))["t0"] > chosen["t0"]
    assert _factors(_plan(model, 64 << 20, types)) == {"t0": 1.0, "t1": 1.0}


def test_given_factors_are_kept_and_the_others_chosen():
    model = _model(extra=[_tiered("given", 5000, 8, "host", 0.1)])
    constraints = {"t0": ParameterConstraints(cache_params=CacheParams(load_factor=0.05))}
    chosen = _factors(_plan(model, 4 << 20, constraints))
    assert chosen["t0"] == 0.05 and chosen["given"] == 0.1
    assert 0.05 < chosen["t1"] < 1.0  # the room t0's small cache leaves


def test_the_smallest_cache_holds_one_steps_ids(tmp_path):
    """The planner's smallest cache (its search at factor 0) holds the ids a step looks up in the
    shard, each counted distinct: table_wise, both ranks' batches of BATCH bags x pooling factor;
    row_wise, half of them in half the rows; all the rows of a table smaller than that."""
    configs = [_tiered("t", CAPACITY, DIM, f"file:{tmp_path}"), _tiered("tiny", 100, DIM, f"file:{tmp_path}")]
    ebc = DynamicEmbeddingBagCollection(configs, device=META, optimizer="adagrad", optimizer_kwargs={"lr": 0.1})
    constraints = {"t": ParameterConstraints(pooling_factors=[3.0])}
    topology = Topology(world_size=2, compute_device="cpu")
    estimator = DynamicEmbeddingStorageEstimator(topology, constraints)
    estimator.auto_load_factor = 0.0
    options = _enumerate(ebc, 2, constraints=constraints, estimators=[estimator])
    step_ids = 2 * BATCH * 3
    for o in options:
        factor = o.cache_params.load_factor
        if o.name == "tiny":
            assert factor == 1.0
        elif o.sharding_type == "table_wise":
            assert math.ceil(factor * CAPACITY - 1e-9) == step_ids
        else:
            assert math.ceil(factor * CAPACITY / 2 - 1e-9) == step_ids / 2
    assert estimator.chose_cache_for == {"t", "tiny"}
    # Above the smallest, the search's factor itself.
    estimator.auto_load_factor = 0.5
    chosen = {
        (o.name, o.cache_params.load_factor)
        for o in _enumerate(ebc, 2, constraints=constraints, estimators=[estimator])
    }
    assert chosen == {("t", 0.5), ("tiny", 1.0)}


def test_smallest_caches_that_do_not_fit_name_the_tables_the_bytes_and_the_budget():
    # One table too large for a rank even with its smallest cache: named, with its bytes.
    big = _tiered("big", 1 << 20, 64, "host")
    model = DynamicEmbeddingBagCollection([big], device=META, optimizer="adagrad", optimizer_kwargs={"lr": 0.1})
    ddr_cap = 8 << 20
    with pytest.raises(PlannerError, match=r"(?s)Insufficient memory.*table 'big'") as info:
        _plan(model, ddr_cap)
    message = str(info.value)
    need = int(message.split("needs ")[1].split(" B")[0])
    assert need > ddr_cap and f"ddr per rank {ddr_cap} B" in message and "cache_load_factor" in message
    assert "one step's ids" in message and "insufficient storage" in message  # the hint, then TorchRec's report
    # Two tables, each fitting alone at its smallest cache, not together: both named, the budget over the ranks.
    constraints = {t: ParameterConstraints(sharding_types=["table_wise"]) for t in ("t0", "t1")}
    with pytest.raises(
        PlannerError, match=r"(?s)No plan even with the smallest caches of the tiered tables.*table 't0'.*table 't1'"
    ) as info:
        _plan(_model(), 9 << 19, constraints, world=1)  # 4.5 MiB: one smallest table fits, two do not
    assert "over 1 rank(s)" in str(info.value)


def test_torchrecs_default_planner_chooses_the_cache_too():
    """EmbeddingShardingPlanner built without an enumerator (what DistributedModelParallel uses
    without a plan) costs our tables with our estimators: it chooses the cache as make_planner does."""
    from torchrec.distributed.planner import EmbeddingShardingPlanner

    model = _model()
    topology = Topology(world_size=2, compute_device="cpu", ddr_cap=5 << 20)
    default = _factors(EmbeddingShardingPlanner(topology=topology, batch_size=BATCH).plan(model, _sharders()))
    assert default == _factors(_plan(model, 5 << 20))
    assert 0 < default["t0"] < 1.0


def test_the_sharders_fused_params_cache_load_factor_is_the_default_of_its_tiered_tables():
    """TorchRec's sharder-wide cache_load_factor (fused_params): the factor of the tiered tables
    without a constraint's or a config's; a bad one names itself."""
    from torchrec_ext.distributed.sharders import DynamicEmbeddingBagCollectionSharder

    model = _model(extra=[_tiered("given", 5000, 8, "host", 0.1)])
    constraints = {"t0": ParameterConstraints(cache_params=CacheParams(load_factor=0.05))}
    topology = Topology(world_size=2, compute_device="cpu", ddr_cap=5 << 20)
    sharders = lambda factor: [DynamicEmbeddingBagCollectionSharder(fused_params={"cache_load_factor": factor})]
    plan = make_planner(topology, BATCH, constraints).plan(model, sharders(0.3))
    assert _factors(plan) == {"t0": 0.05, "given": 0.1, "t1": 0.3}
    with pytest.raises(ValueError, match=r"table 't0'.*the sharder's fused_params cache_load_factor must be .*got 1.5"):
        make_planner(topology, BATCH, constraints).plan(model, sharders(1.5))


@pytest.mark.parametrize("kind", ["host", "file"])
def test_a_tiered_shard_pays_for_its_misses_in_prefetch_compute(tmp_path, kind):
    """Uniform access (a bound): (1 - load_factor) of the ids a shard looks up move a row (vector
    and optimizer state) in and a dirty one out, at random-row cost, over the backing's bandwidth;
    all-resident and fully cached shards pay nothing; the rest of the perf is the resident table's."""
    from torchrec_ext.distributed.planner import DynamicEmbeddingPerfEstimator

    backing = "host" if kind == "host" else f"file:{tmp_path}"
    topology = Topology(world_size=2, compute_device="cpu")

    def perf(factor, tiered=True):
        config = _tiered("t", CAPACITY, DIM, backing, factor) if tiered else _tiered("t", CAPACITY, DIM, "device")
        ebc = DynamicEmbeddingBagCollection([config], device=META, optimizer="adagrad", optimizer_kwargs={"lr": 0.1})
        constraints = {"t": ParameterConstraints(pooling_factors=[4.0])}
        estimators = [DynamicEmbeddingPerfEstimator(topology, constraints)]
        return {
            o.sharding_type: o.shards[0].perf
            for o in _enumerate(ebc, 2, constraints=constraints, estimators=estimators)
        }

    resident = perf(None, tiered=False)
    bw = topology.ddr_mem_bw if kind == "host" else topology.ssd_mem_bw
    for factor in (0.25, 1.0):
        tiered = perf(factor)
        for sharding_type, p in tiered.items():
            ids = 2 * BATCH * 4 / (2 if sharding_type == "row_wise" else 1)  # both ranks' ids; row_wise: half
            want = 4 * (1 - factor) * ids * 2 * (DIM * 4 + DIM * 4) / bw
            assert p.prefetch_compute == pytest.approx(want, rel=1e-12), (factor, sharding_type)
            assert resident[sharding_type].prefetch_compute == 0
            assert p.fwd_compute == resident[sharding_type].fwd_compute
            assert p.bwd_compute == resident[sharding_type].bwd_compute
    assert perf(0.25)["table_wise"].total > perf(0.5)["table_wise"].total > perf(1.0)["table_wise"].total
