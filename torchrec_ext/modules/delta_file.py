"""Delta files: ``save_delta(delta, path)`` / ``load_delta(path)``.

The layout is safetensors' (readable by any safetensors reader, or by hand):

    [8 bytes]  N, little-endian uint64: the header's length
    [N bytes]  JSON header, space-padded to a multiple of 8:
               {"__metadata__": {"format": "torchrec_ext.delta", "format_version": "1",
                                 "delta": "<JSON string, below>", "sha256": "<hex>"},
                "<table>/ids":        {"dtype": "I64", "shape": [n],      "data_offsets": [begin, end]},
                "<table>/weights":    {"dtype": "F32" | "F16" | "BF16", "shape": [n, dim], ...},
                "<table>/tombstones": {"dtype": "I64", "shape": [m], ...},
                "<table>/scores":     {"dtype": "I64", "shape": [n], ...}                  (optional)
                "<table>/optimizer.<state>": {"dtype": "F32", "shape": [n, dim] or [n], ...} (optional)
                "<table>/fallback_slots", "<table>/fallback_weights" [k, dim], "<table>/fallback_optimizer.<state>"
                                      (tables with fallback rows: the ones written since)}
    [rest]     the tensors' bytes, little-endian, C order, back to back in header order

The "delta" string: {"format_version": 1, "since": {"stream", "version"}, "token": {...},
"source": {"module", "tables": {name: {"dim", "dtype"[, "fallback_rows"]}}, ...}, "tables": {name:
{"n", "m", "optimizer": [state names], "scores": bool[, "fallback": k, "fallback_optimizer": [state
names]]}}}. ``sha256`` is the SHA-256 of the "delta" string's UTF-8 bytes followed by the data
section; the tensor entries are checked against the "delta" string (names, counts, dims), so
every byte of the file is covered. A reader refuses a file whose digest, sizes or entries do not
match (``DeltaError``: truncated or corrupted).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import sys

import torch
from torch import Tensor

from torchrec_ext.modules.deltas import FORMAT_VERSION, Delta, DeltaError, DeltaToken, TableDelta

FORMAT = "torchrec_ext.delta"
_CODES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64"}
_DTYPES = {code: dtype for dtype, code in _CODES.items()}


def _entries(delta: Delta) -> list[tuple[str, Tensor]]:
    out = []
    for name, table in delta.tables.items():
        out += [
            (f"{name}/ids", table.ids),
            (f"{name}/weights", table.weights),
            (f"{name}/tombstones", table.tombstones),
        ]
        if table.scores is not None:
            out.append((f"{name}/scores", table.scores))
        out += [(f"{name}/optimizer.{key}", value) for key, value in table.optimizer.items()]
        if table.fallback_slots is not None:
            out += [
                (f"{name}/fallback_slots", table.fallback_slots),
                (f"{name}/fallback_weights", table.fallback_weights),
            ]
            out += [(f"{name}/fallback_optimizer.{key}", value) for key, value in table.fallback_optimizer.items()]
    return out


def _description(delta: Delta) -> str:
    return json.dumps(
        {
            "format_version": delta.format_version,
            "since": delta.since.to_dict(),
            "token": delta.token.to_dict(),
            "source": delta.source,
            "tables": {
                name: {
                    "n": int(t.ids.numel()),
                    "m": int(t.tombstones.numel()),
                    "optimizer": list(t.optimizer),
                    "scores": t.scores is not None,
                }
                | (
                    {}
                    if t.fallback_slots is None
                    else {"fallback": int(t.fallback_slots.numel()), "fallback_optimizer": list(t.fallback_optimizer)}
                )
                for name, t in delta.tables.items()
            },
        },
        sort_keys=True,
    )


def save_delta(delta: Delta, path: str) -> None:
    """Writes ``delta`` to ``path`` (atomically: a temporary file renamed into place)."""
    if not isinstance(delta, Delta):
        raise TypeError(f"save_delta: delta must be a Delta, got {type(delta).__name__}")
    assert sys.byteorder == "little", "delta files are little-endian"
    header: dict[str, object] = {}
    chunks, offset = [], 0
    for name, tensor in _entries(delta):
        if tensor.dtype not in _CODES:
            raise TypeError(f"save_delta: {name} has dtype {tensor.dtype}; the format holds {sorted(map(str, _CODES))}")
        data = tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        header[name] = {
            "dtype": _CODES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + len(data)],
        }
        chunks.append(data)
        offset += len(data)
    description = _description(delta)
    digest = hashlib.sha256(description.encode())
    for data in chunks:
        digest.update(data)
    header["__metadata__"] = {
        "format": FORMAT,
        "format_version": str(FORMAT_VERSION),
        "delta": description,
        "sha256": digest.hexdigest(),
    }
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for data in chunks:
            f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_delta(path: str) -> Delta:
    """Reads a ``save_delta`` file, checking its layout and digest; ``DeltaError`` if it is
    truncated, corrupted or of another format version."""
    where = f"load_delta: {path}"
    with open(path, "rb") as f:
        blob = f.read()
    if len(blob) < 8:
        raise DeltaError(f"{where}: truncated: {len(blob)} bytes, shorter than the 8-byte header length")
    (n,) = struct.unpack("<Q", blob[:8])
    if 8 + n > len(blob):
        raise DeltaError(
            f"{where}: truncated: the header says {n} header bytes, the file has {len(blob) - 8} after the length"
        )
    try:
        header = json.loads(blob[8 : 8 + n])
        meta = header.pop("__metadata__")
        if meta.get("format") != FORMAT:
            raise DeltaError(f"{where}: not a delta file (format {meta.get('format')!r}, expected {FORMAT!r})")
        if meta.get("format_version") != str(FORMAT_VERSION):
            raise DeltaError(
                f"{where}: format_version {meta.get('format_version')!r}; this reader reads {FORMAT_VERSION}"
            )
        description = meta["delta"]
        info = json.loads(description)
    except DeltaError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise DeltaError(f"{where}: corrupted header ({type(e).__name__}: {e})") from None
    data = memoryview(blob)[8 + n :]
    ends = [entry.get("data_offsets", [0, 0])[1] for entry in header.values() if isinstance(entry, dict)]
    if max(ends, default=0) > len(data):
        raise DeltaError(f"{where}: truncated: the tensors need {max(ends)} data bytes, the file has {len(data)}")
    digest = hashlib.sha256(description.encode())
    digest.update(data)
    if digest.hexdigest() != meta.get("sha256"):
        raise DeltaError(
            f"{where}: corrupted: SHA-256 {digest.hexdigest()} of its contents, the header says {meta.get('sha256')}"
        )
    try:
        return _build(info, header, data)
    except (ValueError, KeyError, TypeError, RuntimeError) as e:
        raise DeltaError(f"{where}: corrupted entries ({type(e).__name__}: {e})") from None


def _build(info: dict[str, object], header: dict[str, dict[str, object]], data: memoryview) -> Delta:
    def tensor(name: str, dtype: str, shape: list[int]) -> Tensor:
        entry = header.pop(name)
        if entry["dtype"] != dtype or list(entry["shape"]) != shape:
            raise ValueError(f"{name} is {entry['dtype']} {entry['shape']}, the description says {dtype} {shape}")
        begin, end = entry["data_offsets"]
        size = _DTYPES[dtype].itemsize * (shape[0] * (shape[1] if len(shape) > 1 else 1))
        if end - begin != size:
            raise ValueError(f"{name} spans {end - begin} bytes, {shape} of {dtype} needs {size}")
        if size == 0:
            return torch.zeros(shape, dtype=_DTYPES[dtype], device="cpu")
        return torch.frombuffer(bytearray(data[begin:end]), dtype=_DTYPES[dtype]).view(shape)

    tables = {}
    for name, t in info["tables"].items():
        source = info["source"]["tables"][name]
        dim, code = int(source["dim"]), _CODES[getattr(torch, source["dtype"])]
        n, m = int(t["n"]), int(t["m"])
        table = TableDelta(
            ids=tensor(f"{name}/ids", "I64", [n]),
            weights=tensor(f"{name}/weights", code, [n, dim]),
            tombstones=tensor(f"{name}/tombstones", "I64", [m]),
        )
        if t["scores"]:
            table.scores = tensor(f"{name}/scores", "I64", [n])
        for key in t["optimizer"]:
            entry = header[f"{name}/optimizer.{key}"]
            if entry["dtype"] not in ("F32", "F16", "BF16"):
                raise ValueError(f"{name}/optimizer.{key} has dtype {entry['dtype']}, not a float")
            table.optimizer[key] = tensor(f"{name}/optimizer.{key}", entry["dtype"], [n] + list(entry["shape"][1:2]))
        if "fallback" in t:
            k = int(t["fallback"])
            table.fallback_slots = tensor(f"{name}/fallback_slots", "I64", [k])
            table.fallback_weights = tensor(f"{name}/fallback_weights", code, [k, dim])
            for key in t["fallback_optimizer"]:
                entry = header[f"{name}/fallback_optimizer.{key}"]
                if entry["dtype"] != "F32":
                    raise ValueError(f"{name}/fallback_optimizer.{key} has dtype {entry['dtype']}, not F32")
                table.fallback_optimizer[key] = tensor(
                    f"{name}/fallback_optimizer.{key}", "F32", [k] + list(entry["shape"][1:2])
                )
        tables[name] = table
    if header:
        raise ValueError(f"entries not in the description: {sorted(header)}")
    return Delta(
        since=DeltaToken.from_dict(info["since"]),
        token=DeltaToken.from_dict(info["token"]),
        source=info["source"],
        tables=tables,
        format_version=int(info["format_version"]),
    )
