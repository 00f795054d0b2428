"""Every method as a pure-PyTorch specification: the base (:mod:`.spec`), the methods that
train every layer (:mod:`.dense`), those that train a subset (:mod:`.subset`), the parts a
method brings to the step (LookSAM's :mod:`.looksam`, ESAM's :mod:`.esam`, SSAM-F's
:mod:`.ssamf`) and the registry by name (:mod:`.registry`). No Lightning."""
