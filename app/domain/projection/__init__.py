"""What is derived from the log: samples, R3 assembly, projection rows.

Owns the samples of a closed session (`samples`, `samples_merge`), the R3 plan
and assembly across a path (`assembly`, `r3_slices`), the rows of the
projection tables (`rows`), the miles samples wire (`samples_wire`), the
token lanes the UI draws (`lanes`) and the UI's summaries over samples
(`overview`).
Every value here is a pure function of the events.
Refuses hand-off and CI: imports `wire`, `body` and `log` only.
"""
