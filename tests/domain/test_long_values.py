"""The long values of a MessagePack turn that `msgpackio.loads` does not decode: a
packed prompt (`input_ids` as uint32 items) and packed output entries, read by
numpy, and an R3 bin 32 (64 KiB or more), a read-only view of the body. Either way
the decoded value, the turn and what is stored of it are those of the plain decode.

The oracle is a plain decode of the same bytes (`msgspec`, no shortcut); the packed
bytes are written item by item (`tests.wire`), not by the client's encoder.
"""

from __future__ import annotations

import struct

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.domain.body.session import SessionDefinition
from app.domain.body.turn import parse_turn
from app.domain.errors import InvalidRequest, TooLarge
from app.domain.log.events import prepare_turn
from app.domain.wire import msgpackio, packed
from app.domain.wire.packed import OutputEntries
from app.domain.wire.validate import TOKEN_MAX
from tests.factory import r3_b64, turn
from tests.wire import packed_entries, packed_ids, with_bin

IDS = list(range(1000, 1040))
DEFINITION = SessionDefinition("s", "v2", "in_place", 2, False, 0)
# 48 layers x top-8: the 41 rows of a turn on IDS are a 62,976-byte bin (a bin 16);
# BIG_OUTPUT's 44 rows make 67,584 bytes, a bin 32.
WIDE = SessionDefinition("s", "v2", "in_place", 48, False, 0)
BIG_OUTPUT = [7, 8, 9, 10]


def body_with(ids_value, output=(7, 8), layers=2, topk=2, **over):
    rows = len(IDS) + len(output) - 1
    body = with_bin(turn(IDS, list(output), r3=r3_b64(rows, layers, topk), start=0,
                         event_id="e", **over))
    body["record"]["request"]["input_ids"] = ids_value
    return body


def meta_of(value):
    return value["record"]["response"]["choices"][0]["meta_info"]


def r3_of(value):
    return meta_of(value)["routed_experts"]


def as_list(value):
    """A decoded body as the plain decode makes it: a packed prompt's array as its
    list, packed output entries as theirs, an R3 view as bytes."""
    request = value["record"]["request"]
    if isinstance(request.get("input_ids"), np.ndarray):
        request["input_ids"] = request["input_ids"].tolist()
    meta = meta_of(value) if "response" in value["record"] else {}
    entries = meta.get("output_token_logprobs")
    if isinstance(entries, OutputEntries):
        meta["output_token_logprobs"] = [
            [float(lp), int(i)] + ([None] if entries.width == 3 else [])
            for lp, i in zip(entries.logprobs, entries.ids, strict=True)]
    if isinstance(meta.get("routed_experts"), memoryview):
        meta["routed_experts"] = bytes(meta["routed_experts"])
    return value


def decoded(raw: bytes):
    return as_list(msgpackio.loads(bytearray(raw)))


def test_a_packed_prompt_is_read_as_an_array_of_the_same_ids():
    raw = msgspec.msgpack.encode(body_with(packed_ids(IDS)))
    buffer = bytearray(raw)
    value = msgpackio.loads(buffer)
    ids = value["record"]["request"]["input_ids"]
    assert isinstance(ids, np.ndarray) and ids.dtype == np.int64 and ids.tolist() == IDS
    assert bytes(buffer) == raw, "the body's buffer was left changed"
    assert decoded(raw) == msgspec.msgpack.decode(raw)
    # As bytes (nothing to rewrite in place) it decodes as every other value.
    assert msgpackio.loads(raw)["record"]["request"]["input_ids"] == IDS
    # The turn it makes is the turn of the same body sent as a list.
    plain = msgspec.msgpack.encode(body_with(IDS))
    assert parse_turn(value, DEFINITION).facts.prompt.tolist() == \
        parse_turn(msgpackio.loads(plain), DEFINITION).facts.prompt.tolist() == IDS
    assert parse_turn(value, DEFINITION).content() == \
        parse_turn(msgpackio.loads(plain), DEFINITION).content()


def test_an_array16_header_is_read_too():
    raw = msgspec.msgpack.encode(body_with(packed_ids(IDS, "array16")))
    assert isinstance(msgpackio.loads(bytearray(raw))["record"]["request"]["input_ids"],
                      np.ndarray)
    assert decoded(raw) == msgspec.msgpack.decode(raw)


def _item(tag: int, value: int) -> bytes:
    size = {0xCC: "B", 0xCD: "H", 0xCE: "I", 0xCF: "Q", 0xD2: "i"}[tag]
    return bytes((tag,)) + struct.pack(">" + size, value)


@pytest.mark.parametrize(("items", "why"), [
    ([_item(0xCE, i) for i in IDS[:-1]] + [_item(0xCD, IDS[-1])], "one item not uint32"),
    ([_item(0xCE, i) for i in IDS[:-1]] + [_item(0xCF, IDS[-1])], "one item uint64"),
    ([_item(0xCE, i) for i in IDS[:-1]] + [_item(0xD2, IDS[-1])], "one item int32"),
    ([_item(0xCE, i) for i in IDS[:15]], "too short to pack"),
])
def test_any_other_encoding_decodes_as_it_comes(items, why):
    raw = msgspec.msgpack.encode(body_with(msgspec.Raw(
        struct.pack(">BI", 0xDD, len(items)) + b"".join(items))))
    value = msgpackio.loads(bytearray(raw))
    assert type(value["record"]["request"]["input_ids"]) is list, why
    assert value == msgspec.msgpack.decode(raw)


def test_an_id_beyond_the_token_range_is_named_by_the_turn_rules():
    ids = [*IDS[:-1], TOKEN_MAX + 1]
    value = msgpackio.loads(bytearray(msgspec.msgpack.encode(body_with(packed_ids(ids)))))
    assert value["record"]["request"]["input_ids"] == ids
    with pytest.raises(InvalidRequest) as refused:
        parse_turn(value, DEFINITION)
    assert refused.value.field == f"record.request.input_ids[{len(ids) - 1}]"


def _map(pairs: list[tuple[str, bytes]]) -> bytes:
    """A MessagePack map written by hand (so a key may repeat)."""
    return bytes((0x80 | len(pairs),)) + b"".join(
        msgspec.msgpack.encode(key) + value for key, value in pairs)


@pytest.mark.parametrize("last_packed", [True, False])
def test_a_repeated_key_keeps_the_last_value_as_every_decoder_does(last_packed):
    listed = msgspec.msgpack.encode([5] * 20)
    ids = bytes(packed_ids(IDS))
    first, last = (listed, ids) if last_packed else (ids, listed)
    request = _map([("input_ids", first), ("input_ids", last)])
    raw = _map([("event_id", msgspec.msgpack.encode("e")),
                ("record", _map([("request", request)]))])
    buffer = bytearray(raw)
    value = msgpackio.loads(buffer)
    assert bytes(buffer) == raw
    assert isinstance(value["record"]["request"]["input_ids"], np.ndarray) == last_packed
    assert as_list(value) == msgspec.msgpack.decode(raw)


@pytest.mark.parametrize(("case", "make", "typed_pass_reads_it"), [
    ("truncated", lambda raw: raw[:-3], False),
    ("trailing bytes", lambda raw: raw + b"\x00", False),
    # Skipped over by the typed pass, so the prompt is rewritten and the decode fails.
    ("an ext value", lambda raw: raw.replace(b"\xa2zz\x01", b"\xa2zz\xd4\x05\x00"), True),
    ("a NaN", lambda raw: raw.replace(b"\xa2zz\x01", b"\xa2zz\xcb" + struct.pack(
        ">d", float("nan"))), True),
])
def test_a_malformed_body_with_a_packed_prompt_is_refused_and_left_as_it_was(
        case, make, typed_pass_reads_it):
    raw = make(msgspec.msgpack.encode(body_with(packed_ids(IDS), metadata={"zz": 1})))
    buffer = bytearray(raw)
    assert any(long.key == "input_ids" for long in msgpackio.layout(buffer).longs) \
        == typed_pass_reads_it
    with pytest.raises(InvalidRequest) as refused:
        msgpackio.loads(buffer)
    # A value refused where it stands is named (`metadata.zz`); a body that is not
    # MessagePack at all is `body`.
    assert refused.value.field == ("metadata.zz" if case in ("a NaN", "an ext value")
                                   else "body"), case
    assert bytes(buffer) == raw, "the body's buffer was left changed"


def test_the_width_is_checked_before_a_packed_list_is_read(monkeypatch):
    """A body of too many values is a 413 before anything of it is read into arrays."""
    def never(_span):
        raise AssertionError("a packed list was read before the width check")

    monkeypatch.setattr(packed, "prompt", never)
    monkeypatch.setattr(packed, "output_entries", never)
    raw = msgspec.msgpack.encode(body_with(packed_ids(list(range(2000)))))
    with pytest.raises(TooLarge):
        msgpackio.loads(bytearray(raw), 1000)


def test_a_bin_as_the_prompt_is_still_refused_beside_values_not_decoded():
    """With the R3 bin and packed entries left undecoded, a bin sent as `input_ids` is
    still a bin where none may be."""
    body = body_with_entries(packed_entries(ENTRIES), layers=48, topk=8)
    body["record"]["request"]["input_ids"] = b"\x00" * (5 + 5 * len(IDS))
    buffer = bytearray(msgspec.msgpack.encode(body))
    assert {"routed_experts", "output_token_logprobs"} <= {
        long.key for long in msgpackio.layout(buffer).longs}
    with pytest.raises(InvalidRequest, match="bin is not allowed"):
        msgpackio.loads(buffer)


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(0, TOKEN_MAX), min_size=0, max_size=80),
       extra=st.dictionaries(st.text(max_size=5),
                             st.integers(-(2**63), 2**64 - 1) | st.text(max_size=5),
                             max_size=3),
       header=st.sampled_from(["array16", "array32"]))
def test_packed_or_not_the_value_is_the_plain_decode(ids, extra, header):
    body = body_with(packed_ids(ids, header))
    body["record"]["request"].update({k: v for k, v in extra.items() if k != "input_ids"})
    raw = msgspec.msgpack.encode(body)
    buffer = bytearray(raw)
    assert decoded(raw) == msgspec.msgpack.decode(raw)
    msgpackio.loads(buffer)
    assert bytes(buffer) == raw


def test_a_layout_that_does_not_match_the_decode_falls_back_to_the_plain_decode():
    """Should a rewritten array not be the one `record.request` ends up with (the typed
    pass and the decoder disagreeing), the body is decoded again as it is."""
    raw = msgspec.msgpack.encode(body_with(packed_ids(IDS), metadata={"other": packed_ids(IDS)}))
    start = raw.rindex(bytes(packed_ids(IDS)))  # metadata's twin, not the prompt
    wrong = msgpackio.Layout(msgpackio.layout(raw).r3, (msgpackio.Long(
        start, start + len(bytes(packed_ids(IDS))), "input_ids"),))
    value = msgpackio.loads(bytearray(raw), found=wrong)
    assert value == msgspec.msgpack.decode(raw)


@pytest.mark.parametrize("ids_value", [IDS, packed_ids(IDS)], ids=["listed", "packed"])
def test_a_large_r3_bin_is_a_read_only_view_of_the_body(ids_value):
    raw = msgspec.msgpack.encode(body_with(ids_value, BIG_OUTPUT, 48, 8))
    buffer = bytearray(raw)
    value = msgpackio.loads(buffer)
    view = r3_of(value)
    assert isinstance(view, memoryview) and view.readonly
    assert bytes(view) == r3_of(msgspec.msgpack.decode(raw))
    assert bytes(buffer) == raw, "the body's buffer was left changed"
    value = msgpackio.loads(buffer)
    assert as_list(value) == msgspec.msgpack.decode(raw)
    # The turn, and its content as JSON carries it, are those of the plain decode.
    plain = msgpackio.loads(raw)
    assert isinstance(r3_of(plain), bytes)
    ours, theirs = parse_turn(value, WIDE), parse_turn(plain, WIDE)
    assert ours.content() == theirs.content()
    assert np.array_equal(ours.facts.r3_values, theirs.facts.r3_values)


@pytest.mark.parametrize("code", [101, 5])
def test_a_clients_ext_is_refused_whatever_its_code(code):
    """Ext 101 is what the decoder is shown in place of the long values: one a client
    sends is still an ext, refused as the plain decode refuses it."""
    body = body_with(packed_ids(IDS), BIG_OUTPUT, 48, 8, metadata={"zz": 1})
    raw = msgspec.msgpack.encode(body).replace(b"\xa2zz\x01",
                                               b"\xa2zz\xd4" + bytes((code, 0)))
    buffer = bytearray(raw)
    assert {"input_ids", "routed_experts"} <= {long.key for long in
                                               msgpackio.layout(buffer).longs}
    with pytest.raises(InvalidRequest, match="ext type is not allowed here") as refused:
        msgpackio.loads(buffer)
    assert refused.value.field == "metadata.zz"
    assert bytes(buffer) == raw


ENTRIES = [[-0.5 - i / 7, 3000 + i] for i in range(20)]


def body_with_entries(entries_value, entries=ENTRIES, layers=2, topk=2, **over):
    """A turn whose output is `entries` (as the plain decode reads them), its output
    entries sent as `entries_value`."""
    rows = len(IDS) + len(entries) - 1
    body = with_bin(turn(IDS, [e[1] for e in entries], r3=r3_b64(rows, layers, topk),
                         start=0, event_id="e", **over))
    meta_of(body)["output_token_logprobs"] = entries_value
    return body


@pytest.mark.parametrize("width", [2, 3])
def test_packed_output_entries_are_read_and_stored_as_the_plain_decode(width):
    entries = [[*e, None] if width == 3 else e for e in ENTRIES]
    raw = msgspec.msgpack.encode(body_with_entries(packed_entries(entries), entries))
    plain = msgspec.msgpack.encode(body_with_entries(entries, entries))
    assert msgspec.msgpack.decode(raw) == msgspec.msgpack.decode(plain)
    buffer = bytearray(raw)
    value = msgpackio.loads(buffer)
    read = meta_of(value)["output_token_logprobs"]
    assert isinstance(read, OutputEntries) and read.width == width
    assert bytes(buffer) == raw
    assert as_list(msgpackio.loads(bytearray(raw))) == msgspec.msgpack.decode(raw)
    ours, theirs = parse_turn(value, DEFINITION), parse_turn(msgpackio.loads(plain), DEFINITION)
    assert ours.facts.output.tolist() == theirs.facts.output.tolist()
    assert ours.facts.logprobs == theirs.facts.logprobs
    assert ours.content() == theirs.content()
    # What is stored of it: the same JSON text, byte for byte.
    assert prepare_turn(ours, 2).head == prepare_turn(theirs, 2).head


def _entry(head: int, logprob: bytes, token: bytes, third: bytes = b"") -> bytes:
    return bytes((head,)) + logprob + token + third


F64 = b"\xcb" + struct.pack(">d", -0.5)
U32 = b"\xce" + struct.pack(">I", 3001)


@pytest.mark.parametrize(("odd", "why", "refused"), [
    (_entry(0x92, b"\xca" + struct.pack(">f", -0.5), U32), "a float32 log-prob", False),
    (_entry(0x92, b"\x00", U32), "an integer log-prob", False),
    (_entry(0x92, F64, b"\xcd" + struct.pack(">H", 3001)), "a uint16 id", False),
    (_entry(0x93, F64, U32, b"\xc0"), "one entry of three among pairs", False),
    (_entry(0x92, b"\xcb" + struct.pack(">d", float("inf")), U32), "an infinity", True),
    (_entry(0x92, F64, b"\xce" + struct.pack(">I", TOKEN_MAX + 1)), "an id out of range",
     False),
])
def test_any_other_entry_is_decoded_as_it_comes(odd, why, refused):
    items = [_entry(0x92, F64, U32)] * 19 + [odd]
    raw = msgspec.msgpack.encode(body_with_entries(msgspec.Raw(
        struct.pack(">BI", 0xDD, 20) + b"".join(items)), [[-0.5, 3001]] * 20))
    if refused:  # as the plain decode refuses it
        with pytest.raises(InvalidRequest, match="non-finite"):
            msgpackio.loads(bytearray(raw))
        return
    value = msgpackio.loads(bytearray(raw))
    assert type(meta_of(value)["output_token_logprobs"]) is list, why
    assert as_list(value) == msgspec.msgpack.decode(raw)


def test_entries_with_a_third_item_that_is_not_null_are_decoded_as_they_come():
    entries = [[*e, "tok"] for e in ENTRIES]
    items = [struct.pack(">BBdBI", 0x93, 0xCB, e[0], 0xCE, e[1]) + b"\xa3tok" for e in entries]
    raw = msgspec.msgpack.encode(body_with_entries(msgspec.Raw(
        struct.pack(">BI", 0xDD, len(items)) + b"".join(items)), entries))
    value = msgpackio.loads(bytearray(raw))
    assert meta_of(value)["output_token_logprobs"] == entries
