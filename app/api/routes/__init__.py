"""The routers: one module per resource, each handler parse -> store -> reply.

Owns the REST routes, the append's bare ASGI hot path (`hotpath`) and its log
line (`append_log`), the Prometheus scrape (`metrics`) and the OpenAPI
documentation (`docs`, `docs_ui`).
Refuses cross-cutting concerns (those are `middleware`); errors are mapped
once, in `app.api.problems`.
"""
