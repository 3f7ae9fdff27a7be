"""`turnlog rebuild` in batches: interrupted, it resumes from its checkpoint and still
proves the projections equal against the checksums of the first start."""

import asyncio
import json

import pytest
from typer.testing import CliRunner

from app.cli import cli
from app.settings import Settings
from app.store.engine.db import Database
from app.store.ops.rebuild import checksums, rebuild, session_keys


@pytest.fixture(params=["sqlite", "postgres"])
def demo_url(request, fresh_database):
    url = fresh_database(request.param)
    result = CliRunner().invoke(cli, ["demo", "--sessions", "3", "--database-url", url])
    assert result.exit_code == 0, result.output
    return url


class Interrupted(Exception):
    pass


def run(url, coro_fn):
    async def go():
        db = Database(url, Settings.load(database_url=url))
        try:
            return await coro_fn(db)
        finally:
            await db.dispose()

    return asyncio.run(go())


def test_an_interrupted_rebuild_resumes_after_its_last_batch(demo_url):
    saved: list[tuple[int, dict]] = []

    def stop_after_first(last_id, before, _mark):
        saved.append((last_id, before))
        raise Interrupted

    with pytest.raises(Interrupted):
        run(demo_url, lambda db: rebuild(db, batch_sessions=1, parallel=1,
                                            on_batch=stop_after_first))
    (last_id, before), = saved
    keys = run(demo_url, session_keys)
    assert last_id == keys[0][0] and len(keys) == 3
    done: list[tuple[int, int]] = []
    report = run(demo_url, lambda db: rebuild(
        db, None, lambda d, t: done.append((d, t)), start_after=last_id, before=before,
        batch_sessions=1, parallel=1))
    assert report.equal and report.sessions == 3
    assert done == [(1, 3), (2, 3), (3, 3)]  # the first session was not rebuilt again
    assert report.after == run(demo_url, checksums)


def test_the_cli_resumes_from_a_checkpoint_and_removes_it(demo_url, tmp_path):
    keys = run(demo_url, session_keys)
    before = run(demo_url, checksums)
    from app.cli.store import _checkpoint_key

    checkpoint = tmp_path / "cp.json"
    checkpoint.write_text(json.dumps({"key": _checkpoint_key(demo_url, None),
                                      "last_id": keys[1][0], "before": before}))
    result = CliRunner().invoke(cli, ["rebuild", "--database-url", demo_url,
                                      "--checkpoint", str(checkpoint)])
    assert result.exit_code == 0, result.output
    assert f"resuming the rebuild after session id {keys[1][0]}" in result.output
    assert result.output.count("equal") == 4 and not checkpoint.exists()


def test_another_runs_checkpoint_is_kept_unless_restart(demo_url, tmp_path):
    # A helper's finding: another database's checkpoint was ignored, then removed when
    # this rebuild finished — that one could no longer resume. Now refused, untouched.
    checkpoint = tmp_path / "cp.json"
    before = {"sessions": "x", "session_labels": "x", "nodes": "x", "samples": "x"}
    for text in (json.dumps({"key": "sqlite:////elsewhere.db session=None",
                             "last_id": 10**9, "before": before}), "{not json"):
        checkpoint.write_text(text)
        result = CliRunner().invoke(cli, ["rebuild", "--database-url", demo_url,
                                          "--checkpoint", str(checkpoint)])
        assert result.exit_code == 2, result.output
        assert "--restart" in result.output and str(checkpoint) in result.output
        assert checkpoint.read_text() == text
    result = CliRunner().invoke(cli, ["rebuild", "--database-url", demo_url,
                                      "--checkpoint", str(checkpoint), "--restart"])
    assert result.exit_code == 0, result.output
    assert "resuming" not in result.output and result.output.count("equal") == 4
    assert not checkpoint.exists()


def test_a_sqlite_file_is_one_run_however_its_url_spells_it(tmp_path, monkeypatch):
    from app.store.ops.checkpoint import checkpoint_key

    monkeypatch.chdir(tmp_path)
    assert checkpoint_key("sqlite:///a.db", None) == \
        checkpoint_key(f"sqlite:///{tmp_path / 'a.db'}", None)


def test_batches_in_parallel_rebuild_every_session_equal(demo_url):
    steps: list[tuple[int, int]] = []
    report = run(demo_url, lambda db: rebuild(db, None, lambda d, t: steps.append((d, t)),
                                              batch_sessions=1, parallel=3))
    assert report.equal and report.sessions == 3
    assert steps[0] == (0, 3) and steps[-1] == (3, 3)


@pytest.mark.parametrize("checkpointed", [True, False])
def test_an_interrupted_cli_rebuild_says_whether_it_resumes(demo_url, tmp_path, monkeypatch,
                                                             checkpointed):
    """Ctrl-C: exit 130 and one line saying how to go on (it said nothing)."""
    checkpoint = tmp_path / "cp.json"

    async def interrupted(*_args, **_kwargs):
        if checkpointed:
            checkpoint.write_text("{}")  # a batch's progress, saved before the Ctrl-C
        raise KeyboardInterrupt

    monkeypatch.setattr("app.cli.store._run_rebuild", interrupted)
    result = CliRunner().invoke(cli, ["rebuild", "--database-url", demo_url,
                                      "--checkpoint", str(checkpoint)])
    assert result.exit_code == 130
    expected = (f"run the same command again to resume (progress is in {checkpoint})"
                if checkpointed else "no batch was checkpointed yet; the next run starts over")
    assert "interrupted: " + expected in " ".join(result.output.split())


def test_any_interrupted_command_says_so(demo_url, monkeypatch):
    """Ctrl-C anywhere else: one line, 'interrupted', and the status a SIGINT gives."""
    def interrupted(*_args, **_kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("app.cli.common.check_database", interrupted)
    monkeypatch.setattr("app.cli.browse.check_database", interrupted, raising=False)
    result = CliRunner().invoke(cli, ["sessions", "--database-url", demo_url])
    assert result.exit_code == 130 and result.output.strip().endswith("interrupted")


def test_events_appended_while_interrupted_are_counted_not_taken_for_a_difference(
        demo_url, tmp_path):
    # A helper's finding: a rebuild interrupted, then an import, then the resume: the
    # checkpoint's checksums were of the store before the import, the resume counted
    # events from its own start, and the report said the projections differ (exit 1)
    # where a fresh rebuild said equal.
    from tests.test_import_export import linear_dump, write_json

    checkpoint = tmp_path / "cp.json"
    saved: list[tuple[int, dict, int]] = []

    def stop_after_first(last_id, before, mark):
        saved.append((last_id, before, mark))
        raise Interrupted

    with pytest.raises(Interrupted):
        run(demo_url, lambda db: rebuild(db, batch_sessions=1, parallel=1,
                                            on_batch=stop_after_first))
    (last_id, before, mark), = saved
    from app.cli.store import _checkpoint_key

    checkpoint.write_text(json.dumps({"key": _checkpoint_key(demo_url, None),
                                      "last_id": last_id, "before": before, "mark": mark}))
    dump = write_json(tmp_path / "d.json", linear_dump("retract", turns=2, seed=3))
    imported = CliRunner().invoke(cli, ["import", str(dump), "--close",
                                        "--database-url", demo_url])
    assert imported.exit_code == 0, imported.output
    result = CliRunner().invoke(cli, ["rebuild", "--database-url", demo_url, "--json",
                                      "--checkpoint", str(checkpoint)])
    report = json.loads(result.stdout)
    assert report["changed_during_rebuild"] > 0, result.output  # the import's events
    assert not checkpoint.exists()
