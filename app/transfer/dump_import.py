"""Importing session-server dumps: miles' `GET /sessions/{id}` JSON as turnlog sessions.

Owns reading dump files (one JSON object `{session_id, records, metadata}`,
a JSON array of them, or JSONL with one per line), deriving each session's
open body from its records (v1, the pause mode and R3 geometry), and the
deterministic event ids that make a re-import a no-op. Refuses to own any
rule: every open and every record goes through the store's writer, so a dump
is validated exactly like an API append, and a record that fails is
reported with its problem detail and skipped.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.domain.errors import DomainError
from app.domain.wire import jsonio
from app.domain.wire.validate import is_int
from app.store.append.writes import Writer

JSONL_SUFFIXES = (".jsonl", ".ndjson")


@dataclass(frozen=True)
class Dump:
    """One session as the session server dumped it, and where it came from."""

    source: str
    session_id: Any
    records: list[Any]
    metadata: dict[str, Any]
    size: int  # bytes of the file it stands for (for progress)


@dataclass(frozen=True)
class Unreadable:
    """A part of a file that is not a dump (bad JSON, wrong shape)."""

    source: str
    detail: str
    size: int


@dataclass(frozen=True)
class ImportOptions:
    num_layers: int | None = None
    max_trim_tokens: int = 0
    labels: Mapping[str, Any] = field(default_factory=dict)
    close: bool = False
    # Close a session even when some of its records were rejected (its samples
    # would then miss those turns): only when the operator asks for it.
    close_incomplete: bool = False


@dataclass
class Failure:
    source: str
    session_id: Any
    index: int | None  # record index; None for the session itself
    problem: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"source": self.source, "session_id": self.session_id, "index": self.index,
                **self.problem}


@dataclass
class ImportReport:
    sessions_new: int = 0
    sessions_present: int = 0
    turns_imported: int = 0
    turns_present: int = 0
    closed: int = 0
    failures: list[Failure] = field(default_factory=list)
    # Sessions `--close` left open because a record of theirs was rejected.
    left_open: list[str] = field(default_factory=list)

    @property
    def sessions(self) -> int:
        return self.sessions_new + self.sessions_present

    def to_json(self) -> dict[str, Any]:
        return {"sessions": self.sessions, "sessions_new": self.sessions_new,
                "sessions_present": self.sessions_present,
                "turns_imported": self.turns_imported, "turns_present": self.turns_present,
                "closed": self.closed, "left_open": self.left_open,
                "failures": [f.to_json() for f in self.failures]}


class DumpError(Exception):
    """A dump that cannot become a session (reported like a domain problem)."""

    def __init__(self, detail: str, field_name: str, expected: Any = None,
                 actual: Any = None) -> None:
        super().__init__(detail)
        self.problem = {"type": "urn:turnlog:invalid-dump", "title": "Invalid dump",
                        "detail": detail, "field": field_name, "expected": expected,
                        "actual": actual}


# -- reading ---------------------------------------------------------------------------

def _dump(value: Any, source: str, size: int) -> Dump | Unreadable:
    if not isinstance(value, dict) or not isinstance(value.get("records"), list):
        return Unreadable(source, "expected an object with a `records` array", size)
    metadata = value.get("metadata")
    return Dump(source, value.get("session_id"), value["records"],
                metadata if isinstance(metadata, dict) else {}, size)


def _lines(path: Path) -> Iterator[Dump | Unreadable]:
    with path.open("rb") as handle:
        for number, line in enumerate(handle, start=1):
            source = f"{path}:{number}"
            if not line.strip():
                continue
            try:
                value = jsonio.loads(line)
            except DomainError as exc:
                yield Unreadable(source, exc.detail, len(line))
                continue
            yield _dump(value, source, len(line))


def _parses(line: bytes) -> bool:
    try:
        jsonio.loads(line)
    except DomainError:
        return False
    return True


def read_dumps(path: Path) -> Iterator[Dump | Unreadable]:
    """Every dump in `path`, in file order. JSONL (by suffix) streams line by line;
    anything else is one JSON document (an object or an array of objects), or
    JSONL after all if it does not parse as one document."""
    if path.suffix.lower() in JSONL_SUFFIXES:
        yield from _lines(path)
        return
    raw = path.read_bytes()
    if not raw.strip():
        return  # an empty file holds no dump (the import says so)
    try:
        value = jsonio.loads(raw)
    except DomainError as exc:
        lines = [line for line in raw.splitlines() if line.strip()]
        if not any(_parses(line) for line in lines):
            # Neither one document nor lines of them (an .npz, gzip, a truncated
            # document): one failure for the file, not one per "line" of its bytes.
            yield Unreadable(str(path), f"not JSON, nor JSON Lines: {exc.detail}", len(raw))
            return
        yield from _lines(path)
        return
    items = value if isinstance(value, list) else [value]
    for i, item in enumerate(items):
        source = str(path) if not isinstance(value, list) else f"{path}[{i}]"
        yield _dump(item, source, len(raw) // max(len(items), 1))


# -- the session definition --------------------------------------------------------------

def event_id(session_id: str, index: int) -> str:
    """The idempotency key of record `index`: the same on every import of the dump."""
    return hashlib.sha256(f"{session_id}\n{index}".encode()).hexdigest()


def _request(record: Any) -> dict[str, Any]:
    request = record.get("request") if isinstance(record, dict) else None
    return request if isinstance(request, dict) else {}


def _meta_info(record: Any) -> dict[str, Any]:
    try:
        meta = record["response"]["choices"][0]["meta_info"]
    except (KeyError, IndexError, TypeError):
        return {}
    return meta if isinstance(meta, dict) else {}


def _speculative(record: Any) -> bool:
    verify = _meta_info(record).get("spec_verify_ct")
    return is_int(verify) and verify > 0


def _metadata_layers(metadata: Mapping[str, Any]) -> Any:
    if "num_layers" in metadata:
        return metadata["num_layers"]
    r3 = metadata.get("r3")
    return r3.get("num_layers") if isinstance(r3, dict) else None


def open_body(dump: Dump, options: ImportOptions) -> dict[str, Any]:
    """The v1 open body a dump implies.

    In-place (addition R3) iff some request carries `routed_experts_start_len`;
    R3 `num_layers` from the dump's metadata (`num_layers` or `r3.num_layers`),
    else `options.num_layers` if some record asked for R3 (then it is required:
    a payload alone cannot tell layers from top-k). `spec` iff some turn ran
    speculative decoding (`spec_verify_ct > 0`).
    """
    if not isinstance(dump.session_id, str):
        # A generated id would make every re-import a new session.
        raise DumpError("the dump has no session_id", "session_id", "a session id string",
                        dump.session_id)
    requests = [_request(r) for r in dump.records]
    addition = any("routed_experts_start_len" in r for r in requests)
    wants_r3 = any(r.get("return_routed_experts") is True for r in requests)
    layers = _metadata_layers(dump.metadata)
    if layers is None and wants_r3:
        layers = options.num_layers
    if layers is None and wants_r3:
        raise DumpError("records carry R3 but the number of layers is unknown: give it in "
                        "the dump's metadata (num_layers) or with --num-layers",
                        "metadata.num_layers", "a positive integer", None)
    trim = dump.metadata.get("max_trim_tokens", options.max_trim_tokens)
    speculative = any(_speculative(r) for r in dump.records)
    return {
        "session_id": dump.session_id,
        "version": "v1",
        "pause_generation_mode": "in_place" if addition else "retract",
        "r3": None if layers is None else {"num_layers": layers},
        "spec": speculative,
        "max_trim_tokens": trim,
        "labels": dict(options.labels),
    }


def turn_body(dump: Dump, index: int) -> dict[str, Any]:
    """Record `index` as an append body; the parent is left to the store (derived).

    The dump's session-level `tito_session_mismatch` belongs to the latest
    path, so it travels with the last record (the v1 sample's leaf turn).
    """
    body: dict[str, Any] = {"event_id": event_id(str(dump.session_id), index),
                            "record": dump.records[index]}
    mismatch = dump.metadata.get("tito_session_mismatch")
    if index == len(dump.records) - 1 and isinstance(mismatch, list):
        body["metadata"] = {"tito_session_mismatch": mismatch}
    return body


# -- importing --------------------------------------------------------------------------

async def import_dump(writer: Writer, dump: Dump, options: ImportOptions,
                      report: ImportReport) -> None:
    """Open the dump's session (or find it identical) and append every record once."""
    sid = dump.session_id
    try:
        _definition, created = await writer.open_session(open_body(dump, options))
    except DumpError as exc:
        report.failures.append(Failure(dump.source, sid, None, exc.problem))
        return
    except DomainError as exc:
        report.failures.append(Failure(dump.source, sid, None, exc.problem()))
        return
    if created:
        report.sessions_new += 1
    else:
        report.sessions_present += 1
    rejected = 0
    for index in range(len(dump.records)):
        try:
            written = await writer.append_turn(str(sid), turn_body(dump, index))
        except DomainError as exc:
            # The records after a rejected one continue it: appended without it they
            # would hang off an earlier turn (a v1 session branched where it was
            # linear), and the fixed dump imported again would append it after them.
            # So the session stops here; the fixed dump then goes on from here.
            problem = exc.problem()
            later = len(dump.records) - index - 1
            if later:
                problem["detail"] = (f"{problem['detail']} (records {index + 1}-"
                                     f"{len(dump.records) - 1}, which continue it, were not "
                                     "imported: fix this record and import the dump again)")
                problem["not_imported"] = later
            report.failures.append(Failure(dump.source, sid, index, problem))
            rejected += 1
            break
        if written.created:
            report.turns_imported += 1
        else:
            report.turns_present += 1
    if options.close and rejected and not options.close_incomplete:
        # Closing would turn an incomplete session into a training sample.
        report.left_open.append(str(sid))
    elif options.close:
        try:
            if await writer.close_session(str(sid), {}):
                report.closed += 1
        except DomainError as exc:
            report.failures.append(Failure(dump.source, sid, None, exc.problem()))
