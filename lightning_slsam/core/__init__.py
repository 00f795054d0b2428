"""One training step in plain PyTorch, no Lightning: the step, pass loop, engine, state,
perturbation, partition, isolation and compiled regions every front-end runs."""
