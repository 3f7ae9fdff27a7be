"""CI: metric history and gates.

Owns metric history (`history`) and gate baselines and evaluation (`gates`);
the analytics views it reads are `read`'s.
Refuses the append, the fold, operations and hand-off: imports `engine` and `read`.
"""
