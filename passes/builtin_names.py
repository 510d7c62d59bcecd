"""The names of the built-in passes and the modules that define them (data only).

Its own module so that ``register_pass`` (which reserves these names) and the registry
(which imports the modules lazily) both read it without importing each other.
"""

from __future__ import annotations

#: Built-in pass name -> the module that defines and registers it. A backend's pass is named by
#: its module path like any other: the registry imports it on first use, so ``passes`` itself
#: never imports a backend.
BUILTIN_PASSES: dict[str, str] = {
    "absorb-bn": "passes.absorb_bn",
    "dce": "passes.dce",
    "fuse": "passes.fuse",
    "insert-observers": "passes.insert_observers",
    "legalize": "passes.legalize",
    "lower": "backends.common.lower_pass",
    "quantize": "passes.quantize",
    "remove-identity": "passes.remove_identity",
}
