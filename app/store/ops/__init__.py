"""Operations: rebuild, integrity checks and R3 retention.

Owns rebuilding projections from the log (`rebuild`) and where an interrupted
rebuild resumes (`checkpoint`), the SQLite integrity check (`integrity`) and
freeing acknowledged R3 (`retention`).
Refuses CI; nothing of the append or the reads imports it.
"""
