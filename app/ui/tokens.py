"""Token text for the UI: a local `tokenizer.json` (TURNLOG_TOKENIZER), read with the
optional `tokenizers` library.

Owns loading the file once per process and turning ids into the text each token
stands for. Without a configured file the pages show ids, as before; a file that
cannot be read, or a missing library, is logged once and also leaves ids.
Refuses any rule about tokens: ids come from the domain's lanes unchanged.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import structlog

log = structlog.get_logger("turnlog.ui")


@lru_cache(maxsize=4)
def load(path: str) -> Any | None:
    """The tokenizer at `path`, or None (logged) when it cannot be used."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        log.warning("TURNLOG_TOKENIZER is set but the tokenizers package is not installed: "
                    "pip install 'turnlog[tokenizer]'", path=path)
        return None
    try:
        return Tokenizer.from_file(path)
    except Exception as exc:  # the library raises plain Exceptions for bad files
        log.warning("cannot read TURNLOG_TOKENIZER", path=path, error=str(exc)[:200])
        return None


def texts(path: str, ids: list[int]) -> list[str] | None:
    """Each id decoded on its own (special tokens kept); None without a tokenizer."""
    if not path:
        return None
    tokenizer = load(path)
    if tokenizer is None:
        return None
    return [tokenizer.decode([i], skip_special_tokens=False) if i >= 0 else "" for i in ids]
