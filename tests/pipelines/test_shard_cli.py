"""generate / shard / inspect as commands: exit codes, messages, and the notebook API."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest

from pipelines import describe_dataset, read_manifest, shard_dataset
from common.cli import run_command
from pipelines.commands import register_commands
from pipelines.generate import generate_dataset

pytestmark = [pytest.mark.spark, pytest.mark.stack]

ROOT = Path(__file__).resolve().parents[2]


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="shardtrain")
    register_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return run_command(args.handler, args)


def test_generate_shard_inspect_commands(spark, tmp_path, capsys):
    raw, out = tmp_path / "raw", tmp_path / "out"
    assert run(["generate", str(raw), "--rows", "2000", "--array-shape", "2x2", "--bad-rows", "8"]) == 0
    assert "injected bad rows" in capsys.readouterr().out
    overrides = [f"sources.raw.path={raw}", f"output.path={out}", "features.arrays.image=[2,2]",
                 "output.rows_per_row_group=100", "output.mode=error"]
    assert run(["shard", "--config", "conf/shard.yaml", *overrides]) == 0
    assert "published" in capsys.readouterr().out
    # A second run in error mode refuses (exit 2); skip_if_exists exits 0 without work.
    assert run(["shard", "--config", "conf/shard.yaml", *overrides]) == 2
    assert "already exists" in capsys.readouterr().err
    assert run(["shard", "--config", "conf/shard.yaml", *overrides, "output.mode=skip_if_exists"]) == 0
    assert "unchanged, skipped" in capsys.readouterr().out
    page = tmp_path / "reports" / "ds.html"
    assert run(["inspect", "--html", str(page), str(out)]) == 0
    text = capsys.readouterr().out
    assert "accounting input 2,000 = published 1,992 + quarantined 8" in text
    assert "train" in text and "spread" in text and "null_label" in text
    assert text.rstrip().endswith(f"wrote {page}")
    _check_dataset_page(page.read_text(encoding="utf-8"), read_manifest(str(out)))


def _check_dataset_page(html_text: str, manifest) -> None:
    """inspect --html: self-contained, charts that decode as PNG, every quarantine reason with its
    count and every shard with its rows, as the manifest records them."""
    import base64
    import html
    import io
    import re

    from PIL import Image

    assert not re.search(r'(src|href)="(?!data:)', html_text)
    payloads = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', html_text)
    assert len(payloads) >= len(manifest.split_names) + 1  # rows per shard of each split, quarantine reasons
    for payload in payloads:
        image = Image.open(io.BytesIO(base64.b64decode(payload, validate=True)))
        image.load()
        assert image.format == "PNG"
    cells = re.findall(r"<td>([^<]*)</td>", html_text)
    pairs = set(zip(map(html.unescape, cells), cells[1:]))
    by_reason = manifest.data["quarantine"]["by_reason"]
    assert by_reason and all((reason, str(count)) in pairs for reason, count in by_reason.items())
    for split in manifest.split_names:
        assert all((f.path, str(f.rows)) in pairs for f in manifest.files(split))
    assert manifest.fingerprint in html_text


def test_shard_command_errors_are_one_line_with_the_exit_code_of_their_class(spark, tmp_path, capsys):
    raw = tmp_path / "raw"
    generate_dataset(spark, str(raw), 500)
    code = run(["shard", "--config", "conf/shard.yaml", f"sources.raw.path={raw}", f"output.path={tmp_path / 'o'}",
                "features.numeric=[x0,nope]"])
    err = capsys.readouterr().err
    assert code == 2 and "column 'nope' (features.numeric) is not in source 'raw'" in err
    assert "Traceback" not in err
    code = run(["shard", "--config", "conf/shard.yaml", f"sources.raw.path={raw}", "output.num_shard=3"])
    assert code == 2 and "did you mean 'output.num_shards'" in capsys.readouterr().err
    assert run(["inspect", str(tmp_path / "missing")]) == 2


def test_notebook_api_and_generator_properties(spark, tmp_path):
    data = generate_dataset(spark, str(tmp_path / "a"), 3000, seed=5, numeric=3, categorical=1, partitions=1)
    again = generate_dataset(spark, str(tmp_path / "b"), 3000, seed=5, numeric=3, categorical=1, partitions=4)
    a = pq.read_table(data.path).to_pandas().sort_values("id").reset_index(drop=True)
    b = pq.read_table(again.path).to_pandas().sort_values("id").reset_index(drop=True)
    pd.testing.assert_frame_equal(a, b)  # same seed, any partitioning: same rows
    assert a["id"].tolist() == list(range(3000))
    assert 0.02 < a["x1"].isna().mean() < 0.09 and 0.02 < a["c0"].isna().mean() < 0.09
    # The label is learnable: x0 alone separates the classes well above chance.
    acc = ((a["x0"].fillna(0) > a["x0"].median()) == (a["label"] == 1)).mean()
    assert max(acc, 1 - acc) > 0.65
    result = shard_dataset(data.shard_config(str(tmp_path / "out"), output={"num_shards": 2}), spark=spark)
    manifest = read_manifest(result.uri)
    assert manifest.data["accounting"]["input_rows"] == 3000
    assert "spread" in describe_dataset(result.uri)
    counts = np.asarray(manifest.label.train_class_counts)
    assert counts.sum() == manifest.rows("train") and (counts > 0).all()


def test_a_query_spark_cannot_analyse_is_one_error_line_naming_it_and_exit_2(spark, tmp_path, capsys, monkeypatch):
    """`shardtrain shard` as a scheduler runs it (its main(), in this process: the exit status of
    the real process is tests/shardtrain/test_cli.py's): a query over a column the source lacks
    once ended in `NameError: first_line` (a traceback, exit 1); it is the user's input to fix."""
    from shardtrain.cli import main

    raw, out = tmp_path / "raw", tmp_path / "out"
    generate_dataset(spark, str(raw), 200, array_shape=[8])
    monkeypatch.chdir(ROOT)
    code = main(["shard", "--config", "conf/shard.yaml", f"sources.raw.path={raw}", f"output.path={out}",
                 "query=SELECT id, x0, no_such_column FROM raw"])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    errors = [line for line in lines if line.startswith("shardtrain: error:")]
    assert code == 2, err[-3000:]
    assert len(errors) == 1 and not any(line.startswith("Traceback") for line in lines), lines
    assert errors[0].startswith("shardtrain: error: query failed to analyse over sources ['raw']: ")
    assert "`no_such_column` cannot be resolved" in errors[0]
    assert not out.exists()
