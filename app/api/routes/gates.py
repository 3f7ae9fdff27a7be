"""`/v1/gates/evaluate`: judge a run's metric history against trusted baselines."""

from __future__ import annotations

from fastapi import APIRouter

from app.api.deps import BodyDep, ServicesDep
from app.api.problems import JSONText
from app.domain.ci.gate_definitions import parse_check

router = APIRouter(prefix="/v1/gates", tags=["gates"], default_response_class=JSONText)

EVALUATE_BODY = {"requestBody": {"required": True, "content": {"application/json": {
    "schema": {"type": "object", "required": ["coordinate", "run_id"],
               "additionalProperties": False, "properties": {
                   "coordinate": {"type": "object"},
                   "run_id": {"type": "string"},
                   "specs": {"type": ["array", "null"], "items": {
                       "type": "object", "required": ["metric"], "properties": {
                           "metric": {"type": "string"},
                           "steps": {"oneOf": [{"enum": ["last", "all"]},
                                               {"type": "array",
                                                "items": {"type": "integer"}}]},
                           "constraint": {"type": "object"}}}},
                   "record": {"type": "boolean"}}},
    "example": {"coordinate": {"test_path": "tests/e2e/test_grpo.py", "backend": "cuda",
                               "suite": "stage-c"},
                "run_id": "ci-1234",
                "specs": [{"metric": "train/ppo_kl"},
                          {"metric": "train/grad_norm", "steps": [0, 10],
                           "constraint": {"rel_up": 0.5, "rel_down": 0.5}}]}}}}}


@router.post("/evaluate", openapi_extra=EVALUATE_BODY)
async def evaluate(svc: ServicesDep, body: BodyDep) -> JSONText:
    """The verdict (`trusted` / `failed` / `error`) listing every judged coordinate."""
    return JSONText(await svc.gates.evaluate(parse_check(body)))
