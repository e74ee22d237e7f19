"""``jaxtool.jacve``: Jacobians by vertex elimination, shaped exactly like ``jax.jacrev``'s."""

from __future__ import annotations

import functools

import numpy as np

import jax
import jax.numpy as jnp

from jaxtool.elimination import Problem, blocks, build, run
from jaxtool.graph import flatten
from jaxtool.orders import parse_order, resolve_order


def _positions(argnums) -> tuple:
    return (argnums,) if isinstance(argnums, int) else tuple(argnums)


def _is_array(x) -> bool:
    """Whether ``x`` may pass into or out of ``jax.jit``: an array, a tracer or a numeric scalar."""
    return hasattr(x, "dtype") or isinstance(x, (bool, int, float, complex))


def _trace(fun, args, kwargs, positions, has_aux):
    """Trace ``fun`` as a function of the flat leaves of ``args[positions]``.

    Returns the flat program, the differentiated leaves, their tree, the output and aux trees,
    and the aux leaves that are not arrays (Python scalars, strings, objects: ``{position: value}``),
    which are returned as they are, as ``jax.jacrev`` returns them, instead of being program outputs.
    """
    for p in positions:
        if not -len(args) <= p < len(args):
            raise ValueError(f"argnums {p} out of range for {len(args)} positional arguments")
    leaves, dyn_tree = jax.tree_util.tree_flatten(tuple(args[p] for p in positions))
    leaves = [jnp.asarray(x) for x in leaves]
    trees = {}

    def flat_fun(*flat):
        full = list(args)
        for p, value in zip(positions, jax.tree_util.tree_unflatten(dyn_tree, flat)):
            full[p] = value
        result = fun(*full, **kwargs)
        out, aux = result if has_aux else (result, None)
        out_leaves, trees["out"] = jax.tree_util.tree_flatten(out)
        aux_leaves, trees["aux"] = jax.tree_util.tree_flatten(aux)
        trees["static"] = {n: leaf for n, leaf in enumerate(aux_leaves) if not hasattr(leaf, "dtype")}
        return list(out_leaves) + [leaf for n, leaf in enumerate(aux_leaves) if n not in trees["static"]]

    program = flatten(jax.make_jaxpr(flat_fun)(*leaves))
    return program, leaves, dyn_tree, trees["out"], trees["aux"], trees["static"]


def _signature(args, kwargs) -> tuple:
    """The tree, shapes and dtypes of a call's arguments (a ``jax.jit`` cache entry's)."""
    leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
    return tree, tuple((np.shape(x), jnp.result_type(x)) for x in leaves)


#: Python and NumPy scalars among the arguments not differentiated that the staged Jacobian takes
#: as static: integers and booleans (sizes, counts, flags) always; floats once ``fun`` has needed
#: them concrete
INTEGERS = (bool, int, np.integer, np.bool_)
SCALARS = INTEGERS + (float, complex, np.inexact)


def _split(args, kwargs, positions, kinds):
    """A call's arguments as (static, tree, dynamic) for the staged Jacobian.

    Python and NumPy scalars of ``kinds`` outside the differentiated arguments stay such values
    (``static``: flat leaf index, type and value), as ``jax.jacrev`` leaves them, so that
    ``fun`` may use them as sizes or in Python control flow; every other leaf is traced
    (``dynamic``).
    """
    differentiated = {p % len(args) for p in positions} if args else set()
    flags = []
    for n, arg in enumerate(args):
        flags += [n not in differentiated] * len(jax.tree_util.tree_leaves(arg))
    leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
    flags += [True] * (len(leaves) - len(flags))  # keyword arguments are never differentiated
    # the type too: jax.jit's cache would take True, 1 and 1.0 for one another
    static = tuple((n, type(x), x) for n, (x, outside) in enumerate(zip(leaves, flags))
                   if outside and isinstance(x, kinds))
    fixed = {n for n, _, _ in static}
    return static, tree, [x for n, x in enumerate(leaves) if n not in fixed]


def _merge(static, tree, dynamic):
    """The ``(args, kwargs)`` that :func:`_split` split."""
    values, dynamic = {n: x for n, _, x in static}, iter(dynamic)
    leaves = [values[n] if n in values else next(dynamic) for n in range(tree.num_leaves)]
    return jax.tree_util.tree_unflatten(tree, leaves)


def jacve(fun, order="rev", argnums=0, has_aux=False):
    """The Jacobian of ``fun`` by vertex elimination in ``order``.

    Returns a function with the signature of ``fun`` whose output has exactly the structure of
    ``jax.jacrev(fun, argnums=argnums, has_aux=has_aux)``: for each output leaf, the pytree of the
    differentiated argument(s) with leaves of shape ``out.shape + in.shape``.

    ``order`` is ``"fwd"``/``"forward"``, ``"rev"``/``"reverse"``, ``"markowitz"``, or a sequence
    (or comma-separated string) of vertex numbers: a permutation of the eliminable vertices of the
    traced program, numbered as ``jaxtool show --vertices`` prints them.

    The computation is staged with ``jax.jit``, so repeated calls with the same argument types
    reuse the traced elimination. Python and NumPy integer and boolean scalars among the
    arguments not differentiated are passed to ``fun`` as they are, as ``jax.jacrev`` passes them
    (``fun`` may use them as sizes or in ``if``), and each new value of one is traced anew; float
    scalars are traced, unless ``fun`` needs one concrete (a ``ConcretizationTypeError``): from
    then on they are passed as they are too. It composes with ``jax.jit``, ``jax.vmap``,
    ``jax.jacfwd``, ``jax.jacrev`` and with ``jacve`` itself.
    """
    if isinstance(order, str):
        parse_order(order)  # fail early on a malformed name
    positions = _positions(argnums)

    def parts(*args, **kwargs):
        """The Jacobian, the aux leaves that are arrays, the aux tree and the other aux leaves."""
        program, leaves, dyn_tree, out_tree, aux_tree, static = _trace(fun, args, kwargs, positions, has_aux)
        problem = build(program, leaves, range(len(leaves)))
        run(problem, resolve_order(order, problem))
        n_out = out_tree.num_leaves
        # jax.jacrev's layout: outer structure of the output, inner structure of the inputs
        inner = [jax.tree_util.tree_unflatten(dyn_tree, row) for row in blocks(problem)[:n_out]]
        if isinstance(argnums, int):
            inner = [i[0] for i in inner]
        return jax.tree_util.tree_unflatten(out_tree, inner), list(problem.out_values[n_out:]), aux_tree, static

    def with_aux(result, arrays, aux_tree, static):
        if not has_aux:
            return result
        arrays = iter(arrays)
        leaves = [static[n] if n in static else next(arrays) for n in range(aux_tree.num_leaves)]
        return result, jax.tree_util.tree_unflatten(aux_tree, leaves)

    # aux leaves that are not arrays cannot leave jax.jit: kept per call signature, as traced
    aux_layouts = {}

    def staged_parts(static, call_tree, *dynamic):
        args, kwargs = _merge(static, call_tree, dynamic)
        result, arrays, aux_tree, static_aux = parts(*args, **kwargs)
        if has_aux:
            aux_layouts[static, _signature(args, kwargs)] = (aux_tree, static_aux)
        return result, arrays

    staged = jax.jit(staged_parts, static_argnums=(0, 1))

    kinds = [INTEGERS]  # SCALARS from the first call whose fun needs a Python float concrete

    @functools.wraps(fun)
    def jacobian_staged(*args, **kwargs):
        leaves = jax.tree_util.tree_leaves((args, kwargs))
        if all(_is_array(x) for x in leaves):
            static, call_tree, dynamic = _split(args, kwargs, positions, kinds[0])
            try:
                result, arrays = staged(static, call_tree, *dynamic)
            except (jax.errors.ConcretizationTypeError, jax.errors.TracerIntegerConversionError):
                retry = _split(args, kwargs, positions, SCALARS)
                if kinds[0] is SCALARS or retry[0] == static:
                    raise
                static, call_tree, dynamic = retry
                result, arrays = staged(static, call_tree, *dynamic)
                kinds[0] = SCALARS
            if not has_aux:
                return result
            return with_aux(result, arrays, *aux_layouts[static, _signature(args, kwargs)])
        return with_aux(*parts(*args, **kwargs))  # non-array arguments cannot be staged

    return jacobian_staged


def trace_problem(fun, *args, argnums=0) -> Problem:
    """The elimination problem of ``fun`` at ``args``: its graph of partials and eliminable vertices.

    ``problem.eliminable`` lists the vertices a custom order must permute;
    ``jaxtool.elimination.run(problem.plan(), order)`` costs an order without computing values.
    """
    program, leaves, *_ = _trace(fun, args, {}, _positions(argnums), False)
    return build(program, leaves, range(len(leaves)))
