"""A two-layer tanh perceptron with layer normalisation and a softmax cross-entropy loss.

Source: layer normalisation from J. L. Ba, J. R. Kiros & G. E. Hinton, "Layer
Normalization", arXiv:1607.06450 (2016), eqs. (3)-(4); the MLP and softmax cross-entropy
are textbook (Goodfellow, Bengio & Courville, "Deep Learning", 2016, sec. 6.2.2.3).
Benchmark task "Perceptron" of Lohoff & Neftci (AlphaGrad), arXiv:2406.05027, with the
argument shapes of that task as graphax (the paper's library, commit 5b13282) defines it:
4 inputs, 8 hidden units, 4 classes, a scalar layer-norm gain and bias.
"""

import jax
import jax.numpy as jnp
import numpy as np

EPS = 1e-6


def _layer_norm(h, gamma, beta):
    """Normalise ``h`` over its features to zero mean and unit variance, then scale and shift."""
    mean = jnp.mean(h)
    var = jnp.mean((h - mean) ** 2)
    return (h - mean) / jnp.sqrt(var + EPS) * gamma + beta


def perceptron(x: "f32[4]", y: "f32[4]", W1: "f32[8,4]", b1: "f32[8]", W2: "f32[4,8]", b2: "f32[4]",
               gamma: "f32[]", beta: "f32[]"):
    """Cross-entropy loss of one sample; returns a scalar f32[].

    Arguments:
        x: f32[4], the input sample (argument 0, the usual differentiation target);
        y: f32[4], its one-hot class label (data, not a parameter);
        W1, b1: f32[8,4], f32[8], the hidden layer;
        W2, b2: f32[4,8], f32[4], the output layer producing logits;
        gamma, beta: f32[], the layer-norm gain and bias.

    Computes h = LayerNorm(tanh(W1 x + b1)), logits = W2 h + b2 and
    loss = -sum(y * log_softmax(logits)).

    Source: Ba et al. 2016 (layer norm); Goodfellow et al. 2016 (MLP, cross-entropy);
    AlphaGrad task Perceptron (arXiv:2406.05027).
    """
    h = jnp.tanh(W1 @ x + b1)
    h = _layer_norm(h, gamma, beta)
    logits = W2 @ h + b2
    return -jnp.sum(y * jax.nn.log_softmax(logits))


def perceptron_example_args():
    """Fixed-seed weights, an input vector and the one-hot label of class 2."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal(4)
    y = np.eye(4)[2]
    W1 = 0.5 * rng.standard_normal((8, 4))
    b1 = np.linspace(-0.1, 0.1, 8)
    W2 = 0.35 * rng.standard_normal((4, 8))
    b2 = np.zeros(4)
    gamma = 1.0
    beta = 0.0
    return tuple(jnp.asarray(a, jnp.float32) for a in (x, y, W1, b1, W2, b2, gamma, beta))
