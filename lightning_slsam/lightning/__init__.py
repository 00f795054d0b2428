"""The Lightning layer: the method callbacks, their base and signatures, the module mixin and its
step driver, Fabric's front-end, the forgetting monitor, the setup checks and every use of
Lightning's private internals (:mod:`.compat`)."""
