"""Refusals that name what is wrong: a body holding a non-finite number (NaN, ±Infinity, a
float past float64) names the field where it stands, with what was expected (the rule
every JSON route shares, `jsonio.loads`; oracle: the path written by hand for each
body); an event id that is there but not valid is not called missing."""

from __future__ import annotations

import pytest

from app.domain.body.turn import parse_event_id
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


@pytest.mark.parametrize(("body", "says"), [
    ({}, "event_id is required"),
    ({"event_id": None}, "event_id is required"),
    ({"event_id": "e" * 129}, "event_id must be a printable string of 1-128 characters"),
    ({"event_id": "a\x00b"}, "event_id must be a printable string"),
    ({"event_id": 7}, "event_id must be a printable string"),
])
def test_an_event_id_refusal_says_what_is_wrong(body: dict[str, object], says: str) -> None:
    """A missing id is 'required'; one that is there but not valid says what it must be
    (it said 'required' for both)."""
    with pytest.raises(InvalidRequest) as caught:
        parse_event_id(body)
    assert caught.value.detail.startswith(says) and caught.value.field == "event_id"


def test_a_conflict_whose_stored_open_is_unknown_names_the_body():
    from app.domain.body.session import open_conflict, parse_open

    given = parse_open({"session_id": "s", "version": "v2", "labels": {"run_id": "b"}})
    conflict = open_conflict(None, given)
    assert (conflict.status, conflict.field) == (409, "body")
    stored = parse_open({"session_id": "s", "version": "v2", "labels": {"run_id": "a"}})
    assert open_conflict(stored, given).field == "labels.run_id"
