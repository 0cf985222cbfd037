"""GraphedForward's gradients on CPU, with a stand-in for ``make_graphed_callables`` that keeps
its autograd contract: the backward writes the gradients into static buffers (the graph's) and
returns those buffers, detached. The oracle is the same module trained eagerly.

Found on the first GPU run: autograd kept the static buffer as a parameter's ``.grad`` (it had
none yet), and the next step's ``zero_grad(set_to_none=False)`` + accumulation added the buffer
to itself, so step 1's gradients were doubled."""

import copy

import pytest
import torch
from torch import nn

from torchrec_ext.pipeline.dense_sync import without_static_grads


def _static_grad_graphed(module: nn.Module):
    """What make_graphed_callables returns, minus the graphs: one static gradient buffer per
    input and parameter, overwritten by each backward and returned detached."""
    params = tuple(module.parameters())
    static: dict[int, torch.Tensor] = {}

    class Graphed(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *inputs_and_params):
            ctx.inputs = inputs_and_params[: len(inputs_and_params) - len(params)]
            ctx.needs = ctx.needs_input_grad
            with torch.no_grad():
                return module(*ctx.inputs).detach()

        @staticmethod
        def backward(ctx, grad_out):
            leaves = [x.detach().requires_grad_(need) for x, need in zip(ctx.inputs, ctx.needs)]
            with torch.enable_grad():
                wrt = [x for x in leaves if x.requires_grad] + list(params)
                grads = iter(torch.autograd.grad(module(*leaves), wrt, grad_out))
            out = []
            for i, need in enumerate(ctx.needs):
                if not need:
                    out.append(None)
                    continue
                g = next(grads)
                buffer = static.setdefault(i, torch.empty_like(g))
                buffer.copy_(g)  # the replay overwrites the static buffer in place
                out.append(buffer.detach())
            return tuple(out)

    return lambda *args: Graphed.apply(*args, *params)


def _mlp():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


@pytest.mark.parametrize("set_to_none", [False, True])
def test_graphed_gradients_equal_eager_ones_step_after_step(set_to_none):
    torch.manual_seed(0)
    eager = _mlp()
    graphed_module = copy.deepcopy(eager)
    graphed = without_static_grads(_static_grad_graphed(graphed_module), list(graphed_module.parameters()))
    kept = []  # each step's input gradient, held past the next step's backward
    for step in range(4):
        x = torch.randn(32, 8, requires_grad=True)
        x2 = x.detach().clone().requires_grad_()
        eager.zero_grad(set_to_none=set_to_none)
        graphed_module.zero_grad(set_to_none=set_to_none)
        eager(x).square().mean().backward()
        graphed(x2).square().mean().backward()
        for (name, p), q in zip(graphed_module.named_parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=lambda m, n=name: f"step {step} {n}: {m}")
        kept.append((x2.grad, x.grad.clone()))
    for step, (got, want) in enumerate(kept):
        torch.testing.assert_close(got, want, msg=lambda m, s=step: f"input grad of step {s}: {m}")
