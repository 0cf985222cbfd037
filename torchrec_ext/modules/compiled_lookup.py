"""A training forward of DynamicEmbeddingBagCollection / DynamicEmbeddingCollection as one
opaque op, so that ``torch.compile(model, fullgraph=True)`` holds in training (forward compiled,
its backward run by AOTAutograd's backward graph), as it does for TorchRec's modules.

Under Dynamo the module's lookup (checks, id -> row insertion, pooling) is a custom op whose
fake says only the output's shape, [batch_size, total_dim]; its registered backward is a second
op that runs the fused optimizer update (and the per-sample weights' gradient). Both run the
module's eager code (``PooledLookupFunction`` / ``SequenceLookupFunction``'s forward and
backward), so compiled training
updates the tables exactly as eager training does.

An op takes tensors and scalars, not modules: the module is named by a handle (its ``id``, kept
in a weak registry from the module's construction: ``register_owner``). What the backward needs (the lookup's rows,
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
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from torchrec_ext.modules.features import check_and_arrange
from torchrec_ext.modules.lookup_functions import PooledLookupFunction, SequenceLookupFunction

_OWNERS: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_PENDING: OrderedDict[int, SimpleNamespace] = OrderedDict()  # token -> what its backward needs
MAX_PENDING = 64  # forwards never followed by their backward (a grad-enabled eval loop): oldest dropped
_TOKENS = itertools.count()
_ANCHOR = torch.zeros(0, requires_grad=True, device="cpu")
KEY_SEPARATOR = "\x00"


def register_owner(module: Any) -> None:
    """Names ``module`` to the compiled ops by its ``id`` (a weak entry). Each dynamic collection
    registers when it is built, copied or unpickled, so before any graph can call it; Dynamo
    takes ``id(module)`` into a graph as a constant. (Registering at trace time, through an
    ``assume_constant_result`` function of the module, fails on torch 2.11, whose Dynamo passes
    such a function constants only.)"""
    _OWNERS[id(module)] = module


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
    batch, lookup = _arrange_and_look_up(module, keys, values, lengths, weights, stride, backward_follows)
    ctx = SimpleNamespace(weights_order=None, num_weights=0)
    if weights is not None and module._is_weighted:
        # Where each arranged weight came from: its gradient goes back there (an op's body runs
        # below autograd, which records nothing of the arrangement, so the mapping is kept by hand).
        ctx.weights_order, ctx.num_weights = _arranged_positions(keys, lengths, stride, module._plan), weights.numel()
    pooled = PooledLookupFunction.forward(
        ctx, module._tables, module._plan, module._hyperparams, lookup, batch, batch.weights
    )
    return pooled.detach(), _keep_for_backward(ctx, backward_follows)


def _arranged_positions(keys: str, lengths: Tensor, stride: int, plan: Any) -> Tensor:
    """For each id that check_and_arrange puts in lookup order (the plan's features), its
    position in the KJT."""
    key_list = keys.split(KEY_SEPARATOR) if keys else []
    counts = lengths.view(len(key_list), stride).sum(1).tolist() if key_list else []
    starts = [sum(counts[:i]) for i in range(len(counts))]
    parts = [
        torch.arange(starts[i], starts[i] + counts[i], device=lengths.device)
        for i in (key_list.index(f) for f in plan.features)
    ]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64, device=lengths.device)


def _arrange_and_look_up(module, keys, values, lengths, weights, stride, backward_follows):
    """The module's eager checks, arrangement and lookup (inserting in training) of the KJT."""
    kjt = KeyedJaggedTensor(
        keys=keys.split(KEY_SEPARATOR) if keys else [], values=values, lengths=lengths, weights=weights, stride=stride
    )
    batch = check_and_arrange(
        kjt, module._plan, getattr(module, "_is_weighted", False), type(module).__name__, module.device
    )
    return batch, module._lookup_rows(batch, backward_follows)


def _keep_for_backward(ctx: SimpleNamespace, backward_follows: bool) -> Tensor:
    """The token under which ``ctx`` waits for its backward (kept only when one follows)."""
    token = next(_TOKENS)
    if backward_follows:
        _PENDING[token] = ctx
        while len(_PENDING) > MAX_PENDING:
            _PENDING.popitem(last=False)
    return torch.tensor([token], dtype=torch.int64, device="cpu")


def _pending(token: Tensor) -> SimpleNamespace:
    ctx = _PENDING.pop(int(token.item()), None)
    if ctx is None:
        raise RuntimeError(
            "torchrec_ext: a compiled backward ran after its forward's lookup was dropped (more than "
            f"{MAX_PENDING} forwards of one graph without their backward) or twice"
        )
    return ctx


@compiled_pooled_lookup.register_fake
def _(handle, keys, values, lengths, weights, stride, total_dim, backward_follows, anchor):
    # The token and the anchor's gradient live on the host, as the anchor does (the token is read there).
    return values.new_empty(stride, total_dim, dtype=torch.float32), anchor.new_empty(1, dtype=torch.int64)


@torch.library.custom_op("torchrec_ext::compiled_pooled_update", mutates_args=())
def compiled_pooled_update(token: Tensor, grad: Tensor, weights: Tensor | None) -> tuple[Tensor, Tensor]:
    """The fused optimizer update of the forward ``token`` names; returns (the anchor's empty
    gradient, the per-sample weights' gradient in the KJT's order, or an empty tensor)."""
    ctx = _pending(token)
    wants_weights = weights is not None and ctx.weights_order is not None
    ctx.needs_input_grad = (False,) * 5 + (wants_weights,)  # the forward's inputs: weights the 6th
    grads = PooledLookupFunction.backward(ctx, grad.contiguous())
    weights_grad = grad.new_zeros(0)
    if wants_weights:
        weights_grad = grad.new_zeros(ctx.num_weights).index_add_(0, ctx.weights_order, grads[5])
    return _ANCHOR.detach().new_zeros(0), weights_grad


@compiled_pooled_update.register_fake
def _(token, grad, weights):
    return token.new_empty(0, dtype=torch.float32), (
        torch.empty_like(weights) if weights is not None else grad.new_empty(0)
    )


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


def lookup_is_one_op(module: Any, features: KeyedJaggedTensor, backward_follows: bool) -> bool:
    """Whether ``module``'s forward runs its lookup as one op here: while Dynamo traces a forward
    that may insert or be followed by a backward (eval under no_grad traces the lookup itself), on
    real tables, for a KJT with one batch size (VBE KJTs break the graph)."""
    return (
        torch.compiler.is_dynamo_compiling()
        and (module.training or backward_follows)
        and module.device.type != "meta"
        and not features.variable_stride_per_key()
    )


def compiled_pooled_forward(module: Any, features: KeyedJaggedTensor, backward_follows: bool) -> Tensor:
    """The pooled [batch_size, total_dim] output of ``module``'s lookup of ``features``, as one
    op of the graph Dynamo traces (``features`` has one batch size for all features)."""
    pooled, _token = torch.ops.torchrec_ext.compiled_pooled_lookup(
        id(module),
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


# ----------------------------------------------------------------------------- sequence (EC)


@torch.library.custom_op("torchrec_ext::compiled_sequence_lookup", mutates_args=())
def compiled_sequence_lookup(
    handle: int,
    keys: str,
    values: Tensor,
    lengths: Tensor,
    stride: int,
    dim: int,
    backward_follows: bool,
    anchor: Tensor,
    plan_ids: Tensor,
) -> tuple[Tensor, Tensor]:
    """DynamicEmbeddingCollection's eager lookup: (one vector per id of the plan's features, in
    their order, token). ``plan_ids``, those ids as the traced code cut them from the KJT, only
    gives the output's length to the fake (so that the graph splits it without reading data)."""
    module = _owner(handle)
    batch, lookup = _arrange_and_look_up(module, keys, values, lengths, None, stride, backward_follows)
    ctx = SimpleNamespace()
    vectors = SequenceLookupFunction.forward(ctx, module._tables, module._plan, module._hyperparams, lookup, batch)
    return vectors.detach(), _keep_for_backward(ctx, backward_follows)


@compiled_sequence_lookup.register_fake
def _(handle, keys, values, lengths, stride, dim, backward_follows, anchor, plan_ids):
    return plan_ids.new_empty(plan_ids.shape[0], dim, dtype=torch.float32), anchor.new_empty(1, dtype=torch.int64)


@torch.library.custom_op("torchrec_ext::compiled_sequence_update", mutates_args=())
def compiled_sequence_update(token: Tensor, grad: Tensor) -> Tensor:
    """The fused optimizer update of the forward ``token`` names; returns the anchor's gradient."""
    SequenceLookupFunction.backward(_pending(token), grad.contiguous())
    return _ANCHOR.detach().new_zeros(0)


@compiled_sequence_update.register_fake
def _(token, grad):
    return token.new_empty(0, dtype=torch.float32)


def _sequence_setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(output[1])


def _sequence_backward(ctx, grad_vectors: Tensor, _grad_token: Tensor | None):
    (token,) = ctx.saved_tensors
    anchor_grad = torch.ops.torchrec_ext.compiled_sequence_update(token, grad_vectors)
    return None, None, None, None, None, None, None, anchor_grad, None


compiled_sequence_lookup.register_autograd(_sequence_backward, setup_context=_sequence_setup_context)


def compiled_sequence_forward(module: Any, features: KeyedJaggedTensor, backward_follows: bool) -> dict[str, Any]:
    """``module``'s (a DynamicEmbeddingCollection) output for ``features`` with its lookup as one
    op of the graph Dynamo traces; split per feature by the KJT's own ``to_dict`` (as TorchRec's
    EmbeddingCollection does), whose sizes Dynamo follows."""
    plan, per_key = module._plan, features.to_dict()
    jts = [per_key[f] for f in plan.features]
    vectors, _token = torch.ops.torchrec_ext.compiled_sequence_lookup(
        id(module),
        KEY_SEPARATOR.join(features.keys()),
        features.values(),
        features.lengths(),
        features.stride(),
        module.embedding_dim(),
        backward_follows,
        _ANCHOR,
        torch.cat([jt.values() for jt in jts]) if jts else features.values()[:0],
    )
    per_feature = torch.split(vectors, [jt.values().shape[0] for jt in jts])
    return {
        name: JaggedTensor(
            values=per_feature[i], lengths=jt.lengths(), weights=jt.values() if module.need_indices() else None
        )
        for i, (name, jt) in enumerate(zip(plan.embedding_names, jts))
    }
