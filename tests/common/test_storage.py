"""Storage by URI and the atomic-publish protocol, on local disk and on an S3 endpoint served
over real HTTP on 127.0.0.1 (moto's server, started and stopped by the fixture)."""

from __future__ import annotations

import os
import socket

import pytest

from common import storage
from common.commit_marker import KIND_SCORES, MARKER, is_committed, output_kind
from common.errors import OutputExistsError, StorageError
from common.output_guard import check_replaceable
from common.publish import STAGING_TAG, clean_stale_staging, publish, read_marker, require_committed
from common.storage import check_uri, resolve


def test_resolve_schemes(tmp_path):
    assert resolve(str(tmp_path)).path == str(tmp_path)
    assert resolve(f"file://{tmp_path}").path == str(tmp_path)
    loc = resolve("s3://bucket/some/prefix/")
    assert (loc.scheme, loc.path, loc.uri) == ("s3", "bucket/some/prefix", "s3://bucket/some/prefix")
    assert resolve("s3a://bucket/x").uri == "s3://bucket/x"
    assert resolve("hdfs://namenode:8020/data").path == "/data"


def test_only_this_machines_own_paths_are_local():
    # What a remote Spark Connect cluster cannot read (common.spark.check_paths_reach_cluster).
    local = ["artifacts/model", "/srv/model", "file:///srv/model", "~/model"]
    elsewhere = ["s3://b/m", "s3a://b/m", "hdfs://nn:8020/m", "dbfs:/m", "dbfs:/Volumes/c/s/v/m", "/Volumes/c/s/v/m",
                 "models:/churn@prod"]
    assert [uri for uri in local + elsewhere if storage.is_local_path(uri)] == local


@pytest.mark.parametrize("uri, message", [
    ("gs://bucket/x", r"unsupported URI scheme 'gs'"),
    ("s3:///no-bucket", r"an S3 URI needs a bucket"),
    ("", r"empty storage URI"),
])
def test_bad_uris_name_the_uri(uri, message):
    with pytest.raises(StorageError, match=message):
        resolve(uri)


def test_s3_and_hdfs_paths_keep_question_marks_and_hashes():
    # Legal in a key (and '?' is a glob character in a source path): part of the path, never dropped.
    assert resolve("s3://bucket/runs/a?b#c/").path == "bucket/runs/a?b#c"
    assert resolve("hdfs://namenode:8020/data/x#1").path == "/data/x#1"


@pytest.mark.parametrize("uri, extra", [
    ("file://{tmp}/out#part", r"a #fragment"),
    ("file://{tmp}/out?version=2", r"a \?query"),
    ("file://otherhost{tmp}/out", r"a host \('otherhost'\)"),
    ("file://data{tmp}/out?x#y", r"a host \('data'\) and a \?query and a #fragment"),
])
def test_file_uris_with_a_host_query_or_fragment_are_refused(tmp_path, uri, extra):
    uri = uri.format(tmp=tmp_path)
    with pytest.raises(StorageError, match=rf"^{uri.replace('?', '[?]')}: a file:// URI names a local path only, "
                                           rf"and this one has {extra}, which would be ignored") as err:
        resolve(uri)
    assert err.value.exit_code == 2
    assert resolve(f"file://localhost{tmp_path}/out").path == f"{tmp_path}/out"  # the one host that is here


def test_dbfs_needs_the_mount(monkeypatch, tmp_path):
    monkeypatch.setattr(storage, "DBFS_MOUNT", str(tmp_path / "absent"))
    with pytest.raises(StorageError, match=r"dbfs:/data: dbfs:/ URIs need the .* mount"):
        resolve("dbfs:/data")
    monkeypatch.setattr(storage, "DBFS_MOUNT", str(tmp_path))
    assert resolve("dbfs:/data/x").path == str(tmp_path / "data" / "x")


@pytest.mark.parametrize("dbfs_mount", [True, False])  # a dedicated cluster has /dbfs; standard/serverless do not
def test_volume_paths_are_the_same_path_both_ways(monkeypatch, tmp_path, dbfs_mount):
    from common.spark import to_spark_path

    monkeypatch.setattr(storage, "DBFS_MOUNT", str(tmp_path) if dbfs_mount else str(tmp_path / "absent"))
    volume = "/Volumes/main/default/vol/work/shards"
    for uri in (volume, "dbfs:/Volumes/main/default/vol/work/shards", "dbfs:///Volumes/main/default/vol/work/shards/",
                "file:///Volumes/main/default/vol/work/shards"):
        loc = resolve(uri)
        assert (loc.scheme, loc.path, loc.uri) == ("file", volume, volume), uri
        assert to_spark_path(uri) == volume, uri  # what Databricks' Spark resolves; a local Spark reads it too
    if dbfs_mount:
        assert resolve("dbfs:/VolumesX/a").path == str(tmp_path / "VolumesX" / "a")  # only /Volumes is a volume
        assert resolve("dbfs:/tmp/x").path == str(tmp_path / "tmp" / "x")  # the rest of DBFS stays on the mount


def _write_files(loc, names):
    fs = loc.fs
    for name in names:
        with fs.open(f"{loc.path}/{name}", "wb") as fh:
            fh.write(name.encode())


def _check_publish_protocol(base_uri):
    """What a reader sees at each point of a publish, for any backend."""
    target = f"{base_uri}/dataset"
    # A job that dies mid-write leaves nothing a reader accepts, and no staging litter.
    with pytest.raises(RuntimeError, match="boom"):
        with publish(target) as staging:
            _write_files(staging, ["a.txt"])
            raise RuntimeError("boom")
    loc = resolve(target)
    assert not loc.fs.exists(loc.path)
    with pytest.raises(StorageError, match="no such output"):
        require_committed(target)
    parent = loc.path.rsplit("/", 1)[0]
    assert not [p for p in loc.fs.glob(parent + "/.*") if STAGING_TAG in p]

    with publish(target, marker={"files": 2}) as staging:
        _write_files(staging, ["a.txt", "sub/b.txt"])
        assert not is_committed(target)  # nothing visible before commit
    assert is_committed(target)
    assert read_marker(target)["files"] == 2
    assert sorted(p.rsplit("/", 1)[-1] for p in loc.fs.find(loc.path)) == sorted([MARKER, "a.txt", "b.txt"])

    with pytest.raises(OutputExistsError, match="already exists; set output.mode=overwrite"):
        with publish(target, mode="error"):
            pass

    with publish(target, mode="overwrite") as staging:
        _write_files(staging, ["c.txt"])
    names = sorted(p.rsplit("/", 1)[-1] for p in loc.fs.find(loc.path))
    assert names == sorted([MARKER, "c.txt"])  # old files gone, new ones committed

    # A directory someone wrote without the protocol is refused with the reason.
    raw = f"{base_uri}/half-written"
    _write_files(resolve(raw), ["part-0"])
    with pytest.raises(StorageError, match=r"has no _COMMITTED marker, so it is incomplete"):
        require_committed(raw, "dataset")


def test_publish_protocol_local(tmp_path):
    _check_publish_protocol(str(tmp_path))


def test_stale_staging_is_cleaned(tmp_path):
    (tmp_path / f".out{STAGING_TAG}20260101-dead").mkdir()
    removed = clean_stale_staging(str(tmp_path / "out"))
    assert len(removed) == 1 and not list(tmp_path.iterdir())


# --- S3 over real HTTP on loopback (fixtures in tests/conftest.py) ------------------------

@pytest.mark.s3
def test_publish_protocol_s3(s3_bucket):
    _check_publish_protocol(f"{s3_bucket}/run1")


@pytest.mark.s3
def test_s3_without_credentials_fails_before_work(s3_endpoint, monkeypatch, tmp_path):
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("SHARDTRAIN_S3_ENDPOINT", s3_endpoint)
    storage._FS_CACHE.clear()
    with pytest.raises(StorageError, match=r"s3://bucket/data: no AWS credentials found"):
        resolve("s3://bucket/data").fs


# --- bad locations: one line, exit 2 (1 for an endpoint that does not answer), before any work ------

@pytest.mark.parametrize("raw, problem", [
    (b"{not json", r"is not valid JSON \(Expecting property name"),
    (b"\xff\xfe{}", r"is not valid JSON \('utf-8' codec can't decode byte 0xff"),
    (b"[1, 2]", r"holds a JSON array, not an object"),
    (b'"shardtrain.scores"', r"holds a JSON string, not an object"),
])
def test_a_damaged_marker_is_one_error_naming_the_file(tmp_path, raw, problem):
    out = tmp_path / "scores"
    out.mkdir()
    (out / "part-0.parquet").write_bytes(b"rows")
    (out / MARKER).write_bytes(raw)
    message = rf"^{out}/{MARKER} {problem}.*: the marker is damaged; restore it, or move {out} away"
    for call in (read_marker, output_kind, lambda uri: check_replaceable(uri, KIND_SCORES)):
        with pytest.raises(StorageError, match=message) as err:
            call(str(out))
        assert err.value.exit_code == 2 and "\n" not in str(err.value)
    with pytest.raises(StorageError, match=message):  # not taken for a user's directory, and not replaced
        with publish(str(out), mode="overwrite", marker={"kind": KIND_SCORES}):
            pass
    assert (out / MARKER).read_bytes() == raw and sorted(os.listdir(tmp_path)) == ["scores"]


def _cli(monkeypatch, capsys, *argv) -> tuple[int, list[str]]:
    """A shardtrain command run in-process, which must fail before Spark starts; (exit status, stderr lines)."""
    from common import spark as spark_module
    from shardtrain.cli import main

    def no_spark(*args, **kwargs):
        raise AssertionError("Spark was started")

    monkeypatch.setattr(spark_module, "get_or_create_session", no_spark)
    capsys.readouterr()
    rc = main(list(argv))
    return rc, capsys.readouterr().err.strip().splitlines()


def _job_args(command: str, tmp_path, output: str) -> list[str]:
    if command == "score":
        return ["score", "--config", "conf/score.yaml", f"model={tmp_path}/model", f"sources.raw.path={tmp_path}/raw",
                f"output.path={output}"]
    return ["shard", "--config", "conf/shard.yaml", f"sources.raw.path={tmp_path}/raw", f"output.path={output}"]


@pytest.mark.parametrize("command", ["shard", "score"])
def test_an_output_path_with_a_colon_is_refused_naming_the_key(tmp_path, monkeypatch, capsys, command):
    out = f"{tmp_path}/scores:v2"
    rc, err = _cli(monkeypatch, capsys, *_job_args(command, tmp_path, out))
    assert rc == 2
    assert err[-1] == (f"shardtrain: error: output.path {out} holds ':', which a Hadoop path cannot (Spark's writers "
                       "and HDFS reject it); choose a path without ':'")
    assert not os.path.exists(out)


@pytest.mark.parametrize("command", ["shard", "score"])
def test_an_output_that_is_a_symlink_loop_fails_before_any_work(tmp_path, monkeypatch, capsys, command):
    loop = tmp_path / "scores"
    os.symlink(loop, loop)
    rc, err = _cli(monkeypatch, capsys, *_job_args(command, tmp_path, str(loop)))
    assert rc == 2 and err[-1].startswith(f"shardtrain: error: {loop}: is a symlink loop")
    assert os.readlink(loop) == str(loop)  # left as it was


def test_an_unreachable_s3_endpoint_is_one_line_naming_it(tmp_path, monkeypatch, capsys):
    pytest.importorskip("s3fs")
    with socket.socket() as sock:  # a loopback port where nothing listens (connections are refused)
        sock.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{sock.getsockname()[1]}"
    for var, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1", "SHARDTRAIN_S3_ENDPOINT": endpoint,
                       "AWS_MAX_ATTEMPTS": "1", "AWS_EC2_METADATA_DISABLED": "true"}.items():
        monkeypatch.setenv(var, value)  # one attempt, so the test takes a second, not botocore's retries
    storage._FS_CACHE.clear()
    try:
        with pytest.raises(StorageError, match=rf"^s3://bucket/scores: cannot reach the S3 endpoint {endpoint}: "
                                               r"Could not connect to the endpoint URL") as err:
            check_uri("s3://bucket/scores")
        assert err.value.exit_code == 1
        rc, lines = _cli(monkeypatch, capsys, *_job_args("score", tmp_path, "s3://bucket/scores"))
        assert rc == 1 and len(lines) == 1, lines  # no traceback: the one line, from the check before any work
        assert lines[0].startswith(f"shardtrain: error: s3://bucket/scores: cannot reach the S3 endpoint {endpoint}")
    finally:
        storage._FS_CACHE.clear()
