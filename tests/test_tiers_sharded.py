"""Tiered tables (host or file backing, issue 16) sharded on 2 real gloo ranks.

Oracles: the same DMP with all-resident tables (backing="device"), fed the same batches, must
give bit for bit the same outputs, rows, optimizer state, eviction scores and table stats (each
rank's share is a tiered module over its own backing); the unsharded tiered module fed the global
batch, the same outputs and rows (to float tolerance: the ranks' partial pools are summed in
another order). Checkpoints (state_dict, full_state_dict, DCP) round-trip; file backing keeps
each rank's share in files of its own, named by rank.
"""

import gc
import os

import pytest
import torch
import torch.distributed as dist
from torchrec import DataType, KeyedJaggedTensor

from dist_helpers import ModelWith, assert_same_tables, global_batch, run_ranks
from torchrec_ext import (
    DynamicEmbeddingBagCollection,
    DynamicEmbeddingBagConfig,
    DynamicEmbeddingCollection,
    DynamicEmbeddingConfig,
)

WORLD, BATCH, KEYS = 2, 4, ["f0", "f1", "f2"]
KERNEL = "customized_kernel"
POOL = torch.randint(-(2**62), 2**62, (120,), generator=torch.Generator().manual_seed(5))


def _tier(backing, factor):
    return {} if backing is None else {"backing": backing, "cache_load_factor": factor}


def _bag_configs(backing=None):
    # "a": ample capacity (no index eviction, so sharded and unsharded hold the same ids) but a
    # cache of a tenth of it: misses and write-backs every step. "b": 64 rows for 120 ids, full
    # and evicting, with admission, TTL and FP16 rows.
    return [
        DynamicEmbeddingBagConfig(
            name="a",
            embedding_dim=8,
            num_embeddings=512,
            feature_names=["f0", "f1"],
            ttl_steps=5,
            **_tier(backing, 0.1),
        ),
        DynamicEmbeddingBagConfig(
            name="b",
            embedding_dim=4,
            num_embeddings=64,
            feature_names=["f2"],
            eviction_policy="lfu",
            admit_after=2,
            data_type=DataType.FP16,
            **_tier(backing, 0.5),
        ),
    ]


def _seq_configs(backing=None):
    return [
        DynamicEmbeddingConfig(
            name="a",
            embedding_dim=8,
            num_embeddings=512,
            feature_names=["f0", "f1"],
            eviction_policy="lfu",
            ttl_steps=4,
            **_tier(backing, 0.2),
        ),
        DynamicEmbeddingConfig(
            name="b",
            embedding_dim=8,
            num_embeddings=64,
            feature_names=["f2"],
            admission="counter",
            admit_after=2,
            **_tier(backing, 0.5),
        ),
    ]


def _rank_batch(step, rank):
    gen = torch.Generator().manual_seed(step * 100 + rank)
    lengths = torch.randint(0, 4, (len(KEYS) * BATCH,), generator=gen)
    return KeyedJaggedTensor(
        keys=KEYS,
        values=POOL[torch.randint(0, len(POOL), (int(lengths.sum()),), generator=gen)],
        lengths=lengths,
        stride=BATCH,
    )


def _plan(sharding):
    from torchrec.distributed.sharding_plan import column_wise, row_wise, table_wise

    return {
        "row_wise": lambda: {"a": row_wise(compute_kernel=KERNEL), "b": row_wise(compute_kernel=KERNEL)},
        "table_wise": lambda: {
            "a": table_wise(rank=1, compute_kernel=KERNEL),
            "b": table_wise(rank=0, compute_kernel=KERNEL),
        },
        "column_wise": lambda: {
            "a": column_wise(ranks=[0, 1], compute_kernel=KERNEL),
            "b": table_wise(rank=1, compute_kernel=KERNEL),
        },
    }[sharding]()


def _dmp(module, name, sharding):
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan
    from torchrec.distributed.types import ShardingPlan

    from torchrec_ext.distributed import (
        DynamicEmbeddingBagCollectionSharder,
        DynamicEmbeddingCollectionSharder,
        get_sharders,
    )

    sharder = DynamicEmbeddingBagCollectionSharder() if name == "ebc" else DynamicEmbeddingCollectionSharder()
    plan = construct_module_sharding_plan(
        module, _plan(sharding), sharder=sharder, local_size=WORLD, world_size=WORLD, device_type="cpu"
    )
    return DistributedModelParallel(
        ModelWith(name, module), device=torch.device("cpu"), plan=ShardingPlan({name: plan}), sharders=get_sharders()
    )


def _values(out, features=None):
    """An EmbeddingBagCollection's output values, or (``features``) an EmbeddingCollection's
    vectors of those features (per feature, a JaggedTensor)."""
    return out.values() if features is None else torch.cat([out[k].values() for k in features])


def _samples(out, rank, features):
    """The vectors of rank ``rank``'s samples in an unsharded EmbeddingCollection's output of the global batch."""
    offsets = {k: out[k].offsets() for k in features}
    return torch.cat([out[k].values()[offsets[k][rank * BATCH] : offsets[k][(rank + 1) * BATCH]] for k in features])


def _assert_equal_states(a, b):
    assert list(a) == list(b)
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


def _train_three(rank, root, kind, sharding, name, steps=16):
    """Trains a sharded tiered module, the sharded all-resident one and the unsharded tiered one
    alike; checks each step's outputs and then the tables. Returns (tiered dmp, make)."""
    backing = "host" if kind == "host" else f"file:{root}"
    if name == "ebc":
        optimizer = "adam" if sharding == "column_wise" else "rowwise_adagrad"  # (no row-wise state on column shards)
        make = lambda configs, device=None: DynamicEmbeddingBagCollection(
            configs, optimizer=optimizer, optimizer_kwargs={"lr": 0.1}, device=device
        )
        configs = _bag_configs
    else:
        make = lambda configs, device=None: DynamicEmbeddingCollection(
            configs, optimizer="adagrad", optimizer_kwargs={"lr": 0.1}, device=device
        )
        configs = _seq_configs
    reference_dir = os.path.join(root, f"unsharded{rank}")  # each rank runs an unsharded module of its own
    os.makedirs(reference_dir, exist_ok=True)
    unsharded = make(configs("host" if kind == "host" else f"file:{reference_dir}"))
    # Built on the meta device, as a module to shard is: it holds no rows and opens no file.
    tiered = _dmp(make(configs(backing), torch.device("meta")), name, sharding)
    resident = _dmp(make(configs(), torch.device("meta")), name, sharding)
    local = getattr(tiered.module, name).local_module
    keys = None if name == "ebc" else KEYS
    for step in range(steps):
        kjts = [_rank_batch(step, r) for r in range(WORLD)]
        dmp_out = tiered(kjts[rank])
        outs = [_values(dmp_out, keys), _values(resident(kjts[rank]), keys)]
        assert torch.equal(outs[0], outs[1]), step
        want = unsharded(global_batch(kjts))
        if name == "ebc":
            # Row-wise, the full table "b" (columns 16:) evicts other ids on each share than as a whole.
            cols = slice(0, 16) if sharding == "row_wise" else slice(None)
            torch.testing.assert_close(
                outs[0][:, cols], want.values()[rank * BATCH : (rank + 1) * BATCH, cols], rtol=1e-5, atol=1e-5
            )
            grads = [
                torch.randn(BATCH, 20, generator=torch.Generator().manual_seed(step * 7 + r)) for r in range(WORLD)
            ]
            for out in outs:
                (out * grads[rank]).sum().backward()
            # The ranks train on the mean of their losses (TorchRec's gradient division).
            ((want.values() * torch.cat(grads)).sum() / WORLD).backward()
        else:
            features = ["f0", "f1"] if sharding == "row_wise" else KEYS  # (as above: "b" is full)
            torch.testing.assert_close(_values(dmp_out, features), _samples(want, rank, features), rtol=1e-6, atol=1e-6)
            for out in outs:
                out.square().sum().backward()
            sum(jt.values().square().sum() for jt in want.values()).backward()
    # Each rank's share: the same rows, states, scores and counters as the all-resident share.
    assert type(local._tables).__name__ == "TieredTables"
    _assert_equal_states(local.state_dict(), getattr(resident.module, name).local_module.state_dict())
    stats = local.table_stats()
    traffic = torch.tensor(
        [sum(s.cache_misses for s in stats.values()), sum(s.cache_write_backs for s in stats.values())]
    )
    dist.all_reduce(traffic)
    assert bool((traffic > 0).all()), traffic  # rows left the cache and came back
    return tiered, resident, unsharded, make, configs, backing


def _check_sharded(rank, world_size, root, kind, sharding, name):
    from torchrec_ext.distributed import full_state_dict
    from torchrec_ext.distributed.table_stats import reduce_table_stats

    tiered, resident, unsharded, make, configs, backing = _train_three(rank, root, kind, sharding, name)
    container = "embedding_bags" if name == "ebc" else "embeddings"
    prefix = f"{name}.{container}."
    whole = full_state_dict(tiered.state_dict())
    assert_same_tables(whole, full_state_dict(resident.state_dict()), prefix)
    if name == "ebc":  # (the sequence tables' outputs were compared above by shape only)
        want = {f"{name}.{k}": v for k, v in unsharded.state_dict().items()}
        if sharding == "row_wise":  # "b" is full: a row-wise share evicts other ids than the whole table
            whole = {k: v for k, v in whole.items() if not k.startswith(prefix + "b.")}
            want = {k: v for k, v in want.items() if not k.startswith(prefix + "b.")}
        assert_same_tables(whole, want, prefix)
    # Stats: per rank, each share's own; reduced, the whole table's (the resident ones' alike).
    sharded_module, resident_module = getattr(tiered.module, name), getattr(resident.module, name)
    mine, theirs = sharded_module.table_stats(), resident_module.table_stats()
    assert mine.keys() == theirs.keys()
    for table in mine:
        assert mine[table].evictions == theirs[table].evictions and mine[table].inserts == theirs[table].inserts
        assert mine[table].cache_slots is not None
    reduced = reduce_table_stats(mine)
    assert reduced.keys() == {cfg.name for cfg in configs()}
    # model_table_stats: the shares' cache traffic summed over the ranks.
    from torchrec_ext.distributed.table_stats import model_table_stats

    per_model = model_table_stats(tiered)
    for table in reduced:
        counts = torch.tensor([mine[table].cache_misses, mine[table].cache_write_backs] if table in mine else [0, 0])
        dist.all_reduce(counts)
        assert [per_model[table].cache_misses, per_model[table].cache_write_backs] == counts.tolist(), table
    step_stats = sharded_module.tier_step_stats()
    assert set(step_stats) == set(sharded_module.local_module.table_stats())  # every share here, column shards too
    checked = _check_checkpoints(rank, root, tiered, make, configs, backing, name, sharding)
    if kind == "file":
        _train_past_checkpoint(rank, tiered, name)
        files = _backing_files(root)
        del tiered, sharded_module  # (their files' locks go with them)
        gc.collect()
        _check_reopened(rank, root, make, configs, backing, name, sharding, checked, files)
    if kind == "host" and sharding == "table_wise":  # (one case is enough: the plan's factor is read alike)
        _check_planned_caches(rank)
    if kind == "file":  # every rank's share in files of its own, named by rank
        dist.barrier()
        files = sorted(f for f in os.listdir(root) if f.endswith(".rows"))
        for r in range(WORLD):
            held = [f for f in files if f.startswith(f"rank{r}-of-{WORLD}.")]
            assert held, (r, files)
        assert all(f.startswith(("rank0-of-2.", "rank1-of-2.")) for f in files), files
        dist.barrier()


def _check_planned_caches(rank):
    """A plan of make_planner: the load factor of a constraint (CacheParams) and the one the planner
    chose reach each rank's share (its cache slots); a hand-made plan: the config's, else the
    sharder's fused_params'; one whose load factor differs from the config's is refused, naming both."""
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.planner import ParameterConstraints, Topology
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
    from torchrec.distributed.types import CacheParams, ShardingEnv

    from torchrec_ext.distributed import DynamicEmbeddingBagCollectionSharder, get_sharders
    from torchrec_ext.distributed.planner import make_planner
    from torchrec_ext.modules.configs import cache_slots

    make = lambda a_factor=None: DynamicEmbeddingBagCollection(
        [
            DynamicEmbeddingBagConfig(
                name="a",
                embedding_dim=8,
                num_embeddings=512,
                feature_names=["f0", "f1"],
                backing="host",
                cache_load_factor=a_factor,
            ),
            DynamicEmbeddingBagConfig(
                name="b", embedding_dim=4, num_embeddings=64, feature_names=["f2"], backing="host"
            ),
        ],
        optimizer="rowwise_adagrad",
        optimizer_kwargs={"lr": 0.1},
        device=torch.device("meta"),
    )
    constraints = {
        "a": ParameterConstraints(sharding_types=["row_wise"], cache_params=CacheParams(load_factor=0.25)),
        "b": ParameterConstraints(sharding_types=["table_wise"]),
    }
    model = ModelWith("ebc", make())
    planner = make_planner(Topology(world_size=WORLD, compute_device="cpu"), batch_size=BATCH, constraints=constraints)
    plan = planner.collective_plan(model, get_sharders(), dist.group.WORLD)
    factors = {name: ps.cache_params.load_factor for name, ps in plan.plan["ebc"].items()}
    assert factors == {"a": 0.25, "b": 1.0}, factors  # b: chosen, all of it fits
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=get_sharders())
    tables = dmp.module.ebc.local_module._tables
    slots = {m.name: cache.slots for m, cache in zip(tables.meta, tables.caches)}
    assert slots["a"] == cache_slots(512 // WORLD, 0.25) == 64
    assert slots.get("b", 64) == 64  # (on the rank holding it; the default 0.2 would be 13)
    dmp(_rank_batch(0, rank)).values().sum().backward()
    # A hand-made plan at odds with the config: refused.
    module = make(a_factor=0.1)
    sharder = DynamicEmbeddingBagCollectionSharder()
    hand = construct_module_sharding_plan(
        module,
        {"a": table_wise(rank=0, compute_kernel=KERNEL), "b": table_wise(rank=1, compute_kernel=KERNEL)},
        sharder=sharder,
        local_size=WORLD,
        world_size=WORLD,
        device_type="cpu",
    )
    env = ShardingEnv.from_process_group(dist.group.WORLD)
    # Without cache_params: the config's (a), else the sharder's fused_params' (b), as in TorchRec.
    by_fused = DynamicEmbeddingBagCollectionSharder(fused_params={"cache_load_factor": 0.5})
    local = by_fused.shard(module, hand, env, torch.device("cpu")).local_module._tables
    slots = {m.name: cache.slots for m, cache in zip(local.meta, local.caches)}
    assert slots == ({"a": cache_slots(512, 0.1)} if rank == 0 else {"b": cache_slots(64, 0.5)}), slots
    hand["a"].cache_params = CacheParams(load_factor=0.5)
    with pytest.raises(
        ValueError, match=r"table 'a'.*load_factor=0.5 .*differs from the config's cache_load_factor=0.1"
    ):
        sharder.shard(module, hand, env, torch.device("cpu"))


def _check_checkpoints(rank, root, tiered, make, configs, backing, name, sharding):
    """The sharded state into a fresh tiered DMP of the same plan (over new files), the full
    state into an unsharded tiered module, a DCP save into a fresh tiered DMP: the same eval
    outputs, and the same tables."""
    from torchrec_ext.distributed import full_state_dict
    from torchrec_ext.distributed.checkpoint import load_checkpoint, save_checkpoint

    prefix = f"{name}.{'embedding_bags' if name == 'ebc' else 'embeddings'}."
    sharded = tiered.state_dict()
    whole = full_state_dict(sharded)
    evals = [[_rank_batch(50 + i, r) for r in range(WORLD)] for i in range(2)]
    tiered.eval()
    keys = None if name == "ebc" else KEYS
    want = [_values(tiered(kjts[rank]), keys).detach() for kjts in evals]
    fresh = lambda sub: _dmp(
        make(configs(backing if backing == "host" else f"{backing}/{sub}"), torch.device("meta")), name, sharding
    )
    if backing != "host":
        for sub in ("copy", "restored"):
            os.makedirs(os.path.join(root, sub), exist_ok=True)
    copy = fresh("copy")
    copy.load_state_dict(sharded)
    save_checkpoint(os.path.join(root, "ckpt"), 1, {"model": sharded})
    restored = fresh("restored")
    restored.load_state_dict(
        load_checkpoint(os.path.join(root, "ckpt", "step_1"), {"model": restored.state_dict()})["model"]
    )
    _assert_evaluates_as(rank, [copy, restored], evals, want, keys, whole, prefix)
    unsharded_dir = os.path.join(root, f"full{rank}")
    os.makedirs(unsharded_dir, exist_ok=True)
    unsharded = make(configs(backing if backing == "host" else f"file:{unsharded_dir}"))
    unsharded.load_state_dict({k[len(name) + 1 :]: v for k, v in whole.items()})
    assert_same_tables({f"{name}.{k}": v for k, v in unsharded.state_dict().items()}, whole, prefix)
    return evals, want, whole


def _assert_evaluates_as(rank, modules, evals, want, keys, whole, prefix):
    from torchrec_ext.distributed import full_state_dict

    for module in modules:
        module.eval()
        for kjts, expected in zip(evals, want):
            assert torch.equal(_values(module(kjts[rank]), keys), expected)
        assert_same_tables(full_state_dict(module.state_dict()), whole, prefix)


def _backing_files(root):
    return sorted(f for f in os.listdir(root) if f.endswith((".rows", ".log")))


def _train_past_checkpoint(rank, tiered, name):
    """Steps the checkpoint does not know: the logs get records a reopened directory must ignore."""
    tiered.train()
    for step in range(16, 20):
        _values(tiered(_rank_batch(step, rank)), None if name == "ebc" else KEYS).square().sum().backward()


def _check_reopened(rank, root, make, configs, backing, name, sharding, checked, files):
    """A new tiered DMP over the directory of one freed (its files reopened, not new ones) loads the
    checkpoint with DCP: it evaluates and holds the tables as the checkpoint did."""
    from torchrec_ext.distributed.checkpoint import load_checkpoint

    evals, want, whole = checked
    reopened = _dmp(make(configs(backing), torch.device("meta")), name, sharding)
    assert _backing_files(root) == files  # the same files, reopened
    reopened.load_state_dict(
        load_checkpoint(os.path.join(root, "ckpt", "step_1"), {"model": reopened.state_dict()})["model"]
    )
    prefix = f"{name}.{'embedding_bags' if name == 'ebc' else 'embeddings'}."
    _assert_evaluates_as(rank, [reopened], evals, want, None if name == "ebc" else KEYS, whole, prefix)


@pytest.mark.parametrize(
    "kind,sharding,name",
    [
        ("file", "row_wise", "ebc"),
        ("host", "table_wise", "ebc"),
        ("file", "column_wise", "ebc"),
        ("file", "row_wise", "ec"),
    ],
)
def test_sharded_tiered_tables_equal_resident_and_unsharded_on_two_ranks(tmp_path, kind, sharding, name):
    run_ranks(_check_sharded, WORLD, str(tmp_path), kind, sharding, name)


def _ranks_sharing_files(rank, world_size, root):
    # A file-backed module built on the CPU (not meta) on every rank before sharding: each rank's
    # whole table in the same files. The second rank is refused, saying what to do.
    made, error = None, None
    for turn in range(world_size):
        if turn == rank:
            try:
                made = DynamicEmbeddingBagCollection(_bag_configs(f"file:{root}"))
            except ValueError as e:
                error = str(e)
        dist.barrier()
    errors = [None] * world_size
    dist.all_gather_object(errors, error)
    assert errors[0] is None and "in use by another live module" in errors[1] and "meta device" in errors[1], errors
    del made


def test_ranks_building_one_file_backed_module_are_refused(tmp_path):
    run_ranks(_ranks_sharing_files, WORLD, str(tmp_path))


def _pipeline_equals_plain_loop(rank, world_size, root):
    from dist_helpers import local_state, make_batches, make_dmp_dlrm, plain_loop, progress_losses, tiered_dlrm_tables
    from torchrec_ext.pipeline import PipelineOptions, TrainPipeline

    batches = make_batches(rank, batch_size=4, num_full=12, last=0)
    reference, reference_opt = make_dmp_dlrm(world_size, dynamic=True, tables=tiered_dlrm_tables(None))
    want = plain_loop(reference, reference_opt, batches)
    for threaded, prefetch in ((False, True), (True, True), (False, False)):
        directory = os.path.join(root, f"{threaded}-{prefetch}")
        os.makedirs(directory, exist_ok=True)
        dmp, opt = make_dmp_dlrm(
            world_size, dynamic=True, tables=tiered_dlrm_tables(f"file:{directory}"), ebc_device=torch.device("meta")
        )
        options = PipelineOptions(prefetch_threads=0, threaded_input_dist=threaded, tier_prefetch=prefetch)
        stats = []
        with TrainPipeline(dmp, opt, torch.device("cpu"), options) as pipeline:
            losses = progress_losses(pipeline, batches, stats)
        assert len(losses) == len(want)
        for step, (got, expected) in enumerate(zip(losses, want)):
            assert torch.equal(got, expected), (threaded, step)
        a, b = local_state(reference), local_state(dmp)
        assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a), threaded
        moved = torch.tensor(
            [
                sum(s["staged"] for step in stats for s in step.values()),
                sum(s["misses"] for step in stats[1:] for s in step.values()),
            ]
        )
        dist.all_reduce(moved)
        if prefetch:  # staged ahead: the steps after the first miss nothing
            assert moved[0] > 0 and moved[1] == 0, moved
        else:
            assert moved[0] == 0 and moved[1] > 0, moved


def test_train_pipeline_stages_sharded_tiered_tables_and_equals_the_plain_loop(tmp_path):
    run_ranks(_pipeline_equals_plain_loop, WORLD, str(tmp_path))
