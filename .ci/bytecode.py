"""Bytecode for a new venv's site-packages without compiling it again: hard links to the ``.pyc``
files of an earlier venv built from the same inputs, kept in a store under the cache.

uv hardlinks a venv's ``.py`` files from its cache, so two venvs built from the same constraints share
their sources' inodes, mtimes and sizes; a timestamp-based ``.pyc`` (what compileall and uv write)
records exactly those, so one compiled for one venv is valid for the other (importlib rewrites the
code's file names to where it loads them from). Compiling a venv's ~16,000 modules costs 30 CPU s
per profile (most of a clean checkout's ``make setup``); linking them costs well under a second.

    python bytecode.py SITE_PACKAGES STORE [--save] [--replace]

Links every ``.pyc`` in STORE whose header matches its source in SITE_PACKAGES, compiles the
sources left without a valid one (all of them where STORE does not exist yet), and with ``--save``
makes STORE from SITE_PACKAGES when there is none (written aside and renamed: a reader never sees
half a store). A ``.pyc`` is never written in place (importlib and py_compile replace the file), so
a linked one cannot change under another venv. Only ``.pyc`` files whose header names their source
as it is are linked or saved: a stale one is compiled again, never trusted. ``--replace`` trusts
none of the venv's own: each is linked again from STORE, or compiled.

The header says which source a ``.pyc`` is for, not that the rest of it is whole: a stored file
cut short or replaced keeps a valid header, and importing it fails (``EOFError: marshal data too
short``) in every venv it is linked into. So STORE records each file's digest when it is saved
(``DIGESTS``), and a stored ``.pyc`` is linked only when its content still has that digest; one
that does not is dropped from STORE and its module compiled. A file is saved only where its code
loads. Hashing the ~18,000 files the link step opens anyway costs ~0.5 s more, once per new venv
(the pinned profile's 377 MB: 0.3 s to read their headers, 0.8 s to hash them whole); an
up-to-date venv reads none of them.
"""

from __future__ import annotations

import compileall
import contextlib
import hashlib
import importlib.util
import marshal
import os
import shutil
import struct
import sys

MAGIC = importlib.util.MAGIC_NUMBER
# In STORE, beside the mirrored __pycache__ folders (no .pyc is named so): "<sha256> <relative path>" lines.
DIGESTS = ".digests"


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


def read(path: str) -> bytes:
    with open(path, "rb") as fh:
        return fh.read()


def digest(content: bytes) -> str:
    return hashlib.sha256(content).hexdigest()


def loads(content: bytes) -> bool:
    """Whether a .pyc's code (after its 16-byte header) unmarshals: what importing it needs."""
    try:
        marshal.loads(content[16:])
    except (EOFError, ValueError, TypeError):
        return False
    return True


def recorded_digests(store: str) -> dict[str, str]:
    """The digest of each file as it was saved, by path in STORE; empty where there is no STORE."""
    digests = {}
    try:
        with open(os.path.join(store, DIGESTS), encoding="utf-8") as fh:
            for line in fh:
                value, rel = line.rstrip("\n").split(" ", 1)
                digests[rel] = value
    except FileNotFoundError:
        pass
    return digests


def link(src: str, dst: str) -> None:
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    tmp = f"{dst}.{os.getpid()}.tmp"
    try:
        os.link(src, tmp)
    except OSError:  # another file system: a copy does as well
        shutil.copy2(src, tmp)
    os.replace(tmp, dst)


def restore(site: str, store: str, replace: bool = False) -> list[str]:
    """Links what the store has for ``site``, each file as it was saved; returns the sources still
    without a valid .pyc. ``replace``: none of the venv's own .pyc files is kept, however valid
    its header (one of them does not load)."""
    missing, damaged = [], []
    digests = recorded_digests(store)
    for source in sources(site):
        pyc = importlib.util.cache_from_source(source)
        if replace:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(pyc)
        elif valid_for(pyc, source):
            continue
        rel = os.path.relpath(pyc, site)
        stored = os.path.join(store, rel)
        try:
            if rel in digests and valid_for(stored, source):
                if digest(read(stored)) == digests[rel]:
                    link(stored, pyc)
                    continue
                os.unlink(stored)  # later venvs compile this module too, rather than check it again
                damaged.append(rel)
        except OSError:  # the store pruned meanwhile by another setup: compile instead
            pass
        missing.append(source)
    if damaged:
        print(f"[bootstrap] dropped {len(damaged)} damaged .pyc file(s) from the bytecode store {store} "
              f"(content not as saved: {damaged[0]}{', ...' if len(damaged) > 1 else ''}); compiling them",
              file=sys.stderr)
    return missing


def save(site: str, store: str) -> None:
    if os.path.isdir(store):
        return
    partial = f"{store}.partial-{os.getpid()}"
    digests = []
    for source in sources(site):
        pyc = importlib.util.cache_from_source(source)
        if not valid_for(pyc, source):
            continue
        # Only what loads: a digest of a damaged file would vouch for it in every later venv.
        content = read(pyc)
        if loads(content):
            rel = os.path.relpath(pyc, site)
            link(pyc, os.path.join(partial, rel))
            digests.append(f"{digest(content)} {rel}\n")
    os.makedirs(partial, exist_ok=True)
    with open(os.path.join(partial, DIGESTS), "w", encoding="utf-8") as fh:
        fh.writelines(digests)
    try:
        os.rename(partial, store)
    except OSError:  # another setup saved it meanwhile
        shutil.rmtree(partial, ignore_errors=True)


def main(argv: list[str]) -> int:
    site, store = os.path.abspath(argv[0]), os.path.abspath(argv[1])
    missing = restore(site, store, replace="--replace" in argv[2:])
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
