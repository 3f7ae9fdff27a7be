"""Reading a `.npy` reply straight into one preallocated numpy array.

Owns the client's fast path for R3 tensors: the `.npy` header is parsed from
the first bytes, the array is allocated once, and the rest of the body is
received into it — over plain HTTP by an asyncio `BufferedProtocol` whose
buffer *is* the array (the kernel writes the tensor in place: no chunk
objects, no joined body, no HTTP library touching the bytes), otherwise
from any httpx response stream, one copy per chunk. Refuses everything
else: requests are the client's, errors its `TurnlogError`s.
"""

from __future__ import annotations

import ast
import asyncio
import struct
import urllib.request
from collections.abc import AsyncIterator, Callable, Mapping
from urllib.parse import urlsplit

import numpy as np

NPY_MAGIC = b"\x93NUMPY"
SCRATCH = 1 << 16


def npy_header(head: bytes | bytearray) -> tuple[np.dtype, tuple[int, ...], int] | None:
    """dtype, shape and header length of a `.npy` prefix, or None if more is needed."""
    if len(head) < 10:
        return None
    if head[:6] != NPY_MAGIC:
        raise ValueError("R3 reply is not a .npy document")
    if head[6] == 1:
        size, start = struct.unpack("<H", head[8:10])[0], 10
    elif len(head) < 12:
        return None
    else:
        size, start = struct.unpack("<I", head[8:12])[0], 12
    if len(head) < start + size:
        return None
    meta = ast.literal_eval(bytes(head[start:start + size]).decode("latin-1"))
    if not isinstance(meta, dict) or meta.get("fortran_order") \
            or not isinstance(meta.get("shape"), tuple):
        raise ValueError("R3 reply is not a C-ordered .npy array")
    dtype = np.dtype(meta["descr"])
    if dtype.hasobject:
        raise ValueError("R3 reply holds Python objects")
    return dtype, meta["shape"], start + size


class _Filler:
    """Bytes in, one array out: the header first, then the body in place."""

    def __init__(self) -> None:
        self.head = bytearray()
        self.array: np.ndarray | None = None
        self.out = memoryview(bytearray())
        self.filled = 0

    def feed(self, chunk: bytes | bytearray | memoryview) -> None:
        if self.array is None:
            self.head += chunk
            parsed = npy_header(self.head)
            if parsed is None:
                return
            dtype, shape, offset = parsed
            self.array = np.empty(shape, dtype)
            self.out = self.array.reshape(-1).view(np.uint8).data
            chunk = bytes(self.head[offset:])
        self.advance(len(chunk), chunk)

    def advance(self, nbytes: int, chunk: bytes | bytearray | memoryview | None = None) -> None:
        end = self.filled + nbytes
        if end > len(self.out):
            raise ValueError("R3 reply is longer than its .npy header says")
        if chunk is not None:
            self.out[self.filled:end] = chunk
        self.filled = end

    def result(self) -> np.ndarray:
        if self.array is None or self.filled != len(self.out):
            raise ValueError("R3 reply is shorter than its .npy header says")
        return self.array


async def read_chunks(chunks: AsyncIterator[bytes]) -> np.ndarray:
    """A `.npy` body from any async byte stream (e.g. `httpx.Response.aiter_bytes()`)."""
    filler = _Filler()
    async for chunk in chunks:
        filler.feed(chunk)
    return filler.result()


class HttpReply(Exception):
    """A non-200 answer on the fast path: its status, headers and body, for the caller."""

    def __init__(self, status: int, headers: Mapping[str, str], body: bytes) -> None:
        super().__init__(status)
        self.status, self.headers, self.body = status, dict(headers), body


class _NpyProtocol(asyncio.BufferedProtocol):
    """HTTP/1.1 reply with a Content-Length, its `.npy` body received into the array."""

    def __init__(self, done: asyncio.Future[np.ndarray],
                 progress: Callable[[], None] = lambda: None) -> None:
        self.done = done
        self.progress = progress  # called as bytes come (the read timeout starts over)
        self.scratch = bytearray(SCRATCH)
        self.head = bytearray()
        self.filler: _Filler | None = None
        self.status = 0
        self.headers: dict[str, str] = {}
        self.length = 0
        self.error_body = bytearray()

    def get_buffer(self, sizehint: int) -> memoryview:
        filler = self.filler
        if filler is not None and filler.array is not None and filler.filled < len(filler.out):
            return filler.out[filler.filled:]  # the kernel writes into the tensor itself
        return memoryview(self.scratch)

    def buffer_updated(self, nbytes: int) -> None:
        self.progress()
        try:
            self._received(nbytes)
        except Exception as exc:  # a malformed reply fails the read, not the event loop
            if not self.done.done():
                self.done.set_exception(exc)

    def _received(self, nbytes: int) -> None:
        filler = self.filler
        if filler is not None and filler.array is not None:
            filler.advance(nbytes)
        else:
            data = memoryview(self.scratch)[:nbytes]
            if self.filler is None and self.status != 0:
                self.error_body += data  # a problem body
            elif self.filler is None:
                self.head += data
                end = self.head.find(b"\r\n\r\n")
                if end < 0:
                    return
                self._start(bytes(self.head[:end]))
                rest = bytes(self.head[end + 4:])
                if self.filler is None:
                    self.error_body += rest
                else:
                    self.filler.feed(rest)
            else:
                self.filler.feed(data)
        self._maybe_done()

    def _start(self, head: bytes) -> None:
        lines = head.decode("latin-1").split("\r\n")
        self.status = int(lines[0].split()[1])
        for line in lines[1:]:
            name, _, value = line.partition(":")
            self.headers[name.strip().lower()] = value.strip()
        if "content-length" not in self.headers \
                or self.headers.get("transfer-encoding", "identity") != "identity":
            raise ValueError("R3 reply without a Content-Length")
        self.length = int(self.headers["content-length"])
        if self.status == 200:
            self.filler = _Filler()

    def _maybe_done(self) -> None:
        if self.done.done() or self.status == 0:
            return
        if self.filler is None:
            if len(self.error_body) >= self.length:
                self.done.set_exception(HttpReply(self.status, self.headers,
                                                  bytes(self.error_body[:self.length])))
        elif self.filler.array is not None and self.filler.filled == len(self.filler.out):
            self.done.set_result(self.filler.result())

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_exception(exc or ConnectionError("connection closed mid-reply"))


def fast_path_url(base_url: str) -> tuple[str, int] | None:
    """(host, port) when `base_url` is plain HTTP reached directly (the fast path),
    else None: HTTPS, or a proxy named for it in the environment (`HTTP_PROXY`,
    `ALL_PROXY`, not bypassed by `NO_PROXY`), which httpx's path goes through."""
    parts = urlsplit(base_url)
    if parts.scheme != "http" or not parts.hostname:
        return None
    proxies = urllib.request.getproxies_environment()
    if (proxies.get("http") or proxies.get("all")) \
            and not urllib.request.proxy_bypass(parts.hostname):
        return None
    return parts.hostname, parts.port or 80


async def get_npy(host: str, port: int, target: str, headers: Mapping[str, str],
                  timeout: float | None) -> np.ndarray:
    """`GET target` on a fresh connection; the `.npy` body received into one array.
    `timeout` bounds connecting and each wait for bytes (as httpx's read timeout
    does), not the whole download.

    Raises `HttpReply` for any status but 200, `OSError` / `TimeoutError` for the
    network, `ValueError` for a reply that is not the promised `.npy`.
    """
    loop = asyncio.get_running_loop()
    done: asyncio.Future[np.ndarray] = loop.create_future()
    lines = [f"GET {target} HTTP/1.1", f"Host: {host}:{port}", "Connection: close",
             "Accept-Encoding: identity", *(f"{k}: {v}" for k, v in headers.items())]
    reading = [True]
    async with asyncio.timeout_at(None if timeout is None else loop.time() + timeout) as idle:
        def progress() -> None:
            if timeout is not None and reading[0]:
                idle.reschedule(loop.time() + timeout)

        transport, _protocol = await loop.create_connection(
            lambda: _NpyProtocol(done, progress), host, port)
        try:
            transport.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
            return await done
        finally:
            reading[0] = False
            transport.close()
