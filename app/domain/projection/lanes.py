"""One node's turn as token lanes, and the tree's marks: what the session page shows.

Owns reading, for one node, where its tokens went: the prompt's new tokens
(beyond the part shared with the parent), its output tokens with their
log-probs, and for a closed session which output tokens are in a returned
sample and with which loss. It also says which nodes are retries and which
leaves are dropped. Every rule it reads is written elsewhere: retries and
picked leaves in `app/domain/projection/samples.py`, losses and trims in the built
samples themselves (ownership, TITO alignment and truncation already
applied), SpecInfo in `app/domain/body/specinfo.py`. Refuses rendering and I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from app.domain.body.specinfo import sum_turns
from app.domain.log.tree import Node, SessionState, lcp
from app.domain.projection.samples import Sample, is_retry, pick_leaves


@dataclass(frozen=True)
class NodeMarks:
    """Per node: superseded by a later retry of the same parent; a leaf no sample returns."""

    retry: list[bool]
    dropped: list[bool]


def node_marks(state: SessionState) -> NodeMarks:
    picked = {node.seq for node in pick_leaves(state)}
    # Only v2 drops retries; a v1 session keeps its latest path and its
    # earlier branches were rolled back (dropped), not retried.
    v2 = state.definition.version == "v2"
    return NodeMarks(
        retry=[v2 and is_retry(state, node) for node in state.nodes],
        dropped=[node.is_leaf and node.seq not in picked for node in state.nodes],
    )


@dataclass(frozen=True)
class TokenLanes:
    seq: int
    prompt_shared: int  # prompt tokens shared with the parent's tokens
    new_prompt: list[int]
    output: list[int]
    logprobs: list[float]
    # Closed sessions only (None while open): per output token, whether a
    # returned sample holds it, and its loss there (1 only in its owner).
    in_sample: list[bool] | None
    loss: list[int] | None
    owner: int | None  # index of the sample training this node's tokens
    samples: list[int]  # indexes of every sample whose kept turns include the node
    spec: dict[str, Any]

    def as_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def spec_view(node: Node) -> dict[str, Any]:
    """A turn's SpecInfo as read, whether it counts (the §3 guard) and its own rates."""
    counters = node.facts.spec_info
    info = sum_turns([counters])
    return {**counters.as_dict(), "contributes": counters.contributes,
            "accept_rate": info.accept_rate, "accept_length": info.accept_length}


def token_lanes(state: SessionState, seq: int, samples: list[Sample] | None) -> TokenLanes:
    """Lanes of node `seq`; `samples` are the session's returned samples (None while open).

    An output token is in a sample iff it is in the matching prefix of the
    node's output against that sample's tokens from the node's prompt end
    (what alignment kept and truncation left); its loss there is the
    sample's own loss mask at that position.
    """
    node = state.node(seq)
    # A stored node keeps its tokens as a delta from its parent (`Node.tail`), not in `facts`.
    output = node.output
    lanes: dict[str, Any] = {
        "seq": seq,
        "prompt_shared": node.prompt_lcp,
        "new_prompt": node.prompt[node.prompt_lcp:].tolist(),
        "output": output.tolist(),
        "logprobs": node.logprobs.tolist(),
        "spec": spec_view(node),
    }
    if samples is None:
        return TokenLanes(in_sample=None, loss=None, owner=None, samples=[], **lanes)
    in_sample = [False] * int(output.size)
    loss = [0] * int(output.size)
    owner: int | None = None
    holders: list[int] = []
    for sample in samples:
        if seq not in sample.turns:
            continue
        holders.append(sample.index)
        tokens = sample.tokens
        start = node.prompt_len
        kept = lcp(output, np.asarray(tokens[start:start + output.size], dtype=output.dtype))
        response_start = len(tokens) - sample.response_length
        for i in range(kept):
            in_sample[i] = True
            if sample.loss_mask[start + i - response_start]:
                loss[i] = 1
                owner = sample.index
    return TokenLanes(in_sample=in_sample, loss=loss, owner=owner, samples=holders, **lanes)
