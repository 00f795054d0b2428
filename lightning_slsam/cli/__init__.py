"""The ``lightning-slsam`` command: LightningCLI with the demo (:mod:`.command`), what it
checks first (:mod:`.checks`), its one-line errors (:mod:`.errors`) and its progress lines
(:mod:`.progress`)."""
