"""Learned fallback rows (``fallback_rows=K``): ids without a row of their own (not admitted,
refused by a full table, expired) read one of K shared rows, which train with the fused
optimizer. Checked against a brute-force model written here (a dict of id -> row, K fallback
rows, the forward pooled by hand and SGD / Adagrad stepped by hand), on 2 gloo ranks against
the unsharded module, and through checkpoints."""

import os

import pytest
import torch
import torch.distributed as dist
from torchrec import KeyedJaggedTensor, PoolingType

from dist_helpers import ModelWith, dmp_of, run_ranks
from torchrec_ext import (
    DynamicEmbeddingBagCollection,
    DynamicEmbeddingBagConfig,
    DynamicEmbeddingCollection,
    Initializer,
)
from torchrec_ext.modules.configs import DynamicEmbeddingConfig
from torchrec_ext.reference import fallback_seed, table_seed

MASK = (1 << 64) - 1
DIM, K, LR, EPS, INIT = 4, 3, 0.1, 1e-8, 0.05


def _fmix64(k: int) -> int:
    k ^= k >> 33
    k = (k * 0xFF51AFD7ED558CCD) & MASK
    k ^= k >> 33
    k = (k * 0xC4CEB9FE1A85EC53) & MASK
    return k ^ (k >> 33)


def _slot(i: int, name: str, seed: int = 0, k: int = K) -> int:
    """The fallback row of id i, as documented: fmix64(id ^ fallback seed) >> 1, modulo K."""
    return (_fmix64((i ^ fallback_seed(table_seed(seed, name))) & MASK) >> 1) % k


class Oracle:
    """One table by brute force: rows by id, K fallback rows, and the rule deciding which ids
    get a row (admission after ``admit_after`` sightings, at most ``capacity`` rows, rows unseen
    for more than ``ttl`` training steps expired)."""

    def __init__(self, name, optimizer, capacity=10**9, admit_after=1, ttl=None, k=K):
        self.name, self.optimizer, self.capacity, self.admit_after, self.ttl, self.k = (
            name,
            optimizer,
            capacity,
            admit_after,
            ttl,
            k,
        )
        self.rows, self.state, self.last_seen, self.counts = {}, {}, {}, {}
        self.fallback, self.fallback_state = torch.zeros(k, DIM), torch.zeros(k, DIM)
        self.step = 0
        self.fallback_reads = 0  # training id occurrences read from a fallback row

    def _live(self, i):
        return i in self.rows and (self.ttl is None or self.last_seen[i] >= self.step - self.ttl)

    def key(self, i):
        return ("row", i) if self._live(i) else ("fallback", _slot(i, self.name, k=self.k))

    def vector(self, key):
        return self.rows[key[1]] if key[0] == "row" else self.fallback[key[1]]

    def _admit(self, bags):
        """A training batch's ids, in first-occurrence order, get rows by the rules."""
        self.step += 1
        occurrences = {}
        for bag in bags:
            for i in bag:
                occurrences[i] = occurrences.get(i, 0) + 1
        for i, n in occurrences.items():
            if i in self.rows:
                if not self._live(i):  # expired: a fresh row
                    self.rows[i], self.state[i] = torch.full((DIM,), INIT), torch.zeros(DIM)
                self.last_seen[i] = self.step
                continue
            self.counts[i] = self.counts.get(i, 0) + n
            if self.counts[i] >= self.admit_after and len(self.rows) < self.capacity:
                del self.counts[i]
                self.rows[i], self.state[i] = torch.full((DIM,), INIT), torch.zeros(DIM)
                self.last_seen[i] = self.step

    def forward(self, bags, mean=False):
        out = torch.zeros(len(bags), DIM)
        for b, bag in enumerate(bags):
            for i in bag:
                out[b] += self.vector(self.key(i)) / (len(bag) if mean else 1)
        return out

    def train(self, bags, grad_out, mean=False):
        """One training step; returns the forward output (read before the update)."""
        self._admit(bags)
        out = self.forward(bags, mean)
        grads = {}
        for b, bag in enumerate(bags):
            for i in bag:
                key = self.key(i)
                self.fallback_reads += key[0] == "fallback"
                grads[key] = grads.get(key, torch.zeros(DIM)) + grad_out[b] / (len(bag) if mean else 1)
        for key, g in grads.items():
            vec = self.vector(key)
            state = self.state[key[1]] if key[0] == "row" else self.fallback_state[key[1]]
            if self.optimizer == "sgd":
                vec -= LR * g
            else:  # adagrad
                state += g * g
                vec -= LR * g / (state.sqrt() + EPS)
        return out


def _kjt(bags):
    return KeyedJaggedTensor(
        keys=["f"],
        values=torch.tensor([i for bag in bags for i in bag], dtype=torch.int64),
        lengths=torch.tensor([len(bag) for bag in bags], dtype=torch.int64),
    )


def _module(optimizer, k=K, pooling=PoolingType.SUM, data_type=None, **options):
    from torchrec.modules.embedding_configs import DataType

    cfg = DynamicEmbeddingBagConfig(
        name="t",
        embedding_dim=DIM,
        num_embeddings=options.pop("num_embeddings", 4096),
        feature_names=["f"],
        fallback_rows=k,
        initializer=Initializer("constant", value=INIT),
        pooling=pooling,
        data_type=data_type or DataType.FP32,
        **options,
    )
    kwargs = {"lr": LR} if optimizer == "sgd" else {"lr": LR, "eps": EPS}
    return DynamicEmbeddingBagCollection([cfg], optimizer=optimizer, optimizer_kwargs=kwargs)


def _bags(gen, n, pool):
    lengths = torch.randint(0, 4, (n,), generator=gen).tolist()
    return [[pool[j] for j in torch.randint(0, len(pool), (length,), generator=gen).tolist()] for length in lengths]


def _run(module, oracle, steps, pool, mean=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        bags = _bags(gen, 7, pool)
        grad_out = torch.randn(len(bags), DIM, generator=gen)
        got = module(_kjt(bags)).values()
        want = oracle.train(bags, grad_out, mean)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        (got * grad_out).sum().backward()
    torch.testing.assert_close(module._tables.fallback_view(0), oracle.fallback, rtol=1e-5, atol=1e-6)
    rows = dict(
        zip(module.state_dict()["embedding_bags.t.weight_id"].tolist(), module.state_dict()["embedding_bags.t.weight"])
    )
    assert set(rows) == set(oracle.rows)
    for i, vec in oracle.rows.items():
        torch.testing.assert_close(rows[i], vec, rtol=1e-5, atol=1e-6)


POOL = [0, 1, 2, 3, 5, 8, 13, -1, 2**63 - 1, -(2**63), 10**12, 77]


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_not_admitted_ids_train_their_fallback_row(optimizer):
    module = _module(optimizer, admission="counter", admit_after=3)
    oracle = Oracle("t", optimizer, admit_after=3)
    _run(module, oracle, 6, POOL)
    assert oracle.fallback.abs().sum() > 0 and oracle.counts  # fallback rows did train, some ids still wait
    assert module.table_stats()["t"].fallback_reads == oracle.fallback_reads > 0


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_ids_refused_by_a_full_table_read_fallback(optimizer):
    # One 32-row bucket, eviction off: the first 32 distinct ids get rows, the others are refused.
    pool = list(range(1000, 1045))
    module = _module(optimizer, num_embeddings=32, eviction_policy="none")
    oracle = Oracle("t", optimizer, capacity=32)
    _run(module, oracle, 8, pool, mean=False)
    assert len(oracle.rows) == 32
    stats = module.table_stats()["t"]
    assert stats.refused > 0 and stats.fallback_reads == oracle.fallback_reads


def test_expired_ids_and_eval_read_fallback_with_mean_pooling():
    module = _module("adagrad", pooling=PoolingType.MEAN, ttl_steps=2, admission="counter", admit_after=2)
    oracle = Oracle("t", "adagrad", ttl=2, admit_after=2)
    gen = torch.Generator().manual_seed(3)
    for step in range(6):
        pool = POOL[:6] if step < 2 else POOL[6:]  # the first ids go unseen and expire
        bags = _bags(gen, 5, pool)
        grad_out = torch.randn(len(bags), DIM, generator=gen)
        got = module(_kjt(bags)).values()
        torch.testing.assert_close(got, oracle.train(bags, grad_out, mean=True), rtol=1e-5, atol=1e-6)
        (got * grad_out).sum().backward()
    module.eval()
    bags = [[i] for i in POOL] + [[424242, 9], POOL[:3]]  # expired, live and never seen ids
    with torch.no_grad():
        got = module(_kjt(bags)).values()
    want = oracle.forward(bags, mean=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert oracle.fallback.abs().sum(1).min() > 0  # every fallback row trained: no id reads zeros
    assert {oracle.key(i)[0] for i in POOL[:6]} == {"fallback"}


def test_without_fallback_rows_ids_without_a_row_read_zeros():
    """The control: the same module with fallback_rows=None reads zeros where the oracle reads
    fallback rows (so the tests above see the fallback rows, not something else)."""
    module = DynamicEmbeddingBagCollection(
        [
            DynamicEmbeddingBagConfig(
                name="t", embedding_dim=DIM, num_embeddings=64, feature_names=["f"], admission="counter", admit_after=5
            )
        ],
        optimizer="sgd",
        optimizer_kwargs={"lr": LR},
    )
    out = module(_kjt([[1], [2]])).values()
    out.sum().backward()
    assert module(_kjt([[1], [2]])).values().abs().sum() == 0


def test_sequence_collection_reads_and_trains_fallback_rows():
    cfg = DynamicEmbeddingConfig(
        name="t",
        embedding_dim=DIM,
        num_embeddings=64,
        feature_names=["f"],
        fallback_rows=K,
        admission="counter",
        admit_after=2,
        initializer=Initializer("constant", value=INIT),
    )
    module = DynamicEmbeddingCollection([cfg], optimizer="sgd", optimizer_kwargs={"lr": LR})
    oracle = Oracle("t", "sgd", admit_after=2)
    gen = torch.Generator().manual_seed(5)
    for _ in range(4):
        ids = [POOL[j] for j in torch.randint(0, len(POOL), (9,), generator=gen).tolist()]
        grad_out = torch.randn(len(ids), DIM, generator=gen)
        got = module(_kjt([ids]))["f"].values()
        # A sequence lookup is a pooled one with one id per bag.
        want = oracle.train([[i] for i in ids], grad_out)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        (got * grad_out).sum().backward()
    torch.testing.assert_close(module._tables.fallback_view(0), oracle.fallback, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("optimizer", ["adam", "adamw", "rowwise_adagrad", "ftrl"])
def test_every_fused_optimizer_steps_fallback_rows_as_a_row(optimizer):
    """A fallback row read by several ids takes the step a row of one id reading the summed
    gradient would: compared with a twin module where one admitted id stands for them."""
    kwargs = {"lr": LR} if optimizer != "ftrl" else {"lr": LR, "initial_accumulator_value": 0.1}

    def cfg(**o):
        return DynamicEmbeddingBagConfig(
            name="t",
            embedding_dim=DIM,
            num_embeddings=64,
            feature_names=["f"],
            initializer=Initializer("constant", value=0.0),
            **o,
        )

    shared = DynamicEmbeddingBagCollection(
        [cfg(fallback_rows=1, admission="probabilistic", admit_probability=1e-9)],
        optimizer=optimizer,
        optimizer_kwargs=kwargs,
    )
    single = DynamicEmbeddingBagCollection([cfg()], optimizer=optimizer, optimizer_kwargs=kwargs)
    gen = torch.Generator().manual_seed(7)
    for _ in range(3):
        bags = _bags(gen, 6, POOL)
        grad_out = torch.randn(len(bags), DIM, generator=gen)
        (shared(_kjt(bags)).values() * grad_out).sum().backward()
        (single(_kjt([[0] * len(bag) for bag in bags])).values() * grad_out).sum().backward()
    assert shared.num_live_rows() == 0
    torch.testing.assert_close(shared._tables.fallback_view(0)[0], single.state_dict()["embedding_bags.t.weight"][0])
    fallback_state = shared.state_dict()
    for name, value in single.state_dict().items():
        if ".optimizer." in name:
            torch.testing.assert_close(fallback_state[name.replace(".optimizer.", ".fallback_optimizer.")][0], value[0])


@pytest.mark.parametrize("dtype", ["FP16", "BF16"])
def test_half_precision_tables_train_fallback_rows(dtype):
    from torchrec.modules.embedding_configs import DataType

    module = _module("sgd", data_type=getattr(DataType, dtype), admission="counter", admit_after=2)
    twin = _module("sgd", data_type=getattr(DataType, dtype), admission="counter", admit_after=2)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        bags = _bags(gen, 5, POOL)
        grad_out = torch.randn(len(bags), DIM, generator=gen)
        for m in (module, twin):
            (m(_kjt(bags)).values() * grad_out).sum().backward()
    view = module._tables.fallback_view(0)
    assert view.dtype == getattr(torch, {"FP16": "float16", "BF16": "bfloat16"}[dtype]) and view.abs().sum() > 0
    assert torch.equal(view, twin._tables.fallback_view(0))  # stochastic rounding of a fallback row: deterministic


def test_checkpoint_round_trip_keeps_fallback_rows_and_state():
    module = _module("adagrad", admission="counter", admit_after=2)
    gen = torch.Generator().manual_seed(2)
    for _ in range(3):
        bags = _bags(gen, 6, POOL)
        (module(_kjt(bags)).values() * torch.randn(len(bags), DIM, generator=gen)).sum().backward()
    state = module.state_dict()
    assert state["embedding_bags.t.fallback_weight"].shape == (K, DIM)
    assert state["embedding_bags.t.fallback_optimizer.momentum1"].abs().sum() > 0
    fresh = _module("adagrad", admission="counter", admit_after=2)
    fresh.load_state_dict(state)
    torch.testing.assert_close(fresh._tables.fallback_view(0), module._tables.fallback_view(0), rtol=0, atol=0)
    after = fresh.state_dict()
    for key in ("fallback_weight", "fallback_optimizer.momentum1"):
        assert torch.equal(after[f"embedding_bags.t.{key}"], state[f"embedding_bags.t.{key}"])
    # Both keep training the same.
    bags = _bags(gen, 6, POOL + [31337])
    grad_out = torch.randn(len(bags), DIM, generator=gen)
    for m in (module, fresh):
        (m(_kjt(bags)).values() * grad_out).sum().backward()
    torch.testing.assert_close(fresh._tables.fallback_view(0), module._tables.fallback_view(0), rtol=0, atol=0)
    # A bad fallback_weight is refused before anything changes.
    bad = dict(state)
    bad["embedding_bags.t.fallback_weight"] = torch.zeros(K + 1, DIM)
    before = fresh._tables.fallback_view(0).clone()
    with pytest.raises(ValueError, match="fallback_weight must be"):
        fresh.load_state_dict(bad)
    assert torch.equal(fresh._tables.fallback_view(0), before)
    # So is a bad fallback optimizer state: the wrong shape, a negative squared sum.
    state_before = fresh._tables.state_views(0, fallback=True)["momentum1"].clone()
    for value, match in (
        (torch.zeros(K + 1, DIM), rf"fallback_optimizer.momentum1 must be \[{K}, {DIM}\]"),
        (torch.full((K, DIM), -1.0), "fallback_optimizer.momentum1 must be finite and >= 0"),
    ):
        with pytest.raises(ValueError, match=match):
            fresh.load_state_dict(dict(state) | {"embedding_bags.t.fallback_optimizer.momentum1": value})
        assert torch.equal(fresh._tables.state_views(0, fallback=True)["momentum1"], state_before)
    # reset_parameters forgets them.
    fresh.reset_parameters()
    assert fresh._tables.fallback_view(0).abs().sum() == 0


@pytest.mark.parametrize("value", [0, -3, 2.5, "4", True])
def test_bad_fallback_rows_are_refused_by_name(value):
    with pytest.raises(ValueError, match=rf"table 't' fallback_rows must be an int >= 1 .*got {value!r}"):
        DynamicEmbeddingBagConfig(
            name="t", embedding_dim=DIM, num_embeddings=64, feature_names=["f"], fallback_rows=value
        )
    cfg = DynamicEmbeddingBagConfig(
        name="t", embedding_dim=DIM, num_embeddings=64, feature_names=["f"], fallback_rows=2
    )
    cfg.fallback_rows = value  # changed after it was built: the module refuses it
    with pytest.raises(ValueError, match=r"DynamicEmbeddingBagCollection: table 't' fallback_rows must be an int >= 1"):
        DynamicEmbeddingBagCollection([cfg])


def test_fallback_hash_is_independent_of_buckets_and_routing():
    """Ids of one rank and of one bucket spread over all fallback rows (the three hashes differ)."""
    from torchrec_ext import ops
    from torchrec_ext.reference import bucket_pairs

    ids = torch.arange(20000, dtype=torch.int64) * 7919
    slots = torch.tensor([_slot(i, "t", k=8) for i in ids.tolist()])
    on_rank0 = ops.route(ids, 8) == 0
    first_bucket = bucket_pairs(ids, 32 * 8)[0] == 0
    for mask in (on_rank0, first_bucket):
        counts = torch.bincount(slots[mask], minlength=8).float()
        assert counts.min() > 0.7 * counts.mean(), counts


# ---------------------------------------------------------------------- 2 gloo ranks

WORLD, BATCH = 2, 5


def _sharded_configs():
    from torchrec import EmbeddingBagConfig

    return [
        DynamicEmbeddingBagConfig(
            name="t1",
            embedding_dim=DIM,
            num_embeddings=512,
            feature_names=["f1"],
            fallback_rows=K,
            admission="counter",
            admit_after=2,
            initializer=Initializer("normal", std=0.1),
        ),
        DynamicEmbeddingBagConfig(
            name="t2",
            embedding_dim=8,
            num_embeddings=256,
            feature_names=["f2"],
            fallback_rows=2,
            admission="probabilistic",
            admit_probability=0.5,
            pooling=PoolingType.MEAN,
        ),
        EmbeddingBagConfig(name="t3", embedding_dim=6, num_embeddings=128, feature_names=["f1"]),
    ]


def _rank_batch(step, rank):
    gen = torch.Generator().manual_seed(step * 100 + rank)
    lengths = torch.randint(0, 4, (2 * BATCH,), generator=gen)
    pool = torch.tensor(POOL + list(range(100, 112)))
    values = pool[torch.randint(0, len(pool), (int(lengths.sum()),), generator=gen)]
    return KeyedJaggedTensor(keys=["f1", "f2"], values=values, lengths=lengths, stride=BATCH)


def _global_batch(kjts):
    per_key = [k.to_dict() for k in kjts]
    keys = ["f1", "f2"]
    return KeyedJaggedTensor(
        keys=keys,
        values=torch.cat([jt[k].values() for k in keys for jt in per_key]),
        lengths=torch.cat([jt[k].lengths() for k in keys for jt in per_key]),
        stride=BATCH * len(kjts),
    )


def _sharded(world_size, sharding, optimizer):
    from torchrec.distributed.sharding_plan import row_wise, table_wise

    from torchrec_ext.distributed import DynamicEmbeddingBagCollectionSharder

    model = ModelWith(
        "ebc", DynamicEmbeddingBagCollection(_sharded_configs(), optimizer=optimizer, optimizer_kwargs={"lr": LR})
    )
    kernel = "customized_kernel"
    generators = {
        "row_wise": {t: row_wise(compute_kernel=kernel) for t in ("t1", "t2", "t3")},
        "mixed": {
            "t1": row_wise(compute_kernel=kernel),
            "t2": table_wise(rank=1, compute_kernel=kernel),
            "t3": row_wise(compute_kernel=kernel),
        },
    }[sharding]
    return dmp_of(model, "ebc", generators, DynamicEmbeddingBagCollectionSharder(), world_size)


def _train_both(rank, world_size, dmp, reference, steps, first_step=0):
    for step in range(first_step, first_step + steps):
        kjts = [_rank_batch(step, r) for r in range(world_size)]
        grads = [
            torch.randn(BATCH, DIM + 8 + 6, generator=torch.Generator().manual_seed(step * 7 + r))
            for r in range(world_size)
        ]
        out = dmp(kjts[rank])
        want = reference(_global_batch(kjts))
        torch.testing.assert_close(out.values(), want.values()[rank * BATCH : (rank + 1) * BATCH], rtol=1e-5, atol=1e-5)
        (out.values() * grads[rank]).sum().backward()
        # The ranks train on the mean of their losses (TorchRec divides the gradient by the world size).
        ((want.values() * torch.cat(grads)).sum() / world_size).backward()


def _fallback_state(state):
    return {k.split("ebc.")[-1]: v for k, v in state.items() if ".fallback_" in k}


def _sharded_equals_unsharded(rank, world_size, sharding, optimizer, root):
    from torchrec_ext.distributed import full_state_dict
    from torchrec_ext.distributed.checkpoint import load_checkpoint, save_checkpoint

    reference = DynamicEmbeddingBagCollection(_sharded_configs(), optimizer=optimizer, optimizer_kwargs={"lr": LR})
    dmp = _sharded(world_size, sharding, optimizer)
    _train_both(rank, world_size, dmp, reference, 2)
    # Deltas: an unsharded replica of the state at a token, applying every rank's share, follows
    # the fallback rows too (row-wise tables' in rank 0's share, table-wise ones' in the owner's).
    base = {k[len("ebc.") :]: v for k, v in full_state_dict(dmp.state_dict()).items()}
    token = dmp.module.ebc.delta_token()
    _train_both(rank, world_size, dmp, reference, 2, first_step=2)
    shares = [None] * world_size
    dist.all_gather_object(shares, (token, dmp.module.ebc.export_delta(token, include_optimizer_state=True)))
    replica = DynamicEmbeddingBagCollection(_sharded_configs(), optimizer=optimizer, optimizer_kwargs={"lr": LR})
    replica.load_state_dict(base)
    replica.follow_deltas([t for t, _ in shares])
    for _, delta in reversed(shares):
        replica.apply_delta(delta)
    for key, value in _fallback_state(reference.state_dict()).items():
        torch.testing.assert_close(_fallback_state(replica.state_dict())[key], value, rtol=1e-5, atol=1e-6, msg=key)
    # Eval reads the fallback rows too (never-seen ids included), on the rank each id routes to.
    dmp.eval()
    reference.eval()
    kjts = [_rank_batch(1000 + r, r) for r in range(world_size)]
    with torch.no_grad():
        torch.testing.assert_close(
            dmp(kjts[rank]).values(),
            reference(_global_batch(kjts)).values()[rank * BATCH : (rank + 1) * BATCH],
            rtol=1e-5,
            atol=1e-5,
        )
    dmp.train()
    reference.train()
    # Every rank's copy of the fallback rows (and their state) equals the unsharded table's.
    got, want = _fallback_state(dmp.state_dict()), _fallback_state(reference.state_dict())
    assert set(got) == set(want) and len(want) == (4 if optimizer == "adagrad" else 2)
    for key, value in want.items():
        assert value.abs().sum() > 0, key
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=key)
    # A DCP checkpoint holds them; a fresh sharded module loads them and trains on as the reference.
    save_checkpoint(root, 4, {"model": dmp.state_dict()})
    if rank == 0:
        torch.save(got, os.path.join(root, "want.pt"))
    fresh = _sharded(world_size, sharding, optimizer)
    loaded = load_checkpoint(os.path.join(root, "step_4"), {"model": fresh.state_dict()})
    fresh.load_state_dict(loaded["model"])
    for key, value in _fallback_state(fresh.state_dict()).items():
        torch.testing.assert_close(value, got[key], rtol=0, atol=0, msg=key)
    _train_both(rank, world_size, fresh, reference, 2, first_step=4)


def _load_on_one(rank, world_size, root, optimizer):
    """The 2-rank checkpoint resharded onto 1 rank: the fallback rows come back whole."""
    from torchrec_ext.distributed.checkpoint import load_checkpoint

    dmp = _sharded(world_size, "row_wise", optimizer)
    loaded = load_checkpoint(os.path.join(root, "step_4"), {"model": dmp.state_dict()})
    dmp.load_state_dict(loaded["model"])
    saved = torch.load(os.path.join(root, "want.pt"))
    for key, value in _fallback_state(dmp.state_dict()).items():
        torch.testing.assert_close(value, saved[key], rtol=0, atol=0, msg=key)


def _both_shardings(rank, world_size, root):
    _sharded_equals_unsharded(rank, world_size, "row_wise", "adagrad", root)
    _sharded_equals_unsharded(rank, world_size, "mixed", "sgd", os.path.join(root, "mixed"))


def test_sharded_fallback_rows_equal_unsharded_on_two_ranks(tmp_path):
    """Row-wise (Adagrad) and table-wise + row-wise (SGD) on 2 ranks: outputs, fallback rows and
    their state equal the unsharded module's; a DCP checkpoint round-trips them, at 2 ranks and
    resharded onto 1."""
    run_ranks(_both_shardings, WORLD, str(tmp_path))
    run_ranks(_load_on_one, 1, str(tmp_path), "adagrad")


def test_deltas_carry_the_fallback_rows_written_since_the_token(tmp_path):
    from torchrec_ext.modules import DeltaError, load_delta, save_delta

    source = _module("adagrad", admission="counter", admit_after=2)
    gen = torch.Generator().manual_seed(4)

    def train(module, steps, pool=POOL):
        for _ in range(steps):
            bags = _bags(gen, 6, pool)
            (module(_kjt(bags)).values() * torch.randn(len(bags), DIM, generator=gen)).sum().backward()

    train(source, 2)
    token = source.delta_token()
    replica = _module("adagrad", admission="counter", admit_after=2)
    replica.load_state_dict(source.state_dict())
    replica.follow_deltas(token)
    before = source._tables.fallback_view(0).clone()
    train(source, 1, pool=list(range(500, 520)))  # ids seen once: they read fallback rows
    delta = source.export_delta(token, include_optimizer_state=True)
    table = delta.tables["t"]
    changed = (source._tables.fallback_view(0) != before).any(1).nonzero().squeeze(1)
    assert table.fallback_slots.tolist() == changed.tolist() and changed.numel() > 0
    save_delta(delta, str(tmp_path / "d"))
    replica.apply_delta(load_delta(str(tmp_path / "d")))
    want, got = source.state_dict(), replica.state_dict()
    for key in ("fallback_weight", "fallback_optimizer.momentum1"):
        assert torch.equal(got[f"embedding_bags.t.{key}"], want[f"embedding_bags.t.{key}"]), key
    # A replica with other fallback rows refuses the delta, naming them.
    other = _module("adagrad", k=K + 1, admission="counter", admit_after=2)
    other.follow_deltas(token)
    with pytest.raises(DeltaError, match=f"fallback_rows {K}, this module's has {K + 1}"):
        other.apply_delta(delta)


def test_planner_counts_the_fallback_rows_and_their_state():
    from torchrec.modules.embedding_configs import DataType

    from torchrec_ext.distributed.planner import dynamic_table_bytes

    for data_type, element_bytes in ((DataType.FP32, 4), (DataType.FP16, 2)):
        for parts in (1, 2):
            module = _module("adam", k=7, data_type=data_type, num_embeddings=-(-300 // parts))
            cfg = module.embedding_bag_configs()[0]
            assert (
                dynamic_table_bytes(300, DIM, "adam", parts=parts, admission=cfg, element_bytes=element_bytes)
                == module.storage_bytes()
            )


def _plain_and_replicated(make, seed, grad_of, outputs_of):
    """Two modules from ``make`` trained on the same 3 batches of features f and g, the second
    stepping its fallback rows apart as the sharded path does with a one-rank sum (its all_reduce
    does nothing); each step's gradient ``grad_of(lengths, gen)`` is taken against ``outputs_of``
    the module's output. Returns (plain, split)."""
    plain, split = make(), make()
    split._tables.replicated_fallback = ([0, 1], lambda tensor: None)  # what a one-rank all_reduce does
    gen = torch.Generator().manual_seed(seed)
    for _ in range(3):
        lengths = torch.randint(0, 4, (2 * 5,), generator=gen)
        values = torch.tensor(POOL)[torch.randint(0, len(POOL), (int(lengths.sum()),), generator=gen)]
        kjt = KeyedJaggedTensor(keys=["f", "g"], values=values, lengths=lengths)
        grad_out = grad_of(lengths, gen)
        for m in (plain, split):
            (outputs_of(m(kjt)) * grad_out).sum().backward()
    return plain, split


def _assert_same_state(got, want_module):
    want = want_module.state_dict()
    for key, value in got.state_dict().items():
        torch.testing.assert_close(value, want[key], rtol=0, atol=1e-6, msg=key)


@pytest.mark.parametrize(
    "optimizer,dtype",
    [("sgd", "FP32"), ("adam", "FP16"), ("rowwise_adagrad", "BF16"), ("ftrl", "FP32"), ("adamw", "FP32")],
)
def test_replicated_fallback_step_on_one_rank_equals_the_fused_step(optimizer, dtype):
    """The sharded path (fallback gradients summed apart, then stepped) with a one-rank sum
    trains exactly as the plain fused update: two tables of other dims, pooled sum and mean."""
    from torchrec.modules.embedding_configs import DataType

    kwargs = {"lr": LR} if optimizer != "ftrl" else {"lr": LR, "initial_accumulator_value": 0.1}

    def make():
        cfgs = [
            DynamicEmbeddingBagConfig(
                name=n,
                embedding_dim=d,
                num_embeddings=64,
                feature_names=[f],
                fallback_rows=k,
                admission="counter",
                admit_after=2,
                pooling=p,
                data_type=getattr(DataType, dtype),
            )
            for n, d, f, k, p in (("a", 4, "f", 3, PoolingType.SUM), ("b", 8, "g", 2, PoolingType.MEAN))
        ]
        return DynamicEmbeddingBagCollection(cfgs, optimizer=optimizer, optimizer_kwargs=kwargs)

    plain, split = _plain_and_replicated(
        make, 11, lambda lengths, gen: torch.randn(5, 12, generator=gen), lambda out: out.values()
    )
    for t in range(2):
        assert plain._tables.fallback_view(t).abs().sum() > 0
        torch.testing.assert_close(split._tables.fallback_view(t), plain._tables.fallback_view(t), rtol=0, atol=1e-6)
    _assert_same_state(split, plain)


def test_replicated_fallback_step_of_a_sequence_collection_equals_the_fused_step():
    def make():
        cfgs = [
            DynamicEmbeddingConfig(
                name=n,
                embedding_dim=DIM,
                num_embeddings=64,
                feature_names=[f],
                fallback_rows=k,
                admission="counter",
                admit_after=2,
            )
            for n, f, k in (("a", "f", 3), ("b", "g", 2))
        ]
        return DynamicEmbeddingCollection(cfgs, optimizer="adagrad", optimizer_kwargs={"lr": LR})

    plain, split = _plain_and_replicated(
        make,
        12,
        lambda lengths, gen: torch.randn(int(lengths.sum()), DIM, generator=gen),
        lambda out: torch.cat([out["f"].values(), out["g"].values()]),
    )
    assert plain.state_dict()["embeddings.a.fallback_weight"].abs().sum() > 0
    _assert_same_state(split, plain)


def test_many_fallback_rows_merge_the_ids_sharing_one():
    """K large against the batch (the merge sorts instead of scattering over every row), with
    ids colliding on a fallback row: trained as the brute-force model."""
    k = 200_000
    module = _module("adagrad", k=k, admission="probabilistic", admit_probability=1e-9)
    oracle = Oracle("t", "adagrad", admit_after=10**9, k=k)
    pool = list(range(3000))
    slots = [_slot(i, "t", k=k) for i in pool]
    assert len(set(slots)) < len(slots)  # some ids share a fallback row
    gen = torch.Generator().manual_seed(8)
    for _ in range(2):
        bags = [pool[j : j + 5] for j in torch.randperm(len(pool), generator=gen)[:600].tolist()]
        grad_out = torch.randn(len(bags), DIM, generator=gen)
        got = module(_kjt(bags)).values()
        torch.testing.assert_close(got, oracle.train(bags, grad_out), rtol=1e-5, atol=1e-6)
        (got * grad_out).sum().backward()
    torch.testing.assert_close(module._tables.fallback_view(0), oracle.fallback, rtol=1e-5, atol=1e-6)
