"""One training step in plain PyTorch, no Lightning: the step functions (:mod:`.step`), the pass
loop (:mod:`.passes`), the engine (:mod:`.engine`) and its checkpoint state (:mod:`.state`), the
perturbation, the layer partition and per-step freezing, pass isolation (:mod:`.isolation`) and
compiled regions (:mod:`.regions`); every front-end runs the same."""
