"""Global settings shared by all subcommands: backend, x64, colour, verbosity.

No JAX import at module level; :meth:`Settings.activate` imports and configures JAX.
"""

from __future__ import annotations

import contextlib
import io
import os
import select
import sys
from dataclasses import dataclass

import click

from jaxtool.errors import StdoutClosed, UsageError


@dataclass
class Settings:
    backend: str = "cpu"
    x64: bool = False
    color: str = "auto"
    quiet: bool = False
    debug: bool = False

    @property
    def use_color(self) -> bool:
        """Whether to colour stdout: ``--color``, then ``NO_COLOR``, then is-a-terminal."""
        if self.color == "always":
            return True
        if self.color == "never" or os.environ.get("NO_COLOR"):
            return False
        return sys.stdout is not None and sys.stdout.isatty()

    def console(self, *, stderr: bool = False):
        """A rich console for stdout (data) or stderr (diagnostics) honouring the colour setting."""
        from rich.console import Console

        color = self.use_color if not stderr else (self.color != "never" and not os.environ.get("NO_COLOR")
                                                   and (self.color == "always" or sys.stderr.isatty()))
        # (sys.stdout is None where descriptor 1 was closed when Python started: a command that has no
        # data to print, as typecheck of a correct program, still says its verdict on stderr)
        out = sys.stderr if stderr else _ClosedStdout() if sys.stdout is None else sys.stdout
        console = Console(file=out, force_terminal=color, no_color=not color,
                          highlight=False, soft_wrap=True, width=None if color else 200)
        console.on_broken_pipe = _broken_pipe  # (rich's own handler exits with status 1, "check failed")
        return console

    @staticmethod
    def emit(text: str, *, nl: bool = True) -> None:
        """Data (JSON, DOT, lowered text) on stdout; a closed stdout is :class:`StdoutClosed`."""
        if sys.stdout is None:
            raise StdoutClosed
        try:
            fd = sys.stdout.fileno()
        except (AttributeError, OSError, ValueError):  # (a stream without a descriptor: a test's capture)
            fd = None
        try:
            if fd is None:
                click.echo(text, nl=nl)
                return
            # written to the descriptor until all of it is out: a buffered write that a reader closing
            # the pipe cut short returned as if whole (JSON of 946 KB into `head -c 100`: exit 0)
            sys.stdout.flush()
            data = memoryview((text + "\n" * nl).encode(sys.stdout.encoding or "utf-8", sys.stdout.errors or "strict"))
            while data:
                try:
                    data = data[os.write(fd, data):]
                except BlockingIOError:  # (a descriptor left non-blocking by another program)
                    select.select([], [fd], [])
        except BrokenPipeError as exc:
            raise StdoutClosed from exc

    def note(self, message: str) -> None:
        """A diagnostic note on stderr, unless ``--quiet``."""
        if not self.quiet:
            print(message, file=sys.stderr)

    @staticmethod
    @contextlib.contextmanager
    def user_code():
        """A context for running the user's module and function: what they print goes to stderr, so
        that stdout carries only jaxtool's data (``--format json`` stays one JSON document).

        Both ``sys.stdout`` and file descriptor 1 are redirected, so that ``os.write(1, ...)``, a C
        extension's ``printf`` or a ``jax.debug.print`` land on stderr too. Where descriptor 1 or 2
        is not open, only ``sys.stdout`` is redirected.
        """
        if sys.stdout is not None:  # (None where descriptor 1 was closed when Python started)
            sys.stdout.flush()
        saved = None
        try:
            saved = os.dup(1)
            os.dup2(2, 1)
        except OSError:
            if saved is not None:
                os.close(saved)
                saved = None
        try:
            with contextlib.redirect_stdout(sys.stderr):
                yield
        finally:
            if saved is not None:
                if sys.stderr is not None:
                    sys.stderr.flush()
                os.dup2(saved, 1)
                os.close(saved)

    def activate(self, *, require_device: bool = True) -> None:
        """Import JAX and apply the backend and x64 settings.

        With ``require_device``, asking for a GPU where JAX sees none is a :class:`UsageError`.
        """
        if self.backend == "cpu":
            os.environ.setdefault("JAX_PLATFORMS", "cpu")
        import jax

        jax.config.update("jax_enable_x64", bool(self.x64))
        if self.backend == "gpu" and require_device:
            try:
                devices = jax.devices("gpu")
            except RuntimeError:
                devices = []
            if not devices:
                raise UsageError("--backend gpu: JAX sees no GPU on this machine (try --backend cpu)")
            jax.config.update("jax_default_device", devices[0])
        elif self.backend == "cpu":
            jax.config.update("jax_default_device", jax.devices("cpu")[0])


class _ClosedStdout(io.TextIOBase):
    """The stdout of a process started with descriptor 1 closed: writing any text is :class:`StdoutClosed`."""

    def write(self, text: str) -> int:
        if text:
            raise StdoutClosed
        return 0


def _broken_pipe() -> None:
    """Let a closed stdout reach :func:`jaxtool.cli.main`, which exits with its own status."""
    raise StdoutClosed
