"""The validation kit and the parsers built on it: one rule each, matched in full."""

from __future__ import annotations

import pytest

from app.domain.body.labels import LabelFilters, parse_label_filters, parse_labels
from app.domain.body.queries import FEED_PAGE, GROUP_BY_VALUES, parse_group_by, parse_wait
from app.domain.body.session import parse_open
from app.domain.ci.gate_definitions import parse_check
from app.domain.ci.metric_history import parse_rollout_record
from app.domain.errors import InvalidRequest
from app.domain.wire.validate import (
    LABEL_KEY,
    SESSION_ID,
    finite_float,
    require_text,
)
from app.settings import parse_api_tokens

COORD = {"test_path": "t", "backend": "b", "suite": "s"}


def field_of(call, *args) -> str | None:
    with pytest.raises(InvalidRequest) as info:
        call(*args)
    return info.value.field


@pytest.mark.parametrize("pattern", [SESSION_ID, LABEL_KEY])
def test_id_patterns_match_in_full(pattern) -> None:
    assert pattern.matches("run.7:a-b_c")
    # `^...$` with re.match accepts a trailing newline; a full match does not.
    for bad in ("run\n", "\nrun", "", "a b", "x" * (pattern.max_len + 1), None, 7):
        assert not pattern.matches(bad), bad
    assert pattern.matches("x" * pattern.max_len)


def test_a_trailing_newline_is_refused_in_ids_label_keys_and_filters() -> None:
    assert field_of(parse_open, {"version": "v2", "session_id": "s1\n"}) == "session_id"
    assert field_of(parse_labels, {"run\n": "x"}) == "labels.run\n"
    assert field_of(parse_label_filters, {"run\n": "x"}) == "run\n"


def test_api_tokens_are_matched_in_full() -> None:
    token = "a" * 16
    assert parse_api_tokens(f"{token}:read") == {token: "read"}
    with pytest.raises(ValueError):
        parse_api_tokens(f"{token}\n:read")


@pytest.mark.parametrize(("value", "ok"), [
    ("", True), ("x" * 8, True), ("x" * 9, False), ("a\x00b", False), ("\ud800", False),
    (3, False), (None, False),
])
def test_text_is_utf8_bounded_and_without_nul(value, ok) -> None:
    if ok:
        assert require_text(value, "f", 8) == value
    else:
        with pytest.raises(InvalidRequest) as info:
            require_text(value, "f", 8)
        assert info.value.field == "f"
        assert info.value.expected == "UTF-8 text of 0-8 characters without NUL"


def test_min_len_one_refuses_the_empty_string() -> None:
    with pytest.raises(InvalidRequest) as info:
        require_text("", "run_id", 256, min_len=1)
    assert info.value.expected == "UTF-8 text of 1-256 characters without NUL"


@pytest.mark.parametrize(("value", "expected"), [
    (1, 1.0), (0.5, 0.5), (-2, -2.0), (True, None), ("1", None), (None, None),
    (float("nan"), None), (float("inf"), None), (10 ** 400, None),
])
def test_finite_float(value, expected) -> None:
    assert finite_float(value) == expected


def test_label_filters_compare_label_text() -> None:
    filters = parse_label_filters({"rollout_id": 12, "run_id": "r7", "k": [1, 2]})
    assert filters == LabelFilters((("rollout_id", "12"), ("run_id", "r7"), ("k", "[1,2]")))
    assert not parse_label_filters({})


def test_group_by_is_one_list() -> None:
    from app.store.read.analytics import GROUP_COLUMN

    assert tuple(GROUP_COLUMN) == GROUP_BY_VALUES
    for value in GROUP_BY_VALUES:
        assert parse_group_by(value) == value
    assert field_of(parse_group_by, "week") == "group_by"
    assert field_of(parse_group_by, None) == "group_by"


def test_query_limits_and_wait() -> None:
    assert FEED_PAGE.parse(None) == FEED_PAGE.default
    assert FEED_PAGE.parse(10 ** 9) == FEED_PAGE.maximum
    assert field_of(FEED_PAGE.parse, 0) == "limit"
    assert parse_wait(1e9) == 30.0
    assert field_of(parse_wait, float("nan")) == "wait"


def test_gate_check_is_parsed_whole_in_the_domain() -> None:
    check = parse_check({"coordinate": COORD, "run_id": "r1", "record": False,
                         "specs": [{"metric": "train/ppo_kl"}, {"metric": "train/ppo_kl"}]})
    assert (check.run_id, check.record, len(check.gates)) == ("r1", False, 1)
    assert field_of(parse_check, {"coordinate": COORD, "run_id": ""}) == "run_id"
    assert field_of(parse_check, {"coordinate": COORD, "run_id": "r", "record": 1}) == "record"


def test_rollout_record_is_parsed_before_any_read() -> None:
    body = {"coordinate": COORD, "run_id": "r1", "attempt": 0, "step": 3,
            "labels": {"rollout_id": 12}}
    record = parse_rollout_record(body)
    assert record.step == 3 and not record.trusted
    assert record.labels == LabelFilters((("rollout_id", "12"),))
    assert field_of(parse_rollout_record, {**body, "labels": {"bad key": 1}}) == "bad key"
    without_step = {k: v for k, v in body.items() if k != "step"}
    assert field_of(parse_rollout_record, without_step) == "step"
    assert field_of(parse_rollout_record, {**body, "step": -1}) == "step"
    assert field_of(parse_rollout_record, {**body, "attempt": None}) == "attempt"
    points = record.submission({"rollout/raw_reward": 0.5, "other": 1.0}).points
    assert [(p.metric, p.step, p.value) for p in points] == [("rollout/raw_reward", 3, 0.5)]
