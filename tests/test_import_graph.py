"""The package's import graph: no cycle, no upward import between layers, and production code never
imports the test oracle ``torchrec_ext.reference``.

Every ``import`` / ``from ... import`` in ``torchrec_ext/**/*.py`` counts, at module level or inside a
function (a lazy import is still a dependency). The layers, lowest first, are the ones
CONTRIBUTING.md and docs/architecture.md name; a module may import its own layer or a lower one.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parents[1] / "torchrec_ext"

# Lowest first. A module belongs to the first entry that is it or one of its packages.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("torchrec_ext.vocabulary", "torchrec_ext.hashing", "torchrec_ext.device_sync", "torchrec_ext.device_gate"),
    ("torchrec_ext._C", "torchrec_ext.csrc_kernels", "torchrec_ext.torch_kernels", "torchrec_ext.triton_kernels"),
    ("torchrec_ext.ops",),
    ("torchrec_ext.table",),
    ("torchrec_ext.modules",),
    ("torchrec_ext.distributed",),
    ("torchrec_ext.pipeline",),
    ("torchrec_ext.inference",),
    ("torchrec_ext.data",),
    ("torchrec_ext.train",),
    ("torchrec_ext.serve",),
    ("torchrec_ext",),  # the package's __init__: the front door re-exports from every layer
)
ORACLE = "torchrec_ext.reference"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE_ROOT.rglob("*.py"))}


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The package module ``name`` refers to: itself, else its longest prefix that is a module."""
    while name:
        if name in modules or name == "torchrec_ext._C":
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules ``name`` imports anywhere in its file (``from pkg import sub`` names the
    submodule when ``sub`` is one)."""
    is_package = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name if is_package else name.rpartition(".")[0]
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                source = f"{base}.{node.module}" if node.module else base
            else:
                source = node.module or ""
            targets = [f"{source}.{alias.name}" for alias in node.names]
        for target in targets:
            if not target.startswith("torchrec_ext"):
                continue
            resolved = _resolve(target, modules)
            if resolved is not None and resolved != name:
                out.add(resolved)
    return out


def import_graph() -> dict[str, set[str]]:
    modules = package_modules()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def layer_of(name: str) -> int:
    for index, prefixes in enumerate(LAYERS):
        if any(name == p or name.startswith(p + ".") for p in prefixes):
            return index
    raise AssertionError(f"{name} belongs to no layer: add it to LAYERS in {__file__}")


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return components


def test_the_walk_sees_the_imports_it_must_judge():
    """The walker itself: it finds module-level, function-level and relative imports, and maps
    ``from pkg import sub`` to the submodule (else the checks below would pass vacuously)."""
    graph = import_graph()
    assert "torchrec_ext.ops" in graph["torchrec_ext.table"]  # from torchrec_ext import ops
    assert "torchrec_ext.triton_kernels.embedding_lookup" in graph["torchrec_ext.triton_kernels.embedding_update"]
    assert "torchrec_ext.triton_kernels" in graph["torchrec_ext.ops"]  # inside a function
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle():
    graph = {name: targets for name, targets in import_graph().items() if not name.startswith(ORACLE)}
    assert find_cycles(graph) == []


def test_no_upward_import_between_layers():
    upward = []
    for name, targets in import_graph().items():
        if name.startswith(ORACLE):
            continue
        for target in targets:
            if not target.startswith(ORACLE) and layer_of(target) > layer_of(name):
                upward.append(f"{name} (layer {layer_of(name)}) imports {target} (layer {layer_of(target)})")
    assert upward == []


def test_production_never_imports_the_reference():
    offenders = sorted(
        f"{name} imports {target}"
        for name, targets in import_graph().items()
        if not name.startswith(ORACLE)
        for target in targets
        if target.startswith(ORACLE)
    )
    assert offenders == []


def test_the_reference_imports_no_production_code():
    """The oracle is independent: it keeps its own copies of the constants (test_vocabulary.py
    checks they agree) rather than importing the code it judges."""
    offenders = sorted(
        f"{name} imports {target}"
        for name, targets in import_graph().items()
        if name.startswith(ORACLE)
        for target in targets
        if not target.startswith(ORACLE)
    )
    assert offenders == []
