"""Trace a function to a closed jaxpr, keeping the pytree structure and readable leaf names.

Input leaves are named by argument and pytree path (``x``, ``params["w"]``, ``batch[0]``,
``state.mu``), output leaves likewise from ``out`` (``out``, ``out[0]``, ``out["loss"]``).
An exception raised while tracing the user's function becomes a :class:`LoadError` that
names the user's ``file:line``.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

from jaxtool.errors import JaxtoolError, LoadError
from jaxtool.source import code_file, exception_message, location_of_exception


@dataclass(frozen=True)
class Traced:
    """A traced function: its closed jaxpr plus the pytree structure and names of its leaves."""

    closed_jaxpr: Any
    in_tree: Any
    out_tree: Any
    in_names: list[str]
    out_names: list[str]
    in_avals: list
    out_avals: list

    @property
    def jaxpr(self):
        """The (open) jaxpr of :attr:`closed_jaxpr`."""
        return self.closed_jaxpr.jaxpr


def format_path(path) -> str:
    """A pytree key path as Python-like text: ``["w"]``, ``[0]``, ``.mu``; string keys are quoted
    and escaped as JSON strings (``["a\\"b"]``, ``["two\\nlines"]``), so a name is one line."""
    import json

    import jax

    parts = []
    for key in path:
        if isinstance(key, jax.tree_util.DictKey):
            parts.append(f"[{json.dumps(key.key, ensure_ascii=False)}]" if isinstance(key.key, str)
                         else f"[{key.key!r}]")
        elif isinstance(key, jax.tree_util.SequenceKey):
            parts.append(f"[{key.idx}]")
        elif isinstance(key, jax.tree_util.GetAttrKey):
            parts.append(f".{key.name}")
        elif isinstance(key, jax.tree_util.FlattenedIndexKey):
            parts.append(f"[{key.key}]")
        else:
            parts.append(str(key))
    return "".join(parts)


def argument_names(fn, count: int) -> list[str]:
    """Names for ``count`` positional arguments of ``fn`` from its signature.

    Extra arguments taken by ``*args`` are ``args[0]``, ``args[1]``, ...; without a usable
    signature the names are ``arg0``, ``arg1``, ...
    """
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        params = []
    names: list[str] = []
    for param in params:
        if len(names) == count:
            break
        if param.kind in (param.POSITIONAL_ONLY, param.POSITIONAL_OR_KEYWORD):
            names.append(param.name)
        elif param.kind == param.VAR_POSITIONAL:
            names.extend(f"{param.name}[{i}]" for i in range(count - len(names)))
    names.extend(f"arg{i}" for i in range(len(names), count))
    return names


def trace(fn, args, *, names: list[str] | None = None, source_file: str | None = None) -> Traced:
    """Trace ``fn(*args)`` with ``jax.make_jaxpr``; ``args`` may be arrays or ``ShapeDtypeStruct`` pytrees.

    ``names`` are the argument names (default: from ``fn``'s signature). An exception raised
    by the user's code becomes a :class:`LoadError` located at the innermost frame in
    ``source_file`` (default: the file defining ``fn``), else the innermost user frame; where
    that is elsewhere (a sibling module, a library outside JAX), the message names it too.
    """
    import jax

    args = tuple(args)
    try:
        closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    except JaxtoolError:
        raise
    except (Exception, SystemExit, GeneratorExit) as exc:  # (not KeyboardInterrupt)
        where = location_of_exception(exc, prefer=source_file or code_file(fn))
        message = exception_message(exc)
        innermost = location_of_exception(exc)  # (a sibling module's line, where the target file calls one)
        if where and innermost and innermost != where:
            message += f" (via {innermost})"
        if "Non-hashable static arguments" in message:  # (a jit's static argument given an array)
            message += " (give a static argument of jax.jit with --static NAME=VALUE)"
        elif isinstance(exc, (jax.errors.ConcretizationTypeError, jax.errors.TracerIntegerConversionError,
                              jax.errors.TracerArrayConversionError)) or "Tracer(" in message:
            # (a size or a flag that jaxtool traced: a parameter whose default is a tuple of numbers)
            message += " (a traced value was needed concrete: if it comes from a parameter, such as a size or " \
                       "a flag, pass that with --static NAME=VALUE)"
        if where is None:
            message = f"tracing {getattr(fn, '__qualname__', 'the function')} failed: {message}"
        raise LoadError(message, location=where) from exc
    names = list(names) if names is not None else argument_names(fn, len(args))
    in_paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(args)[0]]
    out_paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(out_shape)[0]]
    return Traced(
        closed_jaxpr=closed,
        in_tree=jax.tree_util.tree_structure(args),
        out_tree=jax.tree_util.tree_structure(out_shape),
        in_names=[names[path[0].idx] + format_path(path[1:]) for path in in_paths],
        out_names=["out" + format_path(path) for path in out_paths],
        in_avals=list(closed.in_avals),
        out_avals=list(closed.out_avals),
    )
