"""The vertex-elimination engine against jax.jacrev / jax.jacfwd on real programs."""

from __future__ import annotations

import collections
import dataclasses
import functools
import importlib.util
import itertools
import math
import pathlib
import random
import re
import sys
import warnings

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax import lax

import jaxtool
from jaxtool import partials, sharing
from jaxtool.elimination import blocks, run
from jaxtool.errors import OpByOpWarning, OrderError, UnsupportedError, UsageError
from jaxtool.jacobian import trace_problem
from jaxtool.orders import resolve_order
from jaxtool.partials import Linear, Sparse
from jaxtool.printing import subjaxprs

SAMPLES = pathlib.Path(__file__).resolve().parent.parent / "sample_programs"
SAMPLE_NAMES = sorted(p.stem for p in SAMPLES.glob("*.py"))
FUNCTION_NAMES = {"mlp": "mlp_loss", "branches": "piecewise", "scan_rnn": "rnn", "pytree_params": "loss"}
#: (major, minor) of the JAX under test, for the few tests of what changed between JAX releases
JAX_VERSION = tuple(int(part) for part in jax.__version__.split(".")[:2])


def load_sample(stem):
    spec = importlib.util.spec_from_file_location(f"sample_{stem}", SAMPLES / f"{stem}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    name = FUNCTION_NAMES.get(stem, stem)
    return getattr(module, name), tuple(getattr(module, f"{name}_example_args")())


def float_argnums(args):
    return tuple(i for i, a in enumerate(args)
                 if all(jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating) for x in jax.tree_util.tree_leaves(a)))


def assert_same_jacobian(got, want, rtol, atol):
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        assert g.shape == w.shape and g.dtype == w.dtype, (g.shape, w.shape, g.dtype, w.dtype)
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=rtol, atol=atol)


def random_orders(problem, count, seed):
    rng = random.Random(seed)
    orders = []
    for _ in range(count):
        order = list(problem.eliminable)
        rng.shuffle(order)
        orders.append(order)
    return orders


def assert_orders_match(fun, args, argnums, want, orders, rtol, atol, staged=False):
    """Eliminate ``fun``'s problem in each of ``orders(problem)`` and compare with ``want``.

    Eagerly by default: one traced problem, no compilation per order, and the operations of
    scalar programs are compiled once for all tests. ``staged`` stages each order with
    ``jax.jit``, as ``jaxtool.jacve`` does: one compilation per order, where eager elimination
    compiles every operation of a new shape (on array programs, up to ten times slower: an RK4
    step of Lorenz-96 on 25 points in fwd order, 5.3 s eager, 0.5 s staged).
    """
    problem = trace_problem(fun, *args, argnums=argnums)
    want_leaves = jax.tree_util.tree_leaves(want)
    for order in orders(problem):
        if staged:
            def eliminate(*xs, order=order):
                copy = trace_problem(fun, *xs, argnums=argnums)
                run(copy, resolve_order(order, copy))
                return blocks(copy)

            got = jax.jit(eliminate)(*args)
        else:
            copy = problem.copy()
            run(copy, resolve_order(order, copy))
            got = blocks(copy)
        got = [block for row in got for block in row]
        assert len(got) == len(want_leaves)
        for g, w in zip(got, want_leaves):
            assert g.shape == w.shape and g.dtype == w.dtype, (order, g.shape, w.shape, g.dtype, w.dtype)
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=rtol, atol=atol, err_msg=str(order))


def is_array_program(args) -> bool:
    """Whether the arguments have more than 64 elements in all: such programs are checked ``staged``
    (see :func:`assert_orders_match`; the encoder's 16 arguments of 154 elements: 22 s staged, 49 s
    eager, for its eight orders; scan_rnn's 47 elements: 2.0 s staged, 0.3 s eager)."""
    return sum(np.size(leaf) for leaf in jax.tree_util.tree_leaves(args)) > 64


@pytest.mark.parametrize("stem", SAMPLE_NAMES)
def test_sample_programs_all_orders_match_jacrev(stem):
    fun, args = load_sample(stem)
    argnums = float_argnums(args)
    want = jax.jacrev(fun, argnums=argnums)(*args)
    assert_orders_match(fun, args, argnums, want,
                        lambda p: ["fwd", "rev", "markowitz"] + random_orders(p, 5, seed=len(stem)),
                        rtol=1e-4, atol=1e-5, staged=is_array_program(args))
    # and once through the staged public API, at the point and over a batch of points (the written-out
    # small sums and products of jaxtool.point_forms are library calls there)
    jacobian = jaxtool.jacve(fun, order="markowitz", argnums=argnums)
    assert_same_jacobian(jacobian(*args), want, rtol=1e-4, atol=1e-5)
    scales = jnp.array([0.9, 1.0, 1.1], jnp.float32)
    batch = tuple(jax.tree_util.tree_map(lambda x: scales.reshape((3,) + (1,) * jnp.ndim(x)).astype(x.dtype) * x, a)
                  if i in argnums else a for i, a in enumerate(args))
    in_axes = tuple(0 if i in argnums else None for i in range(len(args)))
    assert_same_jacobian(jax.jit(jax.vmap(jacobian, in_axes))(*batch),
                         jax.vmap(jax.jacrev(fun, argnums=argnums), in_axes)(*batch), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("stem", ["roe_flux_1d", "robot_arm_6dof", "perceptron", "branches", "scan_rnn"])
def test_sample_programs_x64(stem):
    with jax.enable_x64(True):
        fun, args = load_sample(stem)
        args = jax.tree_util.tree_map(
            lambda x: jnp.asarray(x, jnp.float64) if jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating) else x, args)
        argnums = float_argnums(args)
        want = jax.jacrev(fun, argnums=argnums)(*args)
        assert_orders_match(fun, args, argnums, want,
                            lambda p: ["fwd", "rev", "markowitz"] + random_orders(p, 2, seed=1),
                            rtol=1e-10, atol=1e-10, staged=is_array_program(args))


# --- the classes of programs where graphax is silently wrong or crashes (shared/reference/anchors.md)

X = jnp.linspace(0.1, 1.2, 6)
M = jnp.linspace(-1.0, 1.3, 12).reshape(3, 4)
NUMPY_CONSTANT = np.arange(6.0, dtype=np.float32) - 2.0


def _custom_vjp_sin(x):
    @jax.custom_vjp
    def g(x):
        return jnp.sin(x)

    g.defvjp(lambda x: (jnp.sin(x), x), lambda r, c: (c * jnp.cos(r),))
    return g(x) * x


ANCHOR_CASES = {
    "x*x": (lambda x: x * x, (X,)),
    "x+x": (lambda x: x + x, (X,)),
    "outer(x,x)": (lambda x: jnp.outer(x, x), (X,)),
    "x@x.T": (lambda m: m @ m.T, (M,)),
    "numpy constant": (lambda x: NUMPY_CONSTANT * x + np.float32(2.0), (X,)),
    "python float input": (lambda x: x * 2.0 + jnp.sin(x), (1.5,)),
    "numpy input": (lambda x: jnp.exp(x) * x, (np.linspace(0, 1, 4, dtype=np.float32),)),
    "output is input": (lambda x: (x, jnp.sin(x)), (X,)),
    "output read later": (lambda x: (jnp.sin(x), jnp.sin(x) * 2), (X,)),
    "max ties": (lambda x: jnp.maximum(x, jnp.array([0.5, 1.0, 0.2])), (jnp.array([0.5, 1.0, 0.3]),)),
    "min ties": (lambda x: jnp.minimum(x, x[::-1]), (jnp.array([0.5, 1.0, 0.5]),)),
    "reduce_max ties": (lambda x: jnp.max(x), (jnp.array([1.0, 3.0, 3.0]),)),
    "jnp.where": (lambda x: jnp.where(x > 0.5, x ** 2, jnp.cos(x)), (X,)),
    "clip": (lambda x: jnp.clip(x, 0.3, 0.9), (X,)),
    "linalg.norm": (lambda x: jnp.linalg.norm(x), (X,)),
    "cumsum": (lambda x: jnp.cumsum(x), (X,)),
    "cumsum reverse": (lambda m: lax.cumsum(m, axis=1, reverse=True), (M,)),
    # of 5 elements: jax.jit(jax.jacrev(...)) gives all ones on jax 0.10.2 (XLA:CPU); eager jacrev is right
    "slice of a reverse cumsum": (lambda x: lax.cumsum(x, reverse=True)[2:3], (X[:5],)),
    "element of a cumsum": (lambda x: jnp.cumsum(x)[2], (X[:5],)),  # jit(jacrev): all ones, as above
    "cumprod": (lambda m: jnp.cumprod(m, axis=0), (M,)),
    "cummax": (lambda m: lax.cummax(m, axis=1), (M,)),
    "pad": (lambda x: jnp.pad(x, (2, 1)), (X,)),
    "relu": (lambda x: jax.nn.relu(x - 0.5), (X,)),
    "logaddexp": (lambda x: jnp.logaddexp(x, 0.3), (X,)),
    "softplus/silu/gelu": (lambda x: jax.nn.softplus(x) + jax.nn.silu(x) * jax.nn.gelu(x), (X,)),
    "softmax": (lambda m: jax.nn.softmax(m, axis=-1), (M,)),
    "log_softmax": (lambda m: jax.nn.log_softmax(m, axis=0), (M,)),
    "logsumexp": (lambda m: jax.scipy.special.logsumexp(m, axis=1), (M,)),
    "custom_vjp": (_custom_vjp_sin, (X,)),
    "select_n": (lambda x: lax.select_n(x > 0.6, x, jnp.sin(x)), (X,)),
    "split": (lambda x: jnp.split(jnp.sin(x), 3), (X,)),
    "squeeze of expanded": (lambda x: jnp.squeeze(x[None, :, None]) * 2, (X,)),
    "static indexing": (lambda x: x[2] * x[1:4], (X,)),
    "rev": (lambda x: x[::-1] * x, (X,)),
    "gather": (lambda x: x[jnp.array([0, 2, 2, 5])], (X,)),
    "gather fill (NaN out of bounds)": (lambda x: x.at[jnp.array([0, 7, 2])].get(mode="fill", fill_value=jnp.nan),
                                        (X,)),
    "pad with a traced value": (lambda x: lax.pad(x, x[1] * 2, [(1, 2, 1)]), (X,)),
    "scatter-add": (lambda x: jnp.zeros(4).at[jnp.array([0, 2, 2])].add(x[:3] ** 2), (X,)),
    "scatter": (lambda x: x.at[jnp.array([0, 2])].set(x[3:5] ** 2), (X,)),
    "dynamic_slice": (lambda x: lax.dynamic_slice(x, (2,), (3,)) * x[0], (X,)),
    "dynamic_update_slice": (lambda x: lax.dynamic_update_slice(x, x[:2] * 3, (3,)), (X,)),
    "scan": (lambda x: lax.scan(lambda c, a: (c * a + jnp.sin(c), c), 1.0, x), (X,)),
    "while": (lambda x: lax.fori_loop(0, 3, lambda i, c: c * x + 1, x), (X,)),
    "cond": (lambda x: lax.cond(x.sum() > 1, lambda a: a * 2, jnp.sin, x), (X,)),
    "sort": (lambda x: jnp.sort(jnp.sin(5 * x)), (X,)),
    "reshape": (lambda m: jnp.sin(m.reshape(4, 3)) @ m, (M,)),
    "concatenate/stack": (lambda x: jnp.stack([x[0] * x[1], x[2], jnp.float32(3.0)]), (X,)),
    "stop_gradient": (lambda x: x * lax.stop_gradient(x), (X,)),
    "integer values": (lambda x: x * jnp.arange(6) + (x > 0.5), (X,)),
    "layer norm": (lambda m: (m - m.mean(0)) / jnp.sqrt(m.var(0) + 1e-5), (M,)),
    "convolution": (lambda x: jnp.convolve(x, jnp.array([1.0, 2.0, 3.0])), (X,)),
    "pow family": (lambda x: x ** x + x ** 3 + jnp.sqrt(x) + jnp.cbrt(x), (X,)),
    "jit-wrapped": (jax.jit(lambda x: jnp.sin(x) * 2), (X,)),
    "batched einsum": (lambda m: jnp.einsum("bij,bjk->bik", m.reshape(3, 2, 2), m.reshape(3, 2, 2)), (M,)),
    "pytree": (lambda p: {"a": p["w"] @ p["b"], "c": (p["b"].sum(), p["w"])}, ({"w": M, "b": X[:4]},)),
    "conv2d": (lambda k: lax.conv_general_dilated(M[None, None], k, (1, 1), "SAME"), (jnp.ones((2, 1, 2, 2)),)),
    "prod": (lambda m: jnp.prod(m, axis=1), (M,)),
    # JAX's rule rejects a symbolic zero tangent for one operand: the other gets an explicit zero
    "variadic reduce": (lambda m: lax.reduce((m, jnp.sin(m)), (-jnp.inf, 0.0),
                                             lambda a, b: (jnp.maximum(a[0], b[0]), a[1] + b[1]), (1,)), (M,)),
}


@pytest.mark.parametrize("name", sorted(ANCHOR_CASES))
def test_anchor_failure_classes(name):
    fun, args = ANCHOR_CASES[name]
    want = jax.jacrev(fun)(*args)
    assert_orders_match(fun, args, 0, want, lambda p: ["fwd", "rev", "markowitz"] + random_orders(p, 2, seed=7),
                        rtol=1e-5, atol=1e-6)
    assert_same_jacobian(jaxtool.jacve(fun)(*args), want, rtol=1e-5, atol=1e-6)


# --- the Python API


def test_argnums_has_aux_and_pytrees_match_jacrev_structure():
    def f(a, b, c):
        return {"y": a["w"] @ b + c, "z": jnp.tanh(b).sum()}, {"aux": b * 2}

    args = ({"w": M}, X[:4], 2.0)
    for argnums in (0, 1, (0, 1), (1, 0, 2)):
        got = jaxtool.jacve(f, argnums=argnums, has_aux=True)(*args)
        want = jax.jacrev(f, argnums=argnums, has_aux=True)(*args)
        assert_same_jacobian(got, want, rtol=1e-5, atol=1e-6)

    # the vertices of a custom order for a function with aux (a string among it: a raw TypeError
    # from trace_problem before, which had no has_aux)
    def g(x):
        return jnp.sin(x) * x, {"note": "per call", "total": jnp.cos(x).sum()}

    for not_a_pair in (lambda x: x * 2.0, lambda x: (x, x, x)):  # as jax.jacrev: an error, not out[0] and out[1]
        with pytest.raises(TypeError, match="two-element tuple"):
            jaxtool.jacve(not_a_pair, has_aux=True)(X)
    problem = trace_problem(g, X, has_aux=True)
    order = random_orders(problem, 1, seed=5)[0]
    got, aux = jaxtool.jacve(g, order=order, has_aux=True)(X)
    want, want_aux = jax.jacrev(g, has_aux=True)(X)
    assert_same_jacobian(got, want, rtol=1e-5, atol=1e-6)
    assert aux["note"] == "per call" and np.allclose(aux["total"], want_aux["total"])


def test_vertex_numbers_do_not_depend_on_how_non_differentiated_arguments_arrive():
    # a NumPy array not differentiated is an input of the traced program, not a constant folded
    # away, under jax.jit or not: the vertices a custom order lists are those trace_problem lists
    def f(x, y, scale):
        return jnp.sin(x) * (jnp.cos(y) * 2.0 + 1.0) * scale

    y = np.linspace(0.0, 1.0, 6, dtype=np.float32)
    problem = trace_problem(f, X, y, 3.0)
    assert len(problem.program.eqns) == len(jax.make_jaxpr(f)(X, y, 3.0).eqns)  # y's own ops count too
    assert problem.wrt == (0,)
    order = list(reversed(problem.eliminable))
    want = jax.jacrev(f)(X, y, 3.0)
    for call in (jaxtool.jacve(f, order=order), jax.jit(jaxtool.jacve(f, order=order))):
        np.testing.assert_allclose(call(X, y, 3.0), want, rtol=1e-6)
    # the same numbers whatever order argnums names the arguments in; blocks follow argnums
    both = trace_problem(f, X, y, 3.0, argnums=(1, 0))
    assert both.eliminable == problem.eliminable and both.wrt == (0, 1)
    got = jaxtool.jacve(f, order=order, argnums=(1, 0))(X, y, 3.0)
    assert_same_jacobian(got, jax.jacrev(f, argnums=(1, 0))(X, y, 3.0), rtol=1e-6, atol=1e-7)


def test_python_scalars_not_differentiated_stay_python_values():
    # as with jax.jacrev, fun may use them as sizes and in Python control flow, positional or keyword
    def f(x, n, scale, square=True):
        y = x ** n * jnp.ones(n).sum() * scale
        return (y ** 2 if square else -y), {"n": n, "scale": scale}

    for n, scale, square in ((3, 0.5, True), (2, 0.5, True), (2, 1.5, False), (3, 0.5, True)):
        got, aux = jaxtool.jacve(f, has_aux=True)(X, n, scale, square=square)
        want, want_aux = jax.jacrev(f, has_aux=True)(X, n, scale, square=square)
        assert_same_jacobian(got, want, rtol=1e-5, atol=1e-6)
        assert aux == want_aux == {"n": n, "scale": scale}
    # a differentiated Python float is still traced; under jax.jit the scalars are whatever jit made them
    got = jaxtool.jacve(lambda x, s: x * s, argnums=(0, 1))(X, 2.0)
    assert_same_jacobian(got, jax.jacrev(lambda x, s: x * s, argnums=(0, 1))(X, 2.0), rtol=1e-6, atol=0)
    jitted = jax.jit(jaxtool.jacve(lambda x, n: x ** n * jnp.ones(n).sum()), static_argnums=1)
    np.testing.assert_allclose(jitted(X, 3), jax.jacrev(lambda x: x ** 3 * 3.0)(X), rtol=1e-5)
    flagged = lambda x, k: x * 2 if k is True else x * 3  # noqa: E731 - True and 1 are two values here
    jacobian = jaxtool.jacve(flagged)
    np.testing.assert_allclose([jacobian(X, True)[0, 0], jacobian(X, 1)[0, 0]], [2.0, 3.0])
    # NumPy scalars too (a NumPy array, even of rank 0, is traced as jax.jit traces it)
    sized = lambda x, n: x ** 2 * jnp.ones(n).sum()  # noqa: E731
    np.testing.assert_allclose(jaxtool.jacve(sized)(X, np.int64(4)), jax.jacrev(sized)(X, np.int64(4)), rtol=1e-6)
    scaled = lambda x, k: x * k  # noqa: E731
    np.testing.assert_allclose(jaxtool.jacve(scaled)(X, np.array(3.0)), 3 * np.eye(6), rtol=1e-6)


def test_python_floats_not_differentiated_are_traced_until_fun_needs_them_concrete():
    traces = []

    def smooth(x, t):
        traces.append(t)
        return jnp.sin(x * t)

    jacobian = jaxtool.jacve(smooth)
    for t in (0.5, 0.7, 0.9):  # one trace for all three values
        np.testing.assert_allclose(jacobian(X, t), jax.jacrev(smooth)(X, t), rtol=1e-5)
    assert len([t for t in traces if isinstance(t, jax.core.Tracer)]) == 1  # the others: jax.jacrev's calls

    def branching(x, t):
        return jnp.sin(x) if t > 0.6 else jnp.cos(x) * t

    jacobian = jaxtool.jacve(branching)
    for t in (0.5, 0.7, np.float32(0.5)):
        np.testing.assert_allclose(jacobian(X, t), jax.jacrev(branching)(X, t), rtol=1e-5)
    with pytest.raises(jax.errors.ConcretizationTypeError):  # a differentiated value in an `if` stays an error
        jaxtool.jacve(lambda x: x if x.sum() > 0 else -x)(X)


def test_concrete_floats_that_compare_equal_but_differ_are_not_taken_for_one_another():
    # jax.jit's cache of static arguments takes 0.0 and -0.0 for one another (equal, same hash): the
    # Jacobian traced for one was returned for the other
    def signed(x, s):
        return x if s > 1.0 else x * jnp.copysign(1.0, s)

    for zeros in ((0.0, -0.0), (np.float32(-0.0), np.float32(0.0))):
        jacobian = jaxtool.jacve(signed)
        for s in zeros:
            np.testing.assert_array_equal(jacobian(X, s), jax.jacrev(signed)(X, s))


def test_aux_leaves_that_are_not_arrays_pass_through():
    # un-jitted jax.jacrev returns such aux leaves as they are; jacve does too, per argument shape
    f = lambda v: (v * 2, {"shape": str(v.shape), "sum": v.sum()})  # noqa: E731
    jacobian = jaxtool.jacve(f, has_aux=True)
    for x in (jnp.arange(3.0), jnp.ones((2, 2)), jnp.arange(3.0)):
        (got, got_aux), (want, want_aux) = jacobian(x), jax.jacrev(f, has_aux=True)(x)
        np.testing.assert_array_equal(got, want)
        assert got_aux["shape"] == want_aux["shape"] == str(x.shape)
        np.testing.assert_array_equal(got_aux["sum"], want_aux["sum"])


def test_integer_outputs_get_zero_blocks():
    x = jnp.arange(1.0, 5.0)
    scaled, index = jaxtool.jacve(lambda v: (v * 2, jnp.argmax(v)))(x)
    np.testing.assert_array_equal(scaled, 2 * np.eye(4))
    assert index.shape == (4,) and index.dtype == x.dtype and not np.any(index)
    np.testing.assert_array_equal(index, jax.jacfwd(lambda v: jnp.argmax(v))(x))


def test_non_finite_partials_stay_on_their_paths():
    x = jnp.arange(1.0, 5.0)  # x - 2 is -1, 0, 1, 2: sqrt' is NaN, inf, 0.5, 0.354
    got = np.asarray(jaxtool.jacve(lambda v: jnp.sqrt(v - 2.0))(x))
    np.testing.assert_array_equal(np.isnan(got), np.diag([True, False, False, False]))
    assert got[1, 1] == np.inf and got[~np.eye(4, dtype=bool)].tolist() == [0.0] * 12
    np.testing.assert_allclose(got, jax.jit(jax.jacrev(lambda v: jnp.sqrt(v - 2.0)))(x), rtol=1e-6)
    # a where mask times a NaN partial is NaN (as jax.grad gives), on the diagonal only
    masked = np.asarray(jaxtool.jacve(lambda v: jnp.where(v > 2, jnp.sqrt(v - 2), 0.0))(x))
    np.testing.assert_array_equal(np.isnan(masked), np.diag([True, True, False, False]))
    assert masked[~np.eye(4, dtype=bool)].tolist() == [0.0] * 12
    assert masked[3, 3] == pytest.approx(0.5 ** 1.5)
    assert np.isnan(jax.grad(lambda v: jnp.where(v > 2, jnp.sqrt(v - 2), 0.0).sum())(x)[0])


def test_the_max_of_a_row_with_nan_has_nan_partials_under_jit_too():
    # JAX's rule divides the equal elements by their count, 0 / 0 for a NaN maximum; with a
    # cotangent of ones XLA made that a select of 0 under jax.jit (jacve stages with jit): 0, not NaN
    x = jnp.array([[1.0, np.nan, 2.0], [4.0, 0.5, 6.0], [3.0, 3.0, 1.0]])
    for reduce, ties in ((jnp.max, [0.5, 0.5, 0.0]), (jnp.min, [0.0, 0.0, 1.0])):
        want = np.asarray(jax.jit(jax.jacrev(lambda a: reduce(a, axis=1)))(x))
        assert np.isnan(want[0, 0]).all() and want[2, 2].tolist() == ties
        for order in ("fwd", "rev", "markowitz"):
            got = jaxtool.jacve(lambda a: reduce(a, axis=1), order=order)(x)
            np.testing.assert_array_equal(got, want, err_msg=f"{reduce.__name__} {order}")


def test_max_and_min_partials_are_jaxs_at_ties_zeros_infinities_and_nan():
    # the rule compares the operands with each other (rules.max_min), JAX's with the result: the same
    # values, 1, 1/2 at a tie (of +0 and -0 too) and 0, NaN included (0 for both operands)
    x = jnp.array([1.0, 2.0, 3.0, np.nan, np.inf, -0.0, 0.0, 5.0, -np.inf, 2.5])
    y = jnp.array([2.0, 2.0, 1.0, 1.0, np.inf, 0.0, -0.0, np.nan, 3.0, 2.5])
    for name, f in (("max", jnp.maximum), ("min", jnp.minimum), ("max with a scalar", lambda a, b: jax.lax.max(a, 2.0)),
                    ("min of itself", lambda a, b: jnp.minimum(a, a))):
        want = jax.jacfwd(f, argnums=(0, 1))(x, y)  # one-hot tangents: the rule's values on the diagonal
        for order in ("fwd", "rev", "markowitz"):
            for got in (jaxtool.jacve(f, order, (0, 1))(x, y), jax.jit(jaxtool.jacve(f, order, (0, 1)))(x, y)):
                for g, w in zip(got, want):
                    np.testing.assert_array_equal(np.diag(g), np.diag(w), err_msg=f"{name} {order}")
                    assert not np.asarray(g)[~np.eye(10, dtype=bool)].any(), (name, order)


def test_max_partials_hold_where_xla_computes_an_operand_twice():
    """Under XLA:CPU's older loop emitters with ``jax_disable_most_optimizations``, fuzz seed 267's
    compiled ``markowitz`` Jacobian (a ``jnp.hypot`` of ``tanh`` values) was off by up to 0.93 with
    JAX's rule for ``max``, which compares each operand with the result: right op by op, and with
    ``rules.max_min``, which compares the operands with each other. Run in a process of its own (the
    flag is read when JAX starts its backend); skipped where this jaxlib does not know the flag."""
    import os
    import subprocess

    script = """
import jax, jax.numpy as jnp, numpy as np
jax.config.update("jax_disable_most_optimizations", True)
import jaxtool
c0 = np.array([[1.5, 2.0, -1.75], [0.75, -2.0, 0.5], [-1.5, -2.0, 1.0]], np.float32)
def program(v0, v2):  # fuzz seed 267 (tests/program_generator.py), its unused input left out
    v3 = jnp.cumsum(v2, axis=0)
    v4 = jax.vmap(jnp.dot)(jnp.tanh(v3), jnp.tanh(v3))
    v6 = jnp.hypot(jnp.tanh(c0 @ v0), jnp.tanh(c0 @ v0) * jnp.tanh(c0 @ v0) + 0.5)
    return [v6, v4]
v0 = np.array([[-0.17408876, 0.8768279, -1.361691, -1.3196449], [0.61971265, -0.6129548, -0.55858374, 1.4234697],
               [0.5136326, 1.0565057, 0.54526824, -0.7266293]], np.float32)
v2 = np.array([[1.4087957, -0.2494405], [-0.51019, -1.4343886], [-0.7514483, -0.79430825],
               [1.1486788, -0.62966365]], np.float32)
want = jax.jacrev(program, argnums=(0, 1))(v0, v2)
for order in ("fwd", "rev", "markowitz"):
    got = jax.jit(jaxtool.jacve(program, order, (0, 1)))(v0, v2)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5, err_msg=order)
print("ok")
"""
    env = dict(os.environ, XLA_FLAGS="--xla_cpu_use_fusion_emitters=false", JAX_PLATFORMS="cpu")
    root = pathlib.Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-c", script], cwd=root, env=env, capture_output=True, text=True,
                          timeout=600)
    if done.returncode != 0 and "Unknown flag" in done.stderr:
        pytest.skip("this jaxlib does not know --xla_cpu_use_fusion_emitters")
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_a_mask_below_an_infinite_partial_makes_an_exact_zero_in_every_order():
    # a row that is all masked: logsumexp of -inf is -inf, whose log has an infinite partial (1/0)
    # behind the exp's zero; the mask on the way in and the where on the way out make the row's
    # derivatives 0 in jax.jacrev and jax.jacfwd alike, whatever the elimination order
    mask = np.array([[True, True, False], [False, False, False], [True, False, True]])

    def f(s):
        lse = jax.scipy.special.logsumexp(jnp.where(mask, s, -jnp.inf), axis=1)
        return jnp.where(jnp.isfinite(lse), lse, 0.0)

    s = jnp.linspace(-1.0, 1.0, 9).reshape(3, 3)
    want = jax.jacrev(f)(s)
    np.testing.assert_allclose(jax.jacfwd(f)(s), want, rtol=1e-6)
    assert np.isfinite(want).all()
    eliminable = list(trace_problem(f, s).eliminable)
    orders = ["fwd", "rev", "markowitz"] + [random.Random(seed).sample(eliminable, len(eliminable)) for seed in range(8)]
    for order in orders:
        np.testing.assert_allclose(jaxtool.jacve(f, order=order)(s), want, rtol=1e-5, atol=1e-6, err_msg=str(order))
    # clamp selects too: at x = 0.1 the result is the bound 0.5, where sqrt' is infinite; the
    # partial w.r.t. x is an exact zero there (jax.jacrev: 0; jax.jacfwd: 0 * inf = NaN)
    g = lambda x, lo: jnp.sqrt(lax.clamp(lo, x, jnp.full(3, 2.0)) - 0.5)  # noqa: E731
    x, lo = jnp.array([0.1, 1.0, 3.0]), jnp.full(3, 0.5)
    want = [np.diagonal(block) for block in jax.jacrev(g, argnums=(0, 1))(x, lo)]  # (off it: NaN, no path)
    assert want[0][0] == 0 and want[1][0] == np.inf
    off = ~np.eye(3, dtype=bool)
    for order in ("fwd", "rev", "markowitz"):
        got = jaxtool.jacve(g, argnums=(0, 1), order=order)(x, lo)
        for block, expected in zip(got, want):
            np.testing.assert_allclose(np.diagonal(block), expected, rtol=1e-6)
            assert (np.asarray(block)[off] == 0).all()


def test_infinite_partials_where_a_selection_selects_nothing_stay_zero():
    # sqrt'(0) = inf at padded or concatenated zeros, which no input reaches: jax.jacrev gives 0 there
    cases = [lambda v: jnp.sqrt(jnp.pad(v, 1)), lambda v: jnp.sqrt(jnp.concatenate([v, jnp.zeros(2)])) * 2,
             lambda v: jnp.log(lax.dynamic_update_slice(jnp.zeros(9), v, (jnp.argmax(v) - 4,))),
             lambda v: jnp.sqrt(jnp.pad(v[::-1], (0, 3))[2:]) * jnp.sqrt(jnp.pad(v, (3, 0))[:-2])]
    for f in cases:
        want = jax.jacrev(f)(X)
        assert np.isfinite(want).all()
        for order in ("fwd", "rev", "markowitz"):
            np.testing.assert_allclose(jaxtool.jacve(f, order=order)(X), want, rtol=1e-5, atol=1e-6)


def test_the_order_dependent_nan_conventions_are_as_the_readme_says():
    # README "Non-finite local partials": entries with no path whose value depends on the order
    cumsum = lambda v: jnp.cumsum(jnp.sqrt(v)[::-1])[:1]  # noqa: E731
    x = jnp.array([0.0, 1.2, 4.0])
    assert np.isnan(jaxtool.jacve(cumsum, order="rev")(x)[0, 0]) and np.isnan(jax.jacrev(cumsum)(x)[0, 0])
    assert jaxtool.jacve(cumsum, order="fwd")(x)[0, 0] == 0 == jax.jacfwd(cumsum)(x)[0, 0]
    cdf = lambda a: jax.scipy.stats.truncnorm.cdf(jnp.array([0.5, 3.0]), a, jnp.ones(2))  # noqa: E731
    a = -jnp.ones(2)
    assert jax.jacrev(cdf)(a)[1, 0] == 0 == jax.jacfwd(cdf)(a)[1, 0]
    assert [bool(np.isnan(jaxtool.jacve(cdf, order=o)(a)[1, 0])) for o in ("fwd", "rev", "markowitz")] == \
        [False, False, True]


def test_reduce_precision_follows_its_jvp_rule():
    # JAX differentiates lax.reduce_precision as the identity in forward mode, but jax.jacrev rounds
    # the cotangent as well: the two disagree by the rounding, and jaxtool gives jacfwd's exact ones
    x = jnp.linspace(-1.3, 2.9, 6)
    f = lambda v: lax.reduce_precision(v, exponent_bits=8, mantissa_bits=7) * v  # noqa: E731
    forward, reverse = jax.jacfwd(f)(x), jax.jacrev(f)(x)
    assert not np.allclose(forward, reverse, rtol=1e-4, atol=0)
    for order in ("fwd", "rev", "markowitz"):
        np.testing.assert_array_equal(jaxtool.jacve(f, order=order)(x), forward)


def _dot_precisions(jaxpr) -> list:
    return [p for e in jaxpr.eqns for p in ([e.params["precision"]] if e.primitive is lax.dot_general_p else [])
            + [p for _, _, sub in subjaxprs(e.params) for p in _dot_precisions(sub)]]


def test_the_eliminations_own_matrix_products_run_at_highest_precision():
    # on a GPU, float32 matrix products of default precision run in TF32: the chain rule's own
    # products must not lose float32's precision there (the program's products keep theirs)
    highest = (lax.Precision.HIGHEST, lax.Precision.HIGHEST)
    w, x = jnp.full((24, 24), 0.1), jnp.ones(24)
    f = lambda w, x: jnp.tanh(w @ jnp.tanh(w @ x))  # noqa: E731
    def loop(x):  # a while loop's JVP, which JAX cannot transpose: rows are multiplied by it densified
        y, _ = lax.while_loop(lambda c: c[1] < 3, lambda c: (jnp.sin(c[0]) * 1.1, c[1] + 1), (x, 0))
        return jnp.tanh(jnp.sin(y) @ w)  # (tanh's partial reads the product: it stays in the Jacobian)

    for fun, args, argnums in ((f, (w, x), 1), (loop, (x,), 0)):
        program = _dot_precisions(jax.make_jaxpr(fun)(*args).jaxpr)
        for order in ("fwd", "rev", "markowitz"):
            precisions = _dot_precisions(jax.make_jaxpr(jaxtool.jacve(fun, order, argnums))(*args).jaxpr)
            own = [p for p in precisions if p != highest]
            assert sorted(map(str, own)) == sorted(map(str, program)), order
            assert len(precisions) > len(program), order


COMPLEX_CONSTANT = np.array([1 + 2j, 3 - 1j, 0.5j, 2.0, -1j, 0.25], np.complex64)


def _complex_scan(x):
    def step(carry, xi):
        carry = carry * (0.6 + 0.5j) + xi * COMPLEX_CONSTANT[0]
        return carry, jnp.abs(carry)

    last, moduli = lax.scan(step, jnp.complex64(0), x)
    return jnp.real(last) + moduli.sum()


#: real -> real programs with complex intermediates (each primitive's JVP is only real-linear:
#: conj, abs, real, imag, angle), compared with jax.jacrev
COMPLEX_CASES = {
    "fft_power": lambda x: jnp.abs(jnp.fft.fft(x)) ** 2,
    "rfft_filter": lambda x: jnp.fft.irfft(jnp.fft.rfft(x) * (1 + 2j), n=6),
    "conj_product": lambda x: jnp.real(jnp.conj(x * (1 + 1j)) * (x + 2j)),
    "angle": lambda x: jnp.angle(x + 1j * x ** 2),
    "closed_over_constant": lambda x: jnp.abs(x * COMPLEX_CONSTANT + COMPLEX_CONSTANT[::-1] * x ** 2),
    "scan_carry": _complex_scan,
    "cond": lambda x: lax.cond(x[0] > 0, lambda y: jnp.real(y * 1j + y ** 2), jnp.imag, x.astype(jnp.complex64)),
    "eigenvalues": lambda x: jnp.sort(jnp.real(jnp.linalg.eigvals(jnp.outer(x, x[::-1]) + jnp.eye(6)))),
    "matmul_modulus": lambda x: jnp.abs(jnp.outer(x, x).astype(jnp.complex64) @ (x + 1j)),
    # structural maps and broadcasting on complex values keep their structure (no opaque vertex)
    "slices_and_concatenation": lambda x: jnp.real(jnp.concatenate([(x * 1j)[1:4], (x + 1j)[::-1]]) ** 2),
    "gather_pad_transpose": lambda x: jnp.angle(jnp.pad(jnp.exp(0.3j * x)[jnp.array([0, 2, 2, 5])], 1,
                                                        constant_values=0.5j) * (1 + 1j)).reshape(2, 3).T.ravel(),
    "broadcast_and_sum": lambda x: jnp.abs(jnp.exp(1j * x[:, None] * jnp.arange(3)).sum(axis=1) * (x[0] + 1j)),
}
STRUCTURED_COMPLEX = ("conj_product", "closed_over_constant", "slices_and_concatenation", "gather_pad_transpose",
                      "broadcast_and_sum")


@pytest.mark.parametrize("name", sorted(COMPLEX_CASES))
def test_complex_intermediates_match_jacrev(name):
    f = COMPLEX_CASES[name]
    want = jax.jacrev(f)(X)
    for order in ("fwd", "rev", "markowitz"):
        assert_same_jacobian(jaxtool.jacve(f, order=order)(X), want, rtol=1e-5, atol=1e-5)
    assert_orders_match(f, (X,), 0, want, lambda problem: random_orders(problem, 3, name), rtol=1e-5, atol=1e-5)


def _square(x):
    """A well-conditioned 3 x 3 matrix made of the six values of X and their squares."""
    return jnp.concatenate([x, x[:3] ** 2]).reshape(3, 3) + 2 * jnp.eye(3)


#: library functions that reach what no other test or fuzz program does, on X: opaque svd, qr,
#: triangular_solve and scan (jnp.polyval) vertices, custom JVP rules (slogdet's over an LU, xlogy),
#: a sort read by interpolation (jnp.quantile), jnp.kron's broadcasts
LIBRARY_CASES = {
    "slogdet": lambda x: jnp.linalg.slogdet(_square(x))[1] * x,
    "singular_values": lambda x: jnp.linalg.svd(_square(x), compute_uv=False),
    "qr_r_factor": lambda x: jnp.linalg.qr(_square(x))[1].ravel(),
    "solve_triangular": lambda x: jax.scipy.linalg.solve_triangular(jnp.triu(_square(x)), x[:3], lower=False),
    "xlogy": lambda x: jax.scipy.special.xlogy(x, x[::-1] + 0.5),
    "polyval": lambda x: jnp.polyval(x[:4], x),
    "quantile": lambda x: jnp.quantile(jnp.sin(3 * x), jnp.array([0.3, 0.5, 0.9])),
    "kron": lambda x: jnp.kron(x[:2].reshape(1, 2), _square(x)).ravel(),
}


@pytest.mark.parametrize("name", sorted(LIBRARY_CASES))
def test_library_functions_match_jacrev(name):
    f = LIBRARY_CASES[name]
    want = jax.jit(jax.jacrev(f))(X)
    assert_orders_match(f, (X,), 0, want, lambda problem: ["fwd", "rev", "markowitz"] + random_orders(problem, 2, name),
                        rtol=1e-4, atol=1e-5, staged=True)
    assert_same_jacobian(jaxtool.jacve(f, order="markowitz")(X), want, rtol=1e-4, atol=1e-5)


def test_complex_outputs_and_aux_follow_jacfwd():
    # jax.jacrev rejects complex outputs; jaxtool gives jax.jacfwd's complex blocks (d re + 1j d im)
    f = lambda x: (jnp.fft.fft(x) * x, {"spectrum": jnp.fft.fft(x)})  # noqa: E731
    want = jax.jacfwd(lambda x: f(x)[0])(X)
    for order in ("fwd", "rev", "markowitz"):
        jacobian, aux = jaxtool.jacve(f, order=order, has_aux=True)(X)
        assert jacobian.dtype == jnp.complex64
        assert_same_jacobian(jacobian, want, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(aux["spectrum"], jnp.fft.fft(X))
    g = COMPLEX_CASES["fft_power"]
    batch = jnp.stack([X, 2 * X])
    np.testing.assert_allclose(jax.jit(jax.vmap(jaxtool.jacve(g)))(batch), jax.vmap(jax.jacrev(g))(batch),
                               rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(jax.jacfwd(jaxtool.jacve(g))(X), jax.hessian(g)(X), rtol=1e-4, atol=1e-3)
    with pytest.raises(UsageError, match="complex64"):  # complex inputs, as jax.jacrev without holomorphic=True
        jaxtool.jacve(jnp.abs)(X + 1j)


def test_complex_x64():
    with jax.enable_x64(True):
        x = np.linspace(0.1, 1.2, 6)
        f = COMPLEX_CASES["rfft_filter"]
        got = jaxtool.jacve(f, order="markowitz")(x)
        assert got.dtype == jnp.float64
        np.testing.assert_allclose(got, jax.jacrev(f)(x), rtol=1e-10, atol=1e-10)


def test_selections_computed_at_run_time_in_x64():
    """A sort's selection is computed at run time (its indices from element-number bits): with
    ``jax_enable_x64`` those indices stayed int32, not the default int64 a ``jnp.sum`` gives, which
    crashed its product with a dense partial (a softmax's) before it: found by fuzzing in float64."""
    f = lambda x: lax.cummin(jnp.sort(jax.nn.softmax(x)), axis=0, reverse=True)  # noqa: E731
    with jax.enable_x64(True):
        x = np.array([0.3, -1.2, 0.5, 2.0])
        want = jax.jacrev(f)(x)
        for order in ("fwd", "rev", "markowitz"):
            got = jaxtool.jacve(f, order=order)(x)
            assert got.dtype == jnp.float64
            np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10)


def test_strict_dtype_promotion_applies_to_the_function_not_the_engine():
    """Under ``jax.numpy_dtype_promotion("strict")`` the engine's own arithmetic (a ``select_n``'s
    boolean mask compared with an int) crashed in one program in five of the fuzzer's: it runs
    under standard promotion. The user's function keeps the setting: an implicit int-float mix in
    it fails as it does under ``jax.jacrev``."""
    f = lambda x: jnp.where(x > 0.2, jnp.sin(x) * x, 0.5 * x) @ jnp.tanh(jnp.sort(x))  # noqa: E731
    mixed = lambda x: x * jnp.arange(3)  # noqa: E731
    x = jnp.array([0.3, -1.2, 0.5])
    with jax.numpy_dtype_promotion("strict"):
        want = jax.jacrev(f)(x)
        for order in ("fwd", "rev", "markowitz"):
            np.testing.assert_allclose(jaxtool.jacve(f, order=order)(x), want, rtol=1e-5, atol=1e-6)
        with pytest.raises(jax.dtypes.TypePromotionError):
            jax.jacrev(mixed)(x)
        with pytest.raises(jax.dtypes.TypePromotionError):
            jaxtool.jacve(mixed)(x)


def test_rank_promotion_raise_applies_to_the_function_not_the_engine():
    """Under ``jax.numpy_rank_promotion("raise")`` the engine's own products of partials (a scale of
    shape (n,) times rows of shape (m, n)) crashed in one program in fifteen of the fuzzer's (this
    one in the fwd and markowitz orders): the engine allows rank promotion. The user's function
    keeps the setting: an implicit rank promotion in it fails as it does under ``jax.jacrev``."""
    f = lambda v: jnp.cumsum(jnp.sin(v[::-1]) * v)  # noqa: E731
    promoting = lambda v: v + jnp.ones((2, 4))  # noqa: E731
    x = jnp.array([1.3, -1.0, -1.3, -1.2])
    with jax.numpy_rank_promotion("raise"):
        want = jax.jacrev(f)(x)
        for order in ("fwd", "rev", "markowitz"):
            np.testing.assert_allclose(jax.jit(jaxtool.jacve(f, order=order))(x), want, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(jaxtool.jacve(f, order=order)(x), want, rtol=1e-5, atol=1e-6)
        with pytest.raises(ValueError, match="rank_promotion"):
            jax.jacrev(promoting)(x)
        with pytest.raises(ValueError, match="rank_promotion"):
            jaxtool.jacve(promoting)(x)



@jax.custom_vjp
def _sin_by_vjp(x):
    return jnp.sin(x)


_sin_by_vjp.defvjp(lambda x: (jnp.sin(x), jnp.cos(x)), lambda cos, g: (cos * g,))


def test_no_tracer_outlives_its_trace():
    """Under ``jax.checking_leaks()`` (``jax_check_tracer_leaks``, which a user may switch on to find
    a leak of their own) every order of most of the fuzzer's programs was reported: values made in
    the engine's nested traces (``jax.vmap`` of a map, ``jax.eval_shape``, ...) stayed in the table
    of shared applications, and the staged Jacobian kept its last traced program (closing over the
    values of an argument not differentiated) for an error message."""
    a = jnp.array([0.3, -1.2, 0.8, 0.5])
    b = jnp.array([0.5, 0.7, 0.9, -0.4])
    programs = {
        "sort": (lambda x, y: jnp.sort(x) * y, 0),  # a map densified under jax.vmap
        "gather": (lambda x, y: x[jnp.argsort(x)] * x, 0),
        "cond": (lambda x, y: jax.lax.cond(x[0] > 0, jnp.sin, jnp.cos, x), 0),
        "fft": (lambda x, y: jnp.real(jnp.fft.fft(x * x)), 0),
        "custom_vjp": (lambda x, y: _sin_by_vjp(x) * y, 0),
        "not differentiated": (lambda x, y: jax.nn.relu(x) * y, 1),
    }
    with jax.checking_leaks():
        for name, (f, argnums) in programs.items():
            want = jax.jacrev(f, argnums=argnums)(a, b)
            for order in ("fwd", "rev", "markowitz"):
                jacobian = jaxtool.jacve(f, order=order, argnums=argnums)
                for got in (jacobian(a, b), jax.jit(jacobian)(a, b)):
                    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=f"{name} {order}")


def test_explicitly_sharded_values_are_differentiated_replicated():
    """Over a mesh of ``AxisType.Explicit`` axes (``jax.make_mesh``'s default), values carry their
    sharding in their types, and a product of partials of two values split over one axis was
    rejected (``f32[8@d,8] * f32[8,8@d]``). The engine computes replicated values: placements are
    copies, ``out_sharding`` is dropped, and a ``scan`` traced with sharded carries gets them as
    traced. Four CPU devices need a process of their own (``tests/fixtures/fx_explicit_sharding.py``)."""
    import os
    import subprocess

    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    script = pathlib.Path(__file__).resolve().parent / "fixtures" / "fx_explicit_sharding.py"
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("ok ") == 16, done.stdout


def test_composes_with_jit_vmap_and_second_derivatives():
    f = lambda x: jnp.sin(x) * jnp.exp(x).sum() + x ** 2  # noqa: E731
    x = jnp.linspace(0.1, 1.0, 5)
    batch = jnp.stack([x, 2 * x, -x])
    np.testing.assert_allclose(jax.vmap(jaxtool.jacve(f))(batch), jax.vmap(jax.jacrev(f))(batch), rtol=1e-5)
    np.testing.assert_allclose(jax.jit(jaxtool.jacve(f, order="fwd"))(x), jax.jacfwd(f)(x), rtol=1e-5)
    hessian = jax.hessian(f)(x)
    np.testing.assert_allclose(jaxtool.jacve(jaxtool.jacve(f), order="markowitz")(x), hessian, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(jax.jacfwd(jaxtool.jacve(f))(x), hessian, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(jax.jacrev(jaxtool.jacve(f, order="fwd"))(x), hessian, rtol=1e-4, atol=1e-5)
    closed = jax.make_jaxpr(jaxtool.jacve(f))(x)
    jax.extend.core.check_jaxpr(closed.jaxpr)



def _compiled_flops(fun, *args) -> float:
    return jax.jit(fun).lower(*args).compile().cost_analysis()["flops"]


def test_shared_scalars_are_computed_once_on_cpu(monkeypatch):
    """In a program of scalars, the products and sums several Jacobian entries read pass through
    ``materialize_scalars`` (:mod:`jaxtool.sharing`), so that XLA:CPU computes them once instead of
    in every entry's kernel. Jacobians unchanged in every order, through vmap, jit and second
    derivatives; fewer compiled flops than without it, and for roe_flux_1d fewer than the 1000
    below which XLA:CPU runs a call on the calling thread. A program that is under that line as it
    is, or above it still, keeps its kernels (here: forced, to test the replay on more primitives)."""
    from jaxtool import sharing

    roe, roe_args = load_sample("roe_flux_1d")

    def scalars(a, b, c, k=2):  # x*x, a closed-over NumPy constant, an output that is an input, where, max
        p, q = a * b + np.float32(0.5) * c, a * a - b * c
        r = jnp.where(p > q, p * q, p + q) * jnp.maximum(p, q)
        return {"r": r, "s": [r * p + q * c * k, r * q * p, a], "t": jnp.sin(r) * q}

    x = (jnp.float32(0.3), jnp.float32(1.7), jnp.float32(-0.4))
    def roe_twice(*u):  # above the line still with them: 4852 flops as it is, 1236 so
        flux = roe(*u)
        return roe(u[0] + 0.01 * flux[0], u[1] + 0.01 * flux[1], u[2] + 0.001 * flux[2], *u[3:])

    for fun, args, argnums in ((scalars, x, (0, 1, 2)), (roe_twice, roe_args, tuple(range(6)))):  # left as they are
        assert "materialize_scalars" not in str(jax.make_jaxpr(jaxtool.jacve(fun, argnums=argnums))(*args))
    monkeypatch.setattr(sharing, "crosses_the_line", lambda jaxpr, shared: True)
    jaxtool.jacobian.clear_caches()
    cases = [(roe, roe_args, tuple(range(6))), (scalars, x, (0, 1, 2))]
    for fun, args, argnums in cases:
        want = jax.jacrev(fun, argnums=argnums)(*args)
        problem = trace_problem(fun, *args, argnums=argnums)
        for order in ["fwd", "rev", "markowitz"] + random_orders(problem, 3, seed=11):
            jacobian = jaxtool.jacve(fun, order=order, argnums=argnums)
            assert "materialize_scalars" in str(jax.make_jaxpr(jacobian)(*args)), order
            assert_same_jacobian(jax.jit(jacobian)(*args), want, rtol=1e-4, atol=1e-5)
    # derivatives and batches of it
    f = lambda a, b, c: scalars(a, b, c)["s"][0]  # noqa: E731
    hessian = jax.hessian(f, argnums=(0, 1, 2))(*x)
    for second in (jaxtool.jacve(jaxtool.jacve(f, argnums=(0, 1, 2)), argnums=(0, 1, 2), order="fwd"),
                   jax.jacfwd(jaxtool.jacve(f, argnums=(0, 1, 2)), argnums=(0, 1, 2)),
                   jax.jacrev(jaxtool.jacve(f, argnums=(0, 1, 2)), argnums=(0, 1, 2))):
        assert_same_jacobian(second(*x), hessian, rtol=1e-4, atol=1e-4)
    jax.extend.core.check_jaxpr(jax.make_jaxpr(jaxtool.jacve(f, argnums=(0, 1, 2)))(*x).jaxpr)
    batch = tuple(v * jnp.linspace(0.5, 1.5, 7, dtype=jnp.float32) for v in roe_args)
    batched = jax.vmap(jaxtool.jacve(roe, argnums=tuple(range(6))))
    assert_same_jacobian(batched(*batch), jax.vmap(jax.jacrev(roe, argnums=tuple(range(6))))(*batch),
                         rtol=1e-4, atol=1e-5)
    assert " gather(" not in jax.jit(batched).lower(*batch).compile().as_text()  # the identity, batched
    on_gpu = jax.jit(jaxtool.jacve(roe, argnums=tuple(range(6)))).trace(*roe_args).lower(lowering_platforms=("cuda",))
    assert "gather" not in on_gpu.as_text()  # and on other platforms
    # what it is for
    monkeypatch.undo()
    jaxtool.jacobian.clear_caches()
    shared = _compiled_flops(jaxtool.jacve(roe, order="rev", argnums=tuple(range(6))), *roe_args)
    jaxtool.jacobian.clear_caches()
    monkeypatch.setattr(sharing, "crosses_the_line", lambda jaxpr, shared: False)
    copied = _compiled_flops(jaxtool.jacve(roe, order="rev", argnums=tuple(range(6))), *roe_args)
    jaxtool.jacobian.clear_caches()
    assert shared < 1000 <= copied, (shared, copied)


def _dead_equations(jaxpr) -> int:
    """How many equations of ``jaxpr`` (not of the jaxprs in their params) have results nothing reads."""
    read = {v for e in jaxpr.eqns for v in e.invars if isinstance(v, jax.extend.core.Var)}
    read.update(v for v in jaxpr.outvars if isinstance(v, jax.extend.core.Var))
    return sum(not e.effects and not read.intersection(e.outvars) for e in jaxpr.eqns)


def test_the_replayed_jaxpr_leaves_out_what_nothing_reads(monkeypatch):
    """:func:`sharing.call_sharing` replays only equations whose results are read (or that have
    effects): the pieces of a bundle's product that the next bundle takes whole are left out."""
    printed = jax.make_jaxpr(lambda x: (jax.debug.print("{}", x), jnp.cos(x), jnp.sin(x))[2])(1.0).jaxpr
    assert [e.primitive.name for e in sharing._live(printed).eqns] == ["debug_print", "sin"]
    encoder, args = load_sample("encoder")

    def staged_jaxpr():
        staged = jax.make_jaxpr(jaxtool.jacve(encoder, order="fwd", argnums=tuple(range(len(args)))))(*args).jaxpr
        (inner,) = [sub for e in staged.eqns for _, _, sub in subjaxprs(e.params)]
        return inner

    assert _dead_equations(staged_jaxpr()) == 0
    monkeypatch.setattr(sharing, "_live", lambda jaxpr: jaxpr)  # (the replay as it was: hundreds)
    jaxtool.jacobian.clear_caches()
    assert _dead_equations(staged_jaxpr()) > 100
    jaxtool.jacobian.clear_caches()  # (not to leave that trace to later tests)


def _made_once(jacobian, *args) -> int:
    """How many ``two_forms`` equations of ``jacobian``'s staged program ``sharing.MadeOnce`` marks."""
    return sum(isinstance(e.params.get("forms"), sharing.MadeOnce)
               for e in _equations(jax.make_jaxpr(jacobian)(*args).jaxpr) if e.primitive.name == "two_forms")


def test_written_contractions_xla_would_copy_into_several_kernels_are_made_once(monkeypatch):
    """A written-out contraction whose result several kernels read (an output's row in reverse
    order, multiplied by each in-edge partial) is made once (``sharing.MadeOnce``): the encoder's
    Jacobian compiles to fewer flops than with XLA copying it into each kernel, with the same values,
    also under jax.vmap and in second derivatives (off XLA:CPU nothing is written out:
    test_small_products_are_written_out_on_cpu_only)."""
    encoder, args = load_sample("encoder")
    argnums = tuple(range(len(args)))
    want = jax.jacrev(encoder, argnums=argnums)(*args)
    flops = {}
    for kernels in (sharing.KERNELS, 10 ** 9):  # as it is; never made once
        monkeypatch.setattr(sharing, "KERNELS", kernels)
        jaxtool.jacobian.clear_caches()
        for order in ("rev", "markowitz"):
            jacobian = jaxtool.jacve(encoder, order=order, argnums=argnums)
            assert (_made_once(jacobian, *args) > 0) == (kernels == 2), (order, kernels)
            compiled = jax.jit(jacobian).lower(*args).compile()
            assert_same_jacobian(compiled(*args), want, rtol=1e-4, atol=1e-5)
            flops[order, kernels] = compiled.cost_analysis()["flops"]
    for order in ("rev", "markowitz"):  # (26010 -> 13892 and 25558 -> 11670 flops with JAX 0.10.2)
        assert flops[order, 2] < 0.7 * flops[order, 10 ** 9], flops
    monkeypatch.undo()
    jaxtool.jacobian.clear_caches()
    batch = tuple(a * jnp.linspace(0.5, 1.5, 3, dtype=jnp.float32).reshape((3,) + (1,) * a.ndim) for a in args)
    assert_same_jacobian(jax.jit(jax.vmap(jaxtool.jacve(encoder, argnums=argnums)))(*batch),
                         jax.vmap(jax.jacrev(encoder, argnums=argnums))(*batch), rtol=1e-4, atol=1e-5)
    rng = np.random.default_rng(0)  # second derivatives, of a smaller program with such contractions
    w = jnp.asarray(0.5 * rng.standard_normal((4, 4)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((4, 3)), jnp.float32)
    loss = lambda w, x: jnp.sum(jnp.tanh(w @ jnp.tanh(w @ x)) ** 2)  # noqa: E731
    assert _made_once(jaxtool.jacve(loss, argnums=(0, 1)), w, x) > 0
    assert_same_jacobian(jaxtool.jacve(jaxtool.jacve(loss, argnums=(0, 1)), argnums=(0, 1))(w, x),
                         jax.hessian(loss, argnums=(0, 1))(w, x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("shape, axes", [((4, 3), (0,)), ((3, 5, 2), (0, 2)), ((7,), (0,)), ((1, 4), (0, 1)),
                                         ((6, 8), (1,)), ((2, 0, 3), (0,)), ((5, 3), (1, 0))])
def test_a_sum_of_slices_is_reduce_sum_written_out(shape, axes):
    """A sum written out (halves added, odd terms out at the end) equals ``reduce_sum``, with two
    slices and an addition per halving (one more of each per odd term out) and one reshape for all
    the axes: no ``reduce_sum`` and no reshape per term."""
    x = jnp.asarray(np.random.default_rng(len(shape)).standard_normal(shape), jnp.float32)
    np.testing.assert_allclose(partials._sum_of_slices(x, axes), jnp.sum(x, axes), rtol=1e-6, atol=1e-6)
    eqns = jax.make_jaxpr(lambda x: partials._sum_of_slices(x, axes))(x).jaxpr.eqns
    names = [e.primitive.name for e in eqns]
    assert "reduce_sum" not in names and names.count("squeeze") == 1
    odd = [n % 2 for a in axes for n in _halvings(shape[a])]  # (per halving: whether a term is left out)
    assert names.count("slice") == sum(2 + o for o in odd)
    assert names.count("add") == sum(1 + o for o in odd)


def _halvings(size):
    """The sizes a written-out sum halves along one axis of ``size``, from the largest."""
    while size > 1:
        yield size
        size //= 2


def test_small_sums_and_matrix_vector_products_are_written_out_at_a_point_only():
    """Small sums (the primal's and the elimination's) and matrix-vector products are ``two_forms``
    equations (:mod:`jaxtool.point_forms`): XLA:CPU at a point gets them as sums of slices and
    broadcast products, with no ``dot_general`` or ``reduce`` of their own; under ``jax.vmap`` and
    for other platforms they are the ``dot_general`` and ``reduce`` they were. Jacobians unchanged in
    every order, at a point and batched, and as second derivatives (forward, reverse, and ``jacve``
    of ``jacve``, whose rule for them eliminates the JVP of their batched form)."""
    from jaxtool.point_forms import two_forms_p

    perceptron, args = load_sample("perceptron")
    argnums = tuple(range(8))
    batch = tuple(v * jnp.linspace(0.9, 1.1, 16, dtype=jnp.float32).reshape((16,) + (1,) * v.ndim) for v in args)
    want, want_batched = jax.jacrev(perceptron, argnums)(*args), jax.vmap(jax.jacrev(perceptron, argnums))(*batch)
    for order in ["fwd", "rev", "markowitz"] + random_orders(trace_problem(perceptron, *args, argnums=argnums), 2, 4):
        jacobian = jaxtool.jacve(perceptron, order, argnums)
        assert "two_forms" in str(jax.make_jaxpr(jacobian)(*args)), order
        assert_same_jacobian(jax.jit(jacobian)(*args), want, rtol=1e-5, atol=1e-6)
        assert_same_jacobian(jax.jit(jax.vmap(jacobian))(*batch), want_batched, rtol=1e-5, atol=1e-6)

    def library_calls(lowered) -> tuple:
        text = lowered.as_text()
        return text.count("stablehlo.dot_general"), text.count("stablehlo.reduce(")

    rev = jaxtool.jacve(perceptron, "rev", argnums)
    dots, reductions = library_calls(jax.jit(rev).lower(*args))
    assert dots == 0 and reductions == 1, (dots, reductions)  # (the one left: log_softmax's max)
    on_gpu = jax.jit(rev).trace(*args).lower(lowering_platforms=("cuda",))
    for lowered in (jax.jit(jax.vmap(rev)).lower(*batch), on_gpu):
        dots, reductions = library_calls(lowered)
        assert dots >= 4 and reductions >= 5, (dots, reductions)
    # the primitive itself: eagerly, jitted, batched, differentiated
    x, w = jnp.linspace(-1.0, 1.0, 6, dtype=jnp.float32), jnp.arange(24, dtype=jnp.float32).reshape(4, 6) / 10
    contraction = lambda w, x: partials.dot_general(w, x, (((1,), (0,)), ((), ())))  # noqa: E731
    small_sum = lambda x: partials.reduce_sum(jnp.sin(x), axes=(0,))  # noqa: E731
    assert "two_forms" in str(jax.make_jaxpr(contraction)(w, x)) and "two_forms" in str(jax.make_jaxpr(small_sum)(x))
    cases = ((contraction, lambda w, x: w @ x, (w, x)), (small_sum, lambda x: jnp.sin(x).sum(), (x,)))
    for fun, reference, operands in cases:
        for f in (fun, jax.jit(fun)):
            np.testing.assert_allclose(f(*operands), reference(*operands), rtol=1e-6)
            np.testing.assert_allclose(jax.jacfwd(f)(*operands), jax.jacfwd(reference)(*operands), rtol=1e-6)
            np.testing.assert_allclose(jax.jacrev(f)(*operands), jax.jacrev(reference)(*operands), rtol=1e-6)
        stacked = tuple(jnp.stack([v, 2 * v]) for v in operands)
        np.testing.assert_allclose(jax.vmap(fun)(*stacked), jax.vmap(reference)(*stacked), rtol=1e-6)
    assert two_forms_p.bind(x, forms=partials._WrittenSum((0,), (), np.dtype(np.float32))).shape == ()
    loss = lambda x, W1: perceptron(x, args[1], W1, *args[3:])  # noqa: E731
    hessian = jax.hessian(loss, (0, 1))(args[0], args[2])
    inner = jaxtool.jacve(loss, "rev", (0, 1))
    for second in (jaxtool.jacve(inner, "fwd", (0, 1)), jax.jacfwd(inner, (0, 1)), jax.jacrev(inner, (0, 1))):
        assert_same_jacobian(jax.jit(second)(args[0], args[2]), hessian, rtol=1e-4, atol=1e-5)
    jax.extend.core.check_jaxpr(jax.make_jaxpr(inner)(args[0], args[2]).jaxpr)


def test_sines_several_equations_read_are_computed_once_where_large(monkeypatch):
    """Sines, cosines and tangents that several equations of a staged Jacobian read pass through
    ``computed_once`` (:mod:`jaxtool.sharing`): XLA:CPU copies them into every kernel that reads
    them otherwise. Where they are large (under ``jax.vmap``, or arrays of ONCE_SIZE elements) each
    is computed once: XLA's count of transcendental functions is at most the primal's per point,
    where it is over 10 times that without. Small ones are left to XLA (the same compiled flops)."""
    from jaxtool import sharing

    robot, args = load_sample("robot_arm_6dof")
    argnums = tuple(range(6))
    batch = tuple(v * jnp.linspace(0.9, 1.1, 1024, dtype=jnp.float32) for v in args)
    transcendental = {"sin", "cos", "tan", "atan2", "sqrt", "rsqrt", "exp", "log"}
    per_point = sum(e.primitive.name in transcendental for e in jax.make_jaxpr(robot)(*args).jaxpr.eqns)

    def compiled(fun, *xs):
        jaxtool.jacobian.clear_caches()
        jax.clear_caches()
        return jax.jit(fun).lower(*xs).compile()

    want = jax.vmap(jax.jacrev(robot, argnums=argnums))(*batch)
    for order in ["fwd", "rev", "markowitz"] + random_orders(trace_problem(robot, *args, argnums=argnums), 1, seed=5):
        batched = jax.vmap(jaxtool.jacve(robot, order=order, argnums=argnums))
        assert "computed_once" in str(jax.make_jaxpr(batched)(*batch)), order
        assert_same_jacobian(jax.jit(batched)(*batch), want, rtol=1e-4, atol=1e-5)
        if order == "rev":
            at_point = jaxtool.jacve(robot, order=order, argnums=argnums)
            once = compiled(batched, *batch).cost_analysis()["transcendentals"]
            point = compiled(at_point, *args).cost_analysis()["flops"]
            with monkeypatch.context() as m:
                m.setattr(sharing, "DEAR", ())
                copied = compiled(batched, *batch).cost_analysis()["transcendentals"]
                assert compiled(at_point, *args).cost_analysis()["flops"] == point
            assert once <= 1024 * per_point < copied / 10, (order, once, copied)
    jaxtool.jacobian.clear_caches()
    # an array that large at a point; second derivatives, through vmap; other platforms
    wave = lambda x: jnp.sin(x) * x[::-1] + jnp.cos(x) ** 2 + jnp.tan(0.5 * x) * jnp.sin(x)  # noqa: E731
    x = jnp.linspace(-1.0, 1.0, sharing.ONCE_SIZE, dtype=jnp.float32)
    assert_same_jacobian(jax.jit(jaxtool.jacve(wave))(x), jax.jacrev(wave)(x), rtol=1e-5, atol=1e-6)
    assert compiled(jaxtool.jacve(wave), x).cost_analysis()["transcendentals"] <= 3 * x.size
    scalar = lambda a, b: jnp.sin(a * b) * jnp.cos(a) + jnp.tan(b) * jnp.sin(a * b)  # noqa: E731
    a, b = jnp.linspace(0.1, 1.0, 1024, dtype=jnp.float32), jnp.linspace(-0.5, 0.5, 1024, dtype=jnp.float32)
    for second in (jaxtool.jacve(jaxtool.jacve(scalar, argnums=(0, 1)), argnums=(0, 1)),
                   jax.jacfwd(jaxtool.jacve(scalar, argnums=(0, 1)), argnums=(0, 1)),
                   jax.jacrev(jaxtool.jacve(scalar, argnums=(0, 1)), argnums=(0, 1))):
        assert_same_jacobian(jax.jit(jax.vmap(second))(a, b), jax.vmap(jax.hessian(scalar, argnums=(0, 1)))(a, b),
                             rtol=1e-4, atol=1e-5)
    jax.extend.core.check_jaxpr(jax.make_jaxpr(jax.vmap(jaxtool.jacve(robot, argnums=argnums)))(*batch).jaxpr)
    on_gpu = jax.jit(jax.vmap(jaxtool.jacve(robot, argnums=argnums))).trace(*batch).lower(lowering_platforms=("cuda",))
    assert "gather" not in on_gpu.as_text()


#: scatter-adds and gathers with indices known while tracing (closed-over NumPy arrays, index arithmetic on them)
RNG_INDEX = np.random.default_rng(3)
GATHER, SEGMENT = RNG_INDEX.integers(0, 25, 60), RNG_INDEX.integers(0, 10, 60)
KNOWN_INDICES = {
    "gather then segment_sum": lambda x: jax.ops.segment_sum(jnp.sin(x)[GATHER], SEGMENT, 10),
    "scatter-add dropping out of bounds": lambda x: jnp.zeros(5).at[np.array([0, 2, 2, 7])].add(x[:4] ** 2, mode="drop"),
    "scatter-add into a matrix row": lambda x: jnp.zeros((3, 4)).at[np.array([0, 2, 0]), 1].add(x[:3]) * x[3],
    "scatter-add into the operand": lambda x: x.at[np.array([1, 1, 1, -2])].add(x[:4] * x[5]),
    "more than MAX_PARTS into one element": lambda x: jnp.zeros(2).at[np.zeros(x.size, int)].add(x),
    "negative gather indices": lambda x: jnp.exp(x)[np.array([-1, -3, 0, 4])] * x[:4],
    "interp on a constant grid": lambda x: jnp.interp(jnp.linspace(0.0, 1.0, 7), jnp.linspace(0.0, 1.0, 25), jnp.sin(x)),
    "triu mask from iota": lambda x: jnp.triu(jnp.exp(x.reshape(5, 5))),
    # integer products of constants (mul has an out_dtype param NumPy does not take: a raw TypeError)
    "strided indices": lambda x: jnp.sin(x[jnp.arange(0, 25, 3)]) * x[2 * jnp.arange(9) + 1],
    "mask product": lambda x: x * ((jnp.arange(25) % 2) * (jnp.arange(25) > 2)),
    # floats cast to indices as XLA casts them: saturated, NaN to 0 (NumPy wrapped: another element)
    "saturating index casts": lambda x: x[jnp.clip(jnp.asarray(np.array([np.nan, 1e10, -1e10, 2.0, -3.7], np.float32))
                                                   .astype(jnp.int32), 0, 24)]
    * x[jnp.minimum(jnp.asarray(np.array([-3.0, 2.0, 300.0, 7.9, np.nan], np.float32)).astype(jnp.uint8), 24)],
    # integer rem as XLA computes it: x rem 0 = x (NumPy's fmod gave 0: another element), INT_MIN rem -1 = 0
    "rem of indices by zero": lambda x: x[lax.rem(jnp.array([5, -7, 3, -2**31]), jnp.array([0, 0, 2, -1]))] ** 2,
    # stack and unstack (primitives of their own since JAX 0.10) are selections, and integer stacks known
    "stack and unstack": lambda x: jnp.stack([jnp.sin(x[:5]), x[5:10] * x[:5]], axis=1)[::2]
    * jnp.unstack(x.reshape(5, 5), axis=1)[3][:3, None],
    "stacked indices": lambda x: jnp.exp(x.reshape(5, 5))[tuple(jnp.stack([jnp.arange(4), jnp.arange(4)[::-1]]))],
}


def _largest_value(jaxpr) -> int:
    """The most elements of any value ``jaxpr`` (and the jaxprs in its params) computes."""
    sizes = [int(np.prod(v.aval.shape)) for e in jaxpr.eqns for v in e.outvars]
    nested = [_largest_value(p.jaxpr) for e in jaxpr.eqns for p in e.params.values() if hasattr(p, "jaxpr")]
    return max(sizes + nested, default=0)


def test_selections_of_rows_with_a_dense_block_each_are_not_densified_over_all_rows():
    # graph message passing: a gather of edge rows, a per-row matrix product, a scatter-add onto
    # nodes (some edges dropped). The products of the gather or scatter with the matrix product's
    # partial (paired rows, an 8x8 block each) formed it dense over all of its rows first, (E*D)^2
    # entries, then gathered or scattered (200 nodes, 1000 edges: 64M entries, 4-9x jax.jacrev's
    # time); now at most the dense (E*D) x (N*D) block the elimination stores
    rng = np.random.default_rng(0)
    n, e, d = 12, 40, 3
    src, dst = rng.integers(0, n, e), np.where(np.arange(e) % 7 == 3, n + 2, rng.integers(0, n, e))
    w = jnp.asarray(rng.standard_normal((d, d)), jnp.float32)
    h = jnp.asarray(rng.standard_normal((n, d)), jnp.float32)
    for f in (lambda x: jnp.zeros_like(x).at[dst].add(jnp.tanh(x[src] @ w), mode="drop"),
              lambda x: jnp.sum(jnp.zeros_like(x).at[dst].add(x[src] @ w, mode="drop") ** 2, axis=1)):
        want = jax.jacrev(f)(h)
        assert_orders_match(f, (h,), 0, want, lambda p: ["fwd", "rev", "markowitz"] + random_orders(p, 3, seed=2),
                            rtol=1e-5, atol=1e-6, staged=True)
        for order in ("fwd", "rev", "markowitz"):
            assert _largest_value(jax.make_jaxpr(jaxtool.jacve(f, order=order))(h).jaxpr) <= e * d * n * d, order


def test_known_indices_are_known_under_jit():
    # under jax.jit the index arithmetic (wrapping negative indices) is computed while tracing, so a
    # gather followed by a segment_sum stays a few selections: one value per update, not n_out x n_in
    gathered, segment = np.arange(3000) % 2000, np.arange(3000) % 500
    fun = lambda x: jax.ops.segment_sum(jnp.sin(x)[gathered], segment, 500)  # noqa: E731
    x = jnp.linspace(0.0, 1.0, 2000)
    seen = []

    def staged(x):
        problem = trace_problem(fun, x)
        run(problem, resolve_order("rev", problem))
        (partial,) = problem.graph.preds[problem.outputs[0]].values()
        seen.append(partial)
        return x

    jax.jit(staged)(x)
    (partial,) = seen
    # output o adds updates o, o + 500, ..., o + 2500, which gather x[o], x[o + 500], x[o + 1000],
    # x[o + 1500], x[o], x[o + 500]: four selections, those reading one element merged
    assert isinstance(partial, Linear) and len(partial.parts) == 4 and partial.stored == 4 * 500


def _bilinear(img, pts):
    """Bilinear sampling of ``img`` at ``pts``: four gathers at indices computed from the values (floor)."""
    h, w = img.shape
    x, y = pts[:, 0], pts[:, 1]
    x0, y0 = jnp.floor(x), jnp.floor(y)
    wx, wy = x - x0, y - y0
    xi, yi = jnp.clip(x0.astype(jnp.int32), 0, w - 2), jnp.clip(y0.astype(jnp.int32), 0, h - 2)
    top = (1 - wx) * img[yi, xi] + wx * img[yi, xi + 1]
    return (1 - wy) * top + wy * ((1 - wx) * img[yi + 1, xi] + wx * img[yi + 1, xi + 1])


def _equations(jaxpr):
    """The equations of ``jaxpr`` and of the jaxprs in its params."""
    for e in jaxpr.eqns:
        yield e
        for _, _, sub in subjaxprs(e.params):
            yield from _equations(sub)


def test_selections_at_run_time_indices_are_written_by_their_index():
    # bilinear sampling: the gathers' indices come from floor(pts), so each partial is a selection
    # whose index is known only at run time. Densified (or pulled back) row by row, each was a
    # scatter of an identity block, a window of 300 per row (300 points of a 32x32 image: 7 ms in
    # every order, jax.jacfwd 0.9 ms); now the index is computed once (the gather run on int32
    # element numbers), and the entries are scattered one by one: at most 4 per point
    rng = np.random.default_rng(0)
    img = jnp.asarray(rng.standard_normal((8, 9)), jnp.float32)
    pts = jnp.asarray(rng.uniform(0.3, 8.6, (40, 2)), jnp.float32)  # some clipped at the border
    want = jax.jacrev(_bilinear, argnums=(0, 1))(img, pts)
    assert_orders_match(_bilinear, (img, pts), (0, 1), want,
                        lambda p: ["fwd", "rev", "markowitz"] + random_orders(p, 4, seed=7), rtol=1e-5, atol=1e-6,
                        staged=True)
    for order in ("fwd", "rev", "markowitz"):
        jaxpr = jax.make_jaxpr(jaxtool.jacve(_bilinear, order=order, argnums=(0, 1)))(img, pts).jaxpr
        scatters = [e for e in _equations(jaxpr) if e.primitive is lax.scatter_add_p]
        assert scatters and all(not e.params["dimension_numbers"].update_window_dims for e in scatters), order
        # entries a few per point (4 on the image side; the pts side's selections of known index add up to
        # 9 in some orders), where a window of rows per gather was 40 per point each
        assert sum(int(np.prod(e.invars[2].aval.shape)) for e in scatters) <= 16 * 40, order


#: gathers and other selections whose indices are computed from the values (known only at run time)
RUN_TIME_INDICES = {
    "bilinear": lambda x: _bilinear(jnp.sin(x.reshape(5, 5)), jnp.stack([x[:6] * 5, x[6:12] * 4], axis=1)),
    "gather, out of bounds filled": lambda x: jnp.sin(x).at[(x * 30).astype(int) - 10].get(mode="fill",
                                                                                          fill_value=3.0) * x,
    "gather, out of bounds clipped": lambda x: x.at[(x * 30).astype(int) - 10].get(mode="clip") ** 2,
    "repeated indices, summed": lambda x: jnp.exp(x)[(x * 7).astype(int) % 3] + x[(x * 11).astype(int) % 3] * x[::-1],
    "sort and argsort": lambda x: jnp.sort(x * x[::-1]) + jnp.sin(x)[jnp.argsort(jnp.cos(7 * x))] * 2,
    "argmax element": lambda x: x[jnp.argmax(jnp.sin(9 * x))] * jnp.tanh(x),
    "dynamic slice at a computed start": lambda x: lax.dynamic_slice(jnp.exp(x), (jnp.argmin(jnp.cos(5 * x)),), (7,))
    * x[:7],
    "update at a computed start": lambda x: lax.dynamic_update_slice(jnp.sin(x), x[:4] ** 2,
                                                                     (jnp.argmax(x * x[::-1]),)),
    "take along rows": lambda x: jnp.take_along_axis(jnp.exp(x.reshape(5, 5)), jnp.argsort(jnp.cos(x.reshape(5, 5)),
                                                                                            axis=1), axis=1) @ x[:5],
    "max pool": lambda x: lax.reduce_window(jnp.sin(3 * x.reshape(5, 5)), -jnp.inf, lax.max, (2, 2), (1, 1), "VALID"),
    "gather of a matrix product": lambda x: (x.reshape(5, 5) @ x.reshape(5, 5))[(x[:8] * 6).astype(int) % 5] * x[:5],
    "selections times a dense block": lambda x: jnp.outer(x[(x * 9).astype(int) % 25], x[:3]).sum(0) * x[3:6],
    "no output elements": lambda x: jnp.sin(x)[(x[:0] * 3).astype(int)],
}


@pytest.mark.parametrize("name", sorted(RUN_TIME_INDICES))
def test_selections_at_run_time_indices_match_jacrev(name):
    fun = RUN_TIME_INDICES[name]
    x = jnp.linspace(0.2, 1.5, 25)
    want = jax.jacrev(fun)(x)
    assert_orders_match(fun, (x,), 0, want, lambda p: ["fwd", "rev", "markowitz"] + random_orders(p, 4, seed=11),
                        rtol=1e-5, atol=1e-6, staged=True)
    assert_same_jacobian(jax.jit(jaxtool.jacve(fun, order="markowitz"))(x), want, rtol=1e-5, atol=1e-6)


def test_run_time_indices_differ_per_batch_element_and_have_second_derivatives():
    # under vmap each batch element gathers at its own indices; the indices are integers computed
    # from the values, with no derivative of their own, so jacve of jacve is jax.hessian
    fun = RUN_TIME_INDICES["bilinear"]
    batch = jnp.stack([jnp.linspace(0.2, 1.5, 25), jnp.linspace(1.4, 0.1, 25), jnp.linspace(0.3, 0.9, 25) ** 2])
    hessian = jax.hessian(fun)(batch[1])
    for order in ("fwd", "rev", "markowitz"):
        np.testing.assert_allclose(jax.jit(jax.vmap(jaxtool.jacve(fun, order)))(batch),
                                   jax.vmap(jax.jacrev(fun))(batch), rtol=1e-5, atol=1e-6, err_msg=order)
        np.testing.assert_allclose(jaxtool.jacve(jaxtool.jacve(fun, order), order)(batch[1]), hessian,
                                   rtol=1e-4, atol=1e-5, err_msg=order)
    jax.extend.core.check_jaxpr(jax.make_jaxpr(jaxtool.jacve(fun))(batch[0]).jaxpr)


def test_infinite_partials_before_a_selection_at_run_time_indices_stay_on_their_paths():
    # sqrt'(0) = inf is sorted to output 0; no other output reads element 0. Densified row by row,
    # the infinite scale times the zero cotangent of every other row made row 0 NaN off its path
    # (as jax.jacfwd gives it) in every order; written by its index, entries with no path stay 0
    f = lambda v: jnp.sqrt(v)[jnp.argsort(v)] * 2  # noqa: E731
    x = jnp.array([0.0, 1.2, 4.0, 0.5])
    want = np.asarray(jax.jacrev(f)(x))  # NaN off the path in column 0 (0 * inf), the rest as here
    want = np.where(np.isnan(want), 0.0, want)
    assert want[0, 0] == np.inf and np.count_nonzero(want) == 4
    for order in ("fwd", "rev", "markowitz"):
        np.testing.assert_allclose(jaxtool.jacve(f, order=order)(x), want, rtol=1e-6, err_msg=order)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float64", "complex64"])
def test_run_time_indices_are_exact_in_every_dtype(dtype):
    # the index is read from the gather run on int32 element numbers (or, for a selection JAX's JVP
    # makes, from the bits of the element numbers that selection moves): exact in bfloat16 too, whose
    # numbers are exact only below 256 (a 20 x 20 image has 400 elements), and on the (real,
    # imaginary) pairs of a complex image (800 elements)
    rng = np.random.default_rng(1)
    with jax.enable_x64(dtype == "float64"):
        real = "float32" if dtype == "complex64" else dtype
        img = jnp.asarray(rng.standard_normal((20, 20)), real)
        pts = jnp.asarray(rng.uniform(0.3, 19.6, (30, 2)), real)
        if dtype == "complex64":
            f = lambda m, p: jnp.abs(_bilinear(m.astype(jnp.complex64) * (1 - 2j), p))  # noqa: E731
        else:
            f = lambda m, p: _bilinear(m, p) * 3  # noqa: E731
        want = jax.jacrev(f, argnums=(0, 1))(img, pts)
        tolerance = 1e-2 if dtype in ("bfloat16", "float16") else 1e-5
        for order in ("fwd", "rev", "markowitz"):
            assert_same_jacobian(jax.jit(jaxtool.jacve(f, order, argnums=(0, 1)))(img, pts), want,
                                 rtol=tolerance, atol=tolerance)


def test_float16_and_bfloat16_partials_multiply_in_float32_as_jax_promotes_them():
    """A float16 partial times a bfloat16 one: NumPy has no common type of the two (its
    ``result_type`` raised), JAX promotes them to float32. Found fuzzing with float16 inputs."""
    f = lambda x: (jnp.tanh(x) * x).astype(jnp.bfloat16) * 2  # noqa: E731
    g = lambda x: jnp.exp(jnp.sin(x).astype(jnp.bfloat16)) * jnp.cos(x).astype(jnp.bfloat16)  # noqa: E731
    x = jnp.asarray([0.3, -1.2, 0.5], jnp.float16)
    for fun in (f, g):
        want = jax.jacrev(fun)(x)
        for order in ("fwd", "rev", "markowitz"):
            got = jaxtool.jacve(fun, order)(x)
            assert got.dtype == want.dtype
            np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2e-2, atol=2e-2)


def test_sums_of_selections_compose_with_vmap_and_second_derivatives():
    f = lambda x: jnp.tanh(jnp.diff(jnp.sin(x)) + x[1:] * x[:-1]) + jnp.roll(x, 2)[1:]  # noqa: E731
    batch = jnp.linspace(0.1, 1.3, 12).reshape(3, 4)
    hessian = jax.jacfwd(jax.jacrev(f))(batch[0])
    for order in ("fwd", "rev", "markowitz"):
        np.testing.assert_allclose(jax.jit(jax.vmap(jaxtool.jacve(f, order)))(batch), jax.vmap(jax.jacrev(f))(batch),
                                   rtol=1e-5, atol=1e-6)
        for outer in (jax.jacfwd, jax.jacrev, lambda g: jaxtool.jacve(g, order)):
            np.testing.assert_allclose(outer(jaxtool.jacve(f, order))(batch[0]), hessian, rtol=1e-5, atol=1e-6)
    jax.extend.core.check_jaxpr(jax.make_jaxpr(jaxtool.jacve(f))(batch[0]).jaxpr)


# --- structure


def test_elementwise_chain_of_a_million_stays_diagonal():
    n = 1_000_000
    f = lambda x: jnp.tanh(jnp.exp(jnp.sin(x) * 2.0) + x)  # noqa: E731
    problem = trace_problem(f, jnp.linspace(0.0, 1.0, n))
    run(problem, resolve_order("rev", problem))
    partial = problem.graph.preds[problem.outputs[0]][-1]
    assert isinstance(partial, Sparse) and partial.pairs == (0,)
    assert partial.stored == n  # one value per element, never n*n


def test_complex_elementwise_chain_stays_block_diagonal():
    # x -> x (1+2j) -> exp(.) -> conj -> abs: per element a 2x1, 2x2, 2x2 and 1x2 block
    n = 100_000
    f = lambda x: jnp.abs(jnp.conj(jnp.exp(x * (1.0 + 2.0j))))  # noqa: E731
    x = jnp.linspace(-1.0, 1.0, n)
    problem = trace_problem(f, x)
    assert all(isinstance(p, Sparse) for preds in problem.graph.preds.values() for p in preds.values())
    run(problem, resolve_order("fwd", problem))
    partial = problem.graph.preds[problem.outputs[0]][-1]
    assert isinstance(partial, Sparse) and partial.pairs == (0,) and partial.stored == n
    small = x[:7]
    np.testing.assert_allclose(jaxtool.jacve(f, order="fwd")(small), jax.jacrev(f)(small), rtol=1e-5, atol=1e-6)


def test_opaque_vertices_are_listed():
    for name in STRUCTURED_COMPLEX:  # elementwise and structural equations on complex values
        assert trace_problem(COMPLEX_CASES[name], X).opaque == (), name
    assert {n for _, n in trace_problem(COMPLEX_CASES["fft_power"], X).opaque} == {"fft"}
    problem = trace_problem(_complex_scan, X)
    assert {name for _, name in problem.opaque} == {"scan"}  # its carry and its stacked outputs
    assert all(v in problem.eliminable or v in problem.outputs for v, _ in problem.opaque)
    assert trace_problem(lambda x: jnp.sin(x) * x, X).opaque == ()


def _rnn(w_h, w_x, b, xs):
    def cell(h, x):
        return jnp.tanh(h @ w_h + x @ w_x + b), None

    return lax.scan(cell, jnp.zeros(b.shape, b.dtype), xs)[0]


def _count_primitive(closed, name) -> int:
    count = 0
    for eqn in closed.jaxpr.eqns:
        count += eqn.primitive.name == name
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", param if hasattr(param, "eqns") else None)
            if inner is not None:
                count += _count_primitive(jax.extend.core.ClosedJaxpr(getattr(inner, "jaxpr", inner), []), name)
    return count


def test_an_opaque_equation_is_pulled_back_once_for_all_its_inputs():
    rng = np.random.default_rng(3)
    args = tuple(jnp.asarray(rng.standard_normal(s), jnp.float32) * 0.5 for s in ((4, 4), (3, 4), (4,), (5, 3)))
    for fun in (_rnn, lambda *a: jnp.sum(jnp.tanh(_rnn(*a)) ** 2)):  # the scan as output; as an intermediate
        want = jax.jacrev(fun, argnums=(0, 1, 2, 3))(*args)
        for order in ("rev", "markowitz", "fwd"):
            got = jaxtool.jacve(fun, order=order, argnums=(0, 1, 2, 3))(*args)
            assert_same_jacobian(got, want, rtol=1e-4, atol=1e-5)
        # the primal scan, the VJP's forward scan and ONE transposed scan, not one per input
        jaxpr = jax.make_jaxpr(jaxtool.jacve(fun, order="rev", argnums=(0, 1, 2, 3)))(*args)
        assert _count_primitive(jaxpr, "scan") == 3
    # a while loop has no reverse rule: each partial is still applied through its own JVP
    def loop(x, y):
        return lax.while_loop(lambda c: c[1] < 3, lambda c: (jnp.sin(c[0]) * y, c[1] + 1), (x, 0))[0]
    x, y = jnp.linspace(0.1, 0.5, 3), jnp.linspace(-0.3, 0.2, 3)
    assert_same_jacobian(jaxtool.jacve(loop, order="rev", argnums=(0, 1))(x, y),
                         jax.jacfwd(loop, argnums=(0, 1))(x, y), rtol=1e-4, atol=1e-5)



def test_an_opaque_equation_after_a_diagonal_is_still_pulled_back_once():
    # rates = exp(log_rates) feed an ODE scan: that partial after exp's diagonal was densified by its
    # own JVP (a scan of its columns) besides the equation's joint VJP that every other input's block
    # came from (mass-action kinetics, 100 Euler steps: 610 -> 470 us, one CPU, interleaved)
    def kinetics(log_rates, c0):
        k = jnp.exp(log_rates)

        def step(c, _):
            return c + 0.01 * (k[0] * c - k[1] * c ** 2 + k[2] * jnp.roll(c, 1)), None

        return lax.scan(step, c0, None, length=50)[0]

    args = (jnp.asarray([0.1, -0.2, 0.3], jnp.float32), jnp.linspace(0.5, 1.5, 5, dtype=jnp.float32))
    # the VJP's forward scan and its transposed scan, no JVP's scan; the primal's too where it is used
    for fun, loops in ((kinetics, 2), (lambda p, c: kinetics(2.0 * jnp.sin(p), c), 2),  # diagonals after diagonals
                       (lambda p, c: jnp.tanh(kinetics(p, c)) ** 2, 3)):  # rows pulled back through the scan
        want = jax.jacrev(fun, argnums=(0, 1))(*args)
        for order in ("fwd", "rev", "markowitz"):
            got = jaxtool.jacve(fun, order=order, argnums=(0, 1))(*args)
            assert_same_jacobian(got, want, rtol=1e-4, atol=1e-5)
            compiled = jax.jit(jaxtool.jacve(fun, order=order, argnums=(0, 1))).lower(*args).compile()
            assert compiled.as_text().count(" while(") == loops, order


def _triangular_solves(fun, args) -> int:
    text = jax.jit(fun).lower(*args).as_text()
    return text.count("lapack_strsm") + text.count("stablehlo.triangular_solve")


def test_opaque_partials_scaled_and_transposed_alike_share_one_vjp():
    # solve(a, b) is a custom_linear_solve of b.T whose result jnp.linalg.solve transposes back; its
    # partials with respect to a and b reach their densification scaled by tanh' (and by 2, and
    # transposed once or twice more): each was pulled back by a VJP of its own, 6 triangular solves
    # where jax.jacrev has 4, and past XLA's cost line of 1000 flops (1082; jax.jacrev: 968) the call
    # was handed to a worker thread: 27.7 us against jax.jacrev's 14.2 (one CPU). One VJP: 14.0 us.
    rng = np.random.default_rng(1)
    a = jnp.asarray(rng.standard_normal((4, 4)) + 3 * np.eye(4), jnp.float32)
    b = jnp.asarray(rng.standard_normal((4, 2)), jnp.float32)
    programs = [(lambda a, b: jnp.tanh(jnp.linalg.solve(a, b)), (a, b)),
                (lambda a, b: jnp.tanh(jnp.linalg.solve(a, b.T).T) * 2.0, (a, b.T))]
    for fun, args in programs:
        want = jax.jacrev(fun, argnums=(0, 1))(*args)
        problem = trace_problem(fun, *args, argnums=(0, 1))
        for order in ["fwd", "rev", "markowitz"] + random_orders(problem, 3, seed=2):
            assert_same_jacobian(jax.jit(jaxtool.jacve(fun, order, (0, 1)))(*args), want, rtol=1e-4, atol=1e-5)
            assert _triangular_solves(jaxtool.jacve(fun, order, (0, 1)), args) == \
                _triangular_solves(jax.jacrev(fun, argnums=(0, 1)), args), order


def test_ffts_and_lapack_calls_in_one_program_run():
    # a sum written out as slices linked an FFT to a cholesky's LAPACK call, and XLA:CPU gave the
    # FFT's operand the call's column-major layout, then stopped at run time (RET_CHECK in
    # fft_thunk.cc; fuzz seed 121722); such programs keep reduce_sum and dot_general
    def program(x):
        y = jnp.real(jnp.fft.ifft(jnp.fft.fft(x) * jnp.conj(jnp.fft.fft(jnp.sin(x)))))
        return jnp.linalg.cholesky((1.0 + jnp.tanh(jax.nn.logsumexp(y, keepdims=True))) ** 2)

    x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 2)), jnp.float32)
    want = jax.jacrev(program)(x)
    for order in ("fwd", "rev", "markowitz"):
        assert_same_jacobian(jax.jit(jaxtool.jacve(program, order))(x), want, rtol=1e-4, atol=1e-5)
        assert_same_jacobian(jaxtool.jacve(program, order)(x), want, rtol=1e-4, atol=1e-5)


def test_transposes_after_an_opaque_equation_compose():
    # the rows of a cond's 3-D result, transposed three times, scaled by tanh' and 1.5 on the way:
    # the one VJP takes them laid out as the cond's result (the transposes composed)
    def program(x, y):
        z = lax.cond(x[0, 0, 0] > 0, lambda x, y: jnp.sin(x) * y, lambda x, y: x + y, x, y)
        z = jnp.transpose(jnp.tanh(jnp.transpose(z, (1, 2, 0))), (2, 0, 1)) * 1.5
        return jnp.transpose(z, (1, 0, 2))

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2, 3, 4)), jnp.float32).at[0, 0, 0].set(1.0)
    y = jnp.asarray(rng.standard_normal((2, 3, 4)), jnp.float32)
    want = jax.jacrev(program, argnums=(0, 1))(x, y)
    problem = trace_problem(program, x, y, argnums=(0, 1))
    for order in ["fwd", "rev", "markowitz"] + random_orders(problem, 3, seed=3):
        assert_same_jacobian(jaxtool.jacve(program, order, (0, 1))(x, y), want, rtol=1e-5, atol=1e-6)


def test_an_input_an_opaque_equation_reads_twice_or_through_a_selection_is_pulled_back_once():
    # a Chebyshev recurrence reads x as a constant and as a carry, and c through a slice: the sum of
    # x's two partials and the slice's composition each densified by their own JVP or VJP scans
    # (300 points, 16 coefficients: 2.7 ms in rev order, 1.8 ms as one VJP; jax.jacrev 1.8 ms)
    def chebyshev(c, x):
        def step(carry, ci):
            t0, t1, acc = carry
            t2 = 2 * x * t1 - t0
            return (t1, t2, acc + ci * t2), None

        return lax.scan(step, (jnp.ones_like(x), x, x * c[0]), c[1:])[0][2]

    args = (jnp.linspace(-0.3, 0.3, 6, dtype=jnp.float32), jnp.linspace(-0.9, 0.9, 7, dtype=jnp.float32))
    want = jax.jacrev(chebyshev, argnums=(0, 1))(*args)
    problem = trace_problem(chebyshev, *args, argnums=(0, 1))
    for order in ["fwd", "rev", "markowitz"] + random_orders(problem, 3, seed=5):
        got = jaxtool.jacve(chebyshev, order=order, argnums=(0, 1))(*args)
        assert_same_jacobian(got, want, rtol=1e-5, atol=1e-5)
    for order in ("fwd", "rev", "markowitz"):
        compiled = jax.jit(jaxtool.jacve(chebyshev, order=order, argnums=(0, 1))).lower(*args).compile()
        assert compiled.as_text().count(" while(") == 2, order  # the VJP's forward and transposed scans


def _damped_pendulum(th0, w0, g, length, damping):
    def body(i, state):
        th, w = state
        w = w + 0.01 * (-g / length * jnp.sin(th) - damping * w)
        return th + 0.01 * w, w

    return jnp.stack(lax.fori_loop(0, 300, body, (th0, w0)))


def test_elements_of_a_loops_results_are_pulled_back_once_for_all_inputs():
    # the angle of a damped pendulum (300 steps of a fori_loop, a scan, over angle and velocity; five
    # scalars) is a selection of the stacked pair after the loop: each input's block was densified by
    # a VJP of its own, 10 forward and 10 transposed scans (62-91 us against jax.jacrev's 22-23, one
    # CPU). Through the selection the loop's one VJP serves every input (22-24 us); the velocity's path
    # (its place in the stack, which the slice leaves out) selects nothing and is dropped. Where both
    # reach the output, one VJP of both results serves them (the stack: 36-38 us, as jax.jacrev's).
    args = tuple(jnp.float32(v) for v in (0.5, 0.0, 9.8, 1.0, 0.1))
    argnums = (0, 1, 2, 3, 4)
    programs = [(lambda *a: _damped_pendulum(*a)[0], 0),  # as many scans as jax.jacrev
                (_damped_pendulum, 0),
                (lambda *a: jnp.tanh(_damped_pendulum(*a)[::-1]) * 2.0, 1)]  # (scaled and reversed: one more)
    for fun, more in programs:
        want = jax.jacrev(fun, argnums=argnums)(*args)
        problem = trace_problem(fun, *args, argnums=argnums)
        for order in ["fwd", "rev", "markowitz"] + random_orders(problem, 3, seed=7):
            assert_same_jacobian(jaxtool.jacve(fun, order, argnums)(*args), want, rtol=1e-4, atol=1e-5)
        loops = jax.jit(jax.jacrev(fun, argnums=argnums)).lower(*args).compile().as_text().count(" while(")
        for order in ("fwd", "rev", "markowitz"):
            compiled = jax.jit(jaxtool.jacve(fun, order, argnums)).lower(*args).compile()
            assert compiled.as_text().count(" while(") <= loops + more, order

#: every elementwise primitive the engine's issue names, applied where its derivative is finite:
#: (lax function, map of an input in (-1, 1) into its domain); each must keep a diagonal partial
ELEMENTWISE_PRIMITIVES = {
    "abs": (lax.abs, lambda x: x + 0.05), "sign": (lax.sign, lambda x: x + 0.05), "exp": (lax.exp, None),
    "exp2": (lax.exp2, None), "expm1": (lax.expm1, None), "log": (lax.log, lambda x: x + 1.5),
    "log1p": (lax.log1p, None), "sin": (lax.sin, None), "cos": (lax.cos, None), "tan": (lax.tan, None),
    "asin": (lax.asin, lambda x: 0.9 * x), "acos": (lax.acos, lambda x: 0.9 * x), "atan": (lax.atan, None),
    "sinh": (lax.sinh, None), "cosh": (lax.cosh, None), "tanh": (lax.tanh, None), "asinh": (lax.asinh, None),
    "acosh": (lax.acosh, lambda x: x + 2.0), "atanh": (lax.atanh, lambda x: 0.9 * x),
    "logistic": (lax.logistic, None), "sqrt": (lax.sqrt, lambda x: x + 1.5), "rsqrt": (lax.rsqrt, lambda x: x + 1.5),
    "cbrt": (lax.cbrt, lambda x: x + 1.5), "integer_pow": (lambda x: lax.integer_pow(x, 3), None),
    "square": (lax.square, None), "erf": (lax.erf, None), "erfc": (lax.erfc, None),
    "erf_inv": (lax.erf_inv, lambda x: 0.9 * x),
}


@pytest.mark.parametrize("name", sorted(ELEMENTWISE_PRIMITIVES))
def test_every_elementwise_primitive_is_diagonal_and_matches_jacrev(name):
    op, into_domain = ELEMENTWISE_PRIMITIVES[name]
    x = jnp.linspace(-0.9, 0.9, 5, dtype=jnp.float32)

    def fun(x):
        y = op(into_domain(x) if into_domain else x)
        return y * x  # the primitive's partial meets a second path to x

    problem = trace_problem(fun, x)
    assert name in {e.primitive.name for e in problem.program.eqns}
    assert all(isinstance(partial, Sparse) and partial.pairs == (0,)
               for preds in problem.graph.preds.values() for partial in preds.values())
    want = jax.jacrev(fun)(x)
    assert_orders_match(fun, (x,), 0, want, lambda p: ["fwd", "rev", "markowitz"] + random_orders(p, 2, 0),
                        rtol=1e-4, atol=1e-5)
    binary = {"pow": lambda x: lax.pow(x + 1.5, jnp.cos(x)), "atan2": lambda x: lax.atan2(x, x * x + 0.5)}
    for other in binary.values():
        assert_orders_match(other, (x,), 0, jax.jacrev(other)(x), lambda p: ["fwd", "rev"], rtol=1e-4, atol=1e-5)


def test_clamp_differentiates_every_operand_including_scalar_bounds():
    # jax.jacfwd/jacrev raise for a scalar bound of an array operand; the same clamp with its bounds
    # broadcast to the operand's shape is what JAX does differentiate, and must give the same blocks
    x = jnp.linspace(-1.0, 1.0, 7)
    lo, hi = jnp.float32(-0.45), jnp.float32(0.55)
    scalar_bounds = lambda lo, x, hi: lax.clamp(lo, x, hi) * x  # noqa: E731

    def broadcast(lo, x, hi):
        return scalar_bounds(jnp.broadcast_to(lo, x.shape), x, jnp.broadcast_to(hi, x.shape))

    with pytest.raises(Exception):
        jax.jacfwd(scalar_bounds, argnums=(0, 1, 2))(lo, x, hi)
    want = jax.jacrev(broadcast, argnums=(0, 1, 2))(lo, x, hi)
    assert np.count_nonzero(want[0]) == np.count_nonzero(want[2]) == 2  # both bounds are reached
    for order in ("fwd", "rev", "markowitz"):
        assert_same_jacobian(jaxtool.jacve(scalar_bounds, order=order, argnums=(0, 1, 2))(lo, x, hi), want,
                             rtol=1e-6, atol=1e-7)
    arrays = (jnp.linspace(-0.8, 0.2, 7), x, jnp.linspace(0.9, -0.1, 7))  # array bounds, crossing the operand
    want = jax.jacrev(scalar_bounds, argnums=(0, 1, 2))(*arrays)
    assert_same_jacobian(jaxtool.jacve(scalar_bounds, argnums=(0, 1, 2))(*arrays), want, rtol=1e-6, atol=1e-7)


def test_custom_jvp_rules_keep_their_structure():
    relu = trace_problem(lambda x: jax.nn.relu(x), M)
    (partial,) = relu.graph.preds[relu.outputs[0]].values()
    assert isinstance(partial, Sparse) and partial.pairs == (0, 1)
    softmax = trace_problem(lambda x: jax.nn.softmax(x, axis=-1), M)
    run(softmax, resolve_order("rev", softmax))
    (partial,) = softmax.graph.preds[softmax.outputs[0]].values()
    assert isinstance(partial, Sparse) and partial.pairs[0] == 0  # rows stay independent
    np.testing.assert_allclose(partial.to_dense(), jax.jacrev(lambda x: jax.nn.softmax(x, axis=-1))(M), atol=1e-6)


def test_custom_vjp_rules_jax_cannot_transpose_or_that_index_constants():
    # odeint is a custom_vjp whose VJP indexes the time grid with a traced integer (a NumPy grid must
    # reach it as a JAX array) and calls odeint again, which JAX cannot transpose: forward products
    # then use the partial's rows. Both raised before.
    from jax.experimental.ode import odeint

    ts = np.array([0.0, 0.3, 0.5], np.float32)
    f = lambda y0, a: odeint(lambda y, t, a: -a * y * jnp.sin(y), y0, ts, a)[1:] * y0  # noqa: E731
    args = (X[:3], 1.5)
    want = jax.jacrev(f, argnums=(0, 1))(*args)
    assert_orders_match(f, args, (0, 1), want, lambda p: ["fwd", "rev", "markowitz"] + random_orders(p, 2, seed=3),
                        rtol=1e-4, atol=1e-5)
    assert_same_jacobian(jax.jit(jaxtool.jacve(f, order="fwd", argnums=(0, 1)))(*args), want, rtol=1e-4, atol=1e-5)


def test_custom_rules_that_close_over_an_argument_not_differentiated():
    # a function defined inside the differentiated one, its rule reading an argument of that one:
    # JAX traces the rule only when it differentiates it, after jacve's trace of the program had
    # ended, and the argument was a tracer of that trace (a raw UnexpectedTracerError in every order)
    y = X[3:6] + 1.0

    def with_custom_jvp(x, y, scale=None):
        @jax.custom_jvp
        def g(a):
            return jnp.sin(a) * y * scale["s"]

        g.defjvp(lambda p, t: (g(p[0]), jnp.cos(p[0]) * y * scale["s"] * t[0]))
        return g(x)

    def with_custom_vjp(x, y):
        @jax.custom_vjp
        def g(a):
            return jnp.sin(a) * y

        g.defvjp(lambda a: (g(a), jnp.cos(a) * y), lambda r, c: (r * c,))
        return g(x) * x

    for f, kwargs in ((with_custom_jvp, {"scale": {"s": 2.0}}), (with_custom_vjp, {})):
        want = jax.jacrev(f)(X[:3], y, **kwargs)
        for order in ("fwd", "rev", "markowitz"):
            assert_same_jacobian(jaxtool.jacve(f, order=order)(X[:3], y, **kwargs), want, rtol=1e-5, atol=1e-6)
            assert_same_jacobian(jax.jit(jaxtool.jacve(f, order=order))(X[:3], y, **kwargs), want, rtol=1e-5, atol=1e-6)
    # over the differentiated argument itself: jax.jacrev raises that a tracer escaped; jacve says
    # which rule did it, and where (the CLI's exit-4 error)
    with pytest.raises(jax.errors.UnexpectedTracerError):
        jax.jacrev(with_custom_jvp, argnums=1)(X[:3], y, scale={"s": 2.0})
    with pytest.raises(UnsupportedError, match=r"test_engine\.py:\d+: the derivative rule of 'custom_jvp_call' "
                                               "reads a value of the traced function after that trace has ended"):
        jaxtool.jacve(with_custom_jvp, argnums=1)(X[:3], y, scale={"s": 2.0})


def test_an_equation_whose_derivative_jax_cannot_batch_is_densified_one_column_at_a_time():
    # lax.ragged_dot's JVP has no batching rule for the basis axis ("vmap over any dim but 0 -
    # NYI"): jax.jacfwd and jax.jacrev raise, and jacve raised the same raw NotImplementedError
    def f(x, w):
        return lax.ragged_dot(x * 1.0, w * 1.0, jnp.array([2, 4], jnp.int32)) * 2.0

    values = jnp.linspace(0.1, 1.2, 42)
    x, w = values[:18].reshape(6, 3), values[18:].reshape(2, 3, 4)
    with pytest.raises(NotImplementedError):
        jax.jacfwd(f)(x, w)

    def by_columns(argnum):  # jax.jvp along each basis vector, unbatched
        args = (x, w)
        size = args[argnum].size
        cols = [jax.jvp(f, args, tuple(jnp.eye(size)[k].reshape(a.shape) if i == argnum else jnp.zeros_like(a)
                                       for i, a in enumerate(args)))[1] for k in range(size)]
        return jnp.moveaxis(jnp.stack(cols), 0, -1).reshape((6, 4) + args[argnum].shape)

    want = (by_columns(0), by_columns(1))
    for order in ("fwd", "rev", "markowitz"):
        assert_same_jacobian(jaxtool.jacve(f, order=order, argnums=(0, 1))(x, w), want, rtol=1e-5, atol=1e-6)


def test_a_python_float_through_nondiff_argnums_stays_a_value():
    # traced like the other floats, it reached JAX's custom rule as a tracer: UnexpectedTracerError
    @functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
    def scaled_vjp(x, n):
        return jnp.sin(x) * n

    scaled_vjp.defvjp(lambda x, n: (scaled_vjp(x, n), x), lambda n, r, g: (jnp.cos(r) * n * g,))

    @functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
    def scaled_jvp(x, n):
        return jnp.sin(x) * n

    scaled_jvp.defjvp(lambda n, p, t: (scaled_jvp(p[0], n), jnp.cos(p[0]) * n * t[0]))
    x = jnp.arange(1.0, 4.0)
    for fn in (scaled_vjp, scaled_jvp):
        for n in (2.5, np.float32(2.5), 3):
            for order in ("rev", "fwd"):
                assert_same_jacobian(jaxtool.jacve(fn, order)(x, n), jax.jacrev(fn)(x, n), rtol=1e-6, atol=1e-6)


def test_argnums_read_as_jax_reads_them():
    f = lambda x, y: x * y  # noqa: E731
    x = jnp.ones(2)
    for argnums in (np.array(1), jnp.array(1), jnp.array([0, 1]), range(2), np.int64(0), 1, (1,)):
        assert_same_jacobian(jaxtool.jacve(f, argnums=argnums)(x, x), jax.jacrev(f, argnums=argnums)(x, x),
                             rtol=0, atol=0)
    for bad in (True, 1.0, "a", None, [np.array(1.5)]):
        with pytest.raises(TypeError, match="argnums must be an int or a sequence of ints"):
            jaxtool.jacve(f, argnums=bad)


def test_a_custom_rule_given_an_array_through_nondiff_argnums_is_refused_by_name():
    # JAX stop_gradient's a nondiff_argnums argument inside the traced function and closes the rule
    # over the result, a tracer of a trace that has ended when elimination applies the rule; a raw
    # UnexpectedTracerError before, even where that argument is not differentiated
    def expn(n, x):
        return jax.scipy.special.expn(n, x)

    n, x = jnp.array([1.0, 2.0, 3.0]), jnp.array([0.5, 1.0, 1.5])
    if JAX_VERSION >= (0, 12):  # JAX 0.12 closes the rule over no tracer: jaxtool differentiates it
        for argnums in (1, (0, 1)):
            assert_same_jacobian(jaxtool.jacve(expn, argnums=argnums)(n, x), jax.jacrev(expn, argnums)(n, x),
                                 rtol=1e-5, atol=1e-6)
    else:
        for argnums in (1, (0, 1)):
            with pytest.raises(UnsupportedError, match="custom_jvp_call.*nondiff_argnums argument"):
                jaxtool.jacve(expn, argnums=argnums)(n, x)
        with pytest.raises(UnsupportedError, match="nondiff_argnums"):
            jaxtool.jacobian.trace_problem(expn, n, x, argnums=1).plan()
    # a Python number there is a constant of the rule, as jax.jacrev takes it
    assert_same_jacobian(jaxtool.jacve(lambda x: expn(2, x))(x), jax.jacrev(lambda x: expn(2, x))(x),
                         rtol=1e-5, atol=1e-6)


def test_a_while_loop_read_through_a_dense_partial():
    # the loop's partial is its JVP, which JAX cannot transpose; a dense partial after it (a matrix
    # product) was pulled back through it row by row: a raw ValueError from JAX's while transpose in
    # every order (jax.scipy.linalg.polar, whose iteration is a while loop: in reverse order)
    a = jnp.array([[3.1, 0.2, -0.5], [0.4, 2.7, 0.3], [-0.2, 0.6, 3.3]])
    programs = (lambda m: jnp.sin(lax.while_loop(lambda c: jnp.sum(c) < 10.0, lambda c: c * 1.5 + m, m)) @ m,
                lambda m: jax.scipy.linalg.polar(m)[0])
    for f in programs:
        want = jax.jacfwd(f)(a)  # (jax.jacrev cannot differentiate a while loop)
        assert_orders_match(f, (a,), 0, want, lambda p: ["fwd", "rev", "markowitz"], rtol=1e-4, atol=1e-5)


def test_derivatives_of_the_jacobian_of_a_custom_vjp_function_differentiate_its_forward_rule():
    # as jax.jacrev's Jacobian does: jax.jacfwd(jacve(f)) raised "can't apply forward-mode autodiff
    # (jvp) to a custom_vjp function", and jacve(jacve(f)) applied the custom rule twice: a
    # straight-through round's second derivative was 2, not 1
    @jax.custom_vjp
    def ste_round(x):
        return jnp.round(x)

    ste_round.defvjp(lambda x: (jnp.round(x), None), lambda _, g: (g,))

    @jax.custom_gradient
    def doubled_sin(x):
        return jnp.sin(x), lambda g: 2.0 * g * jnp.cos(x)

    x = jnp.array([0.3, 1.6])
    for f in (lambda v: ste_round(v) * v, lambda v: doubled_sin(v) * v):
        want = jax.hessian(f)(x)
        for order in ("fwd", "rev", "markowitz"):
            jacobian = jaxtool.jacve(f, order=order)
            for second in (jaxtool.jacve(jacobian, order=order), jax.jacrev(jacobian), jax.jacfwd(jacobian)):
                np.testing.assert_allclose(second(x), want, rtol=1e-5, atol=1e-6)


def test_custom_vjp_functions_inside_control_flow():
    # JAX's JVP of a cond or scan around a custom_vjp function traces, but raises once batched (as
    # densification batches it): a raw TypeError in every order before; now the equation's VJP
    @jax.custom_vjp
    def g(a):
        return jnp.sin(a)

    g.defvjp(lambda a: (jnp.sin(a), jnp.cos(a)), lambda c, t: (t * c,))
    programs = (lambda v: lax.cond(v[0] > 0, g, jnp.cos, v),
                lambda v: lax.scan(lambda c, _: (g(c) * 1.5, c), v, None, length=3)[1])
    for f in programs:
        want = jax.jacrev(f)(X[:3])
        assert_orders_match(f, (X[:3],), 0, want, lambda p: ["fwd", "rev", "markowitz"] + random_orders(p, 2, seed=5),
                            rtol=1e-5, atol=1e-6)


def test_a_custom_vjp_rule_not_linear_in_its_cotangent_is_refused():
    # gradient clipping (JAX's custom_vjp documentation): jax.jacrev clips each output's cotangent
    # (3 e_i here), elimination would pull back unit cotangents and get 3 cos(x) unclipped, silently
    # (max error 0.19 before). A rule linear in its cotangent still gives jax.jacrev's Jacobian.
    @functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
    def clip_gradient(lo, hi, x):
        return x

    clip_gradient.defvjp(lambda lo, hi, x: (x, None), lambda lo, hi, _, g: (jnp.clip(g, lo, hi),))
    for order in ("fwd", "rev"):
        with pytest.raises(UnsupportedError, match="custom_vjp_call.*not linear in its cotangent"):
            jaxtool.jacve(lambda x: 3.0 * clip_gradient(-0.1, 0.1, jnp.sin(x)), order=order)(X[:3])

    @jax.custom_vjp
    def straight_through_sign(x):
        return jnp.sign(x)

    straight_through_sign.defvjp(lambda x: (jnp.sign(x), None), lambda _, g: (2.0 * g,))
    f = lambda x: straight_through_sign(x) * jnp.sin(x)  # noqa: E731
    assert_orders_match(f, (X[:3],), 0, jax.jacrev(f)(X[:3]), lambda p: ["fwd", "rev", "markowitz"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["sort", "top_k", "max_pool", "cond", "conv", "conv_to_float32", "scan"])
def test_lazily_applied_partials_of_narrow_floats_inside_a_float32_program(name):
    # a value cast to bfloat16 and back: the graph carries float32 tangents, JAX's rules of the
    # bfloat16 equations take bfloat16 ones (a raw TypeError from jax.jvp or linear_transpose before)
    def bf(a):
        return a.astype(jnp.bfloat16)

    kernel = jnp.full((1, 1, 2, 2), 0.5, jnp.bfloat16)
    fun = {
        "sort": lambda a: jnp.sort(bf(a), axis=1),
        "top_k": lambda a: lax.top_k(bf(a), 2)[0],
        "max_pool": lambda a: lax.reduce_window(bf(a), -jnp.inf, lax.max, (1, 2), (1, 1), "VALID"),
        "cond": lambda a: lax.cond(a[0, 0] < 0, jnp.sin, jnp.cos, bf(a)),
        "conv": lambda a: lax.conv_general_dilated(bf(a)[None, None], kernel, (1, 1), "SAME"),
        "conv_to_float32": lambda a: lax.conv_general_dilated(bf(a)[None, None], kernel, (1, 1), "SAME",
                                                              preferred_element_type=jnp.float32),
        "scan": lambda a: lax.scan(lambda c, r: (jnp.tanh(c * r), c), bf(a[0]), bf(a))[1],
    }[name]
    f = lambda a: fun(a).astype(jnp.float32) * a.sum()  # noqa: E731
    x = jnp.linspace(-1.0, 1.0, 12).reshape(3, 4)
    assert_orders_match(f, (x,), 0, jax.jacrev(f)(x), lambda p: ["fwd", "rev", "markowitz"] + random_orders(p, 1, seed=2),
                        rtol=2e-2, atol=2e-2)  # bfloat16 rounding, in another order than jax.jacrev's


def test_piecewise_constant_ops_cut_the_derivative_as_jax_does():
    # JAX's JVP of round, floor, ceil and sign is a symbolic zero: jax.jacrev gets 0 for
    # sqrt(round(x)) at round(x) = 0, where an explicit zero partial times sqrt's infinite one made
    # a NaN; and a max pool that reads only round(x) was differentiated (13x jax.jacrev's run time)
    def max_pool(a):
        return lax.reduce_window(a, -jnp.inf, lax.max, (3, 3), (1, 1), "SAME")

    def f(x):
        return max_pool(jnp.round(x)) * x + jnp.sqrt(jnp.round(x)) * x + jnp.sign(x) * jnp.floor(x) + jnp.ceil(x)

    x = jnp.abs(jnp.linspace(-1.4, 2.6, 12)).reshape(3, 4)
    want = jax.jacrev(f)(x)
    assert np.isfinite(want).all()
    assert_orders_match(f, (x,), 0, want, lambda p: ["fwd", "rev", "markowitz"] + random_orders(p, 2, seed=4),
                        rtol=1e-6, atol=0)
    problem = trace_problem(f, x)
    differentiated = {e.name for e in problem.program.eqns if any(v in problem.graph.preds for v in e.outvars)}
    assert not differentiated & {"reduce_window_max", "round", "floor", "ceil", "sign", "sqrt"}, differentiated


def test_diagonal_times_slice_is_a_scaled_slice():
    problem = trace_problem(lambda x: jnp.sin(x)[1:4], X)
    run(problem, resolve_order("fwd", problem))
    (partial,) = problem.graph.preds[problem.outputs[0]].values()
    assert isinstance(partial, Linear) and partial.selection and partial.has_scale


#: sums of shifted or permuted selections: stencils, symmetrisation, rolls (kept as a few scaled selections)
def _lorenz96_rk4(x, h=0.01):
    """One RK4 step of the Lorenz-96 system: its rolls by -1, 1 and 2 (each two slices) compose into
    a band of 13 shifts, however the elimination order cuts and adds them."""
    f = lambda y: (jnp.roll(y, -1) - jnp.roll(y, 2)) * jnp.roll(y, 1) - y + 8.0  # noqa: E731
    k1 = f(x)
    k2 = f(x + h / 2 * k1)
    k3 = f(x + h / 2 * k2)
    k4 = f(x + h * k3)
    return x + h / 6 * (k1 + 2 * k2 + 2 * k3 + k4)


def _heat_steps(u, steps=10):
    """Explicit steps of a periodic heat equation with a source: each step widens the band by two
    rolls, so ten steps make 21 shifts (more than the 16 selections a sum once kept as parts, beyond
    which it fell to a lazy sum: five times slower than ``jax.jacfwd`` on 1000 points)."""
    for _ in range(steps):
        u = u + 0.1 * (jnp.roll(u, 1) - 2 * u + jnp.roll(u, -1)) + 0.01 * jnp.sin(u)
    return u


SELECTION_SUMS = {
    "laplacian": lambda x: jnp.tanh(jnp.sin(x)[:-2] - 2 * jnp.sin(x)[1:-1] + jnp.sin(x)[2:]) + x[1:-1] ** 2,
    "diff of diff": lambda x: jnp.diff(jnp.diff(jnp.exp(x)) * 3),
    "roll": lambda x: jnp.roll(jnp.exp(x), 1) * x - x[::-1],
    "symmetrise": lambda x: jnp.tanh(0.5 * (x.reshape(5, 5) + x.reshape(5, 5).T)),
    "grid stencil": lambda x: jnp.sin(x.reshape(5, 5))[1:, :-1] - 2 * x.reshape(5, 5)[:-1, 1:] + x.reshape(5, 5)[1:, 1:],
    "stencil then reduction": lambda x: jnp.sum((x[1:] - x[:-1]) ** 2) * x[:2],
    "stencil then matmul": lambda x: (x[1:7] - x[:6]).reshape(2, 3) @ jnp.cos(x[:9]).reshape(3, 3),
    "wider than MAX_PARTS": lambda x: sum(x[k:k + 5] * (k + 1.0) for k in range(x.size - 4)),  # overlapping shifts
    "diagonal plus selections": lambda x: jnp.exp(x) + jnp.sin(x)[::-1] + jnp.concatenate([x[1:], x[:1]]) * 2,
    "rk4 step of lorenz-96": _lorenz96_rk4,
    # lax.reshape's ``dimensions`` transposes first (numpy's order="F"): once paired or indexed as a
    # plain reshape (a silently wrong Jacobian), and a raw error for three axes
    "column-major reshape": lambda x: jnp.sin(lax.reshape(x, (5, 5), dimensions=(0,))) * lax.reshape(
        x.reshape(5, 5), (25,), dimensions=(1, 0)).reshape(5, 5),
    "reshape transposing unit axes": lambda x: lax.reshape(jnp.exp(x).reshape(1, 25, 1), (25, 1), dimensions=(2, 1, 0)),
    "reshape transposing three axes": lambda x: lax.reshape(x[:24].reshape(2, 3, 4) ** 2, (4, 6), dimensions=(2, 0, 1)),
}


@pytest.mark.parametrize("name", sorted(SELECTION_SUMS) + sorted(KNOWN_INDICES))
def test_sums_of_selections_and_known_indices_match_jacrev(name):
    fun = SELECTION_SUMS.get(name) or KNOWN_INDICES[name]
    x = jnp.linspace(0.2, 1.5, partials.MAX_PARTS + 9 if "MAX_PARTS" in name else 25)
    if "stack" in name:  # (they had JAX's AD as opaque partials, dense products)
        assert trace_problem(fun, x).opaque == ()
    want = jax.jacrev(fun)(x)
    assert_orders_match(fun, (x,), 0, want, lambda p: ["fwd", "rev", "markowitz"] + random_orders(p, 4, seed=5),
                        rtol=1e-5, atol=1e-6, staged=True)
    assert_same_jacobian(jax.jit(jaxtool.jacve(fun, order="markowitz"))(x), want, rtol=1e-5, atol=1e-6)  # the public API


def test_sums_of_selections_stay_sparse():
    # a three-point stencil on 100,000 elements, x + x.T of a 300 x 300 matrix, a five-point stencil
    # on a 300 x 300 grid, an RK4 step of Lorenz-96 (a band of 13, which the reverse order once cut
    # along jnp.roll's slices into more than MAX_PARTS selections, and densified) and ten heat steps
    # (a band of 21): a few values per output element in every order, where a dense block would hold
    # 1e10, 8.1e9, 8.1e9, 1e6 and 1e6 values
    n = 100_000
    bratu_2d, _ = load_sample("bratu_2d")  # the five-point stencil the README cites, on a 300 x 300 grid
    cases = [(SELECTION_SUMS["laplacian"], jnp.linspace(0.0, 1.0, n), 3),
             (lambda a: jnp.tanh(0.5 * (a + a.T)), jnp.ones((300, 300)), 2),
             (bratu_2d, jnp.ones((300, 300)), 5),
             (_lorenz96_rk4, jnp.linspace(0.0, 1.0, 1000), 13),
             (_heat_steps, jnp.linspace(0.0, 1.0, 1000), 21)]
    for fun, x, width in cases:
        problem = trace_problem(fun, x)
        for order in ("fwd", "rev", "markowitz"):
            plan = problem.plan()  # the structure the values take (computing them eagerly: 5-10x slower)
            run(plan, resolve_order(order, plan))
            (partial,) = plan.graph.preds[plan.outputs[0]].values()
            assert isinstance(partial, Linear) and len(partial.parts) == width, order
            assert partial.stored == width * int(np.prod(partial.out_shape)), order
            if fun is _heat_steps:
                assert_same_jacobian(jax.jit(jaxtool.jacve(fun, order=order))(x), jax.jacfwd(fun)(x),
                                     rtol=1e-5, atol=1e-6)
    # densifying stages a scatter into an 8.1e9-element block: more elements than an int32 counts
    traced = jax.jit(jaxtool.jacve(bratu_2d)).trace(jnp.ones((300, 300)))
    assert traced.out_info.shape == (300,) * 4


def test_products_of_sums_of_selections_trace_as_many_equations_whatever_their_width():
    # twice the steps of an explicit stencil: twice the products, each of sums of selections twice
    # as wide (21 -> 41 shifts). All pairs of parts of a product are traced together (a gather, a
    # product, a scatter into the result's stacked scales), so the Jacobian's equations about
    # double; traced pair by pair they grew 3.4-fold (3075 -> 10435 in forward order), and XLA:CPU
    # compiled a kernel for most of them (ten steps: 8.5 s, now 1.9 s)
    x = jnp.linspace(0.0, 1.0, 200)

    def equations(steps, order):
        jacobian = jaxtool.jacve(lambda u: _heat_steps(u, steps), order=order)
        return _count_equations(jax.make_jaxpr(jacobian)(x).jaxpr)

    for order in ("fwd", "rev"):
        assert equations(20, order) < 2.5 * equations(10, order), order


def _count_equations(jaxpr) -> int:
    return sum(1 + sum(_count_equations(sub) for _, _, sub in subjaxprs(e.params))
               for e in jaxpr.eqns)


def _sort_and_rolls(x, steps):
    """Steps that each read the previous one's values through a sort (a selection known only when
    it runs: a lazily applied map) and two rolls: every step's edge is a sum of maps that all apply
    the previous step's edge."""
    for _ in range(steps):
        x = jnp.sort(x) * 0.3 + jnp.roll(x, 1) * 0.5 + jnp.roll(x, -1) * 0.2
    return x


def _sort_and_rolls_equations(steps, order, x) -> int:
    """The equations of jacve's traced Jacobian of :func:`_sort_and_rolls` at ``x``."""
    jacobian = jaxtool.jacve(lambda v: _sort_and_rolls(v, steps), order=order)
    return _count_equations(jax.make_jaxpr(jacobian)(x).jaxpr)


def test_lazy_maps_that_share_a_map_apply_it_once():
    # in forward order every step's edge applies the previous step's edge three times to the same
    # tangent. Applied as a tree, the traced Jacobian grew about sixfold per step (six steps traced
    # for 25 s, seven for 141 s); applied once per argument, it grows with the steps (222 -> 332
    # equations from four to six steps). In reverse order the shared map is the next step's edge to
    # the output, applied once backward (to one cotangent) but once per path forward: densified
    # forward, and transposed through its whole forward map, it grew fivefold per step (2908 -> 14173
    # from four to five steps); now it is densified backward, its transpose made of its factors'
    # (231 -> 319 from four to six steps; see also the next test)
    x = jnp.linspace(0.1, 1.0, 16)

    for order in ("fwd", "rev", "markowitz"):
        assert _sort_and_rolls_equations(6, order, x) < 5 * _sort_and_rolls_equations(4, order, x), order
    fun = lambda v: _sort_and_rolls(v, 4)  # noqa: E731
    assert_orders_match(fun, (x,), 0, jax.jacfwd(fun)(x), lambda p: ["fwd", "rev", "markowitz"] + random_orders(p, 2, seed=3),
                        rtol=1e-5, atol=1e-6)


def _assert_jacobians_under_a_recursion_limit(fun, x, limit):
    """jacve's fwd and rev Jacobians of ``fun`` at ``x``, made under Python recursion ``limit``, match jax.jacfwd's."""
    want = jax.jacfwd(fun)(x)
    before = sys.getrecursionlimit()
    sys.setrecursionlimit(limit)
    try:
        got = {order: jaxtool.jacve(fun, order=order)(x) for order in ("fwd", "rev")}
    finally:
        sys.setrecursionlimit(before)
    for jacobian in got.values():
        assert_same_jacobian(jacobian, want, rtol=1e-5, atol=1e-6)


def test_a_long_chain_of_shared_lazy_maps_grows_with_its_steps():
    # past MAX_DEPTH nested calls, the maps such a chain applies were replayed from their equations,
    # and a replay inlines the replays it applies: each of a step's three maps traced its own copy
    # of the chain before it. 12 -> 20 steps grew 1734 -> 13742 equations in forward and Markowitz
    # order (24 steps: 40410; 32 steps traced for 113 s), 1845 -> 6965 in reverse order. Maps
    # applied to an argument known beforehand are now applied in a loop, deepest first
    # (partials._warm), and need no replay: 662 -> 1102 (reverse: 583 -> 935); and 64 steps pass
    # under a recursion limit of 400
    x = jnp.linspace(0.1, 1.0, 16)

    for order in ("fwd", "rev", "markowitz"):
        assert _sort_and_rolls_equations(20, order, x) < 2 * _sort_and_rolls_equations(12, order, x), order
    fun = lambda v: _sort_and_rolls(v, 64)  # noqa: E731
    _assert_jacobians_under_a_recursion_limit(fun, x, 400)


def test_a_chain_of_updates_of_a_slice_grows_with_its_steps():
    # u.at[1:].set(u[:-1] * 0.9 + sin(u[1:])): in forward order, 4 -> 8 steps traced 143 -> 951
    # equations, 12 steps 2783 in 223 s (replays of the chain inlined into each other, see above);
    # now 143 -> 279
    x = jnp.sin(jnp.arange(16.0) * 0.7)

    def steps(u, n):
        for _ in range(n):
            u = u.at[1:].set(u[:-1] * 0.9 + jnp.sin(u[1:]))
        return u

    def equations(n, order):
        return _count_equations(jax.make_jaxpr(jaxtool.jacve(lambda u: steps(u, n), order=order))(x).jaxpr)

    for order in ("fwd", "rev"):
        assert equations(8, order) < 2.5 * equations(4, order), order
    fun = lambda u: steps(u, 12)  # noqa: E731
    assert_orders_match(fun, (x,), 0, jax.jacfwd(fun)(x), lambda p: ["fwd", "rev", "markowitz"], rtol=1e-5, atol=1e-6)


def test_a_chain_of_lazy_maps_nests_no_deeper_than_its_bound():
    # each FFT round trip's partial is a lazy map applied inside the next one's: a chain of 600
    # nested deeper than Python's recursion limit (a RecursionError). Deep compositions are now
    # replayed from their equations, so 150 of them pass even under a recursion limit of 400
    # (under which they failed before)
    def fun(x):
        for _ in range(150):
            x = jnp.fft.irfft(jnp.fft.rfft(x), 6) * 0.9
        return x

    x = jnp.linspace(1.0, 0.1, 6)
    _assert_jacobians_under_a_recursion_limit(fun, x, 400)


def _wide_stencil_steps(u, steps):
    """Explicit steps of a 17-point periodic stencil: each widens the band by 16 shifts."""
    for _ in range(steps):
        u = u + sum(0.01 * k * (jnp.roll(u, k) + jnp.roll(u, -k)) for k in range(1, 9)) + 0.01 * jnp.sin(u)
    return u


@pytest.mark.parametrize("n, kept", [(100, False), (360, True)])  # (two cases: each takes tens of seconds)
def test_sums_of_more_selections_than_a_sum_keeps(n, kept):
    # five steps make a band of 81 shifts: past MAX_PARTS on 100 points, where the sum is formed
    # dense (it was a lazy sum of 81 maps, and 33 three-point heat steps on 100 points, 67 shifts,
    # compiled for 16 s; 40 on 1000 points overflowed the recursion limit); on 360 points a sum
    # keeps up to 90 parts
    fun = lambda u: _wide_stencil_steps(u, 5)  # noqa: E731
    x = jnp.linspace(0.0, 1.0, n)
    want = jax.jacfwd(fun)(x)
    problem = trace_problem(fun, x)
    for order in ("fwd", "rev", "markowitz"):
        plan = problem.plan()  # the structure the values below take (without computing them)
        run(plan, resolve_order(order, plan))
        (partial,) = plan.graph.preds[plan.outputs[0]].values()
        if kept:
            assert isinstance(partial, Linear) and len(partial.parts) == 81, order
        else:
            assert isinstance(partial, Sparse) and partial.val_shape == (n, n), order
        if order == "fwd" or (order == "rev" and not kept):  # the values: 6-8 s an order
            assert_same_jacobian(jax.jit(jaxtool.jacve(fun, order=order))(x), want, rtol=1e-5, atol=1e-6)


def test_division_by_a_scalar_stores_one_value():
    # d(x/s)/dx = 1/s is one value for every element (as for a product with a scalar), d(x/s)/ds = -(x/s)/s one per element
    f = lambda x, s: jnp.sin(x) / s  # noqa: E731
    problem = trace_problem(f, X, 1.5, argnums=(0, 1))
    quotient = problem.graph.preds[3]  # vertices: 1 = sin(x), 2 = s as float32, 3 = the quotient
    assert quotient[1].stored == 1 and quotient[2].stored == X.size
    np.testing.assert_allclose(np.concatenate([np.ravel(b) for b in jaxtool.jacve(f, argnums=(0, 1))(X, 1.5)]),
                               np.concatenate([np.ravel(b) for b in jax.jacrev(f, argnums=(0, 1))(X, 1.5)]),
                               rtol=1e-6)


def test_clearing_the_caches():
    from jaxtool.jacobian import _SHARED, clear_caches
    from jaxtool.partials import _product_plan

    def f(x):
        return jnp.sin(x) * x

    jaxtool.jacve(f)(X)
    assert _product_plan.cache_info().currsize > 0 and f in _SHARED
    clear_caches()
    assert _product_plan.cache_info().currsize == 0 and f not in _SHARED


def test_a_new_jacve_of_the_same_function_reuses_its_staged_jacobian():
    traces = []

    def f(x, scale, tag):
        traces.append(1)
        return jnp.sin(x) * x * scale, {"tag": tag, "sum": jnp.sum(x)}

    for _ in range(3):  # jacve(f)(x) written inside a loop: traced once, non-array aux included
        jac, aux = jaxtool.jacve(f, has_aux=True)(X, 2.0, 7)
        assert aux["tag"] == 7 and type(aux["tag"]) is int
    assert len(traces) == 1
    jaxtool.jacve(f, order="fwd", has_aux=True)(X, 2.0, 7)  # another order: a Jacobian of its own
    jac1 = jaxtool.jacve(f, argnums=(0, 1), has_aux=True)(X, 2.0, 7)[0]  # other argnums too
    assert len(traces) == 3
    ref, _ = jax.jacrev(f, has_aux=True)(X, 2.0, 7)
    ref1, _ = jax.jacrev(f, argnums=(0, 1), has_aux=True)(X, 2.0, 7)
    np.testing.assert_allclose(jac, ref, rtol=1e-6)
    for block, expected in zip(jac1, ref1):
        np.testing.assert_allclose(block, expected, rtol=1e-6)


def fft_of_a_kept_sum(x):
    """A program JAX 0.10.2's XLA:CPU compiles to one that fails (``INTERNAL: RET_CHECK failure ...
    fft_thunk.cc``): a sum kept as a 1 x 1 array, its FFT, a LAPACK solve on the result (fuzz seed
    310063 of ``--max-ops 60``, attempt 0, cut down). Op by op it runs."""
    s = jnp.sum(x[None, :] * x[:, None], keepdims=True)
    return jnp.linalg.inv(jnp.eye(1) + jnp.real(jnp.fft.fft(s)))


def xla_cannot_compile(fn, *args) -> bool:
    try:
        jax.block_until_ready(jax.jit(fn)(*args))
    except jax.errors.JaxRuntimeError as error:
        return str(error).startswith("INTERNAL:")
    return False


def test_a_jacobian_xla_cannot_compile_is_computed_op_by_op_with_a_warning():
    x = jnp.array([0.3, -0.2], jnp.float32)
    if not xla_cannot_compile(fft_of_a_kept_sum, x):
        pytest.skip("this jaxlib compiles the program: the fallback is not reached")
    expected = jax.jacrev(fft_of_a_kept_sum)(x)  # (op by op: it runs)
    for order in ("rev", "fwd", "markowitz"):
        with pytest.warns(OpByOpWarning, match=r"XLA could not compile .*fft_thunk.* computed op by op"):
            got = jaxtool.jacve(fft_of_a_kept_sum, order=order)(x)
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-7)
    with warnings.catch_warnings():  # the next call is op by op at once: not compiled, no warning again
        warnings.simplefilter("error")
        np.testing.assert_allclose(jaxtool.jacve(fft_of_a_kept_sum)(x), expected, rtol=1e-5, atol=1e-7)
    with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL"):  # staged by the user: XLA's to compile
        jax.jit(jaxtool.jacve(fft_of_a_kept_sum))(x)


def test_the_shared_jacobians_do_not_keep_a_function_alive():
    import gc
    import weakref

    from jaxtool.jacobian import _SHARED

    def make():
        scale = np.full(X.shape, 3.0, np.float32)  # a large closed-over constant would be kept too
        return lambda x: jnp.sin(x) * scale

    f = make()
    jacobian = jaxtool.jacve(f)
    np.testing.assert_allclose(jacobian(X), jax.jacrev(f)(X), rtol=1e-6)
    gone = weakref.ref(f)
    del f
    gc.collect()
    assert gone() is not None  # the jacve function still refers to it
    del jacobian
    gc.collect()
    assert gone() is None and len([k for k in _SHARED.keys() if k is gone()]) == 0


# --- operation counts, derived by hand


def test_counts_of_a_scalar_chain():
    # y = sin(x) * x: vertices 1 = sin x, 2 = mul. Eliminating 1: one product (dmul/dsin * dsin/dx) = 1 mult,
    # summed into the direct edge x -> y = 1 addition.
    problem = trace_problem(lambda x: jnp.sin(x) * x, 0.5)
    assert problem.eliminable == (1,)
    cost = run(problem.plan(), [1])
    assert (cost.mults, cost.adds) == (1, 1)


def test_counts_of_a_vector_chain_and_a_reduction():
    # y = sum(exp(sin(x))) for x of size n. fwd: eliminate sin (n mults: diag*diag), then exp (a unit reduction
    # times a diagonal: 0 mults, the sum is structural). rev: eliminate exp first (0 mults), then sin (n mults).
    n = 7
    problem = trace_problem(lambda x: jnp.exp(jnp.sin(x)).sum(), jnp.ones(n))
    assert problem.eliminable == (1, 2)
    assert run(problem.plan(), [1, 2]).mults == n
    assert run(problem.plan(), [2, 1]).mults == n


def test_counts_of_a_matrix_chain_follow_the_association():
    # y = (A @ B) @ c with A: 2x3 input, B: 3x4 constant, c: 4 constant; vertex 1 = A@B (2x4), 2 = ... @ c (2).
    # d1/dA pairs the row axis and is B^T (4x3) for every row; d2/d1 pairs the row axis and is c (4) for every
    # row. Their product c^T B^T (3) is the same for every row and is formed once: 4*3 = 12 multiplications and
    # (4-1)*3 = 9 additions (a dense product would take 2*4*3 = 24).
    B = jnp.ones((3, 4))
    c = jnp.ones(4)
    problem = trace_problem(lambda a: (a @ B) @ c, jnp.ones((2, 3)))
    cost = run(problem.plan(), [1])
    assert cost.mults == 12 and cost.adds == 9


def test_markowitz_picks_the_cheapest_vertex_first():
    # y = 3 sin(w.x), x of size 50: v1 = w.x (edge x->v1 is the row w: 50 values), v2 = sin v1, v3 = 3 v2.
    # Eliminating v1 first costs 50 (the row times a scalar), v2 first costs 1 (scalar times scalar).
    # Markowitz: v2 (1), then v1 (50) = 51; fwd: v1 (50), then v2 (the new 50-row times a scalar, 50) = 100.
    w = jnp.linspace(0.0, 1.0, 50)
    problem = trace_problem(lambda x: jnp.sin(w @ x) * 3.0, jnp.ones(50))
    order = resolve_order("markowitz", problem)
    assert order == [2, 1]
    assert run(problem.plan(), order).mults == 51
    assert run(problem.plan(), resolve_order("fwd", problem)).mults == 100


def test_markowitz_is_the_greedy_order_costed_from_scratch_at_each_step():
    # markowitz re-costs only the neighbours of each eliminated vertex and remembers each product and
    # sum by its operands; the greedy rule recomputed from scratch at every step gives the same order
    # (a wide stencil's sums of shifted selections, and the perceptron's dense blocks)
    perceptron, args = load_sample("perceptron")
    for fun, xs, argnums in [(lambda u: _wide_stencil_steps(u, 2), (jnp.linspace(0.0, 1.0, 20),), 0),
                             (perceptron, args, float_argnums(args))]:
        problem = trace_problem(fun, *xs, argnums=argnums)
        graph, remaining, greedy = problem.plan().graph, set(problem.eliminable), []
        while remaining:
            v = min(remaining, key=lambda u: (graph.elimination_cost(u).mults,
                                              len(graph.preds.get(u, {})) * len(graph.succs.get(u, {})), u))
            graph.eliminate(v)
            remaining.discard(v)
            greedy.append(v)
        assert resolve_order("markowitz", problem) == greedy


def test_markowitz_breaks_ties_at_zero_cost_by_the_fewest_new_edges():
    # a heat equation's steps (80 points, 6 steps, a copied edge): its slices and scatters cost no
    # multiplications, so many vertices tie at zero. Taken by number, the steps' selections merged into
    # wide sums first and the order cost 37,293 multiplications (fwd: 82,680, rev: 17,120); taken by
    # the fewest predecessors times successors (9,656), it is cheaper than both, and still exact
    def heat(u):
        for _ in range(6):
            u = u.at[1:-1].add(0.2 * (u[:-2] - 2 * u[1:-1] + u[2:]) - 0.01 * u[1:-1] ** 3)
            u = u.at[-1].set(u[-2])
        return u

    u = jnp.sin(jnp.linspace(0.0, 3.0, 80))
    problem = trace_problem(heat, u)
    fwd, rev, markowitz = (run(problem.plan(), resolve_order(o, problem)).mults for o in ("fwd", "rev", "markowitz"))
    assert markowitz < min(fwd, rev)
    np.testing.assert_allclose(jaxtool.jacve(heat, order="markowitz")(u), jax.jacrev(heat)(u), rtol=1e-5, atol=1e-6)


def test_markowitz_can_be_far_worse_than_the_best_order_as_the_readme_says():
    # the README's example of greed gone wrong (its figures were stale once: keep the claim true)
    problem = trace_problem(lambda x: jax.nn.softmax(x @ x.T / 4, axis=-1) @ x, jnp.ones((32, 16)))
    fwd, rev, markowitz = (run(problem.plan(), resolve_order(o, problem)).mults for o in ("fwd", "rev", "markowitz"))
    assert markowitz > 10 * rev and fwd > markowitz
    readme = " ".join((pathlib.Path(__file__).resolve().parent.parent / "README.md").read_text().split())
    assert f"{markowitz / 1e6:.1f} million multiplications to `rev`'s {rev / 1e6:.2f} million" in readme
    assert f"(`fwd`: {fwd / 1e6:.1f} million)" in readme


def test_forming_a_block_from_a_lazy_map_is_counted():
    # a conv and a scan are lazy maps; a block left as one after elimination is formed by applying it
    # to the smaller basis, each application counted as in products (the map's multiplications, plus
    # one per output element for a scale). Both counted 0: no product had stored values to apply them to.
    kernel = np.full((1, 1, 3, 3), 1 / 9, np.float32)
    x = jnp.linspace(-1.0, 1.0, 64).reshape(1, 1, 8, 8)

    def convs(x, layers):
        for _ in range(layers):
            x = jnp.tanh(lax.conv(x, kernel, (1, 1), "SAME"))
        return x

    def scanned(x):
        carry, _ = lax.scan(lambda c, _: (jnp.sin(c), None), x, None, length=3)
        return carry * 2.0

    # one conv: 9 multiplications per output pixel (576), then tanh' as a scale (64); 64 basis vectors
    # three: the same per layer. The scan: one multiplication per result element (4), the x2 scale (4), 4 times
    for fun, args, per_application, basis in [(lambda x: convs(x, 1), (x,), 576 + 64, 64),
                                              (lambda x: convs(x, 3), (x,), 3 * (576 + 64), 64),
                                              (scanned, (jnp.ones(4),), 4 + 4, 4)]:
        problem = trace_problem(fun, *args)
        for order in ("fwd", "rev", "markowitz"):
            assert run(problem.plan(), resolve_order(order, problem)).mults == per_application * basis, order
        assert_same_jacobian(jaxtool.jacve(fun)(*args), jax.jacrev(fun)(*args), rtol=1e-5, atol=1e-6)


# --- orders and errors


def test_custom_order_errors_name_the_offending_vertices():
    problem = trace_problem(lambda x: jnp.sin(jnp.cos(x) * x) + 1.0, X)
    eliminable = list(problem.eliminable)
    n = problem.program.num_vertices
    assert resolve_order(",".join(map(str, eliminable[::-1])), problem) == eliminable[::-1]
    with pytest.raises(OrderError, match=r"duplicates 1"):
        resolve_order([1] + eliminable, problem)
    with pytest.raises(OrderError, match=r"unknown vertices 0"):
        resolve_order([0] + eliminable, problem)
    with pytest.raises(OrderError, match=rf"unknown vertices {n + 5}"):
        resolve_order(eliminable + [n + 5], problem)
    with pytest.raises(OrderError, match=rf"missing vertices {eliminable[-1]}"):
        resolve_order(eliminable[:-1], problem)
    with pytest.raises(OrderError, match=rf"cannot be eliminated {n}"):
        resolve_order(eliminable + [n], problem)
    with pytest.raises(OrderError, match="invalid order"):
        resolve_order("sideways", problem)
    # vertex numbers as a list, tuple or 1-D array of integers, nothing else (2.5 was truncated to 2,
    # a set taken in its iteration order, None a raw TypeError)
    for sequence in (np.array(eliminable), jnp.array(eliminable), tuple(eliminable)):
        assert resolve_order(sequence, problem) == eliminable
    for order, message in [([2.5] + eliminable[1:], "2.5 is not a vertex number"),
                           ([True] + eliminable[1:], "True is not a vertex number"),
                           ([1.0, 2.0], "1.0,2.0 are not vertex numbers (integers)"),
                           (set(eliminable), "or a list, tuple or 1-D array of vertex numbers"),
                           (None, "invalid order None"), (np.array([eliminable]), "1-D array"),
                           # (strings shown quoted; a NumPy scalar as given, not as array(2))
                           ([str(v) for v in eliminable], f"'{eliminable[0]}',"),
                           (np.int64(2), f"invalid order {np.int64(2)!r}: give one of")]:
        with pytest.raises(OrderError, match=re.escape(message)):
            jaxtool.jacve(lambda x: jnp.sin(jnp.cos(x) * x) + 1.0, order=order)


def test_blocks_of_weakly_typed_inputs_are_weakly_typed_as_jax_jacrev_makes_them():
    # a Python float (or a value made from one) gives a weakly typed block, which promotion then
    # follows: times a bfloat16 array it is bfloat16 (it was float32: strongly typed)
    f = lambda p, y: p["a"] * p["b"] * y  # noqa: E731
    args = ({"a": 1.5, "b": jnp.ones(2)}, jnp.asarray(2.0))
    want = jax.jacrev(f, argnums=(0, 1))(*args)
    for got in (jaxtool.jacve(f, argnums=(0, 1))(*args), jax.jit(jaxtool.jacve(f, argnums=(0, 1)))(*args)):
        assert [x.weak_type for x in jax.tree.leaves(got)] == [x.weak_type for x in jax.tree.leaves(want)]
    assert [x.weak_type for x in jax.tree.leaves(want)] == [True, False, True]
    assert (jaxtool.jacve(lambda x: jnp.sin(x) * x)(1.5) * jnp.ones(2, jnp.bfloat16)).dtype == jnp.bfloat16


def test_argnums_are_checked_as_jax_jacrev_takes_them():
    f = lambda x, y: jnp.sin(x) * y  # noqa: E731
    x, y = X[:3], 2.0
    for argnums in (1, (0, 1), [1], np.int64(1), np.array([0, 1])):  # a NumPy integer: a tuple, as jax.jacrev
        assert_same_jacobian(jaxtool.jacve(f, argnums=argnums)(x, y), jax.jacrev(f, argnums=argnums)(x, y),
                             rtol=1e-6, atol=0)
    for argnums in ("0", (0, "1"), 1.0):  # ("0" was a raw "not all arguments converted during string formatting")
        with pytest.raises(TypeError, match="argnums must be an int or a sequence of ints"):
            jaxtool.jacve(f, argnums=argnums)
    with pytest.raises(TypeError, match="expects a callable"):  # when made, as jax.jacrev
        jaxtool.jacve(3)


def test_trace_problem_numbers_a_program_with_keyword_arguments_as_jacve_does():
    def f(logits, *, temperature=1.0, bias=None):  # traced keyword arrays are inputs of the program
        return jax.nn.softmax(logits / temperature + bias)

    x, bias = jnp.arange(3.0), jnp.ones(3)
    eliminable = list(trace_problem(f, x, temperature=0.5, bias=bias).eliminable)
    assert eliminable != list(trace_problem(functools.partial(f, temperature=0.5, bias=bias), x).eliminable)
    got = jaxtool.jacve(f, order=eliminable[::-1])(x, temperature=0.5, bias=bias)
    np.testing.assert_allclose(got, jax.jacrev(f)(x, temperature=0.5, bias=bias), rtol=1e-5, atol=1e-6)


def test_non_differentiable_primitive_is_reported_with_location():
    def f(x):
        y = jax.pure_callback(lambda a: np.sin(a), jax.ShapeDtypeStruct(x.shape, x.dtype), x)
        return y * 2

    with pytest.raises(UnsupportedError) as info:
        jaxtool.jacve(f)(X)
    assert info.value.primitive == "pure_callback"
    assert "test_engine.py" in (info.value.location or "")


def test_primitive_inside_a_library_jit_is_reported_at_the_users_call():
    # JAX records no user frame for the equations of jax.scipy's nested jits: the call's line is named
    def f(a):
        return jax.scipy.linalg.sqrtm(a).real  # schur, which JAX cannot differentiate

    line = f.__code__.co_firstlineno + 1
    with pytest.raises(UnsupportedError) as info:
        jaxtool.jacve(f)(2 * jnp.eye(3))
    assert info.value.primitive == "schur"
    assert (info.value.location or "").endswith(f"test_engine.py:{line}")


def test_primitive_without_a_rule_for_one_input_is_reported():
    def f(x):  # JAX differentiates scatter_mul's operand, not its updates at repeated indices
        return x.at[jnp.array([0, 0, 2])].mul(x[:3])

    with pytest.raises(NotImplementedError):
        jax.jacfwd(f)(X[:4])
    with pytest.raises(UnsupportedError) as info:
        jaxtool.jacve(f)(X[:4])
    assert info.value.primitive == "scatter-mul"
    assert "test_engine.py" in (info.value.location or "")


@pytest.mark.parametrize("name, fun, primitive", [
    ("nextafter", lambda b: jnp.nextafter(X[:3], b), "nextafter"),  # no JVP rule at all
    ("zeta's order", lambda s: lax.zeta(s, X[:3] + 1), "zeta"),  # a rule for the second operand only
    ("polygamma's order", lambda m: lax.polygamma(m, X[:3] + 1), "polygamma"),  # the rule raises ValueError
])
def test_elementwise_primitive_without_a_rule_for_its_input_is_reported(name, fun, primitive):
    if name == "nextafter" and JAX_VERSION >= (0, 12):  # JAX 0.12 gives nextafter a zero derivative
        b = jnp.array([1.0, 2.0, 1.0])
        for order in ("fwd", "rev"):
            assert_same_jacobian(jaxtool.jacve(fun, order)(b), jax.jacfwd(fun)(b), rtol=0, atol=0)
        return
    with pytest.raises((NotImplementedError, ValueError)):
        jax.jacfwd(fun)(jnp.array([1.0, 2.0, 1.0]))
    with pytest.raises(UnsupportedError, match=r"with respect to operand \d: ") as info:  # was the raw error
        jaxtool.jacve(fun)(jnp.array([1.0, 2.0, 1.0]))
    assert info.value.primitive == primitive
    assert "test_engine.py" in (info.value.location or "")


def test_zero_size_values_broadcast_against_size_one_values():
    # jnp.roll of a length-1 vector slices out an empty piece: its partials store zero-size values,
    # which meet partials stored with size-1 (replicated) axes in products and sums
    empty = Sparse.dense(jnp.zeros((0, 1)), (0,), (1,))  # u: f32[1] -> v: f32[0]
    scale = Sparse.diag(jnp.full((1,), 2.0), (0,))  # v -> w, one stored value for every element
    product, _ = partials.matmul(scale, empty)
    assert product.to_dense().shape == (0, 1)
    replicated = Sparse((0,), (1,), (None,), (1, 1), np.dtype(np.float32), jnp.ones((1, 1)))
    total, _ = partials.add(empty, replicated)
    assert total.to_dense().shape == (0, 1)
    f = lambda v, w: jnp.roll(jnp.roll(v, 1) * w, 1) + jnp.roll(v, 1) * v.sum()  # noqa: E731
    args = (jnp.array([0.3]), jnp.array([0.7]))
    problem = trace_problem(f, *args, argnums=(0, 1))
    for order in ("fwd", "rev", "markowitz", sorted(problem.eliminable, key=lambda v: (v % 3, v))):
        assert_same_jacobian(jaxtool.jacve(f, order=order, argnums=(0, 1))(*args),
                             jax.jacrev(f, argnums=(0, 1))(*args), rtol=1e-6, atol=1e-7)


def test_zero_size_partials_of_loops_are_densified():
    # a scan or loop partial with no entries, not itself an output, divided by its zero basis size
    # when choosing how to densify (ZeroDivisionError in every order); the same broke jacve(jacve(f))
    x = np.zeros((0,), np.float32)
    scanned = lambda v: lax.scan(lambda c, t: (c, jnp.sin(t)), 0.0, v)[1] * 2.0  # noqa: E731
    looped = lambda v: jnp.sin(lax.fori_loop(0, 2, lambda i, c: jnp.sin(c), jnp.cos(v)))  # noqa: E731
    carried = lambda v: lax.scan(lambda c, t: (c + t, c * t), 0.0, v)  # noqa: E731
    for order in ("fwd", "rev", "markowitz"):
        assert jaxtool.jacve(scanned, order=order)(x).shape == (0, 0)
        assert jaxtool.jacve(looped, order=order)(x).shape == (0, 0)
        assert_same_jacobian(jaxtool.jacve(jaxtool.jacve(carried, order=order), order=order)(x),
                             jax.hessian(carried)(x), rtol=0, atol=0)


@pytest.mark.parametrize("lhs_shape, rhs_shape, dimension_numbers", [
    ((4, 4), (4, 4), (((1,), (0,)), ((), ()))),  # a small matrix product: fused multiply-and-sum
    ((3, 2, 5), (3, 5, 4), (((2,), (1,)), ((0,), (0,)))),  # batched
    ((2, 3, 4), (4, 3, 2), (((1, 2), (1, 0)), ((), ()))),  # two contracted axes, out of order
    ((6, 2, 3), (2, 6, 3), (((2,), (2,)), ((0, 1), (1, 0)))),
    ((2, 3), (4,), (((), ()), ((), ()))),  # an outer product
    ((0, 3), (3, 2), (((1,), (0,)), ((), ()))),
    ((3, 0), (0, 2), (((1,), (0,)), ((), ()))),  # a sum of no terms: zeros
    ((2, 3), (3, 2), (((1,), (0,)), ((), ()))),  # a sum of 3 terms: written out as additions
    ((4, 6), (6, 2), (((1,), (0,)), ((), ()))),  # a sum of 6 terms, over UNROLLED_SUM: two forms
    ((8, 16), (16, 2), (((1,), (0,)), ((), ()))),  # a sum of 16 terms, over POINT_SUM: lax.dot_general
    ((32, 32), (32, 32), (((1,), (0,)), ((), ()))),  # over SMALL_CONTRACTION: lax.dot_general itself
    ((8, 4), (4,), (((1,), (0,)), ((), ()))),  # small matrix-vector products: two forms
    ((4,), (4, 8), (((0,), (0,)), ((), ()))),
    ((4, 12), (12,), (((1,), (0,)), ((), ()))),  # over POINT_SUM: lax.dot_general
])
def test_primal_dot_general_matches_lax(lhs_shape, rhs_shape, dimension_numbers):
    rng = np.random.default_rng(0)
    lhs = jnp.asarray(rng.standard_normal(lhs_shape), jnp.float32)
    rhs = jnp.asarray(rng.standard_normal(rhs_shape), jnp.float32)
    expected = lax.dot_general(lhs, rhs, dimension_numbers)
    fused = jax.make_jaxpr(lambda a, b: partials.dot_general(a, b, dimension_numbers))(lhs, rhs)
    loop = int(np.prod(expected.shape)) * int(np.prod([lhs_shape[a] for a in dimension_numbers[0][0]]))
    (lc, rc), (lb, _) = dimension_numbers
    matvec = not lb and (len(lc) == len(lhs_shape) or len(rc) == len(rhs_shape))
    summed = int(np.prod([lhs_shape[a] for a in lc]))
    library = loop > partials.SMALL_CONTRACTION or summed > partials.POINT_SUM
    two_forms = not library and (summed > partials.UNROLLED_SUM or matvec)
    forms = [type(e.params["forms"]) for e in fused.eqns if e.primitive.name == "two_forms"]
    assert any(e.primitive is lax.dot_general_p for e in fused.eqns) == library
    assert (partials._SmallContraction in forms) == two_forms  # (else written out in both forms)
    assert (partials._FusedContraction in forms) == (not library and not two_forms and bool(lc))
    for got in (partials.dot_general(lhs, rhs, dimension_numbers),
                jax.jit(lambda a, b: partials.dot_general(a, b, dimension_numbers))(lhs, rhs)):
        assert got.shape == expected.shape and got.dtype == expected.dtype
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    ints = jnp.arange(12, dtype=jnp.int32).reshape(3, 4)
    assert partials.dot_general(ints, ints.T, (((1,), (0,)), ((), ()))).dtype == jnp.int32
    bf16 = jnp.ones((4, 4), jnp.bfloat16)  # narrow floats: the library dot, which accumulates in float32
    for preferred in (None, jnp.float32):
        narrow = jax.make_jaxpr(lambda a: partials.dot_general(a, a, (((1,), (0,)), ((), ())),
                                                               preferred_element_type=preferred))(bf16)
        assert [e.primitive for e in narrow.eqns] == [lax.dot_general_p]


def _primitives(jaxpr) -> set:
    """The primitives of ``jaxpr``'s equations and of the jaxprs nested in them."""
    return {e.primitive for e in _equations(jaxpr)}


@pytest.mark.parametrize("fused", [True, False])
def test_small_products_are_written_out_on_cpu_only(monkeypatch, fused):
    # XLA:GPU's priority fusion took a minute over the written-out forms of the encoder's products:
    # off XLA:CPU each small contraction is a dot_general and each sum a reduce_sum, with the same values
    monkeypatch.setattr(partials, "fuses_small_products", lambda: fused)
    rng = np.random.default_rng(2)
    w = jnp.asarray(rng.standard_normal((4, 4)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((4, 3)), jnp.float32)

    def f(w, x):  # 4x4 products (and a sum of two rows): small enough to be written out
        h = jnp.tanh(w @ x)
        return jnp.tanh(w @ h) * jnp.sum(h[:2], axis=0)

    for order in ("fwd", "rev", "markowitz"):
        jacobian = jaxtool.jacve(lambda *a: f(*a), order, (0, 1))  # (a new function: traced afresh)
        eqns = _equations(jax.make_jaxpr(jacobian)(w, x).jaxpr)
        written = {type(getattr(e.params["forms"], "forms", e.params["forms"]))  # (MadeOnce's, see sharing)
                   for e in eqns if e.primitive.name == "two_forms"}
        assert (partials._FusedContraction in written) == fused and (fused or not written), (order, written)
        assert_same_jacobian(jacobian(w, x), jax.jacrev(f, (0, 1))(w, x), rtol=1e-5, atol=1e-6)


def test_contractions_reach_dot_general_in_canonical_form():
    # XLA:CPU runs a dot whose operands are not (batch, free, contracted) x (batch, contracted, free)
    # with a slow generic loop: every operand and result layout must come out right all the same
    rng = np.random.default_rng(1)
    sizes = {"b": 2, "m": 3, "k": 4, "n": 5}
    for sx, sy, so in itertools.product(map("".join, itertools.permutations("bmk")),
                                        map("".join, itertools.permutations("bkn")),
                                        map("".join, itertools.permutations("bmn"))):
        x = jnp.asarray(rng.standard_normal([sizes[l] for l in sx]), jnp.float32)
        y = jnp.asarray(rng.standard_normal([sizes[l] for l in sy]), jnp.float32)
        got = partials._dot((x, y), (sx, sy), so, np.dtype(np.float32))
        np.testing.assert_allclose(got, jnp.einsum(f"{sx},{sy}->{so}", x, y), rtol=1e-5, atol=1e-5)
        (dot,) = [e for e in jax.make_jaxpr(lambda a, c: partials._dot((a, c), (sx, sy), so, np.dtype(np.float32)))(
            x, y).eqns if e.primitive is lax.dot_general_p]
        (lc, rc), (lb, rb) = dot.params["dimension_numbers"]
        lhs_rank = len(dot.invars[0].aval.shape)
        assert lb == rb == (0,) and lc == (lhs_rank - 1,) and rc == (1,), (sx, sy, so)



@pytest.mark.parametrize("summed", [3, 7, 11])  # written out term by term; in two forms; a dot_general
def test_written_out_contractions_sum_an_axis_where_the_larger_operand_has_it(summed):
    # a summed axis between two kept ones (sum(a[i, j, c] * b[i, j], j)) is summed where it is: moving it
    # last made XLA materialise a transposed copy of the product (256-body energy: 1.5x jax.jacrev)
    rng = np.random.default_rng(0)
    sizes = {"i": 2, "j": summed, "c": 5}
    for sa, sb, so in itertools.product(map("".join, itertools.permutations("ijc")), ("ij", "ji", "jc", "ic", "ijc"),
                                        (("i", None, "c"), ("c", "i"), (None, "i", "c", None))):
        a = jnp.asarray(rng.standard_normal([sizes[l] for l in sa]), jnp.float32)
        b = jnp.asarray(rng.standard_normal([sizes[l] for l in sb]), jnp.float32)

        def contract(a, b):
            operands = [(a, tuple(range(a.ndim))), (b, tuple(range(b.ndim)))]
            return partials._contract(operands, (sa, sb), so, 2 * summed * 5, np.dtype(np.float32))

        want = jnp.einsum(f"{sa},{sb}->{''.join(l for l in so if l)}", a, b)
        for f in (contract, jax.jit(contract)):
            np.testing.assert_allclose(f(a, b), want.reshape([1 if l is None else sizes[l] for l in so]),
                                       rtol=1e-5, atol=1e-5)
        eqns = jax.make_jaxpr(contract)(a, b).eqns
        if "j" in sb and summed > partials.POINT_SUM:  # a contraction of more terms: lax.dot_general
            assert any(e.primitive is lax.dot_general_p for e in eqns), (sa, sb, so)
            continue
        if "j" in sb and summed > partials.UNROLLED_SUM:  # two forms: lax.dot_general under vmap
            (eqn,) = [e for e in eqns if e.primitive.name == "two_forms"]
            forms = eqn.params["forms"]
            assert any(e.primitive is lax.dot_general_p for e in jax.make_jaxpr(forms.batched)(a, b).eqns)
            eqns = jax.make_jaxpr(forms.at_a_point)(a, b).eqns
        in_order = [l for l in sa if l in so] == [l for l in so if l]
        transposed = [e.invars[0].aval.shape for e in eqns if e.primitive is lax.transpose_p]
        assert not (in_order and a.size >= b.size and a.shape in transposed), (sa, sb, so)


def test_broadcasts_and_unit_axes_after_known_selections_compose_as_index_arithmetic():
    # jnp.pad(mode="edge") broadcasts a sliced row to (1, 1, n): that unit partial after a slice was
    # formed dense over its rows, then gathered from row by row, all from trace-time constants that
    # XLA:CPU constant-folded (a 40 x 40 Sobel filter: 17 gathers of 1680 x 40 x 40, 14 s to compile)
    def sobel(img):
        p = jnp.pad(img, 1, mode="edge")
        gx = (p[:-2, 2:] + 2 * p[1:-1, 2:] + p[2:, 2:]) - (p[:-2, :-2] + 2 * p[1:-1, :-2] + p[2:, :-2])
        gy = (p[2:, :-2] + 2 * p[2:, 1:-1] + p[2:, 2:]) - (p[:-2, :-2] + 2 * p[:-2, 1:-1] + p[:-2, 2:])
        return jnp.sqrt(gx ** 2 + gy ** 2 + 1e-6)

    img = jnp.asarray(np.random.default_rng(0).standard_normal((12, 12)), jnp.float32)
    want = jax.jacrev(sobel)(img)
    assert_orders_match(sobel, (img,), 0, want, lambda p: ["fwd", "rev", "markowitz"] + random_orders(p, 3, seed=4),
                        rtol=1e-4, atol=1e-5, staged=True)
    dense = img.size * img.size
    for order in ("fwd", "rev", "markowitz"):
        jaxpr = jax.make_jaxpr(jaxtool.jacve(sobel, order))(img)
        gathered = [np.prod(e.outvars[0].aval.shape) for e in _equations(jaxpr.jaxpr)
                    if e.primitive in (lax.gather_p, lax.select_n_p)]
        assert max(gathered) < dense / 4, (order, max(gathered))


def test_selections_that_are_strided_windows_are_sliced_and_padded_not_gathered():
    # the transpose of a slice is a pad: a gradient row pulled back through jnp.diff's slices was
    # gathered at trace-time indices and masked (total variation of a 64 x 64 image: rev 210 us,
    # jax.jacrev 72 us); as slice and pad, 62 us
    def tv(img):
        dx = jnp.diff(img, axis=1)[:-1]
        dy = jnp.diff(img, axis=0)[:, :-1]
        smooth = jnp.sum(jnp.diff(img, n=2, axis=0) ** 2)
        strided = img[1::3, ::2] * lax.pad(img[::2, 1::2], 0.0, ((0, 0, 0), (1, -1, 0)))[:6, :6]
        holes = lax.pad(img[2:5, 1:4], 0.0, ((1, 0, 2), (0, 2, 1)))  # interior padding
        return jnp.sum(jnp.sqrt(dx ** 2 + dy ** 2 + 1e-6)) + smooth + jnp.sum(strided ** 2) + jnp.sum(jnp.sin(holes))

    img = jnp.asarray(np.random.default_rng(1).standard_normal((17, 12)), jnp.float32)
    want = jax.jacrev(tv)(img)
    assert_orders_match(tv, (img,), 0, want, lambda p: ["fwd", "rev", "markowitz"] + random_orders(p, 4, seed=2),
                        rtol=1e-4, atol=1e-5, staged=True)
    jaxpr = jax.make_jaxpr(jaxtool.jacve(tv, "rev"))(img)
    assert not [e for e in _equations(jaxpr.jaxpr) if e.primitive in (lax.gather_p, lax.scatter_add_p)]


def test_strided_windows_are_recognised_exactly():
    rng = np.random.default_rng(3)
    src_shape = (7, 9)
    numbers = np.arange(63).reshape(src_shape)
    windows = [numbers[1:6:2, ::4], numbers[::3, 2:3], numbers[4:5, 8:9], numbers]
    x = jnp.asarray(rng.standard_normal((2, 63)), jnp.float32)
    for cut in windows:
        for config in [((0, 0, 0), (0, 0, 0)), ((2, 1, 0), (0, 3, 2)), ((0, 0, 1), (1, 0, 0))]:
            index = np.asarray(lax.pad(jnp.asarray(cut), -1, config))
            window = partials._window(index, src_shape)
            assert window is not None, (cut.shape, config)
            got = partials._window_take(x, window, 1, src_shape, index.shape)
            want = partials._take_or_zero(x, index.reshape(-1), axis=1)
            np.testing.assert_array_equal(got, want)
            back = partials._window_take(got, partials._inverse_window(window), 1, index.shape, src_shape)
            np.testing.assert_array_equal(back, partials._scatter_columns(got, index.reshape(-1), 63))
    # reversed, transposed, gathered rows, holes off a grid, nothing selected, a reshaped slice: no window
    for index in (numbers[::-1], numbers.T[:7, :7], numbers[[0, 2, 3]], np.where(numbers % 5 == 0, numbers, -1),
                  np.full(src_shape, -1), numbers[:, :3].reshape(3, 7)):
        assert partials._window(index, src_shape) is None, index


def test_a_window_of_a_scalar_is_a_copy():
    # a selection of a 0-d value from a 0-d value is the empty window (it raised in np.unravel_index:
    # fuzz seed 103137 in fwd and markowitz order, through the flip of a (1,) array that jax.jacrev reads)
    assert partials._window(np.array(0), ()) == () and partials._window(np.array(-1), ()) is None
    rows = jnp.arange(3.0).reshape(3, 1)
    np.testing.assert_array_equal(partials._window_take(rows, (), 1, (), ()), rows)
    inner = jax.jacrev(lambda x: jnp.tanh(x) * jnp.sum(x))
    f = lambda v0: inner(jnp.flip(jnp.expand_dims(v0, 0), axis=0))  # noqa: E731
    x = np.float32(-0.4)
    want = jax.jacrev(f)(x)
    for order in ("fwd", "rev", "markowitz"):
        assert_same_jacobian(jaxtool.jacve(f, order=order)(x), want, rtol=1e-6, atol=1e-6)


def _primitive_counts(jaxpr) -> collections.Counter:
    """Primitive names of ``jaxpr``'s equations and of the jaxprs nested in them, counted."""
    return collections.Counter(e.primitive.name for e in _equations(jaxpr))


def test_products_of_one_structure_are_bundled(monkeypatch):
    """In forward order each of the encoder's vertices carries a partial from each of its 16 inputs,
    many of one structure: each such bundle is multiplied, and added to the edges already there, at
    once (:mod:`jaxtool.bundles`). The same Jacobian as pair by pair, in about half the arithmetic
    equations (each bundle's product is split back into its pieces, an equation each); the values
    eliminated cost what the plan (which is never bundled) costs."""
    from jaxtool import bundles
    from jaxtool.jacobian import clear_caches

    encoder, args = load_sample("encoder")
    argnums = tuple(range(16))
    want = jax.jit(jax.jacrev(encoder, argnums))(*args)
    problem = trace_problem(encoder, *args, argnums=argnums)
    order = resolve_order("fwd", problem)
    made, costs = [], []
    original = bundles.products
    monkeypatch.setattr(bundles, "products", lambda b, parts: made.append(len(parts)) or original(b, parts))
    jax.make_jaxpr(lambda: costs.append(run(problem.copy(), order)))()  # (traced: run eagerly it takes 9 s)
    assert len(made) > 50 and max(made) == 8, made
    assert costs == [run(problem.plan(), order)]
    bundled = jaxtool.jacve(encoder, "fwd", argnums)
    assert_same_jacobian(jax.jit(bundled)(*args), want, rtol=1e-4, atol=1e-5)
    arithmetic = ("mul", "add", "dot_general")
    bundled_equations = sum(_primitive_counts(jax.make_jaxpr(bundled)(*args).jaxpr)[p] for p in arithmetic)

    monkeypatch.setattr(bundles, "bundles", lambda parts, b: [[u] for u in parts])
    clear_caches()
    pairwise = jaxtool.jacve(encoder, "fwd", argnums)
    assert_same_jacobian(jax.jit(pairwise)(*args), want, rtol=1e-4, atol=1e-5)
    pairwise_equations = sum(_primitive_counts(jax.make_jaxpr(pairwise)(*args).jaxpr)[p] for p in arithmetic)
    assert bundled_equations < 0.6 * pairwise_equations, (bundled_equations, pairwise_equations)


def test_a_bundle_stays_one_array_along_a_chain(monkeypatch):
    """Three inputs enter a chain of dense layers through one sum; from there on, in forward order,
    their partials are one bundle at every vertex, multiplied at once and taken from the array the
    vertex before made: a product of 3 partials at each of the 12 vertices, one concatenation for the
    whole chain (where the bundle first forms), its pieces split off where the Jacobian's blocks are
    taken (the split at every vertex is read by nothing and left out of the staged program), and the
    Jacobian of ``jax.jacfwd``."""
    from jaxtool import bundles

    rng = np.random.default_rng(0)
    weights = [jnp.asarray(rng.standard_normal((6, 6)) / 3, jnp.float32) for _ in range(9)]

    def chain(x1, x2, x3):
        h = weights[0] @ x1 + weights[1] @ x2 + weights[2] @ x3
        for w in weights[3:]:
            h = w @ jnp.tanh(h)
        return h

    xs = tuple(jnp.asarray(rng.standard_normal(6), jnp.float32) for _ in range(3))
    made = []
    original = bundles.products
    monkeypatch.setattr(bundles, "products", lambda b, parts: made.append(len(parts)) or original(b, parts))
    jaxtool.jacobian.clear_caches()
    jacobian = jaxtool.jacve(chain, "fwd", (0, 1, 2))
    counts = _primitive_counts(jax.make_jaxpr(jacobian)(*xs).jaxpr)
    assert made.count(3) >= 12, made
    assert 1 <= counts["concatenate"] <= 2 and 1 <= counts["split"] <= 2, counts
    assert_same_jacobian(jax.jit(jacobian)(*xs), jax.jacfwd(chain, (0, 1, 2))(*xs), rtol=1e-5, atol=1e-6)


def test_a_single_row_is_applied_without_a_batch_axis():
    """A lazily applied map (here the pullback of an FFT) applied to a stack of one row is applied
    to that row, not vmapped over a batch of one. XLA:CPU (jaxlib 0.10.2) gave the batched inverse
    FFT of a (1, 1) array next to a LAPACK solve a column-major operand layout and failed a
    RET_CHECK in its FFT thunk (``IsMonotonicWithDim0Major``); fuzz seed 113190, reduced."""
    def program(v0):
        v1 = jax.nn.logsumexp(v0, axis=(0, 1), keepdims=True)
        v2 = jnp.linalg.solve(jnp.eye(1) + jnp.tanh(v1), v1)
        v8 = jnp.exp2(jnp.tanh(v2))[-1]
        v10 = jnp.fft.irfft(jnp.fft.rfft(v8) * (0.5 - 1.0j), n=1)
        v13 = jnp.fft.irfft(jnp.fft.rfft(v10) * (0.5 - 1.0j), n=1)
        return [jnp.mean(v2, axis=0)[None], v13]

    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 4)), jnp.float32)
    want = jax.jacrev(program)(x)
    for order in ("rev", "fwd", "markowitz"):
        assert_same_jacobian(jax.jit(jaxtool.jacve(program, order))(x), want, rtol=1e-4, atol=1e-5)


def _lorenz_rhs(s):
    """The Lorenz system's right-hand side written as scientific code writes it: scalars read out of
    the state by indexing, the derivatives stacked back into a vector."""
    x, y, z = s[0], s[1], s[2]
    return jnp.stack([10.0 * (y - x), x * (28.0 - z) - y, x * y - 8.0 / 3.0 * z])


def _lorenz_rk4_steps(s, steps=2, h=0.01):
    """RK4 steps of :func:`_lorenz_rhs`."""
    for _ in range(steps):
        k1 = _lorenz_rhs(s)
        k2 = _lorenz_rhs(s + h / 2 * k1)
        k3 = _lorenz_rhs(s + h / 2 * k2)
        k4 = _lorenz_rhs(s + h * k3)
        s = s + h / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
    return s


def test_stacked_scalars_read_back_by_index_are_sliced_not_gathered():
    # each row of a stack of scalars is an index known while tracing: rows taken from it were one
    # gather (and a select for the rows a selection leaves zero) per product, 43 gathers and 39
    # selects for two RK4 steps in forward order (reverse: 11 and 34); XLA:CPU fuses a gather into
    # each of its consumers and does not simplify a slice of it, so five steps optimised to 19564
    # HLO instructions (jax.jacfwd: 3119) and compiled in 3.6 s (0.6 s). As slices and zeros,
    # concatenated: 7261 instructions, 1.8 s. (The Markowitz order's products of sums of selections
    # still gather their pairs of entries: 9, from 181.)
    s = jnp.array([1.0, 1.2, 0.9])
    want = jax.jacfwd(_lorenz_rk4_steps)(s)
    assert_orders_match(_lorenz_rk4_steps, (s,), 0, want, lambda p: ["fwd", "rev", "markowitz"] + random_orders(p, 3, seed=4),
                        rtol=1e-5, atol=1e-6, staged=True)
    for order in ("fwd", "rev"):
        jaxpr = jax.make_jaxpr(jaxtool.jacve(_lorenz_rk4_steps, order))(s)
        assert not [e for e in _equations(jaxpr.jaxpr) if e.primitive is lax.gather_p], order


_MIXING = np.array([[1.0, 2.0, 3.0], [0.5, -1.0, 2.0], [1.0, 1.0, -2.0]], np.float32)


def _stacked_rows(s):
    """Scalars that each depend on every input, stacked: each row of the forward Jacobian is a
    product of its own."""
    t = jnp.tanh(_MIXING @ s)
    x, y, z = t[0], t[1], t[2]
    return jnp.stack([jnp.sin(y * z), x * z, jnp.exp(x) * y])


def _indexed_columns(s):
    """Scalars read out of the input by indexing, each feeding every output: each column of the
    reverse Jacobian is a product of its own."""
    x, y, z = s[0], s[1], s[2]
    return _MIXING @ jnp.tanh(jnp.stack([x * y, y * z, z * x]))


@pytest.mark.parametrize("program, order", [(_stacked_rows, "fwd"), (_indexed_columns, "rev")])
def test_row_and_column_disjoint_sums_are_concatenated_not_added(program, order):
    # the rows of x -> stack(a, b, c) in forward order (the columns of out <- s in reverse order)
    # come from one product each, each block zero off its own rows: summed, they were three padded
    # 3x3 blocks added, which XLA:CPU keeps as one kernel per row. Ten RK4 steps of Lorenz
    # (_lorenz_rhs) optimised to 26101 HLO instructions in forward order (jax.jacfwd: 9784) and
    # 27179 in reverse (jax.jacrev: 26232); concatenated, 10407 and 13747
    s = jnp.array([1.0, 1.2, 0.9])
    want = jax.jacfwd(program)(s)
    assert_orders_match(program, (s,), 0, want, lambda p: ["fwd", "rev", "markowitz"] + random_orders(p, 3, seed=5),
                        rtol=1e-5, atol=1e-6, staged=True)
    jaxpr = jax.make_jaxpr(jaxtool.jacve(program, order))(s)
    added = [e for e in _equations(jaxpr.jaxpr) if e.primitive is lax.add_p and e.outvars[0].aval.shape == (3, 3)]
    assert not added, len(added)


def test_disjoint_sums_match_addition():
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((2, 4, 3)), jnp.float32)
    x_live, y_live = np.array([True, False, True, False]), np.array([False, True, False, False])
    a, b = x * x_live[:, None], x[::-1] * y_live[:, None]
    partials._mark_zero_off(a, 1, x_live)
    partials._mark_zero_off(b, 1, y_live)
    total = partials._disjoint_sum(a, b)
    np.testing.assert_array_equal(np.asarray(total), np.asarray(a + b))
    assert partials._zero_off(total)[0] == 1 and partials._zero_off(total)[1].tolist() == [True, True, True, False]
    c = x * y_live[:, None]
    partials._mark_zero_off(c, 1, x_live | y_live)  # overlaps a's rows
    assert partials._disjoint_sum(a, c) is None
    partials._mark_zero_off(c, 0, np.ones(2, bool))  # another block of axes
    assert partials._disjoint_sum(b, c) is None
    assert partials._disjoint_sum(a, x) is None  # x unknown


@pytest.mark.parametrize("runs_limit", [0, 8])
def test_takes_at_known_indices_match_numpy(runs_limit, monkeypatch):
    # runs of consecutive, repeated and missing (-1) elements, as slices concatenated (up to
    # MAX_RUNS runs) or as one gather (and a select of the missing)
    monkeypatch.setattr(partials, "MAX_RUNS", runs_limit)
    rng = np.random.default_rng(7)
    x = rng.standard_normal((6, 5)).astype(np.float32)
    indices = [np.array([0, 1, 2, -1, -1, 4, 4, 4, 3]), np.array([-1, -1]), np.array([2, 2, 2]),
               np.array([3, 2, 1, 0]), np.array([[0, -1], [1, 2]]), rng.integers(-1, 5, size=12)]
    for index in indices:
        want = np.where((index >= 0)[..., None], x[np.maximum(index, 0)], 0.0)
        np.testing.assert_array_equal(np.asarray(partials._take_or_zero(jnp.asarray(x), index, 0)), want)
        want_t = np.where((index >= 0)[None, ...], x.T[:, np.maximum(index, 0)], 0.0)
        np.testing.assert_array_equal(np.asarray(partials._take_or_zero(jnp.asarray(x.T), index, 1)), want_t)
        if (index >= 0).all():
            np.testing.assert_array_equal(np.asarray(partials._take(jnp.asarray(x), index, 0)), x[index])
    index = np.array([0, 1, 2, -1, -1, 4, 4, 4, 3])
    assert partials._runs(index, 4) == [(0, 1, 3), (-1, 0, 2), (4, 0, 3), (3, 1, 1)]
    assert partials._runs(index, 3) is None and partials._runs(np.arange(0, 20, 2), 8) is None


def _float32_orders_match(program, args, seed):
    """``args`` as float32, and their argnums (all): ``program``'s Jacobian in the three named orders
    and three random ones (staged) is ``jax.jacrev``'s."""
    args = tuple(jnp.asarray(a, jnp.float32) for a in args)
    argnums = tuple(range(len(args)))
    want = jax.jacrev(program, argnums)(*args)
    assert_orders_match(program, args, argnums, want,
                        lambda p: ["fwd", "rev", "markowitz"] + random_orders(p, 3, seed=seed), rtol=1e-5, atol=1e-6,
                        staged=True)
    return args, argnums


def _staged_equations(program, order, args, argnums) -> list:
    """The equations of ``jacve(program, order)``'s jaxpr, nested ones included."""
    return list(_equations(jax.make_jaxpr(jaxtool.jacve(program, order, argnums))(*args).jaxpr))


def _top_three_sum(s):
    """The sum of each row's three largest values: a sort, then a slice."""
    return jnp.sum(jnp.sort(s, axis=-1)[:, -3:], -1)


def _two_key_sort(a, b):
    """A sort on two keys (a rounded, then a) carrying a third operand, along the middle axis."""
    s = lax.sort((jnp.round(a), a, b), dimension=1, num_keys=2)
    return s[1] * s[2][:, ::-1, :]


def _descending_top(x):
    s = -jnp.sort(-x)
    return s[:3] * jnp.sum(s)


def _picked_by_argsort(x, y):
    order = jnp.argsort(y)
    return jnp.tanh(x[order[:3]]) * y[order[1]]


def _dynamic_windows(x, u):
    start = jnp.argmin(x)
    return lax.dynamic_update_slice(x, u * 2.0, (start,)) * x + jnp.sum(lax.dynamic_slice(x, (start,), (3,)) ** 2)


def _filled_gather(x):
    return x.at[jnp.argsort(x)[:4] + 3].get(mode="fill", fill_value=0.0) * 3.0


_RUN_TIME_SELECTIONS = [
    (_top_three_sum, (np.random.default_rng(0).standard_normal((4, 10)),)),
    (_two_key_sort, tuple(np.random.default_rng(1).standard_normal((2, 3, 4, 5)) * 2)),
    (_descending_top, (np.random.default_rng(2).standard_normal(8),)),
    (_picked_by_argsort, tuple(np.random.default_rng(3).standard_normal(n) for n in ((5, 3), (5,)))),
    (_dynamic_windows, tuple(np.random.default_rng(4).standard_normal(n) for n in ((10,), (3,)))),
    (_filled_gather, (np.random.default_rng(5).standard_normal(6),)),
]


@pytest.mark.parametrize("program, args", _RUN_TIME_SELECTIONS, ids=lambda v: getattr(v, "__name__", ""))
def test_sorts_and_value_indexed_selections_find_their_indices_without_bit_planes(program, args):
    # a sort's partials read the permutation the primal sort made (one sort, as in jax.jacrev), and a
    # gather or dynamic slice at indices computed from values gives its element indices by running on
    # int32 element numbers. Before, each such selection (and each composition with one) sorted again
    # (JAX's JVP of sort) and found where elements went from log2(n) planes of bits pushed through
    # its map: the top-3 row sums of a 4x10 batch counted 1294 XLA flops, past XLA:CPU's 1000-flop
    # line (a hand-off to a worker thread): 22.7 us a call where jax.jacrev takes 11.7; now 320-644
    # flops, 11.6 us
    args, argnums = _float32_orders_match(program, args, seed=6)
    for order in ("fwd", "rev", "markowitz"):
        equations = _staged_equations(program, order, args, argnums)
        assert not [e for e in equations if e.primitive is lax.shift_right_logical_p], order  # no bit planes
        sorts = [e for e in equations if e.primitive is lax.sort_p]
        assert len(sorts) == (program not in (_dynamic_windows,)), (order, len(sorts))



def test_sorts_read_their_permutation_under_vmap_and_in_second_derivatives():
    # the primal sort carries its positions along (one more operand): batched by jax.vmap, and sorted
    # once more with another when jacve differentiates jacve's own Jacobian (whose take_along_axis at
    # the permutation is then a gather at run-time indices)
    f = lambda x: jnp.sum(jnp.sort(x)[-3:] ** 3) + jnp.sort(x)[0] * x[1]  # noqa: E731
    g = lambda x: jnp.sort(x * x[::-1]) ** 2  # noqa: E731
    x = jnp.asarray(np.random.default_rng(0).standard_normal(6), jnp.float32)
    batch = jnp.asarray(np.random.default_rng(1).standard_normal((5, 6)), jnp.float32)
    hessian = jax.hessian(f)(x)
    for order in ("fwd", "rev", "markowitz"):
        np.testing.assert_allclose(jaxtool.jacve(jaxtool.jacve(f, order), order)(x), hessian, rtol=1e-5, atol=1e-5,
                                   err_msg=order)
        np.testing.assert_allclose(jax.jacrev(jaxtool.jacve(f, order))(x), hessian, rtol=1e-5, atol=1e-5,
                                   err_msg=order)
        np.testing.assert_allclose(jax.jit(jax.vmap(jaxtool.jacve(g, order)))(batch), jax.vmap(jax.jacrev(g))(batch),
                                   rtol=1e-5, atol=1e-6, err_msg=order)
    jax.extend.core.check_jaxpr(jax.make_jaxpr(jaxtool.jacve(jaxtool.jacve(f)))(x).jaxpr)


def _heat_with_copied_boundary(u):
    """Eight explicit heat steps with a Neumann boundary copied in (``.at[-1].set(u[-2])``)."""
    for _ in range(8):
        u = u + 0.1 * (jnp.roll(u, 1) + jnp.roll(u, -1) - 2 * u)
        u = u.at[-1].set(u[-2])
    return u


def _grid_with_boundaries(u):
    """Nonlinear diffusion on a 6x6 grid, edges set to zero and one edge copied."""
    for _ in range(3):
        lap = jnp.roll(u, 1, 0) + jnp.roll(u, -1, 0) + jnp.roll(u, 1, 1) + jnp.roll(u, -1, 1) - 4 * u
        u = u + 0.02 * lap - 0.01 * u ** 3
        u = u.at[0, :].set(0.0).at[-1, :].set(0.0).at[:, 0].set(0.0)
        u = u.at[:, -1].set(u[:, -2])
    return u[1:-1, 1:-1]


def _written_values(x, v):
    return jnp.sin(x.at[jnp.array([1, 3, 4])].set(v * x[0]).at[2].set(1.5)) * x


def _written_twice(x, v):
    # two updates to one element (XLA picks one) and an index computed from values: JAX's JVP
    return x.at[jnp.array([1, 1, 2])].set(v).at[jnp.argmax(x)].set(v[0] ** 2) * 2


_WRITES = [
    (_heat_with_copied_boundary, (np.random.default_rng(0).standard_normal(32),), 8),
    (_grid_with_boundaries, (np.random.default_rng(1).standard_normal((6, 6)),), 12),
    (_written_values, tuple(np.random.default_rng(2).standard_normal(n) for n in (6, 3)), 2),
    (_written_twice, tuple(np.random.default_rng(3).standard_normal(n) for n in (6, 3)), None),
]


@pytest.mark.parametrize("program, args, primal_scatters", _WRITES, ids=lambda v: getattr(v, "__name__", ""))
def test_scatters_at_known_distinct_indices_are_selections(program, args, primal_scatters):
    # x.at[i].set(v) with i known while tracing and distinct is a selection of x (the elements not
    # written over) and of v (where each goes), as dynamic_update_slice is. As JAX's JVP of the
    # whole scatter, its map was applied to every block that crossed it: the Markowitz order of
    # eight 1-D heat steps with a copied boundary (32 points) took 2,496,638 multiplications where
    # fwd took 32,851 (now 6,920 and 7,137) and traced 7,807 scatters (now the primal's 8)
    args, argnums = _float32_orders_match(program, args, seed=7)
    if primal_scatters is None:
        return
    for order in ("fwd", "rev", "markowitz"):
        equations = _staged_equations(program, order, args, argnums)
        assert sum(e.primitive is lax.scatter_p for e in equations) == primal_scatters, order


def _mixed_then_rolled(w, u):
    """A dense map onto a 6x6 grid, then rolls along both grid axes and a zero border: the dense
    partial is taken through selections whose flat indices are many runs but few shifted boxes."""
    v = jnp.tanh(w @ u).reshape(6, 6)
    v = jnp.roll(v, 1, 0) + jnp.roll(v, -1, 1) * v
    return jnp.pad(v[1:-1, 1:-1], 1) * 2


def test_dense_blocks_taken_through_rolls_and_pads_of_a_grid_are_sliced_not_gathered():
    # A roll along a 6x6 grid's minor axis is 12 runs of the flat index (more than MAX_RUNS) but two
    # shifted boxes of the grid: the dense block's rows (fwd) and columns (rev) are sliced and padded
    # into place. As a gather, XLA:CPU fused it with the slices and pads before it and recomputed
    # them per element: 8 steps of a 12x12 diffusion with jnp.pad borders took 1.3 ms in fwd order,
    # now 0.12 ms (jax.jacfwd: 0.12 ms)
    rng = np.random.default_rng(11)
    args, argnums = _float32_orders_match(_mixed_then_rolled, (rng.standard_normal((36, 36)) / 6,
                                                               rng.standard_normal(36)), seed=11)
    for order in ("fwd", "rev"):  # (rev gathers the scales of its sums of selections: vectors)
        equations = _staged_equations(_mixed_then_rolled, order, args, argnums)
        assert not any(e.primitive is lax.gather_p and e.invars[0].aval.ndim > 1 for e in equations), order


def test_sums_of_gathered_selections_are_dense_beyond_a_few_parts():
    # Parts taken by gathers (random permutations) are kept up to GATHERED_PARTS (8 here: 128 inputs),
    # parts that are slices (rolls) up to MAX_PARTS; the products and sums of gathered parts gather
    # their entries one by one, slower and longer to compile than the dense block (a 12x12 diffusion
    # with set edges: 0.66 ms and 4.3 s in rev order with up to 41 parts, 0.28 ms and 0.9 s dense).
    # (Permutations and rolls wrap around: the rule for small maps, SMALL_MAP, leaves them to this one.)
    rng = np.random.default_rng(4)
    n, scale = 128, jnp.asarray(rng.standard_normal(128), jnp.float32)

    def scaled(index):
        part = partials.selection_from_index((n,), (n,), index, np.float32)
        return dataclasses.replace(part, has_scale=True, scale=scale)

    permuted = [scaled(rng.permutation(n)) for _ in range(10)]
    rolled = [scaled(np.roll(np.arange(n), k)) for k in range(10)]
    assert partials.sum_of_selections(permuted[:8], np.float32) is not None
    assert partials.sum_of_selections(permuted, np.float32) is None
    kept = partials.sum_of_selections(rolled, np.float32)
    assert kept is not None and len(kept.parts) == 10
    t = jnp.asarray(rng.standard_normal(n), jnp.float32)
    np.testing.assert_allclose(kept.apply(t), sum(p.apply(t) for p in rolled), rtol=1e-5, atol=1e-5)


def test_sums_of_selections_on_small_maps_are_dense_beyond_a_few_parts():
    # A map between few elements (the square of the larger size n at most SMALL_MAP) keeps at most
    # SMALL_MAP_PARTS parts, or n / 16 where that is more: each part costs equations in every product
    # and sum, the dense block one array (20 steps of a 64-point heat equation: 0.94 ms a call in fwd
    # with bands of up to 41 parts, 0.05 ms dense; on 128 points 1.41 ms and 0.19 ms)
    def shifts(n, count):  # zero-filled, scaled: a band that does not wrap around
        scale = jnp.linspace(0.5, 1.5, n, dtype=jnp.float32)
        return [dataclasses.replace(partials.selection_from_index((n,), (n,), np.where(np.arange(n) + k < n,
                                                                                        np.arange(n) + k, -1),
                                                                  np.float32), has_scale=True, scale=scale)
                for k in range(count)]

    for n, kept in ((32, 4), (64, 4), (128, 8)):
        assert len(partials.sum_of_selections(shifts(n, kept), np.float32).parts) == kept
        assert partials.sum_of_selections(shifts(n, kept + 1), np.float32) is None
    assert len(partials.sum_of_selections(shifts(256, 20), np.float32).parts) == 20  # not a small map

    def heat(u):  # bands of up to 13 shifts, cut at the edges
        for _ in range(6):
            u = u.at[1:-1].add(0.2 * (u[:-2] - 2 * u[1:-1] + u[2:]) - 0.01 * u[1:-1] ** 3)
            u = u.at[-1].set(u[-2])
        return u

    for n in (32, 96):
        u = jnp.sin(jnp.linspace(0.0, 3.0, n))
        for order in ("fwd", "rev", "markowitz"):
            np.testing.assert_allclose(jaxtool.jacve(heat, order)(u), jax.jacrev(heat)(u), rtol=1e-5, atol=1e-6)


def test_sums_of_selections_that_wrap_around_keep_their_parts_on_small_maps():
    # A periodic stencil's rolls wrap around: formed dense, XLA:CPU fused each step's block, and the
    # sines of the steps before it, into both slices of the next step's rolls (ten steps of this wave
    # on 64 points: 4.2 ms a call in rev dense, 0.27 ms as parts; one CPU)
    n = 32
    scale = jnp.linspace(0.5, 1.5, n, dtype=jnp.float32)
    rolled = [dataclasses.replace(partials.selection_from_index((n,), (n,), np.roll(np.arange(n), k), np.float32),
                                  has_scale=True, scale=scale) for k in range(5)]
    assert len(partials.sum_of_selections(rolled, np.float32).parts) == 5
    grid = (4, 8)  # on a grid: a roll along the last axis wraps by 7 of 8 there, not by 7 of 32 in all
    index = np.arange(32).reshape(grid)
    along_rows = [dataclasses.replace(partials.selection_from_index(grid, grid, np.roll(index, k, axis=1), np.float32),
                                      has_scale=True, scale=scale.reshape(grid)) for k in range(5)]
    assert len(partials.sum_of_selections(along_rows, np.float32).parts) == 5

    def wave(u):
        v = jnp.zeros_like(u)
        for _ in range(4):
            v = v + 0.1 * (jnp.roll(u, 1) + jnp.roll(u, -1) - 2 * u) - 0.01 * jnp.sin(u)
            u = u + 0.1 * v
        return u

    u = jnp.sin(jnp.linspace(0.0, 3.0, n))
    for order in ("fwd", "rev", "markowitz"):
        np.testing.assert_allclose(jaxtool.jacve(wave, order)(u), jax.jacrev(wave)(u), rtol=1e-5, atol=1e-6)


def _periodic_stencil(u):
    """Three steps of a nonlinear periodic stencil of 9 shifts (``jnp.roll``)."""
    for _ in range(3):
        u = u + 0.02 * sum(jnp.roll(u, s) * (0.5 + 0.1 * s) for s in range(-4, 5)) - 0.01 * u ** 3
    return u


def test_products_and_sums_of_shifted_selections_move_their_scales_by_slices():
    # A periodic stencil's Jacobians are sums of rolls: re-cut by offset they stay one roll per
    # shift, and in forward order the scales of the products and sums (9 to 25 rows of 1024) are
    # taken through the rolls and added as whole rows, by slices: in all fewer values gathered than
    # the Jacobian has non-zeros (25 diagonals), none from an array of SLICED_SCALES values or more
    # (gathered entry by entry, 100 times as many: 2x slower at 300 and 1000 points, 21 shifts)
    u = jnp.asarray(np.sin(np.linspace(0.0, 6.0, 1024)), jnp.float32)
    expected = jax.jacrev(_periodic_stencil)(u)
    non_zeros = int(np.count_nonzero(np.asarray(expected)))
    assert non_zeros == 25 * u.size
    for order in ("fwd", "rev", "markowitz"):
        jacobian = jaxtool.jacve(_periodic_stencil, order)
        assert_same_jacobian(jacobian(u), expected, rtol=1e-5, atol=1e-6)
    staged = jax.make_jaxpr(jaxtool.jacve(_periodic_stencil, "fwd"))(u).jaxpr
    gathered = [math.prod(e.outvars[0].aval.shape) for e in _equations(staged) if e.primitive is lax.gather_p]
    assert sum(gathered) < non_zeros and max(gathered, default=0) < partials.SLICED_SCALES


def test_sums_of_shifted_selections_are_cut_by_offset():
    # rolls of 2048 points with scales: the sum of two sums with shifts in common is one scaled roll
    # per shift (its scale the sum of the two rows where both have it), not the k-th entries of
    # each output element (which mix shifts near the wrap); applied, the same as the terms
    rng = np.random.default_rng(6)
    n = 2048

    def rolled(shift):
        part = partials.selection_from_index((n,), (n,), np.roll(np.arange(n), shift), np.float32)
        return dataclasses.replace(part, has_scale=True, scale=jnp.asarray(rng.standard_normal(n), jnp.float32))

    terms = [rolled(s) for s in (-1, 0, 1)] + [rolled(s) for s in (0, 1, 2)]
    summed = partials.sum_of_selections(terms, np.float32)
    assert len(summed.parts) == 4
    shifts = sorted(int((np.arange(n)[0] - p.index[0]) % n) for p in summed.parts)
    assert shifts == sorted(s % n for s in (-1, 0, 1, 2))
    assert all(partials._runs(p.index.reshape(-1), 2) is not None for p in summed.parts)
    t = jnp.asarray(rng.standard_normal(n), jnp.float32)
    np.testing.assert_allclose(summed.apply(t), sum(p.apply(t) for p in terms), rtol=1e-5, atol=1e-5)
