"""How many values a request body can decode into, counted before it is decoded.

A body's bytes say little about the memory its decoded form takes: a
MessagePack empty array is one byte and a Python list of ~64, so 40 MB of
them decode into 3.5 GB (JSON's `[],` into ~28× the body). Each decoded value
(container, map key or scalar) costs a slot and usually an object, so a body
that would decode into more than `MAX_VALUES` values is refused (413) before
the decoder allocates anything; the memory a decode may take is then bounded
by the body's bytes plus a fixed ~72 bytes per allowed value.

The count is an upper bound read from the raw bytes: for JSON the commas,
colons and opening brackets (separators inside strings included;
`count_bytes`); for MessagePack a walk over
the value headers (a string or bin payload is stepped over, never read). A
body shorter than the limit is never counted: every value takes at least one
byte; nor is a MessagePack body whose bytes outside one str or bin the caller
located (a turn's R3 payload) are fewer than the limit. Refuses to decode or
validate: malformed input is left to the decoder. Pure: no I/O.
"""

from __future__ import annotations

import numpy as np

from app.domain.errors import TooLarge

# A 128k-token prompt with 32k output log-prob pairs decodes into ~250k values.
MAX_VALUES = 2_000_000
# The bytes that may start a JSON value after the first: , : [ {
_JSON_SEPARATORS = tuple(b",:[{")
_SLICE = 1 << 20


def too_many_values(limit: int) -> TooLarge:
    return TooLarge(f"request body decodes into more than {limit} values",
                    field="body",
                    expected=f"at most {limit} JSON/MessagePack values "
                             "(containers, keys and scalars)",
                    actual=f"more than {limit}")


def check_json(raw: bytes | bytearray | str, limit: int = MAX_VALUES) -> None:
    """Refuse (413) a JSON body that may decode into more than `limit` values."""
    if len(raw) <= limit:
        return
    if isinstance(raw, str):
        bound = raw.count(",") + raw.count(":") + raw.count("[") + raw.count("{") + 1
    else:
        bound = count_bytes(raw, _JSON_SEPARATORS, limit) + 1
    if bound > limit:
        raise too_many_values(limit)


def count_bytes(raw: bytes | bytearray | memoryview, values: tuple[int, ...],
                stop: int) -> int:
    """How many bytes of `raw` are one of `values`; counting ends once over `stop`.

    numpy comparisons take a quarter of the time of `bytes.count` per value; in
    1 MiB slices the temporary masks stay small next to the body.
    """
    total = 0
    data = np.frombuffer(raw, dtype=np.uint8)
    for begin in range(0, len(data), _SLICE):
        part = data[begin:begin + _SLICE]
        total += sum(int(np.count_nonzero(part == value)) for value in values)
        if total > stop:
            break
    return total


def _fixed_sizes() -> tuple[int, ...]:
    """Bytes each MessagePack value takes, by its first byte (0: read its length)."""
    size = [0] * 256
    for b in range(0x00, 0x80):  # positive fixint
        size[b] = 1
    for b in range(0x80, 0xa0):  # fixmap, fixarray (their members follow)
        size[b] = 1
    for b in range(0xa0, 0xc0):  # fixstr
        size[b] = 1 + (b & 0x1f)
    for b in range(0xe0, 0x100):  # negative fixint
        size[b] = 1
    fixed = {0xc0: 1, 0xc2: 1, 0xc3: 1,  # nil, false, true
             0xca: 5, 0xcb: 9,  # float32, float64
             0xcc: 2, 0xcd: 3, 0xce: 5, 0xcf: 9,  # uint 8-64
             0xd0: 2, 0xd1: 3, 0xd2: 5, 0xd3: 9,  # int 8-64
             0xd4: 3, 0xd5: 4, 0xd6: 6, 0xd7: 10, 0xd8: 18,  # fixext 1-16
             0xdc: 3, 0xdd: 5, 0xde: 3, 0xdf: 5}  # array16/32, map16/32
    for b, n in fixed.items():
        size[b] = n
    return tuple(size)


_SIZE = _fixed_sizes()
# bin 8/16/32, str 8/16/32, ext 8/16/32: (bytes of the length field, bytes after it)
_SIZED = {0xc4: (1, 0), 0xc5: (2, 0), 0xc6: (4, 0), 0xd9: (1, 0), 0xda: (2, 0),
          0xdb: (4, 0), 0xc7: (1, 1), 0xc8: (2, 1), 0xc9: (4, 1)}


def msgpack_values(raw: bytes | bytearray | memoryview, stop: int) -> int:
    """The values in a MessagePack buffer, counted up to just past `stop`.

    MessagePack writes a container's members right after its header, so the
    value headers follow one another: one step per value, nesting untracked.
    Malformed bytes end the count (the decoder refuses them).
    """
    size, sized = _SIZE, _SIZED
    end = len(raw)
    pos = count = 0
    while pos < end and count <= stop:
        count += 1
        b = raw[pos]
        step = size[b]
        if step:
            pos += step
            continue
        if b not in sized:  # 0xc1 (never used)
            break
        width, extra = sized[b]
        length = int.from_bytes(raw[pos + 1:pos + 1 + width], "big")
        pos += 1 + width + extra + length
    return count


def check_msgpack(raw: bytes | bytearray | memoryview, limit: int = MAX_VALUES,
                  scalar: int = 0) -> None:
    """Refuse (413) a MessagePack body that decodes into more than `limit` values.

    `scalar`: the bytes (header included) of one str or bin value the caller
    found in `raw`, e.g. a turn's R3 bin: it is one value however long, and
    every other value takes at least one byte outside it, so when the rest is
    at most `limit - 1` bytes the walk cannot reach the limit and is skipped.
    """
    # Every value takes at least one byte (the `scalar` one all of its bytes).
    bound = len(raw) - scalar + 1 if scalar else len(raw)
    if bound > limit and msgpack_values(raw, limit) > limit:
        raise too_many_values(limit)
