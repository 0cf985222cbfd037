"""The walk of one training id, counted by running it: the torchrec_ext files whose code runs in one
training step of a ``DynamicEmbeddingBagCollection`` (forward, ``loss.backward()`` with the fused
optimizer), and the ``csrc/`` files behind the C++ ops it calls.

    PYTHONPATH=$PWD python benchmarks/count_walk.py            # the table of files and hops
    PYTHONPATH=$PWD python benchmarks/count_walk.py --json     # the same, machine-readable

The counting rule (``benchmarks/results/house_counts.md`` states it too):

- the step: a CPU module of two tables (one SUM, one MEAN; Adagrad, the defaults otherwise: batched
  upserts, pending rows), warmed by one step, then one traced step whose batch holds ids seen in
  the warm-up and new ones, so every branch an id can take (found, inserted, pending) runs;
- Python files: every ``torchrec_ext`` file with a function that runs during the traced step
  (``sys.setprofile`` call events; the module's ``forward`` call included);
- C++ files: for each ``torch.ops.torchrec_ext.<op>`` called, the ``csrc/*.cpp`` file whose
  ``TORCH_LIBRARY_IMPL(torchrec_ext, CPU, m)`` block has ``m.impl("<op>", ...)``. The schema file
  (``csrc/ops.cpp``) and the project headers those files include (definitions, not steps) are
  listed apart and not counted;
- the walk's files are the ones above less the *leaves*: files every layer reads for a constant,
  a check or a host read and that call nothing else of the package (``LEAVES`` below:
  vocabulary, device_sync, hashing); they are listed apart, and the total with them is printed too;
- the spine (a second, narrower figure): the files on the Python stack at each op call, from the
  module's forward (or autograd's backward) down to the op, and the op's csrc file: the files a
  reader follows from the module to every kernel, without the side calls that return before one
  (checks, counters, layout reads, the optimizer's settings);
- a hop: a distinct (caller file, callee file) pair, the caller being the nearest ``torchrec_ext``
  frame (or, for an op, the Python file that called it); a hop up a layer goes from a lower layer
  to a higher one (``tests/test_import_graph.py``'s order; within ``modules/`` no order).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "torchrec_ext"
CSRC = ROOT / "csrc"
# Read by every layer for a constant, a check or a host read; they call nothing else of the package.
LEAVES = ("torchrec_ext/vocabulary.py", "torchrec_ext/device_sync.py", "torchrec_ext/hashing.py")


def cpu_registrations() -> dict[str, str]:
    """op name -> the csrc file whose CPU ``TORCH_LIBRARY_IMPL`` block registers it."""
    out: dict[str, str] = {}
    for path in sorted(CSRC.glob("*.cpp")):
        text = path.read_text()
        for block in re.finditer(
            r"TORCH_LIBRARY_IMPL\(\s*torchrec_ext\s*,\s*CPU\s*,\s*m\s*\)\s*\{(.*?)\n?\}", text, re.S
        ):
            for op in re.findall(r'm\.impl\(\s*"(\w+)"', block.group(1)):
                out[op] = str(path.relative_to(ROOT))
    return out


def included_headers(cpp: str) -> list[str]:
    """The project headers ``cpp`` includes, directly or through another header."""
    seen: list[str] = []
    todo = [ROOT / cpp]
    while todo:
        for name in re.findall(r'#include\s+"([^"]+)"', todo.pop().read_text()):
            header = CSRC / name
            rel = str(header.relative_to(ROOT))
            if header.exists() and rel not in seen:
                seen.append(rel)
                todo.append(header)
    return seen


def layer_of(path: str) -> int | None:
    """The layer of a package file, by ``tests/test_import_graph.py``'s order (None: C++ kernels)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from test_import_graph import LAYERS

    if not path.endswith(".py"):
        return 1  # csrc: the kernels' layer
    name = path[:-3].replace("/", ".").removesuffix(".__init__")
    for i, prefixes in enumerate(LAYERS):
        if any(name == p or name.startswith(p + ".") for p in prefixes):
            return i
    return None


def build_step():
    """The module, a warm-up batch and the traced batch."""
    from torchrec import KeyedJaggedTensor

    from torchrec_ext.modules import DynamicEmbeddingBagCollection, DynamicEmbeddingBagConfig

    torch.manual_seed(0)
    tables = [
        DynamicEmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=64, feature_names=["f0"]),
        DynamicEmbeddingBagConfig(
            name="t1",
            embedding_dim=4,
            num_embeddings=64,
            feature_names=["f1"],
            pooling=__import__("torchrec").PoolingType.MEAN,
        ),
    ]
    module = DynamicEmbeddingBagCollection(tables, optimizer="adagrad", optimizer_kwargs={"lr": 0.1})

    def batch(ids0: list[int], ids1: list[int]) -> KeyedJaggedTensor:
        half0, half1 = len(ids0) // 2, len(ids1) // 2
        return KeyedJaggedTensor(
            keys=["f0", "f1"],
            values=torch.tensor(ids0 + ids1, dtype=torch.int64),
            lengths=torch.tensor([half0, len(ids0) - half0, half1, len(ids1) - half1], dtype=torch.int64),
        )

    warm = batch([11, 12, 13, 11], [21, 22])
    traced = batch([11, 99, 12, 98], [21, 97, 97])  # seen ids and new ones (one new id twice)
    return module, warm, traced


def step(module, kjt) -> None:
    module(kjt).values().sum().backward()


def trace(module, kjt) -> tuple[dict[str, set[str]], set[tuple[str, str]], list[str], set[str]]:
    """Files run (file -> functions), hops (caller file, callee file), the ops called, in order,
    and the spine (files on the stack at an op call, and the ops' csrc files)."""
    registrations = cpu_registrations()
    functions: dict[str, set[str]] = defaultdict(set)
    hops: set[tuple[str, str]] = set()
    ops: list[str] = []
    spine: set[str] = set()
    package = str(PACKAGE)

    def nearest_package_frame(frame):
        while frame is not None and not frame.f_code.co_filename.startswith(package):
            frame = frame.f_back
        return frame

    def rel(filename: str) -> str:
        return str(Path(filename).relative_to(ROOT))

    def profile(frame, event, arg):
        if event != "call":
            return
        code = frame.f_code
        if code.co_filename.startswith(package):
            callee = rel(code.co_filename)
            functions[callee].add(getattr(code, "co_qualname", code.co_name))  # (co_qualname: Python 3.11+)
            caller = nearest_package_frame(frame.f_back)
            if caller is not None and rel(caller.f_code.co_filename) != callee:
                hops.add((rel(caller.f_code.co_filename), callee))
        elif code.co_name == "__call__" and code.co_filename.endswith("torch/_ops.py"):
            op = frame.f_locals.get("self")
            name = getattr(op, "_qualified_op_name", None) or getattr(getattr(op, "_schema", None), "name", "")
            if not name.startswith("torchrec_ext::"):
                return
            short = name.split("::", 1)[1].split(".")[0]
            if ops and ops[-1] == short:  # the packet's __call__, then its overload's
                return
            ops.append(short)
            kernel = registrations.get(short)
            caller = nearest_package_frame(frame.f_back)
            on_stack = caller
            while on_stack is not None:
                spine.add(rel(on_stack.f_code.co_filename))
                on_stack = nearest_package_frame(on_stack.f_back)
            if kernel is not None:
                spine.add(kernel)
                functions[kernel].add(short)
                if caller is not None:
                    hops.add((rel(caller.f_code.co_filename), kernel))

    sys.setprofile(profile)
    try:
        step(module, kjt)
    finally:
        sys.setprofile(None)
    return functions, hops, ops, spine


def count() -> dict[str, object]:
    module, warm, traced = build_step()
    step(module, warm)
    functions, hops, ops, spine = trace(module, traced)
    files = sorted(functions)
    kernels = [f for f in files if f.startswith("csrc/")]
    headers: list[str] = []
    for cpp in kernels:
        headers += [h for h in included_headers(cpp) if h not in headers]
    leaves = [f for f in files if f in LEAVES]
    walk = [f for f in files if f not in LEAVES]
    up = sorted(
        (a, b) for a, b in hops if (la := layer_of(a)) is not None and (lb := layer_of(b)) is not None and lb > la
    )
    walk_hops = sorted((a, b) for a, b in hops if a not in LEAVES and b not in LEAVES)
    return {
        "walk_files": walk,
        "leaf_files": leaves,
        "spine_files": sorted(spine),
        "schema_and_headers": ["csrc/ops.cpp"] + headers,
        "ops": ops,
        "hops": walk_hops,
        "hops_with_leaves": sorted(hops),
        "hops_up_a_layer": up,
        "functions": {f: sorted(functions[f]) for f in files},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the counts as JSON")
    args = parser.parse_args()
    torch.set_num_threads(1)
    result = count()
    if args.json:
        print(json.dumps(result, indent=1))
        return
    walk, leaves = result["walk_files"], result["leaf_files"]
    print(f"files per walk: {len(walk)} (with the leaves: {len(walk) + len(leaves)})")
    for f in walk:
        names = result["functions"][f]
        print(f"  {f}: {len(names)} functions: {', '.join(names[:6])}{' ...' if len(names) > 6 else ''}")
    print(f"leaves (not counted): {', '.join(leaves) or 'none'}")
    print(f"spine (files on the stack at an op call, and the ops' csrc files): {len(result['spine_files'])}")
    print(f"  {', '.join(result['spine_files'])}")
    print(f"schema and headers (definitions, not counted): {', '.join(result['schema_and_headers'])}")
    print(f"ops called: {', '.join(result['ops'])}")
    print(f"cross-file hops: {len(result['hops'])} (with the leaves: {len(result['hops_with_leaves'])})")
    for a, b in result["hops"]:
        print(f"  {a} -> {b}")
    print(f"hops up a layer: {len(result['hops_up_a_layer'])}")
    for a, b in result["hops_up_a_layer"]:
        print(f"  {a} -> {b}")


if __name__ == "__main__":
    main()
