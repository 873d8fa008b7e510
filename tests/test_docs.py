"""The docs site cannot drift from the code: every config key has help text (the configuration
reference is generated from it), every key a page names is a key some job has, every config a page
shows loads, and the site builds with warnings as errors (a broken link or reference fails it) into
pages that open from file:// with nothing fetched from elsewhere.

The pages' command blocks run in tests/shardtrain/test_readme.py; the pages and their order are
tests/doc_pages.py's.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

from common.config_keys import NAME, config_keys, find_key
from doc_pages import DOCS, ROOT, all_blocks, reading_order

# Every job's config, as the reference documents it: (root, job configs held whole inside it).
JOBS = {
    "shard": ("pipelines.shard_config", "ShardConfig"),
    "train": ("training.config", "TrainConfig"),
    "score": ("scoring.config", "ScoreConfig"),
    "run": ("shardtrain.run", "RunConfig"),
    "sweep": ("shardtrain.sweep_config", "SweepConfig"),
    "distill": ("shardtrain.distill", "DistillRunConfig"),
}
# An inline code span that reads as a dotted config key, maybe with a value: `train.sync.every=4`.
KEY_SPAN = re.compile(r"`([a-z_]+(?:\.[A-Za-z0-9_<>]+)+)(?:=([^`\s]*))?`")
# Spans that look like keys and are not: files (model.json), and Spark's own settings and API
# (spark.task.maxFailures, spark.read.table), which share the spark section's first word.
NOT_KEYS = re.compile(r"\.(json|jsonl|yaml|html|py|pt|pkl|safetensors|md|whl|journal|db|parquet|sh|txt|jsa)$"
                      r"|^spark\.(?!(master|app_name|conf)\b)")
# The site build's budget in the suite (the issue's: about 60 s).
BUILD_SECONDS = 60


def _job(name: str):
    import importlib

    module, cls = JOBS[name]
    return getattr(importlib.import_module(module), cls)


def _embedded() -> tuple:
    return _job("shard"), _job("train")


def _all_keys() -> dict[str, list]:
    return {name: config_keys(_job(name), () if name in ("shard", "train") else _embedded()) for name in JOBS}


def test_every_config_key_has_help_text():
    """The reference shows each key's help text: a key declared without one (a plain default, a
    field(...) without setting()) fails here, naming the job and the key."""
    missing = [f"{job}: {key.key}" for job, keys in _all_keys().items() for key in keys if not key.help.strip()]
    assert not missing, "config keys without help text (declare them with common.config.setting):\n" + "\n".join(missing)


def test_a_key_without_help_text_is_found():
    """What keeps the test above honest: a section with a key declared the plain way is reported."""
    from dataclasses import dataclass

    from common.config import setting

    @dataclass
    class Section:
        documented: int = setting("a key with its help", default=1)
        plain: int = 2

    assert [k.key for k in config_keys(Section) if not k.help] == ["plain"]


def _page_keys() -> list[tuple[str, int, str, str | None]]:
    """(page, line, key, value) of every inline code span on every page that names a config key."""
    sections = {key.key.split(".")[0] for keys in _all_keys().values() for key in keys}
    found = []
    for page in reading_order():
        inside_fence = False
        for number, line in enumerate(open(page, encoding="utf-8"), 1):
            if line.startswith("```"):
                inside_fence = not inside_fence
                continue
            for match in [] if inside_fence else KEY_SPAN.finditer(line):
                key, value = match.groups()
                if key.split(".")[0] in sections and not NOT_KEYS.search(key):
                    found.append((os.path.relpath(page, ROOT), number, key, value))
    return found


def _unknown(key: str, value: str | None, keys_by_job: dict[str, list]) -> str | None:
    """Why ``key`` (``=value``) is no job's key, or None when one job has it (and takes the value)."""
    hits = [k for keys in keys_by_job.values() if (k := find_key(keys, key.replace("<name>", "x"))) is not None]
    if not hits:
        return "no job has this key"
    if value and all(k.choices and value not in map(str, k.choices) for k in hits):
        return f"{value!r} is not one of {sorted({str(c) for k in hits for c in k.choices})}"
    return None


def test_every_key_the_pages_name_exists():
    """A key named in a page's text (`train.sync.every`, `launch.backend=torch`) is a key of some job,
    and a value given for a key with fixed choices is one of them: a renamed or removed key fails
    here, naming the page and line."""
    keys_by_job = _all_keys()
    found = _page_keys()
    assert len(found) > 150, f"only {len(found)} keys found in the pages: is the scan broken?"
    wrong = [f"{page}:{line}: `{key}{'=' + value if value else ''}`: {why}"
             for page, line, key, value in found if (why := _unknown(key, value, keys_by_job))]
    assert not wrong, "the pages name keys no job has:\n" + "\n".join(wrong)
    # The scan itself: a key that is not there, and a value that is not a choice, are both caught.
    assert _unknown("output.num_shard", None, keys_by_job) and _unknown("train.parallel", "zero3", keys_by_job)
    assert _unknown("sources.raw.path", None, keys_by_job) is None


def test_every_config_block_loads():
    """A ``yaml`` block marked ``<!-- readme-test: config: JOB -->`` loads as that job's config: its
    keys exist, its values type-check and pass the job's own checks."""
    from common.config import from_dict, parse_yaml

    blocks = [b for b in all_blocks() if b.marker and b.marker[0] == "config"]
    assert blocks, "no page shows a config marked to be loaded"
    for block in blocks:
        assert block.language == "yaml" and block.marker[1] in JOBS, f"{block.where}: config: JOB for a yaml block"
        try:
            from_dict(_job(block.marker[1]), parse_yaml(block.text, block.where))
        except Exception as exc:  # noqa: BLE001 - the message names the key
            pytest.fail(f"{block.where}: the {block.marker[1]} config does not load: {exc}")


def test_the_site_builds_offline_without_warnings(tmp_path):
    """`make docs`'s build, with warnings as errors (a broken link, a missing page or reference, a
    docstring autodoc cannot read), in under a minute; every page it writes loads nothing from
    another host (no script, style sheet or font by URL) and links by relative paths, so the folder
    opens from file://. The generated references hold every key and every command."""
    out = tmp_path / "html"
    started = time.monotonic()
    build = subprocess.run([sys.executable, "-m", "sphinx", "-q", "-W", "--keep-going", "-E", "-b", "html", DOCS, str(out)],
                           capture_output=True, text=True, timeout=300)
    seconds = time.monotonic() - started
    assert build.returncode == 0, f"the site does not build cleanly:\n{build.stdout[-4000:]}\n{build.stderr[-6000:]}"
    assert seconds < BUILD_SECONDS, f"the site took {seconds:.0f} s to build (budget {BUILD_SECONDS} s)"
    pages = {os.path.relpath(os.path.join(d, f), out) for d, _, files in os.walk(out) for f in files}
    for page in reading_order()[1:]:
        assert os.path.relpath(page, DOCS)[:-3] + ".html" in pages, page
    remote = re.compile(r"""(<script[^>]+src|<link[^>]+href|<img[^>]+src)=["'](https?:)?//|url\(\s*["']?(https?:)?//|@import\s+["']?(https?:)?//""")
    absolute = re.compile(r"""(href|src)=["'](/|file:)""")
    for name in pages:
        if name.endswith((".html", ".css", ".js")):
            text = (out / name).read_text(encoding="utf-8", errors="replace")
            assert not remote.search(text), f"{name} loads something from another host: {remote.search(text).group(0)}"
            assert not absolute.search(text), f"{name} links by an absolute path: {absolute.search(text).group(0)}"
    reference = (out / "reference" / "config-train.html").read_text(encoding="utf-8")
    for key in config_keys(_job("train")):
        assert f">{key.key.replace(NAME, '&lt;name&gt;')}<" in reference, f"{key.key} is not in the train reference"
    commands = (out / "reference" / "commands.html").read_text(encoding="utf-8")
    for command in ("generate", "shard", "inspect", "train", "report", "run", "sweep", "score", "distill", "demo", "doctor"):
        assert f'id="command-{command}"' in commands, command
