"""A two-layer perceptron regression loss with a dict of parameters.

Source: written for jaxtool; a textbook MLP (Goodfellow, Bengio & Courville,
"Deep Learning", 2016, ch. 6) with a mean-squared-error loss.
"""

import jax
import jax.numpy as jnp
import numpy as np


def mlp_loss(params, x, y):
    """Mean squared error of a relu-tanh MLP.

    Arguments:
        params: dict with ``w1`` f32[3,16], ``b1`` f32[16], ``w2`` f32[16,2], ``b2`` f32[2].
        x: f32[8,3], a batch of 8 inputs.
        y: f32[8,2], the matching targets.

    Returns a scalar f32[].

    Source: textbook MLP (Goodfellow et al., "Deep Learning", ch. 6).
    """
    h = jax.nn.relu(x @ params["w1"] + params["b1"])
    pred = jnp.tanh(h @ params["w2"] + params["b2"])
    return jnp.mean((pred - y) ** 2)


def mlp_loss_example_args():
    """Fixed-seed parameters and a batch of 8 samples."""
    rng = np.random.default_rng(0)
    params = {
        "w1": 0.5 * rng.standard_normal((3, 16)),
        "b1": np.linspace(-0.1, 0.1, 16),
        "w2": 0.3 * rng.standard_normal((16, 2)),
        "b2": np.array([0.05, -0.05]),
    }
    x = rng.standard_normal((8, 3))
    y = rng.uniform(-0.5, 0.5, (8, 2))
    params = {k: jnp.asarray(v, jnp.float32) for k, v in params.items()}
    return params, jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32)
