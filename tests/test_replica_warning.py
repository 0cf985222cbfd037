"""An unsharded dynamic module training on several ranks warns, once, that its replicas diverge
(replica_check.py); it does not warn at world size 1, sharded (DMP with our sharders), in eval
mode or without grad, nor with ``per_rank_tables``. The oracle for the warning's claim: the 2
ranks' tables after DDP training, gathered and compared (TorchRec's own EBC under the same DDP
stays equal)."""

import warnings

import torch
import torch.distributed as dist
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingConfig, KeyedJaggedTensor

from dist_helpers import ModelWith, make_batches, make_dmp_dlrm, plain_loop, run_ranks
from torchrec_ext import DynamicEmbeddingBagCollection, DynamicEmbeddingCollection

WORLD = 2
MARK = "per_rank_tables"  # in the warning's text, and in no other warning


def _bag_tables():
    return [EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=64, feature_names=["a"])]


def _seq_tables():
    return [EmbeddingConfig(name="s", embedding_dim=4, num_embeddings=64, feature_names=["a"])]


def _kjt(step, rank):
    """One bag of ids that differ per rank and per step, one id shared by every rank."""
    return KeyedJaggedTensor.from_lengths_sync(["a"], torch.tensor([step + 10 * rank, 3]), torch.tensor([1, 1]))


class _Head(nn.Module):
    """A dense layer over the embedding module's output: what DDP averages."""

    def __init__(self, embeddings):
        super().__init__()
        self.embeddings, self.linear = embeddings, nn.Linear(4, 1)

    def forward(self, kjt):
        out = self.embeddings(kjt)  # a KeyedTensor, or a dict of JaggedTensors
        values = torch.cat([jt.values() for jt in out.values()]) if isinstance(out, dict) else out.values()
        return self.linear(values).sum()


def _replica_warnings(steps):
    """The replica warnings ``steps()`` gives (each warning recorded however often it repeats)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        steps()
    return [str(w.message) for w in caught if MARK in str(w.message)]


def _train(model, rank, steps=3):
    for step in range(steps):
        model(_kjt(step, rank)).backward()


def _tables_equal_across_ranks(ebc):
    """Whether every rank's module pools ids 0..29 alike (eval: nothing inserted)."""
    ebc.eval()
    with torch.no_grad():
        kjt = KeyedJaggedTensor.from_lengths_sync(["a"], torch.arange(30), torch.ones(30, dtype=torch.long))
        out = ebc(kjt).values()
    ebc.train()
    everyone = [torch.empty_like(out) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, out)
    return all(torch.equal(everyone[0], o) for o in everyone)


def _under_ddp(rank, world_size):
    # TorchRec's EBC under DDP: its gradient is all-reduced, the replicas stay equal.
    torch.manual_seed(0)
    stock = _Head(EmbeddingBagCollection(tables=_bag_tables()))
    ddp = nn.parallel.DistributedDataParallel(stock)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(3):
        optimizer.zero_grad()
        ddp(_kjt(step, rank)).backward()
        optimizer.step()
    assert _tables_equal_across_ranks(stock.embeddings)

    # Ours under the same DDP: one warning over 3 steps, naming the module, the world size, DDP
    # and what to do; and what it says happens (the ranks' tables differ). (No optimizer chosen
    # before DDP wraps it: DDP's first forward then fails in torch's own optimizer-in-backward
    # setup, as it would for TorchRec's EBC with apply_optimizer_in_backward, on CPU.)
    ebc = DynamicEmbeddingBagCollection(_bag_tables())
    ddp = nn.parallel.DistributedDataParallel(_Head(ebc))
    said = _replica_warnings(lambda: _train(ddp, rank))
    assert len(said) == 1, said
    message = said[0]
    for part in (
        "DynamicEmbeddingBagCollection (tables 't')",
        f"rank {rank} of {world_size}",
        "inside torch's DistributedDataParallel",
        "diverge",
        "DistributedModelParallel(model, sharders=torchrec_ext.distributed.get_sharders())",
        "DynamicEmbeddingBagCollection(..., per_rank_tables=True)",
    ):
        assert part in message, (part, message)
    assert not _tables_equal_across_ranks(ebc)


def _plain_ranks_eval_and_opt_out(rank, world_size):
    # No DDP: the same divergence, the same warning without DDP's name; eval-mode forwards (grad
    # on) and no-grad training forwards first say nothing and do not use up the one warning.
    ec = DynamicEmbeddingCollection(_seq_tables(), optimizer="adagrad", optimizer_kwargs={"lr": 0.1})
    model = _Head(ec)

    def not_training():
        ec.eval()
        for step in range(2):
            model(_kjt(step, rank)).backward()
        ec.train()
        with torch.no_grad():
            model(_kjt(0, rank))

    assert _replica_warnings(not_training) == []
    said = _replica_warnings(lambda: _train(model, rank))
    assert len(said) == 1 and "DynamicEmbeddingCollection (tables 's')" in said[0], said
    assert "DistributedDataParallel" not in said[0].split(".")[0]  # the first sentence: no DDP here
    assert _replica_warnings(lambda: _train(model, rank)) == []  # once per module

    # The opt-out: the constructor's argument, or the attribute set afterwards.
    by_argument = DynamicEmbeddingBagCollection(_bag_tables(), per_rank_tables=True)
    by_attribute = DynamicEmbeddingCollection(_seq_tables(), optimizer="sgd", optimizer_kwargs={"lr": 0.1})
    by_attribute.per_rank_tables = True
    quiet = _replica_warnings(
        lambda: [
            _train(nn.parallel.DistributedDataParallel(_Head(by_argument)), rank),
            _train(_Head(by_attribute), rank),
        ]
    )
    assert quiet == []


def _sharded(rank, world_size):
    # DMP with our sharders (it wraps the dense part in DDP): this rank's share of the tables is a
    # plain module, and says nothing.
    from torchrec.distributed import DistributedModelParallel

    from torchrec_ext.distributed import get_sharders

    dmp, optimizer = make_dmp_dlrm(world_size, dynamic=True)
    said = _replica_warnings(lambda: plain_loop(dmp, optimizer, make_batches(rank, 4, 3, 0)))
    assert said == [] and dmp.module.model.sparse_arch.embedding_bag_collection.local_module is not None

    # (DMP plans it: the planner picks the EC's sharding among ours)
    model = ModelWith("ec", DynamicEmbeddingCollection(_seq_tables(), optimizer="sgd", optimizer_kwargs={"lr": 0.1}))
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), sharders=get_sharders())
    assert type(dmp.module.ec).__name__ == "ShardedDynamicEmbeddingCollection"

    def steps():
        for step in range(3):
            out = dmp(_kjt(step, rank))
            out = out.wait() if hasattr(out, "wait") else out
            sum(jt.values().sum() for jt in out.values()).backward()

    assert _replica_warnings(steps) == []


def test_unsharded_under_ddp_warns_once_and_diverges():
    run_ranks(_under_ddp, WORLD)


def test_unsharded_without_ddp_warns_once_in_training_only_and_opt_out_silences():
    run_ranks(_plain_ranks_eval_and_opt_out, WORLD)


def test_sharded_modules_do_not_warn():
    run_ranks(_sharded, WORLD)


def test_no_process_group_does_not_warn():
    assert not dist.is_initialized()
    for module in (DynamicEmbeddingBagCollection(_bag_tables()), DynamicEmbeddingCollection(_seq_tables())):
        assert _replica_warnings(lambda: _train(_Head(module), 0)) == []


def test_one_rank_does_not_warn(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        for module in (DynamicEmbeddingBagCollection(_bag_tables()), DynamicEmbeddingCollection(_seq_tables())):
            assert _replica_warnings(lambda: _train(nn.parallel.DistributedDataParallel(_Head(module)), 0)) == []
    finally:
        dist.destroy_process_group()
