"""Reads: sessions, trees, events, the feed, samples and R3 tensors.

Owns the `Reader` (`reader`), the samples reader (`samples`), the browsing
queries of the UI and CLI (`browse`), feed cursors (`cursor`), the shared
SELECT helpers (`selects`), the analytics views (`analytics`: SpecInfo rates
and rollout metrics, read by the API, the UI and CI) and the recording
gateway's open sessions (`gateway`).
Refuses writing: imports `engine` and `fold` only.
"""
