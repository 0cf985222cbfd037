"""Fused optimizers of dynamic tables: which update rule, its hyper-parameters, and the
TorchRec ``KeyedOptimizer`` that exposes them (learning-rate changes, checkpoints).

An optimizer is chosen the TorchRec ways: ``torchrec.optim.apply_optimizer_in_backward(cls,
params, kwargs)`` on the module's parameters, the module's ``optimizer`` / ``optimizer_kwargs``
arguments, ``fuse_embedding_optimizer(model, cls, kwargs, device)``, or the sharder's
``fused_params`` (``{"optimizer": EmbOptimType..., "learning_rate": ...}``). The classes
understood are torch.optim.SGD, Adagrad, Adam and AdamW (and Adam with
``decoupled_weight_decay=True``, which is AdamW), torchrec.optim.RowWiseAdagrad, and
``torchrec_ext.modules.Ftrl`` (FTRL-Proximal, which torch and fbgemm lack: named the way TorchRec
names RowWiseAdagrad, by a torch.optim class), also as names ("sgd", ..., "adamw", "ftrl") or as
fbgemm EmbOptimType values (ADAM with WeightDecayMode.DECOUPLE is AdamW). The update on each
touched row is exactly that class's update; defaults are that class's own (fbgemm's TBE
defaults for ``fused_params``). With none chosen, the tables train with ``DEFAULT_OPTIMIZER``,
as TorchRec's sharded tables do.

Row-sparse semantics: only the rows a batch touches take a step (their decay, for AdamW, too),
with the module's step count for Adam's bias correction (TorchRec's fused Adam does the same);
a dense torch optimizer also moves untouched rows (Adam's momentum, AdamW's decay), so the two
agree where every row is touched every step.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torchrec.optim.fused import FusedOptimizer

from torchrec_ext.modules.configs import check_finite
from torchrec_ext.modules.ftrl import Ftrl, check_ftrl_hyperparams
from torchrec_ext.vocabulary import COMMON_HYPERPARAMS, FTRL_HYPERPARAMS, OPTIMIZERS

# The hyper-parameters every kind's param group holds (and the kernels read), then FTRL's own.
_HYPERPARAMS = COMMON_HYPERPARAMS
_FTRL_HYPERPARAMS = FTRL_HYPERPARAMS


def _torch_classes() -> dict[str, type]:
    from torchrec.optim import RowWiseAdagrad

    return {
        "sgd": torch.optim.SGD,
        "adagrad": torch.optim.Adagrad,
        "rowwise_adagrad": RowWiseAdagrad,
        "adam": torch.optim.Adam,
        "adamw": torch.optim.AdamW,
        "ftrl": Ftrl,
    }


# fbgemm's EmbOptimType names, as TorchRec's sharder fused_params use them.
_EMB_OPTIM_TYPES = {
    "SGD": "sgd",
    "EXACT_SGD": "sgd",
    "EXACT_ADAGRAD": "adagrad",
    "EXACT_ROWWISE_ADAGRAD": "rowwise_adagrad",
    "ROWWISE_ADAGRAD": "rowwise_adagrad",
    "ADAM": "adam",
}
# Arguments each kind accepts (besides torch's bookkeeping ones), and the values it must keep.
_ADAMW_KWARGS = {
    "lr",
    "betas",
    "eps",
    "weight_decay",
    "amsgrad",
    "maximize",
    "foreach",
    "capturable",
    "differentiable",
    "fused",
}
_ACCEPTED = {
    "sgd": {
        "lr",
        "weight_decay",
        "momentum",
        "dampening",
        "nesterov",
        "maximize",
        "foreach",
        "differentiable",
        "fused",
    },
    "adagrad": {
        "lr",
        "lr_decay",
        "weight_decay",
        "initial_accumulator_value",
        "eps",
        "maximize",
        "foreach",
        "differentiable",
        "fused",
    },
    "rowwise_adagrad": {"lr", "lr_decay", "weight_decay", "initial_accumulator_value", "eps", "maximize"},
    "adam": _ADAMW_KWARGS | {"decoupled_weight_decay"},
    "adamw": _ADAMW_KWARGS,
    "ftrl": {"lr", "lr_power", "l1", "l2", "beta", "initial_accumulator_value"},
}
_MUST_BE = {"momentum": 0, "nesterov": False, "maximize": False, "amsgrad": False}
# The hyper-parameters each kind reads from its kwargs (betas aside), all finite and >= 0.
_SPEC_FIELDS = {
    "sgd": ("lr", "weight_decay"),
    "adagrad": ("lr", "eps", "weight_decay", "lr_decay", "initial_accumulator_value"),
    "rowwise_adagrad": ("lr", "eps", "weight_decay", "lr_decay", "initial_accumulator_value"),
    "adam": ("lr", "eps", "weight_decay"),
    "adamw": ("lr", "eps", "weight_decay"),
    "ftrl": ("lr",) + _FTRL_HYPERPARAMS + ("initial_accumulator_value",),
}
_ADAM_KINDS = ("adam", "adamw")


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
    lr_power: float = 0.0  # FTRL's four
    l1: float = 0.0
    l2: float = 0.0
    beta: float = 0.0

    @property
    def kind_id(self) -> int:
        return OPTIMIZERS[self.kind]

    def hyperparam_names(self) -> tuple[str, ...]:
        """The names the kernels read, in their order (FTRL's four only for FTRL)."""
        return _HYPERPARAMS + (_FTRL_HYPERPARAMS if self.kind == "ftrl" else ())

    def param_group(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in self.hyperparam_names() + ("initial_accumulator_value",)}

    def initial_state_values(self) -> tuple[float, ...]:
        """Each optimizer state's value on a new row, in OPTIMIZER_STATES order: Adagrad kinds'
        and FTRL's accumulator start at initial_accumulator_value, Adam's moments and FTRL's
        linear at 0."""
        if self.kind in ("adagrad", "rowwise_adagrad"):
            return (self.initial_accumulator_value,)
        if self.kind == "ftrl":
            return (self.initial_accumulator_value, 0.0)
        return (0.0, 0.0) if self.kind in _ADAM_KINDS else ()

    def torch_class(self) -> type:
        return _torch_classes()[self.kind]

    def torch_kwargs(self) -> dict[str, Any]:
        """The kwargs of ``torch_class()`` that give this spec back."""
        kwargs: dict[str, Any] = {"lr": self.lr, "weight_decay": self.weight_decay}
        if self.kind in ("adagrad", "rowwise_adagrad"):
            kwargs.update(
                eps=self.eps, lr_decay=self.lr_decay, initial_accumulator_value=self.initial_accumulator_value
            )
        if self.kind in _ADAM_KINDS:
            kwargs.update(eps=self.eps, betas=(self.beta1, self.beta2))
        if self.kind == "ftrl":
            kwargs = {
                name: getattr(self, name) for name in ("lr",) + _FTRL_HYPERPARAMS + ("initial_accumulator_value",)
            }
        return kwargs


def resolve_optimizer(optimizer: Any, kwargs: Mapping[str, Any] | None, where: str) -> OptimizerSpec:
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
    args = dict(_class_defaults(_torch_classes()[kind]))  # Adam's defaults for Adam(decoupled_weight_decay=True)
    args.update(kwargs)
    if kind == "adam" and bool(args.pop("decoupled_weight_decay", False)):
        kind = "adamw"  # torch.optim.Adam's decoupled weight decay is AdamW's update
    if kind == "ftrl":
        spec: dict[str, Any] = check_ftrl_hyperparams(
            {name: args[name] for name in _SPEC_FIELDS[kind]}, f"{where}: ftrl"
        )
    else:
        spec = {name: _hyperparam(args[name], f"{where}: {kind} {name}") for name in _SPEC_FIELDS[kind]}
    spec["kind"] = kind
    if kind in _ADAM_KINDS:
        betas = args["betas"]
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise TypeError(f"{where}: {kind} betas must be a pair (beta1, beta2), got {betas!r}")
        spec["beta1"], spec["beta2"] = (_beta(b, f"{where}: {kind} betas[{i}]") for i, b in enumerate(betas))
    return OptimizerSpec(**spec)


def _hyperparam(value: Any, what: str) -> float:
    """``value`` as a float, refusing what torch's own optimizers refuse (negative values) and
    NaN / inf, which would turn every touched row NaN at its first update."""
    return check_finite(value, what, minimum=0.0)


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
        f"{where}: optimizer must be torch.optim.SGD/Adagrad/Adam/AdamW, torchrec.optim.RowWiseAdagrad, "
        f"torchrec_ext.modules.Ftrl, one of {sorted(OPTIMIZERS)} or an EmbOptimType of those, got {optimizer!r}"
    )


# What TorchRec's sharded tables train with when no optimizer is given: fbgemm's TBE defaults
# (optimizer=EmbOptimType.EXACT_SGD, learning_rate=0.01), which TorchRec's sharders keep.
DEFAULT_OPTIMIZER = OptimizerSpec(kind="sgd", lr=0.01)

# fused_params keys that tune fbgemm's kernels and caches but not the values trained: ignored
# (but cache_load_factor and cache_algorithm, which size and order tiered tables' caches:
# distributed/tier_plan.py).
_FUSED_PARAMS_HINTS = {
    "cache_load_factor",
    "cache_algorithm",
    "cache_reserved_memory",
    "cache_precision",
    "prefetch_pipeline",
    "enforce_hbm",
    "bounds_check_mode",
    "gather_uvm_cache_stats",
    "record_cache_metrics",
}
# fbgemm's TBE defaults for the optimizer keys of fused_params.
_FUSED_PARAMS_DEFAULTS = {"learning_rate": 0.01, "eps": 1.0e-8, "beta1": 0.9, "beta2": 0.999, "weight_decay": 0.0}


def stochastic_rounding_of(fused_params: Mapping[str, Any] | None, where: str) -> bool | None:
    """fbgemm's ``stochastic_rounding`` fused_param (how FP16 / BF16 rows are written), or None
    when not given (each table's config then decides)."""
    value = (fused_params or {}).get("stochastic_rounding")
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"{where}: fused_params stochastic_rounding must be a bool, got {value!r}")
    return value


# fbgemm's SparseType names of the output dtypes TorchRec's sharded tables give (TBE ``output_dtype``).
_OUTPUT_DTYPES = {"FP32": torch.float32, "FP16": torch.float16, "BF16": torch.bfloat16}


def output_dtype_of(fused_params: Mapping[str, Any] | None, where: str) -> torch.dtype:
    """fbgemm's ``output_dtype`` fused_param (a SparseType, its name, or the torch dtype): the
    dtype of a sharded module's outputs, float32 when not given, as TorchRec's sharded tables.
    Lookups still accumulate in float32; the output is cast once (its gradient back to float32)."""
    value = (fused_params or {}).get("output_dtype")
    if value is None:
        return torch.float32
    if isinstance(value, torch.dtype):
        if value in _OUTPUT_DTYPES.values():
            return value
    else:
        name = value if isinstance(value, str) else getattr(value, "name", None)
        if isinstance(name, str) and name.upper() in _OUTPUT_DTYPES:
            return _OUTPUT_DTYPES[name.upper()]
    raise ValueError(
        f"{where}: fused_params output_dtype {value!r} is not supported by dynamic tables; they give "
        f"SparseType {sorted(_OUTPUT_DTYPES)} outputs"
    )


def spec_from_fused_params(fused_params: Mapping[str, Any] | None, where: str) -> OptimizerSpec | None:
    """The spec a TorchRec sharder's ``fused_params`` ask for (None when none are given).

    ``optimizer`` (an EmbOptimType, or its name) defaults to EXACT_SGD and ``learning_rate``,
    ``eps``, ``beta1``, ``beta2``, ``weight_decay`` to fbgemm's TBE defaults, as TorchRec's
    sharded tables do. fbgemm applies ``weight_decay`` only with a ``weight_decay_mode``: L2 (the
    decay torch's optimizers apply), or DECOUPLE for ADAM (fbgemm's AdamW: the weight decays by
    lr * weight_decay * w beside Adam's step, torch.optim.AdamW's update); other modes, other
    optimizers and other keys that change the trained values are refused, naming what is
    supported. FTRL has no EmbOptimType: choose it on the module (``Ftrl`` or "ftrl").
    """
    if fused_params is None:
        return None
    output_dtype_of(fused_params, where)  # checked with the rest, up front (the sharder's constructor)
    unknown = sorted(
        set(fused_params)
        - set(_FUSED_PARAMS_DEFAULTS)
        - _FUSED_PARAMS_HINTS
        - {"optimizer", "weight_decay_mode", "stochastic_rounding", "output_dtype"}
    )
    if unknown:
        raise ValueError(
            f"{where}: fused_params {unknown} are not supported by dynamic tables; they take "
            f"'optimizer', 'weight_decay_mode', 'stochastic_rounding', 'output_dtype', "
            f"{sorted(_FUSED_PARAMS_DEFAULTS)} "
            f"(and ignore the kernel hints {sorted(_FUSED_PARAMS_HINTS)})"
        )
    optimizer = fused_params.get("optimizer", "EXACT_SGD")
    name = optimizer if isinstance(optimizer, str) else getattr(optimizer, "name", None)
    if name not in _EMB_OPTIM_TYPES:
        raise ValueError(
            f"{where}: fused_params optimizer {optimizer!r} is not supported by dynamic tables; "
            f"they support EmbOptimType {sorted(_EMB_OPTIM_TYPES)}"
        )
    args = {**_FUSED_PARAMS_DEFAULTS, **{k: v for k, v in fused_params.items() if k in _FUSED_PARAMS_DEFAULTS}}
    mode = fused_params.get("weight_decay_mode")
    mode_name = None if mode is None else (mode if isinstance(mode, str) else getattr(mode, "name", repr(mode)))
    kind = _EMB_OPTIM_TYPES[name]
    decoupled = mode_name == "DECOUPLE" and kind == "adam"
    if mode_name not in (None, "NONE", "L2") and not decoupled:
        raise ValueError(
            f"{where}: fused_params weight_decay_mode {mode!r} is not supported by dynamic tables"
            f"{' with ' + name if mode_name == 'DECOUPLE' else ''}; they support WeightDecayMode.NONE "
            "and L2, and DECOUPLE with ADAM"
        )
    if mode_name not in ("L2", "DECOUPLE") and args["weight_decay"] != 0:
        raise ValueError(
            f"{where}: fused_params weight_decay={args['weight_decay']!r} without weight_decay_mode="
            "WeightDecayMode.L2 does nothing in fbgemm; set weight_decay_mode L2 (torch's decay) "
            "or leave weight_decay out"
        )
    if decoupled:
        kind = "adamw"
    kwargs: dict[str, Any] = {"lr": args["learning_rate"], "weight_decay": args["weight_decay"]}
    if kind != "sgd":
        kwargs["eps"] = args["eps"]
    if kind in _ADAM_KINDS:
        kwargs["betas"] = (args["beta1"], args["beta2"])
    return resolve_optimizer(kind, kwargs, f"{where}: fused_params")


# END


def _class_defaults(cls: type) -> dict[str, Any]:
    return {
        name: p.default
        for name, p in inspect.signature(cls.__init__).parameters.items()
        if p.default is not inspect.Parameter.empty
    }


def kwargs_copy(kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """Optimizer kwargs as they are now, out of reach of later in-place edits of the caller's
    objects (a list inside them, such as Adam's betas, too): what a marker is compared with to
    see a change, and what a call that reads its kwargs once keeps."""
    return copy.deepcopy(dict(kwargs or {}))


def _undo_torchrec_sharder_edits(cls: Any, kwargs: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``apply_optimizer_in_backward`` gives every parameter of one call the same kwargs dict,
    and TorchRec's sharders edit it in place for their fbgemm tables: they add ``optimizer`` (the
    class's EmbOptimType) and rename ``lr`` to ``learning_rate``. A model whose TorchRec tables and
    ours shared one call hands ours that dict: read it back in torch's form."""
    kwargs = dict(kwargs)
    if "learning_rate" in kwargs and "lr" not in kwargs:
        kwargs["lr"] = kwargs.pop("learning_rate")
    if "optimizer" in kwargs:
        named = kwargs.pop("optimizer")
        if _kind_of(named, where) != _kind_of(cls, where):
            raise ValueError(
                f"{where}: the optimizer kwargs name optimizer={named!r}, which is not the optimizer class "
                f"{getattr(cls, '__name__', cls)} given to apply_optimizer_in_backward"
            )
    return kwargs


def spec_from_parameter(param: Tensor, where: str) -> OptimizerSpec | None:
    """The spec set on a parameter by ``apply_optimizer_in_backward`` (the latest call wins)."""
    classes = getattr(param, "_optimizer_classes", None)
    if not classes:
        return None
    cls, kwargs = classes[-1], param._optimizer_kwargs[-1]
    cached = getattr(param, "_torchrec_ext_spec", None)
    if cached is not None and cached[0] is cls and cached[1] == kwargs:
        return cached[2]
    spec = resolve_optimizer(cls, _undo_torchrec_sharder_edits(cls, kwargs, where), where)
    param._torchrec_ext_spec = (cls, kwargs_copy(kwargs), spec)
    return spec


class DynamicEmbeddingFusedOptimizer(FusedOptimizer):
    """The ``KeyedOptimizer`` of a module's dynamic tables.

    Updates happen in backward; ``step()`` / ``zero_grad()`` do nothing, and the hyper-parameters
    of ``param_groups[0]`` (which LR schedulers change) are read at every backward. ``state``
    holds, per table parameter, the step count (``<table>.step``); the per-row state (momenta)
    is saved with the rows themselves, in the module's ``state_dict`` (``optimizer.<name>``).
    """

    def __init__(self, params: dict[str, Tensor], state: dict[Tensor, dict[str, Tensor]], spec: OptimizerSpec):
        self.spec = spec
        super().__init__(params, state, [dict(spec.param_group(), params=list(params.values()))])

    def hyperparams(self) -> tuple[float, ...]:
        """The update's hyper-parameters (``spec.hyperparam_names()``), checked as the constructor's
        are: LR schedulers and optimizer checkpoints write ``param_groups`` directly."""
        group = self.param_groups[0]
        where = f"{type(self).__name__}: param_groups[0]"
        names = self.spec.hyperparam_names()

        def label(name: str) -> str:
            return f"{where}[{name!r}]"

        # The state's initial value is the spec's (new rows take it), so it is checked with the group's others.
        ftrl = (
            check_ftrl_hyperparams(
                {
                    **{n: group[n] for n in ("lr",) + _FTRL_HYPERPARAMS},
                    "initial_accumulator_value": self.spec.initial_accumulator_value,
                },
                where,
                label,
            )
            if self.spec.kind == "ftrl"
            else {}
        )
        return tuple(
            ftrl[name]
            if name in ftrl
            else (_beta if name in ("beta1", "beta2") else _hyperparam)(group[name], label(name))
            for name in names
        )

    def step(self, closure: Callable[[], Any] | None = None) -> None:
        if closure is not None:
            closure()

    def zero_grad(self, set_to_none: bool = False) -> None:
        pass
