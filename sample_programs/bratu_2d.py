"""The 2-D Bratu problem (solid fuel ignition): the five-point residual of Δu + lam exp(u) = 0.

Source: the solid fuel ignition problem of the MINPACK-2 collection (B. M. Averick,
R. G. Carter, J. J. Moré, G.-L. Xue, "The MINPACK-2 Test Problem Collection", Argonne
ANL/MCS-P153-0692, 1992): the unit square, u = 0 on its boundary, the five-point Laplacian on an
nx x ny grid of interior points, lam = 5 (solutions exist for lam up to about 6.81). Its Jacobian
has at most 5 non-zeros per row (5n - 4 sqrt(n) of n^2 for n unknowns on a square grid).
"""

import jax.numpy as jnp

LAM = 5.0  # MINPACK-2's value


def bratu_2d(u: "f32[40,40]"):
    """Residual F(u)_ij = (u_{i-1,j} + u_{i+1,j} + u_{i,j-1} + u_{i,j+1} - 4 u_ij) / h^2 + LAM exp(u_ij).

    Arguments:
        u: f32[nx, ny], the values at the interior grid points (i hx, j hy) (here nx = ny, hx = hy = h).

    Returns f32[nx, ny]. Source: MINPACK-2 solid fuel ignition (Averick et al. 1992).
    """
    h = 1.0 / (u.shape[0] + 1)
    p = jnp.pad(u, 1)  # the boundary values
    laplacian = (p[:-2, 1:-1] + p[2:, 1:-1] + p[1:-1, :-2] + p[1:-1, 2:] - 4.0 * u) / h ** 2
    return laplacian + LAM * jnp.exp(u)


def bratu_2d_example_args():
    """A tent-shaped guess that meets the boundary condition: u = 0.4 min(x, 1 - x) min(y, 1 - y), 40 x 40 grid."""
    n = 40
    x = jnp.arange(1, n + 1, dtype=jnp.float32) / (n + 1)
    d = jnp.minimum(x, 1.0 - x)
    return (0.4 * d[:, None] * d[None, :],)
