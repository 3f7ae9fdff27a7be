"""The log: events and the session tree folded from them.

Owns the event records and their storage form (`events`: prompt deltas, R3
patches, exact restore) and the session forest (`tree`: folding events into a
state and the attach rules of a new turn).
Refuses projections, hand-off and CI: imports `wire` and `body` only.
"""
