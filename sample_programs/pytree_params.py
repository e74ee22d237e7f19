"""An autoencoder loss whose parameters are a nested pytree (dicts holding a tuple of dicts).

Source: written for jaxtool; a one-hidden-layer autoencoder (Goodfellow et al., "Deep
Learning", 2016, ch. 14) with L2 weight decay over every parameter leaf.
"""

import jax
import jax.numpy as jnp
import numpy as np


def loss(params, batch):
    """Reconstruction MSE plus weight decay; returns a scalar f32[].

    Arguments:
        params: ``{"encoder": {"w": f32[4,6], "b": f32[6]},
                   "decoder": ({"w": f32[6,4]}, {"b": f32[4]}),
                   "decay": f32[]}``
        batch: ``{"x": f32[6,4]}``, six samples to reconstruct.

    Source: autoencoder loss (Goodfellow et al., ch. 14).
    """
    enc = params["encoder"]
    dec_w, dec_b = params["decoder"]
    code = jnp.tanh(batch["x"] @ enc["w"] + enc["b"])
    recon = code @ dec_w["w"] + dec_b["b"]
    weights = (enc["w"], dec_w["w"])
    l2 = sum(jnp.sum(w * w) for w in weights)
    return jnp.mean((recon - batch["x"]) ** 2) + params["decay"] * l2


def loss_example_args():
    """Fixed-seed nested parameters and a batch of six samples."""
    rng = np.random.default_rng(3)
    params = {
        "encoder": {"w": 0.5 * rng.standard_normal((4, 6)), "b": np.linspace(-0.2, 0.2, 6)},
        "decoder": ({"w": 0.5 * rng.standard_normal((6, 4))}, {"b": np.full((4,), 0.01)}),
        "decay": np.array(1e-3),
    }
    batch = {"x": rng.standard_normal((6, 4))}
    return jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), (params, batch))
