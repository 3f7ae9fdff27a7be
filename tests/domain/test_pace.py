"""The minimum pace of a request body (`app.domain.body.pace`): one rule for the
server's middleware, its hot route and upload slots, and the recording gateway."""

import math

import pytest

from app.api.http_errors import RequestTimeout
from app.domain.body.pace import MinPace
from app.gateway.errors import CallerStalled


def test_byte_n_is_due_after_the_grace_plus_n_over_the_rate():
    pace = MinPace(min_rate=100, grace=2.0)
    assert pace.due(0) == pytest.approx(2.01)  # the first byte
    assert pace.due(99) == pytest.approx(3.0)  # byte 100: one second of rate after the grace
    assert pace.due(10_000) == pytest.approx(2.0 + 10_001 / 100)


def test_a_rate_of_zero_sets_no_minimum():
    pace = MinPace(min_rate=0, grace=2.0)
    assert not pace and MinPace(min_rate=1)
    assert pace.due(0) == math.inf and pace.due(10**12) == math.inf


@pytest.mark.parametrize("error", [RequestTimeout, CallerStalled])
def test_each_layer_refuses_a_slow_body_in_the_same_words(error):
    refusal = MinPace(min_rate=64, grace=10.0).too_slow(1234, 31.26, error)
    assert type(refusal) is error
    problem = refusal.problem()
    assert problem["status"] == 408 and problem["type"] == "urn:turnlog:request-timeout"
    assert problem["field"] == "body"
    assert problem["detail"] == "request body arrives slower than 64 bytes/s"
    assert problem["expected"] == ("at least 64 bytes/s after 10 s "
                                   "(TURNLOG_MIN_UPLOAD_RATE, TURNLOG_UPLOAD_GRACE_S)")
    assert problem["actual"] == "1234 bytes in 31.3 s"
