"""Folding a session from its log, and the per-process state cache.

Owns the session row lock, loading stored events and folding them into a
`SessionState` (`loader`).
Refuses writing: imports `engine` only.
"""
