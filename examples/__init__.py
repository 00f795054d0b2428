"""What reproduces the project's measurements, run from the repository's root: the tasks
(:mod:`examples.tasks`), the SL-SAM paper's recipes (:mod:`examples.recipes`) and the
comparison of methods (``python -m examples.compare``, its report :mod:`examples.report`)."""
