"""Any record survives encode → restore exactly (the append → read promise, without a DB)."""

import base64

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from app.domain.body.session import parse_open
from app.domain.body.turn import parse_turn
from app.domain.log.events import encode_turn, restore_prompt, restore_record, stored_facts
from app.domain.log.tree import SessionState
from app.domain.wire import jsonio
from app.domain.wire.r3 import narrow
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
        attachment = state.attach(turn, 1024)
        stored = encode_turn(turn, attachment, definition.num_layers)
        payload = jsonio.loads(stored.payload)
        parent = payload["parent"]
        ptoks = None if parent is None else state.nodes[parent].tokens
        prompt = restore_prompt(ptoks, stored.prompt_lcp, stored.prompt_delta)
        b64 = None if stored.patch is None else stored.patch.base64()
        assert restore_record(payload, prompt, b64) == sent["record"]
        geometry = None if stored.patch is None else (stored.patch.start, stored.patch.topk)
        facts = stored_facts(definition, payload, prompt, geometry)
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
