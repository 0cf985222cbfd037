"""``Server``: the serving replica of a training job's model, following the job's serve directory.

A reader (``predict``) holds the server's read lock for its whole forward; applying an export
prepares everything aside first (deltas loaded and checked, new indexes built, rows encoded, dense
tensors checked: see torchrec_ext.inference.deltas) and holds the write lock only to publish it
(copy the rows, swap the indexes, copy the dense parameters). So reads go on while an export is
prepared, and each read sees the model wholly at one export: the embeddings and the dense layers
of the same training step.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import threading
import time
from typing import Any

import torch
from torch import Tensor
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_ext.inference import load_inference_checkpoint
from torchrec_ext.modules.delta_file import load_delta
from torchrec_ext.modules.deltas import DeltaError, DeltaToken
from torchrec_ext.table import _ReadWriteLock
from torchrec_ext.train.model import build_model
from torchrec_ext.train.serve_export import export_name, model_config_from_json, read_manifest

logger = logging.getLogger(__name__)
_EXPORT = re.compile(r"^(\d{8})\.json$")


class Server:
    """Follows serve directory ``serve_dir``: ``load()`` / ``wait()`` build the model from its
    base, ``poll()`` applies the exports written since, ``predict()`` scores a batch.

    Args:
        data_type: how the replica keeps rows (as ``convert_to_inference``: None = the trained dtype,
            float32 rows then give the training model's eval outputs bit for bit; "fp16", "int8", ...).
        capacity_factor: the replica's rows per table, times the trained table's capacity (room for
            its other hash layout: a replica's buckets fill differently from the source's shards').
    """

    def __init__(self, serve_dir: str, *, data_type: Any = None, capacity_factor: float = 1.25):
        if not (isinstance(capacity_factor, (int, float)) and capacity_factor >= 1):
            raise ValueError(f"Server: capacity_factor must be a number >= 1, got {capacity_factor!r}")
        self.serve_dir = serve_dir
        self.data_type = data_type
        self.capacity_factor = capacity_factor
        self._lock = _ReadWriteLock()  # readers: predict; the writer: an export's publish
        self._poll_lock = threading.Lock()  # one poll at a time
        self._model: torch.nn.Module | None = None
        self._modules: dict[str, torch.nn.Module] = {}
        self._manifest: dict[str, Any] | None = None
        self.seq = 0  # exports applied in this generation
        self.step: int | None = None  # the training step the model is at
        self.error: str | None = None  # the last refusal (cleared by the next export applied)
        self.rows_applied = 0
        self.requests = 0
        self._count_lock = threading.Lock()
        self._following: threading.Thread | None = None
        self._stop = threading.Event()

    # ------------------------------------------------------------------ building

    def load(self) -> bool:
        """Builds the model from the manifest's base if there is one (False: none yet)."""
        manifest = read_manifest(self.serve_dir)
        if manifest is None:
            return False
        with self._poll_lock:
            self._load(manifest)
        return True

    def wait(self, timeout: float | None = None, interval: float = 0.2) -> None:
        """Blocks until the serve directory has a model (TimeoutError after ``timeout`` seconds)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._model is None and not self.load():
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"Server.wait: no {os.path.join(self.serve_dir, 'manifest.json')} after {timeout} s")
            time.sleep(interval)

    def _load(self, manifest: dict[str, Any]) -> None:
        base = os.path.join(self.serve_dir, manifest["base"])
        cfg = model_config_from_json(manifest["model"])
        with torch.device("meta"):
            skeleton = build_model(cfg)  # structure only
        capacity = max(1, int(cfg.capacity * self.capacity_factor))
        model = _loaded(base, skeleton, self.data_type, capacity)
        modules = {}
        for path, tokens in manifest["modules"].items():
            module = model.get_submodule(path)
            module.follow_deltas([DeltaToken.from_dict(t) for t in tokens])
            modules[path] = module
        with self._lock.write():
            self._model, self._modules, self._manifest = model, modules, manifest
            self.seq, self.step, self.error = 0, int(manifest["base_step"]), None
        logger.info("serving generation %s from base %s (step %s)", manifest["generation"], base, self.step)

    # ------------------------------------------------------------------ following

    def poll(self) -> int:
        """Applies every export written since the last poll, in order; returns how many. A new
        generation (the job restarted) rebuilds the model from its base first. A gap in the
        sequence is refused (DeltaError): the model stays at the last export it applied."""
        with self._poll_lock:
            manifest = read_manifest(self.serve_dir)
            if manifest is None:
                return 0
            if self._manifest is None or manifest["generation"] != self._manifest["generation"]:
                self._load(manifest)
            applied = 0
            while True:
                path = os.path.join(self.serve_dir, manifest["exports"], export_name(self.seq + 1))
                if not os.path.exists(path):
                    later = [seq for seq in self._available(manifest) if seq > self.seq + 1]
                    if later:
                        self._refuse(
                            f"export {self.seq + 1} is missing from {os.path.dirname(path)} but export {later[0]} "
                            f"is there: a gap in the sequence; later exports are not applied (the model stays at "
                            f"export {self.seq}, step {self.step}; a new base from the job re-syncs it)"
                        )
                    return applied
                try:
                    with open(path) as f:
                        entry = json.load(f)
                    if not isinstance(entry, dict) or entry.get("seq") != self.seq + 1:
                        raise ValueError(f"it says it is export {getattr(entry, 'get', lambda _: None)('seq')}")
                    self._apply(entry)
                except (ValueError, KeyError, TypeError, OSError) as e:  # DeltaError is a ValueError
                    self._refuse(f"export {self.seq + 1} ({path}) refused: {e}")
                applied += 1

    def _refuse(self, message: str) -> None:
        self.error = message
        raise DeltaError(f"serve: {message}")

    def _available(self, manifest: dict[str, Any]) -> list[int]:
        folder = os.path.join(self.serve_dir, manifest["exports"])
        names = os.listdir(folder) if os.path.isdir(folder) else []
        return sorted(int(m.group(1)) for m in map(_EXPORT.match, names) if m)

    def _apply(self, entry: dict[str, Any]) -> None:
        prepared = {}
        for path, module in self._modules.items():
            files = entry["modules"][path]["deltas"]
            deltas = [load_delta(os.path.join(self.serve_dir, f)) for f in files]
            prepared[path] = module.prepare_deltas(deltas)  # checks each rank's order: nothing changes yet
        dense = torch.load(os.path.join(self.serve_dir, entry["dense"]), weights_only=True)
        targets = self._dense_targets(dense)
        with self._lock.write():  # nothing below can fail
            for path, module in self._modules.items():
                module.commit_deltas(prepared[path])
            with torch.no_grad():
                for name, value in dense.items():
                    targets[name].copy_(value)
            self.seq, self.step, self.error = int(entry["seq"]), int(entry["step"]), None
            self.rows_applied += sum(p.rows for p in prepared.values())

    def _dense_targets(self, dense: dict[str, Tensor]) -> dict[str, Tensor]:
        """The model's tensor for each dense entry, checked: the same names and shapes as the model's."""
        model = self._model
        own = dict(model.named_parameters()) | dict(model.named_buffers())
        own = {k: v for k, v in own.items() if not any(k.startswith(p + ".") for p in self._modules)}
        missing, unexpected = sorted(set(own) - set(dense)), sorted(set(dense) - set(own))
        if missing or unexpected:
            raise ValueError(
                f"the dense file does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
            )
        for name, value in dense.items():
            if value.shape != own[name].shape:
                raise ValueError(f"dense {name!r} has shape {tuple(value.shape)}, the model's {tuple(own[name].shape)}")
        return own

    def start_following(self, interval: float = 1.0) -> threading.Thread:
        """Polls every ``interval`` seconds in a daemon thread until ``stop()``; refusals are
        logged and kept in ``status()['error']``, and the model keeps serving."""

        def follow() -> None:
            while not self._stop.wait(interval):
                try:
                    self.poll()
                except (DeltaError, ValueError, OSError) as e:
                    logger.error("%s", e)

        self._stop.clear()
        self._following = threading.Thread(target=follow, name="torchrec_ext.serve follow", daemon=True)
        self._following.start()
        return self._following

    def stop(self) -> None:
        self._stop.set()
        if self._following is not None:
            self._following.join()
            self._following = None

    # ------------------------------------------------------------------ serving

    @property
    def ready(self) -> bool:
        """Whether a model is loaded (``predict`` answers)."""
        return self._model is not None

    def predict(self, batch: Any, sparse_features: KeyedJaggedTensor | None = None) -> Tensor:
        """Click probabilities [batch] (float32) of the model at its current export, for a batch
        (``.dense_features`` and ``.sparse_features``, as torchrec's ``Batch``) or
        ``predict(dense_features, sparse_features)``."""
        if self._model is None:
            raise RuntimeError(f"Server.predict: no model yet (nothing in {self.serve_dir}: load() or wait() first)")
        dense = batch if sparse_features is not None else batch.dense_features
        sparse = sparse_features if sparse_features is not None else batch.sparse_features
        with self._lock.read(), torch.no_grad():
            logits = self._model.model(dense, sparse)  # DLRMTrain.model: DLRM_DCN
        with self._count_lock:
            self.requests += 1
        return torch.sigmoid(logits.squeeze(-1))

    def feature_names(self) -> list[str]:
        """The sparse features a request may name, in the model's order."""
        return [name for module in self._modules.values() for name in module._tables.plan.features]

    def dense_in_features(self) -> int:
        return self._model.model.dense_arch.model._mlp[0]._linear.in_features

    def status(self) -> dict[str, Any]:
        """Where the replica stands: generation, export and step applied, live rows, lag."""
        manifest = self._manifest
        if manifest is None:
            return {"ready": False, "serve_dir": self.serve_dir}
        available = self._available(manifest)
        newest = available[-1] if available else 0
        pending = [s for s in available if s > self.seq]
        lag_s = 0.0
        if pending:
            first = os.path.join(self.serve_dir, manifest["exports"], export_name(pending[0]))
            with contextlib.suppress(OSError):  # gone since the listing: no lag to tell
                lag_s = max(0.0, time.time() - os.path.getmtime(first))
        return {
            "ready": True,
            "serve_dir": self.serve_dir,
            "generation": manifest["generation"],
            "base_step": manifest["base_step"],
            "applied_seq": self.seq,
            "step": self.step,
            "newest_seq": newest,
            "lag_exports": max(0, newest - self.seq),
            "lag_s": lag_s,
            "live_rows": sum(m.num_live_rows() for m in self._modules.values()),
            "rows_applied": self.rows_applied,
            "requests": self.requests,
            "error": self.error,
        }


def _loaded(base: str, skeleton: torch.nn.Module, data_type: Any, capacity: int) -> torch.nn.Module:
    """The serving model of checkpoint ``base``, read in a one-process group of its own when the
    process has none (a server is no rank of the job)."""
    import torch.distributed as dist

    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        return load_inference_checkpoint(base, skeleton, key="model", data_type=data_type, capacity=capacity)
    finally:
        if own_group:
            dist.destroy_process_group()
