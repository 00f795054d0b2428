"""The Lightning layer: the method callbacks (:mod:`.callbacks`, over :mod:`.callback`'s
shared base), the module mixin (:mod:`.mixin`) and its step driver (:mod:`.driver`), the
checks made when a fit is set up (:mod:`.setup_checks`), per-step logging
(:mod:`.step_logging`, :mod:`.metrics`), the callbacks' signatures (:mod:`.signatures`) and
every use of Lightning's private internals (:mod:`.compat`)."""
