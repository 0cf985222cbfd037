"""A default device other than the module's (``with torch.device("cuda"):`` or
``torch.set_default_device("cuda")``, as TorchRec users build models) leaves our modules alone.

A torch factory call that names no device (``torch.tensor(list)``, ``torch.empty(n)``, ...) makes
its tensor on the default device: host bookkeeping made that way lands on the GPU under a CUDA
default (a sync per call, device mismatches, host code reading GPU memory). The CPU shows every
such call: under ``with torch.device("meta"):`` it makes a meta tensor, and the step then fails
or returns meta. Oracle: the same module trained with no device context, bit for bit (outputs,
state), over steps that evict, admit, expire, grow and miss in the tier's cache.
"""

import ast
import contextlib
import pathlib

import pytest
import torch
from torchrec import DataType, EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, KeyedTensor

import torchrec_ext
from dist_helpers import ModelWith, run_ranks
from matrix import FULL_MATRIX, REASON
from torchrec_ext import (
    DynamicEmbeddingBagCollection,
    DynamicEmbeddingBagConfig,
    DynamicEmbeddingCollection,
    DynamicEmbeddingConfig,
)
from torchrec_ext.modules import tier_copies, tiered_tables
from torchrec_ext.modules.tiered_tables import TieredTables

KEYS = ["f0", "f1", "f2"]
TIERED = {"backing": "host", "cache_load_factor": 0.3}
# name ("ebc..." pooled, "ec..." sequence): (options of both tables, the tier's device maps and records forced)
CASES = {
    "ebc": ({}, False),
    "ebc-fp16-ttl-counter": (
        {"data_type": DataType.FP16, "ttl_steps": 2, "admission": "counter", "admit_after": 2},
        False,
    ),
    "ebc-bloom-fallback": ({"admission": "bloom", "admit_after": 2, "fallback_rows": 2}, False),
    "ebc-growth": ({"initial_capacity": 16}, False),
    "ec-bf16-probabilistic": (
        {"data_type": DataType.BF16, "admission": "probabilistic", "admit_probability": 0.5},
        False,
    ),
    "ec-growth-ttl": ({"initial_capacity": 16, "ttl_steps": 3}, False),
    "ebc-host": (TIERED, False),
    "ec-file": ({"backing": "file", "cache_load_factor": 0.3, "ttl_steps": 3}, False),
    "ebc-host-device-maps": ({**TIERED, "admission": "counter", "admit_after": 2}, True),
    "ec-file-device-maps": ({"backing": "file", "cache_load_factor": 0.3}, True),
}


def _module(name, tmp_path, device="cpu"):
    options, _ = CASES[name]
    pooled = name.startswith("ebc")
    if options.get("backing") == "file":  # each module its own files
        directory = tmp_path / str(len(list(tmp_path.iterdir())))
        directory.mkdir()
        options = {**options, "backing": f"file:{directory}"}
    config = DynamicEmbeddingBagConfig if pooled else DynamicEmbeddingConfig
    capacity = 256 if "backing" in options else 64  # tiered: a batch fits its cache
    tables = [
        config(name="a", embedding_dim=8, num_embeddings=capacity, feature_names=["f0", "f1"], **options),
        config(
            name="b", embedding_dim=8, num_embeddings=capacity, feature_names=["f2"], eviction_policy="lfu", **options
        ),
    ]
    kind = DynamicEmbeddingBagCollection if pooled else DynamicEmbeddingCollection
    return kind(tables, optimizer="adagrad", optimizer_kwargs={"lr": 0.1}, device=device)


def _force_maps(monkeypatch):
    """The tier's GPU path on the CPU, as tests/test_tiers_device_maps.py forces it."""
    monkeypatch.setattr(TieredTables, "device_maps", True)
    monkeypatch.setattr(TieredTables, "copy_through_records", True)
    monkeypatch.setattr(tiered_tables, "MAX_ROWS", 7)
    monkeypatch.setattr(tier_copies, "MAX_ROWS", 7)  # (rounds of the tables' packed reads)


@pytest.fixture
def forced_maps(monkeypatch, request):
    if CASES[request.node.callspec.params["name"]][1]:
        _force_maps(monkeypatch)


@pytest.fixture
def forced_maps_always(monkeypatch):
    _force_maps(monkeypatch)


def _batches(n=8):
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        lengths = torch.randint(0, 4, (len(KEYS) * 8,), generator=gen)
        values = torch.randint(0, 400, (int(lengths.sum()),), generator=gen)
        out.append(KeyedJaggedTensor(keys=KEYS, values=values, lengths=lengths, stride=8))
    return out


def _values(out):
    return out.values() if isinstance(out, KeyedTensor) else torch.cat([jt.values() for jt in out.values()])


def _run(module, batches, context):
    """Training steps (fused optimizer; the tier stages each next batch), then eval lookups with
    and without grad, each inside ``context()``; every output, read on the CPU."""
    outs = []
    for step, batch in enumerate(batches):
        with context():
            if step + 1 < len(batches):
                module.stage_next(batches[step + 1])  # False, nothing done, when all resident
            out = _values(module(batch))
            out.square().sum().backward()
        outs.append(out.detach())
    module.eval()
    for batch in batches[:3]:
        with context():
            outs.append(_values(module(batch)).detach())
            with torch.no_grad():
                outs.append(_values(module(batch)))
    module.train()
    return outs


def _equal(a, b, what):
    assert a.device == b.device and a.dtype == b.dtype, what
    if a.device.type == "cpu" or not a.is_floating_point():
        assert torch.equal(a, b), what
    else:  # (a GPU's atomic sums need not add in one order)
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=lambda m: f"{what}: {m}")


def _assert_same(got, want):
    assert len(got) == len(want)
    for step, (g, w) in enumerate(zip(got, want)):
        _equal(g, w, step)


def _assert_same_state(got, want):
    a, b = got.state_dict(), want.state_dict()
    assert list(a) == list(b)
    for key in a:
        _equal(a[key], b[key], key)


def _assert_trains_as_built_plainly(module, name, tmp_path, context=contextlib.nullcontext):
    """``module`` trained (in ``context``) as one of case ``name`` built with no context: outputs, state."""
    plain, batches = _module(name, tmp_path), _batches(4)
    _assert_same(_run(module, batches, context), _run(plain, batches, contextlib.nullcontext))
    _assert_same_state(module, plain)


@contextlib.contextmanager
def _default_device(device):
    """``torch.set_default_device`` (the global form of the device context), undone after."""
    torch.set_default_device(device)
    try:
        yield
    finally:
        torch.set_default_device(None)


@pytest.mark.parametrize("name", list(CASES))
def test_a_step_under_another_default_device_equals_a_plain_step(name, tmp_path, forced_maps, device):
    """On a GPU too (``device``), where the CUDA-only branches run."""
    batches = [batch.to(device) for batch in _batches()]
    plain, contextual = _module(name, tmp_path, device), _module(name, tmp_path, device)
    want = _run(plain, batches, contextlib.nullcontext)
    _assert_same(_run(contextual, batches, lambda: torch.device("meta")), want)
    _assert_same_state(contextual, plain)


def test_set_default_device_is_seen_as_the_context():
    batches = _batches(4)
    plain, contextual = _module("ebc-fp16-ttl-counter", None), _module("ebc-fp16-ttl-counter", None)
    _assert_same(
        _run(contextual, batches, lambda: _default_device("meta")), _run(plain, batches, contextlib.nullcontext)
    )
    assert torch.get_default_device().type == "cpu"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["ebc-fp16-ttl-counter", "ebc-host", "ec-file"])
def test_a_cpu_step_under_the_cuda_default_device_allocates_nothing_on_the_gpu(name, tmp_path):
    batches = _batches(4)
    plain, contextual = _module(name, tmp_path), _module(name, tmp_path)
    want = _run(plain, batches, contextlib.nullcontext)
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats().get("allocation.all.allocated", 0)
    _assert_same(_run(contextual, batches, lambda: torch.device("cuda")), want)
    assert torch.cuda.memory_stats().get("allocation.all.allocated", 0) == before


# ------------------------------------------------------------------ construction under a context


def test_torchrecs_ebc_builds_where_its_device_argument_says_else_on_the_default_device():
    """What the tests below hold our drop-ins to."""
    tables = [EmbeddingBagConfig(name="a", embedding_dim=4, num_embeddings=10, feature_names=["f0"])]
    with torch.device("meta"):
        named, unnamed = EmbeddingBagCollection(tables, device=torch.device("cpu")), EmbeddingBagCollection(tables)
    assert named.device.type == "cpu" and all(p.device.type == "cpu" for p in named.parameters())
    assert unnamed.device.type == "meta" and all(p.device.type == "meta" for p in unnamed.parameters())


@pytest.mark.parametrize("name", list(CASES))
def test_built_with_a_device_under_another_default_device_equals_built_plainly(name, tmp_path, forced_maps):
    """TorchRec's way: the device argument wins over the context; every tensor of the module on
    it, and it trains as one built with no context."""
    with torch.device("meta"):
        contextual = _module(name, tmp_path, device=torch.device("cpu"))
    assert contextual.device.type == "cpu"
    assert all(v.device.type == "cpu" for v in contextual.state_dict().values())
    _assert_same_state(contextual, _module(name, tmp_path))
    _assert_trains_as_built_plainly(contextual, name, tmp_path)


@pytest.mark.parametrize("name", ["ebc-host", "ec-file-device-maps"])
def test_a_tiered_module_built_under_the_meta_context_is_on_meta_as_torchrecs(name, tmp_path, forced_maps):
    """No device argument: the context's device (as TorchRec's EBC), shapes only, no files."""
    with torch.device("meta"):
        module = _module(name, tmp_path, device=None)
    on_cpu = _module(name, tmp_path)
    assert module.device.type == "meta"
    state, want = module.state_dict(), on_cpu.state_dict()
    assert list(state) == list(want)
    assert all(v.device.type == "meta" and v.shape == want[k].shape for k, v in state.items())
    assert not any(tmp_path.glob("0/*"))  # the meta module made no backing files (when file-backed)


@pytest.mark.parametrize("name", list(CASES))
def test_a_module_built_under_the_meta_context_materialises_as_torchrecs(name, tmp_path, forced_maps):
    """TorchRec's way out of meta: ``to_empty`` then ``reset_parameters``; then it trains as a
    module built on the CPU (initial vectors are a function of seed, table and id)."""
    with torch.device("meta"):
        module = _module(name, tmp_path, device=None)
    module.to_empty(device="cpu")
    module.reset_parameters()
    _assert_trains_as_built_plainly(module, name, tmp_path)


@pytest.mark.parametrize("name", ["ebc-fp16-ttl-counter", "ec-file-device-maps"])
def test_built_and_trained_under_the_cpu_context_equals_plain(name, tmp_path, forced_maps):
    with torch.device("cpu"):
        contextual = _module(name, tmp_path, device=None)
        assert contextual.device.type == "cpu"
    _assert_trains_as_built_plainly(contextual, name, tmp_path, lambda: torch.device("cpu"))


# ------------------------------------------------------------------ sharded, 2 gloo ranks


def _sharded_steps_under_meta(rank, world_size):
    from torchrec.distributed import DistributedModelParallel

    from torchrec_ext.distributed import get_sharders

    for pooled in (True, False):
        name = "ebc-fp16-ttl-counter" if pooled else "ec-growth-ttl"
        models = [ModelWith("m", _module(name, None)) for _ in range(2)]
        dmps = [DistributedModelParallel(m, device=torch.device("cpu"), sharders=get_sharders()) for m in models]
        outs = []
        for dmp, context in zip(dmps, (contextlib.nullcontext, lambda: torch.device("meta"))):
            outs.append([])
            for batch in _batches(4):
                local = KeyedJaggedTensor(
                    keys=KEYS, values=batch.values() + rank, lengths=batch.lengths(), stride=batch.stride()
                )
                with context():
                    out = dmp(local)
                    out = _values(out.wait() if hasattr(out, "wait") else out)
                    out.square().sum().backward()
                outs[-1].append(out.detach())
        _assert_same(outs[1], outs[0])


@pytest.mark.skipif(not FULL_MATRIX, reason=REASON)  # ~35 s on 2 busy cores: scripts/full_matrix.sh
def test_a_sharded_step_under_the_meta_context_equals_a_plain_one():
    run_ranks(_sharded_steps_under_meta, 2)


# ------------------------------------------------------------------ every factory call names its device

# Every torch factory call in the package names its device, its CUDA-only branches included (which
# the meta runs above cannot reach). Not here: the pure-PyTorch references (tests only).
UNCHECKED = ("reference",)


def _factory_calls_without_a_device():
    from torch.utils._device import _device_constructors

    names = {f.__name__ for f in _device_constructors()}
    root = pathlib.Path(torchrec_ext.__file__).parent
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root).parts[0] in UNCHECKED:
            continue
        source = path.read_text()
        for node in ast.walk(ast.parse(source)):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "torch"
                and node.func.attr in names
                and not any(k.arg == "device" for k in node.keywords)
            ):
                yield f"{path.relative_to(root)}:{node.lineno}: {ast.get_source_segment(source, node)[:80]}"


def test_every_factory_call_names_its_device():
    """(``device="cpu"`` for host bookkeeping, else the device of the tensor it pairs with.)"""
    assert list(_factory_calls_without_a_device()) == []


def test_the_scan_finds_a_factory_call_without_a_device(tmp_path, monkeypatch):
    (tmp_path / "modules").mkdir()
    (tmp_path / "modules" / "x.py").write_text('import torch\na = torch.zeros(3)\nb = torch.ones(2, device="cpu")\n')
    (tmp_path / "reference").mkdir()
    (tmp_path / "reference" / "y.py").write_text("import torch\nc = torch.arange(3)\n")
    monkeypatch.setattr(torchrec_ext, "__file__", str(tmp_path / "__init__.py"))
    assert list(_factory_calls_without_a_device()) == ["modules/x.py:2: torch.zeros(3)"]


# ------------------------------------------------------------------ the pipeline


@pytest.mark.parametrize("tier_prefetch", [False, True])
def test_pipeline_steps_under_the_meta_context_equal_plain_ones(tmp_path, tier_prefetch, forced_maps_always):
    """TrainPipeline over a tiered model (the tier's device maps forced), each ``progress`` call
    under the context; the stage's worker thread is outside it (a device context is per thread)."""
    from test_tiers import _backing, _bag_configs, _dlrm, _dlrm_batches
    from torchrec_ext.pipeline import PipelineOptions, TrainPipeline

    batches, losses = _dlrm_batches(6), []
    options = PipelineOptions(prefetch_threads=0, threaded_input_dist=False, tier_prefetch=tier_prefetch)
    for context in (contextlib.nullcontext, lambda: torch.device("meta")):
        tables = _bag_configs(_backing("file", tmp_path / str(len(losses))), 0.3)
        (tmp_path / str(len(losses))).mkdir()
        model, optimizer = _dlrm(DynamicEmbeddingBagCollection(tables, optimizer="adagrad"))
        with TrainPipeline(model, optimizer, torch.device("cpu"), options) as pipeline:
            it, losses = iter(batches), losses + [[]]
            for _ in batches:
                with context():
                    losses[-1].append(pipeline.progress(it)[0].detach())
    _assert_same(losses[1], losses[0])
