"""A module mixing FP32, FP16 and BF16 tables, trained on a fixed stream, and its rows compared to
another's within a rounding of their dtype: for the GPU kernels against the CPU ones
(tests/test_storage_cuda.py on a GPU; tests/test_triton_kernels.py under the Triton interpreter)."""

import torch
from torchrec import KeyedJaggedTensor
from torchrec.modules.embedding_configs import DataType

from torchrec_ext import DynamicEmbeddingBagConfig

TYPES = [DataType.FP32, DataType.FP16, DataType.BF16]
DIMS = [8, 12, 6]  # 6: half rows not a whole number of 16-byte loads
ULP = {torch.float32: 2.0**-20, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}  # (relative, with margin)


def bag_configs(types=TYPES, stochastic=True, cls=DynamicEmbeddingBagConfig, dims=DIMS):
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


def fixed_batch(step, tables=3, vocab=300, batch=16):
    gen = torch.Generator().manual_seed(1000 + step)
    lengths = torch.randint(0, 5, (tables * batch,), generator=gen)
    ids = torch.randint(0, vocab, (int(lengths.sum()),), generator=gen) * 104729 - 2**35
    return KeyedJaggedTensor.from_lengths_sync([f"f{i}" for i in range(tables)], ids, lengths)


def train_on_stream(module, device, steps=4):
    """Trains ``module`` (on ``device``) on a fixed stream; returns each step's output on the CPU."""
    outs = []
    for step in range(steps):
        kjt = fixed_batch(step).to(device)
        out = module(kjt)
        values = out.values() if hasattr(out, "values") and callable(out.values) else out
        gen = torch.Generator().manual_seed(step)
        weight = torch.randn(values.shape, generator=gen).to(device)  # a loss whose gradient ignores the rows
        (values * weight).sum().backward()
        outs.append(values.detach().cpu())
    return outs


def rows_by_id(module, container="embedding_bags"):
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


def assert_rows_within_a_rounding(got, want, dtypes, exact_share=0.97):
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
