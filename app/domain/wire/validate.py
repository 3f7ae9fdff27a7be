"""The validation kit: the input rules every parser of the domain shares.

Owns the checks that used to be copied from parser to parser: JSON types
(`require_object`, `is_int`, `require_bool`), unknown fields, storable text
("UTF-8 text of N-M characters without NUL", `require_text`), finite numbers
(`finite_float`), identifier patterns matched in full (`IdPattern`: never
`^…$` with `re.match`, which accepts a trailing newline), and the short
`actual` a problem body shows (`describe`). Each failure is an
`InvalidRequest` naming `field`, `expected` and `actual`.

Refuses to own any endpoint's rules: which fields a body has, their ranges
and defaults are the parsers' (`session.py`, `turn.py`, `metric_history.py`,
`gate_definitions.py`, `queries.py`). Pure: no I/O.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, TypeGuard

import msgspec

from app.domain.errors import InvalidRequest

TEXT_MAX = 1024
# The largest token id (the stored prompt holds int32).
TOKEN_MAX = (1 << 31) - 1


def is_int(value: Any) -> TypeGuard[int]:
    """A JSON integer; booleans are not, although Python makes them ints."""
    return isinstance(value, int) and not isinstance(value, bool)


# bool before int: Python makes booleans ints, JSON does not.
_JSON_TYPES: tuple[tuple[type, str], ...] = (
    (bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"),
    (list, "array"), (dict, "object"),
)


def type_name(value: Any) -> str:
    """The JSON type of a parsed value (`object`, `array`, …)."""
    if value is None:
        return "null"
    for kind, name in _JSON_TYPES:
        if isinstance(value, kind):
            return name
    return type(value).__name__


def describe(value: Any) -> Any:
    """A short `actual` for problem bodies: scalars as-is, containers by type."""
    if value is None or isinstance(value, bool | int | float):
        return value
    if isinstance(value, str):
        return value if len(value) <= 80 else value[:77] + "..."
    return type_name(value)


def require_object(value: Any, field_name: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise InvalidRequest(
            f"{field_name} must be a JSON object",
            field=field_name,
            expected="object",
            actual=type_name(value),
        )
    return value


def require_member(body: dict[str, Any], key: str, field_name: str) -> dict[str, Any]:
    """`body[key]`, which must be an object; a missing key is reported `absent`,
    never as `null` (which would tell the sender to change a value it never sent)."""
    if key not in body:
        raise InvalidRequest(
            f"{field_name} is missing",
            field=field_name,
            expected="object",
            actual="absent",
        )
    return require_object(body[key], field_name)


def reject_unknown(body: dict[str, Any], allowed: frozenset[str], where: str) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        name = unknown[0] if not where else f"{where}.{unknown[0]}"
        raise InvalidRequest(
            f"unknown field {name!r}",
            field=name,
            expected=f"one of {sorted(allowed)}",
            actual=unknown[0],
        )


def require_bool(value: Any, field_name: str) -> bool:
    if not isinstance(value, bool):
        raise InvalidRequest(f"{field_name} must be a boolean", field=field_name,
                             expected="boolean", actual=describe(value))
    return value


def is_text_safe(value: str) -> bool:
    """Storable as database text on every backend: no NUL, encodable as UTF-8
    (PostgreSQL refuses both a NUL and a lone surrogate)."""
    if "\x00" in value:
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def require_text(value: Any, field_name: str, max_len: int = TEXT_MAX, *,
                 min_len: int = 0) -> str:
    """A string of `min_len`-`max_len` characters, storable as database text."""
    if (not isinstance(value, str) or not min_len <= len(value) <= max_len
            or not is_text_safe(value)):
        expected = f"UTF-8 text of {min_len}-{max_len} characters without NUL"
        raise InvalidRequest(f"{field_name} must be {expected}", field=field_name,
                             expected=expected, actual=describe(value))
    return value


def as_float(value: Any) -> float | None:
    """A JSON number (not a boolean) as float64; None for anything else,
    including integers beyond the float64 range."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        return float(value)
    except OverflowError:  # an int beyond float64
        return None


def finite_float(value: Any) -> float | None:
    """`as_float`, and None for NaN and the infinities too."""
    number = as_float(value)
    return number if number is not None and math.isfinite(number) else None


# What msgspec's typed `convert` raises for a value it refuses: its validation error, or
# UnicodeEncodeError while wording one that quotes a lone surrogate (a JSON escape that
# has no UTF-8 form).
CONVERT_REFUSED = (msgspec.ValidationError, UnicodeEncodeError)


def finite_mean(values: Sequence[float]) -> float:
    """The mean of finite float64 values (at least one), correctly rounded by `fsum`, and
    finite also where their sum is past float64 (rewards, baselines near ±1.8e308): then
    the values are scaled down by a power of two (exact) so that the sum fits."""
    try:
        return math.fsum(values) / len(values)
    except OverflowError:
        scale = 2.0 ** len(values).bit_length()  # the sum of n values ≤ max, over 2^k ≥ n
        return math.fsum(v / scale for v in values) / len(values) * scale


@dataclass(frozen=True)
class IdPattern:
    """An identifier rule: 1-`max_len` characters of `chars`, matched in full."""

    chars: str
    max_len: int

    @property
    def expected(self) -> str:
        return f"{self.chars}{{1,{self.max_len}}}"

    @cached_property
    def regex(self) -> re.Pattern[str]:
        return re.compile(self.expected)

    def matches(self, value: Any) -> bool:
        # fullmatch: `^…$` with re.match would also accept a trailing "\n".
        return isinstance(value, str) and self.regex.fullmatch(value) is not None

    def require(self, value: Any, field_name: str, noun: str) -> str:
        if not self.matches(value):
            raise InvalidRequest(f"{noun} must be 1-{self.max_len} characters of {self.chars}",
                                 field=field_name, expected=self.expected,
                                 actual=describe(value))
        return value


SESSION_ID = IdPattern("[A-Za-z0-9._:-]", 128)
LABEL_KEY = IdPattern("[A-Za-z0-9._:-]", 64)
