"""An Elman (tanh) recurrent network unrolled with lax.scan.

Source: Elman, "Finding Structure in Time", Cognitive Science 14 (1990); the cell is
h_t = tanh(h_{t-1} W_h + x_t W_x + b).
"""

import jax.numpy as jnp
import numpy as np
from jax import lax


def rnn(params, xs):
    """Run a tanh RNN over ``xs`` (f32[5,3]: 5 steps of 3 features); returns the final state f32[4].

    ``params`` is a dict with ``w_h`` f32[4,4], ``w_x`` f32[3,4] and ``b`` f32[4]; the
    initial state is zero.

    Source: Elman 1990.
    """

    def cell(h, x):
        h = jnp.tanh(h @ params["w_h"] + x @ params["w_x"] + params["b"])
        return h, None

    h0 = jnp.zeros(params["b"].shape, xs.dtype)
    h, _ = lax.scan(cell, h0, xs)
    return h


def rnn_example_args():
    """Fixed-seed weights and a 5-step input sequence."""
    rng = np.random.default_rng(2)
    params = {
        "w_h": 0.4 * rng.standard_normal((4, 4)),
        "w_x": 0.6 * rng.standard_normal((3, 4)),
        "b": np.array([0.1, -0.1, 0.05, 0.0]),
    }
    xs = rng.standard_normal((5, 3))
    return {k: jnp.asarray(v, jnp.float32) for k, v in params.items()}, jnp.asarray(xs, jnp.float32)
