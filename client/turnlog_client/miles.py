"""The miles hooks: `agent` for `--custom-agent-function-path`, `rm` for `--custom-rm-path`.

Owns what a miles rollout tells turnlog around the turns the gateway records:
`agent` wraps the user's agent (named by `TURNLOG_MILES_AGENT`) — it opens the
session `<sid>` (the last path segment of miles' `base_url`, or the one after
`/sessions/`) with labels
before the agent runs, closes it with the agent's result after, and returns
the agent's dict with `turnlog_session_id` added so miles carries the id into
every sample's metadata (and records the per-branch rewards the dict carries
as `"rewards": {response_id: reward}`, which miles v2 gives its samples
without calling the reward model; an agent marked fail-closed, whose None
miles reads as a failure, gets its None back as None); `rm` wraps the user's
reward function (named by `TURNLOG_MILES_RM`) and records each reward it returns
for that session (by the sample's leaf `response_id` when its metadata names one, else
session-wide), returning the rewards unchanged. Every setting is read from
the environment at each call (the table in client/README.md).

Also owns keeping the close behind the turns the recording gateway spooled.
With `TURNLOG_GATEWAY_URL` the close and the rewards are handed to the gateway
(`POST /turnlog/v1/sessions/<sid>/close`, `…/rewards`), which carries them
out behind the session's spooled turns, or keeps them in its spool, on disk,
until it can. When the gateway cannot take them (down, its spool full, a
gateway without those routes) or no gateway is named, the close goes to the
store — after asking the gateway, if one is named, whether it still holds
turns of the session — and a close that cannot go yet is deferred to the
background of the process, the session's rewards in order behind it. A
reward that cannot go now (no answer, a 5xx, its session still open) is
deferred too, and sent again with its one event id (`finish` waits for that
work).

Refuses to stand in the rollout's way: it adds no request to a turn's path
(the open comes before the agent's first turn, the close and rewards after
its last), uses short timeouts and few retries, leaves what must wait to the
background, and turnlog unreachable or answering an error never fails a
rollout — the hook logs one warning per call and goes on. Refuses to own any
rule of the store: what a close or a reward means is the server's.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hashlib
import importlib
import inspect
import json
import logging
import math
import os
import ssl
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx
import numpy as np

from turnlog_client.async_client import TurnlogClient, new_event_id
from turnlog_client.errors import NOT_RESENT, URN, TurnlogError
from turnlog_client.transport import escape_path

__all__ = ["Settings", "abort", "agent", "finish", "rm", "session_id_of"]

log = logging.getLogger("turnlog_client.miles")

DEFAULT_URL = "http://127.0.0.1:8000"
# A store that is down must not stall a rollout: a refused connection fails at
# once, a silent one after CONNECT_TIMEOUT, one that accepts and never answers after
# DEADLINE; one call gives up after DEADLINE, its resends and the one in flight included.
CONNECT_TIMEOUT = 2.0
DEADLINE = 5.0
# The close asks the store not to carry it out once the hook has given up on it
# (`commit_within`, a little before DEADLINE): a close carried out late, after the
# database came back from a long lock, could overtake the gateway's spooled turns of
# the same session, which would then meet a closed session and be lost. Opens and
# rewards carried out late lose nothing (a late open finds the session the gateway
# opened meanwhile, or opens it with the hook's labels), so the store gets them without
# it; rewards sent to the gateway carry it, which asks it to answer in time.
COMMIT_WITHIN = 0.9
# How often the agent hook asks the gateway whether it still holds spooled turns.
SPOOL_POLL_S = 0.2
# A deferred close (the gateway still holds turns of the session, or the store could not
# take it) or reward (not taken now) is tried again this often, for this long at most, in
# the background of the process (`finish`); at most this many sessions have deferred work
# at once.
CLOSE_LATER_S = 600.0
CLOSE_LATER_POLL_S = 2.0
MAX_DEFERRED = 1000
RETRIES = 2
# The event ids of the rewards late closes leave (`late_close_event_id`).
LATE_CLOSE_REWARD = "late-close-"
# The gateway answers the store's close and reward routes under this prefix, in order
# behind the session's spooled turns.
GATEWAY_PREFIX = "/turnlog"
# The agent's dict is stored as JSON this deep at most (deeper: a marker), and a
# container met again inside itself is stored as a marker too.
AGENT_DEPTH = 32
SOURCE_MAX = 128


@dataclass(frozen=True)
class Settings:
    """The hooks' environment (read at each call, so a test or a launcher may set it late)."""

    url: str = DEFAULT_URL
    token: str | None = None
    gateway: str | None = None
    agent: str | None = None
    rm: str | None = None
    version: str = "v2"
    pause_generation_mode: str = "retract"
    num_layers: int | None = None
    max_trim_tokens: int = 0
    speculative: bool = False
    run_id: str | None = None
    label_keys: tuple[str, ...] = ()

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if env is None else env

        def text(name: str) -> str | None:
            value = env.get(name, "").strip()
            return value or None

        def integer(name: str) -> int | None:
            value = text(name)
            if value is None:
                return None
            try:
                return int(value)
            except ValueError:
                # A typo in the launcher's environment must not fail a rollout either.
                log.warning("%s must be an integer, not %r: ignored (its default is used)",
                            name, value)
                return None

        def flag(name: str) -> bool:
            value = (text(name) or "").lower()
            if value not in _TRUE | _FALSE:
                log.warning("%s must be one of %s (on) or %s (off), not %r: off", name,
                            "/".join(sorted(_TRUE)), "/".join(sorted(_FALSE - {""})), value)
            return value in _TRUE

        keys = tuple(k.strip() for k in (text("TURNLOG_MILES_LABEL_KEYS") or "").split(","))
        return cls(
            url=text("TURNLOG_URL") or DEFAULT_URL,
            token=text("TURNLOG_TOKEN"),
            gateway=text("TURNLOG_GATEWAY_URL"),
            agent=text("TURNLOG_MILES_AGENT"),
            rm=text("TURNLOG_MILES_RM"),
            # The store's values are lower case; `V2` or `IN_PLACE` mean the same.
            version=(text("TURNLOG_MILES_VERSION") or "v2").lower(),
            pause_generation_mode=(text("TURNLOG_MILES_PAUSE_GENERATION_MODE")
                                   or "retract").lower(),
            num_layers=integer("TURNLOG_MILES_NUM_LAYERS"),
            max_trim_tokens=integer("TURNLOG_MILES_MAX_TRIM_TOKENS") or 0,
            speculative=flag("TURNLOG_MILES_SPECULATIVE"),
            run_id=text("TURNLOG_RUN_ID"),
            label_keys=tuple(k for k in keys if k),
        )

    def client(self) -> TurnlogClient:
        """A client for one hook call (a bad `TURNLOG_URL` raises ValueError here: one
        that is not an http(s) URL would only fail at each try, and a write deferred
        for it would be tried for nothing)."""
        try:
            parts = urlsplit(self.url)
        except ValueError as exc:
            raise ValueError(f"TURNLOG_URL={self.url!r} is not a URL ({exc})") from exc
        if parts.scheme.lower() not in ("http", "https") or not parts.netloc:
            raise ValueError(f"TURNLOG_URL={self.url!r} is not an http:// or https:// URL")
        return self._client(self.url)

    def gateway_client(self) -> TurnlogClient | None:
        """A client of the gateway's close and reward routes (the store's, under
        `/turnlog`), or None: no gateway named, or a name that is not a URL."""
        if self.gateway is None:
            return None
        parts = urlsplit(self.gateway)
        if parts.scheme.lower() not in ("http", "https") or not parts.netloc:
            return None  # said by `gateway_verdict`, which the close then goes through
        try:
            return self._client(self.gateway.rstrip("/") + GATEWAY_PREFIX)
        except ValueError:
            return None

    def _client(self, url: str) -> TurnlogClient:
        return TurnlogClient(url, self.token, retries=RETRIES, retry_deadline=DEADLINE,
                             timeout=httpx.Timeout(DEADLINE, connect=CONNECT_TIMEOUT),
                             transport=httpx.AsyncHTTPTransport(verify=_tls()), wire="json")


def _commit_within() -> float:
    """A close's (and a reward's, at the gateway) `commit_within`: a little before the
    hook's own DEADLINE (read at each call: tests shorten it)."""
    return DEADLINE * COMMIT_WITHIN


_TRUE = frozenset({"1", "true", "yes", "on", "y"})
_FALSE = frozenset({"", "0", "false", "no", "off", "n"})


@functools.lru_cache(maxsize=1)
def _tls() -> ssl.SSLContext:
    """One TLS context for every hook call: building one loads the CA bundle (~20-50 ms
    of blocking work), and a client built per call on the event loop every rollout
    shares would pay it each time (200 rollouts starting together: seconds)."""
    return ssl.create_default_context()


def split_dotted(dotted: str) -> tuple[str, str]:
    """A dotted path's module and the name in it: `package.module:name` (the name may
    be dotted) or `package.module.name`."""
    module_name, sep, attr = dotted.partition(":")
    if not sep:
        module_name, _, attr = dotted.rpartition(".")
    return module_name, attr


def load(dotted: str, variable: str) -> Any:
    """The object a dotted path names: `package.module.name` or `package.module:name`."""
    module_name, attr = split_dotted(dotted)
    if not module_name or not attr:
        raise ValueError(f"{variable}={dotted!r} is not a dotted path like package.module.name")
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as exc:  # the variable's typo, or a module its module imports
        kind = ModuleNotFoundError if isinstance(exc, ModuleNotFoundError) else ImportError
        raise kind(f"{variable}={dotted!r}: cannot import {module_name!r}: {exc}",
                   name=exc.name, path=exc.path) from exc
    for part in attr.split("."):
        try:
            target = getattr(target, part)
        except AttributeError as exc:
            raise AttributeError(f"{variable}={dotted!r}: {module_name!r} has no "
                                 f"{attr!r}") from exc
    return target


def session_id_of(base_url: str) -> str:
    """The session id in miles' `base_url` (`http://<session server>/sessions/<sid>`):
    its last path segment, or the segment after `/sessions/` when more follow it
    (`…/sessions/<sid>/v1`, as some miles versions give their OpenAI clients)."""
    parts = [part for part in urlsplit(base_url).path.split("/") if part]
    sid = parts[-1] if parts else ""
    for i in range(len(parts) - 2, -1, -1):
        if parts[i] == "sessions":
            sid = parts[i + 1]
            break
    if not sid:
        raise ValueError(f"no session id at the end of base_url {base_url!r}")
    return sid


def _scalar(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    return isinstance(value, str | int | bool)


def open_body(sid: str, settings: Settings, metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    """The open of §15: the session options of the environment and the labels."""
    labels: dict[str, Any] = {}
    for key in settings.label_keys:
        value = (metadata or {}).get(key)
        if isinstance(value, np.bool_ | np.number | np.str_):
            value = value.item()  # a dataset's numpy scalar: a number or boolean too
        if _scalar(value):
            labels[key] = value
    if settings.run_id is not None:
        labels["run_id"] = settings.run_id  # wins over a metadata key of the same name
    body: dict[str, Any] = {"session_id": sid, "version": settings.version,
                            "pause_generation_mode": settings.pause_generation_mode,
                            "spec": settings.speculative,
                            "max_trim_tokens": settings.max_trim_tokens, "labels": labels}
    if settings.num_layers is not None:
        body["r3"] = {"num_layers": settings.num_layers}
    return body


def finite(value: Any) -> int | float | None:
    """A reward as the number JSON carries for it when float64 holds it (not a bool),
    else None (an integer of 400 digits included). An integer stays an integer: the
    store tells a reward's `1` from `1.0`, and §15 closes with the returned value."""
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    if not math.isfinite(number):
        return None
    return int(value) if isinstance(value, int | np.integer) else number


def jsonable(value: Any, depth: int = 0, inside: frozenset[int] = frozenset()) -> Any:
    """`value` as strict JSON can carry it: non-finite floats become null, numpy
    scalars numbers, tuples lists, other objects their repr; a container inside
    itself, or deeper than `AGENT_DEPTH`, a marker (never a RecursionError)."""
    if value is None or isinstance(value, str | bool | int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, np.generic):
        return jsonable(value.item(), depth, inside)
    if isinstance(value, Mapping | list | tuple):
        if id(value) in inside:
            return "<cycle>"
        if depth >= AGENT_DEPTH:
            return f"<nested deeper than {AGENT_DEPTH} levels>"
        inside = inside | {id(value)}
        if isinstance(value, Mapping):
            return {str(k): jsonable(v, depth + 1, inside) for k, v in value.items()}
        return [jsonable(v, depth + 1, inside) for v in value]
    try:
        return repr(value)
    except Exception as exc:  # a __repr__ that fails (or recurses) is not the rollout's end
        return f"<{type(value).__name__}: repr failed: {type(exc).__name__}>"


def returned_mapping(result: Any) -> Mapping[str, Any] | None:
    """What the agent returned, as a dict: its dict, or the fields of a dataclass (miles'
    `AgentResult(reward, status, metrics, metadata)`); None for anything else."""
    if isinstance(result, Mapping):
        return result
    if dataclasses.is_dataclass(result) and not isinstance(result, type):
        try:
            return {field.name: getattr(result, field.name)
                    for field in dataclasses.fields(result)}
        except Exception:  # e.g. an init=False field never set: closed as no dict
            return None
    return None


def close_metadata(result: Any, error: BaseException | None) -> dict[str, Any]:
    """The close of §15: the agent's reward, its dict and its error."""
    returned = returned_mapping(result)
    return {"reward": finite(returned.get("reward")) if returned is not None else None,
            "agent": jsonable(returned) if returned is not None else None,
            "agent_error": None if error is None else f"{type(error).__name__}: {error}"}


def _problem(step: str, exc: Exception) -> str:
    if not isinstance(exc, TurnlogError):
        return f"{step}: {type(exc).__name__}: {exc}"
    if exc.slug == "unknown-sample":
        # The turn was answered but not stored: why is in the gateway's log (a tester
        # read only the 404 here, while every turn had been refused as invalid R3).
        return (f"{step}: {exc} (was the sample's last turn recorded? The gateway logs "
                "each turn it does not store and counts it in "
                "turnlog_gateway_unrecorded_total{reason}: e.g. invalid-r3 when "
                "TURNLOG_MILES_NUM_LAYERS / the gateway's --num-layers is not the "
                "model's layer count)")
    if exc.status not in (401, 403):
        return f"{step}: {exc}"
    # Not resent: a token is refused the same way every time.
    if not os.environ.get("TURNLOG_TOKEN", "").strip():
        hint = "TURNLOG_TOKEN is not set, and turnlog there asks for a token with write scope"
    elif exc.status == 401:
        hint = "TURNLOG_TOKEN is not one of the tokens turnlog there takes"
    else:
        hint = "TURNLOG_TOKEN has no write scope there: give it a write token"
    if step == "close":
        hint += ("; the session stays open until it is closed with one (or by the "
                 "gateway's --idle-close-seconds)")
    return f"{step}: {exc} ({hint})"


def branch_rewards(result: Any) -> dict[str, int | float]:
    """The per-branch rewards an agent returned (`"rewards": {response_id: reward}`, the
    shape miles v2 assigns to the samples by their leaf's `response_id`): the finite ones."""
    returned = returned_mapping(result)
    rewards = returned.get("rewards") if returned is not None else None
    if not isinstance(rewards, Mapping):
        return {}
    found = {key: finite(value) for key, value in rewards.items() if isinstance(key, str) and key}
    return {key: value for key, value in found.items() if value is not None}


@dataclass(frozen=True)
class Reward:
    """One reward for a session (§16), with the event id every try of it sends: a try
    whose answer was lost, sent again to the gateway or to the store, records it once."""

    sid: str
    value: int | float
    response_id: str | None
    source: str | None
    event_id: str = field(default_factory=new_event_id)

    @property
    def name(self) -> str:
        """How a problem names it: its session, and its leaf's response id if any."""
        leaf = f" ({self.response_id})" if self.response_id is not None else ""
        return f"reward for {self.sid}{leaf}"


@dataclass(frozen=True)
class Closed:
    """A close carried out (or spooled by the gateway): its problems, and the rewards to
    record after it (the agent's per-branch ones; the agent's reward when the session
    was closed already)."""

    problems: list[str]
    rewards: list[Reward]


def late_close_event_id(metadata: Mapping[str, Any]) -> str:
    """The event id of the reward a close leaves when its session was closed already:
    `late-close-` and the fingerprint of the close's body (key-sorted compact JSON,
    SHA-256), as the recording gateway makes it for a close it spooled — so a close
    tried both ways leaves one reward, however often it is tried."""
    text = json.dumps({"max_seq_len": None, "metadata": metadata}, separators=(",", ":"),
                      ensure_ascii=True, allow_nan=False, sort_keys=True)
    return LATE_CLOSE_REWARD + hashlib.sha256(text.encode("ascii")).hexdigest()[:40]


async def _close(tl: TurnlogClient, sid: str, result: Any, error: BaseException | None,
                 source: str, gateway: str | None = None) -> Closed:
    """Close with the agent's result; a failed close raises. A close the store refuses
    for the agent's dict (too large, too many values) is sent again without it
    (`"agent": null`, `"agent_unrecorded"` saying why): the session is closed whatever
    the agent returned. A session closed already (the gateway's idle close) gets the
    agent's reward as a reward event instead, with `late_close_event_id` (the same for every
    try of this close: it is recorded once). `gateway`: `tl` is that gateway's client,
    whose answers are checked (`gateway_took`)."""
    problems = []
    rewards = []
    try:
        metadata = close_metadata(result, error)
    except Exception as exc:
        metadata = {"reward": None, "agent": None, "agent_unrecorded": _problem("agent", exc),
                    "agent_error": close_metadata(None, error)["agent_error"]}
        problems.append(metadata["agent_unrecorded"])
    answer: Any = None
    try:
        answer = await tl.close(sid, metadata=metadata, commit_within=_commit_within())
    except TurnlogError as exc:
        if exc.slug == "session-closed":
            if metadata["reward"] is not None:
                rewards.append(Reward(sid, metadata["reward"], None, source,
                                      late_close_event_id(metadata)))
        elif exc.status is not None and exc.status < 500 and metadata["agent"] is not None:
            metadata = {**metadata, "agent": None,
                        "agent_unrecorded": _problem("close with the agent's dict", exc)}
            problems.append(metadata["agent_unrecorded"])
            answer = await tl.close(sid, metadata=metadata, commit_within=_commit_within())
        else:
            raise
    if gateway is not None and answer is not None:  # None: closed already (a reward)
        gateway_took(answer, gateway, "close")
    rewards += [Reward(sid, value, response_id, source)
                for response_id, value in branch_rewards(result).items()]
    return Closed(problems, rewards)


NOT_A_GATEWAY = "not-a-gateway"


def gateway_took(result: Any, url: str | None, what: str) -> None:
    """Check that a 2xx to a close or reward handed to `TURNLOG_GATEWAY_URL` is a turnlog
    gateway's (it says its `outcome`). Anything else that answers 2xx at that address
    (the router or an engine, named by mistake) took nothing: raised as a 404
    `not-a-gateway`, so the write goes to the store and a warning says why."""
    if isinstance(result, Mapping) and isinstance(result.get("outcome"), str):
        return
    raise TurnlogError({
        "type": URN + NOT_A_GATEWAY, "status": 404, "title": "Not a turnlog gateway",
        "detail": f"TURNLOG_GATEWAY_URL={url} answered the {what} with a success that is "
                  "not a turnlog gateway's (no `outcome`): is it the router's address?"})


def gateway_missed(exc: BaseException) -> bool:
    """The gateway could not take a close or a reward, which then goes to the store: it
    is unreachable or failing (its spool full among them), it has no such route (a
    gateway before them, or not a gateway at all), or it does not take this token
    (tokens of its own, or none given to it where `turnlog serve` has some)."""
    if not isinstance(exc, TurnlogError):
        return False
    if exc.status is None or exc.status >= 500 or exc.status in (401, 403):
        return True
    return exc.status in (404, 405) and exc.slug != "unknown-session"


@dataclass(frozen=True)
class GatewayMiss:
    """The gateway did not take a close: why, and its answer's status (None: it did not
    answer — down, silent — and is not asked about its spool either)."""

    why: str
    status: int | None


async def hand_to_gateway(settings: Settings, sid: str, result: Any,
                          error: BaseException | None, source: str,
                          ) -> Closed | GatewayMiss | None:
    """The close handed to the gateway, which carries it out behind the session's
    spooled turns or keeps it in its spool until it can. A `GatewayMiss` when the
    gateway could not take it (`gateway_missed`), None when none is named; a refusal
    of the close raises, as the store's."""
    gateway = settings.gateway_client()
    if gateway is None:
        return None
    async with gateway:
        try:
            return await _close(gateway, sid, result, error, source, settings.gateway)
        except TurnlogError as exc:
            if gateway_missed(exc):
                return GatewayMiss(f"the gateway at {settings.gateway} did not take the "
                                   f"close ({exc})", exc.status)
            raise
        except ValueError as exc:  # a 2xx whose body is not JSON: not a gateway's
            return GatewayMiss(f"the gateway at {settings.gateway} did not take the close "
                               f"(its answer is not a turnlog gateway's: {exc})", 404)


async def gateway_verdict(settings: Settings, sid: str, wait: float | None = None,
                          poll: float = SPOOL_POLL_S) -> tuple[bool, str | None]:
    """May the close go now? With `TURNLOG_GATEWAY_URL`, wait (`wait` seconds at most
    in all, DEADLINE by default; asking every `poll`) until the gateway holds no
    spooled turn of the session, so that the close cannot overtake them.

    (True, None): it may (no gateway set, or it holds none). (False, why): not yet —
    the gateway still holds some, or could not be asked (down or restarting, its spool
    may hold some). (True, why): it may, but the gateway was misnamed (a 4xx: an older
    gateway, or not a gateway at all; a URL that is not one), which `why` says."""
    if settings.gateway is None:
        return True, None
    held: int | None = None
    failure = "no answer"
    try:
        url = settings.gateway.rstrip("/") + escape_path(f"/turnlog/sessions/{sid}")
        async with asyncio.timeout(DEADLINE if wait is None else wait), httpx.AsyncClient(
                timeout=httpx.Timeout(DEADLINE, connect=CONNECT_TIMEOUT),
                transport=httpx.AsyncHTTPTransport(verify=_tls())) as http:
            while True:
                try:
                    reply = await http.get(url)
                    if 400 <= reply.status_code < 500:
                        return True, (f"TURNLOG_GATEWAY_URL={settings.gateway} answered "
                                      f"{reply.status_code} to {url}: not a turnlog gateway "
                                      "of this version; closed without asking it")
                    reply.raise_for_status()
                    held = _spooled_turns(reply)
                    if held is None:
                        return True, (f"TURNLOG_GATEWAY_URL={settings.gateway} answered "
                                      f"{url} with {reply.status_code} and no "
                                      "`spooled_turns`: not a turnlog gateway (is it the "
                                      "router's address?); closed without asking it")
                    if held <= 0:
                        return True, None
                except (httpx.UnsupportedProtocol, httpx.InvalidURL) as exc:
                    return True, (f"TURNLOG_GATEWAY_URL={settings.gateway} is not a URL to "
                                  f"ask ({exc}); closed without asking it")
                except Exception as exc:  # noqa: BLE001 - asked again until the deadline
                    held, failure = None, f"{type(exc).__name__}: {exc}"
                await asyncio.sleep(poll)
    except TimeoutError:
        pass
    except ValueError as exc:  # a URL httpx refuses outright
        return True, (f"TURNLOG_GATEWAY_URL={settings.gateway} is not a URL to ask ({exc}); "
                      "closed without asking it")
    if held is None:
        return False, (f"the gateway at {settings.gateway} could not say whether it holds "
                       f"spooled turns of this session ({failure})")
    return False, f"the gateway at {settings.gateway} still holds {held} spooled turn(s) of it"


def _spooled_turns(reply: httpx.Response) -> int | None:
    """A gateway's answer to `GET /turnlog/sessions/<sid>`: the spooled turns it holds;
    None for a body that is not one (a router's or an engine's catch-all 200)."""
    try:
        held = reply.json().get("spooled_turns")
    except (ValueError, AttributeError):
        return None
    return held if isinstance(held, int) and not isinstance(held, bool) else None


def close_later_helps(exc: BaseException) -> bool:
    """A close that failed this way may well go through later: turnlog unreachable or
    silent, a 5xx (its database down), the close's own deadline missed (a lock), or a
    gateway's spool full."""
    return isinstance(exc, TurnlogError) and (exc.retryable or exc.slug in NOT_RESENT)


# One try of a reward: taken (recorded, or spooled by the gateway), not now (to try again
# later), or else the problem that refused it for good.
TAKEN, NOT_NOW = "taken", "not now"


class Sender:
    """Where a hook call sends its rewards: to the gateway while it takes them (behind
    the session's spooled turns and close), else to the store. `deadline` (the event
    loop's clock) bounds a hook call: past it a reward is not now. Without one (the
    background), a gateway that does not answer is followed by the store. Use with
    `async with`; `notes` are what the call should say once."""

    def __init__(self, settings: Settings, deadline: float | None = None) -> None:
        self.settings = settings
        self.deadline = deadline
        self.gateway = settings.gateway_client()
        self.store: TurnlogClient | None = None
        self.notes: list[str] = []

    async def __aenter__(self) -> Sender:
        return self

    async def __aexit__(self, *_exc: object) -> None:
        for client in (self.gateway, self.store):
            if client is not None:
                await client.aclose()

    async def reward(self, reward: Reward) -> str:
        """TAKEN, NOT_NOW (no answer, a 5xx, or the session still open: its close
        waiting in the gateway's spool or deferred in some process), or the problem
        that refused it for good. Never raises."""
        try:
            async with asyncio.timeout_at(self.deadline):
                return await self._reward(reward)
        except TimeoutError:
            return NOT_NOW

    async def _reward(self, reward: Reward) -> str:
        if self.gateway is not None:
            try:
                gateway_took(await self._send(self.gateway, reward, _commit_within()),
                             self.settings.gateway, "reward")
                return TAKEN
            except ValueError as exc:  # a 2xx whose body is not JSON: not a gateway's
                self.notes.append(f"the gateway at {self.settings.gateway} did not take a "
                                  f"reward (its answer is not a turnlog gateway's: {exc}): "
                                  f"rewards sent to {self.settings.url}")
            except TurnlogError as exc:
                if not gateway_missed(exc):
                    return _verdict(reward, exc)
                if exc.status is None and self.deadline is not None:
                    return NOT_NOW  # no answer: no time left in this call to ask the store
                if exc.status in (401, 403) or exc.slug == NOT_A_GATEWAY:
                    self.notes.append(f"the gateway at {self.settings.gateway} did not take "
                                      f"a reward ({exc}): rewards sent to {self.settings.url}")
            await self.gateway.aclose()
            self.gateway = None  # no such route, failing or silent: the store from now on
        try:
            if self.store is None:
                self.store = self.settings.client()
            await self._send(self.store, reward, None)
        except TurnlogError as exc:
            return NOT_NOW if exc.status is None or exc.status >= 500 else \
                _verdict(reward, exc)
        except Exception as exc:  # noqa: BLE001 - a bad TURNLOG_URL, say: said, never raised
            return _problem(reward.name, exc)
        return TAKEN

    @staticmethod
    async def _send(tl: TurnlogClient, reward: Reward, commit_within: float | None) -> Any:
        return await tl.record_reward(reward.sid, reward.value,
                                      response_id=reward.response_id, source=reward.source,
                                      event_id=reward.event_id, commit_within=commit_within)


def _verdict(reward: Reward, exc: TurnlogError) -> str:
    """What a 4xx answer to a reward means: not now for a session still open; taken for
    a late close's reward the gateway recorded already (same event id, its own
    source); else the refusal."""
    if exc.slug == "session-open":
        return NOT_NOW
    if exc.slug == "idempotency-conflict" and reward.event_id.startswith(LATE_CLOSE_REWARD):
        return TAKEN
    return _problem(reward.name, exc)


async def send_rewards(sender: Sender, rewards: list[Reward]) -> tuple[int, list[str]]:
    """Record `rewards` in order (never raises). One that cannot go now, and every one
    after it in this call (each try may take until the deadline), is deferred (`defer`:
    tried again from the background, behind its session's deferred close if any); so is
    one whose session has deferred work already (in order behind it). Returns how many
    were not recorded now (refused, deferred or neither), and why."""
    failed, problems = 0, []
    later: list[Reward] = []
    stalled = False
    for reward in rewards:
        if stalled or reward.sid in _DEFERRED:
            later.append(reward)
            continue
        outcome = await sender.reward(reward)
        if outcome == NOT_NOW:
            stalled = True
            later.append(reward)
        elif outcome != TAKEN:
            failed += 1
            problems.append(outcome)
    deferred = 0
    for reward in later:  # behind the session's deferred close, if any, in order
        if not defer(sender.settings, reward.sid, rewards=[reward]):
            failed += 1
            problems.append(f"{reward.name} not recorded and not deferred either: "
                            f"{MAX_DEFERRED} sessions have deferred work already")
            continue
        deferred += 1
    if deferred:
        problems.append(f"{deferred} reward(s) deferred: turnlog did not take them now; they "
                        f"are sent again from this process every {CLOSE_LATER_POLL_S:g} s, "
                        f"for up to {CLOSE_LATER_S:g} s")
    return failed + deferred, sender.notes + problems


@dataclass(frozen=True)
class CloseArgs:
    """What a deferred close is made of: the agent's result or error, and the source of
    the reward it may leave."""

    result: Any
    error: BaseException | None
    source: str


@dataclass
class Deferred:
    """A session's work the hooks could not do yet, done from the background of the
    process in order: its close (when the agent hook deferred one), then its rewards,
    in the order they came (rewards need a closed session)."""

    settings: Settings
    sid: str
    close: CloseArgs | None
    rewards: list[Reward] = field(default_factory=list)


# The sessions with deferred work, and the background tasks doing it (one per session).
_DEFERRED: dict[str, Deferred] = {}
_TASKS: set[asyncio.Task[None]] = set()


def defer(settings: Settings, sid: str, close: CloseArgs | None = None,
          rewards: Iterable[Reward] = ()) -> bool:
    """Add to the session's deferred work (`finish` waits for it): a close goes before
    every reward, rewards after the ones deferred already. False when MAX_DEFERRED
    sessions have deferred work already (then nothing is added)."""
    found = _DEFERRED.get(sid)
    if found is None:
        if len(_DEFERRED) >= MAX_DEFERRED:
            return False
        found = _DEFERRED[sid] = Deferred(settings, sid, close)
        task = asyncio.get_running_loop().create_task(_send_deferred(found))
        _TASKS.add(task)
        task.add_done_callback(_TASKS.discard)
        task.add_done_callback(lambda _t: _forget(found))
    elif close is not None and found.close is None:
        found.close = close
    found.rewards.extend(rewards)
    return True


def _forget(deferred: Deferred) -> None:
    """From now on the session's work goes straight in (or to a new `Deferred`)."""
    if _DEFERRED.get(deferred.sid) is deferred:
        del _DEFERRED[deferred.sid]


async def finish(timeout: float | None = None) -> None:
    """Wait (`timeout` seconds at most; then TimeoutError, with the sessions still
    pending logged) for the closes and rewards the hooks deferred. They live in this
    process: call it before the process exits, or they are lost with it (each then
    logged as left open)."""
    try:
        async with asyncio.timeout(timeout):
            while _TASKS:
                await asyncio.wait(set(_TASKS))
    except TimeoutError:
        pending = sorted(_DEFERRED)
        log.warning("turnlog: deferred work of %d session(s) still pending: %s", len(pending),
                    ", ".join(pending[:20]))
        raise TimeoutError(f"turnlog: deferred work of {len(pending)} session(s) still "
                           f"pending after {timeout or 0:g} s (closes or rewards not yet "
                           "recorded; they are lost when this process exits)") from None


async def _send_deferred(deferred: Deferred) -> None:
    """A session's deferred work, tried every CLOSE_LATER_POLL_S (the first time one
    interval after the hook's own try) for CLOSE_LATER_S at most: its close
    (`_close_once`), then its rewards in order. Logged either way, never raised."""
    settings, sid = deferred.settings, deferred.sid
    loop = asyncio.get_running_loop()
    give_up = loop.time() + CLOSE_LATER_S
    why = "not tried"
    try:
        while loop.time() < give_up:
            await asyncio.sleep(CLOSE_LATER_POLL_S)
            if deferred.close is not None:
                args = deferred.close
                try:
                    # Asked for DEADLINE at most, so the next try hands it to the gateway.
                    closed, notes = await _close_once(settings, sid, args.result, args.error,
                                                      args.source,
                                                      min(give_up, loop.time() + DEADLINE))
                except Exception as exc:  # noqa: BLE001 - asked again, or said, below
                    if close_later_helps(exc):
                        why = _problem("close", exc)
                        continue
                    _forget(deferred)  # before it is said: nothing joins it after
                    log.warning("turnlog at %s did not record session %s (%d reward(s) "
                                "that waited for its close not recorded either): %s",
                                settings.url, sid, len(deferred.rewards),
                                _problem("close", exc))
                    return
                if isinstance(closed, str):
                    why = closed
                    continue
                deferred.close = None
                deferred.rewards[:0] = closed.rewards  # the agent's own, first
                for problem in notes + closed.problems:
                    log.warning("turnlog at %s: session %s: %s", settings.url, sid, problem)
                log.info("turnlog: session %s closed (deferred)", sid)
            async with Sender(settings) as sender:
                while deferred.rewards:
                    outcome = await sender.reward(deferred.rewards[0])
                    if outcome == NOT_NOW:
                        break
                    deferred.rewards.pop(0)
                    if outcome != TAKEN:
                        log.warning("turnlog at %s: %s", settings.url, outcome)
            # No await from this check on: work added meanwhile is seen here, or, once
            # the session is forgotten, done on its own.
            if not deferred.rewards and deferred.close is None:
                _forget(deferred)
                return
            why = "turnlog did not take its rewards yet (the session still open, or no answer)"
        why = f"after {CLOSE_LATER_S:g} s: {why}"
    except asyncio.CancelledError:
        _forget(deferred)
        _left_undone(deferred, "cancelled (the process is shutting down)")
        raise
    _forget(deferred)  # before it is said: nothing joins it after
    _left_undone(deferred, why)


async def _close_once(settings: Settings, sid: str, result: Any, error: BaseException | None,
                      source: str, ask_until: float) -> tuple[Closed | str, list[str]]:
    """One try of a close: handed to the gateway; else sent to the store once the gateway
    (if one is named) holds no spooled turn of the session, asked until `ask_until`
    (the event loop's clock; at least once). (the close, or why not yet; what to say).
    A close that fails raises."""
    notes: list[str] = []
    handed = await hand_to_gateway(settings, sid, result, error, source)
    if isinstance(handed, Closed):
        return handed, notes
    if handed is not None:
        if handed.status is None:
            return handed.why, notes  # down or silent: nor would it say what its spool holds
        if handed.status >= 500 or handed.status in (401, 403):
            notes.append(handed.why)  # (a gateway without the route: quietly)
    wait = max(ask_until - asyncio.get_running_loop().time(), SPOOL_POLL_S)
    may, why = await gateway_verdict(settings, sid, wait)
    if not may:
        return why or "the gateway holds turns of it", notes
    if why:
        notes.append(why)
    async with settings.client() as tl:
        return await _close(tl, sid, result, error, source), notes


def _left_undone(deferred: Deferred, why: str) -> None:
    if deferred.close is None:
        log.warning("turnlog at %s: %d deferred reward(s) of session %s not recorded: %s",
                    deferred.settings.url, len(deferred.rewards), deferred.sid, why)
        return
    log.warning("turnlog at %s: session %s left open, %d reward(s) not recorded: %s. "
                "Close it through its gateway, POST /turnlog/v1/sessions/<sid>/close "
                "(behind the session's spooled turns), or with POST /v1/sessions/<sid>/close "
                "once GET /turnlog/sessions/<sid> on the gateway says 0",
                deferred.settings.url, deferred.sid, len(deferred.rewards), why)


def _deferral(settings: Settings, sid: str, result: Any, error: BaseException | None,
              source: str, why: str | None) -> str:
    """Defer the close (`defer`); the problem that says so, or that it could not."""
    if not defer(settings, sid, CloseArgs(result, error, source)):
        return (f"close not sent ({why}) and not deferred either: {MAX_DEFERRED} sessions "
                "have deferred work already; the session stays open")
    return (f"close deferred ({why}): it is sent from this process once it can go "
            f"(asked every {CLOSE_LATER_POLL_S:g} s, for up to {CLOSE_LATER_S:g} s); the "
            "reward hook's rewards for the session wait for it")


async def _open(tl: TurnlogClient, body: dict[str, Any]) -> list[str]:
    """Open the session; a label the store refuses (a key outside its pattern, a value
    too long) is left out, and the open sent again, so one odd metadata key costs
    that label, not the session's labels (`run_id` among them). The labels left out
    are returned as problems; another failure raises."""
    problems: list[str] = []
    while True:
        try:
            await tl.open(body)
            return problems
        except TurnlogError as exc:
            key = (exc.field or "").removeprefix("labels.")
            if exc.status != 422 or not (exc.field or "").startswith("labels.") \
                    or key not in body["labels"]:
                raise
            body = {**body, "labels": {k: v for k, v in body["labels"].items() if k != key}}
            problems.append(f"label {key!r} left out ({exc.detail})")


def with_session_id(result: Any, sid: str) -> Any:
    """What the hook returns to miles: the agent's dict (or a dataclass's `metadata`)
    with `turnlog_session_id` added, `{"turnlog_session_id": sid}` for None. An object
    it cannot add the id to goes back as it is, with a warning (its rewards then
    cannot be matched to the session)."""
    if result is None:
        return {"turnlog_session_id": sid}
    if isinstance(result, Mapping):
        return {**result, "turnlog_session_id": sid}
    try:
        metadata = getattr(result, "metadata", None) if dataclasses.is_dataclass(result) \
            and not isinstance(result, type) else None
        if isinstance(metadata, Mapping):
            return dataclasses.replace(result, metadata={**metadata, "turnlog_session_id": sid})
    except Exception as exc:  # whatever its __init__ does: never a failed rollout
        log.warning("turnlog could not add turnlog_session_id to the agent's %s (%s): the "
                    "reward hook will not find session %s", type(result).__name__, exc, sid)
        return result
    log.warning("the agent returned a %s, not a dict: the reward hook will not find "
                "turnlog session %s", type(result).__name__, sid)
    return result


_NOT_GIVEN: Any = object()

# miles' agent contract: an agent function marked with this attribute (True) "fails
# closed": miles aborts the sample when it returns None, rather than training on turns
# whose outcome nobody vouched for. `agent` carries the mark and returns None only for an
# inner agent that carries it too; any other inner None becomes a dict, as before.
FAIL_CLOSED_MARK = "_miles_fail_closed_result"


class FailClosedNone(RuntimeError):
    """A fail-closed agent returned None: what the close records as `agent_error`
    (miles aborts the sample; nothing was raised)."""

    def __init__(self) -> None:
        super().__init__(f"the agent returned None and is marked fail-closed "
                         f"({FAIL_CLOSED_MARK}): miles aborts this sample")


def fails_closed(function: Any) -> bool:
    """Whether miles treats `function`'s None as a failure (it checks `is True`)."""
    return getattr(function, FAIL_CLOSED_MARK, False) is True


async def agent(base_url: str, prompt: Any, request_kwargs: dict[str, Any],
                metadata: Any = _NOT_GIVEN, **kwargs: Any) -> Any:
    """miles' agent function (`--custom-agent-function-path turnlog_client.miles.agent`):
    runs `TURNLOG_MILES_AGENT` between turnlog's open and close of the session, called
    with what miles gave (`metadata`, by keyword or fourth; a miles version that passes
    none gets none passed on)."""
    if metadata is not _NOT_GIVEN:
        kwargs["metadata"] = metadata
    settings = Settings.from_env()
    if settings.agent is None:
        raise RuntimeError("TURNLOG_MILES_AGENT is not set: name your agent function "
                           "(package.module.function) for turnlog_client.miles.agent to run")
    inner = load(settings.agent, "TURNLOG_MILES_AGENT")
    fail_closed = fails_closed(inner)
    try:
        sid = session_id_of(base_url)
    except ValueError as exc:  # an odd base_url: no session to record
        log.warning("turnlog cannot record this rollout (it goes on): %s", exc)
        alone = await inner(base_url=base_url, prompt=prompt,
                            request_kwargs=request_kwargs, **kwargs)
        # This hook is marked fail-closed: a None from an agent that is not would abort.
        return {} if alone is None and not fail_closed else alone
    metadata = kwargs.get("metadata")
    problems: list[str] = []
    try:
        tl: TurnlogClient | None = settings.client()
    except ValueError as exc:
        # A launcher's typo (TURNLOG_URL): no open from here, but the session id still
        # goes into the result (the reward hook finds the session by it), and the close
        # still goes to the gateway, if one is named (which opened the session itself).
        tl = None
        problems.append(f"the session is not opened here ({exc})")
    async with tl if tl is not None else contextlib.nullcontext():
        if tl is not None:
            try:
                problems += await _open(tl, open_body(
                    sid, settings, metadata if isinstance(metadata, Mapping) else None))
            except Exception as exc:  # turnlog never fails the rollout
                problems.append(_problem("open", exc))
        error: BaseException | None = None
        result: Any = None
        try:
            result = await inner(base_url=base_url, prompt=prompt,
                                 request_kwargs=request_kwargs, **kwargs)
        except (Exception, asyncio.CancelledError) as exc:
            # A cancelled rollout (miles' timeout, a shutdown) still closes its session,
            # then the cancellation goes on.
            error = exc
        refused = error is None and result is None and fail_closed
        source = settings.agent[:SOURCE_MAX]
        try:
            problems += await _close_session(settings, sid, result,
                                             FailClosedNone() if refused else error, source)
        except Exception as exc:
            problems.append(_problem("close", exc))
    if problems:
        log.warning("turnlog at %s, session %s (the rollout goes on): %s",
                    settings.url, sid, "; ".join(problems))
    if error is not None:
        raise error
    return None if refused else with_session_id(result, sid)


setattr(agent, FAIL_CLOSED_MARK, True)


async def abort(args: Any) -> Any:
    """miles' agent abort hook, passed on to the user's: miles calls the `abort` beside
    the agent function it runs (`<module of --custom-agent-function-path>.abort(args)`,
    when it aborts SGLang's requests: enough samples collected, weights updated) so that
    an external agent loop stops sending turns. With `agent` as miles' agent that is
    this function; it awaits the `abort` of `TURNLOG_MILES_AGENT`'s module, if that
    module has one, and returns what it returns. Without one (or without
    `TURNLOG_MILES_AGENT`) nothing happens, as in miles; its errors go to miles, which
    logs them."""
    # Read alone, not through `Settings.from_env` (which warns of every mistyped
    # variable, at each abort too).
    named = os.environ.get("TURNLOG_MILES_AGENT", "").strip()
    module_name, _name = split_dotted(named)
    if not module_name:  # unset, or no dotted path: `agent` says so when it runs
        return None
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError:  # said when the agent runs (`load`)
        return None
    inner = getattr(module, "abort", None)
    if inner is None or inner is abort:
        return None
    done = inner(args)
    return await done if inspect.isawaitable(done) else done


async def _close_session(settings: Settings, sid: str, result: Any,
                         error: BaseException | None, source: str) -> list[str]:
    """The close (`_close_once`, or deferred), then the rewards it brings: its problems;
    a close refused for good raises. The close takes two DEADLINEs at most (the
    gateway's try and the store's, or the wait for the gateway's spool and the
    store's); one cut short is deferred and sent again (a repeat, if it did land), and
    the rewards get one DEADLINE more."""
    loop = asyncio.get_running_loop()
    phase_end = loop.time() + 2 * DEADLINE
    try:
        async with asyncio.timeout_at(phase_end):
            closed, notes = await _close_once(settings, sid, result, error, source,
                                              phase_end - DEADLINE)
    except TimeoutError:
        return [_deferral(settings, sid, result, error, source,
                          f"no answer within {2 * DEADLINE:g} s")]
    except Exception as exc:
        if not close_later_helps(exc):
            raise
        return [_deferral(settings, sid, result, error, source, _problem("close", exc))]
    if isinstance(closed, str):
        return [*notes, _deferral(settings, sid, result, error, source, closed)]
    async with Sender(settings, loop.time() + DEADLINE) as sender:
        _failed, more = await send_rewards(sender, closed.rewards)
    return notes + closed.problems + more


def sample_metadata(sample: Any) -> Mapping[str, Any]:
    """A miles `Sample`'s `.metadata` (or a sample given as a dict: its "metadata")."""
    found = sample.get("metadata") if isinstance(sample, Mapping) else \
        getattr(sample, "metadata", None)
    return found if isinstance(found, Mapping) else {}


def reward_target(sample: Any) -> tuple[str, str | None] | None:
    """The session and the leaf's `response_id` (None: session-wide) a sample's reward
    goes to; None when the sample names no turnlog session."""
    metadata = sample_metadata(sample)
    sid = metadata.get("turnlog_session_id")
    if not isinstance(sid, str) or not sid:
        return None
    leaf = metadata.get("leaf")
    response_id = leaf.get("response_id") if isinstance(leaf, Mapping) else None
    return sid, response_id if isinstance(response_id, str) and response_id else None


async def record_rewards(settings: Settings, scored: Iterable[tuple[Any, Any]],
                         source: str) -> tuple[int, list[str]]:
    """Record each (sample, reward) — through the gateway when one is named and takes
    them (behind its spooled writes of the session: a close it spooled among them),
    else in the store; one that cannot go now is deferred (`send_rewards`). Returns how
    many were not recorded and why (never raises)."""
    rewards = [Reward(sid, value, response_id, source)
               for (sid, response_id), value in
               ((target, value) for target, value in
                ((reward_target(sample), finite(reward)) for sample, reward in scored)
                if target is not None and value is not None)]  # else nothing to record
    if not rewards:
        return 0, []
    async with Sender(settings, asyncio.get_running_loop().time() + DEADLINE) as sender:
        return await send_rewards(sender, rewards)


def reward_keys(args: Any) -> list[str]:
    """The entries of a dict reward miles reads, in order: `--reward-key`, then
    `--eval-reward-key` (those given)."""
    return [key for key in (getattr(args, "reward_key", None),
                            getattr(args, "eval_reward_key", None))
            if isinstance(key, str) and key]


def reward_value(reward: Any, args: Any) -> Any:
    """A sample's reward as miles reads it: a dict reward's `args.reward_key` entry
    (`--reward-key`), else the reward itself. A dict without that entry is read at
    `args.eval_reward_key` (`--eval-reward-key`), which miles reads for its
    evaluation datasets: the hook cannot tell an evaluation call from another."""
    if not isinstance(reward, Mapping):
        return reward
    keys = reward_keys(args)
    if not keys:
        return reward  # a dict: not a number, so not recorded
    return next((reward[key] for key in keys if key in reward), None)


_UNREAD_DICTS_SAID: list[bool] = []


def _say_unread_dicts(returned: list[tuple[Any, Any]], scored: list[tuple[Any, Any]],
                      args: Any) -> None:
    """Warn (once per process: miles calls the hook per sample) when a dict reward of a
    turnlog session had no number to record at miles' reward keys: silently, every
    sample of the run would reach the trainer without its reward."""
    if _UNREAD_DICTS_SAID:
        return
    for (sample, reward), (_sample, value) in zip(returned, scored, strict=True):
        if not isinstance(reward, Mapping) or finite(value) is not None \
                or reward_target(sample) is None:
            continue
        _UNREAD_DICTS_SAID.append(True)
        keys = reward_keys(args)
        found = next((key for key in keys if key in reward), None)
        if found is not None:
            why = f"its entry {found!r} is no finite number ({reward[found]!r:.40})"
        else:
            why = (f"it has no entry at miles' reward keys {keys} (pass --reward-key naming "
                   "the entry miles trains on)" if keys else
                   "miles has no --reward-key to read it at (pass one)")
        log.warning("the reward function returned a dict (keys %s) and turnlog records no "
                    "reward for it: %s (said once)", sorted(map(str, reward))[:8], why)
        return


async def rm(args: Any, samples: Any, **kwargs: Any) -> Any:
    """miles' reward function (`--custom-rm-path turnlog_client.miles.rm`): calls
    `TURNLOG_MILES_RM` as miles would — one sample, or a list of samples (batched) —
    records each reward for its turnlog session and returns the rewards unchanged."""
    settings = Settings.from_env()
    if settings.rm is None:
        raise RuntimeError("TURNLOG_MILES_RM is not set: name your reward function "
                           "(package.module.function) for turnlog_client.miles.rm to run")
    inner = load(settings.rm, "TURNLOG_MILES_RM")
    rewards = inner(args, samples, **kwargs)
    if inspect.isawaitable(rewards):
        rewards = await rewards
    if isinstance(samples, list):
        returned = list(zip(samples, rewards if isinstance(rewards, list | tuple) else [],
                            strict=False))
    else:
        returned = [(samples, rewards)]
    scored = [(sample, reward_value(reward, args)) for sample, reward in returned]
    with contextlib.suppress(Exception):  # a warning's trouble is never the rollout's
        _say_unread_dicts(returned, scored, args)
    try:
        failed, problems = await record_rewards(settings, scored, settings.rm[:SOURCE_MAX])
    except Exception as exc:  # turnlog never fails the rollout
        failed, problems = len(scored), [_problem("rewards", exc)]
    if problems and failed:
        log.warning("turnlog at %s did not record %d reward(s) (the rollout goes on): %s",
                    settings.url, failed, "; ".join(problems))
    elif problems:
        log.warning("turnlog at %s recorded the reward(s), but: %s", settings.url,
                    "; ".join(problems))
    return rewards
