FROM python:3.11-slim
WORKDIR /srv/turnlog
COPY pyproject.toml README.md ./
COPY app ./app
# The client is a distribution of its own; the server depends on it.
COPY client ./client
# Regular (non-editable) installs: the wheels carry the migrations and the UI files,
# so the source tree is not needed at run time.
RUN pip install --no-cache-dir ./client . && rm -rf /srv/turnlog/app /srv/turnlog/client
# SQLite by default, on a volume; docker-compose.yml points it at PostgreSQL instead.
ENV TURNLOG_DATABASE_URL=sqlite+aiosqlite:////data/turnlog.db \
    TURNLOG_HOST=0.0.0.0 \
    TURNLOG_PORT=8000
VOLUME /data
WORKDIR /data
EXPOSE 8000
# `turnlog serve` applies migrations to head, then serves on TURNLOG_HOST:TURNLOG_PORT.
# Outside loopback it needs API tokens: without TURNLOG_API_TOKENS (or `--insecure`
# appended) it prints one line saying so and exits 2 (docs/operations.md#docker).
CMD ["turnlog", "serve"]
