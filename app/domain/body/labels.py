"""Session labels: the open body's `labels` and the label filters of the reads.

Owns the one label rule: a label key is 1-64 characters of
`[A-Za-z0-9._:-]`, a label value is any JSON value whose text form
(`label_text`: strings as-is, other values as canonical JSON) is storable
text of at most 1024 characters. Filters (`run_id=run7&rollout_id=12`, or
the `labels` object of `POST /v1/metric-history/rollout`) are parsed into
`LabelFilters` and matched against that text form, so `{"rollout_id": 12}`
matches the query `rollout_id=12`. The store only turns parsed filters into
SQL. Pure: no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from app.domain.body.queries import repeated_parameter
from app.domain.errors import InvalidRequest
from app.domain.wire.jsonio import canonical
from app.domain.wire.validate import LABEL_KEY, require_object, require_text


def label_text(value: Any) -> str:
    """A label value as filters see it: JSON text, strings without quotes."""
    return value if isinstance(value, str) else canonical(value)


def parse_labels(raw: Any, field_name: str = "labels") -> dict[str, Any]:
    """The open body's `labels` (absent/null = none), values kept as sent."""
    labels = {} if raw is None else require_object(raw, field_name)
    for key, value in labels.items():
        LABEL_KEY.require(key, f"{field_name}.{key}", "label names")
        require_text(label_text(value), f"{field_name}.{key}")
    return labels


@dataclass(frozen=True)
class LabelFilters:
    """Parsed filters: each `(key, text)` must match a label of the session."""

    pairs: tuple[tuple[str, str], ...] = ()

    def __iter__(self) -> Iterator[tuple[str, str]]:
        return iter(self.pairs)

    def __bool__(self) -> bool:
        return bool(self.pairs)


def parse_label_filters(raw: Mapping[str, Any]) -> LabelFilters:
    """Query parameters (text) or a JSON object (any values, compared as label text).

    The field of an error is the filter's own name, as the query spells it.
    """
    pairs = []
    for key, value in raw.items():
        LABEL_KEY.require(key, key, "label filter names")
        pairs.append((key, require_text(label_text(value), key)))
    return LabelFilters(tuple(pairs))


def parse_query_label_filters(pairs: Iterable[tuple[str, str]],
                              known: frozenset[str]) -> LabelFilters:
    """A query string's label filters: every parameter but the route's own (`known`).
    A parameter given twice is refused, naming it: no session has two values of one
    label, and keeping one of them (the last, as the framework does) silently
    answered for another filter than the one asked."""
    pairs = list(pairs)
    repeated = repeated_parameter(pairs)
    if repeated is not None:
        raise repeated
    return parse_label_filters({k: v for k, v in pairs if k not in known})


# What separates the pairs of a label filter written as one line of text.
_PAIR_SEPARATORS = frozenset(" \t\r\n,&")
_JSON_STRING = json.JSONDecoder()


def _quoted_if_needed(value: str) -> str:
    if value and not any(c in _PAIR_SEPARATORS or c in "\"=" for c in value):
        return value
    return json.dumps(value, ensure_ascii=False)


def label_filter_text(filters: Mapping[str, str]) -> str:
    """Label filters as one line a person can edit (the web UI's filter field):
    `run_id=run7 task="a b"` — a value holding a separator, a quote or `=`, or none
    at all, written as a JSON string. `parse_label_filter_text` reads it back."""
    return " ".join(f"{key}={_quoted_if_needed(value)}" for key, value in filters.items())


def parse_label_filter_text(text: str, field_name: str = "labels") -> list[tuple[str, str]]:
    """`run_id=run7 task="a b"` → pairs: spaces, commas or `&` between pairs; a value
    in double quotes is a JSON string (so it may hold any of them). A pair without
    `=` or a quote left open is refused, naming the field."""
    def refused(why: str, actual: str) -> InvalidRequest:
        return InvalidRequest(f"{field_name}: {why}", field=field_name,
                              expected='key=value pairs, separated by spaces; a value with '
                                       'spaces, commas, & or quotes in double quotes: '
                                       'key="a b"', actual=actual[:80])

    pairs: list[tuple[str, str]] = []
    at, end = 0, len(text)
    while True:
        while at < end and text[at] in _PAIR_SEPARATORS:
            at += 1
        if at == end:
            return pairs
        stop = at
        while stop < end and text[stop] not in _PAIR_SEPARATORS and text[stop] != "=":
            stop += 1
        key = text[at:stop]
        if stop == end or text[stop] != "=" or not key:
            raise refused("expected key=value", text[at:stop + 1] or text[at:])
        at = stop + 1
        if at < end and text[at] == '"':
            try:
                value, at = _JSON_STRING.raw_decode(text, at)
                value.encode("utf-8")  # a lone surrogate escape (`"\ud800"`) is no text
            except (ValueError, UnicodeEncodeError):
                raise refused("a quoted value is not closed (or not a JSON string of text)",
                              text[stop + 1:]) from None
        else:
            stop = at
            while stop < end and text[stop] not in _PAIR_SEPARATORS:
                stop += 1
            value, at = text[at:stop], stop
        pairs.append((key, value))
