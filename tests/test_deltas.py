"""Row deltas (issue 17, item 1): a replica that loads the source's checkpoint and applies every
delta in order holds the source's live rows bit for bit (oracle: the source's own state_dict,
as id -> vector maps), through LRU evictions, TTL expiry and a load_state_dict that drops ids;
bad deltas (out of order, missing, another config or dtype, NaN, corrupted or truncated files,
stale tokens) are refused and change nothing. Sharded sources: tests/test_deltas_sharded.py."""

import json
import struct

import numpy as np
import pytest
import torch
from torchrec import KeyedJaggedTensor

from torchrec_ext import DynamicEmbeddingBagCollection, DynamicEmbeddingBagConfig, DynamicEmbeddingCollection
from torchrec_ext.modules import DeltaError, DynamicEmbeddingConfig, load_delta, save_delta
from torchrec_ext.modules.deltas import Delta, TableDelta

KEYS = ["f_lru", "f_ttl"]


def _configs(kind, lru_capacity=64, ttl_capacity=256, dim=8):
    cfg = DynamicEmbeddingBagConfig if kind == "ebc" else DynamicEmbeddingConfig
    return [
        cfg(
            name="t_lru", embedding_dim=dim, num_embeddings=lru_capacity, feature_names=["f_lru"], eviction_policy="lru"
        ),
        cfg(
            name="t_ttl",
            embedding_dim=dim if kind == "ec" else 4,
            num_embeddings=ttl_capacity,
            feature_names=["f_ttl"],
            ttl_steps=3,
        ),
    ]


def _module(kind, optimizer="adagrad", **sizes):
    cls = DynamicEmbeddingBagCollection if kind == "ebc" else DynamicEmbeddingCollection
    kwargs = {"optimizer": optimizer, "optimizer_kwargs": {"lr": 0.1}} if optimizer else {}
    return cls(_configs(kind, **sizes), **kwargs)


def _batch(step, batch=16):
    gen = torch.Generator().manual_seed(step)
    lengths = torch.randint(0, 4, (len(KEYS) * batch,), generator=gen)
    n = int(lengths.sum())
    # LRU ids from a pool larger than the table (evictions); TTL ids drift (old ones expire).
    lru = torch.randint(0, 200, (n,), generator=gen) * 7919 - 3
    ttl = torch.randint(0, 40, (n,), generator=gen) + 10 * step
    per_key = lengths.view(len(KEYS), batch).sum(1).tolist()
    values = torch.cat([lru[: per_key[0]], ttl[: per_key[1]]])
    return KeyedJaggedTensor(keys=KEYS, values=values, lengths=lengths, stride=batch)


def _train(module, steps):
    for step in steps:
        out = module(_batch(step))
        loss = (
            out.values().pow(2).sum()
            if hasattr(out, "values") and not isinstance(out, dict)
            else sum(jt.values().pow(2).sum() for jt in out.values())
        )
        loss.backward()


def _live(module):
    """table -> (sorted ids, their vectors), from the module's state_dict."""
    sd = module.state_dict()
    out = {}
    for key, ids in sd.items():
        if key.endswith(".weight_id"):
            table = key.split(".")[1]
            order = ids.argsort()
            out[table] = (ids[order], sd[key[: -len("weight_id")] + "weight"][order])
    return out


def assert_same_rows(replica, source):
    mine, theirs = _live(replica), _live(source)
    assert mine.keys() == theirs.keys()
    for t in theirs:
        assert torch.equal(mine[t][0], theirs[t][0]), f"table {t}: ids differ"
        assert torch.equal(mine[t][1], theirs[t][1]), f"table {t}: vectors differ"


def _fresh_replica(kind, source_sd, token, **sizes):
    replica = _module(kind, optimizer=None, **sizes)
    replica.load_state_dict(source_sd)  # no optimizer: the checkpoint's optimizer.* keys are ignored
    replica.follow_deltas(token)
    return replica


def _drop_ids(sd, table, keep_fraction=0.5):
    """The state with only part of ``table``'s rows (per-row keys masked, counters kept)."""
    prefix = f"{table}."
    ids = next(v for k, v in sd.items() if k.endswith(prefix + "weight_id"))
    keep = torch.arange(ids.numel()) % 2 == 0
    out = {}
    for k, v in sd.items():
        per_row = prefix in k and not k.endswith("counters") and v.dim() >= 1 and v.shape[0] == ids.numel()
        out[k] = v[keep] if per_row else v
    return out


@pytest.mark.parametrize("kind", ["ebc", "ec"])
def test_replica_from_checkpoint_plus_deltas_holds_the_source_rows(kind, tmp_path):
    source = _module(kind)
    _train(source, range(3))
    base, token = source.state_dict(), source.delta_token()
    replica = _fresh_replica(kind, base, token, lru_capacity=128)  # another capacity: rows placed afresh
    tombstones = 0
    for step in range(3, 27, 2):
        _train(source, [step, step + 1])
        if step == 9:  # a training forward without backward inserts rows (initial vectors) all the same
            with torch.no_grad():
                source(_batch(999))
        if step == 15:  # a load_state_dict that drops half of a table's ids (erased) and rewrites the rest
            source.load_state_dict(_drop_ids(source.state_dict(), "t_lru"))
        delta = source.export_delta(since=token)
        token = delta.token
        tombstones += sum(t.tombstones.numel() for t in delta.tables.values())
        save_delta(delta, str(tmp_path / "d.delta"))
        replica.apply_delta(load_delta(str(tmp_path / "d.delta")))
        assert_same_rows(replica, source)
    assert tombstones > 0
    # Deltas carry only what changed: one more step touches a handful of rows.
    _train(source, [100])
    delta = source.export_delta(since=token)
    assert 0 < delta.tables["t_lru"].ids.numel() < source.num_live_rows()
    replica.apply_delta(delta)
    assert_same_rows(replica, source)


def test_evictions_and_ttl_expiry_become_tombstones():
    source = _module("ebc")
    _train(source, range(3))
    token = source.delta_token()
    live_before = {t: set(ids.tolist()) for t, (ids, _) in _live(source).items()}
    _train(source, range(3, 9))
    delta = source.export_delta(since=token)
    live_after = {t: set(ids.tolist()) for t, (ids, _) in _live(source).items()}
    for t in ("t_lru", "t_ttl"):  # gone ids (evicted by LRU; erased by TTL) are exactly the tombstones
        gone = live_before[t] - live_after[t]
        assert gone, t
        assert gone <= set(delta.tables[t].tombstones.tolist())
        assert not set(delta.tables[t].tombstones.tolist()) & live_after[t]


def test_optimizer_state_and_scores_travel_when_asked():
    source = _module("ebc")
    _train(source, range(3))
    base, token = source.state_dict(), source.delta_token()
    replica = _module("ebc", optimizer="adagrad")
    replica.load_state_dict(base)
    replica.follow_deltas(token)
    _train(source, range(3, 6))
    delta = source.export_delta(since=token, include_optimizer_state=True, include_scores=True)
    assert set(delta.tables["t_lru"].optimizer) == {"momentum1"} and delta.tables["t_lru"].scores is not None
    replica.apply_delta(delta)
    src, rep = source.state_dict(), replica.state_dict()
    for t in ("t_lru", "t_ttl"):
        a, b = src[f"embedding_bags.{t}.weight_id"].argsort(), rep[f"embedding_bags.{t}.weight_id"].argsort()
        for key in ("weight", "optimizer.momentum1", "metadata"):
            k = f"embedding_bags.{t}.{key}"
            if key == "metadata" and t == "t_ttl":
                continue  # scores of rows unchanged since the base are the base's
            assert torch.equal(src[k][a], rep[k][b]), k


def _source_and_deltas(kind="ebc", n=3):
    source = _module(kind)
    _train(source, range(3))
    base, token = source.state_dict(), source.delta_token()
    deltas = []
    for step in range(n):
        _train(source, [10 + step])
        deltas.append(source.export_delta(since=deltas[-1].token if deltas else token))
    return source, base, token, deltas


def _unchanged(replica, fn, match):
    before = _live(replica)
    with pytest.raises((DeltaError, TypeError, ValueError), match=match):
        fn()
    after = _live(replica)
    for t in before:
        assert torch.equal(before[t][0], after[t][0]) and torch.equal(before[t][1], after[t][1])


def test_out_of_order_missing_and_repeated_deltas_are_refused():
    source, base, token, (d1, d2, d3) = _source_and_deltas()
    replica = _module("ebc", optimizer=None)
    replica.load_state_dict(base)
    _unchanged(replica, lambda: replica.apply_delta(d1), "follows no source")
    replica.follow_deltas(token)
    _unchanged(replica, lambda: replica.apply_delta(d2), "missing")
    replica.apply_delta(d1)
    _unchanged(replica, lambda: replica.apply_delta(d1), "out of order")
    _unchanged(replica, lambda: replica.apply_delta(d3), "missing")
    other, _, _, (e1, _, _) = _source_and_deltas()
    _unchanged(replica, lambda: replica.apply_delta(e1), "does not follow")
    replica.apply_delta(d2)
    replica.apply_delta(d3)
    assert_same_rows(replica, source)


def _tweaked(delta, table="t_lru", **fields):
    tables = dict(delta.tables)
    tables[table] = TableDelta(**{**vars(delta.tables[table]), **fields})
    return Delta(since=delta.since, token=delta.token, source=delta.source, tables=tables)


def test_bad_deltas_are_refused_whole():
    source, base, token, (d1, _, _) = _source_and_deltas()
    replica = _fresh_replica("ebc", base, token)
    lru = d1.tables["t_lru"]
    assert lru.ids.numel() > 1
    nan = lru.weights.clone()
    nan[1, 0] = float("nan")
    _unchanged(replica, lambda: replica.apply_delta(_tweaked(d1, weights=nan)), "finite")
    _unchanged(replica, lambda: replica.apply_delta(_tweaked(d1, weights=lru.weights.double())), "float32")
    _unchanged(replica, lambda: replica.apply_delta(_tweaked(d1, ids=lru.ids.int())), "int64")
    _unchanged(replica, lambda: replica.apply_delta(_tweaked(d1, weights=lru.weights[:-1])), "must be")
    _unchanged(replica, lambda: replica.apply_delta(_tweaked(d1, tombstones=lru.ids[:1])), "each id once")
    _unchanged(
        replica, lambda: replica.apply_delta(_tweaked(d1, ids=torch.cat([lru.ids[:1], lru.ids[:-1]]))), "distinct"
    )
    wrong_dim = Delta(
        since=d1.since,
        token=d1.token,
        tables=d1.tables,
        source={**d1.source, "tables": {**d1.source["tables"], "t_lru": {"dim": 16, "dtype": "float32"}}},
    )
    _unchanged(replica, lambda: replica.apply_delta(wrong_dim), "dim 16")
    wrong_dtype = Delta(
        since=d1.since,
        token=d1.token,
        tables=d1.tables,
        source={**d1.source, "tables": {**d1.source["tables"], "t_lru": {"dim": 8, "dtype": "float16"}}},
    )
    _unchanged(replica, lambda: replica.apply_delta(wrong_dtype), "float16")
    # Another table config: a replica of other dims refuses the source's delta.
    other = _module("ebc", optimizer=None, dim=16)
    other.follow_deltas(token)
    _unchanged(other, lambda: other.apply_delta(d1), "dim 8")
    # A tombstone of an id the replica does not hold: a source tombstones only ids live at the
    # delta's since, so the replica missed something (refused, not ignored).
    unknown = _tweaked(d1, tombstones=torch.cat([lru.tombstones, torch.tensor([123456789])]))
    _unchanged(replica, lambda: replica.apply_delta(unknown), r"do(es)? not hold.*123456789")
    replica.apply_delta(d1)


def test_too_small_replica_applies_nothing():
    source, base, token, (d1, _, _) = _source_and_deltas()
    replica = _module("ebc", optimizer=None, ttl_capacity=40)  # the TTL table holds the base, not the delta
    replica.load_state_dict(base)
    replica.follow_deltas(token)
    held = _live(replica)["t_ttl"][0]
    assert (~torch.isin(d1.tables["t_ttl"].ids, held)).sum() > 40 - held.numel()
    _unchanged(replica, lambda: replica.apply_delta(d1), "no row")  # nor in t_lru, which has room


def test_corrupted_and_truncated_files_are_refused(tmp_path):
    _, _, _, (d1, _, _) = _source_and_deltas()
    path = tmp_path / "d1.delta"
    save_delta(d1, str(path))
    blob = path.read_bytes()
    for name, bad in [
        ("truncated", blob[:-7]),
        ("header-truncated", blob[:20]),
        ("empty", b""),
        ("data-flipped", blob[:-3] + bytes([blob[-3] ^ 1]) + blob[-2:]),
        (
            "token-edited",
            blob.replace(
                b'\\"version\\": ' + str(d1.token.version).encode(),
                b'\\"version\\": ' + str(d1.token.version + 1).encode(),
            ),
        ),
    ]:
        assert bad != blob, name
        (tmp_path / name).write_bytes(bad)
        with pytest.raises(DeltaError, match="truncated|corrupted"):
            load_delta(str(tmp_path / name))


def test_the_file_is_safetensors_with_a_documented_header(tmp_path):
    """Read by hand (struct, json, numpy), as a non-Python server would, against the delta."""
    _, _, _, (d1, _, _) = _source_and_deltas()
    path = tmp_path / "d1.delta"
    save_delta(d1, str(path))
    blob = path.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + n])
    meta = json.loads(header["__metadata__"]["delta"])
    assert meta["token"] == {"stream": d1.token.stream, "version": d1.token.version}
    assert meta["since"] == {"stream": d1.since.stream, "version": d1.since.version}
    dtypes = {"I64": np.int64, "F32": np.float32}
    for name, table in d1.tables.items():
        for field, want in (("ids", table.ids), ("weights", table.weights), ("tombstones", table.tombstones)):
            entry = header[f"{name}/{field}"]
            begin, end = entry["data_offsets"]
            got = np.frombuffer(blob[8 + n + begin : 8 + n + end], dtype=dtypes[entry["dtype"]]).reshape(entry["shape"])
            assert np.array_equal(got, want.numpy()), (name, field)


def test_released_and_dropped_tokens_are_refused():
    source = _module("ebc")
    _train(source, range(3))
    t1 = source.delta_token()
    _train(source, range(3, 6))
    t2 = source.delta_token()
    source.release_deltas(before=t2)
    with pytest.raises(DeltaError, match="older than what is kept"):
        source.export_delta(since=t1)
    source.export_delta(since=t2)
    # The tombstone bound: a log of 1 id drops the older entries, so t3 goes stale after evictions.
    t3 = source.delta_token(max_tombstones=1)
    _train(source, range(6, 12))
    with pytest.raises(DeltaError, match="older than what is kept"):
        source.export_delta(since=t3)
    other = _module("ebc")
    with pytest.raises(DeltaError, match="another module"):
        source.export_delta(since=other.delta_token())
    with pytest.raises(TypeError, match="DeltaToken"):
        source.export_delta(since=3)


def test_named_consumers_free_what_none_of_them_needs():
    """Two consumers of one module (a serving exporter, incremental checkpoints): a release by one
    frees only what the other no longer needs either, so its older token still exports; once both
    moved on, the log holds nothing older than their tokens (it does not grow with every token)."""
    source = _module("ebc")
    _train(source, range(2))
    serve = source.delta_token(consumer="serve")
    _train(source, range(2, 5))
    ckpt = source.delta_token(consumer="ckpt")
    _train(source, range(5, 8))
    log = source._tables.delta_log
    held = log.logged
    assert held > 0
    source.release_deltas(before=ckpt, consumer="ckpt")  # serve's older token is still needed
    assert log.logged == held
    tombstones = {n: t.tombstones for n, t in source.export_delta(since=serve).tables.items()}
    assert any(t.numel() for t in tombstones.values()), "no evictions: the test does not test the log"
    for step in range(8, 40):  # both export and release each step: the log stays at one step's ids
        _train(source, [step])
        for name, token in (("serve", serve), ("ckpt", ckpt)):
            delta = source.export_delta(since=token)
            source.release_deltas(before=delta.token, consumer=name)
            serve, ckpt = (delta.token, ckpt) if name == "serve" else (serve, delta.token)
        assert log.logged == 0
    with pytest.raises(TypeError, match="release_deltas: consumer must be a str or None, got int"):
        source.release_deltas(before=serve, consumer=3)
    with pytest.raises(TypeError, match="delta_token: consumer must be a str or None, got int"):
        source.delta_token(consumer=3)


def test_a_safetensors_reader_reads_it(tmp_path):
    """Where the safetensors package is installed (not in the venv): its reader gives the tensors."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    source = _module("ebc")
    _train(source, range(3))
    token = source.delta_token()
    _train(source, range(3, 9))
    delta = source.export_delta(since=token, include_optimizer_state=True, include_scores=True)
    save_delta(delta, str(tmp_path / "d.delta"))
    got = safetensors_torch.load_file(str(tmp_path / "d.delta"))
    for name, table in delta.tables.items():
        want = {"ids": table.ids, "weights": table.weights, "tombstones": table.tombstones, "scores": table.scores}
        want.update({f"optimizer.{k}": v for k, v in table.optimizer.items()})
        for field, value in want.items():
            assert torch.equal(got[f"{name}/{field}"], value), (name, field)


# ---------------------------------------------------------------------- full replicas


def _full_table(policy, capacity, optimizer="adagrad", ttl_steps=None):
    cfg = DynamicEmbeddingBagConfig(
        name="t",
        embedding_dim=4,
        num_embeddings=capacity,
        feature_names=["f"],
        eviction_policy=policy,
        ttl_steps=ttl_steps,
    )
    kwargs = {"optimizer": optimizer, "optimizer_kwargs": {"lr": 0.1}} if optimizer else {}
    return DynamicEmbeddingBagCollection([cfg], **kwargs)


def _crowding_batch(step, capacity):
    """Half a table of ids from a pool of 8 tables: every step evicts in a full table."""
    gen = torch.Generator().manual_seed(step)
    n = capacity // 2
    values = torch.randint(0, 8 * capacity, (n,), generator=gen) * 7919 + 3
    return KeyedJaggedTensor(keys=["f"], values=values, lengths=torch.ones(n, dtype=torch.int64), stride=n)


def _by_id(module, *keys):
    sd = module.state_dict()
    ids = sd["embedding_bags.t.weight_id"]
    order = ids.argsort()
    return ids[order], *(sd[f"embedding_bags.t.{k}"][order] for k in keys)


@pytest.mark.parametrize(
    "policy,capacity", [("lru", 128), ("lfu", 128), ("lru", 64 * 32 * 2)], ids=["lru", "lfu", "lru-2-stripes"]
)
def test_a_replica_of_a_full_table_follows_every_delta(policy, capacity, monkeypatch):
    """A full source evicts as it inserts, so its buckets hold what its history left there; a
    replica at the same capacity that inserted the deltas' ids greedily would find some new id's
    buckets full: it re-places its table instead, and holds the source's rows, optimizer state and
    scores per id after every delta (oracle: the source's state_dict); a replica of that replica,
    following its deltas two at a time, holds them too (rows' versions moved with the rows)."""
    from torchrec_ext.modules import delta_placement

    replaced = []
    exact = delta_placement.place_exactly
    monkeypatch.setattr(delta_placement, "place_exactly", lambda *a: replaced.append(1) or exact(*a))
    source = _full_table(policy, capacity)
    step = 0
    while source.num_live_rows() < capacity:
        source(_crowding_batch(step, capacity)).values().sum().backward()
        step += 1
    base, token = source.state_dict(), source.delta_token()
    replica = _full_table(policy, capacity, optimizer="adagrad")
    replica.load_state_dict(base)
    replica.follow_deltas(token)
    second_token = replica.delta_token()  # the replica is a source in turn
    second = _full_table(policy, capacity, optimizer=None)
    second.load_state_dict(replica.state_dict())
    second.follow_deltas(second_token)
    for k in range(12):
        source(_crowding_batch(step + k, capacity)).values().sum().backward()
        delta = source.export_delta(since=token, include_optimizer_state=True, include_scores=True)
        token = delta.token
        assert delta.tables["t"].tombstones.numel() > 0 and source.num_live_rows() == capacity
        replica.apply_delta(delta)
        for got, want in zip(
            _by_id(replica, "weight", "optimizer.momentum1", "metadata"),
            _by_id(source, "weight", "optimizer.momentum1", "metadata"),
        ):
            assert torch.equal(got, want)
        if k % 2:
            second_delta = replica.export_delta(since=second_token)
            second_token = second_delta.token
            second.apply_delta(second_delta)
            assert_same_rows(second, source)
    assert replaced, "no delta needed a re-placement: the test does not test it"


def test_a_re_placed_replica_keeps_its_ids_last_seen_and_clock():
    """TTL tables keep a training step per row: a re-placement moves it with its id; the clock
    ends as a greedy insert leaves it (one call per delta)."""
    capacity = 128
    source = _full_table("lru", capacity, ttl_steps=1000)
    step = 0
    while source.num_live_rows() < capacity:
        source(_crowding_batch(step, capacity)).values().sum().backward()
        step += 1
    base, token = source.state_dict(), source.delta_token()
    replica = _full_table("lru", capacity, optimizer=None, ttl_steps=1000)
    replica.load_state_dict(base)
    replica.follow_deltas(token)
    for k in range(6):
        source(_crowding_batch(step + k, capacity)).values().sum().backward()
        delta = source.export_delta(since=token)
        token = delta.token
        ids, last_seen = _by_id(replica, "last_seen")
        kept = ~torch.isin(ids, torch.cat([delta.tables["t"].ids, delta.tables["t"].tombstones]))
        clock = replica._tables.indexes[0].clock
        replica.apply_delta(delta)
        assert_same_rows(replica, source)
        after_ids, after_last_seen = _by_id(replica, "last_seen")
        assert torch.equal(after_last_seen[torch.isin(after_ids, ids[kept])], last_seen[kept])
        assert replica._tables.indexes[0].clock == clock + 1


def test_a_delta_no_placement_holds_is_refused_whole():
    """More live ids than rows in every placement: refused, naming the count; nothing changes."""
    capacity = 128
    source = _full_table("lru", capacity)
    source(_crowding_batch(0, capacity)).values().sum().backward()
    base, token = source.state_dict(), source.delta_token()
    replica = _full_table("lru", 96, optimizer=None)  # holds the base (64 ids), not the source's 128
    replica.load_state_dict(base)
    replica.follow_deltas(token)
    for step in range(1, 4):
        source(_crowding_batch(step, capacity)).values().sum().backward()
    delta = source.export_delta(since=token)
    assert source.num_live_rows() > 96
    _unchanged(
        replica, lambda: replica.apply_delta(delta), r"of \d+ ids find no row at capacity 96.*nothing was applied"
    )


@pytest.mark.parametrize("policy", ["lru", "lfu", "epoch_lfu"])
@pytest.mark.parametrize("given_scores", [False, True])
def test_place_exactly_keeps_every_score_and_leaves_the_index_alone(policy, given_scores):
    """place_exactly against a dict of what the greedy insert would leave: the held ids' scores
    (touched ones as the policy touches them), new ids' new_key_score (or the given scores), the
    clock one call on; every row in one of its key's buckets; the index it was given unchanged."""
    from torchrec_ext.modules.delta_placement import place_exactly
    from torchrec_ext.reference import bucket_pairs
    from torchrec_ext.table import HashTable

    capacity = 256
    index = HashTable(capacity, policy=policy)
    gen = torch.Generator().manual_seed(1)
    for _ in range(6):  # full, after evictions
        index.find_or_insert(torch.randint(0, 4 * capacity, (capacity // 2,), generator=gen))
    index.set_epoch(2)
    before = index.state_dict()
    held = dict(zip(before["keys"].tolist(), before["scores"].tolist()))
    keys = before["keys"]
    tombstones, touched = keys[:40], keys[40:60]
    new = torch.arange(10_000, 10_040)
    ids = torch.cat([touched, new])
    scores = torch.arange(ids.numel()) + 7 if given_scores else None
    expected = {k: s for k, s in held.items() if k not in set(tombstones.tolist())}
    if given_scores:
        expected.update(zip(ids.tolist(), scores.tolist()))
    else:
        probe = index.clone()
        probe.insert_or_assign(touched)  # the touch the greedy insert gives held ids
        expected.update(
            (k, s)
            for k, s in zip(*(probe.state_dict()[f].tolist() for f in ("keys", "scores")))
            if k in set(touched.tolist())
        )
        expected.update((k, index.new_key_score()) for k in new.tolist())
    placed = place_exactly(index, ids, tombstones, scores)
    after = placed.index.state_dict()
    assert dict(zip(after["keys"].tolist(), after["scores"].tolist())) == expected
    assert after["clock"] == before["clock"] + 1 and after["epoch"] == 2
    first, second = bucket_pairs(after["keys"], capacity)
    assert bool(((after["rows"] // 32 == first) | (after["rows"] // 32 == second)).all())
    assert (
        torch.equal(placed.rows, placed.index.find(ids)[0]) and placed.inserted.tolist() == [False] * 20 + [True] * 40
    )
    old_row = dict(zip(before["keys"].tolist(), before["rows"].tolist()))
    new_row = dict(zip(after["keys"].tolist(), after["rows"].tolist()))
    moved = {(old_row[k], new_row[k]) for k in old_row if k in new_row and old_row[k] != new_row[k]}
    assert moved == set(zip(placed.moved_from.tolist(), placed.moved_to.tolist()))
    for field in ("keys", "rows", "scores"):
        assert torch.equal(index.state_dict()[field], before[field])
