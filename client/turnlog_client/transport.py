"""The one transport every call of the client goes through: `Transport`.

Owns the httpx connection pool, the headers (bearer token), JSON encoding and
decoding, the retry loop of `errors.py` around each request, and turning a
failed answer into a `TurnlogError` (a refused or timed-out connection into a
`TurnlogConnectionError` naming the server's URL). Both halves of the client
— the session calls (`async_client.py`) and the trainer calls
(`consumers.py`) — hold the same `Transport`, so neither imports the other.

Also owns how a path and a write's deadline go on the wire (`escape_path`,
`timeout_text` for `X-Turnlog-Timeout`). Refuses to own any call: which paths,
bodies and what a reply means are the callers'; R3 streaming is
`npy_stream.py`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

import httpx
import msgspec
from tenacity import AsyncRetrying

from turnlog_client.errors import Backoff, TurnlogConnectionError, TurnlogError, retrying

__all__ = ["JSON", "TIMEOUT_HEADER", "Transport", "decode", "encode", "error_from",
           "escape_path", "timeout_text"]

JSON = "application/json"
# A write carried out within this many seconds of arriving or not at all (the store's
# `X-Turnlog-Timeout`).
TIMEOUT_HEADER = "X-Turnlog-Timeout"
# What a path may carry as it is (RFC 3986's pchar, and "/" between segments).
_PATH_SAFE = "/:@-._~!$&'()*+,;="


def timeout_text(seconds: float) -> str:
    """`seconds` as the `X-Turnlog-Timeout` header says it (ValueError outside the
    store's range: above 0, at most a day)."""
    value = float(seconds)
    if not 0.000_001 <= value <= 86400:
        raise ValueError(f"commit_within must be between 1e-06 and 86400 seconds, not {seconds!r}")
    return f"{value:.6f}"


def escape_path(path: str) -> str:
    """`path` as it goes on the wire: what a URL path cannot carry as it is
    percent-encoded (an id with `?`, `#`, `%` or a space means that id, not a query),
    and a `.` or `..` segment (a valid session id) as `%2E`, which no client or
    proxy folds into the path around it. The server decodes both back."""
    escaped = quote(path, safe=_PATH_SAFE)
    return "/".join(segment.replace(".", "%2E") if segment in (".", "..") else segment
                    for segment in escaped.split("/"))


def decode(content: bytes) -> Any:
    try:
        return msgspec.json.decode(content)
    except msgspec.DecodeError:
        # Lone surrogate escapes are valid JSON text that msgspec refuses.
        return json.loads(content)


def encode(body: Any) -> bytes:
    # allow_nan=False: the server rejects non-finite numbers; fail before sending.
    try:
        return json.dumps(body, separators=(",", ":"), ensure_ascii=True,
                          allow_nan=False).encode("ascii")
    except ValueError as exc:
        where = _non_finite(body, "")
        if where is None:
            raise
        # json's own words ("Out of range float values are not JSON compliant") named
        # neither the value nor where it was.
        path, value = where
        raise ValueError(f"{path or 'the body'} is {value!r}: JSON carries no NaN or "
                         "infinity, and turnlog refuses them (send null or a finite "
                         "number)") from exc


def _non_finite(value: Any, path: str) -> tuple[str, float] | None:
    """The path (`record.response.choices[0]…`) and value of the first non-finite float
    in `value`, in document order; None if there is none."""
    if isinstance(value, float):
        return None if math.isfinite(value) else (path, value)
    if isinstance(value, dict):
        for key, item in value.items():
            found = _non_finite(item, f"{path}.{key}" if path else str(key))
            if found is not None:
                return found
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            found = _non_finite(item, f"{path}[{index}]")
            if found is not None:
                return found
    return None


def _retry_after(response: httpx.Response) -> float | None:
    value = response.headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(float(value), 0.0)
    except ValueError:
        return None  # an HTTP date: the backoff decides instead


def error_from(response: httpx.Response, event_id: str | None) -> TurnlogError:
    """A failed answer as a `TurnlogError` (its problem+json, else a plain one)."""
    problem: dict[str, Any] | None = None
    with contextlib.suppress(ValueError, msgspec.DecodeError):
        body = decode(response.content)
        if isinstance(body, dict) and "type" in body:
            problem = body
    if problem is None:
        problem = {"type": "about:blank", "title": response.reason_phrase,
                   "detail": response.text[:500]}
    problem.setdefault("status", response.status_code)
    return TurnlogError(problem, retry_after=_retry_after(response), event_id=event_id)


class Transport:
    """One httpx client, its retry policy and its error mapping.

    `retries` is the number of resends after the first attempt; `retry_deadline`
    (seconds, optional) bounds the whole call, resends and the one in flight
    included;
    `backoff` / `max_backoff` shape the jittered exponential wait between them.
    """

    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        *,
        timeout: float | httpx.Timeout = 30.0,
        retries: int = 5,
        retry_deadline: float | None = None,
        backoff: float = 0.1,
        max_backoff: float = 5.0,
        transport: httpx.AsyncBaseTransport | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        if retries < 0:
            raise ValueError("retries must be >= 0")
        self.base_url = base_url.rstrip("/")
        all_headers = {"accept": "application/json, application/problem+json",
                       **dict(headers or {})}
        if token:
            all_headers["authorization"] = f"Bearer {token}"
        self.http = httpx.AsyncClient(base_url=self.base_url, timeout=timeout,
                                      headers=all_headers, transport=transport)
        self.retries = retries
        self.retry_deadline = retry_deadline
        self.wait = Backoff(backoff, max_backoff)

    async def aclose(self) -> None:
        await self.http.aclose()

    def retrying(self) -> AsyncRetrying:
        """The retry loop for one call (for callers that send by other means)."""
        return retrying(self.retries, self.retry_deadline, self.wait)

    def unreachable(self, cause: httpx.TransportError,
                    event_id: str | None = None) -> TurnlogConnectionError:
        return TurnlogConnectionError(cause, url=self.base_url, event_id=event_id)

    def long_poll(self, wait: float | None) -> httpx.Timeout | None:
        """The read timeout stretched by a long-poll's `wait` (None: the default)."""
        if not wait:
            return None
        base = self.http.timeout
        return httpx.Timeout(connect=base.connect, write=base.write, pool=base.pool,
                             read=None if base.read is None else base.read + wait)

    async def send(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        params: Mapping[str, Any] | None = None,
        event_id: str | None = None,
        timeout: httpx.Timeout | None = None,
        encoded: tuple[bytes, str] | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> httpx.Response:
        """One call with its retries: the body is encoded once, so a resend is
        byte-identical; a non-2xx answer raises the `TurnlogError` it carries.
        `headers`: this call's own, beside the client's."""
        if encoded is None and body is not None:
            encoded = encode(body), JSON
        content = None if encoded is None else encoded[0]
        if encoded is not None:
            headers = {**(headers or {}), "content-type": encoded[1]}
        query = {k: v for k, v in (params or {}).items() if v is not None}
        extra: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
        # `retry_deadline` bounds the whole call: a resend started just before it runs
        # no longer than what is left (tenacity only stops starting new ones).
        try:
            async with asyncio.timeout(self.retry_deadline):
                async for attempt in self.retrying():
                    with attempt:
                        try:
                            response = await self.http.request(
                                method, escape_path(path), content=content,
                                headers=headers, params=query, **extra)
                        except httpx.TransportError as exc:
                            raise self.unreachable(exc, event_id) from exc
                        if response.status_code >= 400:
                            raise error_from(response, event_id)
                        return response
        except TimeoutError as exc:
            raise self.unreachable(httpx.ReadTimeout(
                f"no answer within {self.retry_deadline} s, resends included"),
                event_id) from exc
        raise AssertionError("unreachable: tenacity re-raises the last error")

    async def json(self, method: str, path: str, **kwargs: Any) -> Any:
        """`send`, then the reply's JSON."""
        return decode((await self.send(method, path, **kwargs)).content)
