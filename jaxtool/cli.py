"""The ``jaxtool`` command line: global options, lazy subcommands, errors to exit codes.

Nothing here imports JAX: ``jaxtool --help`` and ``jaxtool CMD --help`` stay fast. Each
subcommand lives in one file, ``jaxtool/commands/NAME.py``, exporting a click command named
``command``; JAX is imported inside the command's body.
"""

from __future__ import annotations

import importlib
import os
import sys

import click

from jaxtool.errors import EXIT_USAGE, JaxtoolError, StdoutClosed
from jaxtool.settings import Settings

EXIT_INTERNAL = 70
#: stdout was closed before the data was all written (``jaxtool show f.py:g | head``): the status a
#: process killed by SIGPIPE reports (128 + 13); Python ignores the signal and raises BrokenPipeError
EXIT_BROKEN_PIPE = 141

SUBCOMMANDS = {
    "show": "Pretty-print the jaxpr of a function.",
    "typecheck": "Check a function's jaxpr (or a jaxpr object).",
    "jac": "Compute a Jacobian by vertex elimination.",
}


class LazyGroup(click.Group):
    """A click group whose subcommands are imported only when used."""

    def list_commands(self, ctx):
        return list(SUBCOMMANDS)

    def get_command(self, ctx, name):
        if name not in SUBCOMMANDS:
            return None
        module = importlib.import_module(f"jaxtool.commands.{name.replace('-', '_')}")
        return module.command

    def format_commands(self, ctx, formatter):
        rows = [(name, help_text) for name, help_text in SUBCOMMANDS.items()]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--backend", type=click.Choice(["cpu", "gpu"]), default="cpu", show_default=True,
              help="JAX platform to run on; 'gpu' is an error (exit 2) where JAX sees none.")
@click.option("--x64", is_flag=True, help="Enable float64 (jax_enable_x64).")
@click.option("--color", type=click.Choice(["auto", "always", "never"]), default="auto", show_default=True,
              help="Colour output; 'auto' honours NO_COLOR and whether stdout is a terminal.")
@click.option("-q", "--quiet", is_flag=True, help="Print only data; no progress or notes on stderr.")
@click.option("--debug", is_flag=True, help="Show full Python tracebacks on errors.")
@click.version_option(package_name="jaxtool")
@click.pass_context
def cli(ctx, backend, x64, color, quiet, debug):
    """jaxtool: inspect, typecheck and differentiate JAX programs.

    TARGET is `path/to/file.py:qualname` or `package.module:qualname`.
    """
    ctx.obj = Settings(backend=backend, x64=x64, color=color, quiet=quiet, debug=debug)


def _quiet_if_stderr_unwritable() -> None:
    """Where descriptor 2 is open for reading only, diagnostics go to the null device: a failed
    write would end the process with status 1 ("a check failed"), not the documented code. (Closed
    with ``2>&-``, stderr is None, which click and rich skip; but behind a pyenv shim descriptor 2
    is then the shim's script, open for reading.)"""
    try:
        import fcntl

        flags = fcntl.fcntl(sys.stderr.fileno(), fcntl.F_GETFL)
    except (ImportError, AttributeError, ValueError, OSError):  # no fcntl (Windows), or no stderr
        return
    if flags & os.O_ACCMODE == os.O_RDONLY:  # (the descriptor, where the user's os.write(1, ...) goes too)
        _to_null_device(sys.stderr.fileno())


def _to_null_device(fd: int) -> None:
    """Point descriptor ``fd`` at the null device."""
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, fd)
    os.close(null)


def main(argv: list[str] | None = None) -> None:
    """Run the CLI, turning jaxtool errors into one line on stderr and an exit code."""
    args = sys.argv[1:] if argv is None else argv
    command_at = next((n for n, arg in enumerate(args) if arg in SUBCOMMANDS), len(args))
    debug = "--debug" in args[:command_at]  # (a global option: after the command it is another option's value)
    _quiet_if_stderr_unwritable()
    try:
        code = cli.main(args=args, prog_name="jaxtool", standalone_mode=False)
    except click.exceptions.Exit as exc:
        code = exc.exit_code
    except click.exceptions.Abort:  # (click's form of KeyboardInterrupt)
        click.echo("Aborted.", err=True)
        code = 130
    except click.ClickException as exc:
        exc.show()
        code = exc.exit_code
    except JaxtoolError as exc:
        if debug:
            import traceback

            traceback.print_exc()
        click.echo(f"error: {exc}", err=True)
        code = exc.exit_code
    except KeyboardInterrupt:
        code = 130
    except (StdoutClosed, BrokenPipeError):
        if sys.stdout is not None:  # (so that the exit's flush is quiet)
            _to_null_device(sys.stdout.fileno())
        code = EXIT_BROKEN_PIPE
    except Exception as exc:  # a bug in jaxtool (one line unless --debug), or out of memory
        if debug:
            import traceback

            traceback.print_exc()
        if isinstance(exc, MemoryError) or "RESOURCE_EXHAUSTED" in str(exc):
            reason = (str(exc).splitlines() or [""])[0]
            click.echo(f"error: out of memory ({type(exc).__name__}: {reason}); each Jacobian block is formed "
                       "densely, as jax.jacrev returns it: differentiate fewer elements", err=True)
            code = EXIT_USAGE
        else:
            click.echo(f"internal error: {type(exc).__name__}: {exc} (rerun with --debug for a traceback)", err=True)
            code = EXIT_INTERNAL
    sys.exit(code or 0)


__all__ = ["cli", "main", "EXIT_USAGE"]
