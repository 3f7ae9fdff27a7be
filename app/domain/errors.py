"""Typed domain errors: every rule violation turnlog can report.

Each error carries the stable problem-type slug and HTTP status of docs/api.md §0.3
together with the field, expected and actual value, so the API maps them to
RFC 9457 problem+json in one place (`app/api/problems.py`). Nothing here knows
about HTTP frameworks. Errors of the transport rather than of a rule (missing
token, foreign host, headers too large, request timeout, wrong content type,
database unavailable) live in `app/api/http_errors.py`; the recording gateway's
(upstream unavailable, spool full) in `app/gateway/errors.py`.
"""

from __future__ import annotations

from typing import Any, ClassVar


class DomainError(Exception):
    slug: ClassVar[str] = "invalid-request"
    status: ClassVar[int] = 422
    title: ClassVar[str] = "Invalid request"

    def __init__(
        self,
        detail: str,
        *,
        field: str | None = None,
        expected: Any = None,
        actual: Any = None,
        status: int | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(detail)
        self.detail = detail
        self.field = field
        self.expected = expected
        self.actual = actual
        self.extra = extra or {}
        if status is not None:
            self.status_override: int | None = status
        else:
            self.status_override = None

    @property
    def http_status(self) -> int:
        return self.status_override or self.status

    def problem(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "type": f"urn:turnlog:{self.slug}",
            "title": self.title,
            "status": self.http_status,
            "detail": self.detail,
        }
        if self.field is not None:
            body["field"] = self.field
        if self.expected is not None:
            body["expected"] = self.expected
        if self.actual is not None:
            body["actual"] = self.actual
        body.update(self.extra)
        return body


class InvalidRequest(DomainError):
    slug = "invalid-request"
    status = 422
    title = "Invalid request"


class InvalidR3(DomainError):
    slug = "invalid-r3"
    status = 422
    title = "Invalid routed-experts payload"


class UnknownSession(DomainError):
    slug = "unknown-session"
    status = 404
    title = "Unknown session"


class UnknownParent(DomainError):
    slug = "unknown-parent"
    status = 404
    title = "Unknown parent node"


class UnknownSample(DomainError):
    slug = "unknown-sample"
    status = 404
    title = "Unknown sample"


class SessionConflict(DomainError):
    slug = "session-conflict"
    status = 409
    title = "Session exists with another definition"


class IdempotencyConflict(DomainError):
    slug = "idempotency-conflict"
    status = 409
    title = "Event id reused with other content"


class SessionClosed(DomainError):
    slug = "session-closed"
    status = 409
    title = "Session is closed"


class SessionOpen(DomainError):
    slug = "session-open"
    status = 409
    title = "Session is still open"


class ParentTruncated(DomainError):
    slug = "parent-truncated"
    status = 409
    title = "Parent turn ended with finish_reason 'length'"


class UnstablePrefix(DomainError):
    slug = "unstable-prefix"
    status = 409
    title = "Prompt does not keep the rows already routed"


class NodeCap(DomainError):
    slug = "node-cap"
    status = 409
    title = "Session node cap reached"


class StrictTito(DomainError):
    slug = "strict-tito"
    status = 409
    title = "Strict TITO mismatch rate is non-zero"


class R3Gap(DomainError):
    """409 when an append would leave a gap; 422 when a stored path cannot yield R3."""

    slug = "r3-gap"
    status = 409
    title = "Routed-experts rows are not contiguous"


class Alignment(DomainError):
    slug = "alignment"
    status = 422
    title = "Path cannot be aligned"


class UnsupportedMediaType(DomainError):
    """A body in a content type no parser here reads (JSON, and MessagePack for turns)."""

    slug = "unsupported-media-type"
    status = 415
    title = "Unsupported request content type"


class TooLarge(DomainError):
    slug = "too-large"
    status = 413
    title = "Request body too large"


class ConsumerConflict(DomainError):
    slug = "consumer-conflict"
    status = 409
    title = "Consumer group exists with another definition"


class LeaseLost(DomainError):
    slug = "lease-lost"
    status = 409
    title = "Another claim acknowledged or holds the session"


class UnknownConsumer(DomainError):
    slug = "unknown-consumer"
    status = 404
    title = "Unknown consumer group"


class UnknownClaim(DomainError):
    slug = "unknown-claim"
    status = 404
    title = "Unknown claim"


class R3Pruned(DomainError):
    slug = "r3-pruned"
    status = 410
    title = "R3 was freed by retention"


class DeadlineExceeded(DomainError):
    """A write still uncommitted when its client's `X-Turnlog-Timeout` ran out: rolled
    back, since its client has given up on it (app/domain/body/deadline.py)."""

    slug = "deadline-exceeded"
    status = 503
    title = "Deadline exceeded"
