"""Fused optimizers of dynamic tables: which update rule, its hyper-parameters, and the
TorchRec ``KeyedOptimizer`` that exposes them (learning-rate changes, checkpoints).

An optimizer is chosen the TorchRec way, ``torchrec.optim.apply_optimizer_in_backward(cls,
params, kwargs)`` on the module's parameters, or with the module's ``optimizer`` /
``optimizer_kwargs`` arguments. The classes understood are torch.optim.SGD, Adagrad and Adam,
and torchrec.optim.RowWiseAdagrad (also as names, or as fbgemm EmbOptimType values). The update
on each touched row is exactly that class's update; defaults are that class's own.
"""
from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

import torch
from torch import Tensor
from torchrec.optim.fused import FusedOptimizer

from torchrec_ext.reference import OPTIMIZERS

_HYPERPARAMS = ("lr", "eps", "beta1", "beta2", "weight_decay", "lr_decay")


def _torch_classes() -> Dict[str, type]:
    from torchrec.optim import RowWiseAdagrad

    return {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad, "rowwise_adagrad": RowWiseAdagrad, "adam": torch.optim.Adam}


# fbgemm's EmbOptimType names, as TorchRec's sharder fused_params use them.
_EMB_OPTIM_TYPES = {"SGD": "sgd", "EXACT_SGD": "sgd", "EXACT_ADAGRAD": "adagrad",
                    "EXACT_ROWWISE_ADAGRAD": "rowwise_adagrad", "ROWWISE_ADAGRAD": "rowwise_adagrad", "ADAM": "adam"}
# Arguments each kind accepts (besides torch's bookkeeping ones), and the values it must keep.
_ACCEPTED = {
    "sgd": {"lr", "weight_decay", "momentum", "dampening", "nesterov", "maximize", "foreach", "differentiable", "fused"},
    "adagrad": {"lr", "lr_decay", "weight_decay", "initial_accumulator_value", "eps", "maximize", "foreach", "differentiable", "fused"},
    "rowwise_adagrad": {"lr", "lr_decay", "weight_decay", "initial_accumulator_value", "eps", "maximize"},
    "adam": {"lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "foreach", "capturable", "differentiable", "fused", "decoupled_weight_decay"},
}
_MUST_BE = {"momentum": 0, "nesterov": False, "maximize": False, "amsgrad": False, "decoupled_weight_decay": False}
# The hyper-parameters each kind reads from its kwargs (betas aside), all finite and >= 0.
_SPEC_FIELDS = {
    "sgd": ("lr", "weight_decay"),
    "adagrad": ("lr", "eps", "weight_decay", "lr_decay", "initial_accumulator_value"),
    "rowwise_adagrad": ("lr", "eps", "weight_decay", "lr_decay", "initial_accumulator_value"),
    "adam": ("lr", "eps", "weight_decay"),
}


@dataclass(frozen=True)
class OptimizerSpec:
    """One fused update rule and its hyper-parameters (defaults: the torch class's own)."""

    kind: str
    lr: float
    eps: float = 0.0
    beta1: float = 0.0
    beta2: float = 0.0
    weight_decay: float = 0.0
    lr_decay: float = 0.0
    initial_accumulator_value: float = 0.0

    @property
    def kind_id(self) -> int:
        return OPTIMIZERS[self.kind]

    def param_group(self) -> Dict[str, float]:
        return {name: getattr(self, name) for name in _HYPERPARAMS + ("initial_accumulator_value",)}

    def torch_class(self) -> type:
        return _torch_classes()[self.kind]

    def torch_kwargs(self) -> Dict[str, Any]:
        """The kwargs of ``torch_class()`` that give this spec back."""
        kwargs: Dict[str, Any] = {"lr": self.lr, "weight_decay": self.weight_decay}
        if self.kind in ("adagrad", "rowwise_adagrad"):
            kwargs.update(eps=self.eps, lr_decay=self.lr_decay, initial_accumulator_value=self.initial_accumulator_value)
        if self.kind == "adam":
            kwargs.update(eps=self.eps, betas=(self.beta1, self.beta2))
        return kwargs


def resolve_optimizer(optimizer: Any, kwargs: Optional[Mapping[str, Any]], where: str) -> OptimizerSpec:
    """OptimizerSpec of a torch optimizer class (or kind name, or EmbOptimType) and its kwargs."""
    kind = _kind_of(optimizer, where)
    kwargs = dict(kwargs or {})
    kwargs.pop("params", None)
    unknown = set(kwargs) - _ACCEPTED[kind]
    if unknown:
        raise TypeError(f"{where}: {kind} does not take {sorted(unknown)}; it takes {sorted(_ACCEPTED[kind])}")
    for name, allowed in _MUST_BE.items():
        if name in kwargs and kwargs[name] != allowed:
            raise ValueError(f"{where}: fused {kind} supports only {name}={allowed!r}, got {kwargs[name]!r}")
    args = dict(_class_defaults(_torch_classes()[kind]))
    args.update(kwargs)
    spec: Dict[str, Any] = dict(kind=kind)
    for name in _SPEC_FIELDS[kind]:
        spec[name] = _hyperparam(args[name], f"{where}: {kind} {name}")
    if kind == "adam":
        betas = args["betas"]
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise TypeError(f"{where}: adam betas must be a pair (beta1, beta2), got {betas!r}")
        spec["beta1"], spec["beta2"] = (_beta(b, f"{where}: adam betas[{i}]") for i, b in enumerate(betas))
    return OptimizerSpec(**spec)


def _hyperparam(value: Any, what: str) -> float:
    """``value`` as a float, refusing what torch's own optimizers refuse (negative values) and
    NaN / inf, which would turn every touched row NaN at its first update."""
    if isinstance(value, Tensor) and value.numel() == 1 and value.is_floating_point():
        value = float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{what} must be a float, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{what} must be finite and >= 0, got {value!r}")
    return float(value)


def _beta(value: Any, what: str) -> float:
    beta = _hyperparam(value, what)
    if not beta < 1.0:  # beta = 1: Adam's bias correction divides by 1 - beta**t = 0
        raise ValueError(f"{what} must be in [0, 1), got {value!r}")
    return beta


def _kind_of(optimizer: Any, where: str) -> str:
    for kind, cls in _torch_classes().items():
        if optimizer is cls:
            return kind
    if isinstance(optimizer, str) and optimizer.lower() in OPTIMIZERS:
        return optimizer.lower()
    name = getattr(optimizer, "name", None)
    if isinstance(name, str) and name in _EMB_OPTIM_TYPES:
        return _EMB_OPTIM_TYPES[name]
    if isinstance(optimizer, type) and optimizer.__name__ == "SGD":  # torchrec.optim's SGD alias
        return "sgd"
    raise ValueError(
        f"{where}: optimizer must be torch.optim.SGD/Adagrad/Adam, torchrec.optim.RowWiseAdagrad, "
        f"one of {sorted(OPTIMIZERS)} or an EmbOptimType of those, got {optimizer!r}"
    )


def _class_defaults(cls: type) -> Dict[str, Any]:
    return {name: p.default for name, p in inspect.signature(cls.__init__).parameters.items()
            if p.default is not inspect.Parameter.empty}


def spec_from_parameter(param: Tensor, where: str) -> Optional[OptimizerSpec]:
    """The spec set on a parameter by ``apply_optimizer_in_backward`` (the latest call wins)."""
    classes = getattr(param, "_optimizer_classes", None)
    if not classes:
        return None
    cls, kwargs = classes[-1], param._optimizer_kwargs[-1]
    cached = getattr(param, "_torchrec_ext_spec", None)
    if cached is not None and cached[0] is cls and cached[1] == kwargs:
        return cached[2]
    spec = resolve_optimizer(cls, kwargs, where)
    param._torchrec_ext_spec = (cls, dict(kwargs), spec)
    return spec


class DynamicEmbeddingFusedOptimizer(FusedOptimizer):
    """The ``KeyedOptimizer`` of a module's dynamic tables.

    Updates happen in backward; ``step()`` / ``zero_grad()`` do nothing, and the hyper-parameters
    of ``param_groups[0]`` (which LR schedulers change) are read at every backward. ``state``
    holds, per table parameter, the step count (``<table>.step``); the per-row state (momenta)
    is saved with the rows themselves, in the module's ``state_dict`` (``optimizer.<name>``).
    """

    def __init__(self, params: Dict[str, Tensor], state: Dict[Tensor, Dict[str, Tensor]], spec: OptimizerSpec):
        self.spec = spec
        super().__init__(params, state, [dict(spec.param_group(), params=list(params.values()))])

    def hyperparams(self) -> Tuple[float, ...]:
        """The update's hyper-parameters, checked as the constructor's are: LR schedulers and
        optimizer checkpoints write ``param_groups`` directly."""
        group = self.param_groups[0]
        where = f"{type(self).__name__}: param_groups[0]"
        return tuple((_beta if name.startswith("beta") else _hyperparam)(group[name], f"{where}[{name!r}]")
                     for name in _HYPERPARAMS)

    def step(self, closure: Optional[Callable[[], Any]] = None) -> None:
        if closure is not None:
            closure()

    def zero_grad(self, set_to_none: bool = False) -> None:
        pass
