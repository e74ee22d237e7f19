"""The bundled sample programs: they load, run, differentiate consistently and say where they come from.

Each sample ``sample_programs/FILE.py`` defines a function ``FN`` and a companion
``FN_example_args()``; ``jaxtool show sample_programs/FILE.py:FN`` relies on both.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

SAMPLES_DIR = Path(__file__).resolve().parent.parent / "sample_programs"

# file stem -> function name
SAMPLES = {
    "elementwise": "elementwise",
    "mlp": "mlp_loss",
    "attention": "attention",
    "branches": "piecewise",
    "scan_rnn": "rnn",
    "pytree_params": "loss",
    "roe_flux_1d": "roe_flux_1d",
    "roe_flux_3d": "roe_flux_3d",
    "robot_arm_6dof": "robot_arm_6dof",
    "human_heart_dipole": "human_heart_dipole",
    "propane_combustion": "propane_combustion",
    "black_scholes_jacobian": "black_scholes_jacobian",
    "perceptron": "perceptron",
    "encoder": "encoder",
    "bratu_1d": "bratu_1d",
    "bratu_2d": "bratu_2d",
}

# AlphaGrad benchmark tasks -> a phrase their module docstring must cite for the mathematics.
BENCHMARK_SOURCES = {
    "roe_flux_1d": "Roe",
    "roe_flux_3d": "Roe",
    "robot_arm_6dof": "Denavit",
    "human_heart_dipole": "MINPACK-2",
    "propane_combustion": "MINPACK-2",
    "black_scholes_jacobian": "Black & M. Scholes",
    "perceptron": "Layer",
    "encoder": "Attention Is All You Need",
}

# (number of inputs, number of outputs) of the scalar benchmark tasks, as in the AlphaGrad paper.
SCALAR_TASK_SIZES = {
    "roe_flux_1d": (6, 3),
    "robot_arm_6dof": (6, 6),
    "human_heart_dipole": (8, 8),
    "propane_combustion": (11, 11),
    "black_scholes_jacobian": (5, 5),
}

_DTYPES = {"f16": jnp.float16, "bf16": jnp.bfloat16, "f32": jnp.float32, "f64": jnp.float64,
           "i32": jnp.int32, "i64": jnp.int64, "bool": jnp.bool_}

# Skip XLA's backend optimisation passes: a quarter less compile time for these small programs,
# which run once; results are the same up to float rounding.
_FAST_COMPILE = {"xla_backend_optimization_level": 0}


def jit(fn):
    """``jax.jit`` with the fast-compile options."""
    return jax.jit(fn, compiler_options=_FAST_COMPILE)


_modules: dict[str, object] = {}


def load(stem):
    """Import ``sample_programs/<stem>.py`` under a private module name (once per session)."""
    if stem not in _modules:
        spec = importlib.util.spec_from_file_location(f"_jaxtool_sample_{stem}", SAMPLES_DIR / f"{stem}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _modules[stem] = module
    return _modules[stem]


def target(stem):
    """The sample's function and its example arguments."""
    module = load(stem)
    name = SAMPLES[stem]
    return getattr(module, name), getattr(module, f"{name}_example_args")()


def float_argnums(args):
    """Indices of the arguments whose leaves are all floating point."""
    return tuple(i for i, a in enumerate(args)
                 if all(jnp.issubdtype(jnp.result_type(leaf), jnp.floating) for leaf in jax.tree.leaves(a)))


def parse_spec(spec):
    """``"f32[3,4]"`` -> (dtype, shape)."""
    m = re.fullmatch(r"([a-z0-9]+)\[([0-9, ]*)\]", spec)
    assert m, f"malformed spec {spec!r}"
    dims = tuple(int(d) for d in m.group(2).split(",") if d.strip())
    return _DTYPES[m.group(1)], dims


def test_every_sample_file_is_covered():
    on_disk = {p.stem for p in SAMPLES_DIR.glob("*.py")}
    assert on_disk == set(SAMPLES)


@functools.cache
def evaluate(stem):
    """Output, reverse-mode and forward-mode Jacobians of a sample at its example arguments.

    The float arguments are flattened into one vector ``v`` and the outputs into one
    vector, so each Jacobian is a single (outputs x inputs) matrix; all three are
    computed under one ``jax.jit`` (one compilation per sample keeps the suite fast).
    Returns numpy arrays ``(out, jac_rev, jac_fwd)`` and the size of argument 0 in ``v``.
    """
    fn, args = target(stem)
    argnums = float_argnums(args)
    assert argnums and argnums[0] == 0, f"{stem}: argument 0 must be floating point"
    v, unravel = ravel_pytree([args[i] for i in argnums])

    def flat_fn(v):
        full = list(args)
        for i, a in zip(argnums, unravel(v)):
            full[i] = a
        return ravel_pytree(fn(*full))[0]

    both = jit(lambda v: (flat_fn(v), jax.jacrev(flat_fn)(v), jax.jacfwd(flat_fn)(v)))
    out, rev, fwd = both(v)
    return np.asarray(out), np.asarray(rev), np.asarray(fwd), ravel_pytree(args[0])[0].size


@pytest.mark.parametrize("stem", SAMPLES)
def test_example_args_are_deterministic_and_outputs_finite(stem):
    _, args = target(stem)
    again = getattr(load(stem), f"{SAMPLES[stem]}_example_args")()
    assert jax.tree.structure(args) == jax.tree.structure(again)
    for a, b in zip(jax.tree.leaves(args), jax.tree.leaves(again)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    out = evaluate(stem)[0]
    assert out.size > 0
    assert np.all(np.isfinite(out)), f"{stem} produced a non-finite output"


@pytest.mark.parametrize("stem", SAMPLES)
def test_jacrev_agrees_with_jacfwd(stem):
    out, rev, fwd, arg0_size = evaluate(stem)
    assert rev.shape == fwd.shape == (out.size, rev.shape[1])
    assert np.all(np.isfinite(rev)) and np.all(np.isfinite(fwd))
    np.testing.assert_allclose(rev, fwd, rtol=2e-4, atol=1e-5)
    # The outputs really depend on argument 0, the default differentiation target.
    assert np.any(fwd[:, :arg0_size] != 0)


@pytest.mark.parametrize("stem", SAMPLES)
def test_spec_annotations_match_example_args(stem):
    fn, args = target(stem)
    params = list(inspect.signature(fn).parameters.values())
    assert len(params) == len(args)
    annotated = [p for p in params if p.annotation is not inspect.Parameter.empty]
    if not annotated:  # pytree arguments: the companion alone describes the inputs
        assert any(not isinstance(a, jax.Array) for a in args), f"{stem} takes plain arrays but has no specs"
        return
    assert len(annotated) == len(params), f"{stem}: annotate every argument or none"
    for p, a in zip(params, args):
        dtype, shape = parse_spec(p.annotation)
        assert jnp.shape(a) == shape, f"{stem}:{p.name}"
        assert jnp.result_type(a) == dtype, f"{stem}:{p.name}"


@pytest.mark.parametrize("stem", SAMPLES)
def test_docstrings_name_their_source(stem):
    module = load(stem)
    fn = getattr(module, SAMPLES[stem])
    assert "Source:" in (module.__doc__ or "")
    assert "Source:" in (fn.__doc__ or "")
    if stem in BENCHMARK_SOURCES:
        assert "arXiv:2406.05027" in module.__doc__
        assert BENCHMARK_SOURCES[stem] in module.__doc__


@pytest.mark.parametrize("stem", SCALAR_TASK_SIZES)
def test_scalar_tasks_have_the_paper_sizes(stem):
    fn, args = target(stem)
    n_in, n_out = SCALAR_TASK_SIZES[stem]
    assert len(args) == n_in and all(jnp.shape(a) == () for a in args)
    out = fn(*args)
    assert isinstance(out, tuple) and len(out) == n_out and all(jnp.shape(o) == () for o in out)


def _euler_flux(rho, mom, energy, gamma=1.4):
    """Physical x-flux of the Euler equations in numpy, written independently of the samples."""
    rho, energy = float(np.squeeze(rho)), float(np.squeeze(energy))
    vel = np.atleast_1d(mom) / rho
    p = (gamma - 1.0) * (energy - 0.5 * rho * vel @ vel)
    u = vel[0]
    return np.concatenate([[rho * u], rho * u * vel + p * np.eye(vel.size)[0], [u * (energy + p)]])


def test_roe_flux_reduces_to_the_physical_flux_for_equal_states():
    fn1, args1 = target("roe_flux_1d")
    left1 = args1[:3]
    np.testing.assert_allclose(jnp.stack(jit(fn1)(*left1, *left1)), _euler_flux(*np.asarray(left1)),
                               rtol=1e-5)
    fn3, args3 = target("roe_flux_3d")
    left3 = args3[:3]
    np.testing.assert_allclose(jit(fn3)(*left3, *left3),
                               _euler_flux(*(np.asarray(a, np.float64) for a in left3)), rtol=1e-5)


def test_roe_flux_3d_matches_1d_without_transverse_motion():
    fn1, (ul, ulu, ulE, ur, uru, urE) = target("roe_flux_1d")
    fn1 = jit(fn1)
    fn3 = jit(load("roe_flux_3d").roe_flux_3d)
    zero = jnp.zeros(2, jnp.float32)
    f3 = fn3(ul[None], jnp.concatenate([ulu[None], zero]), ulE[None],
             ur[None], jnp.concatenate([uru[None], zero]), urE[None])
    mass, mom, energy = fn1(ul, ulu, ulE, ur, uru, urE)
    np.testing.assert_allclose(f3, [mass, mom, 0.0, 0.0, energy], rtol=1e-5, atol=1e-7)


def test_black_scholes_greeks_are_the_gradient_of_the_price():
    module = load("black_scholes_jacobian")
    args = module.black_scholes_jacobian_example_args()
    analytic = module.black_scholes_jacobian(*args)
    autodiff = jit(jax.grad(module.black_scholes_price, argnums=(0, 1, 2, 3, 4)))(*args)
    np.testing.assert_allclose(analytic, autodiff, rtol=1e-5)


def test_robot_arm_kinematics():
    fn, args = target("robot_arm_6dof")
    fn = jit(fn)
    zero = jnp.float32(0.0)
    # PUMA 560 in the zero pose (Corke, "Robotics, Vision and Control").
    np.testing.assert_allclose(fn(*[zero] * 6)[:3], [0.4521, -0.15005, 0.4318], atol=1e-6)
    pose = fn(*args)
    x, y, z = pose[:3]
    # Turning the last joint moves no point on its axis: the wrist centre stays put,
    # only the orientation changes.
    moved = fn(*args[:5], args[5] + 1.0)
    np.testing.assert_allclose(moved[:3], (x, y, z), atol=1e-6)
    assert not np.allclose(moved[3:], pose[3:], atol=1e-3)
    # Turning the base joint rotates about the base z axis.
    xb, yb, zb, *_ = fn(args[0] + 0.5, *args[1:])
    np.testing.assert_allclose([np.hypot(xb, yb), zb], [np.hypot(x, y), z], rtol=1e-5)


def test_heart_dipole_jacobian_rows_match_minpack_closed_form():
    fn, args = target("human_heart_dipole")
    a, b, c, d, t, u, v, w = args
    jac = np.asarray(jit(jax.jacfwd(lambda *xs: jnp.stack(fn(*xs)), argnums=tuple(range(8))))(*args)).T
    np.testing.assert_allclose(jac[0], [1, 1, 0, 0, 0, 0, 0, 0])
    np.testing.assert_allclose(jac[2], [t, u, -v, -w, a, b, -c, -d], rtol=1e-6)
    np.testing.assert_allclose(jac[3], [v, w, t, u, c, d, a, b], rtol=1e-6)


def test_propane_residual_structure():
    fn, args = target("propane_combustion")
    jac = np.asarray(jit(jax.jacfwd(lambda *xs: jnp.stack(fn(*xs)), argnums=tuple(range(11))))(*args)).T
    np.testing.assert_allclose(jac[10], [-1.0] * 10 + [1.0])  # total moles
    np.testing.assert_allclose(jac[0], [1, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0])  # carbon balance
    x4, x8, x11 = args[3], args[7], args[10]
    np.testing.assert_allclose(jac[7, 10], x4 * x8 * 40.0 / x11**2, rtol=1e-5)  # d f8 / d x11
