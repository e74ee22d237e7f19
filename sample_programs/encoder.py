"""Two transformer-encoder blocks on 4 tokens of width 4, with a cross-entropy output per head.

Source: the encoder block of A. Vaswani et al., "Attention Is All You Need", NeurIPS 2017
(scaled dot-product self-attention, eq. (1); residual connection and layer norm, sec. 3.1),
with layer normalisation from J. L. Ba et al., arXiv:1607.06450, and the SiLU activation of
Hendrycks & Gimpel, arXiv:1606.08415. Benchmark task "Encoder" of Lohoff & Neftci
(AlphaGrad), arXiv:2406.05027, with the argument shapes and output of that task as graphax
(the paper's library, commit 5b13282) defines it: tokens are the columns of x (4 x 4), the
second block's dense layer has 2 output rows (W2: 2 x 4), whose softmax over the 4 token
positions is scored by cross-entropy against y (2 x 4): one loss per row, f32[2]. Layer-norm
gains and biases are scalars, as in the task. Written here in the column-token convention
throughout (graphax normalises along the wrong axis; its counts are of the same shapes).
"""

import jax
import jax.numpy as jnp
import numpy as np

EPS = 1e-6


def _layer_norm(h, gamma, beta):
    """Normalise each token (column) of ``h`` over its features, then scale and shift."""
    mean = jnp.mean(h, axis=0, keepdims=True)
    var = jnp.mean((h - mean) ** 2, axis=0, keepdims=True)
    return (h - mean) / jnp.sqrt(var + EPS) * gamma + beta


def _block(x, WQ, WK, WV, W, b, gamma, beta):
    """One encoder block on tokens as columns: self-attention + residual, layer norm, then a
    SiLU dense layer ``W h + b``."""
    q, k, v = WQ @ x, WK @ x, WV @ x
    weights = jax.nn.softmax(q.T @ k / jnp.sqrt(jnp.float32(x.shape[0])), axis=1)  # token x token
    h = _layer_norm(x + v @ weights.T, gamma, beta)
    return jax.nn.silu(W @ h + b)


def encoder(x: "f32[4,4]", y: "f32[2,4]",
            WQ1: "f32[4,4]", WQ2: "f32[4,4]", WK1: "f32[4,4]", WK2: "f32[4,4]",
            WV1: "f32[4,4]", WV2: "f32[4,4]", W1: "f32[4,4]", W2: "f32[2,4]",
            b1: "f32[4,1]", b2: "f32[2,1]",
            gamma1: "f32[]", beta1: "f32[]", gamma2: "f32[]", beta2: "f32[]"):
    """Cross-entropy of a 2-block encoder's 2 output rows; returns f32[2].

    Arguments (in the task's order):
        x: f32[4,4], 4 tokens of width 4 as columns (argument 0);
        y: f32[2,4], per output row a one-hot target over the 4 token positions (data);
        WQn, WKn, WVn: f32[4,4], query, key and value projections of block n (n = 1, 2);
        W1, b1: f32[4,4], f32[4,1], block 1's dense layer; W2, b2: f32[2,4], f32[2,1], block 2's;
        gamman, betan: f32[], block n's layer-norm gain and bias.

    Each block computes h = LayerNorm(x + V softmax(Q^T K / 2)^T) with Q = WQ x, K = WK x,
    V = WV x, then SiLU(W h + b); the result is -sum(y * log_softmax(z, axis=1), axis=1) for the
    second block's output z (2 x 4).

    Source: Vaswani et al. 2017; Ba et al. 2016; AlphaGrad task Encoder (arXiv:2406.05027).
    """
    z = _block(x, WQ1, WK1, WV1, W1, b1, gamma1, beta1)
    z = _block(z, WQ2, WK2, WV2, W2, b2, gamma2, beta2)
    return -jnp.sum(y * jax.nn.log_softmax(z, axis=1), axis=1)


def encoder_example_args():
    """Fixed-seed input and weights (scaled by 1/sqrt(4)); targets: positions 1 and 3; unit
    gains, zero layer-norm biases, small dense-layer biases."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((4, 4))
    y = np.eye(4)[[1, 3]]
    square = tuple(0.5 * rng.standard_normal((4, 4)) for _ in range(7))  # WQ1, WQ2, WK1, WK2, WV1, WV2, W1
    W2 = 0.5 * rng.standard_normal((2, 4))
    b1, b2 = np.full((4, 1), 0.1), np.full((2, 1), -0.1)
    norm = (1.0, 0.0, 1.0, 0.0)  # gamma1, beta1, gamma2, beta2
    return tuple(jnp.asarray(a, jnp.float32) for a in (x, y) + square + (W2, b1, b2) + norm)
