"""Parsed bodies: what a request says, checked against the rules.

Owns opening and closing a session (`session`), a turn (`turn`), labels and
label filters (`labels`), query parameters (`queries`), the SpecInfo counters a
turn carries (`specinfo`), a reward recorded after the close and which
reward each sample shows (`rewards`: the log folds reward bodies, so they
come before it), the turn a proxied SGLang request becomes (`gateway`), and a
write's deadline, the `X-Turnlog-Timeout` header (`deadline`).
The store receives only these parsed values.
Refuses the log and what is derived from it: imports `wire`, never `log`,
`projection`, `handoff` or `ci`.
"""
