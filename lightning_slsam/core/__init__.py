"""One training step in plain PyTorch: the step functions (:mod:`.step`), the one pass loop
every front-end runs (:mod:`.passes`), the engine around them (:mod:`.engine`) and its
state in a checkpoint, saved and restored alike by every front-end (:mod:`.state`), the
perturbation, the layer partition and per-step freezing, what one pass may leave behind
(:mod:`.isolation`) and compiled regions (:mod:`.regions`). No Lightning."""
