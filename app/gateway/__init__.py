"""The recording gateway (`turnlog gateway`): a reverse proxy in front of SGLang that
appends every chat turn to the store before the caller sees the reply.

`proxy` is the ASGI app (forwarding, own routes), `recorder` makes a turn
durable (store or spool, drain, idle close), `spool` is the on-disk queue,
`errors` its transport errors (upstream unavailable, spool full), `metrics` the
Prometheus registry. The rules of what is a turn live in
`app.domain.body.gateway`. May use app.services, app.store, app.domain, app.settings,
app.metrics and app.logs; never app.api or app.cli.
"""
