"""``jaxtool.one_call``: a function computed once, compiled whole or equation by equation."""

from __future__ import annotations

import itertools
import sys
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import jaxtool
import program_generator as pg
from jaxtool import jacobian as staged_jacobians, one_call
from jaxtool.graph import flatten

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from bench import float_argnums, load_program  # noqa: E402

WEIGHTS = np.linspace(-1.0, 1.0, 12, dtype=np.float32).reshape(3, 4)  # closed over as a NumPy constant


def mixed(x, h):
    """An input returned as it is, a value read by several equations, a multi-result equation, a
    nested jit, a scan and a closed-over NumPy constant."""
    y = jnp.sin(x) * x
    a, b = jnp.split(y, [1])
    carry, ys = lax.scan(lambda c, v: (jnp.tanh(c * v + 0.5), c * v), h, b)
    z = jax.jit(lambda u: WEIGHTS @ u)(y)
    return x, jnp.concatenate([a, ys]) * y[0], z, carry


def steps(x, n: int):
    """``n`` unrolled steps of a few elementwise operations: many equations of few kinds."""
    for _ in range(n):
        x = jnp.sin(x) * 1.01 + x[::-1] * 0.1
    return x


def unrolled(x):
    """150 steps, run equation by equation only: with the test suite's XLA settings (older loop
    emitters, LLVM at -O0, see conftest.py) XLA:CPU takes minutes and gigabytes to compile even 20
    steps' Jacobian."""
    return steps(x, 150)


def recorded_by_equation(monkeypatch, module) -> list:
    """The equation counts of the programs ``module.by_equation`` runs from now on (a list that grows)."""
    counts = []
    real = module.by_equation
    monkeypatch.setattr(module, "by_equation", lambda program, args: (counts.append(len(program.eqns)),
                                                                     real(program, args))[1])
    return counts


def test_by_equation_computes_what_the_compiled_program_computes():
    args = (jnp.arange(1.0, 5.0, dtype=jnp.float32), jnp.float32(0.3))
    program = flatten(jax.make_jaxpr(mixed)(*args))
    got = one_call.by_equation(program, list(args))
    want = jax.tree_util.tree_leaves(jax.jit(mixed)(*args))
    assert len(got) == len(want) == 4
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_allclose(g, w, rtol=1e-6)
    assert got[0] is args[0]  # (the input itself)
    # a Jacobian one of whose blocks is a constant, a permutation: an output that is a constant
    jacobian = jax.make_jaxpr(jaxtool.jacve(lambda x: (jnp.sin(x), jnp.flip(x))))(args[0])
    got = one_call.by_equation(flatten(jacobian), [args[0]])
    np.testing.assert_array_equal(got[1], np.eye(4, dtype=np.float32)[::-1])
    np.testing.assert_allclose(got[0], np.diag(np.cos(args[0])), rtol=1e-6)


def test_a_value_is_dropped_after_its_last_reader():
    program = flatten(jax.make_jaxpr(unrolled)(jnp.ones(3)))
    held, most = set(), 0
    for eqn, dropped in zip(program.eqns, one_call.dropped_after(program)):
        assert all(atom in held for atom in eqn.invars if isinstance(atom, int))
        held.update(eqn.outvars)
        most = max(most, len(held))
        held.difference_update(dropped)
    assert held == set(program.outvars)
    assert len(program.eqns) > 700 and most <= 4  # a step reads the step before only


def test_an_unrolled_loop_is_sooner_by_equation_and_a_tensor_program_compiled():
    assert one_call.by_equation_is_sooner(flatten(jax.make_jaxpr(jaxtool.jacve(unrolled))(jnp.ones(3))))
    assert one_call.by_equation_is_sooner(flatten(jax.make_jaxpr(jax.jacrev(unrolled))(jnp.ones(3))))
    # (1833 equations of 36 kinds: about as soon either way at a millisecond an equation; XLA:CPU
    # compiled it for minutes)
    with_scan = jax.jacrev(lambda x: (unrolled(x), lax.associative_scan(jnp.add, x)))
    assert one_call.by_equation_is_sooner(flatten(jax.make_jaxpr(with_scan)(jnp.ones(3))))
    f, args = load_program("encoder")
    encoder_jacobian = jax.make_jaxpr(jaxtool.jacve(f, "rev", float_argnums(args)))(*args)
    assert not one_call.by_equation_is_sooner(flatten(encoder_jacobian))


def test_call_once_takes_either_way_to_the_same_jacobian(monkeypatch):
    x = jnp.linspace(-1.0, 1.0, 3, dtype=jnp.float32)
    ways = recorded_by_equation(monkeypatch, one_call)
    got, note = one_call.call_once(jaxtool.jacve(unrolled), [x])
    assert len(ways) == 1 and note is None
    np.testing.assert_allclose(got, jax.jacrev(unrolled)(x), rtol=1e-5, atol=1e-6)
    small = lambda v: {"s": jnp.sin(v) * v}  # noqa: E731
    got, note = one_call.call_once(jax.jacrev(small), [x])
    assert len(ways) == 1 and note is None  # (compiled whole)
    np.testing.assert_allclose(got["s"], jnp.diag(jnp.cos(x) * x + jnp.sin(x)), rtol=1e-6)


def test_jacve_runs_an_unrolled_loop_equation_by_equation_at_its_first_call(monkeypatch):
    x = jnp.linspace(-1.0, 1.0, 3, dtype=jnp.float32)
    ways = recorded_by_equation(monkeypatch, staged_jacobians)
    got = jaxtool.jacve(unrolled)(x)  # (not called again: the test suite's XLA settings compile it for minutes)
    assert len(ways) == 1 and ways[0] > 5000
    np.testing.assert_allclose(got, jax.jacrev(unrolled)(x), rtol=1e-5, atol=1e-6)


def test_jacve_runs_a_signature_equation_by_equation_until_that_took_as_long_as_compiling(monkeypatch):
    # compiling is made to look slow (a second per equation), so that a small program runs
    # equation by equation; then fast, so that the next call compiles it
    monkeypatch.setattr(one_call, "COMPILE_PER_EQUATION", 1.0)
    x = jnp.linspace(-1.0, 1.0, 3, dtype=jnp.float32)
    ways = recorded_by_equation(monkeypatch, staged_jacobians)

    def with_aux(x, scale=1.0):
        y = steps(x, 3) * scale
        return y, {"first": y[0], "label": "steps"}

    jacobian = jaxtool.jacve(with_aux, has_aux=True)
    calls = [jacobian(x, scale=2.0), jacobian(x, scale=2.0), jacobian(x, scale=2.0)]
    assert len(ways) == 3  # (their runs took well under the minute compiling is estimated at)
    monkeypatch.setattr(one_call, "COMPILE_PER_EQUATION", 1e-9)
    calls += [jacobian(x, scale=2.0), jacobian(x, scale=3.0)]  # (a new value of a traced float: the same signature)
    assert len(ways) == 3  # (compiled)
    monkeypatch.setattr(one_call, "COMPILE_PER_EQUATION", 1.0)
    calls.append(jacobian(x[:2]))  # a new signature
    assert len(ways) == 4
    for got, scale, arg in zip(calls, (2.0, 2.0, 2.0, 2.0, 3.0, 1.0), (x, x, x, x, x, x[:2])):
        want = jax.jacrev(with_aux, has_aux=True)(arg, scale)
        assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
        assert got[1]["label"] == "steps"
        for g, w in zip(jax.tree_util.tree_leaves(got[0]), jax.tree_util.tree_leaves(want[0])):
            assert jax.typeof(g) == jax.typeof(w)
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got[1]["first"], want[1]["first"], rtol=1e-6)
    jax.jit(jaxtool.jacve(lambda v: steps(v, 3)))(x + 1)  # traced inside jax.jit: compiled with it
    assert len(ways) == 4


def test_jacve_compiles_once_its_runs_by_equation_took_as_long_as_compiling_would(monkeypatch):
    clock = itertools.count(step=0.5)  # each run equation by equation takes half a second
    monkeypatch.setattr(staged_jacobians, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
    monkeypatch.setattr(staged_jacobians, "by_equation_is_sooner", lambda program: True)
    monkeypatch.setattr(staged_jacobians, "compile_seconds", lambda program: 1.2)
    ways = recorded_by_equation(monkeypatch, staged_jacobians)

    def two_steps(x):
        return steps(x, 2)

    x = jnp.linspace(-1.0, 1.0, 3, dtype=jnp.float32)
    jacobian = jaxtool.jacve(two_steps)
    for k in range(5):
        np.testing.assert_allclose(jacobian(x + k), jax.jacrev(two_steps)(x + k), rtol=1e-5, atol=1e-6)
    assert len(ways) == 3  # 0.5, 1.0, then 1.5 s of runs: the fourth call compiles


def test_by_equation_computes_what_the_compiled_program_computes_on_generated_programs():
    # the Jacobians of random programs (control flow, custom rules, gathers and scatters, sorts,
    # constants, outputs that are inputs or constants) in two orders, run both ways
    checked = 0
    for seed in range(20):
        case = next((c for c in (pg.generated(seed, attempt) for attempt in range(pg.MAX_ATTEMPTS))
                     if pg.reference(c) is not None), None)
        if case is None:
            continue
        args = jax.tree_util.tree_leaves(case.inputs)
        for order in ("rev", "markowitz"):
            jacobian = jaxtool.jacve(case.fun, order, case.argnums, case.has_aux)
            closed = jax.make_jaxpr(jacobian)(*case.inputs)
            want = jax.jit(jax.extend.core.jaxpr_as_fun(closed))(*args)
            got = one_call.by_equation(flatten(closed), args)
            assert len(got) == len(want)
            for g, w in zip(got, want):
                assert jax.typeof(g) == jax.typeof(w), (seed, order)
                np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5, err_msg=f"seed {seed} {order}")
            checked += 1
    assert checked >= 34
