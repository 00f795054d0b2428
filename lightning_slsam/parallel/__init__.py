"""Multi-process training: gradient averaging (:mod:`.ddp`) and the seam to sharded parameters
(:mod:`.shards`). No Lightning, and nothing else of the package."""
