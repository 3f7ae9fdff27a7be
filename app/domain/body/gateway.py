"""The recording gateway's rules: which request is a turn, what is recorded, how a session opens.

Owns, for `turnlog gateway` (docs/gateway.md):
- which headers are hop-by-hop (never forwarded either way), and which reply
  header cannot be relayed at all (`unrelayable_header`);
- the decision "is this request a turn?", in two steps — on the request
  (`classify_request`: recorded path, session header, TITO body, no streaming)
  and on the upstream reply (`classify_reply`: 200, JSON, the log-prob list) —
  and the reason counted when it is not;
- the SessionRecord appended for a turn (`build_record`, `turn_body`), its R3
  payload handed on decoded once (`r3_as_bin`; `parse_reply` does both steps
  with the payload's base64 decoded straight from the reply's bytes);
- the auto-open body (`open_body`) from the gateway's defaults and the
  `X-Turnlog-Labels` header (`parse_labels_header`);
- when a reward handed to the gateway may wait in its spool (`check_reward_order`,
  `reward_may_wait`), and what a close handed to it leaves when it finds its
  session closed already (`reward_of_late_close`).

Refuses I/O, clocks and id generation: the shell passes the timestamps and
the event id in, forwards the bytes, and writes through the store.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeGuard

import numpy as np

from app.domain.body.labels import parse_labels
from app.domain.body.session import SessionClose
from app.domain.body.turn import PROMPT_FIELD, TOKEN_MAX, token_array
from app.domain.errors import DomainError, InvalidRequest, SessionOpen, TooLarge
from app.domain.wire import jsonio
from app.domain.wire.r3 import payload_bytes
from app.domain.wire.r3text import at_path, parse_spliced
from app.domain.wire.validate import SESSION_ID, finite_float

# Hop-by-hop headers: about one connection, not the message (RFC 9110 §7.6.1).
HOP_BY_HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "te", "trailer",
                        "upgrade"})
DEFAULT_RECORD_PATHS = ("/v1/chat/completions",)
# The gateway's own routes live under this prefix; nothing under it is forwarded.
OWN_PREFIX = "/turnlog/"
DEFAULT_SESSION_HEADER = "X-SMG-Routing-Key"
LABELS_HEADER = "X-Turnlog-Labels"
OPENED_BY = "gateway"
IDLE_CLOSE = {"closed_by": "gateway-idle"}

# Why a request to a recorded path was forwarded without being recorded.
NO_SESSION = "no-session"
NOT_TITO = "not-tito"
STREAM = "stream"
UPSTREAM_STATUS = "upstream-status"
NOT_JSON = "not-json"
SESSION_CLOSED = "session-closed"
REJECTED = "rejected"
# Not forwarded through: the upstream did not answer (or broke off); the caller got a 502.
UPSTREAM_UNAVAILABLE = "upstream-unavailable"
# The store could not take the turn and the spool was full: the caller got a 503.
SPOOL_FULL = "spool-full"
# The caller went away before the upstream answered: its request to the upstream was
# cancelled (the connection closed, as a caller's own hang-up closes it).
CALLER_GONE = "caller-gone"
UNRECORDED_REASONS = (NO_SESSION, NOT_TITO, STREAM, UPSTREAM_STATUS, NOT_JSON, SESSION_CLOSED,
                      REJECTED, UPSTREAM_UNAVAILABLE, SPOOL_FULL, CALLER_GONE)
# What became of a turn held for the store: committed, or spooled; else SPOOL_FULL or the
# store's refusal (REJECTED, SESSION_CLOSED).
RECORDED = "recorded"
SPOOLED = "spooled"
STORE_OUTCOMES = (RECORDED, SPOOLED, SPOOL_FULL, REJECTED, SESSION_CLOSED)


def check_reward_order(session_id: str, spooled_turns: int, spooled_close: bool) -> None:
    """Refuse (409 `session-open`, as the store answers a reward before the close) a
    reward for a session whose turns wait in the gateway's spool with no close behind
    them: spooled behind them, it would meet an open session when its turn came."""
    if spooled_turns and not spooled_close:
        raise SessionOpen(f"session {session_id!r} has turns waiting in the gateway's spool "
                          "and no close: rewards come after the close", field="session_id",
                          expected="a closed session", actual="open")


def reward_may_wait(spooled_writes: int) -> bool:
    """Whether a reward the store cannot take now may wait in the spool: only behind
    other writes of its session — its close, or the rewards spooled behind one
    (`check_reward_order` has refused it behind turns without a close). Spooled with
    nothing of the session before it, it might meet an open session when its turn
    came (its close deferred by a client that is down), and be dropped long after its
    client was answered 202; refused instead, the client keeps it and sends it again."""
    return spooled_writes > 0


# The event ids of the rewards late closes leave: the prefix, then the close's fingerprint.
LATE_CLOSE_REWARD = "late-close-"


def reward_of_late_close(close: SessionClose,
                         closed_with: SessionClose | None) -> dict[str, Any] | None:
    """The reward a close spooled at the gateway leaves when it finds its session closed
    already, `closed_with` another body: its metadata's `reward`, when a finite number,
    as a session-wide reward (docs/api.md §16) — but only when the close that got there
    first carried none (the gateway's idle close, say), so that the reward fills a
    missing one and never replaces one (a client's second, different close of the
    session is refused, as the store refuses it). None: nothing to leave.

    Its `event_id` is made from the close's content, so the same close sent twice (a
    client's retry, a drain repeated after a crash) leaves one reward; `source` is
    null, as the samples show a close's own reward.
    """
    if finite_float(close.reward) is None or closed_with is None \
            or finite_float(closed_with.reward) is not None:
        return None
    return {"event_id": LATE_CLOSE_REWARD + jsonio.fingerprint(close.body())[:40],
            "reward": close.reward, "sample": None, "response_id": None, "source": None}


def is_hop_by_hop(name: str) -> bool:
    lower = name.lower()
    return lower in HOP_BY_HOP or lower.startswith("proxy-")


def end_to_end(headers: Iterable[tuple[bytes, bytes]],
               drop: frozenset[bytes] = frozenset()) -> list[tuple[bytes, bytes]]:
    """The headers a proxy passes on, names lower-cased: hop-by-hop ones left out (the
    fixed list, `Proxy-*`, and each header the `Connection` header names, RFC 9110
    §7.6.1), and the lower-case names in `drop`."""
    pairs = [(name.lower(), value) for name, value in headers]
    listed = {token.strip().lower() for name, value in pairs if name == b"connection"
              for token in value.split(b",")}
    return [(name, value) for name, value in pairs
            if name not in listed and name not in drop
            and not is_hop_by_hop(name.decode("latin-1"))]


# What HTTP/1.1 lets a field carry (RFC 9110 §5.1, §5.5): a name is a token; a value
# has no control character but horizontal tab. The server the gateway answers through
# refuses to send anything else, mid-reply, after the turn would have been recorded.
_NOT_TOKEN = re.compile(rb'[^!#$%&\'*+\-.^_`|~0-9A-Za-z]')
_VALUE_CONTROL = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")


def unrelayable_header(headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    """Why one of a reply's headers (as `end_to_end` passes them on) cannot go to the
    caller — an empty or non-token name, or a control character in a value — or None.
    Such a reply is the upstream's fault: answered 502 like a reply that breaks off,
    never half-sent, never recorded."""
    for name, value in headers:
        if not name or _NOT_TOKEN.search(name):
            return f"header name {name[:64]!r} is not an HTTP token"
        found = _VALUE_CONTROL.search(value)
        if found:
            return (f"header {name[:64].decode('latin-1')!r} has control character "
                    f"{found[0]!r} in its value")
    return None


def forwarded_headers(headers: Iterable[tuple[str, str]],
                      drop: frozenset[str] = frozenset()) -> list[tuple[str, str]]:
    """The headers that travel on (hop-by-hop ones and `drop`, lower-case names, left out)."""
    return [(name, value) for name, value in headers
            if not is_hop_by_hop(name) and name.lower() not in drop]


@dataclass(frozen=True)
class Candidate:
    """A request that is a turn if the upstream answers it with a TITO reply."""

    session_id: str
    request: Any  # the JSON body as forwarded
    # Its `input_ids` as validated token ids, handed to the store so the turn's
    # validation does not convert them again (None: some id is out of range — the
    # store then refuses the turn and names it).
    prompt: np.ndarray | None = field(default=None, compare=False)
    # Why the store cannot hold this body although it is JSON with `input_ids` (a
    # number out of float range, nesting or values past the store's bounds): the
    # turn is then `rejected` as a store's refusal is, never stored (`Refused`).
    refusal: DomainError | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Unrecorded:
    reason: str


@dataclass(frozen=True)
class Refused:
    """A TITO reply the store cannot hold (`Candidate.refusal`, on the reply's side):
    the turn is `rejected`, the reply relayed as it came."""

    refusal: DomainError


def _parsed(body: bytes | bytearray) -> tuple[Any, DomainError | None]:
    """The body as the store reads it; else, if it is JSON all the same, as any JSON
    parser reads it and the store's refusal beside it; else `jsonio.NOT_JSON`."""
    try:
        return jsonio.loads(body), None
    except TooLarge:
        # More values than the store decodes: not decoded here either (a second parser
        # would build them all), and judged as a body that is no JSON, as before.
        return jsonio.NOT_JSON, None
    except DomainError as exc:
        refusal = _bare(exc)
    # Parsed again only once the first parse's frames are let go.
    return jsonio.plain_json(body), refusal


def _bare(error: DomainError) -> DomainError:
    """`error` without the frames it was raised through, nor the error it was raised
    in: they hold what the refused parse had built (a large body's values), and the
    refusal is kept with the turn until it is answered."""
    error.__traceback__ = None
    error.__context__ = None
    return error


def names_session(session_header_value: str | None) -> TypeGuard[str]:
    """The session header holds a session id (without it no request is a turn)."""
    return session_header_value is not None and SESSION_ID.matches(session_header_value)


def classify_request(session_header_value: str | None, body: bytes) -> Candidate | Unrecorded:
    """Step one, for a POST to a recorded path: may this request become a turn?"""
    if not names_session(session_header_value):
        return Unrecorded(NO_SESSION)
    request, refusal = _parsed(body)
    if not isinstance(request, dict):
        return Unrecorded(NOT_TITO)
    ids = request.get("input_ids")
    if not isinstance(ids, list) or not ids:
        return Unrecorded(NOT_TITO)
    prompt: np.ndarray | None = None if refusal else _listed_ids(body, len(ids))
    if prompt is None:
        try:
            prompt = token_array(ids, PROMPT_FIELD)
        except DomainError:
            # Token ids out of range still make a turn the store refuses (and counts);
            # a list that is not all integers (a boolean's type is bool) is no TITO
            # request.
            if set(map(type, ids)) != {int}:
                return Unrecorded(NOT_TITO)
            prompt = None
    if request.get("stream") is True:
        return Unrecorded(STREAM)
    return Candidate(session_header_value, request, prompt, refusal)


_JSON_SPACE = b" \t\r\n"
_REPLY_R3 = ("choices", 0, "meta_info", "routed_experts")
_IDS_KEY = b'"input_ids"'


def _listed_ids(body: bytes | bytearray, count: int) -> np.ndarray | None:
    """The `count` token ids of a request that parsed (as JSON, with a non-empty
    `input_ids` list), read from its bytes into int64 if all are in range — what
    `token_array` makes of the parsed list, for a fraction of its CPU (no type
    scan of 40k Python ints, no conversion from them); None when the bytes do not
    show it plainly (then the parsed list is converted as before):

    - The body has no escape and one `"input_ids"`: that is then the key of the
      top-level list (a nested or escaped one would be another), and its items
      run from the `[` after it to the first `]`.
    - Those bytes are digits, commas and spaces only: in JSON that parsed, the
      items are then non-negative integer literals (`int`, never a bool or a
      float). Read with C's `strtoll` rules, one too large for int64 reads as
      its maximum, out of range like any over `TOKEN_MAX`.
    """
    if b"\\" in body:
        return None
    key = body.find(_IDS_KEY)
    if key < 0 or body.find(_IDS_KEY, key + 1) >= 0:
        return None
    after = key + len(_IDS_KEY)
    begin = body.find(b"[", after) + 1
    end = body.find(b"]", begin)
    if begin <= 0 or end < 0 or body[after:begin - 1].strip(_JSON_SPACE) != b":":
        return None
    text = np.frombuffer(body, np.uint8, end - begin, begin)
    digits = np.count_nonzero((text - np.uint8(ord("0"))) < 10)
    if digits + np.count_nonzero(text == ord(",")) + np.count_nonzero(text == ord(" ")) \
            != len(text):
        return None
    try:
        ids = np.fromstring(bytes(body[begin:end]), dtype=np.int64, sep=",")
    except ValueError:
        return None
    if len(ids) != count or int(ids.max()) > TOKEN_MAX:
        return None
    return ids


def classify_reply_head(status: int, content_type: str) -> Unrecorded | None:
    """Step two, before the body: a reply that cannot complete a turn whatever its body
    holds (not 200, or a server-sent event stream) is relayed as it comes, streamed,
    not buffered; None: read the whole body and classify it (`classify_reply`)."""
    if status != 200:
        return Unrecorded(UPSTREAM_STATUS)
    if content_type.split(";", 1)[0].strip().lower() == "text/event-stream":
        return Unrecorded(NOT_JSON)
    return None


def classify_reply(status: int, body: bytes | bytearray) -> Any | Unrecorded | Refused:
    """Step two: the upstream's reply as parsed JSON if it completes a turn (`Refused`:
    it would, but the store cannot hold it)."""
    if status != 200:
        return Unrecorded(UPSTREAM_STATUS)
    response, refusal = _parsed(body)
    if response is jsonio.NOT_JSON:
        return Unrecorded(NOT_JSON)
    try:
        logprobs = response["choices"][0]["meta_info"]["output_token_logprobs"]
    except (KeyError, IndexError, TypeError):
        return Unrecorded(NOT_TITO)
    if not isinstance(logprobs, list):
        return Unrecorded(NOT_TITO)
    return response if refusal is None else Refused(refusal)


def r3_as_bin(response: Any) -> Any:
    """The reply with its base64 `meta_info.routed_experts` decoded once into the int32
    bytes a MessagePack bin carries (the store takes either; JSON renders a bin as the
    same canonical base64), so a 4 MB payload is neither held twice nor decoded again.

    Copies only the maps on the payload's path. Text that is empty or not canonical
    base64 stays as it is: the store then answers it with its own R3 error.
    """
    try:
        choice = response["choices"][0]
        meta = choice["meta_info"]
        text = meta["routed_experts"]
    except (KeyError, IndexError, TypeError):
        return response
    if not isinstance(text, str) or not text:
        return response
    try:
        data = payload_bytes(text, "record.response.choices[0].meta_info.routed_experts")
    except DomainError:
        return response
    choices = list(response["choices"])
    choices[0] = {**choice, "meta_info": {**meta, "routed_experts": data}}
    return {**response, "choices": choices}


def parse_reply(status: int, body: bytes | bytearray) -> Any | Unrecorded | Refused:
    """`r3_as_bin(classify_reply(status, body))`, without parsing the R3 text as JSON:
    the text is decoded from the reply's bytes and the rest parsed with a marker in
    its place (`r3text.parse_spliced`, which says why the answer is the same in
    every case). Whatever does not fit takes the plain path."""
    if status != 200:
        return Unrecorded(UPSTREAM_STATUS)
    found = parse_spliced(body, lambda rest: classify_reply(status, rest), _reply_r3)
    if found is None:
        reply = classify_reply(status, body)
        return reply if isinstance(reply, Unrecorded | Refused) else r3_as_bin(reply)
    reply, data = found
    reply["choices"][0]["meta_info"]["routed_experts"] = data
    return reply


def _reply_r3(reply: Any) -> Any:
    return at_path(reply, _REPLY_R3)


def build_record(path: str, request: Any, response: Any, request_timestamp: float,
                 timestamp: float) -> dict[str, Any]:
    """miles' SessionRecord of one turn: the request as forwarded, the reply as received."""
    return {
        "timestamp": timestamp,
        "request_timestamp": request_timestamp,
        "method": "POST",
        "path": path,
        "status_code": 200,
        "request": request,
        "response": response,
    }


def turn_body(event_id: str, record: dict[str, Any]) -> dict[str, Any]:
    """The append body; `parent` is left out so the store derives it (docs/api.md §1.2)."""
    return {"event_id": event_id, "record": record}


@dataclass(frozen=True)
class GatewayDefaults:
    """What an auto-opened session is opened with."""

    version: str = "v2"
    pause_generation_mode: str = "retract"
    num_layers: int | None = None
    max_trim_tokens: int = 0
    speculative: bool = False
    labels: dict[str, Any] = field(default_factory=dict)


def parse_label_flags(items: Iterable[str]) -> dict[str, str]:
    """`--label KEY=VALUE` items (values are text); InvalidRequest names the bad one."""
    labels: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise InvalidRequest(f"label {item!r} is not KEY=VALUE", field="--label",
                                 expected="KEY=VALUE", actual=item)
        labels[key] = value
    return parse_labels(labels, "--label")


_RECORD_PATH = re.compile(r"/[!-~]*")  # printable ASCII, no space, from the root


def parse_record_paths(items: Iterable[str]) -> tuple[str, ...]:
    """`--record-path` items: each a path as callers send it (matched exactly, before any
    percent-decoding, the query string aside), so from `/`, printable ASCII, no `?` or
    `#`, and none of the gateway's own; the default when none is given. InvalidRequest
    names the bad one: a path no request can have would silently record nothing."""
    paths = tuple(items) or DEFAULT_RECORD_PATHS
    for path in paths:
        if not _RECORD_PATH.fullmatch(path) or "?" in path or "#" in path \
                or path.startswith(OWN_PREFIX):
            raise InvalidRequest(
                f"--record-path {path!r} is no path a request to the gateway can have",
                field="--record-path",
                expected="a path from / in printable ASCII, without ? or #, not under "
                         f"{OWN_PREFIX} (e.g. /v1/chat/completions)",
                actual=path)
    return paths


def parse_labels_header(text: str) -> dict[str, Any]:
    """`X-Turnlog-Labels`: a JSON object of scalar values (InvalidRequest otherwise)."""
    value = jsonio.loads(text)
    if not isinstance(value, dict):
        raise InvalidRequest(f"{LABELS_HEADER} must be a JSON object", field=LABELS_HEADER,
                             expected="a JSON object of scalar values", actual=type(value).__name__)
    for key, item in value.items():
        if isinstance(item, dict | list):
            raise InvalidRequest(f"{LABELS_HEADER} value of {key!r} is not a scalar",
                                 field=f"{LABELS_HEADER}.{key}",
                                 expected="string, number, boolean or null",
                                 actual=type(item).__name__)
    return parse_labels(value, LABELS_HEADER)


def open_body(session_id: str, defaults: GatewayDefaults,
              header_labels: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The open body of an auto-opened session; header labels win over the flags' on a key."""
    return {
        "session_id": session_id,
        "version": defaults.version,
        "pause_generation_mode": defaults.pause_generation_mode,
        "r3": None if defaults.num_layers is None else {"num_layers": defaults.num_layers},
        "spec": defaults.speculative,
        "max_trim_tokens": defaults.max_trim_tokens,
        "labels": {**defaults.labels, **(header_labels or {})},
        "opened_by": OPENED_BY,
    }
