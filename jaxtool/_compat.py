"""The one place where jaxtool touches JAX internals (``jax._src``).

Everything else uses ``jax``, ``jax.extend.core`` and ``jax.extend.core.primitives``.
Each import below says why the public API is not enough and since which JAX version it is used.
"""

from __future__ import annotations
