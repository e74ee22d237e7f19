"""The one place where jaxtool touches JAX internals (``jax._src``).

Everything else uses ``jax``, ``jax.extend.core`` and ``jax.extend.core.primitives``.
Each import below says why the public API is not enough and since which JAX version it is used.
"""

from __future__ import annotations

# --- primitives missing from jax.extend.core.primitives ---------------------------------------
# `split_p` (jnp.split, lax.split) is not re-exported by jax.extend.core.primitives in JAX 0.10.2;
# it has lived in jax._src.lax.lax since JAX 0.4.36. Used by jaxtool.rules to register its rule.
from jax._src.lax.lax import split_p  # noqa: E402

# --- weakly typed arrays ------------------------------------------------------------------------
# jax.jacrev returns a weakly typed block for a weakly typed input (a Python float, or a value made
# from one), which later promotion follows (times a bfloat16 array: bfloat16). JAX 0.10.2 has no
# public way to mark an array weakly typed; `_convert_element_type(..., weak_type=True)` in
# jax._src.lax.lax (there since JAX 0.4) does it. Used by jaxtool.jacobian.
from jax._src.lax.lax import _convert_element_type  # noqa: E402


def weakly_typed(x):
    """``x`` as a weakly typed array of its dtype."""
    return _convert_element_type(x, weak_type=True)
