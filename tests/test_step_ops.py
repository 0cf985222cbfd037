"""The host side of a training step does not grow with the table count (issue 13 item 6: the H100
found the dlrm-small step host-bound). Counted on CPU with a ``TorchDispatchMode``: every aten op
the step dispatches from Python (views apart: no kernel on a GPU), which on a GPU is a launch.

- the GPU's settings (new rows written by the lookup in one call, one upsert call): the same
  ops at 4 tables as at 26, TTL included (its expiry and ages for all tables at once);
- the CPU's defaults (new rows deferred to the fused update): at most one more op per table, the
  C++ kernel that draws a table's new vectors (the CPU's own; a composite over all tables is
  1.5-4x slower there); on main before this test every table added ~9 ops and ~9 views.

``benchmarks/bench_step_host.py`` measures the same counts with time and Python calls."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torchrec import DataType

from torchrec_ext import (
    DynamicEmbeddingBagCollection,
    DynamicEmbeddingBagConfig,
    DynamicEmbeddingCollection,
    DynamicEmbeddingConfig,
)
from torchrec_ext.data import dlrm_small_batch

FEW, MANY = 4, 26


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = self.views = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.is_view:
            self.views += 1
        else:
            self.ops += 1
        return func(*args, **(kwargs or {}))


def _ops_per_step(tables: int, gpu_settings: bool, kind: str = "ebc", **options) -> tuple[int, int]:
    """(ops, views) of a training step after two warm-up steps (which build cached layouts)."""
    if kind == "ebc":
        configs = [
            DynamicEmbeddingBagConfig(
                name=f"t{t}", embedding_dim=4 + 4 * (t % 3), num_embeddings=64, feature_names=[f"f{t}"], **options
            )
            for t in range(tables)
        ]
        module = DynamicEmbeddingBagCollection(configs, optimizer="adagrad")
    else:
        configs = [
            DynamicEmbeddingConfig(name=f"t{t}", embedding_dim=8, num_embeddings=64, feature_names=[f"f{t}"], **options)
            for t in range(tables)
        ]
        module = DynamicEmbeddingCollection(configs, optimizer="adagrad")
    if gpu_settings:
        module._tables.defer_new_rows, module._tables.flat_init, module._tables.batched_upsert = False, True, True

    def step(kjt) -> None:
        out = module(kjt)
        # one op for the loss whatever the table count (an EC's output is a JaggedTensor per feature)
        values = out.values() if kind == "ebc" else torch.cat([jt.values() for jt in out.values()])
        values.sum().backward()

    batches = [dlrm_small_batch(i, tables, 16, 3) for i in range(3)]
    step(batches[0])
    step(batches[1])
    with _Ops() as counted:
        step(batches[2])
    return counted.ops, counted.views if kind == "ebc" else None  # (an EC's output: views per feature)


@pytest.mark.parametrize("kind", ["ebc", "ec"])
@pytest.mark.parametrize(
    "options",
    # ttl: the counted step (the third) is not a sweep step (every ttl_steps steps, table by table)
    [{}, {"data_type": DataType.FP16}, {"eviction_policy": "lfu"}, {"ttl_steps": 5}],
    ids=["fp32", "fp16", "lfu", "ttl"],
)
def test_gpu_settings_step_ops_do_not_grow_with_tables(kind, options):
    if kind == "ec" and (options.get("eviction_policy") or options.get("ttl_steps")):
        pytest.skip("one policy variant is enough for the sequence module")
    assert _ops_per_step(MANY, True, kind, **options) == _ops_per_step(FEW, True, kind, **options)


@pytest.mark.parametrize("kind", ["ebc", "ec"])
def test_cpu_step_ops_grow_by_at_most_the_init_kernel_per_table(kind):
    few_ops, few_views = _ops_per_step(FEW, False, kind)
    many_ops, many_views = _ops_per_step(MANY, False, kind)
    assert many_ops - few_ops <= MANY - FEW, (few_ops, many_ops)  # the per-table C++ init_rows call
    if kind == "ebc":
        assert many_views - few_views <= MANY - FEW, (few_views, many_views)  # its [n, dim] block
