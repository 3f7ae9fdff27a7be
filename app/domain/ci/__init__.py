"""CI: metric history, gate definitions, gates and rollout metrics.

Owns the bodies of metric submissions (`metric_history`), gate definitions and
checks (`gate_definitions`), judging a run against baselines (`gates`) and the
rollout metrics of closed sessions (`rollout_metrics`).
Refuses to be part of an append: may import the pipeline, which never imports it.
"""
