"""A session-server-like driver: talks to SGLang (or to anything in front of it) the
way miles' session server does, and remembers what went over the wire.

Owns, for the gateway tests, the caller's side of a chat turn as miles builds it:
TITO `input_ids` (the attach checkpoint's tokens plus the new messages, rendered
by a toy chat template), forced `logprobs`/`return_meta_info`/`no_stop_trim`,
`return_routed_experts` and `routed_experts_start_len` (addition mode), the
`X-SMG-Routing-Key` header; v1 sessions (linear; a rollback truncates the
driver's own records, at most one assistant step, as miles does) and v2
sessions (an append-only tree; retries branch), tool-call turns. It also holds
an independent oracle of the samples a closed session must give (which leaves,
their tokens, loss mask and log-probs), written from the miles rules, not from
turnlog's domain code.

Refuses to know anything about turnlog: it talks to a base URL only, so the
same driver talks straight to the fake SGLang or through the gateway.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from app.sim.simulator import OUTPUT_BASE

ROUTING_HEADER = "X-SMG-Routing-Key"
CHAT_PATH = "/v1/chat/completions"
# The toy chat template's special tokens (all below the model's output range).
IM_START, IM_END = 1, 2
ROLE_TOKENS = {"system": 3, "user": 4, "assistant": 5, "tool": 6}
FIRST_TEXT_TOKEN = 16
# miles' MAX_ASSISTANT_ROLLBACK_STEPS: a v1 rollback may discard one assistant turn.
MAX_ROLLBACK_STEPS = 1
COMPLETED = ("stop", "tool_calls")


class DriverRefused(Exception):
    """What miles' session server answers 4xx/5xx for (a rollback too deep, a TITO break)."""


def tokenize(text: str) -> list[int]:
    """Toy tokenizer: one token per whitespace-separated word, hashed below the output range."""
    tokens = []
    for word in text.split():
        digest = hashlib.blake2b(word.encode(), digest_size=4).digest()
        tokens.append(FIRST_TEXT_TOKEN + int.from_bytes(digest, "little")
                      % (OUTPUT_BASE - FIRST_TEXT_TOKEN))
    return tokens


def render(message: dict[str, Any]) -> list[int]:
    """The toy template for one message: `<start> role content [tool calls] <end>`."""
    text = str(message.get("content") or "")
    if message.get("tool_calls"):
        text += " " + json.dumps(message["tool_calls"], sort_keys=True)
    return [IM_START, ROLE_TOKENS.get(str(message.get("role")), 7), *tokenize(text), IM_END]


GENERATION_PROMPT = [IM_START, ROLE_TOKENS["assistant"]]


@dataclass
class Node:
    """One recorded turn, as the driver saw it (the store must agree)."""

    seq: int
    parent: int | None
    depth: int
    messages: list[dict[str, Any]]  # the request's messages plus the reply message
    prompt: list[int]
    output: list[int]
    logprobs: list[float]
    finish_reason: str | None
    record: dict[str, Any]
    children: list[int] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output


@dataclass
class Exchange:
    """One chat call over the wire: the body sent and the reply bytes received."""

    session_id: str
    request: dict[str, Any]
    status: int
    content: bytes
    headers: httpx.Headers

    def json(self) -> Any:
        return json.loads(self.content)


@dataclass
class ExpectedSample:
    leaf: int
    path: list[int]
    tokens: list[int]
    response_length: int
    loss_mask: list[int]
    rollout_log_probs: list[float]


class SessionDriver:
    """One session, driven like miles' session server drives SGLang.

    `http` carries the base URL (fake SGLang or the gateway in front of it);
    without one the driver only builds request bodies.
    Every chat call is kept in `wire`; every 200 with a reply the driver
    accepts becomes a `Node` (in `nodes`, commit order = the store's seq).
    """

    def __init__(self, http: httpx.AsyncClient | None, session_id: str, *, version: str = "v2",
                 addition: bool = False, r3: bool = True,
                 extra_headers: dict[str, str] | None = None) -> None:
        if version not in ("v1", "v2"):
            raise ValueError(version)
        self.http = http
        self.session_id = session_id
        self.version = version
        self.addition = addition
        self.r3 = r3
        self.extra_headers = dict(extra_headers or {})
        self.nodes: list[Node] = []
        self.linear: list[int] = []  # v1: the current chain of seqs (rollbacks cut it)
        self.wire: list[Exchange] = []
        # Awaited with the number of accepted turns before each chat call (fault injection).
        self.before_turn: Callable[[int], Awaitable[None]] | None = None

    # -- attaching -------------------------------------------------------------------

    def _is_prefix(self, node: Node, messages: list[dict[str, Any]]) -> bool:
        return len(node.messages) <= len(messages) and messages[:len(node.messages)] == \
            node.messages

    def attach(self, messages: list[dict[str, Any]]) -> Node | None:
        """The node this request extends (None = a new root)."""
        if self.version == "v1":
            keep = 0
            for index, seq in enumerate(self.linear):
                if self._is_prefix(self.nodes[seq], messages):
                    keep = index + 1
            dropped = len(self.linear) - keep
            if dropped > MAX_ROLLBACK_STEPS:
                raise DriverRefused(f"rollback of {dropped} assistant turns")
            del self.linear[keep:]
            return self.nodes[self.linear[-1]] if self.linear else None
        best: Node | None = None
        for node in self.nodes:
            if self._is_prefix(node, messages) and (best is None or node.depth >= best.depth):
                best = node
        return best

    def input_ids(self, parent: Node | None, messages: list[dict[str, Any]]) -> list[int]:
        """TITO: the checkpoint's tokens as generated, then only the new messages rendered."""
        if parent is None:
            ids: list[int] = []
            new = messages
        else:
            ids = list(parent.tokens)
            new = messages[len(parent.messages):]
        for message in new:
            ids += render(message)
        return ids + GENERATION_PROMPT

    def build_request(self, messages: list[dict[str, Any]], tools: list[Any] | None,
                      sampling: dict[str, Any]) -> tuple[Node | None, dict[str, Any]]:
        parent = self.attach(messages)
        body: dict[str, Any] = {"model": "default", "messages": messages}
        if tools:
            body["tools"] = tools
        body.update(sampling)
        body.update({"logprobs": True, "return_meta_info": True, "no_stop_trim": False})
        if self.r3:
            body["return_routed_experts"] = True
        ids = self.input_ids(parent, messages)
        if self.r3 and self.addition:
            body["routed_experts_start_len"] = 0 if parent is None else len(parent.tokens) - 1
        body["input_ids"] = ids
        return parent, body

    # -- one turn --------------------------------------------------------------------

    async def send(self, body: dict[str, Any], headers: dict[str, str] | None = None,
                   path: str = CHAT_PATH) -> Exchange:
        """POST a body as-is with the session header; the exchange is kept in `wire`."""
        all_headers = {"content-type": "application/json", ROUTING_HEADER: self.session_id,
                       **self.extra_headers, **(headers or {})}
        assert self.http is not None, "a driver without a client only builds bodies"
        reply = await self.http.post(path, content=json.dumps(body).encode(),
                                     headers=all_headers)
        exchange = Exchange(self.session_id, body, reply.status_code, reply.content,
                            reply.headers)
        self.wire.append(exchange)
        return exchange

    async def chat(self, messages: list[dict[str, Any]], *, tools: list[Any] | None = None,
                   headers: dict[str, str] | None = None, **sampling: Any) -> dict[str, Any]:
        """One agent call: returns the reply the agent sees (R3 stripped, as miles does)."""
        messages = copy.deepcopy(messages)
        if self.before_turn is not None:
            await self.before_turn(len(self.nodes))
        parent, body = self.build_request(messages, tools, sampling)
        exchange = await self.send(body, headers)
        if exchange.status != 200:
            raise DriverRefused(f"upstream answered {exchange.status}: {exchange.content[:200]!r}")
        response = exchange.json()
        choice = response["choices"][0]
        meta = choice["meta_info"]
        output = [int(entry[1]) for entry in meta["output_token_logprobs"]]
        if len(output) != meta["completion_tokens"]:
            raise DriverRefused("completion_tokens differs from the log-prob list")
        if parent is not None and body["input_ids"][:len(parent.tokens)] != parent.tokens:
            raise DriverRefused("the checkpoint is not a prefix of the new tokens")
        depth = 0 if parent is None else parent.depth + 1
        record = {"method": "POST", "path": CHAT_PATH, "status_code": 200,
                  "request": body, "response": response}
        node = Node(seq=len(self.nodes), parent=None if parent is None else parent.seq,
                    depth=depth, messages=[*messages, choice["message"]],
                    prompt=list(body["input_ids"]), output=output,
                    logprobs=[float(entry[0]) for entry in meta["output_token_logprobs"]],
                    finish_reason=choice["finish_reason"], record=record)
        if parent is not None:
            parent.children.append(node.seq)
        self.nodes.append(node)
        if self.version == "v1":
            self.linear.append(node.seq)
        client = copy.deepcopy(response)
        client["choices"][0]["meta_info"].pop("routed_experts", None)
        return client

    async def agent_loop(self, question: str, tools: list[Any], **sampling: Any
                         ) -> list[dict[str, Any]]:
        """user → assistant tool call → tool result → assistant answer."""
        messages: list[dict[str, Any]] = [{"role": "system", "content": "you may call tools"},
                                          {"role": "user", "content": question}]
        reply = await self.chat(messages, tools=tools, **sampling)
        message = reply["choices"][0]["message"]
        messages.append(message)
        for call in message.get("tool_calls") or []:
            messages.append({"role": "tool", "tool_call_id": call["id"],
                             "content": f"result of {call['function']['name']} 42"})
        reply = await self.chat(messages, tools=tools, **sampling)
        messages.append(reply["choices"][0]["message"])
        return messages

    # -- the oracle --------------------------------------------------------------------

    def path(self, seq: int) -> list[Node]:
        out = []
        node: Node | None = self.nodes[seq]
        while node is not None:
            out.append(node)
            node = None if node.parent is None else self.nodes[node.parent]
        return out[::-1]

    def leaves(self) -> list[Node]:
        """miles' picks: v1 the last committed turn; v2 every leaf that is not a
        superseded retry (its parent has a later child), longest path first."""
        if not self.nodes:
            return []
        if self.version == "v1":
            return [self.nodes[-1]]
        picked = []
        for node in self.nodes:
            if node.children:
                continue
            if node.parent is not None and max(self.nodes[node.parent].children) > node.seq:
                continue
            picked.append(node)
        return sorted(picked, key=lambda n: (n.depth, n.seq), reverse=True)

    def expected_samples(self) -> list[ExpectedSample]:
        """Tokens, loss mask and log-probs per sample, for sessions whose turns all
        completed (no trims): a completion trains only in the earliest kept leaf
        (its log-probs stay in every sample)."""
        leaves = self.leaves()
        owner: dict[int, int] = {}
        for leaf in leaves:
            for node in self.path(leaf.seq):
                if node.finish_reason not in COMPLETED:
                    raise ValueError("the oracle covers completed turns only")
                owner[node.seq] = min(owner.get(node.seq, leaf.seq), leaf.seq)
        out = []
        for leaf in leaves:
            path = self.path(leaf.seq)
            start = len(path[0].prompt)
            mask = [0] * (len(leaf.tokens) - start)
            logprobs = [0.0] * len(mask)
            for node in path:
                owned = self.version == "v1" or owner[node.seq] == leaf.seq
                for i, lp in enumerate(node.logprobs):
                    mask[len(node.prompt) - start + i] = int(owned)
                    logprobs[len(node.prompt) - start + i] = lp
            out.append(ExpectedSample(leaf.seq, [n.seq for n in path], leaf.tokens,
                                      len(mask), mask, logprobs))
        return out
