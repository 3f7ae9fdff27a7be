"""The session forest: folding events into state and attaching a new turn.

An append-only forest of nodes; `seq` (commit order within the session) is
the only ordering key and the node id. This module owns the fold
(`SessionState.apply_*`), the attach rules of docs/api.md §1.2 (derived parent,
truncated parents, contiguous R3 offsets, stable prefixes, the node cap) and
the resume view (`/state`). Everything here is synchronous pure data: storage,
transactions and HTTP live one layer up.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from app.domain.body.rewards import RewardBody
from app.domain.body.session import SessionClose, SessionDefinition
from app.domain.body.turn import OMITTED, TurnBody, TurnFacts
from app.domain.errors import (
    InvalidR3,
    NodeCap,
    ParentTruncated,
    R3Gap,
    SessionClosed,
    UnknownParent,
    UnstablePrefix,
)


def lcp(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two token arrays."""
    m = min(a.size, b.size)
    if m == 0:
        return 0
    a, b = a[:m], b[:m]
    # An attach walks every node of a session. Most calls meet a full match (a turn
    # extends its parent's tokens) or a tail that differs at once (a sibling: a
    # retry's or a new root's own tokens): the first token settles the second in
    # ~1 us, where the comparison array cost ~6 (`bench.big_session`: an append to a
    # session of 800 roots, 9.7 -> 5.2 ms). A full match compares the raw bytes: two
    # copies at memcpy speed, ~8x less than building the comparison array.
    if a[0] != b[0]:
        return 0
    if a.dtype == b.dtype and a.dtype.kind in "iu" and a.tobytes() == b.tobytes():
        return m
    differs = a != b
    first = int(differs.argmax())  # the first True; no index array built
    return first if differs[first] else m


EMPTY_TOKENS = np.empty(0, np.int64)
INT32 = np.iinfo(np.int32)
NODE_OVERHEAD = 600  # bytes a node costs beyond its arrays (objects, dict entries)


def value_bytes(value: Any) -> int:
    """About what a decoded JSON value holds in memory (containers walked once)."""
    if isinstance(value, str):
        return sys.getsizeof(value)
    if isinstance(value, dict):
        return sys.getsizeof(value) + sum(value_bytes(k) + value_bytes(v)
                                          for k, v in value.items())
    if isinstance(value, list | tuple):
        return sys.getsizeof(value) + sum(value_bytes(v) for v in value)
    return 0 if value is None else sys.getsizeof(value)


def compact(values: np.ndarray) -> np.ndarray:
    """`values` as int32 when every id fits (as on disk), else unchanged."""
    if values.size and (int(values.min()) < INT32.min or int(values.max()) > INT32.max):
        return values
    return values.astype(np.int32)


@dataclass(eq=False)
class Node:
    """One turn in the forest, its tokens kept as a delta from its parent's.

    As in the log (`prompt_lcp` + `prompt_delta`), a node holds only what its
    parent does not: the first `prompt_lcp` tokens are the parent's, `tail`
    (int32) is the rest of the prompt and the output. `tokens`, `prompt` and
    `output` rebuild the full arrays on demand, walking up only as far as
    needed; `facts` keeps every other fact of the turn with its arrays dropped.
    A 1,024-turn session of growing contexts thus costs the sum of the turns'
    new tokens, not of their lengths.
    """

    seq: int
    parent: int | None
    depth: int
    event_id: str
    facts: TurnFacts
    up: Node | None
    tail: np.ndarray
    num_tokens: int
    prompt_len: int
    output_len: int
    logprobs: np.ndarray
    prompt_lcp: int = 0
    children: list[int] = field(default_factory=list)
    facts_bytes: int = 0  # what the kept facts hold beyond NODE_OVERHEAD (text, metadata)

    @classmethod
    def build(cls, seq: int, parent: Node | None, depth: int, event_id: str,
              facts: TurnFacts, prompt_lcp: int) -> Node:
        tokens = facts.tokens
        # Only what the fold and the reads of a folded state need: the token arrays
        # live in `tail`, and the decoded R3 values were stored with the turn (on
        # the MessagePack wire they are a view of the whole request body).
        stripped = replace(facts, prompt=EMPTY_TOKENS, output=EMPTY_TOKENS, logprobs=[],
                           r3_values=None)
        return cls(seq=seq, parent=None if parent is None else parent.seq, depth=depth,
                   event_id=event_id, facts=stripped, up=parent,
                   tail=compact(tokens[prompt_lcp:]), num_tokens=int(tokens.size),
                   prompt_len=int(facts.prompt.size), output_len=int(facts.output.size),
                   logprobs=np.asarray(facts.logprobs, dtype=np.float64),
                   prompt_lcp=prompt_lcp,
                   facts_bytes=value_bytes((stripped.content, stripped.mismatch,
                                            stripped.weight_version)))

    @property
    def nbytes(self) -> int:
        """What the state cache counts for this node: every array and text it keeps."""
        return int(self.tail.nbytes + self.logprobs.nbytes) + self.facts_bytes \
            + NODE_OVERHEAD

    def head(self, length: int) -> np.ndarray:
        """The first `length` tokens (int64), from this node's tail and its ancestors'."""
        pieces: list[np.ndarray] = []
        need = min(length, self.num_tokens)
        node: Node | None = self
        while node is not None and need > 0:
            if need > node.prompt_lcp:
                pieces.append(node.tail[:need - node.prompt_lcp])
                need = node.prompt_lcp
            node = node.up
        if not pieces:
            return EMPTY_TOKENS.copy()
        pieces.reverse()
        return np.concatenate(pieces).astype(np.int64)

    @property
    def tokens(self) -> np.ndarray:
        return self.head(self.num_tokens)

    def common_prefix(self, other: np.ndarray) -> int:
        """`lcp(self.tokens, other)` without rebuilding more than needed."""
        return lcp(self.head(min(self.num_tokens, int(other.size))), other)

    @property
    def prompt(self) -> np.ndarray:
        return self.head(self.prompt_len)

    @property
    def output(self) -> np.ndarray:
        # The output is always the end of the tail (prompt_lcp <= prompt_len).
        return self.tail[self.tail.size - self.output_len:].astype(np.int64)

    @property
    def r3_span(self) -> tuple[int, int] | None:
        if not self.facts.returns_r3 or self.facts.r3_start is None:
            return None
        return self.facts.r3_start, self.num_tokens - 1

    @property
    def is_leaf(self) -> bool:
        return not self.children


@dataclass(frozen=True)
class Attachment:
    """Where a validated turn goes: its seq, resolved parent, depth and prompt delta."""

    seq: int
    parent: int | None
    depth: int
    prompt_lcp: int
    topk: int | None


@dataclass
class SessionState:
    definition: SessionDefinition
    nodes: list[Node] = field(default_factory=list)
    topk: int | None = None
    close: SessionClose | None = None
    event_ids: dict[str, int] = field(default_factory=dict)
    # Rewards recorded after the close, by event_id, in commit order.
    rewards: dict[str, RewardBody] = field(default_factory=dict)
    # (nodes counted, their bytes) for `nbytes`: nodes are only appended, and a node's
    # size never changes, so the state cache's measure on each hand-out (twice an
    # append) adds only the new nodes instead of walking a long session's nodes.
    _counted: tuple[int, int] = field(default=(0, 0), repr=False, compare=False)

    @property
    def closed(self) -> bool:
        return self.close is not None

    @property
    def active_leaf(self) -> int | None:
        return self.nodes[-1].seq if self.nodes else None

    def node(self, seq: int) -> Node:
        return self.nodes[seq]

    def path(self, seq: int) -> list[Node]:
        """Root → node, inclusive."""
        out: list[Node] = []
        cur: int | None = seq
        while cur is not None:
            node = self.nodes[cur]
            out.append(node)
            cur = node.parent
        out.reverse()
        return out

    @property
    def nbytes(self) -> int:
        """What this state holds in memory (token deltas, log-probs, node overhead)."""
        count, total = self._counted
        if count > len(self.nodes):  # not a list this state counted: count it afresh
            count, total = 0, 0
        if count < len(self.nodes):
            total += sum(node.nbytes for node in self.nodes[count:])
            self._counted = (len(self.nodes), total)
        return total + NODE_OVERHEAD

    def leaves(self) -> list[Node]:
        return [n for n in self.nodes if n.is_leaf]

    # -- fold -----------------------------------------------------------------

    def new_node(self, seq: int, parent: int | None, event_id: str, facts: TurnFacts,
                 prompt_lcp: int | None = None) -> Node:
        """The node a turn becomes, without adding it (the state stays unchanged).

        `prompt_lcp`, when known (the log stores it), saves recomputing it."""
        if seq != len(self.nodes):
            raise ValueError(f"turn seq {seq} out of order; expected {len(self.nodes)}")
        parent_node = None if parent is None else self.nodes[parent]
        depth = 0 if parent_node is None else parent_node.depth + 1
        if parent_node is None:
            prefix = 0
        elif prompt_lcp is not None:
            prefix = prompt_lcp
        else:
            prefix = parent_node.common_prefix(facts.prompt)
        return Node.build(seq, parent_node, depth, event_id, facts, prefix)

    def add_node(self, node: Node) -> Node:
        if node.seq != len(self.nodes):
            raise ValueError(f"turn seq {node.seq} out of order; expected {len(self.nodes)}")
        self.nodes.append(node)
        if node.parent is not None:
            self.nodes[node.parent].children.append(node.seq)
        if self.topk is None and node.facts.topk is not None:
            self.topk = node.facts.topk
        self.event_ids[node.event_id] = node.seq
        return node

    def apply_turn(self, seq: int, parent: int | None, event_id: str, facts: TurnFacts,
                   prompt_lcp: int | None = None) -> Node:
        return self.add_node(self.new_node(seq, parent, event_id, facts, prompt_lcp))

    def apply_close(self, close: SessionClose) -> None:
        self.close = close

    def apply_reward(self, reward: RewardBody) -> None:
        """Idempotent: a refold of the log's tail may meet a reward already held."""
        self.rewards.setdefault(reward.event_id, reward)

    # -- attach ---------------------------------------------------------------

    def prefix_lengths(self, prompt: np.ndarray) -> list[int]:
        """`lcp(node.tokens, prompt)` for every node, in one pass over the deltas.

        A node shares its first `prompt_lcp` tokens with its parent (parents
        come first in seq order), so its common prefix with `prompt` is the
        parent's when that is shorter, else `prompt_lcp` plus its tail's.
        """
        # The tails are kept as int32 (`compact`), a decoded prompt is int64: at the
        # same width a full match is one bytes comparison, not a comparison array
        # per node (a chain of 800 nodes: every node a full match).
        prompt = compact(prompt)
        out: list[int] = []
        for node in self.nodes:
            base = 0 if node.parent is None else out[node.parent]
            if base < node.prompt_lcp:
                out.append(base)
                continue
            start = node.prompt_lcp
            out.append(start + lcp(node.tail, prompt[start:]))
        return out

    def derive_parent(self, prompt: np.ndarray) -> int | None:
        """Deepest node whose tokens prefix `prompt` (up to the trim); ties → highest seq."""
        return self._derive_parent(prompt, self.prefix_lengths(prompt))

    def _derive_parent(self, prompt: np.ndarray, shared: list[int]) -> int | None:
        """`derive_parent`, given `shared` = `prefix_lengths(prompt)`."""
        trim = self.definition.max_trim_tokens
        best: Node | None = None
        for node in self.nodes:
            need = node.num_tokens - trim
            if need > prompt.size:
                continue
            if best is not None and node.depth < best.depth:
                continue
            if shared[node.seq] >= need:
                best = node if best is None or node.depth >= best.depth else best
        return None if best is None else best.seq

    def attach(self, body: TurnBody, max_nodes: int) -> Attachment:
        """Validate a new turn against the tree; raises the 404/409/422 of docs/api.md §1.2."""
        facts = body.facts
        if self.closed:
            raise SessionClosed("session is closed; it takes no more turns",
                                field="session_id", expected="an open session",
                                actual="closed")
        if facts.topk is not None and self.topk is not None and facts.topk != self.topk:
            raise InvalidR3(
                f"routed_experts topk {facts.topk} differs from the session's topk {self.topk}",
                field="record.response.choices[0].meta_info.routed_experts",
                expected=f"topk {self.topk}", actual=f"topk {facts.topk}",
            )
        shared: list[int] | None = None  # lcp(node.tokens, prompt) of every node, if known
        if body.parent is OMITTED:
            shared = self.prefix_lengths(facts.prompt)
            parent = self._derive_parent(facts.prompt, shared)
        elif body.parent is None:
            parent = None
        else:
            parent = int(body.parent)
            if parent >= len(self.nodes):
                raise UnknownParent(f"session has no node {parent}", field="parent",
                                    expected=self._seq_range("null (a new root)"),
                                    actual=parent)
        if len(self.nodes) >= max_nodes:
            raise NodeCap(f"session reached the cap of {max_nodes} nodes", field="session_id",
                          expected=f"fewer than {max_nodes} nodes", actual=len(self.nodes))
        parent_node = None if parent is None else self.nodes[parent]
        if parent_node is not None and parent_node.facts.finish_reason == "length":
            raise ParentTruncated(
                f"node {parent} ended with finish_reason 'length' and cannot be extended",
                field="parent", expected="a node that did not hit the length limit",
                actual=parent,
            )
        parent_size = 0 if parent_node is None else parent_node.num_tokens
        prefix = 0 if parent_node is None else shared[parent_node.seq] if shared is not None \
            else parent_node.common_prefix(facts.prompt)
        if self.definition.use_addition_r3 and facts.returns_r3:
            start = facts.r3_start or 0
            expected = max(parent_size - 1, 0)
            if start != expected:
                raise R3Gap(
                    f"patch starts at row {start}; the path to "
                    f"{'a new root' if parent is None else f'node {parent}'} ends at row "
                    f"{expected}",
                    field="record.request.routed_experts_start_len",
                    expected=expected, actual=start,
                )
            if prefix < start:
                raise UnstablePrefix(
                    f"prompt shares {prefix} tokens with node {parent}, fewer than the "
                    f"{start} rows already routed",
                    field="record.request.input_ids",
                    expected=f"a common prefix of at least {start} tokens", actual=prefix,
                )
        depth = 0 if parent_node is None else parent_node.depth + 1
        return Attachment(seq=len(self.nodes), parent=parent, depth=depth, prompt_lcp=prefix,
                          topk=self.topk if self.topk is not None else facts.topk)

    # -- resume ---------------------------------------------------------------

    def covered_rows(self, seq: int) -> int:
        """Rows from 0 that the path to `seq` covers contiguously."""
        covered = 0
        for node in self.path(seq):
            span = node.r3_span
            if span is None:
                continue
            start, end = span
            if start > covered:
                break
            covered = max(covered, end)
        return covered

    def _seq_range(self, otherwise: str) -> str:
        """What a node reference may be, said plainly (also for an empty session)."""
        if not self.nodes:
            return f"{otherwise}: the session has no nodes yet"
        return f"a seq in [0, {len(self.nodes) - 1}] or {otherwise}"

    def resume(self, leaf: int | None = None) -> dict[str, Any]:
        """The `/state` view for `leaf` (default: the most recently committed node)."""
        if leaf is not None and not 0 <= leaf < len(self.nodes):
            raise UnknownParent(f"session has no node {leaf}", field="leaf",
                                expected=self._seq_range("no leaf (the latest node)"),
                                actual=leaf)
        target = self.active_leaf if leaf is None else leaf
        tokens: list[int] = [] if target is None else self.nodes[target].tokens.tolist()
        addition = self.definition.use_addition_r3
        next_start = None
        if addition:
            next_start = max(len(tokens) - 1, 0)
        covered = None
        if self.definition.has_r3:
            covered = 0 if target is None else self.covered_rows(target)
        return {
            "status": "closed" if self.closed else "open",
            "active_leaf": target,
            "checkpoint_token_ids": tokens,
            "num_nodes": len(self.nodes),
            "use_addition_r3": addition,
            "next_routed_experts_start_len": next_start,
            "covered_r3_rows": covered,
        }


def check_first_turn(body: TurnBody, definition: SessionDefinition, max_nodes: int) -> None:
    """Raise what an append would refuse `body` with as the first turn of a session
    opened as `definition`: the refusals of a new session's empty tree (an R3 gap,
    an unknown parent, …) on top of `parse_turn`'s. Whoever opens a session for a
    turn checks it first, so a refused turn leaves no empty session behind."""
    SessionState(definition=definition).attach(body, max_nodes)
