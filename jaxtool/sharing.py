"""Computing each shared value of a staged Jacobian once on XLA:CPU.

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
concatenation fuses with the arithmetic that makes its values: one kernel per row; rows are 1 x 8
arrays, as XLA would merge 1-D concatenations of 1-D concatenations into one), concatenates 9 or
more rows (repeating the first where there are fewer), and reads each value back from that buffer
with a gather at constant indices. roe_flux_1d's reverse-order Jacobian then compiles to 504 flops
in 72 kernels and runs on the calling thread. Only programs that this takes under the line are
changed (:func:`crosses_the_line`): elsewhere the extra kernels cost more than the copies they save.

This is a property of XLA:CPU's fusion heuristics, so :data:`materialize_p` is lowered so only for
CPU; elsewhere, and under ``jax.vmap`` (where the values are batches, and copying a batch into each
kernel cost less than a round trip through memory: roe_flux_1d over 1024 points, 263 us as it is
and 401 us so), it is the identity. Its derivatives are the identity too.

Sines, cosines and tangents are the exception XLA:CPU makes too: it counts them cheap and copies
them into every kernel that reads them, though each is a polynomial of tens of operations. The
forward-order Jacobian of robot_arm_6dof reads its 12 sines and cosines (and their derivatives)
from kernels that compute 106 of them; vmapped over 1024 points, that was most of its time.
:data:`once_p` passes such values, where several equations read them, through a buffer XLA cannot
fuse (a concatenation of more than 8 pieces) wherever they are large enough for the round trip to
cost less than the copies (:data:`ONCE_SIZE` elements, as they are under ``jax.vmap``), on XLA:CPU.

The same copying repeats sums of arrays. A small contraction is written out, a broadcast product
and its sum of slices (:mod:`jaxtool.partials`), so that XLA fuses it with its neighbours; in
reverse order its result (an output's Jacobian with respect to a vertex) is then multiplied by
every in-edge partial of that vertex, and XLA copies the whole sum into each of those kernels,
and the sums it reads into each copy. The encoder's reverse-order Jacobian at a point compiled
to 26010 flops where its elimination counts 6718 operations (``jax.jacrev``'s: 13530).
:func:`call_sharing` finds these contractions (:func:`_copied_contractions`: each is one
:data:`~jaxtool.point_forms.two_forms_p` equation) and makes each once, its result read back
through a ``gather`` at constant indices (:func:`_made_once`), which XLA:CPU fuses into no consumer:
13892 flops, 51.3 us a call instead of 58.6 us, 1.16 s to the first call instead of 1.49 s
(markowitz: 50.7 us, 0.98 s instead of 59.1 us, 1.22 s; over 1024 points, 2.4 ms and 1.8 ms instead
of 4.2 ms and 5.1 ms; ``jax.jacrev``: 84 us, 0.80 s, 10.7 ms; pinned to one CPU, interleaved).
"""

from __future__ import annotations

import collections
import itertools
import math
from dataclasses import dataclass

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jcore
from jax.extend.core import primitives as P
from jax.interpreters import ad, batching, mlir

from jaxtool.graph import bind
from jaxtool.point_forms import two_forms_p

#: values per row: XLA:CPU fuses a concatenation of at most this many operands with its producers
ROW = 8
#: rows at least: a concatenation of more operands than ROW is a kernel of its own
ROWS = ROW + 1

#: elementwise primitives XLA:CPU copies into every kernel that reads their result (it computes
#: division, roots, exp, log and the like once, in a kernel of their own), with the operations each
#: amounts to: erf and its kin are expanded into polynomials of tens of operations
_COPIED = {p: 1 for p in (P.mul_p, P.add_p, P.sub_p, P.max_p, P.min_p, P.select_n_p, P.clamp_p, ad.add_jaxvals_p,
                          P.neg_p, P.abs_p, P.sign_p, P.square_p, P.integer_pow_p, P.sin_p, P.cos_p,
                          P.convert_element_type_p, P.copy_p)}
_COPIED.update({p: 20 for p in (P.erf_p, P.erfc_p, P.erf_inv_p, P.lgamma_p, P.digamma_p)})
#: a value read by several kernels is made once if a copy of it would cost at least this many
#: operations, or if it reads two values or more (copying it then reads more than the copy saves)
COPY_COST = 3
#: XLA:CPU runs a call whose compiled program it counts at fewer flops than this on the calling thread
CHEAP_FLOPS = 1000
#: elementwise primitives XLA:CPU copies into every kernel that reads their result, though each
#: is a polynomial of tens of operations (it keeps exp, log, atan2 and the like apart)
DEAR = (P.sin_p, P.cos_p, P.tan_p)
#: values of :data:`DEAR` primitives read by several equations are made once where they have at
#: least this many elements between them (:data:`once_p`): robot_arm_6dof's reverse-order
#: Jacobian over 1024 points took 0.27 ms so, 0.75 ms as it was (``jax.jacfwd``: 1.2 ms)
ONCE_SIZE = 1024


def _passing_through(name: str, on_cpu, batched) -> jcore.Primitive:
    """A primitive that returns its operands (arrays, any number): so in its impl, its JVP (the
    tangents pass through too) and its lowering but for XLA:CPU's, ``on_cpu``; ``batched`` is its
    batching rule."""
    primitive = jcore.Primitive(name)
    primitive.multiple_results = True
    primitive.def_impl(lambda *xs: list(xs))
    primitive.def_abstract_eval(lambda *avals: list(avals))
    mlir.register_lowering(primitive, mlir.lower_fun(lambda *xs: list(xs), multiple_results=True))
    mlir.register_lowering(primitive, mlir.lower_fun(on_cpu, multiple_results=True), platform="cpu")
    ad.primitive_jvps[primitive] = lambda primals, tangents: (primitive.bind(*primals), list(tangents))
    batching.primitive_batchers[primitive] = batched
    return primitive


def _through_one_buffer(*xs):
    """``xs`` (scalars of one dtype), each read back from one buffer that XLA:CPU computes once."""
    count = len(xs)
    values = [lax.reshape(x, (1, 1)) for x in xs]
    values += values[:1] * (-count % ROW)
    rows = [lax.concatenate(values[i:i + ROW], 1) for i in range(0, len(values), ROW)]
    rows += rows[:1] * (ROWS - len(rows))
    buffer = lax.reshape(lax.concatenate(rows, 0), (len(rows) * ROW,))
    taken = lax.gather(buffer, np.arange(count, dtype=np.int32)[:, None],
                       lax.GatherDimensionNumbers(offset_dims=(), collapsed_slice_dims=(0,), start_index_map=(0,)),
                       slice_sizes=(1,), mode=lax.GatherScatterMode.PROMISE_IN_BOUNDS)
    return [lax.reshape(lax.slice(taken, (i,), (i + 1,)), ()) for i in range(count)]


#: the identity under jax.vmap (see the module docstring)
materialize_p = _passing_through("materialize_scalars", _through_one_buffer,
                                 lambda args, dims: (list(args), list(dims)))


def _once_through_a_buffer(*xs):
    """``xs`` (arrays of one dtype), read back from a buffer that XLA:CPU computes once: one row
    each (padded to the longest), at least :data:`ROWS` rows (the first repeated), concatenated (a
    kernel of its own) and gathered back at constant indices. ``xs`` themselves where they have
    fewer than :data:`ONCE_SIZE` elements between them."""
    sizes = [math.prod(x.shape) for x in xs]
    if sum(sizes) < ONCE_SIZE:
        return list(xs)
    length = max(sizes)
    rows = [lax.reshape(lax.pad(lax.reshape(x, (size,)), lax.full((), 0, x.dtype), [(0, length - size, 0)]),
                        (1, length)) for x, size in zip(xs, sizes)]
    rows += rows[:1] * (ROWS - len(rows))
    taken = lax.gather(lax.concatenate(rows, 0), np.arange(len(rows), dtype=np.int32)[:, None],
                       lax.GatherDimensionNumbers(offset_dims=(1,), collapsed_slice_dims=(0,), start_index_map=(0,)),
                       slice_sizes=(1, length), mode=lax.GatherScatterMode.PROMISE_IN_BOUNDS)
    return [lax.reshape(lax.slice(taken, (n, 0), (n + 1, size)), x.shape) for n, (x, size) in enumerate(zip(xs, sizes))]


#: itself under jax.vmap, of the batches: large enough there to be made once
once_p = _passing_through("computed_once", _once_through_a_buffer,
                          lambda args, dims: (once_p.bind(*args), list(dims)))


def of_scalars(args) -> bool:
    """Whether every floating-point array among ``args`` is a scalar: programs of scalars are the
    ones whose Jacobians :data:`materialize_p` helps (see :func:`call_sharing`)."""
    floats = [x for x in args if jnp.issubdtype(jax.typeof(x).dtype, jnp.floating)]
    return bool(floats) and all(jax.typeof(x).shape == () for x in floats)


def _variables(atoms) -> list:
    """The variables among ``atoms`` (a jaxpr's equation inputs or outputs), literals left out."""
    return [v for v in atoms if not isinstance(v, jcore.Literal)]


def _shared(jaxpr, uses) -> set:
    """The scalars of ``jaxpr`` that XLA:CPU would copy into each of several kernels, where a copy
    costs enough (:data:`COPY_COST`): a copy of a value repeats every copied operation back to the
    values made once (inputs, shared values, the results of other primitives)."""
    shared, cost = set(), {}
    for eqn in jaxpr.eqns:
        if eqn.primitive not in _COPIED or len(eqn.outvars) != 1:
            continue
        out = eqn.outvars[0]
        operands = set(_variables(eqn.invars))
        cost[out] = _COPIED[eqn.primitive] + sum(cost.get(v, 0) for v in operands)
        if (out.aval.shape == () and jnp.issubdtype(out.aval.dtype, jnp.floating) and uses[out] >= 2
                and (len(operands) >= 2 or cost[out] >= COPY_COST)):
            shared.add(out)
            cost[out] = 0
    return shared


def _copied_flops(jaxpr, made_once=frozenset()) -> int:
    """About the flops XLA:CPU counts in ``jaxpr`` compiled with the values ``made_once`` made once:
    a kernel per output and per equation of another primitive, each holding the copied operations
    its operands are made of (back to inputs, ``made_once`` and results of other primitives)."""
    made_by = {eqn.outvars[0]: eqn for eqn in jaxpr.eqns
               if eqn.primitive in _COPIED and len(eqn.outvars) == 1 and eqn.outvars[0] not in made_once}

    def copies(values) -> int:
        seen, stack, flops = set(), _variables(values), 0
        while stack:
            eqn = made_by.get(stack.pop())
            if eqn is not None and id(eqn) not in seen:
                seen.add(id(eqn))
                flops += _COPIED[eqn.primitive]
                stack.extend(_variables(eqn.invars))
        return flops

    copied = {id(eqn) for eqn in made_by.values()}
    kernels = [eqn.invars for eqn in jaxpr.eqns if id(eqn) not in copied]
    kernels += [[v] for v in set(_variables(jaxpr.outvars))]
    return sum(copies(operands) + 1 for operands in kernels)


def crosses_the_line(jaxpr, shared) -> bool:
    """Whether making ``shared`` once takes ``jaxpr`` under :data:`CHEAP_FLOPS` (:func:`_copied_flops`).
    Elsewhere the extra kernels cost more than the copies they save: under the line already, or
    above it still (roe_flux_1d composed with itself, rev: 4852 flops as it is, 1236 so, and
    130 us against 144 us a call)."""
    return _copied_flops(jaxpr, shared) < CHEAP_FLOPS <= _copied_flops(jaxpr)


def _stages(jaxpr, shared) -> list:
    """Each equation's stage: how many shared values lie on its longest path from the inputs.
    Ordered by stage, the shared values of one stage are all made before any equation reads one."""
    stage, stages = {}, []
    for eqn in jaxpr.eqns:
        s = max((stage.get(v, 0) + (v in shared) for v in _variables(eqn.invars)), default=0)
        stages.append(s)
        stage.update((v, s) for v in eqn.outvars)
    return stages


def reads_dear(program) -> bool:
    """Whether a flat program (:class:`jaxtool.graph.FlatProgram`) computes a :data:`DEAR` primitive."""
    return any(eqn.primitive in DEAR for eqn in program.eqns)


def contracts(program) -> bool:
    """Whether a flat program (:class:`jaxtool.graph.FlatProgram`) computes a matrix product or a
    convolution: the dense partials whose products :func:`_copied_contractions` looks for come from
    these (elsewhere the replay that finds none would cost a first call about 8 ms for nothing)."""
    return any(eqn.primitive in (P.dot_general_p, P.conv_general_dilated_p) for eqn in program.eqns)


def _live(jaxpr):
    """``jaxpr`` without the equations whose results nothing reads and that have no effects: the
    pieces of a bundle's product that the next bundle takes whole (:func:`jaxtool.bundles._split`),
    628 of the 1937 equations of the encoder's forward-order Jacobian, are not replayed."""
    needed = set(_variables(jaxpr.outvars))
    kept = []
    for eqn in reversed(jaxpr.eqns):
        if eqn.effects or needed.intersection(eqn.outvars):
            kept.append(eqn)
            needed.update(_variables(eqn.invars))
    return jaxpr.replace(eqns=kept[::-1])


def _one_of_each_dear(jaxpr):
    """``jaxpr`` with each :data:`DEAR` equation that repeats an earlier one (same primitive, operands
    and parameters: the elimination's rules recompute the primal's sines) left out, its readers
    reading the earlier one's result: several equations then read that one."""
    renamed, seen, eqns = {}, {}, []

    def read(atoms) -> list:
        return [v if isinstance(v, jcore.Literal) else renamed.get(v, v) for v in atoms]

    for eqn in jaxpr.eqns:
        invars = read(eqn.invars)
        eqn = eqn.replace(invars=invars)
        if eqn.primitive in DEAR and _variables(invars) == invars:
            key = (eqn.primitive, tuple(invars), tuple(sorted((k, repr(p)) for k, p in eqn.params.items())))
            if key in seen:
                renamed[eqn.outvars[0]] = seen[key]
                continue
            seen[key] = eqn.outvars[0]
        eqns.append(eqn)
    return jaxpr.replace(eqns=eqns, outvars=read(jaxpr.outvars))


#: primitives whose results XLA:CPU fuses into the kernels that read them (elementwise arithmetic,
#: and moving values: broadcasts, reshapes, transposes, slices, concatenations, pads, reversals);
#: a written-out contraction or sum (:data:`~jaxtool.point_forms.two_forms_p`) too
_FUSED = set(_COPIED) | {P.broadcast_in_dim_p, P.reshape_p, P.squeeze_p, P.transpose_p, P.slice_p, P.concatenate_p,
                         P.pad_p, P.rev_p, two_forms_p}
#: a written-out contraction is made once where its result reaches at least this many kernels
KERNELS = 2


def _copied_contractions(jaxpr) -> set:
    """The ids of the :data:`~jaxtool.point_forms.two_forms_p` equations of ``jaxpr`` (written out
    at a point) whose array results XLA:CPU would copy into :data:`KERNELS` kernels or more: those
    reached through :data:`_FUSED` primitives alone from the equations (or outputs) that read
    them, counted from the last equation back, the ones chosen already counted as kernels."""
    readers = collections.defaultdict(list)
    for eqn in jaxpr.eqns:
        for v in set(_variables(eqn.invars)):
            readers[v].append(eqn)
    outputs = set(_variables(jaxpr.outvars))
    kernels, chosen = {}, set()
    for eqn in reversed(jaxpr.eqns):
        for out in eqn.outvars:
            reached = {("output", id(out))} if out in outputs else set()
            for reader in readers[out]:
                if reader.primitive in _FUSED and id(reader) not in chosen:
                    for result in reader.outvars:
                        reached |= kernels[result]
                else:
                    reached.add(id(reader))
            # (how many, up to KERNELS, is all that matters: at most that many kept, so that a large
            # program's sets stay small)
            kernels[out] = reached if len(reached) <= KERNELS else set(itertools.islice(reached, KERNELS))
        if eqn.primitive is two_forms_p and not isinstance(eqn.params["forms"], MadeOnce):
            result = eqn.outvars[0]
            if result.aval.ndim and result.aval.size and len(kernels[result]) >= KERNELS:
                chosen.add(id(eqn))
    return chosen


def _made_once(x):
    """``x`` read back through a ``gather`` at constant indices (its rows in order), which XLA:CPU
    fuses into no consumer: ``x`` is computed once, in the kernel that ends in the gather."""
    dims = lax.GatherDimensionNumbers(offset_dims=tuple(range(1, x.ndim)), collapsed_slice_dims=(0,),
                                      start_index_map=(0,))
    return lax.gather(x, np.arange(x.shape[0], dtype=np.int32)[:, None], dims, (1,) + x.shape[1:],
                      mode=lax.GatherScatterMode.PROMISE_IN_BOUNDS)


@dataclass(frozen=True)
class MadeOnce:
    """The forms (:mod:`jaxtool.point_forms`) of a computation ``forms``, with its result made once
    (:func:`_made_once`) at a point, and under ``jax.vmap`` where its batched form is written out too
    (``forms.batched_fuses``; a library call's result is made once already)."""

    forms: object

    @property
    def shape(self):
        return self.forms.shape

    @property
    def dtype(self):
        return self.forms.dtype

    def at_a_point(self, *operands):
        return _made_once(self.forms.at_a_point(*operands))

    def batched(self, *operands):
        result = self.forms.batched(*operands)
        return _made_once(result) if getattr(self.forms, "batched_fuses", False) else result


def call_sharing(fun, args) -> object:
    """``fun(*args)``, with the values that its computation shares made once on XLA:CPU: ``fun`` is
    traced to a jaxpr, whose equations (those whose results are read, :func:`_live`) are replayed
    stage by stage (:func:`_stages`).

    - In a program of scalars (:func:`of_scalars`), each stage's shared scalars (:func:`_shared`)
      pass through :data:`materialize_p` before the next stage reads them, where that takes the
      program under XLA:CPU's line (:func:`crosses_the_line`).
    - The results of :data:`DEAR` primitives that several equations read pass through
      :data:`once_p`, those of one stage together, before the first equation that reads one.
    - The written-out contractions and sums that XLA:CPU would copy into several kernels
      (:func:`_copied_contractions`) are made once (:class:`MadeOnce`).

    Replayed in its own order where it has effects (reordering could reorder them)."""
    closed, out_shape = jax.make_jaxpr(fun, return_shape=True)(*args)
    out_tree = jax.tree_util.tree_structure(out_shape)
    jaxpr = _one_of_each_dear(_live(closed.jaxpr))
    uses = collections.Counter(v for eqn in jaxpr.eqns for v in _variables(eqn.invars))
    uses.update(_variables(jaxpr.outvars))
    shared = _shared(jaxpr, uses) if of_scalars(args) else set()
    if shared and not crosses_the_line(jaxpr, shared):
        shared = set()
    dear = {eqn.outvars[0] for eqn in jaxpr.eqns if eqn.primitive in DEAR and uses[eqn.outvars[0]] >= 2}
    copied = _copied_contractions(jaxpr)
    env = dict(zip(jaxpr.constvars, closed.consts))
    env.update(zip(jaxpr.invars, args))

    def read(v):
        return v.val if isinstance(v, jcore.Literal) else env[v]

    if not (shared or dear or copied) or jaxpr.effects:
        return jax.tree_util.tree_unflatten(out_tree, jcore.jaxpr_as_fun(closed.replace(jaxpr=jaxpr))(*args))
    pending = {materialize_p: [], once_p: []}

    def made_once(primitive):
        by_dtype = collections.defaultdict(list)
        for v in pending[primitive]:
            by_dtype[v.aval.dtype].append(v)
        for group in by_dtype.values():
            env.update(zip(group, primitive.bind(*(env[v] for v in group))))
        pending[primitive].clear()

    stages, dear_stages = _stages(jaxpr, shared), _stages(jaxpr, dear)
    current = 0
    for index in sorted(range(len(jaxpr.eqns)), key=lambda i: (stages[i], dear_stages[i], i)):
        eqn = jaxpr.eqns[index]
        if stages[index] != current:
            made_once(materialize_p)
            current = stages[index]
        if any(v in pending[once_p] for v in _variables(eqn.invars)):
            made_once(once_p)
        if id(eqn) in copied:
            eqn = eqn.replace(params=dict(eqn.params, forms=MadeOnce(eqn.params["forms"])))
        out = bind(eqn, *map(read, eqn.invars))
        env.update(zip(eqn.outvars, out if eqn.primitive.multiple_results else [out]))
        pending[materialize_p].extend(v for v in eqn.outvars if v in shared)
        pending[once_p].extend(v for v in eqn.outvars if v in dear)
    made_once(materialize_p)
    made_once(once_p)
    return jax.tree_util.tree_unflatten(out_tree, [read(v) for v in jaxpr.outvars])
