"""Pure rules of turnlog: no I/O, no SQLAlchemy, no FastAPI. Written once, called everywhere."""
