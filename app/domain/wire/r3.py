"""Routed-experts (R3) codec: base64 int32 on the wire, narrowed bytes at rest.

Owns decoding and validating a turn's payload against its geometry
`[rows, num_layers, topk]`, narrowing to the smallest dtype that holds every
value (uint8 for <= 256 experts), and restoring the exact base64 text. Also
owns the narrowed wire's R3 bin (`NarrowR3`: a width byte, then the values at
that width), which a client may send instead of int32 bytes. Row
planning and assembly across a path live in `app/domain/projection/assembly.py`.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass

import numpy as np
import pybase64

from app.domain.errors import InvalidR3

WIRE_DTYPE = np.dtype("<i4")
DTYPES: dict[str, np.dtype] = {
    "u1": np.dtype("u1"),
    "u2": np.dtype("<u2"),
    "i4": np.dtype("<i4"),
}


@dataclass(frozen=True)
class Patch:
    """One turn's rows `[start, end)`, narrowed; `data` is C-ordered bytes."""

    start: int
    end: int
    num_layers: int
    topk: int
    dtype: str
    data: bytes

    @property
    def rows(self) -> int:
        return self.end - self.start

    @property
    def freed(self) -> bool:
        """Emptied by R3 retention: the geometry stays, the bytes are gone."""
        return not self.data and self.rows * self.num_layers * self.topk > 0

    def array(self) -> np.ndarray:
        """The patch as int32 `[rows, num_layers, topk]`."""
        narrow = np.frombuffer(self.data, dtype=DTYPES[self.dtype])
        return narrow.astype(WIRE_DTYPE).reshape(self.rows, self.num_layers, self.topk)

    def rows_array(self, row_from: int, row_to: int) -> np.ndarray:
        """Rows `[row_from, row_to)` of the patch as int32, widening only those rows."""
        per_row = self.num_layers * self.topk
        narrow = np.frombuffer(self.data, dtype=DTYPES[self.dtype])
        block = narrow[row_from * per_row:row_to * per_row]
        return block.astype(WIRE_DTYPE).reshape(row_to - row_from, self.num_layers, self.topk)

    def raw(self) -> bytes:
        """The patch as the wire's little-endian int32 bytes (a MessagePack bin)."""
        return self.array().tobytes()

    def base64(self) -> str:
        return pybase64.b64encode(self.array().data).decode("ascii")


def decode_payload(text: str, field: str) -> np.ndarray:
    """Strict, canonical base64 of little-endian int32 → flat int32 array.

    Canonical means re-encoding gives the same text back (so the record reads
    back byte-identical): standard alphabet, full padding, zero trailing bits.
    """
    return np.frombuffer(payload_bytes(text, field), dtype=WIRE_DTYPE)


def payload_bytes(text: str, field: str) -> bytes:
    """`decode_payload`'s bytes: the int32 values as a MessagePack bin carries them."""
    def invalid(why: str) -> InvalidR3:
        return InvalidR3(f"routed_experts is not valid base64: {why}", field=field,
                         expected="canonical padded standard base64 of little-endian int32",
                         actual=f"{len(text)} characters")

    if len(text) % 4:
        raise invalid("length is not a multiple of 4 (truncated?)")
    try:
        raw = pybase64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise invalid(str(exc)) from None
    tail = 3 - text.count("=", len(text) - 2)
    if base64.b64encode(raw[len(raw) - tail:]).decode("ascii") != text[-4:]:
        raise invalid("non-zero trailing bits")
    if len(raw) % 4:
        raise InvalidR3(
            "routed_experts is not a whole number of int32 values",
            field=field,
            expected="a byte length divisible by 4 (whole int32 values)",
            actual=f"{len(raw)} bytes",
        )
    return raw


def decode_raw(data: bytes | memoryview, field: str) -> np.ndarray:
    """Raw little-endian int32 bytes (a MessagePack bin) → flat int32 array, no copy."""
    if len(data) % 4:
        raise InvalidR3(
            "routed_experts is not a whole number of int32 values",
            field=field,
            expected="a byte length divisible by 4 (whole int32 values)",
            actual=f"{len(data)} bytes",
        )
    return np.frombuffer(data, dtype=WIRE_DTYPE)


# The narrowed wire's width byte → the dtype of the values after it.
WIDTHS: dict[int, str] = {1: "u1", 2: "u2", 4: "i4"}


class NarrowR3:
    """An R3 bin of the narrowed MessagePack wire (`msgpackio.NARROW_MEDIA_TYPE`): one
    byte giving the values' width (1: uint8, 2: little-endian uint16, 4:
    little-endian int32, as the plain wire), then the values. The same R3 as the
    int32 bytes of its widened values; a client narrows before sending so the body
    carries a quarter of the bytes when there are at most 256 experts.

    Holds the bin as decoded (bytes, or a read-only view of the request's body);
    judged only when its values are asked for, so a malformed one is refused
    where the plain wire's would be, in the same order.
    """

    __slots__ = ("data",)

    def __init__(self, data: bytes | memoryview) -> None:
        self.data = data

    def __repr__(self) -> str:
        return f"NarrowR3({len(self.data)} bytes)"

    def __len__(self) -> int:
        """The values' bytes: a bin of nothing, or of a width byte alone, is empty (as
        the text "" is); a bin with another first byte counts whole, to be refused."""
        valid = bool(self.data) and self.data[0] in WIDTHS
        return len(self.data) - valid

    def values(self, field: str) -> np.ndarray:
        """The flat values at their sent width, no copy; 422 for a width byte other
        than 1, 2 or 4, or a length that is not whole values."""
        if not self.data:
            return np.empty(0, WIRE_DTYPE)
        width = self.data[0]
        code = WIDTHS.get(width)
        if code is None:
            raise InvalidR3(
                f"routed_experts' first byte is {width}, not a value width",
                field=field,
                expected="a first byte of 1, 2 or 4 (uint8, uint16 or int32 values)",
                actual=width,
            )
        if (len(self.data) - 1) % width:
            raise InvalidR3(
                f"routed_experts is not a whole number of {width}-byte values",
                field=field,
                expected=f"1 + a multiple of {width} bytes",
                actual=f"{len(self.data)} bytes",
            )
        return np.frombuffer(self.data, dtype=DTYPES[code], offset=1)

    def int32(self) -> bytes:
        """The values as the plain wire's little-endian int32 bytes (for comparing with
        its base64 text); a malformed bin (refused by validation) gives its bytes as
        they are."""
        try:
            return self.values("routed_experts").astype(WIRE_DTYPE).tobytes()
        except InvalidR3:
            return bytes(self.data)


def narrow(values: np.ndarray) -> tuple[str, bytes]:
    """Smallest dtype holding every value exactly; negative values keep int32.

    One reduction decides it: read as uint32, a negative int32 is above 0xFFFF, so
    the unsigned maximum alone tells u1 / u2 / i4 apart. Then one converting pass.
    Values already narrowed (the narrowed wire's uint8 or uint16) are unsigned: their
    maximum decides, and uint8 values are kept as they are.
    """
    if values.size == 0:
        return "u1", b""
    assert values.dtype == WIRE_DTYPE or values.dtype.kind == "u", values.dtype
    if values.dtype == DTYPES["u1"]:  # the narrowed wire's bytes: nothing to reduce
        return "u1", values.tobytes()
    unsigned = values if values.dtype != WIRE_DTYPE else values.view(np.dtype("<u4"))
    hi = int(unsigned.max())
    code = "u1" if hi <= 0xFF else "u2" if hi <= 0xFFFF else "i4"
    if values.dtype == DTYPES[code]:
        return code, values.tobytes()
    return code, values.astype(DTYPES[code]).tobytes()


def infer_topk(count: int, rows: int, num_layers: int, field: str) -> int:
    per_row = rows * num_layers
    if per_row <= 0 or count % per_row or count == 0:
        raise InvalidR3(
            f"routed_experts holds {count} values, not divisible into "
            f"{rows} rows x {num_layers} layers x topk",
            field=field,
            expected=f"a positive multiple of {per_row} values",
            actual=count,
        )
    return count // per_row


def npy_header(shape: tuple[int, ...]) -> bytes:
    """The `.npy` (format 1.0) header for a C-ordered little-endian int32 array."""
    import io

    from numpy.lib import format as npy_format

    buf = io.BytesIO()
    npy_format.write_array_header_1_0(
        buf, {"descr": "<i4", "fortran_order": False, "shape": shape}
    )
    return buf.getvalue()
