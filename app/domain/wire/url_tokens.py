"""Credentials in a URL's query string: which parameter names carry one, and the
redaction of their values in a logged request line.

A token in a URL lands in access logs, proxies and browser history, so the API
refuses it (`app.api.middleware.guards.QueryTokens`) and the access log hides its value
(`app.logs`). Both decide on the *decoded* parameter name, as the routers read
it: `%61ccess_token` and `access%5Ftoken` are `access_token` to every query
parser, so they are to this one too.

Refuses to own the HTTP answer or the log handler; pure: no I/O.
"""

from __future__ import annotations

import re
from urllib.parse import unquote_plus

# RFC 6750 §2.3 `access_token` and the usual aliases.
TOKEN_PARAMS = frozenset({"access_token", "token", "api_key", "apikey", "api_token",
                          "bearer", "authorization"})
REDACTED = "REDACTED"
# One `name=value` pair of a query (what follows `?` or `&` up to the next `&`).
_PAIR = re.compile(r"([?&])([^=&\s]*)=([^&\s]*)")


def decoded_name(raw: str) -> str:
    """A query parameter's name as the routers read it (`+` is a space, %XX decoded)."""
    return unquote_plus(raw, encoding="utf-8", errors="replace")


def is_token_param(raw_name: str) -> bool:
    return decoded_name(raw_name).strip().lower() in TOKEN_PARAMS


def query_token_param(query_string: str) -> str | None:
    """The first credential-like parameter name (decoded) in a raw query string."""
    for pair in query_string.split("&"):
        raw = pair.partition("=")[0]
        if is_token_param(raw):
            return decoded_name(raw)
    return None


def redact_query(text: str) -> str:
    """`text` with the values of credential-like query parameters replaced."""
    return _PAIR.sub(lambda m: (f"{m.group(1)}{m.group(2)}={REDACTED}"
                                if is_token_param(m.group(2)) else m.group(0)), text)
