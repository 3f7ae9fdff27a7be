"""Engines, dialect, tables, migrations: what every store module stands on.

Owns connections and transactions (`db`), every SQLite/PostgreSQL branch
(`dialect`), the tables (`schema`), migrating to head (`migrate`) and the Citus
distribution (`citus`).
Refuses every rule of the data: imports no other store folder.
"""
