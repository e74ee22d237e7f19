"""Local partial Jacobians of JAX primitives: one rule per primitive, in one table.

A rule receives the equation, the primal values of its inputs and outputs, and the positions of
the inputs to differentiate with respect to (real floating-point inputs that depend on the
differentiated arguments). It returns ``(input position, output position, partial)`` triples of
:mod:`jaxtool.partials` objects; a missing triple is a zero partial.

Derivative *values* come from JAX's own differentiation rules wherever possible (a JVP with a
tangent of ones gives the diagonal of an elementwise primitive exactly as ``jax.jacfwd`` sees it,
ties of ``max``/``min`` included); the rules here add the *structure* that keeps partials small.
Primitives without a structured rule become one opaque vertex whose partials are the primitive's
JVP (or, for ``custom_vjp``, its VJP) applied lazily: correct for everything JAX can differentiate,
and reported as opaque by the counters. Equations that read or make complex values work on
(real, imaginary) pairs (:func:`complex_partials`): block-diagonal where elementwise, else opaque.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Optional

import numpy as np

import jax
import jax.numpy as jnp
from jax.extend.core import primitives as P

from jaxtool._compat import split_p, stack_p, unstack_p
from jaxtool.errors import UnsupportedError
from jaxtool.graph import NUMPY_RULES, PRIMAL_RULES, FlatEqn, bind
from jaxtool.partials import (MAX_PARTS, JointPullback, Linear, OutputsPullback, Sparse, ValueNotes, apart, cast,
                              promoted, reshaped, selection_from_index, sum_of_selections)
from jaxtool.printing import subjaxprs
from jaxtool.point_forms import two_forms_p
from jaxtool.sharing import materialize_p, once_p

Rule = Callable  # (eqn, invals, outvals, wrt) -> list[(int, int, Partial)]
RULES: dict = {}


def register(*primitives):
    def wrap(rule):
        for p in primitives:
            RULES[p] = rule
        return rule

    return wrap


def is_differentiable(aval) -> bool:
    """Whether values of this type can be differentiated with respect to (real floating point)."""
    return jnp.issubdtype(aval.dtype, jnp.floating)


def _is_complex(aval) -> bool:
    return jnp.issubdtype(aval.dtype, jnp.complexfloating)


def carries_tangent(aval) -> bool:
    """Whether values of this type carry a derivative through the graph: real or complex floating
    point (a complex value is a vertex of (real, imaginary) pairs, see :func:`tangent_shape`)."""
    return is_differentiable(aval) or _is_complex(aval)


def tangent_shape(aval) -> tuple:
    """The shape of a value's vertex in the graph: a complex value's has a last axis of 2 (real,
    imaginary part), so that every partial is a real matrix (complex maps such as ``conj`` or
    ``abs`` are real-linear, not complex-linear)."""
    return tuple(aval.shape) + ((2,) if _is_complex(aval) else ())


def tangent_dtype(aval) -> np.dtype:
    """The dtype of a value's vertex in the graph: a complex value's is that of its parts."""
    return np.dtype(jnp.finfo(aval.dtype).dtype) if _is_complex(aval) else np.dtype(aval.dtype)


def partials_of(eqn: FlatEqn, invals, outvals, wrt) -> list:
    """The structured partials of one equation (see module docstring)."""
    if any(_is_complex(jax.typeof(x)) for x in [invals[i] for i in wrt] + list(outvals)):
        return complex_partials(eqn, invals, outvals, wrt)
    rule = RULES.get(eqn.primitive, opaque)
    return rule(eqn, invals, outvals, wrt)


# --------------------------------------------------------------------------------------------
# helpers


def _jvp_at(eqn, invals, i, t, carrying=()):
    """Output tangents of ``eqn`` for tangent ``t`` on input ``i`` (zero on the others).

    The other inputs are held constant, so JAX passes them symbolic zeros, which some JVP rules
    need (``scatter_mul`` with repeated indices). Some rules reject a symbolic zero where the input
    carries a derivative in the program (a general ``reduce`` of several operands): the inputs
    ``carrying`` (the equation's differentiated positions) then get explicit zero tangents and
    the others, constants, stay symbolic, as in ``jax.jacfwd``. A few rules reject symbolic zeros
    altogether (``custom_linear_solve``); those get explicit zero tangents for every input.
    """
    others = [j for j in range(len(invals)) if j != i]
    carried = [j for j in carrying if j != i]
    # the inputs given explicit zero tangents, attempt by attempt (none: all symbolic)
    attempts = [[]] + ([carried] if carried and carried != others else []) + ([others] if others else [])
    for n, zeros in enumerate(attempts):
        positions = [i] + zeros

        def of_inputs(*xs, positions=positions):
            full = list(invals)
            for j, x in zip(positions, xs):
                full[j] = x
            return bind(eqn, *full)

        tangents = (t, *(_zero_tangent(invals[j]) for j in zeros))
        try:
            _, out = jax.jvp(of_inputs, tuple(invals[j] for j in positions), tangents)
            break
        except (TypeError, NotImplementedError) as error:
            if n == len(attempts) - 1 or (n == 0 and not isinstance(error, TypeError)):
                raise
    return out if eqn.primitive.multiple_results else (out,)


def _zero_tangent(x):
    aval = jax.typeof(x)
    if carries_tangent(aval):
        return jnp.zeros(aval.shape, aval.dtype)
    return np.zeros(aval.shape, jax.dtypes.float0)


def _shape(x):
    return tuple(jnp.shape(x))


def _float_outputs(outvals):
    return [k for k, y in enumerate(outvals) if is_differentiable(jax.typeof(y))]


# --------------------------------------------------------------------------------------------
# elementwise: diagonal partials, values from a JVP with a tangent of ones

ELEMENTWISE = [
    P.abs_p, P.exp_p,
    P.exp2_p, P.expm1_p, P.log_p, P.log1p_p, P.sin_p, P.cos_p, P.tan_p, P.asin_p, P.acos_p,
    P.atan_p, P.atan2_p, P.sinh_p, P.cosh_p, P.tanh_p, P.asinh_p, P.acosh_p, P.atanh_p,
    P.logistic_p, P.rsqrt_p, P.cbrt_p, P.pow_p, P.integer_pow_p, P.square_p, P.erf_p,
    P.erfc_p, P.erf_inv_p, P.rem_p,
    P.lgamma_p, P.digamma_p, P.igamma_p, P.igammac_p, P.nextafter_p, P.reduce_precision_p,
    P.bessel_i0e_p, P.bessel_i1e_p, P.polygamma_p, P.zeta_p,
]


def _operand_partial(x_shape, out_shape, d, dtype) -> Sparse:
    """The diagonal partial of an elementwise result w.r.t. an operand of ``x_shape``.

    ``d`` (broadcastable to ``out_shape``; ``None`` for exactly one) is the derivative; an operand
    broadcast against the others (rank 0, or size-1 axes) is paired only along its full axes.
    """
    pairs = tuple(k if x_shape and x_shape[k] == n else None for k, n in enumerate(out_shape))
    unpaired = [j for j in range(len(x_shape)) if j not in pairs]
    if d is None:
        return Sparse.structural(out_shape, x_shape, pairs, dtype)
    d = jnp.asarray(d)
    padded = (1,) * (len(out_shape) - d.ndim) + d.shape
    d = reshaped(d, tuple(1 if s == 1 else n for s, n in zip(padded, out_shape)) + (1,) * len(unpaired))
    return Sparse(out_shape, x_shape, pairs, d.shape, np.dtype(d.dtype), d)


@register(*ELEMENTWISE)
def elementwise(eqn, invals, outvals, wrt):
    """Any elementwise primitive: the derivative is JAX's JVP along a tangent of ones (an
    :class:`UnsupportedError` where JAX has no rule for an operand: ``nextafter``, ``zeta``'s first,
    ``polygamma``'s order)."""
    out_shape = _shape(outvals[0])
    dtype = jax.typeof(outvals[0]).dtype
    result = []
    for i in wrt:
        x = invals[i]
        try:
            d = _jvp_at(eqn, invals, i, jnp.ones(_shape(x), jax.typeof(x).dtype), wrt)[0]
        except (NotImplementedError, ValueError) as error:
            raise _cannot_differentiate(eqn, error, f" with respect to operand {i}") from error
        result.append((i, 0, _operand_partial(_shape(x), out_shape, d, dtype)))
    return result


@register(P.sqrt_p)
def sqrt(eqn, invals, outvals, wrt):
    """``d sqrt(x)/dx = 0.5 * (1/sqrt(x))``, from the result: the reciprocal a division by the root
    (a layer norm's) computes too, one kernel for both. JAX's JVP recomputes the root, and XLA rewrites
    ``0.5 / sqrt(x)`` to ``0.5 * rsqrt(x)``, a kernel of its own that reads the root's operand again
    (perceptron's rev order: 20 kernels so, 19 from the result; the encoder's: 66, 64)."""
    out = outvals[0]
    d = 0.5 * (1 / out)
    return [(i, 0, _operand_partial(_shape(invals[i]), _shape(out), d, jax.typeof(out).dtype)) for i in wrt]


@register(P.add_p, P.add_jaxvals_p, P.sub_p, P.neg_p)
def signed_sum(eqn, invals, outvals, wrt):
    """``+1`` partials cost nothing; ``-1`` partials are a single stored value."""
    out_shape = _shape(outvals[0])
    dtype = jax.typeof(outvals[0]).dtype
    negative = {P.sub_p: {1}, P.neg_p: {0}}.get(eqn.primitive, set())
    return [(i, 0, _operand_partial(_shape(invals[i]), out_shape,
                                    jnp.asarray(-1, dtype) if i in negative else None, dtype)) for i in wrt]


def _ones_where(chosen, dtype):
    """1 where the boolean array ``chosen`` holds, else 0, in ``dtype``: with a select, not a
    conversion of the booleans, which XLA turns a product with into a select that drops the NaN
    of a zero times an infinite or NaN value (under ``jax.jit``)."""
    return jax.lax.select(chosen, jnp.ones(chosen.shape, dtype), jnp.zeros(chosen.shape, dtype))


def _chosen_partial(x_shape, out_shape, chosen, dtype) -> Sparse:
    """The partial of an operand that is the result where ``chosen`` holds (broadcastable to
    ``out_shape``): one there, and elsewhere an exact zero (:attr:`~jaxtool.partials.Sparse.live`),
    as JAX's JVP rules of ``select_n`` and ``clamp`` select the tangent rather than multiply it."""
    chosen = jnp.broadcast_to(chosen, out_shape)
    partial = _operand_partial(x_shape, out_shape, _ones_where(chosen, dtype), dtype)
    return replace(partial, live=reshaped(chosen, partial.val_shape))


@register(P.select_n_p)
def select_n(eqn, invals, outvals, wrt):
    """``select_n(which, *cases)``: case ``j`` is chosen where ``which == j`` (a boolean ``which``
    chooses case 1 where True)."""
    which = invals[0]
    out_shape = _shape(outvals[0])
    dtype = jax.typeof(outvals[0]).dtype
    return [(i, 0, _chosen_partial(_shape(invals[i]), out_shape, which == (i - 1), dtype)) for i in wrt]


@register(P.max_p, P.min_p)
def max_min(eqn, invals, outvals, wrt):
    """``max(x, y)``: ``x``'s partial is one where ``x > y``, one half at a tie and zero elsewhere
    (``min``: ``x < y``), JAX's values, NaN included (zero for both operands). From comparisons of the
    operands with each other, not, as JAX's JVP rule compares them, of each operand with the result:
    XLA may compute an operand in two kernels, once for the result and once for the comparison, and
    under XLA:CPU's older emitters with ``jax_disable_most_optimizations`` fuzz seed 267's compiled
    ``markowitz`` Jacobian (a ``jnp.hypot`` of ``tanh`` values) was off by up to 0.93 with JAX's rule,
    right with this one. Complex operands keep JAX's rule (:data:`COMPLEX_ELEMENTWISE`)."""
    x, y = invals
    out_shape = _shape(outvals[0])
    dtype = jax.typeof(outvals[0]).dtype
    wins = jax.lax.gt if eqn.primitive is P.max_p else jax.lax.lt
    tie = jnp.broadcast_to(jax.lax.eq(x, y), out_shape)
    half = jax.lax.select(tie, jnp.full(out_shape, 0.5, dtype), jnp.zeros(out_shape, dtype))  # both operands'
    result = []
    for i in wrt:
        a, b = (x, y) if i == 0 else (y, x)
        d = jax.lax.select(jnp.broadcast_to(wins(a, b), out_shape), jnp.ones(out_shape, dtype), half)
        result.append((i, 0, _operand_partial(_shape(a), out_shape, d, dtype)))
    return result


@register(P.clamp_p)
def clamp(eqn, invals, outvals, wrt):
    """``clamp(lo, x, hi)``: each operand's partial is one where it is the result, as JAX's JVP rule
    decides (``x`` strictly inside, ``lo`` above ``x`` and below ``hi``, ``hi`` below ``x``; zero at
    ties). Written here because JAX's rule fails for a scalar bound of an array (``jax.jacfwd``
    raises), which this rule differentiates as the broadcast it is."""
    lo, x, hi = invals
    out_shape = _shape(outvals[0])
    dtype = jax.typeof(outvals[0]).dtype
    chosen = {0: lambda: (lo > x) & (lo < hi), 1: lambda: (x > lo) & (x < hi), 2: lambda: hi < x}
    return [(i, 0, _chosen_partial(_shape(invals[i]), out_shape, chosen[i](), dtype)) for i in wrt]


@register(P.mul_p)
def mul(eqn, invals, outvals, wrt):
    """``d(x*y)/dx = y``, kept at the shape of ``y`` (a scalar factor stays one value)."""
    out_shape = _shape(outvals[0])
    dtype = jax.typeof(outvals[0]).dtype
    return [(i, 0, _operand_partial(_shape(invals[i]), out_shape, jnp.asarray(invals[1 - i], dtype), dtype))
            for i in wrt]


@register(P.div_p)
def div(eqn, invals, outvals, wrt):
    """``d(x/y)/dx = 1/y`` at the shape of ``y`` (a scalar divisor stays one value), ``d(x/y)/dy = -(x/y) * (1/y)``:
    one division, not two (XLA:CPU computes each division several kernels read in a kernel of its own;
    roe_flux_3d's fwd-order Jacobian at a point: 32.8 us so, 33.8 us with ``-(x/y)/y``, ``jax.jacfwd``:
    33.1-33.6 us)."""
    x, y = invals
    out = outvals[0]
    out_shape = _shape(out)
    dtype = jax.typeof(out).dtype
    reciprocal = 1 / y
    d = {0: lambda: reciprocal, 1: lambda: -out * reciprocal}
    return [(i, 0, _operand_partial(_shape(invals[i]), out_shape, d[i](), dtype)) for i in wrt]


@register(P.convert_element_type_p, P.copy_p)
def identity(eqn, invals, outvals, wrt):
    if not _float_outputs(outvals):
        return []
    return [(i, 0, Sparse.identity(_shape(outvals[0]), jax.typeof(outvals[0]).dtype)) for i in wrt]


@register(materialize_p, once_p)
def materialized(eqn, invals, outvals, wrt):
    """Each output is its input (:mod:`jaxtool.sharing`, in the Jacobians ``jacve`` stages)."""
    return [(i, i, Sparse.identity(_shape(outvals[i]), jax.typeof(outvals[i]).dtype)) for i in wrt]


@register(P.stop_gradient_p, P.sign_p, P.round_p, P.floor_p, P.ceil_p)
def no_derivative(eqn, invals, outvals, wrt):
    """No partial: ``stop_gradient``, and the piecewise-constant ops whose JVP JAX defines as a
    symbolic zero (``sign``, ``round``, ``floor``, ``ceil``). Cut, as ``jax.jacrev`` cuts them,
    an infinite partial behind one (``sqrt(round(x))`` at 0) meets no explicit zero to make a NaN
    with, and what only they read is not differentiated at all."""
    return []


def cuts_derivative(eqn: FlatEqn) -> bool:
    """Whether no derivative flows through ``eqn`` whatever its operands (``stop_gradient``)."""
    return RULES.get(eqn.primitive) is no_derivative


# --------------------------------------------------------------------------------------------
# structural ops with a 0/1 pairing: zero multiplications


@register(P.transpose_p)
def transpose(eqn, invals, outvals, wrt):
    perm = tuple(eqn.params["permutation"])
    y = outvals[0]
    return [(0, 0, Sparse.structural(_shape(y), _shape(invals[0]), perm, jax.typeof(y).dtype))] if wrt else []


@register(P.broadcast_in_dim_p)
def broadcast_in_dim(eqn, invals, outvals, wrt):
    if 0 not in wrt:
        return []
    x, y = invals[0], outvals[0]
    pairs = [None] * len(_shape(y))
    for j, k in enumerate(eqn.params["broadcast_dimensions"]):
        if _shape(x)[j] == _shape(y)[k]:
            pairs[k] = j
    return [(0, 0, Sparse.structural(_shape(y), _shape(x), pairs, jax.typeof(y).dtype))]


@register(P.squeeze_p)
def squeeze(eqn, invals, outvals, wrt):
    if not wrt:
        return []
    x, y = invals[0], outvals[0]
    dims = {d % len(_shape(x)) for d in eqn.params["dimensions"]}
    kept = [j for j in range(len(_shape(x))) if j not in dims]
    return [(0, 0, Sparse.structural(_shape(y), _shape(x), kept, jax.typeof(y).dtype))]


@register(P.reduce_sum_p)
def reduce_sum(eqn, invals, outvals, wrt):
    if not wrt:
        return []
    x, y = invals[0], outvals[0]
    axes = set(eqn.params["axes"])
    kept = [j for j in range(len(_shape(x))) if j not in axes]
    return [(0, 0, Sparse.structural(_shape(y), _shape(x), kept, jax.typeof(y).dtype))]


@register(P.reshape_p)
def reshape(eqn, invals, outvals, wrt):
    """Inserting or removing unit axes is a pairing; any other reshape (or one that transposes its
    operand first, ``dimensions``) is a selection map."""
    if 0 not in wrt:
        return []
    x, y = invals[0], outvals[0]
    xs, ys = _shape(x), _shape(y)
    big_x = [j for j, n in enumerate(xs) if n != 1]
    big_y = [k for k, n in enumerate(ys) if n != 1]
    dimensions = eqn.params.get("dimensions")
    if [xs[j] for j in big_x] == [ys[k] for k in big_y] and dimensions in (None, tuple(range(len(xs)))):
        pairs = [None] * len(ys)
        for j, k in zip(big_x, big_y):
            pairs[k] = j
        return [(0, 0, Sparse.structural(ys, xs, pairs, jax.typeof(y).dtype))]
    return linear_selection(eqn, invals, outvals, wrt)


# --------------------------------------------------------------------------------------------
# reductions where each input element feeds at most one output element: values from a VJP


@register(P.reduce_max_p, P.reduce_min_p, P.reduce_prod_p)
def disjoint_reduction(eqn, invals, outvals, wrt):
    if not wrt:
        return []
    x, y = invals[0], outvals[0]
    axes = sorted(set(eqn.params["axes"]))
    kept = [j for j in range(len(_shape(x))) if j not in axes]
    if eqn.primitive is P.reduce_prod_p:
        _, pullback = jax.vjp(lambda a: bind(eqn, a), x)
        (g,) = pullback(jnp.ones(_shape(y), jax.typeof(y).dtype))
    else:
        g = _chosen_share(x, y, kept, axes)
    val = jnp.transpose(g, kept + axes)
    return [(0, 0, Sparse(_shape(y), _shape(x), tuple(kept), val.shape, np.dtype(val.dtype), val))]


def _chosen_share(x, y, kept, axes):
    """The partial of ``reduce_max``/``reduce_min`` (result ``y`` of ``x`` over ``axes``) as JAX's
    rule computes it: ``1 / count`` at the ``count`` elements equal to their result (ties split),
    0 elsewhere, and NaN throughout a NaN result's elements (0 / 0). JAX's rule itself, applied to
    a cotangent of ones, gives 0 there under ``jax.jit`` (see :func:`_ones_where`)."""
    ones = _ones_where(x == jax.lax.broadcast_in_dim(y, _shape(x), kept), jax.typeof(x).dtype)
    return ones / jnp.sum(ones, axis=tuple(axes), keepdims=True)


@register(P.cumsum_p, P.cumprod_p, P.cummax_p, P.cummin_p, P.cumlogsumexp_p)
def cumulative(eqn, invals, outvals, wrt):
    """Diagonal across the other axes, a triangular block along the scanned axis."""
    if not wrt:
        return []
    x = invals[0]
    shape = _shape(x)
    axis = eqn.params["axis"] % len(shape)
    n = shape[axis]
    dtype = jax.typeof(x).dtype
    if eqn.primitive is P.cumsum_p:
        i = jnp.arange(n)[:, None]
        j = jnp.arange(n)[None, :]
        tri = (j >= i) if eqn.params["reverse"] else (j <= i)
        val = tri.astype(dtype).reshape(tuple(n if a == axis else 1 for a in range(len(shape))) + (n,))
    else:
        def column(e):
            t = jnp.broadcast_to(e.reshape(tuple(n if a == axis else 1 for a in range(len(shape)))), shape)
            return _jvp_at(eqn, invals, 0, t.astype(dtype))[0]

        val = jnp.moveaxis(jax.vmap(column)(jnp.eye(n, dtype=dtype)), 0, -1)
    pairs = tuple(None if a == axis else a for a in range(len(shape)))
    return [(0, 0, Sparse(shape, shape, pairs, tuple(val.shape), np.dtype(val.dtype), val))]


# --------------------------------------------------------------------------------------------
# dot_general: dense only over the contracted axes and the other operand's free axes


@register(P.dot_general_p)
def dot_general(eqn, invals, outvals, wrt):
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lhs, rhs = invals
    y = outvals[0]
    dtype = jax.typeof(y).dtype
    result = []
    for i in wrt:
        me, other = (lhs, rhs) if i == 0 else (rhs, lhs)
        my_c, other_c = (lc, rc) if i == 0 else (rc, lc)
        my_b, other_b = (lb, rb) if i == 0 else (rb, lb)
        my_free = [a for a in range(jnp.ndim(me)) if a not in my_c and a not in my_b]
        other_free = [a for a in range(jnp.ndim(other)) if a not in other_c and a not in other_b]
        # output axes: batch, lhs free, rhs free
        mine_first = i == 0
        pairs = list(my_b) + (my_free if mine_first else [None] * len(other_free))
        pairs += [None] * len(other_free) if mine_first else my_free
        unpaired = sorted(my_c)
        # value axes: out axes (batch full, my free size 1, other free full), then my contracted axes in order
        order = list(other_b) + other_free + [other_c[list(my_c).index(a)] for a in unpaired]
        v = jnp.transpose(other, order)
        nb, nf = len(other_b), len(other_free)
        ones = (1,) * len(my_free)
        if mine_first:
            v = reshaped(v, v.shape[:nb] + ones + v.shape[nb:])
        else:
            v = reshaped(v, v.shape[:nb + nf] + ones + v.shape[nb + nf:])
        v = v.astype(dtype)
        result.append((i, 0, Sparse(_shape(y), _shape(me), tuple(pairs), tuple(v.shape), np.dtype(dtype), v)))
    return result


# --------------------------------------------------------------------------------------------
# lazily applied linear maps


def _as_dtype_of(t, x):
    """Tangent (or cotangent) ``t`` in the dtype of the equation's value ``x``, as JAX's rules take
    it: the graph carries it in its partials' common dtype (float32 where a program casts a value to
    bfloat16 and back)."""
    return cast(t, jax.typeof(x).dtype)


def _linear_from_jvp(eqn, invals, outvals, i, k, *, selection, flops, opaque, carrying=()):
    y = outvals[k]
    return Linear(_shape(y), _shape(invals[i]), np.dtype(jax.typeof(y).dtype),
                  fn=lambda t: _jvp_at(eqn, invals, i, _as_dtype_of(t, invals[i]), carrying)[k], selection=selection,
                  flops=flops,
                  opaque=opaque)


def _linear_by_bind(eqn, invals, outvals, i, k):
    """For a primitive linear in its floating-point operands jointly: the map ``t -> eqn(t)`` with
    the other floating-point operands zero (integer operands, such as indices, kept)."""
    params = _zero_fill(eqn.params)

    def fn(t):
        args = [_as_dtype_of(t, x) if j == i else (jnp.zeros_like(x) if is_differentiable(jax.typeof(x)) else x)
                for j, x in enumerate(invals)]
        out = eqn.primitive.bind(*args, **eqn.primitive.get_bind_params(params))
        return out[k] if eqn.primitive.multiple_results else out

    y = outvals[k]
    index = _selection_index(eqn, invals, i, k)
    traced = None if index is not None else _traced_selection_index(eqn, invals, i, k)
    return Linear(_shape(y), _shape(invals[i]), np.dtype(jax.typeof(y).dtype), fn=fn, selection=True,
                  index=index, traced_index=traced)


def _traced_selection_index(eqn, invals, i, k):
    """Where :func:`_selection_index` is not known while tracing (indices computed from values): a
    function that computes it at run time, by the primitive run on int32 element numbers 1, 2, ...
    (the other floating-point operands zero; anything not positive, out of bounds filled: -1)."""
    shape = _shape(invals[i])
    kinds = [jax.typeof(x).dtype for x in invals]
    if int(np.prod(shape)) >= np.iinfo(np.int32).max or not is_differentiable(jax.typeof(invals[i])) or not all(
            jnp.issubdtype(d, jnp.floating) or jnp.issubdtype(d, jnp.integer) or d == bool for d in kinds):
        return None
    params = eqn.primitive.get_bind_params(_zero_fill(eqn.params))

    def index():
        numbers = jnp.reshape(jax.lax.iota(np.int32, int(np.prod(shape))) + np.int32(1), shape)
        args = [numbers if j == i else (jnp.zeros(jnp.shape(x), np.int32) if is_differentiable(jax.typeof(x)) else x)
                for j, x in enumerate(invals)]
        out = eqn.primitive.bind(*args, **params)
        out = out[k] if eqn.primitive.multiple_results else out
        return jnp.where(out > 0, out - np.int32(1), np.int32(-1))

    return index


def _selection_index(eqn, invals, i, k):
    """Per output element of result ``k``, the flat index of the element of operand ``i`` it copies
    (-1: none), computed by running the primitive on element numbers (in NumPy where it has a
    NumPy form here, else with JAX while tracing); ``None`` where that needs a traced integer operand."""
    rule = SELECTION_INDEX.get(eqn.primitive)
    if rule is None:
        return _selection_index_by_evaluation(eqn, invals, i, k)
    shape = _shape(invals[i])
    ops = _concrete_operands(invals, i, np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape), -1)
    if ops is None:
        return None
    out = rule(*ops, **eqn.params)
    if out is NotImplemented:  # a mode the NumPy form does not model
        return _selection_index_by_evaluation(eqn, invals, i, k)
    return np.asarray(out[k] if eqn.primitive.multiple_results else out)


def _concrete_operands(invals, i, value, fill):
    """The operands with operand ``i`` replaced by ``value``, the other floating-point ones by
    arrays of ``fill`` (of ``value``'s dtype) and the integer ones (indices) as NumPy arrays; None
    if an integer operand is traced or a floating-point one is not real."""
    ops = []
    for j, x in enumerate(invals):
        aval = jax.typeof(x)
        if is_differentiable(aval) or j == i:
            if not jnp.issubdtype(aval.dtype, jnp.floating):
                return None
            ops.append(value if j == i else np.full(aval.shape, fill, value.dtype))
            continue
        try:
            ops.append(np.asarray(x))
        except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
            return None
    return ops


def _zero_fill(params) -> dict:
    """``params`` with gather's out-of-bounds fill value (a constant: no tangent, no index) zero."""
    params = dict(params)
    if params.get("fill_value") is not None:
        params["fill_value"] = 0
    return params


#: element numbers are exact in float32 below this count
EXACT_FLOAT32_COUNT = 1 << 24


def _element_numbers(shape):
    """Float32 element numbers 1, 2, ... laid out in ``shape``; None if float32 cannot count that far."""
    n = int(np.prod(shape))
    return (np.arange(n, dtype=np.float32) + 1).reshape(shape) if n < EXACT_FLOAT32_COUNT else None


def _element_index(numbers) -> np.ndarray:
    """The flat indices (-1 for 0: none) that element numbers moved by a linear selection stand for."""
    return np.rint(np.asarray(numbers)).astype(np.int64) - 1


def _selection_index_by_evaluation(eqn, invals, i, k):
    """:func:`_selection_index` for a selection without a NumPy form here (a ``gather`` in a mode
    :func:`_np_gather` does not model): the primitive run, while tracing, on element numbers 1, 2,
    ... in float32 (0 out of bounds: -1). This runs XLA: a compilation per new shape (40-90 ms)."""
    numbers = _element_numbers(_shape(invals[i]))
    ops = None if numbers is None else _concrete_operands(invals, i, numbers, 0)
    if ops is None:
        return None
    with jax.ensure_compile_time_eval():
        out = eqn.primitive.bind(*ops, **eqn.primitive.get_bind_params(_zero_fill(eqn.params)))
    return _element_index(out[k] if eqn.primitive.multiple_results else out)


def _np_pad(x, value, *, padding_config):
    for axis, (lo, hi, interior) in enumerate(padding_config):
        n = x.shape[axis]
        if interior and n > 1:
            grown = np.full(x.shape[:axis] + (n + (n - 1) * interior,) + x.shape[axis + 1:], value, x.dtype)
            index = [slice(None)] * x.ndim
            index[axis] = slice(None, None, interior + 1)
            grown[tuple(index)] = x
            x = grown
        widths = [(0, 0)] * x.ndim
        widths[axis] = (max(lo, 0), max(hi, 0))
        x = np.pad(x, widths, constant_values=value)
        index = [slice(None)] * x.ndim
        index[axis] = slice(-min(lo, 0), x.shape[axis] + min(hi, 0))
        x = x[tuple(index)]
    return x


def _np_start(starts, x_shape, sizes):
    """``dynamic_slice``'s start indices, clamped into range as XLA clamps them."""
    return [int(np.clip(s, 0, n - m)) for s, n, m in zip(starts, x_shape, sizes)]


def _np_dynamic_update_slice(x, update, *starts, **_):
    starts = _np_start(starts, x.shape, update.shape)
    x = x.copy()
    x[tuple(slice(s, s + m) for s, m in zip(starts, update.shape))] = update
    return x


def _np_dynamic_slice(x, *starts, slice_sizes):
    starts = _np_start(starts, x.shape, slice_sizes)
    return x[tuple(slice(s, s + m) for s, m in zip(starts, slice_sizes))]


def _window_starts(operand_shape, indices, index_map, operand_batching, indices_batching, sizes, mode, clamped):
    """Where the windows of a ``gather`` or ``scatter`` start in the operand, and which are in bounds.

    ``indices`` holds one index vector per batch position on its last axis (JAX's layout); its
    entry ``k`` is the start along operand axis ``index_map[k]``, and a batch position's coordinate
    on indices axis ``indices_batching[j]`` is its start along operand axis ``operand_batching[j]``.
    A window whose ``sizes`` do not fit from its start is clamped into the operand in the modes
    ``clamped``, else reported out of bounds (the whole window then reads the fill value, or its
    updates are dropped). Returns ``(starts, in_bounds)`` of shapes ``batch + (operand rank,)`` and
    ``batch``, or None for a mode other than ``CLIP``, ``FILL_OR_DROP`` and ``PROMISE_IN_BOUNDS``.
    """
    modes = jax.lax.GatherScatterMode
    if mode not in (modes.CLIP, modes.FILL_OR_DROP, modes.PROMISE_IN_BOUNDS):
        return None
    indices = np.asarray(indices).astype(np.int64)
    batch = indices.shape[:-1]
    starts = np.zeros(batch + (len(operand_shape),), np.int64)
    for k, axis in enumerate(index_map):
        starts[..., axis] = indices[..., k]
    for axis, coordinate in zip(operand_batching, indices_batching):
        starts[..., axis] = np.arange(batch[coordinate]).reshape((-1,) + (1,) * (len(batch) - coordinate - 1))
    upper = np.asarray(operand_shape, np.int64) - np.asarray(sizes, np.int64)
    in_bounds = np.all((starts >= 0) & (starts <= upper), axis=-1)
    if mode in clamped:
        in_bounds = np.ones(batch, bool)
    return np.clip(starts, 0, np.maximum(upper, 0)), in_bounds


def _np_gather(operand, indices, *, dimension_numbers, slice_sizes, mode, **_):
    """``gather`` of NumPy arrays as XLA runs it (``NotImplemented`` for a mode not modelled): a
    window out of bounds is moved into bounds, or with ``FILL_OR_DROP`` reads -1 (the "no element"
    of an element-number array; JAX fills it with ``fill_value``, a constant)."""
    d = dimension_numbers
    modes = jax.lax.GatherScatterMode
    found = _window_starts(operand.shape, indices, d.start_index_map, d.operand_batching_dims,
                           d.start_indices_batching_dims, slice_sizes, mode, (modes.CLIP, modes.PROMISE_IN_BOUNDS))
    if found is None:
        return NotImplemented
    starts, in_bounds = found
    rank = in_bounds.ndim + len(d.offset_dims)
    batch_positions = [n for n in range(rank) if n not in d.offset_dims]
    window_axes = [a for a in range(operand.ndim)
                   if a not in d.collapsed_slice_dims and a not in d.operand_batching_dims]
    coordinates = _coordinates(starts, slice_sizes, window_axes, d.offset_dims, batch_positions, rank)
    return np.where(_on(in_bounds, batch_positions, rank), operand[coordinates], -1)


def _scatter_targets(out_shape, indices, upd_shape, dimension_numbers, mode):
    """Per element of a ``scatter``'s updates, the flat index of the output element it goes to, -1
    where its window is dropped (XLA drops a window out of bounds unless the mode is ``CLIP``,
    which moves it into bounds); None for a mode not modelled."""
    d = dimension_numbers
    window_axes = [a for a in range(len(out_shape))
                   if a not in d.inserted_window_dims and a not in d.operand_batching_dims]
    sizes = [1] * len(out_shape)
    for axis, position in zip(window_axes, d.update_window_dims):
        sizes[axis] = upd_shape[position]
    found = _window_starts(out_shape, indices, d.scatter_dims_to_operand_dims, d.operand_batching_dims,
                           d.scatter_indices_batching_dims, sizes, mode, (jax.lax.GatherScatterMode.CLIP,))
    if found is None:
        return None
    starts, in_bounds = found
    rank = len(upd_shape)
    batch_positions = [n for n in range(rank) if n not in d.update_window_dims]
    coordinates = _coordinates(starts, sizes, window_axes, d.update_window_dims, batch_positions, rank)
    flat = np.ravel_multi_index(tuple(np.broadcast_arrays(*coordinates)), out_shape) if out_shape else \
        np.zeros(upd_shape, np.int64)
    return np.where(_on(in_bounds, batch_positions, rank), flat, -1)


def _on(batch_array, batch_positions, rank):
    """An array over a result's batch positions, laid out on those axes of a rank-``rank`` array."""
    shape = [1] * rank
    for n, position in enumerate(batch_positions):
        shape[position] = batch_array.shape[n]
    return batch_array.reshape(shape)


def _coordinates(starts, sizes, window_axes, window_positions, batch_positions, rank):
    """Per operand axis, the coordinates of the elements of a rank-``rank`` result (or update):
    the window start of the element's batch position (its axes ``batch_positions``) plus, on the
    operand's ``window_axes[j]``, the element's coordinate on its axis ``window_positions[j]``."""
    coordinates = []
    for axis in range(starts.shape[-1]):
        c = _on(starts[..., axis], batch_positions, rank)
        if axis in window_axes:
            shape = [1] * rank
            shape[window_positions[window_axes.index(axis)]] = sizes[axis]
            c = c + np.arange(sizes[axis]).reshape(shape)
        coordinates.append(c)
    return tuple(coordinates)


#: NumPy forms of the linear selection primitives, evaluated on element numbers (see ``_selection_index``)
SELECTION_INDEX = {
    P.slice_p: NUMPY_RULES["slice"],
    P.rev_p: lambda x, *, dimensions: np.flip(x, dimensions),
    P.reshape_p: NUMPY_RULES["reshape"],
    P.concatenate_p: NUMPY_RULES["concatenate"],
    P.pad_p: _np_pad,
    split_p: lambda x, *, sizes, axis: np.split(x, np.cumsum(sizes)[:-1], axis),
    stack_p: NUMPY_RULES["stack"],
    unstack_p: lambda x, *, axis: tuple(np.moveaxis(x, axis, 0)),
    P.dynamic_slice_p: _np_dynamic_slice,
    P.dynamic_update_slice_p: _np_dynamic_update_slice,
    P.gather_p: _np_gather,
}


#: linear in their floating-point operands: the partial is the primitive itself, applied to a tangent
LINEAR_SELECTION = [P.slice_p, P.pad_p, P.concatenate_p, P.rev_p, P.gather_p, P.dynamic_slice_p,
                    P.dynamic_update_slice_p, split_p, stack_p, unstack_p]


@register(*LINEAR_SELECTION)
def linear_selection(eqn, invals, outvals, wrt):
    """Every output element is zero or one input element, the same for any values: zero multiplications."""
    return [(i, k, _linear_by_bind(eqn, invals, outvals, i, k)) for i in wrt for k in _float_outputs(outvals)]


@register(P.reduce_window_max_p, P.reduce_window_min_p)
def selection(eqn, invals, outvals, wrt):
    """Every output element is one input element, chosen by the values: zero multiplications."""
    return [(i, k, _linear_from_jvp(eqn, invals, outvals, i, k, selection=True, flops=0, opaque=False))
            for i in wrt for k in _float_outputs(outvals)]


@register(P.sort_p)
def sort(eqn, invals, outvals, wrt):
    """Each operand is permuted by the keys' sorting permutation; keys carry no derivative of it.
    Where the primal sort kept its permutation (:func:`_sort_keeping_permutation`), the partials read
    it: a gather forward, its flat indices for products and densification; else JAX's JVP of the sort."""
    permutation = _PERMUTATIONS.of(outvals[0])
    return [(i, i, _linear_from_jvp(eqn, invals, outvals, i, i, selection=True, flops=0, opaque=False)
             if permutation is None else _permuted(outvals[i], permutation, eqn.params["dimension"]))
            for i in wrt if is_differentiable(jax.typeof(outvals[i]))]


#: per result of a primal sort: its permutation (:func:`_sort_keeping_permutation`)
_PERMUTATIONS = ValueNotes()


def _sort_keeping_permutation(*operands, dimension, is_stable, num_keys):
    """The primal ``sort`` with the positions along ``dimension`` sorted along as one more operand:
    its results, each remembered with that permutation, so that the partials take it from the same
    sort (``jax.jacrev`` sorts once too) instead of sorting again and decoding where each element went."""
    positions = jax.lax.broadcasted_iota(np.int32, jnp.shape(operands[0]), dimension)
    *results, permutation = jax.lax.sort_p.bind(*operands, positions, dimension=dimension,
                                                is_stable=is_stable, num_keys=num_keys)
    for y in results:
        _PERMUTATIONS.record(y, permutation)
    return results


PRIMAL_RULES["sort"] = _sort_keeping_permutation


def _permuted(y, permutation, dimension):
    """The partial of a sort's result ``y`` on its operand: element ``o`` is the operand's element at
    ``o`` with its position along ``dimension`` replaced by ``permutation[o]``."""
    shape = _shape(y)
    strides = np.cumprod((1,) + shape[:0:-1])[::-1]

    def flat_index():
        index = permutation * np.int32(strides[dimension])
        for axis, stride in enumerate(strides):
            if axis != dimension and shape[axis] > 1:
                index = index + jax.lax.broadcasted_iota(np.int32, shape, axis) * np.int32(stride)
        return index

    return Linear(shape, shape, np.dtype(jax.typeof(y).dtype),
                  fn=lambda t: jnp.take_along_axis(t, permutation, dimension, mode="promise_in_bounds"),
                  selection=True, traced_index=flat_index)


@register(P.scatter_add_p)
def scatter_add(eqn, invals, outvals, wrt):
    """``operand`` plus ``updates`` added in at the indices: the identity on the operand; on the
    updates, where the indices are known while tracing, a sum of selections (output element ``o``
    reads the first, second, ... update that adds into it), else a lazily applied map."""
    result = []
    for i in wrt:
        if i == 0:
            result.append((0, 0, Sparse.identity(_shape(outvals[0]), jax.typeof(outvals[0]).dtype)))
            continue
        partial = _scatter_add_as_selections(eqn, invals, outvals)
        if partial is None:
            partial = _linear_from_jvp(eqn, invals, outvals, i, 0, selection=False, flops=0, opaque=False)
        result.append((i, 0, partial))
    return result


def _scatter_add_as_selections(eqn, invals, outvals):
    """The partial of ``scatter_add`` on its updates as a sum of at most ``MAX_PARTS`` selections,
    or None (traced indices, more updates into one element). The output element each update adds
    into comes from :func:`_scatter_targets`, or in a mode it does not model from the transposed
    map (a gather) run on element numbers 1, 2, ... in float32 (XLA: a compilation per new shape)."""
    out_shape, upd_shape = _shape(outvals[0]), _shape(invals[2])
    n_out = int(np.prod(out_shape))
    ops = _concrete_operands(invals, 2, np.zeros(upd_shape, np.float32), 0)
    if ops is None:
        return None
    target = _scatter_targets(out_shape, ops[1], upd_shape, eqn.params["dimension_numbers"], eqn.params["mode"])
    if target is None:
        numbers = _element_numbers(out_shape)
        if numbers is None:
            return None
        with jax.ensure_compile_time_eval():
            (moved,) = jax.linear_transpose(lambda t: bind(eqn, ops[0], ops[1], t),
                                            jax.ShapeDtypeStruct(upd_shape, np.float32))(numbers)
        target = _element_index(moved)
    target = target.reshape(-1)  # per update: its output element
    added = np.flatnonzero(target >= 0)
    counts = np.bincount(target[added], minlength=n_out)
    if not 0 < counts.max(initial=0) <= MAX_PARTS:
        return None
    added = added[np.argsort(target[added], kind="stable")]  # grouped by output element, in update order
    rank = np.arange(len(added)) - (np.cumsum(counts) - counts)[target[added]]  # place within its group
    dtype = jax.typeof(outvals[0]).dtype
    parts = []
    for r in range(counts.max()):
        index = np.full(n_out, -1)
        index[target[added[rank == r]]] = added[rank == r]
        parts.append(selection_from_index(out_shape, upd_shape, index.reshape(out_shape), dtype))
    return sum_of_selections(parts, np.dtype(dtype))


@register(P.scatter_p)
def scatter(eqn, invals, outvals, wrt):
    """``operand`` with ``updates`` written over it at the indices (``x.at[i].set(v)``): where the
    indices are known while tracing and no two updates go to one element, a selection of each (the
    operand's elements not written over; each update where it goes), as for ``dynamic_update_slice``;
    else JAX's JVP of the whole equation (:func:`opaque`). As that JVP its map was applied to every
    block that crossed it (the Markowitz order of eight 1-D heat steps with a copied boundary: 2.5
    million multiplications where ``fwd`` took 33 thousand; now 6,920 and 7,137), and under
    ``jax.vmap`` over a Jacobian's columns XLA:CPU ran each as a loop of updates (eight steps of a
    12x12 heat stencil with its boundary set: 0.95 ms a call in forward order, 0.88 ms of it there)."""
    out_shape, upd_shape = _shape(outvals[0]), _shape(invals[2])
    ops = _concrete_operands(invals, 2, np.zeros(upd_shape, np.float32), 0)
    target = None if ops is None else _scatter_targets(out_shape, ops[1], upd_shape, eqn.params["dimension_numbers"],
                                                       eqn.params["mode"])
    written = None if target is None else target.reshape(-1)
    if written is None or len(np.unique(written[written >= 0])) != np.count_nonzero(written >= 0):
        return opaque(eqn, invals, outvals, wrt)
    n_out, dtype = int(np.prod(out_shape)), jax.typeof(outvals[0]).dtype
    kept = np.flatnonzero(written >= 0)  # the updates that are written
    result = []
    for i in wrt:
        index = np.arange(n_out) if i == 0 else np.full(n_out, -1)
        index[written[kept]] = -1 if i == 0 else kept
        result.append((i, 0, selection_from_index(out_shape, _shape(invals[i]), index.reshape(out_shape), dtype)))
    return result


@register(P.reduce_window_sum_p)
def summing(eqn, invals, outvals, wrt):
    """Linear maps that add input elements together: zero multiplications, not a selection."""
    return [(i, k, _linear_from_jvp(eqn, invals, outvals, i, k, selection=False, flops=0, opaque=False))
            for i in wrt for k in _float_outputs(outvals)]


@register(P.conv_general_dilated_p)
def conv(eqn, invals, outvals, wrt):
    """Linear in each operand; one application costs a convolution's multiplications."""
    lhs, rhs = invals
    y = outvals[0]
    spec = eqn.params["dimension_numbers"]
    rhs_spec = spec.rhs_spec if spec is not None else tuple(range(jnp.ndim(rhs)))
    # the kernel's input-feature axis is already per feature group
    per_output = int(np.prod([_shape(rhs)[d] for d in rhs_spec[1:]]))
    flops = int(np.prod(_shape(y))) * per_output
    return [(i, 0, _linear_from_jvp(eqn, invals, outvals, i, 0, selection=False, flops=flops, opaque=False))
            for i in wrt]


# --------------------------------------------------------------------------------------------
# custom derivative rules


def _as_jax_arrays(invals) -> list:
    """Inputs as JAX arrays for rules that run code JAX wrote for its own tracers: the graph keeps
    constants and integer values as NumPy arrays, which such code may index with a traced integer
    (``odeint``'s VJP does ``ts[i]`` in a ``scan``), where a NumPy array raises."""
    return [jnp.asarray(x) if isinstance(x, np.ndarray) else x for x in invals]


@register(P.custom_jvp_call_p)
def custom_jvp(eqn, invals, outvals, wrt):
    """The user's JVP rule, traced and eliminated as a linear sub-program: its structure survives."""
    return _jvp_eliminated(eqn, invals, outvals, wrt, lambda *full: bind(eqn, *full))


@register(two_forms_p)
def two_forms(eqn, invals, outvals, wrt):
    """A computation ``jacve`` writes in two forms (:mod:`jaxtool.point_forms`), in a Jacobian of a
    ``jacve`` Jacobian: the JVP of its batched form, eliminated as a linear sub-program."""
    batched = eqn.params["forms"].batched
    return _jvp_eliminated(eqn, invals, outvals, wrt, lambda *full: [batched(*full)])


def _jvp_eliminated(eqn, invals, outvals, wrt, apply):
    """The partials of ``eqn``, whose results are ``apply(*invals)`` (a list), from JAX's JVP of
    ``apply``, traced and eliminated as a linear sub-program: its structure survives."""
    from jaxtool.elimination import linear_partials

    invals = _as_jax_arrays(invals)
    tangents = [jnp.zeros(_shape(invals[i]), jax.typeof(invals[i]).dtype) for i in wrt]

    def tangent_fn(primals, ts):
        def of_wrt(*xs):
            full = list(primals)
            for i, x in zip(wrt, xs):
                full[i] = x
            return apply(*full)

        return jax.jvp(of_wrt, tuple(primals[i] for i in wrt), tuple(ts))[1]

    try:
        return linear_partials(tangent_fn, list(invals), tangents, wrt, _float_outputs(outvals))
    except UnsupportedError:
        return opaque(eqn, invals, outvals, wrt)
    except jax.errors.UnexpectedTracerError as error:
        raise closure_error(eqn.name, eqn.location(), error) from error


def closure_error(name: str, location, error: Exception) -> UnsupportedError:
    """The error for a custom rule that reads a value of the trace its equation was recorded in.

    A function defined inside the traced one may close over the traced one's arguments, and
    ``nondiff_argnums`` closes the rule over its arguments (JAX first applies ``stop_gradient`` to
    them, in the traced function); JAX traces the rule only when it differentiates the equation.
    ``jaxtool.jacve`` and ``jaxtool jac`` let a closure read the arguments they do not differentiate
    (see ``jacobian._trace``); any other traced value is a stale tracer by then (``jax.jacrev``
    traces the rule within the function's trace). ``name`` and ``location``: the custom function's
    primitive and the user's ``file:line`` of it."""
    return UnsupportedError(
        f"the derivative rule of '{name}' reads a value of the traced function after that trace has ended "
        f"({type(error).__name__}): an array given as a nondiff_argnums argument (such as n of "
        "jax.scipy.special.expn), or a traced value the custom function closes over; pass a Python number "
        "there, or make the value an argument of the custom function (closing over an argument that is not "
        "differentiated is accepted)", primitive=name, location=location)


def custom_rule(program) -> Optional[tuple]:
    """``(name, location)`` of the first equation of ``program`` that is, or holds, a custom
    derivative rule (see :func:`leaked_rule_error`); None if there is none. Plain strings, which
    keep nothing of the trace ``program`` was recorded in alive."""
    custom = (P.custom_jvp_call_p, P.custom_vjp_call_p)
    for eqn in program.eqns:
        if eqn.primitive in custom or any(contains(sub, p) for _, _, sub in subjaxprs(eqn.params) for p in custom):
            return eqn.name, eqn.location()
    return None


def leaked_rule_error(rule: Optional[tuple], error: Exception) -> Exception:
    """``error`` (a tracer leaked from an elimination) as the :func:`closure_error` of the custom
    derivative rule that can have leaked it, ``rule`` (:func:`custom_rule` of the program
    eliminated); ``error`` itself where ``rule`` is None. (The leak shows only when the staged
    Jacobian's trace ends.)"""
    return error if rule is None else closure_error(*rule, error)


@register(P.custom_vjp_call_p)
def custom_vjp(eqn, invals, outvals, wrt):
    """The user's VJP rule, applied lazily as the transposed partial."""
    try:
        return _custom_vjp(eqn, invals, outvals, wrt)
    except jax.errors.UnexpectedTracerError as error:
        raise closure_error(eqn.name, eqn.location(), error) from error


def _custom_vjp(eqn, invals, outvals, wrt):
    invals = _as_jax_arrays(invals)
    result = []
    for i in wrt:
        def f(xi, i=i):
            return bind(eqn, *[xi if j == i else x for j, x in enumerate(invals)])

        _, pullback = jax.vjp(f, invals[i])
        outs = _float_outputs(outvals)
        for k in outs:
            y = outvals[k]

            def fn_t(c, k=k, pullback=pullback):
                cts = [jnp.zeros(_shape(outvals[m]), jax.typeof(outvals[m]).dtype) if m != k else _as_dtype_of(c, y)
                       for m in range(len(outvals))]
                return pullback(cts if eqn.primitive.multiple_results else cts[0])[0]

            _require_linear(eqn, fn_t, jax.ShapeDtypeStruct(_shape(y), jax.typeof(y).dtype))
            result.append((i, k, Linear(_shape(y), _shape(invals[i]), np.dtype(jax.typeof(y).dtype),
                                        fn_t=fn_t, opaque=True)))
    return result


def _require_linear(eqn, fn_t, out_struct) -> None:
    """Raise unless the VJP ``fn_t`` is linear in its cotangent, as JAX can tell by transposing it.

    A ``custom_vjp`` backward rule may be any function of the cotangent (gradient clipping:
    ``clip(g, lo, hi)``). ``jax.jacrev`` applies it to each output's own cotangent, elimination to
    unit cotangents at this equation, so the Jacobians would differ where it is not linear. Where JAX
    cannot transpose it because it loops (``while``: ``odeint``'s backward pass), linearity cannot
    be told and the rule is taken as linear.
    """
    try:
        jax.eval_shape(jax.linear_transpose(fn_t, out_struct), jax.eval_shape(fn_t, out_struct))
    except Exception as error:  # noqa: BLE001 - a nonlinear operation on the cotangent, or a loop
        if contains(jax.make_jaxpr(fn_t)(out_struct).jaxpr, P.while_p):
            return
        raise UnsupportedError(
            f"the backward rule of '{eqn.name}' is not linear in its cotangent "
            f"({str(error).splitlines()[0]}): jax.jacrev applies it to each output's cotangent, vertex "
            "elimination to unit cotangents at this equation, so their Jacobians would differ",
            primitive=eqn.name, location=eqn.location()) from error


#: primitives XLA:CPU runs as LAPACK calls, which ask for column-major operands
LAPACK = frozenset({"cholesky", "triangular_solve", "lu", "eigh", "eig", "svd", "qr", "geqrf", "householder_product",
                    "schur", "hessenberg", "tridiagonal", "tridiagonal_solve"})


def writes_out_safely(program) -> bool:
    """Whether the written-out forms of small sums and products (:func:`jaxtool.partials.fuses_small_products`)
    may serve in the Jacobian of ``program``: not where it has both an ``fft`` and a :data:`LAPACK`
    call. XLA:CPU (jaxlib 0.10.2) lays the operand of an FFT out as a LAPACK call asks for its own
    where slices and elementwise operations link the two, as a sum written out as slices does, and
    then stops at run time (``RET_CHECK failure ... fft_thunk.cc:168 IsMonotonicWithDim0Major``);
    ``jax.jit`` of such a sum written by hand (``real(ifft(fft(x)))``'s slices added, then a
    ``cholesky``) stops alike. A ``reduce_sum`` or ``dot`` between them is laid out on its own."""
    names = set()

    def collect(eqns):
        for e in eqns:
            names.add(e.primitive.name)
            for _, _, sub in subjaxprs(e.params):
                collect(sub.eqns)

    collect(program.eqns)
    return "fft" not in names or not names & LAPACK


def contains(jaxpr, primitive) -> bool:
    """Whether ``jaxpr``, or a jaxpr nested in it, has an equation of ``primitive``."""
    return any(e.primitive is primitive or any(contains(sub, primitive) for _, _, sub in subjaxprs(e.params))
               for e in jaxpr.eqns)


# --------------------------------------------------------------------------------------------
# complex values: real pairs, one opaque vertex per equation


COMPLEX_ELEMENTWISE = {*ELEMENTWISE, P.max_p, P.min_p, P.add_p, P.sub_p, P.neg_p, P.mul_p, P.div_p, P.real_p, P.imag_p,
                       P.conj_p, P.complex_p, P.convert_element_type_p, P.copy_p}


def _as_pairs(y):
    """A tangent as the graph holds it: complex values as (real, imaginary) on a last axis."""
    return jnp.stack([jnp.real(y), jnp.imag(y)], axis=-1) if _is_complex(jax.typeof(y)) else y


def complex_partials(eqn, invals, outvals, wrt):
    """Partials of an equation that reads or makes complex values, between (real, imaginary) pairs.

    JAX's JVP of a complex function is real-linear in the tangent, so with complex tangents split
    into pairs (:func:`tangent_shape`) each partial is a real linear map. An elementwise primitive's
    is block-diagonal: per element a 2x2 (complex to complex), 2x1 or 1x2 block from the JVPs along
    tangents of ones and of ``1j``; any other equation's is applied lazily like an opaque one's.
    """
    if eqn.primitive in COMPLEX_ELEMENTWISE:
        return _complex_elementwise(eqn, invals, outvals, wrt)
    outs = [k for k, y in enumerate(outvals) if carries_tangent(jax.typeof(y))]
    if eqn.primitive in COMPLEX_STRUCTURAL and all(_is_complex(jax.typeof(x)) for x in
                                                   [invals[i] for i in wrt] + [outvals[k] for k in outs]):
        real_parts = [[jnp.real(x) if _is_complex(jax.typeof(x)) else x for x in xs] for xs in (invals, outvals)]
        return [(i, k, _on_pairs(partial)) for i, k, partial in RULES[eqn.primitive](eqn, *real_parts, wrt)]
    error = _forward_rule_error(eqn, invals, wrt)
    if error is not None:
        raise _cannot_differentiate(eqn, error, " on complex values") from error
    result = []
    for i in wrt:
        x_aval = jax.typeof(invals[i])
        for k in outs:
            y_aval = jax.typeof(outvals[k])
            dtype = promoted(tangent_dtype(x_aval), tangent_dtype(y_aval))

            def fn(t, i=i, k=k, x_aval=x_aval, dtype=dtype):
                if _is_complex(x_aval):
                    t = jax.lax.complex(t[..., 0], t[..., 1])
                return _as_pairs(_jvp_at(eqn, invals, i, t.astype(x_aval.dtype), wrt)[k]).astype(dtype)

            n_out = int(np.prod(tangent_shape(y_aval)))
            result.append((i, k, Linear(tangent_shape(y_aval), tangent_shape(x_aval), dtype, fn=fn,
                                        flops=n_out, opaque=True)))
    return result


#: linear maps with real coefficients: on complex values they act on both parts alike
COMPLEX_STRUCTURAL = {P.transpose_p, P.broadcast_in_dim_p, P.squeeze_p, P.reduce_sum_p, P.reshape_p, P.copy_p,
                      *LINEAR_SELECTION}


def _on_pairs(partial):
    """A real partial applied to the real and imaginary parts alike: both sides gain a last axis of 2
    (see :func:`tangent_shape`), paired with each other; the structure is kept."""
    out_shape, in_shape = tuple(partial.out_shape) + (2,), tuple(partial.in_shape) + (2,)
    if isinstance(partial, Sparse):
        k = len(partial.out_shape)
        val_shape = partial.val_shape[:k] + (1,) + partial.val_shape[k:]
        val = None if partial.val is None else reshaped(partial.val, val_shape)
        return Sparse(out_shape, in_shape, tuple(partial.pairs) + (len(partial.in_shape),), val_shape,
                      partial.dtype, val, partial.unit)

    def per_part(f):
        return None if f is None else jax.vmap(apart(f), in_axes=-1, out_axes=-1)

    index = partial.index
    if index is not None:  # flat element o of a part -> flat element 2 o + part
        index = np.where(index[..., None] >= 0, 2 * index[..., None] + np.arange(2), -1)
    scale = None if partial.scale is None else jnp.expand_dims(partial.scale, -1)
    return replace(partial, out_shape=out_shape, in_shape=in_shape, fn=per_part(partial.fn),
                   fn_t=per_part(partial.fn_t), scale=scale, flops=2 * partial.flops, index=index, joint=None,
                   traced_index=None)


def _complex_elementwise(eqn, invals, outvals, wrt):
    """Per output element, the real 2x2 (2x1, 1x2) block of each operand: its columns are the JVPs
    along a tangent of ones and of ``1j``. An operand broadcast against the others (rank 0, or
    size-1 axes) is paired only along its full axes, as in :func:`_operand_partial`."""
    y_aval = jax.typeof(outvals[0])
    shape = tuple(y_aval.shape)
    result = []
    for i in wrt:
        x_aval = jax.typeof(invals[i])
        x_shape = tuple(x_aval.shape)
        units = (1, 1j) if _is_complex(x_aval) else (1,)
        columns = [_as_pairs(_jvp_at(eqn, invals, i, jnp.full(x_shape, u, x_aval.dtype), wrt)[0]) for u in units]
        pairs = tuple(k if x_shape and x_shape[k] == n else None for k, n in enumerate(shape))
        broadcast = len([j for j in range(len(x_shape)) if j not in pairs])  # size-1 axes of x
        val = jnp.stack(columns, axis=-1) if _is_complex(x_aval) else columns[0]
        out_axes = len(tangent_shape(y_aval))
        val = reshaped(val, val.shape[:out_axes] + (1,) * broadcast + val.shape[out_axes:])
        dtype = promoted(tangent_dtype(x_aval), tangent_dtype(y_aval))
        pairs += (None,) if _is_complex(y_aval) else ()
        result.append((i, 0, Sparse(tangent_shape(y_aval), tangent_shape(x_aval), pairs, tuple(val.shape), dtype,
                                    val.astype(dtype))))
    return result


# --------------------------------------------------------------------------------------------
# everything else: one opaque vertex, JAX's own AD of the whole equation


def _forward_rule_error(eqn, invals, wrt):
    """Why JAX cannot take the equation's JVP along one of the inputs ``wrt`` (None if it can); the
    forward rule may exist for some inputs only (``scatter_mul``'s operand). A ``custom_vjp``
    function nested in the equation (in a ``cond`` or ``scan``) has none: JAX's JVP of the equation
    traces, but raises once batched, as densification batches it."""
    nested = any(contains(sub, P.custom_vjp_call_p) for _, _, sub in subjaxprs(eqn.params))
    if nested:
        return TypeError(f"a custom_vjp function nested in '{eqn.name}' has no forward-mode rule")
    for i in wrt:
        probe = jnp.zeros(_shape(invals[i]), jax.typeof(invals[i]).dtype)
        try:
            jax.eval_shape(lambda t, i=i: _jvp_at(eqn, invals, i, t, wrt), probe)
        except Exception as e:  # noqa: BLE001 - any failure means no usable forward rule
            return e
    return None


def _cannot_differentiate(eqn, error: Exception, what: str = "") -> UnsupportedError:
    return UnsupportedError(f"cannot differentiate primitive '{eqn.name}'{what}: {str(error).splitlines()[0]}",
                            primitive=eqn.name, location=eqn.location())


def opaque(eqn, invals, outvals, wrt):
    """JVP of the whole equation (control flow, linear algebra, ...), or its VJP if only that exists."""
    outs = _float_outputs(outvals)
    if not wrt or not outs:
        return []
    invals = _as_jax_arrays(invals)
    jvp_error = _forward_rule_error(eqn, invals, wrt)
    if jvp_error is not None:  # JAX has no forward rule: try reverse mode
        try:
            jax.eval_shape(lambda: jax.vjp(lambda *xs: bind(eqn, *xs), *invals))
            return custom_vjp(eqn, invals, outvals, wrt)
        except Exception:
            raise _cannot_differentiate(eqn, jvp_error) from jvp_error
    n_out = sum(int(np.prod(_shape(outvals[k]))) for k in outs)
    total_in = sum(int(np.prod(_shape(invals[i]))) for i in wrt)
    structs = [jax.ShapeDtypeStruct(_shape(y), jax.typeof(y).dtype) for y in outvals]
    family = OutputsPullback(lambda: _vjp_of_outputs(eqn, invals, wrt), structs) if len(outs) > 1 else None
    joint = {k: JointPullback(lambda k=k: _vjp_of_output(eqn, invals, wrt, k), structs[k], total_in, family, k)
             for k in outs}
    return [(i, k, replace(_linear_from_jvp(eqn, invals, outvals, i, k, selection=False, flops=n_out, opaque=True,
                                            carrying=wrt),
                           joint=((joint[k], None, n, None, None),)))
            for n, i in enumerate(wrt) for k in outs]


def _outputs_of(eqn, invals, wrt) -> Callable:
    """``eqn`` as a function of its inputs ``wrt`` (the others held at ``invals``): the tuple of its
    outputs."""
    def of_wrt(*xs):
        full = list(invals)
        for i, x in zip(wrt, xs):
            full[i] = x
        out = bind(eqn, *full)
        return tuple(out) if eqn.primitive.multiple_results else (out,)

    return of_wrt


def _vjp_of_outputs(eqn, invals, wrt) -> Callable:
    """The VJP of all of ``eqn``'s outputs with respect to its inputs ``wrt`` together: the tuple of
    output cotangents -> tuple of input cotangents."""
    return jax.vjp(_outputs_of(eqn, invals, wrt), *(invals[i] for i in wrt))[1]


def _vjp_of_output(eqn, invals, wrt, k) -> Callable:
    """The VJP of output ``k`` of ``eqn`` with respect to its inputs ``wrt`` together: cotangent ->
    tuple of input cotangents (raises where JAX cannot transpose the equation)."""
    outputs = _outputs_of(eqn, invals, wrt)
    return jax.vjp(lambda *xs: outputs(*xs)[k], *(invals[i] for i in wrt))[1]
