"""The end-of-run report: ``summary.json`` and ``curves.png`` (train loss, held-out AUC and
log loss against the step) in the run directory."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from typing import Any


def smooth(values: Sequence[float], window: int) -> list[float]:
    """Trailing moving average (window >= 1)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def write_json(path: str, value: Any, indent: int | None = 2) -> None:
    """Strict JSON (NaN and infinities written as null), replaced atomically."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(_finite(value), f, indent=indent, default=_jsonable, allow_nan=False)
        f.write("\n")
    os.replace(tmp, path)


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _jsonable(value: Any) -> Any:
    if isinstance(value, (set, tuple)):
        return list(value)
    return str(value)


def plot_curves(
    path: str,
    train_loss: Sequence[float],
    evals: Sequence[dict[str, Any]],
    title: str,
    ceiling: float | None = None,
    tables: Sequence[dict[str, Any]] = (),
) -> None:
    """Train loss of steps 1, 2, ... (raw and smoothed) and eval AUC / log loss per eval step;
    ``ceiling``: the AUC of the data's hidden model, drawn as a dashed line. ``tables``: the
    tables' totals at steps (``distributed.table_stats.summarize`` plus "step"; counted since this
    process started, as ``table_stats()``: a resumed run draws its own steps), drawn below in a
    panel per family: occupancy, churn (inserts, evictions, rejections per step), lookup hit rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if tables:
        fig = plt.figure(figsize=(12, 8))
        grid = fig.add_gridspec(2, 6)
        ax_loss, ax_auc = fig.add_subplot(grid[0, :3]), fig.add_subplot(grid[0, 3:])
        _plot_tables(tables, [fig.add_subplot(grid[1, 2 * i : 2 * i + 2]) for i in range(3)])
    else:
        fig, (ax_loss, ax_auc) = plt.subplots(1, 2, figsize=(12, 4.5))
    steps = list(range(1, len(train_loss) + 1))
    if train_loss:
        ax_loss.plot(steps, train_loss, color="tab:blue", alpha=0.25, linewidth=0.8, label="train loss")
        window = max(1, min(50, len(train_loss) // 10))
        ax_loss.plot(steps, smooth(train_loss, window), color="tab:blue", label=f"train loss (mean of {window})")
    ev = [e for e in evals if not math.isnan(e.get("logloss", float("nan")))]
    if ev:
        ax_loss.plot(
            [e["step"] for e in ev], [e["logloss"] for e in ev], "o-", color="tab:orange", label="eval log loss"
        )
        ax_auc.plot([e["step"] for e in ev], [e["auc"] for e in ev], "o-", color="tab:green", label="eval AUC")
    if ceiling is not None:
        ax_auc.axhline(ceiling, color="tab:gray", linestyle="--", label=f"hidden model's AUC ({ceiling:.3f})")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("log loss (nats)")
    ax_loss.grid(alpha=0.3)
    ax_loss.legend()
    ax_auc.set_xlabel("step")
    ax_auc.set_ylabel("ROC AUC (held out)")
    ax_auc.grid(alpha=0.3)
    if ev or ceiling is not None:
        ax_auc.legend(loc="lower right")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_tables(tables: Sequence[dict[str, Any]], axes: Sequence[Any]) -> None:
    """Occupancy, churn per step between two points (counters are cumulative) and hit rate."""
    ax_occ, ax_churn, ax_hit = axes
    steps = [t["step"] for t in tables]
    ax_occ.plot(steps, [100 * t["occupancy"] for t in tables], "o-", color="tab:purple")
    ax_occ.set_ylabel("tables full (%)")
    for key, color in (("inserts", "tab:blue"), ("evictions", "tab:red"), ("rejections", "tab:gray")):
        rates = [(b[key] - a[key]) / max(1, b["step"] - a["step"]) for a, b in zip(tables, tables[1:])]
        if any(rates):
            ax_churn.plot(steps[1:], rates, "o-", color=color, label=key)
    ax_churn.set_ylabel("per step")
    if ax_churn.get_legend_handles_labels()[0]:
        ax_churn.legend()
    hits = [(t["step"], 100 * t["hit_rate"]) for t in tables if t["hit_rate"] is not None]
    if hits:
        ax_hit.plot(*zip(*hits), "o-", color="tab:green")
    ax_hit.set_ylabel("lookup hit rate (%)")
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
