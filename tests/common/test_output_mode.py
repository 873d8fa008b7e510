"""``output.mode`` means the same for every job that publishes under an input fingerprint
(common/output_mode.py; the shard and score jobs' own tests run it end to end): real outputs
published with ``common.publish.publish`` in a temporary directory, no Spark. Each refusal is
exit 2, names the path and the mode that would go on, and leaves what is there untouched."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.commit_marker import KIND_DATASET, KIND_SCORES, MARKER, PUBLISHING
from common.errors import OutputExistsError
from common.output_mode import ABSENT, REPLACE, SAME, OutputWords, existing_output
from common.publish import publish
from common.storage import resolve

WORDS = {KIND_DATASET: OutputWords(kind=KIND_DATASET, identical="an identical one", committed="a committed dataset",
                                   other="a different dataset", inputs="the config or the source files"),
         KIND_SCORES: OutputWords(kind=KIND_SCORES, identical="identical scores", committed="committed scores",
                                  other="other scores", inputs="the config, the input files or the model",
                                  plural=True)}


def _published(path: Path, kind: str, fingerprint: str = "fp-1") -> Path:
    with publish(str(path), mode="error", marker={"kind": kind, "input_fingerprint": fingerprint}) as staging:
        staging.write_text("part-0.parquet", "rows")
    return path


def _tree(path: Path) -> dict:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("mode", ["error", "overwrite", "skip_if_exists"])
def test_nothing_at_the_path_goes_on_in_every_mode(tmp_path, mode):
    assert existing_output(resolve(str(tmp_path / "out")), mode, WORDS[KIND_SCORES], "fp-1") == ABSENT


@pytest.mark.parametrize("kind", [KIND_DATASET, KIND_SCORES])
def test_each_mode_on_an_output_of_the_jobs_kind(tmp_path, kind):
    out = _published(tmp_path / "out", kind)
    before = _tree(out)
    loc, words = resolve(str(out)), WORDS[kind]
    with pytest.raises(OutputExistsError, match=r"already exists; set output.mode=overwrite to replace it") as info:
        existing_output(loc, "error", words, "fp-1")
    assert info.value.exit_code == 2 and str(out) in str(info.value)
    assert existing_output(loc, "overwrite", words, "fp-1") == REPLACE
    assert existing_output(loc, "skip_if_exists", words, "fp-1") == SAME
    with pytest.raises(OutputExistsError, match=f"holds {words.other} .* set output.mode=overwrite"):
        existing_output(loc, "skip_if_exists", words, "fp-2")  # the input changed: never keep the old output
    assert _tree(out) == before


@pytest.mark.parametrize("mode", ["overwrite", "skip_if_exists"])
def test_an_output_of_another_kind_is_neither_replaced_nor_kept(tmp_path, mode):
    out = _published(tmp_path / "out", KIND_DATASET)
    with pytest.raises(OutputExistsError, match=f"holds a {KIND_DATASET}, not a {KIND_SCORES}"):
        existing_output(resolve(str(out)), mode, WORDS[KIND_SCORES], "fp-1")


@pytest.mark.parametrize("mode", ["overwrite", "skip_if_exists"])
def test_a_users_files_are_neither_replaced_nor_kept(tmp_path, mode):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(OutputExistsError, match="that shardtrain did not publish"):
        existing_output(resolve(str(out)), mode, WORDS[KIND_DATASET], "fp-1")
    assert (out / "notes.txt").read_text() == "mine"


def test_skip_if_exists_refuses_an_output_whose_commit_did_not_finish(tmp_path):
    """A publish cut short leaves the output without its marker: not kept, however it looks."""
    out = _published(tmp_path / "out", KIND_SCORES)
    marker = json.loads((out / MARKER).read_text())
    (out / MARKER).unlink()
    (out / PUBLISHING).write_text(json.dumps({"kind": marker["kind"]}))
    with pytest.raises(OutputExistsError, match="is not committed scores .* set output.mode=overwrite"):
        existing_output(resolve(str(out)), "skip_if_exists", WORDS[KIND_SCORES], "fp-1")
    assert existing_output(resolve(str(out)), "overwrite", WORDS[KIND_SCORES], "fp-1") == REPLACE
