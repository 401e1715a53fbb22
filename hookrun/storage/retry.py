"""Retries of an object store's transient errors: a policy (Retry) and a zarr store wrapper that applies it to
every request, zarr's own included (RetryingStore, over any zarr store, as zarr's LoggingStore wraps one).

    retry = Retry("s3://bucket/run.zarr", seconds=60)        # store.retry_s
    store = RetryingStore(FsspecStore.from_url(url), retry)   # zarr's arrays read and write through it
    sync(retry(lambda: fs._info(path)))                       # one request of hookrun's own, retried

Once the store has answered, a transient error (no connection, a timeout, a 5xx, throttling) is retried with
backoff for up to `seconds`; an endpoint that never answered is a wrong URL or a missing server: refused at once.
"""
from __future__ import annotations

import asyncio
import errno
import logging
import time
from typing import List, Optional

from hookrun.storage.internals import Wrapper

log = logging.getLogger("hookrun")

RETRY_S = 60.0  # how long an object store that has answered may stay unreachable before a request fails
_TRANSIENT_ERRNOS = {errno.EBUSY, errno.EAGAIN, errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNREFUSED,
                     errno.ECONNABORTED, errno.ENETUNREACH, errno.EHOSTUNREACH, errno.EPIPE,
                     getattr(errno, "EREMOTEIO", 121)}  # s3fs: 500 InternalError
# botocore, aiohttp, urllib3 and fsspec errors of a connection or a timeout (by name: none of them is a dependency)
_TRANSIENT_TYPES = {"EndpointConnectionError", "ConnectionClosedError", "ConnectTimeoutError", "ReadTimeoutError",
                    "HTTPClientError", "ClientConnectionError", "ClientPayloadError", "ServerDisconnectedError",
                    "FSTimeoutError", "IncompleteRead", "ResponseParserError"}
_THROTTLED = {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "ServiceUnavailable", "InternalError"}


def is_transient(err: BaseException) -> bool:
    """Whether an object store's error may pass by itself: no connection, a timeout, a server error (5xx) or
    throttling; never a missing key, a refused permission or a bad request."""
    for e in (err, err.__cause__):
        if e is None or isinstance(e, (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError,
                                       NotADirectoryError)):
            continue
        if isinstance(e, (ConnectionError, TimeoutError)) or {c.__name__ for c in type(e).__mro__} & _TRANSIENT_TYPES:
            return True
        if isinstance(e, OSError) and e.errno in _TRANSIENT_ERRNOS:
            return True
        response = getattr(e, "response", None)
        if isinstance(response, dict):  # a botocore ClientError (s3fs keeps it as the cause of the error it raises)
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
            if status >= 500 or response.get("Error", {}).get("Code") in _THROTTLED:
                return True
    return False


class Retry:
    """Runs an object store's requests, retrying transient errors with backoff for up to `seconds` each, once the store
    has answered (an endpoint that never answered is a wrong URL or a missing server: refused at once)."""

    def __init__(self, url: str, seconds: float = RETRY_S):
        self.url = url
        self.seconds = float(seconds)
        self.reached = False
        self.down_since: Optional[float] = None  # when the outage in progress began (monotonic)

    async def __call__(self, request):
        """`await request()`, again after each transient error until `seconds` have passed; then that error."""
        delay, deadline = 0.2, None
        while True:
            try:
                result = await request()
            except Exception as err:
                if not (self.reached and self.seconds > 0 and is_transient(err)):
                    raise
                now = time.monotonic()
                if self.down_since is None:
                    self.down_since = now
                    log.warning("%s: the object store did not answer (%s: %s); retrying for up to %.0f s "
                                "(store.retry_s)", self.url, type(err).__name__, err, self.seconds)
                deadline = deadline or now + self.seconds
                if now >= deadline:
                    raise
                await asyncio.sleep(min(delay, deadline - now))
                delay = min(delay * 2, 5.0)
                continue
            self.reached = True
            if self.down_since is not None:
                log.warning("%s: the object store answers again (after %.1f s)", self.url,
                            time.monotonic() - self.down_since)
                self.down_since = None
            return result


async def _listed(keys) -> List[str]:
    return [k async for k in keys]


class RetryingStore(Wrapper):
    """A zarr store whose every request runs through a Retry: zarr's array reads and writes ride out an outage
    as hookrun's own requests do.

        zarr.open_group(store=RetryingStore(FsspecStore.from_url(url), Retry(url)))"""

    def __init__(self, store, retry: Retry):
        super().__init__(store)
        self.retry = retry

    def rewrap(self, store) -> "RetryingStore":
        return RetryingStore(store, self.retry)

    async def get(self, key, prototype, byte_range=None):
        return await self.retry(lambda: self.inner.get(key, prototype, byte_range))

    async def get_partial_values(self, prototype, key_ranges):
        key_ranges = list(key_ranges)
        return await self.retry(lambda: self.inner.get_partial_values(prototype, key_ranges))

    async def set(self, key, value, *args, **kwargs):
        return await self.retry(lambda: self.inner.set(key, value, *args, **kwargs))

    async def set_if_not_exists(self, key, value):
        return await self.retry(lambda: self.inner.set_if_not_exists(key, value))

    async def delete(self, key):
        return await self.retry(lambda: self.inner.delete(key))

    async def delete_dir(self, prefix):
        return await self.retry(lambda: self.inner.delete_dir(prefix))

    async def exists(self, key):
        return await self.retry(lambda: self.inner.exists(key))

    async def getsize(self, key):
        return await self.retry(lambda: self.inner.getsize(key))

    async def is_empty(self, prefix):
        return await self.retry(lambda: self.inner.is_empty(prefix))

    async def list(self):
        for key in await self.retry(lambda: _listed(self.inner.list())):
            yield key

    async def list_prefix(self, prefix):
        for key in await self.retry(lambda: _listed(self.inner.list_prefix(prefix))):
            yield key

    async def list_dir(self, prefix):
        for key in await self.retry(lambda: _listed(self.inner.list_dir(prefix))):
            yield key
