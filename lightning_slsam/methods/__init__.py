"""Every method as a pure-PyTorch specification, one module per method: its options, the parts it
brings to the step and its selection rule. The base classes are in :mod:`.spec`, the option checks
in :mod:`.options`, the registry by name in :mod:`.registry`. No Lightning."""
