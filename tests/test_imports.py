"""Issue 39: the package's modules import only downward, with no circle, lazy imports included.

The graph is read from the source (ast), not by importing: every `import` statement anywhere in a
module counts, at the top or inside a function (a lazy import that reaches back up is a circle all
the same, only later). An edge goes to the module an import names: `import jaxgpt.a.b` and
`from jaxgpt.a import b` (b a submodule) name jaxgpt.a.b; `from jaxgpt.a import name` (name a
definition) names jaxgpt.a's __init__.py; relative imports are resolved against the importing
module's package. `importlib.import_module("jaxgpt....")` counts as an import of what it names, and
one whose name is built at run time from a constant prefix (data/__init__.py's lazy names) as an
import of every module under that prefix. The implicit import of a module's parent packages is left
out: every module would otherwise sit in a circle with any __init__.py that imports a sibling.
"""

from __future__ import annotations

import ast
from pathlib import Path

from helpers import REPO

def module_name(path: Path, root: Path = REPO) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_of(path: Path, root: Path) -> str:
    name = module_name(path, root)
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def _import_module_target(node: ast.Call) -> ast.expr | None:
    f = node.func
    named = (isinstance(f, ast.Attribute) and f.attr == "import_module") or (isinstance(f, ast.Name) and
                                                                             f.id == "import_module")
    return node.args[0] if named and node.args else None


def imports_of(path: Path, modules: set[str], root: Path = REPO) -> set[str]:
    """The package modules one file imports, anywhere in it (root: the folder that holds the package)."""
    found: set[str] = set()

    def add(name: str) -> None:
        while name and name not in modules:  # `import jaxgpt.a.b.name` -> the deepest module
            name = name.rpartition(".")[0]
        if name:
            found.add(name)

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package_of(path, root).split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                add(sub if sub in modules else base)
        elif isinstance(node, ast.Call) and (target := _import_module_target(node)) is not None:
            if isinstance(target, ast.Constant) and isinstance(target.value, str):
                add(target.value)
            elif isinstance(target, ast.JoinedStr) and target.values and isinstance(target.values[0], ast.Constant):
                prefix = str(target.values[0].value)
                found.update(m for m in modules if m.startswith(prefix))
    found.discard(module_name(path, root))
    return found


def import_graph(root: Path = REPO, package: str = "jaxgpt") -> dict[str, set[str]]:
    paths = sorted((root / package).rglob("*.py"))
    modules = {module_name(p, root) for p in paths}
    return {module_name(p, root): imports_of(p, modules, root) for p in paths}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan), each as a sorted list."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:  # the package's graph is a few dozen modules deep at most
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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_package_has_no_import_circle():
    graph = import_graph()
    assert len(graph) > 50 and "jaxgpt.config" in graph["jaxgpt.train"]  # the reader sees the package
    assert cycles(graph) == [], "modules that import each other (possibly inside a function):\n" + "\n".join(
        " <-> ".join(c) for c in cycles(graph))


def test_the_reader_sees_every_kind_of_import(tmp_path):
    """The checker itself: each import form gives its edge, and a circle closed only by a lazy,
    relative or importlib import is found."""
    pkg = tmp_path / "jaxgpt"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "a.py": "def f():\n    from jaxgpt import b\n",
        "b.py": "import jaxgpt.c\n",
        "c.py": "from .sub.d import thing\n",
        "sub/__init__.py": "import importlib\ndef __getattr__(n):\n    return importlib.import_module(f'jaxgpt.sub.{n}')\n",
        "sub/d.py": "from ..a import f\nthing = 1\n",
        "e.py": "from jaxgpt.sub import anything\n",
        "f.py": "import importlib\nimportlib.import_module('jaxgpt.e')\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    graph = import_graph(tmp_path)
    assert graph == {"jaxgpt": set(), "jaxgpt.a": {"jaxgpt.b"}, "jaxgpt.b": {"jaxgpt.c"},
                     "jaxgpt.c": {"jaxgpt.sub.d"}, "jaxgpt.sub": {"jaxgpt.sub.d"}, "jaxgpt.sub.d": {"jaxgpt.a"},
                     "jaxgpt.e": {"jaxgpt.sub"}, "jaxgpt.f": {"jaxgpt.e"}}
    assert cycles(graph) == [["jaxgpt.a", "jaxgpt.b", "jaxgpt.c", "jaxgpt.sub.d"]]

