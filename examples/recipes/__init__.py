"""The SL-SAM paper's three experiments as LightningModules and DataModules.

Each recipe downloads its model and data on first use (the user's machine) and takes local
files instead, so that its code path runs offline on a small stand-in:

* :mod:`~examples.recipes.cifar`: a timm image model (DeiT-Small, ImageNet
  weights) fine-tuned on CIFAR-10 / CIFAR-100 (the paper's Table 1).
* :mod:`~examples.recipes.glue`: RoBERTa-base on the eight GLUE tasks, each with
  its own metric (Table 3).
* :mod:`~examples.recipes.instruct`: an instruction-tuned causal LM
  (Llama-3.2-3B-Instruct) on Open-Platypus, exported for downstream evaluation (Table 5).

The configs with the paper's hyperparameters are in ``examples/configs/recipes/``.
"""
