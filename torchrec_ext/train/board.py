"""``--tensorboard DIR``: the run's scalars as TensorBoard event files, written by rank 0 through
torch's ``SummaryWriter`` (needs the ``tensorboard`` package).

Tags: ``train/loss`` every step (the mean over ranks), ``eval/auc`` and ``eval/logloss`` at each
eval, and at each segment's end everything ``RecMetricModule.compute()`` gives — here the
tables' stats, ``table_stats|<table>/<stat>`` and their totals ``table_stats|<stat>`` (see
``torchrec_ext.distributed.table_metrics``). A resumed run drops what an earlier run wrote after its
start step (``purge_step``), so the curves show one history.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping, Sequence
from typing import Any


def tensorboard_missing() -> str | None:
    """Why ``--tensorboard`` cannot be used here, or None."""
    if importlib.util.find_spec("tensorboard") is None:
        return "--tensorboard needs the tensorboard package (pip install tensorboard)"
    return None


class Board:
    """Rank 0's writer; on other ranks (``log_dir`` None) every call does nothing."""

    def __init__(self, log_dir: str | None, start_step: int):
        self.writer = None
        if log_dir is not None:
            from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: only when asked for

            # Steps after the checkpoint an earlier run may have written before it ended are its, not ours.
            self.writer = SummaryWriter(log_dir, purge_step=start_step + 1 if start_step > 0 else None)

    def losses(self, first_step: int, losses: Sequence[float]) -> None:
        """``losses[i]`` is the loss of step ``first_step + i``."""
        if self.writer is not None:
            for i, loss in enumerate(losses):
                self.writer.add_scalar("train/loss", loss, first_step + i)

    def eval(self, result: Mapping[str, Any]) -> None:
        if self.writer is not None:
            for key in ("auc", "logloss"):
                self.writer.add_scalar(f"eval/{key}", result[key], result["step"])

    def scalars(self, values: Mapping[str, Any], step: int) -> None:
        """Each of ``values`` (e.g. ``RecMetricModule.compute()``: tensors or numbers) at ``step``."""
        if self.writer is not None:
            for key, value in values.items():
                self.writer.add_scalar(key, float(value), step)
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
