"""`/v1/analytics/spec` and `/v1/metrics/rollout`: SpecInfo rates per group, rollout metrics.

Every query parameter other than the endpoint's own is a label filter
(`run_id=run7&rollout_id=12`), matched against the label's text form.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request

from app.api.deps import ServicesDep
from app.api.problems import JSONText
from app.api.routes.sessions import label_filters
from app.domain.body.queries import GROUP_BY_VALUES, parse_group_by

router = APIRouter(prefix="/v1", tags=["analytics"], default_response_class=JSONText)
SPEC_PARAMS = frozenset({"group_by"})
ROLLOUT_PARAMS = frozenset({"strict"})


@router.get("/analytics/spec")
async def spec_rates(
    request: Request,
    svc: ServicesDep,
    group_by: Annotated[str | None, Query(
        description=" | ".join(GROUP_BY_VALUES),
        json_schema_extra={"enum": list(GROUP_BY_VALUES)})] = None,
) -> JSONText:
    """Spec-decoding sums and rates per weight_version, model, run_id, rollout_id, hour or day."""
    return JSONText(await svc.analytics.spec_rates(parse_group_by(group_by),
                                                   label_filters(request, SPEC_PARAMS)))


@router.get("/metrics/rollout")
async def rollout_metrics(
    request: Request,
    svc: ServicesDep,
    strict: Annotated[bool, Query(
        description="409 if a special_token_* or non_assistant_text rate is non-zero")] = False,
) -> JSONText:
    """Miles-style rollout metrics over the closed sessions that match the label filters."""
    return JSONText(await svc.analytics.rollout(label_filters(request, ROLLOUT_PARAMS), strict))
