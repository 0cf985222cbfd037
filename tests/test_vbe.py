"""KJTs with a variable batch size per feature (TorchRec's VBE: ``stride_per_key_per_rank`` and
``inverse_indices``) in the dynamic EBC, its sharded module and the sharded FP-EBC over it
(issue 14, items 7 and 8): outputs, and after training the tables (and position weights'
gradients), equal those of the same module fed the batch expanded first (each sample's bag
written out), and the forward equals TorchRec's own EBC holding the same rows.
"""

import pytest
import torch
import torch.distributed as dist
from torchrec import KeyedJaggedTensor, PoolingType

from dist_helpers import ModelWith, dmp_of, run_ranks
from modules_helpers import copied_ebc
from torchrec_ext import (
    DynamicEmbeddingBagCollection,
    DynamicEmbeddingBagConfig,
    DynamicEmbeddingCollection,
    DynamicEmbeddingConfig,
)

BATCH = 5
POOL = [0, -1, 2**63 - 1, -(2**63), 5, 6, 7, 2**40, 123456789, -99]


def _tables(pooling=PoolingType.SUM):
    return [
        DynamicEmbeddingBagConfig(
            name="t1", embedding_dim=4, num_embeddings=256, feature_names=["f1", "f2"], pooling=pooling
        ),
        DynamicEmbeddingBagConfig(
            name="t2", embedding_dim=8, num_embeddings=256, feature_names=["f3"], pooling=pooling
        ),
    ]


def _vbe(keys, strides, weighted, seed, batch=BATCH):
    """(a VBE KJT: key k has strides[k] bags and sample b reads bag inverse[k, b]; the same batch
    with every sample's bags written out), built bag by bag."""
    g = torch.Generator().manual_seed(seed)
    bags = {
        k: [
            [
                POOL[int(i)]
                for i in torch.randint(0, len(POOL), (int(torch.randint(0, 4, (1,), generator=g)),), generator=g)
            ]
            for _ in range(s)
        ]
        for k, s in zip(keys, strides)
    }
    bag_weights = {k: [torch.rand(len(b), generator=g).tolist() for b in bags[k]] for k in keys}
    inverse = torch.stack([torch.randint(0, s, (batch,), generator=g) for s in strides])

    def kjt(per_key_bags, per_key_weights, **layout):
        values = [v for k in keys for bag in per_key_bags[k] for v in bag]
        weights = [w for k in keys for ws in per_key_weights[k] for w in ws]
        lengths = [len(bag) for k in keys for bag in per_key_bags[k]]
        return KeyedJaggedTensor(
            keys=list(keys),
            values=torch.tensor(values, dtype=torch.int64),
            lengths=torch.tensor(lengths),
            weights=torch.tensor(weights) if weighted else None,
            **layout,
        )

    vbe = kjt(bags, bag_weights, stride_per_key_per_rank=[[s] for s in strides], inverse_indices=(list(keys), inverse))
    expanded = kjt(
        {k: [bags[k][int(j)] for j in inverse[i]] for i, k in enumerate(keys)},
        {k: [bag_weights[k][int(j)] for j in inverse[i]] for i, k in enumerate(keys)},
        stride=batch,
    )
    return vbe, expanded


def _rows(module):
    """table -> id -> its vector and optimizer state (rows may sit elsewhere: ids arrive in
    another order)."""
    sd = module.state_dict()
    out = {}
    for cfg in module.embedding_bag_configs():
        prefix = f"embedding_bags.{cfg.name}."
        states = [k for k in sd if k.startswith(prefix + "optimizer.")]
        out[cfg.name] = {
            i: torch.cat([sd[prefix + "weight"][r]] + [sd[k][r].flatten() for k in states])
            for r, i in enumerate(sd[prefix + "weight_id"].tolist())
        }
    return out


@pytest.mark.parametrize("pooling", [PoolingType.SUM, PoolingType.MEAN])
@pytest.mark.parametrize("weighted", [False, True])
def test_variable_batch_trains_like_the_expanded_batch(pooling, weighted):
    """Keys in another order than the tables', one key no table reads; Adagrad, 4 steps."""
    make = lambda: DynamicEmbeddingBagCollection(
        _tables(pooling), is_weighted=weighted, optimizer="adagrad", optimizer_kwargs={"lr": 0.1}
    )
    ours, reference = make(), make()
    keys = ["f3", "x", "f1", "f2"]
    for step in range(4):
        vbe, expanded = _vbe(keys, [2, 1, 4, BATCH], weighted, step)
        got, want = ours(vbe), reference(expanded)
        assert got.keys() == want.keys() == ["f1", "f2", "f3"] and got.values().shape == (BATCH, 16)
        torch.testing.assert_close(got.values(), want.values(), rtol=1e-6, atol=1e-6)
        upstream = torch.randn(BATCH, 16, generator=torch.Generator().manual_seed(step))
        (got.values() * upstream).sum().backward()
        (want.values() * upstream).sum().backward()
    got, want = _rows(ours), _rows(reference)
    for table in want:
        assert got[table].keys() == want[table].keys()
        for i in want[table]:
            torch.testing.assert_close(got[table][i], want[table][i], rtol=1e-5, atol=1e-6)


def test_variable_batch_forward_equals_torchrecs_ebc():
    """TorchRec's EBC holding our rows (ids remapped to its row indices) reads the same VBE KJT."""
    ours = DynamicEmbeddingBagCollection(_tables(), optimizer="sgd")
    keys = ["f1", "f2", "f3"]  # TorchRec pairs inverse_indices with its features by position
    for step in range(3):
        ours(_vbe(keys, [3, 2, 4], False, step)[1]).values().sum().backward()
    ours.eval()
    theirs, maps = copied_ebc(ours)
    table_of = {"f1": "t1", "f2": "t1", "f3": "t2"}
    for step in range(3, 6):
        vbe, _ = _vbe(keys, [3, 1, 4], False, step)
        starts = torch.tensor([0] + vbe.length_per_key()).cumsum(0).tolist()
        values = [
            maps[table_of[k]].get(v, len(maps[table_of[k]]))
            for i, k in enumerate(keys)
            for v in vbe.values()[starts[i] : starts[i + 1]].tolist()
        ]
        remapped = KeyedJaggedTensor(
            keys=keys,
            values=torch.tensor(values),
            lengths=vbe.lengths(),
            stride_per_key_per_rank=vbe.stride_per_key_per_rank(),
            inverse_indices=vbe.inverse_indices(),
        )
        got, want = ours(vbe), theirs(remapped)
        assert got.keys() == want.keys()
        torch.testing.assert_close(got.values(), want.values())


def test_variable_batch_bad_input_is_refused_and_leaves_the_tables_unchanged():
    module = DynamicEmbeddingBagCollection(_tables(), optimizer="sgd")
    module(_vbe(["f1", "f2", "f3"], [BATCH] * 3, False, 0)[1]).values().sum().backward()
    before = _rows(module)
    vbe, _ = _vbe(["f1", "f2", "f3"], [2, 3, 1], False, 1)
    no_inverse = KeyedJaggedTensor(
        keys=vbe.keys(),
        values=vbe.values(),
        lengths=vbe.lengths(),
        stride_per_key_per_rank=vbe.stride_per_key_per_rank(),
    )
    with pytest.raises(ValueError, match="variable batch size per feature needs inverse_indices"):
        module(no_inverse)
    inverse = vbe.inverse_indices()[1].clone()
    inverse[1, 2] = 3  # key f2 has 3 bags: 0..2
    beyond = KeyedJaggedTensor(
        keys=vbe.keys(),
        values=vbe.values(),
        lengths=vbe.lengths(),
        stride_per_key_per_rank=vbe.stride_per_key_per_rank(),
        inverse_indices=(vbe.keys(), inverse),
    )
    with pytest.raises(ValueError, match=r"inverse_indices of key 'f2' must lie in \[0, 3\).*got values in \[0, 3\]"):
        module(beyond)
    after = _rows(module)
    assert (
        all(torch.equal(before[t][i], after[t][i]) for t in before for i in before[t]) and before.keys() == after.keys()
    )


def test_sequence_module_reads_each_features_own_bags_like_torchrecs_ec():
    """TorchRec's EC returns, for a VBE KJT, each feature's bags as given (no expansion): ours
    the same, with the vectors of the expanded batch's module for the same ids."""
    from torchrec import EmbeddingCollection, EmbeddingConfig

    configs = [DynamicEmbeddingConfig(name="t", embedding_dim=4, num_embeddings=64, feature_names=["f1", "f2"])]
    ours = DynamicEmbeddingCollection(configs, optimizer="sgd")
    vbe, _ = _vbe(["f1", "f2"], [2, 4], False, 3)
    ours(
        KeyedJaggedTensor(
            keys=vbe.keys(),
            values=vbe.values(),
            lengths=vbe.lengths(),
            stride_per_key_per_rank=vbe.stride_per_key_per_rank(),
            inverse_indices=vbe.inverse_indices(),
        )
    )["f1"].values().sum().backward()
    ours.eval()
    got = ours(vbe)
    theirs = EmbeddingCollection(
        [EmbeddingConfig(name="t", embedding_dim=4, num_embeddings=64, feature_names=["f1", "f2"])]
    )(
        KeyedJaggedTensor(
            keys=vbe.keys(),
            values=vbe.values() % 64,
            lengths=vbe.lengths(),
            stride_per_key_per_rank=vbe.stride_per_key_per_rank(),
            inverse_indices=vbe.inverse_indices(),
        )
    )
    sd = ours.state_dict()
    rows = dict(zip(sd["embeddings.t.weight_id"].tolist(), sd["embeddings.t.weight"]))
    for key in ("f1", "f2"):
        assert torch.equal(got[key].lengths(), theirs[key].lengths())
        want = (
            torch.stack([rows[i] for i in vbe[key].values().tolist()])
            if vbe[key].values().numel()
            else torch.zeros(0, 4)
        )
        torch.testing.assert_close(got[key].values(), want)


def _sharded_against_unsharded(rank, world_size, sharding):
    from torchrec.distributed.sharding_plan import row_wise, table_wise

    from torchrec_ext.distributed import DynamicEmbeddingBagCollectionSharder

    make = lambda: DynamicEmbeddingBagCollection(_tables(), optimizer="adagrad", optimizer_kwargs={"lr": 0.1})
    reference, model = make(), ModelWith("ebc", make())
    spec = {
        "row_wise": {t: row_wise(compute_kernel="customized_kernel") for t in ("t1", "t2")},
        "table_wise": {
            "t1": table_wise(rank=0, compute_kernel="customized_kernel"),
            "t2": table_wise(rank=1, compute_kernel="customized_kernel"),
        },
    }[sharding]
    dmp = dmp_of(model, "ebc", spec, DynamicEmbeddingBagCollectionSharder(), world_size)
    keys = ["f1", "f2", "f3"]
    for step in range(3):
        batches = [_vbe(keys, [1 + r, 3, BATCH - r], False, 10 * step + r) for r in range(world_size)]
        out = dmp(batches[rank][0])
        expanded = [b[1].to_dict() for b in batches]
        whole = KeyedJaggedTensor.from_jt_dict({k: _cat_jts([e[k] for e in expanded]) for k in keys})
        want = reference(whole)
        torch.testing.assert_close(out.values(), want.values()[rank * BATCH : (rank + 1) * BATCH], rtol=1e-5, atol=1e-5)
        upstream = [
            torch.randn(BATCH, 16, generator=torch.Generator().manual_seed(step * 7 + r)) for r in range(world_size)
        ]
        (out.values() * upstream[rank]).sum().backward()
        (want.values() * torch.cat(upstream)).sum().backward()
    local = dmp.module.ebc.local_module
    mine = (
        {}
        if local is None
        else {
            cfg.name: dict(
                zip(
                    local.state_dict()[f"embedding_bags.{cfg.name}.weight_id"].tolist(),
                    local.state_dict()[f"embedding_bags.{cfg.name}.weight"].tolist(),
                )
            )
            for cfg in local.embedding_bag_configs()
        }
    )
    gathered = [None] * world_size
    dist.all_gather_object(gathered, mine)
    sd = reference.state_dict()
    for cfg in reference.embedding_bag_configs():
        merged = {}
        for part in gathered:
            merged.update(part.get(cfg.name, {}))
        want = dict(zip(sd[f"embedding_bags.{cfg.name}.weight_id"].tolist(), sd[f"embedding_bags.{cfg.name}.weight"]))
        assert set(merged) == set(want), cfg.name
        for k, v in want.items():
            torch.testing.assert_close(torch.tensor(merged[k]), v, rtol=1e-5, atol=1e-5)


def _cat_jts(jts):
    from torchrec import JaggedTensor

    return JaggedTensor(values=torch.cat([j.values() for j in jts]), lengths=torch.cat([j.lengths() for j in jts]))


def _fp_ebc():
    """TorchRec's FP-EBC (position weights, set apart from 1) over a weighted dynamic EBC."""
    from torchrec.modules.feature_processor_ import PositionWeightedModuleCollection
    from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection

    ebc = DynamicEmbeddingBagCollection(_tables(), is_weighted=True, optimizer="adagrad", optimizer_kwargs={"lr": 0.1})
    processors = PositionWeightedModuleCollection(dict.fromkeys(["f1", "f2", "f3"], 4))
    with torch.no_grad():
        for i, w in enumerate(processors.position_weights.values()):
            w.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(i))
    return FeatureProcessedEmbeddingBagCollection(ebc, processors)


def _sharded_fp_against_unsharded(rank, world_size, sharding):
    """VBE KJTs through the sharded FP-EBC (DMP, the planner forcing ``sharding``): outputs and
    position-weight gradients (DDP's mean) equal the unsharded FP-EBC fed the expanded global
    batch with the ranks' mean loss."""
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology

    from torchrec_ext.distributed import get_sharders

    reference, model = ModelWith("fp", _fp_ebc()), ModelWith("fp", _fp_ebc())
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world_size, compute_device="cpu"),
        batch_size=BATCH,
        constraints={t: ParameterConstraints(sharding_types=[sharding]) for t in ("t1", "t2")},
    )
    plan = planner.collective_plan(model, get_sharders(), dist.group.WORLD)
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=get_sharders())
    ours = {n[n.index("fp.") :]: p for n, p in dmp.named_parameters() if "position_weight" in n}
    theirs = {n: p for n, p in reference.named_parameters() if "position_weight" in n}
    assert sorted(ours) == sorted(theirs) and len(theirs) == 3
    keys = ["f1", "f2", "f3"]
    for step in range(2):
        batches = [_vbe(keys, [1 + r, 3, BATCH - r], True, 10 * step + r) for r in range(world_size)]
        out = dmp(batches[rank][0]).values()
        expanded = [b[1].to_dict() for b in batches]
        whole = KeyedJaggedTensor.from_jt_dict({k: _cat_jts([e[k] for e in expanded]) for k in keys})
        want = reference(whole).values()
        torch.testing.assert_close(out, want[rank * BATCH : (rank + 1) * BATCH], rtol=1e-5, atol=1e-5)
        upstream = [torch.randn(BATCH, 16, generator=torch.Generator().manual_seed(step * 7 + r)) for r in range(2)]
        for p in [*ours.values(), *theirs.values()]:
            p.grad = None
        (out * upstream[rank]).sum().backward()
        ((want * torch.cat(upstream)).sum() / world_size).backward()  # the ranks train on their losses' mean
        for name, p in theirs.items():
            assert p.grad.abs().sum() > 0, name
            torch.testing.assert_close(ours[name].grad, p.grad, rtol=1e-5, atol=1e-6, msg=name)


def _sharded_cases(rank, world_size, sharding):
    _sharded_against_unsharded(rank, world_size, sharding)
    _sharded_fp_against_unsharded(rank, world_size, sharding)
    if sharding == "row_wise":  # the EC's cases (row-, table- and column-wise) once, in the same ranks
        _sharded_ec_against_unsharded(rank, world_size)


@pytest.mark.parametrize("sharding", ["row_wise", "table_wise"])
def test_sharded_variable_batch_equals_unsharded_on_two_ranks(sharding):
    run_ranks(_sharded_cases, 2, sharding)


def _sharded_ec_against_unsharded(rank, world_size):
    """VBE KJTs through the sharded EC (row-, table- and column-wise, DMP): each feature's own bags (as
    TorchRec's sharded EC gives them), with the vectors and trained tables of the unsharded EC fed
    the ranks' bags together."""
    from torchrec.distributed.sharding_plan import column_wise, row_wise, table_wise

    from dist_helpers import assert_same_tables
    from torchrec_ext.distributed import DynamicEmbeddingCollectionSharder, full_state_dict

    keys = ["f1", "f2", "f3"]
    make = lambda: DynamicEmbeddingCollection(
        [
            DynamicEmbeddingConfig(name="t1", embedding_dim=4, num_embeddings=256, feature_names=["f1", "f2"]),
            DynamicEmbeddingConfig(name="t2", embedding_dim=4, num_embeddings=256, feature_names=["f3"]),
        ],
        optimizer="adagrad",
        optimizer_kwargs={"lr": 0.1},
    )
    specs = (
        (row_wise(), table_wise(rank=0)),
        (table_wise(rank=1), table_wise(rank=0)),
        (column_wise(ranks=[0, 1]), column_wise(ranks=[1, 0])),  # every rank has columns of both
    )
    for t1, t2 in specs:
        reference, model = make(), ModelWith("ec", make())
        dmp = dmp_of(model, "ec", {"t1": t1, "t2": t2}, DynamicEmbeddingCollectionSharder(), world_size)
        for step in range(3):
            strides = [[1 + r, 3, BATCH - r] for r in range(world_size)]
            batches = [_vbe(keys, strides[r], False, 10 * step + r)[0] for r in range(world_size)]
            out = dmp(batches[rank])
            out = out.wait() if hasattr(out, "wait") else out
            per_key = [b.to_dict() for b in batches]
            whole = KeyedJaggedTensor(
                keys=keys,
                values=torch.cat([p[k].values() for k in keys for p in per_key]),
                lengths=torch.cat([p[k].lengths() for k in keys for p in per_key]),
                stride_per_key_per_rank=[[sum(s[i] for s in strides)] for i in range(len(keys))],
                inverse_indices=(
                    keys,
                    torch.zeros(len(keys), world_size * BATCH, dtype=torch.int64),
                ),  # unread by an EC
            )
            want = reference(whole)
            loss = ref_loss = 0
            for key in keys:
                assert torch.equal(out[key].lengths(), per_key[rank][key].lengths()), key
                before = sum(int(per_key[r][key].lengths().sum()) for r in range(rank))
                n = int(per_key[rank][key].lengths().sum())
                torch.testing.assert_close(out[key].values(), want[key].values()[before : before + n])
                loss, ref_loss = loss + out[key].values().sum(), ref_loss + want[key].values().sum()
            loss.backward()
            ref_loss.backward()  # each id's gradient comes whole from its own rank
        no_inverse = KeyedJaggedTensor(
            keys=keys,
            values=batches[rank].values(),
            lengths=batches[rank].lengths(),
            stride_per_key_per_rank=batches[rank].stride_per_key_per_rank(),
        )
        with pytest.raises(ValueError, match="ShardedDynamicEmbeddingCollection: .* needs inverse_indices"):
            dmp(no_inverse)
        whole_state = full_state_dict(dmp.state_dict())
        assert_same_tables(whole_state, {"ec." + k: v for k, v in reference.state_dict().items()}, "ec.embeddings.")
