"""A body holding a non-finite number (NaN, ±Infinity, a float past float64) is refused
naming the field where it stands, with what was expected: the rule every JSON route
shares (`jsonio.loads`). Oracle: the path written by hand for each body."""

from __future__ import annotations

import pytest

from app.domain.errors import InvalidRequest
from app.domain.wire import jsonio


@pytest.mark.parametrize(("text", "field", "actual"), [
    ('{"event_id": "e", "reward": NaN}', "reward", "NaN"),
    ('{"event_id": "e", "reward": -Infinity}', "reward", "-Infinity"),
    ('{"event_id": "e", "reward": 1e400}', "reward", "1e400"),
    ('{"labels": {"a": 1, "x": Infinity}}', "labels.x", "Infinity"),
    ('{"records": [{"y": 1.5}, {"y": 2}, {"y": [0, NaN]}]}', "records[2].y[1]", "NaN"),
    ('[1, 2, -1e999]', "[2]", "-1e999"),
    ("NaN", "body", "NaN"),
    # The first in the document's order names the field.
    ('{"a": [1, {"b": NaN}], "c": Infinity}', "a[1].b", "NaN"),
])
def test_a_non_finite_number_is_refused_naming_its_field(text: str, field: str,
                                                          actual: str) -> None:
    for raw in (text, text.encode()):
        with pytest.raises(InvalidRequest) as caught:
            jsonio.loads(raw)
        error = caught.value
        assert (error.field, error.expected, error.actual) == (field, "a finite JSON number",
                                                               actual)


def test_finite_numbers_and_big_integers_are_kept() -> None:
    value = jsonio.loads('{"reward": 1e308, "n": ' + "9" * 400 + ', "f": -0.0}')
    assert value["reward"] == 1e308 and value["n"] == int("9" * 400)
