"""One call of a function: compiled whole by XLA, or equation by equation.

``jaxtool jac`` computes a Jacobian once (and ``--check`` JAX's two), and the first calls of
:func:`jaxtool.jacve` outside ``jax.jit`` may be its only ones. Compiled whole with ``jax.jit``,
XLA:CPU takes about 1 to 2 ms per equation of the program: the encoder's reverse-order Jacobian,
392 equations, compiles in 0.64 s, but a Lorenz system integrated over 20 unrolled RK4 steps has a
reverse-order Jacobian of 5965 equations, 10.3 s to compile (its ``jax.jacrev``: 25 s). Equation
by equation, JAX compiles each distinct equation (primitive, operand types, parameters) once, some
30 to 50 ms each, and runs the repeats in microseconds: the Lorenz Jacobian's equations are 64
distinct ones, 1.8 s in all (its ``jax.jacrev``: 0.9 s), where the encoder's 129 distinct ones of
392 take 6.4 s. :func:`by_equation_is_sooner` estimates which way is sooner from the equations:
unrolled loops, many equations of few kinds, go equation by equation (:func:`by_equation`); the
rest is compiled whole. :func:`call_once` is the command line's way to compute a function.
"""

from __future__ import annotations

import jax
from jax.extend import core as jcore

from jaxtool.graph import bind, flatten, read

#: seconds XLA:CPU takes to compile one equation of a whole program of a few hundred equations
#: (0.5-1.7 ms measured; 1 ms here so that such a program goes equation by equation only where
#: that is clearly sooner)
COMPILE_PER_EQUATION = 1e-3
#: equations at which XLA:CPU's compile time per equation has doubled: it grows with the program,
#: as the chains of elementwise operations that its fusion passes walk grow longer. Reverse-order
#: Jacobians of unrolled RK4 steps of the Lorenz system: 20 steps, 5965 equations, 10.3-10.7 s
#: (estimated 13.1 s); 50 steps, 14755 equations, 80 s (58 s). ``jax.jacrev``'s compile slower
#: still (Lorenz: 3648 equations 25 s, 9108 equations 446 s; 40 and 80 steps of
#: ``sin(x) * 1.01 + x[::-1] * 0.1``: 488 equations 0.22 s, 968 equations 236 s), so a long
#: program whose estimates are close goes equation by equation, whose time is steadier
COMPILE_DOUBLING = 5000
#: seconds JAX takes to compile and run an equation of a kind it has not run before (30-50 ms)
FIRST_OF_A_KIND = 50e-3
#: seconds JAX takes to run an equation of a kind it has compiled already (10-30 us)
REPEAT = 30e-6


def call_once(fn, args) -> tuple:
    """``(fn(*args), note)``, waited for: compiled whole with ``jax.jit``, or where that is sooner
    (:func:`by_equation_is_sooner`) its program run equation by equation (the note is then None).
    Where XLA cannot compile a program that runs equation by equation
    (:func:`jaxtool.jacobian.xla_failed`), it is run so, and the note says why. Waited for here: an
    allocation that fails (a result too large for memory) is reported by the wait, as
    RESOURCE_EXHAUSTED; reading the array unwaited aborts the process (JAX 0.10.2)."""
    from jaxtool.jacobian import op_by_op_note, xla_failed

    closed, shapes = jax.make_jaxpr(fn, return_shape=True)(*args)
    flat_args = jax.tree_util.tree_leaves(args)
    program = flatten(closed)
    note = None
    if by_equation_is_sooner(program):
        result = jax.block_until_ready(by_equation(program, flat_args))
    else:
        try:
            result = jax.block_until_ready(jax.jit(jcore.jaxpr_as_fun(closed))(*flat_args))
        except jax.errors.JaxRuntimeError as error:
            if not xla_failed(error):
                raise
            result, note = jax.block_until_ready(by_equation(program, flat_args)), "note: " + op_by_op_note(error)
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(shapes), result), note


def by_equation_is_sooner(program) -> bool:
    """Whether running ``program`` (a :class:`~jaxtool.graph.FlatProgram`) equation by equation is
    estimated sooner than compiling it whole (:func:`compile_seconds`, :data:`FIRST_OF_A_KIND`,
    :data:`REPEAT`; an equation of a nested jaxpr, a loop's body, is part of its loop's kind)."""
    kinds = {_kind(program, eqn) for eqn in program.eqns}
    return len(kinds) * FIRST_OF_A_KIND + len(program.eqns) * REPEAT < compile_seconds(program)


def compile_seconds(program) -> float:
    """The seconds XLA:CPU is estimated to take to compile ``program`` whole (:data:`COMPILE_PER_EQUATION`,
    :data:`COMPILE_DOUBLING`)."""
    n = len(program.eqns)
    return n * COMPILE_PER_EQUATION * (1 + n / COMPILE_DOUBLING)


def by_equation(program, args) -> list:
    """The outputs of ``program`` at flat ``args``, each equation run on its own; a value is dropped
    after the last equation that reads it (:func:`dropped_after`), so that memory holds only what is
    still to be read."""
    values = {}
    for eqn, dropped in zip(program.eqns, dropped_after(program)):
        outs = bind(eqn, *(read(atom, args, values) for atom in eqn.invars))
        values.update(zip(eqn.outvars, outs if eqn.primitive.multiple_results else (outs,)))
        for vertex in dropped:
            del values[vertex]
    return [read(atom, args, values) for atom in program.outvars]


def dropped_after(program) -> list:
    """For each equation of ``program``, the vertices no later equation or output reads: those it
    reads last, and those it defines that nothing reads."""
    last = {}
    for index, eqn in enumerate(program.eqns):
        for vertex in eqn.outvars:
            last[vertex] = index
        for atom in eqn.invars:
            if isinstance(atom, int):
                last[atom] = index
    for atom in program.outvars:
        if isinstance(atom, int):  # (an output may be an input or a constant, which are not dropped)
            last.pop(atom, None)
    dropped = [[] for _ in program.eqns]
    for vertex, index in last.items():
        dropped[index].append(vertex)
    return dropped


def _kind(program, eqn) -> tuple:
    """What JAX compiles an equation of ``program`` once per: its primitive, operand types and
    parameters (unhashable ones by identity)."""
    params = tuple(sorted((name, _hashable(value)) for name, value in eqn.params.items()))
    return eqn.primitive, tuple(program.aval(atom) for atom in eqn.invars), params


def _hashable(value):
    try:
        hash(value)
    except TypeError:
        return id(value)
    return value
