"""Any record survives encode → restore exactly (the append → read promise, without a DB)."""

import base64
import dataclasses
import random
import struct
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.domain.body.session import parse_open
from app.domain.body.turn import parse_turn
from app.domain.errors import InvalidRequest
from app.domain.log.events import encode_turn, restore_prompt, restore_record, stored_facts
from app.domain.log.tree import SessionState
from app.domain.wire import jsonio
from app.domain.wire.r3 import NarrowR3, narrow
from tests.fuzz.budget import DERANDOMIZE, examples

json_leaf = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=8),
)
json_value = st.recursive(
    json_leaf,
    lambda inner: st.one_of(st.lists(inner, max_size=3),
                            st.dictionaries(st.text(max_size=5), inner, max_size=3)),
    max_leaves=8,
)
tokens = st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=12)
int32 = st.integers(-(2**31), 2**31 - 1)


@st.composite
def sessions(draw):
    layers = draw(st.integers(1, 3))
    topk = draw(st.integers(1, 3))
    mode = draw(st.sampled_from(["retract", "in_place"]))
    definition = parse_open({"session_id": "p", "version": "v2", "pause_generation_mode": mode,
                       "r3": {"num_layers": layers}})
    return definition, topk


def body_for(draw, definition, topk, prompt, output, start):
    rows = len(prompt) + len(output) - 1 - start
    values = draw(st.lists(int32, min_size=rows * definition.num_layers * topk,
                           max_size=rows * definition.num_layers * topk))
    payload = base64.b64encode(np.asarray(values, "<i4").tobytes()).decode() if rows else ""
    request = {"input_ids": prompt, "return_routed_experts": True,
               "extra": draw(json_value)}
    if definition.use_addition_r3:
        request["routed_experts_start_len"] = start
    meta = {"output_token_logprobs": [[draw(st.floats(-50, 0)), t] for t in output],
            "routed_experts": payload, "anything": draw(json_value)}
    return {"event_id": "e", "record": {
        "timestamp": 1.5, "request": request, "misc": draw(json_value),
        "response": {"choices": [{"finish_reason": "stop", "meta_info": meta}],
                     "usage": draw(json_value)}}}


# Seeded (the same examples every run; TURNLOG_FUZZ_EXAMPLES=N explores afresh): 60
# two-turn sessions cover both R3 modes, 1-3 layers and top-k, narrowing and extras.
@settings(max_examples=examples(60), deadline=None, derandomize=DERANDOMIZE)

def stored_and_read_back(state: SessionState, turn: Any) -> tuple[Any, Any, Any, Any, Any]:
    """Encode `turn` as the log stores it and read it back: (attachment, stored turn,
    payload, restored prompt, facts), the trusted read's facts checked equal to the
    validated read's."""
    definition = state.definition
    attachment = state.attach(turn, 1024)
    stored = encode_turn(turn, attachment, definition.num_layers)
    payload = jsonio.loads(stored.payload)
    parent = payload["parent"]
    parent_tokens = None if parent is None else state.nodes[parent].tokens
    prompt = restore_prompt(parent_tokens, stored.prompt_lcp, stored.prompt_delta)
    geometry = None if stored.patch is None else (stored.patch.start, stored.patch.topk)
    facts = stored_facts(definition, payload, prompt, geometry)
    assert_same_facts(stored_facts(definition, payload, prompt, geometry, trusted=True), facts)
    return attachment, stored, payload, prompt, facts

@given(st.data(), sessions(), tokens, tokens, st.lists(st.integers(0, 2**31 - 1), max_size=6))
def test_two_turn_records_round_trip(data, session, prompt0, out1, extra):
    definition, topk = session
    state = SessionState(definition=definition)
    draw = data.draw
    out0 = draw(st.lists(st.integers(0, 2**31 - 1), max_size=5))
    body0 = body_for(draw, definition, topk, prompt0, out0, 0)
    parent_tokens = prompt0 + out0
    prompt1 = parent_tokens + extra
    start1 = len(parent_tokens) - 1 if definition.use_addition_r3 else 0
    body1 = body_for(draw, definition, topk, prompt1, out1, start1)
    body1["event_id"] = "f"
    for i, raw in enumerate((body0, body1)):
        sent = jsonio.loads(jsonio.dumps(raw))  # what the server receives
        turn = parse_turn(sent, definition)
        attachment, stored, payload, prompt, facts = stored_and_read_back(state, turn)
        b64 = None if stored.patch is None else stored.patch.base64()
        assert restore_record(payload, prompt, b64) == sent["record"]
        assert np.array_equal(facts.tokens, turn.facts.tokens)
        state.apply_turn(i, attachment.parent, turn.event_id, facts)
    # the TITO delta keeps the second prompt's shared prefix out of the log
    assert stored.prompt_lcp == len(parent_tokens)


@given(st.lists(int32, max_size=64))
def test_narrowing_is_lossless(values):
    arr = np.asarray(values, dtype="<i4")
    code, data = narrow(arr)
    back = np.frombuffer(data, dtype={"u1": "u1", "u2": "<u2", "i4": "<i4"}[code])
    assert np.array_equal(back.astype("<i4"), arr)
    if arr.size and arr.min() >= 0 and arr.max() < 256:
        assert code == "u1"


@given(st.lists(int32, max_size=64), st.sampled_from([1, 2, 4]))
def test_the_narrowed_wire_holds_the_same_values_and_narrows_alike(values, width):
    """A `NarrowR3` of the values written at any width that holds them (the
    test's own struct packing) reads back the int32 values, and narrows at rest to
    exactly what the int32 values narrow to."""
    arr = np.asarray(values, dtype="<i4")
    if width < 4 and arr.size and (arr.min() < 0 or arr.max() >= 1 << (8 * width)):
        width = 4
    fmt = {1: "B", 2: "H", 4: "i"}[width]
    sent = NarrowR3(bytes([width]) + struct.pack(f"<{len(values)}{fmt}", *values))
    got = sent.values("f")
    assert got.dtype.itemsize == width and np.array_equal(got.astype("<i4"), arr)
    assert sent.int32() == arr.tobytes()
    assert len(sent) == width * len(values)
    assert narrow(got) == narrow(arr)


def assert_same_facts(got, want):
    for f in dataclasses.fields(want):
        a, b = getattr(got, f.name), getattr(want, f.name)
        if isinstance(b, np.ndarray) or isinstance(a, np.ndarray):
            assert isinstance(a, np.ndarray) and isinstance(b, np.ndarray), f.name
            assert a.dtype == b.dtype and np.array_equal(a, b), f.name
        else:
            assert type(a) is type(b) and a == b, f.name


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32), version=st.sampled_from(["v1", "v2"]),
       mode=st.sampled_from(["retract", "in_place"]), spec=st.booleans(),
       metadata=st.sampled_from([None, {}, {"tito_session_mismatch": []},
                                 {"tito_session_mismatch": [{"type": "assistant_text"}]}]),
       meta_extra=st.fixed_dictionaries({}, optional={
           "weight_version": st.one_of(st.none(), st.text(max_size=4), st.integers(0, 9)),
           "cached_tokens": st.one_of(st.none(), st.integers(-1, 2**60), st.text(max_size=2)),
           "prompt_tokens": st.one_of(st.integers(-1, 99), st.floats(0, 9)),
           "spec_accept_token_num": st.integers(0, 9),
           "completion_tokens": st.none()}),
       timestamp=st.one_of(st.none(), st.integers(0, 2**33), st.floats(0, 2e9)),
       response_id=st.one_of(st.none(), st.text(max_size=4), st.integers(0, 9)))
def test_a_trusted_fold_derives_the_facts_a_validated_one_does(
        seed, version, mode, spec, metadata, meta_extra, timestamp, response_id):
    # A rebuild folds stored turns without validating them again (`trusted`): for
    # every record `parse_turn` accepted, the facts must be the same.
    from app.sim.simulator import SessionSimulator, SimConfig, SimRates

    config = SimConfig(session_id="t", version=version, pause_generation_mode=mode,
                       speculative=spec, max_trim_tokens=1 if mode == "in_place" else 2)
    sim = SessionSimulator(config, random.Random(seed), SimRates(no_r3=0.2, omit_parent=0.3))
    definition = parse_open(sim.open_body())
    state = SessionState(definition=definition)
    for _ in range(4):
        raw = sim.random_turn()
        varied = jsonio.loads(jsonio.dumps(raw))
        choice = varied["record"]["response"]["choices"][0]
        choice["meta_info"].update(meta_extra)
        if timestamp is None:
            varied["record"].pop("timestamp", None)
        else:
            varied["record"]["timestamp"] = timestamp
        if response_id is not None:
            varied["record"]["response"]["id"] = response_id
        if metadata is not None:
            varied["metadata"] = metadata
        turn = parse_turn(varied, definition)
        attachment, _stored, _payload, _prompt, checked = stored_and_read_back(state, turn)
        state.apply_turn(attachment.seq, attachment.parent, turn.event_id, checked)


@pytest.mark.parametrize(("start", "says"), [
    (None, "routed_experts_start_len is required"),
    (-1, "routed_experts_start_len must be a non-negative integer"),
    (7.0, "routed_experts_start_len must be a non-negative integer"),
    ("3", "routed_experts_start_len must be a non-negative integer"),
])
def test_an_addition_turns_start_len_says_what_is_wrong_with_it(start, says):
    # A helper's finding: a start length sent but out of range or of another type was
    # refused as "required", as if it were missing.
    definition = parse_open({"session_id": "p", "version": "v2",
                             "pause_generation_mode": "in_place", "r3": {"num_layers": 1}})
    request: dict[str, Any] = {"input_ids": [1, 2], "return_routed_experts": True}
    if start is not None:
        request["routed_experts_start_len"] = start
    body = {"event_id": "e", "record": {"request": request, "response": {"choices": [{
        "finish_reason": "stop",
        "meta_info": {"output_token_logprobs": [[-0.1, 3]], "routed_experts": "AAAAAAAAAAA="},
    }]}}}
    with pytest.raises(InvalidRequest) as refused:
        parse_turn(body, definition)
    assert refused.value.field == "record.request.routed_experts_start_len"
    assert refused.value.detail.startswith(says), refused.value.detail
