"""Random JAX programs for property-based testing of ``jaxtool.jacve`` against ``jax.jacrev``.

:func:`generate` turns an integer seed into a :class:`Case`: 1-3 float32 input arrays (scalars,
vectors of 2..5, matrices of 2..4 x 2..4) and a program of 3..25 random ``jnp``/``lax`` operations
that builds a DAG over them, returning 1-3 outputs in a tuple, dict or list. The program is emitted
as Python source and compiled with ``exec``, so the readable description *is* the program: a
failure report prints a self-contained script that reproduces it.

The operations cover elementwise math, broadcasting, reductions, slicing, gathers and scatters,
concatenation, reshapes, contractions, cumulative ops, sorting, integer values (iota, argsort,
comparisons), closed-over NumPy constants, ``stop_gradient``, ``custom_jvp``/``custom_vjp``
functions, nested ``jit``/``checkpoint``, ``lax.cond``/``switch``/``scan``/``fori_loop`` and a
little linear algebra, and complex intermediates (FFTs, complex products,
``conj``/``abs``/``angle``). Every value carries an upper bound on its magnitude; an operation that
could push a bound past :data:`BOUND_LIMIT` reads its operands through ``tanh``, so values (and
Jacobians) stay finite and moderate.

:func:`check_seed` runs one case: ``jax.jacrev`` is the reference (a case where it fails or gives
non-finite values is regenerated from the next *attempt* of the same seed and not counted), and
``jaxtool.jacve`` with the ``fwd``, ``rev`` and ``markowitz`` orders and random valid orders must
give the same pytree structure, shapes, dtypes and values (``rtol=1e-4``,
``atol=1e-5 * max(1, max|reference block|)``). A case whose values differ only because the reference
takes another branch of a discontinuity than the program's own evaluation, only when jitted, or only
in float32 where the float32 reference itself is rounding noise, is reported as rounding-dependent
rather than failed (see :func:`check_case`).

With ``dtype`` (``scripts/fuzz.py --dtype``), :func:`check_seed` evaluates the same programs on
inputs of another floating dtype, compared at its :data:`TOLERANCES`: in float64 (under
``jax_enable_x64``) at ``rtol = atol =`` 1e-10, the tolerance of the sample programs' float64 tests,
where engine code that assumes 32-bit types (an int32 index meeting the default int64) or computes
a partial in float32 fails; in float16 and bfloat16 at 0.1, where what fails is a crash or a wrong
dtype (NumPy, unlike JAX, has no common type of the two).
Used by ``tests/test_fuzz.py`` and ``scripts/fuzz.py``.
"""

from __future__ import annotations

import contextlib
import math
import random
from dataclasses import dataclass, field, replace

import numpy as np

#: No generated value has more elements than this (keeps dense Jacobians small).
MAX_SIZE = 48
#: No generated value has more axes than this.
MAX_RANK = 3
#: Magnitude bound above which an operation reads its operands through ``tanh``.
BOUND_LIMIT = 30.0
RTOL = 1e-4
ATOL = 1e-5
#: ``(rtol, atol)`` of a case by the dtype of its inputs (:attr:`Case.dtype`)
TOLERANCES = {"float32": (RTOL, ATOL), "float64": (1e-10, 1e-10), "float16": (0.1, 0.1), "bfloat16": (0.1, 0.1)}

#: Definitions every program may use; printed at the top of reproducers.
PRELUDE = '''\
import numpy as np
import jax
import jax.numpy as jnp
from jax import lax


@jax.custom_jvp
def cube(x):
    return x * x * x


@cube.defjvp
def _cube_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return cube(x), 3.0 * x * x * t


@jax.custom_vjp
def sin_vjp(x):
    return jnp.sin(x)


def _sin_vjp_fwd(x):
    return jnp.sin(x), jnp.cos(x)


def _sin_vjp_bwd(cos_x, g):
    return (cos_x * g,)


sin_vjp.defvjp(_sin_vjp_fwd, _sin_vjp_bwd)
'''


# ------------------------------------------------------------------------------------------------
# cases


@dataclass
class Case:
    """One generated program with its inputs; reproducible from ``(seed, attempt)``."""

    seed: int
    attempt: int
    inputs: tuple  # float32 numpy arrays
    argnums: object  # int or tuple of input positions (usually all of them)
    has_aux: bool  # the program returns ``(outputs, aux)``
    ops: list  # one line per operation, e.g. "v3 = jnp.sin(v1)"
    source: str  # the program: constants and ``def program(v0, ...)``
    fun: object = field(repr=False, default=None)
    tags: list = field(default_factory=list)  # the kinds of operation used, e.g. "control:scan"
    types: dict = field(default_factory=dict)  # value name -> (dtype name, shape), as generated
    dtype: str = "float32"  # of the inputs (float64: evaluated under jax.enable_x64); see TOLERANCES

    def type_of(self, name: str) -> str:
        dtype, shape = self.types[name]
        return f"{dtype}[{','.join(map(str, shape))}]"

    def description(self) -> str:
        """The program's operations, one per line, for failure reports."""
        shapes = ", ".join(f"v{i}: {self.type_of(f'v{i}')}" for i in range(len(self.inputs)))
        lines = [f"seed {self.seed} (attempt {self.attempt}); inputs {shapes}; argnums={self.argnums!r}"
                 + ("; has_aux=True" if self.has_aux else "")]
        for line in self.ops:
            names = line.split(" = ", 1)[0].split(", ") if " = " in line else []
            types = ", ".join(self.type_of(n) for n in names)
            lines.append(f"  {line}" + (f"  # {types}" if types else ""))
        return "\n".join(lines)

    def reproducer(self) -> str:
        """A self-contained script comparing ``jax.jacrev`` and ``jaxtool.jacve`` on this case."""
        args = ", ".join(_array_literal(x, self.dtype) for x in self.inputs)
        options = f"argnums={self.argnums!r}" + (", has_aux=True" if self.has_aux else "")
        x64 = 'jax.config.update("jax_enable_x64", True)\n' if self.dtype == "float64" else ""
        return (PRELUDE + "import jaxtool\n" + x64 + "\n" + self.source + f"\n\nargs = ({args},)\n"
                f"ref = jax.jacrev(program, {options})(*args)\n"
                "for order in ('fwd', 'rev', 'markowitz'):\n"
                f"    got = jaxtool.jacve(program, order=order, {options})(*args)\n"
                "    print(order, jax.tree_util.tree_map(lambda a, b: float(abs(a - b).max()), got, ref))\n")


def _array_literal(x: np.ndarray, dtype: str = "float32") -> str:
    """Python source for an array of a floating ``dtype`` (its values -> Python floats -> itself
    round-trips exactly)."""
    values = np.asarray(x, np.float64).tolist()
    return f"np.array({values!r}, dtype={'jnp' if dtype == 'bfloat16' else 'np'}.{dtype})"


# ------------------------------------------------------------------------------------------------
# the generator


@dataclass
class Var:
    """A value of the program being generated."""

    name: str
    shape: tuple
    kind: str  # "f": float32, "i": int32
    bound: float  # upper bound on max |value|


def _size(shape) -> int:
    return int(math.prod(shape))


def _fits(shape) -> bool:
    return len(shape) <= MAX_RANK and _size(shape) <= MAX_SIZE


def _reduce_shape(shape, axis, keepdims):
    axes = range(len(shape)) if axis is None else ((axis,) if isinstance(axis, int) else axis)
    axes = {a % len(shape) for a in axes}
    if keepdims:
        return tuple(1 if a in axes else n for a, n in enumerate(shape))
    return tuple(n for a, n in enumerate(shape) if a not in axes)


def _broadcast(sa, sb):
    try:
        return tuple(np.broadcast_shapes(sa, sb))
    except ValueError:
        return None


class _TooBig(Exception):
    """An operation would make a value larger than :data:`MAX_SIZE` or :data:`MAX_RANK` allow."""


class _Builder:
    """Accumulates the lines of one program."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.vars: list = []
        self.lines: list = []
        self.consts: list = []  # (name, np.ndarray)
        self.tags: list = []  # the op kinds used, for coverage checks

    # -- values ----------------------------------------------------------------------------
    def fresh(self) -> str:
        return f"v{len(self.vars)}"

    def add(self, expr: str, shape, kind="f", bound=1.0, tag="") -> Var:
        shape = tuple(int(n) for n in shape)
        if not _fits(shape):
            raise _TooBig(expr)
        var = Var(self.fresh(), shape, kind, float(bound))
        self.vars.append(var)
        self.lines.append(f"{var.name} = {expr}")
        self.tags.append(tag)
        return var

    def add_pair(self, expr: str, shapes, bounds, tag="") -> None:
        """A line that defines two values, ``va, vb = expr``."""
        if not all(_fits(tuple(shape)) for shape in shapes):
            raise _TooBig(expr)
        names = [f"v{len(self.vars)}", f"v{len(self.vars) + 1}"]
        for name, shape, bound in zip(names, shapes, bounds):
            self.vars.append(Var(name, tuple(shape), "f", float(bound)))
        self.lines.append(f"{names[0]}, {names[1]} = {expr}")
        self.tags.append(tag)

    def const(self, shape) -> str:
        """A closed-over NumPy float32 constant (multiples of 1/4, exact in any printing)."""
        value = np.array([self.rng.randint(-8, 8) / 4 for _ in range(_size(shape))], np.float32).reshape(shape)
        name = f"c{len(self.consts)}"
        self.consts.append((name, value))
        return name

    def floats(self, pred=lambda v: True) -> list:
        return [v for v in self.vars if v.kind == "f" and pred(v)]

    def ints(self, pred=lambda v: True) -> list:
        return [v for v in self.vars if v.kind == "i" and pred(v)]

    def pick(self, candidates):
        """A candidate, biased towards recent values so that programs grow deep, not just wide."""
        if not candidates:
            return None
        if len(candidates) > 3 and self.rng.random() < 0.5:
            return self.rng.choice(candidates[-3:])
        return self.rng.choice(candidates)

    def operand(self, var: Var, limit=BOUND_LIMIT):
        """``(expression, bound)`` reading ``var``, through ``tanh`` when its bound exceeds ``limit``."""
        if var.bound > limit:
            return f"jnp.tanh({var.name})", 1.0
        return var.name, var.bound

    def axis(self, shape):
        return self.rng.randrange(len(shape))


# ------------------------------------------------------------------------------------------------
# operations: each takes the builder and returns True if it added a line


def _growing(b: _Builder, var: Var, bound_of):
    """``(expression, bound)`` for ``var`` such that ``bound_of(bound) <= BOUND_LIMIT``."""
    expr, bound = b.operand(var)
    if bound_of(bound) > BOUND_LIMIT:
        return f"jnp.tanh({var.name})", 1.0
    return expr, bound


UNARY = [
    # (template, bound of the result given the operand's bound)
    ("jnp.sin({a})", lambda x: 1.0),
    ("jnp.cos({a})", lambda x: 1.0),
    ("jnp.tanh({a})", lambda x: 1.0),
    ("jnp.exp(jnp.tanh({a}))", lambda x: math.e),
    ("jnp.exp(jnp.clip({a}, -2.0, 2.0))", lambda x: math.e ** 2),
    ("jnp.expm1(jnp.tanh({a}))", lambda x: 2.0),
    ("jnp.log1p(jnp.abs({a}))", lambda x: math.log1p(x)),
    ("jnp.log({a} * {a} + 0.5)", lambda x: max(1.0, math.log(x * x + 0.5))),
    ("jnp.sqrt({a} * {a} + 1.0)", lambda x: math.sqrt(x * x + 1)),
    ("jax.nn.sigmoid({a})", lambda x: 1.0),
    ("jnp.square({a})", lambda x: x * x),
    ("{a} ** 2", lambda x: x * x),
    ("{a} ** 3", lambda x: x ** 3),
    ("lax.integer_pow({a}, 4)", lambda x: x ** 4),
    ("1.0 / (1.0 + {a} ** 2)", lambda x: 1.0),
    ("({a} * {a} + 1.0) ** 1.5", lambda x: (x * x + 1) ** 1.5),
    ("jnp.abs({a})", lambda x: x),
    ("-{a}", lambda x: x),
    ("jnp.arctan({a})", lambda x: 1.6),
    ("jnp.arcsinh({a})", lambda x: math.asinh(x)),
    ("jnp.sinh(jnp.tanh({a}))", lambda x: 1.2),
    ("jnp.cosh(jnp.tanh({a}))", lambda x: 1.6),
    ("jax.scipy.special.erf({a})", lambda x: 1.0),
    ("jnp.cbrt({a} * {a} + 1.0)", lambda x: (x * x + 1) ** (1 / 3)),
    ("lax.rsqrt({a} * {a} + 1.0)", lambda x: 1.0),
    ("jnp.floor({a})", lambda x: x + 1),
    ("jnp.round({a} * 2.0) * 0.5", lambda x: x + 1),
    ("jnp.sign({a}) * {a}", lambda x: x),
    ("jnp.clip({a}, -0.5, 0.5)", lambda x: 0.5),
    ("jnp.where({a} > 0.0, {a}, 0.1 * {a})", lambda x: x),
    ("jnp.where({a} > 0.25, jnp.sin({a}), {a} * {a})", lambda x: max(1.0, x * x)),
    ("{a} * 1.5", lambda x: 1.5 * x),
    ("2.0 - {a}", lambda x: x + 2),
    ("{a} / 4.0 + 0.25", lambda x: x / 4 + 0.25),
    ("{a} * {a}", lambda x: x * x),
    ("{a} + {a}", lambda x: 2 * x),
    ("{a} - {a}", lambda x: 0.0),
    ("jnp.maximum({a}, {a})", lambda x: x),
    ("jnp.minimum({a}, -{a})", lambda x: x),
    ("lax.stop_gradient({a})", lambda x: x),
    ("{a} - 0.5 * lax.stop_gradient({a})", lambda x: 1.5 * x),
    ("jax.nn.relu({a})", lambda x: x),
    ("jax.nn.softplus({a})", lambda x: x + 1),
    ("jax.nn.silu({a})", lambda x: x),
    ("jax.nn.gelu({a})", lambda x: x),
    ("jax.nn.elu({a})", lambda x: x),
    ("cube({a})", lambda x: x ** 3),
    ("sin_vjp({a})", lambda x: 1.0),
    ("jax.checkpoint(lambda x: jnp.sin(x) * x)({a})", lambda x: x),
    ("jax.jit(lambda x: jnp.tanh(x) * x + 1.0)({a})", lambda x: x + 1),
    ("lax.fori_loop(0, 3, lambda i, c: jnp.sin(c) * 0.9 + c * 0.1, {a})", lambda x: max(x, 1.0)),
    ("jnp.arctanh(0.9 * jnp.tanh({a}))", lambda x: 1.5),
    ("jnp.arccos(0.9 * jnp.tanh({a}))", lambda x: math.pi),
    ("jnp.arcsin(0.9 * jnp.tanh({a}))", lambda x: 1.2),
    ("jnp.tan(jnp.tanh({a}))", lambda x: 1.6),
    ("jnp.exp2(jnp.tanh({a}))", lambda x: 2.0),
    ("jax.scipy.special.erfc({a})", lambda x: 2.0),
    ("jax.scipy.special.gammaln({a} * {a} + 1.0)", lambda x: math.lgamma(x * x + 1) + 1),
    ("jax.scipy.special.digamma({a} * {a} + 1.0)", lambda x: math.log(x * x + 1) + 1),
    ("lax.clamp(-0.5, {a}, 0.5)", lambda x: 0.5),
    ("jnp.copy({a})", lambda x: x),
    ("jnp.remainder({a}, 0.75)", lambda x: 0.75),
    ("lax.integer_pow({a} * {a} + 1.0, -2)", lambda x: 1.0),
    ("jnp.select([{a} > 0.5, {a} < -0.5], [{a} * {a}, -{a}], {a})", lambda x: max(x, x * x)),
    ("jax.grad(lambda x: jnp.sum(jnp.sin(x) * x))({a})", lambda x: x + 1),
    ("jax.grad(lambda x: jnp.sum(jnp.tanh(x) ** 2))({a})", lambda x: 1.0),
    ("jax.jvp(lambda x: jnp.sin(x) * x, ({a},), (jnp.ones_like({a}),))[1]", lambda x: x + 1),
    ("jax.vmap(lambda x: jnp.where(x > 0.0, jnp.sin(x), x * x))({a})", lambda x: max(1.0, x * x)),
]


def op_unary(b: _Builder) -> bool:
    """An elementwise function of one value (math, custom rules, nested jit/checkpoint/grad, ...)."""
    var = b.pick(b.floats())
    template, bound_of = b.rng.choice(UNARY)
    if "vmap" in template and not var.shape:
        return False
    expr, bound = _growing(b, var, bound_of)
    b.add(template.format(a=expr), var.shape, bound=bound_of(bound), tag="unary:" + template.format(a="x"))
    return True


BINARY = [
    ("{a} + {b}", lambda x, y: x + y),
    ("{a} - {b}", lambda x, y: x + y),
    ("{a} * {b}", lambda x, y: x * y),
    ("{a} / (1.0 + {b} * {b})", lambda x, y: x),
    ("jnp.maximum({a}, {b})", max),
    ("jnp.minimum({a}, {b})", max),
    ("jnp.arctan2({a}, {b} * {b} + 0.5)", lambda x, y: 1.6),  # (0, 0), a NaN partial, is never reached
    ("jnp.where({a} > {b}, {a}, {b})", max),
    ("jnp.where({b} > 0.0, {a} * {b}, {a} - {b})", lambda x, y: max(x * y, x + y)),
    ("jnp.power({a} * {a} + 1.0, jnp.tanh({b}))", lambda x, y: x * x + 1),
    ("({a} > {b}).astype(jnp.float32) * {a}", lambda x, y: x),
    ("jax.jit(lambda x, y: x * jnp.cos(y))({a}, {b})", lambda x, y: x),
    ("lax.cond(jnp.sum({b}) > 0.0, lambda x, y: jnp.sin(x) * y, lambda x, y: x - y, {a}, {b})",
     lambda x, y: x + y),
    ("jax.vmap(lambda x, y: x * y + jnp.sin(x))({a}, {b})", lambda x, y: x * y + 1),
    ("jnp.logaddexp({a}, {b})", lambda x, y: max(x, y) + 0.7),
    ("jnp.hypot({a}, {b} * {b} + 0.5)", lambda x, y: x + y * y + 0.5),
]


def _broadcast_partner(b: _Builder, var: Var):
    """A float value and an expression for it that broadcasts against ``var``; the result shape."""
    options = []
    for other in b.floats():
        shape = _broadcast(var.shape, other.shape)
        if shape is not None and _fits(shape):
            options.append((other, "{}", shape))
        if len(var.shape) == 2 and other.shape == (var.shape[0],):
            options.append((other, "{}[:, None]", var.shape))
        if len(var.shape) == 1 and len(other.shape) == 1 and _fits((other.shape[0], var.shape[0])):
            options.append((other, "{}[:, None]", (other.shape[0], var.shape[0])))
    same = [o for o in options if o[0].shape == var.shape]
    if same and b.rng.random() < 0.5:
        options = same
    if b.rng.random() < 0.15:  # a repeated operand
        options = [(var, "{}", var.shape)]
    return b.rng.choice(options)


def op_binary(b: _Builder) -> bool:
    """An elementwise function of two values, broadcasting (scalar, row, column or outer)."""
    var = b.pick(b.floats())
    other, wrap, shape = _broadcast_partner(b, var)
    template, bound_of = b.rng.choice(BINARY)
    ea, ba = b.operand(var)
    eb, bb = b.operand(other)
    if bound_of(ba, bb) > BOUND_LIMIT:
        ea, ba, eb, bb = f"jnp.tanh({var.name})", 1.0, f"jnp.tanh({other.name})", 1.0
    if "vmap" in template and (shape != var.shape or shape != other.shape or not shape):
        return False  # vmap needs equal shapes with a batch axis
    if wrap != "{}" and len(var.shape) == 1 and len(shape) == 2 and shape[1] == var.shape[0]:
        ea = f"{ea}[None, :]"
    eb = wrap.format(eb)
    b.add(template.format(a=ea, b=eb), shape, bound=bound_of(ba, bb), tag="binary:" + template.format(a="x", b="y"))
    return True


def op_constant(b: _Builder) -> bool:
    """Python float or closed-over NumPy constants."""
    var = b.pick(b.floats())
    expr, bound = b.operand(var)
    choice = b.rng.randrange(4)
    if choice == 0:
        c = b.const(var.shape)
        b.add(f"{expr} * {c}", var.shape, bound=2 * bound, tag="const:np_mul")
    elif choice == 1 and var.shape:
        c = b.const(var.shape[-1:])
        b.add(f"{expr} + {c}", var.shape, bound=bound + 2, tag="const:np_add_broadcast")
    elif choice == 2 and len(var.shape) in (1, 2):
        n = b.rng.randint(2, 4)
        if not _fits((n,) + var.shape[1:]):
            return False
        c = b.const((n, var.shape[0]))
        b.add(f"{c} @ {expr}", (n,) + var.shape[1:], bound=2 * var.shape[0] * bound, tag="const:np_matmul")
    else:
        k = b.rng.choice([0.5, -1.25, 3.0, 0.1])
        b.add(f"{k} * {expr} + {-k / 2}", var.shape, bound=abs(k) * bound + abs(k), tag="const:python")
    return True


def op_reduce(b: _Builder) -> bool:
    """A reduction over all, one or two axes (keepdims sometimes), or a softmax along one."""
    var = b.pick(b.floats(lambda v: len(v.shape) >= 1))
    if var is None:
        return False
    shape = var.shape
    r = b.rng.random()
    if r < 0.3:
        axis = None
    elif r < 0.8 or len(shape) < 2:
        axis = b.axis(shape) - (len(shape) if b.rng.random() < 0.3 else 0)
    else:
        axis = tuple(sorted(b.rng.sample(range(len(shape)), 2)))
    keepdims = b.rng.random() < 0.2
    out = _reduce_shape(shape, axis, keepdims)
    n = _size(shape) // max(1, _size(_reduce_shape(shape, axis, False)))
    kind = b.rng.choice(["sum", "mean", "max", "min", "prod", "logsumexp", "var", "sum_sq", "max_abs", "softmax",
                         "log_softmax"])
    if kind in ("softmax", "log_softmax"):  # custom_jvp functions normalising along an axis
        axis = b.axis(shape)
        expr, bound = b.operand(var)
        b.add(f"jax.nn.{kind}({expr}, axis={axis})", shape, bound=1.0 if kind == "softmax" else 2 * bound + math.log(
            shape[axis]), tag="reduce:" + kind)
        return True
    extra = f", axis={axis!r}" + (", keepdims=True" if keepdims else "")
    if kind == "prod":
        expr, bound = _growing(b, var, lambda x: x ** n)
        b.add(f"jnp.prod({expr}{extra})", out, bound=bound ** n, tag="reduce:prod")
        return True
    expr, bound = b.operand(var)
    template, result_bound = {
        "sum": ("jnp.sum({a}{x})", n * bound),
        "mean": ("jnp.mean({a}{x})", bound),
        "max": ("jnp.max({a}{x})", bound),
        "min": ("jnp.min({a}{x})", bound),
        "logsumexp": ("jax.nn.logsumexp({a}{x})", bound + math.log(n)),
        "var": ("jnp.var({a}{x})", 4 * bound * bound),
        "sum_sq": ("jnp.sum({a} * {a}{x})", n * bound * bound),
        "max_abs": ("jnp.max(jnp.abs({a}){x})", bound),
    }[kind]
    if result_bound > BOUND_LIMIT * 4:
        expr, bound = f"jnp.tanh({var.name})", 1.0
        result_bound = {"sum": n, "logsumexp": 1 + math.log(n), "var": 4, "sum_sq": n}.get(kind, 1.0)
    b.add(template.format(a=expr, x=extra), out, bound=result_bound, tag="reduce:" + kind)
    return True


def op_slice(b: _Builder) -> bool:
    """Static slicing and indexing: strides, reversal, single rows and columns, rolls, diffs."""
    var = b.pick(b.floats(lambda v: len(v.shape) >= 1))
    if var is None:
        return False
    s, a, rng = var.shape, var.name, b.rng
    options = [
        (f"{a}[::-1]", s),
        (f"{a}[{rng.randrange(s[0])}]", s[1:]),
        (f"{a}[-1]", s[1:]),
        (f"jnp.flip({a}, axis={len(s) - 1})", s),
        (f"jnp.roll({a}, 1, axis=0)", s),
        (f"lax.dynamic_slice_in_dim({a}, 1, {s[0] - 1}, axis=0)", (s[0] - 1,) + s[1:]),
    ]
    if s[0] >= 2:
        options += [(f"{a}[1:]", (s[0] - 1,) + s[1:]), (f"{a}[:-1]", (s[0] - 1,) + s[1:]),
                    (f"{a}[::2]", ((s[0] + 1) // 2,) + s[1:]), (f"jnp.diff({a}, axis=0)", (s[0] - 1,) + s[1:])]
    if len(s) >= 2:
        j = rng.randrange(s[1])
        options += [(f"{a}[:, {j}]", (s[0],) + s[2:]), (f"{a}[..., 0]", s[:-1]),
                    (f"{a}[1:, ::-1]", (s[0] - 1,) + s[1:]), (f"{a}[:, 1:]", (s[0], s[1] - 1) + s[2:])]
    expr, shape = rng.choice(options)
    if 0 in shape:
        return False
    b.add(expr, shape, bound=var.bound, tag="slice:" + expr.replace(a, "x").split("(")[0][:12])
    return True


def _index_list(rng, n, k, unique=False):
    if unique:
        return sorted(rng.sample(range(n), min(k, n)))
    return [rng.randrange(n) for _ in range(k)]


def op_gather_scatter(b: _Builder) -> bool:
    """Indexing with constant index arrays (repeats included) and ``.at[...]`` updates."""
    var = b.pick(b.floats(lambda v: len(v.shape) >= 1))
    if var is None:
        return False
    s, a, rng = var.shape, var.name, b.rng
    n = s[0]
    kind = rng.choice(["gather", "gather_np", "take", "gather_col", "gather_points", "scatter_add",
                       "scatter_add_scalar", "scatter_set", "set_zero", "scatter_mul"])
    idx = _index_list(rng, n, rng.randint(1, 4))
    if kind == "gather":
        b.add(f"{a}[jnp.array({idx})]", (len(idx),) + s[1:], bound=var.bound, tag="gather")
    elif kind == "gather_np":
        b.add(f"{a}[np.array({idx})]", (len(idx),) + s[1:], bound=var.bound, tag="gather")
    elif kind == "take":
        axis = b.axis(s)
        idx = _index_list(rng, s[axis], rng.randint(1, 4))
        shape = s[:axis] + (len(idx),) + s[axis + 1:]
        b.add(f"jnp.take({a}, jnp.array({idx}), axis={axis})", shape, bound=var.bound, tag="gather:take")
    elif kind == "gather_col" and len(s) >= 2:
        idx = _index_list(rng, s[1], rng.randint(1, 3))
        b.add(f"{a}[:, jnp.array({idx})]", (n, len(idx)) + s[2:], bound=var.bound, tag="gather:col")
    elif kind == "gather_points" and len(s) >= 2:
        k = rng.randint(1, 4)
        rows, cols = _index_list(rng, s[0], k), _index_list(rng, s[1], k)
        b.add(f"{a}[jnp.array({rows}), jnp.array({cols})]", (k,) + s[2:], bound=var.bound, tag="gather:points")
    elif kind in ("scatter_add", "scatter_set"):
        unique = kind == "scatter_set"
        idx = _index_list(rng, n, rng.randint(1, 4), unique=unique)
        upd_shape = (len(idx),) + s[1:]
        partners = b.floats(lambda v: v.shape == upd_shape or v.shape == () or v.shape == s[1:])
        upd = b.pick(partners)
        if upd is None:
            return False
        ea, ba = b.operand(var)
        eu, bu = b.operand(upd)
        method = "add" if kind == "scatter_add" else "set"
        bound = ba + len(idx) * bu if method == "add" else max(ba, bu)
        b.add(f"{ea}.at[jnp.array({idx})].{method}({eu})", s, bound=bound, tag="scatter:" + method)
    elif kind == "scatter_add_scalar":
        b.add(f"{a}.at[{rng.randrange(n)}].add(1.5)", s, bound=var.bound + 1.5, tag="scatter:add_const")
    elif kind == "set_zero":
        b.add(f"{a}.at[{rng.randrange(n)}].set(0.0)", s, bound=var.bound, tag="scatter:set_const")
    elif kind == "scatter_mul":
        idx = _index_list(rng, n, rng.randint(1, 3), unique=True)
        b.add(f"{a}.at[jnp.array({idx})].mul(2.0)", s, bound=2 * var.bound, tag="scatter:mul_const")
    else:
        return False
    return True


def op_matrix_structure(b: _Builder) -> bool:
    """diag, triu/tril, trace, pad: structured selections of vectors and matrices."""
    rng = b.rng
    var = b.pick(b.floats(lambda v: len(v.shape) in (1, 2)))
    if var is None:
        return False
    s, a = var.shape, var.name
    if len(s) == 1:
        options = [(f"jnp.diag({a})", (s[0], s[0])), (f"jnp.pad({a}, 1)", (s[0] + 2,)),
                   (f"jnp.pad({a}, (0, 2))", (s[0] + 2,)), (f"jnp.repeat({a}, 2)", (2 * s[0],)),
                   (f"jnp.tile({a}, 2)", (2 * s[0],)), (f"jnp.pad({a}, 1, mode='edge')", (s[0] + 2,))]
    else:
        options = [(f"jnp.triu({a})", s), (f"jnp.tril({a}, -1)", s), (f"jnp.diagonal({a})", (min(s),)),
                   (f"jnp.trace({a})", ()), (f"jnp.pad({a}, ((1, 0), (0, 1)))", (s[0] + 1, s[1] + 1)),
                   (f"jnp.fliplr({a})", s), (f"jnp.repeat({a}, 2, axis=1)", (s[0], 2 * s[1]))]
    if s[0] >= 2:
        window = "(2,)" if len(s) == 1 else "(2, 1)"
        ones = "(1,)" if len(s) == 1 else "(1, 1)"
        options += [(f"lax.reduce_window({a}, -jnp.inf, lax.max, {window}, {ones}, 'VALID')", (s[0] - 1,) + s[1:]),
                    (f"lax.reduce_window({a}, 0.0, lax.add, {window}, {ones}, 'VALID')", (s[0] - 1,) + s[1:]),
                    (f"jnp.split({a}, [1])[1]", (s[0] - 1,) + s[1:]), (f"jnp.unstack({a})[-1]", s[1:]),
                    (f"lax.pad({a}, 0.0, [(1, -1, 1)" + (", (0, 0, 0)" if len(s) == 2 else "") + "])",
                     (2 * s[0] - 1,) + s[1:])]
    expr, shape = rng.choice(options)
    if not _fits(shape):
        return False
    bound = var.bound * (min(s) if "trace" in expr else 2 if "lax.add" in expr else 1)
    b.add(expr, shape, bound=bound, tag="structure:" + expr.split("(")[0])
    return True


def op_window_update(b: _Builder) -> bool:
    """Convolutions and in-place updates of a slice: two differentiated operands."""
    rng = b.rng
    var = b.pick(b.floats(lambda v: len(v.shape) in (1, 2) and v.shape[0] >= 2))
    if var is None:
        return False
    s = var.shape
    if len(s) == 1 and rng.random() < 0.5:
        kernel = b.pick(b.floats(lambda v: len(v.shape) == 1))
        mode = rng.choice(["full", "same", "valid"])
        n, m = s[0], kernel.shape[0]
        length = {"full": n + m - 1, "same": max(n, m), "valid": max(n, m) - min(n, m) + 1}[mode]
        ea, ba = b.operand(var)
        ek, bk = b.operand(kernel)
        if min(n, m) * ba * bk > BOUND_LIMIT:
            ea, ba, ek, bk = f"jnp.tanh({var.name})", 1.0, f"jnp.tanh({kernel.name})", 1.0
        b.add(f"jnp.convolve({ea}, {ek}, mode='{mode}')", (length,), bound=min(n, m) * ba * bk, tag="window:convolve")
        return True
    k = rng.randint(1, s[0] - 1)
    update = b.pick(b.floats(lambda v: v.shape == (k,) + s[1:]))
    if update is None:
        return False
    start = rng.randint(0, s[0] - k)
    b.add(f"lax.dynamic_update_slice_in_dim({var.name}, {update.name}, {start}, axis=0)", s,
          bound=max(var.bound, update.bound), tag="window:dynamic_update_slice")
    return True


def op_concat(b: _Builder) -> bool:
    """``concatenate`` (with itself or a constant sometimes) or ``stack`` of same-shaped values."""
    rng = b.rng
    var = b.pick(b.floats(lambda v: len(v.shape) >= 1))
    if var is None:
        return False
    s = var.shape
    if rng.random() < 0.5:
        axis = b.axis(s)
        partners = b.floats(lambda v: len(v.shape) == len(s) and all(
            v.shape[k] == s[k] for k in range(len(s)) if k != axis))
        other = var if rng.random() < 0.2 else b.pick(partners)
        shape = s[:axis] + (s[axis] + other.shape[axis],) + s[axis + 1:]
        if not _fits(shape):
            return False
        if rng.random() < 0.2:
            c = b.const(other.shape)
            b.add(f"jnp.concatenate([{var.name}, {c}], axis={axis})", shape, bound=max(var.bound, 2.0),
                  tag="concat:const")
        else:
            b.add(f"jnp.concatenate([{var.name}, {other.name}], axis={axis})", shape,
                  bound=max(var.bound, other.bound), tag="concat")
    else:
        partners = b.floats(lambda v: v.shape == s)
        others = [b.pick(partners) for _ in range(rng.randint(1, 2))]
        axis = rng.randrange(len(s) + 1)
        shape = s[:axis] + (1 + len(others),) + s[axis:]
        if not _fits(shape):
            return False
        names = ", ".join(v.name for v in [var] + others)
        b.add(f"jnp.stack([{names}], axis={axis})", shape, bound=max(v.bound for v in [var] + others),
              tag="stack")
    return True


def op_reshape(b: _Builder) -> bool:
    """Reshapes, transposes, unit axes and broadcasts to a new leading axis."""
    rng = b.rng
    var = b.pick(b.floats())
    s, a = var.shape, var.name
    options = [(f"{a}[None]", (1,) + s), (f"jnp.expand_dims({a}, {len(s)})", s + (1,))]
    if len(s) >= 2:
        options += [(f"{a}.reshape(-1)", (_size(s),)), (f"{a}.T", s[::-1]), (f"{a}.ravel()", (_size(s),)),
                    (f"jnp.ravel({a}, order='F')", (_size(s),))]  # (lax.reshape with ``dimensions``)
    if len(s) == 3:
        perm = rng.choice([(1, 0, 2), (0, 2, 1), (2, 0, 1)])
        options += [(f"jnp.transpose({a}, {perm})", tuple(s[p] for p in perm)),
                    (f"jnp.moveaxis({a}, 0, -1)", s[1:] + s[:1]), (f"{a}.reshape({s[0]}, -1)", (s[0], s[1] * s[2])),
                    (f"lax.reshape({a}, {(s[2], s[0] * s[1])}, dimensions=(2, 1, 0))", (s[2], s[0] * s[1]))]
    if len(s) == 1 and s[0] in (4, 6, 8, 9, 12, 16):
        m = next(d for d in (2, 3, 4) if s[0] % d == 0)
        options.append((f"{a}.reshape({m}, {s[0] // m})", (m, s[0] // m)))
    if len(s) == 2 and s[0] * s[1] in (6, 8, 12, 16) and s[0] != s[1]:
        options.append((f"{a}.reshape({s[1]}, {s[0]})", (s[1], s[0])))
        options.append((f"{a}.reshape({s[1]}, {s[0]}, order='F')", (s[1], s[0])))
    if 1 in s:
        options.append((f"jnp.squeeze({a})", tuple(n for n in s if n != 1)))
    if len(s) <= 2:
        k = rng.randint(2, 3)
        options.append((f"jnp.broadcast_to({a}, {(k,) + s})", (k,) + s))
    expr, shape = rng.choice(options)
    if not _fits(shape):
        return False
    b.add(expr, shape, bound=var.bound, tag="reshape:" + expr.replace(a, "x").split("(")[0][:14])
    return True


def op_contract(b: _Builder) -> bool:
    """Matrix products, dots, einsums and outer products (repeated operands included)."""
    rng = b.rng
    var = b.pick(b.floats(lambda v: len(v.shape) >= 1))
    if var is None:
        return False
    s = var.shape
    options = []  # (template, other var, result shape, contracted size)
    for o in b.floats(lambda v: len(v.shape) >= 1):
        t = o.shape
        if len(s) == 2 and len(t) == 2 and s[1] == t[0]:
            options += [("{a} @ {b}", o, (s[0], t[1]), s[1]), ("jnp.einsum('ij,jk->ik', {a}, {b})", o, (s[0], t[1]), s[1])]
        if len(s) == 2 and len(t) == 1 and s[1] == t[0]:
            options += [("jnp.dot({a}, {b})", o, (s[0],), s[1]), ("jnp.einsum('ij,j->i', {a}, {b})", o, (s[0],), s[1])]
        if len(s) == 1 and len(t) == 2 and s[0] == t[0]:
            options += [("{a} @ {b}", o, (t[1],), s[0])]
        if len(s) == 1 and len(t) == 1:
            options += [("jnp.outer({a}, {b})", o, (s[0], t[0]), 1)]
            if s == t:
                options += [("jnp.dot({a}, {b})", o, (), s[0]), ("jnp.vdot({a}, {b})", o, (), s[0])]
        if len(s) == 2 and s == t:
            options += [("jnp.einsum('ij,ij->i', {a}, {b})", o, (s[0],), s[1]),
                        ("jnp.einsum('ij,kj->ik', {a}, {b})", o, (s[0], s[0]), s[1]),
                        ("jax.vmap(jnp.dot)({a}, {b})", o, (s[0],), s[1])]
        if len(s) == 3 and len(t) == 3 and s[0] == t[0] and s[2] == t[1]:
            options += [("jnp.matmul({a}, {b})", o, (s[0], s[1], t[2]), s[2])]
        if len(s) == 3 and len(t) == 2 and s[2] == t[0]:
            options += [("jnp.einsum('bij,jk->bik', {a}, {b})", o, (s[0], s[1], t[1]), s[2])]
    if len(s) == 1:
        options += [("jnp.outer({a}, {a})", var, (s[0], s[0]), 1), ("jnp.dot({a}, {a})", var, (), s[0])]
    if len(s) == 2:
        options += [("{a} @ {a}.T", var, (s[0], s[0]), s[1]), ("{a}.T @ {a}", var, (s[1], s[1]), s[0])]
        if s[0] == s[1]:
            options += [("{a} @ {a}", var, s, s[0]), ("jnp.einsum('ii->i', {a})", var, (s[0],), 1),
                        ("jnp.einsum('ij,ji->', {a}, {a})", var, (), s[0] * s[1])]
    options = [o for o in options if _fits(o[2])]
    if not options:
        return False
    template, other, shape, k = rng.choice(options)
    ea, ba = b.operand(var)
    eb, bb = b.operand(other)
    if k * ba * bb > BOUND_LIMIT:
        ea, ba, eb, bb = f"jnp.tanh({var.name})", 1.0, f"jnp.tanh({other.name})", 1.0
    if other is var:
        eb = ea
    b.add(template.format(a=ea, b=eb), shape, bound=k * ba * bb, tag="contract:" + template.format(a="x", b="y"))
    return True


def op_cumulative(b: _Builder) -> bool:
    """Cumulative sums, products, maxima, minima and log-sum-exps along an axis."""
    rng = b.rng
    var = b.pick(b.floats(lambda v: len(v.shape) >= 1))
    if var is None:
        return False
    axis = b.axis(var.shape)
    n = var.shape[axis]
    kind = rng.choice(["cumsum", "cumsum_rev", "cumprod", "cummax", "cummin_rev", "cumlogsumexp"])
    if kind == "cumprod":
        expr, bound = _growing(b, var, lambda x: x ** n)
        b.add(f"jnp.cumprod({expr}, axis={axis})", var.shape, bound=max(bound, bound ** n), tag="cum:prod")
        return True
    expr, bound = _growing(b, var, lambda x: n * x + math.log(n))
    template, result = {
        "cumsum": (f"jnp.cumsum({expr}, axis={axis})", n * bound),
        "cumsum_rev": (f"lax.cumsum({expr}, axis={axis}, reverse=True)", n * bound),
        "cummax": (f"lax.cummax({expr}, axis={axis})", bound),
        "cummin_rev": (f"lax.cummin({expr}, axis={axis}, reverse=True)", bound),
        "cumlogsumexp": (f"lax.cumlogsumexp({expr}, axis={axis})", bound + math.log(n)),
    }[kind]
    b.add(template, var.shape, bound=result, tag="cum:" + kind)
    return True


def op_sort(b: _Builder) -> bool:
    """Sorting: along an axis, flattened, descending, by other keys, top-k, median."""
    rng = b.rng
    var = b.pick(b.floats(lambda v: len(v.shape) >= 1))
    if var is None:
        return False
    s, a = var.shape, var.name
    kind = rng.choice(["sort", "sort_axis0", "sort_desc", "sort_flat", "sort_pair", "top_k", "take_along",
                       "median"])
    if kind == "sort":
        b.add(f"jnp.sort({a})", s, bound=var.bound, tag="sort")
    elif kind == "sort_axis0":
        b.add(f"jnp.sort({a}, axis=0)", s, bound=var.bound, tag="sort")
    elif kind == "sort_desc":
        b.add(f"-jnp.sort(-{a})", s, bound=var.bound, tag="sort")
    elif kind == "sort_flat":
        b.add(f"jnp.sort({a}, axis=None)", (_size(s),), bound=var.bound, tag="sort")
    elif kind in ("sort_pair", "take_along"):
        other = b.pick(b.floats(lambda v: v.shape == s))
        if kind == "sort_pair":
            b.add(f"lax.sort(({a}, {other.name}), num_keys=1)[1]", s, bound=other.bound, tag="sort:pair")
        else:
            b.add(f"jnp.take_along_axis({other.name}, jnp.argsort({a}, axis=-1), axis=-1)", s,
                  bound=other.bound, tag="sort:take_along")
    elif kind == "top_k":
        k = rng.randint(1, s[-1])
        b.add(f"lax.top_k({a}, {k})[0]", s[:-1] + (k,), bound=var.bound, tag="sort:top_k")
    else:
        b.add(f"jnp.median({a})", (), bound=var.bound, tag="sort:median")
    return True


def op_integer(b: _Builder) -> bool:
    """Integer (and integer-derived constant) values, and their uses as factors and indices."""
    rng = b.rng
    ints = b.ints()
    if ints and rng.random() < 0.6:
        iv = b.pick(ints)
        targets = b.floats(lambda v: len(v.shape) >= 1)
        use = rng.choice(["cast", "mul", "index", "scatter", "where", "switch", "dynamic_slice"])
        if use == "cast":
            b.add(f"{iv.name}.astype(jnp.float32) * 0.5", iv.shape, bound=iv.bound / 2, tag="int:cast")
            return True
        if use == "mul":
            var = b.pick(b.floats(lambda v: _broadcast(v.shape, iv.shape) == v.shape))
            if var is None:
                return False
            expr, bound = _growing(b, var, lambda x: x * iv.bound)
            b.add(f"{expr} * {iv.name}", var.shape, bound=bound * iv.bound, tag="int:mul")
            return True
        if use == "where":
            var = b.pick(b.floats(lambda v: _broadcast(v.shape, iv.shape) == v.shape))
            if var is None:
                return False
            b.add(f"jnp.where({iv.name} > 1, {var.name}, jnp.cos({var.name}))", var.shape,
                  bound=max(1.0, var.bound), tag="int:where")
            return True
        var = b.pick(targets)
        if var is None:
            return False
        n = var.shape[0]
        if use == "index":
            shape = iv.shape + var.shape[1:]
            if not _fits(shape):
                return False
            b.add(f"{var.name}[{iv.name} % {n}]", shape, bound=var.bound, tag="int:index")
        elif use == "scatter":
            upd = b.pick(b.floats(lambda v: v.shape == () or v.shape == iv.shape + var.shape[1:]))
            if upd is None or (iv.shape and len(iv.shape) > 1):
                return False
            count = _size(iv.shape)
            ev, bv = b.operand(var)
            eu, bu = b.operand(upd)
            b.add(f"{ev}.at[{iv.name} % {n}].add({eu})", var.shape, bound=bv + count * bu, tag="int:scatter_add")
        elif use == "switch" and iv.shape == ():
            b.add(f"lax.switch({iv.name} % 3, [jnp.sin, lambda x: x * x, lambda x: -x], {b.operand(var)[0]})",
                  var.shape, bound=max(1.0, min(var.bound, BOUND_LIMIT) ** 2), tag="control:switch")
        elif use == "dynamic_slice" and iv.shape == () and n >= 2:
            b.add(f"lax.dynamic_slice_in_dim({var.name}, {iv.name} % {n - 1}, 2, axis=0)", (2,) + var.shape[1:],
                  bound=var.bound, tag="int:dynamic_slice")
        else:
            return False
        return True
    # make an integer value (or a constant float derived from one)
    var = b.pick(b.floats(lambda v: len(v.shape) >= 1))
    kind = rng.choice(["arange", "iota", "argsort", "argmax", "argmin_axis", "compare", "floor", "count",
                       "arange_f", "linspace", "eye", "one_hot", "any"])
    n = rng.randint(2, 5)
    if kind == "arange":
        b.add(f"jnp.arange({n})", (n,), kind="i", bound=n, tag="int:arange")
    elif kind == "iota":
        b.add(f"lax.iota(jnp.int32, {n})", (n,), kind="i", bound=n, tag="int:iota")
    elif kind == "arange_f":
        b.add(f"jnp.arange({n}, dtype=jnp.float32) * 0.5", (n,), bound=n / 2, tag="int:arange_float")
    elif kind == "linspace":
        b.add(f"jnp.linspace(-1.0, 1.0, {n})", (n,), bound=1.0, tag="int:linspace")
    elif kind == "eye":
        b.add(f"jnp.eye({n}) * 0.5", (n, n), bound=0.5, tag="int:eye")
    elif var is None:
        return False
    elif kind == "argsort":
        b.add(f"jnp.argsort({var.name}, axis=-1)", var.shape, kind="i", bound=var.shape[-1], tag="int:argsort")
    elif kind == "argmax":
        b.add(f"jnp.argmax({var.name})", (), kind="i", bound=_size(var.shape), tag="int:argmax")
    elif kind == "argmin_axis":
        axis = b.axis(var.shape)
        b.add(f"jnp.argmin({var.name}, axis={axis})", _reduce_shape(var.shape, axis, False), kind="i",
              bound=var.shape[axis], tag="int:argmin")
    elif kind == "compare":
        other, wrap, shape = _broadcast_partner(b, var)
        b.add(f"({var.name} > {wrap.format(other.name)}).astype(jnp.float32)", shape, bound=1.0,
              tag="int:compare_cast")
    elif kind == "floor":
        expr, bound = b.operand(var)
        b.add(f"jnp.floor({expr} * 2.0).astype(jnp.int32)", var.shape, kind="i", bound=2 * bound + 1,
              tag="int:floor_cast")
    elif kind == "one_hot":
        index = b.pick(b.ints(lambda v: len(v.shape) <= 1))
        if index is None or not _fits(index.shape + (n,)):
            return False
        b.add(f"jax.nn.one_hot({index.name} % {n}, {n})", index.shape + (n,), bound=1.0, tag="int:one_hot")
    elif kind == "any":
        b.add(f"jnp.where(jnp.any({var.name} > 0.5), {var.name}, -{var.name})", var.shape, bound=var.bound,
              tag="int:any")
    else:
        b.add(f"jnp.sum({var.name} > 0.0)", (), kind="i", bound=_size(var.shape), tag="int:count")
    return True


COND_BRANCHES = [
    ("lambda x: jnp.sin(x) * 2.0", "lambda x: x * x", lambda x: max(2.0, x * x)),
    ("lambda x: jnp.tanh(x)", "lambda x: -x", lambda x: max(1.0, x)),
    ("lambda x: x * {w}", "lambda x: x + {w}", None),  # closes over another value
]

SCAN_BODIES = [
    # (body, carry bound, ys bound) given the carry's and xs's bounds and the length
    ("lambda c, x: (jnp.tanh(c * x + 0.5), c * x)", lambda c, x, n: 1.0, lambda c, x, n: max(c, 1.0) * x),
    ("lambda c, x: (c * 0.9 + jnp.sin(x), jnp.cos(c) + x)", lambda c, x, n: c + n, lambda c, x, n: 1 + x),
    ("lambda c, x: (c + x, c)", lambda c, x, n: c + n * x, lambda c, x, n: c + n * x),
    ("lambda c, x: (jnp.tanh(c * {w} + x), c * x)", lambda c, x, n: 1.0, lambda c, x, n: max(c, 1.0) * x),
]


def op_control(b: _Builder) -> bool:
    """``lax.cond``, ``lax.scan``, ``lax.map``, ``associative_scan`` and a little linear algebra, and complex intermediates (FFTs, complex products, ``conj``/``abs``/``angle``)."""
    rng = b.rng
    kind = rng.choice(["cond", "scan", "scan", "map", "assoc_scan", "solve", "det", "inv", "cholesky", "eigvalsh"])
    if kind == "cond":
        var = b.pick(b.floats())
        pred = b.pick(b.floats())
        yes, no, bound_of = rng.choice(COND_BRANCHES)
        ea, ba = b.operand(var)
        if bound_of is None:
            w = b.pick(b.floats(lambda v: _broadcast(var.shape, v.shape) == var.shape))
            ew, bw = b.operand(w)
            yes, no = yes.format(w=ew), no.format(w=ew)
            bound = ba * bw + ba + bw
        else:
            if bound_of(ba) > BOUND_LIMIT:
                ea, ba = f"jnp.tanh({var.name})", 1.0
            bound = bound_of(ba)
        b.add(f"lax.cond(jnp.sum({pred.name}) > 0.0, {yes}, {no}, {ea})", var.shape, bound=bound,
              tag="control:cond")
        return True
    if kind == "scan":
        xs = b.pick(b.floats(lambda v: len(v.shape) >= 1))
        if xs is None:
            return False
        n, carry_shape = xs.shape[0], xs.shape[1:]
        init = b.pick(b.floats(lambda v: v.shape == carry_shape))
        body, carry_bound, ys_bound = rng.choice(SCAN_BODIES)
        ex, bx = b.operand(xs, 1.0)
        ei, bi = b.operand(init, 1.0) if init is not None else (f"jnp.zeros({carry_shape})", 0.0)
        if "{w}" in body:
            w = b.pick(b.floats(lambda v: _broadcast(carry_shape, v.shape) == carry_shape))
            body = body.format(w=b.operand(w, 1.0)[0] if w is not None else "0.5")
        reverse = ", reverse=True" if rng.random() < 0.3 else ""
        b.add_pair(f"lax.scan({body}, {ei}, {ex}{reverse})", (carry_shape, xs.shape),
                   (carry_bound(bi, bx, n), ys_bound(bi, bx, n)), tag="control:scan")
        return True
    if kind == "map":
        var = b.pick(b.floats(lambda v: len(v.shape) >= 1))
        if var is None:
            return False
        expr, bound = b.operand(var, 5.0)
        per = _size(var.shape[1:])
        b.add(f"lax.map(lambda r: jnp.sum(r * r) + jnp.sin(r).sum(), {expr})", var.shape[:1],
              bound=per * (bound * bound + 1), tag="control:map")
        return True
    if kind == "assoc_scan":
        var = b.pick(b.floats(lambda v: len(v.shape) >= 1))
        if var is None:
            return False
        expr, bound = b.operand(var, 5.0)
        b.add(f"lax.associative_scan(jnp.add, {expr})", var.shape, bound=var.shape[0] * bound,
              tag="control:associative_scan")
        return True
    square = b.floats(lambda v: len(v.shape) == 2 and v.shape[0] == v.shape[1])
    m = b.pick(square)
    if m is None:
        return False
    n = m.shape[0]
    well_conditioned = f"({n}.0 * jnp.eye({n}) + jnp.tanh({m.name}))"
    if kind == "solve":
        rhs = b.pick(b.floats(lambda v: len(v.shape) in (1, 2) and v.shape[0] == n))
        er, br = b.operand(rhs)
        b.add(f"jnp.linalg.solve({well_conditioned}, {er})", rhs.shape, bound=2 * br, tag="linalg:solve")
    elif kind == "det":
        b.add(f"jnp.linalg.det(0.5 * {well_conditioned})", (), bound=(n / 2 + 0.5) ** n, tag="linalg:det")
    elif kind == "inv":
        b.add(f"jnp.linalg.inv({well_conditioned})", (n, n), bound=2.0, tag="linalg:inv")
    elif kind == "cholesky":
        b.add(f"jnp.linalg.cholesky({well_conditioned} @ {well_conditioned}.T)", (n, n), bound=2.0 * n,
              tag="linalg:cholesky")
    else:
        b.add(f"jnp.linalg.eigvalsh(jnp.tanh({m.name}) + jnp.tanh({m.name}).T)", (n,), bound=2.0 * n,
              tag="linalg:eigvalsh")
    return True


def op_higher_order(b: _Builder) -> bool:
    """JAX transformations inside the program: its jaxpr holds their (already differentiated) equations."""
    var = b.pick(b.floats(lambda v: len(v.shape) == 1 and _fits(v.shape * 2)))
    if var is None:
        return False
    n, expr = var.shape[0], b.operand(var, 5.0)[0]
    expr, shape, bound = b.rng.choice([
        (f"jax.jacfwd(jnp.sin)({expr})", (n, n), 1.0),
        (f"jax.jacrev(lambda x: jnp.tanh(x) * jnp.sum(x))({expr})", (n, n), 6.0 * n),
        (f"jax.hessian(lambda x: jnp.sum(x ** 3))({expr})", (n, n), 30.0),
        (f"jax.vmap(lambda r: jnp.sort(r) * r)(jnp.outer({expr}, {expr}))", (n, n), 625.0),
    ])
    b.add(expr, shape, bound=bound, tag="higher:" + expr.split("(")[0])
    return True


def op_complex(b: _Builder) -> bool:
    """Complex intermediates with a real result: FFTs, complex products, ``conj``, ``abs``, ``angle``."""
    var = b.pick(b.floats())
    if var is None:
        return False
    a, bound = b.operand(var, 5.0)
    n = var.shape[-1] if var.shape else 1
    vector_forms = [
        (f"jnp.abs(jnp.fft.fft({a}) + 0.5j)", bound * n + 0.5),
        (f"jnp.fft.irfft(jnp.fft.rfft({a}) * (0.5 - 1.0j), n={n})", 1.2 * bound * n),
        (f"jnp.real(jnp.fft.ifft(jnp.fft.fft({a}) * jnp.conj(jnp.fft.fft(jnp.sin({a})))))", bound * n),
    ] if var.shape else []
    expr, out_bound = b.rng.choice(vector_forms + [
        (f"jnp.abs({a} * (1.0 + 2.0j) + 3.0j)", 3 * bound + 3),  # |.| >= 1.3: smooth
        (f"jnp.angle(jnp.exp(0.5j * {a}) * (2.0 + 1.0j))", 3.2),  # the angle stays inside (-pi, pi)
        (f"jnp.imag(jnp.conj({a} + 1.0j) * jnp.exp(1.0j * {a}))", bound + 1),
        (f"lax.scan(lambda c, t: (c * (0.5 + 0.5j) + t, jnp.real(c * t)), 0.0j, {a}.reshape(-1))[0].real"
         f" * jnp.ones_like({a})", 2 * bound),
    ])
    b.add(expr, var.shape, bound=out_bound, tag="complex:" + expr.split("(")[0])
    return True


OPS = [
    (op_unary, 8), (op_binary, 8), (op_constant, 2), (op_reduce, 4), (op_slice, 3), (op_gather_scatter, 3),
    (op_matrix_structure, 2), (op_concat, 2), (op_reshape, 2), (op_contract, 4), (op_cumulative, 2),
    (op_sort, 2), (op_integer, 3), (op_control, 2), (op_window_update, 1), (op_higher_order, 1), (op_complex, 1),
]


# ------------------------------------------------------------------------------------------------
# programs


def _input_shape(rng: random.Random):
    kind = rng.choice(["scalar", "vector", "vector", "matrix", "matrix"])
    if kind == "scalar":
        return ()
    if kind == "vector":
        return (rng.randint(2, 5),)
    return (rng.randint(2, 4), rng.randint(2, 4))


def _outputs(b: _Builder, n_inputs: int) -> str:
    """The ``return`` expression: 1-3 float values in a tuple, dict, list or bare."""
    rng = b.rng
    floats = [v.name for v in b.floats()]
    names = [floats[-1]]  # the last value, so that the program's tail matters
    for _ in range(rng.randint(0, 2)):
        r = rng.random()
        if r < 0.2:
            names.append(f"v{rng.randrange(n_inputs)}")  # an input, directly
        elif r < 0.3:
            names.append(rng.choice(names))  # the same value twice
        elif r < 0.37:
            names.append(b.const((rng.randint(1, 3),)))  # a constant: its Jacobian is zero
        else:
            names.append(rng.choice(floats))  # often a value later operations read too
    if rng.random() < 0.03:  # a half-precision output: jacrev's blocks keep the input's dtype
        k = rng.randrange(len(names))
        names[k] = f"{names[k]}.astype(jnp.{rng.choice(['float16', 'bfloat16'])})"
    style = rng.choice(["bare", "tuple", "dict", "list", "nested"]) if len(names) > 1 else rng.choice(
        ["bare", "bare", "tuple", "dict"])
    if style == "bare" and len(names) == 1:
        return names[0]
    if style == "dict" or (style == "bare" and len(names) > 1):
        return "{" + ", ".join(f"'out{k}': {n}" for k, n in enumerate(names)) + "}"
    if style == "list":
        return "[" + ", ".join(names) + "]"
    if style == "nested" and len(names) > 1:
        return f"({names[0]}, {{'rest': [{', '.join(names[1:])}]}})"
    return "(" + ", ".join(names) + ",)"


def generate(seed: int, attempt: int = 0, max_ops: int = 25) -> Case:
    """The random program and inputs of ``(seed, attempt)`` with 3..``max_ops`` operations; deterministic."""
    rng = random.Random(f"jaxtool-fuzz:{seed}:{attempt}:{max_ops}")
    b = _Builder(rng)
    n_inputs = rng.randint(1, 3)
    inputs = []
    for _ in range(n_inputs):
        shape = _input_shape(rng)
        inputs.append(np.array([rng.uniform(-1.5, 1.5) for _ in range(_size(shape))], np.float32).reshape(shape))
        b.vars.append(Var(b.fresh(), shape, "f", 1.5))
        b.tags.append("input")
    n_ops = rng.randint(3, max(3, max_ops))
    ops, weights = zip(*OPS)
    while len(b.lines) < n_ops:
        op = rng.choices(ops, weights)[0]
        try:
            op(b)
        except _TooBig:
            pass  # another operation instead
    ret = _outputs(b, n_inputs)
    has_aux = rng.random() < 0.15
    if has_aux:
        ret = f"{ret}, {{'aux': {rng.choice(b.vars).name}}}"
    params = ", ".join(f"v{i}" for i in range(n_inputs))
    consts = "".join(f"{name} = {_array_literal(value)}\n" for name, value in b.consts)
    body = "".join(f"    {line}\n" for line in b.lines)
    source = f"{consts}\n\ndef program({params}):\n{body}    return {ret}\n"
    r = rng.random()
    if n_inputs == 1:
        argnums = 0 if r < 0.5 else (0,)
    elif r < 0.1:
        argnums = rng.randrange(n_inputs)
    elif r < 0.25:
        argnums = tuple(sorted(rng.sample(range(n_inputs), rng.randint(1, n_inputs - 1))))
    else:
        argnums = tuple(range(n_inputs))
    return Case(seed, attempt, tuple(inputs), argnums, has_aux, list(b.lines) + [f"return {ret}"],
                source.lstrip("\n"),
                fun=compile_program(source), tags=[t for t in b.tags if t != "input"],
                types={v.name: ("f32" if v.kind == "f" else "i32", v.shape) for v in b.vars})


def compile_program(source: str):
    """The function ``program`` that ``source`` (with :data:`PRELUDE`'s names in scope) defines."""
    namespace: dict = {}
    exec(compile(PRELUDE, "<prelude>", "exec"), namespace)
    exec(compile(source, "<generated program>", "exec"), namespace)
    return namespace["program"]


# ------------------------------------------------------------------------------------------------
# checking


class Skip(Exception):
    """No valid program for this seed within the attempts allowed."""


MAX_ATTEMPTS = 20


def _finite(tree) -> bool:
    import jax

    return all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree_util.tree_leaves(tree))


def reference(case: Case):
    """``jax.jacrev`` of the case, or None if it fails or is not finite (the case is then regenerated)."""
    import jax

    try:  # XLA reports some failures only when the result is read: read it here
        ref = jax.jit(jax.jacrev(case.fun, argnums=case.argnums, has_aux=case.has_aux))(*case.inputs)
        finite = _finite(ref)
    except Exception:  # noqa: BLE001 - any failure of the reference means "not a valid program"
        return None
    return ref if finite else None


def eliminable(case: Case) -> tuple:
    """The eliminable vertices of the case's elimination problem (traced abstractly: no compile)."""
    import jax

    from jaxtool.jacobian import trace_problem

    box = {}

    def probe(*args):  # (only the vertex numbers leave the trace: the problem holds its values)
        box["eliminable"] = tuple(trace_problem(case.fun, *args, argnums=case.argnums).eliminable)
        return 0.0

    jax.eval_shape(probe, *case.inputs)
    return box["eliminable"]


def orders_for(case: Case, n_random: int = 2) -> list:
    """fwd, rev, markowitz and ``n_random`` random permutations of the eliminable vertices."""
    vertices = list(eliminable(case))
    rng = random.Random(f"jaxtool-orders:{case.seed}:{case.attempt}")
    orders: list = ["fwd", "rev", "markowitz"]
    for _ in range(n_random):
        shuffled = list(vertices)
        rng.shuffle(shuffled)
        orders.append(shuffled)
    return orders


#: How :func:`compare` words a problem of values (as opposed to structure, shape or dtype).
VALUES_DIFFER = "entries differ"


def compare(got, ref, rtol: float = RTOL, atol: float = ATOL) -> list:
    """Differences between a Jacobian pytree and the reference: structure, shapes, dtypes, values.

    Values must satisfy ``|got - ref| <= atol * max(1, max|ref|) + rtol * |ref|`` elementwise (by
    default ``rtol`` = :data:`RTOL`, ``atol`` = :data:`ATOL`), ``max|ref|`` per leaf (the scale of the
    block: entries far below it are rounding noise of sums of larger terms). Returns one message per
    problem; empty if equal.
    """
    import jax

    got_leaves, got_tree = jax.tree_util.tree_flatten(got)
    ref_paths, ref_tree = jax.tree_util.tree_flatten_with_path(ref)
    if got_tree != ref_tree:
        return [f"pytree structure {got_tree} != reference {ref_tree}"]
    problems = []
    for (path, r), g in zip(ref_paths, got_leaves):
        name = jax.tree_util.keystr(path) or "(root)"
        g_shape, g_dtype = np.shape(g), getattr(g, "dtype", type(g).__name__)
        if g_shape != np.shape(r) or g_dtype != r.dtype:
            problems.append(f"leaf {name}: {g_dtype}{list(g_shape)} != reference {r.dtype}{list(np.shape(r))}")
            continue
        g, r = np.asarray(g, np.float64), np.asarray(r, np.float64)
        scale = max(1.0, float(np.max(np.abs(r)))) if r.size else 1.0
        err = np.abs(g - r)
        bad = ~(err <= atol * scale + rtol * np.abs(r))  # NaN counts as bad
        if np.any(bad):
            k = np.unravel_index(int(np.argmax(np.where(bad, np.nan_to_num(err, nan=np.inf), -1))), r.shape)
            problems.append(f"leaf {name}: {int(bad.sum())}/{r.size} {VALUES_DIFFER}; worst at {list(k)}: "
                            f"{g[k]:.7g} vs reference {r[k]:.7g} (block scale {scale:.3g})")
    return problems


@dataclass
class Result:
    """The outcome of one seed: ``failures`` maps an order's label to its problems.

    ``rounding`` holds the problems of the jitted comparison that a second opinion (see
    :func:`check_case`) cleared, for ``reason``: the program decides a discontinuity (a sort key, a
    max, a comparison) on values that two evaluations round differently, or it cancels so that its
    float32 Jacobian is rounding noise.
    """

    case: Case
    failures: dict
    rounding: dict = field(default_factory=dict)
    reason: str = ""  # why ``rounding`` holds the problems

    @property
    def ok(self) -> bool:
        return not self.failures

    def report(self) -> str:
        lines = [self.case.description()]
        for label, problems in (self.failures or self.rounding).items():
            lines.append(f"order {label}:")
            lines += ["  " + p for p in problems]
        return "\n".join(lines)


def tolerances(case: Case) -> dict:
    """:func:`compare`'s tolerances for ``case`` (:data:`TOLERANCES`)."""
    rtol, atol = TOLERANCES[case.dtype]
    return {"rtol": rtol, "atol": atol}


def label(order) -> str:
    """A short name for an order: its name, or ``random[v1,v2,...]``."""
    return order if isinstance(order, str) else "random[" + ",".join(map(str, order)) + "]"


def _crash(e: Exception) -> list:
    text = str(e).strip()
    return [f"crashed: {type(e).__name__}: {text.splitlines()[0][:300] if text else ''}"]


def check_case(case: Case, n_random: int = 2):
    """``Result`` of comparing ``jacve`` in every order with ``jacrev`` on ``case``, or None if invalid.

    The reference and all orders are staged in one ``jax.jit`` (one XLA compilation instead of one
    per order; ``jacve`` is built to compose with ``jit``). Only if that fails is each part run on
    its own, to tell an invalid program (``jacrev`` fails) from an engine crash. Problems of values
    only are reported in ``Result.rounding`` instead of ``Result.failures`` where the reference
    differentiates another branch than the program takes (:func:`_reference_branch_differs`),
    where an eager second opinion passes (:func:`_eager_failures`; the reason then says whether the
    jitted reference alone differs, or the compilation without XLA's optimisations,
    :func:`_optimized_failures`), or where the float32 reference
    is itself rounding noise (:func:`_float32_reference_is_noise`) and a float64 second opinion
    passes (:func:`_float64_failures`).
    """
    import jax

    try:
        orders = orders_for(case, n_random)
    except Exception as e:  # noqa: BLE001 - an engine crash is a finding, unless the program is invalid
        return None if reference(case) is None else Result(case, {"trace_problem": _crash(e)})
    jacobians = _jacobians(case, orders)
    jacrev = jax.jacrev(case.fun, argnums=case.argnums, has_aux=case.has_aux)
    try:
        ref, gots = jax.block_until_ready(jax.jit(lambda *a: (jacrev(*a), [j(*a) for j in jacobians]))(*case.inputs))
    except Exception:  # noqa: BLE001 - find out which part failed
        ref = reference(case)
        if ref is None:
            return None
        failures = _order_failures(case, orders, jacobians, ref)
    else:
        if not _finite(ref):
            return None
        failures = {label(o): p for o, got in zip(orders, gots) if (p := compare(got, ref, **tolerances(case)))}
    values_only = all(VALUES_DIFFER in p for problems in failures.values() for p in problems)
    reason = _not_the_engine(case, n_random, orders, jacobians) if failures and values_only else ""
    if reason:
        return Result(case, {}, rounding=failures, reason=reason)
    return Result(case, failures)


def _not_the_engine(case: Case, n_random: int, orders, jacobians) -> str:
    """Why differences of values are not engine bugs (rounding artefacts, or the jitted reference
    alone is off); "" if they are."""
    if _reference_branch_differs(case):
        return "the primal output jax.jacrev differentiates differs from the program's own output"
    if not _eager_failures(case, n_random):
        if _only_the_jitted_reference_differs(case, orders, jacobians):
            return ("jax.jit(jax.jacrev) alone differs: eager jax.jacrev, jax.jit(jax.jacfwd) and every jacve "
                    "order agree")
        if not _optimized_failures(case, orders, jacobians):
            return ("XLA without its optimisations alone differs: compiled with them (as JAX compiles by "
                    "default), jax.jacrev and every jacve order agree")
        return "jacve and jax.jacrev agree when both run eagerly"
    if case.dtype != "float32":
        if case.dtype == "float64" and _computes_in_float32(case) \
                and not _float32_tolerance_failures(case, orders, jacobians):
            return ("the program computes some values in float32 (a cast, a float32 buffer), and jacve and "
                    "jax.jacrev agree to float32's tolerance")
        return ""
    if _float32_reference_is_noise(case) and not _float64_failures(case, n_random):
        return ("jax.jacrev's float32 Jacobian is itself off its float64 value by more than the tolerance, "
                "and jacve and jax.jacrev agree in float64")
    return ""


def _reference_branch_differs(case: Case) -> bool:
    """Whether the primal output ``jax.jacrev`` differentiates differs from the program's own output.

    JAX's AD evaluates some primitives' primal values by another computation than the primitive
    itself (``cumsum``, ``cumlogsumexp``, ``cummax`` and ``cumprod`` through an associative scan),
    which rounds differently. A discontinuity decided on such a value (a sort key tied up to
    rounding) can then take another branch than the program does, and the reference is the
    Jacobian of that branch, not of the program's (jaxtool differentiates the program's own values).
    """
    import jax

    def with_primal(*args):
        result = case.fun(*args)
        out = result[0] if case.has_aux else result
        return out, out

    _, primal = jax.jit(jax.jacrev(with_primal, argnums=case.argnums, has_aux=True))(*case.inputs)
    own = jax.jit(with_primal)(*case.inputs)[0]
    return bool(compare(primal, own, **tolerances(case)))


def _only_the_jitted_reference_differs(case: Case, orders, jacobians) -> bool:
    """Whether eager ``jax.jacrev``, ``jax.jit(jax.jacfwd)`` and every order's (staged) ``jacve``
    agree, so that of all of them only the reference, ``jax.jit(jax.jacrev)``, differs: JAX 0.10.2
    has such programs (``jax.jit(jax.jacrev(lambda v: jnp.cumsum(v)[2]))`` of 5 elements returns
    all ones on XLA:CPU; see the anchor cases in ``tests/test_engine.py``)."""
    import jax

    with jax.disable_jit():
        eager = jax.jacrev(case.fun, argnums=case.argnums, has_aux=case.has_aux)(*case.inputs)
    try:
        forward = jax.jit(jax.jacfwd(case.fun, argnums=case.argnums, has_aux=case.has_aux))(*case.inputs)
    except TypeError:  # no forward mode (a custom_vjp function): no third opinion (seed 134282)
        return False
    return not compare(forward, eager, **tolerances(case)) and not _order_failures(case, orders, jacobians, eager)


def _optimized_failures(case: Case, orders, jacobians) -> dict:
    """The problems of every order when the reference and ``jacve`` are compiled with XLA's
    optimisations, which :func:`quick_compilation` turns off for the checks: XLA:CPU (JAX 0.10.2)
    without them computes some fused scalar programs wrongly. Seed 101906: inside a fusion,
    0.273 + -0.0 gave 0, and a Jacobian entry -0.041 instead of 0.225, in jacve's fwd and markowitz
    orders and a random one, each compiled alone, and in jax.jit(jax.jacrev) where the checker
    compiles it in one program with them (XLA merges their common computations); with the
    optimisations every one is right."""
    import jax

    from jaxtool.jacobian import clear_caches

    quick = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", False)
    jax.clear_caches()
    clear_caches()
    try:
        ref = jax.jit(jax.jacrev(case.fun, argnums=case.argnums, has_aux=case.has_aux))(*case.inputs)
        return _order_failures(case, orders, jacobians, ref)
    finally:
        jax.config.update("jax_disable_most_optimizations", quick)
        jax.clear_caches()
        clear_caches()


def _eager_failures(case: Case, n_random: int) -> dict:
    """The problems of every order when the reference and ``jacve`` both run eagerly (``jax.disable_jit``).

    Asked only where every jitted problem is one of values: a crash, or a wrong structure, shape or
    dtype, is a failure whatever the second opinion says. Jitted, XLA fuses the reference's primal
    computation and jaxtool's differently, and a value can round differently by an ulp in each.
    Where the program makes a discontinuous decision on it (a sort key tied up to rounding, the
    location of a max), the two Jacobians are then of different, equally valid branches, and with
    XLA's optimisations off even ``jax.jacrev`` alone can disagree with ``jax.jacfwd``. Eagerly,
    every primitive runs on its own and both read identical primal values: an engine bug shows
    there too, a rounding artefact does not. (Eager tracing inlines what jitted tracing keeps as
    calls, so the vertices differ: the random orders are drawn afresh.)
    """
    import jax

    with jax.disable_jit():
        try:
            ref = jax.jacrev(case.fun, argnums=case.argnums, has_aux=case.has_aux)(*case.inputs)
        except Exception as e:  # noqa: BLE001 - no eager reference: the jitted verdict stands
            return {"eager jax.jacrev": _crash(e)}
        orders = orders_for(case, n_random)
        return _order_failures(case, orders, _jacobians(case, orders), ref)


def _computes_in_float32(case: Case) -> bool:
    """Whether the program of a float64 case (:attr:`Case.dtype`) computes some values in a narrower
    floating type (``astype(jnp.float32)`` of a comparison, a scatter into such an array): rounded
    there, they differ between two evaluation orders by float32's rounding, not float64's."""
    import jax

    from jaxtool.printing import subjaxprs

    def narrow(jaxpr) -> bool:
        for eqn in jaxpr.eqns:
            dtypes = [np.dtype(v.aval.dtype) for v in eqn.outvars if hasattr(v.aval, "dtype")]
            if any(d.kind in "fc" and d.itemsize < (8 if d.kind == "f" else 16) for d in dtypes):
                return True
            if any(narrow(sub) for _, _, sub in subjaxprs(eqn.params)):
                return True
        return False

    return narrow(jax.make_jaxpr(case.fun)(*case.inputs).jaxpr)


def _float32_tolerance_failures(case: Case, orders, jacobians) -> dict:
    """The problems of every order of a float64 case at float32's tolerances (:data:`RTOL`, :data:`ATOL`)."""
    import jax

    ref = jax.jit(jax.jacrev(case.fun, argnums=case.argnums, has_aux=case.has_aux))(*case.inputs)
    return _order_failures(case, orders, jacobians, ref, {"rtol": RTOL, "atol": ATOL})


def _in_float64(case: Case) -> Case:
    """The case with its inputs in float64 (evaluate it under ``jax.enable_x64``)."""
    return replace(case, inputs=tuple(np.asarray(x, np.float64) for x in case.inputs))


def _float32_reference_is_noise(case: Case) -> bool:
    """Whether ``jax.jacrev``'s float32 Jacobian differs from its float64 one beyond the tolerance.

    A program that cancels (``1 + tanh(z)`` for z near -5, a difference of nearly equal sums) has
    float32 Jacobian entries that are rounding noise: any two evaluation orders of the same
    mathematics, the reference's and jaxtool's among them, disagree there by up to the noise.
    """
    import jax

    ref32 = jax.jit(jax.jacrev(case.fun, argnums=case.argnums, has_aux=case.has_aux))(*case.inputs)
    with jax.enable_x64(True):
        wide = _in_float64(case)
        ref64 = jax.jit(jax.jacrev(wide.fun, argnums=wide.argnums, has_aux=wide.has_aux))(*wide.inputs)
        ref64 = jax.tree_util.tree_map(lambda x, like: np.asarray(x, np.asarray(like).dtype), ref64, ref32)
    return bool(compare(ref32, ref64))


def _float64_failures(case: Case, n_random: int) -> dict:
    """The problems of every order when the reference and ``jacve`` both run in float64.

    Asked, like :func:`_eager_failures`, only where every float32 problem is one of values, and only
    where the float32 reference is itself rounding noise (:func:`_float32_reference_is_noise`). An
    engine bug (a lost or doubled term, a wrong index) is independent of the precision and shows in
    float64 too; float32 rounding noise of about 1e-5 shrinks to about 1e-14. Programs that cast to
    float32 keep those parts in float32, so where they cancel the verdict stays "failed".
    """
    import jax

    with jax.enable_x64(True):
        wide = _in_float64(case)
        try:
            ref = jax.jit(jax.jacrev(wide.fun, argnums=wide.argnums, has_aux=wide.has_aux))(*wide.inputs)
        except Exception as e:  # noqa: BLE001 - no float64 reference: the float32 verdict stands
            return {"float64 jax.jacrev": _crash(e)}
        orders = orders_for(wide, n_random)
        return _order_failures(wide, orders, _jacobians(wide, orders), ref)


def _jacobians(case: Case, orders) -> list:
    """``jaxtool.jacve`` of the case, one per order."""
    import jaxtool

    return [jaxtool.jacve(case.fun, order=o, argnums=case.argnums, has_aux=case.has_aux) for o in orders]


def _order_failures(case: Case, orders, jacobians, ref, tolerance=None) -> dict:
    """``label -> problems`` of each order whose Jacobian differs from ``ref`` or crashes, beyond
    ``tolerance`` (:func:`compare`'s keywords; by default :func:`tolerances`)."""
    failures = {}
    for order, jacobian in zip(orders, jacobians):
        try:
            problems = compare(jacobian(*case.inputs), ref, **(tolerance or tolerances(case)))
        except Exception as e:  # noqa: BLE001 - an engine crash is a finding
            problems = _crash(e)
        if problems:
            failures[label(order)] = problems
    return failures


def generated(seed: int, attempt: int = 0, max_ops: int = 25, dtype: str = "float32") -> Case:
    """:func:`generate`'s case, with inputs of ``dtype`` (:attr:`Case.dtype`; float64: to be run under
    ``jax.enable_x64``)."""
    import jax.numpy as jnp

    case = generate(seed, attempt, max_ops)
    return replace(case, dtype=dtype, inputs=tuple(np.asarray(x, jnp.dtype(dtype)) for x in case.inputs))


def check_seed(seed: int, n_random: int = 2, max_ops: int = 25, dtype: str = "float32") -> Result:
    """Check the first valid attempt of ``seed`` (see :func:`check_case`), on inputs of ``dtype``
    (:func:`generated`); :class:`Skip` if none is valid."""
    import jax

    with jax.enable_x64(True) if dtype == "float64" else contextlib.nullcontext():
        for attempt in range(MAX_ATTEMPTS):
            result = check_case(generated(seed, attempt, max_ops, dtype), n_random)
            if result is not None:
                return result
    raise Skip(f"seed {seed}: no valid program in {MAX_ATTEMPTS} attempts")


def check_seed_outcome(seed: int, n_random: int = 2, max_ops: int = 25, reproducer: bool = True,
                       dtype: str = "float32") -> tuple:
    """``(status, report)`` of :func:`check_seed` (on inputs of ``dtype``) as plain data, for worker processes.

    ``status`` is "passed", "failed" (a crash of the checker itself is a failure too, reported with
    its traceback; with ``reproducer`` the report ends with a reproducer script), "rounding" (the
    comparison failed and a second opinion cleared it; the report says which and where) or
    "skipped" (no valid program).
    """
    import traceback

    try:
        result = check_seed(seed, n_random, max_ops, dtype)
    except Skip as e:
        return "skipped", str(e)
    except Exception:  # noqa: BLE001 - report it with the seed instead of losing the whole run
        return "failed", f"seed {seed}: the checker crashed\n{traceback.format_exc()}"
    if result.rounding:
        return "rounding", (f"jacve differs from jacrev, not an engine bug ({result.reason}):\n"
                            + result.report())
    if result.ok:
        return "passed", ""
    report = "jacve differs from jacrev:\n" + result.report()
    return "failed", report + ("\n\nreproducer:\n" + result.case.reproducer() if reproducer else "")


def quick_compilation() -> None:
    """Compile with LLVM at -O0 (``jax_disable_most_optimizations``): for these tiny programs its
    optimisations cost far more time than they save (about a quarter of each check), and they do not
    change what is compared. Except under XLA:CPU's older loop emitters (the test suite's, see
    ``tests/conftest.py``), which compile quickly already and, at -O0, compute ``jnp.hypot``
    differently in different kernels of one program (seeds 15, 126, 152, 219: a compiled ``jax.jacrev``
    then differs from a compiled Jacobian, where the two agree eagerly)."""
    import os

    import jax

    legacy_emitters = "--xla_cpu_use_fusion_emitters=false" in os.environ.get("XLA_FLAGS", "").split()
    jax.config.update("jax_disable_most_optimizations", not legacy_emitters)


#: the engine's size thresholds (module -> name -> value) shrunk so far that the paths for large
#: partials (densified in parts, bundled, replayed, contracted by ``dot_general``, ...) run on these
#: small programs: the thresholds choose how a Jacobian is computed, never what it is
SMALL_THRESHOLDS = {
    "partials": {"SMALL_DENSE": 2, "MAX_DEPTH": 2, "MAX_REPLAYED": 4, "SMALL_CONTRACTION": 2, "UNROLLED_SUM": 1,
                 "POINT_SUM": 1, "MAX_PARTS": 2},
    "rules": {"MAX_PARTS": 2},
    "bundles": {"MIN_STORED": 1, "MAX_STORED": 4},
    "sharing": {"ROW": 1, "ROWS": 2, "COPY_COST": 1, "ONCE_SIZE": 1},
    "graph": {"FOLDED_SIZE": 2},
}


def thresholds() -> dict:
    """The engine's current values of the thresholds :data:`SMALL_THRESHOLDS` names."""
    import importlib

    return {name: {attribute: getattr(importlib.import_module(f"jaxtool.{name}"), attribute) for attribute in values}
            for name, values in SMALL_THRESHOLDS.items()}


def set_thresholds(values: dict) -> None:
    """Set the engine's thresholds to ``values`` (as :data:`SMALL_THRESHOLDS`)."""
    import importlib

    for name, settings in values.items():
        module = importlib.import_module(f"jaxtool.{name}")
        for attribute, value in settings.items():
            setattr(module, attribute, value)


@contextlib.contextmanager
def small_thresholds():
    """Within: the engine's thresholds are :data:`SMALL_THRESHOLDS` (its caches emptied on the way
    in and out: a cached plan or staged Jacobian was made under the thresholds of its time)."""
    from jaxtool.jacobian import clear_caches

    previous = thresholds()
    set_thresholds(SMALL_THRESHOLDS)
    clear_caches()
    try:
        yield
    finally:
        set_thresholds(previous)
        clear_caches()
