"""Tracked text files carry no leftover merge-conflict markers (a merge once left three in
benchmarks/RESULTS.md, and nothing else would have noticed)."""
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MARKER = re.compile(r"^(<{7} |>{7} |={7}$)", re.MULTILINE)


def test_no_tracked_file_has_merge_conflict_markers():
    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    names = [n for n in listed.decode().split("\0") if n]
    assert names, "git ls-files listed nothing"
    found = []
    for name in names:
        path = ROOT / name
        if not path.is_file() or path.stat().st_size > 5_000_000:
            continue
        text = path.read_bytes()
        if b"\0" in text[:8192]:
            continue  # binary
        for m in MARKER.finditer(text.decode("utf-8", "replace")):
            line = text[:m.start()].count(b"\n") + 1
            found.append(f"{name}:{line}: {m.group(0).strip()}")
    assert not found, "merge-conflict markers left in:\n" + "\n".join(found)
