"""Half-precision rows and growth on a GPU (issue 15): what only a CUDA device shows. Skipped
without one; scripts/gpu_check.sh runs the whole suite there.

* A module mixing FP32, FP16 and BF16 tables (one multi-table lookup / update call, the Triton
  kernels) trains on the GPU as the same module on the CPU (the C++ kernels): float32 sums in
  another order and fused multiply-adds, so values agree to a rounding of their dtype, most
  bit for bit. Stochastic rounding on the GPU is reproducible: two runs give the same bits, and
  it is not rounding to nearest.
* Checkpoints convert between dtypes from and to CUDA tensors, exactly as ``Tensor.to`` does.
* A growth that runs out of device memory (the caching allocator held to what is in use) raises
  GrowthError naming the table and bytes, gives back what it allocated, and the table trains on
  as a preallocated one.
"""

import gc
import warnings

import pytest
import torch
from torchrec import KeyedJaggedTensor
from torchrec.modules.embedding_configs import DataType

from mixed_dtype_helpers import (
    ULP,
    assert_rows_within_a_rounding,
    bag_configs,
    fixed_batch,
    rows_by_id,
    train_on_stream,
)
from torchrec_ext import (
    DynamicEmbeddingBagCollection,
    DynamicEmbeddingBagConfig,
    DynamicEmbeddingCollection,
    DynamicEmbeddingConfig,
)
from torchrec_ext.modules import GrowthError

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("optimizer", ["adagrad", "rowwise_adagrad", "adam"])
def test_mixed_dtype_bag_collection_on_the_gpu_trains_as_on_the_cpu(optimizer):
    cuda = torch.device("cuda")
    kwargs = dict(optimizer=optimizer, optimizer_kwargs={"lr": 0.05})
    on_cpu = DynamicEmbeddingBagCollection(bag_configs(), **kwargs)
    on_gpu = DynamicEmbeddingBagCollection(bag_configs(), device=cuda, **kwargs)
    assert on_gpu._tables.weights.device.type == "cuda"
    for got, want in zip(train_on_stream(on_gpu, cuda), train_on_stream(on_cpu, torch.device("cpu"))):
        assert got.dtype == torch.float32
        # Sums in another order, of rows a rounding apart where a step's last float32 bit differed
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-3)
    dtypes = [torch.float32, torch.float16, torch.bfloat16]
    assert_rows_within_a_rounding(rows_by_id(on_gpu), rows_by_id(on_cpu), dtypes)


def test_mixed_dtype_sequence_collection_on_the_gpu_trains_as_on_the_cpu():
    cuda = torch.device("cuda")
    configs = bag_configs(cls=DynamicEmbeddingConfig, dims=[8, 8, 8])
    kwargs = dict(optimizer="adagrad", optimizer_kwargs={"lr": 0.05})
    on_cpu = DynamicEmbeddingCollection(configs, **kwargs)
    on_gpu = DynamicEmbeddingCollection(bag_configs(cls=DynamicEmbeddingConfig, dims=[8, 8, 8]), device=cuda, **kwargs)

    def train(module, device):
        outs = []
        for step in range(4):
            out = module(fixed_batch(step).to(device))
            values = torch.cat([out[f"f{i}"].values() for i in range(3)])
            gen = torch.Generator().manual_seed(step)
            (values * torch.randn(values.shape, generator=gen).to(device)).sum().backward()
            outs.append(values.detach().cpu())
        return outs

    for got, want in zip(train(on_gpu, cuda), train(on_cpu, torch.device("cpu"))):
        torch.testing.assert_close(got, want, rtol=2 * ULP[torch.bfloat16], atol=1e-5)
    assert_rows_within_a_rounding(
        rows_by_id(on_gpu, "embeddings"),
        rows_by_id(on_cpu, "embeddings"),
        [torch.float32, torch.float16, torch.bfloat16],
    )


def test_stochastic_rounding_on_the_gpu_is_reproducible_and_not_to_nearest():
    cuda = torch.device("cuda")
    kwargs = dict(device=cuda, optimizer="adagrad", optimizer_kwargs={"lr": 0.05})
    runs = [DynamicEmbeddingBagCollection(bag_configs(stochastic=s), **kwargs) for s in (True, True, False)]
    outs = [train_on_stream(m, cuda, steps=6) for m in runs]
    for a, b in zip(outs[0], outs[1]):
        assert torch.equal(a, b)
    states = [{k: v.cpu() for k, v in m.state_dict().items()} for m in runs]
    for key, value in states[0].items():
        assert torch.equal(value, states[1][key]), key  # the same bits
    for t in ("t1", "t2"):  # the half tables: some element rounded otherwise than to nearest
        key = f"embedding_bags.{t}.weight"
        assert states[0][key].shape == states[2][key].shape
        assert not torch.equal(states[0][key], states[2][key]), t
    assert torch.equal(states[0]["embedding_bags.t0.weight"], states[2]["embedding_bags.t0.weight"])  # float32


@pytest.mark.parametrize("source_device, target_device", [("cuda", "cuda"), ("cuda", "cpu"), ("cpu", "cuda")])
def test_checkpoints_convert_between_dtypes_to_and_from_the_gpu(source_device, target_device):
    source = DynamicEmbeddingBagCollection(
        bag_configs(), device=torch.device(source_device), optimizer="adagrad", optimizer_kwargs={"lr": 0.05}
    )
    train_on_stream(source, torch.device(source_device), steps=2)
    sd = source.state_dict()
    assert all(v.device.type == source_device for v in sd.values() if isinstance(v, torch.Tensor))
    # Every table in another dtype: FP32 -> BF16, FP16 -> FP32, BF16 -> FP16.
    other = [DataType.BF16, DataType.FP32, DataType.FP16]
    target = DynamicEmbeddingBagCollection(
        bag_configs(types=other),
        device=torch.device(target_device),
        optimizer="adagrad",
        optimizer_kwargs={"lr": 0.05},
    )
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        target.load_state_dict(sd)
    assert sum("converted, rounding to nearest" in str(w.message) for w in said) == 3
    got = target.state_dict()
    for i, dtype in enumerate([torch.bfloat16, torch.float32, torch.float16]):
        key = f"embedding_bags.t{i}"
        assert got[f"{key}.weight"].device.type == target_device and got[f"{key}.weight"].dtype == dtype
        order_got, order_sd = got[f"{key}.weight_id"].cpu().argsort(), sd[f"{key}.weight_id"].cpu().argsort()
        assert torch.equal(got[f"{key}.weight_id"].cpu()[order_got], sd[f"{key}.weight_id"].cpu()[order_sd])
        want = sd[f"{key}.weight"].cpu().to(dtype)[order_sd]  # the CPU's conversion, to nearest even
        assert torch.equal(got[f"{key}.weight"].cpu()[order_got], want), key
        assert torch.equal(
            got[f"{key}.optimizer.momentum1"].cpu()[order_got], sd[f"{key}.optimizer.momentum1"].cpu()[order_sd]
        )
    # And it trains on from there on the target's device.
    train_on_stream(target, torch.device(target_device), steps=1)


def test_a_growth_that_runs_out_of_device_memory_leaves_the_table_unchanged_and_training():
    cuda = torch.device("cuda")

    def module(initial):
        cfg = DynamicEmbeddingBagConfig(
            name="t", embedding_dim=64, num_embeddings=1 << 20, feature_names=["f"], initial_capacity=initial
        )
        return DynamicEmbeddingBagCollection([cfg], device=cuda, optimizer="adam", optimizer_kwargs={"lr": 0.01})

    def kjt(first, count):  # ``count`` distinct ids, 4 a bag
        ids = torch.arange(first, first + count) * 7919
        return KeyedJaggedTensor.from_lengths_sync(["f"], ids, torch.full((count // 4,), 4)).to(cuda)

    def step(m, batch):
        out = m(batch).values()
        out.pow(2).sum().backward()
        return out.detach()

    grown, full = module(1 << 12), module(None)
    small, big = kjt(0, 2000), kjt(10**6, 200_000)  # the big one: 4096 rows -> 2^19 (~400 MB with Adam)
    for m in (grown, full):
        step(m, small)
    before = rows_by_id(grown)
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    in_use = torch.cuda.memory_allocated(cuda)
    total = torch.cuda.get_device_properties(cuda).total_memory
    # The allocator may hold 192 MiB more than now: the batch's lookup fits, the growth (>= 384 MiB) does not.
    torch.cuda.set_per_process_memory_fraction(min(1.0, (torch.cuda.memory_reserved(cuda) + (192 << 20)) / total), cuda)
    try:
        with pytest.raises(
            GrowthError, match=r"tables \['t'\]: growing to capacities \[\d+\] needs new storage of \d+ bytes"
        ) as raised:
            step(grown, big)
        message, cause = str(raised.value), raised.value.__cause__
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, cuda)
    assert isinstance(cause, torch.OutOfMemoryError), repr(cause)
    assert "unchanged, at capacities [4096]" in message, message
    del raised, cause
    gc.collect()
    assert torch.cuda.memory_allocated(cuda) <= in_use + (8 << 20)  # what the growth allocated is given back
    assert grown.table_stats()["t"].capacity == 4096
    after = rows_by_id(grown)
    for key, value in before["t"].items():
        assert torch.equal(after["t"][key], value), key
    # With the memory back, it grows and trains as the preallocated module.
    torch.testing.assert_close(step(grown, big), step(full, big), rtol=0, atol=0)
    assert grown.table_stats()["t"].capacity == 1 << 19
    for key, value in rows_by_id(full)["t"].items():
        assert torch.equal(rows_by_id(grown)["t"][key], value), key
