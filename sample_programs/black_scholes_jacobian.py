"""First-order Black-Scholes greeks of a European call, in closed form.

Source: F. Black & M. Scholes, "The Pricing of Options and Corporate Liabilities", J. Polit.
Econ. 81 (1973) 637-654; closed-form greeks as in J. C. Hull, "Options, Futures, and Other
Derivatives", 10th ed. (2018), ch. 15 and 19. Benchmark task "BlackScholes_Jacobian" of
Lohoff & Neftci (AlphaGrad), arXiv:2406.05027: the outputs are the gradient of the option
price, so the Jacobian of this function is the matrix of second-order greeks.
"""

import jax.numpy as jnp
from jax.scipy.stats import norm


def black_scholes_price(S, K, r, sigma, T):
    """Black-Scholes price of a European call: S N(d1) - K exp(-rT) N(d2).

    Source: Black & Scholes 1973.
    """
    sqrt_t = jnp.sqrt(T)
    d1 = (jnp.log(S / K) + (r + 0.5 * sigma * sigma) * T) / (sigma * sqrt_t)
    d2 = d1 - sigma * sqrt_t
    return S * norm.cdf(d1) - K * jnp.exp(-r * T) * norm.cdf(d2)


def black_scholes_jacobian(S: "f32[]", K: "f32[]", r: "f32[]", sigma: "f32[]", T: "f32[]"):
    """The five first derivatives of the call price: 5 scalars -> 5 scalars.

    Inputs: spot S, strike K, risk-free rate r, volatility sigma, time to maturity T.
    With d1 = (ln(S/K) + (r + sigma^2/2) T) / (sigma sqrt(T)) and d2 = d1 - sigma sqrt(T),
    returns the tuple

        dC/dS     = N(d1)                                       (delta)
        dC/dK     = -exp(-rT) N(d2)                             (dual delta)
        dC/dr     = K T exp(-rT) N(d2)                          (rho)
        dC/dsigma = S phi(d1) sqrt(T)                           (vega)
        dC/dT     = S phi(d1) sigma / (2 sqrt(T)) + r K exp(-rT) N(d2)   (minus theta)

    where N and phi are the standard normal cdf and pdf.

    Source: Black & Scholes 1973; Hull 2018, ch. 19; AlphaGrad task BlackScholes_Jacobian
    (arXiv:2406.05027).
    """
    sqrt_t = jnp.sqrt(T)
    d1 = (jnp.log(S / K) + (r + 0.5 * sigma * sigma) * T) / (sigma * sqrt_t)
    d2 = d1 - sigma * sqrt_t
    discount = jnp.exp(-r * T)
    n_d1 = norm.cdf(d1)
    n_d2 = norm.cdf(d2)
    pdf_d1 = norm.pdf(d1)
    delta = n_d1
    dual_delta = -discount * n_d2
    rho = K * T * discount * n_d2
    vega = S * pdf_d1 * sqrt_t
    d_maturity = S * pdf_d1 * sigma / (2.0 * sqrt_t) + r * K * discount * n_d2
    return delta, dual_delta, rho, vega, d_maturity


def black_scholes_jacobian_example_args():
    """A slightly in-the-money one-year call: S=105, K=100, r=5%, sigma=20%, T=1."""
    return tuple(jnp.float32(v) for v in (105.0, 100.0, 0.05, 0.2, 1.0))
