"""A small async Python client for turnlog (httpx): one method per wire call.

Owns one method per call and what makes resending them safe: every write
is idempotent on the wire — a turn carries an `event_id`, an open carries a
`session_id`, a close repeats identically, a reward carries an `event_id` —
so the client always sends those ids, generating them when the caller does
not, and every request goes through the one `Transport` (`transport.py`:
retries of `errors.py`, failed answers as `TurnlogError`s).

Owns the wire of a turn too: turns go as MessagePack by default (`wire="json"`
opts out) with the record taken as the session server wrote it and its base64
R3 decoded once here into the raw int32 bin the server stores without another
decode, and the prompt and output entries written packed (fixed-width items the
server reads without an object per item; docs/ingest.md, "Packed lists"); R3
tensors stream into one preallocated array (`npy_stream.py`).

Refuses to own any rule of the store: answers are returned as the JSON the
server sent (plain dicts), and R3 tensors as numpy arrays read from `.npy`.
Also refuses the trainer calls (`consumers.py`), the error types and retry
policy (`errors.py`) and the blocking facade (`sync.py`).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Annotated, Any

import httpx
import msgspec
import numpy as np
import pybase64

from turnlog_client.consumers import Claim, ConsumerCalls, bounds
from turnlog_client.errors import TurnlogError
from turnlog_client.npy_stream import HttpReply, fast_path_url, get_npy, read_chunks
from turnlog_client.transport import (
    JSON,
    TIMEOUT_HEADER,
    Transport,
    encode,
    error_from,
    escape_path,
    timeout_text,
)

__all__ = [
    "Claim",
    "FeedPage",
    "TurnlogClient",
    "new_event_id",
]

OMITTED: Any = object()
WIRES = ("narrow", "msgpack", "json")
MSGPACK = "application/msgpack"
# MessagePack with the R3 bin narrowed: a width byte (1, 2 or 4), then the values at
# that width, a quarter of the int32 bytes for up to 256 experts (docs/ingest.md).
NARROW = "application/vnd.turnlog.narrow-r3+msgpack"
_WIDTHS = ((0xFF, 1, np.dtype("u1")), (0xFFFF, 2, np.dtype("<u2")))


def new_event_id() -> str:
    """A fresh idempotency key for one turn (uuid4 hex); reuse it when resending that turn."""
    return uuid.uuid4().hex


def _r3_bin(text: str) -> bytes | None:
    """The int32 bytes of a canonical base64 R3 payload, else None (sent as text).

    Only canonical text (full padding, zero trailing bits) becomes a bin: the
    server compares a bin with its canonical text, and must refuse the other
    text exactly as it would on the JSON wire.
    """
    if not text or len(text) % 4:
        return None
    try:
        raw = pybase64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return None
    tail = 3 - text.count("=", len(text) - 2)
    if base64.b64encode(raw[len(raw) - tail:]).decode("ascii") != text[-4:]:
        return None
    return raw


# Long lists written at fixed width (valid if not minimal MessagePack), which the
# server reads with numpy, with no Python object per item: a prompt's ids as uint32s
# (`0xce` + 4 bytes big-endian each), and output entries as `[float64, uint32]` (or
# with a nil third, as SGLang writes `[logprob, token_id, null]`). The item layouts
# and the minimum length are the server's (docs/ingest.md, "Packed lists").
_MIN_ITEMS = 16  # shorter lists go as msgspec writes them: nothing to gain
_FIXARRAY, _FLOAT64, _UINT32_TAG, _NIL = 0x90, 0xCB, 0xCE, 0xC0
_UINT32 = list[Annotated[int, msgspec.Meta(ge=0, le=0xFFFFFFFF)]]
_ID_ITEM = np.dtype([("tag", "u1"), ("id", ">u4")])
_ENTRY_ITEMS = {
    2: np.dtype([("head", "u1"), ("float", "u1"), ("logprob", ">f8"), ("tag", "u1"),
                 ("id", ">u4")]),
    3: np.dtype([("head", "u1"), ("float", "u1"), ("logprob", ">f8"), ("tag", "u1"),
                 ("id", ">u4"), ("nil", "u1")]),
}


def _uint32s(values: list[Any]) -> np.ndarray | None:
    """`values` as uint32 if each is an int (not a boolean) in [0, 2**32), else None."""
    try:
        msgspec.convert(values, _UINT32)
    except msgspec.ValidationError:
        return None
    return np.fromiter(values, np.uint32, len(values))


def _array(items: np.ndarray) -> msgspec.Raw:
    return msgspec.Raw(b"\xdd" + len(items).to_bytes(4, "big") + items.tobytes())


def _packed_ids(ids: Any) -> msgspec.Raw | None:
    """A list of ints in [0, 2**32) as one packed array; None for anything else."""
    if type(ids) is not list or len(ids) < _MIN_ITEMS:
        return None
    values = _uint32s(ids)
    if values is None:
        return None
    items = np.empty(len(ids), _ID_ITEM)
    items["tag"], items["id"] = _UINT32_TAG, values
    return _array(items)


def _packed_entries(entries: Any) -> msgspec.Raw | None:
    """Output entries, all `[float, int]` or all `[float, int, None]` (ids in the
    uint32 range), as one packed array; None for anything else."""
    if type(entries) is not list or len(entries) < _MIN_ITEMS \
            or set(map(type, entries)) != {list}:
        return None
    widths = set(map(len, entries))
    width = widths.pop() if len(widths) == 1 else 0
    if width not in _ENTRY_ITEMS:
        return None
    columns = list(zip(*entries, strict=True))
    ids = _uint32s(list(columns[1]))
    if ids is None or set(map(type, columns[0])) != {float} \
            or (width == 3 and any(item is not None for item in columns[2])):
        return None
    items = np.empty(len(entries), _ENTRY_ITEMS[width])
    items["head"], items["float"], items["tag"] = _FIXARRAY + width, _FLOAT64, _UINT32_TAG
    items["logprob"], items["id"] = columns[0], ids
    if width == 3:
        items["nil"] = _NIL
    return _array(items)


def _with_packed_lists(body: Mapping[str, Any]) -> Mapping[str, Any]:
    """`body` with its prompt and output entries packed where they can be, copying
    only the maps on their paths."""
    try:
        record = body["record"]
        request = record["request"]
        response = record["response"]
        choice = _first_choice(response["choices"])
        meta = choice["meta_info"]
    except (KeyError, IndexError, TypeError):
        return body
    ids = _packed_ids(request.get("input_ids")) if isinstance(request, Mapping) else None
    entries = _packed_entries(meta.get("output_token_logprobs")) \
        if isinstance(meta, Mapping) else None
    if ids is None and entries is None:
        return body
    record = dict(record)
    if ids is not None:
        record["request"] = {**request, "input_ids": ids}
    if entries is not None:
        choices = list(response["choices"])
        choices[0] = {**choice, "meta_info": {**meta, "output_token_logprobs": entries}}
        record["response"] = {**response, "choices": choices}
    return {**body, "record": record}


def _first_choice(choices: Any) -> Any:
    """The first of a list of choices (a map of them is not rewritten: TypeError)."""
    if type(choices) is not list:
        raise TypeError("choices is not a list")
    return choices[0]


def _narrowed(raw: bytes) -> bytes:
    """Little-endian int32 R3 bytes as the narrowed wire's bin: the narrowest width
    that holds every value (a negative one keeps int32), then the values."""
    values = np.frombuffer(raw, "<i4")
    if not values.size:
        return raw
    top = int(values.view("<u4").max())  # a negative value reads as above 0xFFFF
    for limit, width, dtype in _WIDTHS:
        if top <= limit:
            return bytes((width,)) + values.astype(dtype).tobytes()
    return b"\x04" + raw


def _with_r3_bin(body: Mapping[str, Any], narrow: bool = False) -> Mapping[str, Any] | None:
    """`body` with its R3 text as a bin (narrowed if `narrow`, and so is a payload given
    as int32 bytes), copying only the maps on the payload's path. Text that is not
    canonical base64 of whole int32 values stays text, for the server to refuse as on
    the JSON wire. None (`narrow` only): bytes that are not whole int32 values, which
    only the plain wire carries as they are."""
    try:
        record = body["record"]
        response = record["response"]
        choice = _first_choice(response["choices"])
        meta = choice["meta_info"]
        payload = meta["routed_experts"]
    except (KeyError, IndexError, TypeError):
        return body
    if isinstance(payload, str):
        raw = _r3_bin(payload)
        if raw is None or (narrow and len(raw) % 4):
            return body
    elif narrow and isinstance(payload, bytes | bytearray | memoryview):
        raw = bytes(payload)
        if len(raw) % 4:
            return None
    else:
        return body
    if narrow:
        raw = _narrowed(raw)
    choices = list(response["choices"])
    choices[0] = {**choice, "meta_info": {**meta, "routed_experts": raw}}
    return {**body, "record": {**record, "response": {**response, "choices": choices}}}


def _encode_turn(body: Mapping[str, Any], wire: str) -> tuple[bytes, str]:
    """A turn body on `wire`; what MessagePack cannot carry (ints beyond 64 bits) goes
    as JSON, for the server to judge."""
    if wire in ("msgpack", "narrow"):
        narrow = wire == "narrow"
        with contextlib.suppress(OverflowError, TypeError):
            shaped = _with_r3_bin(body, narrow)
            if shaped is None:  # R3 bytes only the plain wire carries as they are
                shaped, narrow = body, False
            return msgspec.msgpack.encode(_with_packed_lists(shaped)), \
                NARROW if narrow else MSGPACK
    return encode(body), JSON


# The largest pages the server answers (docs/api.md): asked for more, it answers these.
EVENTS_PAGE_MAX = 100_000
SESSIONS_PAGE_MAX = 1000


@dataclass(frozen=True)
class FeedPage:
    """One page of the global feed and the cursor to continue after it."""

    events: list[dict[str, Any]]
    next: str


def _label_params(labels: Mapping[str, Any] | None) -> dict[str, str]:
    """Label filters as query parameters (strings as-is, anything else as JSON text)."""
    out: dict[str, str] = {}
    for key, value in (labels or {}).items():
        out[key] = value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))
    return out


class TurnlogClient(ConsumerCalls):
    """Async client. Use as `async with TurnlogClient(url) as tl: ...` (or call `aclose`).

    `retries` is the number of resends after the first attempt; `retry_deadline`
    (seconds, optional) bounds the whole call, resends and the one in flight included
    (past it: a `TurnlogConnectionError`, as for a server that never answered).
    `backoff` / `max_backoff` shape the jittered exponential wait between
    attempts. `transport` lets tests plug in `httpx.ASGITransport(app=...)`.
    `wire` is how turns are sent: "narrow" (default: MessagePack, R3 as its values
    at the narrowest width, a quarter of the bytes for up to 256 experts; a server
    that does not read it answers 415, and the client then sends "msgpack" from
    there on), "msgpack" (R3 as raw int32 bytes) or "json" (the record exactly as
    given); every other call is JSON.
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
        wire: str = "narrow",
    ) -> None:
        if wire not in WIRES:
            raise ValueError(f"wire must be one of {WIRES}")
        self.wire = wire
        super().__init__(Transport(base_url, token, timeout=timeout, retries=retries,
                                   retry_deadline=retry_deadline, backoff=backoff,
                                   max_backoff=max_backoff, transport=transport,
                                   headers=headers))
        self._http = self._transport.http
        # Plain HTTP on the default transport: R3 tensors take the in-place fast path.
        self._fast = None if transport is not None else fast_path_url(base_url)

    @property
    def base_url(self) -> str:
        return self._transport.base_url

    async def __aenter__(self) -> TurnlogClient:
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._transport.aclose()

    # -- sessions ------------------------------------------------------------------

    async def open(self, body: Mapping[str, Any] | None = None, /, **fields: Any) -> dict[str, Any]:
        """Open a session (`POST /v1/sessions`) from `body` and/or keyword fields.

        A `session_id` is generated when absent, so a retried open is idempotent;
        read it back from the reply. Returns the session summary.
        """
        payload = {**dict(body or {}), **fields}
        if payload.get("session_id") is None:
            payload["session_id"] = uuid.uuid4().hex
        result: dict[str, Any] = await self._transport.json("POST", "/v1/sessions", body=payload)
        return result

    async def append(
        self,
        session_id: str,
        record: Mapping[str, Any],
        *,
        event_id: str | None = None,
        parent: int | None = OMITTED,
        metadata: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Append one turn (`POST …/turns`); returns the append reply.

        `parent` omitted = derived by the server; None = a new root. Without an
        `event_id` one is generated and reused by this call's retries; if the
        call still fails, the error's `event_id` is the one to resend with.
        """
        body: dict[str, Any] = {"event_id": event_id or new_event_id(), "record": record}
        if parent is not OMITTED:
            body["parent"] = parent
        if metadata is not None:
            body["metadata"] = metadata
        return await self.append_body(session_id, body)

    async def append_body(self, session_id: str, body: Mapping[str, Any]) -> dict[str, Any]:
        """Append a complete turn body as docs/api.md §1.2 spells it (an `event_id` is
        added when missing)."""
        payload = dict(body)
        if payload.get("event_id") is None:
            payload["event_id"] = new_event_id()
        # Encoded once, outside the retries: a resend sends the very same bytes.
        path = f"/v1/sessions/{session_id}/turns"
        encoded = _encode_turn(payload, self.wire)
        try:
            result: dict[str, Any] = await self._transport.json(
                "POST", path, encoded=encoded, event_id=payload["event_id"])
        except TurnlogError as exc:
            if exc.status != 415 or encoded[1] != NARROW:
                raise
            # A server older than the narrowed wire: it stored nothing; from now on
            # this client sends the plain MessagePack every server reads.
            self.wire = "msgpack"
            result = await self._transport.json(
                "POST", path, encoded=_encode_turn(payload, self.wire),
                event_id=payload["event_id"])
        return result

    async def close(
        self,
        session_id: str,
        *,
        max_seq_len: int | None = None,
        metadata: Mapping[str, Any] | None = None,
        commit_within: float | None = None,
    ) -> dict[str, Any]:
        """Close a session; returns its samples without arrays. Repeats are idempotent.

        `commit_within` (seconds): the store carries the close out within that long
        of receiving it or not at all (503 `deadline-exceeded`), never later, when
        this call may long have given up (`X-Turnlog-Timeout`). Keep it below the
        client's timeout. That 503 is not resent (a resend would get a new window);
        a close that did commit is answered as a repeat, 200, as always."""
        body: dict[str, Any] = {"max_seq_len": max_seq_len, "metadata": dict(metadata or {})}
        headers = None if commit_within is None else {TIMEOUT_HEADER: timeout_text(commit_within)}
        result: dict[str, Any] = await self._transport.json(
            "POST", f"/v1/sessions/{session_id}/close", body=body, headers=headers)
        return result

    async def record_reward(
        self,
        session_id: str,
        reward: float,
        *,
        sample: int | None = None,
        response_id: str | None = None,
        source: str | None = None,
        event_id: str | None = None,
        commit_within: float | None = None,
    ) -> dict[str, Any]:
        """Record a reward for a closed session (`POST …/rewards`); returns the
        `reward_recorded` event. `commit_within`: as `close`'s.

        `sample` (an index) or `response_id` (the leaf turn's `response.id`)
        picks the samples it scores; neither = every sample of the session.
        Without an `event_id` one is generated and reused by this call's
        retries (a repeat answers the original event); if the call still
        fails, the error's `event_id` is the one to resend with.
        """
        body: dict[str, Any] = {"event_id": event_id or new_event_id(), "reward": reward,
                                "sample": sample, "response_id": response_id,
                                "source": source}
        headers = None if commit_within is None else {TIMEOUT_HEADER: timeout_text(commit_within)}
        result: dict[str, Any] = await self._transport.json(
            "POST", f"/v1/sessions/{session_id}/rewards", body=body,
            event_id=body["event_id"], headers=headers)
        return result

    async def session(self, session_id: str) -> dict[str, Any]:
        """The session summary with its `tree`."""
        result: dict[str, Any] = await self._transport.json("GET", f"/v1/sessions/{session_id}")
        return result

    async def state(self, session_id: str, leaf: int | None = None) -> dict[str, Any]:
        """`GET …/state`: where the session stands (for `leaf`, default the latest node)."""
        result: dict[str, Any] = await self._transport.json(
            "GET", f"/v1/sessions/{session_id}/state", params={"leaf": leaf})
        return result

    async def resume(self, session_id: str) -> dict[str, Any]:
        """What a restarted session server needs to carry on: `active_leaf`,
        `checkpoint_token_ids`, `next_routed_experts_start_len`, `covered_r3_rows`."""
        return await self.state(session_id)

    async def events(
        self,
        session_id: str,
        *,
        after: int | None = None,
        limit: int | None = None,
        include_r3: bool = True,
    ) -> list[dict[str, Any]]:
        """One page of a session's events in commit order (records exactly as appended)."""
        result: list[dict[str, Any]] = await self._transport.json(
            "GET", f"/v1/sessions/{session_id}/events",
            params={"after": after, "limit": limit,
                    "include_r3": "true" if include_r3 else "false"})
        return result

    async def all_events(self, session_id: str, *, include_r3: bool = True,
                         page_size: int = 1000) -> list[dict[str, Any]]:
        """Every event of a session, paging by position."""
        out: list[dict[str, Any]] = []
        after: int | None = None
        # The server answers at most EVENTS_PAGE_MAX a page, whatever is asked: a page
        # shorter than that (not than `page_size`) is the last.
        full = min(page_size, EVENTS_PAGE_MAX)
        while True:
            page = await self.events(session_id, after=after, limit=full,
                                     include_r3=include_r3)
            out.extend(page)
            if len(page) < full:
                return out
            after = page[-1]["position"]

    async def sessions(
        self,
        *,
        status: str | None = None,
        labels: Mapping[str, Any] | None = None,
        after: str | None = None,
        limit: int | None = None,
    ) -> dict[str, Any]:
        """One page of `GET /v1/sessions`: `{"sessions": [...], "next": cursor}`."""
        result: dict[str, Any] = await self._transport.json(
            "GET", "/v1/sessions",
            params={"status": status, "after": after, "limit": limit,
                    **_label_params(labels)})
        return result

    async def iter_sessions(
        self,
        *,
        status: str | None = None,
        labels: Mapping[str, Any] | None = None,
        page_size: int = 100,
    ) -> AsyncIterator[dict[str, Any]]:
        """Every matching session summary, paging with the cursor."""
        after: str | None = None
        full = min(page_size, SESSIONS_PAGE_MAX)  # as `all_events` (the server's bound)
        while True:
            page = await self.sessions(status=status, labels=labels, after=after,
                                       limit=full)
            for summary in page["sessions"]:
                yield summary
            if len(page["sessions"]) < full:
                return
            after = page["next"]

    # -- samples -------------------------------------------------------------------

    async def samples(self, session_id: str, *, arrays: bool = True,
                      format: str = "json") -> Any:
        """The samples of a closed session (409 `session-open` while open). With
        `format="safetensors"`: the miles samples wire as `{name: ndarray}`."""
        if format == "safetensors":
            return await self.samples_wire(session_id)
        result: dict[str, Any] = await self._transport.json(
            "GET", f"/v1/sessions/{session_id}/samples",
            params={"arrays": "true" if arrays else "false", "format": format})
        return result

    async def r3(self, session_id: str, index: int, *, rows: Any = None,
                 layers: Any = None) -> np.ndarray:
        """A sample's R3 tensor, int32 `[len(tokens) - 1, num_layers, topk]`, or its
        `[rows, layers, :]` slice (`"a:b"`, a `slice` or an `(a, b)` pair each).

        Streamed: the `.npy` header is parsed from the first bytes, then the body
        is copied chunk by chunk into one preallocated array (no joined body,
        no second parse).
        """
        if rows is not None or layers is not None:
            return await self.r3_slice(session_id, index, rows=bounds(rows),
                                       layers=bounds(layers))
        path = escape_path(f"/v1/sessions/{session_id}/samples/{index}/r3")
        deadline = self._transport.retry_deadline
        try:
            # `retry_deadline` bounds the whole call, as `Transport.send` does.
            async with asyncio.timeout(deadline):
                async for attempt in self._transport.retrying():
                    with attempt:
                        if self._fast is not None:
                            return await self._r3_fast(path)
                        try:
                            async with self._http.stream("GET", path) as response:
                                if response.status_code >= 400:
                                    await response.aread()
                                    raise error_from(response, None)
                                return await read_chunks(response.aiter_bytes())
                        except httpx.TransportError as exc:
                            raise self._transport.unreachable(exc) from exc
        except TimeoutError as exc:
            raise self._transport.unreachable(httpx.ReadTimeout(
                f"no answer within {deadline} s, resends included")) from exc
        raise AssertionError("unreachable: tenacity re-raises the last error")

    async def _r3_fast(self, path: str) -> np.ndarray:
        """The R3 GET over a plain socket, received into the array (npy_stream.py)."""
        assert self._fast is not None
        if self._http.is_closed:  # as the httpx path says it
            raise RuntimeError("Cannot send a request, as the client has been closed.")
        host, port = self._fast
        target = self._http.base_url.raw_path.decode("ascii").rstrip("/") + path
        headers = {k: v for k, v in self._http.headers.items()
                   if k.lower() not in ("host", "connection", "accept-encoding")}
        try:
            return await get_npy(host, port, target, headers, self._http.timeout.read)
        except HttpReply as reply:
            raise error_from(httpx.Response(reply.status, headers=reply.headers,
                                        content=reply.body), None) from None
        except TimeoutError as exc:
            raise self._transport.unreachable(httpx.ReadTimeout(str(exc) or "timed out")) from exc
        except OSError as exc:
            cause = httpx.ConnectError(str(exc)) if isinstance(exc, ConnectionRefusedError) \
                else httpx.ReadError(str(exc))
            raise self._transport.unreachable(cause) from exc

    # -- feed ----------------------------------------------------------------------

    async def feed(self, *, after: str | None = None, limit: int | None = None,
                   wait: float | None = None) -> FeedPage:
        """One page of the global feed; `wait` long-polls up to that many seconds."""
        timeout = self._transport.long_poll(wait)
        body = await self._transport.json(
            "GET", "/v1/events", params={"after": after, "limit": limit, "wait": wait},
            timeout=timeout)
        return FeedPage(events=body["events"], next=body["next"])

    async def follow_pages(
        self,
        *,
        after: str | None = None,
        wait: float = 10.0,
        limit: int | None = None,
        until_idle: bool = False,
    ) -> AsyncIterator[FeedPage]:
        """Pages of the feed forever (or, with `until_idle`, until a long-poll
        comes back empty). Persist `page.next` after handling a page to resume there."""
        cursor = after
        while True:
            page = await self.feed(after=cursor, limit=limit, wait=wait)
            if page.events:
                yield page
            elif until_idle:
                return
            cursor = page.next

    async def follow(
        self,
        *,
        after: str | None = None,
        wait: float = 10.0,
        limit: int | None = None,
        until_idle: bool = False,
    ) -> AsyncIterator[dict[str, Any]]:
        """Feed events one by one in commit order (see `follow_pages` for cursors)."""
        async for page in self.follow_pages(after=after, wait=wait, limit=limit,
                                            until_idle=until_idle):
            for event in page.events:
                yield event

    # -- metric history and gates (CI) ---------------------------------------------

    async def submit_history(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """`POST /v1/metric-history`: one attempt's points; the reply lists `dropped`
        metrics (not in the server's whitelist). Re-posting the same body is a no-op."""
        result: dict[str, Any] = await self._transport.json("POST", "/v1/metric-history", body=body)
        return result

    async def metric_history(self, coordinate: Mapping[str, str], run_id: str) -> dict[str, Any]:
        """`GET /v1/metric-history`: a run's merged series (`attempts` empty: no such run)."""
        result: dict[str, Any] = await self._transport.json(
            "GET", "/v1/metric-history", params={**coordinate, "run_id": run_id})
        return result

    async def evaluate_gates(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """`POST /v1/gates/evaluate`: the verdict (records the run's values unless
        `record` is false)."""
        result: dict[str, Any] = await self._transport.json("POST", "/v1/gates/evaluate", body=body)
        return result

    # -- service -------------------------------------------------------------------

    async def ready(self) -> dict[str, Any]:
        """`GET /readyz` (raises `TurnlogError` 503 `not-ready` after the retries)."""
        result: dict[str, Any] = await self._transport.json("GET", "/readyz")
        return result
