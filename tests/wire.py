"""The MessagePack twin of a JSON-shaped turn body, and a test client that sends it.

`to_msgpack` is the test's own oracle of the wire (docs/ingest.md): the same
object as MessagePack, with `meta_info.routed_experts` as a bin of the bytes
its base64 text decodes to — only when that text is canonical base64 of a
whole number of bytes, so a payload the JSON path refuses as base64 is still
sent as a str and must be refused the same way.
"""

from __future__ import annotations

import base64
import binascii
import copy
import struct
from typing import Any

import httpx
import msgspec

MSGPACK = "application/msgpack"
NARROW = "application/vnd.turnlog.narrow-r3+msgpack"
R3_KEYS = ("record", "response", "choices", 0, "meta_info")


def _canonical_b64(text: str) -> bytes | None:
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return None
    return raw if base64.b64encode(raw).decode("ascii") == text else None


def with_bin(body: Any) -> Any:
    """A deep copy of `body` with a canonical base64 R3 payload turned into a bin."""
    out = copy.deepcopy(body)
    node = out
    try:
        for key in R3_KEYS:
            node = node[key]
        payload = node["routed_experts"]
    except (KeyError, IndexError, TypeError):
        return out
    if isinstance(payload, str):
        raw = _canonical_b64(payload)
        if raw is not None:
            node["routed_experts"] = raw
    return out


def to_msgpack(body: Any) -> bytes:
    return msgspec.msgpack.encode(with_bin(body))


def narrowed(raw: bytes, width: int | None = None) -> bytes:
    """Little-endian int32 R3 bytes as the narrowed wire's bin: a width byte, then each
    value at that width (the narrowest that holds them all unless `width` says),
    written value by value: the test's own oracle."""
    values = struct.unpack(f"<{len(raw) // 4}i", raw)
    if width is None:
        top = max(values, default=0)
        width = 4 if min(values, default=0) < 0 or top > 0xFFFF else 2 if top > 0xFF else 1
    code = {1: "B", 2: "H", 4: "i"}[width]
    return bytes([width]) + struct.pack(f"<{len(values)}{code}", *values)


def to_narrow_msgpack(body: Any, width: int | None = None) -> bytes:
    """`to_msgpack` for the narrowed wire: an R3 bin (a canonical base64 payload of whole
    int32 values) as `narrowed` writes it; any other payload is sent as it is."""
    out = with_bin(body)
    node = out
    try:
        for key in R3_KEYS:
            node = node[key]
    except (KeyError, IndexError, TypeError):
        return msgspec.msgpack.encode(out)
    payload = node.get("routed_experts")
    if isinstance(payload, bytes):
        # Bytes that are not whole int32 values go back to their text, refused as in JSON.
        node["routed_experts"] = narrowed(payload, width) if len(payload) % 4 == 0 \
            else base64.b64encode(payload).decode("ascii")
    return msgspec.msgpack.encode(out)


def packed_ids(ids: list[int], header: str = "array32") -> msgspec.Raw:
    """`ids` as a packed MessagePack array: each a uint32 (`0xce`, 4 bytes big-endian),
    after an array 16 or 32 header — written item by item, the test's own oracle."""
    head = struct.pack(">BH", 0xDC, len(ids)) if header == "array16" else \
        struct.pack(">BI", 0xDD, len(ids))
    return msgspec.Raw(head + b"".join(struct.pack(">BI", 0xCE, i) for i in ids))


def packed_entries(entries: list[list[Any]]) -> msgspec.Raw:
    """Output entries `[logprob, token_id]` (or with a null third) as a packed
    MessagePack array: a fixarray, a float64 and a uint32 (and a nil) per entry."""
    items = [struct.pack(">BBdBI", 0x90 + len(entry), 0xCB, entry[0], 0xCE, entry[1])
             + (b"\xc0" if len(entry) == 3 else b"") for entry in entries]
    return msgspec.Raw(struct.pack(">BI", 0xDD, len(entries)) + b"".join(items))


def to_packed_msgpack(body: Any) -> bytes:
    """`to_msgpack`, with `record.request.input_ids` and the output entries packed."""
    out = with_bin(body)
    request = out["record"]["request"]
    request["input_ids"] = packed_ids(request["input_ids"])
    meta = out["record"]["response"]["choices"][0]["meta_info"]
    meta["output_token_logprobs"] = packed_entries(meta["output_token_logprobs"])
    return msgspec.msgpack.encode(out)


class WireClient:
    """An httpx client whose `post(…/turns, json=body)` sends `body` on `wire`."""

    def __init__(self, http: httpx.AsyncClient, wire: str) -> None:
        self._http = http
        self.wire = wire

    def __getattr__(self, name: str) -> Any:
        return getattr(self._http, name)

    async def post(self, url: str, **kwargs: Any) -> httpx.Response:
        if self.wire != "json" and url.endswith("/turns") and "json" in kwargs:
            body = kwargs.pop("json")
            kwargs["content"], kind = (to_msgpack(body), MSGPACK) if self.wire == "msgpack" \
                else (to_narrow_msgpack(body), NARROW)
            kwargs["headers"] = {**kwargs.get("headers", {}), "content-type": kind}
        return await self._http.post(url, **kwargs)
