"""``fuse_embedding_optimizer``: TorchRec's function of that name, extended to models that hold
dynamic collections. It sits above ``base`` (it walks a model for its dynamic collections),
while the optimizer vocabulary it resolves lives below, in ``fused_optimizer``.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from torchrec_ext.modules.base import DynamicCollectionMixin
from torchrec_ext.modules.fused_optimizer import resolve_optimizer


def fuse_embedding_optimizer(
    model: nn.Module,
    optimizer_type: type[torch.optim.Optimizer],
    optimizer_kwargs: dict[str, Any],
    device: torch.device | None = None,
    location: Any = None,
) -> nn.Module:
    """``torchrec.modules.fused_embedding_modules.fuse_embedding_optimizer`` for models that
    hold dynamic collections (TorchRec's skips them: it replaces only its own EBC / EC).

    Each dynamic collection in ``model`` (``model`` itself included) keeps its rows and gets the
    fused optimizer ``optimizer_type(**optimizer_kwargs)``, replacing any chosen before (as
    TorchRec's fresh fused modules do), and moves to ``device`` when given. ``location`` (an
    fbgemm EmbeddingLocation) is accepted and ignored: dynamic tables live on their device. The
    rest of the model goes to TorchRec's function. Returns the model, as TorchRec's does.
    """
    import torchrec.modules.fused_embedding_modules as torchrec_fused

    torchrec_fuse = getattr(torchrec_fused.fuse_embedding_optimizer, "torchrec_original", None)
    torchrec_fuse = torchrec_fuse or torchrec_fused.fuse_embedding_optimizer
    dynamic = [m for m in model.modules() if isinstance(m, DynamicCollectionMixin)]
    # Checked once, before any module changes.
    spec = resolve_optimizer(optimizer_type, optimizer_kwargs, "fuse_embedding_optimizer")
    for module in dynamic:
        module._set_fused_optimizer(optimizer_type, optimizer_kwargs, spec)
        if device is not None and module.device != torch.device(device):
            module.to(device)
    if isinstance(model, DynamicCollectionMixin):
        return model
    return torchrec_fuse(model, optimizer_type, optimizer_kwargs, device, location)


def install_torchrec_fuse_hook() -> None:
    """Make ``torchrec.modules.fused_embedding_modules.fuse_embedding_optimizer`` this function, so
    TorchRec's own name sets our modules' optimizer instead of skipping them (its ``isinstance``
    check knows only its EBC / EC). Code that bound TorchRec's function before ``import
    torchrec_ext`` keeps the original. Idempotent; runs on ``import torchrec_ext.modules``."""
    import torchrec.modules.fused_embedding_modules as torchrec_fused

    original = torchrec_fused.fuse_embedding_optimizer
    if getattr(original, "torchrec_original", None) is not None:
        return

    @functools.wraps(original)
    def hooked(*args: Any, **kwargs: Any) -> nn.Module:
        return fuse_embedding_optimizer(*args, **kwargs)

    hooked.torchrec_original = original  # type: ignore[attr-defined]
    torchrec_fused.fuse_embedding_optimizer = hooked
