"""The Lightning layer: the method callbacks (:mod:`.callbacks`, over :mod:`.callback`'s
shared base, which also logs each step), the module mixin (:mod:`.mixin`) and its step
driver (:mod:`.driver`), Lightning Fabric's front-end (:mod:`.fabric`), the checks made when
a fit is set up (:mod:`.setup_checks`), the end-of-fit record (:mod:`.record`), the
callbacks' signatures (:mod:`.signatures`) and every use of Lightning's private internals
(:mod:`.compat`)."""
