"""Runs a function on N real ranks (processes, gloo process group over a file store) and a
small TorchRec DLRM workload shared by the distributed tests."""

from __future__ import annotations

import datetime
import gc
import multiprocessing
import os
import tempfile
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Ranks are forked from a forkserver that has imported these once (a spawned rank spent ~4 s of CPU
# importing them: most of the distributed tests' time). None of them reads the environment at
# import in a way a test changes; each rank gets the caller's environment as it is at the call.
_PRELOAD = ["torch", "torchrec", "torchrec.distributed", "torchrec_ext.modules", "torchrec_ext.distributed"]


def start_forkserver(*modules: str) -> None:
    """Starts this process's multiprocessing forkserver unless running, with _PRELOAD and `modules`
    imported (only the first start's list counts), and CUDA untouched: the imports ask
    torch.cuda.is_available(), which there answers through NVML (no driver init), so a forked
    child may still use CUDA as a spawned one could."""
    from multiprocessing import forkserver

    multiprocessing.set_forkserver_preload([*_PRELOAD, *modules])
    saved = os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK")
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"  # the server's environment is this one
    try:
        forkserver.ensure_running()
    finally:
        if saved is None:
            del os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"]
        else:
            os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = saved


def _entry(
    rank: int,
    fn: Callable,
    world_size: int,
    init_file: str,
    args: tuple,
    timeout_s: float | None,
    environ: dict[str, str],
) -> None:
    os.environ.clear()  # the caller's, not the one the forkserver started with
    os.environ.update(environ)
    torch.set_num_threads(1)
    timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size, timeout=timeout
    )
    try:
        fn(rank, world_size, *args)
        # Every rank done with its collectives, and the models holding the group freed, before
        # the group goes: tearing it down under a peer's last collective aborts that peer.
        gc.collect()
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable, world_size: int, *args, timeout_s: float | None = None) -> None:
    """fn(rank, world_size, *args) on each rank; a failure on any rank fails the caller.
    timeout_s: the collectives' timeout (default: torch's), short where a rank left waiting in a
    collective is the failure a test looks for."""
    start_forkserver()
    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(
            _entry,
            args=(fn, world_size, os.path.join(d, "init"), args, timeout_s, dict(os.environ)),
            nprocs=world_size,
            join=True,
            start_method="forkserver",
        )


NUM_TABLES, ROWS, DIM, DENSE_IN = 3, 64, 8, 4


class ModelWith(torch.nn.Module):
    """A model whose one child, ``.<name>``, is the module DMP shards; forward feeds it the KJT."""

    def __init__(self, name: str, module: torch.nn.Module):
        super().__init__()
        self._child = name
        setattr(self, name, module)

    def forward(self, kjt):
        return getattr(self, self._child)(kjt)


def make_batches(rank: int, batch_size: int, num_full: int, last: int, seed: int = 0, rows: int = ROWS) -> list:
    """num_full batches of batch_size, then one of `last` rows (0: none), different per rank;
    ids in [0, rows)."""
    from torchrec.datasets.utils import Batch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    sizes = [batch_size] * num_full + ([last] if last else [])
    batches = []
    for b in sizes:
        lengths = torch.randint(0, 4, (NUM_TABLES * b,), generator=gen)
        values = torch.randint(0, rows, (int(lengths.sum()),), generator=gen)
        batches.append(
            Batch(
                dense_features=torch.randn(b, DENSE_IN, generator=gen),
                sparse_features=KeyedJaggedTensor.from_lengths_sync(
                    keys=[f"f{i}" for i in range(NUM_TABLES)], values=values, lengths=lengths
                ),
                labels=torch.randint(0, 2, (b,), generator=gen).float(),
            )
        )
    return batches


def tiered_dlrm_tables(backing: str | None) -> list:
    """make_dmp_dlrm's 3 tables as dynamic configs holding ROWS ids in 2 * ROWS rows (no index
    eviction), with ``backing`` (None: all-resident) and a cache of a quarter of each share: the
    rows move between the tiers every step."""
    from torchrec_ext import DynamicEmbeddingBagConfig

    tier = {} if backing is None else {"backing": backing, "cache_load_factor": 0.25}
    return [
        DynamicEmbeddingBagConfig(
            name=f"t{i}",
            embedding_dim=DIM,
            num_embeddings=2 * ROWS,
            feature_names=[f"f{i}"],
            eviction_policy="lru",
            **tier,
        )
        for i in range(NUM_TABLES)
    ]


def make_dmp_dlrm(
    world_size: int, seed: int = 0, dynamic: bool = False, tables=None, ebc_device=None, t1_column_wise=False
):
    """A DLRM over 3 tables sharded row-wise / table-wise / row-wise, fused Adagrad on the
    tables, dense Adagrad; returns (dmp, optimizer). dynamic: torchrec_ext's
    DynamicEmbeddingBagCollection and sharder instead of TorchRec's EBC; ``tables``: its 3 configs
    (t0, t1, t2 of dim DIM reading f0, f1, f2) instead of the plain ones; ``ebc_device``: where the
    module to shard is built (default the CPU; meta for tiered tables with file backing);
    ``t1_column_wise``: t1 column-wise, one column shard per rank, instead of table-wise."""
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.sharding_plan import column_wise, construct_module_sharding_plan, row_wise, table_wise
    from torchrec.distributed.types import ShardingPlan
    from torchrec.models.dlrm import DLRM, DLRMTrain
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    torch.manual_seed(seed)
    tables = tables or [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=DIM, num_embeddings=ROWS, feature_names=[f"f{i}"])
        for i in range(NUM_TABLES)
    ]
    if dynamic:
        from torchrec_ext import DynamicEmbeddingBagCollection
        from torchrec_ext.distributed import DynamicEmbeddingBagCollectionSharder, get_sharders

        ebc = DynamicEmbeddingBagCollection(tables=tables, device=ebc_device or torch.device("cpu"))
        sharder, sharders, kernel = DynamicEmbeddingBagCollectionSharder(), get_sharders(), "customized_kernel"
    else:
        ebc = EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))
        sharder, kernel = EmbeddingBagCollectionSharder(), None
        sharders = [sharder]
    model = DLRMTrain(
        DLRM(
            embedding_bag_collection=ebc,
            dense_in_features=DENSE_IN,
            dense_arch_layer_sizes=[16, DIM],
            over_arch_layer_sizes=[16, 1],
        )
    )
    apply_optimizer_in_backward(torch.optim.Adagrad, model.model.sparse_arch.parameters(), {"lr": 0.05})
    plan = construct_module_sharding_plan(
        ebc,
        per_param_sharding={
            "t0": row_wise(compute_kernel=kernel),
            "t1": (
                column_wise(ranks=list(range(world_size)), compute_kernel=kernel)
                if t1_column_wise
                else table_wise(rank=world_size - 1, compute_kernel=kernel)
            ),
            "t2": row_wise(compute_kernel=kernel),
        },
        sharder=sharder,
        local_size=world_size,
        world_size=world_size,
        device_type="cpu",
    )
    dmp = DistributedModelParallel(
        model,
        device=torch.device("cpu"),
        plan=ShardingPlan({"model.sparse_arch.embedding_bag_collection": plan}),
        sharders=sharders,
    )
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())), lambda params: torch.optim.Adagrad(params, lr=0.05)
    )
    return dmp, CombinedOptimizer([dmp.fused_optimizer, dense])


def plain_loop(dmp, optimizer, batches) -> list[torch.Tensor]:
    """The losses of a plain sequential loop over ``batches``: the pipelines' oracle."""
    losses = []
    for batch in batches:
        optimizer.zero_grad()
        loss, _ = dmp(batch)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach().clone())
    return losses


def progress_losses(pipeline, batches, tier_stats: list | None = None) -> list[torch.Tensor]:
    """The losses of ``pipeline.progress`` run over ``batches`` until they are exhausted (the
    first item of each step's output); each step's ``pipeline.tier_step_stats()`` appended to
    ``tier_stats`` when given."""
    losses, it = [], iter(batches)
    while True:
        try:
            loss = pipeline.progress(it)[0]
        except StopIteration:
            return losses
        losses.append(loss.detach().clone())
        if tier_stats is not None:
            tier_stats.append(pipeline.tier_step_stats())


def local_state(dmp) -> dict:
    """Every parameter this rank holds (local shards of sharded tables), by name."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    out = {}
    for name, value in dmp.state_dict().items():
        if isinstance(value, ShardedTensor):
            for i, shard in enumerate(value.local_shards()):
                out[f"{name}#{i}"] = shard.tensor.detach().clone()
        elif isinstance(value, torch.Tensor):
            out[name] = value.detach().clone()
    return out


def copy_stock_table(dmp, key: str, table) -> None:
    """Copies a TorchRec table sharded by ``dmp`` (its state_dict ``key``: a ShardedTensor, or a
    tensor) into an unsharded ``table`` (an ``nn.EmbeddingBag``): TorchRec's sharded tables draw
    their own initial rows. Collective."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    weight = dmp.state_dict()[key]
    if isinstance(weight, ShardedTensor):
        full = torch.empty(weight.size()) if dist.get_rank() == 0 else None
        weight.gather(dst=0, out=full)
        weight = full if full is not None else torch.empty(weight.size())
        dist.broadcast(weight, src=0)
    table.weight.data.copy_(weight)


def global_batch(kjts):
    """The KJT of every rank's samples, rank after rank per key: what an unsharded module is fed
    to stand for all ranks (the order column shards and routed lookups receive ids in)."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    keys, per_key = kjts[0].keys(), [k.to_dict() for k in kjts]
    weighted = kjts[0].weights_or_none() is not None
    return KeyedJaggedTensor(
        keys=keys,
        values=torch.cat([jt[key].values() for key in keys for jt in per_key]),
        lengths=torch.cat([jt[key].lengths() for key in keys for jt in per_key]),
        stride=kjts[0].stride() * len(kjts),
        weights=torch.cat([jt[key].weights() for key in keys for jt in per_key]) if weighted else None,
    )


def rows_by_id(state, prefix):
    """{table: {key: {id: value}}} of a (full, unsharded) state dict's per-row keys under ``prefix``
    (vectors, scores, optimizer state, last-seen steps)."""
    out = {}
    for key, value in state.items():
        if not key.startswith(prefix) or not isinstance(value, torch.Tensor):
            continue
        table, field = key[len(prefix) :].split(".", 1)
        if field in ("weight_id", "counters", "row") or field.startswith("admission"):
            continue
        ids = state[f"{prefix}{table}.weight_id"].tolist()
        if value.dim() >= 1 and value.shape[0] == len(ids):
            out.setdefault(table, {})[field] = dict(zip(ids, value))
    return out


def assert_same_tables(got_state, want_state, prefix):
    """The same ids with the same per-row values in two (full) state dicts' tables."""
    got, want = rows_by_id(got_state, prefix), rows_by_id(want_state, prefix)
    assert got.keys() == want.keys()
    for table in want:
        assert got[table].keys() == want[table].keys(), table
        for field in want[table]:
            assert got[table][field].keys() == want[table][field].keys(), (table, field)
            for k, v in want[table][field].items():
                torch.testing.assert_close(got[table][field][k], v, rtol=1e-5, atol=1e-5, msg=f"{table}.{field}[{k}]")


def dmp_t1_row_t2_table_wise(model, world_size: int):
    """``model`` (its dynamic EBC at ``model.ebc``) under DMP with table t1 row-wise and t2
    table-wise on the last rank, planned by ``construct_module_sharding_plan``."""
    from torchrec.distributed.sharding_plan import row_wise, table_wise

    from torchrec_ext.distributed import DynamicEmbeddingBagCollectionSharder

    gens = {
        "t1": row_wise(compute_kernel="customized_kernel"),
        "t2": table_wise(rank=world_size - 1, compute_kernel="customized_kernel"),
    }
    return dmp_of(model, "ebc", gens, DynamicEmbeddingBagCollectionSharder(), world_size)


def dmp_of(model, name: str, generators: dict, sharder, world_size: int):
    """``model`` under DMP, its child ``name`` sharded by ``sharder`` with the plan ``generators``
    (table name -> TorchRec's row_wise(...) etc.) give, the other modules by ``get_sharders()``."""
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan
    from torchrec.distributed.types import ShardingEnv, ShardingPlan

    from torchrec_ext.distributed import get_sharders

    plan = construct_module_sharding_plan(
        getattr(model, name),
        generators,
        sharder=sharder,
        local_size=world_size,
        world_size=world_size,
        device_type="cpu",
    )
    sharders = [s for s in get_sharders() if s.module_type is not sharder.module_type] + [sharder]
    return DistributedModelParallel(
        model,
        env=ShardingEnv.from_process_group(dist.group.WORLD),
        device=torch.device("cpu"),
        plan=ShardingPlan({name: plan}),
        sharders=sharders,
    )
