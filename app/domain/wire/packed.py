"""Packed MessagePack arrays: long lists of a turn written item by item at fixed width.

Owns the two encodings a MessagePack turn may use for its long lists, and reading
them from a body's bytes with numpy, with no Python object per item:

- a prompt (`record.request.input_ids`): an array 16 or 32 of uint32 items
  (`0xce` and 4 big-endian bytes each);
- output entries (`meta_info.output_token_logprobs`): an array 16 or 32 of
  `[logprob, token_id]` items, each a fixarray of 2 (`0x92`), a float64
  (`0xcb`, 8 bytes) and a uint32 — or of 3 (`0x93`) with a nil (`0xc0`) third,
  as SGLang writes `[logprob, token_id, null]`.

Both are ordinary MessagePack (fixed width is allowed, if not the shortest), so
any decoder reads the same lists; a list in any other encoding is simply not
packed, and is decoded as it comes. Only lists of at least `MIN_ITEMS` items,
ids in [0, TOKEN_MAX] and finite log-probs are read here: anything else is left
to the decoder and the turn's validation, which name what is wrong. Pure; which
body holds them is `msgpackio`'s business.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from app.domain.wire.validate import TOKEN_MAX

MIN_ITEMS = 16  # shorter lists decode as they come: nothing to gain
_ARRAY_HEADERS = {0xDC: 3, 0xDD: 5}  # array 16, array 32: header bytes
_ID_ITEM = np.dtype([("tag", "u1"), ("id", ">u4")])
_ENTRY_ITEMS = {
    2: np.dtype([("head", "u1"), ("float", "u1"), ("logprob", ">f8"),
                 ("tag", "u1"), ("id", ">u4")]),
    3: np.dtype([("head", "u1"), ("float", "u1"), ("logprob", ">f8"),
                 ("tag", "u1"), ("id", ">u4"), ("nil", "u1")]),
}
_UINT32, _FLOAT64, _NIL = 0xCE, 0xCB, 0xC0
_FIXARRAY = 0x90


@dataclass(frozen=True, eq=False)
class OutputEntries:
    """Packed `output_token_logprobs`, read: `[logprob, token_id]` per entry, or
    `[logprob, token_id, None]` when `width` is 3."""

    logprobs: np.ndarray  # float64
    ids: np.ndarray  # int64, each in [0, TOKEN_MAX]
    width: int

    def __len__(self) -> int:
        return int(self.ids.size)

    def as_lists(self) -> list[list[Any]]:
        """The entries as the decoder would have made them."""
        return list(map(list, self.as_items()))

    def as_items(self) -> list[tuple[Any, ...]]:
        """The entries as tuples, which JSON writes as it writes the lists (half the
        CPU of making the lists, for a value only written)."""
        columns = [self.logprobs.tolist(), self.ids.tolist()]
        if self.width == 3:
            columns.append([None] * len(self))
        return list(zip(*columns, strict=True))


def _header(span: np.ndarray) -> int:
    """The bytes of the array 16/32 header `span` starts with (0: not one, or no item
    follows it)."""
    header = _ARRAY_HEADERS.get(int(span[0]), 0) if span.size else 0
    return header if span.size > header else 0


def _items(span: np.ndarray, header: int, item: np.dtype) -> np.ndarray | None:
    """The items after `header`, if there are at least `MIN_ITEMS` and they fill `span`
    exactly at `item`'s width."""
    count = int.from_bytes(span[1:header].tobytes(), "big")
    if count < MIN_ITEMS or span.size != header + item.itemsize * count:
        return None
    return np.frombuffer(span, item, count, header)


def prompt(span: np.ndarray) -> np.ndarray | None:
    """A packed prompt's ids (int64), or None: not one, or an id out of range."""
    header = _header(span)
    items = _items(span, header, _ID_ITEM) if header else None
    if items is None or not (items["tag"] == _UINT32).all() \
            or int(items["id"].max()) > TOKEN_MAX:
        return None
    return items["id"].astype(np.int64)


def output_entries(span: np.ndarray) -> OutputEntries | None:
    """Packed output entries, or None: not packed, an id out of range or a log-prob
    that is not finite."""
    header = _header(span)
    width = int(span[header]) - _FIXARRAY if header else 0
    item = _ENTRY_ITEMS.get(width)
    items = None if item is None else _items(span, header, item)
    if items is None:
        return None
    shaped = (items["head"] == _FIXARRAY + width) & (items["float"] == _FLOAT64) \
        & (items["tag"] == _UINT32)
    if width == 3:
        shaped &= items["nil"] == _NIL
    logprobs = items["logprob"].astype(np.float64)
    if not shaped.all() or int(items["id"].max()) > TOKEN_MAX \
            or not np.isfinite(logprobs).all():
        return None
    return OutputEntries(logprobs, items["id"].astype(np.int64), width)
