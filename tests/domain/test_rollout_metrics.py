"""Specification of the rollout metrics: TITO mismatch rates, strict check, spec rates."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from app.domain.body.specinfo import SpecInfo
from app.domain.body.turn import MISMATCH_TYPES
from app.domain.ci.rollout_metrics import (
    SampleRow,
    SessionRow,
    check_strict,
    rollout_metrics,
    spec_rates,
    strict_violations,
    tito_rates,
)
from app.domain.errors import StrictTito

P = "rollout/tito_session_mismatch_rate"


def entry(kind: str) -> dict[str, Any]:
    return {"type": kind, "segment_index": 1}


def test_rates_count_only_samples_that_sent_the_key() -> None:
    rates = tito_rates([("v1", []), ("v1", [entry("assistant_text")]), ("v1", None)])
    assert rates[f"{P}/v1"] == 0.5
    assert rates[f"{P}/v1/assistant_text"] == 0.5


def test_every_type_gets_a_key_for_a_present_version() -> None:
    rates = tito_rates([("v2", [])])
    assert rates == {f"{P}/v2": 0.0, **{f"{P}/v2/{kind}": 0.0 for kind in MISMATCH_TYPES}}


def test_v1_and_v2_never_share_a_key() -> None:
    rates = tito_rates([("v1", [entry("special_token_type")]), ("v2", []), ("v2", [])])
    assert rates[f"{P}/v1"] == 1.0 and rates[f"{P}/v2"] == 0.0
    assert rates[f"{P}/v1/special_token_type"] == 1.0
    assert rates[f"{P}/v2/special_token_type"] == 0.0


def test_a_version_without_any_mismatch_metadata_has_no_keys() -> None:
    assert tito_rates([("v1", None), ("v2", [])]).keys() == tito_rates([("v2", [])]).keys()
    assert tito_rates([("v1", None)]) == {}


def test_a_sample_counts_once_per_type_however_many_entries_it_has() -> None:
    rates = tito_rates([("v2", [entry("assistant_text"), entry("assistant_text")]),
                        ("v2", [])])
    assert rates[f"{P}/v2/assistant_text"] == 0.5


samples_st = st.lists(st.tuples(
    st.sampled_from(["v1", "v2"]),
    st.none() | st.lists(st.sampled_from(MISMATCH_TYPES).map(entry), max_size=4),
), max_size=30)


@given(samples_st)
def test_rates_are_fractions_of_counts_over_the_samples_that_sent_the_key(
    samples: list[tuple[str, list[dict[str, Any]] | None]]
) -> None:
    rates = tito_rates(samples)
    for version in ("v1", "v2"):
        sent = [m for v, m in samples if v == version and m is not None]
        if not sent:
            assert not any(k.startswith(f"{P}/{version}") for k in rates)
            continue
        assert rates[f"{P}/{version}"] == sum(1 for m in sent if m) / len(sent)
        for kind in MISMATCH_TYPES:
            hits = sum(1 for m in sent if any(e["type"] == kind for e in m))
            assert rates[f"{P}/{version}/{kind}"] == hits / len(sent)
    assert all(0.0 <= rate <= 1.0 for rate in rates.values())


def test_strict_violations_are_the_non_zero_strict_types_of_any_version() -> None:
    rates = tito_rates([("v1", [entry("special_token_count")]), ("v1", []),
                        ("v2", [entry("non_assistant_text"), entry("assistant_text")])])
    assert strict_violations(rates) == [(f"{P}/v1/special_token_count", 0.5),
                                        (f"{P}/v2/non_assistant_text", 1.0)]


def test_assistant_text_and_the_overall_rate_are_never_strict() -> None:
    rates = tito_rates([("v1", [entry("assistant_text")])])
    assert rates[f"{P}/v1"] == 1.0
    assert strict_violations(rates) == []


def test_strict_answers_409_naming_each_strict_key_and_rate() -> None:
    rates = tito_rates([("v1", [entry("special_token_type")]),
                        ("v2", [entry("special_token_count")])])
    with pytest.raises(StrictTito) as info:
        check_strict(rates)
    problem = info.value.problem()
    assert problem["status"] == 409 and problem["type"] == "urn:turnlog:strict-tito"
    assert problem["violations"] == [{"key": f"{P}/v1/special_token_type", "rate": 1.0},
                                     {"key": f"{P}/v2/special_token_count", "rate": 1.0}]
    assert f"{P}/v1/special_token_type" in problem["detail"]


def test_strict_passes_when_every_strict_rate_is_zero() -> None:
    check_strict(tito_rates([("v1", [entry("assistant_text")]), ("v2", [])]))


def test_spec_rates_are_ratios_of_sums_not_means_of_ratios() -> None:
    rates = spec_rates([SpecInfo(1, 2, 1, 2),
                        SpecInfo(9, 10, 9, 90)])
    assert rates == {"rollout/spec_accept_rate": 10 / 12,
                     "rollout/spec_accept_length": 92 / 10}


def test_spec_rates_are_zero_on_zero_denominators() -> None:
    assert spec_rates([SpecInfo()]) == {"rollout/spec_accept_rate": 0.0,
                                           "rollout/spec_accept_length": 0.0}


@given(st.lists(st.tuples(*[st.integers(0, 10 ** 6)] * 4), min_size=1, max_size=10))
def test_spec_rates_sum_the_four_counters_then_divide(
    counters: list[tuple[int, int, int, int]]
) -> None:
    rates = spec_rates(SpecInfo(*c) for c in counters)
    correct, proposed, verify, completion = (sum(c[i] for c in counters) for i in range(4))
    assert rates["rollout/spec_accept_rate"] == (correct / proposed if proposed else 0.0)
    assert rates["rollout/spec_accept_length"] == (completion / verify if verify else 0.0)


def test_carriers_come_from_the_session_metrics_wire_form() -> None:
    carrier = SpecInfo.from_dict({"spec_num_correct_drafts": 109,
                                  "spec_num_proposed_drafts": 130,
                                  "spec_verify_ct": 5, "completion_tokens": 5})
    out = rollout_metrics([SessionRow("a", "v2", carrier=carrier)])
    assert out["rollout/spec_accept_rate"] == 109 / 130
    assert out["rollout/spec_accept_length"] == 1.0


def session(sid: str, *samples: SampleRow, version: str = "v2",
            carrier: SpecInfo | None = None) -> SessionRow:
    return SessionRow(session_id=sid, version=version, samples=samples, carrier=carrier)


def test_rollout_metrics_combine_counts_spec_tito_and_lengths() -> None:
    out = rollout_metrics([
        session("a", SampleRow(10, "completed", []), SampleRow(30, "truncated"),
                carrier=SpecInfo(1, 2, 1, 3)),
        session("b", SampleRow(20, "completed", [entry("assistant_text")]), version="v1"),
    ])
    assert out["sessions"] == 2 and out["samples"] == 3
    assert out["rollout/spec_accept_rate"] == 0.5
    assert out["rollout/spec_accept_length"] == 3.0
    assert out[f"{P}/v1/assistant_text"] == 1.0 and out[f"{P}/v2"] == 0.0
    assert out["rollout/response_len/mean"] == 20.0
    assert (out["rollout/response_len/max"], out["rollout/response_len/min"]) == (30.0, 10.0)
    assert out["rollout/truncated_ratio"] == pytest.approx(1 / 3)


def test_spec_keys_appear_only_if_some_session_has_spec() -> None:
    out = rollout_metrics([session("a", SampleRow(5, "completed"))])
    assert "rollout/spec_accept_rate" not in out
    assert "rollout/spec_accept_length" not in out


def test_a_spec_session_without_samples_still_counts_its_carrier() -> None:
    out = rollout_metrics([session("a", carrier=SpecInfo(3, 4, 2, 8)),
                           session("b", SampleRow(5, "completed"))])
    assert out["rollout/spec_accept_rate"] == 0.75
    assert out["rollout/spec_accept_length"] == 4.0


EMPTY = {"rollout/response_len/mean": 0.0, "rollout/response_len/max": 0.0,
         "rollout/response_len/min": 0.0, "rollout/truncated_ratio": 0.0}


def test_without_samples_length_and_truncation_keys_are_zero() -> None:
    assert rollout_metrics([session("a")]) == {"sessions": 1, "samples": 0, **EMPTY}
    assert rollout_metrics([]) == {"sessions": 0, "samples": 0, **EMPTY}


def test_a_session_given_twice_is_a_caller_bug() -> None:
    with pytest.raises(ValueError, match="twice"):
        rollout_metrics([session("a"), session("a")])
