"""`/ui`: the web UI's pages and the small JSON and SVG fragments their scripts load.

Thin handlers: data from the store services (`app.state.services`), rules
from `app/domain/`, shaping in `app/ui/views.py` and `plots.py`, HTML in the
Jinja templates (autoescaped: every label, id and record text is user data).
A page that fails answers an HTML error page; the fragments answer
problem+json like the API. Refuses auth and headers (`app/ui/guard.py`).
"""

from __future__ import annotations

import posixpath
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit

from fastapi import APIRouter, Query, Request
from fastapi.responses import RedirectResponse, Response

from app.access import TokenTable
from app.api.deps import Blank, OptStr, ServicesDep, server_closing
from app.api.problems import JSONText
from app.api.routes.sessions import label_filters
from app.domain.body.labels import (
    label_filter_text,
    label_text,
    parse_label_filter_text,
    parse_label_filters,
)
from app.domain.body.queries import SESSIONS_PAGE, parse_status, parse_wait
from app.domain.body.specinfo import SpecInfo
from app.domain.errors import DomainError, UnknownParent
from app.domain.projection.lanes import token_lanes
from app.domain.projection.overview import (
    mismatch_lines,
    newest_version,
    off_policy_lag,
    parse_list_view,
    reward_distribution,
    session_overview,
)
from app.domain.projection.samples import session_carrier
from app.store.read import browse
from app.ui import plots, tokens
from app.ui.guard import COOKIE
from app.ui.render import error_page, render, templates, utf8
from app.ui.views import run_view, text_of, tree_rows, turn_messages

STATIC = Path(__file__).parent / "static"
LIST_PARAMS = frozenset({"status", "limit", "labels", "sort", "reward_min", "reward_max",
                         "sample_status"})
# Below this many hourly points the run view plots 10-minute buckets instead.
FEW_HOURS = 3
FINE_BUCKET_S = 600
FEED_WAIT = 25.0
LOGIN_FORM_BYTES = 8192

router = APIRouter(prefix="/ui", include_in_schema=False, default_response_class=JSONText)


@router.get("", response_model=None)
async def index(
    request: Request, svc: ServicesDep, status: OptStr = None, limit: OptStr = None,
    labels: OptStr = None, sort: OptStr = None, reward_min: OptStr = None,
    reward_max: OptStr = None, sample_status: OptStr = None,
) -> Response:
    try:
        filters = label_filters(request, LIST_PARAMS)
        if labels is not None:
            # The filter form's free-text field: redirect to the canonical `?key=value` URL.
            query = [(k, v) for k, v in request.query_params.multi_items() if k != "labels"]
            return RedirectResponse(
                f"/ui?{urlencode(query + parse_label_filter_text(labels))}", status_code=303)
        view = parse_list_view(sort, reward_min, reward_max, sample_status)
        page_size = SESSIONS_PAGE.parse_text(limit)
        recent = await browse.recent_sessions(svc.db, parse_status(status), filters, page_size)
        facts = await browse.sample_facts(svc.db, [s["session_id"] for s in recent.sessions])
        run = None
        rewards = None
        timeline = None
        if filters:
            run = run_view(await svc.analytics.spec_rates("hour", filters),
                           await svc.analytics.spec_rates("weight_version", filters),
                           await svc.analytics.rollout(filters))
            rewards = reward_distribution(await browse.run_rewards(svc.db, filters))
            if len(run.by_hour) <= FEW_HOURS:
                timeline = await browse.spec_rates_by_bucket(svc.db, filters, FINE_BUCKET_S)
    except DomainError as exc:
        return error_page(exc)
    rows = view.order([(s, session_overview(facts.get(s["session_id"], [])))
                       for s in recent.sessions])
    charts = None
    if run is not None:
        if timeline is not None:
            # A short run: 10-minute buckets of the records' own time (UTC).
            times = [datetime.fromtimestamp(g["key"], UTC) for g in timeline]
            hours = [t.strftime("%Y-%m-%dT%H:%M:%SZ") for t in times]
            hour_axis = [t.strftime("%H:%M") for t in times]
            by_time = timeline
            bucket = "10 minutes"
        else:
            hours = [str(g["key"]) for g in run.by_hour]
            # `2026-11-29T08:00:00Z` → `11-29 08:00` on the axis.
            hour_axis = [hour[5:16].replace("T", " ") for hour in hours]
            by_time = run.by_hour
            bucket = "hour"
        weights = [text_of(g["key"]) or "none" for g in run.by_weight]
        charts = {
            "bucket": bucket,
            "rate_by_hour": plots.chart(hours, [g["accept_rate"] for g in by_time], 1.0,
                                        axis=hour_axis),
            "length_by_hour": plots.chart(hours, [g["accept_length"] for g in by_time],
                                          axis=hour_axis),
            "rate_by_weight": plots.chart(weights, [g["accept_rate"] for g in run.by_weight],
                                          1.0),
            "length_by_weight": plots.chart(weights,
                                            [g["accept_length"] for g in run.by_weight]),
        }
    view_query = {key: value for key, value in (
        ("sort", view.sort), ("reward_min", reward_min or ""), ("reward_max", reward_max or ""),
        ("sample_status", view.sample_status or "")) if value}
    # Every link and the filter form keep what the page shows: its filters, its view
    # (sort, reward range, sample status) and its page size.
    shown = {**({"status": status} if status else {}), **dict(filters)}
    sized = {"limit": str(page_size)} if limit else {}
    # A full page may hide older sessions: offer the largest page the list allows.
    more = len(recent.sessions) >= page_size and page_size < SESSIONS_PAGE.maximum
    more_query = urlencode({**shown, **view_query, "limit": SESSIONS_PAGE.maximum})
    return render("index.html", rows=rows, status=status, filters=dict(filters),
                  filters_text=label_filter_text(dict(filters)), page_limit=sized.get("limit"),
                  view=view, view_query=view_query, rewards=rewards,
                  reward_plots=None if rewards is None else plots.reward_histograms(rewards),
                  more_query=more_query if more else None,
                  list_cursor=recent.list_cursor, feed_cursor=recent.feed_cursor,
                  filter_query=urlencode(shown),
                  sort_query=lambda column: urlencode({
                      **shown, **{k: v for k, v in view_query.items() if k != "sort"}, **sized,
                      "sort": ("-" + column) if view.sort == column else column}),
                  run=run, charts=charts)


@router.get("/", response_model=None)
async def index_slash(request: Request) -> RedirectResponse:
    """`/ui/` is where a browser user may type the list: send them to `/ui`, query kept
    (the API keeps its no-redirect rule; this is a page, fetched by GET only)."""
    query = request.url.query
    return RedirectResponse("/ui" + (f"?{query}" if query else ""), status_code=308)


@router.get("/rows")
async def new_rows(request: Request, svc: ServicesDep, after: OptStr = None,
                   status: OptStr = None) -> JSONText:
    """Sessions opened after the list cursor (oldest first), for the live list."""
    filters = label_filters(request, frozenset({"after", "status", "limit"}))
    return JSONText(await svc.reader.list_sessions(parse_status(status), after, 1000, filters))


@router.get("/feed")
async def feed(request: Request, svc: ServicesDep, after: OptStr = None,
               wait: Annotated[float | None, Blank, Query()] = None) -> JSONText:
    """The feed's long-poll (`GET /v1/events`), under `/ui` where the login cookie counts;
    answered at once when the server begins to shut down, as the API's is."""
    return JSONText(await svc.reader.feed(after, 1000, parse_wait(wait, FEED_WAIT) or 0.0,
                                          server_closing(request)))


@router.get("/sessions/{session_id}", response_model=None)
async def session(session_id: str, svc: ServicesDep) -> Response:
    try:
        page = await browse.session_page(svc.db, svc.cache, session_id)
    except DomainError as exc:
        return error_page(exc)
    leaf_sample = {sample["leaf"]: sample["index"] for sample in page.samples}
    carrier = session_carrier(page.state)
    newest, run_scope = await _newest_version(svc, page.summary, page.samples)
    for sample in page.samples:
        sample["lag"] = off_policy_lag(sample["weight_versions"], newest)
        sample["mismatch"] = mismatch_lines(sample["metadata"].get("tito_session_mismatch"))
    return render("session.html", s=page.summary, rows=tree_rows(page.state, leaf_sample),
                  samples=page.samples, errors=page.errors, empty_reason=page.empty_reason,
                  newest=newest, run_scope=run_scope,
                  carrier=None if carrier is None
                  else SpecInfo.from_dict(carrier["metrics"]["spec_info"]))


async def _newest_version(svc: Any, summary: dict[str, Any],
                          samples: list[dict[str, Any]]) -> tuple[int | None, str]:
    """The newest integer weight version seen in the session's run (its `run_id`
    label: every recorded turn of the run counts), else in its own samples."""
    run_id = summary["labels"].get("run_id")
    if run_id is not None:
        run_filter = parse_label_filters({"run_id": run_id})
        groups = (await svc.analytics.spec_rates("weight_version", run_filter))["groups"]
        return newest_version(g["key"] for g in groups), f"run_id={label_text(run_id)}"
    return newest_version(v for s in samples for v in s["weight_versions"]), "this session"


@router.get("/sessions/{session_id}/nodes/{seq}")
async def node_lanes(session_id: str, seq: int, svc: ServicesDep) -> JSONText:
    """One node's token lanes, spec counters and new messages (loaded on selection)."""
    state = await browse.folded(svc.db, svc.cache, session_id)
    if not 0 <= seq < len(state.nodes):
        raise UnknownParent(f"session has no node {seq}", field="seq",
                            expected=f"a seq below {len(state.nodes)}", actual=seq)
    samples = (await svc.samples.result(session_id)).samples if state.closed else None
    body = token_lanes(state, seq, samples).as_json()
    body.update(turn_messages(await browse.turn_payload(svc.db, session_id, seq)))
    # Token text when TURNLOG_TOKENIZER names a tokenizer.json; ids alone otherwise.
    body["prompt_text"] = tokens.texts(svc.settings.ui.tokenizer, body["new_prompt"])
    body["output_text"] = tokens.texts(svc.settings.ui.tokenizer, body["output"])
    return JSONText(body)


@router.get("/sessions/{session_id}/samples/{index}/r3.svg")
async def r3_picture(session_id: str, index: int, svc: ServicesDep) -> Response:
    """Experts used per layer over the sample's rows: a heatmap (or why there is none)."""
    try:
        plan = await svc.samples.r3_plan(session_id, index)
        patches = await svc.samples.read_patches(session_id, plan)
    except DomainError as exc:
        svg = templates.get_template("message.svg").render(text=exc.detail)
        return Response(utf8(svg), media_type="image/svg+xml")
    counts = browse.expert_usage(plan, patches)
    svg = templates.get_template("heatmap.svg").render(map=plots.heatmap(counts),
                                                        rows=plan.rows)
    return Response(utf8(svg), media_type="image/svg+xml")


def same_origin(request: Request) -> bool:
    """A form post from this site (or one without an `Origin`, as curl sends). Same
    origin is scheme and host: a page served over plain http must not sign in to the
    https site of the same name (and behind a TLS proxy the scheme is the forwarded one,
    as uvicorn's proxy headers set it)."""
    origin = request.headers.get("origin")
    return origin is None or origin == f"{request.url.scheme}://{request.headers.get('host')}"


def safe_next(target: str) -> str:
    """Only a path under `/ui` (never `//host` or a scheme): no open redirect. Judged
    with its dot segments resolved as a browser resolves them (`/ui/../v1/sessions`
    is `/v1/sessions`, and `%2e%2e` is `..`), and `/uix` is not under `/ui`."""
    if "\\" in target or not target.startswith("/") or target.startswith("//"):
        return "/ui"
    path = urlsplit(target).path
    resolved = posixpath.normpath(unquote(path)) if path else "/"
    if resolved == "/ui" or resolved.startswith("/ui/"):
        return target
    return "/ui"


@router.get("/login", response_model=None)
async def login_form(svc: ServicesDep, next: str = "/ui") -> Response:
    if not svc.settings.access.api_tokens:
        return RedirectResponse(safe_next(next), status_code=303)
    return render("login.html", 200, next=safe_next(next), error=False)


@router.post("/login", response_model=None)
async def login(request: Request, svc: ServicesDep) -> Response:
    """Take a token from the form; if this server knows it, keep it in the cookie."""
    raw = await request.body()
    if len(raw) > LOGIN_FORM_BYTES:  # a token and a path: anything bigger is not our form
        return render("login.html", 400, next="/ui", error=True)
    form = dict(parse_qsl(raw.decode("utf-8", "replace")))
    target = safe_next(form.get("next", "/ui"))
    if not same_origin(request):
        return render("login.html", 403, next=target, error=True)
    token = form.get("token", "").strip()
    tokens = TokenTable(svc.settings.access.api_tokens)
    if not tokens:  # nothing to sign in to: every page is open
        return RedirectResponse(target, status_code=303)
    if not token.isascii() or tokens.scope_of(token.encode("ascii")) is None:
        return render("login.html", 401, next=target, error=True)
    response = RedirectResponse(target, status_code=303)
    # "Strict" as documented: Starlette writes the value as given (its type says lowercase).
    response.set_cookie(COOKIE, token, httponly=True, samesite="Strict",  # type: ignore[arg-type]
                        path="/ui", secure=request.url.scheme == "https")
    return response


@router.post("/logout", response_model=None)
async def logout(request: Request) -> Response:
    if not same_origin(request):  # another site may not sign the user out either
        return render("login.html", 403, next="/ui", error=True)
    response = RedirectResponse("/ui/login", status_code=303)
    response.delete_cookie(COOKIE, path="/ui", httponly=True, samesite="strict")
    return response
