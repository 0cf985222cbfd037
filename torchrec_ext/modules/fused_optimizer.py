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
    lr = args["lr"]
    if isinstance(lr, Tensor):
        lr = float(lr)
    if not isinstance(lr, (int, float)) or lr < 0:
        raise ValueError(f"{where}: lr must be a float >= 0, got {lr!r}")
    spec = dict(kind=kind, lr=float(lr), weight_decay=float(args.get("weight_decay", 0.0)))
    if kind in ("adagrad", "rowwise_adagrad"):
        spec.update(eps=float(args["eps"]), lr_decay=float(args["lr_decay"]),
                    initial_accumulator_value=float(args["initial_accumulator_value"]))
    if kind == "adam":
        beta1, beta2 = args["betas"]
        if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):
            raise ValueError(f"{where}: adam betas must be in [0, 1), got {args['betas']!r}")
        spec.update(eps=float(args["eps"]), beta1=float(beta1), beta2=float(beta2))
    if spec["weight_decay"] < 0 or spec.get("eps", 0.0) < 0:
        raise ValueError(f"{where}: weight_decay and eps must be >= 0, got {spec['weight_decay']} and {spec.get('eps')}")
    return OptimizerSpec(**spec)


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
        group = self.param_groups[0]
        return tuple(float(group[name]) for name in _HYPERPARAMS)

    def step(self, closure: Optional[Callable[[], Any]] = None) -> None:
        if closure is not None:
            closure()

    def zero_grad(self, set_to_none: bool = False) -> None:
        pass
