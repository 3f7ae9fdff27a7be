"""A deterministic fake SGLang behind a fake session server.

Owns three things used by property tests and demos: `route`, a causal MoE
router whose full forward over any token sequence is the R3 oracle (row i
depends only on tokens[0..i], like real top-k routing); `SessionSimulator`,
which plays an agent's session (branches, retries, TITO trailing-token
trims, every finish reason, both R3 modes, v1 and v2) and emits open and turn
bodies in the exact wire shape of a session server's records (docs/api.md §1.2;
examples in `tests/data/`); and
`fold_in_memory`, which feeds those bodies through the real domain rules
(parse, attach, encode) to get a `SessionState` and its stored patches.
Refuses to own any rule it exercises — validation, attachment and samples
are the domain's — and any I/O: the demo sends these bodies over HTTP.

Token ids are drawn from disjoint ranges (user/template text below
`OUTPUT_BASE`, model output above it), so a trimmed output token can never be
matched again by the next turn's new user tokens: each trim is exactly what
the aligner sees.
"""

from __future__ import annotations

import base64
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from app.domain.body.session import parse_open
from app.domain.body.turn import parse_turn
from app.domain.log.events import encode_turn
from app.domain.log.tree import SessionState
from app.domain.wire.r3 import WIRE_DTYPE, Patch

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
OUTPUT_BASE = 1000
VOCAB = 2000
FINISH_REASONS: tuple[str | None, ...] = ("stop", "tool_calls", "length", "abort", None)
FINISH_WEIGHTS = (50, 20, 10, 10, 10)
MISMATCH_TYPES = ("special_token_count", "special_token_type", "non_assistant_text",
                  "assistant_text")


def _mix(x: int) -> int:
    """splitmix64's finalizer on a Python int (one avalanche step)."""
    x &= MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def _mix_array(x: np.ndarray) -> np.ndarray:
    """`_mix` over a uint64 array; numpy wraps on overflow like the masks above."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def prefix_hashes(tokens: np.ndarray, seed: int) -> np.ndarray:
    """uint64 [len(tokens)]: entry i is a hash of tokens[0..i] (and the seed)."""
    out = np.empty(tokens.size, dtype=np.uint64)
    h = _mix(seed ^ GOLDEN)
    for i, token in enumerate(tokens.tolist()):
        h = _mix(h ^ _mix(int(token) + GOLDEN))
        out[i] = h
    return out


def route(tokens: np.ndarray, num_layers: int, topk: int, num_experts: int,
          seed: int = 0) -> np.ndarray:
    """A full forward's routed experts: int32 `[len(tokens) - 1, num_layers, topk]`.

    Row i is the top-k of per-expert scores hashed from the prefix tokens[0..i]
    and the layer, so a row never depends on later tokens and a row's experts
    are distinct. The last token predicts nothing in training: it has no row.
    """
    if not 1 <= topk <= num_experts:
        raise ValueError(f"topk {topk} must be in [1, num_experts={num_experts}]")
    tokens = np.asarray(tokens, dtype=np.int64)
    rows = max(int(tokens.size) - 1, 0)
    prefix = prefix_hashes(tokens[:rows], seed)
    layer_salt = np.array([_mix(GOLDEN * (layer + 1)) for layer in range(num_layers)],
                          dtype=np.uint64)
    expert_salt = np.array([_mix(~GOLDEN * (expert + 1)) for expert in range(num_experts)],
                           dtype=np.uint64)
    scores = _mix_array(prefix[:, None, None] ^ layer_salt[None, :, None]
                        ^ expert_salt[None, None, :])
    experts = np.argsort(scores, axis=-1, kind="stable")[..., :topk]
    return np.ascontiguousarray(experts, dtype=WIRE_DTYPE)


@dataclass(frozen=True)
class SimConfig:
    session_id: str = "sim-session"
    version: str = "v2"
    pause_generation_mode: str = "retract"
    num_layers: int | None = 2
    topk: int = 2
    num_experts: int = 16
    speculative: bool = False
    max_trim_tokens: int = 0
    router_seed: int = 0
    labels: dict[str, Any] = field(default_factory=lambda: {"run_id": "sim", "rollout_id": 0})

    @property
    def addition(self) -> bool:
        return self.pause_generation_mode == "in_place"


@dataclass(frozen=True)
class SimNode:
    """The simulator's own view of a committed turn (what it sent)."""

    seq: int
    parent: int | None
    prompt: tuple[int, ...]
    output: tuple[int, ...]
    finish_reason: str | None

    @property
    def tokens(self) -> tuple[int, ...]:
        return self.prompt + self.output


@dataclass
class SimRates:
    """How often each random action happens (probabilities in [0, 1])."""

    new_root: float = 0.1
    retry: float = 0.2
    trim: float = 0.4
    no_r3: float = 0.0
    omit_parent: float = 0.0
    mismatch: float = 0.3
    weight_bump: float = 0.3


def _lcp(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class SessionSimulator:
    """Plays one session. Every body it returns must be appended, in order:
    the n-th body becomes node n (that is how it knows seqs and parents)."""

    def __init__(self, config: SimConfig, rng: random.Random,
                 rates: SimRates | None = None) -> None:
        self.config = config
        self.rng = rng
        self.rates = rates or SimRates()
        self.nodes: list[SimNode] = []
        self.weight_version = 1
        self.clock = 1755800000.0

    # -- bodies -----------------------------------------------------------------

    def open_body(self) -> dict[str, Any]:
        c = self.config
        return {
            "session_id": c.session_id,
            "version": c.version,
            "pause_generation_mode": c.pause_generation_mode,
            "r3": None if c.num_layers is None else {"num_layers": c.num_layers},
            "spec": c.speculative,
            "max_trim_tokens": c.max_trim_tokens,
            "labels": c.labels,
        }

    def _user_tokens(self, count: int) -> list[int]:
        return [self.rng.randrange(1, OUTPUT_BASE) for _ in range(count)]

    def _output_tokens(self, count: int) -> list[int]:
        return [self.rng.randrange(OUTPUT_BASE, VOCAB) for _ in range(count)]

    def derived_parent(self, prompt: tuple[int, ...]) -> int | None:
        """The derived parent of docs/api.md §1.2, written independently of the domain's."""
        best: SimNode | None = None
        best_depth = -1
        for node in self.nodes:
            need = len(node.tokens) - self.config.max_trim_tokens
            if _lcp(node.tokens, prompt) >= need:
                depth = self.depth(node.seq)
                if depth >= best_depth:
                    best, best_depth = node, depth
        return None if best is None else best.seq

    def depth(self, seq: int) -> int:
        depth = 0
        parent = self.nodes[seq].parent
        while parent is not None:
            depth += 1
            parent = self.nodes[parent].parent
        return depth

    def _spec_counters(self, n_out: int) -> dict[str, int]:
        if not self.config.speculative:
            return {}
        # verify 0 happens: the SpecInfo guard must then skip the whole turn.
        verify = self.rng.randint(0, max(n_out, 1))
        proposed = self.rng.randint(verify, 3 * verify + 1)
        return {
            "spec_verify_ct": verify,
            "spec_num_correct_drafts": self.rng.randint(0, proposed),
            "spec_num_proposed_drafts": proposed,
        }

    def _r3_fields(self, parent: int | None, tokens: tuple[int, ...],
                   with_r3: bool) -> tuple[dict[str, Any], dict[str, Any]]:
        c = self.config
        if c.num_layers is None or not with_r3:
            return {}, {}
        end = len(tokens) - 1
        start = 0
        if c.addition and parent is not None:
            start = len(self.nodes[parent].tokens) - 1
        rows = route(np.asarray(tokens, dtype=np.int64), c.num_layers, c.topk,
                     c.num_experts, c.router_seed)[start:end]
        request: dict[str, Any] = {"return_routed_experts": True}
        if c.addition:
            request["routed_experts_start_len"] = start
        payload = base64.b64encode(rows.astype(WIRE_DTYPE).tobytes()).decode("ascii")
        return request, {"routed_experts": payload}

    def extension(self, parent: int | None, trim: int, new_tokens: int) -> tuple[int, ...]:
        """A TITO prompt: the parent's tokens minus `trim` trailing output
        tokens, then `new_tokens` fresh user/template tokens."""
        base: tuple[int, ...] = ()
        if parent is not None:
            node = self.nodes[parent]
            if not 0 <= trim <= len(node.output):
                raise ValueError(f"trim {trim} exceeds node {parent}'s output")
            base = node.tokens[:len(node.tokens) - trim]
        return base + tuple(self._user_tokens(new_tokens))

    def turn(
        self,
        parent: int | None,
        *,
        new_tokens: int = 3,
        output_tokens: int = 3,
        trim: int = 0,
        finish_reason: str | None = "stop",
        prompt: Sequence[int] | None = None,
        output: Sequence[int] | None = None,
        logprobs: Sequence[float] | None = None,
        weight_version: str | None = None,
        spec_info: dict[str, int] | None = None,
        with_r3: bool = True,
        include_parent: bool = True,
        mismatch: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """One turn body extending `parent` (None = a new root).

        The prompt is the parent's tokens minus `trim` trailing output tokens
        plus `new_tokens` user tokens, unless `prompt` is given (a retry, or a
        hand-built test). `output`, `logprobs`, `weight_version` and
        `spec_info` (meta_info counters) override the random ones. With
        `include_parent=False` the body leaves `parent` out and the node is
        recorded under the parent docs/api.md §1.2 derives.
        """
        ids = self.extension(parent, trim, new_tokens) if prompt is None else tuple(prompt)
        if not ids:
            raise ValueError("a prompt needs at least one token")
        if not include_parent:
            parent = self.derived_parent(ids)
        out = tuple(self._output_tokens(output_tokens) if output is None else output)
        if logprobs is None:
            logprobs = [-round(self.rng.random() * 4, 6) for _ in out]
        if len(logprobs) != len(out):
            raise ValueError("one log-prob per output token")
        seq = len(self.nodes)
        tokens = ids + out
        r3_request, r3_meta = self._r3_fields(parent, tokens, with_r3)
        parent_tokens = () if parent is None else self.nodes[parent].tokens
        if weight_version is None and self.rng.random() < self.rates.weight_bump:
            self.weight_version += 1
        self.clock += 1.0
        meta: dict[str, Any] = {
            "output_token_logprobs": [[lp, tok] for lp, tok in zip(logprobs, out, strict=True)],
            "completion_tokens": len(out),
            "prompt_tokens": len(ids),
            "cached_tokens": _lcp(parent_tokens, ids),
            "weight_version": str(self.weight_version) if weight_version is None
            else weight_version,
            "finish_reason": {"type": finish_reason or "unknown"},
            **r3_meta,
            **(self._spec_counters(len(out)) if spec_info is None else spec_info),
        }
        body: dict[str, Any] = {
            "event_id": f"{seq:032x}",
            "record": {
                "timestamp": self.clock,
                "request_timestamp": self.clock - 0.5,
                "method": "POST",
                "path": "/v1/chat/completions",
                "status_code": 200,
                "request": {
                    "model": "default",
                    "messages": [{"role": "user", "content": "x"}],
                    "logprobs": True,
                    "return_meta_info": True,
                    "no_stop_trim": False,
                    "input_ids": list(ids),
                    **r3_request,
                },
                "response": {
                    "id": f"chatcmpl-{seq:08x}",
                    "object": "chat.completion",
                    "choices": [{
                        "index": 0,
                        "finish_reason": finish_reason,
                        "message": {"role": "assistant", "content": "y"},
                        "meta_info": meta,
                    }],
                },
            },
        }
        if include_parent:
            body["parent"] = parent
        if mismatch is not None:
            body["metadata"] = {"tito_session_mismatch": mismatch}
        self.nodes.append(SimNode(seq=seq, parent=parent, prompt=ids, output=out,
                                  finish_reason=finish_reason))
        return body

    # -- random play --------------------------------------------------------------

    def extendable(self) -> list[int]:
        """Nodes a turn may extend: a 'length' node is never extended (409)."""
        return [node.seq for node in self.nodes if node.finish_reason != "length"]

    def _max_trim(self, parent: int) -> int:
        limit = min(self.config.max_trim_tokens, len(self.nodes[parent].output))
        # Addition mode: the child's patch starts at len(parent) - 1 and the
        # prompt must keep those rows' tokens, so only the last token may go.
        return min(limit, 1) if self.config.addition else limit

    def _mismatch(self) -> list[dict[str, Any]] | None:
        if self.rng.random() >= self.rates.mismatch:
            return None
        kinds = self.rng.sample(MISMATCH_TYPES, self.rng.randint(0, 2))
        return [{"type": kind, "segment_index": i, "expected_text": "a", "actual_text": "b",
                 "detail": ""} for i, kind in enumerate(kinds)]

    def random_turn(self) -> dict[str, Any]:
        """One random action: a new root, a retry of an existing node, or an
        extension (possibly trimming the parent's last output tokens)."""
        rng, rates = self.rng, self.rates
        finish = rng.choices(FINISH_REASONS, weights=FINISH_WEIGHTS)[0]
        n_out = rng.choice((0, 1, 2, 3, 4, 5, 6))
        with_r3 = rng.random() >= rates.no_r3
        extendable = self.extendable()
        common: dict[str, Any] = {"output_tokens": n_out, "finish_reason": finish,
                                  "with_r3": with_r3, "mismatch": self._mismatch()}
        if not extendable or rng.random() < rates.new_root:
            return self.turn(None, new_tokens=rng.randint(1, 6), **common)
        if rng.random() < rates.retry:
            of = self.nodes[rng.randrange(len(self.nodes))]
            return self.turn(of.parent, prompt=of.prompt, **common)
        parent = rng.choice(extendable)
        trim = 0
        if rng.random() < rates.trim:
            trim = rng.randint(0, self._max_trim(parent))
        # A trim is always followed by new user tokens, so the trimmed token
        # is never re-matched by the next output.
        prompt = self.extension(parent, trim, rng.randint(1 if trim else 0, 5))
        # Leaving the parent out is only faithful when docs/api.md §1.2 derives this one.
        include = not (rng.random() < rates.omit_parent
                       and self.derived_parent(prompt) == parent)
        return self.turn(parent, prompt=prompt, include_parent=include, **common)

    def random_session(self, num_turns: int) -> list[dict[str, Any]]:
        return [self.random_turn() for _ in range(num_turns)]


def fold_in_memory(open_body: dict[str, Any], bodies: Iterable[dict[str, Any]],
                   max_nodes: int = 1024) -> tuple[SessionState, dict[int, Patch]]:
    """Append bodies through the real domain rules, without a database: the
    state the store would fold, and the R3 patches it would store per seq."""
    definition = parse_open(open_body)
    state = SessionState(definition=definition)
    patches: dict[int, Patch] = {}
    for raw in bodies:
        body = parse_turn(raw, definition)
        attachment = state.attach(body, max_nodes)
        stored = encode_turn(body, attachment, definition.num_layers)
        state.apply_turn(attachment.seq, attachment.parent, body.event_id, body.facts)
        if stored.patch is not None:
            patches[attachment.seq] = stored.patch
    return state, patches
