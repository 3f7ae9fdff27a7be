"""`/v1/metric-history`: CI metric series per run, and a rollout's metrics as one step."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query

from app.api.deps import BodyDep, ServicesDep
from app.api.problems import JSONText
from app.domain.ci.metric_history import parse_coordinate, parse_rollout_record, parse_submission

router = APIRouter(prefix="/v1/metric-history", tags=["metric history"],
                   default_response_class=JSONText)

_VALUE = {"oneOf": [{"type": "number"}, {"enum": ["NaN", "Infinity", "-Infinity"]}]}
_COORDINATE = {"type": "object", "required": ["test_path", "backend", "suite"],
               "additionalProperties": False,
               "properties": {name: {"type": "string", "minLength": 1}
                              for name in ("test_path", "backend", "suite")}}
_RUN = {"coordinate": _COORDINATE, "run_id": {"type": "string", "minLength": 1},
        "attempt": {"type": "integer", "minimum": 0}, "trusted": {"type": "boolean"}}
_EXAMPLE_RUN = {"coordinate": {"test_path": "tests/e2e/test_grpo.py", "backend": "cuda",
                               "suite": "stage-c"},
                "run_id": "ci-1234", "attempt": 0, "trusted": True}


def _body(properties: dict[str, Any], required: list[str],
          example: dict[str, Any]) -> dict[str, Any]:
    schema = {"type": "object", "required": required, "additionalProperties": False,
              "properties": properties}
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": schema, "example": example}}}}


SUBMIT_BODY = _body({**_RUN, "points": {"type": "array", "items": {
    "type": "object", "required": ["metric", "step", "value"], "additionalProperties": False,
    "properties": {"metric": {"type": "string"}, "step": {"type": ["integer", "null"]},
                   "value": _VALUE}}}},
    ["coordinate", "run_id", "attempt", "points"],
    {**_EXAMPLE_RUN, "points": [{"metric": "train/ppo_kl", "step": 0, "value": 0.012},
                                {"metric": "train/grad_norm", "step": 0, "value": "NaN"}]})
ROLLOUT_BODY = _body({**_RUN, "step": {"type": ["integer", "null"], "minimum": 0},
                      "labels": {"type": "object"}},
                     ["coordinate", "run_id", "attempt", "step"],
                     {**_EXAMPLE_RUN, "step": 12, "labels": {"run_id": "run7",
                                                             "rollout_id": 12}})


@router.post("", status_code=201, openapi_extra=SUBMIT_BODY)
async def submit(svc: ServicesDep, body: BodyDep) -> JSONText:
    """Store one attempt's points (whitelisted keys only); answers the run's merged series."""
    reply, created = await svc.history.submit(parse_submission(body))
    return JSONText(reply, status_code=201 if created else 200)


@router.get("")
async def run_history(
    svc: ServicesDep,
    test_path: Annotated[str, Query()],
    backend: Annotated[str, Query()],
    suite: Annotated[str, Query()],
    run_id: Annotated[str, Query()],
) -> JSONText:
    """A run's series, every attempt merged (concatenated, sorted by step)."""
    coordinate = parse_coordinate({"test_path": test_path, "backend": backend, "suite": suite})
    return JSONText((await svc.history.run(coordinate, run_id)).as_dict())


@router.post("/rollout", status_code=201, openapi_extra=ROLLOUT_BODY)
async def record_rollout(svc: ServicesDep, body: BodyDep) -> JSONText:
    """Record `GET /v1/metrics/rollout` for the labelled sessions as the points of one step."""
    reply, created = await svc.history.record_rollout(parse_rollout_record(body),
                                                     svc.analytics)
    return JSONText(reply, status_code=201 if created else 200)
