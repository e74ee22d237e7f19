"""Where in the user's source a jaxpr equation or an exception comes from.

A frame is *library* code when its file lies in the standard library, in JAX or one of the
packages JAX is built on (jaxlib, numpy, ml_dtypes, opt_einsum, scipy), or in jaxtool itself;
every other frame (the user's files, other installed packages, ``<string>``) is *user* code.
Equation tracebacks come from ``eqn.source_info.traceback`` (public attributes only).
"""

from __future__ import annotations

import functools
import importlib.util
import linecache
import os
import sysconfig
import traceback as _traceback
from dataclasses import dataclass

LIBRARY_PACKAGES = ("jax", "jaxlib", "numpy", "ml_dtypes", "opt_einsum", "scipy", "jaxtool")


@dataclass(frozen=True)
class Frame:
    """One source position: file, line and enclosing function."""

    file_name: str
    line_num: int
    function_name: str


def _norm(path: str) -> str:
    return os.path.normcase(os.path.realpath(path))


@functools.cache
def _library_roots() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(package folders, standard-library folders), normalised."""
    packages = []
    for name in LIBRARY_PACKAGES:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        for folder in (spec.submodule_search_locations or []) if spec else []:
            packages.append(_norm(folder) + os.sep)
    paths = sysconfig.get_paths()
    stdlib = {_norm(paths[key]) + os.sep for key in ("stdlib", "platstdlib") if key in paths}
    return tuple(packages), tuple(stdlib)


@functools.lru_cache(maxsize=4096)
def is_library(file_name: str) -> bool:
    """Whether ``file_name`` belongs to the standard library, JAX and its foundations, or jaxtool."""
    if file_name.startswith("<"):
        return file_name.startswith("<frozen")
    path = _norm(file_name)
    packages, stdlib = _library_roots()
    if path.startswith(packages):
        return True
    for root in stdlib:
        if path.startswith(root):
            rest = path[len(root):].split(os.sep)
            return not ({"site-packages", "dist-packages"} & set(rest))
    return False


def _frames(source_info) -> list[Frame]:
    """Frames of a ``SourceInfo`` (or a JAX ``Traceback``), innermost first."""
    tb = getattr(source_info, "traceback", source_info)
    if tb is None or not hasattr(tb, "frames"):
        return []
    return [Frame(f.file_name, f.line_num, f.function_name) for f in tb.frames]


def user_frame(source_info) -> Frame | None:
    """The innermost user frame of an equation's ``source_info`` (or a ``Traceback``), if any."""
    return next((f for f in _frames(source_info) if not is_library(f.file_name)), None)


def display_path(file_name: str) -> str:
    """``file_name`` relative to the working directory when it lies under it, else unchanged."""
    if file_name.startswith("<"):
        return file_name
    cwd = os.getcwd()
    path = os.path.abspath(file_name)
    if path == cwd or path.startswith(cwd.rstrip(os.sep) + os.sep):
        return os.path.relpath(path, cwd)
    return file_name


def format_frame(frame: Frame) -> str:
    """``file:line`` for ``frame``, the path relative to the working directory when under it."""
    return f"{display_path(frame.file_name)}:{frame.line_num}"


def location(source_info) -> str | None:
    """``file:line`` of the innermost user frame of ``source_info``, or ``None``."""
    frame = user_frame(source_info)
    return format_frame(frame) if frame else None


def source_line(frame: Frame) -> str:
    """The stripped text of ``frame``'s line ('' when the file cannot be read)."""
    return linecache.getline(frame.file_name, frame.line_num).strip()


def exception_frame(exc: BaseException, prefer: str | None = None) -> Frame | None:
    """The frame an exception is best reported at.

    A ``SyntaxError`` is reported where the bad code is. Otherwise the innermost traceback
    frame in the file ``prefer`` (when given), else the innermost user frame.
    """
    if isinstance(exc, SyntaxError) and exc.filename and exc.lineno:
        return Frame(exc.filename, exc.lineno, "<module>")
    frames = [Frame(s.filename, s.lineno or 0, s.name) for s in _traceback.extract_tb(exc.__traceback__)][::-1]
    if prefer:
        wanted = _norm(prefer)
        preferred = next((f for f in frames if not f.file_name.startswith("<") and _norm(f.file_name) == wanted),
                         None)
        if preferred:
            return preferred
    return next((f for f in frames if not is_library(f.file_name)), None)


def location_of_exception(exc: BaseException, prefer: str | None = None) -> str | None:
    """``file:line`` of :func:`exception_frame`, or ``None`` when no user frame is found."""
    frame = exception_frame(exc, prefer)
    return format_frame(frame) if frame else None


def wrapper_chain(fn) -> list:
    """``fn`` and the functions behind it, outermost first: through partials, bound methods and
    ``__wrapped__`` wrappers (at most 100: wrapper chains can be cyclic)."""
    chain = [fn]
    while len(chain) < 100:
        if isinstance(fn, functools.partial):
            fn = fn.func
        elif hasattr(fn, "__func__"):
            fn = fn.__func__
        elif hasattr(fn, "__wrapped__"):
            fn = fn.__wrapped__
        else:
            break
        chain.append(fn)
    return chain


def unwrap(fn):
    """The innermost function behind partials, bound methods and ``__wrapped__`` wrappers."""
    return wrapper_chain(fn)[-1]


def code_file(fn) -> str | None:
    """The file that defines ``fn`` (through wrappers, see :func:`unwrap`, and callable objects)."""
    fn = unwrap(fn)
    code = getattr(fn, "__code__", None) or getattr(getattr(type(fn), "__call__", None), "__code__", None)
    file_name = getattr(code, "co_filename", None)
    return file_name if file_name and not file_name.startswith("<") else None


def exception_message(exc: BaseException) -> str:
    """``Type: first line of the message`` for one-line error reports."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if len(lines) > 1 and lines[0].endswith(":"):  # ("... The error was:" and the cause on the next line)
        lines[0] = f"{lines[0]} {lines[1]}"
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
