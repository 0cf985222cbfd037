"""Online serving (issue 17, item 4): the job's --export-deltas-every feed and torchrec_ext.serve.

Oracles: the training model (an unsharded DLRMTrain on DynamicEmbeddingBagCollection, in eval
mode) loaded from the job's own checkpoint at the same step, bit for bit on CPU; brute-force
live-id sets read from the source's state before and after an export (tombstones); the set of
the model's outputs at each export step (concurrent readers see one of them, never a mix).
The job runs once (2 gloo ranks, tiny model, 9 steps, tables small enough to evict).
"""

import json
import os
import pathlib
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch
import torch.distributed as dist
from torchrec import KeyedJaggedTensor

from job_helpers import ROOT, TINY_BATCHES, TINY_MODEL, TORCHRUN, job_ok, run_job
from torchrec_ext import DynamicEmbeddingBagCollection, DynamicEmbeddingBagConfig
from torchrec_ext.data.synthetic import SyntheticCriteo
from torchrec_ext.inference import convert_to_inference
from torchrec_ext.modules import DeltaError, load_delta
from torchrec_ext.serve import Server
from torchrec_ext.serve.http import make_http_server
from torchrec_ext.train.model import build_model
from torchrec_ext.train.serve_export import model_config_from_json, read_manifest

EVERY, STEPS = 3, 9
SPARSE = "model.sparse_arch.embedding_bag_collection."


def _exporting_job_args(serve_dir, run_dir):
    """A tiny job that checkpoints and exports a delta every EVERY steps."""
    every = str(EVERY)
    return (
        ["--capacity", "256"]
        + TINY_MODEL
        + TINY_BATCHES
        + [
            "--eval-every",
            "0",
            "--checkpoint-every",
            every,
            "--keep-checkpoints",
            "0",
            "--export-deltas-every",
            every,
            "--serve-dir",
            serve_dir,
            "--run-dir",
            run_dir,
        ]
    )


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """The 2-rank job's serve directory D and run directory (checkpoints at every export step)."""
    root = tmp_path_factory.mktemp("serve_job")
    args = _exporting_job_args(str(root / "D"), str(root / "run")) + ["--steps", str(STEPS)]
    job_ok(run_job(args, timeout=300, launcher=TORCHRUN))
    return {"D": str(root / "D"), "ckpt": str(root / "run" / "checkpoints")}


def _in_group(fn):
    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        return fn()
    finally:
        if own:
            dist.destroy_process_group()


def _trained_model(serve_dir, checkpoint):
    """The training model (DLRMTrain on a DynamicEmbeddingBagCollection, unsharded) at a checkpoint
    of the job (key "model"), in eval mode."""
    from torchrec_ext.distributed.checkpoint import load_checkpoint

    model = build_model(model_config_from_json(read_manifest(serve_dir)["model"]))
    request = {}
    for key, value in model.state_dict().items():
        if not key.startswith(SPARSE):
            request[key] = value
        elif key.endswith((".weight", ".weight_id", ".metadata", ".counters")):
            request[key] = torch.empty(0)
    state = _in_group(lambda: load_checkpoint(checkpoint, {"model": request})["model"])
    ebc = model.model.sparse_arch.embedding_bag_collection
    ebc.load_state_dict({k[len(SPARSE) :]: v for k, v in state.items() if k.startswith(SPARSE)}, strict=False)
    with torch.no_grad():
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            if not name.startswith(SPARSE):
                tensor.copy_(state[name])
    return model.eval()


def _batches():
    """Batches of the job's train stream (ids it trained on) and of another stream (mostly unseen)."""
    seen = SyntheticCriteo(batch_size=64, num_batches=100, seed=0, truth_seed=0)
    other = SyntheticCriteo(batch_size=64, num_batches=100, seed=7, truth_seed=0)
    return [seen.batch(0), seen.batch(9), other.batch(3)]


def _json(path):
    return json.loads(pathlib.Path(path).read_text())


def _scores(model, batch):
    with torch.no_grad():
        _, (_, logits, _) = model(batch)
    return torch.sigmoid(logits.squeeze(-1))


def _following_copy(src, dst, upto):
    """A copy of serve directory ``src`` holding exports 1..upto (later ones are added with _publish)."""
    shutil.copytree(src, dst)
    exports = os.path.join(dst, read_manifest(dst)["exports"])
    for name in os.listdir(exports):
        if int(name.split(".")[0]) > upto:
            os.remove(os.path.join(exports, name))
    return dst


def _publish(src, dst, seq):
    rel = read_manifest(src)["exports"]
    name = f"{seq:08d}.json"
    shutil.copy(os.path.join(src, rel, name), os.path.join(dst, rel, name))


# ----------------------------------------------------------------------------- the loop


def test_replica_follows_the_job_and_predicts_as_the_trained_model_bit_for_bit(job, tmp_path):
    D = _following_copy(job["D"], str(tmp_path / "D"), upto=0)
    manifest = read_manifest(D)
    assert manifest["world_size"] == 2 and len(manifest["modules"][SPARSE[:-1]]) == 2  # a token per rank
    server = Server(D)
    assert server.load() and server.step == 0
    base = _trained_model(D, os.path.join(D, manifest["base"]))
    for batch in _batches():
        assert torch.equal(server.predict(batch), _scores(base, batch))
    tombstones = 0
    for seq in range(1, STEPS // EVERY + 1):
        _publish(job["D"], D, seq)
        assert server.poll() == 1
        step = seq * EVERY
        status = server.status()
        assert (status["applied_seq"], status["step"], status["lag_exports"], status["error"]) == (seq, step, 0, None)
        trained = _trained_model(D, os.path.join(job["ckpt"], f"step_{step}"))
        sparse = trained.model.sparse_arch.embedding_bag_collection
        assert status["live_rows"] == sparse.num_live_rows()
        for batch in _batches():
            got = server.predict(batch.dense_features, batch.sparse_features)
            assert torch.equal(got, _scores(trained, batch)), f"step {step}"
        entry = _json(os.path.join(D, manifest["exports"], f"{seq:08d}.json"))
        for f in entry["modules"][SPARSE[:-1]]["deltas"]:
            tombstones += sum(t.tombstones.numel() for t in load_delta(os.path.join(D, f)).tables.values())
    assert tombstones > 0  # the tables evicted: the replica reclaimed rows through tombstones
    assert server.poll() == 0


def test_http_round_trip(job):
    server = Server(job["D"])
    server.load()
    server.poll()
    http = make_http_server(server, port=0)
    thread = threading.Thread(target=http.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{http.server_address[1]}"
    try:
        batch = _batches()[0]
        kjt = batch.sparse_features
        per_feature = kjt.to_dict()
        body = {
            "dense": batch.dense_features.tolist(),
            "sparse": {
                name: [
                    jt.values()[o : o + n].tolist() for o, n in zip(jt.offsets()[:-1].tolist(), jt.lengths().tolist())
                ]
                for name, jt in per_feature.items()
            },
        }
        request = urllib.request.Request(
            url + "/predict",
            data=json.dumps(body).encode(),
            method="POST",
            headers={"Content-Type": "application/json"},
        )
        reply = json.load(urllib.request.urlopen(request, timeout=30))
        want = server.predict(batch.dense_features, kjt)
        assert torch.equal(torch.tensor(reply["scores"], dtype=torch.float32), want) and reply["step"] == STEPS
        status = json.load(urllib.request.urlopen(url + "/status", timeout=30))
        assert status["applied_seq"] == STEPS // EVERY and status["live_rows"] > 0 and "lag_s" in status
        for bad, why in (({"dense": [[0.0] * 3]}, "dense"), ({"dense": body["dense"], "sparse": {"nope": []}}, "nope")):
            request = urllib.request.Request(url + "/predict", data=json.dumps(bad).encode(), method="POST")
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(request, timeout=30)
            assert e.value.code == 400 and why in json.load(e.value)["error"]
    finally:
        http.shutdown()
        http.server_close()


def test_command_waits_for_the_first_model_then_serves(job, tmp_path):
    D = str(tmp_path / "D")
    os.makedirs(D)
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "torchrec_ext.serve", D, "--wait", "--port", "0", "--poll-interval", "0.2"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        time.sleep(1.0)
        assert proc.poll() is None  # still waiting: no model yet
        shutil.rmtree(D)
        shutil.copytree(job["D"], D)
        line = ""
        while "serving" not in line:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "the server ended"
        url = line.strip().rsplit(" ", 1)[-1]
        status = json.load(urllib.request.urlopen(url + "/status", timeout=30))
        assert status["step"] == STEPS and status["error"] is None
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_gap_in_the_sequence_is_refused_loudly_and_the_model_keeps_serving(job, tmp_path):
    D = _following_copy(job["D"], str(tmp_path / "D"), upto=1)
    _publish(job["D"], D, 3)  # export 2 missing
    server = Server(D)
    server.load()
    with pytest.raises(DeltaError, match="export 2 is missing.*gap"):
        server.poll()
    assert server.step == EVERY and "gap" in server.status()["error"]
    trained = _trained_model(D, os.path.join(job["ckpt"], f"step_{EVERY}"))
    batch = _batches()[0]
    assert torch.equal(server.predict(batch.dense_features, batch.sparse_features), _scores(trained, batch))
    # Export 2's entry naming export 3's deltas: their since is not the followed token.
    rel = read_manifest(D)["exports"]
    entry = _json(os.path.join(job["D"], rel, "00000003.json"))
    entry["seq"] = 2
    with open(os.path.join(D, rel, "00000002.json"), "w") as f:
        json.dump(entry, f)
    with pytest.raises(DeltaError, match="missing delta"):
        server.poll()
    assert server.step == EVERY
    assert torch.equal(server.predict(batch.dense_features, batch.sparse_features), _scores(trained, batch))
    # The real export 2, one of its delta files truncated: refused; whole again: applied, then export 3.
    entry = _json(os.path.join(job["D"], rel, "00000002.json"))
    shutil.copy(os.path.join(job["D"], rel, "00000002.json"), os.path.join(D, rel, "00000002.json"))
    victim = os.path.join(D, entry["modules"][SPARSE[:-1]]["deltas"][1])
    whole = pathlib.Path(victim).read_bytes()
    pathlib.Path(victim).write_bytes(whole[: len(whole) // 2])
    with pytest.raises(DeltaError, match="truncated"):
        server.poll()
    assert server.step == EVERY and "truncated" in server.status()["error"]
    pathlib.Path(victim).write_bytes(whole)
    assert server.poll() == 2 and server.step == STEPS and server.status()["error"] is None


def test_concurrent_readers_see_one_whole_export_never_a_mix(job, tmp_path):
    """Readers predicting while exports apply get, every time, the outputs of the model at one
    export step (embeddings and dense layers of the same step), never a mix."""
    D = _following_copy(job["D"], str(tmp_path / "D"), upto=0)
    batch = _batches()[1]
    manifest = read_manifest(D)
    expected = [_scores(_trained_model(D, os.path.join(D, manifest["base"])), batch)]
    expected += [
        _scores(_trained_model(D, os.path.join(job["ckpt"], f"step_{s}")), batch)
        for s in range(EVERY, STEPS + 1, EVERY)
    ]
    assert all(not torch.equal(a, b) for a, b in zip(expected, expected[1:]))
    server = Server(D)
    server.load()
    stop, reads, mixed = threading.Event(), [0], []

    def reader():
        while not stop.is_set():
            got = server.predict(batch.dense_features, batch.sparse_features)
            if not any(torch.equal(got, want) for want in expected):
                mixed.append(got)
            reads[0] += 1

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    for seq in range(1, STEPS // EVERY + 1):
        time.sleep(0.05)
        _publish(job["D"], D, seq)
        server.poll()
    time.sleep(0.05)
    stop.set()
    for t in threads:
        t.join()
    assert reads[0] > 0 and not mixed, f"{len(mixed)} of {reads[0]} reads matched no export step"
    assert torch.equal(server.predict(batch.dense_features, batch.sparse_features), expected[-1])


def test_a_resumed_job_starts_a_new_generation_the_server_rebuilds_from(tmp_path):
    D, run = str(tmp_path / "D"), str(tmp_path / "run")
    args = _exporting_job_args(D, run)
    job_ok(run_job(args + ["--steps", str(2 * EVERY)]))
    server = Server(D)
    server.load()
    server.poll()
    assert (server.status()["generation"], server.step) == (1, 2 * EVERY)
    job_ok(run_job(args + ["--steps", str(3 * EVERY), "--resume"]))
    assert server.poll() == 1  # generation 2: rebuilt from its base (step 6), then its export 1
    status = server.status()
    assert (status["generation"], status["base_step"], status["applied_seq"], server.step) == (
        2,
        2 * EVERY,
        1,
        3 * EVERY,
    )
    assert sorted(n for n in os.listdir(D) if n.startswith("gen_")) == ["gen_1", "gen_2"]  # the previous one kept
    trained = _trained_model(D, os.path.join(run, "checkpoints", f"step_{3 * EVERY}"))
    for batch in _batches():
        assert torch.equal(server.predict(batch.dense_features, batch.sparse_features), _scores(trained, batch))


def test_a_new_generation_removes_those_before_the_previous_one(tmp_path):
    from torchrec_ext.train.serve_export import remove_old_generations

    for name in ("gen_1", "gen_2", "gen_3", "gen_x", "other"):
        os.makedirs(tmp_path / name)
    remove_old_generations(str(tmp_path), keep_from=2)
    assert sorted(os.listdir(tmp_path)) == ["gen_2", "gen_3", "gen_x", "other"]


# ----------------------------------------------------------------------------- tombstones


def _tables():
    return [
        DynamicEmbeddingBagConfig(
            name="lru", embedding_dim=4, num_embeddings=32, feature_names=["f_lru"], eviction_policy="lru"
        ),
        DynamicEmbeddingBagConfig(
            name="ttl", embedding_dim=4, num_embeddings=256, feature_names=["f_ttl"], ttl_steps=2
        ),
    ]


def _kjt(step, batch=8):
    g = torch.Generator().manual_seed(step)
    # 40 lru ids a step from a pool of 1000 into 32 rows: a step evicts the previous step's ids.
    lru = torch.randint(0, 1000, (5 * batch,), generator=g) * 7919 + 5
    ttl = torch.randint(0, 12, (batch,), generator=g) + 5 * step  # drifting: old ids expire
    lengths = torch.tensor([5] * batch + [1] * batch)
    return KeyedJaggedTensor(keys=["f_lru", "f_ttl"], values=torch.cat([lru, ttl]), lengths=lengths, stride=batch)


def _live_ids(module):
    """table -> the ids its index holds (brute force: the state_dict's ids)."""
    sd = module.state_dict()
    return {t: set(sd[f"embedding_bags.{t}.weight_id"].tolist()) for t in ("lru", "ttl")}


def test_tombstones_are_exactly_the_ids_live_at_since_and_gone_now():
    """Against brute-force live sets: an export's tombstones are (live at since) - (live now), so
    an id inserted and evicted between two exports (never seen by a replica) is no tombstone;
    replicas (training and serving, the serving one converted with expired ids left out) follow
    every delta and hold the source's live ids, and refuse a tombstone of an id they do not hold."""
    torch.manual_seed(0)
    source = DynamicEmbeddingBagCollection(_tables(), optimizer="adagrad", optimizer_kwargs={"lr": 0.1})
    for step in range(5):  # odd: the last sweep (every ttl_steps) was a step ago, ids expired since
        source(_kjt(step)).values().sum().backward()
    token = source.delta_token()
    trained = DynamicEmbeddingBagCollection(_tables())
    trained.load_state_dict(source.state_dict())
    trained.follow_deltas(token)
    served = convert_to_inference(source.eval())
    served.follow_deltas(token)
    source.train()
    assert served.num_live_rows() < source.num_live_rows()  # expired ids left out of the serving copy
    born_and_gone = {"lru": 0, "ttl": 0}
    for k in range(6):
        live_before = _live_ids(source)
        seen = {"lru": set(), "ttl": set()}
        for step in (5 + 2 * k, 6 + 2 * k):
            batch = _kjt(step)
            for t, f in (("lru", "f_lru"), ("ttl", "f_ttl")):
                seen[t] |= set(batch[f].values().tolist())
            source(batch).values().sum().backward()
        delta = source.export_delta(since=token)
        token = delta.token
        live_after = _live_ids(source)
        for t in ("lru", "ttl"):
            assert set(delta.tables[t].tombstones.tolist()) == live_before[t] - live_after[t], (k, t)
            born_and_gone[t] += len(seen[t] - live_before[t] - live_after[t])
        trained.apply_delta(delta)
        served.apply_delta(delta)
        assert _live_ids(trained) == live_after
        source.eval()
        kjt = _kjt(100 + k)
        assert torch.equal(served(kjt).values(), source(kjt).values())
        source.train()
    assert born_and_gone["lru"] > 0  # the case exercised: ids inserted and evicted between exports
    stranger = torch.tensor([123456789], dtype=torch.int64)
    source(_kjt(50)).values().sum().backward()
    delta = source.export_delta(since=token)
    delta.tables["lru"].tombstones = torch.cat([delta.tables["lru"].tombstones, stranger])
    for replica in (trained, served):
        with pytest.raises(DeltaError, match="does not hold.*123456789"):
            replica.apply_delta(delta)


# ----------------------------------------------------------------------------- structure


def test_the_job_refuses_half_a_serving_setup():
    from torchrec_ext.train.args import parse_args

    for argv in (["--export-deltas-every", "5"], ["--serve-dir", "/tmp/x"], ["--export-deltas-every", "-1"]):
        with pytest.raises(SystemExit):
            parse_args(argv)
