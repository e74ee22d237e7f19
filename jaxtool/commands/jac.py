"""``jaxtool jac``: the Jacobian of a function by vertex elimination, optionally checked against JAX's AD.

The function is traced (:func:`jaxtool.tracing.trace`) for the names, shapes and dtypes of its
leaves; its inlined program is numbered as ``jaxtool show --vertices`` numbers it, so custom
``--order`` lists use those numbers. The differentiated inputs are the flat leaves of the
``--argnums`` arguments, in ``--argnums`` order; the other arguments stay fixed. Tracing the
program again, building the graph of partials, eliminating and reading out the blocks are traced
as one function (the cost is recorded while tracing), so that a custom derivative rule that closes
over an argument, traced only when its equation is eliminated, reads a value of that trace; that
function, and ``--check``'s ``jax.jacrev`` and ``jax.jacfwd``, are computed by
:func:`jaxtool.one_call.call_once`: compiled whole, or equation by equation where that is sooner.

No JAX import at module level (``jaxtool jac --help`` stays fast).
"""

from __future__ import annotations

import json

import click
from click.core import ParameterSource

from jaxtool.errors import CheckFailed, UnsupportedError, UsageError

#: Default (rtol, atol) of ``--check`` by the itemsize of the Jacobian's floating-point dtype.
DEFAULT_TOLERANCES = {8: (1e-10, 1e-10), 4: (1e-4, 1e-5), 2: (1e-2, 1e-2)}


class Tolerance(click.ParamType):
    """A finite number >= 0 (``click.FloatRange(min=0)`` lets ``nan`` and ``inf`` through)."""

    name = "tolerance"

    def convert(self, value, param, ctx):
        try:
            number = float(value)
        except ValueError:
            number = None
        if number is None or not 0 <= number < float("inf"):
            self.fail(f"{value!r} is not a finite number >= 0", param, ctx)
        return number


@click.command(name="jac")
@click.argument("target")
@click.argument("specs", nargs=-1)
@click.option("--order", "order_text", default="rev", show_default=True, metavar="ORDER",
              help="fwd, rev, markowitz, or comma-separated vertex numbers (a permutation of the eliminable "
                   "vertices, numbered as `jaxtool show --vertices` prints them).")
@click.option("--argnums", default="0", show_default=True, metavar="I,J,...",
              help="The positional arguments to differentiate; their flat leaves are the Jacobian's inputs. "
                   "'all': every floating-point leaf of every argument.")
@click.option("--static", "static", multiple=True, metavar="NAME=VALUE",
              help="A static (non-array) argument, as a Python literal; repeatable.")
@click.option("--inputs", "inputs", metavar="FILE.npz", help="Take the arguments from an .npz file (arg0, arg1, ...).")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True,
              help="Seed for values drawn from specs.")
@click.option("--check", is_flag=True,
              help="Recompute with jax.jacrev and jax.jacfwd; exit 1 if either differs beyond the tolerances.")
@click.option("--rtol", type=Tolerance(), default=None, metavar="TOL",
              help="Relative tolerance of --check [default: 1e-4 for float32, 1e-10 for float64, "
                   "1e-2 for float16/bfloat16; see the README].")
@click.option("--atol", type=Tolerance(), default=None, metavar="TOL",
              help="Absolute tolerance of --check [default: 1e-5 for float32, 1e-10 for float64, "
                   "1e-2 for float16/bfloat16; see the README].")
@click.option("--save", metavar="FILE.npz",
              help="Save the blocks as arrays jac_I_J (output leaf I, differentiated leaf J), shaped as jax.jacrev's.")
@click.option("--spy", is_flag=True, help="Draw the sparsity pattern of every block.")
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True,
              help="Text (table, small blocks in full) or JSON.")
@click.pass_obj
def command(settings, target, specs, order_text, argnums, static, inputs, seed, check, rtol, atol, save, spy, fmt):
    """Compute the Jacobian of TARGET at SPECS by vertex elimination.

    TARGET is `path/to/file.py:qualname` or `package.module:qualname`; SPECS give the arguments'
    shapes and dtypes (`f32[8,3]`, or JSON pytrees of them) where annotations or an
    `FN_example_args()` companion do not; values are then drawn from N(0,1) (--seed), or taken
    from --inputs. Prints one block per (output leaf, differentiated input leaf), then the
    elimination order and its cost in multiplications and additions.

    \b
    Examples:
      jaxtool jac sample_programs/roe_flux_1d.py:roe_flux_1d --order markowitz --check
      jaxtool jac model.py:loss '{"w": "f32[3,4]"}' f32[8,3] --argnums 0 --spy
      jaxtool jac model.py:f f32[5] --order 3,1,2 --save jac.npz --format json
    """
    from jaxtool.orders import parse_order

    if not check and (rtol is not None or atol is not None):
        raise UsageError(f"{'--rtol' if rtol is not None else '--atol'} sets a tolerance of --check; add --check")
    positions = _parse_argnums(argnums)
    order = parse_order(order_text)
    if save is not None:
        _check_save_path(save)
    if spy and fmt == "json":
        raise UsageError("--spy draws in the text output, not in --format json (--save writes every block's values)")
    if inputs is not None and click.get_current_context().get_parameter_source("seed") is ParameterSource.COMMANDLINE:
        raise UsageError("--seed draws values from specs; with --inputs there are none to draw")
    settings.activate()

    from jaxtool.loading import load_target
    from jaxtool.report import JacobianReport, render_text, to_json
    from jaxtool.tracing import trace

    with settings.user_code():  # the function runs for the trace, the elimination and --check
        loaded = load_target(target, specs, inputs=inputs, seed=seed, static=static)
        for line in loaded.notes(seed):
            settings.note(line)
        traced = trace(loaded.fn, loaded.args, names=loaded.arg_names, source_file=loaded.source_file)
        if not traced.out_avals:
            raise UsageError(f"{target} returns no arrays: nothing to differentiate")
        leaves, wrt = _differentiated_leaves(loaded, traced, positions)

        (vertices, cost), jac, opaque, note = _eliminate(loaded.fn, traced.in_tree, leaves, wrt, order)
        if note is not None:
            settings.note(note)
        blocks = _blocks(traced, wrt, jac)
        report = JacobianReport(order_name=order if isinstance(order, str) else "custom", order=tuple(vertices),
                                mults=cost.mults, adds=cost.adds, blocks=blocks, opaque=opaque,
                                check=_check(loaded.fn, traced, leaves, wrt, blocks, rtol, atol) if check else None)
    if save is not None:
        _save(save, blocks, len(wrt))
        settings.note(f"note: saved {len(blocks)} array{'s' * (len(blocks) != 1)} jac_I_J to {save}")

    if fmt == "json":
        settings.emit(json.dumps(to_json(report), indent=2))
    else:
        settings.console().print(render_text(report, spy=spy))
    if report.check is not None and not report.check.passed:
        failed = [c.reference for c in report.check.comparisons if c.unavailable is None and not c.passed]
        raise CheckFailed(f"--check: the Jacobian differs from {' and '.join(failed)} beyond rtol "
                          f"{report.check.rtol:g}, atol {report.check.atol:g}")


def _parse_argnums(text: str) -> list | None:
    """``"0,1"`` -> ``[0, 1]``, ``"all"`` -> ``None``; a :class:`UsageError` for anything else or a repeat."""
    if text.strip() == "all":
        return None
    try:
        positions = [int(part) for part in text.replace(" ", "").split(",")]
    except ValueError:
        raise UsageError(f"--argnums {text!r}: expected comma-separated argument positions such as 0,1") from None
    repeated = sorted({p for p in positions if positions.count(p) > 1})
    if repeated:
        raise UsageError(f"--argnums {text}: position {','.join(map(str, repeated))} given more than once")
    return positions


def _differentiated_leaves(loaded, traced, positions):
    """(all flat argument leaves as arrays, indices of the differentiated leaves in ``positions`` order).

    ``positions=None`` selects every floating-point leaf.
    """
    import jax
    import jax.numpy as jnp

    from jaxtool.rules import is_differentiable
    from jaxtool.specs import format_spec

    if positions is None:
        wrt = [k for k, aval in enumerate(traced.in_avals) if is_differentiable(aval)]
    else:
        count = len(loaded.args)
        starts = [0]
        for arg in loaded.args:
            starts.append(starts[-1] + len(jax.tree_util.tree_leaves(arg)))
        for p in positions:  # (every position in range before any two are compared: 1 is 0 modulo 1)
            if not -count <= p < count:
                names = ", ".join(loaded.arg_names) or "none"
                raise UsageError(f"--argnums {p}: {loaded.name} takes {count} array argument{'s' * (count != 1)} "
                                 f"({names})")
        wrt = []
        for p in positions:
            same = [q for q in positions if q != p and q % count == p % count]
            if same:  # (a negative position and a non-negative one)
                name = loaded.arg_names[p % count] if p % count < len(loaded.arg_names) else f"number {p % count}"
                raise UsageError(f"--argnums {p} and {same[0]} name the same argument ({name})")
            wrt.extend(range(starts[p % count], starts[p % count + 1]))
        for k in wrt:
            aval = traced.in_avals[k]
            if not is_differentiable(aval):
                raise UsageError(f"cannot differentiate with respect to {traced.in_names[k]} ({format_spec(aval)}): "
                                 "only real floating-point inputs have derivatives; leave it out of --argnums "
                                 "(--argnums all takes every floating-point leaf)")
    if not wrt:
        raise UsageError("--argnums selects no floating-point leaves: nothing to differentiate")
    leaves = [jnp.asarray(x) for x in jax.tree_util.tree_leaves(loaded.args)]
    return leaves, wrt


def _eliminate(fn, in_tree, leaves, wrt, order):
    """((vertices eliminated, Cost), Jacobian blocks ``[output][differentiated leaf]`` in ``wrt`` order,
    opaque vertices (see :attr:`jaxtool.elimination.Problem.opaque`)) of ``fn`` at the flat
    argument ``leaves`` (of ``in_tree``)."""
    import jax

    from jaxtool.elimination import blocks, build, run
    from jaxtool.graph import flatten
    from jaxtool.one_call import call_once
    from jaxtool.orders import resolve_order
    from jaxtool.rules import custom_rule, leaked_rule_error

    recorded, chosen = {}, set(wrt)

    def eliminate(args):
        def program(*flat):
            # the leaves not differentiated are read as this trace's values: a custom_jvp/custom_vjp
            # rule that closes over one is traced when elimination applies it, within this trace;
            # their program inputs stay (unused), so the numbering is the one `show` prints
            full = [x if k in chosen else args[k] for k, x in enumerate(flat)]
            return jax.tree_util.tree_leaves(fn(*jax.tree_util.tree_unflatten(in_tree, full)))

        flat = flatten(jax.make_jaxpr(program)(*args))
        recorded["rule"] = custom_rule(flat)
        problem = build(flat, args, wrt)
        vertices = resolve_order(order, problem)
        recorded["opaque"] = problem.opaque
        recorded["result"] = (vertices, run(problem, vertices))
        return blocks(problem)

    try:
        jac, note = call_once(eliminate, [leaves])
    except jax.errors.UnexpectedTracerError as error:  # a rule closing over a differentiated argument
        raise leaked_rule_error(recorded.get("rule"), error) from error
    columns = sorted(wrt)  # blocks() orders the differentiated inputs by flat index
    jac = [[row[columns.index(k)] for k in wrt] for row in jac]
    return recorded["result"], jac, recorded["opaque"], note


def _blocks(traced, wrt, jac) -> tuple:
    """The :class:`~jaxtool.report.Block` of every (output leaf, differentiated leaf), output-major."""
    import numpy as np

    from jaxtool.report import Block

    return tuple(Block(output=traced.out_names[i], input=traced.in_names[k],
                       out_shape=tuple(traced.out_avals[i].shape), in_shape=tuple(traced.in_avals[k].shape),
                       values=np.asarray(jac[i][j]))
                 for i in range(len(jac)) for j, k in enumerate(wrt))


def _check(fn, traced, leaves, wrt, blocks, rtol, atol):
    """Compare ``blocks`` with ``jax.jacrev`` and ``jax.jacfwd`` of ``fn``, the function ``traced``
    is the program of (see :class:`Check`)."""
    import jax
    import numpy as np

    from jaxtool.one_call import call_once
    from jaxtool.report import Check, Comparison
    from jaxtool.rules import carries_tangent, tangent_dtype
    from jaxtool.source import exception_message

    # complex outputs too: jax.jacrev then reports itself unavailable, jax.jacfwd compares
    outs = [i for i, aval in enumerate(traced.out_avals) if carries_tangent(aval)]
    if not outs:
        raise UsageError("--check: no output has a derivative (all outputs are integer or boolean)")
    skipped = tuple(traced.out_names[i] for i in range(len(traced.out_avals)) if i not in outs)
    n = len(wrt)
    # complex64: float32's; a program computing in a narrower float than it returns is checked at that
    # float's tolerance (jax.jacrev rounds cotangents to it where jax.jacfwd and jaxtool do not), and
    # so is a block of a narrower input (its dtype, as jax.jacrev's; jax.jacfwd's has the output's)
    # a reduce_precision to at most float16's (float32's) mantissa counts as a float16 (float32)
    mantissas = _reduced_mantissas(traced.closed_jaxpr.jaxpr)
    itemsize = min([tangent_dtype(traced.out_avals[i]).itemsize for i in outs]
                   + [tangent_dtype(traced.in_avals[k]).itemsize for k in wrt]
                   + [2 if m <= 10 else 4 if m <= 23 else 8 for m in mantissas]
                   + _computed_itemsizes(traced.closed_jaxpr.jaxpr))
    default_rtol, default_atol = DEFAULT_TOLERANCES.get(itemsize, DEFAULT_TOLERANCES[4])
    # it rounds jax.jacrev's cotangents (jax.jacfwd's tangents) by up to 2**-(m + 1) relative for m
    # mantissa bits: float16/bfloat16's default covers m >= 7
    if mantissas:
        rounding = 2.0 ** -(min(mantissas) + 1)
        default_rtol, default_atol = max(default_rtol, rounding), max(default_atol, rounding)
    rtol = default_rtol if rtol is None else rtol
    atol = default_atol if atol is None else atol

    def fun(*xs):
        full = list(leaves)
        for k, x in zip(wrt, xs):
            full[k] = x
        results = jax.tree_util.tree_leaves(fn(*jax.tree_util.tree_unflatten(traced.in_tree, full)))
        return [results[i] for i in outs]

    comparisons = []
    for name, transform in (("jax.jacrev", jax.jacrev), ("jax.jacfwd", jax.jacfwd)):
        try:
            reference, _ = call_once(transform(fun, argnums=tuple(range(n))), [leaves[k] for k in wrt])
        except Exception as exc:  # e.g. jax.jacfwd of a custom_vjp function
            comparisons.append(Comparison(name, unavailable=exception_message(exc)))
            continue
        errors = [_errors(b.values, np.asarray(reference[r][j]), rtol, atol)
                  for r, i in enumerate(outs) for j, b in enumerate(blocks[i * n:(i + 1) * n])]
        comparisons.append(Comparison(name, max_abs_error=max(e[0] for e in errors),
                                      max_rel_error=max(e[1] for e in errors), passed=all(e[2] for e in errors)))
    check = Check(rtol=rtol, atol=atol, comparisons=tuple(comparisons), skipped_outputs=skipped)
    if not any(c.unavailable is None for c in comparisons):
        reasons = "; ".join(f"{c.reference}: {c.unavailable}" for c in comparisons)
        raise UnsupportedError(f"--check: neither reference can differentiate this program ({reasons})")
    return check


def _computed_itemsizes(jaxpr) -> list:
    """The item sizes of the floating-point values ``jaxpr`` (and the jaxprs in it) computes."""
    import jax.numpy as jnp

    from jaxtool.printing import subjaxprs

    sizes = []
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            dtype = getattr(var.aval, "dtype", None)
            if dtype is not None and jnp.issubdtype(dtype, jnp.inexact):
                sizes.append(jnp.finfo(dtype).bits // 8)
        for _, _, sub in subjaxprs(eqn.params):
            sizes += _computed_itemsizes(sub)
    return sizes


def _reduced_mantissas(jaxpr) -> list:
    """The mantissa bits of every ``reduce_precision`` in ``jaxpr`` and the jaxprs in it."""
    from jaxtool.printing import subjaxprs

    bits = [eqn.params["mantissa_bits"] for eqn in jaxpr.eqns if eqn.primitive.name == "reduce_precision"]
    for eqn in jaxpr.eqns:
        for _, _, sub in subjaxprs(eqn.params):
            bits += _reduced_mantissas(sub)
    return bits


def _errors(ours, reference, rtol: float, atol: float):
    """(largest absolute error, largest relative error where ``|reference| > atol``, whether all entries pass)."""
    import numpy as np

    wide = np.complex128 if np.iscomplexobj(ours) or np.iscomplexobj(reference) else np.float64
    a = np.asarray(ours, wide)
    b = np.asarray(reference, wide)
    if a.size == 0:
        return 0.0, 0.0, True
    with np.errstate(invalid="ignore", divide="ignore"):
        same = (a == b) | (np.isnan(a) & np.isnan(b))
        diff = np.where(same, 0.0, np.abs(a - b))
        diff = np.where(np.isnan(diff), np.inf, diff)
        ok = same | (np.isfinite(b) & (diff <= atol + rtol * np.abs(b)))
        large = np.isfinite(b) & (np.abs(b) > atol)
        rel = float(np.max(diff[large] / np.abs(b[large]))) if large.any() else 0.0
    return float(np.max(diff)), rel, bool(ok.all())


def _check_save_path(path: str) -> None:
    """A :class:`UsageError` before any work where ``--save`` names no file it could create."""
    from pathlib import Path

    if not path.strip() or Path(path).is_dir():
        raise UsageError(f"--save {path!r}: expected the name of a file to write, such as jac.npz")
    if not Path(path).parent.is_dir():
        raise UsageError(f"--save {path}: no such directory {Path(path).parent}")


def _save(path: str, blocks, n_wrt: int) -> None:
    """Write ``jac_I_J`` arrays to the ``.npz`` file ``path`` (exactly that name)."""
    import numpy as np

    arrays = {}
    for index, block in enumerate(blocks):
        values = block.values
        if values.dtype.kind == "V":  # bfloat16 and other ml_dtypes: numpy cannot read them back
            values = values.astype(np.float32)
        arrays[f"jac_{index // n_wrt}_{index % n_wrt}"] = values
    try:
        with open(path, "wb") as f:
            np.savez(f, **arrays)
    except OSError as exc:
        raise UsageError(f"--save {path}: cannot write it ({exc.strerror or exc})") from None
