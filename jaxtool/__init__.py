"""jaxtool: inspect, typecheck and differentiate JAX programs by vertex elimination.

The Python API is imported lazily so that ``import jaxtool`` (and the CLI's ``--help``)
does not import JAX.
"""

from __future__ import annotations

__version__ = "0.1.0"

_LAZY = {
    "load": ("jaxtool.loading", "load"),
    "jacve": ("jaxtool.jacobian", "jacve"),
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'jaxtool' has no attribute {name!r}")


__all__ = ["load", "jacve", "__version__"]
