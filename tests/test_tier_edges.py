"""Edges of tiered tables (issue 16) found by the session-13 audit (benchmarks/results/issue16_audit.md):
a backing path that is a file, the job's hit rate before the prefetch's rows, and a batch sharing
the rows of a batch in flight; the pipeline's prefetch on 2 gloo ranks with index evictions, TTL
and admission on.

Oracles: the same batches through a tiered module that does not stage (its misses are the rows
the cache did not hold), and an all-resident module.
"""

import pytest
import torch
from torchrec import KeyedJaggedTensor

from torchrec_ext import DynamicEmbeddingBagCollection, DynamicEmbeddingBagConfig
from torchrec_ext.train.tier_traffic import TierTraffic, cache_text


def _module(backing=None, factor=0.1, capacity=100):
    tier = {} if backing is None else {"backing": backing, "cache_load_factor": factor}
    config = DynamicEmbeddingBagConfig(name="a", embedding_dim=4, num_embeddings=capacity, feature_names=["f"], **tier)
    return DynamicEmbeddingBagCollection([config], optimizer="adagrad", optimizer_kwargs={"lr": 0.1})


def _kjt(ids):
    return KeyedJaggedTensor.from_lengths_sync(["f"], ids, torch.tensor([ids.numel()]))


def test_a_backing_path_that_is_a_file_is_refused_as_not_a_directory(tmp_path):
    plain = tmp_path / "plain"
    plain.write_text("x")
    with pytest.raises(ValueError, match=r"backing directory '.*plain' is not a directory"):
        _module(f"file:{plain}")
    assert plain.read_text() == "x"


def test_the_jobs_hit_rate_before_the_staged_rows_is_the_unstaged_caches_hit_rate():
    # A cache of 32 rows over 64 ids, each batch 16 ids drawn around a moving window: rows are
    # evicted and come back. The staged module's step-time rate is ~1; before its staged rows,
    # it is the rate of the same cache without the prefetch.
    staged, plain = _module("host", 0.25, 128), _module("host", 0.25, 128)
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randperm(24, generator=gen)[:16] + 2 * step) % 64 for step in range(40)]
    traffic = {"staged": TierTraffic(), "plain": TierTraffic()}
    for step, ids in enumerate(batches):
        if step + 1 < len(batches):
            staged.stage_next(_kjt(batches[step + 1]))
        for name, module in (("staged", staged), ("plain", plain)):
            module(_kjt(ids)).values().square().sum().backward()
            if step >= 4:  # after the cache has filled
                traffic[name].add(module.tier_step_stats())
    mine, theirs = traffic["staged"].reduced()["a"], traffic["plain"].reduced()["a"]
    assert mine["staged"] > 0 and theirs["misses"] > 0 and mine["misses"] < theirs["misses"]
    assert mine["hit_rate"] > theirs["hit_rate"]
    assert mine["held_hit_rate"] == theirs["hit_rate"]
    assert theirs["held_hit_rate"] == theirs["hit_rate"]  # nothing staged: the same rate
    assert f"before the {mine['staged']:,} rows staged ahead" in cache_text(mine)
    assert "staged ahead" not in cache_text(theirs)


def test_a_batch_sharing_the_rows_of_a_batch_in_flight_needs_no_more_slots():
    # 10 slots; a batch of 8 ids is in flight (forward done, update pending); the same 8 ids again
    # need no new slot, as an all-resident table needs no new row.
    resident, tiered = _module(), _module("host")
    for module in (resident, tiered):
        pending = module(_kjt(torch.arange(8))).values().sum()
        again = module(_kjt(torch.arange(8))).values().sum()
        (pending + again).backward()
    for key, value in resident.state_dict().items():
        assert torch.equal(value, tiered.state_dict()[key]), key


def _pipeline_with_churn_equals_resident(rank, world_size, root):
    import os

    import torch.distributed as dist
    from torchrec import DataType

    from dist_helpers import DIM, NUM_TABLES, local_state, make_batches, make_dmp_dlrm, plain_loop, progress_losses
    from torchrec_ext.distributed.table_stats import model_table_stats
    from torchrec_ext.pipeline import PipelineOptions, TrainPipeline

    # 64 ids in 40 rows a table (index evictions every step), TTL, admission and FP16 rows, a
    # cache of half of each share: the prefetch stages rows while the index evicts and expires.
    tiers = lambda backing: [
        DynamicEmbeddingBagConfig(
            name=f"t{i}",
            embedding_dim=DIM,
            num_embeddings=40,
            feature_names=[f"f{i}"],
            eviction_policy=("lru", "lfu")[i % 2],
            ttl_steps=6 if i == 2 else None,
            **({"admission": "counter", "admit_after": 2} if i == 1 else {}),
            data_type=DataType.FP16 if i == 2 else DataType.FP32,
            **({} if backing is None else {"backing": backing, "cache_load_factor": 0.5}),
        )
        for i in range(NUM_TABLES)
    ]
    batches = make_batches(rank, batch_size=3, num_full=24, last=0)
    resident, resident_opt = make_dmp_dlrm(world_size, dynamic=True, tables=tiers(None))
    want = plain_loop(resident, resident_opt, batches)
    directory = os.path.join(root, f"rank{rank}")
    os.makedirs(directory, exist_ok=True)
    dmp, opt = make_dmp_dlrm(
        world_size, dynamic=True, tables=tiers(f"file:{directory}"), ebc_device=torch.device("meta")
    )
    stats = []
    options = PipelineOptions(prefetch_threads=0, tier_prefetch=True)
    with TrainPipeline(dmp, opt, torch.device("cpu"), options) as pipeline:
        losses = progress_losses(pipeline, batches, stats)
    assert len(losses) == len(want) and all(torch.equal(a, b) for a, b in zip(losses, want))
    a, b = local_state(resident), local_state(dmp)
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
    # the cache moved rows both ways: staged in ahead, and dirty rows written back as they left it
    moved = torch.tensor(
        [
            sum(s[key] for step in stats for s in step.values())
            for key in ("staged", "staged_write_backs", "bytes_moved")
        ]
    )
    dist.all_reduce(moved)
    tables = model_table_stats(dmp)  # (summed over the ranks)
    assert bool((moved > 0).all()) and all(tables[f"t{i}"].evictions > 0 for i in range(NUM_TABLES)), (moved, tables)
    assert tables["t1"].admission_rejections > 0 and tables["t2"].ttl_expiries > 0


def test_the_pipelines_prefetch_on_two_ranks_equals_resident_tables_with_evictions_ttl_and_admission(tmp_path):
    from dist_helpers import run_ranks

    run_ranks(_pipeline_with_churn_equals_resident, 2, str(tmp_path))
