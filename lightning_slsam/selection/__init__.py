"""Which layers train each step: the selection rules (:mod:`.rules`) and SL-SAM's bandit with
the KL projection it renormalises with (:mod:`.bandit`). No Lightning, and nothing else of
the package: the step (:mod:`lightning_slsam.core`) draws from a rule it is given."""
