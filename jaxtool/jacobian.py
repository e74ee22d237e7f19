"""``jaxtool.jacve``: Jacobians by vertex elimination, shaped exactly like ``jax.jacrev``'s."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxtool.elimination import Problem, blocks, build, run
from jaxtool.graph import flatten
from jaxtool.orders import parse_order, resolve_order


def _positions(argnums) -> tuple:
    return (argnums,) if isinstance(argnums, int) else tuple(argnums)


def _trace(fun, args, kwargs, positions, has_aux):
    """Trace ``fun`` as a function of the flat leaves of ``args[positions]``.

    Returns the flat program, the differentiated leaves, their tree, and the output and aux trees.
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
        return list(out_leaves) + list(aux_leaves)

    program = flatten(jax.make_jaxpr(flat_fun)(*leaves))
    return program, leaves, dyn_tree, trees["out"], trees["aux"]


def jacve(fun, order="rev", argnums=0, has_aux=False):
    """The Jacobian of ``fun`` by vertex elimination in ``order``.

    Returns a function with the signature of ``fun`` whose output has exactly the structure of
    ``jax.jacrev(fun, argnums=argnums, has_aux=has_aux)``: for each output leaf, the pytree of the
    differentiated argument(s) with leaves of shape ``out.shape + in.shape``.

    ``order`` is ``"fwd"``/``"forward"``, ``"rev"``/``"reverse"``, ``"markowitz"``, or a sequence
    (or comma-separated string) of vertex numbers: a permutation of the eliminable vertices of the
    traced program, numbered as ``jaxtool show --vertices`` prints them.

    The computation is staged with ``jax.jit``, so repeated calls with the same argument types
    reuse the traced elimination; it composes with ``jax.jit``, ``jax.vmap``, ``jax.jacfwd``,
    ``jax.jacrev`` and with ``jacve`` itself.
    """
    if isinstance(order, str):
        parse_order(order)  # fail early on a malformed name
    positions = _positions(argnums)

    def jacobian(*args, **kwargs):
        program, leaves, dyn_tree, out_tree, aux_tree = _trace(fun, args, kwargs, positions, has_aux)
        problem = build(program, leaves, range(len(leaves)))
        run(problem, resolve_order(order, problem))
        n_out = out_tree.num_leaves
        # jax.jacrev's layout: outer structure of the output, inner structure of the inputs
        inner = [jax.tree_util.tree_unflatten(dyn_tree, row) for row in blocks(problem)[:n_out]]
        if isinstance(argnums, int):
            inner = [i[0] for i in inner]
        result = jax.tree_util.tree_unflatten(out_tree, inner)
        if has_aux:
            return result, jax.tree_util.tree_unflatten(aux_tree, list(problem.out_values[n_out:]))
        return result

    staged = jax.jit(jacobian)

    @functools.wraps(fun)
    def jacobian_staged(*args, **kwargs):
        leaves = jax.tree_util.tree_leaves((args, kwargs))
        if all(hasattr(x, "dtype") or isinstance(x, (int, float, bool)) for x in leaves):
            return staged(*args, **kwargs)
        return jacobian(*args, **kwargs)  # non-array arguments cannot be staged

    return jacobian_staged


def trace_problem(fun, *args, argnums=0) -> Problem:
    """The elimination problem of ``fun`` at ``args``: its graph of partials and eliminable vertices.

    ``problem.eliminable`` lists the vertices a custom order must permute;
    ``jaxtool.elimination.run(problem.plan(), order)`` costs an order without computing values.
    """
    program, leaves, *_ = _trace(fun, args, {}, _positions(argnums), False)
    return build(program, leaves, range(len(leaves)))
