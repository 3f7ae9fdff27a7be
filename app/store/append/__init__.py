"""The append: opening, appending to and closing a session in one transaction.

Owns the write transactions (`writes`) and the one-round-trip append on
PostgreSQL (`fastpath`).
Refuses reads and operations: imports `engine`, `fold` and, for the close's
enqueue in the same transaction, `handoff`.
"""
