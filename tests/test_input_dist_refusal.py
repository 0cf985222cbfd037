"""A batch refused by one rank's checks, on 2 real gloo ranks: every rank raises at the input
dist's counts exchange (the refusing rank its own error, the other a BatchRefusedError naming
it), none is left waiting in a collective (a 20 s collective timeout fails a regression fast),
every table is unchanged on every rank, and the next good step gives what a run that never saw
the refused batch gives. Sharded EBC (plain and weighted) and EC called directly, our
TrainPipeline (input dist threaded, inline and deferred) and TorchRec's TrainPipelineSparseDist."""

import time

import pytest
import torch
import torch.distributed as dist
from torchrec import KeyedJaggedTensor

from dist_helpers import ModelWith, local_state, run_ranks
from torchrec_ext import device_sync

WORLD, KEYS, BAD_RANK, TIMEOUT_S = 2, ["f1", "f2", "f3"], 1, 20


def _good(step, rank, weighted, batch=4):
    gen = torch.Generator().manual_seed(100 * step + rank)
    lengths = torch.randint(0, 3, (len(KEYS) * batch,), generator=gen)
    n = int(lengths.sum())
    return KeyedJaggedTensor(
        keys=KEYS,
        values=torch.randint(0, 50, (n,), generator=gen),
        lengths=lengths,
        weights=torch.rand(n, generator=gen) if weighted else None,
    )


def _kjt(values, lengths, weighted, keys=KEYS, **kw):
    values = torch.tensor(values)
    weights = torch.ones(values.shape) if weighted else None
    return KeyedJaggedTensor(keys=keys, values=values, lengths=torch.tensor(lengths), weights=weights, **kw)


# (name, KJT of the refused batch (weighted module?), what its rank raises, checked deferred as on a GPU)
def _bad_cases(weighted):
    cases = [
        ("float ids", _kjt([1.0, 2.0], [1, 0, 1, 0, 0, 0], weighted), TypeError, "must be int64 or int32", False),
        ("missing key", _kjt([1, 2], [1, 1], weighted, keys=["f1"]), ValueError, "lacks the features", False),
        ("repeated key", _kjt([1, 2, 3], [1, 1, 1], weighted, keys=["f1", "f1", "f3"]), ValueError, "distinct", False),
        ("lengths sum", _kjt([1, 2], [1, 1, 1, 0, 0, 0], weighted), ValueError, "sum to 3 but there are 2", False),
        ("negative length", _kjt([1, 2], [2, -1, 1, 0, 0, 0], weighted), ValueError, "must be >= 0", False),
        (
            "length_per_key disagrees (checked on the device)",
            _kjt([1, 2, 3], [1, 1, 1, 0, 0, 0], weighted, length_per_key=[1, 1, 1]),
            ValueError,
            "must sum to its length_per_key entry",
            True,
        ),
    ]
    if weighted:
        kjt = _kjt([1, 2], [1, 0, 1, 0, 0, 0], False)
        cases.append(("no weights", kjt, ValueError, "has no weights", False))
        nan = KeyedJaggedTensor(
            keys=KEYS,
            values=torch.tensor([1, 2]),
            lengths=torch.tensor([1, 0, 1, 0, 0, 0]),
            weights=torch.tensor([1.0, float("nan")]),
            length_per_key=[1, 1, 0],
        )
        cases.append(("nan weight (checked on the device)", nan, ValueError, "must be finite", True))
    return cases


def _modules(kind):
    from torchrec_ext import (
        DynamicEmbeddingBagCollection,
        DynamicEmbeddingBagConfig,
        DynamicEmbeddingCollection,
        DynamicEmbeddingConfig,
    )

    if kind == "ec":
        return DynamicEmbeddingCollection(
            [
                DynamicEmbeddingConfig(name="t1", embedding_dim=4, num_embeddings=64, feature_names=["f1", "f3"]),
                DynamicEmbeddingConfig(name="t2", embedding_dim=4, num_embeddings=64, feature_names=["f2"]),
            ],
            optimizer="adagrad",
            optimizer_kwargs={"lr": 0.1},
        )
    return DynamicEmbeddingBagCollection(
        [
            DynamicEmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=64, feature_names=["f1", "f2"]),
            DynamicEmbeddingBagConfig(name="t2", embedding_dim=3, num_embeddings=64, feature_names=["f3"]),
        ],
        is_weighted=kind == "weighted ebc",
        optimizer="adagrad",
        optimizer_kwargs={"lr": 0.1},
    )


def _sharded(kind, world_size):
    from torchrec.distributed.sharding_plan import row_wise, table_wise

    from dist_helpers import dmp_of
    from torchrec_ext.distributed import get_sharders

    module = _modules(kind)
    sharder = next(s for s in get_sharders() if s.module_type is type(module))
    plan = {
        "t1": row_wise(compute_kernel="customized_kernel"),
        "t2": table_wise(rank=1, compute_kernel="customized_kernel"),
    }
    return dmp_of(ModelWith("m", module), "m", plan, sharder, world_size)


def _step(dmp, kjt, scale):
    out = dmp(kjt)
    out = out.wait() if hasattr(out, "wait") else out
    values = out.values() if isinstance(out.values(), torch.Tensor) else torch.cat([jt.values() for jt in out.values()])
    (values * scale).sum().backward()
    return values.detach()


def _refused_everywhere(rank, world_size):
    from torchrec_ext.distributed import BatchRefusedError

    for kind in ("ebc", "weighted ebc", "ec"):
        weighted = kind == "weighted ebc"
        refused, never = _sharded(kind, world_size), _sharded(kind, world_size)  # the latter never sees a bad batch
        for step, (name, bad, error, match, deferred) in enumerate(_bad_cases(weighted)):
            where = (kind, name)
            before = local_state(refused)
            mine = bad if rank == BAD_RANK else _good(step, rank, weighted)
            device_sync.defer_on_cpu = deferred  # the order of a GPU: raised at the exchange's host read
            try:
                try:
                    _step(refused, mine, 1.0)
                except Exception as raised:  # noqa: BLE001 - its type is checked below
                    got = raised
                else:
                    raise AssertionError(f"{where}: rank {rank} did not raise")
            finally:
                device_sync.defer_on_cpu = False
            if rank == BAD_RANK:
                assert isinstance(got, error) and match in str(got), (where, repr(got))
            else:
                assert isinstance(got, BatchRefusedError), (where, repr(got))
                assert f"rank(s) [{BAD_RANK}] refused" in str(got), (where, str(got))
            after = local_state(refused)
            assert after.keys() == before.keys(), where
            for key in before:
                torch.testing.assert_close(after[key], before[key], rtol=0, atol=0, msg=f"{where}: {key}")
            # The next good step, on both models: the same outputs and tables.
            good = _good(1000 + step, rank, weighted)
            torch.testing.assert_close(
                _step(refused, good, step + 1.0), _step(never, good, step + 1.0), rtol=0, atol=0, msg=str(where)
            )
            got_state, want_state = local_state(refused), local_state(never)
            for key in want_state:
                torch.testing.assert_close(got_state[key], want_state[key], rtol=0, atol=0, msg=f"{where}: {key}")
        # Both ranks refusing: each raises its own error.
        try:
            _step(refused, _kjt([1.0], [1, 0, 0, 0, 0, 0], weighted), 1.0)
        except TypeError as raised:
            assert "must be int64 or int32" in str(raised), (kind, str(raised))
        else:
            raise AssertionError(f"{kind}: rank {rank} did not raise")


def test_one_rank_refusing_its_batch_raises_on_every_rank():
    run_ranks(_refused_everywhere, WORLD, timeout_s=TIMEOUT_S)


def _float_ids(batch):
    """``batch`` with its ids as floats: refused by the sharded EBC's checks."""
    from torchrec.datasets.utils import Batch

    kjt = batch.sparse_features
    bad = KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values().float(), lengths=kjt.lengths())
    return Batch(dense_features=batch.dense_features, sparse_features=bad, labels=batch.labels)


def _wrong_length_per_key(batch):
    """``batch`` with a length_per_key its lengths disagree with (the same total): refused by a
    check deferred on the device, raised at the next host read on a GPU."""
    from torchrec.datasets.utils import Batch

    kjt = batch.sparse_features
    per_key = kjt.lengths().view(len(kjt.keys()), -1).sum(1).tolist()
    assert per_key[1] >= 1
    per_key[0], per_key[1] = per_key[0] + 1, per_key[1] - 1
    bad = KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values(), lengths=kjt.lengths(), length_per_key=per_key)
    return Batch(dense_features=batch.dense_features, sparse_features=bad, labels=batch.labels)


def progress_until_raised(pipeline, it, where) -> tuple[int, Exception]:
    """(steps run, the error raised) of ``pipeline.progress(it)`` run until it raises."""
    done = 0
    try:
        while True:
            pipeline.progress(it)
            done += 1
    except StopIteration:
        raise AssertionError(f"{where}: rank {dist.get_rank()} ran every batch") from None
    except Exception as raised:  # noqa: BLE001 - the caller checks its type
        return done, raised


# how the bad rank's batch is refused: (made bad by, its error, its message, checked deferred as on a GPU)
REFUSALS = {
    "float ids": (_float_ids, TypeError, "must be int64 or int32", False),
    # The pipelines that wait for the counts after the previous batch's forward (deferred, TorchRec's)
    # read the host in that forward first: the check must still raise at the counts' wait.
    "length_per_key (checked on the device)": (_wrong_length_per_key, ValueError, "length_per_key entry", True),
}


def _pipelines_raise_everywhere(rank, world_size, refusal):
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    from dist_helpers import make_batches, make_dmp_dlrm, plain_loop
    from torchrec_ext.distributed import BatchRefusedError
    from torchrec_ext.pipeline import PipelineOptions, TrainPipeline

    def ours(options, defer=False):
        def make(model, optimizer):
            pipeline = TrainPipeline(model, optimizer, torch.device("cpu"), options)
            pipeline._defer_dist_wait = defer  # (NCCL's order: the counts waited after the forward)
            return pipeline

        return make

    makers = {
        "threaded": ours(PipelineOptions(threaded_input_dist=True, prefetch_threads=0, timeout_s=10)),
        "inline": ours(PipelineOptions(threaded_input_dist=False, prefetch_threads=0, timeout_s=10)),
        "deferred": ours(PipelineOptions(threaded_input_dist=False, prefetch_threads=0, timeout_s=10), defer=True),
        "torchrec": lambda model, optimizer: TrainPipelineSparseDist(model, optimizer, torch.device("cpu")),
    }
    make_bad, error, match, deferred = REFUSALS[refusal]
    batches = make_batches(rank, batch_size=4, num_full=5, last=0)
    fed = list(batches)
    if rank == BAD_RANK:
        fed[3] = make_bad(fed[3])
    for name, make in makers.items():
        model, optimizer = make_dmp_dlrm(world_size, dynamic=True)
        pipeline = make(model, optimizer)
        it = iter(fed)
        device_sync.defer_on_cpu = deferred
        try:
            done, got = progress_until_raised(pipeline, it, name)
        finally:
            device_sync.defer_on_cpu = False
        if rank == BAD_RANK:
            assert isinstance(got, error) and match in str(got), (name, repr(got))
        else:
            assert isinstance(got, BatchRefusedError) and f"[{BAD_RANK}] refused" in str(got), (name, repr(got))
        if name != "torchrec":  # ours refuses a next progress() at once (no input dist for its batch)
            began = time.monotonic()
            try:
                pipeline.progress(it)
            except RuntimeError as again:
                assert "progress() after an input dist that raised" in str(again), (name, str(again))
            else:
                raise AssertionError(f"{name}: progress() after the refusal ran")
            assert time.monotonic() - began < 5, name
        steps = [None] * world_size
        dist.all_gather_object(steps, done)
        assert steps == [done] * world_size and done <= 3, (name, steps)  # the same steps on every rank
        if hasattr(pipeline, "close"):
            pipeline.close()
        # The tables and dense parts: those of a plain loop over the steps done, every rank.
        oracle, oracle_optimizer = make_dmp_dlrm(world_size, dynamic=True)
        plain_loop(oracle, oracle_optimizer, batches[:done])
        if name in ("deferred", "torchrec"):  # the counts waited after the forward: batch `done`'s ran, everywhere
            oracle(batches[done])
        got_state, want_state = local_state(model), local_state(oracle)
        assert got_state.keys() == want_state.keys(), name
        for key in want_state:
            torch.testing.assert_close(got_state[key], want_state[key], rtol=0, atol=0, msg=f"{name}: {key}")
        if name != "torchrec":  # (our pipeline gives the model back on close: it trains on)
            torch.testing.assert_close(
                plain_loop(model, optimizer, batches[4:]), plain_loop(oracle, oracle_optimizer, batches[4:]), msg=name
            )


@pytest.mark.parametrize("refusal", list(REFUSALS))
def test_pipelines_raise_on_every_rank_for_a_batch_one_rank_refused(refusal):
    run_ranks(_pipelines_raise_everywhere, WORLD, refusal, timeout_s=TIMEOUT_S)
