"""The computational graph of a jaxpr, with call primitives inlined, and its vertex numbering.

``flatten(closed_jaxpr)`` turns a (closed) jaxpr into a :class:`FlatProgram`: a straight list of
equations in which ``jit``, ``closed_call``, ``core_call`` and ``remat`` calls are replaced by their
bodies (recursively). Every value an equation defines is a *vertex*, numbered 1..N in definition
order; an equation with k results defines k consecutive vertices. Inputs and constants are not
vertices. This numbering is the one ``jaxtool show --vertices`` prints and the one elimination orders
(``jaxtool jac --order``) are written in; for single-result equations it equals the equation index of
the inlined jaxpr (graphax's numbering).

Each :class:`FlatEqn` remembers its ``path``: the equation indices that lead to it through the
nesting of the original jaxpr (``(3,)`` is the fourth top-level equation, ``(3, 0)`` the first
equation inside it), so printers can show vertex numbers on the original, nested jaxpr.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Optional, Union

import numpy as np

import jax
import jax.extend.core as jcore
import jax.numpy as jnp
from jax.extend.core import primitives as P

from jaxtool import partials

#: Call-like primitives whose body is inlined into the graph. ``remat2`` is ``jax.checkpoint``.
INLINED = frozenset(p.name for p in (P.jit_p, P.closed_call_p, P.call_p, P.remat_p))


@dataclass(frozen=True)
class Input:
    """The ``index``-th flat input of the program."""

    index: int


@dataclass(frozen=True)
class Const:
    """A constant: a literal, a closed-over array or a Python scalar."""

    value: Any


#: What an equation reads: a vertex number (int), an :class:`Input` or a :class:`Const`.
Atom = Union[int, Input, Const]


@dataclass(frozen=True)
class FlatEqn:
    """One equation of the inlined program."""

    primitive: Any  # jax.extend.core.Primitive
    params: dict
    invars: tuple  # tuple[Atom, ...]
    outvars: tuple  # tuple[int, ...]: vertex numbers (a dropped result ``_`` still gets one)
    source_info: Any
    path: tuple  # tuple[int, ...]
    callers: tuple = ()  # the source_info of each inlined call around it, innermost first
    #: the shardings :func:`bind` gives the operands (a PartitionSpec or None each), after which it
    #: replicates the results, or None (see :func:`replicated`)
    placed: Optional[tuple] = None

    @property
    def name(self) -> str:
        return self.primitive.name

    def user_source_info(self):
        """This equation's ``source_info`` if it has a user frame, else that of the innermost inlined
        call around it that has one (None if none has): JAX records no user frame for the equations of
        a library's nested ``jit`` (``jax.scipy.linalg.sqrtm``'s ``schur``, ``jnp.where``'s
        ``select_n``), but the call into the library has it."""
        from jaxtool.source import user_frame

        return next((info for info in (self.source_info,) + self.callers if user_frame(info) is not None), None)

    def location(self) -> str | None:
        """The user's ``file:line`` of this equation (see :meth:`user_source_info`)."""
        from jaxtool.source import location

        info = self.user_source_info()
        return None if info is None else location(info)


@dataclass
class FlatProgram:
    """A program in inlined form: inputs, equations, outputs, and the aval of every vertex."""

    in_avals: tuple
    eqns: list
    outvars: tuple  # tuple[Atom, ...]
    avals: dict = field(default_factory=dict)  # vertex number -> aval
    vertex_eqn: dict = field(default_factory=dict)  # vertex number -> index into eqns

    @property
    def num_vertices(self) -> int:
        return len(self.avals)

    def vertices_by_path(self) -> dict:
        """Map each equation path of the original (nested) jaxpr to the vertex numbers it defines."""
        return {e.path: e.outvars for e in self.eqns}

    def aval(self, atom) -> Any:
        """The abstract value of an atom."""
        if isinstance(atom, Input):
            return self.in_avals[atom.index]
        if isinstance(atom, Const):
            return jax.typeof(atom.value)
        return self.avals[atom]


#: primitives that only place a value on devices (``jax.sharding.reshard``, ``mesh_cast``,
#: ``with_sharding_constraint``): copies for the engine, which computes on replicated values
PLACEMENTS = frozenset({"reshard", "mesh_cast", "sharding_constraint"})
#: equation parameters that ask for a sharded result (``dot_general(out_sharding=...)``, ``iota``'s
#: and ``broadcast_in_dim``'s ``sharding``): None for the engine
SHARDING_PARAMS = ("out_sharding", "sharding")


def explicitly_sharded(aval) -> bool:
    """Whether ``aval``'s type says how it is split over a mesh axis (``jax.sharding.AxisType.Explicit``)."""
    spec = getattr(getattr(aval, "sharding", None), "spec", None)
    return spec is not None and any(axis is not None for axis in spec)


def replicated(program: FlatProgram) -> FlatProgram:
    """``program`` as it computes on replicated values: :data:`PLACEMENTS` are copies and no
    equation asks for a sharded result. The elimination multiplies partials of values split over
    different axes (an ``n x n`` partial of two vectors split over one mesh axis would be split twice
    over it, which explicit sharding rejects); it computes them whole, as ``jax.jacrev`` of the
    same program under an ``Auto`` mesh lets XLA decide.

    Equations whose nested jaxprs are typed with shardings (``scan``, ``cond``) keep them: :func:`bind`
    gives their operands the shardings they were traced with, and replicates their results (and so
    JAX's AD of them)."""
    eqns = []
    for eqn in program.eqns:
        if eqn.name in PLACEMENTS:
            eqn = replace(eqn, primitive=P.copy_p, params={})
        elif any(eqn.params.get(k) is not None for k in SHARDING_PARAMS):
            eqn = replace(eqn, params={k: None if k in SHARDING_PARAMS else v for k, v in eqn.params.items()})
        elif any(explicitly_sharded(program.avals[v]) for v in eqn.outvars):
            specs = [program.aval(a).sharding.spec if explicitly_sharded(program.aval(a)) else None
                     for a in eqn.invars]
            eqn = replace(eqn, placed=tuple(specs))
        eqns.append(eqn)
    return replace(program, eqns=eqns)


def replicated_value(x):
    """``x`` replicated (``jax.sharding.reshard`` to ``PartitionSpec()``) where its type is explicitly sharded."""
    return jax.sharding.reshard(x, jax.sharding.PartitionSpec()) if explicitly_sharded(jax.typeof(x)) else x


def _body(eqn):
    """The (jaxpr, consts) of an inlined call equation."""
    body = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
    if isinstance(body, jcore.ClosedJaxpr):
        return body.jaxpr, body.consts
    return body, ()


def flatten(closed_jaxpr) -> FlatProgram:
    """Inline call primitives and number the vertices of ``closed_jaxpr`` (a ClosedJaxpr or Jaxpr)."""
    if isinstance(closed_jaxpr, jcore.ClosedJaxpr):
        jaxpr, consts = closed_jaxpr.jaxpr, closed_jaxpr.consts
    else:
        jaxpr, consts = closed_jaxpr, ()
    program = FlatProgram(in_avals=tuple(v.aval for v in jaxpr.invars), eqns=[], outvars=())
    env = {v: Const(c) for v, c in zip(jaxpr.constvars, consts)}
    env.update({v: Input(i) for i, v in enumerate(jaxpr.invars)})
    program.outvars = tuple(_walk(program, jaxpr, env, (), ()))
    return program


def _read(env, var):
    if isinstance(var, jcore.Literal):
        return Const(var.val)
    return env[var]


def _walk(program: FlatProgram, jaxpr, env: dict, path: tuple, callers: tuple) -> list:
    for index, eqn in enumerate(jaxpr.eqns):
        invars = tuple(_read(env, v) for v in eqn.invars)
        if eqn.primitive.name in INLINED:
            body, body_consts = _body(eqn)
            inner = {v: Const(c) for v, c in zip(body.constvars, body_consts)}
            inner.update(zip(body.invars, invars))
            results = _walk(program, body, inner, path + (index,), (eqn.source_info,) + callers)
            for var, atom in zip(eqn.outvars, results):
                if not isinstance(var, jcore.DropVar):
                    env[var] = atom
            continue
        outs = []
        for var in eqn.outvars:
            number = len(program.avals) + 1
            program.avals[number] = var.aval
            program.vertex_eqn[number] = len(program.eqns)
            outs.append(number)
            if not isinstance(var, jcore.DropVar):
                env[var] = number
        program.eqns.append(FlatEqn(eqn.primitive, dict(eqn.params), invars, tuple(outs),
                                    eqn.source_info, path + (index,), callers))
    return [_read(env, v) for v in jaxpr.outvars]


def bind(eqn: FlatEqn | jcore.JaxprEqn, *args):
    """Apply ``eqn``'s primitive to ``args`` (as ``jax.core.eval_jaxpr`` does, call primitives included);
    placed as the equation says (:attr:`FlatEqn.placed`)."""
    placed = getattr(eqn, "placed", None)
    if placed is not None:
        args = [x if spec is None else jax.sharding.reshard(x, spec) for x, spec in zip(args, placed)]
    out = eqn.primitive.bind(*args, **eqn.primitive.get_bind_params(eqn.params))
    return out if placed is None else jax.tree_util.tree_map(replicated_value, out)


def read(atom, args, values):
    """The value of an atom, given the flat inputs ``args`` and the vertex ``values``."""
    if isinstance(atom, Input):
        return args[atom.index]
    if isinstance(atom, Const):
        return atom.value
    return values[atom]


def evaluate(program: FlatProgram, args) -> dict:
    """Run ``program`` on flat ``args``; return the value of every vertex (number -> array).

    Integer and boolean values computed from constants alone by the primitives of
    :data:`NUMPY_RULES`, up to ``FOLDED_SIZE`` elements (index arithmetic such as the wrapping of
    negative indices, masks from ``iota``) are computed in NumPy while tracing, even under
    ``jax.jit``, so that rules see them (a gather or scatter-add with known indices is a known selection).
    """
    values: dict = {}
    known = set()  # vertices whose values are NumPy arrays computed while tracing
    for eqn in program.eqns:
        invals = [read(a, args, values) for a in eqn.invars]
        outs = _in_numpy(program, eqn, invals, known)
        if outs is None and eqn.name in PRIMAL_RULES and eqn.placed is None:
            outs = PRIMAL_RULES[eqn.name](*invals, **eqn.params)
            if not eqn.primitive.multiple_results:
                outs = (outs,)
        elif outs is None and eqn.primitive is P.custom_vjp_call_p:
            outs = _custom_vjp_primal(eqn, invals)
        elif outs is None:
            outs = bind(eqn, *invals)
            if not eqn.primitive.multiple_results:
                outs = (outs,)
        else:
            known.update(eqn.outvars)
        values.update(zip(eqn.outvars, outs))
    return values


def _custom_vjp_primal(eqn: FlatEqn, invals) -> list:
    """The results of a ``custom_vjp`` function as JAX's reverse mode computes them: by its forward
    rule (the primal results of ``jax.vjp``). A differentiation of the Jacobian (``jax.jacfwd`` of
    ``jacve(f)``, ``jacve(jacve(f))``) then differentiates that rule, as it does in ``jax.jacrev(f)``;
    bound as the custom function itself, forward mode raised there and reverse mode applied the
    custom rule once more (a straight-through ``round``'s second derivative was 2, not 1)."""
    consts = invals[:eqn.params.get("num_consts", 0)]  # (closed-over values: not the function's inputs)
    return jax.vjp(lambda *xs: bind(eqn, *consts, *xs), *invals[len(consts):])[0]


#: values computed from constants are computed while tracing up to this many elements (larger ones,
#: such as the masks of ``jnp.triu`` on a large matrix, are left to XLA rather than become constants)
FOLDED_SIZE = 1 << 16


def _in_numpy(program: FlatProgram, eqn: FlatEqn, invals, known: set):
    """``eqn``'s results computed in NumPy, if it has a NumPy rule, reads constants only and makes
    integer or boolean values of at most ``FOLDED_SIZE`` elements; else None."""
    rule = NUMPY_RULES.get(eqn.name)
    if rule is None or not all(isinstance(a, Const) or a in known for a in eqn.invars):
        return None
    avals = [program.avals[v] for v in eqn.outvars]
    if not all((jnp.issubdtype(a.dtype, jnp.integer) or a.dtype == bool) and a.size <= FOLDED_SIZE for a in avals):
        return None
    try:
        arrays = [np.asarray(x) for x in invals]
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None  # a constant closed over from an enclosing trace
    out = rule(*arrays, **eqn.params)
    return None if out is None else (np.broadcast_to(np.asarray(out), avals[0].shape).astype(avals[0].dtype),)


def _np_select_n(which, *cases):
    return np.choose(np.asarray(which, np.int64), np.broadcast_arrays(*cases))


def _np_iota(*, dtype, shape, dimension, **_):
    axis = [1] * len(shape)
    axis[dimension] = shape[dimension]
    return np.arange(shape[dimension]).reshape(axis)


def _np_broadcast_in_dim(x, *, shape, broadcast_dimensions, **_):
    expanded = [1] * len(shape)
    for d, n in zip(broadcast_dimensions, np.shape(x)):
        expanded[d] = n
    return np.broadcast_to(np.reshape(x, expanded), shape)


#: primitives that :func:`evaluate` computes otherwise than by ``bind`` (name -> function of the
#: input values and the equation's params, returning its result, or its list of results): a small
#: matrix product is a fused multiply-and-sum on XLA:CPU, cheaper there than a library call (see
#: ``partials.SMALL_CONTRACTION``), a small sum a sum of slices at a point (``partials.POINT_SUM``);
#: ``jaxtool.rules`` adds ``sort``, which also makes the permutation its partials read
PRIMAL_RULES = {"dot_general": partials.dot_general, "reduce_sum": partials.reduce_sum}

#: NumPy forms of integer and boolean primitives, for values computed from constants (see :func:`evaluate`)
def _np_elementwise(function):
    """A NumPy elementwise function as a rule: the equation's params (``mul``'s ``out_dtype``) are
    not NumPy's; the result takes the equation's dtype in :func:`_in_numpy`."""
    return lambda *xs, **_: function(*xs)


def _np_rem(x, y, **_):
    """Integer ``rem`` as XLA computes it: the sign of ``x`` (C's ``%``, NumPy's ``fmod``), and
    ``x rem 0 = x`` and ``INT_MIN rem -1 = 0`` where NumPy gives 0 with a warning, or overflows."""
    x, y = np.broadcast_arrays(x, y)
    safe = np.where((y == 0) | (y == -1), 1, y).astype(y.dtype)  # (-1 only where signed; any x rem -1 is 0)
    return np.where(y == 0, x, np.fmod(x, safe))


def _np_convert(x, *, new_dtype, **_):
    """``convert_element_type`` as XLA converts: floats to integers saturate at the integer type's
    range and NaN becomes 0 (NumPy's cast gives the least integer, or wraps, for those)."""
    if np.issubdtype(x.dtype, np.floating) and np.issubdtype(new_dtype, np.integer):
        bounds = np.iinfo(new_dtype)
        whole = np.trunc(np.nan_to_num(np.asarray(x, np.float64), nan=0.0, posinf=np.inf, neginf=-np.inf))
        high, low = whole >= float(bounds.max), whole <= float(bounds.min)
        out = np.where(high | low, 0, whole).astype(new_dtype)  # (the bounds themselves may not be floats)
        out[high], out[low] = bounds.max, bounds.min
        return out
    return x


NUMPY_RULES = {
    **{name: _np_elementwise(function) for name, function in {
        "add": np.add, "sub": np.subtract, "mul": np.multiply, "max": np.maximum, "min": np.minimum,
        "neg": np.negative, "abs": np.abs, "sign": np.sign,
        "lt": np.less, "le": np.less_equal, "gt": np.greater, "ge": np.greater_equal, "eq": np.equal,
        "ne": np.not_equal, "and": np.bitwise_and, "or": np.bitwise_or, "xor": np.bitwise_xor, "not": np.invert,
    }.items()},
    "rem": _np_rem,
    "select_n": _np_select_n,
    "clamp": lambda lo, x, hi: np.clip(x, lo, hi),
    "convert_element_type": _np_convert,
    "iota": _np_iota,
    "broadcast_in_dim": _np_broadcast_in_dim,
    "reshape": lambda x, *, new_sizes, dimensions, **_: np.reshape(
        x if dimensions is None else np.transpose(x, dimensions), new_sizes),
    "squeeze": lambda x, *, dimensions: np.squeeze(x, dimensions),
    "transpose": lambda x, *, permutation: np.transpose(x, permutation),
    "concatenate": lambda *xs, dimension: np.concatenate(xs, dimension),
    "stack": lambda *xs, axis: np.stack(xs, axis),
    "slice": lambda x, *, start_indices, limit_indices, strides: x[tuple(
        slice(a, b, c) for a, b, c in zip(start_indices, limit_indices, strides or (1,) * np.ndim(x)))],
    "copy": lambda x: x,
}
