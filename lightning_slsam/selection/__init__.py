"""Which layers train each step: the selection rules (:mod:`.rules`), the rules that reshape
another's draw (:mod:`.wrappers`), SL-SAM's bandit (:mod:`.bandit`) and the KL projection it
renormalises with (:mod:`.projection`). No Lightning."""
