"""The simulator: a fake SGLang and session server, for tests, demos and benchmarks.

Owns the causal MoE router that is the R3 oracle and the fake session server
(`simulator`), and the same behind HTTP routes (`sglang_http`).
Refuses the server's core: imports `app.domain` only, and no part of the
server imports it (outside `turnlog demo`).
"""
