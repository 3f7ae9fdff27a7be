"""The trainers' and session servers' public surface: `from app.client import TurnlogClient`.

`async_client` is the async httpx client (retries that are safe because appends
are idempotent), `sync` a blocking facade over it for scripts, `errors` the
typed errors and the retry policy. Nothing here imports the server.
"""

from app.client.async_client import Claim, FeedPage, TurnlogClient, new_event_id
from app.client.errors import Backoff, TurnlogConnectionError, TurnlogError
from app.client.sync import SyncTurnlogClient

__all__ = [
    "Backoff",
    "Claim",
    "FeedPage",
    "SyncTurnlogClient",
    "TurnlogClient",
    "TurnlogConnectionError",
    "TurnlogError",
    "new_event_id",
]
