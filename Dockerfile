FROM python:3.11-slim
WORKDIR /srv/turnlog
COPY pyproject.toml README.md migrations.ini ./
COPY app ./app
COPY alembic ./alembic
# The client is a distribution of its own; the server depends on it.
COPY client ./client
RUN pip install --no-cache-dir ./client -e .
EXPOSE 8000
# `turnlog serve` applies migrations to head, then serves.
CMD ["turnlog", "serve", "--host", "0.0.0.0", "--port", "8000"]
