"""Middleware and the served protocol: what runs before any router sees a request.

Owns bearer authorization (`auth`), body size and time limits (`limits`),
header, host and query-token guards (`guards`), request metrics (`telemetry`)
and the bounded HTTP protocol handed to uvicorn (`serving`).
Refuses routes: imports no router (the Swagger UI's public asset paths excepted).
"""
