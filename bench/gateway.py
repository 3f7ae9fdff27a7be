"""What the recording gateway adds: per-turn latency through `turnlog gateway` vs
straight to the same fake SGLang, and the gateway's memory on a huge reply.

Run by hand (not in CI):

    .venv/bin/python -m bench.gateway [--postgres-url postgresql://...] [--sessions 8]
                                      [--turns 12] [--turn-tokens 2048] [--big-reply-mb 100]

One fake SGLang (`python -m app.sim.sglang_http`, Qwen3-30B-A3B R3 geometry:
48 layers × top-8, cheap filler rows) and one `turnlog gateway` in front of it
(addition-mode v2 sessions, auto-opened, PostgreSQL), side by side in one run:
1. `--sessions` concurrent sessions, each `--turns` turns of `--turn-tokens`
   new tokens (so ~`turn-tokens` R3 rows, ~4 MB of base64, per reply). Every
   turn is sent twice, straight to the fake SGLang and through the gateway
   (alternating which goes first), the same bytes both ways; the added latency
   of a turn is the difference. Targets: p50 ≤ 20 ms, p99 ≤ 60 ms.
   `--think-ms T`: the fake answers each turn after 0.5–1.5 × T ms (its
   generation time; the same both ways, so it cancels out of "added"). With
   T = 0 every session sends its next turn at once: the 2 cores then run the
   fake, the load generator, PostgreSQL and the gateway flat out, and "added"
   is mostly the gateway's turn waiting for a core (the bench prints the
   harness's own CPU per turn beside the gateway's). One session runs first,
   unmeasured (the process's own first turn is not a session's); each
   session's first turn (its auto-open, new connections) is reported apart.
2. A passthrough route (`GET /health`, no recording), alternately direct and
   through the gateway, one at a time. Target: added p50 ≤ 2 ms.
3. One `--big-reply-mb` MB reply relayed unrecorded (no session header) and
   then recorded (a new session): the gateway's peak RSS growth (VmHWM, reset
   before each) ÷ the reply size. Target ≤ 3.

`--turn-tokens 1536` is the ~3 MB-reply case (`--big-reply-mb 0` skips part 3).
Figures and the profile behind them: docs/gateway.md, "Performance".

Without --postgres-url a throwaway cluster is started from the installed
binaries (tests/pg/), with production durability (fsync on). The gateway is
the installed console script next to this Python (`.venv/bin/turnlog`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import msgspec

from bench.common import (
    ROOT,
    add_warm_wal_option,
    cpu_split,
    free_port,
    postgres,
    py_spy_exe,
    show_durability,
    start_py_spy,
    warm_wal_for,
)
from tests.pg import create_database

LAYERS, TOPK, EXPERTS = 48, 8, 128
OUTPUT_TOKENS = 64
HEADER = "X-SMG-Routing-Key"
TURNLOG = Path(sys.executable).parent / "turnlog"


# -- processes -------------------------------------------------------------------


async def wait_ready(proc: subprocess.Popen[bytes], url: str, what: str) -> None:
    async with httpx.AsyncClient(timeout=5) as http:
        for _ in range(1200):
            if proc.poll() is not None:
                raise RuntimeError(f"{what} exited with {proc.returncode}")
            with contextlib.suppress(httpx.TransportError):
                if (await http.get(url)).status_code == 200:
                    return
            await asyncio.sleep(0.05)
    raise RuntimeError(f"{what} did not become ready within 60 s")


def spawn(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TURNLOG_")}
    with log.open("ab") as out:
        return subprocess.Popen(argv, cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                                stdout=out, stderr=subprocess.STDOUT)


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def vm_kb(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def reset_peak(pid: int) -> bool:
    """Reset VmHWM to the current RSS (Linux `clear_refs` 5); False if not allowed."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (all its threads)."""
    return sum(cpu_split(pid))


def gateway_argv(upstream: str, port: int, url: str, spool: Path) -> list[str]:
    return [str(TURNLOG), "gateway", "--upstream", upstream, "--host", "127.0.0.1",
            "--port", str(port), "--database-url", url, "--num-layers", str(LAYERS),
            "--version", "v2", "--pause-generation-mode", "in_place", "--no-migrate",
            "--spool-dir", str(spool)]


# -- a lean HTTP/1.1 client (the load generator must cost little) -------------------


class Conn:
    """One keep-alive connection on a bare socket; bodies read by Content-Length
    (straight into one buffer) or chunked.

    uvicorn closes a connection idle for 5 s; `ready()` (called outside the
    timed part) reconnects one idle for over 2 s, so no request races a close.
    """

    IDLE = 2.0

    def __init__(self, base: str) -> None:
        host, port = base.removeprefix("http://").split(":")
        self.host, self.port = host, int(port)
        self.sock: socket.socket | None = None
        self.rest = b""  # bytes received past the end of the last reply
        self.used = 0.0

    async def __aenter__(self) -> Conn:
        await self.ready()
        return self

    async def ready(self) -> None:
        if self.sock is not None and time.monotonic() - self.used < self.IDLE:
            return
        if self.sock is not None:
            self.sock.close()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        await asyncio.get_running_loop().sock_connect(sock, (self.host, self.port))
        self.sock, self.rest, self.used = sock, b"", time.monotonic()

    async def __aexit__(self, *_exc: object) -> None:
        assert self.sock is not None
        self.sock.close()

    async def _until(self, buf: bytes, mark: bytes) -> tuple[bytes, int]:
        """`buf` extended until it holds `mark`; and where the mark starts."""
        while (at := buf.find(mark)) < 0:
            buf += await self._recv()
        return buf, at

    async def _recv(self) -> bytes:
        assert self.sock is not None
        data = await asyncio.get_running_loop().sock_recv(self.sock, 1 << 20)
        if not data:
            raise ConnectionError(f"{self.host}:{self.port} closed the connection")
        return data

    async def _exactly(self, buf: bytes, length: int) -> tuple[bytearray, bytes]:
        """`length` bytes (the first ones from `buf`, the rest received into one
        buffer), and what `buf` held beyond them."""
        assert self.sock is not None
        body = bytearray(length)
        view = memoryview(body)
        have = min(len(buf), length)
        view[:have] = buf[:have]
        loop = asyncio.get_running_loop()
        while have < length:
            got = await loop.sock_recv_into(self.sock, view[have:])
            if not got:
                raise ConnectionError(f"{self.host}:{self.port} closed mid-body")
            have += got
        return body, buf[length:]

    async def request(self, method: str, path: str, body: bytes = b"",
                      headers: dict[str, str] | None = None) -> tuple[int, bytes | bytearray]:
        assert self.sock is not None
        head = f"{method} {path} HTTP/1.1\r\nHost: {self.host}\r\n"
        if body:
            head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        for name, value in (headers or {}).items():
            head += f"{name}: {value}\r\n"
        await asyncio.get_running_loop().sock_sendall(
            self.sock, head.encode("latin-1") + b"\r\n" + body)
        buf, at = await self._until(self.rest, b"\r\n\r\n")
        lines = buf[:at].decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        length, chunked = 0, False
        for line in lines[1:]:
            name, _, value = line.partition(":")
            name = name.strip().lower()
            if name == "content-length":
                length = int(value)
            elif name == "transfer-encoding" and "chunked" in value.lower():
                chunked = True
        buf = buf[at + 4:]
        self.used = time.monotonic()
        if not chunked:
            reply, self.rest = await self._exactly(buf, length)
            return status, reply
        parts: list[bytes | bytearray] = []
        while True:
            buf, at = await self._until(buf, b"\r\n")
            size = int(buf[:at].split(b";")[0], 16)
            chunk, buf = await self._exactly(buf[at + 2:], size + 2)
            if size == 0:
                self.rest = buf
                return status, b"".join(parts)
            parts.append(chunk[:size])


# -- the workload ----------------------------------------------------------------


class _Meta(msgspec.Struct):
    output_token_logprobs: list[tuple[float, int]]


class _Choice(msgspec.Struct):
    meta_info: _Meta


class _Reply(msgspec.Struct):
    choices: list[_Choice]


# The load generator's reading of a reply: only the output tokens, the rest skipped
# (json.loads of a 4 MB reply costs the load generator ~4 ms a turn of shared CPU).
_read_reply = msgspec.json.Decoder(_Reply).decode


def chat_body(input_ids: list[int], start: int) -> bytes:
    """A miles-shaped chat request (addition R3 from `start`); written by msgspec
    (`json.dumps` of a 60k-token prompt costs the load generator ~5 ms a turn)."""
    return msgspec.json.encode({
        "model": "default", "messages": [{"role": "user", "content": "bench"}],
        "max_tokens": OUTPUT_TOKENS,
        "logprobs": True, "return_meta_info": True, "no_stop_trim": False,
        "return_routed_experts": True, "routed_experts_start_len": start,
        "input_ids": input_ids})


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


async def session(index: int, turns: int, turn_tokens: int, direct: str, gateway: str,
                  out: list[tuple[float, float, int]], recorded: bool = True,
                  think_s: float = 0.0, first: list[float] | None = None,
                  which: list[tuple[float, int, int, float]] | None = None) -> None:
    """One session's turns, each sent straight and through the gateway; `recorded`
    False leaves the routing header out, so the gateway relays the turns unrecorded.
    `think_s` > 0: the fake SGLang takes about that long to answer each turn
    (`X-Sim-Delay`, uniform in 0.5-1.5 x, the same both ways), as a real engine's
    generation does: turns of different lengths, so sessions that start together
    drift apart."""
    sid = f"bench-{uuid.uuid4().hex[:8]}-{index}"
    tokens: list[int] = []
    jitter = random.Random(index)
    async with Conn(direct) as to_direct, Conn(gateway) as to_gateway:
        for turn in range(turns + 1):
            new = [1 + (index * 7919 + turn * 104729 + i) % 997
                   for i in range(turn_tokens - OUTPUT_TOKENS)]
            input_ids = tokens + new
            body = chat_body(input_ids, max(len(tokens) - 1, 0))
            headers = {HEADER: sid} if recorded else {}
            if think_s > 0:
                headers["X-Sim-Delay"] = f"{think_s * (0.5 + jitter.random()):.6f}"
            timed: dict[str, tuple[float, int, bytes | bytearray]] = {}
            order = [("direct", to_direct), ("gateway", to_gateway)]
            for name, conn in order if turn % 2 == 0 else order[::-1]:
                await conn.ready()
                started = time.perf_counter()
                status, reply = await conn.request("POST", "/v1/chat/completions", body,
                                                   headers)
                timed[name] = (time.perf_counter() - started, status, reply)
            (t_direct, s_direct, r_direct), (t_gateway, s_gateway, r_gateway) = \
                timed["direct"], timed["gateway"]
            if s_direct != 200 or s_gateway != 200 or r_direct != r_gateway:
                raise RuntimeError(f"{sid} turn {turn}: {s_direct}/{s_gateway}, "
                                   f"bytes equal: {r_direct == r_gateway}: {r_gateway[:300]!r}")
            meta = _read_reply(r_direct).choices[0].meta_info
            tokens = input_ids + [entry[1] for entry in meta.output_token_logprobs]
            if turn > 0:  # the first turn warms connections and the session's open
                out.append((t_direct, t_gateway, len(r_direct)))
                if which is not None:  # (added, session, turn, when it ended)
                    which.append((t_gateway - t_direct, index, turn, time.perf_counter()))
            elif first is not None:
                first.append(t_gateway - t_direct)


async def passthrough(direct: str, gateway: str, count: int) -> list[float]:
    added = []
    async with Conn(direct) as to_direct, Conn(gateway) as to_gateway:
        for i in range(count + 20):
            pair = []
            for conn in (to_direct, to_gateway) if i % 2 == 0 else (to_gateway, to_direct):
                started = time.perf_counter()
                status, _ = await conn.request("GET", "/health")
                pair.append(time.perf_counter() - started)
                assert status == 200
            if i >= 20:
                t_direct, t_gateway = (pair[0], pair[1]) if i % 2 == 0 else (pair[1], pair[0])
                added.append(t_gateway - t_direct)
    return added


async def big_reply(gateway: str, pid: int, mb: int) -> list[tuple[str, int, int, float]]:
    """One `mb` MB reply relayed unrecorded, then recorded: (kind, reply bytes,
    peak RSS growth in bytes, seconds)."""
    rows = mb * 2**20 * 3 // 4 // (LAYERS * TOPK * 4)
    input_ids = [1 + i % 997 for i in range(rows + 1 - OUTPUT_TOKENS)]
    body = chat_body(input_ids, 0)
    results = []
    for kind, headers in (("unrecorded", {}),
                          ("recorded", {HEADER: f"bench-big-{uuid.uuid4().hex[:8]}"})):
        await asyncio.sleep(1.0)  # let the allocator settle
        reset_peak(pid)
        before = vm_kb(pid, "VmRSS")
        async with Conn(gateway) as conn:
            await conn.ready()
            started = time.perf_counter()
            status, reply = await conn.request("POST", "/v1/chat/completions", body, headers)
            took = time.perf_counter() - started
        if status != 200:
            raise RuntimeError(f"big {kind} reply: {status} {reply[:300]!r}")
        growth = (vm_kb(pid, "VmHWM") - before) * 1024
        results.append((kind, len(reply), growth, took))
        del reply
    return results


async def latency(args: argparse.Namespace, direct: str, gateway: str, pid: int,
                  recorded: bool, upstream_pid: int) -> None:
    """Part 1: the turns straight and through the gateway; added latency and CPU."""
    pairs: list[tuple[float, float, int]] = []
    first: list[float] = []
    # One session first, not measured: the process's own first turn (code paths run
    # once, the store's statements prepared) is not a session's; a gateway runs for days.
    await session(args.sessions, 1, args.turn_tokens, direct, gateway, [], recorded,
                  args.think_ms / 1000)
    user0, system0 = cpu_split(pid)
    upstream0, load0 = cpu_seconds(upstream_pid), time.process_time()
    which: list[tuple[float, int, int, float]] = []
    started = time.perf_counter()
    await asyncio.gather(*(session(i, args.turns, args.turn_tokens, direct, gateway, pairs,
                                   recorded, args.think_ms / 1000, first, which)
                           for i in range(args.sessions)))
    user1, system1 = cpu_split(pid)
    upstream1, load1 = cpu_seconds(upstream_pid), time.process_time()
    added = [g - d for d, g, _ in pairs]
    size = statistics.mean(n for _, _, n in pairs)
    kind = "recorded" if recorded else "relayed unrecorded (no routing header)"
    print(f"-- turns {kind}; reply size: mean {size / 1e6:.2f} MB")
    print(f"direct:   p50 {percentile([d for d, _, _ in pairs], .5) * 1000:7.1f} ms  "
          f"p99 {percentile([d for d, _, _ in pairs], .99) * 1000:7.1f} ms")
    print(f"gateway:  p50 {percentile([g for _, g, _ in pairs], .5) * 1000:7.1f} ms  "
          f"p99 {percentile([g for _, g, _ in pairs], .99) * 1000:7.1f} ms")
    targets = (" (target <= 20)", " (target <= 60)") if recorded else ("", "")
    print(f"added per turn ({len(added)} turns): p50 {percentile(added, .5) * 1000:.1f} ms"
          f"{targets[0]}, p99 {percentile(added, .99) * 1000:.1f} ms{targets[1]}")
    # Where the tail is: a run's p99 is its slowest turn or two.
    print("slowest turns: " + ", ".join(
        f"{added_s * 1000:.1f} ms (session {i} turn {turn}, at {at - started:.2f} s)"
        for added_s, i, turn, at in sorted(which, reverse=True)[:4]))
    if recorded:
        # Not in the figures above: the session's open, and new connections both ways.
        print(f"first turn of each session (auto-open; {len(first)} turns): added p50 "
              f"{percentile(first, .5) * 1000:.1f} ms, max {max(first) * 1000:.1f} ms")
    # CPU is the figure a loaded machine disturbs least (wall time queues).
    turns = len(pairs) + args.sessions
    print(f"gateway process CPU per turn: {(user1 - user0) / turns * 1000:.1f} ms user + "
          f"{(system1 - system0) / turns * 1000:.1f} ms system (all its threads)")
    # The harness shares the cores: what the fake SGLang (two replies a turn) and the
    # load generator cost beside the gateway.
    print(f"harness CPU per turn: fake SGLang {(upstream1 - upstream0) / turns * 1000:.1f} ms "
          f"(two replies), load generator {(load1 - load0) / turns * 1000:.1f} ms", flush=True)


def histogram(metrics: str, name: str, labels: str = "") -> str:
    """A histogram of the gateway's metrics page (`name{labels}`): its count and mean."""
    count = total = None
    for line in metrics.splitlines():
        if line.startswith(f"{name}_count{labels} "):
            count = float(line.split()[-1])
        elif line.startswith(f"{name}_sum{labels} "):
            total = float(line.split()[-1])
    if not count or total is None:
        return "not exposed"
    return f"{count:.0f} turns, mean {total / count * 1000:.1f} ms"


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--postgres-url", help="admin URL of a PostgreSQL server "
                        "(default: a throwaway cluster from the installed binaries)")
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--turns", type=int, default=12, help="measured turns per session")
    parser.add_argument("--turn-tokens", type=int, default=2048,
                        help="new tokens (and R3 rows) per turn")
    parser.add_argument("--passthrough", type=int, default=500,
                        help="GET /health pairs for the passthrough figure")
    parser.add_argument("--relay", action=argparse.BooleanOptionalAction, default=True,
                        help="also send the same turns without the routing header "
                             "(relayed, not recorded) for the relay's own cost")
    parser.add_argument("--think-ms", type=float, default=0.0,
                        help="the fake SGLang's mean time to answer a turn (X-Sim-Delay, "
                             "0.5-1.5 x), both ways: an engine's generation time, which "
                             "spaces a session's turns (0: at once, sessions back to back)")
    add_warm_wal_option(parser)
    parser.add_argument("--big-reply-mb", type=int, default=100, help="0 = skip")
    parser.add_argument("--py-spy", metavar="FILE",
                        help="record a py-spy profile (raw format) of the gateway during "
                             "the latency part into FILE (py-spy: the `bench` extra)")
    args = parser.parse_args()
    if args.py_spy:
        py_spy_exe()  # missing: say so now, before any process starts
    from app.allocator import keep_turn_buffers_resident

    keep_turn_buffers_resident()  # the load generator's 4 MB reads: no brk churn per turn
    if not TURNLOG.exists():
        raise SystemExit(f"no turnlog console script at {TURNLOG} (run `make install`)")

    server = postgres(args.postgres_url, durable=True)
    print(f"PostgreSQL: {await show_durability(server.url)}", flush=True)
    await warm_wal_for(args, server.url)
    from app.store.engine import migrate

    url = create_database(server, f"bench_gateway_{uuid.uuid4().hex[:6]}")
    await migrate.upgrade_async(url)

    with tempfile.TemporaryDirectory() as tmp:
        logs = Path(tmp)
        sglang_port, gateway_port = free_port(), free_port()
        direct = f"http://127.0.0.1:{sglang_port}"
        gateway = f"http://127.0.0.1:{gateway_port}"
        sglang = spawn([sys.executable, "-m", "app.sim.sglang_http", "--port", str(sglang_port),
                        "--num-layers", str(LAYERS), "--topk", str(TOPK),
                        "--num-experts", str(EXPERTS), "--r3", "filler"],
                       logs / "sglang.log")
        proxy = spawn(gateway_argv(direct, gateway_port, url, logs / "spool"),
                      logs / "gateway.log")
        try:
            await wait_ready(sglang, direct + "/health", "fake SGLang")
            await wait_ready(proxy, gateway + "/turnlog/readyz", "turnlog gateway")
            print(f"load average before: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores "
                  "(the figures are only comparable on a quiet machine)")
            print(f"{args.sessions} sessions x {args.turns} turns of {args.turn_tokens} "
                  f"tokens, R3 {LAYERS} layers x top-{TOPK}, PostgreSQL, addition mode, "
                  f"upstream answers after {args.think_ms:g} ms", flush=True)
            spy = start_py_spy(args.py_spy, proxy.pid, "--gil") if args.py_spy else None
            await latency(args, direct, gateway, proxy.pid, True, sglang.pid)
            if spy is not None:
                spy.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
                spy.wait(30)
            async with httpx.AsyncClient(timeout=30) as http:
                metrics = (await http.get(gateway + "/turnlog/metrics")).text
            recorded = '{outcome="recorded"}'
            print("gateway's own turnlog_gateway_added_seconds: "
                  f"{histogram(metrics, 'turnlog_gateway_added_seconds')}; of it the store's "
                  f"write, turnlog_gateway_store_seconds{recorded}: "
                  f"{histogram(metrics, 'turnlog_gateway_store_seconds', recorded)}")
            if args.relay:
                # The same turns without the routing header: what relaying a reply of
                # this size costs before anything is recorded.
                await latency(args, direct, gateway, proxy.pid, False, sglang.pid)

            cpu_before = cpu_seconds(proxy.pid)
            through = await passthrough(direct, gateway, args.passthrough)
            cpu = cpu_seconds(proxy.pid) - cpu_before
            print(f"passthrough GET /health added ({len(through)} calls): "
                  f"p50 {percentile(through, .5) * 1000:.2f} ms (target <= 2), "
                  f"p99 {percentile(through, .99) * 1000:.2f} ms; gateway CPU per call "
                  f"{cpu / (len(through) + 20) * 1000:.2f} ms", flush=True)

            if args.big_reply_mb > 0:
                # A fresh gateway: the latency run's freed heap would hide the growth.
                stop(proxy)
                proxy = spawn(gateway_argv(direct, gateway_port, url, logs / "spool-big"),
                              logs / "gateway-big.log")
                await wait_ready(proxy, gateway + "/turnlog/readyz", "turnlog gateway")
                base = vm_kb(proxy.pid, "VmRSS") * 1024
                print(f"fresh gateway RSS before the big replies: {base / 1e6:.0f} MB")
                for kind, nbytes, growth, took in await big_reply(gateway, proxy.pid,
                                                                  args.big_reply_mb):
                    print(f"one {nbytes / 1e6:.0f} MB reply {kind} ({took:.2f} s): gateway "
                          f"peak RSS growth {growth / 1e6:.0f} MB = {growth / nbytes:.2f}x "
                          f"the reply   (target <= 3x)")
                print(f"gateway peak RSS (VmHWM, whole process): "
                      f"{vm_kb(proxy.pid, 'VmHWM') / 1e3:.0f} MB")
        finally:
            stop(proxy)
            stop(sglang)
        print(f"load average after: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")


if __name__ == "__main__":
    asyncio.run(main())
