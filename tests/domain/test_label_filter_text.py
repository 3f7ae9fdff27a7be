"""The web UI's labels field: filters written as one line of text and read back.
Oracle: the filters themselves (a round trip), for any key a label may have and any
text value."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from app.domain.body.labels import label_filter_text, parse_label_filter_text
from app.domain.errors import InvalidRequest

KEYS = st.text(st.sampled_from("abcXYZ09._:-"), min_size=1, max_size=12)


@given(st.dictionaries(KEYS, st.text(max_size=20), max_size=5))
def test_filters_written_as_text_read_back_the_same(filters):
    assert parse_label_filter_text(label_filter_text(filters)) == list(filters.items())


@pytest.mark.parametrize(("text", "pairs"), [
    ("run_id=run7 rollout_id=12", [("run_id", "run7"), ("rollout_id", "12")]),
    ("a=1,b=2&c=3", [("a", "1"), ("b", "2"), ("c", "3")]),
    (' task="a b"  x= ', [("task", "a b"), ("x", "")]),
    ('k="\\"q\\" & , ="', [("k", '"q" & , =')]),
    ("", []),
])
def test_typed_filters(text, pairs):
    assert parse_label_filter_text(text) == pairs


@pytest.mark.parametrize("text", ["novalue", "=v", 'k="open', "a=[1,2]", 'a="\\ud800"'])
def test_a_pair_without_a_key_and_value_is_refused_naming_labels(text):
    with pytest.raises(InvalidRequest) as refused:
        parse_label_filter_text(text)
    assert refused.value.field == "labels" and "key=" in refused.value.expected
