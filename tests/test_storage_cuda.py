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

from torchrec_ext import (
    DynamicEmbeddingBagCollection,
    DynamicEmbeddingBagConfig,
    DynamicEmbeddingCollection,
    DynamicEmbeddingConfig,
)
from torchrec_ext.modules import GrowthError

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

TYPES = [DataType.FP32, DataType.FP16, DataType.BF16]
DIMS = [8, 12, 6]  # 6: half rows not a whole number of 16-byte loads
ULP = {torch.float32: 2.0**-20, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}  # (relative, with margin)


def _bag_configs(types=TYPES, stochastic=True, cls=DynamicEmbeddingBagConfig, dims=DIMS):
    return [
        cls(
            name=f"t{i}",
            embedding_dim=dim,
            num_embeddings=512,
            feature_names=[f"f{i}"],
            data_type=dtype,
            stochastic_rounding=stochastic,
        )
        for i, (dtype, dim) in enumerate(zip(types, dims))
    ]


def _batch(step, tables=3, vocab=300, batch=16):
    gen = torch.Generator().manual_seed(1000 + step)
    lengths = torch.randint(0, 5, (tables * batch,), generator=gen)
    ids = torch.randint(0, vocab, (int(lengths.sum()),), generator=gen) * 104729 - 2**35
    return KeyedJaggedTensor.from_lengths_sync([f"f{i}" for i in range(tables)], ids, lengths)


def _train(module, device, steps=4):
    """Trains ``module`` (on ``device``) on a fixed stream; returns each step's output on the CPU."""
    outs = []
    for step in range(steps):
        kjt = _batch(step).to(device)
        out = module(kjt)
        values = out.values() if hasattr(out, "values") and callable(out.values) else out
        gen = torch.Generator().manual_seed(step)
        weight = torch.randn(values.shape, generator=gen).to(device)  # a loss whose gradient ignores the rows
        (values * weight).sum().backward()
        outs.append(values.detach().cpu())
    return outs


def _by_id(module, container="embedding_bags"):
    sd = {k: v.cpu() for k, v in module.state_dict().items()}
    out = {}
    for name in sorted({k.split(".")[1] for k in sd if k.startswith(container + ".")}):
        prefix = f"{container}.{name}."
        order = sd[prefix + "weight_id"].argsort()
        out[name] = {
            k[len(prefix) :]: v[order]
            for k, v in sd.items()
            if k.startswith(prefix) and (k.endswith((".weight", ".weight_id")) or ".optimizer." in k)
        }
    return out


def _assert_rows_within_a_rounding(got, want, dtypes, exact_share=0.97):
    for (name, g), dtype in zip(sorted(got.items()), dtypes):
        w = want[name]
        assert torch.equal(g["weight_id"], w["weight_id"]), name
        assert g["weight"].dtype == w["weight"].dtype == dtype, name
        a, b = g["weight"].float(), w["weight"].float()
        torch.testing.assert_close(a, b, rtol=2 * ULP[dtype] if dtype != torch.float32 else 1e-5, atol=1e-6, msg=name)
        if dtype != torch.float32:  # float32 rows differ in their last bits (sums' order, FMA); half rows
            # only where that moves a value across a rounding boundary
            assert (a == b).float().mean() >= exact_share, (name, (a == b).float().mean())
        for key in g:
            if key.startswith("optimizer."):
                torch.testing.assert_close(g[key], w[key], rtol=1e-5, atol=1e-7, msg=f"{name}.{key}")


@pytest.mark.parametrize("optimizer", ["adagrad", "rowwise_adagrad", "adam"])
def test_mixed_dtype_bag_collection_on_the_gpu_trains_as_on_the_cpu(optimizer):
    cuda = torch.device("cuda")
    kwargs = dict(optimizer=optimizer, optimizer_kwargs={"lr": 0.05})
    on_cpu = DynamicEmbeddingBagCollection(_bag_configs(), **kwargs)
    on_gpu = DynamicEmbeddingBagCollection(_bag_configs(), device=cuda, **kwargs)
    assert on_gpu._tables.weights.device.type == "cuda"
    for got, want in zip(_train(on_gpu, cuda), _train(on_cpu, torch.device("cpu"))):
        assert got.dtype == torch.float32
        # Sums in another order, of rows a rounding apart where a step's last float32 bit differed
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-3)
    dtypes = [torch.float32, torch.float16, torch.bfloat16]
    _assert_rows_within_a_rounding(_by_id(on_gpu), _by_id(on_cpu), dtypes)


def test_mixed_dtype_sequence_collection_on_the_gpu_trains_as_on_the_cpu():
    cuda = torch.device("cuda")
    configs = _bag_configs(cls=DynamicEmbeddingConfig, dims=[8, 8, 8])
    kwargs = dict(optimizer="adagrad", optimizer_kwargs={"lr": 0.05})
    on_cpu = DynamicEmbeddingCollection(configs, **kwargs)
    on_gpu = DynamicEmbeddingCollection(_bag_configs(cls=DynamicEmbeddingConfig, dims=[8, 8, 8]), device=cuda, **kwargs)

    def train(module, device):
        outs = []
        for step in range(4):
            out = module(_batch(step).to(device))
            values = torch.cat([out[f"f{i}"].values() for i in range(3)])
            gen = torch.Generator().manual_seed(step)
            (values * torch.randn(values.shape, generator=gen).to(device)).sum().backward()
            outs.append(values.detach().cpu())
        return outs

    for got, want in zip(train(on_gpu, cuda), train(on_cpu, torch.device("cpu"))):
        torch.testing.assert_close(got, want, rtol=2 * ULP[torch.bfloat16], atol=1e-5)
    _assert_rows_within_a_rounding(
        _by_id(on_gpu, "embeddings"), _by_id(on_cpu, "embeddings"), [torch.float32, torch.float16, torch.bfloat16]
    )


def test_stochastic_rounding_on_the_gpu_is_reproducible_and_not_to_nearest():
    cuda = torch.device("cuda")
    kwargs = dict(device=cuda, optimizer="adagrad", optimizer_kwargs={"lr": 0.05})
    runs = [DynamicEmbeddingBagCollection(_bag_configs(stochastic=s), **kwargs) for s in (True, True, False)]
    outs = [_train(m, cuda, steps=6) for m in runs]
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
        _bag_configs(), device=torch.device(source_device), optimizer="adagrad", optimizer_kwargs={"lr": 0.05}
    )
    _train(source, torch.device(source_device), steps=2)
    sd = source.state_dict()
    assert all(v.device.type == source_device for v in sd.values() if isinstance(v, torch.Tensor))
    # Every table in another dtype: FP32 -> BF16, FP16 -> FP32, BF16 -> FP16.
    other = [DataType.BF16, DataType.FP32, DataType.FP16]
    target = DynamicEmbeddingBagCollection(
        _bag_configs(types=other),
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
    _train(target, torch.device(target_device), steps=1)


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
    before = _by_id(grown)
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
    after = _by_id(grown)
    for key, value in before["t"].items():
        assert torch.equal(after["t"][key], value), key
    # With the memory back, it grows and trains as the preallocated module.
    torch.testing.assert_close(step(grown, big), step(full, big), rtol=0, atol=0)
    assert grown.table_stats()["t"].capacity == 1 << 19
    for key, value in _by_id(full)["t"].items():
        assert torch.equal(_by_id(grown)["t"][key], value), key
