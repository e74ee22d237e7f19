"""The 1-D Bratu problem: the finite-difference residual of u'' + lam exp(u) = 0 on (0, 1).

Source: G. Bratu, "Sur les équations intégrales non linéaires", Bull. Soc. Math. France 42
(1914); the discretisation of the MINPACK-2 collection's solid fuel ignition problem
(B. M. Averick, R. G. Carter, J. J. Moré, G.-L. Xue, "The MINPACK-2 Test Problem Collection",
Argonne ANL/MCS-P153-0692, 1992), in one dimension: central second differences on n interior
points of a uniform grid, boundary values u(0) = u(1) = 0. Newton's method needs the residual's
Jacobian at every step; it is tridiagonal (3n - 2 non-zeros of n^2).
"""

import jax.numpy as jnp

LAM = 1.0  # below the critical value 3.51, where two solutions exist


def bratu_1d(u: "f32[2000]"):
    """Residual F(u)_i = (u_{i-1} - 2 u_i + u_{i+1}) / h^2 + LAM exp(u_i), u_0 = u_{n+1} = 0.

    Arguments:
        u: f32[n], the values at the interior grid points x_i = i h, h = 1 / (n + 1).

    Returns f32[n]. Source: Bratu 1914; MINPACK-2 solid fuel ignition (Averick et al. 1992).
    """
    h = 1.0 / (u.shape[0] + 1)
    padded = jnp.pad(u, 1)  # the boundary values
    laplacian = (padded[:-2] - 2.0 * padded[1:-1] + padded[2:]) / h ** 2
    return laplacian + LAM * jnp.exp(u)


def bratu_1d_example_args():
    """A smooth guess that meets the boundary conditions: u(x) = 0.1 sin(pi x) on 2000 points."""
    n = 2000
    x = jnp.arange(1, n + 1, dtype=jnp.float32) / (n + 1)
    return (0.1 * jnp.sin(jnp.pi * x),)
