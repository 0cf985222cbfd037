"""The README's Python examples that are whole programs (those opening with an ``import``) run as
written: a user copies them first. The others are fragments (a process group, a trained model and
a data loader around them) that the tests of their subjects exercise."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def _whole_programs():
    blocks = _BLOCK.findall(README.read_text())
    return [b for b in blocks if b.startswith("import ")]


def test_the_readme_has_whole_programs():
    assert len(_whole_programs()) >= 2  # HashTable, and the one-line swap into DLRM_DCN


@pytest.mark.parametrize("index", range(len(_whole_programs())))
def test_readme_program_runs_as_written(index):
    source = _whole_programs()[index]
    namespace = {"__name__": f"readme_snippet_{index}"}
    exec(compile(source, f"README.md python block {index}", "exec"), namespace)
    if "DLRM_DCN" in source:  # the swapped model trains and scores like TorchRec's
        import torch
        from torchrec import KeyedJaggedTensor

        kjt = KeyedJaggedTensor.from_lengths_sync(["user_id"], torch.tensor([2**40 + 7, -3, 5]), torch.tensor([1, 2]))
        out = namespace["model"](torch.randn(2, 13), kjt)
        assert out.shape == (2, 1)
        out.sum().backward()
