"""The one place where jaxtool touches JAX internals (``jax._src``).

Everything else uses ``jax``, ``jax.extend.core`` and ``jax.extend.core.primitives``.
Each import below says why the public API is not enough and since which JAX version it is used.
"""

from __future__ import annotations

# --- primitives missing from jax.extend.core.primitives ---------------------------------------
# `split_p` (jnp.split, lax.split) is not re-exported by jax.extend.core.primitives in JAX 0.10.2;
# it has lived in jax._src.lax.lax since JAX 0.4.36. Used by jaxtool.rules to register its rule.
from jax._src.lax.lax import split_p  # noqa: E402
