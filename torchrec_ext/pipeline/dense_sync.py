"""The dense (data-parallel) half of a step, done by the pipeline instead of DDP's hooks.

``FlatGradSync`` all-reduces every dense gradient in one flat buffer after the backward, and on
CUDA captures that work (flatten, all-reduce, unflatten, and the dense optimizer step when the
optimizer is capturable) in a CUDA graph replayed every step. ``GraphedForward`` captures a
dense submodule's forward and backward (``torch.cuda.make_graphed_callables``) for the batch
shape it first sees, and runs eagerly for any other shape (the last partial batch).

Both belong to the model, not to a pipeline: one ``FlatGradSync`` per DDP module and one
``GraphedForward`` per submodule, shared by every pipeline built on that model (a job builds one
per train segment), so a segment replays the graphs the first one captured. Every capture runs
with the process's helper threads held off the device (``DEVICE_WORK``), after the work in flight
of threads the gate does not hold is joined (the pipeline's ``join_before_capture``: the tiered
tables' stage).
"""

import functools
import logging
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from torchrec_ext.pipeline.quiesce import DEVICE_WORK, DeviceWorkGate, quiesced
from torchrec_ext.pipeline.streams import ReplayFence

logger = logging.getLogger(__name__)


def data_parallel_parameters(ddp: DistributedDataParallel) -> list[nn.Parameter]:
    """The parameters DDP would all-reduce: all but the ones it was told to ignore (the
    sharded embedding tables, updated by their fused optimizers)."""
    ignored = set(getattr(ddp, "parameters_to_ignore", ()))
    return [p for n, p in ddp.module.named_parameters() if p.requires_grad and n not in ignored]


class DdpTakeover:
    """A communication hook on DDP that skips its all-reduce while ``skip`` is set (the
    pipeline then all-reduces itself) and does DDP's default all-reduce otherwise, so the model
    trains correctly outside the pipeline too.

    A hook rather than ``no_sync``: it keeps DDP's own bookkeeping intact under every DDP mode
    (TorchRec builds DDP with ``static_graph=True``, where ``no_sync`` breaks). DDP takes one
    hook for life, so one takeover per DDP module serves every pipeline built on it."""

    def __init__(self, process_group: dist.ProcessGroup | None) -> None:
        self.process_group = process_group
        self.skip = False

    @classmethod
    def of(cls, ddp: DistributedDataParallel) -> "DdpTakeover":
        takeover = getattr(ddp, "_torchrec_ext_takeover", None)
        if takeover is None:
            takeover = cls(ddp.process_group)
            try:
                ddp.register_comm_hook(takeover, _takeover_hook)
            except RuntimeError as e:
                raise ValueError(
                    f"TrainPipeline: cannot take over DDP's all-reduce ({e}); the model already has a "
                    "communication hook. Pass PipelineOptions(flat_dense_allreduce=False) to keep DDP's"
                ) from None
            ddp._torchrec_ext_takeover = takeover
        return takeover


# DDP checks a hook's annotations, so they are real types here (no postponed annotations).
def _takeover_hook(state: DdpTakeover, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    if not state.skip:
        return default_hooks.allreduce_hook(state.process_group, bucket)
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    done.set_result(bucket.buffer())
    return done


class FlatGradSync:
    """Averages dense gradients over ``group`` with one all-reduce of a flat buffer (one per
    gradient dtype, as DDP's buckets: a float32 gradient keeps its bits beside bfloat16 ones).

    Averaging divides before the sum, as DDP's default hook does, so results match DDP's bit for
    bit where the division by the world size is exact (powers of two).

    With ``capture``, steps after the warm-up replay a CUDA graph of that work (and of the dense
    optimizer step when given one), captured when there is work to capture: not at world size 1
    without an optimizer step. The graph reads the gradients where they were at capture; should
    they move (set to None and re-made outside the pipeline), it is captured again; so it is
    when a captured optimizer step's float hyperparameters change (an LR scheduler: the graph
    holds them as constants; a tensor lr avoids the captures).
    """

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        group: dist.ProcessGroup | None,
        *,
        capture: bool = False,
        optimizer: torch.optim.Optimizer | None = None,
        warmup_steps: int = 3,
    ) -> None:
        self._params = list(params)
        self._group = group
        self._world = dist.get_world_size(group) if dist.is_initialized() else 1
        self._capture = capture
        self._optimizer = optimizer
        self._warmup_steps = warmup_steps
        self._steps = 0
        self._graph: torch.cuda.CUDAGraph | None = None
        self._graphed_grads: tuple = ()  # data_ptr of each gradient the graph reads, the optimizer's constants
        self._flat: dict[torch.dtype, torch.Tensor] | None = None  # a buffer per gradient dtype

    @classmethod
    def of(
        cls, ddp: DistributedDataParallel, *, capture: bool, optimizer: torch.optim.Optimizer | None
    ) -> "FlatGradSync":
        """The DDP module's sync (one per module: pipelines built on it share its graph); a new
        one when asked for another capture setting or optimizer."""
        sync = _grad_syncs.get(ddp)
        if sync is None or sync._capture != capture or sync._optimizer is not optimizer:
            sync = cls(data_parallel_parameters(ddp), ddp.process_group, capture=capture, optimizer=optimizer)
            _grad_syncs[ddp] = sync
        return sync

    @property
    def steps_optimizer(self) -> bool:
        """True when the captured graph also runs the dense optimizer step."""
        return self._capture and self._optimizer is not None

    @property
    def graphed(self) -> bool:
        """Whether steps after the warm-up replay a graph: only when it would hold work."""
        return self.steps_optimizer or (self._capture and self._world > 1 and bool(self._params))

    def __call__(
        self,
        gate: DeviceWorkGate = DEVICE_WORK,
        timeout_s: float = 600.0,
        join_before_capture: Sequence[Callable[[], None]] = (),
    ) -> None:
        """Syncs the gradients of the step just run (and steps the optimizer if captured). A
        capture first calls each ``join_before_capture`` (device work of threads the gate does not
        hold), then holds ``gate`` closed, waiting at most ``timeout_s`` for the helper threads."""
        self._steps += 1
        if not self.graphed or self._steps <= self._warmup_steps:
            self._step_eagerly()
            return
        grads = [g.data_ptr() for g in self._grads()]
        baked = (grads, self._baked_hyperparameters())
        if self._graph is None or baked != self._graphed_grads:
            if self._graph is not None:
                logger.info(
                    "FlatGradSync: gradients moved or optimizer hyperparameters changed since the capture; capturing again"
                )
            self._graph = None
            graph = torch.cuda.CUDAGraph()
            # thread_local: a helper thread's CUDA call cannot invalidate this capture.
            with (
                quiesced(gate, timeout_s, join_before_capture),
                torch.cuda.graph(graph, capture_error_mode="thread_local"),
            ):
                self._step_eagerly()
            self._graph, self._graphed_grads = graph, baked
        self._graph.replay()

    def _baked_hyperparameters(self) -> list[dict]:
        """What a captured optimizer step holds as constants: each param group's hyperparameters
        that are not tensors (a scheduler's new float lr never reaches a replay; a tensor lr is
        read from its memory at each one). Empty when the graph does not step the optimizer."""
        if not self.steps_optimizer:
            return []
        return [
            {k: v for k, v in group.items() if k != "params" and not isinstance(v, torch.Tensor)}
            for group in self._optimizer.param_groups
        ]

    def _step_eagerly(self) -> None:
        self._sync()
        if self.steps_optimizer:
            self._optimizer.step()

    def _grads(self) -> list[torch.Tensor]:
        for p in self._params:
            if p.grad is None:  # every rank must reduce the same buffer
                p.grad = torch.zeros_like(p)
        return [p.grad for p in self._params]

    def _sync(self) -> None:
        if self._world == 1 or not self._params:
            return
        grads = self._grads()
        # One flat buffer per gradient dtype (as DDP's buckets): a float32 gradient reduced in a
        # bfloat16 buffer would lose its low bits. Dtypes in order of first appearance, the same
        # on every rank.
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for grad in grads:
            by_dtype.setdefault(grad.dtype, []).append(grad)
        if self._flat is None:
            self._flat = {
                dtype: torch.empty(sum(g.numel() for g in same), dtype=dtype, device=same[0].device)
                for dtype, same in by_dtype.items()
            }
        for dtype, same in by_dtype.items():
            flat = self._flat[dtype]
            views = flat.split([g.numel() for g in same])
            for view, grad in zip(views, same):
                view.copy_(grad.reshape(-1))
            flat.div_(self._world)
            dist.all_reduce(flat, group=self._group)
            for view, grad in zip(views, same):
                grad.copy_(view.view_as(grad))


# DDP module -> its FlatGradSync (weak: a dropped model takes its graph with it)
_grad_syncs: "weakref.WeakKeyDictionary[DistributedDataParallel, FlatGradSync]" = weakref.WeakKeyDictionary()


class _CapturedForward(nn.Module):
    """What make_graphed_callables captures: the module's original forward. The module is a
    child here so its parameters are the callable's parameters."""

    def __init__(self, module: nn.Module, original_forward) -> None:
        super().__init__()
        self.module = module
        self._original_forward = original_forward

    def forward(self, *args):
        return self._original_forward(*args)


class _CopyGrad(torch.autograd.Function):
    """Identity whose backward hands on a copy of the gradient, not the tensor it was given."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.clone()


def _copy_if_kept(param_ref: "weakref.ref[nn.Parameter]", grad: torch.Tensor) -> torch.Tensor | None:
    # Autograd keeps the incoming tensor as .grad when there is none yet (no copy); a copy
    # then, so .grad never is the graph's static buffer. With a .grad, it adds in place: no copy.
    param = param_ref()
    return grad.clone() if param is not None and param.grad is None else None


def without_static_grads(graphed, params: Sequence[nn.Parameter]):
    """``graphed`` (from ``make_graphed_callables``) whose gradients never alias its static buffers.

    Its backward returns the graph's static gradient buffers (detached). Autograd would keep
    such a tensor as a parameter's ``.grad`` when that is None (and as a leaf input's ``.grad``),
    and the next replay overwrites it in place: with ``zero_grad(set_to_none=False)`` the next
    step's accumulation then adds the buffer to itself (doubled gradients), and a kept input
    gradient changes under its holder. So parameters get a copy when they have no ``.grad`` yet
    (a hook, registered here once), and inputs that need a gradient get a copy always."""
    for param in params:
        if param.requires_grad:
            param.register_hook(functools.partial(_copy_if_kept, weakref.ref(param)))

    def call(*args: Any):
        return graphed(*(_CopyGrad.apply(a) if isinstance(a, torch.Tensor) and a.requires_grad else a for a in args))

    return call


class GraphedForward:
    """Replaces ``module.forward``: CUDA training calls run through graphs (forward and
    backward) captured at the first such call; calls with other input shapes, in eval mode or
    on CPU run the original forward. The module, its parameters and state-dict keys stay as
    they were. ``install`` puts one on a module once: later pipelines reuse it and its graphs.

    A replay overwrites the graph's static outputs, which the previous step's outputs alias:
    ``outputs_read`` collects the events of reads still under way on other streams (the pinned
    copy of a step's outputs), and the next replay waits for them."""

    def __init__(self, module: nn.Module) -> None:
        self._module = module
        self._original = module.forward
        self._graphed: Any = None
        self._signature: tuple | None = None
        self.outputs_read = ReplayFence()
        self.gate: DeviceWorkGate = DEVICE_WORK
        self.capture_timeout_s = 600.0
        self.join_before_capture: Sequence[Callable[[], None]] = ()  # set by the pipeline using it
        module.forward = self

    @classmethod
    def install(cls, module: nn.Module) -> "GraphedForward":
        """The module's GraphedForward: the one already in place, or a new one."""
        current = module.__dict__.get("forward")
        return current if isinstance(current, GraphedForward) else cls(module)

    @staticmethod
    def _signature_of(args) -> tuple:
        return tuple((tuple(a.shape), a.dtype, a.requires_grad) if isinstance(a, torch.Tensor) else a for a in args)

    def __call__(self, *args: Any):
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if not self._module.training or not tensors or not tensors[0].is_cuda:
            return self._original(*args)
        signature = self._signature_of(args)
        if self._graphed is None:
            sample = tuple(
                a.detach().clone().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a for a in args
            )
            # make_graphed_callables captures in global mode (it takes no capture_error_mode):
            # holding the helper threads off the device is what keeps the capture valid.
            with quiesced(self.gate, self.capture_timeout_s, self.join_before_capture):
                self._graphed = without_static_grads(
                    torch.cuda.make_graphed_callables(_CapturedForward(self._module, self._original), sample),
                    list(self._module.parameters()),
                )
            self._signature = signature
            logger.info("captured %s in CUDA graphs for inputs %s", type(self._module).__name__, signature)
        if signature != self._signature:
            return self._original(*args)
        self.outputs_read.before_replay(torch.cuda.current_stream(tensors[0].device))
        return self._graphed(*args)
