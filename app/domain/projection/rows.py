"""Projection rows as pure functions of the folded session.

Owns what the `sessions` head, `nodes` and `samples` rows contain, so that the
inline writer (append/close) and `rebuild` produce them from one definition,
bit for bit, and the checksum of a projection is well defined. Refuses any
knowledge of tables or transactions: the store maps these dicts to rows.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

import msgspec

from app.domain.body.labels import label_text
from app.domain.body.rewards import all_rewarded
from app.domain.body.session import SessionDefinition, uses_addition_r3
from app.domain.body.specinfo import SpecInfo, sum_turns
from app.domain.body.turn import COUNTER_MAX
from app.domain.log.tree import Node, SessionState
from app.domain.projection.samples import Sample, SamplesResult
from app.domain.wire import jsonio


def weight_version_text(value: Any) -> str | None:
    """A weight version as analytics group it: strings as-is, other JSON as text."""
    if value is None:
        return None
    return value if isinstance(value, str) else jsonio.canonical(value)


def hour_key(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, UTC).strftime("%Y-%m-%dT%H:00:00Z")


def day_key(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, UTC).strftime("%Y-%m-%d")


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def iso_us(us: int) -> str:
    """Microseconds since the epoch → ISO-8601 UTC with a `Z`; exact (integer arithmetic:
    through a float, 9999-12-31T23:59:59.999999 rounded into the year 10000)."""
    return (_EPOCH + timedelta(microseconds=us)).isoformat().replace("+00:00", "Z")


def node_row(session_id: str, node: Node, position: int, recorded_us: int) -> dict[str, Any]:
    facts = node.facts
    span = node.r3_span
    ts = facts.timestamp
    return {
        "session_id": session_id,
        "seq": node.seq,
        "parent": node.parent,
        "depth": node.depth,
        "num_tokens": node.num_tokens,
        "prompt_len": node.prompt_len,
        "prompt_lcp": node.prompt_lcp,
        "output_len": node.output_len,
        "r3_start": None if span is None else span[0],
        "r3_end": None if span is None else span[1],
        "finish_reason": facts.finish_reason,
        "weight_version": weight_version_text(facts.weight_version),
        **facts.spec_info.columns(),
        # The column is a BIGINT; a count beyond any real prompt is left out of it.
        "cached_tokens": facts.cached_tokens
        if facts.cached_tokens is not None and facts.cached_tokens <= COUNTER_MAX else None,
        "record_ts": ts,
        "record_hour": None if ts is None else hour_key(ts),
        "record_day": None if ts is None else day_key(ts),
        "position": position,
        "recorded_us": recorded_us,
    }


def session_head(state: SessionState, pending: Node | None = None) -> dict[str, Any]:
    """The mutable part of a `sessions` row: status, counts and the carrier sums.

    `pending` is a node about to be added: the head as it will be after it.
    """
    all_nodes = state.nodes if pending is None else [*state.nodes, pending]
    carrier = sum_turns(node.facts.spec_info for node in all_nodes)
    topk = state.topk
    if topk is None and pending is not None:
        topk = pending.facts.topk
    return {
        "status": "closed" if state.closed else "open",
        "num_nodes": len(all_nodes),
        "active_leaf": all_nodes[-1].seq if all_nodes else None,
        "topk": topk,
        **carrier.columns(),
    }


def tree_entry(node: Node) -> dict[str, Any]:
    """One entry of `GET /v1/sessions/{sid}` → `tree`."""
    span = node.r3_span
    return {
        "seq": node.seq,
        "parent": node.parent,
        "depth": node.depth,
        "num_tokens": node.num_tokens,
        "completion_span": [node.prompt_len, node.num_tokens],
        "finish_reason": node.facts.finish_reason,
        "weight_version": node.facts.weight_version,
        "is_leaf": node.is_leaf,
        "r3": None if span is None else {"start": span[0], "end": span[1]},
    }


def _row_text(row: Mapping[str, Any]) -> bytes:
    """Key-sorted compact JSON of one row (msgspec; the standard library for the rare
    row msgspec cannot encode, e.g. a lone surrogate)."""
    try:
        return msgspec.json.encode(row, order="sorted")
    except (UnicodeEncodeError, TypeError):
        return jsonio.canonical(dict(row)).encode("ascii")


def checksum(rows: Iterable[Mapping[str, Any]]) -> str:
    """Order-independent digest of projection rows: the sorted rows' JSON, hashed once.

    (JSON escapes newlines inside strings, so one row can never pass for two.)
    """
    digest = hashlib.sha256()
    for text in sorted(map(_row_text, rows)):
        digest.update(text)
        digest.update(b"\n")
    return digest.hexdigest()


def sample_row(session_id: str, sample: Sample) -> dict[str, Any]:
    return {
        "session_id": session_id,
        "sample_index": sample.index,
        "leaf": sample.leaf,
        "path": jsonio.dumps(sample.path),
        "status": sample.status,
        "num_tokens": len(sample.tokens),
        "response_length": sample.response_length,
        "weight_versions": jsonio.dumps(sample.weight_versions),
        **SpecInfo.from_dict(sample.spec_info).columns(),
        "reward": None if sample.reward is None else jsonio.dumps(sample.reward),
        "reward_source": sample.reward_source,
        "sample_metadata": jsonio.dumps(sample.metadata),
        "r3": None if sample.r3 is None else jsonio.dumps(sample.r3),
    }


def rewards_head(state: SessionState, result: SamplesResult) -> dict[str, Any]:
    """The reward columns of a closed session's row: how many rewards were recorded
    (what a cached fold is checked against) and whether every sample has one."""
    return {"num_rewards": len(state.rewards),
            "rewarded": all_rewarded(sample.reward for sample in result.samples)}


def closed_head(state: SessionState, result: SamplesResult, closed_us: int) -> dict[str, Any]:
    """The `sessions` row after close: head, close fingerprint and samples summary."""
    assert state.close is not None
    head = session_head(state)
    head.update({
        "closed_us": closed_us,
        "close_fingerprint": jsonio.fingerprint(state.close.body()),
        "empty_reason": result.empty_reason,
        "sample_errors": jsonio.dumps(result.errors),
        **rewards_head(state, result),
    })
    return head


def session_definition(definition: SessionDefinition, created_us: int) -> dict[str, Any]:
    """The immutable part of a `sessions` row: the open body, normalized."""
    return {
        "session_id": definition.session_id,
        "version": definition.version,
        "pause_generation_mode": definition.pause_generation_mode,
        "num_layers": definition.num_layers,
        "spec": definition.speculative,
        "max_trim_tokens": definition.max_trim_tokens,
        "labels": jsonio.dumps(definition.labels),
        "open_fingerprint": jsonio.fingerprint(definition.body()),
        "created_us": created_us,
    }


def open_rows(definition: SessionDefinition, created_us: int) -> tuple[dict[str, Any], str]:
    """What an open writes: the new session's whole `sessions` row (no turn yet) and
    its `session_opened` event's payload."""
    row = {**session_definition(definition, created_us),
           **session_head(SessionState(definition=definition))}
    return row, jsonio.dumps({"session": definition.body()})


def session_summary(row: Mapping[Any, Any]) -> dict[str, Any]:
    """A session as opened plus its status: the reply of open and list."""
    layers = row["num_layers"]
    closed_us = row["closed_us"]
    return {
        "session_id": row["session_id"],
        "version": row["version"],
        "pause_generation_mode": row["pause_generation_mode"],
        "use_addition_r3": uses_addition_r3(row["pause_generation_mode"]),
        "r3": None if layers is None else {"num_layers": layers},
        "spec": bool(row["spec"]),
        "max_trim_tokens": row["max_trim_tokens"],
        "labels": jsonio.loads(row["labels"]),
        "status": row["status"],
        "num_nodes": row["num_nodes"],
        "created_at": iso_us(row["created_us"]),
        "closed_at": None if closed_us is None else iso_us(closed_us),
    }


def label_rows(definition: SessionDefinition) -> list[dict[str, Any]]:
    return [{"session_id": definition.session_id, "key": key, "value_text": label_text(value)}
            for key, value in definition.labels.items()]


def project_session(
    state: SessionState,
    opened_us: int,
    closed_us: int | None,
    turns: Mapping[int, tuple[int, int]],
) -> dict[str, list[dict[str, Any]]]:
    """Every projection row of one session, from its fold (what `rebuild` writes).

    `turns` maps each seq to its event's (position, recorded_us).
    """
    from app.domain.projection.samples import build_samples

    sid = state.definition.session_id
    row = session_definition(state.definition, opened_us)
    sample_rows: list[dict[str, Any]] = []
    if state.close is not None and closed_us is not None:
        result = build_samples(state, state.close)
        row.update(closed_head(state, result, closed_us))
        sample_rows = [sample_row(sid, sample) for sample in result.samples]
    else:
        row.update(session_head(state))
        row.update({"closed_us": None, "close_fingerprint": None, "empty_reason": None,
                    "sample_errors": None, "num_rewards": 0, "rewarded": None})
    return {
        "sessions": [row],
        "session_labels": label_rows(state.definition),
        "nodes": [node_row(sid, node, *turns[node.seq]) for node in state.nodes],
        "samples": sample_rows,
    }
