"""Roe's approximate Riemann solver for the 3D Euler equations: the flux normal to an x-face.

Source: P. L. Roe, J. Comput. Phys. 43 (1981) 357-372; the 3D eigenstructure follows
E. F. Toro, "Riemann Solvers and Numerical Methods for Fluid Dynamics", 3rd ed. (2009),
sec. 11.2.2. Benchmark task "RoeFlux_3d" of Lohoff & Neftci (AlphaGrad), arXiv:2406.05027.
"""

import jax.numpy as jnp
import numpy as np

GAMMA = 1.4


def _euler_flux_x(rho, mom, energy):
    """Physical x-flux (rho u, rho u u + p, rho u v, rho u w, u (E + p)) and the pressure."""
    vel = mom / rho
    p = (GAMMA - 1.0) * (energy - 0.5 * jnp.sum(mom * vel, keepdims=True))
    u = vel[0:1]
    flux = jnp.concatenate([mom[0:1], mom * u + jnp.concatenate([p, jnp.zeros((2,), p.dtype)]),
                            u * (energy + p)])
    return flux, vel, p


def roe_flux_3d(ul: "f32[1]", ulv: "f32[3]", ulE: "f32[1]", ur: "f32[1]", urv: "f32[3]", urE: "f32[1]"):
    """Roe flux through a face with normal e_x.

    Inputs, for the left (``l``) and right (``r``) state of an ideal gas, gamma = 1.4:
        ul, ur: density rho, shape (1,);
        ulv, urv: momentum (rho u, rho v, rho w), shape (3,);
        ulE, urE: total energy E, shape (1,).

    Returns f32[5], the fluxes of mass, x-, y-, z-momentum and energy:
    F = (F(U_L) + F(U_R)) / 2 - 1/2 * sum_i |lambda_i| alpha_i K_i with Roe averages
    (u, v, w, H, a), eigenvalues (u-a, u, u, u, u+a), eigenvectors
    K_1 = (1, u-a, v, w, H-ua), K_2 = (1, u, v, w, |V|^2/2), K_3 = (0, 0, 1, 0, v),
    K_4 = (0, 0, 0, 1, w), K_5 = (1, u+a, v, w, H+ua) and strengths
    alpha_{1,5} = (dp -+ rho a du) / (2 a^2), alpha_2 = drho - dp / a^2,
    alpha_3 = rho dv, alpha_4 = rho dw.

    Source: Roe 1981; Toro 2009, sec. 11.2.2; AlphaGrad task RoeFlux_3d (arXiv:2406.05027).
    """
    f_l, vel_l, p_l = _euler_flux_x(ul, ulv, ulE)
    f_r, vel_r, p_r = _euler_flux_x(ur, urv, urE)
    h_l = (ulE + p_l) / ul
    h_r = (urE + p_r) / ur

    s_l = jnp.sqrt(ul)
    s_r = jnp.sqrt(ur)
    w = s_l + s_r
    rho = s_l * s_r
    vel = (s_l * vel_l + s_r * vel_r) / w
    h = (s_l * h_l + s_r * h_r) / w
    q2 = jnp.sum(vel * vel, keepdims=True)
    a2 = (GAMMA - 1.0) * (h - 0.5 * q2)
    a = jnp.sqrt(a2)
    u, v, wz = vel[0:1], vel[1:2], vel[2:3]

    d_rho = ur - ul
    d_vel = vel_r - vel_l
    d_p = p_r - p_l
    alpha1 = (d_p - rho * a * d_vel[0:1]) / (2.0 * a2)
    alpha2 = d_rho - d_p / a2
    alpha3 = rho * d_vel[1:2]
    alpha4 = rho * d_vel[2:3]
    alpha5 = (d_p + rho * a * d_vel[0:1]) / (2.0 * a2)

    one = jnp.ones_like(u)
    zero = jnp.zeros_like(u)
    k1 = jnp.concatenate([one, u - a, v, wz, h - u * a])
    k2 = jnp.concatenate([one, u, v, wz, 0.5 * q2])
    k3 = jnp.concatenate([zero, zero, one, zero, v])
    k4 = jnp.concatenate([zero, zero, zero, one, wz])
    k5 = jnp.concatenate([one, u + a, v, wz, h + u * a])

    dissipation = (jnp.abs(u - a) * alpha1 * k1 + jnp.abs(u) * (alpha2 * k2 + alpha3 * k3 + alpha4 * k4)
                   + jnp.abs(u + a) * alpha5 * k5)
    return 0.5 * (f_l + f_r) - 0.5 * dissipation


def roe_flux_3d_example_args():
    """Two subsonic states with jumps in density, every velocity component and pressure."""

    def state(rho, vel, p):
        vel = np.array(vel)
        energy = p / (GAMMA - 1.0) + 0.5 * rho * vel @ vel
        return tuple(jnp.asarray(a, jnp.float32) for a in ([rho], rho * vel, [energy]))

    return state(1.0, [0.3, 0.1, -0.05], 1.0) + state(0.6, [0.2, -0.1, 0.08], 0.5)
