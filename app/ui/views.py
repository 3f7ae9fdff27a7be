"""What the pages show, as plain data: tree rows, a turn's messages, the run view.

Pure shaping of store and domain results for the templates: the tree in
depth-first order with its collapse ranges and indentation, a turn's new
messages as text, the run view's tables. Refuses every rule: retries,
dropped leaves, losses and rates come from `app/domain/`; no I/O, no HTML.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from markupsafe import Markup

from app.domain.ci.rollout_metrics import TITO_PREFIX
from app.domain.log.tree import SessionState
from app.domain.projection.lanes import node_marks
from app.domain.projection.overview import mismatch_lines
from app.domain.wire import jsonio

# Indentation steps the stylesheet has classes for; deeper branches share the last.
MAX_INDENT = 24


@dataclass(frozen=True)
class TreeRow:
    seq: int
    parent: int | None
    depth: int
    indent: int  # branch points above the node: a chain stays in one column
    last: int  # preorder index of the last row in this node's subtree
    children: int
    num_tokens: int
    prompt_len: int
    output_len: int
    finish_reason: str | None
    weight_version: str | None
    r3: tuple[int, int] | None
    retry: bool
    dropped: bool
    sample: int | None  # index of the sample this leaf became


# Unicode's directional controls (embeddings, overrides, isolates and marks): stored
# text is user data, and an unclosed override in one value reorders how the values
# after it in the same line display (a weight version "step-7<RLO>" made "step-7,
# step-8" read "step-78-pets ,"). A page shows them as visible codes instead.
BIDI_CONTROLS = {cp: f"[U+{cp:04X}]" for cp in
                 (0x061C, 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A))}


def visible_controls(value: Any) -> Any:
    """A value with its directional controls shown as `[U+202E]` (other values as-is;
    markup stays markup)."""
    if not isinstance(value, str):
        return value
    text = str(value)
    shown = text.translate(BIDI_CONTROLS)
    if shown == text:
        return value
    return Markup(shown) if isinstance(value, Markup) else shown


def text_of(value: Any) -> str | None:
    """A JSON value as a page shows it: strings as-is, anything else as JSON text."""
    if value is None:
        return None
    return value if isinstance(value, str) else jsonio.dumps(value)


def tree_rows(state: SessionState, leaf_sample: dict[int, int]) -> list[TreeRow]:
    """Every node once, depth first (children in seq order), so each subtree is
    the contiguous run of rows `[index, last]` that collapsing it hides."""
    marks = node_marks(state)
    order: list[tuple[int, int]] = []  # (seq, indent)
    stack = [(node.seq, 0) for node in reversed(state.nodes) if node.parent is None]
    while stack:  # iterative: a 1,024-deep chain must not hit the recursion limit
        seq, indent = stack.pop()
        order.append((seq, indent))
        children = state.node(seq).children
        step = 1 if len(children) > 1 else 0
        stack.extend((child, indent + step) for child in reversed(children))
    position = {seq: index for index, (seq, _) in enumerate(order)}
    last = list(range(len(order)))
    for index in range(len(order) - 1, -1, -1):
        parent = state.node(order[index][0]).parent
        if parent is not None:
            up = position[parent]
            last[up] = max(last[up], last[index])
    rows = []
    for index, (seq, indent) in enumerate(order):
        node = state.node(seq)
        facts = node.facts
        rows.append(TreeRow(
            seq=seq, parent=node.parent, depth=node.depth, indent=min(indent, MAX_INDENT),
            last=last[index], children=len(node.children), num_tokens=node.num_tokens,
            prompt_len=node.prompt_len, output_len=node.output_len,
            finish_reason=facts.finish_reason, weight_version=text_of(facts.weight_version),
            r3=node.r3_span, retry=marks.retry[seq], dropped=marks.dropped[seq],
            sample=leaf_sample.get(seq),
        ))
    return rows


def message_text(message: Any) -> dict[str, str]:
    """A chat message as role and text (structured content and tool calls as JSON)."""
    if not isinstance(message, dict):
        return {"role": "?", "content": text_of(message) or ""}
    parts = []
    content = message.get("content")
    if content is not None:
        parts.append(text_of(content) or "")
    if message.get("tool_calls"):
        parts.append(jsonio.dumps(message["tool_calls"]))
    return {"role": str(message.get("role", "?")), "content": "\n".join(parts)}


def turn_messages(payload: dict[str, Any]) -> dict[str, Any]:
    """The request's messages since the model last spoke, and the reply's message."""
    record = payload.get("record") or {}
    request = record.get("request") or {}
    messages = request.get("messages")
    new: list[Any] = []
    if isinstance(messages, list):
        for message in reversed(messages):
            if isinstance(message, dict) and message.get("role") == "assistant":
                break
            new.append(message)
        new.reverse()
    choices = (record.get("response") or {}).get("choices") or [{}]
    reply = choices[0].get("message") if isinstance(choices[0], dict) else None
    metadata = payload.get("metadata") or {}
    return {
        "messages": [message_text(m) for m in new],
        "reply": None if reply is None else message_text(reply),
        # One readable line per reported mismatch (the panel lists them).
        "mismatch": mismatch_lines(metadata.get("tito_session_mismatch")),
    }


@dataclass(frozen=True)
class RunView:
    by_hour: list[dict[str, Any]]
    by_weight: list[dict[str, Any]]
    counts: dict[str, Any]
    tito: list[tuple[str, float]]


def run_view(by_hour: dict[str, Any], by_weight: dict[str, Any],
             rollout: dict[str, Any]) -> RunView:
    """The run view from `/v1/analytics/spec` (two groupings) and `/v1/metrics/rollout`."""
    tito = sorted((key.removeprefix(TITO_PREFIX + "/"), float(value))
                  for key, value in rollout.items() if key.startswith(TITO_PREFIX))
    counts = {key: value for key, value in rollout.items() if not key.startswith(TITO_PREFIX)}
    counts["turns"] = sum(int(group["turns"]) for group in by_hour["groups"])
    return RunView(by_hour["groups"], by_weight["groups"], counts, tito)
