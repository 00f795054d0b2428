"""The offline tasks the project measures on, beside the packaged demo
(:mod:`lightning_slsam.demo`): digits with an MLP, a ViT and EfficientNet-Lite0
(:mod:`examples.tasks.vision`), a small causal language model on Rotten Tomatoes
(:mod:`examples.tasks.causal_lm`) and the demo's task with a test split and label noise
(:mod:`examples.tasks.text`; the shared pieces: :mod:`examples.tasks.held_out`). They need
the ``examples`` extra's offline assets."""
