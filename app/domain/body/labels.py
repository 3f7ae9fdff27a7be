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

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

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
