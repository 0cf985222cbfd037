"""The warning an unsharded dynamic module gives when it trains on more than one rank.

Unsharded, each rank's module is a replica that inserts its own batch's ids and applies the
fused optimizer to its own rows during backward. The table weights get no ``.grad``, so
torch's ``DistributedDataParallel`` has nothing of theirs to all-reduce, and nothing else
does: the replicas drift apart with every step (TorchRec's own EmbeddingBagCollection, whose
gradient DDP all-reduces, stays in sync). Sharding the module (``DistributedModelParallel``
with ``torchrec_ext.distributed.get_sharders()``) gives each id one owner instead.

Checked once, at the module's first training lookup that a backward follows, once
``torch.distributed`` is initialized: a warning, not an error, since per-rank tables may be
meant (``per_rank_tables=True`` says so and silences it), and nothing tells reliably whether a
DDP wraps the module (torch's only sign is a private attribute, set only during the forward of
a DDP that uses its C++ reducer), while the same divergence happens without DDP. The sign,
where torch gives it, only adds DDP's name to the message.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch.distributed as dist


def check_unsharded_replica(module: Any) -> bool:
    """Warns when ``module`` (a DynamicEmbeddingBagCollection / DynamicEmbeddingCollection about
    to train) is one of several ranks' replicas and ``module.per_rank_tables`` is false. Returns
    whether the question is settled (False while no process group is initialized, so that a
    group made after the first step is still seen)."""
    if not (dist.is_available() and dist.is_initialized()):
        return False
    world_size = dist.get_world_size()
    if world_size > 1 and not module.per_rank_tables:
        where = type(module).__name__
        tables = ", ".join(repr(m.name) for m in module._tables.meta)
        wrapped = " inside torch's DistributedDataParallel" if _inside_ddp_forward() else ""
        warnings.warn(
            f"{where} (tables {tables}) is training unsharded{wrapped} on rank {dist.get_rank()} of "
            f"{world_size}: each rank inserts its own batch's ids and its fused optimizer updates its own "
            "rows in backward, and nothing all-reduces them (the table weights get no .grad for "
            "DistributedDataParallel to average), so the ranks' tables diverge. Shard the module instead: "
            "DistributedModelParallel(model, sharders=torchrec_ext.distributed.get_sharders()). If each rank "
            f"is meant to train tables of its own, build it with {where}(..., per_rank_tables=True) "
            "(or set module.per_rank_tables = True) to silence this",
            stacklevel=6,  # the line that calls the module (past _lookup_rows, forward and nn.Module's call)
        )
    return True


def _inside_ddp_forward() -> bool:
    """Whether a DistributedDataParallel's forward is running now, as far as torch says (a private
    class attribute: absent in other versions, unset with DDP's Python reducer)."""
    from torch.nn.parallel import DistributedDataParallel

    return getattr(DistributedDataParallel, "_active_ddp_module", None) is not None
