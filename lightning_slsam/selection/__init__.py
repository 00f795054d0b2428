"""Which layers train each step: the selection rules (:mod:`.rules`) and SL-SAM's bandit
(:mod:`.bandit`). No Lightning, and nothing else of the package."""
