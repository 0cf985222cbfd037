import os
import tempfile

import pytest
import torch
import torch.distributed as dist

from parts import split


def _cuda_usable() -> bool:
    if not torch.cuda.is_available():
        return False
    from torchrec_ext import ops

    return ops.has_kernel("hash_find", torch.device("cuda"))


CUDA_SKIP = pytest.mark.skipif(not _cuda_usable(), reason="needs a CUDA GPU and a CUDA build of torchrec_ext")


def pytest_addoption(parser):
    parser.addoption(
        "--tests-part",
        metavar="K/N",
        default=None,
        help="run only part K of N disjoint parts of the selected tests (tests/parts.py)",
    )


@pytest.hookimpl(trylast=True)  # after -k / -m deselection: parts split what is selected
def pytest_collection_modifyitems(config, items):
    spec = config.getoption("--tests-part")
    if spec:
        try:
            kept, deselected = split(items, spec)
        except ValueError as e:
            raise pytest.UsageError(str(e)) from None
        config.hook.pytest_deselected(items=deselected)
        items[:] = kept


def pytest_generate_tests(metafunc):
    # Every test taking `device` runs on CPU and on CUDA; the CUDA variant skips without a GPU.
    if "device" in metafunc.fixturenames:
        metafunc.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA_SKIP)])


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _no_process_group_left_behind():
    """A test that made the default process group (e.g. DCP's load through ensure_process_group)
    destroys it, so that a later test finds the process as a fresh job would."""
    before = dist.is_available() and dist.is_initialized()
    yield
    if not before and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def one_rank_group():
    """A one-rank gloo group in this process, for checks that run before any collective (no peer
    is needed)."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(d, 'init')}", rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()
