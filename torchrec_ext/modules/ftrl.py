"""``Ftrl``: FTRL-Proximal as a ``torch.optim.Optimizer`` class, so it can be named the TorchRec
way (``apply_optimizer_in_backward(Ftrl, module.parameters(), {...})``, a module's
``optimizer=Ftrl``, ``fuse_embedding_optimizer``), as ``torchrec.optim.RowWiseAdagrad`` names an
update torch lacks. Dynamic tables run it fused in backward; on a dense parameter ``step()``
applies the same update to every element (TensorFlow's ``tf.keras.optimizers.Ftrl``).

Arguments (TensorFlow's, with torch-style names): ``lr`` (alpha, > 0), ``lr_power`` (<= 0),
``l1``, ``l2``, ``beta`` (>= 0), ``initial_accumulator_value`` (>= 0; > 0 where the first step
would otherwise divide by 0). State per element: ``accumulator`` (n) and ``linear`` (z).
The update is ``ftrl_step`` below (``torchrec_ext.reference.ftrl_step`` is its oracle); the
fused kernels run the same rule. ``check_ftrl_hyperparams`` is every FTRL front door's check.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from torchrec_ext.modules.configs import check_finite
from torchrec_ext.vocabulary import FTRL_HYPERPARAMS

_FTRL_HYPERPARAMS = FTRL_HYPERPARAMS


def _hyperparam(value: Any, what: str) -> float:
    return check_finite(value, what, minimum=0.0)


def check_ftrl_hyperparams(
    values: Mapping[str, Any], where: str, label: Callable[[str], str] = None
) -> dict[str, float]:
    """FTRL's settings as floats, refusing values its update cannot take: lr <= 0 (it divides by
    lr), lr_power > 0 (n^-lr_power would be infinite at n = 0), l1, l2, beta or
    initial_accumulator_value < 0, and initial_accumulator_value = 0 where the first step's
    denominator (beta + n^-lr_power) / lr + 2 * l2 can be 0 (lr_power < 0, beta = l2 = 0), as
    TensorFlow's FtrlOptimizer refuses non-positive accumulators. ``values`` holds the names it
    checks (a param group may hold more)."""
    label = label or (lambda name: f"{where} {name}")
    out: dict[str, float] = {}
    for name in ("lr",) + _FTRL_HYPERPARAMS + ("initial_accumulator_value",):
        if name not in values:
            continue
        value = values[name]
        if name == "lr_power":
            out[name] = check_finite(value, label(name))
            if out[name] > 0:
                raise ValueError(f"{label(name)} must be <= 0 (the accumulator is raised to -lr_power), got {value!r}")
        elif name == "lr":
            out[name] = check_finite(value, label(name))
            if not out[name] > 0:
                raise ValueError(f"{label(name)} must be finite and > 0 (FTRL divides by it), got {value!r}")
        else:
            out[name] = _hyperparam(value, label(name))
    if (
        out.get("initial_accumulator_value") == 0
        and out.get("lr_power", -0.5) < 0
        and out.get("beta", 0.0) == 0
        and out.get("l2", 0.0) == 0
    ):
        raise ValueError(
            f"{label('initial_accumulator_value')} must be > 0 when lr_power < 0 and beta = l2 = 0 "
            "(the first step divides by (beta + n^-lr_power) / lr + 2 * l2, 0 at n = 0), got "
            f"{values['initial_accumulator_value']!r}"
        )
    return out


def ftrl_step(
    w: Tensor, g: Tensor, n: Tensor, z: Tensor, lr: float, lr_power: float, l1: float, l2: float, beta: float
) -> None:
    """One FTRL-Proximal step, in place on the weights ``w``, accumulator ``n`` and linear ``z``
    (TensorFlow's ApplyFtrl kernel, beta folded into the denominator), per element:
        n' = n + g^2;  sigma = (n'^-lr_power - n^-lr_power) / lr;  z' = z + g - sigma * w
        w' = (sign(z') * l1 - z') / ((beta + n'^-lr_power) / lr + 2 * l2) where |z'| > l1, else 0
    """
    n_new = n + g * g
    p_new, p_old = n_new.pow(-lr_power), n.pow(-lr_power)
    sigma = (p_new - p_old) / lr
    z.add_(g - sigma * w)
    n.copy_(n_new)
    quadratic = (p_new + beta) / lr + 2 * l2
    w.copy_(torch.where(z.abs() > l1, (torch.sign(z) * l1 - z) / quadratic, torch.zeros_like(w)))


class Ftrl(torch.optim.Optimizer):
    """FTRL-Proximal (McMahan et al. 2013) with TensorFlow's update and defaults."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 0.001,
        lr_power: float = -0.5,
        l1: float = 0.0,
        l2: float = 0.0,
        beta: float = 0.0,
        initial_accumulator_value: float = 0.1,
    ) -> None:
        settings = check_ftrl_hyperparams(
            dict(
                lr=lr, lr_power=lr_power, l1=l1, l2=l2, beta=beta, initial_accumulator_value=initial_accumulator_value
            ),
            "Ftrl",
        )
        super().__init__(params, settings)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["accumulator"] = torch.full_like(p, group["initial_accumulator_value"])
                    state["linear"] = torch.zeros_like(p)
                ftrl_step(
                    p,
                    p.grad,
                    state["accumulator"],
                    state["linear"],
                    group["lr"],
                    group["lr_power"],
                    group["l1"],
                    group["l2"],
                    group["beta"],
                )
        return loss
