"""No module of the project imports another that imports it back, directly or through others.

Every ``.py`` under the project's packages is parsed with ``ast`` (nothing is imported or run),
its imports are read wherever they appear (module level or inside a function: a function-level
import only delays a circle, it does not remove it), and the module graph must be acyclic. A
package's ``__init__`` counts as the module named by the package; importing ``a.b`` is an edge to
``a.b`` only (Python runs ``a/__init__`` first, but that is not a dependency of ``a.b``'s code)."""

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("common", "pipelines", "training", "scoring", "shardtrain")


def _modules() -> dict[str, str]:
    """Module name -> file, for every .py of the project's packages."""
    found = {}
    for package in PACKAGES:
        for folder, _, files in os.walk(os.path.join(ROOT, package)):
            for name in files:
                if not name.endswith(".py"):
                    continue
                parts = os.path.relpath(os.path.join(folder, name), ROOT)[:-3].split(os.sep)
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                found[".".join(parts)] = os.path.join(folder, name)
    return found


def _imported(module: str, path: str, modules: dict[str, str]) -> set[str]:
    """The project modules ``module`` imports anywhere in its file."""
    is_package = path.endswith("__init__.py")
    package = module if is_package else module.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, one level up per extra dot
                anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                # ``from a import b``: the submodule a.b when there is one, else a name in a.
                targets.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return {t for t in targets if t in modules and t != module}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle (as a path that ends where it starts), or None."""
    state: dict[str, str] = {}  # "open" while on the current path, "done" once fully explored

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt, path + [nxt])
                if found:
                    return found
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start, [start])
            if found:
                return found
    return None


def test_the_graph_reader_finds_a_circle_through_a_function_level_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycle(graph) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_every_project_module_is_read():
    modules = _modules()
    graph = {m: _imported(m, p, modules) for m, p in modules.items()}
    assert {"common.errors", "training.api", "scoring", "shardtrain.cli"} <= set(modules)
    assert "common.errors" in graph["training.api"]  # a module-level import is an edge


def test_no_module_imports_one_that_imports_it_back():
    modules = _modules()
    graph = {m: _imported(m, p, modules) for m, p in modules.items()}
    circle = _cycle(graph)
    assert circle is None, "import circle: " + " -> ".join(circle)
