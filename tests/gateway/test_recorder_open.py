"""How the recorder opens a session it holds no state of (in process, the three
backends): a new one is opened and its turn appended without reading the session
first; one that exists — opened by another gateway, through the API with another
definition, or with turns a new session would refuse — takes the general path and
is recorded exactly as before. Oracle: the store read back."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from app.gateway.metrics import GatewayMetrics
from app.gateway.recorder import RECORDED, Recorder
from app.gateway.spool import Spool
from app.services import Services, build_services
from app.settings import Settings
from app.store.append.writes import Writer
from tests.factory import open_body, r3_b64, turn

L, K = 2, 2
Make = Callable[[], Awaitable[tuple[Services, Recorder]]]


@pytest.fixture
async def gateways(db_url: str, tmp_path: Path) -> AsyncIterator[Make]:
    """`await make()`: a fresh store and recorder (no state held), as a new gateway."""
    made: list[tuple[Services, Recorder]] = []

    async def make() -> tuple[Services, Recorder]:
        svc = build_services(Settings.load(database_url=db_url, migrate_on_start=False,
                                           api_tokens=""))
        spool = Spool(tmp_path / f"spool-{len(made)}", 1 << 30)
        made.append((svc, Recorder(svc, spool, GatewayMetrics(), store_timeout=30)))
        return made[-1]

    yield make
    for svc, recorder in made:
        recorder.spool.close()
        await svc.db.dispose()


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts the writer's opens and general-path appends (the real calls are made)."""
    seen = {"open": 0, "append_turn": 0}
    real_open, real_append = Writer.open, Writer.append_turn

    async def counted_open(self: Writer, raw: Any, **kwargs: Any) -> Any:
        seen["open"] += 1
        return await real_open(self, raw, **kwargs)

    async def counted_append(self: Writer, *args: Any, **kwargs: Any) -> Any:
        seen["append_turn"] += 1
        return await real_append(self, *args, **kwargs)

    monkeypatch.setattr(Writer, "open", counted_open)
    monkeypatch.setattr(Writer, "append_turn", counted_append)
    return seen


def gateway_open(sid: str, **over: Any) -> dict[str, Any]:
    return open_body(sid, pause_generation_mode="in_place", r3={"num_layers": L},
                     labels={"run": "gw"}, opened_by="gateway", **over)


def first() -> dict[str, Any]:
    return turn([1, 2, 3], [4, 5], r3=r3_b64(4, L, K, seed=1), start=0)


def second() -> dict[str, Any]:
    # Addition R3 from row 4: a new session would refuse it (an R3 gap).
    return turn([1, 2, 3, 4, 5, 6], [7], r3=r3_b64(2, L, K, seed=2), start=4)


async def turns_of(svc: Services, sid: str) -> list[str]:
    summary = await svc.reader.session(sid)
    return [str(n["seq"]) for n in summary["tree"]]


async def test_a_new_session_is_opened_and_its_turn_appended_without_a_read(
        gateways: Make, calls: dict[str, int]) -> None:
    svc, recorder = await gateways()
    sid = f"gw-{uuid.uuid4().hex}"
    assert await recorder.record(sid, first(), gateway_open(sid)) == RECORDED
    assert calls == {"open": 1, "append_turn": 0}
    summary = await svc.reader.summary(sid)
    assert summary["opened_by"] == "gateway" and summary["num_nodes"] == 1
    # The next turn is the session's, state held: the usual append, no open.
    assert await recorder.record(sid, second(), gateway_open(sid)) == RECORDED
    assert calls == {"open": 1, "append_turn": 1}
    assert await turns_of(svc, sid) == ["0", "1"]


async def test_a_session_another_gateway_opened_takes_its_next_turn(
        gateways: Make, calls: dict[str, int]) -> None:
    """A turn the new session's rules would refuse (R3 from row 4) is the existing
    session's next turn: recorded, not rejected."""
    _, one = await gateways()
    svc, other = await gateways()
    sid = f"gw-{uuid.uuid4().hex}"
    assert await one.record(sid, first(), gateway_open(sid)) == RECORDED
    assert await other.record(sid, second(), gateway_open(sid)) == RECORDED
    assert calls["open"] == 1  # the second gateway's check refused it for a new session
    assert await turns_of(svc, sid) == ["0", "1"]


async def test_a_session_opened_through_the_api_keeps_its_definition(
        gateways: Make, calls: dict[str, int]) -> None:
    svc, recorder = await gateways()
    sid = f"gw-{uuid.uuid4().hex}"
    assert (await svc.writer.open(open_body(sid, pause_generation_mode="in_place",
                                            r3={"num_layers": L},
                                            labels={"run": "mine"}))).created
    fresh, recorder = await gateways()
    assert await recorder.record(sid, first(), gateway_open(sid)) == RECORDED
    assert calls["open"] == 2 and calls["append_turn"] == 1  # the open wrote nothing
    summary = await fresh.reader.summary(sid)
    assert summary["labels"] == {"run": "mine"} and summary["opened_by"] is None
    assert summary["num_nodes"] == 1
