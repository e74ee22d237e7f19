"""Errors that jaxtool reports to users, each with a stable exit code.

| code | meaning                                                                  |
|------|--------------------------------------------------------------------------|
| 0    | success                                                                  |
| 1    | a check failed (type errors, a failed ``--check``, a budget exceeded)    |
| 2    | usage error (bad option, bad spec, unknown backend, invalid order)       |
| 3    | the target could not be loaded or traced                                 |
| 4    | the program uses something jaxtool cannot handle                         |

This module must not import JAX: the CLI imports it before JAX is needed.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_CHECK_FAILED = 1
EXIT_USAGE = 2
EXIT_LOAD = 3
EXIT_UNSUPPORTED = 4


class JaxtoolError(Exception):
    """Base class: a problem reported as one line, with an exit code."""

    exit_code = EXIT_USAGE

    def __init__(self, message: str, *, location: str | None = None):
        super().__init__(message)
        self.message = message
        self.location = location

    def __str__(self) -> str:
        return f"{self.location}: {self.message}" if self.location else self.message


class UsageError(JaxtoolError):
    """A user mistake on the command line or in an API call (exit 2)."""

    exit_code = EXIT_USAGE


class SpecError(UsageError):
    """An input specification (``f32[3,4]``, pytree JSON, ``--static``) is malformed."""


class OrderError(UsageError):
    """An elimination order is not a valid permutation of the eliminable vertices."""


class LoadError(JaxtoolError):
    """The target could not be imported, found, called or traced (exit 3)."""

    exit_code = EXIT_LOAD


class UnsupportedError(JaxtoolError):
    """The program uses something jaxtool cannot handle (exit 4).

    ``primitive`` names the JAX primitive; ``location`` is the user's ``file:line``.
    """

    exit_code = EXIT_UNSUPPORTED

    def __init__(self, message: str, *, primitive: str | None = None, location: str | None = None):
        super().__init__(message, location=location)
        self.primitive = primitive


class CheckFailed(JaxtoolError):
    """A requested check found problems (exit 1)."""

    exit_code = EXIT_CHECK_FAILED


class StdoutClosed(Exception):
    """stdout was closed before all the data was written (``| head``, ``>&-``): exit 141, with no
    message, as a process killed by SIGPIPE reports. Not an ``OSError``: click ends the process
    with status 1 ("a check failed") on a broken-pipe ``OSError`` it sees."""


class OpByOpWarning(RuntimeWarning):
    """XLA could not compile a staged Jacobian (an ``INTERNAL`` error of its own, which ``jax.jit`` of
    the function itself may meet too), so it was computed op by op, as ``jax.jacrev`` computes
    outside ``jax.jit``: the same values, more slowly."""
