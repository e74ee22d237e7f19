"""``jaxtool.jacve``: Jacobians by vertex elimination, shaped exactly like ``jax.jacrev``'s."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxtool.elimination import blocks, build, run
from jaxtool.graph import flatten
from jaxtool.orders import parse_order, resolve_order


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
    int_argnums = isinstance(argnums, int)
    positions = (argnums,) if int_argnums else tuple(argnums)

    def jacobian(*args, **kwargs):
        for p in positions:
            if not -len(args) <= p < len(args):
                raise ValueError(f"argnums {argnums} out of range for {len(args)} positional arguments")
        dyn = tuple(args[p] for p in positions)
        dyn_leaves, dyn_tree = jax.tree_util.tree_flatten(dyn)
        dyn_leaves = [jnp.asarray(x) for x in dyn_leaves]
        out_tree_box = {}

        def flat_fun(*leaves):
            full = list(args)
            for p, value in zip(positions, jax.tree_util.tree_unflatten(dyn_tree, leaves)):
                full[p] = value
            result = fun(*full, **kwargs)
            out, aux = result if has_aux else (result, None)
            out_leaves, out_tree_box["out"] = jax.tree_util.tree_flatten(out)
            aux_leaves, out_tree_box["aux"] = jax.tree_util.tree_flatten(aux)
            return list(out_leaves) + list(aux_leaves)

        closed = jax.make_jaxpr(flat_fun)(*dyn_leaves)
        out_tree, aux_tree = out_tree_box["out"], out_tree_box["aux"]
        n_out = out_tree.num_leaves
        program = flatten(closed)
        problem = build(program, dyn_leaves, range(len(dyn_leaves)))
        run(problem, resolve_order(order, problem))
        jac = blocks(problem)[:n_out]
        # jax.jacrev's layout: outer structure of the output, inner structure of the inputs
        inner = [jax.tree_util.tree_unflatten(dyn_tree, row) for row in jac]
        if int_argnums:
            inner = [i[0] for i in inner]
        result = jax.tree_util.tree_unflatten(out_tree, inner)
        if has_aux:
            aux = jax.tree_util.tree_unflatten(aux_tree, list(problem.out_values[n_out:]))
            return result, aux
        return result

    staged = jax.jit(jacobian)

    @functools.wraps(fun)
    def jacobian_staged(*args, **kwargs):
        leaves = jax.tree_util.tree_leaves((args, kwargs))
        if all(isinstance(x, (jax.Array, float, int, complex, bool)) or hasattr(x, "__jax_array__")
               or hasattr(x, "dtype") for x in leaves):
            return staged(*args, **kwargs)
        return jacobian(*args, **kwargs)

    return jacobian_staged


def trace_problem(fun, *args, argnums=0):
    """The elimination problem of ``fun`` at ``args`` (graph of partials, outputs, eliminable vertices).

    Useful to list ``problem.eliminable`` (for custom orders) or to cost orders with
    :func:`jaxtool.elimination.run` on ``problem.plan()``.
    """
    positions = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    dyn = tuple(args[p] for p in positions)
    dyn_leaves, dyn_tree = jax.tree_util.tree_flatten(dyn)
    dyn_leaves = [jnp.asarray(x) for x in dyn_leaves]

    def flat_fun(*leaves):
        full = list(args)
        for p, value in zip(positions, jax.tree_util.tree_unflatten(dyn_tree, leaves)):
            full[p] = value
        return jax.tree_util.tree_leaves(fun(*full))

    program = flatten(jax.make_jaxpr(flat_fun)(*dyn_leaves))
    return build(program, dyn_leaves, range(len(dyn_leaves)))
