"""The job's model: TorchRec's DLRM_DCN over a DynamicEmbeddingBagCollection (one dynamic table
per sparse feature, fused Adagrad), wrapped in DistributedModelParallel, and its optimizer
(the tables' fused optimizer combined with a dense Adagrad, as TorchRec does)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torchrec.distributed import DistributedModelParallel
from torchrec.models.dlrm import DLRM_DCN, DLRMTrain
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from torchrec_ext.data import DEFAULT_CAT_NAMES, INT_FEATURE_COUNT
from torchrec_ext.modules import DynamicEmbeddingBagCollection, DynamicEmbeddingBagConfig


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    embedding_dim: int = 16
    capacity: int = 100_000  # rows per table
    eviction_policy: str = "lru"
    dense_arch: Sequence[int] = (64,)  # hidden sizes; the last layer outputs embedding_dim
    over_arch: Sequence[int] = (128, 64)  # hidden sizes; then 1 logit
    dcn_layers: int = 2
    dcn_rank: int = 16
    embedding_lr: float = 0.02
    seed: int = 0
    table_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # more config fields, each table


def build_model(cfg: ModelConfig) -> DLRMTrain:
    """DLRMTrain(DLRM_DCN) on CPU (DMP moves it): forward(batch) -> (loss, (loss, logits, labels))."""
    torch.manual_seed(cfg.seed)
    tables = [
        DynamicEmbeddingBagConfig(
            name=f"t_{feature}",
            embedding_dim=cfg.embedding_dim,
            num_embeddings=cfg.capacity,
            feature_names=[feature],
            eviction_policy=cfg.eviction_policy,
            seed=cfg.seed,
            **cfg.table_options,
        )
        for feature in DEFAULT_CAT_NAMES
    ]
    ebc = DynamicEmbeddingBagCollection(
        tables, optimizer=torch.optim.Adagrad, optimizer_kwargs={"lr": cfg.embedding_lr}
    )
    dlrm = DLRM_DCN(
        embedding_bag_collection=ebc,
        dense_in_features=INT_FEATURE_COUNT,
        dense_arch_layer_sizes=list(cfg.dense_arch) + [cfg.embedding_dim],
        over_arch_layer_sizes=list(cfg.over_arch) + [1],
        dcn_num_layers=cfg.dcn_layers,
        dcn_low_rank_dim=cfg.dcn_rank,
    )
    return DLRMTrain(dlrm)


def shard_model(model: torch.nn.Module, device: torch.device, batch_size: int) -> DistributedModelParallel:
    """DistributedModelParallel over ``model``, its tables sharded by torchrec_ext's sharders
    with the plan of its planner (collective: every rank calls it)."""
    from torchrec.distributed.planner import Topology

    from torchrec_ext.distributed import get_sharders, make_planner

    world_size = dist.get_world_size()
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    topology = Topology(world_size=world_size, local_world_size=local_world_size, compute_device=device.type)
    plan = make_planner(topology, batch_size).collective_plan(model, get_sharders(), dist.group.WORLD)
    return DistributedModelParallel(model, device=device, plan=plan, sharders=get_sharders())


def make_optimizer(dmp: DistributedModelParallel, lr: float) -> KeyedOptimizer:
    """The tables' fused optimizer (steps in backward) combined with a dense Adagrad over the
    other parameters."""
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())), lambda params: torch.optim.Adagrad(params, lr=lr)
    )
    return CombinedOptimizer([dmp.fused_optimizer, dense])


def plan_summary(dmp: DistributedModelParallel) -> str:
    """'26 tables: 20 table_wise, 6 row_wise' (or 'not sharded')."""
    counts: dict[str, int] = {}
    for module_plan in dmp.plan.plan.values():
        for sharding in module_plan.values():
            counts[sharding.sharding_type] = counts.get(sharding.sharding_type, 0) + 1
    if not counts:
        return "not sharded"
    return f"{sum(counts.values())} tables: " + ", ".join(f"{n} {kind}" for kind, n in sorted(counts.items()))


def live_rows(dmp: DistributedModelParallel) -> int:
    """Rows held by the dynamic tables, summed over ranks (outermost modules that count them)."""
    total, counted = 0, []
    for name, module in dmp.module.named_modules():
        if any(name.startswith(c + ".") for c in counted):
            continue
        # A sharded module holds this rank's tables in a plain module: its local_module.
        counter = module if hasattr(module, "num_live_rows") else getattr(module, "local_module", None)
        if callable(getattr(counter, "num_live_rows", None)):
            counted.append(name)
            total += int(counter.num_live_rows())
    t = torch.tensor([total], dtype=torch.int64, device="cpu")
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t)
    return int(t.item())
