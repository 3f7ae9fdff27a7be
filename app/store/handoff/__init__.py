"""Hand-off: consumer groups that give closed sessions to trainers exactly once.

Owns the consumer tables' transactions (`consumers`).
Refuses the append's and the operations' code: imports `engine`, `fold`, `read`.
"""
