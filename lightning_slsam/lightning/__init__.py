"""The Lightning layer: the method callbacks (:mod:`.callbacks`, over :mod:`.callback`'s
shared base), the module mixin (:mod:`.mixin`) and its step driver (:mod:`.driver`),
Fabric's front-end (:mod:`.fabric`), the forgetting monitor (:mod:`.forgetting`), the fit's
setup checks (:mod:`.setup_checks`), the callbacks' signatures (:mod:`.signatures`) and
every use of Lightning's private internals (:mod:`.compat`)."""
