"""Checkpoints through ``torch.distributed.checkpoint`` (DCP), in ``<dir>/step_<k>``, verified
before anything in them is read.

A save is written to ``<dir>/.tmp_step_<k>``. Once every rank's files and DCP's ``.metadata``
are on disk, the ranks hash the files (SHA-256, each rank a share) and rank 0 writes
``MANIFEST.json`` last (every file's size and digest), fsyncs it and renames the directory into
place; an interrupted save leaves no ``step_<k>``. Rotation: of the checkpoints of steps up to
the one just saved, the newest ``keep`` are kept (the one just saved always among them) and
older ones deleted; checkpoints of later steps (damaged ones a resume skipped, say) are neither
counted nor deleted, and a save of their step replaces them. A ``.tmp_step_<k>`` (or
``step_<k>``) that is a symlink is refused, never written through.

Reading: ``verify_checkpoint`` checks a directory against its manifest (every listed file
present, nothing else, no symlinks, sizes and digests equal) and raises ``CheckpointError``
naming the file otherwise; ``latest_checkpoint`` returns the newest checkpoint that verifies
(``find_checkpoint`` also says why newer ones were skipped); ``load_checkpoint`` verifies before
it reads. Nothing is unpickled freely: DCP's ``.metadata`` (a pickle) is read by an unpickler that
admits only DCP's metadata classes, every entry it lists must lie inside one of the
checkpoint's own files (a bare file name, offset and length within its size), and non-tensor
values load with ``torch.load(weights_only=True)``. The manifest detects corruption, not
forgery: whoever can write the run directory can write a matching manifest, so a checkpoint
directory must come from a trusted writer (a forged one cannot run code or read files outside it
when loaded, but may hold any weights).

Loading handles state whose tensor shapes change as training goes: a dynamic table's
``state_dict()`` holds its live rows (``weight`` [n, dim], ``weight_id``, ``metadata``,
``optimizer.*`` ...), so the tensors of the model being resumed have other sizes than the
checkpoint's. ``load_checkpoint`` reads the checkpoint's metadata first and replaces every
plain tensor of the destination whose stored size (or dtype) differs by an empty tensor of the
stored size, and every ShardedTensor of a sharded dynamic table (``dynamic_rows``, rows per
rank vary) by a full tensor of the stored size, then lets DCP fill the destination (the sharded
module's load hook keeps the rows this rank owns, whatever the world size at save time). Values
DCP stores as bytes (ints, floats, strings, lists and dicts of them) come back as they were
saved; keep such values terminal (e.g. JSON strings): a list that held dicts at save time and is
empty in the destination has another structure to DCP.

    state = {"model": dmp.state_dict(), "optim": optimizer.state_dict(), "step": step}
    save_checkpoint(ckpt_dir, step, state, keep=2)
    ...
    found = latest_checkpoint(ckpt_dir)                 # (step, path) of the newest that verifies, or None
    state = load_checkpoint(found[1], {"model": dmp.state_dict(), "optim": optimizer.state_dict(), "step": 0})
    dmp.load_state_dict(state["model"]); optimizer.load_state_dict(state["optim"])

Every rank calls these collectively (all ranks see the same directory). Without a process
group a gloo group of one process is created, so a single process works too.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import re
import shutil
import stat
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint._traverse import set_element, traverse_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from torchrec_ext.distributed.checkpoint_background import PendingCheckpoint, start_background_save, wait_for_pending
from torchrec_ext.distributed.checkpoint_io import HashingWriter, file_digests

_NAME = re.compile(r"^step_(\d+)$")
_METADATA_FILE = ".metadata"  # DCP's index of the checkpoint (a pickle), written once every rank's data is in
MANIFEST_FILE = "MANIFEST.json"  # size and SHA-256 of every other file, written last
_MANIFEST_FORMAT = "torchrec_ext.checkpoint.manifest/1"
# A link of an incremental chain (checkpoint_incremental): also names the links it builds on. Readers
# that know only /1 refuse it rather than load half of it.
_CHAIN_FORMAT = "torchrec_ext.checkpoint.manifest/2"
_MANIFEST_MAX_BYTES = 64 << 20
_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
_PATH_CLASSES = {"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"}
# The globals DCP's .metadata pickle refers to (torch 2.11-2.13); any other global is refused.
_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "ChunkStorageMetadata",
        "BytesStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},  # and the dtypes, checked by type
    "pathlib": _PATH_CLASSES,
    "pathlib._local": _PATH_CLASSES,  # where Python 3.13 defines (and pickles) them
    "collections": {"OrderedDict"},
}


class CheckpointError(ValueError):
    """A checkpoint directory that is incomplete, corrupted or not safe to read; the message
    names the directory and the file."""


def ensure_process_group() -> dist.ProcessGroup:
    """The default process group; a gloo group of this one process when none exists."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return dist.group.WORLD


def checkpoint_path(ckpt_dir: str, step: int) -> str:
    return os.path.join(ckpt_dir, f"step_{step}")


def _step_dirs(ckpt_dir: str) -> list[tuple[int, str]]:
    """Every ``step_<k>`` entry under ckpt_dir (verified or not) as (step, path), oldest first."""
    if not os.path.isdir(ckpt_dir):
        return []
    found = [
        (int(m.group(1)), os.path.join(ckpt_dir, name))
        for name in os.listdir(ckpt_dir)
        for m in [_NAME.match(name)]
        if m
    ]
    return sorted(found)


def list_checkpoints(ckpt_dir: str) -> list[tuple[int, str]]:
    """Complete checkpoints under ckpt_dir (real directories with a manifest) as (step, path),
    oldest first. Not verified: see find_checkpoint."""
    return [
        (step, path)
        for step, path in _step_dirs(ckpt_dir)
        if not os.path.islink(path) and os.path.isfile(os.path.join(path, MANIFEST_FILE))
    ]


def find_checkpoint(
    ckpt_dir: str, process_group: dist.ProcessGroup | None = None
) -> tuple[tuple[int, str] | None, list[tuple[str, str]]]:
    """(step, path) of the newest checkpoint under ckpt_dir that verifies (None when none does),
    and the newer ones skipped as (path, reason), newest first. Collective."""
    pg = process_group or ensure_process_group()
    candidates = _from_first_rank(_step_dirs(ckpt_dir) if dist.get_rank(pg) == 0 else None, pg)
    skipped: list[tuple[str, str]] = []
    for step, path in reversed(candidates):
        try:
            verify_checkpoint(path, pg, step=step)
        except CheckpointError as e:
            skipped.append((path, str(e)))
            continue
        return (step, path), skipped
    return None, skipped


def latest_checkpoint(ckpt_dir: str, process_group: dist.ProcessGroup | None = None) -> tuple[int, str] | None:
    """(step, path) of the newest checkpoint under ckpt_dir that verifies, or None. Collective."""
    return find_checkpoint(ckpt_dir, process_group)[0]


def save_checkpoint(
    ckpt_dir: str,
    step: int,
    state: dict[str, Any],
    keep: int = 2,
    process_group: dist.ProcessGroup | None = None,
    blocking: bool = True,
) -> str | PendingCheckpoint:
    """Saves ``state`` as ``<ckpt_dir>/step_<step>`` with its manifest (collective); of the
    checkpoints of steps <= ``step`` keeps the newest ``keep`` (0: all), never deleting a later
    step's. Returns the checkpoint's path.

    ``blocking=False`` copies ``state``'s tensors to host memory now and writes in the
    background (see checkpoint_background): it returns a ``PendingCheckpoint`` whose ``wait()``
    gives the path. Training may go on and change the tables meanwhile; the checkpoint holds
    them as they were at the call. Any later save first waits for this one."""
    if type(keep) is not int or keep < 0:
        raise ValueError(f"save_checkpoint: keep must be an int >= 0, got {keep!r}")
    if type(blocking) is not bool:
        raise TypeError(f"save_checkpoint: blocking must be a bool, got {blocking!r}")
    pg = process_group or ensure_process_group()
    if not blocking:
        return start_background_save(
            pg,
            checkpoint_path(ckpt_dir, step),
            state,
            # one writer thread: a background save leaves the cores to training
            lambda staged, group: _save(ckpt_dir, step, staged, keep, group, io_threads=1),
        )
    wait_for_pending(pg)
    return _save(ckpt_dir, step, state, keep, pg)


def _save(
    ckpt_dir: str,
    step: int,
    state: dict[str, Any],
    keep: int,
    pg: dist.ProcessGroup,
    write_files: Callable[[str], dict[str, tuple[int, str]]] | None = None,
    chain: dict[str, Any] | None = None,
    io_threads: int | None = None,
) -> str:
    """The save (collective). ``write_files(directory)``: writes this rank's further files into
    the checkpoint before the manifest and returns their digests; ``chain``: the incremental
    chain the manifest records (checkpoint_incremental); ``io_threads``: DCP writer threads
    (default: checkpoint_io.IO_THREADS)."""
    rank = dist.get_rank(pg)
    final = checkpoint_path(ckpt_dir, step)
    tmp = os.path.join(ckpt_dir, f".tmp_step_{step}")
    old = os.path.join(ckpt_dir, f".old_step_{step}")
    error = None
    if rank == 0:
        os.makedirs(ckpt_dir, exist_ok=True)
        link = next((p for p in (tmp, final, old) if os.path.islink(p)), None)
        if link is not None:
            error = (
                f"save_checkpoint: {link} is a symlink; a checkpoint is never written through one "
                "(remove it if it is yours)"
            )
        else:
            shutil.rmtree(tmp, ignore_errors=True)  # left by an interrupted save
    _raise_if_any(error, pg)
    writer = HashingWriter(tmp, io_threads)  # hashes each file as it writes it, one file per writer thread
    dcp.save(state, storage_writer=writer, process_group=pg)
    known = writer.digests
    if write_files is not None:
        known.update(write_files(tmp))
    dist.barrier(pg)  # every rank's files and the metadata are written
    # One listing for all ranks: a rank with a stale view would shift the shares and leave a file unhashed.
    names = _from_first_rank(sorted(os.listdir(tmp)) if rank == 0 else None, pg)
    digests = _hash_files(tmp, names, pg, known=known)
    if rank == 0:
        _write_manifest(tmp, step, digests, chain)
        if os.path.exists(final):  # saving a step again (e.g. after resuming from it)
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        _fsync_dir(ckpt_dir)
        if keep:  # counted up to this step: later ones (e.g. damaged, skipped by a resume) must not push it out
            upto = [path for saved, path in list_checkpoints(ckpt_dir) if saved <= step]
            # An incremental checkpoint needs the links it builds on: they stay while it does.
            needed = {link for path in upto[-keep:] for link in chain_links(path)}
            for path in upto[:-keep]:
                if path not in needed:
                    shutil.rmtree(path, ignore_errors=True)
    dist.barrier(pg)
    return final


def verify_checkpoint(path: str, process_group: dist.ProcessGroup | None = None, step: int | None = None) -> None:
    """Checks checkpoint directory ``path`` against its manifest (collective: each rank hashes a
    share of the files): every listed file present and nothing else, no symlink or other
    non-regular entry, sizes and SHA-256 digests equal, and the manifest's step equal to
    ``step`` when given. Raises CheckpointError naming the first problem found."""
    pg = process_group or ensure_process_group()
    manifest = _verify_files(path, step, pg)
    links = manifest.get("incremental", {}).get("links", [])
    for link in links:  # an incremental checkpoint: every link it builds on, each as it was when it was built on
        link_path = checkpoint_path(os.path.dirname(os.path.abspath(path)), link["step"])
        error = None
        try:
            digest = hashlib.sha256(_read_file(os.path.join(link_path, MANIFEST_FILE))).hexdigest()
            if digest != link["manifest_sha256"]:
                error = (
                    f"checkpoint {path}: the link it builds on, {link_path}, is not the one it was saved on "
                    f"(its {MANIFEST_FILE} differs): the incremental chain is broken"
                )
        except OSError as e:
            error = (
                f"checkpoint {path}: the link it builds on, {link_path}, cannot be read ({e.strerror}): "
                "the incremental chain is broken"
            )
        _raise_if_any(error, pg)
        try:
            _verify_files(link_path, link["step"], pg)
        except CheckpointError as e:
            raise CheckpointError(f"checkpoint {path}: a link of its incremental chain is damaged: {e}") from None


def _verify_files(path: str, step: int | None, pg: dist.ProcessGroup) -> dict[str, Any]:
    """Checks directory ``path``'s own files against its manifest (collective); the manifest."""
    error, manifest = None, {"files": {}}
    try:
        manifest = _read_manifest(path, step)
    except CheckpointError as e:
        error = str(e)
    except OSError as e:  # e.g. an entry removed while being listed
        error = f"checkpoint {path}: cannot be read ({e})"
    _raise_if_any(error, pg)
    files = manifest["files"]
    digests = _hash_files(path, sorted(files), pg)
    for name in sorted(files):
        if digests[name] != (files[name]["size"], files[name]["sha256"]):
            raise CheckpointError(
                f"checkpoint {path}: {name}: its SHA-256 differs from the manifest's (the file is corrupted)"
            )
    return manifest


def chain_links(path: str) -> list[str]:
    """The paths of the links incremental checkpoint ``path`` builds on, base first ([] for a
    full checkpoint, or one whose manifest cannot be read). Reads the manifest only."""
    try:
        manifest = json.loads(_read_file(os.path.join(path, MANIFEST_FILE)))
        links = manifest["incremental"]["links"]
        return [checkpoint_path(os.path.dirname(os.path.abspath(path)), int(link["step"])) for link in links]
    except (OSError, ValueError, KeyError, TypeError):
        return []


def read_manifest(path: str) -> dict[str, Any]:
    """Checkpoint ``path``'s manifest after the checks that need no hashing (verify first)."""
    return _read_manifest(path, None)


def _read_manifest(path: str, step: int | None) -> dict[str, Any]:
    """The manifest (its ``files``: {name: {"size", "sha256"}}) after the checks that need no
    hashing: the directory's entries (regular files, exactly the listed ones) and their sizes."""
    where = f"checkpoint {path}"
    try:
        st = os.lstat(path)
    except OSError as e:
        raise CheckpointError(f"{where}: cannot be read ({e.strerror})") from None
    if stat.S_ISLNK(st.st_mode):
        raise CheckpointError(f"{where}: is a symlink (checkpoints are real directories)")
    if not stat.S_ISDIR(st.st_mode):
        raise CheckpointError(f"{where}: is not a directory")
    entries: dict[str, os.stat_result] = {}
    for name in sorted(os.listdir(path)):
        st = os.lstat(os.path.join(path, name))
        if stat.S_ISLNK(st.st_mode):
            raise CheckpointError(f"{where}: {name} is a symlink (a checkpoint holds regular files only)")
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"{where}: {name} is not a regular file")
        entries[name] = st
    if MANIFEST_FILE not in entries:
        raise CheckpointError(
            f"{where}: no {MANIFEST_FILE} (an interrupted save, or a checkpoint written "
            "before checkpoints had manifests)"
        )
    if entries[MANIFEST_FILE].st_size > _MANIFEST_MAX_BYTES:
        raise CheckpointError(
            f"{where}: {MANIFEST_FILE} is {entries[MANIFEST_FILE].st_size} bytes, "
            f"more than a manifest's {_MANIFEST_MAX_BYTES}"
        )
    try:
        manifest = json.loads(_read_file(os.path.join(path, MANIFEST_FILE)))
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{where}: {MANIFEST_FILE} is not valid JSON ({e})") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if (
        not isinstance(files, dict)
        or manifest.get("format") not in (_MANIFEST_FORMAT, _CHAIN_FORMAT)
        or not isinstance(manifest.get("step"), int)
        or not all(_valid_entry(name, entry) for name, entry in files.items())
        or (manifest["format"] == _CHAIN_FORMAT) != _valid_chain(manifest.get("incremental"), manifest["step"])
    ):
        raise CheckpointError(
            f"{where}: {MANIFEST_FILE} is malformed (expected format {_MANIFEST_FORMAT!r} or "
            f"{_CHAIN_FORMAT!r} with its chain, a step, and a size and SHA-256 per file)"
        )
    if step is not None and manifest["step"] != step:
        raise CheckpointError(f"{where}: {MANIFEST_FILE} is of step {manifest['step']}, not {step}")
    for name in sorted(files):
        if name not in entries:
            raise CheckpointError(f"{where}: {name} is missing (the manifest lists it)")
        if entries[name].st_size != files[name]["size"]:
            raise CheckpointError(
                f"{where}: {name} is {entries[name].st_size} bytes, the manifest says "
                f"{files[name]['size']} (truncated or overwritten)"
            )
    extra = sorted(set(entries) - set(files) - {MANIFEST_FILE})
    if extra:
        raise CheckpointError(f"{where}: {extra[0]} is not in the manifest (written after the checkpoint)")
    return manifest


def _valid_chain(chain: Any, step: int) -> bool:
    """An incremental chain: the world size and the earlier links, base first, in step order."""
    if not isinstance(chain, dict) or type(chain.get("world_size")) is not int or chain["world_size"] < 1:
        return False
    links = chain.get("links")
    if not isinstance(links, list) or not all(
        isinstance(link, dict)
        and type(link.get("step")) is int
        and isinstance(link.get("manifest_sha256"), str)
        and bool(_SHA256_HEX.match(link["manifest_sha256"]))
        for link in links
    ):
        return False
    steps = [link["step"] for link in links] + [step]
    return all(a < b for a, b in zip(steps, steps[1:]))


def _valid_entry(name: Any, entry: Any) -> bool:
    return (
        isinstance(name, str)
        and name not in ("", ".", "..", MANIFEST_FILE)
        and "/" not in name
        and os.sep not in name
        and isinstance(entry, dict)
        and type(entry.get("size")) is int
        and entry["size"] >= 0
        and isinstance(entry.get("sha256"), str)
        and bool(_SHA256_HEX.match(entry["sha256"]))
    )


def _write_manifest(
    directory: str, step: int, digests: dict[str, tuple[int, str]], chain: dict[str, Any] | None = None
) -> None:
    """Writes the manifest of ``directory``'s files (their digests) and, for a link of an
    incremental chain, the chain; fsynced, then the directory."""
    manifest: dict[str, Any] = {
        "format": _MANIFEST_FORMAT if chain is None else _CHAIN_FORMAT,
        "step": step,
        "files": {name: {"size": size, "sha256": digest} for name, (size, digest) in sorted(digests.items())},
    }
    if chain is not None:
        manifest["incremental"] = chain
    fd = os.open(
        os.path.join(directory, MANIFEST_FILE),
        os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0),
        0o644,
    )
    with os.fdopen(fd, "w") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(directory)


def _hash_files(
    directory: str, names: list[str], pg: dist.ProcessGroup, known: dict[str, tuple[int, str]] | None = None
) -> dict[str, tuple[int, str]]:
    """{name: (size, SHA-256)} of the files ``names`` in ``directory`` (collective; every rank
    gets all). ``known``: digests this rank computed as it wrote its files (a save); the files
    no rank knows are read and hashed, rank r taking names r, r + world, ... on several threads.
    A file that cannot be read raises CheckpointError on every rank."""
    rank, world = dist.get_rank(pg), dist.get_world_size(pg)
    found: dict[str, tuple[int, str]] = {}
    if known is not None:
        shares: list[Any] = [None] * world
        dist.all_gather_object(shares, {name: known[name] for name in names if name in known}, group=pg)
        found = {name: tuple(value) for share in shares for name, value in share.items()}
    mine: dict[str, Any] = {}
    error = None
    try:
        mine = file_digests(directory, [name for name in names if name not in found][rank::world])
    except OSError as e:
        error = f"checkpoint {directory}: {os.path.basename(e.filename or '?')} cannot be read ({e.strerror})"
    _raise_if_any(error, pg)
    shares = [None] * world
    dist.all_gather_object(shares, mine, group=pg)
    found.update({name: tuple(value) for share in shares for name, value in share.items()})
    return found


def _read_file(path: str) -> bytes:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    with os.fdopen(fd, "rb") as f:
        return f.read()


def _from_first_rank(value: Any, pg: dist.ProcessGroup) -> Any:
    """Rank 0's ``value`` on every rank: one view of the file system for all ranks."""
    holder = [value]
    dist.broadcast_object_list(holder, src=dist.get_global_rank(pg, 0), group=pg)
    return holder[0]


def _raise_if_any(error: str | None, pg: dist.ProcessGroup) -> None:
    """Raises CheckpointError on every rank when any rank found an error (the lowest rank's
    message), so that no rank goes on to a collective the others have left."""
    errors: list[str | None] = [None] * dist.get_world_size(pg)
    dist.all_gather_object(errors, error, group=pg)
    first = next((e for e in errors if e), None)
    if first:
        raise CheckpointError(first)


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's .metadata admitting only the classes it is made of: a crafted pickle
    cannot call anything else (os.system, eval, ...)."""

    def __init__(self, file, where: str):
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointError(
            f"{self.where}: refers to {module}.{name}, which is not part of DCP's metadata "
            "(refused: unpickling it could run code)"
        )


def read_metadata(path: str) -> Metadata:
    """The DCP metadata of checkpoint directory ``path``, unpickled with only DCP's metadata
    classes admitted (clear error when it is missing, damaged or refers to anything else).
    Does not verify the manifest: load_checkpoint does that first."""
    where = f"checkpoint {path}: {_METADATA_FILE}"
    file = os.path.join(path, _METADATA_FILE)
    if not os.path.isfile(file):
        raise CheckpointError(f"checkpoint {path}: no {_METADATA_FILE} (not a complete checkpoint)")
    try:
        metadata = _MetadataUnpickler(io.BytesIO(_read_file(file)), where).load()
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - a damaged pickle raises any of several types
        raise CheckpointError(f"{where}: cannot be read ({type(e).__name__}: {e})") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{where}: holds a {type(metadata).__name__}, not DCP's Metadata")
    return metadata


def _check_storage(path: str, metadata: Metadata) -> None:
    """Raises CheckpointError unless every entry of ``metadata`` lies inside one of checkpoint
    ``path``'s own files: DCP reads an entry at ``<path>/<relative_path>``, so a forged .metadata
    naming an absolute path or ``..`` would read any file (another run's weights, a FIFO that
    hangs, /dev/zero with a huge length)."""
    storage = metadata.storage_data
    if not isinstance(storage, dict):
        raise CheckpointError(
            f"checkpoint {path}: {_METADATA_FILE}: its storage_data is a {type(storage).__name__}, not a dict"
        )
    sizes: dict[str, int] = {}
    for index, info in storage.items():
        where = f"checkpoint {path}: {_METADATA_FILE}: entry {getattr(index, 'fqn', index)!r}"
        name = getattr(info, "relative_path", None)
        if (
            not isinstance(name, str)
            or name in ("", ".", "..")
            or "/" in name
            or os.sep in name
            or (os.altsep is not None and os.altsep in name)
        ):
            raise CheckpointError(
                f"{where} is stored at {name!r}, not a file name of the checkpoint "
                "(refused: it would read outside the checkpoint)"
            )
        if name not in sizes:
            try:
                st = os.lstat(os.path.join(path, name))
            except OSError:
                st = None
            if st is None or not stat.S_ISREG(st.st_mode):
                raise CheckpointError(f"{where} is stored in {name}, which the checkpoint does not hold")
            sizes[name] = st.st_size
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if type(offset) is not int or type(length) is not int or offset < 0 or length < 0:
            raise CheckpointError(
                f"{where}: offset {offset!r} and length {length!r} in {name} are not non-negative integers"
            )
        if offset + length > sizes[name]:
            raise CheckpointError(
                f"{where}: bytes {offset}..{offset + length} lie beyond the end of {name} ({sizes[name]} bytes)"
            )


class _Reader(dcp.FileSystemReader):
    """DCP's file reader, reading .metadata with the restricted unpickler and refusing entries
    outside the checkpoint's files."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_metadata(str(self.path))
        _check_storage(str(self.path), metadata)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _Planner(dcp.DefaultLoadPlanner):
    """DCP's load planner, loading values stored as bytes with torch.load(weights_only=True)
    (plain data only) instead of a full unpickle."""

    def __init__(self, path: str):
        super().__init__()
        self.path = path

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, weights_only=True)
        except Exception as e:  # noqa: BLE001 - weights_only refusals and damaged data raise several types
            raise CheckpointError(
                f"checkpoint {self.path}: entry {fqn!r} is not plain data (refused: "
                f"{str(e).splitlines()[0] if str(e) else type(e).__name__})"
            ) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


def fit_to_checkpoint(state: dict[str, Any], metadata: Metadata, allow_missing: bool = False) -> dict[str, Any]:
    """Replaces, in place, every plain tensor of ``state`` whose checkpointed size or dtype
    differs by an empty tensor of the stored size and dtype (same device), so DCP can load into
    it. Returns ``state``. Raises KeyError naming entries the checkpoint lacks, unless
    ``allow_missing`` (those are left as they are)."""
    stored = metadata.state_dict_metadata
    replace: list[tuple[tuple, torch.Tensor]] = []
    missing: list[str] = []

    def visit(path, value) -> None:
        fqn = ".".join(map(str, path))
        if fqn not in stored:
            if not allow_missing:
                missing.append(fqn)
            return
        md = stored[fqn]
        if not isinstance(md, TensorStorageMetadata):
            return
        if isinstance(value, ShardedTensor):
            # Rows of a sharded dynamic table (dynamic_rows): how many each rank held at save time
            # need not match now, so read the whole tensor; the module's load hook keeps this
            # rank's rows (by routing). Other ShardedTensors load as they are when sizes match.
            if getattr(value, "dynamic_rows", False) or tuple(value.size()) != tuple(md.size):
                replace.append((path, torch.empty(tuple(md.size), dtype=md.properties.dtype, device="cpu")))
        elif type(value) is torch.Tensor and (
            tuple(value.shape) != tuple(md.size) or value.dtype != md.properties.dtype
        ):
            replace.append((path, torch.empty(tuple(md.size), dtype=md.properties.dtype, device=value.device)))

    traverse_state_dict(state, visit)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise KeyError(f"load_checkpoint: the checkpoint has no {shown}")
    for path, tensor in replace:
        set_element(state, path, tensor)
    return state


class DynamicTablesLoadPlanner(dcp.DefaultLoadPlanner):
    """DCP's default load planner for a plain ``torch.distributed.checkpoint.load`` of a state
    holding dynamic tables: a table's entries have its live row count, which differs between the
    model being loaded and the checkpoint, so DCP's own planner refuses them ("Size mismatch").
    This one first resizes those entries to the checkpoint's (``fit_to_checkpoint``), then plans
    as DCP does; load the state into the model afterwards, as with any DCP load::

        state = {"model": dmp.state_dict()}
        dcp.load(state, checkpoint_id=path, planner=DynamicTablesLoadPlanner())
        dmp.load_state_dict(state["model"])

    It reads whatever DCP reads (no manifest check, DCP's own unpickling): ``load_checkpoint``
    is the verified, restricted path for checkpoints ``save_checkpoint`` wrote."""

    def set_up_planner(self, state_dict: Any, metadata: Metadata | None = None, is_coordinator: bool = False) -> None:
        if metadata is not None:
            fit_to_checkpoint(state_dict, metadata, allow_missing=self.allow_partial_load)
        super().set_up_planner(state_dict, metadata, is_coordinator)


def load_checkpoint(
    path: str, state: dict[str, Any], process_group: dist.ProcessGroup | None = None, verify: bool = True
) -> dict[str, Any]:
    """Loads checkpoint ``path`` into ``state`` (collective) and returns it: tensors resized to
    the stored sizes where they differ, then filled; non-tensor values replaced by the saved ones.
    The directory is verified against its manifest first; ``verify=False`` skips that (only right
    after find_checkpoint / verify_checkpoint did it); nothing is unpickled freely either way."""
    pg = process_group or ensure_process_group()
    if verify:
        verify_checkpoint(path, pg)
    if "incremental" in read_manifest(path):
        raise CheckpointError(
            f"checkpoint {path}: is a link of an incremental chain (its tables are in base and "
            "delta files): load it with IncrementalCheckpoints.load "
            "(torchrec_ext.distributed.checkpoint_incremental)"
        )
    return load_dcp(path, state, pg)


def load_dcp(path: str, state: dict[str, Any], pg: dist.ProcessGroup) -> dict[str, Any]:
    """Loads the DCP part of verified checkpoint ``path`` into ``state`` (see load_checkpoint)."""
    metadata = read_metadata(path)
    _check_storage(path, metadata)  # here for a clear error; DCP would wrap the _Reader's in its own
    fit_to_checkpoint(state, metadata)
    try:
        dcp.load(state, storage_reader=_Reader(path), planner=_Planner(path), process_group=pg)
    except CheckpointException as e:  # DCP gathers each rank's failure: raise ours as it was
        ours = [exc for exc, _ in e.failures.values() if isinstance(exc, CheckpointError)]
        if ours:
            raise ours[0] from None
        raise
    return state


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
