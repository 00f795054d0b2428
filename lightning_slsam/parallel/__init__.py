"""Multi-process training: gradient averaging on the active tensors (:mod:`.ddp`) and the
one seam to sharded parameters (:mod:`.shards`: FSDP2, or whole tensors). No Lightning, and
nothing else of the package."""
