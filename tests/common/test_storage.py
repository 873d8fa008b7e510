"""Storage by URI and the atomic-publish protocol, on local disk and on an S3 endpoint served
over real HTTP on 127.0.0.1 (moto's server, started and stopped by the fixture)."""

from __future__ import annotations


import pytest

from common import storage
from common.errors import OutputExistsError, StorageError
from common.storage import MARKER, is_committed, publish, require_committed, resolve


def test_resolve_schemes(tmp_path):
    assert resolve(str(tmp_path)).path == str(tmp_path)
    assert resolve(f"file://{tmp_path}").path == str(tmp_path)
    loc = resolve("s3://bucket/some/prefix/")
    assert (loc.scheme, loc.path, loc.uri) == ("s3", "bucket/some/prefix", "s3://bucket/some/prefix")
    assert resolve("s3a://bucket/x").uri == "s3://bucket/x"
    assert resolve("hdfs://namenode:8020/data").path == "/data"


@pytest.mark.parametrize("uri, message", [
    ("gs://bucket/x", r"unsupported URI scheme 'gs'"),
    ("s3:///no-bucket", r"an S3 URI needs a bucket"),
    ("", r"empty storage URI"),
])
def test_bad_uris_name_the_uri(uri, message):
    with pytest.raises(StorageError, match=message):
        resolve(uri)


def test_dbfs_needs_the_mount(monkeypatch, tmp_path):
    monkeypatch.setattr(storage, "DBFS_MOUNT", str(tmp_path / "absent"))
    with pytest.raises(StorageError, match=r"dbfs:/data: dbfs:/ URIs need the .* mount"):
        resolve("dbfs:/data")
    monkeypatch.setattr(storage, "DBFS_MOUNT", str(tmp_path))
    assert resolve("dbfs:/data/x").path == str(tmp_path / "data" / "x")


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
    assert not [p for p in loc.fs.glob(parent + "/.*") if storage.STAGING_TAG in p]

    with publish(target, marker={"files": 2}) as staging:
        _write_files(staging, ["a.txt", "sub/b.txt"])
        assert not is_committed(target)  # nothing visible before commit
    assert is_committed(target)
    assert storage.read_marker(target)["files"] == 2
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
    (tmp_path / f".out{storage.STAGING_TAG}20260101-dead").mkdir()
    removed = storage.clean_stale_staging(str(tmp_path / "out"))
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
