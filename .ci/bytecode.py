"""Bytecode for a new venv's site-packages without compiling it again: hard links to the ``.pyc``
files of an earlier venv built from the same inputs, kept in a store under the cache.

uv hardlinks a venv's ``.py`` files from its cache, so two venvs built from the same constraints share
their sources' inodes, mtimes and sizes; a timestamp-based ``.pyc`` (what compileall and uv write)
records exactly those, so one compiled for one venv is valid for the other (importlib rewrites the
code's file names to where it loads them from). Compiling a venv's ~16,000 modules costs 30 CPU s
per profile (most of a clean checkout's ``make setup``); linking them costs well under a second.

    python bytecode.py SITE_PACKAGES STORE [--save]

Links every ``.pyc`` in STORE whose header matches its source in SITE_PACKAGES, compiles the
sources left without a valid one (all of them where STORE does not exist yet), and with ``--save``
makes STORE from SITE_PACKAGES when there is none (written aside and renamed: a reader never sees
half a store). A ``.pyc`` is never written in place (importlib and py_compile replace the file), so
a linked one cannot change under another venv. Only ``.pyc`` files whose header names their source
as it is are linked or saved: a stale one is compiled again, never trusted.
"""

from __future__ import annotations

import compileall
import importlib.util
import os
import shutil
import struct
import sys

MAGIC = importlib.util.MAGIC_NUMBER


def sources(site: str):
    for folder, dirs, names in os.walk(site):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in names:
            if name.endswith(".py"):
                yield os.path.join(folder, name)


def valid_for(pyc: str, source: str) -> bool:
    """Whether ``pyc`` is a timestamp-based .pyc of this Python for ``source`` as it is now."""
    try:
        with open(pyc, "rb") as fh:
            head = fh.read(16)
        st = os.stat(source)
    except OSError:
        return False
    if len(head) < 16 or head[:4] != MAGIC:
        return False
    flags, mtime, size = struct.unpack("<III", head[4:16])
    return flags == 0 and mtime == int(st.st_mtime) & 0xFFFFFFFF and size == st.st_size & 0xFFFFFFFF


def link(src: str, dst: str) -> None:
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    tmp = f"{dst}.{os.getpid()}.tmp"
    try:
        os.link(src, tmp)
    except OSError:  # another file system: a copy does as well
        shutil.copy2(src, tmp)
    os.replace(tmp, dst)


def restore(site: str, store: str) -> list[str]:
    """Links what the store has for ``site``; returns the sources still without a valid .pyc."""
    missing = []
    for source in sources(site):
        pyc = importlib.util.cache_from_source(source)
        if valid_for(pyc, source):
            continue
        stored = os.path.join(store, os.path.relpath(pyc, site))
        try:
            if os.path.isdir(store) and valid_for(stored, source):
                link(stored, pyc)
                continue
        except OSError:  # the store pruned meanwhile by another setup: compile instead
            pass
        missing.append(source)
    return missing


def save(site: str, store: str) -> None:
    if os.path.isdir(store):
        return
    partial = f"{store}.partial-{os.getpid()}"
    for source in sources(site):
        pyc = importlib.util.cache_from_source(source)
        if valid_for(pyc, source):
            link(pyc, os.path.join(partial, os.path.relpath(pyc, site)))
    try:
        os.rename(partial, store)
    except OSError:  # another setup saved it meanwhile
        shutil.rmtree(partial, ignore_errors=True)


def main(argv: list[str]) -> int:
    site, store = os.path.abspath(argv[0]), os.path.abspath(argv[1])
    missing = restore(site, store)
    if len(missing) > 200:  # a first build: all of it, on every core
        compileall.compile_dir(site, quiet=2, workers=0)
    else:
        for source in missing:
            compileall.compile_file(source, quiet=2)
    if "--save" in argv[2:]:
        save(site, store)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
