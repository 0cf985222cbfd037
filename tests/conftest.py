import pytest
import torch

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def pytest_generate_tests(metafunc):
    # Every test taking `device` runs on CPU and, when a GPU is present, on CUDA; no GPU means
    # the CUDA variants are not generated, and test_cuda_* files say so by skipping.
    if "device" in metafunc.fixturenames:
        metafunc.parametrize("device", DEVICES)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
