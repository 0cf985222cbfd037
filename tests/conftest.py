import pytest
import torch


def _cuda_usable() -> bool:
    if not torch.cuda.is_available():
        return False
    from torchrec_ext import ops

    return ops.has_kernel("hash_find", torch.device("cuda"))


CUDA_SKIP = pytest.mark.skipif(not _cuda_usable(), reason="needs a CUDA GPU and a CUDA build of torchrec_ext")


def pytest_generate_tests(metafunc):
    # Every test taking `device` runs on CPU and on CUDA; the CUDA variant skips without a GPU.
    if "device" in metafunc.fixturenames:
        metafunc.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA_SKIP)])


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
