"""The job's feed to serving (``--export-deltas-every N --serve-dir D``): a base checkpoint, then
every N steps each rank's row delta since its last export and the dense parameters, in a
directory a serving process follows (``python -m torchrec_ext.serve D``).

The serve directory (every file written to a temporary name and renamed into place, the
manifests last, so a reader never sees a half-written one):

    D/manifest.json                  {"format": "torchrec_ext.serve", "format_version": 1,
                                      "generation": g, "base": "gen_<g>/base/step_<k>", "base_step": k,
                                      "world_size": W, "model": {ModelConfig fields},
                                      "modules": {path: [token of rank 0, ..., token of rank W-1]},
                                      "exports": "gen_<g>/exports"}
    D/gen_<g>/base/step_<k>/         the model's state at step k (save_checkpoint's DCP layout, key "model")
    D/gen_<g>/deltas/<seq>_<i>_rank<r>.delta   rank r's delta of module i (delta_file's format)
    D/gen_<g>/dense/<seq>.pt         the dense parameters and buffers at the export (torch.save of tensors)
    D/gen_<g>/exports/<seq>.json     {"seq": n, "step": k, "dense": file,
                                      "modules": {path: {"deltas": [file per rank]}}}

Exports are numbered 1, 2, ... within a generation; export n of every rank starts at the token
export n - 1 ended at (the manifest's tokens for n = 1), so a reader applies them in order and a
gap in the numbers (or a delta whose ``since`` is not the token it follows) is a missing export.
Each start of the job (a fresh run or a ``--resume``) begins a new generation with its own base:
a token does not outlive the process that issued it; generations before the previous one are
removed then. Every rank writes its own deltas; rank 0
writes the base's share it holds (with every other rank: save_checkpoint is collective), the
dense file and the manifests.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torchrec.modules.embedding_configs import DataType

from torchrec_ext.distributed.checkpoint import save_checkpoint
from torchrec_ext.distributed.deltas import ShardedDeltaMixin
from torchrec_ext.modules.delta_file import save_delta
from torchrec_ext.modules.deltas import DeltaToken
from torchrec_ext.train.model import ModelConfig

FORMAT = "torchrec_ext.serve"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
CONSUMER = "serve"  # this exporter's name on the modules' delta logs (release_deltas)


# ----------------------------------------------------------------------------- the format


def model_config_to_json(cfg: ModelConfig) -> dict[str, Any]:
    out = dataclasses.asdict(cfg)
    out["dense_arch"], out["over_arch"] = list(cfg.dense_arch), list(cfg.over_arch)
    out["table_options"] = {k: (v.name if isinstance(v, DataType) else v) for k, v in dict(cfg.table_options).items()}
    return out


def model_config_from_json(d: Mapping[str, Any]) -> ModelConfig:
    options = dict(d.get("table_options", {}))
    if "data_type" in options:
        options["data_type"] = DataType[options["data_type"]]
    return ModelConfig(
        **{**d, "dense_arch": tuple(d["dense_arch"]), "over_arch": tuple(d["over_arch"]), "table_options": options}
    )


def export_name(seq: int) -> str:
    return f"{seq:08d}.json"


def write_json_atomic(path: str, value: Any) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(value, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_manifest(serve_dir: str) -> dict[str, Any] | None:
    """The serve directory's manifest (None while there is none), checked for its format."""
    path = os.path.join(serve_dir, MANIFEST)
    try:
        with open(path) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        return None
    except ValueError as e:
        raise ValueError(f"{path}: not a serve manifest ({e})") from None
    if manifest.get("format") != FORMAT or manifest.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{path}: format {manifest.get('format')!r} version {manifest.get('format_version')!r}; this reader "
            f"reads {FORMAT!r} version {FORMAT_VERSION}"
        )
    return manifest


def remove_old_generations(serve_dir: str, keep_from: int) -> None:
    """Deletes ``gen_<k>`` for k < ``keep_from``: a server still on the previous generation reads
    it until it sees the new manifest; older ones have no reader."""
    for name in os.listdir(serve_dir):
        match = re.fullmatch(r"gen_(\d+)", name)
        if match and int(match.group(1)) < keep_from:
            shutil.rmtree(os.path.join(serve_dir, name), ignore_errors=True)


def delta_modules(model: torch.nn.Module) -> dict[str, ShardedDeltaMixin]:
    """The model's sharded dynamic modules, by their path in the unsharded model."""
    found = {}
    for path, module in model.named_modules():
        if isinstance(module, ShardedDeltaMixin):
            found[_unwrapped(path)] = module
    return found


def dense_state(model: torch.nn.Module, sparse_paths: list[str]) -> dict[str, torch.Tensor]:
    """The parameters and buffers outside the dynamic modules, keyed as the unsharded model's."""
    out = {}
    for items in (model.named_parameters(), model.named_buffers()):
        for name, value in items:
            name = _unwrapped(name)
            if not any(name.startswith(p + ".") for p in sparse_paths):
                out[name] = value.detach().to("cpu", copy=True)
    return out


def _unwrapped(name: str) -> str:
    """A parameter's name without the wrappers DMP puts around the dense part (DDP's ``module.``,
    DMP's ``_dmp_wrapped_module.``)."""
    parts = [p for p in name.split(".") if p not in ("_dmp_wrapped_module", "module")]
    return ".".join(parts)


# ----------------------------------------------------------------------------- the writer


class DeltaExporter:
    """Writes the base and the exports of one generation (collective: every rank calls each method)."""

    def __init__(self, serve_dir: str, dmp: torch.nn.Module, model_config: ModelConfig, rank: int, world_size: int):
        self.serve_dir, self.dmp, self.rank, self.world_size = serve_dir, dmp, rank, world_size
        self.model_config = model_config
        self.modules = delta_modules(dmp.module)
        if not self.modules:
            raise ValueError("--export-deltas-every: the model has no sharded dynamic module to export deltas of")
        self.tokens: dict[str, DeltaToken] = {}
        self.seq = 0
        self.last_step: int | None = None
        self.generation = 0

    def _dir(self, *parts: str) -> str:
        return os.path.join(self.serve_dir, f"gen_{self.generation}", *parts)

    def start(self, step: int) -> str:
        """A new generation: the base checkpoint at ``step`` and every rank's token, taken with
        no write in between. Returns the base's path."""
        previous = read_manifest(self.serve_dir) if self.rank == 0 else None
        generation = [(previous or {}).get("generation", 0) + 1]
        dist.broadcast_object_list(generation, src=0)
        self.generation = generation[0]
        if self.rank == 0:
            for sub in ("deltas", "dense", "exports"):
                os.makedirs(self._dir(sub), exist_ok=True)
            remove_old_generations(self.serve_dir, keep_from=self.generation - 1)
        base = save_checkpoint(self._dir("base"), step, {"model": self.dmp.state_dict()}, keep=1)
        self.tokens = {path: m.delta_token(consumer=CONSUMER) for path, m in self.modules.items()}
        everyone: list = [None] * self.world_size
        dist.all_gather_object(everyone, {p: t.to_dict() for p, t in self.tokens.items()})
        if self.rank == 0:
            write_json_atomic(
                os.path.join(self.serve_dir, MANIFEST),
                {
                    "format": FORMAT,
                    "format_version": FORMAT_VERSION,
                    "generation": self.generation,
                    "base": os.path.relpath(base, self.serve_dir),
                    "base_step": step,
                    "world_size": self.world_size,
                    "model": model_config_to_json(self.model_config),
                    "modules": {p: [everyone[r][p] for r in range(self.world_size)] for p in self.modules},
                    "exports": os.path.relpath(self._dir("exports"), self.serve_dir),
                },
            )
        dist.barrier()
        self.seq, self.last_step = 0, step
        return base

    def export(self, step: int) -> int:
        """Export ``seq + 1``: each rank's deltas since its last token, the dense parameters; returns
        the rows this rank exported."""
        self.seq += 1
        mine, rows = {}, 0
        for i, (path, module) in enumerate(self.modules.items()):
            delta = module.export_delta(since=self.tokens[path])
            name = f"{self.seq:08d}_{i}_rank{self.rank}.delta"
            save_delta(delta, self._dir("deltas", name))
            module.release_deltas(before=delta.token, consumer=CONSUMER)  # only the newest token is needed now
            self.tokens[path] = delta.token
            mine[path] = os.path.relpath(self._dir("deltas", name), self.serve_dir)
            rows += sum(t.ids.numel() for t in delta.tables.values())
        dense_file = None
        if self.rank == 0:
            dense_file = self._dir("dense", f"{self.seq:08d}.pt")
            tmp = f"{dense_file}.tmp"
            torch.save(dense_state(self.dmp.module, list(self.modules)), tmp)
            os.replace(tmp, dense_file)
        everyone: list = [None] * self.world_size
        dist.all_gather_object(everyone, mine)  # every rank's files are in place
        if self.rank == 0:
            write_json_atomic(
                self._dir("exports", export_name(self.seq)),
                {
                    "seq": self.seq,
                    "step": step,
                    "dense": os.path.relpath(dense_file, self.serve_dir),
                    "modules": {p: {"deltas": [everyone[r][p] for r in range(self.world_size)]} for p in self.modules},
                },
            )
        dist.barrier()
        self.last_step = step
        return rows
