"""The setup's bytecode store (.ci/bytecode.py): a venv built from the same sources as an earlier one
gets that one's .pyc files as hard links and compiles nothing; a .pyc that does not match its source
as it is (another file with the same name) is never linked, and the module is compiled for the
source it has; Python imports what was linked, from where it is linked."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(os.path.dirname(HERE), ".ci", "bytecode.py")


def _bytecode(site, store, *flags):
    subprocess.run([sys.executable, SCRIPT, str(site), str(store), *flags], check=True)


def _site_linked_from(first, site):
    """A site-packages whose sources are hard links to ``first``'s (as uv makes them from its cache)."""
    for folder, dirs, names in os.walk(first):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in names:
            source = os.path.join(folder, name)
            target = os.path.join(site, os.path.relpath(source, first))
            os.makedirs(os.path.dirname(target), exist_ok=True)
            os.link(source, target)


def _pyc(site, rel):
    return importlib.util.cache_from_source(os.path.join(site, rel))


def test_a_second_venv_links_the_first_ones_bytecode_and_a_changed_source_is_compiled_afresh(tmp_path):
    first, store = tmp_path / "first", tmp_path / "store" / "pinned-abc"
    (first / "pkg").mkdir(parents=True)
    (first / "pkg" / "__init__.py").write_text("WHERE = 'pkg'\n")
    (first / "pkg" / "same.py").write_text("def f():\n    return 1\n")
    (first / "pkg" / "edited.py").write_text("VALUE = 'old'\n")
    _bytecode(first, store, "--save")  # the first build: compiles all, then keeps it
    for rel in ("pkg/__init__.py", "pkg/same.py", "pkg/edited.py"):
        assert os.path.exists(_pyc(first, rel)), rel
    assert os.path.samefile(_pyc(first, "pkg/same.py"), os.path.join(store, os.path.relpath(_pyc(first, "pkg/same.py"), first)))

    second = tmp_path / "second"
    _site_linked_from(first, second)
    # Another module under the same name, as a newer build of a package would have it: not linked.
    os.unlink(second / "pkg" / "edited.py")
    (second / "pkg" / "edited.py").write_text("VALUE = 'new, and longer'\n")
    _bytecode(second, store)
    assert os.path.samefile(_pyc(second, "pkg/same.py"), _pyc(first, "pkg/same.py"))
    assert os.path.samefile(_pyc(second, "pkg/__init__.py"), _pyc(first, "pkg/__init__.py"))
    assert not os.path.samefile(_pyc(second, "pkg/edited.py"), _pyc(first, "pkg/edited.py"))

    # The interpreter takes the linked bytecode (no write allowed: it must not need one), names the
    # second site's file in the code, and imports the edited module's own content.
    out = subprocess.run([sys.executable, "-B", "-c",
                          "import sys; sys.path.insert(0, sys.argv[1]); import pkg.same, pkg.edited; "
                          "print(pkg.same.f.__code__.co_filename); print(pkg.edited.VALUE); "
                          "print(type(pkg.same.__spec__.loader).__name__, pkg.same.__cached__)", str(second)],
                         check=True, capture_output=True, text=True, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    filename, value, cached = out.stdout.splitlines()
    assert filename == str(second / "pkg" / "same.py")
    assert value == "new, and longer"
    assert cached.split()[1] == _pyc(second, "pkg/same.py")

    # A store is never half written or replaced: a second save leaves it as it was.
    before = sorted(os.listdir(store / "pkg" / "__pycache__"))
    _bytecode(second, store, "--save")
    assert sorted(os.listdir(store / "pkg" / "__pycache__")) == before
    assert not [p for p in os.listdir(store.parent) if ".partial-" in p]
    shutil.rmtree(first)  # the store holds its own links: the second venv keeps working
    subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); import pkg.same", str(second)],
                   check=True)
