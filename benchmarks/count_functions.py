"""The longest functions of the package and of ``csrc/``, measured, not traced by hand.

    PYTHONPATH=$PWD python benchmarks/count_functions.py            # the 12 longest overall
    PYTHONPATH=$PWD python benchmarks/count_functions.py --top 20 --under torchrec_ext/modules

A function's length is its lines from its first line (``def``, or the C++ signature's first line) to
its last, blank lines and comments included:

- Python (``torchrec_ext/**/*.py``, the Triton kernels included): the AST's ``lineno`` ..
  ``end_lineno`` of each ``def`` (decorators not counted); a nested ``def`` counts apart and
  inside its parent;
- C++ / CUDA (``csrc/*.cpp``, ``*.cu``, ``*.h``): each ``{`` at namespace level whose statement
  is a signature (has a ``(``, is not a class, struct, enum, namespace or a brace initialiser),
  to its matching ``}``; comments, strings and character literals are skipped when matching; the
  registration macros' bodies (``TORCH_LIBRARY``, ``TORCH_LIBRARY_IMPL``) are lists, not counted.
"""

from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def python_functions(path: Path) -> list[tuple[int, str, str]]:
    """(lines, file, qualified name) of each function of ``path``."""
    out: list[tuple[int, str, str]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                out.append((child.end_lineno - child.lineno + 1, str(path.relative_to(ROOT)), name))
                visit(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(path.read_text(), str(path)), "")
    return out


_CODE = re.compile(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'', re.S)
_ATTRIBUTE = re.compile(r"__attribute__\s*\(\(.*?\)\)|\[\[.*?\]\]", re.S)
# Registration macros (TORCH_LIBRARY, TORCH_LIBRARY_IMPL, PYBIND11_MODULE) hold lists, not steps.
_REGISTRATION = ("TORCH_LIBRARY", "TORCH_LIBRARY_IMPL", "TORCH_LIBRARY_FRAGMENT", "PYBIND11_MODULE")
_NOT_FUNCTION = re.compile(r"^\s*(?:template\s*<.*>\s*)?(?:class|struct|union|enum|namespace|extern)\b|=\s*$", re.S)


def cpp_functions(path: Path) -> list[tuple[int, str, str]]:
    """(lines, file, name) of each function defined at namespace level in ``path``."""
    text = path.read_text()
    # Comments and literals blanked (newlines kept, so line numbers hold).
    code = _CODE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)
    out: list[tuple[int, str, str]] = []
    stack: list[str] = []  # per open brace: "scope" (namespace, extern "C"), "function" or "other"
    statement_start = 0
    function_start = 0
    name = ""
    for i, ch in enumerate(code):
        if ch in ";":
            statement_start = i + 1
        elif ch == "{":
            statement = code[statement_start:i]
            at_scope = all(kind == "scope" for kind in stack)
            head = statement.strip()
            if at_scope and re.match(r"^\s*(namespace|extern)\b", statement):
                stack.append("scope")
            elif at_scope and "(" in head and not _NOT_FUNCTION.search(head) and not head.startswith("#"):
                stack.append("function")
                # The signature's first line: after any preprocessor lines before it.
                lines = statement.split("\n")
                skip = 0
                while skip < len(lines) and (not lines[skip].strip() or lines[skip].strip().startswith("#")):
                    skip += 1
                function_start = code.count("\n", 0, statement_start) + skip + 1
                bare = _ATTRIBUTE.sub(" ", head)
                before_paren = bare[: bare.index("(")].split() if "(" in bare else []
                name = before_paren[-1] if before_paren else "?"
            else:
                stack.append("other")
            statement_start = i + 1
        elif ch == "}":
            kind = stack.pop() if stack else "other"
            if kind == "function":
                end = code.count("\n", 0, i) + 1
                if name not in _REGISTRATION:
                    out.append((end - function_start + 1, str(path.relative_to(ROOT)), name.lstrip("*&")))
            statement_start = i + 1
        elif ch == "#" and (i == 0 or code[i - 1] == "\n"):
            # A preprocessor line ends no statement but is not part of the next one's head either.
            statement_start = code.find("\n", i) + 1 if code.find("\n", i) >= 0 else len(code)
    return out


def all_functions(under: str | None = None) -> list[tuple[int, str, str]]:
    out: list[tuple[int, str, str]] = []
    for path in sorted((ROOT / "torchrec_ext").rglob("*.py")):
        out += python_functions(path)
    for pattern in ("*.cpp", "*.cu", "*.h", "*.cuh"):
        for path in sorted((ROOT / "csrc").glob(pattern)):
            out += cpp_functions(path)
    if under:
        out = [f for f in out if f[1].startswith(under)]
    return sorted(out, key=lambda f: (-f[0], f[1], f[2]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--under", default=None, help="only files under this path (e.g. csrc, torchrec_ext/modules)")
    parser.add_argument("--name", default=None, help="only functions whose name contains this")
    args = parser.parse_args()
    functions = all_functions(args.under)
    if args.name:
        functions = [f for f in functions if args.name in f[2]]
    for lines, file, name in functions[: args.top]:
        print(f"{lines:5d}  {file}  {name}")


if __name__ == "__main__":
    main()
