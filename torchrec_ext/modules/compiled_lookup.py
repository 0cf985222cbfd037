"""A training forward of DynamicEmbeddingBagCollection as one opaque op, so that
``torch.compile(model, fullgraph=True)`` holds in training (forward compiled, its backward run
by AOTAutograd's backward graph), as it does for TorchRec's EmbeddingBagCollection.

Under Dynamo the module's lookup (checks, id -> row insertion, pooling) is a custom op whose
fake says only the output's shape, [batch_size, total_dim]; its registered backward is a second
op that runs the fused optimizer update (and the per-sample weights' gradient). Both run the
module's eager code (``PooledLookupFunction``'s forward / backward), so compiled training
updates the tables exactly as eager training does.

An op takes tensors and scalars, not modules: the module is named by a handle (its ``id``, kept
in a weak registry when Dynamo traces the call). What the backward needs (the lookup's rows,
the arranged batch) waits in ``_PENDING`` under a token the forward returns. The backward op's
only effect is on the tables, so that no compiler drops it as dead code it returns the
gradient of ``_ANCHOR``, an empty tensor that requires grad and that every forward op reads.
"""

from __future__ import annotations

import itertools
import weakref
from collections import OrderedDict
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_ext.modules.base import PooledLookupFunction
from torchrec_ext.modules.features import check_and_arrange

_OWNERS: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_PENDING: OrderedDict[int, SimpleNamespace] = OrderedDict()  # token -> what its backward needs
MAX_PENDING = 64  # forwards never followed by their backward (a grad-enabled eval loop): oldest dropped
_TOKENS = itertools.count()
_ANCHOR = torch.zeros(0, requires_grad=True)
KEY_SEPARATOR = "\x00"


@torch.compiler.assume_constant_result
def _owner_handle(module: Any) -> int:
    # Runs when Dynamo traces the call (its result is a constant of the graph), so the module is
    # registered before the compiled graph can run.
    _OWNERS[id(module)] = module
    return id(module)


def _owner(handle: int) -> Any:
    module = _OWNERS.get(handle)
    if module is None:
        raise RuntimeError("torchrec_ext: a compiled graph calls a dynamic collection that no longer exists")
    return module


@torch.library.custom_op("torchrec_ext::compiled_pooled_lookup", mutates_args=())
def compiled_pooled_lookup(
    handle: int,
    keys: str,
    values: Tensor,
    lengths: Tensor,
    weights: Tensor | None,
    stride: int,
    total_dim: int,
    backward_follows: bool,
    anchor: Tensor,
) -> tuple[Tensor, Tensor]:
    """The module's eager pooled lookup (inserting in training); returns (pooled, token).
    ``keys``: the KJT's keys joined by KEY_SEPARATOR (an op takes no list of strings)."""
    module = _owner(handle)
    weight_leaf = None
    if weights is not None and backward_follows:  # the gradient is mapped back to the KJT's order by autograd
        weight_leaf = weights.detach().requires_grad_()
    with torch.enable_grad():
        kjt = KeyedJaggedTensor(
            keys=keys.split(KEY_SEPARATOR) if keys else [],
            values=values,
            lengths=lengths,
            weights=weight_leaf if weight_leaf is not None else weights,
            stride=stride,
        )
        batch = check_and_arrange(kjt, module._plan, module._is_weighted, type(module).__name__, module.device)
    with torch.set_grad_enabled(backward_follows):
        lookup = module._lookup_rows(batch)
    ctx = SimpleNamespace()
    pooled = PooledLookupFunction.forward(ctx, module, lookup, batch, batch.weights)
    token = next(_TOKENS)
    if backward_follows:
        ctx.handle, ctx.weight_leaf = handle, weight_leaf
        _PENDING[token] = ctx
        while len(_PENDING) > MAX_PENDING:
            _PENDING.popitem(last=False)
    return pooled.detach(), torch.tensor([token], dtype=torch.int64)


@compiled_pooled_lookup.register_fake
def _(handle, keys, values, lengths, weights, stride, total_dim, backward_follows, anchor):
    return values.new_empty(stride, total_dim, dtype=torch.float32), values.new_empty(1, dtype=torch.int64)


@torch.library.custom_op("torchrec_ext::compiled_pooled_update", mutates_args=())
def compiled_pooled_update(token: Tensor, grad: Tensor, weights: Tensor | None) -> tuple[Tensor, Tensor]:
    """The fused optimizer update of the forward ``token`` names; returns (the anchor's empty
    gradient, the per-sample weights' gradient in the KJT's order, or an empty tensor)."""
    ctx = _PENDING.pop(int(token.item()), None)
    if ctx is None:
        raise RuntimeError(
            "torchrec_ext: a compiled backward ran after its forward's lookup was dropped (more than "
            f"{MAX_PENDING} forwards of one graph without their backward) or twice"
        )
    module = _owner(ctx.handle)
    ctx.needs_input_grad = (False, False, False, ctx.weight_leaf is not None)
    grads = PooledLookupFunction.backward(ctx, grad.contiguous())
    weights_grad = grad.new_zeros(0)
    if ctx.weight_leaf is not None:
        (weights_grad,) = torch.autograd.grad(ctx.batch.weights, ctx.weight_leaf, grads[3])
    del module
    return _ANCHOR.detach().new_zeros(0), weights_grad


@compiled_pooled_update.register_fake
def _(token, grad, weights):
    return grad.new_empty(0), (torch.empty_like(weights) if weights is not None else grad.new_empty(0))


def _setup_context(ctx, inputs, output) -> None:
    weights, backward_follows = inputs[4], inputs[7]
    ctx.backward_follows = backward_follows
    ctx.save_for_backward(output[1], weights if weights is not None and backward_follows else None)


def _backward(ctx, grad_pooled: Tensor, _grad_token: Tensor | None):
    token, weights = ctx.saved_tensors
    anchor_grad, weights_grad = torch.ops.torchrec_ext.compiled_pooled_update(token, grad_pooled, weights)
    wants_weights = ctx.needs_input_grad[4]
    return None, None, None, None, weights_grad if wants_weights else None, None, None, None, anchor_grad


compiled_pooled_lookup.register_autograd(_backward, setup_context=_setup_context)


def compiled_pooled_forward(module: Any, features: KeyedJaggedTensor, backward_follows: bool) -> Tensor:
    """The pooled [batch_size, total_dim] output of ``module``'s lookup of ``features``, as one
    op of the graph Dynamo traces (``features`` has one batch size for all features)."""
    pooled, _token = torch.ops.torchrec_ext.compiled_pooled_lookup(
        _owner_handle(module),
        KEY_SEPARATOR.join(features.keys()),
        features.values(),
        features.lengths(),
        features.weights_or_none(),
        features.stride(),
        module._plan.total_dim,
        backward_follows,
        _ANCHOR,
    )
    return pooled
