"""The loopback S3 server of tests/s3server.py: bytes and zarr arrays round-trip through s3fs, and which
conditional writes SeaweedFS honours (If-None-Match: * is an atomic create; If-Match refuses a stale ETag)."""
import asyncio
import threading
import uuid

import botocore.session
import numpy as np
import pytest
import s3fs
import zarr
from botocore.exceptions import ClientError
from zarr.core.buffer import default_buffer_prototype
from zarr.storage import FsspecStore

from tests.s3server import s3  # noqa: F401 - the fixture


@pytest.fixture
def client(s3):
    """A plain botocore S3 client on the server (to see the raw status codes)."""
    return botocore.session.get_session().create_client(
        "s3", endpoint_url=s3.endpoint_url, region_name="us-east-1",
        aws_access_key_id=s3.key, aws_secret_access_key=s3.secret)


def new_key(prefix):
    return f"{prefix}/{uuid.uuid4().hex}"


def refused(call) -> bool:
    """True if call() raised 412 PreconditionFailed, False if it succeeded."""
    try:
        call()
        return False
    except ClientError as e:
        assert e.response["ResponseMetadata"]["HTTPStatusCode"] == 412, e.response
        assert e.response["Error"]["Code"] == "PreconditionFailed"
        return True


def test_bytes_round_trip_through_s3fs(s3):
    fs = s3fs.S3FileSystem(**s3.storage_options)
    path = f"{s3.bucket}/{new_key('bytes')}"
    data = np.random.default_rng(0).bytes(3 << 20)
    fs.pipe_file(path, data)
    assert fs.cat_file(path) == data and fs.info(path)["size"] == len(data)
    assert fs.cat_file(path, start=10, end=20) == data[10:20]


def test_zarr_array_round_trip(s3):
    url = s3.url(f"{new_key('zarr')}/x.zarr")
    a = np.random.default_rng(1).standard_normal((50, 7)).astype("float32")
    z = zarr.open_array(url, mode="w", shape=a.shape, chunks=(8, 7), dtype=a.dtype, storage_options=s3.storage_options)
    z[:] = a
    back = zarr.open_array(url, mode="r", storage_options=s3.storage_options)
    assert isinstance(back.store, FsspecStore) and back.metadata.zarr_format == 3
    assert back[:].tobytes() == a.tobytes()


def test_if_none_match_star_is_an_exclusive_create(s3, client):
    key = new_key("create")
    assert not refused(lambda: client.put_object(Bucket=s3.bucket, Key=key, Body=b"first", IfNoneMatch="*"))
    assert refused(lambda: client.put_object(Bucket=s3.bucket, Key=key, Body=b"second", IfNoneMatch="*"))
    assert client.get_object(Bucket=s3.bucket, Key=key)["Body"].read() == b"first"


def test_s3fs_create_mode_refuses_an_existing_key_with_oserror_not_fileexistserror(s3):
    # s3fs maps 412 to FileExistsError only when the error has <Condition>If-None-Match</Condition> (as AWS
    # sends); SeaweedFS leaves it out, so it is OSError(EINVAL) with the botocore error as __cause__.
    fs = s3fs.S3FileSystem(**s3.storage_options)
    path = f"{s3.bucket}/{new_key('s3fs-create')}"
    fs.pipe_file(path, b"first", mode="create")
    with pytest.raises(OSError) as err:
        fs.pipe_file(path, b"second", mode="create")
    assert err.value.__cause__.response["Error"]["Code"] == "PreconditionFailed"
    with pytest.raises(OSError):
        with fs.open(path, "xb") as f:  # exclusive open: IfNoneMatch="*" on the PUT at close
            f.write(b"third")
    assert fs.cat_file(path) == b"first"


def test_racing_creates_have_exactly_one_winner(s3, client):
    for _ in range(5):  # a loser of a race sometimes waits ~1 s on SeaweedFS's per-key lock
        key, wins, gate = new_key("race"), [], threading.Barrier(8)

        def create(i):
            gate.wait()
            if not refused(lambda: client.put_object(Bucket=s3.bucket, Key=key, Body=b"%d" % i, IfNoneMatch="*")):
                wins.append(i)

        threads = [threading.Thread(target=create, args=(i,)) for i in range(8)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        assert len(wins) == 1
        assert client.get_object(Bucket=s3.bucket, Key=key)["Body"].read() == b"%d" % wins[0]


def test_zarr_set_if_not_exists_keeps_the_first_value_but_is_not_atomic(s3):
    # FsspecStore inherits Store.set_if_not_exists: exists() then set(), no conditional PUT - fine one
    # writer at a time, but two racers both write (use s3fs mode="create" for a real exclusive create).
    assert "set_if_not_exists" not in FsspecStore.__dict__
    store = FsspecStore.from_url(s3.url(new_key("zarr-sine")), storage_options=s3.storage_options)
    buf = default_buffer_prototype().buffer.from_bytes

    async def twice():
        await store.set_if_not_exists("k", buf(b"first"))
        await store.set_if_not_exists("k", buf(b"second"))
        return (await store.get("k", default_buffer_prototype())).to_bytes()

    assert asyncio.run(twice()) == b"first"


def test_if_match_overwrites_only_the_current_etag(s3, client):
    # Sequentially exact; under 8 racers with the same ETag, ~1 round in 8 let two PUTs through
    # (SeaweedFS 4.48 checks, then writes), so it is no compare-and-swap for a lease renewal.
    key = new_key("lease")
    client.put_object(Bucket=s3.bucket, Key=key, Body=b"v1")
    etag = client.head_object(Bucket=s3.bucket, Key=key)["ETag"]
    assert not refused(lambda: client.put_object(Bucket=s3.bucket, Key=key, Body=b"v2", IfMatch=etag))
    assert refused(lambda: client.put_object(Bucket=s3.bucket, Key=key, Body=b"v3", IfMatch=etag))  # stale
    assert refused(lambda: client.put_object(Bucket=s3.bucket, Key=new_key("none"), Body=b"x", IfMatch=etag))
    assert client.get_object(Bucket=s3.bucket, Key=key)["Body"].read() == b"v2"
    fs = s3fs.S3FileSystem(**s3.storage_options)  # the same through s3fs: extra kwargs go to put_object
    with pytest.raises(OSError):
        fs.pipe_file(f"{s3.bucket}/{key}", b"v4", IfMatch=etag)
    fs.pipe_file(f"{s3.bucket}/{key}", b"v5", IfMatch=fs.info(f"{s3.bucket}/{key}", refresh=True)["ETag"])
    assert refused(lambda: client.delete_object(Bucket=s3.bucket, Key=key, IfMatch=etag))
    assert fs.cat_file(f"{s3.bucket}/{key}") == b"v5"
