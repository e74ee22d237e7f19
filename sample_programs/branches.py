"""Control flow and piecewise arithmetic: jnp.where, jnp.maximum and lax.cond.

Source: written for jaxtool to exercise select, max and cond; no external reference.
"""

import jax.numpy as jnp
from jax import lax


def piecewise(x: "f32[5]", y: "f32[5]"):
    """A piecewise function of two f32[5] vectors; returns f32[5].

    Elementwise it picks ``x*y`` where ``x > 0`` and ``-x`` elsewhere, clamps from
    below by ``y``, then branches with ``lax.cond`` on the sign of the sum.

    Source: written for jaxtool.
    """
    a = jnp.where(x > 0, x * y, -x)
    b = jnp.maximum(a, y)
    s = jnp.sum(b)
    return lax.cond(s > 0, lambda v: jnp.sin(v) * s, lambda v: jnp.cos(v) - s, b)


def piecewise_example_args():
    """Values chosen away from the kinks (x == 0, a == y) so the function is smooth there."""
    x = jnp.array([-1.5, -0.5, 0.25, 1.0, 2.0], jnp.float32)
    y = jnp.array([0.3, 1.2, -0.7, 0.5, -1.0], jnp.float32)
    return x, y
