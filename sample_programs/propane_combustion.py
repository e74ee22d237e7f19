"""The MINPACK-2 combustion of propane problem (full formulation): 11 equations, 11 unknowns.

Source: B. M. Averick, R. G. Carter, J. J. More & G.-L. Xue, "The MINPACK-2 test problem
collection", Argonne preprint MCS-P153-0692 (1992), problem "combustion of propane: full
formulation" (dcpffj); the chemistry is K. Meintjes & A. P. Morgan, "Chemical equilibrium
systems as numerical test problems", ACM TOMS 16 (1990) 143-151. Benchmark task
"PropaneCombustion" of Lohoff & Neftci (AlphaGrad), arXiv:2406.05027.
"""

import jax.numpy as jnp

P = 40.0   # pressure [atm]
R = 10.0   # air-to-fuel ratio parameter
# Equilibrium constants K5..K10 of the six dissociation reactions.
K5, K6, K7, K8, K9, K10 = 1.930e-1, 2.597e-3, 3.448e-3, 1.799e-5, 2.155e-4, 3.846e-5


def propane_combustion(x1: "f32[]", x2: "f32[]", x3: "f32[]", x4: "f32[]", x5: "f32[]", x6: "f32[]",
                       x7: "f32[]", x8: "f32[]", x9: "f32[]", x10: "f32[]", x11: "f32[]"):
    """Residual of the propane-in-air equilibrium equations: 11 scalars -> 11 scalars.

    x1..x10 are the mole numbers of the ten product species and x11 their total. With
    p = 40 and R = 10 the residuals are four element balances, six equilibrium relations
    and the total-moles identity:

        f1  = x1 + x4 - 3
        f2  = 2 x1 + x2 + x4 + x7 + x8 + x9 + 2 x10 - R
        f3  = 2 x2 + 2 x5 + x6 + x7 - 8
        f4  = 2 x3 + x9 - 4 R
        f5  = K5 x2 x4 - x1 x5
        f6  = K6 sqrt(x2 x4) - sqrt(x1) x6 sqrt(p / x11)
        f7  = K7 sqrt(x1 x2) - sqrt(x4) x7 sqrt(p / x11)
        f8  = K8 x1 - x4 x8 (p / x11)
        f9  = K9 x1 sqrt(x3) - x4 x9 sqrt(p / x11)
        f10 = K10 x1^2 - x4^2 x10 (p / x11)
        f11 = x11 - (x1 + ... + x10)

    Requires x1..x4 > 0 and x11 > 0. Returns the tuple (f1, ..., f11).

    Source: MINPACK-2 (Averick et al. 1992), dcpffj; Meintjes & Morgan 1990; AlphaGrad
    task PropaneCombustion (arXiv:2406.05027).
    """
    pdx = P / x11
    sqpdx = jnp.sqrt(pdx)
    f1 = x1 + x4 - 3.0
    f2 = 2.0 * x1 + x2 + x4 + x7 + x8 + x9 + 2.0 * x10 - R
    f3 = 2.0 * x2 + 2.0 * x5 + x6 + x7 - 8.0
    f4 = 2.0 * x3 + x9 - 4.0 * R
    f5 = K5 * x2 * x4 - x1 * x5
    f6 = K6 * jnp.sqrt(x2 * x4) - jnp.sqrt(x1) * x6 * sqpdx
    f7 = K7 * jnp.sqrt(x1 * x2) - jnp.sqrt(x4) * x7 * sqpdx
    f8 = K8 * x1 - x4 * x8 * pdx
    f9 = K9 * x1 * jnp.sqrt(x3) - x4 * x9 * sqpdx
    f10 = K10 * x1 * x1 - x4 * x4 * x10 * pdx
    f11 = x11 - (x1 + x2 + x3 + x4 + x5 + x6 + x7 + x8 + x9 + x10)
    return f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11


def propane_combustion_example_args():
    """The MINPACK-2 standard starting point."""
    sqrtp = P ** 0.5
    x0 = (5.0, 2.5, 5.0, 0.1, 0.05 * K5, K6 / sqrtp, 50.0 * K7 / sqrtp, 1e3 * K8 / P,
          500.0 * K9 / sqrtp, 5e4 * K10 / P, 20.0)
    return tuple(jnp.float32(x) for x in x0)
