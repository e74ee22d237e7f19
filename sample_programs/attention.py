"""Single-head scaled dot-product self-attention over 8 tokens of width 16.

Source: Vaswani et al., "Attention Is All You Need", NeurIPS 2017, eq. (1):
Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V.
"""

import jax
import jax.numpy as jnp
import numpy as np


def attention(x: "f32[8,16]", wq: "f32[16,16]", wk: "f32[16,16]", wv: "f32[16,16]"):
    """Self-attention of the tokens ``x`` (f32[8,16]); returns f32[8,16].

    ``wq``, ``wk``, ``wv`` (each f32[16,16]) project tokens to queries, keys and values.

    Source: Vaswani et al. 2017, eq. (1).
    """
    q = x @ wq
    k = x @ wk
    v = x @ wv
    scores = q @ k.T / jnp.sqrt(jnp.float32(q.shape[-1]))
    return jax.nn.softmax(scores, axis=-1) @ v


def attention_example_args():
    """Fixed-seed tokens and projection matrices scaled by 1/sqrt(16)."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((8, 16))
    wq, wk, wv = (0.25 * rng.standard_normal((16, 16)) for _ in range(3))
    return tuple(jnp.asarray(a, jnp.float32) for a in (x, wq, wk, wv))
