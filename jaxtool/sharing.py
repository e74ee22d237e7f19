"""Computing each shared scalar of a staged Jacobian once on XLA:CPU.

Eliminating the vertices of a program of scalars (roe_flux_1d, black_scholes_jacobian) leaves
many scalar products and sums that several Jacobian entries read. XLA:CPU fuses each entry into a
loop kernel of its own and copies into every such kernel the cheap arithmetic it reads (additions,
multiplications: it only keeps divisions, roots and transcendental functions apart), however many
kernels share it. roe_flux_1d's reverse-order Jacobian, 525 equations, compiles to 18 kernels that
hold 1756 flops between them. Besides repeating work this crosses a line that costs more than the
work: XLA:CPU runs a call whose compiled program it counts at fewer than 1000 flops on the calling
thread, and hands any other call to a worker thread (20-40 us on a 2-CPU VM; ``make bench``'s
*hand-off* column).

XLA copies a value into its consumers' kernels only if every consumer can take it in. A
concatenation of more than 8 operands cannot: XLA:CPU emits it as a kernel of its own. So
:data:`materialize_p` gathers each stage's shared scalars into rows of at most 8 (a row's
concatenation fuses with the arithmetic that makes its values: one kernel per row), concatenates
9 or more rows (repeating the first where there are fewer), and reads each value back from that
buffer with a gather at a constant index. roe_flux_1d's Jacobian then compiles to 599 flops in 67
kernels and runs on the calling thread.

This is a property of XLA:CPU's fusion heuristics, so :data:`materialize_p` is lowered so only for
CPU; elsewhere, and under ``jax.vmap`` (where the values are batches, and copying a batch
into each kernel costs less than a round trip through memory), it is the identity. Its
derivatives are the identity too.
"""

from __future__ import annotations

import collections

import numpy as np

import jax
import jax.numpy as jnp
from jax.extend import core as jcore
from jax.extend.core import primitives as P
from jax.interpreters import ad, batching, mlir

#: values per row: XLA:CPU fuses a concatenation of at most this many operands with its producers
ROW = 8
#: rows at least: a concatenation of more operands than ROW is a kernel of its own
ROWS = ROW + 1

#: the cheap elementwise primitives of two or more operands whose results XLA:CPU copies into
#: every kernel that reads them (a unary one reads no more than its copy would, and expensive ones,
#: division included, XLA:CPU computes once already)
_COPIED = frozenset({P.mul_p, P.add_p, P.sub_p, P.max_p, P.min_p, P.select_n_p, P.clamp_p, ad.add_jaxvals_p})

materialize_p = jcore.Primitive("materialize_scalars")
materialize_p.multiple_results = True
materialize_p.def_impl(lambda *xs: list(xs))
materialize_p.def_abstract_eval(lambda *avals: list(avals))
mlir.register_lowering(materialize_p, mlir.lower_fun(lambda *xs: list(xs), multiple_results=True))


def _through_one_buffer(*xs):
    """``xs`` (scalars of one dtype), each read back from one buffer that XLA:CPU computes once."""
    values = list(xs) + [xs[0]] * (-len(xs) % ROW)
    rows = [jnp.stack(values[i:i + ROW])[None] for i in range(0, len(values), ROW)]
    rows += rows[:1] * (ROWS - len(rows))
    buffer = jnp.concatenate(rows).reshape(-1)
    taken = buffer.at[np.arange(len(xs))].get(mode="promise_in_bounds")
    return [taken[i] for i in range(len(xs))]


mlir.register_lowering(materialize_p, mlir.lower_fun(_through_one_buffer, multiple_results=True),
                       platform="cpu")


def _materialize_jvp(primals, tangents):
    return materialize_p.bind(*primals), list(tangents)


def _materialize_batched(args, dims):
    return list(args), list(dims)


ad.primitive_jvps[materialize_p] = _materialize_jvp
batching.primitive_batchers[materialize_p] = _materialize_batched


def of_scalars(args) -> bool:
    """Whether every floating-point array among ``args`` is a scalar: programs of scalars are the
    ones whose Jacobians :func:`call_sharing_scalars` helps (and tracing them twice is cheap)."""
    floats = [x for x in args if jnp.issubdtype(jax.typeof(x).dtype, jnp.floating)]
    return bool(floats) and all(jax.typeof(x).shape == () for x in floats)


def _is_shared(eqn, uses) -> bool:
    """Whether ``eqn`` makes a scalar that XLA:CPU would copy into each of several kernels."""
    if eqn.primitive not in _COPIED or len(eqn.outvars) != 1:
        return False
    aval = eqn.outvars[0].aval
    operands = {v for v in eqn.invars if not isinstance(v, jcore.Literal)}
    return (aval.shape == () and jnp.issubdtype(aval.dtype, jnp.floating) and len(operands) >= 2
            and uses[eqn.outvars[0]] >= 2)


def _stages(jaxpr, shared) -> list:
    """Each equation's stage: how many shared values lie on its longest path from the inputs.
    Ordered by stage, the shared values of one stage are all made before any equation reads one."""
    stage, stages = {}, []
    for eqn in jaxpr.eqns:
        s = max((stage.get(v, 0) + (v in shared) for v in eqn.invars if not isinstance(v, jcore.Literal)),
                default=0)
        stages.append(s)
        stage.update((v, s) for v in eqn.outvars)
    return stages


def call_sharing_scalars(fun, args) -> object:
    """``fun(*args)``, with the scalars that its computation shares made once on XLA:CPU: ``fun``
    is traced to a jaxpr, whose equations are replayed stage by stage (:func:`_stages`), each
    stage's shared scalars passed through :data:`materialize_p` before the next stage reads them.
    A jaxpr with effects is replayed as it is (reordering could reorder its effects)."""
    closed, out_shape = jax.make_jaxpr(fun, return_shape=True)(*args)
    out_tree = jax.tree_util.tree_structure(out_shape)
    jaxpr = closed.jaxpr
    if jaxpr.effects:
        return jax.tree_util.tree_unflatten(out_tree, jcore.jaxpr_as_fun(closed)(*args))
    uses = collections.Counter(v for eqn in jaxpr.eqns for v in eqn.invars if not isinstance(v, jcore.Literal))
    uses.update(v for v in jaxpr.outvars if not isinstance(v, jcore.Literal))
    shared = {eqn.outvars[0] for eqn in jaxpr.eqns if _is_shared(eqn, uses)}
    stages = _stages(jaxpr, shared)
    env = dict(zip(jaxpr.constvars, closed.consts))
    env.update(zip(jaxpr.invars, args))

    def read(v):
        return v.val if isinstance(v, jcore.Literal) else env[v]

    pending = []

    def materialize():
        by_dtype = collections.defaultdict(list)
        for v in pending:
            by_dtype[v.aval.dtype].append(v)
        for group in by_dtype.values():
            env.update(zip(group, materialize_p.bind(*(env[v] for v in group))))
        pending.clear()

    current = 0
    for index in sorted(range(len(jaxpr.eqns)), key=lambda i: (stages[i], i)):
        eqn = jaxpr.eqns[index]
        if stages[index] != current:
            materialize()
            current = stages[index]
        out = eqn.primitive.bind(*map(read, eqn.invars), **eqn.primitive.get_bind_params(eqn.params))
        env.update(zip(eqn.outvars, out if eqn.primitive.multiple_results else [out]))
        pending.extend(v for v in eqn.outvars if v in shared)
    materialize()
    return jax.tree_util.tree_unflatten(out_tree, [read(v) for v in jaxpr.outvars])
