"""The trainers' and session servers' public surface: `from turnlog_client import TurnlogClient`.

`async_client` is the async httpx client (retries that are safe because appends
are idempotent), `sync` a blocking facade over it for scripts, `errors` the
typed errors and the retry policy, `transport` the one httpx transport both
halves of the async client share, `miles` the hooks for miles'
`--custom-agent-function-path` and `--custom-rm-path`. A distribution of its
own (`turnlog-client`): nothing here imports the server.
"""

from turnlog_client.async_client import Claim, FeedPage, TurnlogClient, new_event_id
from turnlog_client.errors import Backoff, TurnlogConnectionError, TurnlogError
from turnlog_client.sync import SyncClaim, SyncTurnlogClient

__all__ = [
    "Backoff",
    "Claim",
    "FeedPage",
    "SyncClaim",
    "SyncTurnlogClient",
    "TurnlogClient",
    "TurnlogConnectionError",
    "TurnlogError",
    "new_event_id",
]
