"""A JSON document's base64 R3 read straight from its bytes, the rest parsed as before.

A TITO reply, and a turn body that carries one, is ~99.9 % one string:
`…choices[0].meta_info.routed_experts`, base64 of little-endian int32.
Parsed as JSON, that string is most of the work (counted for the value bound,
UTF-8-checked, copied into a `str`, scanned for nesting), and then it is
decoded again. Here the text is found in the bytes and decoded from them,
which checks that it holds base64 characters only (no quote, escape,
separator or bracket), and the rest of the document, with a short marker in
the text's place, is parsed by the caller's own parser. The answer is the
same as parsing the whole document and then decoding the text, in every case:
- The text is one string's whole content: the quote before it is not escaped
  (a `:` and maybe spaces precede it) and the quote after it is the first
  one. Were the quote before it the end of a string, base64 right after it
  would be invalid JSON, and so would the marker (letters) in its place: the
  rest does not parse and the plain path answers.
- The rest parses, counts and nests exactly as the whole does: the two differ
  in one string's content, and neither holds anything the value bound
  (`width`) or the nesting check counts.
- The marker is found where the R3 belongs, and it is the spliced string
  there: the only literal one when the document has no escape, else the rest
  is parsed again with another marker, which must show up there instead.
Whatever does not fit (no such key, text that is not canonical base64 of
whole int32 values, a parse that fails, the marker elsewhere) takes the plain
path: the caller parses the whole document, which then decides.

Owns: finding and decoding the text, the markers, and `loads_turn` (a JSON
turn body so read; its R3 as the int32 bytes a MessagePack bin carries, which
every later step takes as it takes a bin). Refuses: what a document means.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable, Sequence
from typing import Any

import pybase64

from app.domain.errors import DomainError
from app.domain.wire import jsonio
from app.domain.wire.msgpackio import R3_PATH
from app.domain.wire.width import MAX_VALUES

# What goes in place of the R3 text before the rest is parsed (letters only: no JSON
# separator, bracket, quote or escape; two, to tell the spliced string apart).
MARKERS = (b"turnlogSplicedRoutedExpertsA", b"turnlogSplicedRoutedExpertsB")
_KEY = b'"routed_experts":'
_JSON_SPACE = b" \t\r\n"


def text_span(body: bytes | bytearray) -> int:
    """The bytes of the first `"routed_experts":` key's string value in a JSON body, or
    less (0: none). Not a parse: it stops at the first quote, escaped or not, so it
    never counts bytes outside that one string (how much of a body is one value)."""
    key = body.find(_KEY)
    if key < 0:
        return 0
    begin = key + len(_KEY)
    while begin < len(body) and body[begin] in _JSON_SPACE:
        begin += 1
    if body[begin:begin + 1] != b'"':
        return 0
    end = body.find(b'"', begin + 1)
    return max(end - begin - 1, 0)


def splice(body: bytes | bytearray) -> tuple[int, int, bytes] | None:
    """Where the first `"routed_experts":` key's string value runs in `body`, [begin,
    end), and its bytes decoded, if it is non-empty canonical base64 of whole int32
    values (what `r3.payload_bytes` accepts); None otherwise."""
    key = body.find(_KEY)
    if key < 0:
        return None
    begin = key + len(_KEY)
    while begin < len(body) and body[begin] in _JSON_SPACE:
        begin += 1
    if body[begin:begin + 1] != b'"':
        return None
    begin += 1
    end = body.find(b'"', begin)
    if end <= begin or (end - begin) % 4:
        return None
    with memoryview(body) as view:
        text = view[begin:end]
        try:
            data = pybase64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            return None
        tail = 3 - bytes(text[-2:]).count(b"=")
        if base64.b64encode(data[len(data) - tail:]) != text[-4:] or len(data) % 4:
            return None
    return begin, end, data


def parse_spliced(body: bytes | bytearray, parse: Callable[[bytes], Any],
                  found_at: Callable[[Any], Any]) -> tuple[Any, bytes] | None:
    """`parse` of `body` with its R3 text replaced by a marker, and that text decoded;
    None for the plain path. `found_at(value)` reads where the R3 belongs in a parsed
    value (None, or anything, when it is not there); a `DomainError` from `parse`
    means the plain path too (parsing the whole raises the same, or decides)."""
    spliced = splice(body)
    if spliced is None:
        return None
    begin, end, data = spliced
    with memoryview(body) as view:
        head, tail = view[:begin], view[end:]
        rest = b"".join((head, MARKERS[0], tail))
        try:
            value = parse(rest)
            if found_at(value) != MARKERS[0].decode():
                return None
            ambiguous = b"\\" in rest or rest.count(MARKERS[0]) != 1
            if ambiguous and (found_at(parse(b"".join((head, MARKERS[1], tail))))
                              != MARKERS[1].decode()):
                return None
        except DomainError:
            return None
    return value, data


def at_path(value: Any, path: Sequence[str | int]) -> Any:
    """`value[path[0]][path[1]]…`, or None where the path does not run."""
    for key in path:
        if isinstance(key, str):
            if type(value) is not dict:
                return None
            value = value.get(key)
        elif type(value) is not list or len(value) <= key:
            return None
        else:
            value = value[key]
    return value


def loads_turn(raw: bytes | bytearray, max_values: int = MAX_VALUES) -> Any:
    """`jsonio.loads(raw, max_values)` of a turn body, with the base64 R3 text at
    `R3_PATH` (`record.response.choices[0].meta_info.routed_experts`) as its int32
    bytes when it is canonical base64 of whole values, read from the bytes."""
    found = parse_spliced(raw, lambda rest: jsonio.loads(rest, max_values),
                          lambda value: at_path(value, R3_PATH))
    if found is None:
        return jsonio.loads(raw, max_values)
    value, data = found
    at_path(value, R3_PATH[:-1])[R3_PATH[-1]] = data
    return value
