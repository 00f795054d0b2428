"""The offline tasks the project measures on, beside the packaged demo
(:mod:`lightning_slsam.demo`): digits with an MLP, a ViT and EfficientNet-Lite0
(:mod:`examples.tasks.vision`) and a small causal language model on Rotten Tomatoes
(:mod:`examples.tasks.causal_lm`). They need the ``examples`` extra's offline assets."""
