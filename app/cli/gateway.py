"""`turnlog gateway`: the recording gateway in front of SGLang (docs/gateway.md).

Parses the flags (each has a `TURNLOG_GATEWAY_*` environment variable),
checks the port before anything starts, migrates the store when it can
(a store that is down at start is not fatal: turns go to the spool), sets
the allocator up for turn-sized buffers (app.allocator), then
serves `app.gateway.proxy.Gateway` with uvicorn.

Refuses: forwarding and recording (app.gateway) and their rules (app.domain.body.gateway).
"""

from __future__ import annotations

import functools
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from app.cli import common
from app.cli.common import CliError, DatabaseUrl, mask, resolve_url


class Version(StrEnum):
    v1 = "v1"
    v2 = "v2"


class PauseMode(StrEnum):
    retract = "retract"
    in_place = "in_place"


def _env(name: str) -> dict[str, object]:
    return {"envvar": f"TURNLOG_GATEWAY_{name}", "show_envvar": True}


def gateway(
    upstream: Annotated[str, typer.Option(
        metavar="URL", help="The SGLang router (or engine) every request is forwarded to",
        **_env("UPSTREAM"))],
    host: Annotated[str, typer.Option(help="Address to bind", **_env("HOST"))] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="Port", **_env("PORT"))] = 30000,
    database_url: DatabaseUrl = None,
    record_path: Annotated[list[str] | None, typer.Option(
        "--record-path", metavar="PATH",
        help="Path whose POSTs are recorded (repeatable; default: /v1/chat/completions)",
        **_env("RECORD_PATH"))] = None,
    session_header: Annotated[str, typer.Option(
        metavar="NAME", help="Request header holding the session id",
        **_env("SESSION_HEADER"))] = "X-SMG-Routing-Key",
    upstream_timeout: Annotated[float, typer.Option(
        min=0.001, metavar="SECONDS", help="Connect/read/write timeout towards the upstream",
        **_env("UPSTREAM_TIMEOUT"))] = 600.0,
    store_timeout: Annotated[float, typer.Option(
        min=0.001, metavar="SECONDS",
        help="How long a store write may take before the turn (close, reward) goes to the "
             "spool",
        **_env("STORE_TIMEOUT"))] = 10.0,
    version: Annotated[Version, typer.Option(
        help="Auto-opened sessions: version", **_env("VERSION"))] = Version.v2,
    pause_generation_mode: Annotated[PauseMode, typer.Option(
        help="Auto-opened sessions: pause_generation_mode (in_place = addition R3)",
        **_env("PAUSE_GENERATION_MODE"))] = PauseMode.retract,
    num_layers: Annotated[int | None, typer.Option(
        min=1, max=4096, help="Auto-opened sessions: r3.num_layers (without it, turns "
                              "asking for R3 are rejected)", **_env("NUM_LAYERS"))] = None,
    max_trim_tokens: Annotated[int, typer.Option(
        min=0, help="Auto-opened sessions: max_trim_tokens", **_env("MAX_TRIM_TOKENS"))] = 0,
    speculative: Annotated[bool, typer.Option(
        "--speculative", help="Auto-opened sessions: spec = true",
        **_env("SPECULATIVE"))] = False,
    label: Annotated[list[str] | None, typer.Option(
        "--label", metavar="KEY=VALUE",
        help="Auto-opened sessions: a label (repeatable; X-Turnlog-Labels wins on a key)",
        **_env("LABEL"))] = None,
    idle_close_seconds: Annotated[float | None, typer.Option(
        min=0.001, metavar="SECONDS",
        help="Close an auto-opened session this long after its last recorded turn "
             "(default: off)", **_env("IDLE_CLOSE_SECONDS"))] = None,
    spool_dir: Annotated[Path, typer.Option(
        metavar="DIR", help="Where turns (closes, rewards) wait while the store cannot "
                            "take them",
        **_env("SPOOL_DIR"))] = Path("turnlog-spool"),
    spool_max_bytes: Annotated[int, typer.Option(
        min=1, metavar="BYTES",
        help="Bound of the spool; past it a turn (close, reward) is answered 503",
        **_env("SPOOL_MAX_BYTES"))] = 1 << 30,
    migrate: Annotated[bool, typer.Option(
        help="Apply the store's migrations first (skipped with a warning if the store is "
             "down)", **_env("MIGRATE"))] = True,
) -> None:
    """Forward every request to SGLang and record each chat turn before answering it."""
    import uvicorn

    from app.cli.main import _cannot_listen
    from app.domain.body.gateway import GatewayDefaults, parse_label_flags, parse_record_paths
    from app.domain.errors import DomainError
    from app.gateway.proxy import Gateway, GatewayConfig

    if not upstream.startswith(("http://", "https://")):
        raise CliError(f"--upstream {upstream!r} must be an http:// or https:// URL")
    if _is_own_address(upstream, host, port):
        # Every request would be forwarded to the gateway itself, again and again
        # (a newcomer's mistake: the router's usual port is the gateway's default).
        raise CliError(f"--upstream {upstream} is this gateway's own address "
                       f"({host}:{port}): point it at the SGLang router (or engine), and "
                       "give the gateway another --port if the router uses this one")
    try:
        labels = parse_label_flags(label or ())
        record_paths = parse_record_paths(record_path or ())
    except DomainError as exc:
        raise CliError(exc.detail + (f" (expected {exc.expected})" if exc.expected else "")
                       ) from None
    url = resolve_url(database_url)
    problem = _cannot_listen(host, port, makefile_hint=False)
    if problem is not None:
        raise CliError(problem)
    from app.gateway.spool import Spool, SpoolInUse, SpoolUnreadable

    try:
        spool = Spool(spool_dir, spool_max_bytes)
    except (SpoolInUse, SpoolUnreadable) as exc:
        raise CliError(str(exc)) from None
    except OSError as exc:
        raise CliError(f"cannot use the spool directory {spool_dir}: {exc}") from None
    if migrate:
        _migrate(url)
    else:
        _migrated_or_down(url)
    defaults = GatewayDefaults(version=version.value,
                               pause_generation_mode=pause_generation_mode.value,
                               num_layers=num_layers, max_trim_tokens=max_trim_tokens,
                               speculative=speculative, labels=labels)
    config = GatewayConfig(upstream=upstream.rstrip("/"), database_url=url,
                           record_paths=record_paths,
                           session_header=session_header, upstream_timeout=upstream_timeout,
                           store_timeout=store_timeout, defaults=defaults,
                           idle_close_seconds=idle_close_seconds, spool_dir=spool_dir,
                           spool_max_bytes=spool_max_bytes, bind_host=host)
    store = common.sqlite_path(url) or mask(url)  # a SQLite file by its absolute path
    common.say(f"turnlog gateway on http://{host}:{port} → {mask(upstream)} "
               f"(store {store}, spool {spool_dir})")
    settings = common.settings_for(url)
    from app.access import is_loopback

    if idle_close_seconds is not None and idle_close_seconds <= upstream_timeout:
        common.warn(f"--idle-close-seconds {idle_close_seconds:g} is not above "
                    f"--upstream-timeout {upstream_timeout:g}: a turn generating through "
                    "another gateway on this store for longer than that is not seen here, "
                    "so its session may be closed under it and the turn refused "
                    "(session-closed); docs/gateway.md, \"Sessions\"")
    if not settings.access.api_tokens and not is_loopback(host):
        common.warn(f"no TURNLOG_API_TOKENS: anyone who reaches {host}:{port} may close "
                    "sessions and record rewards through /turnlog/v1/… (give the gateway "
                    "the tokens turnlog serve has)")
    if len(spool):
        others = len(spool) - spool.turns
        common.say(f"{spool.turns} spooled turns"
                   + (f" and {others} closes or rewards" if others else "")
                   + f" ({spool.bytes} bytes) are written as soon as the store answers")
    from app.allocator import keep_turn_buffers_resident

    keep_turn_buffers_resident()
    # Date and Server are the upstream's: the caller sees its headers, not ours.
    from app.served import guarded_protocol

    uvicorn.run(Gateway(config, settings, spool), host=host, port=port,
                log_config=None, lifespan="on", server_header=False, date_header=False,
                timeout_keep_alive=75,
                # The store's HTTP bounds (TURNLOG_MAX_HEADER_BYTES, …_MAX_HEADERS,
                # …_HEADER_TIMEOUT_S): one caller's endless or oversized headers could
                # stall every session's relaying on the one event loop; malformed HTTP
                # is a problem+json 400, as from the store.
                http=functools.partial(guarded_protocol, bounds=settings.server),  # type: ignore[arg-type]
                # The caller's address is the peer's: an X-Forwarded-For it sends is
                # passed on with that address added, never taken as the peer.
                proxy_headers=False)


def _is_own_address(upstream: str, host: str, port: int) -> bool:
    """`upstream` names the address the gateway listens on (a loopback name for a
    loopback or wildcard bind counts as the same host)."""
    from urllib.parse import urlsplit

    from app.access import is_loopback

    try:
        target = urlsplit(upstream)
        target_port = target.port or (443 if target.scheme == "https" else 80)
    except ValueError:
        return False
    name = (target.hostname or "").lower()
    if target_port != port:
        return False
    local = {"localhost", "0.0.0.0", "::"}
    same = name == host.lower() or (is_loopback(name) or name in local) and (
        is_loopback(host) or host in local)
    return same


def _migrated_or_down(url: str) -> None:
    """`--no-migrate`: a store without turnlog's schema (or no store file yet) is said
    at start, loudly — every turn is spooled until someone migrates it — but not
    refused: generation never stops for the log, and the operator may be about to
    migrate (or the store's volume to appear)."""
    from app.cli.common import check_database

    path = common.sqlite_path(url)
    if path is not None and not path.exists():
        common.warn(f"no database at {path} yet (--no-migrate): every turn is spooled "
                    f"until `turnlog migrate --database-url {mask(url)}` creates it")
        return
    try:
        check_database(url)
    except CliError as exc:
        common.warn(f"{exc} (--no-migrate): every turn is spooled until it is done")
    except Exception as exc:  # unreachable: the gateway spools until it is back
        common.warn(f"cannot check the store {mask(url)} ({common.describe_failure(exc)}); "
                    "starting anyway, turns go to the spool until the store answers")


def _migrate(url: str) -> None:
    from app.cli.common import check_database
    from app.store.engine import migrate as migrations

    check_database(url, creating=True)
    try:
        migrations.upgrade(url)
    except Exception as exc:  # the store may be down: the gateway spools until it is back
        common.warn(f"could not migrate {mask(url)} ({common.describe_failure(exc)}); "
                    "starting anyway, turns go to the spool until the store answers")
