"""The UI overviews' rules, against hand-computed values: a session's reward, the
list's sort and filters, off-policy lag, reward histograms and mismatch lines."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.domain.errors import InvalidRequest
from app.domain.projection.overview import (
    SampleFacts,
    mismatch_lines,
    newest_version,
    off_policy_lag,
    parse_list_view,
    reward_distribution,
    reward_number,
    session_overview,
)
from app.domain.wire.validate import finite_mean


def test_a_session_overview_agrees_on_one_reward_or_averages():
    same = session_overview([SampleFacts(1.0, 10, "completed"), SampleFacts(1, 20, "truncated")])
    assert (same.samples, same.reward, same.response_length) == (2, 1.0, 15.0)
    assert same.status_text == "completed 1 · truncated 1"
    mixed = session_overview([SampleFacts(0.0, 4, "completed"), SampleFacts(1.0, 4, "completed"),
                              SampleFacts("good", 4, "completed"), SampleFacts(True, 4,
                                                                                "completed")])
    assert mixed.reward == 0.5 and mixed.status_text == "completed"
    assert session_overview([]).reward is None
    assert session_overview([SampleFacts(None, 3, "aborted")]).reward is None


def test_the_list_view_sorts_known_values_first_and_filters():
    rows = [("a", session_overview([SampleFacts(0.5, 1, "completed")])),
            ("b", session_overview([])),
            ("c", session_overview([SampleFacts(0.9, 2, "truncated")])),
            ("d", session_overview([SampleFacts(0.1, 3, "completed")]))]
    order = lambda view: [k for k, _ in view.order(rows)]  # noqa: E731
    assert order(parse_list_view("reward", None, None, None)) == ["d", "a", "c", "b"]
    assert order(parse_list_view("-reward", None, None, None)) == ["c", "a", "d", "b"]
    assert order(parse_list_view("-response", "", "", "")) == ["d", "c", "a", "b"]
    assert order(parse_list_view(None, "0.2", "0.9", None)) == ["a", "c"]
    assert order(parse_list_view(None, " .2 ", "9e-1", None)) == ["a", "c"]
    assert order(parse_list_view(None, None, None, "truncated")) == ["c"]
    assert order(parse_list_view(None, None, None, None)) == ["a", "b", "c", "d"]


@pytest.mark.parametrize(("args", "field"), [
    (("colour", None, None, None), "sort"), ((None, "x", None, None), "reward_min"),
    ((None, None, "nan", None), "reward_max"), ((None, None, None, "lost"), "sample_status"),
    ((None, "1_0", None, None), "reward_min"), ((None, None, "١", None), "reward_max"),
    ((None, "1e999", None, None), "reward_min"), ((None, "0x1p3", None, None), "reward_min")])
def test_bad_list_parameters_name_themselves(args, field):
    with pytest.raises(InvalidRequest) as info:
        parse_list_view(*args)
    assert info.value.field == field


def test_off_policy_lag_counts_versions_behind_the_newest():
    newest = newest_version(["7", 9, "8", None, "v10"])
    assert newest == 9
    assert off_policy_lag(["7", "8"], newest) == 2
    assert off_policy_lag([9], newest) == 0
    assert off_policy_lag(["7", "beta"], newest) is None
    assert off_policy_lag([], newest) is None
    assert off_policy_lag(["7"], None) is None


def test_reward_histograms_share_one_range_and_count_every_reward():
    dist = reward_distribution([(["1", "2"], 0.0), (["2"], 1.0), (["2"], 0.5), (["1"], 0.25),
                                ([], 0.75), (["3"], None), (["3"], "n/a")], bins=4)
    assert (dist.low, dist.high, dist.unrewarded) == (0.0, 1.0, 2)
    by_version = {g.weight_version: g for g in dist.groups}
    assert [g.weight_version for g in dist.groups] == [None, "1", "2"]
    assert by_version["2"].histogram == [1, 0, 1, 1]  # 0.0, 0.5, 1.0 (the top edge counts in)
    assert by_version["1"].histogram == [0, 1, 0, 0] and by_version["1"].mean == 0.25
    assert sum(sum(g.histogram) for g in dist.groups) == 5
    single = reward_distribution([(["1"], 2.0), (["1"], 2.0)])
    assert single.groups[0].histogram[0] == 2


def test_rewards_at_the_edges_of_float64_still_make_a_histogram():
    """Finite rewards whose sum or range is beyond float64 (a §16 reward may be any
    finite number): the mean and the bins are still finite, every reward counted."""
    both = reward_distribution([(["1"], 1e308), (["1"], 1e308), (["1"], -1e308)], bins=4)
    group = both.groups[0]
    assert (both.low, both.high) == (-1e308, 1e308)
    assert group.histogram == [1, 0, 0, 2] and sum(group.histogram) == 3
    assert group.mean == pytest.approx(1e308 / 3)
    same = reward_distribution([(["1"], 1.7e308), (["1"], 1.7e308)])
    assert same.groups[0].mean == 1.7e308 and sum(same.groups[0].histogram) == 2


def test_rewards_a_few_subnormals_apart_still_make_a_histogram():
    """A range so small its bins underflow to 0 wide (ZeroDivisionError: a 500 on /ui)."""
    tiny = reward_distribution([(["1"], 5e-324), (["1"], 0.0), (["1"], 1e-323)], bins=4)
    assert (tiny.low, tiny.high) == (0.0, 1e-323)
    assert tiny.groups[0].histogram == [1, 0, 1, 1]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.floats(allow_nan=False, allow_infinity=False), min_size=1, max_size=40))
def test_a_mean_of_finite_rewards_is_finite_and_between_them(values):
    """Also where the sum is past float64 (the mean of three 1.797e308 overflowed)."""
    mean = finite_mean(values)
    assert math.isfinite(mean)
    assert min(values) <= mean <= max(values) or mean == pytest.approx(min(values))


@pytest.mark.parametrize("value", [10 ** 400, -(10 ** 400), float("nan"), float("inf"), True,
                                   "1.0", None])
def test_a_reward_float64_cannot_hold_is_no_number(value):
    # A close's metadata is free JSON: its reward may be an integer of 400 digits.
    assert reward_number(value) is None


def test_mismatch_lines_read_as_text():
    report = [{"type": "assistant_text", "segment_index": 1, "expected_text": "a",
               "actual_text": "b"}, {"type": "special_token_count"}, "odd"]
    assert mismatch_lines(report) == [
        "assistant_text at segment index 1 (expected_text: a; actual_text: b)",
        "special_token_count", "odd"]
    assert mismatch_lines(None) == []


@pytest.mark.parametrize(("text", "size"), [
    (None, 100), ("", 100), (" 7 ", 7), ("5000", 1000), ("+3", 3)])
def test_a_typed_page_size_reads_as_the_api_reads_it(text, size):
    from app.domain.body.queries import SESSIONS_PAGE

    assert SESSIONS_PAGE.parse_text(text) == size


@pytest.mark.parametrize("text", ["abc", "1_0", "١", "2.5", "0", "-1"])
def test_a_typed_page_size_that_is_not_one_names_limit(text):
    from app.domain.body.queries import SESSIONS_PAGE

    with pytest.raises(InvalidRequest) as info:
        SESSIONS_PAGE.parse_text(text)
    assert info.value.field == "limit"
