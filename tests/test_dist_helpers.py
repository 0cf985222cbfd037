"""run_ranks forks its ranks from a forkserver started once: each rank still sees the caller's
environment as it is at the call (as a spawned rank would), and the server leaves the caller's
environment as it found it."""

import os

from dist_helpers import run_ranks


def _sees(rank, world_size, name, value):
    assert os.environ.get(name) == value, (rank, os.environ.get(name))
    assert "PYTORCH_NVML_BASED_CUDA_CHECK" not in os.environ  # the server's, not the caller's


def test_each_rank_sees_the_callers_environment_at_the_call(monkeypatch):
    monkeypatch.delenv("PYTORCH_NVML_BASED_CUDA_CHECK", raising=False)
    monkeypatch.setenv("TORCHREC_EXT_RANK_PROBE", "first")
    run_ranks(_sees, 2, "TORCHREC_EXT_RANK_PROBE", "first")
    monkeypatch.setenv("TORCHREC_EXT_RANK_PROBE", "second")  # the server runs on: a later value
    run_ranks(_sees, 2, "TORCHREC_EXT_RANK_PROBE", "second")
    monkeypatch.delenv("TORCHREC_EXT_RANK_PROBE")
    run_ranks(_sees, 2, "TORCHREC_EXT_RANK_PROBE", None)
    assert "PYTORCH_NVML_BASED_CUDA_CHECK" not in os.environ
