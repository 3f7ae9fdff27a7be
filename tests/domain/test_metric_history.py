"""Specification of the metric-history submission, value encoding, whitelist and merge."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from app.domain.ci.metric_history import (
    DEFAULT_METRIC_KEYS,
    MetricPoint,
    RunCoordinate,
    decode_value,
    encode_series,
    encode_value,
    keep_whitelisted,
    merge_attempts,
    parse_submission,
    rollout_points,
)
from app.domain.errors import InvalidRequest
from app.domain.wire.jsonio import dumps

V1_TEXT = "rollout/tito_session_mismatch_rate/v1/assistant_text"
V2_TEXT = "rollout/tito_session_mismatch_rate/v2/assistant_text"


def body(**overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "coordinate": {"test_path": "tests/e2e/test_grpo.py", "backend": "cuda",
                       "suite": "stage-c"},
        "run_id": "run-7",
        "attempt": 0,
        "trusted": True,
        "points": [{"metric": "train/grad_norm", "step": 0, "value": 1.5}],
    }
    base.update(overrides)
    return base


def point(value: Any = 1.0, step: Any = 0, metric: str = "train/grad_norm") -> dict[str, Any]:
    return {"metric": metric, "step": step, "value": value}


def rejected_field(raw: Any) -> str | None:
    with pytest.raises(InvalidRequest) as info:
        parse_submission(raw)
    return info.value.field


def test_a_valid_submission_parses_into_coordinate_run_attempt_and_points() -> None:
    sub = parse_submission(body())
    assert sub.coordinate == RunCoordinate("tests/e2e/test_grpo.py", "cuda", "stage-c")
    assert (sub.run_id, sub.attempt, sub.trusted) == ("run-7", 0, True)
    assert sub.points == (MetricPoint("train/grad_norm", 0, 1.5),)


@pytest.mark.parametrize(("text", "check"), [
    ("NaN", math.isnan),
    ("Infinity", lambda v: v == math.inf),
    ("-Infinity", lambda v: v == -math.inf),
])
def test_non_finite_values_are_written_as_their_marker_strings(text: str, check: Any) -> None:
    sub = parse_submission(body(points=[point(text)]))
    assert check(sub.points[0].value)


@pytest.mark.parametrize("value", ["abc", "nan", "inf", "", None, [1.0], {"v": 1}])
def test_a_non_numeric_value_is_rejected_naming_the_point(value: Any) -> None:
    assert rejected_field(body(points=[point(), point(value)])) == "points[1].value"


@pytest.mark.parametrize("value", [True, False])
def test_a_boolean_is_not_a_numeric_value(value: bool) -> None:
    assert rejected_field(body(points=[point(value)])) == "points[0].value"


def test_an_integer_beyond_float64_is_rejected_not_crashed() -> None:
    assert rejected_field(body(points=[point(10 ** 400)])) == "points[0].value"


def test_integer_values_are_numbers() -> None:
    assert parse_submission(body(points=[point(3)])).points[0].value == 3.0


def test_a_missing_value_is_rejected() -> None:
    raw = body(points=[{"metric": "train/grad_norm", "step": 0}])
    assert rejected_field(raw) == "points[0].value"


def test_a_null_step_is_a_step_less_point() -> None:
    assert parse_submission(body(points=[point(step=None)])).points[0].step is None


def test_the_step_key_is_required_even_when_null() -> None:
    raw = body(points=[{"metric": "train/grad_norm", "value": 1.0}])
    assert rejected_field(raw) == "points[0].step"


@pytest.mark.parametrize("step", [-1, True, 1.0, "3"])
def test_a_step_must_be_a_non_negative_integer(step: Any) -> None:
    assert rejected_field(body(points=[point(step=step)])) == "points[0].step"


@pytest.mark.parametrize("attempt", [-1, True, 1.5, None, "0"])
def test_attempt_must_be_a_non_negative_integer(attempt: Any) -> None:
    assert rejected_field(body(attempt=attempt)) == "attempt"


def test_trusted_defaults_to_false() -> None:
    raw = body()
    del raw["trusted"]
    assert parse_submission(raw).trusted is False


def test_trusted_must_be_a_boolean() -> None:
    assert rejected_field(body(trusted=1)) == "trusted"


@pytest.mark.parametrize("name", ["test_path", "backend", "suite"])
def test_each_coordinate_field_is_a_non_empty_string(name: str) -> None:
    raw = body()
    raw["coordinate"][name] = ""
    assert rejected_field(raw) == f"coordinate.{name}"


def test_unknown_fields_are_rejected_at_every_level() -> None:
    assert rejected_field(body(extra=1)) == "extra"
    raw = body(points=[{**point(), "wall": 3}])
    assert rejected_field(raw) == "points[0].wall"


def test_points_must_be_a_list() -> None:
    assert rejected_field(body(points={"a": 1})) == "points"


def test_every_point_is_validated_even_outside_the_whitelist() -> None:
    raw = body(points=[point("oops", metric="perf/step_time")])
    assert rejected_field(raw) == "points[0].value"


def test_the_normalized_body_is_strict_json_with_markers() -> None:
    sub = parse_submission(body(points=[point("NaN"), point("-Infinity", step=1)]))
    text = dumps(sub.body())
    assert json.loads(text)["points"][0]["value"] == "NaN"
    assert json.loads(text)["points"][1]["value"] == "-Infinity"


@given(st.floats(allow_nan=True, allow_infinity=True))
def test_encoding_then_decoding_a_value_is_lossless(value: float) -> None:
    back = decode_value(encode_value(value))
    assert (math.isnan(back) and math.isnan(value)) or back == value


def test_encoded_series_keep_steps_and_mark_non_finite_values() -> None:
    assert encode_series([(0, 1.0), (None, math.inf)]) == [[0, 1.0], [None, "Infinity"]]


def test_the_default_whitelist_is_the_seven_gate_metrics() -> None:
    assert set(DEFAULT_METRIC_KEYS) == {
        "train/grad_norm", "train/ppo_kl", "train/train_rollout_logprob_abs_diff",
        "train/train_rollout_kl", "rollout/raw_reward", V1_TEXT, V2_TEXT,
    }


def test_the_whitelist_keeps_only_listed_keys_in_order() -> None:
    points = [MetricPoint("perf/tokens_per_s", 0, 9.0), MetricPoint("train/ppo_kl", 0, 0.1),
              MetricPoint(V2_TEXT, 0, 0.0)]
    assert keep_whitelisted(points) == (points[1], points[2])


def test_the_whitelist_is_configurable() -> None:
    points = [MetricPoint("perf/tokens_per_s", 0, 9.0), MetricPoint("train/ppo_kl", 0, 0.1)]
    assert keep_whitelisted(points, {"perf/tokens_per_s"}) == (points[0],)


def test_whitelist_matching_is_exact_with_no_normalization() -> None:
    points = [MetricPoint("Train/Grad_Norm", 0, 1.0), MetricPoint(" train/grad_norm", 0, 1.0)]
    assert keep_whitelisted(points) == ()


def test_merge_concatenates_attempts_and_sorts_by_step_with_step_less_points_last() -> None:
    first = {"train/ppo_kl": [(2, 0.2), (None, 9.0)]}
    second = {"train/ppo_kl": [(0, 0.0), (1, 0.1)]}
    assert merge_attempts([first, second]) == {
        "train/ppo_kl": [(0, 0.0), (1, 0.1), (2, 0.2), (None, 9.0)]}


def test_merge_keeps_repeated_steps_in_attempt_order() -> None:
    merged = merge_attempts([{"m": [(1, 1.0)]}, {"m": [(1, 2.0)]}])
    assert merged == {"m": [(1, 1.0), (1, 2.0)]}


def test_v1_and_v2_series_never_merge() -> None:
    merged = merge_attempts([{V1_TEXT: [(0, 0.1)]}, {V2_TEXT: [(0, 0.2)]}])
    assert merged == {V1_TEXT: [(0, 0.1)], V2_TEXT: [(0, 0.2)]}


def test_a_submission_groups_its_points_per_metric_in_submission_order() -> None:
    sub = parse_submission(body(points=[point(1.0, 3), point(2.0, 1, "train/ppo_kl"),
                                        point(3.0, 2)]))
    assert sub.series() == {"train/grad_norm": [(3, 1.0), (2, 3.0)],
                            "train/ppo_kl": [(1, 2.0)]}


attempt_series = st.dictionaries(
    st.sampled_from(sorted(DEFAULT_METRIC_KEYS)),
    st.lists(st.tuples(st.integers(0, 50), st.floats(allow_nan=False)), max_size=5),
    max_size=3,
)


@given(st.lists(attempt_series, max_size=4), st.randoms())
def test_merge_is_order_independent_across_attempts_for_distinct_steps(
    attempts: list[dict[str, list[tuple[int, float]]]], rnd: Any
) -> None:
    seen: dict[str, set[int]] = {}
    distinct: list[dict[str, list[tuple[int | None, float]]]] = []
    for attempt in attempts:
        kept: dict[str, list[tuple[int | None, float]]] = {}
        for metric, series in attempt.items():
            steps = seen.setdefault(metric, set())
            for step, value in series:
                if step not in steps:
                    steps.add(step)
                    kept.setdefault(metric, []).append((step, value))
        distinct.append(kept)
    shuffled = list(distinct)
    rnd.shuffle(shuffled)
    assert merge_attempts(shuffled) == merge_attempts(distinct)


@given(st.lists(attempt_series, max_size=4))
def test_merge_keeps_every_point_exactly_once(
    attempts: list[dict[str, list[tuple[int, float]]]]
) -> None:
    merged = merge_attempts(attempts)
    for metric in {m for a in attempts for m in a}:
        expected = sorted(p for a in attempts for p in a.get(metric, []))
        assert sorted(merged[metric]) == expected
        assert [s for s, _ in merged[metric]] == sorted(s for s, _ in expected)


def test_rollout_metrics_become_whitelisted_points_of_one_step() -> None:
    metrics = {"sessions": 4, V1_TEXT: 0.25, "rollout/response_len/mean": 10.0,
               "rollout/raw_reward": 1}
    assert rollout_points(metrics, 12) == (
        MetricPoint("rollout/raw_reward", 12, 1.0), MetricPoint(V1_TEXT, 12, 0.25))


def test_rollout_points_take_a_configurable_whitelist() -> None:
    metrics = {"rollout/response_len/mean": 10.0, "rollout/raw_reward": 1.0}
    assert rollout_points(metrics, 3, {"rollout/response_len/mean"}) == (
        MetricPoint("rollout/response_len/mean", 3, 10.0),)
