"""Two transformer-encoder blocks on a 4x4 input, with a squared-error output.

Source: the encoder block of A. Vaswani et al., "Attention Is All You Need", NeurIPS 2017
(scaled dot-product self-attention, eq. (1); residual connection and layer norm, sec. 3.1),
with layer normalisation from J. L. Ba et al., arXiv:1607.06450, and the SiLU activation of
Hendrycks & Gimpel, arXiv:1606.08415. Benchmark task "Encoder" of Lohoff & Neftci
(AlphaGrad), arXiv:2406.05027: two blocks on a sequence of 4 tokens of width 4.
"""

import jax
import jax.numpy as jnp
import numpy as np

EPS = 1e-6


def _layer_norm(h, gamma, beta):
    """Normalise each token (row) of ``h`` over its features, then scale and shift."""
    mean = jnp.mean(h, axis=-1, keepdims=True)
    var = jnp.mean((h - mean) ** 2, axis=-1, keepdims=True)
    return (h - mean) / jnp.sqrt(var + EPS) * gamma + beta


def _block(x, WQ, WK, WV, W, b, gamma, beta):
    """One encoder block: self-attention + residual, layer norm, then a SiLU dense layer."""
    q = x @ WQ
    k = x @ WK
    v = x @ WV
    scores = q @ k.T / jnp.sqrt(jnp.float32(x.shape[-1]))
    h = _layer_norm(x + jax.nn.softmax(scores, axis=-1) @ v, gamma, beta)
    return jax.nn.silu(h @ W + b)


def encoder(x: "f32[4,4]", y: "f32[4,4]",
            WQ1: "f32[4,4]", WK1: "f32[4,4]", WV1: "f32[4,4]", W1: "f32[4,4]", b1: "f32[4]",
            gamma1: "f32[4]", beta1: "f32[4]",
            WQ2: "f32[4,4]", WK2: "f32[4,4]", WV2: "f32[4,4]", W2: "f32[4,4]", b2: "f32[4]",
            gamma2: "f32[4]", beta2: "f32[4]"):
    """Elementwise squared error of a 2-block encoder; returns f32[4,4].

    Arguments:
        x: f32[4,4], 4 tokens of width 4 (argument 0, the usual differentiation target);
        y: f32[4,4], the target output (data, not a parameter);
        WQn, WKn, WVn: f32[4,4], query, key and value projections of block n (n = 1, 2);
        Wn, bn: f32[4,4], f32[4], the block's output dense layer;
        gamman, betan: f32[4], the block's layer-norm gain and bias.

    Each block computes h = LayerNorm(x + softmax(x WQ (x WK)^T / 2) x WV) and
    SiLU(h W + b); the result is 0.5 * (z - y)^2 for the second block's output z.

    Source: Vaswani et al. 2017; Ba et al. 2016; AlphaGrad task Encoder (arXiv:2406.05027).
    """
    z = _block(x, WQ1, WK1, WV1, W1, b1, gamma1, beta1)
    z = _block(z, WQ2, WK2, WV2, W2, b2, gamma2, beta2)
    return 0.5 * (z - y) ** 2


def encoder_example_args():
    """Fixed-seed input, target and weights (scaled by 1/sqrt(4)); unit gains, small biases."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((4, 4))
    y = rng.standard_normal((4, 4))

    def block_params():
        mats = tuple(0.5 * rng.standard_normal((4, 4)) for _ in range(4))  # WQ, WK, WV, W
        return mats + (np.full(4, 0.1), np.ones(4), np.zeros(4))  # b, gamma, beta

    return tuple(jnp.asarray(a, jnp.float32) for a in (x, y) + block_params() + block_params())
