"""One root→leaf path merged into one sample's arrays: docs/api.md §2.4 steps 1–5.

Owns TITO alignment (trailing-token trim), truncation by `max_seq_len`, the
per-turn status, the merge stop after the first non-completed turn, and the
merge into tokens, per-position log-probs and the kept turn behind every
response position. Refuses to own which leaves become samples, who owns a
completion shared by several samples, SpecInfo, R3 and the JSON shape — all
in `app/domain/projection/samples.py`, which calls `merge_path` once per leaf.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from app.domain.errors import Alignment
from app.domain.log.tree import Node, lcp

COMPLETED = "completed"
TRUNCATED = "truncated"
ABORTED = "aborted"
PENDING = "pending"

_STATUS = {"stop": COMPLETED, "tool_calls": COMPLETED, "length": TRUNCATED, "abort": ABORTED}


def turn_status(finish_reason: str | None) -> str:
    """stop|tool_calls → completed, length → truncated, abort → aborted, else pending."""
    if finish_reason is None:
        return PENDING
    return _STATUS.get(finish_reason, PENDING)


def align(path: Sequence[Node], max_trim_tokens: int) -> list[int]:
    """Output tokens each turn keeps after the TITO trailing-token trim.

    The accumulated ids are the leaf's tokens. A turn's output is matched
    against them from `len(prompt)`; what does not match was re-rendered by
    the next turn's chat template (a stop token doubling as a delimiter), so
    it is trimmed — at most `max_trim_tokens` on a non-final turn, none on the
    final one, whose tokens *are* the accumulated ids.
    """
    acc = path[-1].tokens
    last = len(path) - 1
    kept: list[int] = []
    for index, node in enumerate(path):
        output = node.output
        start = node.prompt_len
        matched = lcp(output, acc[start:start + output.size])
        unmatched = int(output.size) - matched
        allowed = 0 if index == last else max_trim_tokens
        if unmatched > allowed:
            where = "the final turn" if index == last else "a non-final turn"
            raise Alignment(
                f"turn {node.seq} (path[{index}]): {unmatched} trailing output tokens do not "
                f"match the leaf's accumulated ids from position {start + matched}; at most "
                f"{allowed} may be trimmed on {where}",
                field=f"path[{index}]", expected=f"at most {allowed} unmatched tokens",
                actual=unmatched, extra={"seq": node.seq},
            )
        kept.append(matched)
    return kept


def truncate(path: Sequence[Node], kept: Sequence[int],
             max_seq_len: int | None) -> tuple[list[int], bool]:
    """Kept output per surviving turn (a prefix of the path) and whether
    anything was removed. The first turn over the limit loses the overshoot
    from its output, or is dropped when none would remain; later turns go."""
    if max_seq_len is None:
        return list(kept), False
    surviving: list[int] = []
    for node, count in zip(path, kept, strict=True):
        total = node.prompt_len + count
        if total <= max_seq_len:
            surviving.append(count)
            continue
        remaining = count - (total - max_seq_len)
        if remaining > 0:
            surviving.append(remaining)
        return surviving, True
    return surviving, False


@dataclass(frozen=True)
class MergedPath:
    """A path's sample before ownership, SpecInfo and R3 are applied.

    `writer[i]` is the index (into `turns`) of the kept turn whose output sits
    at response position i, or -1 for tokens between outputs (tool, user,
    template). Keeping the writer instead of a 0/1 mask lets the caller zero a
    shared node's positions without re-deriving where they are.
    """

    leaf: int
    path: tuple[int, ...]
    turns: tuple[Node, ...]
    kept: tuple[int, ...]
    truncated: bool
    status: str
    tokens: np.ndarray
    response_start: int
    writer: np.ndarray
    logprobs: np.ndarray

    @property
    def response_length(self) -> int:
        return int(self.tokens.size) - self.response_start

    def loss_mask(self, owned: Sequence[bool]) -> np.ndarray:
        """1 where a kept output token of an owned turn sits, else 0."""
        flags = np.asarray(list(owned) + [False], dtype=bool)
        # writer == -1 indexes the trailing False.
        return flags[self.writer].astype(np.int64)


def _stop_after_first_incomplete(path: Sequence[Node], surviving: int) -> int:
    for index in range(surviving):
        if turn_status(path[index].facts.finish_reason) != COMPLETED:
            return index + 1
    return surviving


def _response(turns: Sequence[Node], kept: Sequence[int], start: int,
              length: int) -> tuple[np.ndarray, np.ndarray]:
    writer = np.full(length, -1, dtype=np.int64)
    logprobs = np.zeros(length, dtype=np.float64)
    for index, (node, count) in enumerate(zip(turns, kept, strict=True)):
        lo = node.prompt_len - start
        a, b = max(lo, 0), min(lo + count, length)
        if a >= b:
            continue
        # A later turn overwrites an earlier one where they overlap: its
        # log-prob was sampled in the context the final tokens actually have.
        writer[a:b] = index
        logprobs[a:b] = node.logprobs[a - lo:b - lo]
    return writer, logprobs


def merge_path(path: Sequence[Node], *, max_trim_tokens: int,
               max_seq_len: int | None) -> MergedPath | None:
    """Steps 1–5 for one root→leaf path; None if truncation removed every turn.

    Raises `Alignment` naming the turn when the path cannot be assembled.
    """
    kept_all = align(path, max_trim_tokens)
    surviving, truncated = truncate(path, kept_all, max_seq_len)
    if not surviving:
        return None
    count = _stop_after_first_incomplete(path, len(surviving))
    turns = tuple(path[:count])
    kept = tuple(surviving[:count])
    last = turns[-1]
    tokens = np.concatenate([last.prompt, last.output[:kept[-1]]])
    start = turns[0].prompt_len
    length = int(tokens.size) - start
    if length < 0:
        raise Alignment(
            f"turn {last.seq} (path[{count - 1}]) ends at {tokens.size} tokens, before the "
            f"first turn's prompt ({start} tokens): the path's prompts do not extend each other",
            field=f"path[{count - 1}]", expected=f"at least {start} tokens",
            actual=int(tokens.size), extra={"seq": last.seq},
        )
    writer, logprobs = _response(turns, kept, start, length)
    status = TRUNCATED if truncated else turn_status(last.facts.finish_reason)
    return MergedPath(
        leaf=path[-1].seq,
        path=tuple(node.seq for node in path),
        turns=turns,
        kept=kept,
        truncated=truncated,
        status=status,
        tokens=tokens,
        response_start=start,
        writer=writer,
        logprobs=logprobs,
    )
