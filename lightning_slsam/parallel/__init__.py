"""Multi-process training: gradient averaging on the active tensors (:mod:`.ddp`) and the
engine's arithmetic on FSDP2 shards (:mod:`.fsdp2`). No Lightning."""
