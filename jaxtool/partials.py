"""Structured local partial Jacobians and their algebra (product, sum, densify).

A partial ``J`` of a graph edge ``u -> v`` is a linear map from tangents of ``u`` (``in_shape``) to
tangents of ``v`` (``out_shape``). Its dense form has shape ``out_shape + in_shape`` (the layout of
``jax.jacrev``). Two structured forms keep it small:

:class:`Sparse`
    ``J[o, i] = val[o, i_unpaired] * prod_k delta(o[k], i[pairs[k]])``: each output axis ``k`` is
    either *paired* with an input axis of the same size (a Kronecker delta: diagonal along it) or
    *dense*; input axes that no output axis pairs with are dense too. ``val`` holds one axis per
    output axis followed by one per unpaired input axis (in input-axis order), each of full size or
    of size 1 (constant along that axis). Elementwise ops are all-paired (diagonal), broadcasts and
    reductions are size-1 axes, ``dot_general`` is dense only over the axes it couples, and
    ``unit`` partials (transpose, ``reduce_sum``, copies) store no values at all. A ``select_n``
    (``jnp.where``) or ``clamp`` partial also carries ``live``, False where its operand is not
    selected: an exact zero, which no infinite or NaN partial nearer the outputs turns into NaN
    (see :attr:`Sparse.live`).

:class:`Linear`
    ``J(t) = scale * fn(t)``: a linear function applied lazily, for structural ops (reshape,
    slice, pad, gather, ...: ``selection`` maps, where every output element is zero or one input
    element) and for opaque partials (control flow, convolutions, custom rules). ``fn_t`` is its
    transpose; either may be derived from the other with :func:`jax.linear_transpose`. A selection
    known at trace time carries its ``index``; a sum of a few such scaled selections (a stencil
    ``y[2:] - 2 y[1:-1] + y[:-2]``, ``x + x.T``, ``x + roll(x)``) keeps them as its ``parts``, so
    that products distribute over them and densifying writes only their entries. A selection whose
    index depends on the values (a gather at indices computed from them, a sort) gets its index at
    run time where it is densified or multiplied by a Sparse partial (:func:`_index_of`); sums of
    such scaled selections keep them as parts too, one per term.

Every operation computes the result's *structure* and its multiplication/addition counts from
shapes alone, and computes values only when its operands carry them. A partial without values
(:meth:`Partial.abstract`) is a plan: elimination orders are costed on plans, and the same code
executes them on values.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
import weakref
from dataclasses import dataclass, field, replace
from typing import Callable, ClassVar, Optional

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax

from jaxtool.point_forms import two_forms

HIGHEST = lax.Precision.HIGHEST


@dataclass(frozen=True)
class Cost:
    """Multiplications and additions of one operation on partials."""

    mults: int = 0
    adds: int = 0

    def __add__(self, other: "Cost") -> "Cost":
        return Cost(self.mults + other.mults, self.adds + other.adds)


def _size(shape) -> int:
    return int(math.prod(shape))


def cast(v, dtype):
    """``v.astype(dtype)``, or ``v`` itself when it has that dtype (no equation is traced)."""
    return v if v.dtype == dtype else v.astype(dtype)


def reshaped(v, shape):
    """``v.reshape(shape)``, or ``v`` itself when it has that shape (no equation is traced)."""
    shape = tuple(shape)
    if tuple(v.shape) == shape:
        return v
    return v.reshape(shape) if isinstance(v, np.ndarray) else lax.reshape(v, shape)


class Partial:
    """Base class of structured partials; see the module docstring."""

    out_shape: tuple
    in_shape: tuple
    dtype: np.dtype

    @property
    def shape(self) -> tuple:
        return tuple(self.out_shape) + tuple(self.in_shape)

    def densify_cost(self) -> "Cost":
        """The multiplications of forming the dense block (``to_dense``): none where it writes
        stored values where they go."""
        return Cost()


# --------------------------------------------------------------------------------------------
# Sparse


@dataclass(frozen=True)
class Sparse(Partial):
    out_shape: tuple
    in_shape: tuple
    pairs: tuple  # per output axis: the paired input axis, or None
    val_shape: tuple  # stored value shape; each axis full size or 1
    dtype: np.dtype
    val: Optional[jax.Array] = None
    unit: bool = False  # every stored value is exactly one; ``val`` is not kept
    #: booleans of ``val_shape``, False at an exact zero (an operand that ``select_n`` or ``clamp``
    #: does not select): a product whose factor nearer the inputs is an exact zero there is that
    #: zero whatever its other factor, as a cotangent passing a select is (:func:`_with_exact_zeros`);
    #: None: all live
    live: Optional[jax.Array] = None

    # -- construction -------------------------------------------------------------------------
    @staticmethod
    def diag(d, shape, dtype=None) -> "Sparse":
        """The elementwise partial ``d * t`` for values of ``shape`` (``d`` broadcastable to it)."""
        shape = tuple(shape)
        d = jnp.asarray(d, dtype=dtype)
        d = reshaped(d, (1,) * (len(shape) - d.ndim) + d.shape)
        val_shape = tuple(1 if s == 1 else n for s, n in zip(d.shape, shape))
        d = reshaped(d, val_shape)
        return Sparse(shape, shape, tuple(range(len(shape))), val_shape, d.dtype, d)

    @staticmethod
    def identity(shape, dtype) -> "Sparse":
        shape = tuple(shape)
        return Sparse(shape, shape, tuple(range(len(shape))), (1,) * len(shape), np.dtype(dtype), None, True)

    @staticmethod
    def structural(out_shape, in_shape, pairs, dtype) -> "Sparse":
        """A 0/1 partial with the given pairing and constant value one (transpose, reduce_sum, ...)."""
        nun = len(in_shape) - sum(p is not None for p in pairs)
        return Sparse(tuple(out_shape), tuple(in_shape), tuple(pairs), (1,) * (len(out_shape) + nun),
                      np.dtype(dtype), None, True)

    @staticmethod
    def dense(val, out_shape, in_shape) -> "Sparse":
        """A dense partial from an array of shape ``out_shape + in_shape`` (size-1 axes allowed)."""
        return Sparse(tuple(out_shape), tuple(in_shape), (None,) * len(out_shape), tuple(val.shape),
                      np.dtype(val.dtype), val)

    def __post_init__(self):
        assert len(self.pairs) == len(self.out_shape)
        assert len(self.val_shape) == len(self.out_shape) + len(self.unpaired_in)
        assert all(s in (1, n) for s, n in zip(self.val_shape, self.full_val_shape)), (self.val_shape, self.full_val_shape)
        paired = [p for p in self.pairs if p is not None]
        assert len(set(paired)) == len(paired)
        assert all(self.out_shape[k] == self.in_shape[p] for k, p in enumerate(self.pairs) if p is not None)
        assert self.live is None or tuple(self.live.shape) == tuple(self.val_shape), (self.live.shape, self.val_shape)

    # -- structure ----------------------------------------------------------------------------
    @functools.cached_property
    def unpaired_in(self) -> tuple:
        paired = set(p for p in self.pairs if p is not None)
        return tuple(j for j in range(len(self.in_shape)) if j not in paired)

    @property
    def key(self) -> tuple:
        """The structure (every field but the values): equal keys, equal plans."""
        return (self.out_shape, self.in_shape, self.pairs, self.val_shape, self.dtype, None, self.unit)

    @property
    def full_val_shape(self) -> tuple:
        return tuple(self.out_shape) + tuple(self.in_shape[j] for j in self.unpaired_in)

    @property
    def abstract(self) -> bool:
        return self.val is None and not self.unit

    @property
    def dense_val_shape(self) -> tuple:
        """``val_shape`` once every output axis is unpaired (:meth:`unpair`): paired axes full on both
        sides, the input axes in their order."""
        nout = len(self.out_shape)
        paired = {j for j in self.pairs if j is not None}
        rows = tuple(self.out_shape[k] if self.pairs[k] is not None else self.val_shape[k] for k in range(nout))
        return rows + tuple(self.in_shape[j] if j in paired else self.val_shape[nout + self.unpaired_in.index(j)]
                            for j in range(len(self.in_shape)))

    @property
    def is_permuted_diag(self) -> bool:
        """Every output axis is paired and every input axis is used: ``J(t) = val * transpose(t)``."""
        return all(p is not None for p in self.pairs) and len(self.in_shape) == len(self.out_shape)

    @property
    def stored(self) -> int:
        """Number of stored values (the memory this partial takes)."""
        return 0 if self.unit else _size(self.val_shape)

    def plan(self) -> "Sparse":
        return self if self.val is None else replace(self, val=None, live=None)

    def values(self):
        """The stored values (ones for a unit partial)."""
        if self.unit:
            return jnp.ones(self.val_shape, self.dtype)
        return self.val

    # -- dense conversion -----------------------------------------------------------------------
    def unpair(self, out_axes) -> "Sparse":
        """Drop the pairing of ``out_axes``: the paired input axes become dense (values grow)."""
        out_axes = [k for k in out_axes if self.pairs[k] is not None]
        if not out_axes:
            return self
        pairs = list(self.pairs)
        for k in out_axes:
            pairs[k] = None
        old_unpaired = self.unpaired_in
        new_unpaired = tuple(sorted(set(old_unpaired) | {self.pairs[k] for k in out_axes}))
        nout = len(self.out_shape)
        val_shape = list(self.val_shape[:nout]) + [1] * len(new_unpaired)
        for pos, j in enumerate(old_unpaired):
            val_shape[nout + new_unpaired.index(j)] = self.val_shape[nout + pos]
        for k in out_axes:
            n = self.out_shape[k]
            val_shape[k] = n
            val_shape[nout + new_unpaired.index(self.pairs[k])] = n
        def spread(v):
            # move stored in-axes into their new slots, then keep them on the deltas only (a select,
            # not a product: an infinite value off the delta is no path, and must not become NaN)
            expanded = reshaped(v, v.shape[:nout] + tuple(
                v.shape[nout + old_unpaired.index(j)] if j in old_unpaired else 1 for j in new_unpaired))
            for k in out_axes:
                n = self.out_shape[k]
                eye_shape = [1] * len(val_shape)
                eye_shape[k] = n
                eye_shape[nout + new_unpaired.index(self.pairs[k])] = n
                expanded = _zero_unless(np.eye(n, dtype=bool).reshape(eye_shape), expanded)
            return jnp.broadcast_to(expanded, tuple(val_shape))

        val = None if self.abstract else spread(self.values())
        live = None if self.live is None else spread(self.live)
        return Sparse(self.out_shape, self.in_shape, tuple(pairs), tuple(val_shape), self.dtype, val, live=live)

    def to_dense(self):
        """The dense Jacobian block, shape ``out_shape + in_shape``."""
        full = self.unpair(range(len(self.out_shape)))
        return jnp.broadcast_to(full.values(), self.shape)


# --------------------------------------------------------------------------------------------
# Linear


#: a selection's dense block of at most this many elements is written as a where over its 0/1
#: pattern (fused by XLA); a larger one as its entries scattered into zeros (no pattern constant)
SMALL_DENSE = 1 << 12


class _Applications(threading.local):
    """Per thread: the results of Linears' functions by (function, argument), while they are kept."""

    results: Optional[dict] = None
    nested: int = 0  # how many maps run apart (see apart) now


_APPLICATIONS = _Applications()


@contextlib.contextmanager
def shared_applications():
    """Within: each Linear's function is evaluated at most once per argument object, its result
    reused after that (:func:`_once_per_argument`), and :func:`_ones` gives one array per shape and
    dtype. Elimination and densification run within one; outside, the results are kept while one
    outermost application runs."""
    state = _APPLICATIONS
    if state.results is not None:
        yield
        return
    state.results = {}
    try:
        yield
    finally:
        state.results = None


def apart(f: Callable) -> Callable:
    """``f`` run with a table of applications of its own (see :func:`shared_applications`), where
    there is one outside, and the outer one back afterwards: for a map that JAX traces in a trace of
    its own (``jax.vmap``, ``lax.map``, ``jax.eval_shape``, ``jax.linear_transpose``,
    ``jax.closure_convert``). What the map makes there belongs to that trace, and an entry of the
    outer table would keep it alive after the trace has ended (``jax_check_tracer_leaks`` reported
    most programs' Jacobians for it)."""
    def run(*args):
        state = _APPLICATIONS
        outer = state.results
        state.results = None if outer is None else {}
        state.nested += 1
        try:
            return f(*args)
        finally:
            state.results = outer
            state.nested -= 1

    return run


def _made_once(owner, name: str, make: Callable):
    """``owner``'s ``name``, made by ``make()`` once and kept on ``owner``; but where it is first
    needed while a map runs apart (:func:`apart`), what ``make`` builds (a transposition, a VJP)
    closes over values of that nested trace: then it is kept in the nested table of applications,
    which ends with the trace (a map replayed deep in a chain derived its callees' maps there)."""
    made = owner.__dict__.get(name)
    if made is not None:
        return made
    if _APPLICATIONS.nested:
        return _kept((name, id(owner)), make, owner)
    made = make()
    object.__setattr__(owner, name, made)
    return made


def _once_per_argument(f: Optional[Callable], owner: Optional["Linear"] = None,
                       forward: bool = True) -> Optional[Callable]:
    """``f`` (a Linear's ``fn`` or ``fn_t``) evaluated at most once per argument object while
    results are kept (see :func:`shared_applications`).

    Lazy maps form a DAG: in forward order the edge of each step of ``u = a(u) + b(u)`` is a sum
    of two maps that both apply the previous step's edge to the same tangent. Applied as a tree,
    that is exponential in the number of steps (seven steps of ``sort(x) + roll(x) + roll(x, -1)``
    traced for 141 s); applied once per argument it is as large as the DAG. (Maps shared on the
    output side, as in reverse order, get one argument backward, a different one per path forward:
    see :func:`_densify_forward`.)

    ``owner``: the Linear whose function (``fn`` if ``forward``, else ``fn_t``) ``f`` is; the maps
    it applies to arguments known beforehand are then applied first, deepest first (:func:`_warm`).
    """
    if f is None or getattr(f, "once_per_argument", False):
        return f

    def applied(t):
        with shared_applications():
            results = _APPLICATIONS.results
            key = (id(applied), id(t))
            if key not in results:
                if owner is not None and owner.calls:
                    _warm(owner, forward, t)
                results[key] = (f(t), t)  # t is kept so that its id is not reused meanwhile
            return results[key][0]

    applied.once_per_argument = True
    return applied


def _warm(x: "Linear", forward: bool, t) -> None:
    """Apply, before ``x`` itself, the maps ``x`` applies (in direction ``forward``) to arguments
    known before it runs (:func:`_argument_passed`), and the maps those apply, each callee before
    its callers, with nothing on the Python stack in between: ``x``'s own application then finds
    their results made (:func:`_once_per_argument`) instead of nesting their calls.

    A chain of compositions that each apply the one before to the same tangent (forward order:
    each edge to step k is step k's maps after the edge to step k - 1) is then applied in a loop,
    however long; nested, a chain of 600 exceeded Python's recursion limit."""
    results = _APPLICATIONS.results
    stack, seen, ordered = [(x, t, False)], set(), []
    while stack:
        node, argument, expanded = stack.pop()
        if expanded:
            ordered.append((node, argument))
            continue
        if (id(node), id(argument)) in seen:
            continue
        seen.add((id(node), id(argument)))
        stack.append((node, argument, True))
        for callee, *passed in node.calls:
            passes = _argument_passed(argument, passed[0] if forward else passed[1], callee)
            if passes is not None and (id(_function(callee, forward)), id(passes)) not in results:
                stack.append((callee, passes, False))
    for node, argument in ordered[:-1]:  # (the last is x)
        _function(node, forward)(argument)


def _function(x: "Linear", forward: bool) -> Callable:
    return x.forward() if forward else x.backward()


def _argument_passed(argument, token, callee: "Linear"):
    """The argument a Linear applied to ``argument`` passes ``callee`` where it is known before it
    runs (see :attr:`Linear.calls`): ``argument`` itself (``token`` None), or ``argument`` times a
    scale (``token`` that scale: a sum's term applied backward, :func:`_summed_calls`), with the
    dtype ``callee`` takes (else the application casts it to a new array); None otherwise."""
    if token is None:
        passed = argument
    elif isinstance(token, (jax.Array, np.ndarray)):
        passed = _scaled(argument, token)
    else:
        return None
    return passed if passed.dtype == callee.dtype else None


def _kept(key, make: Callable, *alive):
    """``make()``, made once per ``key`` while results are kept (see :func:`shared_applications`);
    ``alive``: the objects whose ids ``key`` holds, kept so that their ids are not reused meanwhile."""
    results = _APPLICATIONS.results
    if results is None:
        return make()
    if key not in results:
        results[key] = (make(), alive)
    return results[key][0]


def _times(x, val):
    """``x * val``, or ``x`` where ``val`` is None (a unit partial's)."""
    return x if val is None else x * val


def _scaled(x, scale):
    """``x * scale``, the same array for the same two operands while results are kept: the terms of a
    sum that share their outer map share its scale too, and so its application to the product."""
    return _kept(("scaled", id(x), id(scale)), lambda: x * scale, x, scale)


def _ones(shape, dtype):
    """An array of ones, the same one for the same shape and dtype while results are kept (so
    that a chain of selections, each asked which elements it selects, applies each map to it once)."""
    return _kept(("ones", tuple(shape), np.dtype(dtype)), lambda: jnp.ones(shape, dtype))


def _element_bits(shape, dtype):
    """The element numbers 1, 2, ... of ``shape`` bit by bit: ``(bits,) + shape`` zeros and ones of
    ``dtype``, bit ``k`` of each number in plane ``k`` (made by ``iota``: no constant of that size).

    A selection moves every plane's elements as it moves the numbers, and zero and one are exact in
    every floating dtype, also through the casts a selection's map makes on the way (a float32 number
    is exact only below 2**24 elements, a bfloat16 one below 256: see ``jaxtool.rules._element_numbers``
    for the numbers a selection known while tracing is run on)."""
    n = _size(shape)
    bits = max(1, n.bit_length())
    numbers = lax.broadcasted_iota(np.int32, (1, n), 1) + np.int32(1)
    planes = lax.bitwise_and(lax.shift_right_logical(numbers, lax.broadcasted_iota(np.int32, (bits, 1), 0)),
                             np.int32(1))
    return reshaped(cast(planes, dtype), (bits,) + tuple(shape))


def _index_from_bits(moved):
    """The flat input indices (-1 for number 0: none) that element-number bits moved by a selection
    (:func:`_element_bits`, planes on the first axis) stand for: int32, of the shape of one plane."""
    weights = reshaped(lax.shift_left(np.int32(1), lax.iota(np.int32, moved.shape[0])),
                       (moved.shape[0],) + (1,) * (moved.ndim - 1))
    number = lax.reduce_sum(lax.mul(cast(lax.ne(moved, lax.full_like(moved, 0)), np.int32), weights), (0,))
    return number - np.int32(1)


def _index_of(x: "Linear"):
    """Per output element of the selection ``x`` (of ``x.out_shape``), the flat index of the input
    element it copies, -1 where none: :attr:`Linear.index` where it is known while tracing; else an
    int32 array computed at run time, once per ``x`` while results are kept: by
    :attr:`Linear.traced_index` where there is one (a sort's, from its permutation; a gather's at
    indices computed from values; their compositions), else (a selection from JAX's JVP of an
    equation, such as a max pool) by ``x``'s map applied at once to the bits of the element numbers
    (:func:`_element_bits`). Densifying, and products with Sparse
    partials, then write or read entries by that index instead of applying the map (or its
    transpose) to a basis row by row: a dense block's every row as a scatter (XLA:CPU: 1.5 ms for
    300 rows of 1024 elements)."""
    if x.index is not None:
        return x.index
    if x.traced_index is not None:
        return _kept(("index", id(x)), x.traced_index, x)

    def computed():
        return _index_from_bits(_vmapped(x.forward(), _element_bits(x.in_shape, x.dtype)))

    return _kept(("index", id(x)), computed, x)


@dataclass(frozen=True)
class Linear(Partial):
    out_shape: tuple
    in_shape: tuple
    dtype: np.dtype
    fn: Optional[Callable] = None  # tangent of in_shape -> tangent of out_shape
    fn_t: Optional[Callable] = None  # cotangent of out_shape -> cotangent of in_shape
    scale: Optional[jax.Array] = None  # post-multiplier broadcastable to out_shape
    has_scale: bool = False
    selection: bool = False  # each output element is zero or exactly one input element
    flops: int = 0  # multiplications per application of fn
    opaque: bool = False  # derivative from JAX's own AD of a whole equation
    #: for a selection known at trace time: per output element, the flat input index ``fn`` copies,
    #: or -1 for zero (``fn`` itself carries no multiplier). Products, sums and densification of such
    #: maps are then index arithmetic in NumPy, with nothing traced.
    index: Optional[np.ndarray] = field(default=None, compare=False)
    #: for a selection whose indices come from values (a sort, a gather at computed indices, and
    #: their compositions): a function of no arguments that gives ``index`` as a traced int32 array
    #: (of ``out_shape``), read by :func:`_index_of`
    traced_index: Optional[Callable] = field(default=None, compare=False)
    #: for a sum of scaled selections with known indices: those selections (``fn`` is their sum)
    parts: tuple = field(default=(), compare=False)
    #: for such a sum whose parts' scales were computed together: their full scales, flat, in the
    #: order of the parts (``len(parts) * n_out``), so that products and densification read them
    #: at once instead of stacking the parts' scales again
    stacked: Optional[jax.Array] = field(default=None, compare=False)
    #: for a partial of opaque equations: its terms ``(pullbacks, before, i, after, scale)``, so that one VJP
    #: of an equation's output serves the partials of all its inputs: that output's
    #: :class:`JointPullback`; None, or a selection after the output (an element of a loop's result,
    #: :func:`_linear_linear`) whose transpose takes this partial's cotangents to the output's; an input
    #: position of the equation; and the map of a cotangent of that input on to this partial's input
    #: (None: the same; else for the partial after a linear map, :func:`_joint_after`). One term for the
    #: partial itself; more for a sum: of the partials of an input the equation reads twice, or of the
    #: paths through several of a loop's results (a stack of its angle and velocity). ``scale``: None,
    #: or for a term of a sum, the scale of the partial it came from (the sum has none of its own)
    joint: Optional[tuple] = field(default=None, compare=False)
    #: how deeply ``fn`` and ``fn_t`` nest calls of other Linears' functions, those applied first
    #: (:func:`_warm`) not counted: ``(forward, backward)`` (see :func:`_nesting`, :func:`_bounded`)
    depth: tuple = field(default=(0, 0), compare=False)
    #: the Linears whose functions ``fn`` and ``fn_t`` apply, as ``(linear, forward, backward)``: the
    #: argument each direction passes it, None for its own argument, ``_UNCALLED`` for none, else an
    #: object that stands for a new one (see :func:`_applications`)
    calls: tuple = field(default=(), compare=False)

    def __post_init__(self):
        object.__setattr__(self, "fn", _once_per_argument(self.fn, self, True))
        object.__setattr__(self, "fn_t", _once_per_argument(self.fn_t, self, False))

    @property
    def abstract(self) -> bool:
        return self.fn is None and self.fn_t is None

    @property
    def stored(self) -> int:
        return (_size(self.out_shape) if self.has_scale else 0) + sum(p.stored for p in self.parts)

    def plan(self) -> "Linear":
        if self.abstract and self.scale is None:
            return self
        return replace(self, fn=None, fn_t=None, scale=None, stacked=None, parts=tuple(p.plan() for p in self.parts),
                       calls=(), traced_index=None)

    def _in_struct(self):
        return jax.ShapeDtypeStruct(self.in_shape, self.dtype)

    def _out_struct(self):
        return jax.ShapeDtypeStruct(self.out_shape, self.dtype)

    def forward(self) -> Callable:
        """``t -> fn(t)`` (without scale), deriving it by transposition when only ``fn_t`` is known."""
        if self.fn is not None:
            return self.fn
        return _made_once(self, "derived_fn", self._derived_fn)  # (kept: it too is applied once per argument)

    def _derived_fn(self) -> Callable:
        transposed = jax.linear_transpose(apart(self.fn_t), self._out_struct())
        takes = jax.eval_shape(apart(self.fn_t), self._out_struct()).dtype  # the dtype fn_t's cotangents have
        try:
            jax.eval_shape(transposed, jax.ShapeDtypeStruct(self.in_shape, takes))
        except Exception:  # noqa: BLE001 - a VJP JAX cannot transpose (odeint's calls odeint): by rows
            dense = replace(self, scale=None, has_scale=False).to_dense()
            return _once_per_argument(lambda t: jnp.tensordot(dense, t, axes=len(self.in_shape), precision=HIGHEST))
        return _once_per_argument(lambda t: transposed(cast(t, takes))[0])

    def backward(self) -> Callable:
        """``c -> fn_t(c)`` (without scale), deriving it by transposition when only ``fn`` is known."""
        if self.fn_t is not None:
            return self.fn_t
        return _made_once(self, "derived_fn_t", self._derived_fn_t)

    def _derived_fn_t(self) -> Callable:
        transposed = jax.linear_transpose(apart(self.fn), self._in_struct())
        gives = jax.eval_shape(apart(self.fn), self._in_struct()).dtype  # the dtype fn's tangents have
        return _once_per_argument(lambda c: transposed(cast(c, gives))[0])

    def apply(self, t):
        """``J(t)`` for one tangent."""
        y = self.forward()(cast(t, self.dtype))
        return _scaled(y, self.scale) if self.has_scale else y

    def apply_t(self, c):
        """``J^T(c)`` for one cotangent."""
        if self.has_scale:
            c = _scaled(c, self.scale)
        return self.backward()(cast(c, self.dtype))

    def _pattern_dense(self):
        """The dense block of a selection with a known index, as its 0/1 pattern times its scale."""
        one_hot = (self.index.reshape(-1, 1) == np.arange(_size(self.in_shape))).reshape(self.shape)
        if not self.has_scale:
            return jnp.asarray(one_hot, self.dtype)
        # the scale on the selected entries only (see unpair)
        scale = reshaped(self.scale, np.shape(self.scale) + (1,) * len(self.in_shape))
        return cast(_zero_unless(one_hot, cast(scale, self.dtype)), self.dtype)

    def _joint(self):
        """This partial's terms (:attr:`Linear.joint`) where VJPs of whole equations can stand for its
        transpose (its scale, if any, applied to the cotangents first: :func:`_joint_rows`)."""
        if self.joint is None or self.fn is None or not all(term[0].usable() for term in self.joint):
            return None
        return self.joint

    def densify_cost(self) -> Cost:
        """Forming the dense block applies the map to a basis of unit vectors, the smaller one, each
        application counted as in products (:attr:`flops`, and the scale); a selection whose
        pattern is known while tracing, or computed at run time (:func:`_index_of`), is written, not
        applied (no multiplications)."""
        if self.parts or self.selection:
            return Cost()
        per_application = self.flops + (_size(self.out_shape) if self.has_scale else 0)
        return Cost(min(_size(self.in_shape), _size(self.out_shape)) * per_application, 0)

    def to_dense(self):
        """The dense Jacobian block, shape ``out_shape + in_shape``, through the smaller basis."""
        n_in, n_out = _size(self.in_shape), _size(self.out_shape)
        if self.joint is not None and n_out < min(term[0].total_in for term in self.joint) \
                and self._joint() is not None:
            # rows of all of the equation's blocks at once
            rows = _joint_rows(self.joint, None, jnp.eye(n_out, dtype=self.dtype).reshape((n_out,) + self.out_shape),
                               self.scale if self.has_scale else None)
            return rows.reshape(self.shape)
        if self.parts or self.selection:
            parts = self.parts or (self,)
            if n_out * n_in > SMALL_DENSE or any(p.index is None for p in parts):
                return _parts_to_dense(parts, self.shape, self.dtype, self.stacked)
            # small: 0/1 patterns known while tracing, scaled and added (fused by XLA; no scatter)
            return functools.reduce(lax.add, [cast(p._pattern_dense(), self.dtype) for p in parts])
        if self.fn is not None and self.fn_t is not None:
            use_forward = _densify_forward(self, n_in, n_out)
        else:
            use_forward = self.fn is not None
        if use_forward:
            basis = jnp.eye(n_in, dtype=self.dtype).reshape((n_in,) + self.in_shape)
            cols = _vmapped(self.apply, basis)  # (n_in,) + out_shape
            return jnp.moveaxis(cols.reshape((n_in, n_out)), 0, 1).reshape(self.shape)
        basis = jnp.eye(n_out, dtype=self.dtype).reshape((n_out,) + self.out_shape)
        rows = _vmapped(self.apply_t, basis)  # (n_out,) + in_shape
        return rows.reshape(self.shape)


def _vmapped(f, *xs):
    """``jax.vmap(f)(*xs)``: a linear map applied to stacks of tangents or cotangents at once (one
    stack per argument of ``f``, of one length). Where JAX cannot batch ``f`` (a primitive whose
    batching rule does not handle this axis, as ``lax.ragged_dot``'s JVP: "vmap over any dim but 0 -
    NYI"), ``lax.map``: the same values, one application after another (``jax.jacfwd`` and
    ``jax.jacrev`` fail there). A stack of one is applied unbatched: XLA:CPU (jaxlib 0.10.2) laid a
    batched inverse FFT's (1, 1) operand out column-major next to a LAPACK solve and failed its FFT
    thunk's layout check (fuzz seed 113190)."""
    if xs[0].shape[0] == 1:
        return jax.tree_util.tree_map(lambda y: lax.expand_dims(y, (0,)), f(*(lax.squeeze(x, (0,)) for x in xs)))
    try:
        return jax.vmap(apart(f))(*xs)
    except NotImplementedError:
        return lax.map(lambda args: apart(f)(*args), xs)


# --------------------------------------------------------------------------------------------
# Products


#: :func:`_applications` counts at most this many applications
MAX_APPLICATIONS = 1 << 16


def _applications(x: Linear, forward: bool, limit: int = MAX_APPLICATIONS) -> int:
    """How many functions of Linears one application of ``x`` (``fn`` if ``forward``, else ``fn_t``)
    evaluates, each at most once per argument (:func:`_once_per_argument`): the distinct (map,
    argument) pairs reached through :attr:`Linear.calls`; ``limit + 1`` where there are more.

    Maps shared on one side are applied once in one direction and once per path in the other: in
    reverse order, each step of ``x = sort(x) + roll(x) + roll(x, -1)`` gives the edge to the
    output as three maps that all begin with the previous step's edge, applied to one cotangent
    backward but to three different tangents forward.
    """
    seen, arguments = set(), {}
    stack = [(x, 0)]
    known_more = "unreplayed_fn" if forward else "unreplayed_fn_t"  # more than MAX_REPLAYED (see _replay)
    while stack:
        node, argument = stack.pop()
        if (id(node), argument) in seen:
            continue
        seen.add((id(node), argument))
        if len(seen) > limit or (limit <= MAX_REPLAYED and node.__dict__.get(known_more)):
            return limit + 1
        for callee, *passed in node.calls:
            new = passed[0] if forward else passed[1]
            if new is _UNCALLED:
                continue
            stack.append((callee, argument if new is None else arguments.setdefault((id(new), argument), len(arguments) + 1)))
    return len(seen)


def _densify_forward(x: Linear, n_in: int, n_out: int) -> bool:
    """Whether ``x`` is densified by columns (``fn`` of ``n_in`` basis tangents) rather than by rows
    (``fn_t`` of ``n_out`` basis cotangents): the cheaper of applications times basis vectors
    (:func:`_applications`), the smaller basis where they tie."""
    by_columns = n_in <= n_out
    if not n_in or not n_out:  # a block of no entries: no application either way
        return by_columns
    first = _applications(x, by_columns)
    basis, other_basis = (n_in, n_out) if by_columns else (n_out, n_in)
    bound = first * basis // other_basis
    if bound < 1:
        return by_columns
    return by_columns != (_applications(x, not by_columns, bound) * other_basis < first * basis)


def _transposable(x: Linear) -> bool:
    """Whether ``x.backward()`` exists: ``x`` has ``fn_t``, or JAX can transpose its ``fn`` (tried
    once, kept). A composition gets ``fn_t`` from its factors' ``backward()`` where they all have
    one, so that its transpose is theirs, each derived once, never a transposition of the whole
    composition's forward map (which applies maps shared on the output side once per path)."""
    if x.fn_t is not None:
        return True
    if x.fn is None or x.calls:  # (a composition without fn_t has a factor JAX cannot transpose)
        return False
    if x.index is not None:  # a selection known while tracing (slice, gather, pad, scatter, ...):
        return True  # JAX transposes the JVPs of all of them
    known = x.__dict__.get("transposable")
    if known is None:
        try:
            jax.eval_shape(apart(x.backward()), x._out_struct())  # derived here, in the trace x was made in
            known = True
        except Exception:  # noqa: BLE001 - JAX has no transpose rule for a primitive of fn (while)
            known = False
        object.__setattr__(x, "transposable", known)
    return known


def promoted(*dtypes) -> np.dtype:
    """The dtype JAX promotes ``dtypes`` to (float16 with bfloat16: float32, where NumPy has no
    common type and raised)."""
    if all(d == dtypes[0] for d in dtypes[1:]):  # (the usual case, and JAX's promotion is dear to ask)
        return np.dtype(dtypes[0])
    return np.dtype(functools.reduce(jnp.promote_types, dtypes))


def _result_dtype(a: Partial, b: Partial):
    return promoted(a.dtype, b.dtype)


def _compose_index(outer, inner):
    """Index of ``outer o inner`` for two selections given by their indices (-1: zero): NumPy where
    both are, else traced int32 (:attr:`Linear.traced_index`)."""
    if not (isinstance(outer, np.ndarray) and isinstance(inner, np.ndarray)):
        flat = jnp.reshape(jnp.asarray(inner, np.int32), (-1,))
        if flat.shape[0] == 0:
            return jnp.full(jnp.shape(outer), -1, np.int32)
        picked = _take(flat, np.maximum(outer, 0) if isinstance(outer, np.ndarray) else jnp.maximum(outer, 0), 0)
        return jnp.where(jnp.asarray(outer) >= 0, picked, np.int32(-1))
    flat = inner.reshape(-1)
    if flat.size == 0:  # nothing to select from (zero-size values)
        return np.full(outer.shape, -1)
    return np.where(outer >= 0, flat[np.maximum(outer, 0)], -1)


def _transposed_index(index, in_shape, pairs):
    """Index of ``t -> selection(transpose(t, pairs))`` where ``selection`` reads a transposed ``in_shape``
    (NumPy, or traced: see :func:`_compose_index`)."""
    if index is None:
        return None
    flat = np.transpose(np.arange(_size(in_shape)).reshape(in_shape), pairs)
    return _compose_index(index, flat)


def matmul(b: Partial, a: Partial) -> tuple[Partial, Cost]:
    """The partial of ``u -> w`` through ``v``: ``b o a`` for ``a: u -> v`` and ``b: v -> w``."""
    if selects_nothing(b) or selects_nothing(a):  # (an element of a stack that a later slice leaves out)
        nothing = selection_from_index(b.out_shape, a.in_shape, np.full(b.out_shape, -1), _result_dtype(a, b))
        return (nothing.plan() if a.abstract or b.abstract else nothing), Cost()
    product, cost = _product(b, a)
    return _bounded(product), cost


def selects_nothing(x: Partial) -> bool:
    """Whether ``x`` is a selection known while tracing to select no element: exactly zero, as are
    its products with any partial."""
    return isinstance(x, Linear) and x.selection and not x.parts and x.index is not None and bool((x.index < 0).all())


#: A Linear whose functions nest calls of others' deeper than this (a chain of hundreds of sorts or
#: FFTs, each step's partial a lazy map applied to the result of the one before, where the order
#: does not let :func:`_warm` apply them in a loop) has the maps it applies that deep replayed from
#: their equations; applied as nested calls, a chain of 600 exceeded Python's recursion limit.
MAX_DEPTH = 32


def _warmed(token, callee: Linear, dtype) -> bool:
    """Whether a Linear of ``dtype`` applies ``callee`` to an argument :func:`_warm` knows
    beforehand (``token`` as in :attr:`Linear.calls`)."""
    if token is None:
        return callee.dtype == dtype
    return isinstance(token, (jax.Array, np.ndarray)) and promoted(dtype, token.dtype) == callee.dtype


def _nesting(calls, dtype) -> tuple:
    """:attr:`Linear.depth` of a Linear of ``dtype`` whose functions apply ``calls``: one more than
    a callee's where the callee's argument is made by the application itself, as deep as the
    callee's where :func:`_warm` applies it first."""
    depth = [0, 0]
    for callee, *passed in calls:
        for d, token in enumerate(passed):
            if token is not _UNCALLED:
                depth[d] = max(depth[d], callee.depth[d] + (0 if _warmed(token, callee, dtype) else 1), 1)
    return tuple(depth)


def _bounded(x: Partial) -> Partial:
    """``x`` nesting at most :data:`MAX_DEPTH` deep: in a direction where it nests deeper, the
    Linears it applies that nest that deep are replaced, in place, by replays of their equations
    (:func:`_replay`).

    In place, so that every composition sharing such a map applies the one replay (the products of
    one edge with each of its successors, made in turn), instead of each tracing it into its own.
    """
    if not isinstance(x, Linear) or x.abstract or max(x.depth) <= MAX_DEPTH:
        return x
    for d in (0, 1):
        if x.depth[d] <= MAX_DEPTH:
            continue
        for callee, *passed in x.calls:
            if callee.depth[d] >= MAX_DEPTH and not _warmed(passed[d], callee, x.dtype):
                _replay(callee, forward=d == 0)
    return replace(x, depth=_nesting(x.calls, x.dtype))


def _replay(x: Linear, forward: bool) -> None:
    """Replace ``x``'s function in direction ``forward`` by a replay of its equations (the same
    map; the Linears that apply ``x`` look its functions up when they apply them). A direction
    that applies more maps than :data:`MAX_REPLAYED` (maps shared on the other side, see
    :func:`_applications`) is left as it is: traced, it would take as long as applying it."""
    name = "fn" if forward else "fn_t"
    f, d = getattr(x, name), 0 if forward else 1
    if f is None or x.depth[d] == 0 or x.__dict__.get("unreplayed_" + name):
        return
    if _applications(x, forward, MAX_REPLAYED) > MAX_REPLAYED:
        x.__dict__["unreplayed_" + name] = True  # (not counted again)
        return
    argument = x._in_struct() if forward else x._out_struct()
    object.__setattr__(x, name, _once_per_argument(_replayed(f, argument), x, forward))
    # a replay applies no other maps: only the calls of the other direction remain
    calls = tuple((callee, *(_UNCALLED if k == d else p for k, p in enumerate(passed))) for callee, *passed in x.calls)
    object.__setattr__(x, "calls", tuple(c for c in calls if c[1:] != (_UNCALLED, _UNCALLED)))
    object.__setattr__(x, "depth", (0, x.depth[1]) if forward else (x.depth[0], 0))


#: :func:`_bounded` replays a direction of a deep composition that applies at most this many maps
MAX_REPLAYED = 1 << 12

#: in :attr:`Linear.calls`: the direction does not apply the map
_UNCALLED = object()


def _replayed(f: Optional[Callable], argument) -> Optional[Callable]:
    """``f`` traced once at ``argument``'s shape and dtype, as a function that replays its equations
    (values it closes over become arguments of the trace, :func:`jax.closure_convert`)."""
    if f is None:
        return None
    converted, consts = jax.closure_convert(apart(f), argument)
    return lambda t: converted(t, *consts)


def _product(b: Partial, a: Partial) -> tuple[Partial, Cost]:
    assert tuple(a.out_shape) == tuple(b.in_shape), (a.out_shape, b.in_shape)
    if _has_parts(a) or _has_parts(b):
        distributed = _distributed(b, a)
        if distributed is not None:
            return distributed
    if isinstance(a, Sparse) and isinstance(b, Sparse):
        return _sparse_sparse(b, a)
    if isinstance(a, Linear) and isinstance(b, Linear):
        return _linear_linear(b, a)
    known, other = (a, b) if isinstance(a, Linear) else (b, a)
    if known.index is not None and not other.is_permuted_diag:
        selection = _replication_as_selection(other)
        if selection is not None:
            return _linear_linear(*((selection, a) if known is a else (b, selection)))
    if isinstance(a, Linear):
        return _sparse_after_linear(b, a)
    return _linear_after_sparse(b, a)


def _replication_as_selection(x: Sparse) -> Optional[Linear]:
    """A unit ``x`` as a selection with known index, where each of its output elements reads one
    input element (every input axis it does not pair has size 1: a broadcast, a reshape adding or
    removing unit axes), or None. Multiplied by a selection of known index, it is then composed as
    index arithmetic (:func:`_linear_linear`), not formed dense over its rows (an edge-padded image:
    a slice of a row of 40, broadcast to a (1, 1, 40) row, densified into 40 x 40 x 40 blocks)."""
    if not x.unit or any(x.in_shape[j] != 1 for j in x.unpaired_in):
        return None
    out = np.indices(x.out_shape, sparse=True)
    coords = [np.zeros((1,) * len(x.out_shape), int)] * len(x.in_shape)
    for k, j in enumerate(x.pairs):
        if j is not None:
            coords[j] = out[k]
    index = np.ravel_multi_index(tuple(coords), x.in_shape) if x.in_shape else np.zeros((), int)
    return selection_from_index(x.out_shape, x.in_shape, np.broadcast_to(index, x.out_shape).copy(), x.dtype)


def clear_plan_caches() -> None:
    """Forget the cached product and sum plans (for measuring a cold start; see ``make bench``)."""
    _product_plan.cache_clear()
    _sum_plan.cache_clear()


def _sparse_sparse(b: Sparse, a: Sparse) -> tuple[Sparse, Cost]:
    plan = _product_plan(b.key, a.key)
    result = plan.result
    if result.unit or a.abstract or b.abstract:
        return result, plan.cost
    kept = [(part, keep) for part, keep in ((b, plan.b_keep), (a, plan.a_keep)) if keep is not None]
    val = _contract([(part.val, keep) for part, keep in kept], plan.specs, plan.out_layout, plan.loop, result.dtype)
    if plan.factor != 1:
        val = lax.mul(val, np.asarray(plan.factor, result.dtype))
    product = replace(result, val=val)
    if a.live is None and b.live is None:
        return product, plan.cost
    b_layout = _product_layout(b, plan.b_keep, plan.specs[0] if plan.b_keep is not None else None, plan)
    a_layout = _product_layout(a, plan.a_keep, plan.specs[-1] if plan.a_keep is not None else None, plan)
    return _with_exact_zeros(product, b, a, b_layout, a_layout), plan.cost


def _product_layout(part: Sparse, keep, spec, plan: "_ProductPlan"):
    """A function laying an array of ``part``'s value shape out as the product's values, or None
    where ``part`` has no exact zeros or the product sums over an axis it stores."""
    if part.live is None or spec is None or not set(spec) <= set(plan.out_layout) - {None}:
        return None
    shape = tuple(part.val_shape[keep[spec.index(l)]] if l is not None and l in spec else 1 for l in plan.out_layout)
    return lambda v: _broadcast_to(_laid_out(v, keep, spec, plan.out_layout, shape), plan.result.val_shape)


def _with_exact_zeros(product: Sparse, b: Sparse, a: Sparse, b_layout, a_layout) -> Sparse:
    """The product ``b o a`` with the exact zeros of its factors (:attr:`Sparse.live`) applied as
    ``jax.jacrev`` applies them, a cotangent passing ``b`` and then ``a``.

    Where ``a`` is an exact zero the product is ``a``'s value (a select: zero, whatever ``b``), and
    an exact zero; where ``b`` is, the product is ``b``'s zero times ``a``'s value (NaN where that
    is infinite or NaN), and an exact zero. This composition is associative: every elimination
    order gives the result of the path's cotangent. Exact zeros on an axis the product sums over
    are kept as plain zeros (where ``a`` has them, its product is not selected). ``b_layout`` and
    ``a_layout`` lay a factor's values out as the product's (:func:`_product_layout`)."""
    val, live = product.val, None
    if a.live is not None:
        if a_layout is None:
            return product
        live = a_layout(a.live)
        val = lax.select(live, val, a_layout(cast(a.val, product.dtype)))
    if b_layout is not None:
        live = b_layout(b.live) if live is None else lax.bitwise_and(live, b_layout(b.live))
    return replace(product, val=val, live=live)


@dataclass(frozen=True)
class _ProductPlan:
    """Structure and cost of ``b o a`` for two Sparse partials, and how to compute its values."""

    result: Sparse  # the product's structure (a plan, or a unit partial)
    cost: Cost
    factor: int  # contracted size over which neither operand stores values
    b_keep: Optional[tuple]  # stored axes of b's values taken into the contraction (None: b is unit)
    a_keep: Optional[tuple]
    specs: tuple  # einsum-style letters of the operands' kept axes (b first)
    out_layout: tuple  # per axis of the result's values: its letter, or None (an axis of size 1)
    loop: int  # scalar multiplications of the contraction


@functools.lru_cache(maxsize=1 << 16)
def _product_plan(b_key: tuple, a_key: tuple) -> _ProductPlan:
    """The plan of ``b o a`` from the operands' :attr:`Sparse.key` (cached: orders re-cost products)."""
    b, a = Sparse(*b_key), Sparse(*a_key)
    nw, nv, nu = len(b.out_shape), len(a.out_shape), len(a.in_shape)
    # union-find over axes ('w', i), ('v', k), ('u', j): pairings are Kronecker deltas
    parent: dict = {}

    def find(x):
        while parent.setdefault(x, x) != x:
            x = parent[x]
        return x

    def union(x, y):
        parent[find(x)] = find(y)

    for i, k in enumerate(b.pairs):
        if k is not None:
            union(("w", i), ("v", k))
    for k, j in enumerate(a.pairs):
        if j is not None:
            union(("v", k), ("u", j))
    size = {}
    for i in range(nw):
        size[find(("w", i))] = b.out_shape[i]
    for k in range(nv):
        size[find(("v", k))] = a.out_shape[k]
    for j in range(nu):
        size[find(("u", j))] = a.in_shape[j]

    a_axes = [find(("v", k)) for k in range(nv)] + [find(("u", j)) for j in a.unpaired_in]
    b_axes = [find(("w", i)) for i in range(nw)] + [find(("v", k)) for k in b.unpaired_in]
    w_classes = [find(("w", i)) for i in range(nw)]
    u_class = {j: find(("u", j)) for j in range(nu)}
    pairs = []
    for i in range(nw):
        paired = [j for j in range(nu) if u_class[j] == w_classes[i]]
        pairs.append(paired[0] if paired else None)
    c_unpaired = [j for j in range(nu) if j not in pairs]
    c_axes = w_classes + [u_class[j] for j in c_unpaired]

    a_present = [c for c, s in zip(a_axes, a.val_shape) if s != 1 and not a.unit]
    b_present = [c for c, s in zip(b_axes, b.val_shape) if s != 1 and not b.unit]
    present = set(a_present) | set(b_present)
    contracted = (set(a_axes) | set(b_axes)) - set(c_axes)
    factor = _size(size[c] for c in contracted if c not in present)
    val_shape = tuple(size[c] if c in present else 1 for c in c_axes)
    dtype = np.dtype(_result_dtype(a, b))

    loop = _size(size[c] for c in present)
    out_size = _size(val_shape)
    both = not a.unit and not b.unit
    mults = (loop if both else 0) + (out_size if factor != 1 else 0)
    adds = loop - out_size if present & contracted else 0

    letters = {c: chr(ord("a") + n) for n, c in enumerate(dict.fromkeys(a_axes + b_axes + c_axes))}
    keeps, specs = [], []
    for part, axes, present_axes in ((b, b_axes, b_present), (a, a_axes, a_present)):
        if part.unit:
            keeps.append(None)
            continue
        keep = tuple(n for n, c in enumerate(axes) if c in present_axes)
        keeps.append(keep)
        specs.append("".join(letters[axes[n]] for n in keep))
    out_layout = tuple(letters[c] if c in present else None for c in c_axes)
    result = Sparse(b.out_shape, a.in_shape, tuple(pairs), val_shape, dtype, None, a.unit and b.unit and factor == 1)
    return _ProductPlan(result, Cost(mults, adds), factor, keeps[0], keeps[1], tuple(specs), out_layout, loop)


#: Products with at most this many scalar multiplications, and products that sum no axis the two factors
#: share (scalings, outer products), are written as broadcast-multiply(-sum), which XLA fuses with its
#: neighbours; larger contractions, and those that sum more than :data:`POINT_SUM` terms, go to
#: ``dot_general``. On XLA:CPU a small matrix-matrix ``dot`` is a call of its own, dearer than its
#: arithmetic: the encoder's Jacobian at a point (rev order, pinned to one CPU) took 57.0 us with a
#: limit of 64 and its primal products as ``dot``, 48.2 us with 256 and :func:`dot_general` for them,
#: 48.1 us with 1024 (``jax.jacrev``: 57.5 us). A matrix-vector product, and a contraction that sums
#: more than :data:`UNROLLED_SUM` terms, has two forms (:mod:`jaxtool.point_forms`): written out at a
#: point, a ``dot`` under ``jax.vmap``, where it is the faster form: with it, over 1024 points, the
#: rev-order Jacobian of roe_flux_3d took 0.34 ms instead of 1.29 ms, perceptron's 0.105 ms instead
#: of 0.176 ms (pinned; ``jax.jacrev``: 1.27, 0.18).
SMALL_CONTRACTION = 256

#: a fused multiply-and-sum over at most this many terms is written as a sum of slices, not a
#: ``reduce_sum``, also under ``jax.vmap``: XLA:CPU hands small multiply-reduce chains, most of all
#: vmapped ones, to a library call (a YNNPACK fusion) that nothing fuses with. Over 1024 points the
#: rev-order Jacobian of the encoder (4x4 products) took 4.4 ms with sums of slices, 10.3 ms with
#: ``reduce_sum``; of ``real((x + 1j y)**3 * exp(1j x))`` (2x2 blocks of complex values) over 256
#: points, 0.05 ms, not 0.2. XLA compiles the slices into its own loops: the encoder's first call took
#: 1.45x as long. A contraction that sums more terms goes to ``dot_general`` under ``jax.vmap``: its
#: product, which that library call cannot take in, would be made in memory first. Over 1024 points
#: the mlp sample's rev-order Jacobian (an 8x16 by 16x2 product) took 1.39 ms so, 10.4 ms as
#: broadcast-multiply and ``reduce_sum`` (one CPU, interleaved; ``jax.jacrev``: 1.2-2.3 ms).
UNROLLED_SUM = 4

#: at a point (:mod:`jaxtool.point_forms`), sums of at most this many terms are written out: the
#: primal's ``reduce_sum`` and the contractions of :data:`UNROLLED_SUM`'s next size. More terms
#: gained nothing more (perceptron's rev order: 20.4 us with 8, 20.2 us with 16) and cost more
#: under ``jax.vmap`` where a contraction's two forms did not reach (the encoder's rev order over
#: 1024 points: 12.0 ms with 16 written out everywhere, 6.4 ms with 8, 5.6 ms as before).
POINT_SUM = 8


class _WrittenOut(threading.local):
    """Per thread: whether the program being differentiated may have written-out forms at all."""

    allowed: bool = True


_WRITTEN_OUT = _WrittenOut()


@contextlib.contextmanager
def written_out_forms(allowed: bool):
    """Within: :func:`fuses_small_products` is False unless ``allowed`` (see
    :func:`jaxtool.rules.writes_out_safely`)."""
    state, before = _WRITTEN_OUT, _WRITTEN_OUT.allowed
    state.allowed = allowed
    try:
        yield
    finally:
        state.allowed = before


def fuses_small_products() -> bool:
    """Whether small contractions and sums are written out as above (:data:`SMALL_CONTRACTION`,
    :data:`UNROLLED_SUM`, :data:`POINT_SUM`): for JAX's default backend XLA:CPU only. Elsewhere every
    contraction is a ``dot_general`` and every sum a ``reduce_sum``: XLA:GPU's priority fusion takes
    minutes over the written-out forms. On an H200 (JAX 0.11.2) the encoder's rev-order Jacobian
    compiled in 60 s with them, 51.8 s of it in priority fusion, and in 1.05 s without (``jax.jacrev``'s:
    0.89 s); its fwd order did not compile in 75 s with them, and did in 3.5 s without. Nor where a
    program mixes FFTs with LAPACK calls (:func:`written_out_forms`)."""
    return _WRITTEN_OUT.allowed and jax.default_backend() == "cpu"


def _wide_float(dtype) -> bool:
    """float32 or float64: a library sum or dot of narrower floats accumulates in float32, a
    written-out one would not."""
    return np.dtype(dtype) in (np.float32, np.float64)


def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, out_sharding=None):
    """``lax.dot_general``, as a fused multiply-and-sum where it takes at most :data:`SMALL_CONTRACTION`
    scalar multiplications of float32 or float64 values and sums at most :data:`UNROLLED_SUM` terms,
    or in two forms (:func:`_contract`) where it is a matrix-vector product or sums at most
    :data:`POINT_SUM`, on XLA:CPU (:func:`fuses_small_products`)."""
    (lc, rc), (lb, rb) = dimension_numbers
    dtype = np.dtype(preferred_element_type or jnp.result_type(lhs, rhs))
    lhs_free = [a for a in range(lhs.ndim) if a not in lc and a not in lb]
    rhs_free = [a for a in range(rhs.ndim) if a not in rc and a not in rb]
    out_shape = [lhs.shape[a] for a in lb] + [lhs.shape[a] for a in lhs_free] + [rhs.shape[a] for a in rhs_free]
    loop = _size(out_shape) * _size([lhs.shape[a] for a in lc])
    small = loop <= SMALL_CONTRACTION and fuses_small_products()
    matvec = not lb and not (lhs_free and rhs_free)
    if not small or (matvec and _size(lhs.shape[a] for a in lc) > POINT_SUM) or out_sharding is not None \
            or not all(_wide_float(t) for t in (lhs.dtype, rhs.dtype, dtype)):
        return lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                               preferred_element_type=preferred_element_type, out_sharding=out_sharding)
    letters = iter("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
    lhs_spec, rhs_spec = [None] * lhs.ndim, [None] * rhs.ndim
    for l_axes, r_axes in ((lb, rb), (lc, rc)):
        for a, b in zip(l_axes, r_axes):
            lhs_spec[a] = rhs_spec[b] = next(letters)
    for a in lhs_free:
        lhs_spec[a] = next(letters)
    for a in rhs_free:
        rhs_spec[a] = next(letters)
    out_layout = tuple(lhs_spec[a] for a in lb) + tuple(lhs_spec[a] for a in lhs_free) + \
        tuple(rhs_spec[a] for a in rhs_free)
    operands = [(lhs, tuple(range(lhs.ndim))), (rhs, tuple(range(rhs.ndim)))]
    return _contract(operands, ("".join(lhs_spec), "".join(rhs_spec)), out_layout, loop, dtype)


def reduce_sum(x, **params):
    """``lax.reduce_sum``, in two forms (a sum of slices at a point, :class:`_WrittenSum`) where it sums
    at most :data:`POINT_SUM` terms of float32 or float64 values, on XLA:CPU (:func:`fuses_small_products`)."""
    axes = tuple(params["axes"])
    terms = _size(x.shape[a] for a in axes)
    if 1 < terms <= POINT_SUM and _wide_float(x.dtype) and params.get("out_sharding") is None \
            and fuses_small_products():
        shape = tuple(n for a, n in enumerate(x.shape) if a not in axes)
        return two_forms(_WrittenSum(axes, shape, np.dtype(x.dtype)), x)
    return lax.reduce_sum_p.bind(x, **params)


def _sum_of_slices(x, axes):
    """``reduce_sum(x, axes)`` as sums of slices of ``x``, which XLA fuses: along each axis in turn,
    its two halves added until one term is left (the odd term out, where there is one, added at the
    end), then the summed axes dropped. A sum of 4 terms is 4 slices, 2 additions and a reshape, not
    4 slices, 4 reshapes and 3 additions, and XLA:CPU compiles these instructions into every kernel
    that reads the sum: the encoder's forward-order Jacobian compiled to 2981 instructions in its
    kernels instead of 3099 (markowitz: 1335 instead of 1396), in 3-5% less time."""
    for axis in axes:
        odd_terms = []
        while x.shape[axis] > 1:
            size = x.shape[axis]
            half = size // 2
            if size % 2:
                odd_terms.append(lax.slice_in_dim(x, size - 1, size, axis=axis))
            x = lax.add(lax.slice_in_dim(x, 0, half, axis=axis), lax.slice_in_dim(x, half, 2 * half, axis=axis))
        for term in odd_terms:
            x = lax.add(x, term)
    return lax.squeeze(x, axes)


@dataclass(frozen=True)
class _WrittenSum:
    """The two forms (:mod:`jaxtool.point_forms`) of a sum of a few terms: slices added up, ``reduce_sum``."""

    axes: tuple
    shape: tuple
    dtype: np.dtype

    def at_a_point(self, x):
        return _sum_of_slices(x, self.axes)

    def batched(self, x):
        return lax.reduce_sum(x, self.axes)


@dataclass(frozen=True)
class _SmallContraction:
    """The two forms (:mod:`jaxtool.point_forms`) of a small contraction (:func:`_contract`'s arguments):
    written out (a broadcast product and its sum of slices), and ``dot_general``."""

    keeps: tuple
    specs: tuple
    out_layout: tuple
    shape: tuple
    dtype: np.dtype

    def at_a_point(self, *values):
        return _written_out(list(zip(values, self.keeps)), self.specs, self.out_layout, POINT_SUM)

    def batched(self, *values):
        return _by_dot(list(zip(values, self.keeps)), self.specs, self.out_layout, self.shape, self.dtype)


@dataclass(frozen=True)
class _FusedContraction:
    """A contraction that sums at most :data:`UNROLLED_SUM` terms, written out in both forms
    (:mod:`jaxtool.point_forms`: a broadcast product and its sum of slices, at a point and under
    ``jax.vmap``), as one equation: so that :func:`jaxtool.sharing.call_sharing` finds it where XLA
    would copy it into several kernels, and has it made once."""

    keeps: tuple
    specs: tuple
    out_layout: tuple
    shape: tuple
    dtype: np.dtype
    #: its batched form is written out too, so XLA copies it under ``jax.vmap`` as well
    batched_fuses: ClassVar[bool] = True

    def at_a_point(self, *values):
        return _written_out(list(zip(values, self.keeps)), self.specs, self.out_layout, UNROLLED_SUM)

    batched = at_a_point


def _contract(operands, specs, out_layout, loop, dtype):
    """``einsum(specs -> out)`` of zero, one or two stored value arrays, fusible when small.

    ``operands`` are ``(array, keep)`` pairs: the array's axes at the positions ``keep`` carry the
    letters of its spec, its other axes have size 1. The result's axes are ``out_layout``'s: a letter
    (every one occurs in some operand), or None for an axis of size 1. Written with ``lax`` directly,
    each operand broadcast from its stored shape in one step where its letters are in result order:
    tracing ``jnp.einsum`` (or ``jnp`` broadcasting arithmetic) costs far more, and a Jacobian may
    take thousands of these products.
    """
    sizes = {l: v.shape[n] for (v, keep), spec in zip(operands, specs) for n, l in zip(keep, spec)}
    out_shape = tuple(1 if l is None else sizes[l] for l in out_layout)
    if not operands:
        return lax.full(out_shape, 1, dtype)
    operands = [(cast(v, dtype), keep) for v, keep in operands]
    out_spec = "".join(l for l in out_layout if l is not None)
    contracted = (set(specs[0]) & set(specs[1])) - set(out_spec) if len(operands) == 2 else ()
    fused = fuses_small_products()
    summed = _size(sizes[l] for l in contracted)
    if contracted and (loop > SMALL_CONTRACTION or summed > POINT_SUM or not fused):
        return _by_dot(operands, specs, out_layout, out_shape, dtype)
    if contracted and (summed > UNROLLED_SUM or _is_matvec(specs, out_spec)):
        forms = _SmallContraction(tuple(keep for _, keep in operands), tuple(specs), tuple(out_layout), out_shape,
                                  np.dtype(dtype))
        return two_forms(forms, *(v for v, _ in operands))
    if contracted:
        forms = _FusedContraction(tuple(keep for _, keep in operands), tuple(specs), tuple(out_layout), out_shape,
                                  np.dtype(dtype))
        return two_forms(forms, *(v for v, _ in operands))
    return _written_out(operands, specs, out_layout, UNROLLED_SUM if fused else 0)


def _by_dot(operands, specs, out_layout, out_shape, dtype):
    """:func:`_contract` of two operands as one ``dot_general`` (:func:`_dot`)."""
    kept = [reshaped(v, tuple(v.shape[n] for n in keep)) for v, keep in operands]
    return reshaped(_dot(kept, specs, "".join(l for l in out_layout if l is not None), dtype), out_shape)


def _written_out(operands, specs, out_layout, unrolled: int):
    """:func:`_contract` as a broadcast product, its sum over at most ``unrolled`` terms a sum of
    slices (:func:`_sum_of_slices`), over more a :func:`reduce_sum`."""
    sizes = {l: v.shape[n] for (v, keep), spec in zip(operands, specs) for n, l in zip(keep, spec)}
    layout = _summation_layout(operands, specs, out_layout)
    full = tuple(sizes[l] if l in sizes else 1 for l in layout)
    product = None
    for (v, keep), spec in zip(operands, specs):
        v = _laid_out(v, keep, spec, layout, full)
        product = v if product is None else lax.mul(product, v)
    summed_axes = tuple(n for n, l in enumerate(layout) if l is not None and l not in out_layout)
    if not summed_axes:
        return product
    if 0 < _size(full[n] for n in summed_axes) <= unrolled:  # (a sum of no terms is zero)
        return _sum_of_slices(product, summed_axes)
    return reduce_sum(product, axes=summed_axes, out_sharding=None)


def _summation_layout(operands, specs, out_layout) -> tuple:
    """The axes (letters, None for size 1) of a contraction's product before its sum: ``out_layout``
    with each summed letter inserted after the letter that precedes it in the largest operand that
    has it, so that laying that operand out needs no transpose (a summed axis between two kept ones,
    as in ``sum(a[i, j, c], j)``, stays where it is; the sum removes it from any position)."""
    layout = list(out_layout)
    largest_first = sorted(range(len(specs)), key=lambda n: -operands[n][0].size)
    for spec in (specs[n] for n in largest_first):
        for k, letter in enumerate(spec):
            if letter not in layout:
                placed = [l for l in spec[:k] if l in layout]
                layout.insert(layout.index(placed[-1]) + 1 if placed else 0, letter)
    return tuple(layout)


def _is_matvec(specs, out_spec) -> bool:
    """Whether a contraction of two operands (letters ``specs``, result ``out_spec``) is a
    matrix-vector product: no batch letter, and one operand carries no letter of the result."""
    batch = set(specs[0]) & set(specs[1]) & set(out_spec)
    return not batch and any(not set(spec) & set(out_spec) for spec in specs)


def _laid_out(v, keep, spec, layout, full):
    """Stored values ``v`` (letters ``spec`` on its axes ``keep``, size 1 on the others) broadcast to
    ``full``, the shape whose axes carry the letters (or None) of ``layout``.

    One ``broadcast_in_dim`` from the stored shape where the letters come in ``layout``'s order and
    the size-1 axes fit between them; else the kept axes are taken out, transposed and broadcast.
    """
    target = [layout.index(l) for l in spec]
    dims, last = [], -1
    for n in range(v.ndim):
        bound = len(layout) if n not in keep else target[keep.index(n)]
        if n in keep and bound > last:
            last = bound
        elif n not in keep and last + 1 < min([len(layout)] + [t for m, t in zip(keep, target) if m > n]):
            last += 1
        else:
            break
        dims.append(last)
    else:
        if tuple(v.shape) == tuple(full) and dims == list(range(len(full))):
            return v
        return lax.broadcast_in_dim(v, full, tuple(dims))
    v = reshaped(v, tuple(v.shape[n] for n in keep))
    perm = sorted(range(len(spec)), key=lambda n: target[n])
    if perm != list(range(len(spec))):
        v = lax.transpose(v, perm)
    return lax.broadcast_in_dim(v, full, tuple(sorted(target)))


def _broadcast_shape(s: tuple, t: tuple) -> tuple:
    """The common shape of two shapes of one rank whose axes are equal or 1 (a 1 also broadcasts to 0)."""
    return tuple(n if m == 1 else m for m, n in zip(s, t))


def _broadcasting(op, x, y):
    """``op(x, y)`` for arrays of one rank and dtype whose axes are equal or of size 1 in one of them."""
    shape = _broadcast_shape(x.shape, y.shape)
    dims = tuple(range(len(shape)))
    x = x if x.shape == shape else lax.broadcast_in_dim(x, shape, dims)
    y = y if y.shape == shape else lax.broadcast_in_dim(y, shape, dims)
    return op(x, y)


def _dot(operands, specs, out_spec, dtype):
    """``einsum`` of two operands as one ``dot_general``, then a transpose into ``out_spec`` order."""
    (x, y), (sx, sy) = operands, specs
    # a letter only one operand has and the result lacks is summed out first
    for which in (0, 1):
        v, s, other = (x, sx, sy) if which == 0 else (y, sy, sx)
        lone = [n for n, l in enumerate(s) if l not in other and l not in out_spec]
        if lone:
            v = v.sum(axis=tuple(lone))
            s = "".join(l for n, l in enumerate(s) if n not in lone)
            x, sx = (v, s) if which == 0 else (x, sx)
            y, sy = (v, s) if which == 1 else (y, sy)
    batch = "".join(l for l in out_spec if l in sx and l in sy)
    # dot_general lays its result out as (batch, free axes of its first operand, of its second). Of
    # the two operand orders, take the one that needs the fewest transposes of the operands into
    # the canonical (batch, free, contracted) x (batch, contracted, free) form, then of the result
    candidates = []
    for (a, sa), (b, sb) in (((x, sx), (y, sy)), ((y, sy), (x, sx))):
        contract = "".join(l for l in sa if l in sb and l not in out_spec)
        free_a, free_b = "".join(l for l in sa if l not in sb), "".join(l for l in sb if l not in sa)
        lhs, rhs = batch + free_a + contract, batch + contract + free_b
        cost = (sa != lhs) + (sb != rhs), batch + free_a + free_b != out_spec
        candidates.append((cost, (a, sa, lhs), (b, sb, rhs), len(contract), batch + free_a + free_b))
    _, (a, sa, lhs), (b, sb, rhs), nc, result_spec = min(candidates, key=lambda c: c[0])
    a, b = _canonical(a, sa, lhs), _canonical(b, sb, rhs)
    nb = len(batch)
    dims = ((tuple(range(len(lhs) - nc, len(lhs))), tuple(range(nb, nb + nc))),
            (tuple(range(nb)), tuple(range(nb))))
    result = lax.dot_general(a, b, dims, precision=HIGHEST, preferred_element_type=dtype)
    perm = tuple(result_spec.index(l) for l in out_spec)
    return lax.transpose(result, perm) if perm != tuple(range(len(perm))) else result


def _canonical(v, spec: str, order: str):
    """``v`` (axes lettered ``spec``) with its axes in ``order``: a transpose, kept as a copy.

    The barrier keeps XLA from folding the transpose back into the ``dot``'s dimension numbers:
    XLA:CPU runs a ``dot`` whose operands are not in canonical form with a slow generic loop
    (vmapped over 256 points, an 8x3 by 8x16 product contracting the 8s: 118 us; as 3x8 by
    8x16, 61 us with the copy, 21 us with operands already in that layout).
    """
    if spec == order:
        return v
    return lax.optimization_barrier(lax.transpose(v, tuple(spec.index(l) for l in order)))


def _linear_linear(b: Linear, a: Linear) -> tuple[Linear, Cost]:
    dtype = np.dtype(_result_dtype(a, b))
    n_out = _size(b.out_shape)
    flops = a.flops + b.flops
    push = a.has_scale and b.selection  # b(s * x) = b(s) * b(x) for a selection b
    embed = a.has_scale and not b.selection
    cost = Cost((n_out if push and b.has_scale else 0), 0)
    if embed:
        flops += _size(a.out_shape)
    index = None if embed or a.index is None or b.index is None else _compose_index(b.index, a.index)
    result = Linear(b.out_shape, a.in_shape, dtype, has_scale=b.has_scale or push,
                    selection=a.selection and b.selection and not embed, flops=flops,
                    opaque=a.opaque or b.opaque, index=index)
    if a.abstract or b.abstract:
        return result, cost
    # (each factor's functions looked up when applied: _bounded may replace them by replays)
    fb = b.forward()  # (derived here, in the trace a and b were made in, where only fn_t is known)
    a.forward()
    if embed:
        fn = lambda t: b.forward()(a.scale * a.forward()(t))  # noqa: E731
    else:
        fn = lambda t: b.forward()(a.forward()(t))  # noqa: E731
    scale = b.scale
    if push:
        pushed = _broadcast_to(a.scale, a.out_shape).astype(a.dtype)
        picked = None if b.index is None else b.index.reshape(-1)
        if picked is not None and (picked >= 0).any():  # one gather (or slice), not b's own equations
            pushed = reshaped(_take(jnp.reshape(pushed, (-1,)), np.maximum(picked, 0), axis=0), b.out_shape)
            # (where b selects nothing the result does not either: zeroed below)
        else:
            pushed = fb(pushed)
        scale = pushed * b.scale if b.has_scale else pushed
    # the transpose of a, with the scale b does not take where embedded
    a_t = (lambda c: a.backward()(a.scale * c)) if embed else (lambda c: a.backward()(c))
    fn_t = (lambda c: a_t(b.backward()(c))) if _transposable(a) and _transposable(b) else None
    inner = object() if embed else a  # what b's argument is made from: new per composition, or a's result
    calls = ((a, None, object() if embed else b), (b, inner, None))
    joint = None
    # b's rows from its equation's one VJP, then the transpose of a selection a (a slice, a gather): not
    # of a composition, whose transpose each use of the rows would trace anew (a chain of scatters)
    if fn_t is not None and not push and a.index is not None and not a.calls:
        joint = _joint_after(b, a_t)
    # a selection b (an element of a loop's result) after a's equations: the rows taken back through b
    # once (per use of the rows), then each equation's one VJP, shared by the partials of all its inputs
    elif fn_t is not None and not push and not embed and b.index is not None and a.joint is not None:
        joint = None if any(term[4] is not None for term in a.joint) else \
            tuple(term for term in ((pullbacks, b if before is None else _before_before(b, before), i, after, None)
                                    for pullbacks, before, i, after, _ in a.joint)
                  if not selects_nothing(term[1])) or None  # (a selection of nothing: a zero term)
    traced_index = None
    if result.selection and index is None and _has_index(a) and _has_index(b):
        traced_index = lambda: _compose_index(_index_of(b), _index_of(a))  # noqa: E731
    return _zero_where_unselected(replace(result, fn=fn, fn_t=fn_t, scale=scale, depth=_nesting(calls, dtype),
                                          calls=calls, joint=joint, traced_index=traced_index)), cost


def _before_before(b: Linear, before: Linear) -> Linear:
    """The selection ``b o before``, one object per pair while results are kept, so that the partials
    of all an equation's inputs keep one selection before its output (:attr:`Linear.joint`)."""
    return _kept(("before", id(b), id(before)), lambda: matmul(b, before)[0], b, before)


def _has_index(x: Linear) -> bool:
    """Whether the selection ``x`` knows its index without applying its map (:func:`_index_of`)."""
    return x.index is not None or x.traced_index is not None


def _zero_where_unselected(x: Linear) -> Linear:
    """A scaled selection whose scale is zero where it selects nothing: such an output element is
    zero, and stays zero even where the scale (a local partial with no path to it, the infinite
    derivative of ``sqrt`` at a padded zero) is infinite or NaN, as in ``jax.jacrev``."""
    if not (x.selection and x.has_scale) or x.abstract:
        return x
    if x.index is not None:
        selected = x.index >= 0
        if selected.all():
            return x
    else:
        selected = x.forward()(_ones(x.in_shape, x.dtype)) != 0
    return replace(x, scale=_zero_unless(selected, x.scale))


def _transposer(pairs):
    """``t -> transpose(t)`` laying input axes out in the order of the output axes' pairs."""
    perm = tuple(pairs)
    if perm == tuple(range(len(perm))):
        return lambda t: t
    return lambda t: jnp.transpose(t, perm)


def _untransposer(pairs):
    inverse = tuple(int(i) for i in np.argsort(pairs))
    if inverse == tuple(range(len(inverse))):
        return lambda c: c
    return lambda c: jnp.transpose(c, inverse)


def _sparse_after_linear(b: Sparse, a: Linear) -> tuple[Partial, Cost]:
    """``b o a``: a Linear ``a: u -> v`` followed by a Sparse ``b: v -> w``."""
    dtype = np.dtype(_result_dtype(a, b))
    if b.is_permuted_diag:
        # b(x) = val * transpose(x): stays a Linear with a (transposed) scale
        both = a.has_scale and not b.unit
        cost = Cost(_size(b.out_shape) if both else 0, 0)
        index = None if a.index is None else np.transpose(a.index, b.pairs)
        result = Linear(b.out_shape, a.in_shape, dtype, has_scale=a.has_scale or not b.unit,
                        selection=a.selection, flops=a.flops, opaque=a.opaque, index=index)
        if a.abstract or b.abstract:
            return result, cost
        tr, untr = _transposer(b.pairs), _untransposer(b.pairs)
        a.forward()  # (derived here, in the trace a was made in, where only fn_t is known)
        fn = lambda t: tr(a.forward()(t))  # noqa: E731
        fn_t = (lambda c: a.backward()(untr(c))) if _transposable(a) else None
        scale = None
        if a.has_scale:  # (one array for each scale and b: the partials of one equation's inputs share it)
            scale = _kept(("scale after", id(a.scale), id(b.val), b.pairs),
                          lambda: _times(tr(jnp.broadcast_to(a.scale, a.out_shape)), b.val), a.scale, b.val)
        elif not b.unit:
            scale = b.val
        in_order = b.pairs == tuple(range(len(b.pairs)))
        calls = ((a, None, None if in_order else object()),)
        joint = a.joint  # (the same map, scaled and transposed: the equation's VJP still serves)
        if joint is not None and not in_order:  # (a selection before the output's VJP: not so)
            joint = None if any(term[1] is not None or term[4] is not None for term in joint) else \
                tuple((pullbacks.transposed(b.pairs),) + tuple(rest) for pullbacks, *rest in joint)
        traced_index = None
        if a.traced_index is not None:
            traced_index = lambda: lax.transpose(_index_of(a), b.pairs)  # noqa: E731
        return _zero_where_unselected(replace(result, fn=fn, fn_t=fn_t, scale=scale, depth=_nesting(calls, dtype),
                                              calls=calls, joint=joint, traced_index=traced_index)), cost
    # general: rows of b (dense over v) pulled back through a^T
    nw = len(b.out_shape)
    row_shape = b.dense_val_shape[:nw]
    n_rows = _size(row_shape)
    cost = Cost(n_rows * (a.flops + (_size(a.out_shape) if a.has_scale else 0)), 0)
    val_shape = tuple(row_shape) + tuple(a.in_shape)
    result = Sparse(b.out_shape, a.in_shape, (None,) * nw, val_shape, dtype)
    if a.abstract or b.abstract:
        return result, cost
    if a.selection and any(p is not None for p in b.pairs):
        pulled = _rows_through_index(b, a, tuple(row_shape), dtype)
        return replace(result, val=cast(reshaped(pulled, val_shape), dtype)), cost
    rows = b.unpair(range(nw))
    block = jnp.broadcast_to(rows.values(), tuple(row_shape) + tuple(a.out_shape)).reshape((n_rows,) + a.out_shape)
    if a.selection:
        if a.has_scale:
            block = block * jnp.broadcast_to(a.scale, a.out_shape).astype(dtype)
        index = _index_of(a)
        pulled = _scatter_columns(block.reshape(n_rows, _size(a.out_shape)).astype(dtype),
                                  reshaped(index, (_size(a.out_shape),)), _size(a.in_shape),
                                  (a.out_shape, a.in_shape))
        if isinstance(index, np.ndarray):
            hit = np.zeros(_size(a.in_shape), bool)
            hit[index[index >= 0]] = True
            if not hit.all():
                val = cast(reshaped(pulled, val_shape), dtype)
                _mark_zero_off(val, len(row_shape), hit.reshape(a.in_shape))
                return replace(result, val=val), cost
    elif a._joint() is not None:  # the same rows pulled back through all inputs of a's equation at once
        pulled = _joint_rows(a.joint, b, cast(block, a.dtype), a.scale if a.has_scale else None)
    elif _transposable(a):
        pulled = _vmapped(a.apply_t, cast(block, a.dtype))
    else:  # JAX cannot transpose a (a while loop's JVP): the rows times a densified by columns
        dense = cast(a.to_dense(), dtype).reshape(_size(a.out_shape), _size(a.in_shape))
        pulled = jnp.matmul(block.reshape(n_rows, _size(a.out_shape)).astype(dtype), dense, precision=HIGHEST)
    return replace(result, val=cast(reshaped(pulled, val_shape), dtype)), cost


class JointPullback:
    """The VJP of one equation's output with respect to all its differentiated inputs at once.

    An opaque equation (``scan``, ``while``, linear algebra) has one partial per differentiated
    input. Pulled back one by one, each would trace JAX's transpose of the whole equation (a
    ``scan`` backwards per input); this computes every input's cotangents in one pass and
    remembers them per block of cotangents, keyed by the partial the block came from (the rows of
    one edge meet each of the equation's partials in turn when its vertex is eliminated).
    ``make_vjp()`` returns the map from one output cotangent to the tuple of input cotangents;
    where JAX cannot transpose the equation (``while``), the partials pull back alone.
    """

    def __init__(self, make_vjp: Callable, out_struct, total_in: int, family: Optional["OutputsPullback"] = None,
                 k: int = 0):
        self._make_vjp = make_vjp  # () -> vjp, called once, when first needed
        self._out_struct = out_struct  # the output's ShapeDtypeStruct
        self.total_in = total_in  # elements of all the differentiated inputs together
        self.family, self.k = family, k  # the VJP of all the equation's outputs, and this one's position
        self._usable = None
        self._memo = {}
        self._transposed = {}

    def _vjp(self) -> Callable:
        """``make_vjp()``, made once (:func:`_made_once`: in the trace it is first needed in)."""
        return _made_once(self, "made_vjp", self._make_vjp)

    def usable(self) -> bool:
        if self._usable is None:
            try:
                jax.eval_shape(self._vjp(), self._out_struct)  # JAX may linearize what it cannot transpose
                self._usable = True
            except Exception:  # noqa: BLE001 - no reverse rule: each partial's own forward map is used
                self._usable = False
        return self._usable

    def pull(self, source, block, scale=None, before=None, pairs: Optional[tuple] = None) -> tuple:
        """Cotangents of every input for the cotangents ``block`` (leading axis: rows) that came
        from ``source`` (this object itself for the identity rows of densifying), each times ``scale``
        first where given, then taken back through the selection ``before`` where given (see
        :attr:`Linear.joint`), then laid out as the output's (:func:`_untransposer`) where they are
        of its transpose by ``pairs``; computed once per ``source``, ``scale``, ``before`` and ``pairs``."""
        def pulled():
            c = block if scale is None else block * cast(scale, block.dtype)
            if before is not None:
                c = _vmapped(before.backward(), cast(c, before.dtype))
            if pairs is not None:
                c = jnp.transpose(c, (0,) + tuple(1 + int(i) for i in np.argsort(pairs)))
            return _vmapped(self._vjp(), cast(c, self._out_struct.dtype))  # (a bfloat16 output's: bfloat16)

        if _APPLICATIONS.nested:  # (what it makes belongs to the nested trace: see _made_once)
            return _kept(("pulled", id(self), id(source), id(scale), id(before), pairs), pulled, self, source, scale,
                         before)
        key = (id(source), id(scale), id(before), pairs)
        if key not in self._memo:
            self._memo[key] = (source, scale, before, pulled())  # (kept alive: their ids stay their own)
        return self._memo[key][3]

    def transposed(self, pairs: tuple):
        """This VJP for cotangents of the output transposed by ``pairs`` (one object per ``pairs``)."""
        pairs = tuple(int(p) for p in pairs)
        if pairs == tuple(range(len(pairs))):
            return self
        if pairs not in self._transposed:
            self._transposed[pairs] = _TransposedPullback(self, pairs)
        return self._transposed[pairs]


class OutputsPullback:
    """The VJP of all of one equation's outputs with respect to all its differentiated inputs: where
    the rows pulled back through a partial reach several outputs of one equation (a stack of a loop's
    angle and velocity), one VJP of their cotangents together serves them all, as in ``jax.jacrev``,
    not one per output (:func:`_joint_rows`). ``make_vjp()`` returns the map from the tuple of every
    output's cotangent to the tuple of input cotangents; ``out_structs`` are the outputs'
    ShapeDtypeStructs (an integer output's cotangent is a ``float0`` zero)."""

    def __init__(self, make_vjp: Callable, out_structs: list):
        self._make_vjp = make_vjp
        self._out_structs = out_structs
        self._memo = {}

    def pull(self, source, block, routes: tuple) -> tuple:
        """Input cotangents for the cotangents ``block`` (leading axis: rows, from ``source``) that
        reach output ``k``, times ``scale`` where given, through the selection ``before`` where given,
        for each ``(k, before, scale)`` of ``routes``, summed; computed once per ``source`` and
        ``routes``."""
        def pulled():
            cotangents = {}
            for k, before, scale in routes:
                ck = block if scale is None else block * cast(scale, block.dtype)
                ck = ck if before is None else _vmapped(before.backward(), cast(ck, before.dtype))
                ck = cast(ck, self._out_structs[k].dtype)
                cotangents[k] = ck if k not in cotangents else lax.add(cotangents[k], ck)
            ks = list(cotangents)
            vjp = _made_once(self, "made_vjp", self._make_vjp)

            def one(*rows):
                full = [rows[ks.index(k)] if k in cotangents else _zero_cotangent(x)
                        for k, x in enumerate(self._out_structs)]
                return vjp(tuple(full))

            return _vmapped(one, *(cotangents[k] for k in ks))

        key = (id(source),) + tuple((k, id(before), id(scale)) for k, before, scale in routes)
        alive = (source,) + tuple(before for _, before, _ in routes) + tuple(scale for _, _, scale in routes)
        if _APPLICATIONS.nested:  # (what it makes belongs to the nested trace: see _made_once)
            return _kept(("pulled together", id(self)) + key, pulled, self, *alive)
        if key not in self._memo:
            self._memo[key] = (alive, pulled())  # (kept alive: their ids stay their own)
        return self._memo[key][1]


def _zero_cotangent(struct):
    """A zero cotangent of an output of this ShapeDtypeStruct (``float0`` for an integer one)."""
    if jnp.issubdtype(struct.dtype, jnp.inexact):
        return jnp.zeros(struct.shape, struct.dtype)
    return np.zeros(struct.shape, jax.dtypes.float0)


class _TransposedPullback:
    """A :class:`JointPullback` whose output cotangents come transposed by ``pairs`` (``tanh`` of the
    transpose of an opaque equation's result): :meth:`pull` lays them out as the output's first."""

    def __init__(self, inner: JointPullback, pairs: tuple):
        self.inner, self.pairs, self.total_in = inner, pairs, inner.total_in

    def usable(self) -> bool:
        return self.inner.usable()

    def pull(self, source, block, scale=None, before=None) -> tuple:
        return self.inner.pull(source, block, scale, before, self.pairs)

    def transposed(self, pairs: tuple):
        """For cotangents transposed by ``pairs`` once more: the inner VJP's, both transposes in one."""
        inverse = np.argsort(pairs)[np.argsort(self.pairs)]  # (undo pairs, then self.pairs: the axes composed)
        return self.inner.transposed(tuple(np.argsort(inverse)))


def _joint_rows(joint: tuple, source, block, scale=None):
    """The cotangents ``block`` (leading axis: rows, from ``source``: see :meth:`JointPullback.pull`;
    None: the identity rows of densifying) pulled back through a partial with this ``joint`` and
    ``scale`` (None: none): per output and selection before it (:attr:`Linear.joint`), the one VJP
    of the scaled rows, each term's input's cotangents mapped on by its ``after``, summed. The
    partials of one equation's inputs scaled alike (``tanh(solve(a, b))`` in reverse order: ``tanh'``
    on both) share that VJP, as do those of all a loop's inputs reached through an element of its
    result."""
    total = None
    for family, terms in _by_family(joint):
        if family is None:
            pulled = [((i, after), pullbacks.pull(pullbacks if source is None else source, block,
                                                  _both_scales(scale, term_scale), before))
                      for pullbacks, before, i, after, term_scale in terms]
        else:
            routes = {}
            for pullbacks, before, _, _, term_scale in terms:
                both = _both_scales(scale, term_scale)
                routes.setdefault((pullbacks.k, id(before), id(both)), (pullbacks.k, before, both))
            routes = tuple(routes.values())
            together = family.pull(family if source is None else source, block, routes)
            pulled = [(key, together) for key in dict.fromkeys((i, after) for _, _, i, after, _ in terms)]
        for (i, after), cotangents in pulled:
            rows = cotangents[i] if after is None else _vmapped(after, cotangents[i])
            total = rows if total is None else lax.add(total, cast(rows, total.dtype))
    return total


def _both_scales(scale, term_scale):
    """The product of a partial's scale and a term's (either may be None), one array per pair while
    results are kept: the partials of all an equation's inputs then pull back the same rows."""
    if scale is None or term_scale is None:
        return term_scale if scale is None else scale
    return _kept(("both scales", id(scale), id(term_scale)), lambda: scale * term_scale, scale, term_scale)


def _by_family(joint: tuple) -> list:
    """The terms of ``joint`` as ``(family, terms)``: those whose rows one VJP of all their
    equation's outputs serves (:class:`OutputsPullback`; their routes, an output and the selection
    before it, times their inputs, each input with its map after) together, each other alone
    (family None)."""
    groups = {}
    for term in joint:
        family = getattr(term[0], "family", None)
        groups.setdefault(id(family) if family is not None else ("alone", len(groups)), (family, []))[1].append(term)
    result = []
    for family, terms in groups.values():
        routes = set((id(p), id(b), id(s)) for p, b, _, _, s in terms)
        inputs = set((i, id(a)) for _, _, i, a, _ in terms)
        pairs = set(((id(p), id(b), id(s)), (i, id(a))) for p, b, i, a, s in terms)
        if family is not None and len(routes) > 1 and len(pairs) == len(routes) * len(inputs) == len(terms):
            result.append((family, terms))
        else:
            result.extend((None, [term]) for term in terms)
    return result


def _joint_after(b: Linear, a_t: Callable) -> Optional[tuple]:
    """The joint of ``b o a`` for an opaque partial ``b`` with a joint (:attr:`Linear.joint`; ``b``'s scale
    stays the product's) after a linear map ``a`` whose transpose is ``a_t``: the same VJP, each
    term's cotangents then mapped through ``a_t``; None where ``b`` has none."""
    if b.joint is None:
        return None
    return tuple((pullbacks, before, i, a_t if after is None else (lambda c, after=after: a_t(after(c))), scale)
                 for pullbacks, before, i, after, scale in b.joint)


def _rows_through_index(b: Sparse, a: Linear, row_shape: tuple, dtype):
    """``b o a`` as rows ``row_shape`` (``b.unpair``'s) by ``a``'s input, for a Sparse ``b`` with paired
    axes after a selection ``a`` (each element of ``v`` is the element ``_index_of(a)`` of ``u``, times
    ``a.scale``; -1: zero). A row of ``b`` is non-zero only where ``v``'s paired axes are the row's own
    coordinates: its few entries are added at their ``u`` columns by one scatter (at a run-time
    index, every entry, those ``a`` selects nothing for dropped). Formed as ``b`` densified over all
    of ``v`` and that scattered column by column, a gather of 1,000 of 200 rows times a per-row 8x8
    block (graph message passing) was 64M entries and a 12.8M-column scatter."""
    n_v, nw = len(b.in_shape), len(b.out_shape)
    free = b.unpaired_in
    w = np.indices(row_shape).reshape(nw, _size(row_shape))  # (nw, rows)
    entries = tuple(b.in_shape[j] for j in free)
    c = np.indices(entries).reshape(len(free), _size(entries))  # (len(free), entries)
    paired = {j: k for k, j in enumerate(b.pairs) if j is not None}
    coords = [w[paired[j]][:, None] if j in paired else c[free.index(j)][None, :] for j in range(n_v)]
    v = np.ravel_multi_index(np.broadcast_arrays(*coords), b.in_shape)  # (rows, entries)
    index, n_in = _index_of(a), _size(a.in_shape)
    full = tuple(row_shape) + tuple(b.in_shape[j] for j in free)
    values = reshaped(_broadcast_to(cast(b.values(), dtype), full), v.shape)
    if a.has_scale:
        values = values * _take(reshaped(cast(jnp.broadcast_to(a.scale, a.out_shape), dtype), (_size(a.out_shape),)),
                                v, 0)
    row_of = np.broadcast_to(np.arange(v.shape[0])[:, None], v.shape).reshape(-1)
    if not isinstance(index, np.ndarray):
        if not v.size:
            return lax.full((v.shape[0], n_in), 0, dtype)
        targets = _take(reshaped(index, (_size(a.out_shape),)), v.reshape(-1), 0)
        return _scattered(row_of, targets, reshaped(values, (v.size,)), (v.shape[0], n_in), dtype)
    targets = index.reshape(-1)[v].reshape(-1)
    kept = np.flatnonzero(targets >= 0)
    if not len(kept):  # (also where b or a has no elements)
        return lax.full((v.shape[0], n_in), 0, dtype)
    updates = _take(reshaped(values, (v.size,)), kept, 0)
    return jnp.zeros((v.shape[0], n_in), dtype).at[row_of[kept], targets[kept]].add(updates)


def _scatter_columns(rows, index, n: int, shapes: Optional[tuple] = None):
    """``out[:, u] = sum of rows[:, v] over the v with index[v] == u`` (-1: dropped); ``out`` is ``(len(rows), n)``.
    A traced ``index`` (computed at run time) scatters every entry on its own: XLA:CPU moves a column
    window per index slowly (300 rows of 300 into 1024 columns: 1.5 ms; entry by entry 0.3 ms).
    ``shapes``, where given, are the shapes of ``v`` and ``u``: where ``index`` is a strided window
    (:func:`_window`, a slice or pad) or a few shifted boxes (:func:`_windows`), the columns are sliced
    and padded into place instead."""
    if not isinstance(index, np.ndarray):
        columns = lax.broadcast_in_dim(index, rows.shape, (1,))
        return _scattered(lax.broadcasted_iota(np.int32, rows.shape, 0), columns, rows, (rows.shape[0], n), rows.dtype)
    windows = None if shapes is None else _windows(index.reshape(shapes[0]), shapes[1])
    if windows is not None:
        return _windows_take(rows, windows, 1, transposed=True)
    picked = np.flatnonzero(index >= 0)
    targets = index[picked]
    if len(np.unique(targets)) == len(targets):  # each column read at most once: a gather
        source = np.full(n, -1)
        source[targets] = picked
        return _take_or_zero(rows, source, axis=1)
    return jnp.zeros((rows.shape[0], n), rows.dtype).at[:, targets].add(rows[:, picked])


def _window(index: np.ndarray, src_shape: tuple) -> Optional[tuple]:
    """A selection's ``index`` (in the destination's shape: per element, the flat index of the element
    of ``src_shape`` it copies, -1 for none) as a strided window of the same rank, where it is one:
    per axis ``(dst_start, dst_step, src_start, src_step, count)``, destination coordinates
    ``dst_start + dst_step * i`` copying source coordinates ``src_start + src_step * i`` for
    ``i < count``, every other destination element zero. That is a strided slice followed by a pad
    with interior padding (``x[a:b:s]``, ``jnp.pad``, ``lax.pad``, and each one's transpose), which
    XLA fuses as such, where a gather by ``index`` is a gather. None where ``index`` is not of that form."""
    nd = index.ndim
    if nd != len(src_shape) or not index.size:
        return None
    valid = index >= 0
    runs = []
    for k in range(nd):
        at = np.flatnonzero(valid.any(axis=tuple(a for a in range(nd) if a != k)))
        if not len(at):
            return None
        step = int(at[1] - at[0]) if len(at) > 1 else 1
        if not np.array_equal(at, at[0] + step * np.arange(len(at))):
            return None
        runs.append((int(at[0]), step, len(at)))
    inner = index[tuple(slice(s, s + step * (n - 1) + 1, step) for s, step, n in runs)]
    if int(np.count_nonzero(valid)) != inner.size or not (inner >= 0).all():
        return None
    coords = _unravel(inner.reshape(-1), src_shape)  # (0-d: no coordinates, the empty window: a copy)
    window = []
    for k, (start, step, n) in enumerate(runs):
        c = coords[k].reshape(inner.shape)
        first = int(c.flat[0])
        src_step = int(np.take(c, 1, axis=k).flat[0]) - first if n > 1 else 1
        if src_step <= 0 or not (c == first + src_step * np.arange(n).reshape((-1,) + (1,) * (nd - 1 - k))).all():
            return None
        window.append((start, step, first, src_step, n))
    return tuple(window)


def _inverse_window(window: tuple) -> tuple:
    """The window of the transposed selection: source and destination swapped."""
    return tuple((src, src_step, dst, dst_step, n) for dst, dst_step, src, src_step, n in window)


#: an index that is at most this many shifted boxes (:func:`_windows`) is taken as their slices
#: padded into place and added, not by a ``gather``: XLA:CPU fuses a gather with the chain of slices
#: and pads before it and recomputes that chain for every element it reads, so a dense 2-D block
#: taken through ``jnp.pad(u[1:-1, 1:-1], 1)`` (rows 10 runs apart) step after step cost 0.4-0.6 ms
#: per kernel in 8 steps of a 12x12 diffusion (forward order)
MAX_WINDOWS = 4


def _windows(index: np.ndarray, src_shape: tuple) -> Optional[tuple]:
    """A selection's ``index`` (as :func:`_window`'s) as a few windows with disjoint destinations:
    :func:`_window`'s one strided window where it is one, else at most :data:`MAX_WINDOWS` boxes of
    destination elements that each copy a box of the source shifted by one offset (``jnp.roll`` on
    a grid axis is two; a 2-D stencil's shift cut at the grid's edges, one). Returned as
    ``(src_grid, dst_grid, windows)``, the windows in the grid shapes they were found in
    (:func:`_grids`); None where there are none."""
    for src_grid, dst_grid in _grids(tuple(src_shape), tuple(index.shape)):
        windows = _boxes(index.reshape(dst_grid), src_grid)
        if windows is not None:
            return src_grid, dst_grid, windows
    return None


def _grids(src_shape: tuple, dst_shape: tuple) -> list:
    """The shapes of the same rank :func:`_windows` tries to see a selection's source and destination
    in: themselves; equal-sized shapes of different ranks (a flat vector made a grid) both as the one
    of more axes; where one has one axis fewer (a row written into a grid), it with a unit axis put
    in at each place."""
    if len(src_shape) == len(dst_shape):
        return [(src_shape, dst_shape)]
    if _size(src_shape) == _size(dst_shape):
        grid = max(src_shape, dst_shape, key=len)
        return [(grid, grid)]
    if abs(len(src_shape) - len(dst_shape)) != 1:
        return []
    unit = lambda shape: [shape[:k] + (1,) + shape[k:] for k in range(len(shape) + 1)]  # noqa: E731
    if len(src_shape) < len(dst_shape):
        return [(grid, dst_shape) for grid in unit(src_shape)]
    return [(src_shape, grid) for grid in unit(dst_shape)]


def _boxes(index: np.ndarray, src_shape: tuple) -> Optional[tuple]:
    """:func:`_windows` in the given grid shapes: ``index`` of the destination's, ``src_shape``."""
    window = _window(index, src_shape)
    if window is not None:
        return (window,)
    if not index.ndim or not (index >= 0).any():
        return None
    at = np.argwhere(index >= 0)  # (destination elements, axes), row-major
    offsets = np.stack(np.unravel_index(index[tuple(at.T)], src_shape), axis=1) - at
    keys, group = np.unique(offsets, axis=0, return_inverse=True)
    if len(keys) > MAX_WINDOWS:
        return None
    windows = []
    for k, offset in enumerate(keys):
        box = at[group.reshape(-1) == k]
        low, high = box.min(axis=0), box.max(axis=0)
        if len(box) != np.prod(high - low + 1):  # (elements are distinct: a full box has its volume)
            return None
        windows.append(tuple((int(lo), 1, int(lo + o), 1, int(hi - lo + 1)) for lo, hi, o in zip(low, high, offset)))
    return tuple(windows)


def _windows_take(x, found: tuple, axis: int, transposed: bool = False):
    """``x`` with its ``axis`` (the flattened source) replaced by the flattened destination, taken
    through :func:`_windows`' ``found`` windows (destination to source where ``transposed``): each
    window's slice padded into place, added up (disjoint destinations: each element is one
    window's or zero; a transposed selection's overlap and add up as its scatter does)."""
    src_grid, dst_grid, windows = found
    if transposed:
        src_grid, dst_grid, windows = dst_grid, src_grid, [_inverse_window(w) for w in windows]
    return functools.reduce(lax.add, [_window_take(x, w, axis, src_grid, dst_grid) for w in windows])


def _window_take(x, window: tuple, axis: int, src_shape: tuple, dst_shape: tuple):
    """``x`` with its ``axis`` (the flattened ``src_shape``) replaced by the flattened ``dst_shape``,
    taken through the strided ``window`` (:func:`_window`): one slice and one pad."""
    lead, rest = tuple(x.shape[:axis]), tuple(x.shape[axis + 1:])
    v = reshaped(x, lead + tuple(src_shape) + rest)
    whole = [(0, n, 1) for n in lead]
    cut = whole + [(src, src + src_step * (n - 1) + 1, src_step) for _, _, src, src_step, n in window]
    cut += [(0, n, 1) for n in rest]
    if cut != [(0, n, 1) for n in v.shape]:
        v = lax.slice(v, *zip(*cut))
    config = [(0, 0, 0)] * len(lead) + [(dst, size - dst - dst_step * (n - 1) - 1, dst_step - 1)
                                        for (dst, dst_step, _, _, n), size in zip(window, dst_shape)]
    config += [(0, 0, 0)] * len(rest)
    if any(c != (0, 0, 0) for c in config):
        v = lax.pad(v, lax.full((), 0, v.dtype), config)
    return reshaped(v, lead + (_size(dst_shape),) + rest)


def _take_or_zero(x, index: np.ndarray, axis: int, shapes: Optional[tuple] = None):
    """``x`` taken at the NumPy ``index`` along ``axis``, zero where ``index`` is -1: slices and
    zeros concatenated where ``index`` is at most :data:`MAX_RUNS` runs, else a ``gather`` and a
    ``select``. ``shapes``, where given, are the shapes ``(src, dst)`` of ``x``'s axis and of
    ``index``'s elements: where ``index`` is a few windows in them (:func:`_windows`), their slices
    padded into place."""
    shape = x.shape[:axis] + index.shape + x.shape[axis + 1:]
    if not (index >= 0).any():
        return lax.full(shape, 0, x.dtype)
    runs = _runs(index.reshape(-1), MAX_RUNS)
    if runs is not None:
        return reshaped(_concatenated_runs(x, runs, axis), shape)
    windows = None if shapes is None else _windows(index.reshape(shapes[1]), shapes[0])
    if windows is not None:
        return reshaped(_windows_take(x, windows, axis), shape)
    taken = _take(x, np.maximum(index, 0), axis)
    if (index >= 0).all():
        return taken
    return _zero_unless((index >= 0).reshape(index.shape + (1,) * (x.ndim - 1 - axis)), taken)


def _take(x, index, axis: int):
    """``jnp.take(x, index, axis)`` for an ``index`` within range, by ``lax``: a strided slice where
    a NumPy index is an increasing even run, slices concatenated where it is at most
    :data:`MAX_RUNS` runs, else one ``gather`` (``jnp.take`` traces a nested jit and wraps negative
    indices, several equations a Jacobian may need hundreds of times)."""
    shape = x.shape[:axis] + index.shape + x.shape[axis + 1:]
    flat = index.reshape(-1) if isinstance(index, np.ndarray) else np.zeros(0, int)  # (traced: a gather)
    step = int(flat[1] - flat[0]) if len(flat) > 1 else 1
    if len(flat) and step > 0 and np.array_equal(flat, flat[0] + step * np.arange(len(flat))):
        if len(flat) == x.shape[axis] and index.ndim == 1:
            return x
        run = lax.slice_in_dim(x, int(flat[0]), int(flat[-1]) + 1, step, axis)
        return reshaped(run, shape)
    runs = _runs(flat, MAX_RUNS) if len(flat) else None
    if runs is not None:
        return reshaped(_concatenated_runs(x, runs, axis), shape)
    offset_dims = tuple(range(axis)) + tuple(range(axis + index.ndim, len(shape)))
    dims = lax.GatherDimensionNumbers(offset_dims=offset_dims, collapsed_slice_dims=(axis,), start_index_map=(axis,))
    return lax.gather(x, index.astype(np.int32)[..., None], dims, x.shape[:axis] + (1,) + x.shape[axis + 1:],
                      mode=lax.GatherScatterMode.PROMISE_IN_BOUNDS)


#: a NumPy index of at most this many runs (:func:`_runs`) is taken as their slices concatenated,
#: not as a ``gather`` (and its -1 as zeros, not a ``select``): XLA simplifies a slice of a
#: concatenation, not of a gather, so a chain of small blocks (a stack of scalars, then their
#: slices) stays one value each instead of being recomputed in every consumer
MAX_RUNS = 8


def _runs(flat: np.ndarray, limit: int) -> Optional[list]:
    """The 1-D NumPy index ``flat`` (-1: zero) as runs ``(first, step, length)``: consecutive elements
    (step 1), one element repeated (step 0), or zeros (``first`` -1, step 0); None where they are
    more than ``limit``. Cut greedily from the left: a run goes on while its step does."""
    steps = np.diff(flat)
    if np.count_nonzero((steps != 0) & (steps != 1)) >= limit:  # (each such step starts a run)
        return None
    ends = {0: np.flatnonzero(steps != 0), 1: np.flatnonzero(steps != 1)}  # where a run of each step stops
    runs, start, n = [], 0, len(flat)
    while start < n:
        if len(runs) == limit:
            return None
        first = int(flat[start])
        step = int(steps[start]) if start < n - 1 else -1
        last = start
        if step == 0 or (step == 1 and first >= 0):
            stops = ends[step]
            k = int(np.searchsorted(stops, start))
            last = int(stops[k]) if k < len(stops) else n - 1
        runs.append((first, step if last > start else 1, last - start + 1))
        start = last + 1
    return runs


def _concatenated_runs(x, runs, axis: int):
    """``x`` taken along ``axis`` at the :func:`_runs` ``runs``, as slices (and zeros) concatenated."""
    pieces = []
    for first, step, length in runs:
        piece_shape = x.shape[:axis] + (length,) + x.shape[axis + 1:]
        if first < 0:
            pieces.append(lax.full(piece_shape, 0, x.dtype))
        elif step == 1 or length == 1:
            pieces.append(lax.slice_in_dim(x, first, first + length, 1, axis))
        else:
            one = lax.slice_in_dim(x, first, first + 1, 1, axis)
            pieces.append(lax.broadcast_in_dim(one, piece_shape, tuple(range(x.ndim))))
    return pieces[0] if len(pieces) == 1 else lax.concatenate(pieces, axis)


def _broadcast_to(v, shape):
    """``v`` broadcast NumPy-style (trailing axes aligned) to ``shape`` by ``lax`` (``v`` itself when it has it)."""
    shape = tuple(shape)
    if np.shape(v) == shape:
        return v
    return lax.broadcast_in_dim(v, shape, tuple(range(len(shape) - np.ndim(v), len(shape))))


def _zero_unless(mask, x):
    """``x`` where ``mask`` holds, zero elsewhere, both broadcast NumPy-style to their common shape: a
    select, so an infinite or NaN ``x`` off the mask stays out (``jnp.where`` would trace a nested jit)."""
    x = jnp.asarray(x)
    shape = np.broadcast_shapes(np.shape(mask), x.shape)
    x = _broadcast_to(x, shape)
    return lax.select(_broadcast_to(mask, shape), x, lax.full(shape, 0, x.dtype))


def _unravel(index, shape) -> tuple:
    """``np.unravel_index(index, shape)`` for a non-negative ``index``, NumPy or traced (by ``lax``)."""
    if isinstance(index, np.ndarray):
        return np.unravel_index(index, shape) if shape else ()  # (NumPy takes no 0-d shape)
    return tuple(lax.rem(lax.div(index, np.int32(math.prod(shape[k + 1:]))), np.int32(n)) for k, n in enumerate(shape))


def _rows_at(a: Sparse, index, dtype, index_shape: Optional[tuple] = None):
    """The rows of ``a`` at its flattened output elements ``index`` (-1: a row of zeros; NumPy, or
    traced where computed at run time), dense over its input as ``a.unpair`` of every output axis
    stores them (size 1 along an unpaired input axis its values are constant on):
    ``(len(index),) + columns``. Taken from the stored values and the pairing: ``a`` densified over
    all its rows (a selection of 1,600 of 8,000 rows of a per-row 8x8 block, graph message passing)
    was a 64M-entry array and a gather from it. ``index_shape``, where given, is the shape ``index``
    is flat in (see :func:`_take_or_zero`'s ``shapes``)."""
    nout, n_in = len(a.out_shape), len(a.in_shape)
    columns = a.dense_val_shape[nout:]
    known = isinstance(index, np.ndarray)
    if not _size(a.out_shape) or (known and not (index >= 0).any()):  # no row is taken
        return lax.full((len(index),) + columns, 0, dtype)
    paired = {j: k for k, j in enumerate(a.pairs) if j is not None}
    stored = a.val_shape[:nout]
    coords = _unravel(np.maximum(index, 0) if known else lax.max(index, np.int32(0)), a.out_shape)
    at = sum((c * math.prod(stored[k + 1:]) for k, c in enumerate(coords) if stored[k] > 1), 0 * index)
    values = reshaped(cast(a.values(), dtype), (_size(stored),) + tuple(a.val_shape[nout:]))
    if known:  # (zero rows written as such)
        grids = (tuple(a.out_shape), tuple(index_shape)) if index_shape is not None and stored == a.out_shape else None
        rows, keep = _take_or_zero(values, np.where(index >= 0, at, -1), 0, grids), None
    else:
        rows, keep = _take(values, at, 0), (index >= 0).reshape((-1,) + (1,) * n_in)
    rows = reshaped(rows, (len(index),) + tuple(1 if j in paired else columns[j] for j in range(n_in)))
    for j, k in paired.items():  # a paired input element is the row's own output coordinate
        axis = [1] * (1 + n_in)
        axis[1 + j] = a.in_shape[j]
        own = coords[k].astype(np.int32).reshape((-1,) + (1,) * n_in)
        hit = lax.broadcasted_iota(np.int32, tuple(axis), 1 + j) == own
        keep = hit if keep is None else keep & hit
    rows = _broadcast_to(rows, (len(index),) + columns)
    return rows if keep is None else _zero_unless(keep, rows)


def _linear_after_sparse(b: Linear, a: Sparse) -> tuple[Partial, Cost]:
    """``b o a``: a Sparse ``a: u -> v`` followed by a Linear ``b: v -> w``."""
    dtype = np.dtype(_result_dtype(a, b))
    if a.is_permuted_diag:
        # a(t) = val * transpose(t)
        push = not a.unit and b.selection
        embed = not a.unit and not b.selection
        cost = Cost(_size(b.out_shape) if push and b.has_scale else 0, 0)
        flops = b.flops + (_size(a.out_shape) if embed else 0)
        index = None if embed else _transposed_index(b.index, a.in_shape, a.pairs)
        result = Linear(b.out_shape, a.in_shape, dtype, has_scale=b.has_scale or push,
                        selection=b.selection and not embed, flops=flops, opaque=b.opaque, index=index)
        if a.abstract or b.abstract:
            return result, cost
        tr, untr = _transposer(a.pairs), _untransposer(a.pairs)
        fb = b.forward()  # (derived here, in the trace b was made in, where only fn_t is known)
        transposable = _transposable(b)
        if embed:
            fn = lambda t: b.forward()(a.val * tr(t))  # noqa: E731
            a_t = lambda c: untr(a.val * c)  # noqa: E731
        else:
            fn = lambda t: b.forward()(tr(t))  # noqa: E731
            a_t = untr
        fn_t = (lambda c: a_t(b.backward()(c))) if transposable else None
        joint = _joint_after(b, a_t)
        scale = b.scale
        if push:
            pushed = fb(jnp.broadcast_to(a.val, a.out_shape).astype(b.dtype))
            scale = pushed * b.scale if b.has_scale else pushed
        calls = ((b, None if not embed and a.pairs == tuple(range(len(a.pairs))) else object(), None),)
        traced_index = None
        if not embed and b.traced_index is not None:
            traced_index = lambda: _transposed_index(_index_of(b), a.in_shape, a.pairs)  # noqa: E731
        return _zero_where_unselected(replace(result, fn=fn, fn_t=fn_t, scale=scale, depth=_nesting(calls, dtype),
                                              calls=calls, joint=joint, traced_index=traced_index)), cost
    # general: columns of a (dense over v) pushed through b
    nv = len(a.out_shape)
    col_shape = a.dense_val_shape[nv:]
    n_cols = _size(col_shape)
    cost = Cost(n_cols * (b.flops + (_size(b.out_shape) if b.has_scale else 0)), 0)
    val_shape = tuple(b.out_shape) + tuple(col_shape)
    result = Sparse(b.out_shape, a.in_shape, (None,) * len(b.out_shape), val_shape, dtype)
    if b.abstract or a.abstract:
        return result, cost
    if b.selection:
        index = _index_of(b)
        val = cast(reshaped(_rows_at(a, reshaped(index, (_size(b.out_shape),)), dtype, b.out_shape), val_shape), dtype)
        if b.has_scale:
            val = val * reshaped(jnp.broadcast_to(b.scale, b.out_shape), tuple(b.out_shape) + (1,) * len(col_shape))
        elif isinstance(index, np.ndarray) and (index < 0).any():
            _mark_zero_off(val, 0, index.reshape(b.out_shape) >= 0)
        return replace(result, val=val), cost
    block = jnp.broadcast_to(a.unpair(range(nv)).values(), tuple(a.out_shape) + tuple(col_shape))
    block = jnp.moveaxis(block.reshape(tuple(a.out_shape) + (n_cols,)), -1, 0)
    pushed = _vmapped(b.apply, cast(block, b.dtype))  # (n_cols,) + w
    val = reshaped(jnp.moveaxis(pushed, 0, -1), val_shape)
    return replace(result, val=cast(val, dtype)), cost


# --------------------------------------------------------------------------------------------
# Sums


def add(x: Partial, y: Partial) -> tuple[Partial, Cost]:
    """The sum of two partials of the same edge, at their cheapest common structure."""
    dtype = promoted(x.dtype, y.dtype)
    if selects_nothing(y) and x.dtype == dtype:
        return x, Cost()
    if selects_nothing(x) and y.dtype == dtype:
        return y, Cost()
    total, cost = _sum(x, y)
    return _bounded(total), cost


def _sum(x: Partial, y: Partial) -> tuple[Partial, Cost]:
    assert x.shape == y.shape, (x.shape, y.shape)
    if isinstance(x, Linear) and isinstance(y, Linear):
        return _linear_add(x, y)
    as_parts = _diagonals_as_parts(x, y)
    if as_parts is not None:
        return as_parts
    if isinstance(x, Linear):
        x = linear_to_sparse(x)
    if isinstance(y, Linear):
        y = linear_to_sparse(y)
    return _sparse_add(x, y)


def linear_to_sparse(x: Linear) -> Sparse:
    """Materialise a Linear partial as a dense Sparse."""
    result = Sparse(x.out_shape, x.in_shape, (None,) * len(x.out_shape), x.shape, x.dtype)
    if x.abstract:
        return result
    return replace(result, val=x.to_dense())


def _sparse_add(x: Sparse, y: Sparse) -> tuple[Sparse, Cost]:
    result, cost = _sum_plan(x.key, y.key)
    if x.abstract or y.abstract:
        return result, cost
    unpaired = [k for k, p in enumerate(result.pairs) if p is None]
    x, y = x.unpair(unpaired), y.unpair(unpaired)
    dtype = result.dtype
    xv, yv = (cast(v, dtype) for v in (x.values(), y.values()))
    live = None  # (exact zeros where neither term is live)
    if x.live is not None and y.live is not None:
        live = _broadcast_to(_broadcasting(lax.bitwise_or, x.live, y.live), result.val_shape)
    if x.live is None and y.live is None:
        merged = _disjoint_sum(xv, yv)
        if merged is not None:
            return replace(result, val=merged), cost
    return replace(result, val=_broadcasting(lax.add, xv, yv), live=live), cost


class ValueNotes:
    """Facts about traced arrays, recorded while a Jacobian is traced and looked up later by the
    array itself: kept by id and weakly, so that an entry goes with its array and an id a new array
    reuses finds nothing."""

    def __init__(self):
        self._entries: dict = {}

    def record(self, v, fact) -> None:
        key = id(v)
        self._entries[key] = (weakref.ref(v, lambda _, key=key: self._entries.pop(key, None)), fact)

    def of(self, v):
        """The fact recorded for ``v``, or None."""
        entry = self._entries.get(id(v))
        return None if entry is None or entry[0]() is not v else entry[1]


#: arrays known while tracing to be exactly zero off a block of their axes: (first axis of the
#: block, booleans of the block's shape, False where the array is zero)
_ZERO_OFF = ValueNotes()


def _mark_zero_off(v, start: int, live: np.ndarray) -> None:
    """Record that the traced ``v`` is exactly zero wherever the NumPy booleans ``live``, laid over
    ``v``'s axes from ``start`` on (rows: 0; columns of a partial's values: its number of output
    axes), are False: rows of a selection that selects nothing there, columns scattered to nowhere."""
    _ZERO_OFF.record(v, (start, live))


def _zero_off(v) -> Optional[tuple]:
    """``(start, live)`` as :func:`_mark_zero_off` recorded them for ``v``, or None."""
    return _ZERO_OFF.of(v)


def _disjoint_sum(x, y):
    """``x + y`` without an addition where no element is non-zero in both (:func:`_mark_zero_off`,
    along the same axes): the blocks of each concatenated, so that the rows of a stack of scalars,
    each made by its own product, become one array as ``jnp.stack`` makes it, not a sum of padded
    blocks; None where that is not known or takes more than :data:`MAX_RUNS` slices."""
    xz, yz = _zero_off(x), _zero_off(y)
    if xz is None or yz is None or x.shape != y.shape or xz[0] != yz[0] or xz[1].shape != yz[1].shape:
        return None
    (start, x_live), (_, y_live) = xz, yz
    n = x_live.size
    if not n or x_live.shape != x.shape[start:start + x_live.ndim] or (x_live & y_live).any():
        return None
    source = np.where(x_live.reshape(-1), np.arange(n), np.where(y_live.reshape(-1), n + np.arange(n), -1))
    runs = _runs(source, MAX_RUNS)
    if runs is None:
        return None
    flat = lambda v: reshaped(v, (_size(v.shape[:start]), n, _size(v.shape[start + x_live.ndim:])))  # noqa: E731
    total = reshaped(_concatenated_runs(lax.concatenate([flat(x), flat(y)], 1), runs, 1), x.shape)
    _mark_zero_off(total, start, x_live | y_live)
    return total


@functools.lru_cache(maxsize=1 << 16)
def _sum_plan(x_key: tuple, y_key: tuple) -> tuple:
    """The structure (a plan) and cost of the sum of two Sparse partials, from their keys."""
    x, y = Sparse(*x_key[:-1], False), Sparse(*y_key[:-1], False)  # structure only, no values
    common = tuple(p if p == q else None for p, q in zip(x.pairs, y.pairs))
    x = x.unpair([k for k, p in enumerate(common) if p is None])
    y = y.unpair([k for k, p in enumerate(common) if p is None])
    val_shape = _broadcast_shape(x.val_shape, y.val_shape)
    return Sparse(x.out_shape, x.in_shape, common, val_shape, np.dtype(_result_dtype(x, y))), Cost(0, _size(val_shape))


def _linear_add(x: Linear, y: Linear) -> tuple[Linear, Cost]:
    n_out = _size(x.out_shape)
    dtype = np.dtype(_result_dtype(x, y))
    cost = Cost(0, n_out)
    xs, ys = _terms(x), _terms(y)
    if xs and ys:
        scales = None
        if x.stacked is not None or y.stacked is not None:  # the parts' scales as they are stacked
            scales = lambda: jnp.concatenate([_stacked_scales(x, xs, dtype), _stacked_scales(y, ys, dtype)])  # noqa: E731
        summed = _summed_terms(xs + ys, dtype, scales)
        if summed is not None:
            return summed, cost
        return _dense_sum(xs + ys, dtype), cost  # too many parts to keep
    result = Linear(x.out_shape, x.in_shape, dtype, selection=False,
                    flops=x.flops + y.flops + (n_out if x.has_scale else 0) + (n_out if y.has_scale else 0),
                    opaque=x.opaque or y.opaque)
    if x.abstract or y.abstract:
        return result, cost
    x.forward(), y.forward()  # derived, where they are, in the trace x and y were made in
    fn = lambda t: x.apply(t) + y.apply(t)  # noqa: E731
    fn_t = (lambda c: x.apply_t(c) + y.apply_t(c)) if _transposable(x) and _transposable(y) else None  # noqa: E731
    calls = _summed_calls((x, y))
    joint = None  # the terms of both (an input an equation reads twice: one VJP serves both)
    if x.joint is not None and y.joint is not None:  # (each partial's scale moved into its terms)
        joint = tuple((p, b, i, a, _both_scales(part.scale if part.has_scale else None, s))
                      for part in (x, y) for p, b, i, a, s in part.joint)
    return replace(result, fn=fn, fn_t=fn_t, depth=_nesting(calls, dtype), calls=calls, joint=joint), cost


def _summed_calls(terms) -> tuple:
    """:attr:`Linear.calls` of the sum of ``terms``: each applied forward to the sum's argument, and
    backward to it times the term's scale (one product per scale, see :func:`_scaled`)."""
    return tuple((t, None, t.scale if t.has_scale else None) for t in terms)


def _full_scale(part: Linear, dtype):
    """A scaled selection's scale at every output element (ones where it has none)."""
    return cast(jnp.broadcast_to(part.scale if part.has_scale else jnp.ones((), dtype), part.out_shape), dtype)


# --------------------------------------------------------------------------------------------
# Sums of scaled selections

#: A sum of scaled selections that needs at most this many (as few as its output elements have
#: entries, see ``_fewest_selections``), or more but fewer than a quarter of its input elements,
#: keeps them as its parts; one that needs more is formed dense (it then stores at most four times
#: as many values as its parts would). Applied lazily instead, as any sum of linear maps, such sums
#: compose functions instead of multiplying values: ten explicit steps of a 1000-point periodic
#: stencil (21 shifts) took 280 ms in forward order with a limit of 16, where ``jax.jit(jax.jacfwd)``
#: takes 59 ms (with 64: 3 to 5 ms); 33 steps on 100 points (67 shifts) compiled for 16 s.
MAX_PARTS = 64


#: A sum of scaled selections between few elements (at most 128 inputs and 128 outputs: the square
#: of the larger size n at most :data:`SMALL_MAP`) keeps at most :data:`SMALL_MAP_PARTS` parts, or
#: n / 16 where that is more, and is formed dense beyond: each part costs its own equations in every
#: product and sum, where the dense block is one array. Twenty steps of a nonlinear 1-D heat equation
#: on 64 points with a copied edge (bands of up to 41 shifts, cut at the edges) took 0.96 ms a call in
#: ``fwd`` and 0.80 ms in ``rev`` with up to :data:`MAX_PARTS` parts, first calls 8.6 and 7.3 s; dense
#: beyond 4 parts 0.05 and 0.11 ms, 0.9 and 1.1 s (``jax.jacfwd`` / ``jax.jacrev``: 0.07 and 0.11
#: ms, 0.65 s; one CPU). On 128 points, dense beyond 8 parts: ``fwd`` 1.41 -> 0.19 ms, ``rev`` 1.39
#: -> 0.33 ms, first calls 9.9 -> 2.1 s and 7.8 -> 1.7 s (``jax.jacfwd``: 0.18 ms, 0.6 s), but
#: ``markowitz`` 0.23 -> 0.30 ms; on 1-D Burgers (6 steps) all three faster, on a damped wave with
#: ``sin`` ``rev`` 1.2x slower; on 256 points dense beyond 16 parts made ``markowitz`` 1.4x slower
#: (4x beyond 8). Both sizes count: the few elements at the edge of a roll of many points (8 of 360)
#: meet many parts, and formed dense there, they made the whole band dense. Sums that wrap around (a
#: periodic stencil's rolls, :func:`_wraps`) keep their parts.
SMALL_MAP_PARTS = 4
SMALL_MAP = 1 << 14


def _small_map_part_limit(n: int) -> Optional[int]:
    """The most parts a sum of selections between at most ``n`` elements keeps before it is formed
    dense (see :data:`SMALL_MAP`), or None where it keeps up to :func:`_part_limit`."""
    return max(SMALL_MAP_PARTS, n // 16) if n * n <= SMALL_MAP else None


def _wraps(rows: np.ndarray, inputs: np.ndarray, out_shape: tuple, in_shape: tuple) -> bool:
    """Whether the entries ``(rows, inputs)`` (flat) of a sum of selections wrap around, as a periodic
    stencil's rolls do: some entry's input is more than half an axis away from its output element
    (along that axis where both shapes are one; else in flat position). Such sums on small maps keep
    their parts (:data:`SMALL_MAP`): formed dense, each step's block is sliced twice per roll, and
    XLA:CPU fuses the steps that made it, and their sines, into both slices, so every step recomputes
    the ones before it. Ten steps of a nonlinear wave on 64 periodic points (``sin`` in each step) took
    1.9 ms a call in ``fwd`` and 4.2 ms in ``rev`` dense, 0.59 and 0.30 ms as parts (``jax.jacfwd``:
    2.4 ms, ``jax.jacrev``: 7.0 ms; one CPU); first calls 1.9 and 2.7 s dense, 2.9 and 4.2 s as parts."""
    if tuple(out_shape) == tuple(in_shape):
        return any(bool(np.any(np.abs(i - r) > n // 2)) for r, i, n in
                   zip(np.unravel_index(rows, out_shape), np.unravel_index(inputs, in_shape), out_shape))
    return bool(np.any(np.abs(inputs - rows) > max(_size(out_shape), _size(in_shape)) // 2))


def _part_limit(n_in: int) -> int:
    """The most parts a sum of scaled selections from ``n_in`` input elements keeps (see :data:`MAX_PARTS`)."""
    return max(MAX_PARTS, n_in // 4)


#: A sum of scaled selections some of whose parts are taken by a ``gather`` (their indices neither
#: :data:`MAX_RUNS` runs nor :func:`_windows`) keeps at most this many parts, or a sixteenth of its
#: input elements where that is more, and is formed dense beyond. Every product and sum of such
#: parts gathers their entries, which XLA:CPU does element by element. Eight steps of diffusion on
#: a 12x12 grid (one CPU, 1e598b9 -> this limit; ``jax.jacfwd`` / ``jax.jacrev``): edges set to zero
#: (up to 41 parts of 144 inputs) rev 0.66 -> 0.28 ms, markowitz 0.27 -> 0.21 ms, compile 4.5 ->
#: 0.9 s (0.20 / 0.37 ms); ``jnp.pad`` edges fwd 1.26 -> 0.12 ms, rev 0.55 -> 0.12 ms (0.12 / 0.17);
#: periodic (``jnp.roll`` only) markowitz 0.38 -> 0.21 ms but fwd 0.92 -> 1.5 ms and rev 0.81 -> 3.5 ms
#: (5.1 / 8.6 ms): there XLA:CPU fuses the primal's eight steps (all cheap elementwise operations
#: and slices) into the kernel that scales the dense block, recomputing them for each of its
#: 14,400 entries. Parts that are slices and pads (a periodic 1-D stencil's rolls) stay up to
#: :data:`MAX_PARTS`.
GATHERED_PARTS = 8


def _gathered_part_limit(n_in: int) -> int:
    return max(GATHERED_PARTS, n_in // 16)


def _sliced(index: np.ndarray, out_shape: tuple, in_shape: tuple) -> bool:
    """Whether a selection by ``index`` (flat) is taken by slices and pads, not a ``gather``
    (:func:`_take_or_zero`)."""
    return _pieces(index, out_shape, in_shape) is not None


def _pieces(index: np.ndarray, out_shape: tuple, in_shape: tuple) -> Optional[int]:
    """How many slices :func:`_take_or_zero` takes a selection by ``index`` (flat) as: its runs, or
    else its windows; None where it is a ``gather``."""
    runs = _runs(index, MAX_RUNS)
    if runs is not None:
        return len(runs)
    windows = _windows(index.reshape(out_shape), in_shape)
    return None if windows is None else len(windows[2])


def _has_parts(x: Partial) -> bool:
    return isinstance(x, Linear) and bool(x.parts)


def _terms(x: Linear) -> Optional[tuple]:
    """``x`` as a tuple of scaled selections that sum to it (its parts, or ``x`` itself), with indices
    known while tracing or computed at run time (:func:`_index_of`), or None."""
    if x.parts:
        return x.parts
    return (x,) if x.selection else None


def _selections(x: Linear) -> Optional[tuple]:
    """``x`` as a tuple of scaled selections with known indices that sum to it, or None."""
    terms = _terms(x)
    return terms if terms and all(t.index is not None for t in terms) else None


def _summed_terms(terms, dtype, scales_of_terms: Optional[Callable] = None) -> Optional[Linear]:
    """The sum of scaled selections: :func:`sum_of_selections` where every index is known; else,
    where some index is computed at run time, they themselves as its parts (one part per term: which
    entries they share is not known while tracing), or None where they are more than a sum keeps."""
    if all(t.index is not None for t in terms):
        return sum_of_selections(terms, dtype, scales_of_terms)
    if len(terms) > _part_limit(_size(terms[0].in_shape)):
        return None
    return _sum_of_parts(tuple(terms), dtype)


def sum_of_selections(terms, dtype, scales_of_terms: Optional[Callable] = None) -> Optional[Linear]:
    """The sum of scaled selections with known indices, re-cut into the fewest selections whose
    sum it is (:func:`_fewest_selections`; entries several terms share are added there, in one
    scatter): one selection, or a Linear with them as its parts; None if more remain than a sum
    keeps (:data:`MAX_PARTS`). ``scales_of_terms()``, where given, traces the full scales of
    ``terms``, flat, in order."""
    terms = list(terms)
    stacked = None
    if len(terms) > 1:
        cut = _fewest_selections(terms, dtype, scales_of_terms)
        if cut is None:
            return None
        terms, stacked = cut
    if len(terms) == 1:
        return terms[0]
    return _sum_of_parts(tuple(terms), dtype, stacked)


def _dense_sum(terms, dtype) -> Sparse:
    """The sum of scaled selections with known indices as a dense block, their entries scattered
    into it at once."""
    first = terms[0]
    result = Sparse(first.out_shape, first.in_shape, (None,) * len(first.out_shape), first.shape, np.dtype(dtype))
    if any(t.abstract for t in terms):
        return result
    return replace(result, val=_parts_to_dense(terms, first.shape, dtype))


def _sum_of_parts(parts: tuple, dtype, stacked=None) -> Linear:
    """The Linear that is the sum of ``parts`` (scaled selections with known indices), with their
    ``stacked`` scales where they were computed together."""
    n_out = _size(parts[0].out_shape)
    result = Linear(parts[0].out_shape, parts[0].in_shape, dtype, parts=parts,
                    flops=sum(p.flops + (n_out if p.has_scale else 0) for p in parts))
    if any(p.abstract for p in parts):
        return result
    fn = lambda t: functools.reduce(lax.add, [cast(p.apply(t), dtype) for p in parts])  # noqa: E731
    fn_t = lambda c: functools.reduce(lax.add, [cast(p.apply_t(c), dtype) for p in parts])  # noqa: E731
    calls = _summed_calls(parts)
    return replace(result, fn=fn, fn_t=fn_t, stacked=stacked, depth=_nesting(calls, dtype), calls=calls)


def selection_from_index(out_shape, in_shape, index: np.ndarray, dtype) -> Linear:
    """The selection ``J(t)[o] = t.flat[index[o]]`` (zero where ``index`` is -1) from its index
    array (of ``out_shape``)."""
    out_shape, in_shape = tuple(out_shape), tuple(in_shape)
    flat = index.reshape(-1)
    n_in = _size(in_shape)
    windows = functools.cache(lambda: _windows(index.reshape(out_shape), in_shape))  # (slices, pads: no gather)

    def fn(t):
        if windows() is not None and (len(windows()[2]) == 1 or _runs(flat, MAX_RUNS) is None):
            return _windows_take(jnp.reshape(t, (1, n_in)), windows(), 1).reshape(out_shape)
        return _take_or_zero(jnp.reshape(t, (n_in,)), flat, axis=0).reshape(out_shape)

    def fn_t(c):  # (the index checks here, not when the selection is made: most are never transposed)
        if windows() is not None:
            return _windows_take(jnp.reshape(c, (1, -1)), windows(), 1, transposed=True).reshape(in_shape)
        picked = np.flatnonzero(flat >= 0)
        unique = len(np.unique(flat[picked])) == len(picked)
        rows = jnp.reshape(c, (-1,))[picked]
        into = jnp.zeros(n_in, c.dtype).at[flat[picked]]
        return (into.set(rows, unique_indices=True) if unique else into.add(rows)).reshape(in_shape)

    return Linear(out_shape, in_shape, np.dtype(dtype), fn=fn, fn_t=fn_t, selection=True, index=index)


def _fewest_selections(terms, dtype, scales_of_terms: Optional[Callable] = None) -> Optional[tuple]:
    """Scaled selections with known indices (no two equal) re-cut into few whose sum is the same map,
    entries that several terms share added: one per offset where that is at most twice the fewest
    and each a few runs (:func:`_cut_by_offset`: a 1-D stencil's shifts); else the fewest, the
    k-th entry of each output element (ordered by input element) to the k-th selection, as many as
    any output element has entries (a band of shifts: its width, however the terms were cut, e.g.
    by ``jnp.roll``'s slices). Either is the same cut for the same pattern, so later sums merge them
    again. ``terms`` themselves where they are already the fewest; None if more are needed than a
    sum keeps (:data:`MAX_PARTS`, :data:`SMALL_MAP_PARTS`).
    Returns ``(selections, stacked)``, ``stacked`` their scales computed together (see
    :attr:`Linear.stacked`) or None. ``scales_of_terms()``: see :func:`sum_of_selections`."""
    out_shape, in_shape = terms[0].out_shape, terms[0].in_shape
    n_out, n_in = _size(out_shape), _size(in_shape)
    index = np.stack([t.index.reshape(-1) for t in terms])
    term, row = np.nonzero(index >= 0)
    entries, slot = np.unique(row * n_in + index[term, row], return_inverse=True)  # by row, then input
    entry_rows, entry_inputs = entries // n_in, entries % n_in
    rank = np.arange(len(entries)) - np.searchsorted(entry_rows, entry_rows)
    count = int(rank.max(initial=0)) + 1
    small = _small_map_part_limit(max(n_out, n_in))
    if count > _part_limit(n_in) or (small is not None and count > small
                                     and not _wraps(entry_rows, entry_inputs, out_shape, in_shape)):
        return None
    as_given = count >= len(terms) and len(entries) == len(term)  # as few already, no entry shared
    by_offset = False
    if as_given:
        cut = index
    else:
        part, cut = _cut_by_offset(entry_rows, entry_inputs, count, out_shape, in_shape)
        by_offset = cut is not None  # (its parts are each a few runs: sliced, no need to check them)
        if cut is None:
            part = rank
            cut = np.full((count, n_out), -1)
            cut[rank, entry_rows] = entry_inputs
    if not by_offset and len(cut) > _gathered_part_limit(n_in) \
            and not all(_sliced(c, out_shape, in_shape) for c in cut):
        return None
    if as_given:
        return list(terms), None
    count = len(cut)
    scaled = any(t.has_scale for t in terms) or len(entries) < len(term)
    if any(t.abstract for t in terms):  # their plans (no maps made: a Markowitz order costs many)
        return [Linear(out_shape, in_shape, np.dtype(dtype), has_scale=scaled, selection=True,
                       index=cut[k].reshape(out_shape)) for k in range(count)], None
    parts = [selection_from_index(out_shape, in_shape, cut[k].reshape(out_shape), dtype) for k in range(count)]
    if not scaled:
        return parts, None
    # each entry's scale into its place (part, row) of the stacked scales of the new selections
    scales = _concatenated_scales(terms, dtype) if scales_of_terms is None else cast(scales_of_terms(), dtype)
    stacked = _placed(scales, part[slot.reshape(-1)], row, term, count, n_out, dtype)
    scales = lax.split(stacked, (n_out,) * count)  # one equation, not a slice and a squeeze per part
    return [replace(p, has_scale=True, scale=reshaped(s, out_shape)) for s, p in zip(scales, parts)], stacked


def _cut_by_offset(rows: np.ndarray, inputs: np.ndarray, fewest: int, out_shape: tuple, in_shape: tuple) -> tuple:
    """The entries ``(rows, inputs)`` of a sum of selections cut into one selection per offset
    ``input - row`` (modulo the size where input and output have as many elements: a roll's entries
    are one offset): ``(part of each entry, index of each part)``, or ``(None, None)`` where that
    takes more than twice the ``fewest`` selections, some of them are more than a few runs
    (:func:`_runs`), or the scales are small (:data:`SLICED_SCALES`). A 1-D stencil's shifts stay
    one selection each, and their scales whole rows of the terms' (:func:`_placed`); cut by rank
    (:func:`_fewest_selections`) the k-th entries of a periodic or bounded band mix shifts from row
    to row. (On a 2-D grid a shift is a window, not runs; cut by offset there, 8 parts of 256 dense
    and fast became up to 61 windows, each sliced and padded: 5 steps of a 16x16 wave 1.5x slower.)"""
    n_out, n_in = _size(out_shape), _size(in_shape)
    if not len(rows) or fewest * n_out < SLICED_SCALES:
        return None, None
    offset = inputs - rows
    if n_in == n_out:
        offset = offset % n_in
    offsets, part = np.unique(offset, return_inverse=True)
    if len(offsets) > min(2 * fewest, _part_limit(n_in)):
        return None, None
    cut = np.full((len(offsets), n_out), -1)
    cut[part, rows] = inputs
    if not all(_runs(c, MAX_RUNS) is not None for c in cut):
        return None, None
    return part, cut


def _diag_as_selection(x: Sparse) -> Linear:
    """A permuted diagonal ``val * transpose(t)`` as a scaled selection."""
    index = np.transpose(np.arange(_size(x.in_shape)).reshape(x.in_shape), x.pairs)
    result = Linear(x.out_shape, x.in_shape, x.dtype, has_scale=not x.unit, selection=True, index=index)
    if x.abstract:
        return result
    scale = None if x.unit else jnp.broadcast_to(x.val, x.out_shape)
    return replace(result, fn=_transposer(x.pairs), fn_t=_untransposer(x.pairs), scale=scale)


def _diagonals_as_parts(x: Partial, y: Partial) -> Optional[tuple]:
    """``x + y`` as a sum of scaled selections where one is a (sum of) selection(s) and the other a
    permuted diagonal, or both are diagonals permuted differently (``x + x.T``), and those parts are
    smaller than the sum in its other form (dense); None otherwise."""
    def selections(z):
        if isinstance(z, Sparse):
            return (_diag_as_selection(z),) if z.is_permuted_diag else None
        return _terms(z)

    if isinstance(x, Sparse) and isinstance(y, Sparse):
        if x.pairs == y.pairs:
            return None
        other_form = _size(_sum_plan(x.key, y.key)[0].val_shape)
    else:
        other_form = _size(x.shape)  # a Linear plus a Sparse: the Linear densified
    xs, ys = selections(x), selections(y)
    n_out = _size(x.out_shape)
    if not xs or not ys or (len(xs) + len(ys)) * n_out >= other_form:
        return None
    summed = _summed_terms(xs + ys, np.dtype(_result_dtype(x, y)))
    return None if summed is None else (summed, Cost(0, n_out))


def _distributed(b: Partial, a: Partial) -> Optional[tuple]:
    """``b o a`` as the sum of the products of their parts, where one is a sum of scaled selections
    and the other a Sparse partial or (a sum of) scaled selections; None where the other is a lazily
    applied map (composing with the sum costs less than with each part). Between two Linears, only
    selections with known indices distribute: products of selections at run-time indices are not
    merged into fewer (:func:`_summed_terms`), so a chain of steps that each add several maps of the
    last (``sort(x) + roll(x) + roll(x, -1)``) would multiply its parts at every step."""
    def terms(x, other):
        if isinstance(x, Sparse):
            return (x,)
        return _terms(x) if isinstance(other, Sparse) else _selections(x)

    b_terms, a_terms = terms(b, a), terms(a, b)
    if b_terms is None or a_terms is None:
        return None
    selection_like = all(isinstance(t, Linear) or t.is_permuted_diag for t in b_terms + a_terms)
    concrete = not (selection_like and len(b_terms) * len(a_terms) > 1)
    # every pair's own product where it is traced below; else its plan (values at once below)
    products, total = _pair_products(b_terms, a_terms, planned=not concrete)
    adds = Cost(0, (len(products) - 1) * _size(b.out_shape))  # one addition per element per sum
    selections = [_selections(p) if isinstance(p, Linear) else None for p in products]
    if len(products) > 1 and all(selections):
        # merged at once, not one sum at a time (each re-cutting its parts): the same sum and count
        dtype = promoted(*[p.dtype for p in products])
        summed = sum_of_selections([s for some in selections for s in some], dtype)
        if summed is None:  # more parts than a sum keeps: every product's entries into one dense block
            if concrete or a.abstract or b.abstract:
                return _dense_sum([s for some in selections for s in some], dtype), total + adds
            row, entry, values, pairs = _pair_entries(b, a, b_terms, a_terms, dtype)
            if pairs is not None:  # (every pair's every output element: those of the entries)
                values = _take(reshaped(values, (_size(values.shape),)), pairs * _size(b.out_shape) + row, 0)
            dense = _scattered(row, entry, values, (_size(b.out_shape), _size(a.in_shape)), dtype)
            plan = _dense_sum([s.plan() for some in selections for s in some], dtype)
            return replace(plan, val=dense.reshape(plan.shape)), total + adds
        if concrete or a.abstract or b.abstract:
            return summed, total + adds
        valued = _selection_products(b, a, b_terms, a_terms, summed, dtype)
        if valued is not None:
            return valued, total + adds
    if not concrete:  # a structure the values at once do not fill: every pair's product traced
        products, total = _pair_products(b_terms, a_terms, planned=False)
    result = products[0]
    for product in products[1:]:
        result, cost = add(result, product)
        total += cost
    return result, total


def _pair_products(b_terms, a_terms, planned: bool) -> tuple:
    """``([tb o ta for every pair], their cost)``: the products' plans only where ``planned``."""
    total, products = Cost(), []
    for tb in b_terms:
        for ta in a_terms:
            product, cost = matmul(tb.plan(), ta.plan()) if planned else matmul(tb, ta)
            total += cost
            products.append(product)
    return products, total


def _as_selection(x: Partial) -> Linear:
    return _diag_as_selection(x) if isinstance(x, Sparse) else x


def _selection_products(b, a, b_terms, a_terms, summed: Linear, dtype) -> Optional[Linear]:
    """The values of ``summed``, the planned sum of the products of every pair of scaled selections
    (or permuted diagonals) ``b_terms[i] o a_terms[j]``, traced at once (:func:`_pair_entries`),
    then one scatter (or gather) into the parts of ``summed``. (Pair by pair, ten steps of a stencil
    of 21 shifts traced 3000 equations, and XLA:CPU compiled as many kernels.) None where
    ``summed``'s parts mix scaled and unscaled ones, or (never expected) where an entry of the
    products finds no place in them."""
    parts = summed.parts or (summed,)
    scaled = {p.has_scale for p in parts}
    if len(scaled) > 1:
        return None
    out_shape, in_shape = tuple(summed.out_shape), tuple(summed.in_shape)
    n_out, n_in = _size(out_shape), _size(in_shape)
    values, stacked = [], None
    if scaled == {True}:
        row, entry, scales, pairs = _pair_entries(b, a, b_terms, a_terms, dtype)
        if not len(row):
            return None
        # each entry's place: the first part of ``summed`` holding its (row, input) pair
        index = np.stack([p.index.reshape(-1) for p in parts])
        slot_part, slot_row = np.nonzero(index >= 0)
        slot_key = slot_row * n_in + index[slot_part, slot_row]
        by_key = np.argsort(slot_key, kind="stable")
        keys = row * n_in + entry
        found = np.searchsorted(slot_key[by_key], keys)
        if np.any(found >= len(by_key)) or not np.array_equal(slot_key[by_key][np.minimum(found, len(by_key) - 1)], keys):
            return None
        stacked = _placed(scales, slot_part[by_key][found], row, pairs, len(parts), n_out, dtype)
        values = lax.split(stacked, (n_out,) * len(parts)) if len(parts) > 1 else [stacked]
    built = []
    for k, p in enumerate(parts):  # each planned part with its map (and scale)
        selection = selection_from_index(out_shape, in_shape, p.index, dtype)
        built.append(replace(p, fn=selection.fn, fn_t=selection.fn_t,
                             scale=reshaped(values[k], out_shape) if values else None))
    return built[0] if len(built) == 1 else _sum_of_parts(tuple(built), dtype, stacked)


#: the scales of sums of selections with at least this many values (all parts together) are moved by
#: slices where they can be (:func:`_cut_by_offset`, :func:`_placed`, :func:`_pair_entries`): XLA:CPU
#: gathers element by element, and fuses the gather with the chain that made its operand. Four steps
#: of a 21-shift periodic stencil on 300 points (one CPU; all scales gathered -> this): fwd 4.9 ->
#: 2.6 ms, rev 6.3 -> 3.8 ms (its first call 24 -> 17 s). Smaller ones are gathered: one equation,
#: not a few slices and their concatenation (with no limit, 20 steps of 1-D diffusion on 64 points
#: staged 27,000 equations in Markowitz order instead of 14,000).
SLICED_SCALES = 1 << 12


#: the most terms one new selection's scale may be added up from for :func:`_placed` to take them
#: as whole rows
PLACED_LAYERS = 4


def _placed(values, part: np.ndarray, row: np.ndarray, term: Optional[np.ndarray], count: int, n_out: int, dtype):
    """The stacked scales ``(count * n_out,)`` of ``count`` new selections, entry ``e``'s value added
    at ``(part[e], row[e])``: ``values[term[e], row[e]]`` where ``term`` is given (``values`` of shape
    ``(terms, n_out)``, or flat), else ``values[e]``. An entry keeps its output element (row), so with
    ``term`` each selection's scale is the sum of a few terms' rows, masked where they select
    nothing for it: taken as whole rows, by slices (where every layer's rows are a few runs,
    :func:`_take_or_zero`), one layer per term a selection adds up (at most :data:`PLACED_LAYERS`),
    no element-wise ``gather`` or scatter; else entry by entry."""
    if not len(part):
        return lax.full((count * n_out,), 0, dtype)
    if term is not None:
        n_terms = _size(values.shape) // n_out
        pairs, of_pair = np.unique(part * n_terms + term, return_inverse=True)  # by part, then term
        pair_part, pair_term = pairs // n_terms, pairs % n_terms
        layer = np.arange(len(pairs)) - np.searchsorted(pair_part, pair_part)  # a part's k-th term
        picked = np.full((int(layer.max(initial=0)) + 1, count), -1)
        picked[layer, pair_part] = pair_term
        if (count * n_out >= SLICED_SCALES and len(picked) <= PLACED_LAYERS
                and all(_runs(picks, MAX_RUNS) is not None for picks in picked)):
            rows, stacked = reshaped(values, (n_terms, n_out)), None
            for k, picks in enumerate(picked):
                mask = np.zeros((count, n_out), bool)
                mine = layer[of_pair.reshape(-1)] == k
                mask[part[mine], row[mine]] = True
                taken = _take_or_zero(rows, picks, axis=0)
                if not mask[picks >= 0].all():
                    taken = _zero_unless(mask, taken)
                stacked = taken if stacked is None else stacked + taken
            return reshaped(stacked, (count * n_out,))
    values = reshaped(values, (_size(values.shape),))
    at = np.arange(len(part)) if term is None else term * n_out + row  # each entry's value in ``values``
    place = part * n_out + row
    if len(np.unique(place)) == len(place):  # every place filled once: a gather
        source = np.full(count * n_out, -1)
        source[place] = at
        return _take_or_zero(values, source, axis=0)
    return jnp.zeros(count * n_out, dtype).at[place].add(_take(values, at, axis=0))


#: the most slices (:func:`_pieces`) the selections of one side of a product of sums of selections
#: may take together for the other side's scales to be taken through them (:func:`_pair_entries`)
#: instead of by one ``gather``
PAIR_PIECES = 2 * MAX_RUNS


def _pair_entries(b, a, b_terms, a_terms, dtype) -> tuple:
    """The entries of the products of every pair of scaled selections (or permuted diagonals)
    ``b_terms[i] o a_terms[j]``: ``(rows, inputs, values, pairs)``, the flat output and input element
    of each, and the values, traced at once. A pair's values are ``b_terms[i]``'s scale
    times ``a_terms[j]``'s taken through ``b_terms[i]``'s selection. Where that is a few slices and
    pads for every ``i`` (a roll, a shift, a stencil's box; :data:`PAIR_PIECES` in all), or ``a_terms``
    have no scales, ``values`` is every pair's every output element, one row per pair ``(i, j)``
    (any value where the pair selects nothing), ``pairs`` each entry's pair ``i * len(a_terms) + j``,
    and no ``gather`` is traced (:data:`SLICED_SCALES` and up); else ``values`` is the entries'
    only, in order, ``pairs`` None: one gather of each side's stacked scales."""
    bs, as_ = [_as_selection(t) for t in b_terms], [_as_selection(t) for t in a_terms]
    out_shape, mid_shape = tuple(bs[0].out_shape), tuple(bs[0].in_shape)
    n_out, n_mid = _size(out_shape), _size(mid_shape)
    b_index = np.stack([t.index.reshape(-1) for t in bs])  # (k_b, n_out), into the middle
    a_index = np.stack([t.index.reshape(-1) for t in as_])  # (k_a, n_mid), into the input
    k_b, k_a = len(bs), len(as_)
    middle = np.broadcast_to(b_index[:, None, :], (k_b, k_a, n_out))
    entry = np.where(middle >= 0, a_index[np.arange(k_a)[None, :, None], np.maximum(middle, 0)], -1)
    entry = entry.reshape(k_b * k_a, n_out)  # per pair (i, j), as term i * k_a + j
    term, row = np.nonzero(entry >= 0)
    if not len(term):
        return row, entry[term, row], None, None
    b_scaled, a_scaled = any(t.has_scale for t in bs), any(t.has_scale for t in as_)
    sliced = not a_scaled  # (no scales of ``a`` to take)
    if a_scaled and k_b * k_a * n_out >= SLICED_SCALES:
        pieces = 0
        for i in b_index:
            pieces += _pieces(i, out_shape, mid_shape) or PAIR_PIECES + 1
            if pieces > PAIR_PIECES:
                break
        sliced = pieces <= PAIR_PIECES
    if sliced:
        every = (k_b * k_a, n_out)
        values = None
        if a_scaled:
            a_rows = reshaped(_stacked_scales(a, as_, dtype), (k_a, n_mid))
            taken = [_take_or_zero(a_rows, i, 1, (mid_shape, out_shape)) for i in b_index]
            values = taken[0] if k_b == 1 else lax.concatenate(taken, 0)
        if b_scaled:
            b_scales = _stacked_scales(b, bs, dtype)
            if k_a == 1:
                b_rows = reshaped(b_scales, every)
            elif k_b == 1:
                b_rows = lax.broadcast_in_dim(b_scales, every, (1,))
            else:
                b_rows = lax.broadcast_in_dim(reshaped(b_scales, (k_b, n_out)), (k_b, k_a, n_out), (0, 2))
                b_rows = reshaped(b_rows, every)
            values = b_rows if values is None else values * b_rows
        if values is None:
            values = lax.full(every, 1, dtype)
        return row, entry[term, row], values, term
    read = np.arange(k_a)[None, :, None] * n_mid + np.maximum(middle, 0)  # into stacked a scales
    flat_read = read.reshape(-1)[term * n_out + row]
    a_scales, b_scales = _stacked_scales(a, as_, dtype), _stacked_scales(b, bs, dtype)
    values = _take(a_scales, flat_read, axis=0) * _take(b_scales, (term // k_a) * n_out + row, axis=0)
    return row, entry[term, row], values, None


def _stacked_scales(x: Partial, terms, dtype):
    """The full scales of ``terms`` (``x``'s parts, or ``x`` as one selection), flat, in order."""
    if isinstance(x, Linear) and x.stacked is not None:
        return cast(x.stacked, dtype)
    return _concatenated_scales(terms, dtype)


def _concatenated_scales(terms, dtype):
    """The full scales of scaled selections ``terms`` (ones where one has none), flat, in order."""
    return jnp.concatenate([cast(_full_scale(t, dtype), dtype).reshape(-1) for t in terms])


def _parts_to_dense(parts, shape, dtype, stacked=None):
    """The dense block of a sum of scaled selections: their entries scattered into zeros (no
    output element reads the scales more than once), their scales read from ``stacked`` if given.
    Where some part's index is computed at run time (:func:`_index_of`), every part's entries go in,
    and those of output elements a part selects nothing for are dropped by the scatter."""
    n_out = _size(parts[0].out_shape)
    if stacked is None:
        stacked = _concatenated_scales(parts, dtype)
    if any(p.index is None for p in parts):
        index = jnp.concatenate([reshaped(jnp.asarray(_index_of(p), np.int32), (n_out,)) for p in parts])
        rows = np.tile(np.arange(n_out), len(parts))
        return _scattered(rows, index, stacked, (n_out, _size(parts[0].in_shape)), dtype).reshape(shape)
    index = np.stack([p.index.reshape(-1) for p in parts])
    part, row = np.nonzero(index >= 0)
    values = stacked if len(part) == index.size else _take(stacked, part * n_out + row, axis=0)
    return _scattered(row, index[part, row], values, (n_out, _size(parts[0].in_shape)), dtype).reshape(shape)


def _scattered(rows, inputs, values, shape: tuple, dtype):
    """Zeros of ``(n_out, n_in)`` ``shape`` with ``values`` added at ``(rows, inputs)`` (none if None).
    Where ``inputs`` is traced (an index computed at run time), an entry at input -1 is dropped."""
    dense = jnp.zeros(shape, dtype)
    if values is None or not dense.size:
        return dense
    if isinstance(inputs, np.ndarray):
        return dense.at[rows, inputs].add(cast(values, dtype), mode="promise_in_bounds")
    # one scatter-add, by lax: the .at[] form wraps negative indices, index arithmetic on every entry
    # (XLA counts it: a sort's partial densified over 4x40 entries passed XLA:CPU's 1000-flop line)
    inputs = cast(inputs, np.int32)
    inputs = lax.select(inputs >= 0, inputs, lax.full_like(inputs, shape[1]))  # (-1: out of bounds, dropped)
    rows = jnp.broadcast_to(jnp.asarray(rows, np.int32), inputs.shape)
    where = lax.concatenate([lax.expand_dims(rows, (rows.ndim,)), lax.expand_dims(inputs, (inputs.ndim,))], rows.ndim)
    numbers = lax.ScatterDimensionNumbers(update_window_dims=(), inserted_window_dims=(0, 1),
                                          scatter_dims_to_operand_dims=(0, 1))
    return lax.scatter_add(dense, where, cast(values, dtype), numbers, mode=lax.GatherScatterMode.FILL_OR_DROP)
