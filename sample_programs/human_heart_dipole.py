"""The MINPACK-2 human heart dipole problem: an 8x8 system of nonlinear equations.

Source: B. M. Averick, R. G. Carter, J. J. More & G.-L. Xue, "The MINPACK-2 test problem
collection", Argonne preprint MCS-P153-0692 (1992), problem "human heart dipole" (dhhdfj,
data set DHHD1, experiment 791129); originally C. V. Nelson & B. C. Hodgkin, IEEE Trans.
Biomed. Eng. 28 (1981) 817-823, as posed by Dennis, Gay & Vu (1985). Benchmark task
"HumanHeartDipole" of Lohoff & Neftci (AlphaGrad), arXiv:2406.05027.
"""

import jax.numpy as jnp

# Measured moments of data set DHHD1: sigma_mx, sigma_my, sigma_A, ..., sigma_F.
SIGMA_MX = 0.485
SIGMA_MY = -0.0019
SIGMA_A = -0.0581
SIGMA_B = 0.015
SIGMA_C = 0.105
SIGMA_D = 0.0406
SIGMA_E = 0.167
SIGMA_F = -0.399


def human_heart_dipole(a: "f32[]", b: "f32[]", c: "f32[]", d: "f32[]",
                       t: "f32[]", u: "f32[]", v: "f32[]", w: "f32[]"):
    """Residual of the heart dipole equations at (a, b, c, d, t, u, v, w): 8 scalars -> 8 scalars.

    (a, c) and (b, d) are the moments of two dipoles, (t, v) and (u, w) their locations.
    Returns the tuple (f1, ..., f8):

        f1 = a + b - s_mx
        f2 = c + d - s_my
        f3 = t a + u b - v c - w d - s_A
        f4 = v a + w b + t c + u d - s_B
        f5 = a (t^2 - v^2) - 2 c t v + b (u^2 - w^2) - 2 d u w - s_C
        f6 = c (t^2 - v^2) + 2 a t v + d (u^2 - w^2) + 2 b u w - s_D
        f7 = a t (t^2 - 3 v^2) + c v (v^2 - 3 t^2) + b u (u^2 - 3 w^2) + d w (w^2 - 3 u^2) - s_E
        f8 = c t (t^2 - 3 v^2) - a v (v^2 - 3 t^2) + d u (u^2 - 3 w^2) - b w (w^2 - 3 u^2) - s_F

    Source: MINPACK-2 (Averick et al. 1992), dhhdfj with data set DHHD1; AlphaGrad task
    HumanHeartDipole (arXiv:2406.05027).
    """
    tt, vv, uu, ww = t * t, v * v, u * u, w * w
    f1 = a + b - SIGMA_MX
    f2 = c + d - SIGMA_MY
    f3 = t * a + u * b - v * c - w * d - SIGMA_A
    f4 = v * a + w * b + t * c + u * d - SIGMA_B
    f5 = a * (tt - vv) - 2.0 * c * t * v + b * (uu - ww) - 2.0 * d * u * w - SIGMA_C
    f6 = c * (tt - vv) + 2.0 * a * t * v + d * (uu - ww) + 2.0 * b * u * w - SIGMA_D
    f7 = (a * t * (tt - 3.0 * vv) + c * v * (vv - 3.0 * tt)
          + b * u * (uu - 3.0 * ww) + d * w * (ww - 3.0 * uu) - SIGMA_E)
    f8 = (c * t * (tt - 3.0 * vv) - a * v * (vv - 3.0 * tt)
          + d * u * (uu - 3.0 * ww) - b * w * (ww - 3.0 * uu) - SIGMA_F)
    return f1, f2, f3, f4, f5, f6, f7, f8


def human_heart_dipole_example_args():
    """The MINPACK-2 standard starting point of data set DHHD1."""
    return tuple(jnp.float32(x) for x in (0.299, 0.186, -0.0273, 0.0254, -0.474, 0.474, -0.0892, 0.0892))
