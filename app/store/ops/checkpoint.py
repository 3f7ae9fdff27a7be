"""The resume protocol of a rebuild: where an interrupted `turnlog rebuild` stands.

A checkpoint file holds the run's key (the database URL without its password,
and the session asked for), the id of the last session rebuilt, and the
checksums and the count of events (`log_mark`) taken when the run first
started: events appended between the interruption and the resume are then
counted as written during the rebuild, not taken for a difference. It is written whole after each
batch (`rebuild`'s `on_batch`) and then renamed over the previous one, so an
interruption never leaves half a checkpoint; a run of the same database and
session resumes from it, compared against those first checksums, and a
finished run removes it.

Refuses: the rebuild itself (`rebuild`) and anything shown to the operator
(`app.cli.store`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


class ForeignCheckpoint(Exception):
    """The checkpoint file holds another run's progress (or is not a checkpoint): it
    is neither resumed nor overwritten, so that run can still resume from it."""


def checkpoint_key(url: str, session: str | None, *, absolute: bool = True) -> str:
    """Which run a checkpoint belongs to: the database (password hidden; a SQLite
    file by its absolute path, however the URL spells it) and the session."""
    # Imported here: the CLI imports this module at start, and starts without SQLAlchemy.
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    if absolute and parsed.get_backend_name() == "sqlite" \
            and parsed.database not in (None, "", ":memory:"):
        parsed = parsed.set(database=str(Path(parsed.database).resolve()))
    return f"{parsed.render_as_string(hide_password=True)} session={session}"


@dataclass(frozen=True)
class Resume:
    """Where an interrupted run stood: after session id `last_id`, with the checksums
    taken `before` it first started."""

    last_id: int
    before: dict[str, str] | None
    # The events in scope when the run first started (None: a checkpoint written
    # before this was kept; the resume counts from its own start then).
    mark: int | None = None


class Checkpoint:
    """The checkpoint file of one run (`path`) for one database and session."""

    def __init__(self, path: Path, url: str, session: str | None) -> None:
        self.path = path
        self.key = checkpoint_key(url, session)
        # As checkpoints written before SQLite paths were made absolute name it.
        self.spelled = checkpoint_key(url, session, absolute=False)

    def load(self) -> Resume | None:
        """The saved position, if the file exists; `ForeignCheckpoint` if it is another
        run's (another database or session) or not a checkpoint at all."""
        if not self.path.exists():
            return None
        try:
            saved = json.loads(self.path.read_text())
            key, last_id = saved["key"], saved["last_id"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ForeignCheckpoint(
                f"{self.path} is not a rebuild checkpoint ({exc}): give this rebuild "
                "another --checkpoint, or pass --restart to replace it") from None
        if key not in (self.key, self.spelled):
            raise ForeignCheckpoint(
                f"{self.path} holds an interrupted rebuild of another run ({key}), not of "
                f"this one ({self.key}): finish that one first, give this one another "
                "--checkpoint, or pass --restart to discard it")
        return Resume(last_id, saved.get("before"), saved.get("mark"))

    def save(self, last_id: int, before: dict[str, str], mark: int | None = None) -> None:
        # Written whole then renamed: an interruption never leaves half a checkpoint.
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            tmp.write_text(json.dumps({"key": self.key, "last_id": last_id, "before": before,
                                       "mark": mark}))
            tmp.replace(self.path)
        except BaseException:
            tmp.unlink(missing_ok=True)  # a full disk: no half-written file left behind
            raise

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)
