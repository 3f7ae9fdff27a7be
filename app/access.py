"""Who may call what: API tokens, the scope a request needs, and their refusals.

Owns the rule shared by every HTTP shell that takes writes — `turnlog serve`'s
API and web UI, and `turnlog gateway`'s close and reward routes: with tokens
configured (`TURNLOG_API_TOKENS`), a request needs `Authorization: Bearer
<token>`; GET, HEAD and OPTIONS read, every other method may change something
and needs a `write` token (which also reads). A missing or unknown token is
401 `Unauthorized`, a read token on a write route 403 `Forbidden`; `challenge`
is their `WWW-Authenticate`. Tokens are compared in constant time. The token
format is `app.settings.parse_api_tokens`. Also who is answered without tokens:
loopback `Host` names (`is_loopback`), and an `Origin` only this server's own
(`foreign_request`: a browser page elsewhere — another site, DNS rebinding,
another local web app — is 421 `ForeignHost`).

Refuses: which paths are open and answering a request (the shells' own:
`app.api.middleware.auth`, `app.ui.guard`, `app.gateway.proxy`).
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Iterable, Mapping
from urllib.parse import urlsplit

from app.domain.errors import DomainError
from app.settings import Scope

READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
CHALLENGE = 'Bearer realm="turnlog"'
UNKNOWN_TOKEN = "unknown token"


class Unauthorized(DomainError):
    slug = "unauthorized"
    status = 401
    title = "Missing or unknown API token"


class Forbidden(DomainError):
    slug = "forbidden"
    status = 403
    title = "API token lacks the required scope"


def required_scope(method: str) -> Scope:
    return "read" if method.upper() in READ_METHODS else "write"


# What `bearer_token` answers for an Authorization header that is not `Bearer <token>`
# (another scheme, a bare token): refused as such, not as a missing header.
NOT_BEARER = b""


def bearer_token(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """The bearer token presented; None without an Authorization header, NOT_BEARER
    with one of another form, or with two (the first won: which one counts must not
    depend on what a proxy added; a tester's finding)."""
    found = [value for name, value in headers if name.lower() == b"authorization"]
    if not found:
        return None
    scheme, _, token = found[0].strip().partition(b" ")
    token = token.strip()
    if len(found) == 1 and scheme.lower() == b"bearer" and token:
        return token
    return NOT_BEARER


class TokenTable:
    """The configured tokens; lookups compare against every token in constant time."""

    def __init__(self, tokens: Mapping[str, Scope]) -> None:
        self._tokens = [(token.encode("ascii"), scope) for token, scope in tokens.items()]

    def __bool__(self) -> bool:
        return bool(self._tokens)

    def scope_of(self, presented: bytes) -> Scope | None:
        found: Scope | None = None
        # No early exit: the time taken does not depend on which token matched.
        for token, scope in self._tokens:
            if hmac.compare_digest(token, presented):
                found = scope
        return found


def authorize(tokens: TokenTable, method: str, presented: bytes | None) -> None:
    """Raise `Unauthorized`/`Forbidden` unless `presented` may call a `method` route."""
    needed = required_scope(method)
    if not presented:
        raise Unauthorized("this route needs `Authorization: Bearer <token>`",
                           field="Authorization", expected="Bearer <token>",
                           actual="missing" if presented is None else "not a Bearer token")
    scope = tokens.scope_of(presented)
    if scope is None:
        raise Unauthorized("the bearer token is not one this server knows",
                           field="Authorization", expected="a configured API token",
                           actual=UNKNOWN_TOKEN)
    if needed == "write" and scope != "write":
        raise Forbidden(f"{method} needs a write token; this token may only read",
                        field="Authorization", expected="a write token", actual="a read token")


def challenge(error: DomainError) -> str:
    """The RFC 6750 `WWW-Authenticate` value for a refusal."""
    if isinstance(error, Forbidden):
        return CHALLENGE + ', error="insufficient_scope", scope="write"'
    if error.actual == UNKNOWN_TOKEN:
        return CHALLENGE + ', error="invalid_token"'
    return CHALLENGE


# A token in a URL lands in access logs, proxies and browser history, so it is refused
# (the store's `QueryTokens` middleware, the gateway's own routes).
URL_TOKEN_CHALLENGE = CHALLENGE + ', error="invalid_request"'


def token_in_url(query_string: bytes) -> Unauthorized | None:
    """The refusal of a request whose query string carries a credential-like parameter
    (names matched decoded, `app.domain.wire.url_tokens`), or None."""
    from app.domain.wire.url_tokens import query_token_param

    name = query_token_param(query_string.decode("latin-1"))
    if name is None:
        return None
    return Unauthorized("API tokens go in the Authorization header, never in the URL",
                        field=name[:40], expected="Authorization: Bearer <token>",
                        actual="a token in the query string (redacted)")


class ForeignHost(DomainError):
    """A `Host` or `Origin` that is not this loopback server (DNS rebinding, CSRF)."""

    slug = "foreign-host"
    status = 421
    title = "Request not meant for this server"


LOOPBACK_NAMES = frozenset({"localhost", "localhost.", "ip6-localhost", "ip6-loopback"})


def host_name(value: str) -> str:
    """The name of a `Host` value without its port, lower case (`[::1]:80` → `::1`)."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:value.find("]")] if "]" in value else value
    if value.count(":") == 1:
        value = value.partition(":")[0]
    return value


def is_loopback(name: str, extra: Iterable[str] = ()) -> bool:
    if name in LOOPBACK_NAMES or name in extra:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def allowed_names(hosts: Iterable[str]) -> frozenset[str]:
    """The `Host` names served besides loopback ones: `hosts` (the bind address and
    TURNLOG_ALLOWED_HOSTS) less a wildcard bind, which is no name a browser uses."""
    return frozenset(host_name(h) for h in hosts) - {"", "0.0.0.0", "::"}


def foreign_origin(headers: Mapping[bytes, bytes], allowed: Iterable[str]) -> ForeignHost | None:
    """The refusal of a request whose `Origin` is not this server's own: another host,
    or another port of a loopback one (a page of another local web app, Jupyter or a dev
    server, wrote to the store: a tester's finding). Only browsers send `Origin`, and the
    UI's pages are this server's own; None without one."""
    origin = headers.get(b"origin")
    if origin is None:
        return None
    text = origin.decode("latin-1").strip()
    try:
        parts = urlsplit(text)
        origin_port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        parts, origin_port = urlsplit(""), -1
    host = headers.get(b"host", b"").decode("latin-1").strip().lower()
    host_port = host.rpartition(":")[2] if host.rpartition(":")[2].isdigit() \
        and not host.endswith("]") else "80"
    if not is_loopback(parts.hostname or "", allowed) \
            or (parts.hostname or "") != host_name(host) or str(origin_port) != host_port:
        return ForeignHost(
            "without API tokens this server refuses requests from other origins",
            field="Origin", expected="this server's own origin, or no Origin header",
            actual=text[:80])
    return None


def foreign_request(headers: Mapping[bytes, bytes], allowed: Iterable[str]) -> ForeignHost | None:
    """A `Host` that is no loopback name (nor `allowed`), or an `Origin` not this
    server's own; `headers` by lower-case name."""
    host = host_name(headers.get(b"host", b"").decode("latin-1"))
    if not is_loopback(host, allowed):
        return ForeignHost(
            "without API tokens this server answers only loopback host names",
            field="Host", expected="localhost, 127.0.0.1, [::1] or TURNLOG_ALLOWED_HOSTS",
            actual=host[:80] or "missing")
    return foreign_origin(headers, allowed)


def header_map(scope_headers: Iterable[tuple[bytes, bytes]]) -> dict[bytes, bytes]:
    """An ASGI scope's headers by lower-case name, the first of each."""
    headers: dict[bytes, bytes] = {}
    for name, value in scope_headers:
        headers.setdefault(name.lower(), value)
    return headers
