"""Vertex (cross-country) elimination on the computational graph of a flat program.

:func:`build` evaluates a :class:`~jaxtool.graph.FlatProgram`, keeps the vertices that depend on the
differentiated inputs and reach an output, and attaches to every edge ``u -> v`` the structured
local partial ``dv/du`` from :mod:`jaxtool.rules` (partials of an equation that reads the same
value twice are summed). Eliminating a vertex ``v`` replaces every path ``u -> v -> w`` by the
edge ``u -> w`` with partial ``dw/dv . dv/du``, added to any existing ``u -> w``. When every
eliminable vertex is gone, the edges from inputs to outputs are the Jacobian.

The same code runs on *plans* (partials without values, see :mod:`jaxtool.partials`): costing
an order, or choosing one greedily, needs shapes and structures only.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field, replace

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax

from jaxtool import bundles
from jaxtool.errors import UsageError
from jaxtool.graph import Const, FlatProgram, Input, evaluate, explicitly_sharded, flatten, read, replicated, \
    replicated_value
from jaxtool.partials import Cost, Partial, Sparse, add, cast, matmul, reshaped, shared_applications
from jaxtool.rules import carries_tangent, cuts_derivative, is_differentiable, partials_of, tangent_dtype, \
    tangent_shape


def input_node(index: int) -> int:
    """Graph node of the ``index``-th flat input (inputs are negative, vertices 1..N, sinks above N)."""
    return -(index + 1)


def _node(atom):
    if isinstance(atom, Input):
        return input_node(atom.index)
    if isinstance(atom, Const):
        return None
    return atom


@dataclass
class EdgeGraph:
    """Edges with their partials, indexed both ways."""

    preds: dict = field(default_factory=dict)  # v -> {u: partial}
    succs: dict = field(default_factory=dict)  # u -> {v: partial}

    def add_edge(self, u: int, v: int, partial: Partial) -> Cost:
        """Add ``partial`` to edge ``u -> v``; the cost of the sum if the edge existed."""
        cost = Cost()
        old = self.preds.get(v, {}).get(u)
        if old is not None:
            partial, cost = add(old, partial)
        self._set_edge(u, v, partial)
        return cost

    def _set_edge(self, u: int, v: int, partial: Partial) -> None:
        self.preds.setdefault(v, {})[u] = partial
        self.succs.setdefault(u, {})[v] = partial

    def copy(self) -> "EdgeGraph":
        """An independent copy (partials are immutable and shared)."""
        return EdgeGraph({v: dict(p) for v, p in self.preds.items()}, {u: dict(s) for u, s in self.succs.items()})

    def plan(self) -> "EdgeGraph":
        """The same graph with every partial reduced to its plan (structure, no values)."""
        g = EdgeGraph()
        for v, preds in self.preds.items():
            for u, p in preds.items():
                g.add_edge(u, v, p.plan())
        return g

    def elimination_cost(self, v: int, memo: dict | None = None, sums: bool = True) -> Cost:
        """What eliminating ``v`` now would cost (products and, with ``sums``, the sums they cause:
        additions only, so the multiplications are the same without).

        ``memo``, a dict kept across calls on one plan graph, remembers each product and sum by its
        operands, which are immutable (the ones an elimination leaves in place are costed once)."""
        total = Cost()
        for u, a in self.preds.get(v, {}).items():
            for w, b in self.succs.get(v, {}).items():
                c, cost = _remembered(memo, matmul, b.plan(), a.plan())
                total += cost
                old = self.preds.get(w, {}).get(u) if sums else None
                if old is not None:
                    total += _remembered(memo, add, old.plan(), c)[1]
        return total

    def eliminate(self, v: int) -> Cost:
        """Eliminate vertex ``v``; return the multiplications and additions it took."""
        preds = self.preds.pop(v, {})
        succs = self.succs.pop(v, {})
        for u in preds:
            del self.succs[u][v]
        for w in succs:
            del self.preds[w][v]
        total = Cost()
        for w, b in succs.items():
            for members in bundles.bundles(preds, b):
                products = bundles.products(b, [preds[u] for u in members]) if len(members) > 1 else None
                if products is None:
                    for u in members:
                        c, cost = matmul(b, preds[u])
                        total += cost + self.add_edge(u, w, c)
                else:
                    total += self._add_bundle(members, w, products)
        return total

    def _add_bundle(self, members: list, w: int, products: list) -> Cost:
        """Add the ``(partial, cost)`` ``products`` to the edges ``u -> w`` of ``members``, the sums of
        one structure bundled (:mod:`jaxtool.bundles`); their cost and the products'."""
        total = Cost()
        olds = self.preds.get(w, {})
        by_structure = collections.defaultdict(list)
        for k, (u, (c, cost)) in enumerate(zip(members, products)):
            total += cost
            old = olds.get(u)
            if old is None:
                self._set_edge(u, w, c)
            else:
                by_structure[(bundles.bundle_key(old), bundles.bundle_key(c))].append(k)
        for (old_key, new_key), ks in by_structure.items():
            sums = None
            if len(ks) > 1 and old_key is not None and new_key is not None:
                sums = bundles.sums([olds[members[k]] for k in ks], [products[k][0] for k in ks])
            if sums is None:
                for k in ks:
                    total += self.add_edge(members[k], w, products[k][0])
                continue
            for k, (s, cost) in zip(ks, sums):
                total += cost
                self._set_edge(members[k], w, s)
        return total

    def neighbours(self, v: int) -> set:
        return set(self.preds.get(v, {})) | set(self.succs.get(v, {}))


def _remembered(memo: dict | None, combine, x, y):
    """``combine(x, y)``, looked up in ``memo`` by the operands' identities (the entry keeps them alive,
    so their ids are not reused while it is there)."""
    if memo is None:
        return combine(x, y)
    key = (combine, id(x), id(y))
    if key not in memo:
        memo[key] = (x, y, combine(x, y))
    return memo[key][2]


@dataclass
class Problem:
    """A computational graph ready for elimination."""

    program: FlatProgram
    graph: EdgeGraph
    wrt: tuple  # flat input indices differentiated
    outputs: tuple  # per flat output: a graph node (int) or a Const
    eliminable: tuple  # vertex numbers an order must list (all but outputs no equation reads)
    out_avals: tuple
    out_values: tuple = ()  # the program's primal outputs
    #: ``(vertex, primitive name)`` of the vertices whose partials are JAX's AD of their whole
    #: equation (control flow, complex FFTs, ...): the counts take each application of such a
    #: partial as one multiplication per element of the equation's differentiable results
    opaque: tuple = ()

    def plan(self) -> "Problem":
        """A copy whose partials carry structure only: for costing orders."""
        return replace(self, graph=self.graph.plan())

    def copy(self) -> "Problem":
        """A copy that can be eliminated without changing this one."""
        return replace(self, graph=self.graph.copy())


def build(program: FlatProgram, args, wrt) -> Problem:
    """Evaluate ``program`` on flat ``args`` and build the graph of partials w.r.t. inputs ``wrt``."""
    wrt = tuple(sorted(wrt))
    for i in wrt:
        aval = program.in_avals[i]
        if not is_differentiable(aval):
            raise UsageError(f"input {i} has dtype {aval.dtype}: only real floating-point inputs can be differentiated")
    if any(map(explicitly_sharded, program.in_avals + tuple(program.avals.values()))):
        program, args = replicated(program), [replicated_value(x) for x in args]
    values = evaluate(program, args)
    n = program.num_vertices
    active = {input_node(i) for i in wrt}
    for eqn in program.eqns:
        if any(_node(a) in active for a in eqn.invars) and not cuts_derivative(eqn):
            active.update(v for v in eqn.outvars if carries_tangent(program.avals[v]))
    out_nodes = [_node(a) for a in program.outvars]
    useful = {v for v in out_nodes if v is not None}
    for eqn in reversed(program.eqns):
        if any(v in useful for v in eqn.outvars) and not cuts_derivative(eqn):
            useful.update(_node(a) for a in eqn.invars if _node(a) is not None)
    live = active & useful

    graph = EdgeGraph()
    opaque = {}
    for eqn in program.eqns:
        positions = [i for i, a in enumerate(eqn.invars) if _node(a) in live]
        if not positions or not any(v in live for v in eqn.outvars):
            continue
        invals = [read(a, args, values) for a in eqn.invars]
        outvals = [values[v] for v in eqn.outvars]
        for i, k, partial in partials_of(eqn, invals, outvals, positions):
            v = eqn.outvars[k]
            if v in live:
                graph.add_edge(_node(eqn.invars[i]), v, partial)
                if getattr(partial, "opaque", False):
                    opaque[v] = eqn.name

    # an output that later equations read gets a sink copy, so that it is eliminated like any intermediate
    outputs = []
    sinks = {}
    for v in out_nodes:
        if v is not None and v > 0 and graph.succs.get(v):
            if v not in sinks:
                sinks[v] = n + 1 + len(sinks)
                aval = program.avals[v]
                graph.add_edge(v, sinks[v], Sparse.identity(tangent_shape(aval), tangent_dtype(aval)))
            outputs.append(sinks[v])
        elif v is None:
            outputs.append(program.outvars[len(outputs)])
        else:
            outputs.append(v)
    pure_outputs = {v for v in out_nodes if v is not None and v > 0 and v not in sinks}
    eliminable = tuple(v for v in range(1, n + 1) if v not in pure_outputs)
    out_avals = tuple(program.aval(a) for a in program.outvars)
    out_values = tuple(read(a, args, values) for a in program.outvars)
    return Problem(program, graph, wrt, tuple(outputs), eliminable, out_avals, out_values,
                   tuple(sorted(opaque.items())))


def run(problem: Problem, order) -> Cost:
    """Eliminate the vertices of ``order`` (already validated) in turn; the total cost, forming
    the dense blocks of :func:`blocks` from lazy linear maps included."""
    total = Cost()
    with shared_applications():
        for v in order:
            total += problem.graph.eliminate(v)
    for out in problem.outputs:
        for i in problem.wrt:
            partial = _block_partial(problem, out, i)
            total += Cost() if partial is None else partial.densify_cost()
    return total


def _block_partial(problem: Problem, out, i: int):
    """The partial from flat input ``i`` to output ``out`` (a graph node or a Const) once every
    eliminable vertex is gone; None where there is none."""
    return None if isinstance(out, Const) else problem.graph.preds.get(out, {}).get(input_node(i))


def blocks(problem: Problem) -> list:
    """The Jacobian as dense blocks ``[output][wrt input]``, each ``out.shape + in.shape``.

    A complex output's blocks are complex, ``d real/dx + 1j d imag/dx``, as ``jax.jacfwd`` gives
    them (``jax.jacrev`` rejects complex outputs).
    """
    with shared_applications():
        return _blocks(problem)


def _blocks(problem: Problem) -> list:
    program = problem.program
    result = []
    for out, out_aval in zip(problem.outputs, problem.out_avals):
        row = []
        for i in problem.wrt:
            in_aval = program.in_avals[i]
            shape = tuple(out_aval.shape) + tuple(in_aval.shape)
            dtype = _block_dtype(out_aval, in_aval)
            if not isinstance(out, Const) and out == input_node(i):
                size = int(np.prod(in_aval.shape))
                row.append(jnp.eye(size, dtype=dtype).reshape(shape))
                continue
            partial = _block_partial(problem, out, i)
            if partial is None:
                row.append(jnp.zeros(shape, dtype))
            elif jnp.issubdtype(dtype, jnp.complexfloating):  # (real, imaginary) on the axis after out.shape
                pairs = jnp.moveaxis(partial.to_dense(), len(out_aval.shape), 0)
                row.append(reshaped(lax.complex(pairs[0], pairs[1]).astype(dtype), shape))
            else:
                row.append(reshaped(cast(partial.to_dense(), dtype), shape))
        result.append(row)
    return result


def _block_dtype(out_aval, in_aval):
    """``jax.jacrev``'s dtype for a block: the differentiated input's (a complex output's own)."""
    return out_aval.dtype if jnp.issubdtype(out_aval.dtype, jnp.complexfloating) else in_aval.dtype


def linear_partials(fn, primals, tangents, wrt, outs) -> list:
    """Structured partials of ``fn(primals, tangents)``, a function linear in ``tangents``.

    ``tangents[t]`` is the tangent of equation input ``wrt[t]``; ``fn`` returns one tangent per
    equation output, of which ``outs`` are differentiable. Returns ``(wrt[t], k, partial)`` triples.
    Used for custom JVP rules, whose tangent program keeps its structure this way.
    """
    from jaxtool.orders import resolve_order

    closed = jax.make_jaxpr(fn)(primals, tangents)
    program = flatten(closed)
    flat_primals = jax.tree_util.tree_leaves(primals)
    args = list(flat_primals) + list(tangents)
    first = len(flat_primals)
    problem = build(program, args, range(first, first + len(tangents)))
    run(problem, resolve_order("markowitz", problem))
    result = []
    for k in outs:
        out = problem.outputs[k]
        if isinstance(out, Const):
            continue
        for t, i in enumerate(wrt):
            node = input_node(first + t)
            if out == node:
                aval = program.in_avals[first + t]
                result.append((i, k, Sparse.identity(aval.shape, aval.dtype)))
            elif node in problem.graph.preds.get(out, {}):
                result.append((i, k, problem.graph.preds[out][node]))
    return result
