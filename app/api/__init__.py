"""HTTP layer: thin FastAPI routers that parse, call the store and map errors."""
