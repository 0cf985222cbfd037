"""Devices of the sharded checkpoint layout, checked without a GPU: placements name the CUDA
index (torch refuses a shard on ``cuda:1`` placed at ``cuda``), every shard a rank holds (rows,
placeholders of tables it does not hold) is placed on that rank's table device, and the
row-count all-gather uses a tensor its group can take (NCCL has no CPU backend)."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import TensorProperties
from torch.distributed.remote_device import _remote_device
from torchrec import KeyedJaggedTensor

from dist_helpers import ModelWith, dmp_t1_row_t2_table_wise, run_ranks
from torchrec_ext import DynamicEmbeddingBagCollection, DynamicEmbeddingBagConfig
from torchrec_ext.distributed import sharded_state
from torchrec_ext.distributed.sharded_state import (
    ShardedDynamicState,
    collective_device,
    placement,
    rows_metadata,
    shard_device,
)


def test_placement_names_the_device_index_torch_compares():
    cuda1 = torch.device("cuda", 1)
    assert placement(2, cuda1) == "rank:2/cuda:1"
    assert placement(0, "cpu") == "rank:0/cpu"
    # What torch checks a local shard against: the placement's parsed device equals the tensor's.
    assert _remote_device(placement(3, cuda1)).device() == cuda1
    assert _remote_device("rank:3/cuda").device() != cuda1  # the old placement, refused for a cuda:1 shard


def test_cuda_without_index_is_the_current_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert shard_device("cuda") == torch.device("cuda", 3)
    assert shard_device(torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert placement(1, torch.device("cuda")) == "rank:1/cuda:3"


def test_rows_metadata_places_each_rank_on_its_own_device():
    props = TensorProperties.create_from_tensor(torch.empty(0, 4))
    devices = [torch.device("cuda", i) for i in range(3)]
    meta = rows_metadata([3, 0, 2], [4], props, devices)
    assert [(str(m.placement), m.shard_offsets, m.shard_sizes) for m in meta.shards_metadata] == [
        ("rank:0/cuda:0", [0, 0], [3, 4]),
        ("rank:2/cuda:2", [3, 0], [2, 4]),
    ]
    assert meta.size == torch.Size([5, 4])
    empty = rows_metadata([0, 0, 0], [4], props, devices)  # no rows anywhere: one empty shard on rank 0
    assert [(str(m.placement), m.shard_sizes) for m in empty.shards_metadata] == [("rank:0/cuda:0", [0, 4])]
    with pytest.raises(ValueError, match=r"devices must name one device per rank \(3\), got 2"):
        rows_metadata([3, 0, 2], [4], props, devices[:2])


@pytest.mark.parametrize(
    "backend, expected", [("gloo", "cpu"), ("cpu:gloo,cuda:nccl", "cpu"), ("nccl", "cuda:1"), ("cuda:nccl", "cuda:1")]
)
def test_collective_device_follows_the_group_backend(monkeypatch, backend, expected):
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    assert collective_device(object(), torch.device("cuda", 1)) == torch.device(expected)


def _configs():
    return [
        DynamicEmbeddingBagConfig(name="t1", embedding_dim=8, num_embeddings=512, feature_names=["f1"]),
        DynamicEmbeddingBagConfig(
            name="t2", embedding_dim=4, num_embeddings=256, feature_names=["f2"], ttl_steps=50, admit_after=2
        ),
    ]


def _sharded_ebc(world_size):
    model = ModelWith("ebc", DynamicEmbeddingBagCollection(_configs(), optimizer="adam", optimizer_kwargs={"lr": 0.05}))
    return dmp_t1_row_t2_table_wise(model, world_size)


def _state_placements_on_fake_cuda(rank, world_size):
    """Each rank's module reports cuda:<rank + 1>; the ShardedTensors it would build are recorded."""
    dmp = _sharded_ebc(world_size)
    gen = torch.Generator().manual_seed(rank)
    lengths = torch.randint(1, 4, (2 * 4,), generator=gen)
    kjt = KeyedJaggedTensor(
        keys=["f1", "f2"], values=torch.randint(0, 100, (int(lengths.sum()),), generator=gen), lengths=lengths, stride=4
    )
    for _ in range(2):  # t2 admits ids seen twice: rows and pending ids on the rank that holds it
        dmp(kjt).values().sum().backward()

    built = []
    mp = pytest.MonkeyPatch()
    mp.setattr(ShardedDynamicState, "_shard_device", lambda self: torch.device("cuda", rank + 1))
    mp.setattr(
        sharded_state, "sharded_tensor", lambda local, meta, r, pg: built.append((local, meta)) or len(built) - 1
    )
    try:
        state = dmp.module.ebc.state_dict()
    finally:
        mp.undo()

    expected = {f"embedding_bags.{t}.{k}" for t in ("t1", "t2") for k in ("weight", "weight_id", "counters")}
    expected |= {f"embedding_bags.t2.{k}" for k in ("last_seen", "admission_id", "admission_count")}
    assert expected <= set(state) and any(".optimizer." in k for k in state), sorted(state)
    layout = {}
    counters = {k: state.pop(k) for k in list(state) if k.endswith(".counters")}
    for key, i in sorted(state.items()):
        local, meta = built[i]
        placements = [str(m.placement) for m in meta.shards_metadata]
        # Every shard named on its own rank's device, with the index: the placeholders of t2 on
        # rank 0 (which does not hold it) included.
        assert placements == [
            f"rank:{m.placement.rank()}/cuda:{m.placement.rank() + 1}" for m in meta.shards_metadata
        ], key
        mine = [m for m in meta.shards_metadata if m.placement.rank() == rank]
        assert all(m.placement.device() == torch.device("cuda", rank + 1) for m in mine), key
        assert sum(m.shard_sizes[0] for m in mine) == local.shape[0], key
        layout[key] = [(p, m.shard_offsets, m.shard_sizes) for p, m in zip(placements, meta.shards_metadata)]
    # Counters are the unsharded module's [4], replicated: the same on every rank (rank 0 too, which
    # does not hold t2), on its tables' device.
    assert all(type(c) is torch.Tensor and c.shape == (5,) and c.device.type == "cpu" for c in counters.values())
    everyone = [None] * world_size
    dist.all_gather_object(everyone, (layout, {k: c.tolist() for k, c in counters.items()}))
    assert all(other == everyone[0] for other in everyone)  # every rank built the same metadata and counters


def test_state_dict_places_every_shard_on_its_rank_device():
    run_ranks(_state_placements_on_fake_cuda, 2)


def test_job_on_cuda_gives_host_side_collectives_a_cpu_backend(monkeypatch):
    """init_runtime on CUDA (faked): the default group takes CPU tensors through gloo and CUDA
    tensors through NCCL, so host-side collectives (checkpoint bookkeeping) need no GPU copy."""
    from torchrec_ext.train import runtime

    calls = []
    monkeypatch.setattr(runtime, "resolve_device", lambda name, local_rank, local_world_size=1: torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(runtime, "_die_with_launcher", lambda: None)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kwargs: calls.append(backend))
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1)
    monkeypatch.setenv("WORLD_SIZE", "1")
    rt = runtime.init_runtime("cuda")
    assert calls == [rt.backend]
    monkeypatch.setattr(dist, "get_backend", lambda group=None: rt.backend)
    assert collective_device(object(), rt.device) == torch.device("cpu")
    assert {pair.split(":")[0]: pair.split(":")[1] for pair in rt.backend.split(",")} == {"cpu": "gloo", "cuda": "nccl"}
