"""Text features through the real shard job (issue 44): real strings in a real CSV (unicode, an
empty string, nulls, a 1 MB string, bytes that are not UTF-8, rows of 1 to 10,000 tokens), a
tokenizer fitted on the train split and published beside the manifest, token ids stored as
list<int32>, each bad row quarantined with its reason; a re-run with the published tokenizer as
``tokenizer.file`` writes the same shard bytes; a changed tokenizer file is refused, named."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from common.dataset import read_manifest
from common.errors import ConfigError, DatasetError
from pipelines.shard_job import run_shard_job
from shard_testdata import config, file_hashes, quarantine, read_split

pytestmark = pytest.mark.spark

WORDS = ["river", "stone", "naïve", "café", "日本語", "über", "light", "🙂"]
LONG = {10: 1, 11: 2, 12: 100, 13: 1000, 14: 10_000}  # id -> words in its review: 1 to 10,000 tokens
MEGABYTE_ID, BAD_BYTES_ID, EMPTY_ID, NULL_REVIEW_ID, NULL_TITLE_ID, LONG_TITLE_ID = 20, 21, 22, 23, 24, 25


def _review(i: int) -> str:
    words = LONG.get(i, 1 + i % 9)
    return " ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(words))


def _csv_line(*fields) -> bytes:
    out = []
    for f in fields:
        if f is None:
            out.append(b"")
        elif isinstance(f, bytes):
            out.append(b'"' + f + b'"')
        elif isinstance(f, str):
            out.append(b'"' + f.encode("utf-8") + b'"')
        else:
            out.append(str(f).encode())
    return b",".join(out)


def _write_csv(path: Path, rows: int = 90) -> str:
    lines = [b"id,review,title,y"]
    for i in range(rows):
        review, title = _review(i), f"{WORDS[i % len(WORDS)]} {i % 4}"
        if i == MEGABYTE_ID:
            review = ("river stone " * (1 << 16))[: 1 << 20]  # 1 MiB of text, ~170k tokens
        elif i == BAD_BYTES_ID:
            review = b"caf\xe9 au lait"  # Latin-1: not valid UTF-8
        elif i == EMPTY_ID:
            review = ""
        elif i == NULL_REVIEW_ID:
            review = None
        elif i == NULL_TITLE_ID:
            title = None
        elif i == LONG_TITLE_ID:
            title = "light " * 30
        lines.append(_csv_line(i, review, title, i % 2))
    path.mkdir(parents=True, exist_ok=True)
    (path / "reviews.csv").write_bytes(b"\n".join(lines) + b"\n")
    return str(path)


def _config(src: str, out: Path, review_tokenizer: dict | None = None):
    return config(src, str(out), fmt="csv",
                  sources={"raw": {"path": src, "format": "csv",
                                   "options": {"header": True, "multiLine": True, "emptyValue": ""},
                                   "schema": "id BIGINT, review STRING, title STRING, y INT"}},
                  split={"key": "id", "fractions": {"train": 0.7, "val": 0.3}},
                  features={"numeric": [], "categorical": [], "text": {
                      "review": {"tokenizer": review_tokenizer or {"type": "wordpiece", "vocab_size": 120},
                                 "max_tokens": 64, "truncate": "head"},
                      "title": {"tokenizer": {"type": "bpe", "vocab_size": 80}, "max_tokens": 8,
                                "truncate": "quarantine", "on_null": "quarantine"}}})


@pytest.fixture(scope="module")
def text_dataset(spark, tmp_path_factory):
    root = tmp_path_factory.mktemp("text")
    src = _write_csv(root / "in")
    return root, src, run_shard_job(spark, _config(src, root / "out"))


def _by_row(result, split: str) -> dict:
    table = read_split(result.uri, split)
    return dict(zip(table.column("_row").to_pylist(), table.column("review").to_pylist()))


def test_bad_text_rows_are_quarantined_with_their_reason_and_the_rest_stored_as_token_ids(text_dataset):
    _, _, result = text_dataset
    bad = quarantine(result.uri)
    reasons = {json.loads(raw)["id"]: reason for reason, raw in zip(bad["reason"], bad["raw"])}
    assert reasons == {BAD_BYTES_ID: "bad_encoding", NULL_TITLE_ID: "null_text:title",
                       LONG_TITLE_ID: "too_many_tokens:title"}
    manifest = result.manifest
    assert manifest.data["quarantine"]["by_reason"] == {"bad_encoding": 1, "null_text:title": 1,
                                                        "too_many_tokens:title": 1}
    assert manifest.column("review") == {"name": "review", "dtype": "int32", "shape": [64], "ragged": True}
    import pyarrow as pa

    train = read_split(result.uri, "train")
    assert train.schema.field("review").type == pa.list_(pa.int32())
    lengths = [len(ids) for split in ("train", "val") for ids in _by_row(result, split).values()]
    # every kept row: at most max_tokens ids (the 1 MiB and the 10,000-token rows truncated to
    # their head), the empty string and the null review (on_null: empty) an empty sequence
    assert max(lengths) == 64 and lengths.count(0) == 2
    assert sum(lengths) and len(lengths) == 90 - 3
    record = next(r for r in manifest.data["features"] if r["name"] == "review")
    ids = [i for row in _by_row(result, "train").values() for i in row]
    assert 0 <= min(ids) and max(ids) < record["vocab_size"] and record["pad_id"] == 0


def test_the_tokenizer_sees_only_the_train_split_and_its_length_statistics_are_recorded(text_dataset):
    _, _, result = text_dataset
    manifest = result.manifest
    review = next(r for r in manifest.data["features"] if r["name"] == "review")
    stats = review["lengths"]
    # fitted on the train split's non-null values that pass the rules known before the fit: its
    # published rows, and the long-title row if it fell in train (too_many_tokens is decided with
    # the fitted tokenizer, after), never the val split's
    train = manifest.rows("train") - round(review["null_share"] * manifest.rows("train"))
    assert train <= stats["rows"] <= train + 1 and manifest.rows("val") > 10
    assert stats["max"] > 64 and 0 < stats["truncated_share"] < 1 and stats["p50"] <= stats["p95"] <= stats["max"]
    tokenizer = Path(result.uri.removeprefix("file://"), review["tokenizer"]["path"])
    assert review["files"] == [{"path": "_text/review/tokenizer.json", "sha256": review["tokenizer"]["sha256"]}]
    assert json.loads(tokenizer.read_text())["model"]["type"] == "WordPiece"


def test_a_rerun_with_the_published_tokenizer_as_file_writes_the_same_shard_bytes(spark, text_dataset):
    root, src, first = text_dataset
    given = root / "given-tokenizer.json"
    shutil.copy(Path(first.uri.removeprefix("file://"), "_text/review/tokenizer.json"), given)
    again = run_shard_job(spark, _config(src, root / "again", review_tokenizer={"file": str(given)}))
    assert file_hashes(again.uri) == file_hashes(first.uri)
    review = next(r for r in again.manifest.data["features"] if r["name"] == "review")
    # the file is used as it is: stored byte for byte, recorded by its hash and where it came from
    stored = Path(again.uri.removeprefix("file://"), review["tokenizer"]["path"]).read_bytes()
    assert stored == given.read_bytes()
    import hashlib

    assert review["tokenizer"]["sha256"] == hashlib.sha256(given.read_bytes()).hexdigest()
    assert review["tokenizer"]["file"].endswith("given-tokenizer.json")
    # The job's input is the file's bytes, not its URI: the same tokenizer rewritten in other bytes
    # at the same path is another input (output.mode skip_if_exists would not skip it).
    from pipelines.shard_job import input_fingerprint

    cfg = _config(src, root / "again", review_tokenizer={"file": str(given)})
    before = input_fingerprint(cfg, {})
    assert input_fingerprint(cfg, {}) == before
    given.write_text(json.dumps(json.loads(given.read_text()), indent=1))
    assert input_fingerprint(cfg, {}) != before


def test_a_dataset_whose_tokenizer_changed_after_publishing_is_refused_naming_the_file(text_dataset, tmp_path):
    _, _, result = text_dataset
    copy = tmp_path / "copy"
    shutil.copytree(result.uri.removeprefix("file://"), copy)
    read_manifest(str(copy))  # intact: read
    path = copy / "_text" / "review" / "tokenizer.json"
    path.write_text(path.read_text().replace('"river"', '"rivers"', 1))
    with pytest.raises(DatasetError, match=r"_text/review/tokenizer.json: sha256 .* does not match") as err:
        read_manifest(str(copy))
    assert err.value.exit_code == 2


def test_a_tokenizer_file_that_is_missing_is_exit_2_naming_the_key(tmp_path):
    """The job's input fingerprint reads the file first (its bytes are input): a path with no file
    there is the user's input to fix (exit 2, the key named), not a storage failure to retry."""
    from common.errors import EXIT_USAGE, InputDataError
    from pipelines.shard_job import input_fingerprint

    missing = tmp_path / "missing-tokenizer.json"
    cfg = _config(str(tmp_path), tmp_path / "out", review_tokenizer={"file": str(missing)})
    with pytest.raises(InputDataError, match=r"^features.text.review.tokenizer.file: .*missing-tokenizer.json does "
                                             r"not exist$") as err:
        input_fingerprint(cfg, {})
    assert err.value.exit_code == EXIT_USAGE and not missing.exists()


def test_a_tokenizer_given_both_as_a_type_and_a_file_is_a_config_error_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"features.text.review.tokenizer.type and tokenizer.file are exclusive"):
        _config(str(tmp_path), tmp_path / "out", review_tokenizer={"type": "bpe", "file": str(tmp_path / "t.json")})
    with pytest.raises(ConfigError, match=r"features.text.review.max_tokens must be in"):
        config(str(tmp_path), str(tmp_path / "o"), features={"text": {"review": {"max_tokens": 0}}})


def test_served_raw_strings_give_the_stored_token_ids(text_dataset):
    """Serving's encoding (``FeatureSpec.transform`` on raw strings) equals what the shard job stored."""
    import pandas as pd

    _, _, result = text_dataset
    spec = result.manifest.features
    texts = [_review(i) for i in (1, 2, 13)] + ["", None]
    served = spec.transform(pd.DataFrame({"review": texts, "title": ["river 1"] * len(texts)}))
    ids, mask = served["review"], served["review#mask"]
    assert ids.shape == mask.shape == (5, 64) and mask.sum(axis=1).tolist()[3:] == [0, 0]
    assert (ids[~mask] == 0).all()
    import pyarrow as pa

    kind = spec.kind_of("review")
    stored = {name: kind.stored_values(name, pa.array(values)).to_pylist()
              for name, values in (("review", texts), ("title", ["river 1"] * len(texts)))}
    assert [list(row[m]) for row, m in zip(ids, mask)] == stored["review"]
    # scoring an already-encoded table: the same arrays from the stored ids
    assert np.array_equal(kind.stored_batch(pa.table(stored), 5)["review"], ids)
