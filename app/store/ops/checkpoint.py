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


def checkpoint_key(url: str, session: str | None) -> str:
    """Which run a checkpoint belongs to: the database (password hidden) and the session."""
    # Imported here: the CLI imports this module at start, and starts without SQLAlchemy.
    from sqlalchemy.engine import make_url

    return f"{make_url(url).render_as_string(hide_password=True)} session={session}"


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

    def load(self) -> Resume | None:
        """The saved position, if the file exists and belongs to this run."""
        if not self.path.exists():
            return None
        saved = json.loads(self.path.read_text())
        if saved.get("key") != self.key:
            return None
        return Resume(saved["last_id"], saved.get("before"), saved.get("mark"))

    def save(self, last_id: int, before: dict[str, str], mark: int | None = None) -> None:
        # Written whole then renamed: an interruption never leaves half a checkpoint.
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps({"key": self.key, "last_id": last_id, "before": before,
                                   "mark": mark}))
        tmp.replace(self.path)

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)
