"""The engine and what one step is made of, in plain PyTorch: the step contract
(:mod:`.contract`, :mod:`.step_parts`), the step kinds, a gradient pass, the perturbation,
per-step freezing over the layer partition, schedules, and the state a forward changes
besides the weights. No Lightning."""
