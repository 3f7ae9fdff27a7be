"""The samples projection of a closed session (docs/api.md §2).

Owns which leaves become samples (v1: the latest path; v2: every leaf but
retries, longest path first), who keeps the loss of a completion shared by
several v2 samples, each sample's SpecInfo, metadata, reward and R3 plan, the
empty reasons, the exact sample JSON and the session carrier
(`session_metrics`, SpecInfo summed over every node). Refuses to own the
per-path merge (`app/domain/projection/samples_merge.py`), R3 row planning
(`app/domain/projection/assembly.py`), which recorded reward a sample shows
(`app/domain/body/rewards.py`), SpecInfo arithmetic (`app/domain/body/specinfo.py`)
and persistence or streaming (the store materializes arrays and tensors from
the log on demand).

Leaf turn: a sample's `leaf` is the last node of its root→leaf `path`, even
when truncation or the merge stop left that node out of the sample's tokens.
The TITO mismatch report is the session server's verdict on that whole path,
so `metadata.tito_session_mismatch` always comes from the leaf node.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from app.domain.body.rewards import latest_rewards
from app.domain.body.session import SessionClose
from app.domain.body.specinfo import sum_turns
from app.domain.errors import Alignment, R3Gap, UnknownSample
from app.domain.log.tree import Node, SessionState
from app.domain.projection.assembly import R3Plan, plan_r3
from app.domain.projection.samples_merge import MergedPath, merge_path

NO_TURNS = "no_turns"
ALL_TRUNCATED = "all_truncated"
ASSEMBLY_ERROR = "assembly_error"


def session_carrier(state: SessionState) -> dict[str, Any] | None:
    """`session_metrics`: every node counted once, whatever the leaves.

    Retries, rolled-back branches and turns that truncation cut all cost
    speculative work, so they count here although no sample trains on them;
    summing per leaf instead would count shared ancestors once per leaf.
    """
    if not state.definition.speculative:
        return None
    total = sum_turns(node.facts.spec_info for node in state.nodes)
    return {"session_id": state.definition.session_id, "metrics": {"spec_info": total.as_dict()}}


@dataclass(frozen=True)
class Sample:
    index: int
    leaf: int
    path: list[int]
    turns: list[int]  # seqs of the kept turns: a prefix of `path`
    tokens: list[int]
    response_length: int
    loss_mask: list[int]
    rollout_log_probs: list[float]
    status: str
    weight_versions: list[Any]
    spec_info: dict[str, int]
    reward: Any
    metadata: dict[str, Any]
    r3: dict[str, Any] | None
    r3_plan: R3Plan | None = None
    # Raised when the tensor is read, not when the sample is built: a gap
    # costs the trainer the replay tensor, never the rest of the sample.
    r3_error: R3Gap | None = None
    # The miles samples wire's text fields (`app/domain/projection/samples_wire.py`).
    response: str = ""
    prefix_cache_info: dict[str, int] = field(default_factory=dict)
    # Where `reward` came from: the `source` of the recorded reward it is, null for
    # the close's reward (or a recorded one sent without a source).
    reward_source: str | None = None

    def read_plan(self) -> R3Plan:
        """The plan `…/samples/{index}/r3` streams: 404 without R3, 422 on a gap."""
        if self.r3_error is not None:
            raise self.r3_error
        if self.r3_plan is None:
            raise UnknownSample(f"sample {self.index} has no R3", field="index",
                                expected="a sample whose session and turns carry R3",
                                actual=self.index)
        return self.r3_plan

    def to_json(self, arrays: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {"index": self.index, "leaf": self.leaf, "path": self.path}
        if arrays:
            out["tokens"] = self.tokens
        out["response_length"] = self.response_length
        if arrays:
            out["loss_mask"] = self.loss_mask
            out["rollout_log_probs"] = self.rollout_log_probs
        out.update({
            "status": self.status,
            "weight_versions": self.weight_versions,
            "spec_info": self.spec_info,
            "reward": self.reward,
            "reward_source": self.reward_source,
            "metadata": self.metadata,
            "r3": self.r3,
        })
        return out


@dataclass(frozen=True)
class SamplesResult:
    session_id: str
    version: str
    samples: list[Sample]
    errors: list[dict[str, Any]] = field(default_factory=list)
    empty_reason: str | None = None
    session_metrics: dict[str, Any] | None = None
    labels: dict[str, Any] = field(default_factory=dict)

    def sample(self, index: int) -> Sample:
        if not 0 <= index < len(self.samples):
            raise UnknownSample(f"session has no sample {index}", field="index",
                                expected=f"an index below {len(self.samples)}", actual=index)
        return self.samples[index]

    def to_json(self, arrays: bool = True, pruned: bool = False) -> dict[str, Any]:
        """The §2 body; `pruned`: the session's R3 was freed by retention, which each
        sample's `r3` says (`"pruned": true`: its shape stays, its rows are gone)."""
        samples = [sample.to_json(arrays) for sample in self.samples]
        if pruned:
            for sample in samples:
                if sample["r3"] is not None:
                    sample["r3"] = {**sample["r3"], "pruned": True}
        return {
            "session_id": self.session_id,
            "version": self.version,
            "empty_reason": self.empty_reason,
            "errors": self.errors,
            "samples": samples,
            "session_metrics": self.session_metrics,
        }


def is_retry(state: SessionState, node: Node) -> bool:
    """A node whose parent was extended again later: superseded by that retry."""
    if node.parent is None:
        return False
    return max(state.node(node.parent).children) > node.seq


def pick_leaves(state: SessionState) -> list[Node]:
    """The leaves that become samples, in sample order."""
    if not state.nodes:
        return []
    if state.definition.version == "v1":
        # The most recently committed node never has children (they would be
        # newer), so it is a leaf; earlier branches were rolled back.
        return [state.nodes[-1]]
    leaves = [node for node in state.leaves() if not is_retry(state, node)]
    # Path length is depth + 1.
    leaves.sort(key=lambda node: (node.depth, node.seq), reverse=True)
    return leaves


def _owners(merged: list[MergedPath]) -> dict[int, int]:
    """Node seq → the smallest leaf seq among the returned samples keeping it.

    Ownership goes by the turns a sample keeps, not its whole path: a sample
    that truncation cut before a node cannot train it, so it must not own it.
    """
    owners: dict[int, int] = {}
    for item in merged:
        for node in item.turns:
            owners[node.seq] = min(owners.get(node.seq, item.leaf), item.leaf)
    return owners


def _r3(state: SessionState, item: MergedPath
        ) -> tuple[dict[str, Any] | None, R3Plan | None, R3Gap | None]:
    num_layers = state.definition.num_layers
    if num_layers is None:
        return None, None, None
    # topk is unknown only when every R3 payload so far had zero rows.
    topk = state.topk or 0
    rows = int(item.tokens.size) - 1
    try:
        plan = plan_r3(item.turns, rows, addition=state.definition.use_addition_r3,
                       num_layers=num_layers, topk=topk,
                       path=[state.node(seq) for seq in item.path])
    except R3Gap as gap:
        return {"shape": [rows, num_layers, topk], "dtype": "int32"}, None, gap
    if plan is None:
        return None, None, None
    return {"shape": [plan.rows, num_layers, topk], "dtype": "int32"}, plan, None


def _sample(state: SessionState, close: SessionClose, index: int, item: MergedPath,
            owners: dict[int, int] | None) -> Sample:
    owned = [owners is None or owners[node.seq] == item.leaf for node in item.turns]
    leaf = state.node(item.leaf)
    metadata: dict[str, Any] = {}
    if leaf.facts.mismatch is not None:
        metadata["tito_session_mismatch"] = leaf.facts.mismatch
    r3, plan, gap = _r3(state, item)
    return Sample(
        index=index,
        leaf=item.leaf,
        path=list(item.path),
        turns=[node.seq for node in item.turns],
        tokens=item.tokens.tolist(),
        response_length=item.response_length,
        loss_mask=item.loss_mask(owned).tolist(),
        rollout_log_probs=item.logprobs.tolist(),
        status=item.status,
        # A turn whose meta_info has no weight_version has none to report; one that
        # sent null reports null (miles appends the value whenever the key is there).
        weight_versions=[node.facts.weight_version for node in item.turns
                         if node.facts.sends_weight_version],
        spec_info=sum_turns(node.facts.spec_info for node in item.turns).as_dict(),
        reward=close.reward,
        metadata=metadata,
        r3=r3,
        r3_plan=plan,
        r3_error=gap,
        response="".join(node.facts.content for node in item.turns),
        prefix_cache_info={
            "cached_tokens": sum(node.facts.cached_tokens or 0 for node in item.turns),
            "total_prompt_tokens": sum(node.facts.prompt_tokens for node in item.turns),
        },
    )


def build_samples(state: SessionState, close: SessionClose) -> SamplesResult:
    """The whole projection of a closed session; alignment failures never block it."""
    sid, version = state.definition.session_id, state.definition.version
    carrier = session_carrier(state)
    if not state.nodes:
        return SamplesResult(sid, version, [], [], NO_TURNS, carrier, state.definition.labels)
    merged: list[MergedPath] = []
    errors: list[dict[str, Any]] = []
    for leaf in pick_leaves(state):
        try:
            item = merge_path(state.path(leaf.seq),
                              max_trim_tokens=state.definition.max_trim_tokens,
                              max_seq_len=close.max_seq_len)
        except Alignment as exc:
            errors.append({"leaf": leaf.seq, "type": exc.slug, "detail": exc.detail})
            continue
        if item is not None:
            merged.append(item)
    owners = _owners(merged) if version == "v2" else None
    samples = [_sample(state, close, index, item, owners) for index, item in enumerate(merged)]
    empty_reason = None
    if not samples:
        # Every picked leaf was either unalignable or truncated away; any
        # error is the actionable cause, so it wins over truncation.
        empty_reason = ASSEMBLY_ERROR if errors else ALL_TRUNCATED
    return with_rewards(
        SamplesResult(sid, version, samples, errors, empty_reason, carrier,
                      state.definition.labels),
        state, close)


def leaf_response_ids(state: SessionState, samples: list[Sample]) -> list[str | None]:
    """Each sample's leaf `response.id`, in sample order (what `response_id` names)."""
    return [state.node(sample.leaf).facts.response_id for sample in samples]


def with_rewards(result: SamplesResult, state: SessionState,
                 close: SessionClose) -> SamplesResult:
    """`result` with each sample's reward and source after the recorded rewards."""
    if not state.rewards:
        return result
    chosen = latest_rewards(close.reward, leaf_response_ids(state, result.samples),
                            state.rewards.values())
    return replace(result, samples=[
        replace(sample, reward=pick.reward, reward_source=pick.source)
        for sample, pick in zip(result.samples, chosen, strict=True)])
