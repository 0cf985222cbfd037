"""fbgemm-gpu's CUDA build, carried to the lent GPU machine in parts (it has no package index, and a
device call carries at most 64 MiB while the wheel is 465 MB). Without it, TorchRec's own tables
cannot run on the GPU there, so the benchmarks' TorchRec baselines (above all issue 16's: the tier
against TorchRec's UVM-caching EBC) are "not runnable".

Here (a machine with pip's index), once:

    .venv/bin/python scripts/fbgemm_cuda_parts.py pack          # fbgemm-gpu 1.6.0 (torch 2.11), sm_90

downloads the cp312 wheel, drops every cubin of another architecture than sm_90 from its libraries
(scripts/fatbin.py: 2.5 GB of libraries of which 1.5 GB are sm_80/sm_100 code; cuobjdump, when at
hand, then reads each library's cubins as the sm_90 ones), packs the tree as
one .tar.xz (~80 MB) cut into parts of at most ``--part-mib`` MiB under .fbgemm/ (ignored by git),
with MANIFEST.json (each part's size and sha256). Each device call carries .fbgemm/MANIFEST.json and
one more part; the machine keeps the parts of earlier calls while it stays warm. There,

    python3 scripts/fbgemm_cuda_parts.py unpack --target /tmp/fbgemm_cuda   # scripts/gpu_check.sh does this

checks every part, unpacks once (a marker names the archive) and exits 0, after which putting the
target first on PYTHONPATH makes ``import fbgemm_gpu`` the CUDA build. With a part missing or
damaged it names which and exits 3, changing nothing.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fatbin import FatbinError, cuobjdump_listing, find_cuobjdump, keep_archs

MANIFEST = "MANIFEST.json"
MARKER = ".fbgemm_cuda_archive"
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]
MISSING = 3


def sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def download(version: str, python_version: str, into: str) -> str:
    os.makedirs(into, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
    cmd += ["--python-version", python_version, "--implementation", "cp", "-d", into, f"fbgemm-gpu=={version}"]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    subprocess.run(cmd, check=True)
    tag = python_version.replace(".", "")
    found = glob.glob(os.path.join(into, f"fbgemm_gpu-{version}-cp{tag}-*.whl"))
    if not found:
        raise SystemExit(f"fbgemm_cuda_parts.py: pip left no fbgemm_gpu-{version} cp{tag} wheel in {into}")
    return found[0]


def slim_tree(wheel: str, tree: str, archs: set[int]) -> dict[str, dict[str, int]]:
    """Unpacks ``wheel`` into ``tree`` (its site-packages layout) and slims each library to ``archs``;
    then, with cuobjdump at hand, checks that it reads each slimmed library's cubins as the kept ones."""
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(tree)
    cuobjdump = find_cuobjdump()
    report = {}
    for path in sorted(glob.glob(os.path.join(tree, "**", "*.so"), recursive=True)):
        name = os.path.relpath(path, tree)
        with open(path, "rb") as f:
            data = bytearray(f.read())
        try:
            stats = keep_archs(data, archs, name=name)
            if stats["dropped_bytes"]:
                with open(path, "wb") as f:
                    f.write(data)
            if cuobjdump:
                check_listing(cuobjdump_listing(cuobjdump, path), stats["cubins_kept"], archs, name)
        except FatbinError as e:
            raise SystemExit(f"fbgemm_cuda_parts.py: {e}") from None
        report[name] = stats
    if not cuobjdump:
        print(
            "fbgemm_cuda_parts.py: no cuobjdump here (scripts/setup.sh installs it): the slimmed libraries are unchecked"
        )
    return report


def check_listing(listed: list[str], cubins_kept: int, archs: set[int], name: str) -> None:
    """cuobjdump's cubins of a slimmed library must be the ones kept: as many, each of a kept
    architecture (sm_90 or its arch-specific sm_90a)."""
    foreign = [a for a in listed if int(a[3:].rstrip("abcdefghijklmnopqrstuvwxyz")) not in archs]
    if len(listed) != cubins_kept or foreign:
        raise FatbinError(
            f"{name}: cuobjdump lists {len(listed)} cubin(s) ({', '.join(sorted(set(listed))) or 'none'}) after "
            f"slimming, expected the {cubins_kept} kept for sm_{', sm_'.join(map(str, sorted(archs)))}"
        )


def pack(args: argparse.Namespace) -> None:
    try:
        archs = {int(a) for a in args.arch.split(",")}
    except ValueError:
        raise SystemExit(
            f"fbgemm_cuda_parts.py: --arch must be architectures like 90 or 80,90, got {args.arch!r}"
        ) from None
    if args.part_mib <= 0:
        raise SystemExit(f"fbgemm_cuda_parts.py: --part-mib must be > 0, got {args.part_mib}")
    wheel = args.wheel or download(args.version, args.python_version, args.cache)
    with tempfile.TemporaryDirectory(prefix="fbgemm_cuda_") as tmp:
        tree = os.path.join(tmp, "tree")
        libraries = slim_tree(wheel, tree, archs)
        archive = os.path.join(tmp, "fbgemm_cuda.tar.xz")
        with tarfile.open(archive, "w:xz", preset=args.preset) as tar:
            for name in sorted(os.listdir(tree)):
                tar.add(os.path.join(tree, name), arcname=name)
        if os.path.isdir(args.out) and os.listdir(args.out):
            if not os.path.isfile(os.path.join(args.out, MANIFEST)):  # never empty a folder this did not make
                raise SystemExit(
                    f"fbgemm_cuda_parts.py: --out {args.out} holds files but no {MANIFEST}: not emptying it"
                )
            shutil.rmtree(args.out)
        os.makedirs(args.out, exist_ok=True)
        part_bytes, parts, whole = max(1, int(args.part_mib * 2**20)), [], hashlib.sha256()
        with open(archive, "rb") as f:
            for block in iter(lambda: f.read(part_bytes), b""):
                name = f"part-{len(parts):02d}"
                with open(os.path.join(args.out, name), "wb") as out:
                    out.write(block)
                parts.append({"name": name, "bytes": len(block), "sha256": hashlib.sha256(block).hexdigest()})
                whole.update(block)
    manifest = {
        "wheel": os.path.basename(wheel),
        "wheel_sha256": sha256(wheel),
        "archs": sorted(archs),
        "archive_sha256": whole.hexdigest(),
        "parts": parts,
        "libraries": libraries,
    }
    with open(os.path.join(args.out, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)
    dropped = sum(s["dropped_bytes"] for s in libraries.values())
    print(
        f"{manifest['wheel']}: {dropped / 2**30:.2f} GiB of other architectures' code dropped; "
        f"{len(parts)} parts, {sum(p['bytes'] for p in parts) / 2**20:.1f} MiB in {args.out}/"
    )
    for p in parts:
        print(f"  a device call carries {args.out}/{MANIFEST} and {args.out}/{p['name']}")


def unpack(args: argparse.Namespace) -> int:
    path = os.path.join(args.dir, MANIFEST)
    if not os.path.isfile(path):
        print(f"fbgemm_cuda_parts.py: no {path} (make the parts with `pack` and carry them)", file=sys.stderr)
        return MISSING
    with open(path) as f:
        manifest = json.load(f)
    marker = os.path.join(args.target, MARKER)
    if os.path.isfile(marker) and pathlib.Path(marker).read_text() == manifest["archive_sha256"]:
        print(f"fbgemm_cuda_parts.py: {manifest['wheel']} already unpacked in {args.target}")
        return 0
    problems = []
    for p in manifest["parts"]:
        part = os.path.join(args.dir, p["name"])
        if not os.path.isfile(part):
            problems.append(f"{p['name']} is not here")
        elif os.path.getsize(part) != p["bytes"] or sha256(part) != p["sha256"]:
            problems.append(f"{p['name']} is damaged ({os.path.getsize(part)} bytes, expected {p['bytes']})")
    if problems:
        n = len(manifest["parts"])
        print(
            f"fbgemm_cuda_parts.py: {manifest['wheel']} cannot be unpacked: {'; '.join(problems)} "
            f"({n} parts in all; a call carries {args.dir}/{MANIFEST} and a part, and the machine keeps the "
            "parts of earlier calls only while it stays warm)",
            file=sys.stderr,
        )
        return MISSING
    staging = args.target.rstrip("/") + ".partial"
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    archive = os.path.join(staging, "fbgemm_cuda.tar.xz")
    with open(archive, "wb") as joined:
        for p in manifest["parts"]:
            with open(os.path.join(args.dir, p["name"]), "rb") as part:
                shutil.copyfileobj(part, joined, 1 << 20)
    with tarfile.open(archive) as tar:
        tar.extractall(staging, filter="data")
    os.remove(archive)
    shutil.rmtree(args.target, ignore_errors=True)
    os.rename(staging, args.target)
    with open(marker, "w") as f:
        f.write(manifest["archive_sha256"])
    print(
        f"fbgemm_cuda_parts.py: {manifest['wheel']} (code for sm_{', sm_'.join(map(str, manifest['archs']))}) "
        f"unpacked in {args.target}"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pack", help="download, slim and cut the wheel into parts (here)")
    p.add_argument("--wheel", help="a downloaded fbgemm-gpu CUDA wheel (default: pip download it)")
    p.add_argument("--version", default="1.6.0", help="fbgemm-gpu's version: 1.6.0 pairs with torch 2.11")
    p.add_argument("--python-version", default="3.12", help="the GPU machine's Python")
    p.add_argument("--arch", default="90", help="architectures kept, comma-separated (90: H100, H200)")
    p.add_argument("--part-mib", type=float, default=40, help="largest part, MiB (a call carries 64 MiB in all)")
    p.add_argument("--preset", type=int, default=6, help="xz preset")
    p.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "fbgemm_cuda_wheel"))
    p.add_argument("--out", default=".fbgemm")
    u = sub.add_parser("unpack", help="check the parts and unpack them (on the GPU machine)")
    u.add_argument("--dir", default=".fbgemm")
    u.add_argument("--target", default="/tmp/fbgemm_cuda")
    args = parser.parse_args(argv)
    if args.command == "pack":
        pack(args)
        return 0
    return unpack(args)


if __name__ == "__main__":
    sys.exit(main())
