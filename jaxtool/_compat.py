"""The one place where jaxtool touches JAX internals (``jax._src``).

Everything else uses ``jax``, ``jax.extend.core`` and ``jax.extend.core.primitives``.
Each import below says why the public API is not enough and since which JAX version it is used.
"""

from __future__ import annotations

# --- primitives missing from jax.extend.core.primitives ---------------------------------------
# `split_p` (jnp.split, lax.split) is not re-exported by jax.extend.core.primitives in JAX 0.10.2;
# it has lived in jax._src.lax.lax since JAX 0.4.36. Used by jaxtool.rules to register its rule.
from jax._src.lax.lax import split_p  # noqa: E402

# `stack_p` and `unstack_p` (what jnp.stack and jnp.unstack emit since JAX 0.10) are not re-exported
# by jax.extend.core.primitives either (checked up to JAX 0.12); they live in jax._src.lax.lax. Used
# by jaxtool.rules to register them as selections, and by jaxtool.graph to fold integer stacks.
from jax._src.lax.lax import stack_p, unstack_p  # noqa: E402

# --- weakly typed arrays ------------------------------------------------------------------------
# jax.jacrev returns a weakly typed block for a weakly typed input (a Python float, or a value made
# from one), which later promotion follows (times a bfloat16 array: bfloat16). JAX 0.10.2 has no
# public way to mark an array weakly typed; `_convert_element_type(..., weak_type=True)` in
# jax._src.lax.lax (there since JAX 0.4) does it. Used by jaxtool.jacobian.
from jax._src.lax.lax import _convert_element_type  # noqa: E402


def weakly_typed(x):
    """``x`` as a weakly typed array of its dtype."""
    return _convert_element_type(x, weak_type=True)


# --- the operand layout of `scan` ---------------------------------------------------------------
# Up to JAX 0.10 a scan equation says how its operands split into (consts, carry, xs) with the
# params num_consts and num_carry. JAX 0.11 drops both and packs the layout in the param ft_in, a
# jax._src.flattree.FlatTree whose unpack() gives the three groups. Used by jaxtool.typecheck.
def scan_layout(params) -> tuple[int, int]:
    """The numbers of const and carry operands of a ``scan`` equation with ``params``."""
    if "num_consts" in params:
        return int(params["num_consts"]), int(params["num_carry"])
    consts, carry, _ = params["ft_in"].unpack()
    return len(consts), len(carry)
