FROM python:3.11-slim
WORKDIR /srv/turnlog
COPY pyproject.toml README.md migrations.ini ./
COPY app ./app
COPY alembic ./alembic
RUN pip install --no-cache-dir -e .
EXPOSE 8000
# `turnlog serve` applies migrations to head, then serves.
CMD ["turnlog", "serve", "--host", "0.0.0.0", "--port", "8000"]
