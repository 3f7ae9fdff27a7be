"""`turnlog gate check` (exit 0 trusted, 1 failed, 2 error), `history submit`, `analytics spec`.

The commands talk to the test database directly (`--database-url`), on both backends.
"""

import json
import uuid

import pytest
from typer.testing import CliRunner

from app.cli import cli

KL = "train/ppo_kl"
runner = CliRunner()


@pytest.fixture
def coord():
    return {"test_path": f"tests/e2e/test_{uuid.uuid4().hex}.py", "backend": "cuda",
            "suite": "stage-c"}


def submit(db_url, tmp_path, coord, run_id, points, trusted=True):
    path = tmp_path / f"{run_id}.json"
    path.write_text(json.dumps({"coordinate": coord, "run_id": run_id, "attempt": 0,
                                "trusted": trusted,
                                "points": [{"metric": m, "step": s, "value": v}
                                           for m, s, v in points]}))
    result = runner.invoke(cli, ["history", "submit", str(path), "--database-url", db_url])
    assert result.exit_code == 0, result.output
    return result


def check(db_url, coord, run_id, *extra):
    return runner.invoke(cli, [
        "gate", "check", "--run-id", run_id, "--test-path", coord["test_path"],
        "--backend", coord["backend"], "--suite", coord["suite"], "--database-url", db_url,
        *extra])


def spec_file(tmp_path, specs):
    path = tmp_path / f"gates-{uuid.uuid4().hex}.json"
    path.write_text(json.dumps(specs))
    return str(path)


def test_history_submit_reports_kept_and_dropped_points(db_url, tmp_path, coord):
    result = submit(db_url, tmp_path, coord, "r1", [(KL, 0, 0.1), ("perf/x", 0, 1.0)])
    assert "kept 1 point(s), dropped perf/x" in result.output


def test_a_cold_start_exits_0_and_prints_every_coordinate(db_url, tmp_path, coord):
    submit(db_url, tmp_path, coord, "r1", [(KL, 0, 0.1), (KL, 1, 0.2)])
    result = check(db_url, coord, "r1", "--metric", KL)
    assert result.exit_code == 0, result.output
    assert result.output.count("INACTIVE") == 2
    assert "outcome: trusted (exit 0); 2 value(s) recorded as baseline" in result.output


def test_a_regression_exits_1_with_value_baseline_and_corridor(db_url, tmp_path, coord):
    specs = spec_file(tmp_path, [{"metric": KL, "steps": "last",
                                  "constraint": {"rel_up": 0.5, "rel_down": 0.5}}])
    submit(db_url, tmp_path, coord, "r1", [(KL, 0, 2.0)])
    assert check(db_url, coord, "r1", "--spec", specs).exit_code == 0
    submit(db_url, tmp_path, coord, "r2", [(KL, 0, 9.0)])
    result = check(db_url, coord, "r2", "--spec", specs, "--json")
    assert result.exit_code == 1, result.output
    report = json.loads(result.output)
    assert report["outcome"] == "failed" and report["exit_code"] == 1
    (row,) = report["results"]
    assert {k: row[k] for k in ("status", "value", "baseline", "lo", "hi", "step")} == {
        "status": "FAIL", "value": 9.0, "baseline": 2.0, "lo": 1.0, "hi": 3.0, "step": -1}


def test_a_gate_that_cannot_be_judged_exits_2(db_url, tmp_path, coord):
    submit(db_url, tmp_path, coord, "r1", [(KL, 0, 0.1)])
    result = check(db_url, coord, "r1", "--metric", "train/grad_norm")
    assert result.exit_code == 2
    assert "ERROR" in result.output and "outcome: error" in result.output


def test_default_gates_are_checked_without_spec_or_metric(db_url, tmp_path, coord):
    submit(db_url, tmp_path, coord, "r1", [(KL, 0, 0.1)])
    report = json.loads(check(db_url, coord, "r1", "--json").output)
    assert len({r["metric"] for r in report["results"]}) == 7


def test_a_dry_run_records_nothing(db_url, tmp_path, coord):
    submit(db_url, tmp_path, coord, "r1", [(KL, 0, 0.1)])
    assert "recorded" not in check(db_url, coord, "r1", "--metric", KL, "--dry-run").output
    submit(db_url, tmp_path, coord, "r2", [(KL, 0, 0.1)])
    report = json.loads(check(db_url, coord, "r2", "--metric", KL, "--json").output)
    assert report["results"][0]["status"] == "INACTIVE"


def test_an_invalid_spec_file_exits_2_naming_the_problem(db_url, tmp_path, coord):
    bad = spec_file(tmp_path, [{"metric": KL, "steps": "first"}])
    result = check(db_url, coord, "r1", "--spec", bad)
    assert result.exit_code == 2 and "steps" in result.output


@pytest.mark.parametrize("empty", [[], {"specs": []}])
def test_an_empty_spec_file_exits_2_and_records_nothing(db_url, tmp_path, coord, empty):
    """A tester's finding: `--spec` with `[]` ran every default gate and recorded values."""
    result = check(db_url, coord, "r1", "--spec", spec_file(tmp_path, empty))
    assert result.exit_code == 2 and "lists no gate" in result.output
    assert "recorded" not in result.output


def test_an_unreachable_database_exits_2(tmp_path, coord):
    missing = f"sqlite+aiosqlite:///{tmp_path}/absent/dir/x.db"
    assert check(missing, coord, "r1").exit_code == 2


def test_analytics_spec_prints_groups(db_url, tmp_path):
    result = runner.invoke(cli, ["analytics", "spec", "--group-by", "run_id", "--label",
                                 f"run_id=none-{uuid.uuid4().hex}", "--database-url", db_url,
                                 "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output) == {"groups": []}
    bad = runner.invoke(cli, ["analytics", "spec", "--group-by", "nope", "--database-url",
                              db_url])
    assert bad.exit_code == 2 and "group_by" in bad.output
