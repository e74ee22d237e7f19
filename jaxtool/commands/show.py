"""``jaxtool show``: pretty-print a function's jaxpr, or its lowered StableHLO/HLO module.

JAX is imported inside the command, never at module level (``--help`` stays fast).
"""

from __future__ import annotations

import json

import click
from click.core import ParameterSource

from jaxtool.errors import UsageError


@click.command(name="show")
@click.argument("target")
@click.argument("specs", nargs=-1)
@click.option("--static", "static", multiple=True, metavar="NAME=VALUE",
              help="A static (non-array) argument, as a Python literal; repeatable.")
@click.option("--inputs", "inputs", metavar="FILE.npz", help="Take the arguments from an .npz file.")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True,
              help="Seed for drawn values (unused: show needs only shapes; kept for parity with other commands).")
@click.option("--format", "fmt", type=click.Choice(["text", "json", "dot"]), default="text", show_default=True,
              help="Styled text, JSON (every equation, nested jaxprs, summary) or a Graphviz digraph.")
@click.option("--stage", type=click.Choice(["jaxpr", "stablehlo", "hlo"]), default="jaxpr", show_default=True,
              help="Show the jaxpr, or the module lowered for --backend (no device of it needed).")
@click.option("--source", "with_source", is_flag=True, help="Show each equation's user file:line and code.")
@click.option("--vertices", is_flag=True, help="Show the vertex number(s) of each equation's results.")
@click.option("--depth", type=click.IntRange(min=0), default=None, metavar="N",
              help="Fold jaxprs nested deeper than N levels to '{ ... K eqns }' [default: unlimited].")
@click.option("--inline", is_flag=True,
              help="Show the inlined program (jit/closed_call/remat bodies inlined), results named by vertex.")
@click.option("--summary/--no-summary", "with_summary", default=True, show_default=True,
              help="Follow the jaxpr with inputs, outputs and equation counts (text; JSON always has them).")
@click.pass_obj
def command(settings, target, specs, static, inputs, seed, fmt, stage, with_source, vertices, depth, inline,
            with_summary):
    """Pretty-print the jaxpr of TARGET traced at SPECS.

    TARGET is `path/to/file.py:qualname` or `package.module:qualname`; SPECS give the arguments'
    shapes and dtypes (`f32[8,3]`, or JSON pytrees of them) where annotations or an
    `FN_example_args()` companion do not. Only shapes are needed: no values are computed.

    \b
    Examples:
      jaxtool show model.py:loss '{"w": "f32[3,4]"}' f32[8,3] --vertices --source
      jaxtool show model.py:loss --depth 1 --no-summary
      jaxtool --backend gpu show model.py:loss --stage stablehlo
    """
    if fmt == "dot" and stage != "jaxpr":
        raise UsageError("--format dot needs --stage jaxpr")
    jaxpr_only = [flag for flag, given in (("--source", with_source), ("--vertices", vertices),
                                           ("--depth", depth is not None), ("--inline", inline)) if given]
    if jaxpr_only and stage != "jaxpr":
        raise UsageError(f"{' and '.join(jaxpr_only)} {'apply' if len(jaxpr_only) > 1 else 'applies'} to "
                         f"--stage jaxpr only, not to the lowered {stage} module")
    given = click.get_current_context().get_parameter_source("with_summary") is ParameterSource.COMMANDLINE
    if given and (fmt != "text" or stage != "jaxpr"):
        raise UsageError("--summary/--no-summary apply to the text of --stage jaxpr only (its JSON always has "
                         "the summary, as data)")
    settings.activate(require_device=stage == "jaxpr")

    from jaxtool.loading import load_target
    from jaxtool.tracing import trace

    with settings.user_code():
        loaded = load_target(target, specs, inputs=inputs, seed=seed, static=static, concrete=False)
        for line in loaded.notes(seed):
            settings.note(line)
        traced = trace(loaded.fn, loaded.args, names=loaded.arg_names, source_file=loaded.source_file)
    if stage != "jaxpr":
        _show_lowered(settings, loaded, stage, fmt)
        return

    from jaxtool import export, printing
    from jaxtool.graph import flatten

    program = flatten(traced.closed_jaxpr)
    want_source = fmt == "json" or (fmt == "text" and with_source)
    if inline:
        view = printing.build_flat_view(program, depth=depth, source=want_source)
    else:
        view = printing.build_view(traced.closed_jaxpr, program=program, depth=depth, source=want_source)
    summary = printing.summarize(program if inline else traced.closed_jaxpr, view,  # (what is printed)
                                 in_names=traced.in_names, out_names=traced.out_names)

    if fmt == "json":
        settings.emit(json.dumps(export.to_json(view, summary), indent=2))
    elif fmt == "dot":
        settings.emit(export.to_dot(view, summary, name=target.rpartition(":")[2] or "jaxpr"), nl=False)
    else:
        console = settings.console()
        console.print(printing.render(view, vertices=vertices, source=with_source))
        if with_summary:
            console.print()
            console.print(printing.render_summary(summary))


def _show_lowered(settings, loaded, stage: str, fmt: str) -> None:
    """Print the module ``loaded.fn`` lowers to for the chosen backend."""
    from jaxtool.export import PLATFORMS, lowered_text

    with settings.user_code():
        text = lowered_text(loaded.fn, loaded.args, stage=stage, backend=settings.backend)
    if fmt == "json":
        settings.emit(json.dumps({"stage": stage, "backend": settings.backend,
                                  "platform": PLATFORMS[settings.backend], "text": text}, indent=2))
    else:
        settings.emit(text, nl=not text.endswith("\n"))
