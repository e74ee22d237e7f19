"""``jaxtool.jacve``: Jacobians by vertex elimination, shaped exactly like ``jax.jacrev``'s."""

from __future__ import annotations

import contextlib
import functools
import time
import warnings
import weakref

import numpy as np

import jax
import jax.numpy as jnp

from jaxtool._compat import weakly_typed
from jaxtool.elimination import Problem, blocks, build, run
from jaxtool.errors import OpByOpWarning
from jaxtool.graph import flatten
from jaxtool.one_call import by_equation, by_equation_is_sooner, compile_seconds
from jaxtool.orders import parse_order, resolve_order, vertex_numbers
from jaxtool.partials import clear_plan_caches, fuses_small_products, written_out_forms
from jaxtool.rules import custom_rule, leaked_rule_error, writes_out_safely
from jaxtool.sharing import call_sharing, contracts, of_scalars, reads_dear


def _argnums(argnums):
    """``argnums`` as ``jax.jacrev`` takes it, with Python ints: an int, or a sequence of ints (a
    NumPy integer or a 0-d array counts as a sequence of one, as ``jax.jacrev`` then returns a
    tuple); a TypeError for anything else."""
    def position(p):
        if isinstance(p, bool) or not isinstance(p, (int, np.integer)):
            raise TypeError(f"argnums must be an int or a sequence of ints, got {argnums!r}")
        return int(p)

    if hasattr(argnums, "__array__") and not isinstance(argnums, (tuple, list)):  # NumPy integers, arrays
        return tuple(position(p) for p in np.asarray(argnums).ravel().tolist())
    if not isinstance(argnums, (tuple, list, range)):
        return position(argnums)
    return tuple(position(p) for p in argnums)


def _positions(argnums) -> tuple:
    return (argnums,) if isinstance(argnums, int) else tuple(argnums)


def _is_array(x) -> bool:
    """Whether ``x`` may pass into or out of ``jax.jit``: an array, a tracer or a numeric scalar."""
    return hasattr(x, "dtype") or isinstance(x, (bool, int, float, complex))


def _differentiated_leaves(args, positions) -> list:
    """The indices of the leaves of ``args[positions]`` among the flat leaves of ``(args, kwargs)``,
    in the order of ``positions``."""
    first = np.cumsum([0] + [len(jax.tree_util.tree_leaves(arg)) for arg in args])
    return [n for p in positions for n in range(first[p % len(args)], first[p % len(args) + 1])]


@contextlib.contextmanager
def _engine_promotion():
    """JAX's standard dtype promotion and implicit rank promotion, under which jaxtool's own
    arithmetic on partials is written (a boolean mask compared with an int, a scale of shape (n,)
    times a block of shape (m, n), say): where a user sets ``jax_numpy_dtype_promotion`` to
    ``"strict"`` or ``jax_numpy_rank_promotion`` to ``"raise"``, that applies to their function,
    traced before (:func:`_trace`), and not to the engine (which crashed on a ``select_n``, or on a
    product of partials, otherwise)."""
    with jax.numpy_dtype_promotion("standard"), jax.numpy_rank_promotion("allow"):
        yield


def _trace(fun, args, kwargs, positions, has_aux, static_kinds):
    """Trace ``fun`` at ``args`` and ``kwargs``, differentiated with respect to ``args[positions]``.

    Every array leaf is an input of the traced program, differentiated or not, whether the call
    is staged under ``jax.jit`` or eager: the program, and so the numbering of its vertices that a
    custom order refers to, is the same in every context (as ``jaxtool show --vertices`` prints
    it). Scalars of ``static_kinds`` outside the differentiated arguments (see :func:`_split`) and
    leaves that are not arrays at all are constants of the program.

    Returns the flat program, its input values, the positions among them of the differentiated
    leaves, the tree of the differentiated arguments, the output and aux trees, and the aux
    leaves that are not arrays (Python scalars, strings, objects: ``{position: value}``), which
    are returned as they are, as ``jax.jacrev`` returns them, instead of being program outputs.
    """
    for p in positions:
        if not -len(args) <= p < len(args):
            raise ValueError(f"argnums {p} out of range for {len(args)} positional arguments")
    leaves, call_tree = jax.tree_util.tree_flatten((args, kwargs))
    in_order = _differentiated_leaves(args, positions)
    chosen = set(in_order)
    traced = [n for n, x in enumerate(leaves) if n in chosen or (_is_array(x) and not isinstance(x, static_kinds))]
    values = [jnp.asarray(leaves[n]) for n in traced]
    wrt = [traced.index(n) for n in in_order]  # in the order of ``positions``, as jax.jacrev's blocks
    dyn_tree = jax.tree_util.tree_structure(tuple(args[p] for p in positions))
    trees = {}

    def flat_fun(*flat):
        full = list(leaves)
        for n, value in zip(traced, flat):
            # a leaf not differentiated that is already traced (the staged call's) is read as it
            # is: functions ``fun`` defines may close over it, and a custom_jvp/custom_vjp rule of
            # one is traced only when elimination applies it, after this trace has ended
            # (``jax.jacrev`` traces it in the same trace). Its input stays, unused.
            full[n] = leaves[n] if n not in chosen and isinstance(leaves[n], jax.core.Tracer) else value
        call_args, call_kwargs = jax.tree_util.tree_unflatten(call_tree, full)
        result = fun(*call_args, **call_kwargs)
        if has_aux and not (isinstance(result, (tuple, list)) and len(result) == 2):
            raise TypeError("expected a function with aux output (has_aux=True) to return a two-element "
                            f"tuple (output, aux), but got {'an array' if hasattr(result, 'shape') else type(result).__name__}"
                            + (f" of length {len(result)}" if isinstance(result, (tuple, list)) else ""))
        out, aux = result if has_aux else (result, None)
        out_leaves, trees["out"] = jax.tree_util.tree_flatten(out)
        aux_leaves, trees["aux"] = jax.tree_util.tree_flatten(aux)
        trees["static"] = {n: leaf for n, leaf in enumerate(aux_leaves) if not hasattr(leaf, "dtype")}
        return list(out_leaves) + [leaf for n, leaf in enumerate(aux_leaves) if n not in trees["static"]]

    program = flatten(jax.make_jaxpr(flat_fun)(*values))
    return program, values, wrt, dyn_tree, trees["out"], trees["aux"], trees["static"]


def xla_failed(error: Exception) -> bool:
    """Whether ``error`` is XLA failing on a program, not the program failing: an ``INTERNAL`` error
    (JAX 0.10.2 compiles a sum kept as a 1 x 1 array, its FFT and a LAPACK call on the result to a
    program that stops at ``RET_CHECK failure ... fft_thunk.cc``, ``jax.jit`` of the function too,
    where op by op they run)."""
    return isinstance(error, jax.errors.JaxRuntimeError) and str(error).startswith("INTERNAL:")


def op_by_op_note(error: Exception) -> str:
    """What :class:`~jaxtool.errors.OpByOpWarning` says of ``error``."""
    reason = (str(error).strip().splitlines() or [""])[0].strip()
    return (f"XLA could not compile the staged Jacobian ({reason}); computed op by op instead, as "
            "jax.jacrev computes outside jax.jit (jax.jit of the function may fail the same way)")


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
    (``static``: flat leaf index, type, value and a float's bits), as ``jax.jacrev`` leaves them, so that
    ``fun`` may use them as sizes or in Python control flow; every other leaf is traced
    (``dynamic``).
    """
    leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
    differentiated = set(_differentiated_leaves(args, positions)) if args else set()
    # the type too: jax.jit's cache would take True, 1 and 1.0 for one another; a float's bits too:
    # it would take -0.0 and 0.0 for one another (copysign tells them apart)
    static = tuple((n, type(x), x, np.asarray(x).tobytes() if isinstance(x, (float, complex, np.inexact)) else None)
                   for n, x in enumerate(leaves) if n not in differentiated and isinstance(x, kinds))
    fixed = {n for n, *_ in static}
    return static, tree, [x for n, x in enumerate(leaves) if n not in fixed]


def _merge(static, tree, dynamic):
    """The ``(args, kwargs)`` that :func:`_split` split."""
    values, dynamic = {n: x for n, _, x, _ in static}, iter(dynamic)
    leaves = [values[n] if n in values else next(dynamic) for n in range(tree.num_leaves)]
    return jax.tree_util.tree_unflatten(tree, leaves)


class _ByEquation:
    """A call signature's staged Jacobian while its calls run equation by equation
    (:meth:`_StagedJacobian.first_or_staged`): its flat program, output tree, and the seconds its
    runs have taken so far."""

    def __init__(self, program, out_tree):
        self.program, self.out_tree, self.seconds = program, out_tree, 0.0


class _StagedJacobian:
    """The staged Jacobian of one function for one ``(order, argnums, has_aux)``, shared by every
    :func:`jacve` of them (see :data:`_SHARED`): the ``jax.jit`` that traces and compiles it per
    call signature, which scalar kinds it passes as they are, and the layouts of non-array aux.

    It reaches the function through ``fun_ref`` (a weak reference where the function takes one),
    so that the table of shared Jacobians does not keep the function alive.
    """

    def __init__(self, fun_ref, order, argnums, has_aux):
        self.fun_ref, self.order, self.argnums, self.has_aux = fun_ref, order, argnums, has_aux
        self.positions = _positions(argnums)
        self.staged = jax.jit(self.staged_parts, static_argnums=(0, 1, 2))
        self.kinds = INTEGERS  # SCALARS from the first call whose fun needs a float scalar concrete
        # aux leaves that are not arrays cannot leave jax.jit: kept per call signature, as traced
        self.aux_layouts = {}
        self.custom_rule = None  # the last program traced's first custom rule (rules.custom_rule)
        self.op_by_op = set()  # call signatures whose staged Jacobian XLA could not compile (xla_failed)
        self.compiled = set()  # call signatures staged to be compiled (see first_or_staged)
        self.by_equation = {}  # call signature -> _ByEquation, while its calls run equation by equation

    def trace(self, kinds, args, kwargs) -> tuple:
        """The function traced at ``args`` and ``kwargs`` (:func:`_trace`)."""
        return _trace(self.fun_ref(), args, kwargs, self.positions, self.has_aux, kinds)

    def parts(self, kinds, *args, **kwargs):
        """The Jacobian, the aux leaves that are arrays, the aux tree and the other aux leaves."""
        return self.emitted(self.trace(kinds, args, kwargs))

    def emitted(self, traced):
        """:meth:`parts` of the function as :meth:`trace` traced it."""
        program, values, wrt, dyn_tree, out_tree, aux_tree, static = traced
        self.custom_rule = custom_rule(program)  # (for the error of a rule that leaks a tracer, see __call__)
        with _engine_promotion(), written_out_forms(writes_out_safely(program)):
            problem = build(program, values, wrt)
            run(problem, resolve_order(self.order, problem))
            jacobian = blocks(problem)
        n_out = out_tree.num_leaves
        # jax.jacrev's layout: outer structure of the output, inner structure of the inputs (blocks
        # come in input order, jax.jacrev's in argnums order)
        columns = [problem.wrt.index(k) for k in wrt]
        weak = [jax.typeof(values[k]).weak_type for k in wrt]  # (as jax.jacrev: a weakly typed block)
        inner = [jax.tree_util.tree_unflatten(dyn_tree, [weakly_typed(row[c]) if w else row[c]
                                                         for c, w in zip(columns, weak)])
                 for row in jacobian[:n_out]]
        if isinstance(self.argnums, int):
            inner = [i[0] for i in inner]
        return jax.tree_util.tree_unflatten(out_tree, inner), list(problem.out_values[n_out:]), aux_tree, static

    def staged_parts(self, kinds, static, call_tree, *dynamic):
        traced = self.trace(kinds, *_merge(static, call_tree, dynamic))

        def emit(*dynamic):
            result, arrays, aux_tree, static_aux = self.emitted(traced)
            if self.has_aux:
                self.aux_layouts[static, _signature(*_merge(static, call_tree, dynamic))] = (aux_tree, static_aux)
            return result, arrays

        if of_scalars(dynamic) or reads_dear(traced[0]) or (fuses_small_products() and contracts(traced[0])):
            return call_sharing(emit, dynamic)  # (its jaxpr closes over this trace's values: fun is traced once)
        return emit(*dynamic)

    def with_aux(self, result, arrays, aux_tree, static):
        if not self.has_aux:
            return result
        arrays = iter(arrays)
        leaves = [static[n] if n in static else next(arrays) for n in range(aux_tree.num_leaves)]
        return result, jax.tree_util.tree_unflatten(aux_tree, leaves)

    def with_kinds(self, call):
        # (a leaked tracer: a float given to a custom_jvp/custom_vjp function through nondiff_argnums)
        try:
            return call(self.kinds)
        except (jax.errors.ConcretizationTypeError, jax.errors.TracerIntegerConversionError,
                jax.errors.UnexpectedTracerError):
            if self.kinds is SCALARS:
                raise
            result = call(SCALARS)  # raises again where a differentiated value is what fun needs concrete
            self.kinds = SCALARS
            return result

    def first_or_staged(self, kinds, static, call_tree, dynamic):
        """``self.staged(kinds, static, call_tree, *dynamic)``, compiled; but outside any trace, a
        signature whose traced program is sooner run equation by equation than compiled
        (:func:`jaxtool.one_call.by_equation_is_sooner`: an unrolled loop, many equations of few
        kinds) is run so until its runs have taken as long as compiling it is estimated to take
        (:func:`jaxtool.one_call.compile_seconds`), and compiled at the next call (``jax.jit`` keeps
        the trace). As a skier rents until the rent paid would have bought the skis: however many
        calls follow, about twice the time of the better of the two ways at most."""
        if any(isinstance(x, jax.core.Tracer) for x in dynamic):
            return self.staged(kinds, static, call_tree, *dynamic)
        signature = (kinds, static, call_tree, tuple(jax.typeof(x) for x in dynamic))
        runs = self.by_equation.get(signature)
        if runs is None and signature not in self.compiled:
            traced = self.staged.trace(kinds, static, call_tree, *dynamic)
            program = flatten(traced.jaxpr)
            if by_equation_is_sooner(program):
                runs = self.by_equation[signature] = _ByEquation(program, traced.out_tree)
        if runs is None or runs.seconds >= compile_seconds(runs.program):
            self.by_equation.pop(signature, None)
            self.compiled.add(signature)
            return self.staged(kinds, static, call_tree, *dynamic)
        start = time.perf_counter()
        outs = jax.block_until_ready(by_equation(runs.program, list(dynamic)))
        runs.seconds += time.perf_counter() - start
        return jax.tree_util.tree_unflatten(runs.out_tree, outs)

    def op_by_op_call(self, args, kwargs):
        """The Jacobian computed op by op, unstaged (as ``jax.jacrev`` computes outside ``jax.jit``)."""
        return self.with_aux(*self.with_kinds(lambda k: self.parts(k, *args, **kwargs)))

    def __call__(self, *args, **kwargs):
        leaves = jax.tree_util.tree_leaves((args, kwargs))
        if not all(_is_array(x) for x in leaves):  # non-array arguments cannot be staged
            return self.op_by_op_call(args, kwargs)
        if self.op_by_op and _signature(args, kwargs) in self.op_by_op:
            return self.op_by_op_call(args, kwargs)

        def staged_call(k):
            static, call_tree, dynamic = _split(args, kwargs, self.positions, k)
            return self.first_or_staged(k, static, call_tree, dynamic), static

        try:
            (result, arrays), static = self.with_kinds(staged_call)
        except jax.errors.UnexpectedTracerError as error:
            raise leaked_rule_error(self.custom_rule, error) from error
        except jax.errors.JaxRuntimeError as error:
            if not xla_failed(error):
                raise
            warnings.warn(op_by_op_note(error), OpByOpWarning, stacklevel=3)
            self.op_by_op.add(_signature(args, kwargs))  # (not compiled again: it would fail again)
            return self.op_by_op_call(args, kwargs)
        if not self.has_aux:
            return result
        return self.with_aux(result, arrays, *self.aux_layouts[static, _signature(args, kwargs)])


#: function -> {(order, argnums, has_aux): _StagedJacobian}, weakly keyed (an entry goes with its
#: function): ``jaxtool.jacve(f)(x)`` written inside a loop traces and compiles once per argument
#: signature, as ``jax.jit(f)`` written there does, instead of once per iteration (roe_flux_3d:
#: about 0.75 s per call otherwise; ``jax.jacrev(f)(x)`` eager: 45 ms)
_SHARED = weakref.WeakKeyDictionary()


def _shared(fun, order, argnums, has_aux) -> _StagedJacobian:
    """The staged Jacobian of ``fun`` for these arguments, made on first use; a function that takes
    no weak reference, or is unhashable, gets one of its own."""
    key = (order if isinstance(order, str) else tuple(order), argnums, bool(has_aux))
    try:
        table = _SHARED.setdefault(fun, {})
        hash(key)
    except TypeError:
        return _StagedJacobian(lambda: fun, *key)
    if key not in table:
        table[key] = _StagedJacobian(weakref.ref(fun), *key)
    return table[key]


def clear_caches() -> None:
    """Forget every shared staged Jacobian and cached product and sum plan (for a cold start, as
    after ``jax.clear_caches()``; see ``make bench``)."""
    _SHARED.clear()
    clear_plan_caches()


def jacve(fun, order="rev", argnums=0, has_aux=False):
    """The Jacobian of ``fun`` by vertex elimination in ``order``.

    Returns a function with the signature of ``fun`` whose output has exactly the structure of
    ``jax.jacrev(fun, argnums=argnums, has_aux=has_aux)``: for each output leaf, the pytree of the
    differentiated argument(s) with leaves of shape ``out.shape + in.shape``.

    ``order`` is ``"fwd"``/``"forward"``, ``"rev"``/``"reverse"``, ``"markowitz"``, or a sequence
    (or comma-separated string) of vertex numbers: a permutation of the eliminable vertices of the
    traced program, numbered as ``jaxtool show --vertices`` prints them.

    The computation is staged with ``jax.jit``, so repeated calls with the same argument types
    reuse the traced elimination, also through a new ``jacve`` of the same function and arguments
    (``jacve(f)(x)`` inside a loop compiles once). Outside ``jax.jit``, the first call of a
    signature whose traced Jacobian has many equations of few kinds (an unrolled loop) runs it
    equation by equation where that is sooner (:mod:`jaxtool.one_call`), and so do the next calls
    until their runs have taken as long as compiling it is estimated to take; the call after that
    compiles it. Python and NumPy integer and boolean scalars
    among the arguments not differentiated are passed to ``fun`` as they are, as ``jax.jacrev``
    passes them (``fun`` may use them as sizes or in ``if``), and each new value of one is traced
    anew; float scalars are traced, unless ``fun`` needs one concrete (a
    ``ConcretizationTypeError``): from then on they are passed as they are too. It composes with
    ``jax.jit``, ``jax.vmap``, ``jax.jacfwd``, ``jax.jacrev`` and with ``jacve`` itself.
    """
    if not callable(fun):
        raise TypeError(f"jacve expects a callable function, got {fun!r}")
    if isinstance(order, str):
        parse_order(order)  # fail early on a malformed name
    else:
        order = vertex_numbers(order)
    argnums = _argnums(argnums)
    shared = _shared(fun, order, argnums, has_aux)

    @functools.wraps(fun)  # its __wrapped__ keeps fun alive for the shared Jacobian, as long as it lives
    def jacobian_staged(*args, **kwargs):
        return shared(*args, **kwargs)

    return jacobian_staged


def trace_problem(fun, *args, argnums=0, has_aux=False, **kwargs) -> Problem:
    """The elimination problem of ``fun`` at ``args`` and ``kwargs``: its graph of partials and
    eliminable vertices (with ``has_aux``, ``fun`` returns ``(output, aux)`` as for :func:`jacve`:
    array aux leaves are outputs of the program too, as in the program ``jacve`` eliminates).
    Keyword arguments are traced as :func:`jacve` traces them, so the vertices are numbered as
    in the program a ``jacve`` call with the same arguments eliminates.

    ``problem.eliminable`` lists the vertices a custom order must permute;
    ``jaxtool.elimination.run(problem.plan(), order)`` costs an order without computing values.
    """
    program, values, wrt, *_ = _trace(fun, args, kwargs, _positions(argnums), has_aux, INTEGERS)
    with _engine_promotion():
        return build(program, values, wrt)
