"""Errors of the recording gateway's transport, not of any rule of the data.

Owns the conditions only the gateway meets: its upstream did not answer
(502 `upstream-unavailable`), a turn can be neither stored nor spooled
(503 `spool-full`; the spool raises it when a turn would take it past its byte
bound, the proxy answers it), a reward the store did not take in time with
nothing of its session spooled to wait behind (503 `store-unavailable`), a
caller whose request body stopped arriving (408 `request-timeout`, as `turnlog
serve` answers it), a
path under `/turnlog/` that is none of its own routes (404 `not-found`) and a
method one of them does not answer (405 `method-not-allowed`). They subclass
`DomainError` only to carry the same problem+json shape (`DomainError.problem`),
which `proxy._problem` sends. Refuses every rule of the data: those errors are
`app/domain/errors.py`'s.
"""

from __future__ import annotations

from app.domain.errors import DomainError


class UpstreamUnavailable(DomainError):
    """The recording gateway could not reach its upstream, or it did not answer in time."""

    slug = "upstream-unavailable"
    status = 502
    title = "Upstream unavailable"


class SpoolFull(DomainError):
    """The recording gateway can neither store a turn nor spool it: it is not answered."""

    slug = "spool-full"
    status = 503
    title = "Gateway spool full"


class StoreUnavailable(DomainError):
    """The store gave no verdict on a reward in time, and the gateway's spool holds
    nothing of its session to put it behind (`reward_may_wait`): not spooled."""

    slug = "store-unavailable"
    status = 503
    title = "Store unavailable"


class CallerStalled(DomainError):
    """The caller sent no byte of its request body for the body timeout
    (`TURNLOG_BODY_TIMEOUT_S`): answered 408 before anything goes upstream or,
    for a body streamed up, before the upstream's reply head is in."""

    slug = "request-timeout"
    status = 408
    title = "Request body not received in time"


class MethodNotAllowed(DomainError):
    """A method one of the gateway's own routes (`/turnlog/…`) does not answer."""

    slug = "method-not-allowed"
    status = 405
    title = "Method Not Allowed"


class NotFound(DomainError):
    """A path under `/turnlog/` that is none of the gateway's own routes."""

    slug = "not-found"
    status = 404
    title = "Not Found"
