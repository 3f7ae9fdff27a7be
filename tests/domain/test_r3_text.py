"""`r3text.loads_turn` answers as `jsonio.loads`, the R3 text maybe as its bytes.

The oracle parses the whole body with `jsonio.loads`. `loads_turn` must give
the same value — where the R3 belongs
(`record.response.choices[0].meta_info.routed_experts`) either the same text
or, when that text is non-empty canonical base64 of whole int32 values, its
bytes (what a MessagePack bin carries; JSON writes a bin as that same text)
— or raise the same problem (type, status, message, field), for every body:
the bench's shape, spacing variants, the key elsewhere or twice, escapes, the
markers spelled in the body, broken base64, broken JSON, too many values,
too deep.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.domain.errors import DomainError
from app.domain.wire import jsonio
from app.domain.wire.r3 import payload_bytes
from app.domain.wire.r3text import MARKERS, loads_turn
from tests.fuzz.budget import DERANDOMIZE, examples
from tests.r3_splice import splice_breakers

PROPS = settings(max_examples=examples(200), deadline=None, derandomize=DERANDOMIZE)


def _meta(value: Any) -> Any:
    try:
        return value["record"]["response"]["choices"][0]["meta_info"]
    except (KeyError, IndexError, TypeError):
        return None


def as_json_carries(value: Any) -> Any:
    """`value` with bytes at the R3's place as their base64 text (checked canonical)."""
    meta = _meta(value)
    if isinstance(meta, dict) and isinstance(meta.get("routed_experts"), bytes):
        text = base64.b64encode(meta["routed_experts"]).decode()
        assert payload_bytes(text, "f") == meta["routed_experts"]
        meta = {**meta, "routed_experts": text}
        choice = {**value["record"]["response"]["choices"][0], "meta_info": meta}
        response = {**value["record"]["response"],
                    "choices": [choice, *value["record"]["response"]["choices"][1:]]}
        return {**value, "record": {**value["record"], "response": response}}
    return value


def outcome(fn: Any, raw: bytes, max_values: int) -> tuple[str, Any]:
    try:
        value = fn(raw, max_values)
    except DomainError as exc:
        return "raised", (type(exc), exc.http_status, exc.problem())
    # msgspec writes bytes as base64: the encoding pins the text and the key order.
    try:
        text = msgspec.json.encode(value)
    except UnicodeEncodeError:  # a lone surrogate: the key order, as the store writes it
        text = json.dumps(as_json_carries(value)).encode()
    return "value", (as_json_carries(value), text)


def assert_alike(raw: bytes, max_values: int = 2_000_000) -> None:
    plain = outcome(jsonio.loads, raw, max_values)
    assert outcome(loads_turn, raw, max_values) == plain
    assert outcome(loads_turn, bytearray(raw), max_values) == plain


def turn(r3: str, **extra: Any) -> dict[str, Any]:
    return {
        "event_id": "e" * 32,
        "record": {
            "timestamp": 1.5, "request_timestamp": 1.0, "method": "POST",
            "path": "/v1/chat/completions", "status_code": 200,
            "request": {"input_ids": [1, 2, 3], "return_routed_experts": True,
                        "routed_experts_start_len": 0, **extra},
            "response": {"id": "c", "choices": [{"index": 0, "meta_info": {
                "output_token_logprobs": [[-0.5, 7], [-0.25, 8]],
                "routed_experts": r3, "completion_tokens": 2}}]},
        },
    }


R3 = base64.b64encode(np.arange(4 * 2 * 2, dtype="<i4").tobytes())
BODY = json.dumps(turn(R3.decode())).encode()


@pytest.mark.parametrize("body", [
    *splice_breakers(BODY, R3, b'{"event_id"', b'"index"', b'"completion_tokens"'),
    BODY.replace(b'"input_ids"', b'"routed_experts": "AAAAAAAA", "input_ids"'),
    BODY.replace(R3, b"\\u0041AAA"),  # an escape inside the text
    BODY + b" x",  # trailing garbage
    BODY.replace(b'"index": 0', b'"index": 1e999'),  # out of range: the stdlib decides
    BODY.replace(b'"c"', b'"\\ud800"'),  # a lone surrogate
    BODY.replace(b'"c"', b'"' + MARKERS[0] + b'"'),  # the marker text elsewhere
    BODY.replace(b'"choices": [{', b'"choices": [{"x": 1}, {'),  # not the first choice
    json.dumps({"record": {"response": {"choices": []}}, "routed_experts": "AAAA"}).encode(),
    b"[]", b"null", b"<html>",
])
def test_loads_turn_answers_as_the_plain_parse_then_the_decode(body: bytes) -> None:
    assert_alike(body)


def test_the_r3_text_comes_back_as_its_int32_bytes() -> None:
    for body in (BODY, BODY.replace(b", ", b","), json.dumps(turn(R3.decode()),
                                                           ensure_ascii=False).encode()):
        assert _meta(loads_turn(body))["routed_experts"] == base64.b64decode(R3)


def test_too_many_values_and_too_deep_are_refused_alike() -> None:
    many = json.dumps(turn(R3.decode(), input_ids=list(range(3000)))).encode()
    assert outcome(loads_turn, many, 1000)[0] == "raised"
    assert_alike(many, 1000)
    assert_alike(many, len(many))  # at the bound where the count is skipped
    deep = json.dumps(turn(R3.decode(), nest=json.loads("[" * 70 + "]" * 70))).encode()
    assert outcome(loads_turn, deep, 2_000_000)[0] == "raised"
    assert_alike(deep)


_TEXT = st.text(alphabet=st.sampled_from('a"\\/:,[]{} \n\u00e9\U0001f600'), max_size=12)


@PROPS
@given(values=st.lists(st.integers(-(2**31), 2**31 - 1), max_size=40),
       content=_TEXT, key=st.sampled_from(["c", "routed_experts", "x"]),
       compact=st.booleans(), cut=st.integers(0, 3))
def test_any_r3_and_any_text_around_it(values: list[int], content: str, key: str,
                                       compact: bool, cut: int) -> None:
    r3 = base64.b64encode(np.asarray(values, dtype="<i4").tobytes()).decode()
    if cut:  # a text that is not canonical base64 of whole int32 values
        r3 = r3[:-cut] if len(r3) > cut else "A" * cut
    body = turn(r3)
    body["record"]["request"][key] = content
    separators = (",", ":") if compact else (", ", ": ")
    assert_alike(json.dumps(body, separators=separators).encode())
    assert_alike(json.dumps(body, separators=separators, ensure_ascii=False).encode())
