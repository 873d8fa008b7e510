"""No module of the project imports another that imports it back, directly or through others.

Every ``.py`` under the project's packages is parsed with ``ast`` (nothing is imported or run),
its imports are read wherever they appear (module level or inside a function: a function-level
import only delays a circle, it does not remove it), and the module graph must be acyclic. A
package's ``__init__`` counts as the module named by the package; importing ``a.b`` is an edge to
``a.b`` only (Python runs ``a/__init__`` first, but that is not a dependency of ``a.b``'s code).

Read the same way: scoring imports only ``common``, ``scoring`` and the names ``training`` exports
(``training.__all__``), never ``pipelines`` or a module inside ``training``."""

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


# --- what scoring may import ----------------------------------------------------------------------
# Scoring stands on common and on training's public API only (docs/contributing.md, layout): not on pipelines
# (data reaches it through common.sources, the row rules through common.rows) and not on a
# training module, whose insides another stage must be free to change.

def _public_training_names() -> set[str]:
    import training  # cheap: the package's names are resolved lazily

    return set(training.__all__)


def _scoring_reaches_past(module: str, path: str, modules: dict[str, str]) -> list[str]:
    """What ``module`` (a scoring module) imports beyond common, training's public names and scoring."""
    found = sorted(t for t in _imported(module, path, modules)
                   if t.split(".")[0] not in ("common", "scoring", "training") or t.startswith("training."))
    public = _public_training_names()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.ImportFrom) and node.module == "training" and not node.level:
            found += [f"training.{a.name}" for a in node.names
                      if a.name not in public and f"training.{a.name}" not in modules]
    return found


def test_the_scoring_rule_finds_pipelines_and_training_internals_in_a_function(tmp_path):
    modules = _modules()
    snippet = tmp_path / "snippet.py"
    snippet.write_text("from training import load_model\n"
                       "def f():\n"
                       "    from pipelines.preprocess import row_columns\n"
                       "    from training.export import WEIGHTS\n"
                       "    from training import models, train\n"
                       "    import shardtrain.cli\n")
    assert _scoring_reaches_past("scoring.snippet", str(snippet), modules) == [
        "pipelines.preprocess", "shardtrain.cli", "training.export", "training.models"]


def test_scoring_imports_only_common_and_trainings_public_api():
    modules = _modules()
    assert {"scoring.predict", "scoring.job", "scoring.config"} <= set(modules)
    reached = {m: _scoring_reaches_past(m, p, modules) for m, p in modules.items() if m.split(".")[0] == "scoring"}
    assert not any(reached.values()), {m: r for m, r in reached.items() if r}


# --- what the sweep may import ----------------------------------------------------------------------
# The sweep (shardtrain/sweep*.py) drives training as a user's program would: through training's
# public API (its exported names, training.api, training.config, and the task registry that names
# the metrics a run reports), never a module inside it, whose insides (the loop, launchers,
# recorder) must stay free to change.

SWEEP_MAY_IMPORT = ("training.api", "training.config", "training.tasks")


def _sweep_reaches_past(module: str, path: str, modules: dict[str, str]) -> list[str]:
    """What ``module`` (a sweep module) imports of training beyond its public API."""
    found = sorted(t for t in _imported(module, path, modules)
                   if t.startswith("training.") and t not in SWEEP_MAY_IMPORT)
    public = _public_training_names()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.ImportFrom) and node.module == "training" and not node.level:
            found += [f"training.{a.name}" for a in node.names
                      if a.name not in public and f"training.{a.name}" not in modules]
    return found


def test_the_sweep_rule_finds_training_internals_in_a_function(tmp_path):
    modules = _modules()
    snippet = tmp_path / "snippet.py"
    snippet.write_text("from training.api import train\n"
                       "from training.config import TrainConfig\n"
                       "def f():\n"
                       "    from training.loop import Hooks\n"
                       "    from training.launchers.capacity import task_slots\n")
    assert _sweep_reaches_past("shardtrain.snippet", str(snippet), modules) == [
        "training.launchers.capacity", "training.loop"]


def test_the_sweep_drives_training_through_its_public_api_only():
    modules = _modules()
    sweep = [m for m in modules if m.startswith("shardtrain.sweep")]
    assert "shardtrain.sweep" in sweep
    reached = {m: _sweep_reaches_past(m, modules[m], modules) for m in sweep}
    assert not any(reached.values()), {m: r for m, r in reached.items() if r}
