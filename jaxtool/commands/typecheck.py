"""``jaxtool typecheck``: check a function's jaxpr, or a jaxpr object, and report problems.

No JAX import at module level (``jaxtool typecheck --help`` stays fast).
"""

from __future__ import annotations

import inspect
import json

import click

from jaxtool.errors import CheckFailed, LoadError, UsageError

FORMATS = ("text", "json", "github")


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _zero_arg_result(obj):
    """The jaxpr ``obj()`` returns when ``obj`` is a callable taking no required arguments that
    returns one (a jaxpr factory), else None.

    ``obj`` is called while JAX traces it, not run: a zero-argument *program* is not executed (its
    host callbacks do not run, its arithmetic is not computed), and any exception is left to the
    function path, which reports it as it reports a failing trace. Only a factory whose jaxpr holds
    constants of that trace (arrays it computed with ``jnp``) is then called for real.
    """
    import jax
    import jax.extend.core as jcore

    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    required = [p for p in signature.parameters.values()
                if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if required:
        return None
    made = []

    def probe():
        result = obj()
        if isinstance(result, (jcore.Jaxpr, jcore.ClosedJaxpr)):
            made.append(result)
            return ()
        return result

    try:
        jax.make_jaxpr(probe)()
    except Exception:  # noqa: BLE001 - a program that fails to trace: the function path reports it
        pass
    if not made:
        return None
    consts = made[0].consts if isinstance(made[0], jcore.ClosedJaxpr) else []
    if not any(isinstance(c, jax.core.Tracer) for c in consts):
        return made[0]
    try:
        return obj()
    except Exception as exc:
        from jaxtool.source import exception_message, location_of_exception

        raise LoadError(f"calling {getattr(obj, '__qualname__', 'the target')}() failed: "
                        f"{exception_message(exc)}", location=location_of_exception(exc)) from exc


def _leaves_by_argument(arg_names, in_names, in_avals) -> tuple[dict[str, list], dict[str, list]]:
    """The abstract values of each argument's leaves (``params["w"]`` belongs to ``params``), and
    their key paths (``["w"]``)."""
    grouped: dict[str, list] = {name: [] for name in arg_names}
    paths: dict[str, list] = {name: [] for name in arg_names}
    for leaf_name, aval in zip(in_names, in_avals):
        for name in arg_names:
            if leaf_name == name or leaf_name.startswith((f"{name}[", f"{name}.")):
                grouped[name].append(aval)
                paths[name].append(leaf_name[len(name):])
                break
    return grouped, paths


def _def_line(obj) -> int | None:
    from jaxtool.source import unwrap

    try:
        return inspect.getsourcelines(unwrap(obj))[1]
    except (TypeError, OSError):
        return None


def _annotations(loaded) -> dict:
    """The target's annotations: ``loaded.annotations``, except that spec strings naming
    dimensions (``"f32[n,4]"``, alone or in a JSON pytree spec, which the loader cannot turn into
    shapes) are kept as written."""
    import ast

    from jaxtool.loading import annotations_apply
    from jaxtool.source import unwrap
    from jaxtool.typecheck import is_shape_annotation

    result = dict(loaded.annotations)
    if not annotations_apply(loaded.obj):
        return result
    try:
        signature = inspect.signature(unwrap(loaded.obj))
    except (TypeError, ValueError):
        return result
    raw = {p.name: p.annotation for p in signature.parameters.values()}
    raw["return"] = signature.return_annotation
    for key, annotation in raw.items():
        if isinstance(annotation, str) and annotation[:1] in "'\"":  # from __future__ import annotations
            try:
                annotation = ast.literal_eval(annotation)
            except (ValueError, SyntaxError):
                continue
        if isinstance(annotation, str) and is_shape_annotation(annotation):
            result[key] = annotation
    return result


def _check_function(settings, target, specs, static, inputs, seed):
    """Load and trace a function target; typecheck its jaxpr and its annotations."""
    from jaxtool import typecheck
    from jaxtool.loading import load_target
    from jaxtool.source import display_path
    from jaxtool.tracing import trace

    # shapes suffice, as for `show`: no values are drawn (a spec too large to allocate is fine)
    loaded = load_target(target, specs, inputs=inputs, seed=seed, static=static, concrete=False)
    for line in loaded.notes(seed):
        settings.note(line)
    traced = trace(loaded.fn, loaded.args, names=loaded.arg_names, source_file=loaded.source_file)
    report = typecheck.check_jaxpr(traced.closed_jaxpr, warn_float64=not settings.x64)
    arguments, paths = _leaves_by_argument(loaded.arg_names, traced.in_names, traced.in_avals)
    paths["return"] = [name[len("out"):] for name in traced.out_names]
    report.problems.extend(typecheck.check_annotations(
        _annotations(loaded), arguments, traced.out_avals,
        file=display_path(loaded.source_file) if loaded.source_file else None,
        line=_def_line(loaded.obj), name=loaded.name, paths=paths))
    return report, loaded.name


def _print_text(settings, problems, strict: bool) -> None:
    from rich.text import Text

    console = settings.console()
    for problem in problems:
        style = "bold red" if problem.severity(strict) == "error" else "bold yellow"
        console.print(Text.assemble((f"{problem.location}:", "bold"), " ", (problem.code, style), " ",
                                    problem.message))
        if problem.equation:
            console.print(Text("\n".join("    " + line for line in problem.equation.splitlines()), style="dim"))


def _escape(text: str, *, prop: bool = False) -> str:
    """Escape a GitHub workflow-command message (or property value, with ``prop``)."""
    text = text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")
    return text.replace(":", "%3A").replace(",", "%2C") if prop else text


def _github_line(problem, strict: bool) -> str:
    props = []
    if problem.file is not None and problem.line is not None:
        props = [f"file={_escape(problem.file, prop=True)}", f"line={problem.line}", f"col={problem.col}"]
    message = problem.message if props else f"{problem.message} (at {problem.where})"
    head = problem.severity(strict) + (" " + ",".join(props) if props else "")
    return f"::{head}::{_escape(f'{problem.code} {message}')}"


@click.command("typecheck")
@click.argument("target")
@click.argument("specs", nargs=-1)
@click.option("--static", "static", multiple=True, metavar="NAME=VALUE",
              help="A static (non-traced) argument, e.g. --static n=3 (repeatable).")
@click.option("--inputs", type=click.Path(dir_okay=False), metavar="FILE.npz",
              help="Take the arguments from an .npz file instead of drawing them from SPECS.")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True,
              help="Seed for drawn values (unused: typecheck needs only shapes; kept for parity with other commands).")
@click.option("--strict", is_flag=True, help="Treat warnings (W2xx) as errors.")
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="text", show_default=True,
              help="text: file:line:col: CODE message; json: a list of objects; github: annotations.")
@click.pass_obj
def command(settings, target, specs, static, inputs, seed, strict, fmt):
    """Typecheck the jaxpr of TARGET and report problems as file:line:col: CODE message.

    TARGET is a function (traced with SPECS such as f32[3,4], --inputs or its annotations),
    a ClosedJaxpr/Jaxpr object, or a zero-argument callable returning one. Codes: JT0xx
    malformed jaxprs, JT1xx annotation mismatches, W2xx warnings (down-casts, float64, host
    callbacks), which are errors with --strict. Exit 1 when errors are found, else 0 (warnings alone).
    """
    settings.activate()
    import jax.extend.core as jcore

    from jaxtool import typecheck
    from jaxtool.loading import resolve

    with settings.user_code():
        obj = resolve(target)
        jaxpr = obj if isinstance(obj, (jcore.Jaxpr, jcore.ClosedJaxpr)) else \
            _zero_arg_result(obj) if callable(obj) else None
        if jaxpr is not None:
            if specs or static or inputs:
                raise UsageError(f"{target} is a jaxpr: SPECS, --static and --inputs do not apply")
            report, name = typecheck.check_jaxpr(jaxpr, warn_float64=not settings.x64), target.rpartition(":")[2]
        else:
            report, name = _check_function(settings, target, specs, static, inputs, seed)

    if fmt == "json":
        settings.emit(json.dumps([p.to_dict(strict) for p in report.problems], indent=2))
    elif fmt == "github":
        for problem in report.problems:
            settings.emit(_github_line(problem, strict))
    else:
        _print_text(settings, report.problems, strict)

    errors, warnings = report.counts(strict)
    size = f"in {name} ({_plural(report.n_equations, 'equation')})"
    if errors:
        raise CheckFailed(f"{_plural(errors, 'error')}, {_plural(warnings, 'warning')} {size}")
    settings.note(f"ok: {_plural(warnings, 'warning')} {size}" if warnings else f"ok: no problems {size}")
