"""The tables' stats through TorchRec's metrics module (issue 18 item 4):
``RecMetricModule(state_metrics={"table_stats": TableStatsMetric(model)}).compute()`` against
counts kept by brute force over the fed ids, unsharded, and on 2 gloo ranks against the
unsharded module fed both ranks' batches (every rank gets the same values)."""

import pytest
import torch
from torchrec import KeyedJaggedTensor
from torchrec.metrics.metric_module import RecMetricModule

from dist_helpers import ModelWith, dmp_of, run_ranks
from torchrec_ext import DynamicEmbeddingBagCollection, DynamicEmbeddingBagConfig
from torchrec_ext.distributed.table_metrics import TableStatsMetric

CAPACITY = 1 << 12
TABLES = ("a", "b")


def _module():
    cfgs = [
        DynamicEmbeddingBagConfig(name=t, embedding_dim=4, num_embeddings=CAPACITY, feature_names=[f"f_{t}"])
        for t in TABLES
    ]
    return DynamicEmbeddingBagCollection(cfgs, optimizer="sgd", optimizer_kwargs={"lr": 0.1})


def _kjt(ids):
    """Bags of 3 ids per feature."""
    return KeyedJaggedTensor.from_lengths_sync(
        [f"f_{t}" for t in TABLES],
        torch.cat([ids[t] for t in TABLES]),
        torch.full((sum(len(v) for v in ids.values()) // 3,), 3),
    )


def _batch(step, part):
    """Ids of both features of one batch (20 bags of 3 per feature), overlapping across steps."""
    gen = torch.Generator().manual_seed(100 * step + part)
    ids = {t: torch.randint(0, 150 * (i + 1), (60,), generator=gen) * 7919 - 10**12 for i, t in enumerate(TABLES)}
    return ids, _kjt(ids)


def _metrics(model):
    return RecMetricModule(batch_size=20, world_size=1, state_metrics={"table_stats": TableStatsMetric(model)})


def test_metric_module_reports_each_tables_counts_and_their_totals():
    module, seen = _module(), {t: set() for t in TABLES}
    truth = {t: dict(lookups=0, hits=0) for t in TABLES}
    for step in range(6):
        ids, kjt = _batch(step, 0)
        module(kjt).values().sum().backward()
        for t in TABLES:
            earlier = seen[t].copy()
            truth[t]["lookups"] += ids[t].numel()
            truth[t]["hits"] += sum(i in earlier for i in ids[t].tolist())
            seen[t].update(ids[t].tolist())
    got = {k: float(v) for k, v in _metrics(module).compute().items()}
    for t in TABLES:
        assert got[f"table_stats|{t}/lookups"] == truth[t]["lookups"]
        assert got[f"table_stats|{t}/hits"] == truth[t]["hits"] > 0
        assert got[f"table_stats|{t}/inserts"] == got[f"table_stats|{t}/live_rows"] == len(seen[t])
        assert got[f"table_stats|{t}/capacity"] == CAPACITY and got[f"table_stats|{t}/evictions"] == 0
        assert got[f"table_stats|{t}/load_factor"] == pytest.approx(len(seen[t]) / CAPACITY)
    lookups, hits = (sum(truth[t][k] for t in TABLES) for k in ("lookups", "hits"))
    assert got["table_stats|lookups"] == lookups and got["table_stats|hits"] == hits
    assert got["table_stats|hit_rate"] == pytest.approx(hits / lookups)
    assert got["table_stats|load_factor"] == pytest.approx(sum(len(s) for s in seen.values()) / (2 * CAPACITY))
    assert "table_stats|evicted_age_mean" not in got  # undefined (no ttl_steps, no eviction): left out


def test_an_untrained_module_reports_zeros_and_no_rates():
    got = _metrics(_module()).compute()
    assert float(got["table_stats|a/lookups"]) == 0 and "table_stats|a/hit_rate" not in got


def _sharded(rank, world_size, out):
    import torch.distributed as dist
    from torchrec.distributed.sharding_plan import row_wise

    from torchrec_ext.distributed import DynamicEmbeddingBagCollectionSharder

    generators = {t: row_wise(compute_kernel="customized_kernel") for t in TABLES}
    dmp = dmp_of(ModelWith("ebc", _module()), "ebc", generators, DynamicEmbeddingBagCollectionSharder(), world_size)
    for step in range(6):
        dmp(_batch(step, rank)[1]).values().sum().backward()
    metrics = RecMetricModule(
        batch_size=20, world_size=world_size, state_metrics={"table_stats": TableStatsMetric(dmp)}
    )
    got = {k: float(v) for k, v in metrics.compute().items()}  # collective
    everyone = [None] * world_size
    dist.all_gather_object(everyone, got)
    if rank == 0:
        torch.save(everyone, out)


def test_sharded_values_are_the_unsharded_modules_on_every_rank(tmp_path):
    out = str(tmp_path / "metrics.pt")
    run_ranks(_sharded, 2, out)
    per_rank = torch.load(out)
    unsharded = _module()
    for step in range(6):  # the global batch: both ranks' bags in one
        parts = [_batch(step, rank)[0] for rank in range(2)]
        unsharded(_kjt({t: torch.cat([p[t] for p in parts]) for t in TABLES})).values().sum().backward()
    want = {k: float(v) for k, v in _metrics(unsharded).compute().items()}
    assert per_rank[0] == per_rank[1]
    assert per_rank[0].keys() == want.keys()
    for key, value in want.items():
        assert per_rank[0][key] == pytest.approx(value, rel=1e-12), key
    assert want["table_stats|hits"] > 0
