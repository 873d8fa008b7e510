"""The typed config loader: YAML -> overrides -> unknown keys -> types -> validation, and the
errors a user sees at each step (one line naming the file/key, exit status 2)."""

from __future__ import annotations

import os
import re
import textwrap

import pytest
import yaml

from common.config import (MAX_ALIAS_EXPANSION, config_fingerprint, dump_yaml, load_config, parse_override, parse_yaml,
                           storage_paths, to_dict)
from common.errors import EXIT_USAGE, ConfigError
from pipelines.shard_config import ShardConfig, load_shard_config

VALID = textwrap.dedent("""
    sources:
      raw: {path: /data/raw.csv, format: csv, options: {header: true}}
    features:
      numeric: [x, y]
      categorical: [city]
    label: {column: label, task: classification, num_classes: 2}
    split: {key: id}
    output: {path: /tmp/out, num_shards: 4}
""")


@pytest.fixture
def config_file(tmp_path):
    path = tmp_path / "shard.yaml"
    path.write_text(VALID)
    return path


def test_loads_typed_tree_with_defaults(config_file):
    cfg = load_shard_config(config_file)
    assert isinstance(cfg, ShardConfig)
    assert cfg.sources["raw"].format == "csv"
    assert cfg.sources["raw"].options == {"header": True}
    assert cfg.output.num_shards == 4
    assert cfg.output.mode == "error"  # the default
    assert cfg.split.fractions == {"train": 0.8, "val": 0.1, "test": 0.1}
    assert cfg.spark.master == "local[2]"


def test_overrides_apply_in_order_and_parse_yaml_values(config_file):
    cfg = load_shard_config(config_file, ["output.num_shards=7", "output.num_shards=9", "spark.conf.spark.x=1",
                                          "features.numeric=[a, b, c]", "output.mode=overwrite"])
    assert cfg.output.num_shards == 9
    assert cfg.features.numeric == ["a", "b", "c"]
    assert cfg.output.mode == "overwrite"
    # free-form maps take new keys; dotted names inside them nest, as YAML would
    assert cfg.spark.conf == {"spark": {"x": 1}}


def test_unknown_key_suggests_closest(config_file):
    with pytest.raises(ConfigError, match=r"unknown key 'output.num_shard'; did you mean 'output.num_shards'\?"):
        load_shard_config(config_file, ["output.num_shard=3"])


def test_unknown_section_lists_valid_keys(config_file):
    with pytest.raises(ConfigError, match=r"unknown key 'zzz'; valid keys: .*features"):
        load_shard_config(config_file, ["zzz.a=1"])


def test_wrong_type_names_key_and_expected_type(config_file):
    with pytest.raises(ConfigError, match=r"output.num_shards must be an integer, got 'four' \(str\)"):
        load_shard_config(config_file, ["output.num_shards=four"])
    with pytest.raises(ConfigError, match=r"output.mode must be one of error, overwrite, skip_if_exists; got 'nope'"):
        load_shard_config(config_file, ["output.mode=nope"])
    with pytest.raises(ConfigError, match=r"features.numeric must be a list"):
        load_shard_config(config_file, ["features.numeric=7"])


def test_bool_is_not_an_integer(config_file):
    with pytest.raises(ConfigError, match=r"num_shards must be an integer, got True"):
        load_shard_config(config_file, ["output.num_shards=true"])


def test_validation_names_the_option_to_change(config_file):
    with pytest.raises(ConfigError, match=r"split.fractions must add up to 1, got 0.9"):
        load_shard_config(config_file, ["split.fractions={train: 0.8, val: 0.1}"])
    with pytest.raises(ConfigError, match=r"output.num_shards must be >= 1, got 0"):
        load_shard_config(config_file, ["output.num_shards=0"])
    with pytest.raises(ConfigError, match=r"label.num_classes must be set"):
        load_shard_config(config_file, ["label.num_classes=null"])


def test_missing_required_key(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("sources: {raw: {path: x}}\n")
    with pytest.raises(ConfigError, match=r"missing required key 'label'"):
        load_shard_config(path)


def test_missing_file_and_malformed_yaml_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match=r"config file not found: .*nope.yaml"):
        load_shard_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("sources:\n  raw: {path: x\n")
    with pytest.raises(ConfigError, match=r"malformed YAML in .*bad.yaml line \d+, column \d+"):
        load_shard_config(bad)
    assert ConfigError.exit_code == EXIT_USAGE == 2


def test_bad_override_syntax():
    with pytest.raises(ConfigError, match="not of the form key.sub=value"):
        parse_override("output.num_shards")
    with pytest.raises(ConfigError, match="not of the form"):
        parse_override("a..b=1")
    assert parse_override("a.b=[1, 2]") == (["a", "b"], [1, 2])


def test_override_into_a_value_is_refused(config_file):
    with pytest.raises(ConfigError, match=r"output.num_shards is a value, not a section"):
        load_shard_config(config_file, ["output.num_shards.x=1"])


def test_resolved_config_round_trips(config_file, tmp_path):
    cfg = load_shard_config(config_file, ["output.num_shards=5"])
    saved = tmp_path / "resolved.yaml"
    saved.write_text(dump_yaml(cfg))
    again = load_config(ShardConfig, saved)
    assert to_dict(again) == to_dict(cfg)


def test_fingerprint_names_the_resolved_config(config_file, tmp_path):
    """The fingerprint in a job's first log line: the same for the config saved beside its output,
    different as soon as any value differs (an override included)."""
    cfg = load_shard_config(config_file, ["output.num_shards=5"])
    saved = tmp_path / "resolved.yaml"
    saved.write_text(dump_yaml(cfg))
    fingerprint = config_fingerprint(cfg)
    assert len(fingerprint) == 12 and int(fingerprint, 16) >= 0
    assert config_fingerprint(load_config(ShardConfig, saved)) == fingerprint
    assert config_fingerprint(load_shard_config(config_file, ["output.num_shards=5", "split.seed=1"])) != fingerprint
    assert config_fingerprint(load_shard_config(config_file)) != fingerprint


# --- bounded by design: YAML that cannot exhaust memory, values that cannot loop for ever ------

def _alias_bomb(levels: int) -> str:
    """``levels`` lists of 10 aliases to the list before: 10**levels leaves once expanded."""
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def _leaves(value) -> int:
    return sum(_leaves(v) for v in value) if isinstance(value, list) else 1


def test_an_alias_bomb_is_refused_naming_the_file(tmp_path, capsys):
    from shardtrain.cli import main

    small = yaml.safe_load(_alias_bomb(3))
    assert _leaves(small["a2"]) == 1000  # aliases really multiply: 3 levels already give 10**3 leaves
    assert parse_yaml(_alias_bomb(3), "small.yaml")["a2"] == small["a2"]  # a few aliases are fine
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(VALID + _alias_bomb(9))  # 10**9 leaves: gigabytes once copied
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(bomb))}: its YAML aliases expand to more than "
                                          rf"{MAX_ALIAS_EXPANSION:,} extra nodes"):
        load_shard_config(bomb)
    assert main(["shard", "--config", str(bomb)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"shardtrain: error: {bomb}: its YAML aliases expand"), err
    with pytest.raises(ConfigError, match=r"override 'features=.*': its YAML aliases expand"):
        load_shard_config(None, ["features=" + "{" + _alias_bomb(9).replace("\n", ", ").rstrip(", ") + "}"])


def test_a_recursive_alias_is_refused():
    with pytest.raises(ConfigError, match=r"^f.yaml: the YAML alias .* a config cannot be recursive"):
        parse_yaml("a: &x [1, *x]\n", "f.yaml")


def test_a_duplicate_key_is_refused_naming_key_and_lines(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text(VALID + "split: {key: id, seed: 3}\n")
    assert yaml.safe_load(path.read_text())["split"]["seed"] == 3  # plain YAML: the last one wins silently
    last = len(path.read_text().splitlines())
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: duplicate key 'split' at line {last} "
                                          r"\(first at line \d+\)"):
        load_shard_config(path)
    with pytest.raises(ConfigError, match=r"override 'output=\{num_shards: 2, num_shards: 3\}': duplicate key "
                                          r"'num_shards'"):
        load_shard_config(None, ["output={num_shards: 2, num_shards: 3}"])
    # A merge key's values may be overridden beside it: that is what `<<` is for, not a duplicate.
    assert parse_yaml("b: &b {lr: 1, wd: 0}\nt: {<<: *b, lr: 2}\n", "m.yaml")["t"] == {"lr": 2, "wd": 0}


def test_a_config_file_that_is_not_utf8_is_refused_naming_the_file(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes(VALID.encode() + "  # café\n".encode("latin-1"))
    with pytest.raises(UnicodeDecodeError):
        path.read_text(encoding="utf-8")  # the bytes really are not UTF-8
    line = len(VALID.splitlines()) + 1
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))} is not UTF-8 text \(byte 0xe9 at line {line}\)"):
        load_shard_config(path)


@pytest.mark.parametrize("override, key", [
    ("features.impute.x=.nan", "features.impute.x"),
    ("features.impute.x=-.inf", "features.impute.x"),
    ("output.row_group_mb=.inf", "output.row_group_mb"),
    ("quality.max_bad_fraction=.nan", "quality.max_bad_fraction"),  # NaN fails no range check
    ("features.impute.x=" + "9" * 400, "features.impute.x"),  # an integer too large for a float
])
def test_config_numbers_must_be_finite(config_file, override, key):
    with pytest.raises(ConfigError, match=rf"{re.escape(key)} must be a finite number"):
        load_shard_config(config_file, [override])


@pytest.mark.parametrize("override, key, limit", [
    ("output.num_shards=1000000000000", "output.num_shards", "10,000"),
    ("features.max_vocab=100000000000", "features.max_vocab", "10,000,000"),
    ("features.max_category_bytes=10000000000", "features.max_category_bytes", "1,048,576"),
    ("features.arrays={img: [100000, 100000]}", "features.arrays.img", "16,777,216"),
])
def test_counts_have_a_fixed_limit(config_file, override, key, limit):
    with pytest.raises(ConfigError, match=rf"{re.escape(key)} .*{re.escape(limit)}"):
        load_shard_config(config_file, [override])
    assert load_shard_config(config_file, ["output.num_shards=10000"]).output.num_shards == 10_000


# --- storage paths: absolute once, on the driver ----------------------------------------------------

def test_relative_storage_paths_are_absolute_once_loaded_and_uris_stay_as_written(config_file, tmp_path, monkeypatch):
    """Every key naming a place (``storage_path``) holds an absolute path once loaded, from the
    directory the config was loaded in: executors and ranks, whose working directory is another,
    read and write the same place. Defaults too; URIs and absolute paths stay as written; the
    config saved beside an output loads again, from anywhere, to the same values and fingerprint."""
    from scoring.config import load_score_config
    from training.config import load_train_config

    monkeypatch.chdir(tmp_path)
    shard = load_shard_config(config_file, ["sources.raw.path=raw/*.csv", "output.path=./out/",
                                            "teacher={model: ~/models/teacher}"])
    assert storage_paths(shard) == {"sources.raw.path": f"{tmp_path}/raw/*.csv", "output.path": f"{tmp_path}/out",
                                    "teacher.model": os.path.expanduser("~/models/teacher")}
    train = load_train_config(None, ["data.path=artifacts/shards"])  # output.model_path: its default, artifacts/model
    assert (train.data.path, train.output.model_path) == (f"{tmp_path}/artifacts/shards", f"{tmp_path}/artifacts/model")
    assert train.checkpoint_path == f"{tmp_path}/artifacts/model.run/checkpoints"
    uris = ["s3://bucket/raw", "hdfs://namenode:8020/raw", "dbfs:/raw", "/Volumes/main/default/raw", "file:///srv/raw"]
    for uri in uris:
        assert load_score_config(None, ["model=models:/churn@prod", "output.path=/srv/scores",
                                        f"sources.raw.path={uri}"]).sources["raw"].path == uri
    saved = tmp_path / "resolved.yaml"
    saved.write_text(dump_yaml(shard))
    monkeypatch.chdir(tmp_path / "..")
    again = load_config(ShardConfig, saved)
    assert to_dict(again) == to_dict(shard) and config_fingerprint(again) == config_fingerprint(shard)
