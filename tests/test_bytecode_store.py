"""The setup's bytecode store (.ci/bytecode.py): a venv built from the same sources as an earlier one
gets that one's .pyc files as hard links and compiles nothing; a .pyc that does not match its source
as it is (another file with the same name) is never linked, and the module is compiled for the
source it has; Python imports what was linked, from where it is linked. A stored .pyc whose content
is no longer what was saved is dropped, not linked, and one that does not load is never saved. And
the setup (.ci/bootstrap) never calls a venv up to date that cannot import shardtrain's entry point:
where its bytecode is what fails, it is replaced."""

from __future__ import annotations

import importlib.util
import marshal
import os
import shutil
import subprocess
import sys
import sysconfig

import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SCRIPT = os.path.join(ROOT, ".ci", "bytecode.py")
BOOTSTRAP = os.path.join(ROOT, ".ci", "bootstrap")
CACHE = os.environ.get("SHARDTRAIN_CACHE", os.path.expanduser("~/.cache/shardtrain"))


def _bytecode(site, store, *flags) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, SCRIPT, str(site), str(store), *flags], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out


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


def _cut_short(path, keep: int) -> bytes:
    """Puts a new file holding ``path``'s first ``keep`` bytes in its place (the hard links to the old
    one elsewhere keep it whole), as a disk error or a stray copy would; returns the whole content."""
    with open(path, "rb") as fh:
        whole = fh.read()
    with open(f"{path}.cut", "wb") as fh:
        fh.write(whole[:keep])
    os.replace(f"{path}.cut", path)
    return whole


def _assert_cut_short(path, whole: bytes) -> None:
    """The damage is real: the header still names the source as it is (what a link checked before
    digests), and the code behind it does not load."""
    with open(path, "rb") as fh:
        cut = fh.read()
    assert len(cut) < len(whole) and cut[:16] == whole[:16]
    try:
        marshal.loads(cut[16:])
    except EOFError:
        return
    raise AssertionError(f"{path} still loads")


def _import_f(site) -> subprocess.CompletedProcess:
    """pkg.mod.f() in a fresh interpreter that reads the site's bytecode and writes none."""
    return subprocess.run([sys.executable, "-B", "-c", "import sys; sys.path.insert(0, sys.argv[1]); "
                           "import pkg.mod; print(pkg.mod.f())", str(site)], capture_output=True, text=True)


def _site_with_pkg(site) -> None:
    (site / "pkg").mkdir(parents=True)
    (site / "pkg" / "__init__.py").write_text("")
    (site / "pkg" / "mod.py").write_text("def f():\n    return 'the whole module'\n")


def test_a_stored_pyc_damaged_after_it_was_saved_is_dropped_and_the_new_venv_compiles_its_module(tmp_path):
    first, store = tmp_path / "first", tmp_path / "store" / "pinned-abc"
    _site_with_pkg(first)
    _bytecode(first, store, "--save")
    second = tmp_path / "second"
    _site_linked_from(first, second)

    stored = os.path.join(store, os.path.relpath(_pyc(first, "pkg/mod.py"), first))
    whole = _cut_short(stored, 40)
    _assert_cut_short(stored, whole)
    assert _import_f(first).stdout.strip() == "the whole module"  # the venv it was saved from keeps its own

    out = _bytecode(second, store)
    imported = _import_f(second)
    assert imported.returncode == 0 and imported.stdout.strip() == "the whole module", imported.stderr
    assert "dropped 1 damaged .pyc file(s)" in out.stderr and "pkg/__pycache__/mod." in out.stderr, out.stderr
    assert not os.path.exists(stored)  # the next venv compiles it too, without checking it again
    assert os.path.samefile(_pyc(second, "pkg/__init__.py"), _pyc(first, "pkg/__init__.py"))  # the rest: linked


def test_a_pyc_that_does_not_load_is_never_saved_into_the_store(tmp_path):
    site = tmp_path / "site"
    _site_with_pkg(site)
    _bytecode(site, tmp_path / "elsewhere")  # compiled in place, nothing saved
    _assert_cut_short(_pyc(site, "pkg/mod.py"), _cut_short(_pyc(site, "pkg/mod.py"), 40))

    store = tmp_path / "store" / "pinned-abc"
    _bytecode(site, store, "--save")
    assert os.path.exists(os.path.join(store, os.path.relpath(_pyc(site, "pkg/__init__.py"), site)))
    assert not os.path.exists(os.path.join(store, os.path.relpath(_pyc(site, "pkg/mod.py"), site)))
    with open(store / ".digests") as fh:
        assert [line.split(" ", 1)[1].strip() for line in fh] == [os.path.relpath(_pyc(site, "pkg/__init__.py"), site)]


def _small_venv_importing_shardtrain(venv) -> str:
    """A venv without pip or the stack, where shardtrain's entry point imports all the same: this
    checkout on its path, and its own copy of PyYAML's Python (the one package the entry point
    imports), compiled. Stamped as the venv running the tests, so setup finds it up to date. Returns
    its site-packages."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = sysconfig.get_paths(vars={"base": str(venv), "platbase": str(venv)})["purelib"]
    shutil.copytree(os.path.dirname(yaml.__file__), os.path.join(site, "yaml"),
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    with open(os.path.join(site, "shardtrain-checkout.pth"), "w") as fh:
        fh.write(ROOT + "\n")
    subprocess.run([str(venv / "bin" / "python"), "-m", "compileall", "-q", site], check=True)
    shutil.copy(os.path.join(sys.prefix, ".shardtrain-stamp"), venv / ".shardtrain-stamp")
    return site


def _setup(venv, cache) -> subprocess.CompletedProcess:
    # No Airflow. Were this venv ever not up to date, the setup would install the stack with pip,
    # which this venv does not have: it fails at once instead of building a venv here.
    env = {**os.environ, "SHARDTRAIN_VENV": str(venv), "SHARDTRAIN_CACHE": str(cache), "SHARDTRAIN_PROFILE": "pinned",
           "SHARDTRAIN_AIRFLOW": "0", "SHARDTRAIN_INSTALLER": "pip", "PYTHON": sys.executable}
    return subprocess.run([BOOTSTRAP], env=env, capture_output=True, text=True, timeout=120)


def test_setup_never_calls_a_venv_up_to_date_that_cannot_import_shardtrain_and_replaces_its_damaged_bytecode(tmp_path):
    venv, cache = tmp_path / "venv", tmp_path / "cache"
    site = _small_venv_importing_shardtrain(venv)
    cache.mkdir()
    os.symlink(os.path.join(CACHE, "test-wheels"), cache / "test-wheels")  # what an up-to-date setup looks for
    python = str(venv / "bin" / "python")
    first = _setup(venv, cache)
    assert first.returncode == 0 and "is up to date" in first.stderr, first.stderr

    pyc = importlib.util.cache_from_source(os.path.join(site, "yaml", "__init__.py"))
    _assert_cut_short(pyc, _cut_short(pyc, 200))
    broken = subprocess.run([python, "-c", "import shardtrain.cli"], capture_output=True, text=True)
    assert broken.returncode == 1 and "EOFError: marshal data too short" in broken.stderr, broken.stderr

    mended = _setup(venv, cache)
    assert mended.returncode == 0, mended.stderr
    after = subprocess.run([python, "-m", "shardtrain.cli", "--version"], capture_output=True, text=True)
    assert after.returncode == 0 and after.stdout.startswith("shardtrain "), after.stderr
    assert "(EOFError: marshal data too short) but its sources can: replacing its bytecode" in mended.stderr

    # A venv whose sources do not import either (PyYAML gone): not up to date, and the error named.
    shutil.rmtree(os.path.join(site, "yaml"))
    missing = _setup(venv, cache)
    assert missing.returncode == 1 and "is up to date" not in missing.stderr, missing.stderr
    assert "cannot import shardtrain.cli (ModuleNotFoundError: No module named 'yaml')" in missing.stderr
