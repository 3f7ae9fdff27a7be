"""Errors of the HTTP transport, not of any rule: raised by the API's middleware and deps.

Owns the problem types a request earns before (or instead of) reaching a rule:
a foreign `Host`/`Origin`, headers too large, a body not received in time,
and the database being unavailable (a missing or unknown token is
`app/access.py`'s, an unsupported content type `app/domain/errors.py`'s: the
recording gateway answers them too). They subclass `DomainError` only to be mapped to
problem+json by the same one handler (`app/api/problems.py`). Refuses every
rule of the data: those errors are `app/domain/errors.py`'s — including a body
too large (`TooLarge`), which the domain raises too when a body would decode
into more values than it allows.
"""

from __future__ import annotations

from app.access import ForeignHost  # noqa: F401  (the API's, defined with its rule)
from app.domain.errors import DomainError


class RequestTimeout(DomainError):
    slug = "request-timeout"
    status = 408
    title = "Request body not received in time"


class HeadersTooLarge(DomainError):
    slug = "headers-too-large"
    status = 431
    title = "Request headers too large"


class Unavailable(DomainError):
    """The store cannot answer now (database lost or damaged); retrying may succeed."""

    slug = "unavailable"
    status = 503
    title = "Database unavailable"


class Overloaded(DomainError):
    """More requests or connections in flight than the server takes at once."""

    slug = "overloaded"
    status = 503
    title = "Server overloaded"
