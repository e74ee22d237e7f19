"""Roe's approximate Riemann solver: the numerical flux of the 1D Euler equations.

Source: P. L. Roe, "Approximate Riemann solvers, parameter vectors, and difference
schemes", J. Comput. Phys. 43 (1981) 357-372; written here following E. F. Toro,
"Riemann Solvers and Numerical Methods for Fluid Dynamics", 3rd ed. (2009), sec. 11.2.
Benchmark task "RoeFlux_1d" of Lohoff & Neftci, "Optimizing Automatic Differentiation
with Deep Reinforcement Learning" (AlphaGrad), arXiv:2406.05027.
"""

import jax.numpy as jnp

GAMMA = 1.4


def roe_flux_1d(ul: "f32[]", ulu: "f32[]", ulE: "f32[]", ur: "f32[]", uru: "f32[]", urE: "f32[]"):
    """Roe flux across the interface between a left and a right state.

    Inputs (6 scalars, conserved variables of an ideal gas with gamma = 1.4):
        ul, ulu, ulE: left density rho, momentum rho*u and total energy E;
        ur, uru, urE: the same for the right state.

    Returns a tuple of 3 scalars, the mass, momentum and energy fluxes

        F = (F(U_L) + F(U_R)) / 2 - 1/2 * sum_i |lambda_i| alpha_i K_i

    with Roe-averaged velocity, enthalpy and sound speed (Toro eqs. 11.60-11.67):
    eigenvalues u-a, u, u+a; eigenvectors K_1 = (1, u-a, H-ua), K_2 = (1, u, u^2/2),
    K_3 = (1, u+a, H+ua); wave strengths alpha_{1,3} = (dp -+ rho a du) / (2 a^2),
    alpha_2 = drho - dp / a^2.

    Source: Roe 1981; Toro 2009, sec. 11.2; AlphaGrad task RoeFlux_1d (arXiv:2406.05027).
    """
    u_l = ulu / ul
    u_r = uru / ur
    p_l = (GAMMA - 1.0) * (ulE - 0.5 * ulu * u_l)
    p_r = (GAMMA - 1.0) * (urE - 0.5 * uru * u_r)
    h_l = (ulE + p_l) / ul
    h_r = (urE + p_r) / ur

    # Roe averages, weighted by the square roots of the densities.
    s_l = jnp.sqrt(ul)
    s_r = jnp.sqrt(ur)
    w = s_l + s_r
    rho = s_l * s_r
    u = (s_l * u_l + s_r * u_r) / w
    h = (s_l * h_l + s_r * h_r) / w
    a2 = (GAMMA - 1.0) * (h - 0.5 * u * u)
    a = jnp.sqrt(a2)

    # Wave strengths from the jumps in density, velocity and pressure.
    d_rho = ur - ul
    d_u = u_r - u_l
    d_p = p_r - p_l
    alpha1 = (d_p - rho * a * d_u) / (2.0 * a2)
    alpha2 = d_rho - d_p / a2
    alpha3 = (d_p + rho * a * d_u) / (2.0 * a2)

    # Upwind dissipation: |lambda_i| alpha_i.
    w1 = jnp.abs(u - a) * alpha1
    w2 = jnp.abs(u) * alpha2
    w3 = jnp.abs(u + a) * alpha3

    # Central part: the mean of the physical fluxes F(U) = (rho u, rho u^2 + p, u (E + p)).
    f_mass = 0.5 * (ulu + uru)
    f_mom = 0.5 * (ulu * u_l + p_l + uru * u_r + p_r)
    f_energy = 0.5 * (u_l * (ulE + p_l) + u_r * (urE + p_r))

    mass = f_mass - 0.5 * (w1 + w2 + w3)
    momentum = f_mom - 0.5 * (w1 * (u - a) + w2 * u + w3 * (u + a))
    energy = f_energy - 0.5 * (w1 * (h - u * a) + w2 * 0.5 * u * u + w3 * (h + u * a))
    return mass, momentum, energy


def roe_flux_1d_example_args():
    """A subsonic left-to-right flow with a density and pressure jump (a mild Sod-like state)."""
    f = jnp.float32
    # left: rho = 1.0, u = 0.3, p = 1.0; right: rho = 0.5, u = 0.2, p = 0.4
    ul, ur = f(1.0), f(0.5)
    ulu, uru = f(1.0 * 0.3), f(0.5 * 0.2)
    ulE = f(1.0 / (GAMMA - 1.0) + 0.5 * 1.0 * 0.3**2)
    urE = f(0.4 / (GAMMA - 1.0) + 0.5 * 0.5 * 0.2**2)
    return ul, ulu, ulE, ur, uru, urE
