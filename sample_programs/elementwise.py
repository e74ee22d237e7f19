"""An elementwise function of a vector: a chain of unary primitives and products.

Source: written for jaxtool as a minimal smoke test; no external reference.
"""

import jax.numpy as jnp
import numpy as np


def elementwise(x: "f32[8]"):
    """Map ``x`` (f32[8]) through sin, exp, log1p, tanh and products; returns f32[8].

    Source: written for jaxtool; every output element depends only on the matching
    input element, so the Jacobian is diagonal.
    """
    a = jnp.sin(x) * jnp.exp(-0.5 * x * x)
    b = jnp.log1p(x * x) + jnp.tanh(2.0 * x)
    return a * b + x * x * x


def elementwise_example_args():
    """One f32[8] vector spread over [-2, 2], avoiding 0."""
    return (jnp.asarray(np.linspace(-2.0, 2.0, 8), jnp.float32),)
