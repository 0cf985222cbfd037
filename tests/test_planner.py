"""The dynamic-table planner: storage estimates against an independent byte model and against
the modules' own storage_bytes(), perf estimates, and whole plans of models mixing dynamic and
stock TorchRec tables under TorchRec's EmbeddingShardingPlanner (plan() needs no process group)."""

import logging
import math
import os

import pytest
import torch
from torch import nn
from torchrec import DataType, EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.distributed.embedding_types import BaseEmbeddingSharder, EmbeddingComputeKernel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import ParameterConstraints, Topology
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.types import PlannerError, Storage

from torchrec_ext import (
    DynamicEmbeddingBagCollection,
    DynamicEmbeddingBagConfig,
    DynamicEmbeddingCollection,
    DynamicEmbeddingConfig,
    reference,
)
from torchrec_ext.distributed.planner import (
    DynamicEmbeddingPerfEstimator,
    DynamicEmbeddingStorageEstimator,
    make_planner,
)

META = torch.device("meta")
BATCH = 64


# ------------------------------------------------------------------ sharders


class _TestSharder(BaseEmbeddingSharder):
    """The interface of our sharders, for planning only (used when the real ones are missing)."""

    _type: type[nn.Module]
    _container: str

    def shard(self, module, params, env, device=None, module_fqn=None):
        raise NotImplementedError("planning only")

    @property
    def module_type(self):
        return self._type

    def shardable_parameters(self, module) -> dict[str, nn.Parameter]:
        return {name: table.weight for name, table in getattr(module, self._container).items()}

    def sharding_types(self, compute_device_type: str) -> list[str]:
        return ["table_wise", "row_wise"]

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        return [EmbeddingComputeKernel.CUSTOMIZED_KERNEL.value]


class _TestEbcSharder(_TestSharder):
    _type, _container = DynamicEmbeddingBagCollection, "embedding_bags"


class _TestEcSharder(_TestSharder):
    _type, _container = DynamicEmbeddingCollection, "embeddings"


try:  # the project's sharders when they exist
    from torchrec_ext.distributed.sharders import (
        DynamicEmbeddingBagCollectionSharder as EbcSharder,
    )
    from torchrec_ext.distributed.sharders import (
        DynamicEmbeddingCollectionSharder as EcSharder,
    )
except ImportError:
    EbcSharder, EcSharder = _TestEbcSharder, _TestEcSharder


def _sharders():
    return [EbcSharder(), EcSharder(), EmbeddingBagCollectionSharder()]


# ------------------------------------------------------------------ the byte model, written out again

STATE = {
    None: lambda d: 0,
    "sgd": lambda d: 0,
    "adagrad": lambda d: 4 * d,
    "rowwise_adagrad": lambda d: 4,
    "adam": lambda d: 8 * d,
    "adamw": lambda d: 8 * d,  # two float32 moments per element
    "ftrl": lambda d: 8 * d,
}  # float32 accumulator and linear per element


def _expected_resident(cap, dim, opt, ttl, admit_after, admission_capacity, parts):
    rows = math.ceil(cap / parts)
    # index: 17 B per slot (digest, key, score), per stash entry 17 B (tag, row, key), 1 B per bucket
    total = rows * (4 * dim + STATE[opt](dim)) + 17 * 32 * math.ceil(rows / 32)
    total += 17 * reference.stash_slots(rows) + math.ceil(rows / 32)
    if ttl:
        total += 8 * rows
    if admit_after > 1:
        a = math.ceil((admission_capacity or cap) / parts)
        total += 17 * 32 * math.ceil(a / 32) + 17 * reference.stash_slots(a) + math.ceil(a / 32) + 8 * a
    return total


def _expected_io(sharding_type, world, dim, pooled, weighted, pooling_factors, batch=BATCH):
    ids = sum(pf * batch for pf in pooling_factors)
    bags = sum(min(1.0, pf) * batch for pf in pooling_factors)
    if sharding_type == "table_wise":
        shard_ids, outs = ids * world, (bags if pooled else ids) * world
    else:
        shard_ids, outs = ids, (bags * world if pooled else ids)
    return math.ceil(shard_ids * (12 if weighted else 8)) + math.ceil(outs * dim * 4)


ORIGINAL_TYPES = ("table_wise", "row_wise")


def _enumerate(model, world, device="cpu", constraints=None, estimators=None, types=ORIGINAL_TYPES, **topo):
    """The options of ``types`` (the byte model of the other types: test_sharding_types_storage_and_perf)."""
    topology = Topology(world_size=world, compute_device=device, **topo)
    if estimators is None:
        estimators = [
            DynamicEmbeddingStorageEstimator(topology, constraints),
            DynamicEmbeddingPerfEstimator(topology, constraints),
        ]
    enumerator = EmbeddingEnumerator(topology, BATCH, constraints, estimator=estimators)
    options = enumerator.enumerate(model, _sharders())
    return options if types is None else [o for o in options if o.sharding_type in types]


TABLE_CASES = [
    # capacity, dim, ttl_steps, admit_after, admission_capacity
    (1000, 16, None, 1, None),
    (4097, 8, 10, 1, None),
    (33, 64, None, 3, None),
    (1000, 12, 5, 2, 77),
]


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("opt", [None, "sgd", "adagrad", "rowwise_adagrad", "adam", "adamw", "ftrl"])
def test_storage_equals_byte_model(world, opt):
    configs = [
        DynamicEmbeddingBagConfig(
            name=f"t{i}",
            embedding_dim=dim,
            num_embeddings=cap,
            feature_names=[f"f{i}"],
            ttl_steps=ttl,
            admit_after=adm,
            admission_capacity=acap,
        )
        for i, (cap, dim, ttl, adm, acap) in enumerate(TABLE_CASES)
    ]
    kwargs = {} if opt is None else {"optimizer": opt, "optimizer_kwargs": {"lr": 0.1}}
    ebc = DynamicEmbeddingBagCollection(configs, device=META, **kwargs)
    constraints = {"t1": ParameterConstraints(pooling_factors=[3.5, 0.5])}  # two features' worth of ids
    options = _enumerate(ebc, world, constraints=constraints)
    assert {(o.name, o.sharding_type) for o in options} == {
        (c.name, st) for c in configs for st in ("table_wise", "row_wise")
    }
    for o in options:
        cap, dim, ttl, adm, acap = TABLE_CASES[int(o.name[1:])]
        parts = world if o.sharding_type == "row_wise" else 1
        pf = [3.5, 0.5] if o.name == "t1" else [1.0]
        want = _expected_resident(cap, dim, opt, ttl, adm, acap, parts) + _expected_io(
            o.sharding_type, world, dim, True, False, pf
        )
        assert len(o.shards) == (world if o.sharding_type == "row_wise" else 1)
        for shard in o.shards:
            assert shard.storage == Storage(hbm=0, ddr=want), (o.name, o.sharding_type)


def test_storage_of_sequence_and_weighted_tables_and_cuda():
    ec = DynamicEmbeddingCollection(
        [DynamicEmbeddingConfig(name="s", embedding_dim=8, num_embeddings=500, feature_names=["a"], ttl_steps=4)],
        device=META,
        optimizer="rowwise_adagrad",
        optimizer_kwargs={"lr": 0.1},
    )
    wbc = DynamicEmbeddingBagCollection(
        [DynamicEmbeddingBagConfig(name="w", embedding_dim=24, num_embeddings=300, feature_names=["b"])],
        is_weighted=True,
        device=META,
        optimizer="adam",
        optimizer_kwargs={"lr": 0.1},
    )
    model = nn.ModuleDict({"ec": ec, "wbc": wbc})
    constraints = {"s": ParameterConstraints(pooling_factors=[5.0])}
    for device in ("cpu", "cuda"):
        for o in _enumerate(model, 2, device=device, constraints=constraints):
            parts = 2 if o.sharding_type == "row_wise" else 1
            if o.name == "s":
                want = _expected_resident(500, 8, "rowwise_adagrad", 4, 1, None, parts) + _expected_io(
                    o.sharding_type, 2, 8, False, False, [5.0]
                )
            else:
                want = _expected_resident(300, 24, "adam", None, 1, None, parts) + _expected_io(
                    o.sharding_type, 2, 24, True, True, [1.0]
                )
            expected = Storage(hbm=want, ddr=0) if device == "cuda" else Storage(hbm=0, ddr=want)
            assert all(s.storage == expected for s in o.shards), (device, o.name, o.sharding_type)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_storage_matches_modules_storage_bytes(world):
    """Without IO buffers (is_inference), a shard's bytes are what a module holding that share
    reports: the whole table for table_wise, ceil(capacity / world) rows for row_wise."""
    cases = [(1000, 16, None, 1, None), (4097, 8, 10, 1, None), (1000, 12, 5, 2, 77), (70, 4, 3, 4, None)]
    configs = [
        DynamicEmbeddingBagConfig(
            name=f"t{i}",
            embedding_dim=dim,
            num_embeddings=cap,
            feature_names=[f"f{i}"],
            ttl_steps=ttl,
            admit_after=adm,
            admission_capacity=acap,
        )
        for i, (cap, dim, ttl, adm, acap) in enumerate(cases)
    ]
    ebc = DynamicEmbeddingBagCollection(configs, device=META, optimizer="adagrad", optimizer_kwargs={"lr": 0.1})
    topology = Topology(world_size=world, compute_device="cpu")
    options = _enumerate(ebc, world, estimators=[DynamicEmbeddingStorageEstimator(topology, is_inference=True)])
    for o in options:
        cap, dim, ttl, adm, acap = cases[int(o.name[1:])]
        parts = world if o.sharding_type == "row_wise" else 1
        share = DynamicEmbeddingBagCollection(
            [
                DynamicEmbeddingBagConfig(
                    name="x",
                    embedding_dim=dim,
                    num_embeddings=math.ceil(cap / parts),
                    feature_names=["x"],
                    ttl_steps=ttl,
                    admit_after=adm,
                    admission_capacity=None if acap is None else math.ceil(acap / parts),
                )
            ],
            optimizer="adagrad",
            optimizer_kwargs={"lr": 0.1},
        )
        assert all(s.storage.ddr == share.storage_bytes() for s in o.shards), (o.name, o.sharding_type)


@pytest.mark.parametrize("world", [1, 2])
def test_storage_of_half_tables_matches_modules_storage_bytes(world):
    """FP16 / BF16 tables (odd rows * dim: a share's vectors end mid-word) plan the bytes a module
    holding that share reports, fewer than the same table in FP32."""
    cases = [(1001, 5, DataType.FP16), (333, 7, DataType.BF16), (64, 64, DataType.FP16)]
    configs = [
        DynamicEmbeddingBagConfig(
            name=f"t{i}", embedding_dim=dim, num_embeddings=cap, feature_names=[f"f{i}"], data_type=dt
        )
        for i, (cap, dim, dt) in enumerate(cases)
    ]
    ebc = DynamicEmbeddingBagCollection(configs, device=META, optimizer="rowwise_adagrad", optimizer_kwargs={"lr": 0.1})
    topology = Topology(world_size=world, compute_device="cpu")
    options = _enumerate(ebc, world, estimators=[DynamicEmbeddingStorageEstimator(topology, is_inference=True)])
    for o in options:
        cap, dim, dt = cases[int(o.name[1:])]
        parts = world if o.sharding_type == "row_wise" else 1
        share = lambda data_type: DynamicEmbeddingBagCollection(
            [
                DynamicEmbeddingBagConfig(
                    name="x",
                    embedding_dim=dim,
                    num_embeddings=math.ceil(cap / parts),
                    feature_names=["x"],
                    data_type=data_type,
                )
            ],
            optimizer="rowwise_adagrad",
            optimizer_kwargs={"lr": 0.1},
        ).storage_bytes()
        assert all(s.storage.ddr == share(dt) for s in o.shards), (o.name, o.sharding_type)
        rows = math.ceil(cap / parts)
        assert share(DataType.FP32) - share(dt) == rows * dim * 4 - 4 * math.ceil(rows * dim * 2 / 4)


# ------------------------------------------------------------------ plans


class _Mixed(nn.Module):
    def __init__(self, big_capacity: int = 2000, device=META):
        super().__init__()
        self.dyn = DynamicEmbeddingBagCollection(
            [
                DynamicEmbeddingBagConfig(name="d1", embedding_dim=16, num_embeddings=1000, feature_names=["f1"]),
                DynamicEmbeddingBagConfig(
                    name="d2", embedding_dim=32, num_embeddings=big_capacity, feature_names=["f2"], ttl_steps=3
                ),
            ],
            device=device,
            optimizer="adagrad",
            optimizer_kwargs={"lr": 0.1},
        )
        self.seq = DynamicEmbeddingCollection(
            [
                DynamicEmbeddingConfig(name="e1", embedding_dim=8, num_embeddings=300, feature_names=["f3"]),
            ],
            device=device,
            optimizer="sgd",
            optimizer_kwargs={"lr": 0.1},
        )
        self.sparse = nn.ModuleDict(
            {
                "ebc": EmbeddingBagCollection(
                    [
                        EmbeddingBagConfig(name="s1", embedding_dim=16, num_embeddings=100, feature_names=["f4"]),
                        EmbeddingBagConfig(name="s2", embedding_dim=8, num_embeddings=50, feature_names=["f5"]),
                    ],
                    device=device,
                )
            }
        )
        self.dense = nn.Linear(4, 4, device=device)


def _by_table(plan):
    return {(path, name): ps for path, module_plan in plan.plan.items() for name, ps in module_plan.items()}


def test_mixed_model_plans_every_table():
    planner = make_planner(Topology(world_size=2, compute_device="cpu"), batch_size=BATCH)
    plan = planner.plan(_Mixed(), _sharders())
    tables = _by_table(plan)
    assert set(tables) == {("dyn", "d1"), ("dyn", "d2"), ("seq", "e1"), ("sparse.ebc", "s1"), ("sparse.ebc", "s2")}
    for (path, _name), ps in tables.items():
        if path in ("dyn", "seq"):
            assert ps.compute_kernel == "customized_kernel"
            assert ps.sharding_type in ("table_wise", "row_wise")
            assert len(ps.ranks) == (2 if ps.sharding_type == "row_wise" else 1)
        else:  # TorchRec's own choices for a stock EBC on CPU
            assert ps.compute_kernel in ("fused", "dense")
            assert ps.sharding_type in ("data_parallel", "table_wise", "column_wise", "table_column_wise")


def test_mixed_model_plans_with_the_project_sharders():
    sharders = pytest.importorskip("torchrec_ext.distributed.sharders")
    plan = make_planner(Topology(world_size=2, compute_device="cpu"), batch_size=BATCH).plan(
        _Mixed(), sharders.get_sharders()
    )
    tables = _by_table(plan)
    assert set(tables) == {("dyn", "d1"), ("dyn", "d2"), ("seq", "e1"), ("sparse.ebc", "s1"), ("sparse.ebc", "s2")}
    assert all(tables[k].compute_kernel == "customized_kernel" for k in tables if k[0] in ("dyn", "seq"))
    assert all(tables[k].compute_kernel != "customized_kernel" for k in tables if k[0] == "sparse.ebc")


@pytest.mark.parametrize(
    "forced",
    [
        {"d1": "table_wise", "d2": "row_wise", "e1": "row_wise"},
        {"d1": "row_wise", "d2": "table_wise", "e1": "table_wise"},
    ],
)
def test_constraints_are_honoured(forced):
    constraints = {name: ParameterConstraints(sharding_types=[st]) for name, st in forced.items()}
    constraints["s1"] = ParameterConstraints(sharding_types=["table_wise"], compute_kernels=["fused"])
    planner = make_planner(Topology(world_size=4, compute_device="cpu"), batch_size=BATCH, constraints=constraints)
    tables = {name: ps for (_, name), ps in _by_table(planner.plan(_Mixed(), _sharders())).items()}
    for name, st in forced.items():
        assert tables[name].sharding_type == st
        assert tables[name].compute_kernel == "customized_kernel"
        if st == "row_wise":
            assert tables[name].ranks == [0, 1, 2, 3]
        else:
            assert len(tables[name].ranks) == 1
    assert (tables["s1"].sharding_type, tables["s1"].compute_kernel) == ("table_wise", "fused")


def test_constraints_naming_no_table_are_reported(caplog):
    """A typo in a constraint's table name constrains nothing (TorchRec ignores the key): the
    planner logs the names the model lacks beside its tables; names it has are not reported."""
    constraints = {"d1": ParameterConstraints(sharding_types=["row_wise"])}
    constraints["d_1"] = ParameterConstraints(sharding_types=["table_wise"])
    planner = make_planner(Topology(world_size=2, compute_device="cpu"), batch_size=BATCH, constraints=constraints)
    with caplog.at_level(logging.WARNING, logger="torchrec_ext.distributed.planner"):
        tables = {name: ps for (_, name), ps in _by_table(planner.plan(_Mixed(), _sharders())).items()}
    assert tables["d1"].sharding_type == "row_wise"
    reports = [r.getMessage() for r in caplog.records if "constrain nothing" in r.getMessage()]
    assert len(reports) == 1
    assert "['d_1'] (its tables: ['d1', 'd2', 'e1', 's1', 's2'])" in reports[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="torchrec_ext.distributed.planner"):
        make_planner(
            Topology(world_size=2, compute_device="cpu"), batch_size=BATCH, constraints={"d1": constraints["d1"]}
        ).plan(_Mixed(), _sharders())
    assert not [r for r in caplog.records if "constrain nothing" in r.getMessage()]


def test_table_too_large_for_any_rank_names_the_table():
    ddr_cap = 4 << 20
    model = _Mixed(big_capacity=1 << 18)  # d2: 256 Ki rows x (32 * 4 * 2 (adagrad) + 17 + 8) B ~ 70 MB
    planner = make_planner(Topology(world_size=2, compute_device="cpu", ddr_cap=ddr_cap), batch_size=BATCH)
    with pytest.raises(PlannerError, match=r"(?s)Insufficient memory.*table 'd2'") as info:
        planner.plan(model, _sharders())
    message = str(info.value)
    best = _expected_resident(1 << 18, 32, "adagrad", 3, 1, None, 2) + _expected_io(
        "row_wise", 2, 32, True, False, [1.0]
    )
    assert f"needs {best} B" in message and "row_wise" in message
    assert f"per rank {ddr_cap} B" in message
    assert "'d1'" not in message and "'s1'" not in message  # only the table that cannot fit is named
    assert "insufficient storage" in message  # TorchRec's own report follows


def test_tables_fitting_alone_but_not_together_keep_torchrecs_error():
    # Each table fits a rank, table_wise only, but three of them cannot be packed on two ranks.
    configs = [
        DynamicEmbeddingBagConfig(name=f"t{i}", embedding_dim=16, num_embeddings=4096, feature_names=[f"f{i}"])
        for i in range(3)
    ]
    ebc = DynamicEmbeddingBagCollection(configs, device=META, optimizer="adagrad", optimizer_kwargs={"lr": 0.1})
    one = _expected_resident(4096, 16, "adagrad", None, 1, None, 1) + _expected_io(
        "table_wise", 2, 16, True, False, [1.0]
    )
    constraints = {c.name: ParameterConstraints(sharding_types=["table_wise"]) for c in configs}
    planner = make_planner(
        Topology(world_size=2, compute_device="cpu", ddr_cap=int(one * 1.5)), batch_size=BATCH, constraints=constraints
    )
    with pytest.raises(PlannerError) as info:
        planner.plan(ebc, _sharders())
    assert "Insufficient memory:" not in str(info.value)


def test_growing_tables_plan_at_their_maximum_unless_asked_for_the_initial_capacity():
    """A growing table is planned at num_embeddings by default: with a budget that holds its initial
    rows but not all of them, no plan, naming it; plan_capacity (all tables, or this table by name)
    plans its initial capacity (issue 15 item 4)."""
    grown = lambda initial: DynamicEmbeddingBagCollection(
        [
            DynamicEmbeddingBagConfig(
                name="g", embedding_dim=32, num_embeddings=1 << 16, feature_names=["f"], initial_capacity=initial
            )
        ],
        device=META,
        optimizer="adagrad",
        optimizer_kwargs={"lr": 0.1},
    )
    topology = Topology(world_size=2, compute_device="cpu", ddr_cap=4 << 20)  # 64 Ki rows: ~17 MB; 4 Ki: ~1 MB
    with pytest.raises(PlannerError, match=r"(?s)Insufficient memory.*table 'g'"):
        make_planner(topology, BATCH).plan(grown(1 << 12), _sharders())
    for plan_capacity in ("initial", {"g": "initial"}):
        plan = make_planner(topology, BATCH, plan_capacity=plan_capacity).plan(grown(1 << 12), _sharders())
        assert _by_table(plan)[("", "g")].compute_kernel == "customized_kernel"
    with pytest.raises(PlannerError, match=r"(?s)Insufficient memory.*table 'g'"):  # (another table's name: no effect)
        make_planner(topology, BATCH, plan_capacity={"other": "initial"}).plan(grown(1 << 12), _sharders())


def test_the_planner_reports_a_growing_tables_initial_and_maximum_bytes(caplog):
    """The planner's stats show a growing table's bytes at its initial capacity and at its maximum,
    which a module holding that table reports (storage_bytes(), storage_bytes(maximum=True)); a
    table that does not grow is not listed (issue 15 item 3)."""
    from torchrec_ext.distributed.planner import GrowingTableStats

    configs = lambda: [
        DynamicEmbeddingBagConfig(
            name="g", embedding_dim=8, num_embeddings=1 << 12, feature_names=["f"], initial_capacity=1 << 8
        ),
        DynamicEmbeddingBagConfig(name="fixed", embedding_dim=8, num_embeddings=1 << 8, feature_names=["h"]),
    ]
    make = lambda device: DynamicEmbeddingBagCollection(
        configs(), device=device, optimizer="adagrad", optimizer_kwargs={"lr": 0.1}
    )
    constraints = {name: ParameterConstraints(sharding_types=["table_wise"]) for name in ("g", "fixed")}
    oracle = DynamicEmbeddingBagCollection(configs()[:1], optimizer="adagrad", optimizer_kwargs={"lr": 0.1})
    for plan_capacity in ("maximum", "initial"):
        planner = make_planner(
            Topology(world_size=2, compute_device="cpu"), BATCH, constraints, plan_capacity=plan_capacity
        )
        with caplog.at_level(logging.INFO, logger="torchrec_ext.distributed.planner"):
            planner.plan(make(META), _sharders())
        (stats,) = [s for s in planner._stats if isinstance(s, GrowingTableStats)]
        (grown,) = stats.tables
        assert (grown.table, grown.initial_rows, grown.maximum_rows) == ("g", 1 << 8, 1 << 12)
        assert grown.initial_bytes == oracle.storage_bytes() < grown.maximum_bytes == oracle.storage_bytes(maximum=True)
        assert grown.planned_at == plan_capacity
        assert "initial 256 rows" in caplog.text and f"planned at its {plan_capacity}" in caplog.text


def _perf_options(world, device="cpu", is_inference=False, **topo):
    ebc = DynamicEmbeddingBagCollection(
        [
            DynamicEmbeddingBagConfig(name="t", embedding_dim=64, num_embeddings=10000, feature_names=["f"]),
        ],
        device=META,
        optimizer="adagrad",
        optimizer_kwargs={"lr": 0.1},
    )
    topology = Topology(world_size=world, compute_device=device, **topo)
    constraints = {"t": ParameterConstraints(pooling_factors=[8.0])}
    options = _enumerate(
        ebc,
        world,
        device=device,
        constraints=constraints,
        estimators=[DynamicEmbeddingPerfEstimator(topology, constraints, is_inference=is_inference)],
    )
    return {o.sharding_type: o for o in options}


@pytest.mark.parametrize("world", [2, 4])
def test_perf_is_positive_and_row_wise_splits_compute(world):
    options = _perf_options(world)
    tw, rw = options["table_wise"], options["row_wise"]
    assert len(rw.shards) == world
    for o in (tw, rw):
        for s in o.shards:
            p = s.perf
            assert min(p.fwd_compute, p.bwd_compute, p.fwd_comms, p.bwd_comms, p.input_dist_comms) > 0
    tw_perf = tw.shards[0].perf
    for s in rw.shards:
        assert s.perf.fwd_compute < tw_perf.fwd_compute
        assert s.perf.bwd_compute < tw_perf.bwd_compute
        assert s.perf.input_dist_comms < tw_perf.input_dist_comms
    # the total work of the row_wise shards is about the table_wise shard's (plus routing)
    assert sum(s.perf.fwd_compute for s in rw.shards) == pytest.approx(tw_perf.fwd_compute, rel=0.5)


def test_perf_scales_with_topology_bandwidths():
    base = _perf_options(2)["table_wise"].shards[0].perf
    fast = _perf_options(
        2,
        ddr_mem_bw=2 * Topology(world_size=1, compute_device="cpu").ddr_mem_bw,
        intra_host_bw=2 * Topology(world_size=1, compute_device="cpu").intra_host_bw,
    )
    fast = fast["table_wise"].shards[0].perf
    assert fast.fwd_compute == pytest.approx(base.fwd_compute / 2)
    assert fast.bwd_compute == pytest.approx(base.bwd_compute / 2)
    assert fast.fwd_comms == pytest.approx(base.fwd_comms / 2)
    cuda = _perf_options(2, device="cuda")["table_wise"].shards[0].perf
    assert cuda.fwd_compute < base.fwd_compute  # hbm bandwidth on cuda
    single = _perf_options(1)["table_wise"].shards[0].perf
    assert single.fwd_comms == single.bwd_comms == single.input_dist_comms == 0
    inference = _perf_options(2, is_inference=True)["table_wise"].shards[0].perf
    assert inference.bwd_compute == inference.bwd_comms == 0
    assert 0 < inference.fwd_compute < base.fwd_compute  # find instead of find_or_insert


def test_perf_calibration_matches_the_committed_measurement():
    """The planner's training throughput for one CPU rank (dim 64, adagrad) is within 2x of what
    benchmarks/bench_lookup.py last measured for our module (results/lookup_cpu.jsonl: the
    newest CPU record, dim 64, both its partly full and full-table systems)."""
    import json

    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results", "lookup_cpu.jsonl")
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    record = next(
        r for r in reversed(records) if r["config"]["dim"] == 64 and r["config"].get("device", "cpu") == "cpu"
    )
    o = _perf_options(1)["table_wise"]
    p = o.shards[0].perf
    predicted = 8.0 * BATCH / ((p.fwd_compute + p.bwd_compute) / 1e3)
    for system in ("ours", "ours-full"):
        measured = record["results"][system]["ids_per_s"]
        assert 0.5 < predicted / measured < 2.0, (system, predicted, measured)


def test_stock_options_are_left_to_torchrec():
    model = _Mixed()
    options = _enumerate(model, 2)
    stock = [o for o in options if o.path == "sparse.ebc"]
    assert stock and all(s.perf is not None and s.storage is not None for o in stock for s in o.shards)
    assert {o.compute_kernel for o in stock} <= {"fused", "dense"}


def test_make_planner_rejects_an_enumerator():
    topology = Topology(world_size=1, compute_device="cpu")
    with pytest.raises(TypeError, match="enumerator"):
        make_planner(topology, BATCH, enumerator=EmbeddingEnumerator(topology, BATCH))


# ------------------------------------------------------------------ the other sharding types


def _types_model(opt="adagrad"):
    configs = [
        DynamicEmbeddingBagConfig(name="c", embedding_dim=8, num_embeddings=1000, feature_names=["f"], ttl_steps=5)
    ]
    return DynamicEmbeddingBagCollection(configs, device=META, optimizer=opt, optimizer_kwargs={"lr": 0.1})


def test_sharding_types_storage_and_perf():
    """column_wise / table_column_wise shards are tables of their columns with the whole capacity
    (each its own index) looking up every rank's ids; table_row_wise spreads rows and ids over a
    node's ranks: against the byte model, and perf that scales as the ids and widths do."""
    world, local = 4, 2
    constraints = {"c": ParameterConstraints(min_partition=4)}  # 2 column shards of 4
    options = {
        o.sharding_type: o
        for o in _enumerate(_types_model(), world, constraints=constraints, types=None, local_world_size=local)
    }
    assert set(options) == {"table_wise", "row_wise", "table_row_wise", "column_wise", "table_column_wise"}
    for kind, o in options.items():
        parts = {"row_wise": world, "table_row_wise": local}.get(kind, 1)
        dims = [4, 4] if kind in ("column_wise", "table_column_wise") else [8] * len(o.shards)
        assert [int(s.size[1]) for s in o.shards] == dims, kind
        ids = BATCH * world / parts  # every rank's ids, spread over the ranks holding rows
        for shard, dim in zip(o.shards, dims):
            want = (
                _expected_resident(1000, dim, "adagrad", 5, 1, None, parts)
                + math.ceil(ids * 8)
                + math.ceil(BATCH * world * dim * 4)
            )
            assert shard.storage == Storage(hbm=0, ddr=want), kind
    per_shard = lambda kind, field: [getattr(s.perf, field) for s in options[kind].shards]
    table_wise = options["table_wise"].shards[0].perf
    for kind in ("column_wise", "table_column_wise"):  # the same ids, half the width
        assert per_shard(kind, "input_dist_comms") == [table_wise.input_dist_comms] * 2
        assert all(t < table_wise.fwd_compute for t in per_shard(kind, "fwd_compute"))
        assert per_shard(kind, "fwd_comms") == pytest.approx([table_wise.fwd_comms / 2] * 2)
    twrw = per_shard("table_row_wise", "input_dist_comms")
    assert twrw == pytest.approx([table_wise.input_dist_comms / local] * local)
    assert per_shard("row_wise", "input_dist_comms") == pytest.approx([table_wise.input_dist_comms / world] * world)


def test_tables_that_cannot_be_split_by_columns_or_replicated_are_refused_with_the_reason():
    """A row-wise optimizer's tables never get column options that split their columns (a single
    column shard, the whole table, is kept); constraints that leave only those, or only
    data_parallel, are a PlannerError saying why."""
    topology = Topology(world_size=2, compute_device="cpu")
    options = _enumerate(_types_model("rowwise_adagrad"), 2, types=None)  # dim 8 < min_partition: 1 column shard
    assert {o.sharding_type for o in options} == {
        "table_wise",
        "row_wise",
        "table_row_wise",
        "column_wise",
        "table_column_wise",
    }
    assert all(len(o.shards) == 1 for o in options if "column" in o.sharding_type)
    split = {"c": ParameterConstraints(min_partition=4)}  # 2 column shards of 4
    kinds = {o.sharding_type for o in _enumerate(_types_model("rowwise_adagrad"), 2, constraints=split, types=None)}
    assert kinds == {"table_wise", "row_wise", "table_row_wise"}
    for types, reason in (
        (
            ["column_wise"],
            r"constrained to \['column_wise'\], but it cannot be split into column "
            r"shards: it has optimizer 'rowwise_adagrad': a row-wise optimizer state "
            r"\(rowwise_adagrad averages",
        ),
        (
            ["data_parallel"],
            r"constrained to data_parallel: data_parallel cannot serve a dynamic "
            r"table: each rank would insert the ids of its own batch",
        ),
    ):
        planner = make_planner(
            topology, BATCH, constraints={"c": ParameterConstraints(sharding_types=types, min_partition=4)}
        )
        with pytest.raises(PlannerError, match=r"table 'c' \(<root>\) is " + reason):
            planner.plan(_types_model("rowwise_adagrad"), _sharders())


def test_the_sharders_optimizer_is_costed_when_the_module_chose_none():
    """A module without an optimizer trains with its sharder's fused_params optimizer once
    sharded: its state is counted (storage) like the module's own would be."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    configs = [DynamicEmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=1000, feature_names=["f"])]
    topology = Topology(world_size=2, compute_device="cpu")
    fused_params = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1}
    for module_optimizer, sharder_params, opt in (
        (None, fused_params, "rowwise_adagrad"),
        ("adam", fused_params, "adam"),
        (None, None, None),
    ):
        kwargs = {} if module_optimizer is None else {"optimizer": module_optimizer, "optimizer_kwargs": {"lr": 0.1}}
        ebc = DynamicEmbeddingBagCollection(configs, device=META, **kwargs)
        estimators = [DynamicEmbeddingStorageEstimator(topology), DynamicEmbeddingPerfEstimator(topology)]
        options = EmbeddingEnumerator(topology, BATCH, estimator=estimators).enumerate(
            ebc, [EbcSharder(fused_params=sharder_params)]
        )
        table_wise = [o for o in options if o.sharding_type == "table_wise"][0]
        want = _expected_resident(1000, 8, opt, None, 1, None, 1) + _expected_io("table_wise", 2, 8, True, False, [1.0])
        assert table_wise.shards[0].storage == Storage(hbm=0, ddr=want), (module_optimizer, sharder_params)
