"""UI benchmark: a 1,024-node, ~100k-token session page opens in under 2 s.

Run by hand (not in CI):

    .venv/bin/python -m bench.ui [--postgres-url postgresql://...] [--sqlite]
                                 [--trajectories 8] [--tokens-per-turn 100]

Builds one addition-mode v2 session of exactly 1,024 nodes: `trajectories`
agent runs side by side (each a chain of turns of ~`tokens-per-turn` new
tokens, half user/tool text and half output), every 16th turn retried, R3 on
(8 layers, top-2, 64 experts), spec counters on every turn, then closes it.
With the defaults the session holds ~100k distinct tokens and each
trajectory's path ~12.8k tokens. Then it measures, against a real `turnlog
serve`:
- the session page's HTML, server side: cold (a fresh server process, no
  cached state) and warm;
- the page in headless Chromium: navigation start to the `load` event
  (the page is open, the tree is clickable), cold and warm;
- a node's token lanes (the lazy fetch): server time of the first (which
  builds the session's samples) and of the next ones, and in Chromium from
  the click on a deep node to its lanes drawn;
- one R3 heatmap (a whole trajectory's sample).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import statistics
import time
import uuid
from typing import Any

import httpx
import numpy as np

from bench.common import postgres, start_server, stop_server
from tests.pgserver import create_database
from tests.ui.chromium import ARGS, ensure_chromium

NODES = 1024
LAYERS, TOPK, EXPERTS = 8, 2, 64
RETRY_EVERY = 16


def turn_body(rng: np.random.Generator, seq: int, parent: int | None,
              parent_tokens: list[int], prompt: list[int], n_out: int,
              clock: float) -> tuple[dict[str, Any], list[int]]:
    output = rng.integers(1000, 30000, n_out).tolist()
    tokens = prompt + output
    start = max(len(parent_tokens) - 1, 0) if parent is not None else 0
    end = len(tokens) - 1
    rows = rng.integers(0, EXPERTS, (end - start, LAYERS, TOPK), dtype=np.int32)
    meta = {
        "output_token_logprobs": [[float(-x), t] for x, t in
                                  zip(rng.exponential(0.8, n_out).round(4), output,
                                      strict=True)],
        "completion_tokens": n_out, "weight_version": str(1 + seq // 128),
        "routed_experts": base64.b64encode(rows.tobytes()).decode("ascii"),
        "spec_verify_ct": max(n_out // 2, 1), "spec_num_correct_drafts": n_out // 3,
        "spec_num_proposed_drafts": n_out,
    }
    body = {
        "event_id": f"e{seq}", "parent": parent,
        "record": {
            "timestamp": clock, "method": "POST", "path": "/v1/chat/completions",
            "status_code": 200,
            "request": {"input_ids": prompt, "return_routed_experts": True,
                        "routed_experts_start_len": start,
                        "messages": [{"role": "user", "content": f"step {seq}"}]},
            "response": {"choices": [{"finish_reason": "stop",
                                      "message": {"role": "assistant", "content": "ok"},
                                      "meta_info": meta}]},
        },
    }
    return body, tokens


def session_bodies(trajectories: int, per_turn: int) -> list[dict[str, Any]]:
    """Exactly NODES turn bodies: round-robin over the trajectories, retries included."""
    rng = np.random.default_rng(11)
    tips: list[tuple[int | None, list[int]]] = [(None, [])] * trajectories
    # (parent seq, parent tokens, prompt) of each trajectory's latest turn, for retries.
    last: list[tuple[int | None, list[int], list[int]] | None] = [None] * trajectories
    bodies: list[dict[str, Any]] = []
    clock = 1_764_000_000.0
    for seq in range(NODES):
        lane = seq % trajectories
        step = seq // trajectories
        retry = step % RETRY_EVERY == RETRY_EVERY - 1 and last[lane] is not None
        if retry:
            parent, parent_tokens, prompt = last[lane]  # type: ignore[misc]
        else:
            parent, parent_tokens = tips[lane]
            prompt = parent_tokens + rng.integers(1, 1000, per_turn // 2).tolist()
        body, tokens = turn_body(rng, seq, parent, parent_tokens, prompt, per_turn // 2,
                                 clock)
        clock += 30.0
        bodies.append(body)
        last[lane] = (parent, parent_tokens, prompt)
        tips[lane] = (seq, tokens)
    return bodies


async def browser_times(base: str, sid: str, deep: int, repeat: int) -> dict[str, float]:
    from playwright.async_api import async_playwright

    out: dict[str, list[float]] = {"ready": [], "load": [], "lanes": []}
    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(executable_path=str(ensure_chromium()),
                                                   args=ARGS)
        for _ in range(repeat):
            context = await browser.new_context()
            page = await context.new_page()
            await page.goto(f"{base}/ui/sessions/{sid}", wait_until="load")
            ready, load = await page.evaluate(
                "() => { const t = performance.getEntriesByType('navigation')[0];"
                " return [t.domContentLoadedEventEnd - t.startTime,"
                " t.loadEventEnd - t.startTime]; }")
            out["ready"].append(ready / 1000)
            out["load"].append(load / 1000)
            if deep < 0:
                await context.close()
                continue
            row = page.locator(f'[data-testid="tree-node"][data-seq="{deep}"] .depth')
            await row.scroll_into_view_if_needed()
            t0 = time.perf_counter()
            await row.click()
            await page.wait_for_selector(f'#nv-seq:text-is("{deep}")')
            await page.wait_for_selector('[data-testid="lane-output"] .tok')
            out["lanes"].append(time.perf_counter() - t0)
            await context.close()
        await browser.close()
    return {key: statistics.median(values) if values else 0.0 for key, values in out.items()}


def timed_get(http: httpx.Client, path: str) -> tuple[float, int]:
    t0 = time.perf_counter()
    reply = http.get(path)
    reply.raise_for_status()
    return time.perf_counter() - t0, len(reply.content)


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--postgres-url")
    parser.add_argument("--sqlite", action="store_true")
    parser.add_argument("--trajectories", type=int, default=8)
    parser.add_argument("--tokens-per-turn", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    if args.sqlite:
        url = f"sqlite+aiosqlite:////tmp/turnlog-bench-ui-{uuid.uuid4().hex[:6]}.db"
    else:
        url = create_database(postgres(args.postgres_url), f"bench_ui_{uuid.uuid4().hex[:6]}")
    sid = f"bench-ui-{uuid.uuid4().hex[:8]}"
    bodies = session_bodies(args.trajectories, args.tokens_per_turn)
    distinct = sum(args.tokens_per_turn for _ in bodies)
    longest = max(len(b["record"]["request"]["input_ids"]) for b in bodies)
    proc, base = await start_server(url)
    try:
        with httpx.Client(base_url=base, timeout=300) as http:
            t0 = time.perf_counter()
            http.post("/v1/sessions", json={
                "session_id": sid, "version": "v2", "pause_generation_mode": "in_place",
                "r3": {"num_layers": LAYERS}, "spec": True,
                "labels": {"run_id": "bench-ui"}}).raise_for_status()
            for body in bodies:
                http.post(f"/v1/sessions/{sid}/turns", json=body).raise_for_status()
            http.post(f"/v1/sessions/{sid}/close", json={}).raise_for_status()
            ingest = time.perf_counter() - t0
            # The baseline: a one-turn session's page, to read the big one against
            # this machine's speed in the same run.
            http.post("/v1/sessions", json={
                "session_id": sid + "-small", "version": "v2",
                "pause_generation_mode": "in_place", "r3": {"num_layers": LAYERS},
                "spec": True}).raise_for_status()
            http.post(f"/v1/sessions/{sid}-small/turns", json=bodies[0]).raise_for_status()
            http.post(f"/v1/sessions/{sid}-small/close", json={}).raise_for_status()
    finally:
        stop_server(proc)

    # Cold: a fresh process has nothing cached; the page folds the log itself.
    proc, base = await start_server(url)
    try:
        with httpx.Client(base_url=base, timeout=300) as http:
            cold, size = timed_get(http, f"/ui/sessions/{sid}")
            warm = statistics.median(timed_get(http, f"/ui/sessions/{sid}")[0]
                                     for _ in range(args.repeat))
            deep = NODES - 1
            # The first lanes of a closed session build its samples (then kept).
            lanes_first, _ = timed_get(http, f"/ui/sessions/{sid}/nodes/{deep}")
            lanes_next = statistics.median(
                timed_get(http, f"/ui/sessions/{sid}/nodes/{seq}")[0]
                for seq in range(deep - args.repeat, deep))
            heat, _ = timed_get(http, f"/ui/sessions/{sid}/samples/0/r3.svg")
        stop_server(proc)
        proc, base = await start_server(url)
        cold_browser = await browser_times(base, sid, deep, 1)
        warm_browser = await browser_times(base, sid, deep, args.repeat)
        small_browser = await browser_times(base, sid + "-small", -1, args.repeat)
    finally:
        stop_server(proc)
    backend = "sqlite" if args.sqlite else "postgresql"
    print(f"backend {backend}; {NODES} nodes in {args.trajectories} trajectories, "
          f"{distinct} distinct tokens, longest prompt {longest} tokens; "
          f"ingest {ingest:.1f} s")
    print(f"session page HTML        : {size / 1e3:.0f} kB")
    print(f"server, cold (no cache)  : {cold * 1000:8.0f} ms")
    print(f"server, warm (median)    : {warm * 1000:8.0f} ms")
    print("Chromium, navigation start to DOMContentLoaded (tree clickable) / load event:")
    for name, seen in (("cold (fresh server)", cold_browser), ("warm (median)", warm_browser),
                       ("1-node page (median)", small_browser)):
        print(f"  {name:22s}: {seen['ready'] * 1000:6.0f} / {seen['load'] * 1000:6.0f} ms"
              "   (target < 2000)")
    print(f"  1,024-node / 1-node load : {warm_browser['load'] / small_browser['load']:6.1f}x")
    print(f"lanes JSON, first / next : {lanes_first * 1000:6.0f} / {lanes_next * 1000:6.0f} ms"
          "   (server; the first builds the samples)")
    print(f"select node {deep} in Chromium, click to lanes drawn: "
          f"{warm_browser['lanes'] * 1000:.0f} ms")
    print(f"R3 heatmap of sample 0   : {heat * 1000:8.0f} ms")


if __name__ == "__main__":
    asyncio.run(main())
